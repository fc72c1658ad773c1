"""Atomic file replacement for the bring-up's own files (its state file, `report.md`).

A crash or a full disk mid-write must leave the previous file whole: the bytes go to a new temporary file in the
same directory (so the rename stays on one filesystem), are fsynced, then `os.replace`d over the target.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` (str: UTF-8) atomically; an existing file keeps its permissions."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    old_mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else None
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    # 0o666 less the umask, like any new file; O_EXCL: never write into a file we did not create
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if old_mode is not None:
                os.fchmod(f.fileno(), old_mode)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the file
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C included: remove our temporary file, the old file stays as it was
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # the rename itself survives a power loss once the directory is synced (not every filesystem allows it)
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
