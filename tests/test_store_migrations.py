"""Alembic migrations: own version table, up and down on empty and populated databases."""

from __future__ import annotations

import json
import sqlite3

import pytest

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store._tables import OPTUNA_COLUMNS, OPTUNA_TABLES
from moetune.tuner.store.store import VERSION_TABLE, Store, StoreError, head_revision

OWN = {"fingerprints", "measurements", "tuning_runs", "profiles", "events"}


def tables(path) -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()


def count(path, table: str) -> int:
    con = sqlite3.connect(path)
    try:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        con.close()


def populate(s: Store) -> None:
    s.upsert_fingerprint("fp", {"gpus": 2}, origin="local")
    run = s.start_run(study_name="st", storage=s.url, backend="model")
    for i in range(5):
        s.add_measurement(
            fingerprint="fp", kind="lat", transport="nvlink", size_bytes=1 << i, value=float(i), spread=0.1,
            unit="us", run_id=run,
        )
    for b in (16, 128, 1024):
        key = ProfileKey(
            fingerprint="fp", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=4096,
            intermediate=1024, experts=64, topk=6, dtype="bfloat16", token_bucket=b,
        )
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=10.0 * b, spread_us=1.0, backend="m"))
    s.add_event(kind="fabric_changed", reason="test")


def test_empty_database_upgrades_itself_with_own_version_table(tmp_path):
    path = tmp_path / "e.db"
    with Store(path) as s:
        assert s.current_revision() == head_revision()
        info = s.check()
        assert info["ok"], info
        assert info["schema_diff"] == [] and info["integrity"] == ["ok"]
    t = tables(path)
    assert t >= OWN and VERSION_TABLE in t
    assert "alembic_version" not in t  # Optuna's table name stays free


def test_down_to_base_and_up_again_on_empty(tmp_path):
    path = tmp_path / "e.db"
    with Store(path) as s:
        s.downgrade("base")
        assert s.current_revision() is None
        assert not (OWN & tables(path))
        s.upgrade()
        assert s.check()["ok"]


def test_populated_database_step_down_and_up_keeps_data(tmp_path):
    path = tmp_path / "p.db"
    with Store(path) as s:
        populate(s)
        before = {t: count(path, t) for t in OWN}
        exported = s.dump_profiles()
        s.downgrade("0001")
        assert s.current_revision() == "0001"
        # 0002's downgrade keeps every measurement (only their run links go).
        assert {t: count(path, t) for t in OWN} == before
        con = sqlite3.connect(path)
        assert "run_id" not in {r[1] for r in con.execute("PRAGMA table_info(measurements)")}
        con.close()
        s.upgrade()
        assert s.check()["ok"]
        assert {t: count(path, t) for t in OWN} == before
        assert s.dump_profiles() == exported
        assert all(m.run_id is None for m in s.list_measurements())
        # Still fully usable after the round trip.
        s.add_measurement(fingerprint="fp", kind="x", transport="t", size_bytes=None, value=1, spread=0, unit="u")
        assert len(s.list_measurements()) == before["measurements"] + 1


def test_populated_database_to_base_leaves_other_tables_alone(tmp_path):
    path = tmp_path / "p.db"
    # Someone else's Alembic-managed tables in the same file (Optuna's storage does exactly this).
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
    con.execute("INSERT INTO alembic_version VALUES ('v3.2.0.a')")
    for table in OPTUNA_TABLES:  # Optuna's core tables, with Optuna's columns
        con.execute(f"CREATE TABLE {table} ({', '.join(OPTUNA_COLUMNS[table])})")
    con.execute("INSERT INTO studies (study_name) VALUES ('s')")
    con.commit()
    con.close()
    with Store(path) as s:
        populate(s)
        assert s.check()["ok"]  # other tables are not schema drift
        s.downgrade("base")
        assert not (OWN & tables(path))
        s.upgrade()
        assert s.list_profiles() == []
        populate(s)
        assert len(s.list_profiles()) == 3
    con = sqlite3.connect(path)
    assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [("v3.2.0.a",)]
    assert con.execute("SELECT study_name FROM studies").fetchall() == [("s",)]
    con.close()


