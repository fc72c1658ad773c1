"""An ipc:// path with a linked folder and a `..` after it names the file the kernel finds (`..` goes up from where
the link led, not lexically): the daemon keeps its lock, owner records and daemon.json beside that socket, a client
given the same string finds it, and a refused start removes the folders it made there (not lexically named ones)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app
from moetune.tuner.daemon import server
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.runtime_dir import check_socket_ancestors, record_binding

pytestmark = pytest.mark.timeout(60)


def _linked(tmp: Path) -> tuple[Path, Path]:
    """tmp/a/link -> tmp/real/sub: `tmp/a/link/..` is tmp/real for the kernel, tmp/a written lexically."""
    (tmp / "real" / "sub").mkdir(parents=True, mode=0o700)
    (tmp / "a").mkdir(mode=0o700)
    (tmp / "a" / "link").symlink_to(tmp / "real" / "sub")
    return tmp / "a", tmp / "real"


def test_the_socket_file_is_resolved_as_the_kernel_resolves_it(tmp_path: Path) -> None:
    from moetune.runtime.paths import ipc_socket_file

    a, real = _linked(tmp_path)
    assert ipc_socket_file(f"ipc://{a}/link/../new/d.sock") == real / "new" / "d.sock"
    assert ipc_socket_file("tcp://127.0.0.1:5555") is None


def test_serve_and_status_through_a_linked_folder_and_dotdot(tmp_path: Path) -> None:
    a, real = _linked(tmp_path)
    endpoint = f"ipc://{a}/link/../new/daemon.sock"  # new/ does not exist: the daemon makes it where the kernel goes
    d = F.DaemonProc(tmp_path, endpoint=endpoint)
    try:
        d.wait_ready()
        r = CliRunner().invoke(app, ["status", "--socket", endpoint, "--timeout-ms", "2000"],
                               env={"MOETUNE_HOME": str(tmp_path / "home")})
        assert r.exit_code == 0, r.output
        names = set(os.listdir(real / "new"))
        assert {"daemon.sock", ".daemon.sock.moetune-owner", ".daemon.sock.moetune-lock", "daemon.json"} <= names
        assert os.listdir(a) == ["link"]  # nothing written where the path reads lexically
    finally:
        d.kill(15)
    assert d.proc.returncode == 143, d.read_log()[-3000:]  # stopped by SIGTERM (128 + 15), cleanly
    assert not (real / "new" / "daemon.sock").exists()  # its own socket: removed at exit
    assert not (real / "new" / ".daemon.sock.moetune-owner").exists()


def test_a_refused_start_through_a_link_removes_the_folders_it_made(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    a, real = _linked(tmp_path)

    def refuse(*_args: Any) -> Any:
        raise DaemonConfigError("record refused (test)")

    monkeypatch.setattr(server, "record_owner", refuse)
    with pytest.raises(DaemonConfigError, match="record refused"):
        F.in_process_daemon(tmp_path, endpoint=f"ipc://{a}/link/../new/run/daemon.sock").start(background=True)
    assert not (real / "new").exists()  # made by this start, in the folder the kernel went to: removed again
    assert sorted(os.listdir(real)) == ["sub"]


def test_the_folder_holding_the_link_is_checked(tmp_path: Path) -> None:
    """`a/link/..` is looked up through a/: others who may write a/ could repoint the link (abspath skipped a/)."""
    a, _real = _linked(tmp_path)
    os.chmod(a, 0o777)
    with pytest.raises(DaemonConfigError, match=f"{a}, a parent of the socket directory .*every user"):
        check_socket_ancestors(a / "link" / "..")


def test_an_owner_record_that_cannot_be_written_is_said_clearly(tmp_path: Path) -> None:
    sock = tmp_path / "gone" / "daemon.sock"
    with pytest.raises(DaemonConfigError, match=f"cannot write {sock.parent}/.daemon.sock.moetune-owner"):
        record_binding(sock, sock.with_name(".daemon.sock.0123abcd"))


def test_a_client_naming_the_socket_another_way_finds_the_dead_daemon(tmp_path: Path) -> None:
    """daemon.json names a/link/../run/daemon.sock; a client given real/run/daemon.sock (one socket, resolved) is told
    the daemon is not running, as one given the daemon's own string is."""
    import json
    import socket
    import subprocess

    from moetune.runtime.profiles.daemon_info import stale_daemon_reason

    a, real = _linked(tmp_path)
    (real / "run").mkdir(mode=0o700)
    sock = real / "run" / "daemon.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))  # bound, never listening: a dead daemon's socket
    s.close()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    named = f"ipc://{a}/link/../run/daemon.sock"
    (real / "run" / "daemon.json").write_text(json.dumps({"written_by": "moetune-daemon", "endpoint": named,
                                                          "pid": p.pid, "host": socket.gethostname(), "running": True}))
    for endpoint in (named, f"ipc://{sock}"):
        why = stale_daemon_reason(endpoint)
        assert why is not None and f"pid {p.pid} is gone" in why, endpoint


