"""A real small filesystem for full-disk tests: a 1 MiB tmpfs mounted on a folder of the test's, filled to a few KiB.

A full disk hand-made in a test (an OSError(ENOSPC), SQLite's "database or disk is full" words) missed what SQLite
actually answers: where its -wal or -shm cannot grow it says "disk I/O error" (SQLITE_IOERR_SHMSIZE and others) before
"database or disk is full". Mounting needs root (or CAP_SYS_ADMIN) and a system that allows it: the test is skipped
with the reason where it cannot mount."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

SIZE_KIB = 1024


@contextlib.contextmanager
def small_disk(where: Path, size_kib: int = SIZE_KIB) -> Iterator[Path]:
    """`where` (made) with a tmpfs of `size_kib` mounted on it, unmounted (and the folder removed) after."""
    if os.geteuid() != 0 or shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0755", "tmpfs", str(where)],
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        where.rmdir()
        pytest.skip(f"mounting a small tmpfs is not permitted here: {p.stderr.strip() or p.returncode}")
    try:
        yield where
    finally:
        gc.collect()  # a connection the command left to the garbage collector (an Optuna storage's pool) closes
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], check=True, capture_output=True, timeout=30)
        where.rmdir()


def fill(where: Path, left_kib: int) -> None:
    """Fill the filesystem at `where` until a write fails for want of room, then give back `left_kib` KiB."""
    path = where / "fill"
    block = b"\0" * 4096
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    size = path.stat().st_size
    os.truncate(path, max(0, size - left_kib * 1024))


def empty(where: Path) -> None:
    """Remove everything in `where` (the filesystem's own folder kept)."""
    for p in where.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
