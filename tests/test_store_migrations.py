"""Alembic migrations: own version table, up and down on empty and populated databases."""

from __future__ import annotations

import sqlite3

import pytest

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
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
    s.upsert_fingerprint("fp", {"gpus": 2})
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
    s.add_event(kind="hardware", reason="test")


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
    con.execute("CREATE TABLE studies (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO studies (name) VALUES ('s')")
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
    assert con.execute("SELECT name FROM studies").fetchall() == [("s",)]
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
