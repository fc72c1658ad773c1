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
