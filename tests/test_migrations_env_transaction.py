"""env.py's own connection (a developer's `alembic upgrade` with sqlalchemy.url, no moetune store) migrates in one
transaction, as the store's does: a migration that fails midway leaves the database as it was, at its revision, and
usable. SQLite's Python driver begins a transaction only before an INSERT/UPDATE/DELETE, so without BEGIN of its own
the DDL of a batch migration (CREATE TABLE _alembic_tmp_..., DROP, RENAME) ran outside any transaction."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from moetune.migrations import _kept
from moetune.tuner.store._schema import alembic_config
from moetune.tuner.store.store import VERSION_TABLE, Store, head_revision


def schema_rows(path: Path) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
    finally:
        con.close()


def test_a_migration_failing_midway_through_env_py_s_own_connection_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    from alembic import command

    db = tmp_path / "d.db"
    s = Store(db, upgrade=False)
    s.upgrade("0004")
    s.close()
    before = schema_rows(db)

    def fail(*_a: object, **_k: object) -> None:  # 0005's upgrade, after its batch added the routing column
        raise RuntimeError("interrupted")

    monkeypatch.setattr(_kept, "restore", fail)
    cfg = alembic_config()
    cfg.set_main_option("sqlalchemy.url", f"sqlite:///{db}")
    with pytest.raises(RuntimeError, match="interrupted"):
        command.upgrade(cfg, "head")
    assert schema_rows(db) == before  # no routing column, no _alembic_tmp_profiles left behind
    con = sqlite3.connect(db)
    assert con.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [("0004",)]
    con.close()
    monkeypatch.undo()
    command.upgrade(cfg, "head")  # usable: the same upgrade goes through
    with Store(db) as s:
        assert s.current_revision() == head_revision()
        assert s.check()["ok"]


def test_a_migration_failing_midway_through_the_store_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    """The store's own path (Store.upgrade: one BEGIN IMMEDIATE around every step) leaves it as it was too."""
    db = tmp_path / "s.db"
    s = Store(db, upgrade=False)
    s.upgrade("0004")
    s.close()
    before = schema_rows(db)

    def fail(*_a: object, **_k: object) -> None:
        raise RuntimeError("interrupted")

    monkeypatch.setattr(_kept, "restore", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        Store(db)
    assert schema_rows(db) == before
    monkeypatch.undo()
    with Store(db) as s:
        assert s.upgraded is not None and s.upgraded.from_revision == "0004"
        assert s.check()["ok"]
