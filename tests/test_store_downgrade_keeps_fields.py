"""A schema downgrade below 0006/0005 and back loses no profile's routing or performance environment: the upgrade
gives them back from the downgrade's events to the same rows only, and an import of an export made before fills in
what a row lost instead of skipping it as "already present"."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import msgspec
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store

ENV = {"NCCL_ALGO": "Ring"}


def key(bucket: int = 128) -> ProfileKey:
    return ProfileKey(fingerprint="fp", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                      intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=bucket)


def measured(latency: float = 3.0, bucket: int = 128, **kw) -> ProfileRecord:
    return ProfileRecord(key=key(bucket), knobs=default_knobs("nvlink"), latency_us=latency, spread_us=0.5,
                         backend="local:nccl", provenance="measured", measured_on="fp",
                         **{"routing": "zipf:1.2", "perf_env": ENV, **kw})


def fields(s: Store) -> dict[int, tuple[str, dict | None]]:
    return {i: (r.tuned_routing, r.tuned_perf_env) for i, r in s.list_profiles()}


def sql(path: Path, statement: str, *args) -> None:
    con = sqlite3.connect(path)
    try:
        con.execute(statement, args)
        con.commit()
    finally:
        con.close()


def test_downgrade_to_0004_and_back_gives_routing_and_perf_env_back(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with Store(path) as s:
        s.put_profile(measured())
        s.put_profile(measured(bucket=256, routing="uniform", perf_env={}))  # recorded: no variable set
        s.put_profile(measured(bucket=512, routing=msgspec.UNSET, perf_env=msgspec.UNSET))  # not recorded
        before = fields(s)
        s.downgrade("0004")
        s.upgrade()
        assert fields(s) == before
        assert s.check()["ok"]
        kinds = sorted(e.kind for e in s.list_events())
        assert kinds == ["perf_env_restored", "routing_restored"]  # each applied once, kept as history
        s.downgrade("0004")  # and again: the second round trip's own events
        s.upgrade()
        assert fields(s) == before


def test_a_row_changed_at_0004_gets_nothing_back(tmp_path: Path) -> None:
    """At 0004 a moetune may delete a row and give its id to a new one, or store new numbers in it: a routing or an
    environment recorded for the old measurement must not be attached to either."""
    path = tmp_path / "m.db"
    with Store(path) as s:
        s.put_profile(measured())
        s.put_profile(measured(bucket=256))
        s.put_profile(measured(bucket=512))
        s.downgrade("0004")
    # row 3 deleted, a new measurement takes its id (same key, knobs and backend; another creation date)
    con = sqlite3.connect(path)
    con.execute("CREATE TEMP TABLE t AS SELECT * FROM profiles WHERE id = 3")
    con.execute("DELETE FROM profiles WHERE id = 3")
    con.execute("UPDATE t SET created = '2030-01-01T00:00:00+00:00', latency_us = 2.0")
    con.execute("INSERT INTO profiles SELECT * FROM t")
    con.commit()
    con.close()
    sql(path, "UPDATE profiles SET latency_us = 9.0 WHERE id = 2")  # re-measured in place
    with Store(path) as s:
        got = fields(s)
        assert got[1] == ("zipf:1.2", ENV)
        assert got[2] == ("", None) and got[3] == ("", None)


def test_an_event_from_an_older_downgrade_that_names_no_row_is_left_as_it_is(tmp_path: Path) -> None:
    """Events written before the rows were named ({id: {routing, status}}) cannot tell the row from a new one with
    its id: nothing is applied on a guess, and the event keeps its values (and its kind)."""
    path = tmp_path / "m.db"
    with Store(path) as s:
        s.put_profile(measured(routing=msgspec.UNSET, perf_env=msgspec.UNSET))
        s.downgrade("0004")
    details = json.dumps({"profiles": {"1": {"routing": "zipf:2", "status": "current"}}})
    sql(path, "INSERT INTO events(created, kind, reason, details) VALUES ('2026-01-01T00:00:00+00:00', "
              "'routing_dropped', 'old', ?)", details)
    with Store(path) as s:
        assert fields(s)[1] == ("", None)
        [ev] = [e for e in s.list_events() if e.kind.startswith("routing_")]
        assert ev.kind == "routing_dropped" and ev.details["profiles"]["1"]["routing"] == "zipf:2"


def test_import_of_an_earlier_export_fills_in_what_a_row_lost(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with Store(path) as s:
        s.put_profile(measured())
        data = s.dump_profiles()
    sql(path, "UPDATE profiles SET routing = '', perf_env = NULL")  # as an older downgrade and upgrade left it
    with Store(path) as s:
        res = s.import_bytes(data)
        assert (res.inserted, res.skipped, res.completed, res.differing) == (0, 0, 1, [])
        assert fields(s)[1] == ("zipf:1.2", ENV)
        [ev] = [e for e in s.list_events() if e.kind == "import_completed"]
        assert ev.details["profiles"] == {"1": {"routing": "zipf:1.2", "perf_env": ENV}}
        res = s.import_bytes(data)  # now it is all there
        assert (res.inserted, res.skipped, res.completed) == (0, 1, 0)


def test_import_never_overwrites_a_recorded_value_nor_touches_another_measurement(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with Store(path) as s:
        s.put_profile(measured())
        data = s.dump_profiles()
    # the same measurement, recorded under another routing; and a later measurement of the key and knobs
    sql(path, "UPDATE profiles SET routing = 'uniform', perf_env = NULL")
    with Store(path) as s:
        res = s.import_bytes(data)
        assert res.completed == 1 and len(res.differing) == 1 and "routing 'uniform' stored" in res.differing[0]
        assert fields(s)[1] == ("uniform", ENV)  # the empty one filled, the recorded one kept
    sql(path, "UPDATE profiles SET created = '2026-12-01T00:00:00+00:00', routing = '', perf_env = NULL")
    with Store(path) as s:
        res = s.import_bytes(data)  # not the row's measurement: a new row (history), the stored one untouched
        assert res.completed == 0 and res.inserted == 1
        assert fields(s)[1] == ("", None)


def test_cli_reproducer_downgrade_upgrade_then_import(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with Store(db) as s:
        s.put_profile(measured())
    run = CliRunner().invoke
    export = tmp_path / "e1.json"
    assert run(app, ["profiles", "export", str(export), "--db", str(db)]).exit_code == 0
    assert run(app, ["db", "downgrade", "0004", "--yes", "--db", str(db)]).exit_code == 0
    assert run(app, ["db", "upgrade", "--db", str(db)]).exit_code == 0
    shown = run(app, ["profiles", "show", "1", "--json", "--db", str(db)])
    assert shown.exit_code == 0, shown.output
    got = json.loads(shown.stdout)
    assert got["routing"] == "zipf:1.2" and got["perf_env"] == ENV
    sql(db, "UPDATE profiles SET routing = '', perf_env = NULL")
    res = run(app, ["profiles", "import", str(export), "--db", str(db)])
    assert res.exit_code == 0 and "1 already present and completed" in res.stdout, res.output
