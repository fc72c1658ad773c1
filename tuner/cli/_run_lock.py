"""The lock a measuring run (`moetune profile`, `moetune tune`) holds on its database for as long as it runs.

Two such runs on one database at once both ran every stage: the microbenchmarks were stored twice, each study got
the trials of both runs, and both measured while competing for the same cores and GPUs. An exclusive flock on a
file beside the database (`run_lock_path`; its holder's pid written in it) makes the second refuse at once (exit
1). The kernel drops a flock when its process dies, kill -9 included: no stale lock is left to clear by hand.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

RUN_LOCK_SUFFIX = ".run-lock"

BUSY = "another bring-up is running on this database{pid}; wait for it or stop it"


def run_lock_path(db_path: str | Path) -> Path:
    """The lock file of the database `db_path`: beside the file its links lead to (as `daemon_lock_path`), so two
    paths to one database take one lock."""
    from moetune.tuner.store.store import database_path

    p = Path(os.path.realpath(database_path(db_path)))
    return p.with_name(p.name + RUN_LOCK_SUFFIX)


class RunBusy(RuntimeError):
    """Another process holds the run lock of the database (`pid`: the holder, None when it cannot be told)."""

    exit_code = 1

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        super().__init__(BUSY.format(pid=f" (pid {pid})" if pid is not None else ""))


def take_run_lock(db_path: str | Path) -> int | None:
    """Take the run lock of `db_path` without waiting: its fd (closing it releases the lock), this process's pid
    written in it. RunBusy when another process holds it. None where no lock file can be made (a folder this user
    may not write, a file of another user or a link planted there): the run goes on unguarded, as the store then
    says itself what it cannot write."""
    import fcntl

    from moetune.tuner.cli.db import _lock_holder

    path = run_lock_path(db_path)
    while True:
        try:
            # never through a link (a planted one would have us create or truncate its target); O_NONBLOCK: a FIFO
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = _lock_holder(fd)
            os.close(fd)
            raise RunBusy(pid) from None
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            break
        os.close(fd)  # its holder ended and removed the file between our open and our flock: take the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def refuse_serving_daemon(db_path: str | Path) -> None:
    """Exit 1 when a daemon serves the database `db_path`: it is the single writer of its database (README), and a
    measuring run (`profile`, `tune`) writes facts, measurements and profiles behind its back (the daemon keeps
    serving what it loaded) while measuring on the GPUs its own re-tune jobs measure on. Checked before the database
    is opened: nothing written, no schema upgraded under the daemon."""
    from moetune.tuner.cli.db import abort, serving_daemon

    pid = serving_daemon(db_path)
    if pid is not None:
        abort(f"daemon pid {pid} is serving this database ({db_path}); stop it first (then start it again after this "
              "run), or let it re-tune with `moetune retune`", 1)


def hold_run_lock(db_path: str | Path, ctx: Any) -> None:
    """Take the run lock of `db_path` for the rest of the running command: released when its Typer context `ctx`
    closes (the command returned or failed; a CliRunner test runs the next one in the same process), else when the
    process ends. Exit 1 with the holder's pid when another run holds it."""
    from moetune.tuner.cli.db import abort

    try:
        fd = take_run_lock(db_path)
    except RunBusy as e:
        abort(str(e), e.exit_code)
    if fd is not None:
        ctx.call_on_close(lambda: release_run_lock(db_path, fd))


def release_run_lock(db_path: str | Path, fd: int) -> None:
    """Remove the lock file while it is still the one `fd` holds (a run leaves nothing beside the database), then
    release the lock. A run killed leaves the file (unlocked): the next one takes it."""
    import contextlib

    with contextlib.suppress(OSError):
        st = os.fstat(fd)
        path = run_lock_path(db_path)
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            path.unlink()
    os.close(fd)


def close_orphaned_runs(store: Any) -> None:
    """Under the run lock, once the store is open: the tuning runs a killed run left `running` (its owner gone) are
    marked `interrupted` (`Store.close_orphaned_runs`); a store that cannot be written says so (exit 1 where busy)."""
    from moetune.tuner.cli.db import abort
    from moetune.tuner.store.store import StoreError

    try:
        store.close_orphaned_runs()
    except StoreError as e:
        abort(str(e), e.exit_code)