@pytest.mark.parametrize("path", ["/", "/tmp/x/.."])
def test_an_ipc_path_naming_a_folder_is_refused(path: str) -> None:
    from moetune.runtime.paths import endpoint_problem

    for bind in (True, False):
        assert endpoint_problem(f"ipc://{path}", bind=bind) == ("expected ipc:///absolute/path naming a socket file, "
                                                                f"not the folder {path}")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a link to another user (lchown) needs root")
def test_a_linked_socket_folder_of_another_user_in_a_sticky_folder_is_refused(tmp_path: Path) -> None:
    """The socket folder is followed through its links now: one another user owns in a sticky folder (as /tmp) is
    theirs to repoint, and is refused; this user's own link there is followed."""
    _a, real = _linked(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    link = shared / "run"
    link.symlink_to(real / "sub")
    check_socket_ancestors(link)  # this user's (root's) link: followed
    os.lchown(link, 4242, 4242)
    with pytest.raises(DaemonConfigError, match=f"socket directory {link}: {link} is a symbolic link owned by uid 4242"):
        check_socket_ancestors(link)
    with pytest.raises(DaemonConfigError, match="symbolic link owned by uid 4242"):
        F.in_process_daemon(tmp_path, endpoint=f"ipc://{link}/daemon.sock").start(background=True)
    assert os.listdir(real / "sub") == []


def _long_behind_short(tmp: Path) -> tuple[Path, Path]:
    """tmp/s -> tmp/LLL...: a socket named through tmp/s fits a socket address (107 bytes), its resolved path not."""
    from moetune.runtime.paths import MAX_IPC_PATH_BYTES

    long = tmp / ("L" * 100)
    long.mkdir(mode=0o700)
    (tmp / "s").symlink_to(long)
    assert len(os.fsencode(tmp / "s" / "be.sock")) <= MAX_IPC_PATH_BYTES < len(os.fsencode(long / "a.sock"))
    return tmp / "s", long


def test_a_live_daemon_whose_resolved_socket_path_is_too_long_is_seen_alive(tmp_path: Path) -> None:
    """A daemon bound at a short path through a linked folder whose resolved path is over 107 bytes was probed at the
    resolved path (connect fails: too long), read as dead, and a second daemon in that folder took over its
    daemon.json (its clients then read the other's fingerprint and database)."""
    import json

    short, long = _long_behind_short(tmp_path)
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    a = F.in_process_daemon(tmp_path / "A", endpoint=f"ipc://{short}/a.sock", pub_endpoint=f"ipc://{short}/ae.sock")
    a.start(background=True)
    try:
        b = F.in_process_daemon(tmp_path / "B", endpoint=f"ipc://{short}/b.sock", pub_endpoint=f"ipc://{short}/be.sock")
        b.start(background=True)
        try:
            assert json.loads((long / "daemon.json").read_text())["endpoint"] == f"ipc://{short}/a.sock"
        finally:
            b.stop()
    finally:
        a.stop()


def test_a_listener_at_a_too_long_resolved_path_is_not_called_dead(tmp_path: Path) -> None:
    """check_socket_path at the resolved path of a socket something listens on (bound through the short link) says
    another daemon listens there, not "a dead socket" (which, proven ours, it would have removed)."""
    import socket

    from moetune.tuner.daemon.errors import DaemonBusy
    from moetune.tuner.daemon.runtime_dir import check_socket_path

    short, long = _long_behind_short(tmp_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(short / "a.sock"))
        listener.listen(1)
        with pytest.raises(DaemonBusy, match="another daemon is listening on"):
            check_socket_path(long / "a.sock")
        assert (long / "a.sock").exists()
    finally:
        listener.close()
