"""A daemon killed with -9 leaves its IPC socket and a daemon.json saying it runs: `moetune status`/`retune` (and
the runtime client) say the daemon is not running (its pid is gone, the socket stale), not "no reply within N ms"
(which blames a slow daemon). Only a trusted daemon.json of this host, naming this endpoint, a pid that is gone and
a socket nobody listens on, is taken as proof."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime._proc import pid_gone
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.daemon_info import stale_daemon_reason
from moetune.runtime.profiles.errors import DaemonUnavailable
from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(60)
runner = CliRunner()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _stale(tmp: Path, **info: object) -> tuple[str, Path]:
    """A 0700 runtime dir holding a socket file nobody listens on and a daemon.json (`info` overrides)."""
    run = tmp / "run"
    run.mkdir(mode=0o700)
    sock = run / "daemon.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))  # bound, never listening, closed: the file stays, a connect is refused
    s.close()
    endpoint = f"ipc://{sock}"
    data: dict[str, object] = {"written_by": "moetune-daemon", "endpoint": endpoint, "pid": _dead_pid(),
                               "host": socket.gethostname(), "running": True}
    data.update(info)
    (run / "daemon.json").write_text(json.dumps(data))
    return endpoint, sock


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_dead_pid_and_a_refused_socket_is_a_stale_daemon(tmp_path: Path) -> None:
    endpoint, sock = _stale(tmp_path)
    pid = json.loads((sock.parent / "daemon.json").read_text())["pid"]
    want = f"the daemon is not running (pid {pid} is gone; stale socket at {sock}): start it with `moetune serve`"
    assert stale_daemon_reason(endpoint) == want
    c = ProfileClient(endpoint, timeout_ms=50)
    with pytest.raises(DaemonUnavailable) as ei:
        c.status()
    c.close()
    assert str(ei.value) == want


@pytest.mark.parametrize("change", [
    {"pid": os.getpid()},  # alive
    {"running": False},
    {"host": "another-host"},  # a runtime directory on a shared folder: that pid is not this host's
    {"host": None},  # written before the host was recorded: whose pid it is cannot be told
    {"endpoint": "ipc:///elsewhere/daemon.sock"},
    {"pid": "123"},
    {"pid": None},
])
def test_anything_less_certain_is_not_called_stale(tmp_path: Path, change: dict) -> None:
    endpoint, _ = _stale(tmp_path, **change)
    assert stale_daemon_reason(endpoint) is None
    c = ProfileClient(endpoint, timeout_ms=50)
    with pytest.raises(DaemonUnavailable, match="no reply from the daemon"):
        c.status()
    c.close()


def test_an_untrusted_directory_or_a_listening_socket_is_not_called_stale(tmp_path: Path) -> None:
    endpoint, sock = _stale(tmp_path)
    os.chmod(sock.parent, 0o777)  # others could have written daemon.json
    try:
        assert stale_daemon_reason(endpoint) is None
    finally:
        os.chmod(sock.parent, 0o700)
    sock.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))
    s.listen(1)  # something accepts there (a daemon started since): not stale
    try:
        assert stale_daemon_reason(endpoint) is None
    finally:
        s.close()


def test_a_killed_unreaped_process_is_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not pid_gone(p.pid)
        p.kill()
        F.until(lambda: Path(f"/proc/{p.pid}/stat").read_bytes().rpartition(b")")[2].split()[0] == b"Z")
        assert pid_gone(p.pid)  # a zombie (not waited for yet) runs nothing
    finally:
        p.kill()
        p.wait()
    assert pid_gone(p.pid)


def test_status_and_retune_after_kill_9_say_the_daemon_is_not_running(tmp_path: Path) -> None:
    with F.seeded_daemon(tmp_path) as (d, _facts):
        info = json.loads((d.run_dir / "daemon.json").read_text())
        assert info["running"] is True and info["host"] == socket.gethostname() and info["pid"] == d.proc.pid
        d.kill(9)
    sock = d.run_dir / "daemon.sock"
    assert sock.exists()  # left behind by kill -9
    want = (f"the daemon is not running (pid {d.proc.pid} is gone; stale socket at {sock}): start it with "
            "`moetune serve`")
    env = {"MOETUNE_HOME": str(tmp_path / "home")}
    for cmd in (["status"], ["retune"], ["retune", "--all"]):
        r = runner.invoke(app, [*cmd, "--socket", d.endpoint, "--timeout-ms", "200"], env=env)
        assert r.exit_code == 1, r.output
        assert f"moetune {cmd[0]}: {want}" in _flat(r.output) and "no reply" not in r.output
    r = runner.invoke(app, ["status", "--socket", d.endpoint, "--timeout-ms", "200", "--json"], env=env)
    assert r.exit_code == 1 and json.loads(r.stdout) == {"ok": False, "error": want}
