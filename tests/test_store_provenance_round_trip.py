"""`db downgrade 0002` then `db upgrade` relabelled a node model's profile with a `local:*` backend measured (current
rows made stale, superseded history relabelled silently): 0003's downgrade keeps the labels the backfill would not
derive again (an event: the events table is in 0002's schema) and its upgrade gives them back, never `measured` over
another label."""

from __future__ import annotations

import json
import sqlite3

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.store import Store


def key(bucket: int) -> ProfileKey:
    return ProfileKey(fingerprint="fp", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                      intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=bucket)


def put(s: Store, bucket: int, latency: float, backend: str, **kw) -> None:
    s.put_profile(ProfileRecord(key=key(bucket), knobs=default_knobs("nvlink"), latency_us=latency, spread_us=0.1,
                                backend=backend, **kw))


def labels(s: Store) -> dict[int, tuple[str, str, str]]:
    return {i: (r.status, str(r.provenance), r.measured_on) for i, r in s.list_profiles()}


def test_a_round_trip_through_0002_keeps_every_modelled_label(tmp_path):
    path = tmp_path / "rl.db"
    with Store(path) as s:
        # unlabelled records with a local:* backend are modelled (profile_record.unlabelled_provenance)
        put(s, 16, 5.0, "local:nccl")
        put(s, 16, 9.0, "local:nccl", status="superseded")
        put(s, 128, 7.0, "local:nccl", provenance="measured")  # a real measurement stays one
        put(s, 256, 3.0, "model:node:fp", provenance="node_model", measured_on="other-fp")
        before = labels(s)
        assert [p for _st, p, _on in before.values()] == ["node_model", "node_model", "measured", "node_model"]
        s.downgrade("0002")
        s.upgrade()
        after = labels(s)
        assert s.check()["ok"]
    # labels and measured_on back as they were; the current modelled one was retired (stale) for the 0002 meantime
    assert {i: v[1:] for i, v in after.items()} == {i: v[1:] for i, v in before.items()}
    assert after[1][0] == "stale" and after[2][0] == "superseded" and after[3][0] == "current"
    assert not [i for i, (_st, p, _on) in after.items() if p == "measured" and before[i][1] != "measured"]


def test_a_row_that_is_no_longer_the_one_kept_gets_the_backfills_label(tmp_path):
    """At 0002 an older moetune may delete a row and give its id to a new measurement: the kept label is not its."""
    path = tmp_path / "reuse.db"
    with Store(path) as s:
        put(s, 16, 5.0, "local:nccl")  # id 1, node_model
        s.downgrade("0002")
    con = sqlite3.connect(path)
    con.execute("UPDATE profiles SET created = '2030-01-01T00:00:00+00:00' WHERE id = 1")  # another row now
    con.commit()
    con.close()
    with Store(path) as s:
        assert str(s.get_profile(1).provenance) == "measured"


def test_an_event_never_restores_measured_over_a_backend_that_does_not_measure(tmp_path):
    path = tmp_path / "forged.db"
    with Store(path) as s:
        put(s, 16, 5.0, "model:ndr-ibrc-h100x8", provenance="preset")
        row = s.get_profile(1)
        s.downgrade("0002")
    con = sqlite3.connect(path)
    kept = {"1": {"provenance": "measured", "measured_on": "fp", "status": "current", "backend": row.backend,
                  "profile_hash": row.profile_hash, "created": row.created}}
    con.execute("INSERT INTO events(created, kind, reason, details) VALUES ('2026-01-01T00:00:00+00:00', "
                "'provenance_dropped', 'x', ?)", (json.dumps({"profiles": kept}),))
    con.commit()
    con.close()
    with Store(path) as s:
        assert str(s.get_profile(1).provenance) == "preset"


def test_a_kept_label_is_given_back_once(tmp_path):
    """The events stayed `provenance_dropped` after the upgrade gave their labels back, so every later downgrade and
    upgrade applied them again, over whatever label the row had been given since."""
    path = tmp_path / "once.db"
    with Store(path) as s:
        put(s, 16, 5.0, "local:nccl")  # node_model: kept by the downgrade
        s.downgrade("0002")
        s.upgrade()
    con = sqlite3.connect(path)
    kinds = [k for (k,) in con.execute("SELECT kind FROM events WHERE kind LIKE 'provenance_%' ORDER BY id")]
    assert kinds == ["provenance_restored"], kinds
    con.execute("UPDATE profiles SET provenance = 'measured' WHERE id = 1")  # a label given since (as a re-tune would)
    con.commit()
    con.close()
    with Store(path) as s:
        s.downgrade("0002")  # measured is what the backfill derives for local:*: nothing kept this time
        s.upgrade()
        assert str(s.get_profile(1).provenance) == "measured"
