"""`moetune serve` ends with the statuses the top-level help documents for every command: 130 after Ctrl-C
(SIGINT), 143 after SIGTERM (it exited 0 on both). The systemd unit counts both as success, so `systemctl stop`
(SIGTERM) leaves no failed unit and Restart=on-failure does not restart it."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import EXIT_STATUS_HELP

pytestmark = pytest.mark.timeout(90)
UNIT = Path(__file__).resolve().parent.parent / "tuner" / "daemon" / "deploy" / "moetune.service"


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_serve_ends_with_the_documented_status(tmp_path: Path, sig: int, status: int) -> None:
    F.make_capture(tmp_path / "capture")
    d = F.DaemonProc(tmp_path)
    try:
        d.wait_ready()
        d.proc.send_signal(sig)
        assert d.proc.wait(20) == status, d.read_log()[-2000:]
    finally:
        d.kill(9)
    assert not (d.run_dir / "daemon.sock").exists()  # a clean stop all the same
    assert "130 / 143: ended by Ctrl-C / SIGTERM" in EXIT_STATUS_HELP


def test_the_systemd_unit_takes_a_signalled_stop_for_success() -> None:
    lines = [x.strip() for x in UNIT.read_text().splitlines() if not x.lstrip().startswith("#")]
    ok = [x for x in lines if x.startswith("SuccessExitStatus=")]
    assert ok and {"130", "143"} <= set(ok[0].split("=", 1)[1].split())
    assert "Restart=on-failure" in lines


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_daemon_leaves_its_database_whole(tmp_path: Path, sig: int) -> None:
    """The daemon closes its store when it stops: SQLite checkpoints the WAL into the file and removes -wal and -shm.
    Left open, they stayed beside the database, and a copy of moetune.db alone (a backup, another node) lacked what
    the WAL still held."""
    F.make_capture(tmp_path / "capture")
    d = F.DaemonProc(tmp_path)
    try:
        d.wait_ready()
        assert (tmp_path / "moetune.db-wal").exists()  # written while it serves (fingerprint, discovery)
        d.proc.send_signal(sig)
        d.proc.wait(20)
    finally:
        d.kill(9)
    left = sorted(p.name for p in tmp_path.glob("moetune.db-*"))
    assert left == [], (left, d.read_log()[-2000:])