def test_optuna_shares_the_file(tmp_path):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = tmp_path / "shared.db"
    with Store(path) as s:
        study = optuna.create_study(study_name="t", storage=s.url)
        study.optimize(lambda tr: tr.suggest_float("x", 0, 1) ** 2, n_trials=3)
        populate(s)
        assert s.check()["ok"]
        s.finish_run(1, status="complete", trials=3, best_value=study.best_value)
    t = tables(path)
    assert "alembic_version" in t and VERSION_TABLE in t
    assert len(optuna.load_study(study_name="t", storage=f"sqlite:///{path}").trials) == 3


def test_old_database_without_upgrade_and_unknown_revision(tmp_path):
    path = tmp_path / "o.db"
    with Store(path) as s:
        s.downgrade("0001")
    with pytest.raises(StoreError, match="moetune db upgrade"):
        Store(path, upgrade=False)._ensure_schema(upgrade=False)
    with pytest.raises(StoreError, match="moetune db upgrade"):
        Store(path, readonly=True)
    with Store(path) as s:  # upgrades on first use
        assert s.current_revision() == head_revision()
    con = sqlite3.connect(path)
    con.execute(f"UPDATE {VERSION_TABLE} SET version_num='9999'")
    con.commit()
    con.close()
    with pytest.raises(StoreError, match="newer moetune"):
        Store(path)


def test_not_a_database_is_a_store_error(tmp_path):
    bad = tmp_path / "text.db"
    bad.write_text("hello, I am not SQLite\n")
    with pytest.raises(StoreError, match="not a database"):
        Store(bad)
    assert bad.read_text() == "hello, I am not SQLite\n"


# -- migration 0004: rows labelled measured whose backend does not measure ---------------------------
STAMP = "2026-01-01T00:00:00+00:00"
# (backend, token bucket, status, stored provenance, stored measured_on) -> (provenance, measured_on) after 0004
AT_0003 = {
    # labelled measured before the store refused it (e645822): relabelled, whatever their status
    ("model:nvlink-h200x2", 4096, "current", "measured", "fp"): ("preset", "preset:nvlink-h200x2"),
    ("model:node:fp", 256, "current", "measured", "fp"): ("node_model", "fp"),
    ("LOCAL:nccl", 1024, "current", "measured", "fp"): ("node_model", "fp"),  # prefixes are case-sensitive
    ("model:nvlink-h200x2", 64, "stale", "measured", "fp"): ("preset", "preset:nvlink-h200x2"),
    ("odd", 64, "superseded", "measured", ""): ("node_model", ""),
    # labelled as their backend says: untouched
    ("local:nccl", 64, "current", "measured", "fp"): ("measured", "fp"),
    ("model:nvlink-h200x2", 16384, "current", "preset", "preset:nvlink-h200x2"): ("preset", "preset:nvlink-h200x2"),
    ("local:nccl", 16, "current", "node_model", ""): ("node_model", ""),  # an unlabelled import of a local:* record
    ("model:node:fp", 16384, "superseded", "node_model", "fp"): ("node_model", "fp"),
}
MISLABELLED = [k for k, (prov, _on) in AT_0003.items() if k[3] != prov]


