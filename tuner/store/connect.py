"""How the store's connections run: busy timeout, WAL, BEGIN IMMEDIATE, read-only opens, retried reads."""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.exc import DatabaseError

from moetune.runtime.profiles import sqlite_open
from moetune.tuner.store import busy_timeout as busy
from moetune.tuner.store._schema import StoreError
from moetune.tuner.store.sqlite_errors import is_locked

_T = TypeVar("_T")
log = logging.getLogger("moetune.store")


def on_connect(readonly: bool) -> Any:
    def connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        # Let SQLAlchemy's begin event emit BEGIN (the driver's implicit transactions are off).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy.BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            _wal(cur)
            cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    return connect


def _wal(cur: sqlite3.Cursor) -> None:
    """Put the database in WAL mode (once per file; later connections find it so). The switch needs the file to itself
    for a moment, and SQLite answers "database is locked" at once, without the busy wait, when another process is
    opening or switching the same new file at that instant: two processes creating one store failed so 4 times in 100
    (tests/test_store_concurrency.py: test_two_processes_open_a_new_store). Retried until BUSY_TIMEOUT_S."""
    deadline = time.monotonic() + busy.BUSY_TIMEOUT_S
    pause = 0.001
    while str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() not in ("wal", "memory"):
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def readonly_connect(path: Path) -> sqlite_open.ReadOnlyConnection:
    """A read-only connection (`moetune.runtime.profiles.sqlite_open`: mode=ro, else immutable=1 while no -wal/-journal
    holds changes; reads through immutable=1 are checked for a change of the file under them)."""
    return sqlite_open.connect_readonly(path, timeout_s=busy.BUSY_TIMEOUT_S)


class DatabaseChangedError(StoreError):
    """A read through immutable=1 overlapped a change of the database file (`sqlite_open.DatabaseChanged`): a
    passing condition (retry), not a wrong database."""

    exit_code = 1


def retried(method: Callable[..., _T]) -> Callable[..., _T]:
    """Runs a read again (from a fresh connection: mode=ro first) when the file changed under an immutable=1 read, up
    to `sqlite_open.READ_ATTEMPTS` times; then the DatabaseChangedError says to retry."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> _T:
        return sqlite_open.retry_changed(lambda: method(*args, **kwargs),
                                         lambda e: isinstance(e, DatabaseChangedError))

    return run


def on_begin(path: Path, give_up: threading.Event | None = None,
             began: Callable[[], None] | None = None) -> Callable[[Any], None]:
    """The begin listener: `BEGIN <moetune_begin>`. A write transaction (IMMEDIATE/EXCLUSIVE) that waits for another
    process's lock says so once, after NOTICE_AFTER_S, on the `moetune.store` log (stderr in a command), then waits on
    to BUSY_TIMEOUT_S in all; past that SQLite's "database is locked" (`sqlite_failure`: StoreBusy). It waits in slices
    of WAIT_SLICE_S: once `give_up` is set (the process stops) a waiting write ends within one slice, and a later one
    does not wait at all (SQLite's "database is locked" at once; the store raises StoreStopping). `began` is called
    once a write transaction holds the lock."""

    def begin(conn: Any) -> None:
        mode = conn.get_execution_options().get("moetune_begin", "DEFERRED")
        if mode == "DEFERRED":
            conn.exec_driver_sql(f"BEGIN {mode}")
            return
        raw = conn.connection.driver_connection
        t0 = time.monotonic()
        noticed = busy.NOTICE_AFTER_S >= busy.BUSY_TIMEOUT_S  # no notice where the wait ends first
        try:
            while True:
                waited = time.monotonic() - t0
                if not noticed and waited >= busy.NOTICE_AFTER_S:
                    log.warning("another process is writing the database %s: waiting for it (up to %g s more)", path,
                                busy.BUSY_TIMEOUT_S - busy.NOTICE_AFTER_S)
                    noticed = True
                stopping = give_up is not None and give_up.is_set()
                until = busy.BUSY_TIMEOUT_S if noticed else busy.NOTICE_AFTER_S
                wait = 0.0 if stopping else max(0.0, min(busy.WAIT_SLICE_S, until - waited))
                raw.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")
                try:
                    conn.exec_driver_sql(f"BEGIN {mode}")
                    if began is not None:
                        began()
                    return
                except DatabaseError as e:
                    if not is_locked(e.orig) or stopping or time.monotonic() - t0 >= busy.BUSY_TIMEOUT_S:
                        raise
        finally:
            raw.execute(f"PRAGMA busy_timeout = {int(busy.BUSY_TIMEOUT_S * 1000)}")

    return begin
