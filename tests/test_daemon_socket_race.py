"""Two daemons starting at once on one socket path (different databases): checking the path and binding it is no
atomic step, and libzmq unlinks an IPC path before binding, so without a lock the second would remove the first's
live socket. The socket's lock (taken before the check, held while serving) makes the one that comes second refuse
(exit 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.tuner.daemon.locks import LOCK_SUFFIX
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(90)


def test_a_daemon_starting_while_another_binds_the_same_socket_refuses(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"ipc://{tmp_path}/run/d.sock"
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    F.make_capture(other_dir / "capture")
    other: list[F.DaemonProc] = []
    real = Daemon._secure

    def between_check_and_bind(self: Daemon, s: Any, ep: str) -> None:
        if ep == endpoint and not other:  # this daemon has checked the path: another starts now, same socket
            other.append(F.DaemonProc(other_dir, endpoint=endpoint, interval=0))
            try:
                other[0].proc.wait(15)
            except subprocess.TimeoutExpired:
                pass  # it bound and serves (the race lost): the assertions below say so
        real(self, s, ep)

    monkeypatch.setattr(Daemon, "_secure", between_check_and_bind)
    facts = F.FakeFacts({"gpu_model": "H200"})
    try:
        d = Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint=endpoint, discover=lambda: facts,
                   rediscover_interval_s=0, db_path=str(tmp_path / "moetune.db")).start(background=True)
    except BaseException:
        for o in other:  # never left running (before the fix it bound first, and this start failed)
            o.kill()
        raise
    try:
        assert other[0].proc.poll() == 1, other[0].read_log()[-2000:]
        assert "is locked" in other[0].read_log()
        c = ProfileClient(endpoint, timeout_ms=2000)
        try:
            assert c.status().db == str(tmp_path / "moetune.db")  # the socket is this daemon's, and it answers
        finally:
            c.close()
    finally:
        other[0].kill()
        d.stop()
    assert not (tmp_path / "run" / "d.sock").exists()
    assert not (tmp_path / "run" / f".d.sock{LOCK_SUFFIX}").exists()  # its own lock file: removed at exit
