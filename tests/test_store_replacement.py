"""When a new profile replaces the stored one (`tuner/store/_rows.decide`): a re-measurement of the same knobs
is the current truth about them (slower or faster, with an event); the noise rule decides only between different
knobs, and never calls a slower new best a loss to a stored number nobody re-measured; latencies measured under
different routings are never compared (migration 0005 stores the routing, not part of the key)."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs, default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.store import Store, head_revision, now


def key(bucket: int = 128) -> ProfileKey:
    return ProfileKey(fingerprint="fp", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                      intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=bucket)


def sms(n: int) -> Knobs:
    return default_knobs("nvlink").replace(num_sms=n)


def measured(lat: float, spread: float = 1.0, knobs: Knobs | None = None, bucket: int = 128, **kw) -> ProfileRecord:
    return ProfileRecord(key=key(bucket), knobs=knobs or default_knobs("nvlink"), latency_us=lat, spread_us=spread,
                         backend="local:nccl", provenance="measured", **kw)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "r.db")
    yield s
    s.close()


# -- the same knobs measured again ------------------------------------------------------------------------------
def test_slower_remeasurement_of_the_same_knobs_replaces_the_stored_number(store):
    """A change the fingerprint does not capture (NCCL_* env, power cap, clocks) makes the node slower: the
    re-measurement of the same knobs replaces the stored number, or the outdated fast one is kept for good ("gain -50
    does not beat the noise")."""
    assert store.put_profile(measured(100.0))[0]
    ok, why = store.put_profile(measured(150.0, spread=2.0))
    assert ok, why
    assert "same knobs re-measured" in why and "100.000" in why and "150.000" in why
    cur = store.get_current(key())
    assert (cur.latency_us, cur.spread_us) == (150.0, 2.0)
    assert sorted(r.status for _i, r in store.list_profiles()) == ["current", "superseded"]
    ev = store.list_events(kinds=("remeasured",))
    assert len(ev) == 1
    d = ev[0].details
    assert d["from"]["latency_us"] == 100.0 and d["to"]["latency_us"] == 150.0
    assert d["from"]["profile"] != d["to"]["profile"] and d["profile_hash"] == cur.profile_hash
    assert d["key"] == key().to_dict()


def test_faster_remeasurement_within_the_noise_replaces_too(store):
    store.put_profile(measured(100.0, spread=5.0))
    ok, why = store.put_profile(measured(98.0, spread=5.0))  # 2 us < noise 5, yet 100 is not kept
    assert ok, why
    assert store.get_current(key()).latency_us == 98.0


def test_identical_numbers_write_nothing(store):
    store.put_profile(measured(100.0))
    ok, why = store.put_profile(measured(100.0))
    assert not ok and "same numbers" in why
    assert len(store.list_profiles()) == 1 and store.list_events(kinds=("remeasured",)) == []


def test_remeasurement_never_breaks_the_provenance_order(store):
    store.put_profile(measured(100.0))
    preset = ProfileRecord(key=key(), knobs=default_knobs("nvlink"), latency_us=5.0, spread_us=0.1,
                           backend="model:nvlink-h200x2", provenance="preset")
    ok, why = store.put_profile(preset)
    assert not ok and "never displaces" in why
    assert store.get_current(key()).latency_us == 100.0


def test_other_source_of_the_same_knobs_is_not_a_remeasurement(store):
    """Same knobs through another benchmark backend: not the same measurement, the noise rule decides."""
    store.put_profile(measured(100.0))
    other = msgspec.structs.replace(measured(150.0), backend="local:torch")
    assert not store.put_profile(other)[0]
    assert store.get_current(key()).latency_us == 100.0


# -- other knobs ----------------------------------------------------------------------------------------------
def test_slower_other_knobs_keep_the_stored_profile_and_say_its_number_may_be_stale(store):
    store.put_profile(measured(643.45, spread=2.0))
    ok, why = store.put_profile(measured(700.0, spread=2.0, knobs=sms(8)))
    assert not ok
    assert "does not beat the noise" not in why  # not a fair comparison: the stored number was not re-measured
    assert "may be stale" in why and "side-by-side" in why
    assert store.get_current(key()).latency_us == 643.45
    assert len(store.list_profiles()) == 1


def test_other_knobs_replace_after_a_side_by_side_or_by_beating_the_noise(store):
    store.put_profile(measured(100.0))
    assert store.put_profile(measured(120.0, knobs=sms(8)), force_reason="tuned beat the incumbent side by side")[0]
    assert store.put_profile(measured(110.0, knobs=sms(12)))[0]  # 10 us better than the stored 120, noise 1
    assert store.get_current(key()).knobs == sms(12)


# -- metric -----------------------------------------------------------------------------------------------------
def test_numbers_of_two_metrics_are_never_compared(store):
    """`moetune tune` stored a whole layer (900 us, `local:gloo`); a bring-up's round trip (500 us,
    `local:gloo:comm`) of other knobs must not replace it on 'gain 400 us beats the noise' -- the difference of two
    figures, not a gain."""
    assert store.put_profile(msgspec.structs.replace(measured(900.0), backend="local:gloo"))[0]
    comm = msgspec.structs.replace(measured(500.0, knobs=sms(8)), backend="local:gloo:comm")
    ok, why = store.put_profile(comm)
    assert not ok and "not compared" in why and "gain" not in why and "layer" in why and "comm" in why
    cur = store.get_current(key())
    assert (cur.latency_us, cur.backend) == (900.0, "local:gloo")
    # kept as history, and a slower layer number of other knobs is not read as a loss against the round trip either
    assert [r.backend for _i, r in store.list_profiles(status="superseded")] == ["local:gloo:comm"]
    # the same knobs in the other metric are no re-measurement of the stored number
    assert not store.put_profile(msgspec.structs.replace(measured(400.0), backend="local:gloo:comm"))[0]
    # a side-by-side re-measurement in the new metric replaces, and the reason says the old number was not compared
    ok, why = store.put_profile(comm, force_reason="beat the incumbent side by side")
    assert ok and "side by side" in why and "not compared" in why
    assert store.get_current(key()).backend == "local:gloo:comm"


def test_a_comm_tune_is_labelled_with_its_metric():
    from moetune.runtime.profile_record import metric_of_backend
    from moetune.tuner.search.local_backend import LocalBackend

    layer, comm = LocalBackend(comm_backend="gloo"), LocalBackend(comm_backend="gloo", metric="comm")
    assert (layer.label, comm.label) == ("local:gloo", "local:gloo:comm")  # the layer label stays as stored
    assert [metric_of_backend(b.label) for b in (layer, comm)] == ["layer", "comm"]
    assert LocalBackend(comm_backend="nccl", metric="comm", family="megakernel").label == "local:megakernel"


# -- routing ----------------------------------------------------------------------------------------------------
def test_routing_is_recorded_in_canonical_form_and_read_back(store):
    store.put_profile(measured(100.0, routing="ZIPF:1.20"))
    cur = store.get_current(key())
    assert cur.routing == cur.tuned_routing == "zipf:1.2"
    assert json.loads(store.dump_profiles())["profiles"][0]["routing"] == "zipf:1.2"
    with pytest.raises(ValueError, match="routing: unknown routing"):  # the store refuses a spelling it cannot compare
        store.put_profile(measured(1.0, routing="hot-experts"))
    # not recorded: left out of the record (and of an export, which an older moetune then still reads)
    r = measured(1.0, routing="")
    assert r.tuned_routing == "" and "routing" not in msgspec.to_builtins(r)


def test_a_profile_tuned_under_another_routing_never_replaces_by_latency(store):
    """Uniform best 643.45 stored; a zipf:1.2 tune (inherently slower) must not be refused with 'gain -587.746 us
    does not beat the noise' -- a comparison of two different workloads."""
    assert store.put_profile(measured(643.45, routing="uniform"))[0]
    ok, why = store.put_profile(measured(1231.2, knobs=sms(8), routing="zipf:1.2"))
    assert not ok and "routing" in why and "not compared" in why and "noise" not in why
    assert store.get_current(key()).tuned_routing == "uniform"
    # kept, labelled, as history: the work is not lost
    hist = store.list_profiles(status="superseded")
    assert [(r.latency_us, r.tuned_routing) for _i, r in hist] == [(1231.2, "zipf:1.2")]
    # a faster number under another routing does not win either (nor does force_reason: it is about knobs)
    assert not store.put_profile(measured(10.0, knobs=sms(12), routing="zipf:1.2"), force_reason="x")[0]
    # the same knobs under another routing are no re-measurement of the stored number
    assert not store.put_profile(measured(900.0, routing="zipf:1.2"))[0]
    assert store.get_current(key()).latency_us == 643.45


def test_replace_routing_is_the_explicit_way_and_leaves_an_event(store):
    store.put_profile(measured(643.45, routing="uniform"))
    ok, why = store.put_profile(measured(1231.2, knobs=sms(8), routing="zipf:1.2"), replace_routing=True)
    assert ok and "as asked" in why
    cur = store.get_current(key())
    assert cur.tuned_routing == "zipf:1.2" and cur.latency_us == 1231.2
    ev = store.list_events(kinds=("routing",))
    assert len(ev) == 1 and ev[0].details["from"]["routing"] == "uniform" and ev[0].details["to"]["routing"] == "zipf:1.2"
    # replace_routing never skips the provenance order
    preset = ProfileRecord(key=key(), knobs=sms(8), latency_us=5.0, spread_us=0.1, backend="model:nvlink-h200x2",
                           provenance="preset", routing="uniform")
    assert not store.put_profile(preset, replace_routing=True)[0]


def test_unrecorded_routing_compares_as_before(store):
    """A profile stored before 0005 (or by a caller that does not say) has no routing: nothing says it differs."""
    store.put_profile(measured(100.0))
    assert store.put_profile(measured(120.0, routing="uniform"))[0]  # same knobs: a re-measurement, now labelled
    assert store.get_current(key()).tuned_routing == "uniform"
    assert not store.put_profile(measured(119.5, knobs=sms(8)))[0]  # unrecorded vs uniform, other knobs: noise rule


# -- import ---------------------------------------------------------------------------------------------------
def test_import_of_the_same_knobs_replaces_only_when_measured_later(store, tmp_path):
    store.put_profile(measured(100.0))
    doc = json.loads(store.dump_profiles())
    p = doc["profiles"][0]
    with Store(tmp_path / "dst.db") as dst:
        dst.put_profile(measured(90.0))  # stored now: newer than the file's record
        res = dst.import_bytes(json.dumps(doc).encode())
        assert (res.replaced, res.kept_superseded) == (0, 1)
        assert dst.get_current(key()).latency_us == 90.0
    with Store(tmp_path / "dst2.db") as dst:
        dst.import_bytes(json.dumps(doc).encode())
        later = now()  # the file's record was stored (updated) when `store` took it, a moment ago
        assert later > p["updated"]
        newer = {**p, "latency_us": 150.0, "created": later, "updated": later}
        res = dst.import_bytes(json.dumps({**doc, "profiles": [newer]}).encode())
        assert res.replaced == 1 and dst.get_current(key()).latency_us == 150.0
        assert len(dst.list_events(kinds=("remeasured",))) == 1


def test_import_under_another_routing_is_kept_as_history(store, tmp_path):
    store.put_profile(measured(1231.2, knobs=sms(8), routing="zipf:1.2"))
    data = store.dump_profiles()
    with Store(tmp_path / "dst.db") as dst:
        dst.put_profile(measured(643.45, routing="uniform"))
        res = dst.import_bytes(data)
        assert (res.replaced, res.kept_superseded) == (0, 1)
        assert dst.get_current(key()).tuned_routing == "uniform"
        # a round trip keeps the label
        assert [r.tuned_routing for _i, r in dst.list_profiles(status="superseded")] == ["zipf:1.2"]


# -- migration 0005 -------------------------------------------------------------------------------------------
def columns(path) -> list[str]:
    con = sqlite3.connect(path)
    try:
        return [r[1] for r in con.execute("PRAGMA table_info(profiles)")]
    finally:
        con.close()


def test_0005_upgrade_labels_old_rows_unrecorded_and_downgrade_keeps_profiles_and_routings(tmp_path):
    path = tmp_path / "m.db"
    with Store(path, upgrade=False) as s:
        s.upgrade("0004")
        assert "routing" not in columns(path)
    con = sqlite3.connect(path)
    con.execute("INSERT INTO fingerprints(hash, facts, first_seen, last_seen) VALUES ('fp', '{}', 't', 't')")
    knobs = json.dumps(default_knobs("nvlink").to_dict())
    for bucket, status in ((128, "current"), (128, "superseded"), (256, "current")):
        con.execute(
            "INSERT INTO profiles(fingerprint, software, transport_family, ep_size, nodes, hidden, intermediate,"
            " experts, topk, dtype, token_bucket, knobs, latency_us, spread_us, backend, status, software_versions,"
            " profile_hash, created, updated, provenance, measured_on) VALUES ('fp', 'sw', 'nvlink', 2, 1, 7168,"
            " 2048, 256, 8, 'bfloat16', ?, ?, 100.0, 1.0, 'local:nccl', ?, '{}', 'h', '2026-01-01T00:00:00+00:00',"
            " '2026-01-01T00:00:00+00:00', 'measured', 'fp')",
            (bucket, knobs, status),
        )
    con.commit()
    con.close()
    with Store(path) as s:  # upgrades on first use
        assert s.current_revision() == head_revision() == "0011"
        assert s.check()["ok"]
        assert {r.tuned_routing for _i, r in s.list_profiles()} == {""}
        F.assert_one_current_profile_per_key(path)  # the unique index on current keys survived the table copy
        # a tune that records its routing, then one under another routing (history)
        assert s.put_profile(measured(90.0, knobs=sms(8), routing="uniform"))[0]
        assert not s.put_profile(measured(80.0, knobs=sms(12), routing="zipf:1.2"))[0]
        n, labelled = s.count_profiles(), {i: r.tuned_routing for i, r in s.list_profiles() if r.tuned_routing}
        s.downgrade("0004")
        assert s.current_revision() == "0004" and "routing" not in columns(path)
        assert s.count_profiles() == n  # every profile kept
        ev = [e for e in s.list_events() if e.kind == "routing_dropped"]
        assert len(ev) == 1
        assert {int(i): v["routing"] for i, v in ev[0].details["profiles"].items()} == labelled
        s.upgrade()
        assert s.check()["ok"] and s.count_profiles() == n
        # given back from the event to the rows that had one; the others stay unrecorded, never guessed
        assert {i: r.tuned_routing for i, r in s.list_profiles() if r.tuned_routing} == labelled
        assert s.get_current(key()).latency_us == 90.0


def test_a_pick_among_families_compares_no_round_trip_with_a_whole_layer(tmp_path):
    """Without a family asked, the fastest family at a bucket won: a bring-up's round trip (60 µs) beat a tuned
    whole layer (900 µs) of another family by the metrics' difference alone. Where both kinds are stored, the
    whole-layer numbers are compared (the daemon's store and the runtime's fallback pick alike)."""
    from moetune.runtime.profiles.db_lookup import pick_profile
    from moetune.tuner.store.store import Store

    def record(family: str, us: float, backend: str) -> ProfileRecord:
        key = ProfileKey(fingerprint="fp-m", software="sw", transport_family=family, ep_size=2, nodes=1, hidden=7168,
                         intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=128)
        return ProfileRecord(key=key, knobs=default_knobs(family), latency_us=us, spread_us=1.0, backend=backend,
                             provenance="measured")

    recs = [record("nvlink", 60.0, "local:nccl:comm"), record("host_staged", 900.0, "local:nccl"),
            record("collective", 950.0, "local:nccl")]
    with Store(tmp_path / "m.db") as s:
        for r in recs:
            s.put_profile(r)
        got = s.find_profile(fingerprint="fp-m", software="sw", ep_size=2, nodes=1, hidden=7168, intermediate=2048,
                             experts=256, topk=8, dtype="bfloat16", tokens=128)
    assert got is not None and got.key.transport_family == "host_staged"
    assert pick_profile(recs, 128).key.transport_family == "host_staged"
    # one metric only: the fastest, as before
    assert pick_profile(recs[1:], 128).key.transport_family == "host_staged"
    assert pick_profile([recs[0]], 128).key.transport_family == "nvlink"