def database_at_0003(path) -> None:
    """A database at 0003 holding AT_0003's rows, written as the store wrote them before e645822 (raw SQL:
    today's store refuses a measured label from a backend that does not measure)."""
    s = Store(path, upgrade=False)
    s.upgrade("0003")
    s.close()
    con = sqlite3.connect(path)
    con.execute("INSERT INTO fingerprints(hash, facts, first_seen, last_seen) VALUES ('fp', '{}', ?, ?)", (STAMP, STAMP))
    knobs = json.dumps(default_knobs("nvlink").to_dict())
    for i, (backend, bucket, status, provenance, measured_on) in enumerate(AT_0003):
        stamp = STAMP.replace(":00+", f":{i:02d}+")  # distinct dates: an import tells the rows apart by them
        con.execute(
            "INSERT INTO profiles(fingerprint, software, transport_family, ep_size, nodes, hidden, intermediate,"
            " experts, topk, dtype, token_bucket, knobs, latency_us, spread_us, backend, status, software_versions,"
            " profile_hash, created, updated, provenance, measured_on) VALUES ('fp', 'sw', 'nvlink', 2, 1, 4096,"
            " 1024, 64, 6, 'bfloat16', ?, ?, 10.0, 1.0, ?, ?, '{}', ?, ?, ?, ?, ?)",
            (bucket, knobs, backend, status, f"h{bucket}{backend}", stamp, stamp, provenance, measured_on),
        )
    con.commit()
    con.close()


def profile_rows(path) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT * FROM profiles ORDER BY id").fetchall()
    finally:
        con.close()


def labels(s: Store) -> dict[tuple, tuple[str, str]]:
    return {
        (r.backend, r.key.token_bucket, r.status): (str(r.provenance), r.measured_on) for _i, r in s.list_profiles()
    }


QUERY = dict(fingerprint="fp", software="sw", ep_size=2, nodes=1, hidden=4096, intermediate=1024, experts=64,
             topk=6, dtype="bfloat16")


def test_0004_relabels_rows_labelled_measured_by_a_backend_that_does_not_measure(tmp_path):
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    path = tmp_path / "m.db"
    database_at_0003(path)
    before = profile_rows(path)
    with Store(path) as s:  # upgrades on first use
        assert s.current_revision() == head_revision() == "0011"
        assert s.check()["ok"]
        assert labels(s) == {(k[0], k[1], k[2]): v for k, v in AT_0003.items()}
        # The preset's number at 4096 tokens is no measurement: find_profile offers it as a preset only.
        assert s.find_profile(**QUERY, tokens=4096, measured_only=True) is None
        assert s.find_profile(**QUERY, tokens=4096).provenance == "preset"
        assert s.find_profile(**QUERY, tokens=64, measured_only=True).backend == "local:nccl"
        # One event per relabelled row, with what the row said before.
        events = [e for e in s.list_events() if e.kind == "relabelled"]
        assert len(events) == len(MISLABELLED) == 5
        by_backend = {(e.details["backend"], e.details["status"]): e.details for e in events}
        d = by_backend[("model:nvlink-h200x2", "stale")]
        assert d["provenance"] == {"from": "measured", "to": "preset"}
        assert d["measured_on"] == {"from": "fp", "to": "preset:nvlink-h200x2"} and d["fingerprint"] == "fp"
        assert {e.details["profile"] for e in events} == {
            i for i, r in s.list_profiles() if (r.backend, r.key.token_bucket, r.status, r.provenance)
            in {(k[0], k[1], k[2], AT_0003[k][0]) for k in MISLABELLED}}
        # Importable again: an export of the upgraded database passes the import checks (a preset names its preset).
        with Store(tmp_path / "copy.db") as copy:
            assert copy.import_bytes(s.dump_profiles()).inserted == len(AT_0003)
    # No row deleted; keys, statuses, numbers and dates are as they were: only the two label columns moved.
    after = profile_rows(path)
    assert len(after) == len(before) == len(AT_0003)
    # (0005 then adds the routing column, "" for every row, 0006 the perf_env column, NULL: not recorded, and 0009 the
    # runtime_options and runtime_options_digest columns, NULL: not recorded)
    assert [r[:-6] for r in after] == [r[:-2] for r in before]
    assert {r[-4:] for r in after} == {("", None, None, None)}
    # `moetune profiles list` lists only the real measurement as measured.
    r = CliRunner().invoke(app, ["profiles", "list", "--provenance", "measured", "--json", "--db", str(path)])
    assert r.exit_code == 0, r.output
    assert [(p["backend"], p["key"]["token_bucket"]) for p in json.loads(r.stdout)] == [("local:nccl", 64)]


