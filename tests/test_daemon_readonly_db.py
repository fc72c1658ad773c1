"""An operator's database folder the daemon may not write (a read-only mount, a folder of another user, a unit whose
ReadWritePaths leaves it out): `moetune serve` said "cannot open the database lock ...: Read-only file system",
what was wrong but not what to do. It now says the daemon writes there and how to give it a folder it may write."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.locks import lock_database
from moetune.tuner.store import lock_files


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_a_database_folder_the_daemon_may_not_write_says_what_to_do(tmp_path: Path, code: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "moetune.db"
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):  # root writes past a mode: the kernel's refusal, as a non-root user gets
        if str(path).endswith(".daemon-lock"):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(lock_files.os, "open", refusing_open)
    with pytest.raises(DaemonConfigError) as e:
        lock_database(db)
    msg = str(e.value)
    assert os.strerror(code) in msg and str(tmp_path) in msg, msg  # what is wrong, where
    assert "--db" in msg and "[store] db" in msg, msg  # and what to do
    assert not list(tmp_path.iterdir())  # nothing made


@pytest.mark.parametrize("exists", [False, True])
def test_a_read_only_mount_is_not_called_permission_denied(tmp_path: Path, exists: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A database folder on a read-only mount was said as "permission denied": an operator chmods it, and nothing
    changes. The kernel's answer (EROFS) is what `os.access` hides; the mount's flag says it."""
    import types

    from moetune.tuner.store import _folders

    db = tmp_path / "moetune.db"
    if exists:
        db.write_bytes(b"")
    real_statvfs = os.statvfs
    monkeypatch.setattr(_folders.os, "access", lambda *a, **kw: False)  # what a read-only mount answers (root too)
    monkeypatch.setattr(_folders.os, "statvfs", lambda p: types.SimpleNamespace(
        **{k: getattr(real_statvfs(p), k) for k in ("f_bsize", "f_bavail")}, f_flag=os.ST_RDONLY))
    why = _folders.not_writable(db)
    assert "read-only file system" in why and "permission denied" not in why, why
