"""`moetune tune show` on a studies file a tune writes while it reads: Optuna wraps SQLAlchemy's errors
(StorageInternalError "...invalid data in the commit..."), which hides the read-only opener's DatabaseChanged. The
file is read again a few times, then one line, exit 1: not "cannot be opened ... move it aside" (exit 2) about a
healthy file, nor a traceback from `tune show -s NAME` (also on "database is locked"). The fallback (immutable=1) is
forced as in test_sqlite_readonly_fallback.py, and a writer changes the file before a statement runs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import event
from typer.testing import CliRunner

from moetune.runtime.profiles import sqlite_open
from moetune.tuner.cli import app
from moetune.tuner.search import readback
from moetune.tuner.search import storage as storage_mod

runner = CliRunner()


def closed_studies_file(folder: Path) -> str:
    """A studies file with one moetune study of 2 trials, closed (as test_sqlite_readonly_fallback.py makes it)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    url = f"sqlite:///{folder / 'studies.db'}"
    storage = storage_mod.make_storage(url)
    study = optuna.create_study(study_name="moetune/t", storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    storage.engine.dispose()
    return url


@pytest.fixture
def immutable(monkeypatch: pytest.MonkeyPatch) -> None:
    """mode=ro fails as it does for a WAL file without -shm in a folder the reader cannot write: immutable=1."""

    def no_shm(uri: str, timeout_s: float) -> sqlite_open.ReadOnlyConnection:
        e = sqlite3.OperationalError("attempt to write a readonly database")
        e.sqlite_errorname = "SQLITE_READONLY_DIRECTORY"
        raise e

    monkeypatch.setattr(sqlite_open, "_open_ro", no_shm)


def _writer(monkeypatch: pytest.MonkeyPatch, db: Path, *, opens_left_alone: int = 0, changes: int = 10**6,
            error: str = "database disk image is malformed") -> list[int]:
    """Each read-only storage opened after the first `opens_left_alone` gets a writer: before a statement runs a tune
    commits to the file (`changes` times in all), and SQLite's read fails with `error`. Returns [opens, changes]."""
    real = storage_mod.open_readonly_storage
    n = [0, 0]

    def opened(url: str):
        st = real(url)
        n[0] += 1
        if n[0] <= opens_left_alone:
            return st

        @event.listens_for(st.engine, "before_cursor_execute")
        def writer(*_a: object) -> None:
            if n[1] >= changes:
                return
            n[1] += 1
            if "locked" not in error:
                con = sqlite3.connect(db)
                con.execute("UPDATE studies SET study_name = study_name")
                con.execute(f"CREATE TABLE IF NOT EXISTS t{n[1]} (x)")
                con.commit()
                con.close()
            raise sqlite3.OperationalError(error) if "locked" in error else sqlite3.DatabaseError(error)

        return st

    monkeypatch.setattr(readback, "open_readonly_storage", opened)
    return n


def _show(url: str, *args: str):
    return runner.invoke(app, ["tune", "show", "--storage", url, *args])


def test_tune_show_of_a_file_that_keeps_changing_says_retry_exit_1(tmp_path: Path, immutable: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url = closed_studies_file(tmp_path)
    n = _writer(monkeypatch, tmp_path / "studies.db")
    r = _show(url)
    assert r.exit_code == 1, r.output
    assert "changed while being read" in r.output and "retry" in r.output
    assert "move it aside" not in r.output and "cannot be opened" not in r.output
    assert n[0] == sqlite_open.READ_ATTEMPTS, r.output  # read again before giving up


def test_tune_show_reads_again_a_file_that_changed_under_it(tmp_path: Path, immutable: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    url = closed_studies_file(tmp_path)
    _writer(monkeypatch, tmp_path / "studies.db", changes=2)
    r = _show(url)
    assert r.exit_code == 0, r.output
    assert "moetune/t" in r.output


def test_tune_show_study_of_a_file_that_keeps_changing_is_one_line(tmp_path: Path, immutable: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    url = closed_studies_file(tmp_path)
    _writer(monkeypatch, tmp_path / "studies.db", opens_left_alone=1)  # list_studies reads; describe_study does not
    r = _show(url, "-s", "moetune/t")
    assert r.exit_code == 1, r.output
    assert "changed while being read" in r.output and "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


@pytest.mark.parametrize("study", [None, "moetune/t"])
def test_tune_show_of_a_locked_file_is_busy_exit_1(tmp_path: Path, immutable: None, monkeypatch: pytest.MonkeyPatch,
                                                   study: str | None) -> None:
    url = closed_studies_file(tmp_path)
    _writer(monkeypatch, tmp_path / "studies.db", opens_left_alone=1 if study else 0, error="database is locked")
    r = _show(url, *(["-s", study] if study else []))
    assert r.exit_code == 1, r.output
    assert "busy" in r.output and "move it aside" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
