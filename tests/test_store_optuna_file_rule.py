"""One rule, `moetune.tuner.store._tables`, says whose SQLite file it is, for the store and `tune show` alike: a file
is Optuna's when it holds Optuna's core tables (studies, trials, version_info), whatever else a newer Optuna adds;
another Alembic application's file (alembic_version and tables of its own, one of them called trials) is foreign."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from moetune.tuner.search import study
from moetune.tuner.store import _tables
from moetune.tuner.store.store import Store, StoreError, head_revision, probe_database


def make(path: Path, *tables: str) -> str:
    con = sqlite3.connect(path)
    for t in tables:
        con.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY)")
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
    with pytest.raises(study.StorageRefused, match="another program's database"):
        study.make_storage(f"sqlite:///{theirs}")
    with pytest.raises(study.NotAStudiesFile, match="no studies, version_info tables"):
        study.open_readonly_storage(f"sqlite:///{theirs}")
    assert hashlib.sha256(theirs.read_bytes()).hexdigest() == digest
    assert not _tables.is_foreign_file({"alembic_version", "studies", "trials", "version_info", "x"})