def test_0004_downgrade_keeps_the_relabelling_and_upgrade_round_trips(tmp_path):
    path = tmp_path / "r.db"
    database_at_0003(path)
    with Store(path, upgrade=False) as s:
        s.upgrade("0004")
        upgraded, events = profile_rows(path), s.list_events()
        s.downgrade("0003")  # a no-op that keeps data: the relabelling is not undone
        assert s.current_revision() == "0003"
        assert profile_rows(path) == upgraded and s.list_events() == events
        s.upgrade("0004")
        assert s.current_revision() == "0004"
        assert profile_rows(path) == upgraded and s.list_events() == events  # nothing left to relabel
        s.upgrade()
        assert s.check()["ok"]


def test_0004_after_a_round_trip_through_0002_no_modelled_row_is_measured(tmp_path):
    """0003's downgrade retires (stale) a current profile whose label its backfill would not derive again; after
    the upgrade no row whose backend does not measure is labelled measured, current or history, and none is lost."""
    path = tmp_path / "h.db"
    database_at_0003(path)
    with Store(path) as s:
        s.downgrade("0002")
        s.upgrade()
        got = s.list_profiles()
        assert len(got) == len(AT_0003)
        assert not [r for _i, r in got if r.provenance == "measured" and not r.backend.startswith("local:")]
        assert s.find_profile(**QUERY, tokens=4096, measured_only=True) is None
        assert s.check()["ok"]


def test_0004_relabels_stale_and_superseded_history_made_at_head(tmp_path):
    """A mislabelled row that went stale (a fabric change) or superseded before the upgrade is relabelled too."""
    path = tmp_path / "s.db"
    database_at_0003(path)
    con = sqlite3.connect(path)
    con.execute("UPDATE profiles SET status = 'stale' WHERE status = 'current'")
    con.commit()
    con.close()
    with Store(path) as s:
        assert s.count_profiles(status="current") == 0
        got = {(r.backend, r.key.token_bucket): r.provenance for _i, r in s.list_profiles()}
        assert got == {(k[0], k[1]): v[0] for k, v in AT_0003.items()}
        assert len([e for e in s.list_events() if e.kind == "relabelled"]) == len(MISLABELLED)


def test_an_open_says_what_it_migrated(tmp_path) -> None:
    """Store.upgraded: what the open itself migrated (the daemon's start log reads it), nothing when at head."""
    from moetune.tuner.store._schema import Upgraded

    path = tmp_path / "m.db"
    with Store(path) as s:
        assert s.upgraded == Upgraded(None, head_revision())  # created
        s.downgrade("0004")
    with Store(path) as s:
        assert s.upgraded == Upgraded("0004", head_revision())
        s.downgrade("base")  # moetune's tables dropped, its version table kept: a migration from base, not a creation
    with Store(path) as s:
        assert s.upgraded == Upgraded("base", head_revision())
    with Store(path) as s, Store(path, readonly=True) as r:
        assert s.upgraded is None and r.upgraded is None


def test_the_suggested_command_quotes_a_path_with_a_space(tmp_path) -> None:
    """The schema's "run `moetune db upgrade --db PATH`" pasted into a shell must name the one file."""
    path = tmp_path / "my dbs" / "m.db"
    path.parent.mkdir()
    with Store(path) as s:
        s.downgrade("0004")
    for open_it in (lambda: Store(path, readonly=True), lambda: Store.open_existing(path)):
        with pytest.raises(StoreError) as e:
            open_it()
        assert f"`moetune db upgrade --db '{path}'`" in str(e.value), str(e.value)
