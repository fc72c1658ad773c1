"""An ipc:// daemon that does not answer (stopped with SIGSTOP, stuck, busy) was said as "no reply from the daemon at
ENDPOINT within N ms" and nothing more, while the tcp:// case names the budget and what to check (1399dd28): an
operator was not told where the budget is set, which process to look at, or whether anything listened at all. The
time-out now says both: a socket that accepts (a daemon that does not answer, its pid from its daemon.json) or a
socket file nothing listens on (a start is what is needed)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonTimeout
from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(60)


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return run


def _mute(p: Path) -> socket.socket:
    """A unix socket that accepts connections (backlog) and never answers: a daemon stopped or stuck."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(p))
    s.listen(8)
    return s


def _time_out(endpoint: str) -> str:
    c = ProfileClient(endpoint, timeout_ms=300, retries=0)
    try:
        with pytest.raises(DaemonTimeout) as ei:
            c.status()
        return str(ei.value)
    finally:
        c.close()


def test_a_mute_ipc_daemon_is_named_with_its_pid_the_budget_and_what_to_check(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    sock = run / "daemon.sock"
    endpoint = f"ipc://{sock}"
    # daemon.json as a running daemon writes it: this (live) pid, this host
    (run / "daemon.json").write_text(json.dumps({"written_by": "moetune-daemon", "endpoint": endpoint, "pid": os.getpid(),
                                                 "host": socket.gethostname(), "running": True}))
    s = _mute(sock)
    try:
        said = _time_out(endpoint)
    finally:
        s.close()
    assert said.startswith(f"no reply from the daemon at {endpoint} within 300 ms"), said
    assert "client.timeout_ms" in said and "--timeout-ms" in said, said
    assert f"check that the daemon (pid {os.getpid()}) is not stopped or stuck" in said, said


def test_a_socket_file_nothing_listens_on_says_to_start_the_daemon(tmp_path: Path) -> None:
    """No daemon.json proving it stale (a pid not known to be gone): the socket file alone refuses connections."""
    run = _run_dir(tmp_path)
    sock = run / "daemon.sock"
    _mute(sock).close()  # the file stays, nothing listens
    said = _time_out(f"ipc://{sock}")
    assert f"nothing listens on its socket file {sock}" in said and "`moetune serve`" in said, said


def test_the_cli_says_it(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    sock = run / "daemon.sock"
    s = _mute(sock)
    home = tmp_path / "h"
    try:
        r = CliRunner().invoke(app, ["status", "--socket", f"ipc://{sock}", "--timeout-ms", "300"],
                               env={"MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"),
                                    "MOETUNE_CONFIG": "", "COLUMNS": "200"})
    finally:
        s.close()
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and "Traceback" not in out, r.output
    assert "its socket is there but nothing answered" in out and "`systemctl status moetune`" in out, out
