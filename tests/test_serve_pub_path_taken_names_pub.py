"""The socket checks name the option that set the path (`setting`, 7d1ab4e0/e49b25d0), but a file in the way of the
PUB socket's IPC path still said "choose another --socket" (the request socket's option), and the PUB's setting as
the IPC refusals now say it ended "default: the socket's port + 1", TCP's rule, where an IPC PUB defaults to
events.sock beside the socket. Each refusal names the PUB's own option and its IPC default."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.runtime_dir import check_socket_path

pytestmark = pytest.mark.timeout(120)


def test_a_file_in_the_way_names_the_setting_given(tmp_path: Path) -> None:
    p = tmp_path / "events.sock"
    p.write_text("not a socket\n")
    with pytest.raises(DaemonConfigError) as e:
        check_socket_path(p, "--pub-socket")
    assert "choose another --pub-socket" in str(e.value) and "another --socket" not in str(e.value), e.value


def test_a_dead_socket_not_ours_names_the_setting_given(tmp_path: Path) -> None:
    p = tmp_path / "events.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(p))
    s.close()  # dead, and no owner record of ours
    with pytest.raises(DaemonConfigError) as e:
        check_socket_path(p, "--pub-socket")
    assert "choose another --pub-socket" in str(e.value) and "another --socket" not in str(e.value), e.value


def test_serve_with_its_ipc_pub_path_taken_names_the_pub_and_its_ipc_default(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "events.sock").write_text("not a socket\n")  # where the PUB beside ipc://run/d.sock goes
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "", "COLUMNS": "400"}
    r = subprocess.run([sys.executable, "-m", "moetune.tuner.cli", "serve", "--db", str(tmp_path / "new.db"), "--create",
                        "--rediscover-interval", "0", "--socket", f"ipc://{run / 'd.sock'}"],
                       capture_output=True, text=True, timeout=100, env=env)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "exists and is not a socket" in err and "Traceback" not in err, err[-3000:]
    assert "choose another daemon.pub_socket (--pub-socket; default: events.sock beside the socket)" in err, err[-3000:]
    assert "port + 1" not in err, err[-3000:]
