"""The daemon's exclusive locks: one beside its database, the database's run lock, and one beside each socket path.

Each is a flock-ed file with this process's pid in it (`moetune.tuner.store.lock_files`): the kernel drops the flock
when its holder dies, even on kill -9, so a lock is never left stale. Here they are taken as the daemon says its
refusals: DaemonConfigError for a lock file that cannot be used, DaemonBusy for one another process holds.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from moetune.tuner.daemon.errors import DaemonBusy, DaemonConfigError
from moetune.tuner.store.lock_files import (
    LockFileUnusable,
    LockHeld,
    RunBusy,
    release_lock_file,
    take_lock_file,
    take_run_lock,
)

LOCK_SUFFIX = ".moetune-lock"  # ".<socket name>.moetune-lock": flock-ed by the daemon that checks, binds and serves it


def holder_words(pid: int | None) -> str:
    """How a refusal names a lock's holder: "pid N", or "its pid unknown" where none is written (or its writer is
    gone). One wording for every lock the daemon takes."""
    return f"pid {pid}" if pid is not None else "its pid unknown"


def _take_lock(path: Path, what: str, busy: Callable[[str], str], unwritable: str = "") -> int:
    """`lock_files.take_lock_file` of `path` (this process's pid written in it), its refusals as the daemon says them:
    DaemonConfigError naming `what` when the file cannot be used (`unwritable` added where its folder may not be
    written), DaemonBusy(`busy(holder)`) when another process holds it, `holder` naming it ("pid N", or "its pid
    unknown" where none is written): the operator is told which process to stop."""
    try:
        return take_lock_file(path)
    except LockFileUnusable as e:
        if e.foreign:
            raise DaemonConfigError(f"{what} {path} is {e.why}: refusing to use it") from None
        hint = f": {unwritable}" if unwritable and e.code in (errno.EROFS, errno.EACCES, errno.EPERM) else ""
        raise DaemonConfigError(f"cannot open {what} {path}: {e.why}{hint}") from None
    except LockHeld as e:
        holder = holder_words(e.pid)
        raise DaemonBusy(busy(holder), holder=holder) from None


def lock_database(db_path: str | Path) -> int:
    """The fd of the daemon's flock beside the database `db_path`, this process's pid written in it (`db migrate`
    names the daemon it finds holding it); DaemonBusy when another daemon (or a migration) holds it."""
    from moetune.tuner.store._schema import StoreError
    from moetune.tuner.store.db_file import daemon_lock_path, refuse_foreign_link

    try:  # taken before the store opens: the lock is made where the links lead, not where another user's link points
        refuse_foreign_link(db_path)
    except StoreError as e:
        raise DaemonConfigError(str(e)) from None
    path = daemon_lock_path(db_path)
    return _take_lock(path, "the database lock",
                      lambda holder: f"another moetune daemon is using the database {db_path} ({path} is locked by "
                      f"{holder}; or a `moetune db upgrade/downgrade`, `profiles import` or `profiles delete` of it is "
                      "running): stop it first, or serve another database (--db, [store] db)",
                      # an operator's read-only mount or a folder left out of the unit's ReadWritePaths: what to do
                      unwritable=f"the daemon writes its database and this lock beside it, so {path.parent} must be "
                      f"writable by its user (uid {os.geteuid()}); serve a database in such a folder (--db, "
                      "[store] db) or make this one writable")


def lock_runs(db_path: str | Path) -> int | None:
    """Take the run lock of the database `db_path` for this daemon's lifetime (the fd; None where no lock file can be
    made, as for a bring-up): its re-tune jobs measure on the node's GPUs and write profiles as a bring-up does. A
    bring-up started after the daemon refuses its database (`refuse_serving_daemon`, then this lock); one started
    before holds the lock: DaemonBusy, naming it, and nothing is opened or re-tuned beside it. Never waited for (no
    deadlock with a run that holds it and waits for nothing); the kernel drops it when its holder dies."""
    try:
        return take_run_lock(db_path)
    except RunBusy as e:
        holder = holder_words(e.pid)
        raise DaemonBusy(f"a bring-up is running on the database {db_path} ({holder}: `moetune profile` or `moetune tune "
                         "--backend local`); start the daemon once it has ended (or stop it): the daemon's re-tunes "
                         "would measure and write beside it", holder=holder) from None


def lock_socket_path(p: Path, setting: str = "--socket (daemon.socket)") -> int:
    """Take the lock beside the socket path `p` for this daemon's lifetime (the fd; the kernel drops the flock when
    the process dies, even on kill -9). Checking the path and binding it is no atomic step, and libzmq unlinks an
    IPC path before binding it: two daemons starting at once on one path (with different databases) would both
    pass the check and the second would remove the first's live socket. Taken before the check, held while serving:
    DaemonBusy when another daemon holds it; `setting`: the option that names `p`, said as the other way out."""
    lock = p.with_name(f".{p.name}{LOCK_SUFFIX}")
    return _take_lock(lock, "the socket lock",
                      lambda holder: f"another daemon is listening on {p} (or starting on it: {lock} is locked by "
                      f"{holder}): stop it first, or give this one another {setting}")


def release_socket_lock(p: Path, fd: int) -> None:
    """Remove the lock file while it is still the one `fd` holds (ours), then release the lock."""
    release_lock_file(p.with_name(f".{p.name}{LOCK_SUFFIX}"), fd)
