"""What a SQLite failure on the database means (locked, disk full, not writable, damaged), as a StoreError."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from moetune.tuner.store import busy_timeout as busy
from moetune.tuner.store._folders import not_writable
from moetune.tuner.store._schema import (
    StoreBusy,
    StoreDamaged,
    StoreError,
    StoreFull,
    StoreNotDatabase,
    StoreNotWritable,
    db_option,
)


def is_locked(e: BaseException) -> bool:
    """SQLite's answer when another connection held the lock past the busy timeout (SQLITE_BUSY)."""
    return "database is locked" in str(e)


# SQLite's answers when it cannot write the file or create it (or its -wal/-shm/-journal) in its folder
SQLITE_CANNOT_WRITE = ("readonly database", "unable to open database file")

# SQLite's primary result codes (the low byte of an extended code) of a disk that took no more: SQLITE_FULL ("database
# or disk is full"), and SQLITE_IOERR ("disk I/O error"), SQLite's usual answer on a full disk, where the -wal or -shm
# cannot grow (SQLITE_IOERR_SHMSIZE, _WRITE, _FSYNC, ...) before the database file itself is written


def sqlite_code(e: BaseException) -> int | None:
    """SQLite's primary result code of `e` (sqlite3 errors carry the extended one in `sqlite_errorcode`; SQLAlchemy's
    wrap them in `.orig`), else None."""
    for x in (e, getattr(e, "orig", None)):
        code = getattr(x, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF
    return None


def disk_failed(e: BaseException) -> str | None:
    """"full" when SQLite said the disk took no more (SQLITE_FULL), "io" for its I/O error (SQLITE_IOERR: on a full
    disk, the -wal/-shm that could not grow), None for any other failure. By the code, else by the words (an error
    made by hand has no code)."""
    why = str(getattr(e, "orig", None) or e)
    code = sqlite_code(e)
    if code == sqlite3.SQLITE_FULL or (code is None and "database or disk is full" in why):
        return "full"
    if code == sqlite3.SQLITE_IOERR or (code is None and "disk I/O error" in why):
        return "io"
    return None


def disk_failed_message(path: Path | str, why: str, kind: str) -> str:
    """The words of a database (or studies file) whose disk took no more: SQLite's, then the folder and what to do."""
    folder = Path(os.path.abspath(path)).parent
    if kind == "full":
        return f"{path}: {why}: the disk holding {folder} is full; free space there, then run the command again"
    return (f"{path}: {why}: the disk holding {folder} is full or failed; free space there (or check the disk), then "
            "run the command again")


def sqlite_failure(path: Path, e: BaseException, *, write: bool) -> StoreError:
    """The StoreError for a SQLite failure on the database at `path`: `StoreBusy` when another process held its lock
    past the busy timeout (the file is fine: retry); a StoreError naming the permission when this user may not read
    the file (SQLite said "unable to open database file"; exit 2 whether the command reads or writes it);
    `StoreNotWritable` when, for a write, this user may not write the file or its folder; `StoreFull` when the disk
    took no more or failed (`disk_failed`: SQLITE_FULL, or SQLITE_IOERR, what a full disk usually gives first);
    else SQLite's message with the path."""
    why = str(e)
    if is_locked(e):
        return StoreBusy(f"another process held the database {path} for {busy.BUSY_TIMEOUT_S:g} s (it is locked for "
                         "writing, not damaged); retry when that process is done")
    if os.path.isfile(path) and not os.access(path, os.R_OK):  # os.path: never raises (Path.is_file may)
        return StoreError(f"{path}: cannot read it (permission denied)")
    disk = disk_failed(e)
    if disk == "io" and write:  # an I/O error where this user may not write a side file: the permission says why
        reason = not_writable(path, side_files=True)
        if reason:
            return StoreNotWritable(reason)
    if disk is not None:
        return StoreFull(disk_failed_message(path, why, disk))
    if write and any(m in why for m in SQLITE_CANNOT_WRITE):
        reason = not_writable(path, side_files=True)
        if reason:
            return StoreNotWritable(reason)
    if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_CORRUPT or "malformed" in why:
        return StoreDamaged(damaged_message(path, why))
    if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB or "file is not a database" in why:
        return StoreNotDatabase(f"{path}: {why}")  # the same words and exit; `db check` tells it from the rest
    return StoreError(f"{path}: {why}")


def damaged_message(path: Path, problem: str) -> str:
    return (f"{path} is damaged ({problem}): not written to; `moetune db check{db_option(path)}` names the problem; "
            "restore the file from a backup (or recover its rows with `sqlite3 FILE .recover`) before using it")
