"""Profiles in the store: one current per key, noise-gated replacement, lookups, staleness."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy.exc import IntegrityError

from moetune.runtime.knobs import Knobs, default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.models import Profile
from moetune.tuner.store.store import Store, StoreError


def key(**over) -> ProfileKey:
    base = dict(
        fingerprint="fp-a",
        software="sw-1",
        transport_family="nvlink",
        ep_size=2,
        nodes=1,
        hidden=7168,
        intermediate=2048,
        experts=256,
        topk=8,
        dtype="bfloat16",
        token_bucket=128,
    )
    base.update(over)
    return ProfileKey(**base)


def rec(latency: float, spread: float = 1.0, knobs: Knobs | None = None, **key_over) -> ProfileRecord:
    return ProfileRecord(
        key=key(**key_over),
        knobs=knobs or default_knobs("nvlink"),
        latency_us=latency,
        spread_us=spread,
        backend="model:test",
        software_versions={"torch": "2.13.0"},
    )


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "p.db")
    yield s
    s.close()


def test_first_profile_is_current(store):
    ok, reason = store.put_profile(rec(100.0))
    assert ok and "no current" in reason
    got = store.get_current(key())
    assert got is not None and got.latency_us == 100.0 and got.status == "current"
    assert got.software_versions == {"torch": "2.13.0"}
    assert got.created and got.updated


def test_second_current_profile_is_impossible_in_the_schema(store):
    store.put_profile(rec(100.0))
    from sqlalchemy.orm import Session

    row = Profile(
        **key().to_dict(),
        knobs=Knobs().to_dict(),
        latency_us=1.0,
        spread_us=0.1,
        backend="x",
        status="current",
        software_versions={},
        profile_hash="h",
        created="t",
        updated="t",
    )
    with Session(store.engine) as s, pytest.raises(IntegrityError):
        s.add(row)
        s.commit()
    # The same through plain sqlite3 (what any other writer would do): copy the current row.
    con = sqlite3.connect(store.path)
    cols = [r[1] for r in con.execute("PRAGMA table_info(profiles)") if r[1] != "id"]
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        con.execute(f"INSERT INTO profiles ({', '.join(cols)}) SELECT {', '.join(cols)} FROM profiles")
    con.close()
    # A non-current copy of the same key is fine (history).
    stale = ProfileRecord(key=key(), knobs=Knobs(), latency_us=5.0, spread_us=0.1, backend="x", status="stale")
    assert store.put_profile(stale) == (False, "stored as stale")
    assert len(store.list_profiles(status="current")) == 1
    assert len(store.list_profiles()) == 2


def test_bad_status_is_rejected_by_the_schema(store):
    store.put_profile(rec(100.0))
    con = sqlite3.connect(store.path)
    with pytest.raises(sqlite3.IntegrityError):
        con.execute("UPDATE profiles SET status='bogus'")
    con.close()


def sms(n: int) -> Knobs:
    """Other knobs than the default (the noise rule decides only between different knobs)."""
    return default_knobs("nvlink").replace(num_sms=n)


def test_replacement_only_when_gain_beats_noise(store):
    assert store.put_profile(rec(100.0, spread=2.0))[0]
    # Other knobs, 1.5 us better but noise is max(2, 1) = 2: kept.
    ok, reason = store.put_profile(rec(98.5, spread=1.0, knobs=sms(8)))
    assert not ok and "noise" in reason
    assert store.get_current(key()).latency_us == 100.0
    # The new one's own spread counts too: 5 us better, spread 6 -> kept.
    assert not store.put_profile(rec(95.0, spread=6.0, knobs=sms(12)))[0]
    # Exactly at the noise: not strictly better -> kept.
    assert not store.put_profile(rec(98.0, spread=2.0, knobs=sms(16)))[0]
    # 10 us better with noise 2: replaced; the old one is superseded.
    ok, reason = store.put_profile(rec(90.0, spread=1.0, knobs=sms(20)))
    assert ok and "replaced" in reason
    cur = store.get_current(key())
    assert cur.latency_us == 90.0
    statuses = sorted(r.status for _i, r in store.list_profiles())
    assert statuses == ["current", "superseded"]
    # Slower other knobs never replace (the stored number is not re-measured here).
    assert not store.put_profile(rec(200.0, spread=0.1, knobs=sms(24)))[0]
    assert len(store.list_profiles()) == 2


def test_stale_current_is_always_replaced(store):
    store.put_profile(rec(10.0, spread=0.1))
    store.put_profile(rec(10.0, spread=0.1, token_bucket=256))
    store.put_profile(rec(10.0, spread=0.1, fingerprint="fp-b"))
    assert store.mark_stale(fingerprint="fp-a", reason="NCCL 2.27 -> 2.28") == 2
    assert store.get_current(key()) is None
    assert store.get_current(key(fingerprint="fp-b")) is not None
    ev = store.list_events()[0]
    assert ev.kind == "stale" and "NCCL" in ev.reason and ev["details"]["profiles"] == 2
    # Much slower than the stale one, still written: stale profiles do not compete.
    ok, _ = store.put_profile(rec(50.0, spread=0.1))
    assert ok and store.get_current(key()).latency_us == 50.0
    assert store.mark_stale(fingerprint="fp-none", reason="x") == 0


def test_keys_are_separate(store):
    assert store.put_profile(rec(10.0))[0]
    for over in ({"software": "sw-2"}, {"dtype": "fp8"}, {"ep_size": 4}, {"topk": 6}, {"transport_family": "collective"}):
        assert store.put_profile(rec(100.0, **over))[0], over
    assert len(store.list_profiles(status="current")) == 6
    assert len(store.list_profiles(fingerprint="fp-a")) == 6
    assert store.list_profiles(fingerprint="nope") == []


def test_find_profile_nearest_bucket_and_family(store):
    for bucket, lat in ((16, 5.0), (128, 20.0), (1024, 90.0)):
        store.put_profile(rec(lat, token_bucket=bucket))
    store.put_profile(rec(15.0, token_bucket=128, transport_family="collective", knobs=default_knobs("collective")))
    q = dict(
        fingerprint="fp-a", software="sw-1", ep_size=2, nodes=1, hidden=7168, intermediate=2048, experts=256,
        topk=8, dtype="bfloat16",
    )
    assert store.find_profile(**q, tokens=100).key.token_bucket == 128
    # Without a family: the fastest at that bucket.
    assert store.find_profile(**q, tokens=100).key.transport_family == "collective"
    assert store.find_profile(**q, tokens=100, transport_family="nvlink").latency_us == 20.0
    assert store.find_profile(**q, tokens=1).key.token_bucket == 16
    # 100000 tokens is the 65536 bucket, six rungs above the nearest stored one: no profile, fall back.
    assert store.find_profile(**q, tokens=100000) is None
    assert store.find_profile(**q, tokens=100000, max_bucket_steps=6).key.token_bucket == 1024
    assert store.find_profile(**{**q, "software": "other"}, tokens=100) is None
    assert store.find_profile(**q, tokens=100, transport_family="ibgda") is None


def test_invalid_records_rejected(store):
    with pytest.raises(ValueError, match="latency_us"):
        store.put_profile(rec(-1.0))
    with pytest.raises(ValueError, match="spread_us"):
        store.put_profile(rec(1.0, spread=float("nan")))
    assert store.list_profiles() == []


def test_get_delete_profile(store):
    store.put_profile(rec(10.0))
    (pid, r), = store.list_profiles()
    assert store.get_profile(pid) == r
    assert store.delete_profile(pid)
    assert not store.delete_profile(pid)
    assert store.get_profile(pid) is None


def test_measurements_runs_fingerprints_events(store):
    store.upsert_fingerprint("fp-a", {"gpus": 2, "model": "H200"}, origin="local")
    first = store.get_fingerprint("fp-a")
    store.upsert_fingerprint("fp-a", {"gpus": 2, "model": "H200", "driver": "x"}, origin="local")
    again = store.get_fingerprint("fp-a")
    assert again.facts["driver"] == "x" and again.first_seen == first.first_seen
    run = store.start_run(study_name="s1", storage=store.url, backend="model")
    mid = store.add_measurement(
        fingerprint="fp-new", kind="bandwidth", transport="nvlink", size_bytes=1 << 20, value=225.0,
        spread=3.0, unit="GB/s", extra={"iters": 10}, run_id=run,
    )
    m = store.list_measurements(fingerprint="fp-new")
    assert [x.id for x in m] == [mid] and m[0].extra == {"iters": 10} and m[0].run_id == run
    assert store.list_measurements(run_id=run)[0].value == 225.0
    assert store.get_fingerprint("fp-new").facts == {}  # placeholder for an unknown fingerprint
    store.finish_run(run, status="complete", trials=40, best_value=12.5)
    (r,) = store.list_runs()
    assert r.status == "complete" and r.trials == 40 and r.best_value == 12.5 and r.ended
    with pytest.raises(StoreError):
        store.finish_run(999, status="x", trials=0, best_value=None)
    # if_running (a daemon's stop): a run that ended meanwhile keeps how it ended; a missing one still raises
    assert store.finish_run(run, status="failed", trials=0, best_value=None, if_running=True) is False
    (r,) = store.list_runs()
    assert r.status == "complete" and r.trials == 40 and r.best_value == 12.5
    with pytest.raises(StoreError):
        store.finish_run(999, status="failed", trials=0, best_value=None, if_running=True)
    run2 = store.start_run(study_name="s2", storage=store.url, backend="model")
    assert store.finish_run(run2, status="failed", trials=0, best_value=None, if_running=True) is True
    assert store.list_runs()[0].status == "failed"
    e1 = store.add_event(kind="fabric_changed", reason="NIC mlx5_1 gone", details={"nic": "mlx5_1"})
    e2 = store.add_event(kind="fabric_seen", reason="driver 570 -> 575")
    assert [e.id for e in store.list_events()] == [e2, e1]
    assert len(store.list_events(limit=1)) == 1
    assert [e.id for e in store.list_events(kinds=("fabric_changed",))] == [e1]


def test_event_kinds_are_the_one_list(store):
    """Event kinds are an EventKind (models.py): a writer's typo is refused before anything is written, and a filter
    naming no kind is refused rather than matching nothing."""
    from moetune.tuner.store.models import EVENT_KINDS, Event

    assert "job_finished" in EVENT_KINDS and "fabric_changed" in EVENT_KINDS
    with pytest.raises(ValueError, match=r"unknown event kind\(s\) 'job_finshed'; known: job_queued, "):
        store.add_event(kind="job_finshed", reason="typo")  # type: ignore[arg-type]
    assert store.list_events() == []
    with pytest.raises(ValueError, match=r"'fabric_change'"):
        store.list_events(kinds=("fabric_changed", "fabric_change"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'job_done'"):
        store.events_after(0, kinds=("job_done",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'done'"):
        store.open_jobs(kinds=("job_queued",), finished="done")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'hardware'"):  # every writer, not only add_event
        Event(created="t", kind="hardware", reason="", details={})


def test_pragmas_on_every_connection(store):
    with store.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000


def test_readonly_store(tmp_path):
    path = tmp_path / "r.db"
    with Store(path) as s:
        s.put_profile(rec(10.0))
    with Store(path, readonly=True) as ro:
        assert len(ro.list_profiles()) == 1
        with pytest.raises(StoreError, match="read-only"):
            ro.put_profile(rec(1.0))
    with pytest.raises(StoreError, match="no database"):
        Store(tmp_path / "missing.db", readonly=True)


def test_memory_store():
    with Store(":memory:") as s:
        assert s.put_profile(rec(10.0))[0]
        assert s.get_current(key()) is not None


def test_default_path_comes_from_config(tmp_path, monkeypatch):
    from moetune.runtime import paths

    monkeypatch.setattr(paths, "SYSTEM_CONFIG", tmp_path / "etc.toml")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MOETUNE_STORE_DB", raising=False)
    monkeypatch.delenv("MOETUNE_CONFIG", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "mh"))
    with Store() as s:
        assert s.path == tmp_path / "mh" / "moetune.db" and s.path.is_file()
        assert s.url == f"sqlite:///{tmp_path / 'mh' / 'moetune.db'}"
    monkeypatch.setenv("MOETUNE_STORE_DB", str(tmp_path / "env.db"))
    with Store() as s:
        assert s.path == tmp_path / "env.db"


def test_atomic_writes_are_stored_together_or_not_at_all(tmp_path) -> None:
    """`Store.atomic`: a profile and the measurement that records its comparison (the bring-up's compare stage) are
    one transaction; an interrupt between them leaves neither."""
    with Store(tmp_path / "a.db") as s:
        with pytest.raises(KeyboardInterrupt), s.atomic():
            assert s.put_profile(rec(10.0))[0]
            raise KeyboardInterrupt
        assert s.list_profiles() == []
        with s.atomic():
            s.put_profile(rec(10.0))
            with s.atomic():  # nested: the outer one's transaction
                s.add_measurement(fingerprint="fp-a", kind="k", transport="nvlink", size_bytes=None, value=1.0,
                                  spread=0.0, unit="us")
        assert len(s.list_profiles()) == 1 and len(s.list_measurements(kind="k")) == 1
        s.add_measurement(fingerprint="fp-a", kind="k", transport="nvlink", size_bytes=None, value=2.0, spread=0.0,
                          unit="us")  # after it: a transaction of its own again
        assert len(s.list_measurements(kind="k")) == 2


def test_every_event_kind_a_migration_writes_is_a_known_kind() -> None:
    """Migrations write events as plain SQL (their spellings frozen there): each kind they name must be an EventKind,
    or reading those events back by kind is refused (0009's runtime_options_* were missing)."""
    import re
    from pathlib import Path

    from moetune.tuner.store.models import EVENT_KINDS

    versions = Path(__file__).resolve().parents[1] / "migrations" / "versions"
    named = set()
    for f in versions.glob("0*.py"):
        text = f.read_text()
        named |= set(re.findall(r'(?:kind|dropped|restored)="([a-z_]+)"', text))
        named |= set(re.findall(r'^(?:DROPPED|RESTORED) = "([a-z_]+)"', text, re.M))
    assert {"runtime_options_dropped", "provenance_restored"} <= named  # the scan finds them
    assert named - set(EVENT_KINDS) == set()
