"""Opening a moetune SQLite file read-only: the ONE opener of the store's read-only connections
(`moetune.tuner.store`), the runtime's "daemon down" fallback (`db_lookup.db_read`) and `tune show`'s studies file.

`immutable=1` (the database file alone, without locks, creating nothing) for a WAL file while no -wal, -shm or
-journal is beside it: nothing has it open, and mode=ro would leave an empty -wal and -shm behind in a writable
folder (beside another program's WAL file moetune only looked at, too). Otherwise `mode=ro`; SQLite cannot open a WAL database
mode=ro when its -shm/-wal files are gone and the folder is not writable (/var/lib/moetune owned by the daemon's
user, the daemon down); then `immutable=1` again. That is right only while no process writes the file and no
-wal/-journal holds changes the file lacks (immutable=1 would not see a crashed writer's committed WAL frames), so:

- the fallback is refused (an error naming the file) while a non-empty -wal/-journal is there;
- every read through it is checked: the file's (inode, size, mtime_ns) and the absence of a non-empty -wal/-journal,
  taken before the connection is opened, must hold after the read (`ReadOnlyConnection.check_unchanged`). A change
  is `DatabaseChanged` ("changed while being read; retry"), never "malformed": a file being written is not damaged.
  `read` retries a few times, each time from mode=ro (a writer that appeared has made the -shm mode=ro needs).
  One exception: `tune show`'s reads through Optuna (`storage.open_readonly_storage`) are checked only when SQLite
  reports an error (a torn page is then DatabaseChanged, not "malformed"); what they show is for display only.

No SQLAlchemy, no moetune.tuner here: the runtime may not import them.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

READ_ATTEMPTS = 4  # reads of a file that keeps changing under immutable=1 before DatabaseChanged is raised

# SQLite's answers when a read-only connection cannot set up a WAL database's shared memory because the -shm/-wal
# files are gone and the directory is not writable: "unable to open" (SQLITE_CANTOPEN, also SQLite < 3.22) and, from
# SQLite 3.22, "attempt to write a readonly database" (SQLITE_READONLY_DIRECTORY). The other READONLY codes
# (ROLLBACK: a hot journal; RECOVERY/CANTINIT: a WAL to recover) say the file alone is not the database.
NO_SHM_ERRORS = frozenset({"SQLITE_CANTOPEN", "SQLITE_READONLY_DIRECTORY"})


class DatabaseChanged(sqlite3.OperationalError):
    """A read through immutable=1 overlapped a change of the file: what it read may be stale or torn."""


def pending_changes(path: Path) -> Path | None:
    """The -wal or -journal file beside `path` that holds changes not (or not wholly) in the database file itself,
    if any: a writer is active or died. A 0-byte one (a read-only connection in a writable directory leaves an
    empty -wal) holds nothing."""
    for suffix in ("-wal", "-journal"):
        side = path.with_name(path.name + suffix)
        with contextlib.suppress(OSError):
            if side.stat().st_size > 0:
                return side
    return None


def file_identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime_ns) of the database file (None: gone), and None too while a -wal/-journal holds changes."""
    try:
        st = path.stat()
    except OSError:
        return None
    if pending_changes(path) is not None:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class ReadOnlyConnection(sqlite3.Connection):
    """A sqlite3 connection that knows how it was opened: `immutable` (the fallback) and, then, the file's
    identity taken before it was opened."""

    path: Path
    immutable: bool = False
    identity: tuple[int, int, int] | None = None

    def check_unchanged(self) -> None:
        """DatabaseChanged when this is an immutable=1 connection and its file changed since it was opened (or a
        -wal/-journal with changes appeared): what was read may be stale or torn. A mode=ro connection: nothing
        to check (SQLite's locks keep its reads consistent)."""
        if self.immutable and (self.identity is None or file_identity(self.path) != self.identity):
            raise DatabaseChanged(
                f"{self.path}: the database changed while being read (a process was writing it); retry"
            )


def readonly_uri(path: Path) -> str:
    """The SQLite URI that opens `path` read-only (mode=ro; append `&PARAM=...` for more)."""
    # the name's bytes, percent-encoded: a name that is not UTF-8 (argv's bytes as Python decodes them) made quote()
    # raise UnicodeEncodeError; SQLite decodes %XX to the very bytes the file system has
    return f"file:{urllib.parse.quote(os.fsencode(path.absolute()))}?mode=ro"


def _open_ro(uri: str, timeout_s: float) -> ReadOnlyConnection:
    """mode=ro, checked by reading the schema (SQLite opens lazily: the -shm problem shows on the first read)."""
    con = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False, factory=ReadOnlyConnection)
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except BaseException:
        con.close()
        raise
    return con


def _side_files(path: Path) -> bool:
    """Whether a -wal, -shm or -journal file is beside `path` (a connection is open, or one left its state)."""
    return any(path.with_name(path.name + suffix).exists() for suffix in ("-wal", "-shm", "-journal"))


