"""One rule, `moetune.tuner.store._tables`, says whose SQLite file it is, for the store and `tune show` alike: a file
is Optuna's when it holds Optuna's core tables (studies, trials, version_info), whatever else a newer Optuna adds;
another Alembic application's file (alembic_version and tables of its own, one of them called trials) is foreign."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from moetune.tuner.search import readback, storage, study, trials
from moetune.tuner.store import _tables
from moetune.tuner.store.db_file import probe_database
from moetune.tuner.store.store import Store, StoreError, head_revision


def make(path: Path, *tables: str) -> str:
    """A file with these tables: Optuna's with Optuna's columns, any other with an id column."""
    con = sqlite3.connect(path)
    for t in tables:
        con.execute(f"CREATE TABLE {t} ({', '.join(_tables.OPTUNA_COLUMNS.get(t, ('id',)))})")
    con.commit()
    con.close()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_another_alembic_apps_file_is_foreign_everywhere(tmp_path: Path) -> None:
    db = tmp_path / "theirs.db"
    digest = make(db, "alembic_version", "trials")
    assert probe_database(db) == ("foreign", None)
    for readonly in (False, True):
        with pytest.raises(StoreError, match=r"theirs\.db is not a moetune database \(it has tables alembic_version, "
                                             r"trials"):
            Store(db, readonly=readonly)
    with pytest.raises(StoreError, match="not a moetune database"):
        Store.open_existing(db, write=True, create=True)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


def test_a_newer_optunas_file_with_a_table_of_its_own_still_becomes_a_store(tmp_path: Path) -> None:
    db = tmp_path / "studies.db"
    make(db, "alembic_version", "studies", "trials", "version_info", "trial_something_new")
    assert probe_database(db) == ("empty", None)  # no moetune tables yet; not another program's
    with pytest.raises(StoreError, match=r"it has only Optuna's tables: `moetune db upgrade"):
        Store.open_existing(db)
    with Store(db) as s:
        assert s.current_revision() == head_revision()


def test_tune_storage_and_tune_show_apply_the_same_rule(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs.db"
    digest = make(theirs, "alembic_version", "trials")
    with pytest.raises(storage.StorageRefused, match="another program's database"):
        storage.make_storage(f"sqlite:///{theirs}")
    with pytest.raises(storage.NotAStudiesFile, match="no studies, version_info tables"):
        storage.open_readonly_storage(f"sqlite:///{theirs}")
    assert hashlib.sha256(theirs.read_bytes()).hexdigest() == digest
    assert not _tables.is_foreign_file({"alembic_version", "studies", "trials", "version_info", "x"})


def test_optuna_rdb_tables_are_the_installed_optunas() -> None:
    from optuna.storages._rdb import models

    assert set(_tables.OPTUNA_RDB_TABLES) == set(models.BaseModel.metadata.tables) | {"alembic_version"}
    assert set(_tables.OPTUNA_TABLES) <= set(_tables.OPTUNA_RDB_TABLES)


def half_created(path: Path, *names: str) -> set[str]:
    """What a first opening stopped midway leaves: some of Optuna's own tables (its metadata's create_all commits
    them one by one), no alembic_version (stamped last)."""
    import sqlalchemy
    from optuna.storages._rdb import models

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        models.BaseModel.metadata.create_all(engine, tables=[models.BaseModel.metadata.tables[n] for n in names])
    finally:
        engine.dispose()
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()


@pytest.mark.parametrize("names", [("studies", "study_directions", "version_info"),
                                   ("studies", "trials", "version_info", "trial_params"), ("studies",)])
def test_a_half_created_studies_file_is_finished_not_refused(tmp_path: Path, names: tuple[str, ...]) -> None:
    """Finished, not refused for ever as "another program's database (it has tables studies, study_directions,
    ...)"."""
    db = tmp_path / "studies.db"
    assert half_created(db, *names) == set(names)
    tables = _tables.existing_tables(db, timeout_s=5)  # the names with their columns
    assert not _tables.is_foreign_file(tables) and _tables.is_unfinished_optuna_file(tables)
    st = storage.make_storage(f"sqlite:///{db}")  # finishes the schema (and stamps it)
    assert (tmp_path / "studies.db.lock").is_file()  # under the creation lock (taken only while the schema is missing)
    s = study.open_study("moetune/t", st, seed=0)
    s.tell(s.ask(), 1.0)
    assert trials.finished_trials(study.open_study("moetune/t", f"sqlite:///{db}")) == 1
    assert readback.list_studies(f"sqlite:///{db}")[0]["study"] == "moetune/t"


def test_a_half_created_studies_file_may_become_a_store(tmp_path: Path) -> None:
    db = tmp_path / "studies.db"
    half_created(db, "studies", "study_directions", "version_info")
    assert probe_database(db) == ("empty", None)
    with pytest.raises(StoreError, match=r"it has only Optuna's tables: `moetune db upgrade"):
        Store.open_existing(db)
    with Store(db) as s:
        assert s.current_revision() == head_revision()
    storage.make_storage(f"sqlite:///{db}")  # and Optuna finishes its part


def test_an_unfinished_optuna_file_needs_optunas_names_and_columns() -> None:
    ok = {n: frozenset(c) for n, c in _tables.OPTUNA_COLUMNS.items() if n in ("studies", "trials")}
    assert _tables.is_unfinished_optuna_file(_tables.Tables(ok))
    assert _tables.is_foreign_file(_tables.Tables({**ok, "trials": frozenset({"id", "patient"})}))  # a user's columns
    assert _tables.is_foreign_file(_tables.Tables({**ok, "customers": frozenset({"id"})}))  # a table of another's
    core = {n: frozenset({"id"}) for n in _tables.OPTUNA_TABLES}  # Optuna's core names, a user's own columns
    assert _tables.is_foreign_file(_tables.Tables(core)) and not _tables.is_optuna_file(_tables.Tables(core))
    assert _tables.is_foreign_file({"studies", "customers"})
    assert _tables.is_foreign_file({"alembic_version", "studies", "study_directions"})  # stamped: not unfinished
    assert not _tables.is_unfinished_optuna_file(set())


def test_optuna_columns_are_the_installed_optunas() -> None:
    from optuna.storages._rdb import models

    assert {n: set(c) for n, c in _tables.OPTUNA_COLUMNS.items()} == {
        n: {c.name for c in t.columns} for n, t in models.BaseModel.metadata.tables.items()}


@pytest.mark.parametrize("ddl", ["CREATE TABLE trials (id INTEGER PRIMARY KEY, patient TEXT)",
                                 "CREATE TABLE studies (id INTEGER PRIMARY KEY, title TEXT)"])
def test_a_users_file_with_a_table_called_trials_or_studies_is_foreign(tmp_path: Path, ddl: str) -> None:
    """Only Optuna's table names, no alembic_version: but a user's own columns, so not an unfinished Optuna file;
    neither the store nor tune --storage adds a table to it or switches its journal."""
    db = tmp_path / "user.db"
    con = sqlite3.connect(db)
    con.execute(ddl)
    con.commit()
    con.close()
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    assert probe_database(db) == ("foreign", None)
    with pytest.raises(StoreError, match="not a moetune database"):
        Store(db)
    with pytest.raises(storage.StorageRefused, match="another program's database"):
        storage.make_storage(f"sqlite:///{db}")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user.db"]
