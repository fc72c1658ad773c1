"""`moetune serve --create` whose start is refused (its socket in use, a port taken, TCP without CURVE) left the new
database it had just created behind, with its lock file: the corrected rerun then found an empty database it never
asked for (and `--db` without --create served it). A refused start now removes what it created, only that: a database
that was there before is left as it was. The refusal is still said, with the configuration's exit status (2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)


def _serve(tmp_path: Path, db: Path, *args: str, create: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "moetune.tuner.cli", "serve", "--db", str(db), *(["--create"] if create else []),
           "--rediscover-interval", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)


def _refusals(tmp_path: Path, port: int) -> dict[str, tuple[list[str], str]]:
    """Each refused start: its serve options and a part of the error it prints."""
    in_the_way = tmp_path / "sock" / "d.sock"
    in_the_way.parent.mkdir(mode=0o700)
    in_the_way.write_text("not a socket\n")
    return {
        "port in use": (["--socket", f"tcp://127.0.0.1:{port}", "--allow-insecure-tcp"], "the address is in use"),
        "socket path taken": (["--socket", f"ipc://{in_the_way}"], "exists and is not a socket"),
        # refused by the transport check at the start, before the start's own clean-up
        "tcp without curve": (["--socket", f"tcp://127.0.0.1:{port}"], "CURVE"),
    }


@pytest.mark.parametrize("case", ["port in use", "socket path taken", "tcp without curve"])
def test_a_refused_create_leaves_no_database(tmp_path: Path, taken_port: int, case: str) -> None:
    args, said = _refusals(tmp_path, taken_port)[case]
    folder = tmp_path / "db"
    folder.mkdir()
    r = _serve(tmp_path, folder / "new.db", *args)
    assert r.returncode == 2, r.stderr[-3000:]
    assert said in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    # no database, no -wal/-shm, no lock file beside it
    assert sorted(p.name for p in folder.iterdir()) == [], r.stderr[-3000:]


def test_a_database_that_was_there_is_kept(tmp_path: Path, taken_port: int) -> None:
    """--create over an existing database (or --db without --create) refused the same way: the file is not touched."""
    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "old.db"
    Store(db).close()
    before = (db.stat().st_ino, db.read_bytes())
    for create in (True, False):
        r = _serve(tmp_path, db, "--socket", f"tcp://127.0.0.1:{taken_port}", "--allow-insecure-tcp", create=create)
        assert r.returncode == 2 and "the address is in use" in r.stderr, r.stderr[-3000:]
        assert (db.stat().st_ino, db.read_bytes()) == before