def _is_wal(path: Path) -> bool:
    """Whether `path` is a WAL-mode SQLite file (its header says so): only there does mode=ro leave files behind. A
    rollback-journal file is read mode=ro, under SQLite's locks: a writer between two transactions has no -journal,
    and an unlocked read beside its next one read torn pages ("malformed").

    Asked of SQLite, never read off the header through a file of our own: closing any descriptor of a file drops
    every POSIX lock this process holds on it, SQLite's included (a rollback-journal file has no side file while its
    connections only read, so a read of this process lost its SHARED lock to this check). A nolock=1 connection
    takes no lock and cannot set up a WAL file's wal-index: its first read of a WAL file is SQLITE_CANTOPEN, before
    any -wal or -shm is made; any other file reads (or is SQLite's other error). SQLite keeps its descriptor of the
    file open while this process holds locks on it."""
    try:
        con = sqlite3.connect(readonly_uri(path) + "&nolock=1", uri=True, check_same_thread=False)
    except sqlite3.Error:  # cannot be opened (gone, unreadable): as when the header could not be read
        return False
    try:
        con.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as e:
        return getattr(e, "sqlite_errorname", None) == "SQLITE_CANTOPEN" and path.is_file()
    finally:
        con.close()
    return False


def _immutable(uri: str, path: Path, identity: tuple[int, int, int]) -> ReadOnlyConnection:
    con = sqlite3.connect(uri + "&immutable=1", uri=True, check_same_thread=False, factory=ReadOnlyConnection)
    con.immutable = True
    con.identity = identity
    con.path = path
    return con


def connect_readonly(path: str | Path, *, timeout_s: float) -> ReadOnlyConnection:
    """A read-only connection to `path`: immutable=1 while no -wal, -shm or -journal is beside it (nothing open
    on it: mode=ro would leave an empty -wal and -shm behind in a writable folder, beside another program's file
    too), else mode=ro, else (no -shm can be made) immutable=1 when no -wal/-journal holds changes. Reads through
    an immutable one must be followed by `check_unchanged` (`checked`, `read` do so): a writer that starts
    meanwhile makes the read DatabaseChanged, and the retry finds its -wal and reads mode=ro.
    sqlite3.OperationalError naming the -wal/-journal when the fallback is refused."""
    path = Path(path).absolute()
    uri = readonly_uri(path)
    if path.is_file() and not _side_files(path) and _is_wal(path):
        identity = file_identity(path)  # before the connection reads a byte
        if identity is not None and not _side_files(path):
            return _immutable(uri, path, identity)
    try:
        con = _open_ro(uri, timeout_s)
    except sqlite3.OperationalError as e:
        if getattr(e, "sqlite_errorname", None) not in NO_SHM_ERRORS:
            raise
        pending = pending_changes(path)
        if pending is not None:
            raise sqlite3.OperationalError(
                f"{e}: cannot read {path} read-only, {pending} holds changes that only a process allowed to write "
                f"in {path.parent} can apply (start the daemon, or open it once as the user who owns it)"
            ) from None
        identity = file_identity(path)  # before the connection reads a byte
        if identity is None and not path.exists():
            raise  # no file (gone meanwhile): SQLite's own "unable to open", not "changed while being read"
        return _immutable(uri, path, identity)  # type: ignore[arg-type]  # None: check_unchanged always refuses
    con.path = path
    return con


@contextlib.contextmanager
def checked(con: ReadOnlyConnection) -> Iterator[None]:
    """Around reads on `con`: DatabaseChanged when its file changed meanwhile (`check_unchanged`), also in place of
    an error those reads raised (a page torn by a writer reads as "database disk image is malformed")."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        if not isinstance(e, DatabaseChanged):
            con.check_unchanged()  # raises DatabaseChanged from inside the handler: the SQLite error is its context
        raise
    con.check_unchanged()


def retry_pause(attempt: int) -> None:
    time.sleep(min(0.002 * 2**attempt, 0.05))


def retry_changed(fn: Callable[[], T], changed: Callable[[BaseException], bool], *,
                  attempts: int | None = None) -> T:
    """fn() run again while `changed(error)` says the file changed under the read, up to `attempts` times
    (READ_ATTEMPTS as it is at the call), with a short growing pause between; then that error. Any other error is
    raised at once."""
    attempts = READ_ATTEMPTS if attempts is None else attempts
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if attempt == attempts - 1 or not changed(e):
                raise
        retry_pause(attempt)
    raise AssertionError("unreachable")


def read(path: str | Path, fn: Callable[[ReadOnlyConnection], T], *, timeout_s: float,
         attempts: int = READ_ATTEMPTS) -> T:
    """fn(connection) on a fresh read-only connection (`connect_readonly`), closed after. A read through immutable=1
    that overlapped a change is run again from mode=ro, up to `attempts` times; then DatabaseChanged. fn must read
    everything it needs (fetchall), not return a cursor."""

    def once() -> T:
        con = connect_readonly(path, timeout_s=timeout_s)
        try:
            with checked(con):
                return fn(con)
        finally:
            con.close()

    return retry_changed(once, lambda e: isinstance(e, DatabaseChanged), attempts=attempts)
