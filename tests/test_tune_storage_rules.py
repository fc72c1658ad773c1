"""A SQLite `--storage` follows the rules `--db` follows: no Optuna tables (nor WAL) added to another program's file,
no folder made but moetune's own data folder. The schema-creation lock `<file>.lock` is taken only while the schema
is missing, opened read-only and never through a link; where it cannot be opened the creation is retried."""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.search import readback, storage
from moetune.tuner.search.storage import make_storage
from moetune.tuner.search.study import open_study

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.timeout(240)
runner = CliRunner()
TUNE = ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "3", "--tokens", "128"]


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _foreign(p: Path) -> Path:
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO customers VALUES (1, 'a')")
    con.commit()
    con.close()
    return p


def _tables(p: Path) -> set[str]:
    con = sqlite3.connect(p)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()


def test_another_programs_file_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    other = _foreign(tmp_path / "app.db")
    before = _digest(other)
    with pytest.raises(ValueError, match=rf"{other} is another program's database \(it has tables customers"):
        make_storage(f"sqlite:///{other}")
    assert _digest(other) == before and _tables(other) == {"customers"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]  # no -wal, no lock file
    con = sqlite3.connect(other)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    con.close()


def test_tune_with_another_programs_file_is_one_line_exit_2(tmp_path: Path) -> None:
    other = _foreign(tmp_path / "app.db")
    before = _digest(other)
    r = runner.invoke(app, [*TUNE, "--db", str(tmp_path / "m.db"), "--storage", f"sqlite:///{other}"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert f"--storage sqlite:///{other}: {other} is another program's database" in " ".join(r.output.split())
    assert _digest(other) == before


def test_optuna_store_and_empty_files_are_studies_storages(tmp_path: Path) -> None:
    optuna_file = tmp_path / "studies.db"
    make_storage(f"sqlite:///{optuna_file}")  # a new file: Optuna's
    make_storage(f"sqlite:///{optuna_file}")  # and again
    store_file = tmp_path / "moetune.db"  # the profile store's file may hold the studies too
    con = sqlite3.connect(store_file)
    con.execute("CREATE TABLE moetune_alembic_version (version_num TEXT)")
    con.execute("CREATE TABLE profiles (id INTEGER)")
    con.commit()
    con.close()
    make_storage(f"sqlite:///{store_file}")
    assert {"studies", "trials", "profiles"} <= _tables(store_file)
    empty = tmp_path / "empty.db"
    empty.touch()
    make_storage(f"sqlite:///{empty}")
    assert "studies" in _tables(empty)


def test_a_missing_folder_is_refused_not_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    deep = tmp_path / "nonexist" / "deep" / "s.db"
    with pytest.raises(ValueError, match=rf"the folder {deep.parent} does not exist"):
        make_storage(f"sqlite:///{deep}")
    assert not (tmp_path / "nonexist").exists()
    r = runner.invoke(app, [*TUNE, "--db", str(tmp_path / "m.db"), "--storage", f"sqlite:///{deep}"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "does not exist" in r.output and not (tmp_path / "nonexist").exists()
    # moetune's own data folder is made (the default studies file beside the default store)
    make_storage(f"sqlite:///{tmp_path / 'home' / 'moetune-studies.db'}")
    assert (tmp_path / "home" / "moetune-studies.db").is_file()


def test_the_lock_is_taken_only_while_the_schema_is_missing(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    lock = tmp_path / "s.db.lock"
    make_storage(f"sqlite:///{db}")  # first creation: under the lock
    assert lock.exists()
    lock.unlink()  # ours (the test's)
    open_study("moetune/t", f"sqlite:///{db}")
    make_storage(f"sqlite:///{db}")
    assert not lock.exists()  # the schema is there: no lock, no lock file


def test_a_read_only_lock_file_is_used(tmp_path: Path) -> None:
    """flock needs no write access: a lock file another user (root, 0644) made still serializes the creation.
    Opened O_RDWR it would fail for the daemon's user on such a file, and the lock be silently skipped."""
    db = tmp_path / "s.db"
    lock = tmp_path / "s.db.lock"
    lock.touch(mode=0o444)
    os.chmod(lock, 0o444)
    seen: list[int] = []
    real_open = os.open

    def spy(path, flags, *a, **k):  # type: ignore[no-untyped-def]
        if str(path) == str(lock):
            seen.append(flags)
        return real_open(path, flags, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "open", spy)
        make_storage(f"sqlite:///{db}")
    assert seen and all(f & os.O_ACCMODE == os.O_RDONLY and f & os.O_NOFOLLOW for f in seen)
    assert "studies" in _tables(db)


def test_a_lock_through_a_link_is_not_followed_and_creation_is_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "s.db"
    target = tmp_path / "elsewhere"
    (tmp_path / "s.db.lock").symlink_to(target)
    real = storage.GuardedRDBStorage  # the RDBStorage make_storage builds (interrupts held back in its calls)
    calls: list[int] = []

    def racing(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:  # another first run is creating the schema right now
            raise optuna.exceptions.StorageInternalError("(sqlite3.IntegrityError) UNIQUE constraint failed: "
                                                         "alembic_version.version_num")
        return real(*a, **k)

    monkeypatch.setattr(storage, "GuardedRDBStorage", racing)
    monkeypatch.setattr("time.sleep", lambda s: None)
    with caplog.at_level(logging.DEBUG, logger="moetune.tuner.search.storage"):
        make_storage(f"sqlite:///{db}")
    assert not target.exists()  # the link was not followed
    assert len(calls) == 2 and "studies" in _tables(db)
    assert any("no creation lock for" in r.getMessage() and "s.db.lock" in r.getMessage() for r in caplog.records)


def test_tune_finishes_a_half_created_studies_file(tmp_path: Path) -> None:
    """A first `moetune tune` stopped while Optuna created the default studies file's tables left some of them and no
    alembic_version: the next run was refused ("another program's database (it has tables studies, ...")."""
    import sqlalchemy
    from optuna.storages._rdb import models

    studies = tmp_path / "m-studies.db"  # the default --storage beside --db m.db
    engine = sqlalchemy.create_engine(f"sqlite:///{studies}")
    models.BaseModel.metadata.create_all(engine, tables=[models.BaseModel.metadata.tables[n]
                                                         for n in ("studies", "study_directions", "version_info")])
    engine.dispose()
    r = runner.invoke(app, [*TUNE, "--db", str(tmp_path / "m.db"), "--json"])
    assert r.exit_code == 0, r.output
    assert {"trials", "alembic_version"} <= _tables(studies)
    assert readback.list_studies(f"sqlite:///{studies}")[0]["trials"] >= 3


def _refusals(path: Path) -> tuple[str, str]:
    """What the store and the studies storage say, refusing the same path."""
    from moetune.tuner.store.store import Store, StoreError

    with pytest.raises(StoreError) as store_error:
        Store(path)
    with pytest.raises(storage.StorageRefused) as storage_error:
        make_storage(f"sqlite:///{path}")
    return str(store_error.value), str(storage_error.value)


def test_the_store_and_the_studies_storage_word_one_rule_alike(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """One function each (tuner/store/_folders.make_parent, _tables.shown_tables / existing_tables): the folder rule
    and the list of a foreign file's tables were written twice, with different words for the same failure."""
    other = _foreign(tmp_path / "app.db")
    con = sqlite3.connect(other)
    for t in "bcdefg":
        con.execute(f"CREATE TABLE {t} (id INTEGER)")
    con.commit()
    con.close()
    for said in _refusals(other):
        assert "it has tables b, c, customers, d, e and 2 more" in said
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "file" / "home"))  # the own data folder cannot be made
    store_said, storage_said = _refusals(tmp_path / "file" / "home" / "x.db")
    assert store_said == storage_said
    assert store_said == (f"cannot create {tmp_path / 'file' / 'home' / 'x.db'}: MOETUNE_HOME "
                          f"({tmp_path / 'file' / 'home'}) is under a file, not a folder")
    store_said, storage_said = _refusals(tmp_path / "missing" / "x.db")
    assert store_said == storage_said and "the folder" in store_said and "does not exist" in store_said


def test_a_fifo_at_the_lock_name_does_not_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO planted at `<file>.lock` (a sticky shared folder, another user) is opened without blocking (a
    read-only open would wait for a writer for ever), refused as not a regular file, and the creation is retried."""
    import threading

    db = tmp_path / "s.db"
    fifo = tmp_path / "s.db.lock"
    os.mkfifo(fifo)
    done: list[object] = []

    def run() -> None:
        try:
            with caplog.at_level(logging.DEBUG, logger="moetune.tuner.search.storage"):
                make_storage(f"sqlite:///{db}")
            done.append(True)
        except Exception as e:  # the outcome under test
            done.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # blocked in open(): release it (a writer opens the FIFO) before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(30)
        pytest.fail("opening the creation lock blocked on a FIFO")
    assert done == [True]
    assert "studies" in _tables(db)
    assert any("no creation lock for" in r.getMessage() and "not a regular file" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("refused", ["foreign", "missing folder", "not a URL"])
def test_a_refused_storage_leaves_no_new_profile_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          refused: str) -> None:
    """`moetune tune` created and migrated --db before it checked --storage: a refused storage left a new db behind."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    url = {"foreign": f"sqlite:///{_foreign(tmp_path / 'app.db')}",
           "missing folder": f"sqlite:///{tmp_path / 'nonexist' / 's.db'}", "not a URL": "nonsense"}[refused]
    db = tmp_path / "new.db"
    r = runner.invoke(app, [*TUNE, "--db", str(db), "--storage", url])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "--storage" in r.output
    assert not db.exists() and not (tmp_path / "new.db-wal").exists()


def test_a_refused_profile_database_leaves_no_new_studies_file(tmp_path: Path) -> None:
    db = _foreign(tmp_path / "app.db")
    r = runner.invoke(app, [*TUNE, "--db", str(db)])
    assert r.exit_code == 2 and "not a moetune database" in " ".join(r.output.split()), r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]  # no app-studies.db beside it
