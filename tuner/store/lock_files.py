"""Lock files a process holds (an exclusive flock, its pid written in them) for as long as it runs: a daemon's database
lock and socket lock (tuner/daemon/locks.py), and the run lock of a measuring run on a database (`moetune profile`,
`moetune tune --backend local`, and the daemon that re-tunes it).

The kernel drops a flock when its holder dies (kill -9 included): a lock whose owner is gone never blocks, and there
is no stale lock to clear by hand. A lock file is opened only as a regular file of this user, never through a link (a
planted one would have us create, lock or truncate its target). A holder that removes its file when it ends
(`release_lock_file`) removes only the file it still holds; a taker checks that the file it locked is still the one at
the path (its holder may have removed it between our open and our flock) and else takes the new one.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

RUN_LOCK_SUFFIX = ".run-lock"

BUSY = "another bring-up is running on this database{pid}; wait for it or stop it"


class LockFileUnusable(OSError):
    """The lock file cannot be used: it cannot be opened (`why`: the reason, "it is a symbolic link" for one), or
    (`foreign`) it is not a regular file of this user."""

    def __init__(self, path: Path, why: str, *, foreign: bool = False, code: int | None = None) -> None:
        self.path = path
        self.why = why
        self.foreign = foreign
        self.code = code  # the open's errno, when that failed
        super().__init__(f"{path}: {why}")


class LockHeld(RuntimeError):
    """Another process (or another open file of this one) holds the lock; `pid` its holder, None when it cannot be
    told (none written yet, or its writer is gone: a holder that inherited the lock)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        super().__init__(f"{path} is locked" + (f" by pid {pid}" if pid is not None else ""))


def lock_holder(fd: int) -> int | None:
    """The pid written in the lock file `fd`, while that process lives (None: none written yet, or it is gone)."""
    from moetune.runtime._proc import pid_gone

    try:
        pid = int(os.pread(fd, 32, 0).split()[0])
    except (ValueError, IndexError, OSError):
        return None
    if pid <= 0 or pid_gone(pid):  # a zombie is gone too (its fds, its flock with them, are closed)
        return None
    return pid


def _open_own(path: Path) -> tuple[int, os.stat_result]:
    """(fd, its stat) of `path` opened read-write, created 0600 if absent; LockFileUnusable unless a regular file of
    this user. O_NONBLOCK: a FIFO put there must not hang the open."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise LockFileUnusable(path, "it is a symbolic link" if os.path.islink(path) else (e.strerror or str(e)),
                               code=e.errno) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise LockFileUnusable(path, f"not a regular file of this user (uid {os.getuid()})", foreign=True)
    return fd, st


def take_lock_file(path: Path) -> int:
    """Take the lock file `path` without waiting, this process's pid written in it: its fd (closing it releases the
    lock). LockHeld when another holds it; LockFileUnusable when it cannot be used (see `_open_own`)."""
    import fcntl

    while True:
        fd, st = _open_own(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = lock_holder(fd)
            os.close(fd)
            raise LockHeld(path, pid) from None
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            break
        os.close(fd)  # its holder ended and removed the file between our open and our flock: take the new one
    try:  # the pid only names the holder in a refusal (`lock_holder`): the flock is the lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        # a full disk (ENOSPC; the empty file needed only an inode): the lock is held all the same, its holder named
        # nowhere. Raised, it ended the start of a daemon (or a run) that needs no room for it, with its fd (the lock)
        # left open; a daemon's service restarted it every few seconds, to fail the same way
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # no half-written pid (a pid of another process would be named as the holder)
    return fd


def release_lock_file(path: Path, fd: int) -> None:
    """Remove the lock file `path` while it is still the one `fd` holds (never one put in its place since), then
    release the lock. A holder killed leaves the file (unlocked): the next taker takes it.

    The check and the unlink are two steps (no call unlinks "this inode"): whoever swaps another file in between has
    that entry removed. Only someone who may write the folder can swap it, and they may remove or rename any entry of
    it themselves (where they may not, as in a sticky folder, they cannot swap it either); unlink never follows a link
    and changes no file's content. So the race gives nobody anything they could not do already; what it cannot keep
    is the lock's exclusion against users who may write the database's folder, which no lock file can."""
    with contextlib.suppress(OSError):
        st = os.fstat(fd)
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            path.unlink()
    os.close(fd)


# -- the run lock: one measuring run per database ---------------------------------------------------------------
def run_lock_path(db_path: str | Path) -> Path:
    """The run lock of the database `db_path`: beside the file its links lead to (as `daemon_lock_path`), so two
    paths to one database take one lock."""
    from moetune.tuner.store.db_file import database_path

    p = Path(os.path.realpath(database_path(db_path)))
    return p.with_name(p.name + RUN_LOCK_SUFFIX)


class RunBusy(RuntimeError):
    """Another process holds the run lock of the database (`pid`: the holder, None when it cannot be told)."""

    exit_code = 1

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        super().__init__(BUSY.format(pid=f" (pid {pid})" if pid is not None else ""))


def take_run_lock(db_path: str | Path) -> int | None:
    """Take the run lock of `db_path` without waiting: its fd (`release_run_lock` releases it), this process's pid
    written in it. RunBusy when another process holds it. None where no lock file can be made (a folder this user
    may not write, a file of another user or a link planted there): the run goes on unguarded, as the store then
    says itself what it cannot write.

    The database's folder is made first where it is moetune's own data folder (as the store would make it, same
    rule and mode): a first run on the default database took no lock there (no folder), then the store made it.
    StoreError, as the store's own, where the folder is missing and not moetune's (the store refuses it anyway), or
    where the path goes through another user's link in a sticky folder (`db_file.refuse_foreign_link`)."""
    from moetune.tuner.store._folders import make_parent
    from moetune.tuner.store._schema import StoreError
    from moetune.tuner.store.db_file import database_path, refuse_foreign_link

    refuse_foreign_link(db_path)  # the lock is made where the links lead: not where another user's link points
    make_parent(database_path(db_path), StoreError)
    try:
        return take_lock_file(run_lock_path(db_path))
    except LockFileUnusable:
        return None
    except LockHeld as e:
        raise RunBusy(e.pid) from None


def release_run_lock(db_path: str | Path, fd: int) -> None:
    """Release the run lock `take_run_lock` gave, its file removed (a run leaves nothing beside the database)."""
    release_lock_file(run_lock_path(db_path), fd)
