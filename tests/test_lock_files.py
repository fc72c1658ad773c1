"""The pid-owned lock files (tuner/store/lock_files.py) that the run lock, the daemon's database lock and its socket
lock share: one flock per holder, its pid inside, dropped by the kernel when the holder dies; never through a link;
a holder removes only the file it still holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.tuner.store.lock_files import LockFileUnusable, LockHeld, release_lock_file, take_lock_file

HOLD = """
import sys, time
from pathlib import Path
from moetune.tuner.store.lock_files import take_lock_file
take_lock_file(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def _holder(path: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_a_held_lock_names_its_holder_and_a_killed_holder_blocks_nothing(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    holder = _holder(lock)
    try:
        with pytest.raises(LockHeld) as e:
            take_lock_file(lock)
        assert e.value.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    fd = take_lock_file(lock)  # the kernel dropped the dead holder's flock: taken, our pid written
    try:
        assert lock.read_text() == f"{os.getpid()}\n"
        assert lock.stat().st_mode & 0o777 == 0o600
    finally:
        release_lock_file(lock, fd)
    assert not lock.exists()


def test_release_removes_only_the_file_it_holds(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    fd = take_lock_file(lock)
    lock.unlink()
    lock.write_text("someone else's\n")  # put in its place since
    release_lock_file(lock, fd)
    assert lock.read_text() == "someone else's\n"


def test_a_link_or_a_folder_is_never_used(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep\n")
    link = tmp_path / "x.lock"
    link.symlink_to(target)
    with pytest.raises(LockFileUnusable) as e:
        take_lock_file(link)
    assert e.value.why == "it is a symbolic link" and not e.value.foreign
    assert target.read_text() == "keep\n"
    folder = tmp_path / "d.lock"
    folder.mkdir()
    with pytest.raises(LockFileUnusable):
        take_lock_file(folder)


def test_a_full_disk_that_takes_no_pid_still_gives_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pid only names the holder: a write of it that fails (ENOSPC on a full disk, where the empty file took only
    an inode) leaves the lock taken, not an OSError out of the daemon's start with the lock's fd left open."""
    import errno

    lock = tmp_path / "x.lock"
    real = os.pwrite

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    fd = take_lock_file(lock)
    monkeypatch.setattr(os, "pwrite", real)
    try:
        with pytest.raises(LockHeld) as e:  # held: a second taker is refused, no holder named
            take_lock_file(lock)
        assert e.value.pid is None and lock.read_bytes() == b""
    finally:
        release_lock_file(lock, fd)
    os.close(take_lock_file(lock))  # released: free again
