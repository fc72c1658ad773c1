"""A `moetune serve` whose start was refused before it served (here: its metrics port taken) removed the new database it
had created, but left the socket folder it had made for its IPC socket (`$MOETUNE_HOME/run`, or a --socket's missing
folders) with the daemon's mark in it; on a fresh node that kept moetune's data folder too (the folder was no longer
empty). A refused start now removes the folders it made, only those, only while empty; a folder that was there stays
as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _serve(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOETUNE_HOME": str(home), "MOETUNE_CONFIG": "", "COLUMNS": "200"}
    env.pop("MOETUNE_DAEMON_SOCKET", None)
    cmd = [sys.executable, "-m", "moetune.tuner.cli", "serve", "--rediscover-interval", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)


def test_a_refused_start_leaves_no_socket_folder_it_made(tmp_path: Path, taken_port: int) -> None:
    sock = tmp_path / "run" / "a" / "b" / "d.sock"  # three folders the start makes
    db_dir = tmp_path / "db"
    db_dir.mkdir()
    r = _serve(tmp_path / "home", "--db", str(db_dir / "new.db"), "--create", "--socket", f"ipc://{sock}",
               "--metrics-port", str(taken_port))
    assert r.returncode == 2 and "--metrics-port" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run").exists(), sorted(str(p) for p in (tmp_path / "run").rglob("*"))
    assert sorted(db_dir.iterdir()) == []


def test_a_fresh_home_is_left_as_it_was(tmp_path: Path, taken_port: int) -> None:
    """No --db, no home: the default database and `$MOETUNE_HOME/run` were made by the refused start, and both go."""
    home = tmp_path / "home"
    r = _serve(home, "--metrics-port", str(taken_port))
    assert r.returncode == 2 and "--metrics-port" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not home.exists(), sorted(str(p) for p in home.rglob("*"))


def test_a_socket_folder_that_was_there_stays(tmp_path: Path, taken_port: int) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "mine.txt").write_text("the operator's\n")
    db_dir = tmp_path / "db"
    db_dir.mkdir()
    r = _serve(tmp_path / "home", "--db", str(db_dir / "new.db"), "--create", "--socket", f"ipc://{run / 'd.sock'}",
               "--metrics-port", str(taken_port))
    assert r.returncode == 2, r.stderr[-3000:]
    assert sorted(p.name for p in run.iterdir()) == ["mine.txt"]
    assert (run / "mine.txt").read_text() == "the operator's\n"
