"""`moetune query` with no daemon checks the fallback database it read for damage (SQLite's quick_check). The client
does not read a database other users can write (`paths.untrusted_file_reason`), yet `query` still opened that file
to scan it: SQLite then parsed every page of a file whose bytes (and -wal, -shm, locks) another user controls, and
the command warned that a file the lookup never used was damaged. An untrusted database is now not opened at all:
the warning names it as untrusted, and why."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_readers_warn_on_damaged_db import dbs  # noqa: F401  (the fixture: a sound and a damaged database)

from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(120)


def _query(tmp_path: Path, db: Path) -> tuple[int, str]:
    args = ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--socket", f"ipc://{tmp_path}/none.sock",
            "--format", "json"]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200", "MOETUNE_STORE_DB": str(db)})
    return r.exit_code, " ".join(r.stderr.split())


@pytest.mark.parametrize("which", ["sound", "damaged"])
def test_an_untrusted_fallback_database_is_named_and_never_opened(dbs: tuple[Path, Path], tmp_path: Path,  # noqa: F811
                                                                  monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    db = dbs[0] if which == "sound" else dbs[1]
    os.chmod(db, 0o666)  # the test's own file: others may write it, so the client does not trust it
    from moetune.tuner.store import store as store_mod

    opened: list[str] = []
    real_init = store_mod.Store.__init__

    def spy(self: object, path: object, *a: object, **kw: object) -> None:
        opened.append(str(path))
        real_init(self, path, *a, **kw)

    monkeypatch.setattr(store_mod.Store, "__init__", spy)
    code, err = _query(tmp_path, db)
    assert code == 0, err
    assert str(db) not in opened, opened
    assert "integrity check" not in err, err
    assert f"warning: {db} is a database this client does not trust" in err and "world-writable" in err, err


def test_a_trusted_damaged_fallback_database_is_still_checked(dbs: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    _good, bad = dbs
    code, err = _query(tmp_path, bad)
    assert code == 0, err
    assert f"warning: {bad} failed SQLite's integrity check" in err and "does not trust" not in err, err


# `query --db FILE` probed the file it was given (SQLite parsed it) before any trust check: the fallback database's
# rule (`paths.untrusted_file_reason`) now refuses an untrusted one first, naming it and why, exit 2, no traceback
_OTHER_UID = 54321  # no user of this machine


def _query_db(tmp_path: Path, db: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, list[str], object]:
    import sqlite3

    opened: list[str] = []
    real_connect = sqlite3.connect

    def spy(database: object, *a: object, **kw: object) -> object:
        opened.append(str(database))
        return real_connect(database, *a, **kw)

    monkeypatch.setattr(sqlite3, "connect", spy)
    args = ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--socket", f"ipc://{tmp_path}/none.sock",
            "--format", "json", "--db", str(db)]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    return r.exit_code, " ".join(r.stderr.split()), opened, r.exception


@pytest.mark.parametrize("how", ["world-writable file", "folder others can write", "another user's file"])
def test_query_refuses_an_untrusted_db_before_sqlite_opens_it(dbs: tuple[Path, Path], tmp_path: Path,  # noqa: F811
                                                             monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    good, _bad = dbs
    if how == "world-writable file":
        db, why = good, "world-writable"
        os.chmod(db, 0o666)
    elif how == "folder others can write":
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)  # no sticky bit: anyone may replace the file
        db, why = shared / "good.db", "group- or world-writable"
        os.rename(good, db)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user (chown) needs root")
        db, why = good, f"owned by uid {_OTHER_UID}"
        os.chown(db, _OTHER_UID, _OTHER_UID)
    code, err, opened, exc = _query_db(tmp_path, db, monkeypatch)
    assert code == 2, err
    assert isinstance(exc, SystemExit), exc  # typer's exit, not a traceback
    assert f"--db {db} is a database this client does not trust" in err and why in err, err
    assert "Traceback" not in err and opened == [], (err, opened)


def test_query_reads_a_trusted_db(dbs: tuple[Path, Path], tmp_path: Path,  # noqa: F811
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    good, _bad = dbs
    code, err, opened, _exc = _query_db(tmp_path, good, monkeypatch)
    assert code == 0, err
    assert "does not trust" not in err and opened, (err, opened)
