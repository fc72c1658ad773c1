"""`moetune serve` on a socket or a database another daemon holds said only "another daemon is listening on PATH (or
starting on it: LOCK is locked)" / "another moetune daemon is using the database ...": what is wrong, but neither which
process holds it (its pid is in the lock file) nor what to do. Each now names the holder's pid and the way out (stop
it, or another --socket / --db). The exit status stays 1 (busy, not a wrong configuration)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.tuner.daemon.errors import DaemonBusy
from moetune.tuner.daemon.locks import lock_database
from moetune.tuner.daemon.runtime_dir import check_socket_path
from moetune.tuner.store.lock_files import take_lock_file

pytestmark = pytest.mark.timeout(120)


def test_serve_on_a_held_socket_names_the_holder_and_what_to_do(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    fd = take_lock_file(run / ".d.sock.moetune-lock")  # as a daemon serving run/d.sock holds it (this pid in it)
    try:
        env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "", "COLUMNS": "200"}
        r = subprocess.run([sys.executable, "-m", "moetune.tuner.cli", "serve", "--db", str(tmp_path / "new.db"),
                            "--create", "--rediscover-interval", "0", "--socket", f"ipc://{run / 'd.sock'}"],
                           capture_output=True, text=True, timeout=100, env=env)
    finally:
        os.close(fd)
    assert r.returncode == 1, r.stderr[-3000:]
    err = r.stderr
    assert f"another daemon is listening on {run / 'd.sock'}" in err and "Traceback" not in err, err[-3000:]
    assert f"locked by pid {os.getpid()}" in err, err[-3000:]
    assert "stop it first, or give this one another daemon.socket (--socket)" in err, err[-3000:]


def test_a_held_database_names_the_holder_and_what_to_do(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    fd = take_lock_file(tmp_path / "m.db.daemon-lock")
    try:
        with pytest.raises(DaemonBusy) as e:
            lock_database(db)
    finally:
        os.close(fd)
    said = str(e.value)
    assert "another moetune daemon is using the database" in said
    assert f"locked by pid {os.getpid()}" in said and "stop it first, or serve another database (--db" in said


def test_a_live_socket_without_our_lock_says_what_to_do(tmp_path: Path) -> None:
    p = tmp_path / "d.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(p))
    s.listen(1)
    try:
        with pytest.raises(DaemonBusy, match=r"another daemon is listening on .*: stop it first, or give this one "
                                             r"another --pub-socket"):
            check_socket_path(p, "--pub-socket")
    finally:
        s.close()
