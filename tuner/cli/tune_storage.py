"""The study storage and profile database `moetune tune` and `tune show` open: their checks and error messages."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Literal, NoReturn

from moetune.tuner.cli.db import abort

# --storage "": refused by its parser (it was taken for the default studies file: `if storage:`)
STORAGE_EMPTY = ("an empty URL names no storage (leave the option out for the default studies file NAME-studies.db "
                 "beside the profile database NAME.db)")


_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup


def redacted(url: str) -> str:
    from moetune.tuner.search.storage import redact_url

    return redact_url(url)  # the one redaction: a server URL's password stays off the terminal


# another process holds or is creating the studies file: the file is fine, a re-run works (never "move it aside")
BUSY_MARKERS = ("database is locked", "database table is locked", "already exists", "UNIQUE constraint failed")


Problem = tuple[Literal["busy", "denied", "full", ""], str]  # storage_problem's answer


def storage_failed(url: str, given: bool, e: BaseException, problem: Problem | None = None, *,
                   storage_option: bool = True) -> NoReturn:
    """Exit with `_storage_error`'s message: 1 where nothing is wrong in what was given (the storage is busy: a re-run
    works; this user may not write the file or its folder; the disk under it is full), 2 otherwise.
    `storage_option`: the command has a --storage option (`profile` has none: its messages do not offer one)."""
    problem = problem or storage_problem(url, e)
    _fail(_storage_error(url, given, e, problem, storage_option=storage_option), 1 if problem[0] else 2)


def tuning_storage_failed(url: str, given: bool, e: BaseException, *, storage_option: bool = True) -> None:
    """Exit as `storage_failed` where `e`, raised while tuning, is the study storage's failure: SQLAlchemy's or
    SQLite's error, Optuna's wrapping of one this user cannot fix by a re-run alone (busy, not writable, full), or a
    full disk under the studies file however Optuna passed it on (a StorageInternalError, or the AssertionError
    "Should not reach." its `_run_trial` raises when the trial's end could not be stored). Returns for anything
    else. `storage_option`: as `storage_failed` (`tune` and `profile` share this)."""
    from sqlite3 import Error as SqliteError

    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    if isinstance(e, SQLAlchemyError | SqliteError):
        storage_failed(url, given, e, storage_option=storage_option)
    cause = e.__cause__ or e.__context__  # Optuna's StorageInternalError wraps SQLite's "readonly", "locked"
    if isinstance(e, optuna.exceptions.OptunaError) and isinstance(cause, SQLAlchemyError | SqliteError):
        problem = storage_problem(url, cause)
        if problem[0]:
            storage_failed(url, given, cause, problem, storage_option=storage_option)
    if disk_full(url, e) is not None:
        storage_failed(url, given, e, storage_problem(url, e), storage_option=storage_option)


def read_failed(url: str, given: bool, e: BaseException) -> NoReturn:
    """`tune show`'s read failed. Optuna wraps SQLAlchemy's errors (StorageInternalError "...invalid data in the
    commit..."): the chain says what happened. A writer changed the file under the read (DatabaseChanged, after the
    reads `list_studies`/`describe_study` ran again) or holds it locked: exit 1, retry; else `storage_failed`."""
    from moetune.tuner.search.readback import changed_while_read
    from moetune.tuner.search.storage import sqlite_path
    from moetune.tuner.search.workers import exception_chain

    if changed_while_read(e):
        where = f"--storage {redacted(url)}" if given else f"the studies file {sqlite_path(url) or redacted(url)}"
        _fail(f"{where}: the studies file changed while being read (a tune is writing it); the file is kept as it is: "
              "retry", 1)
    busy = next((x for x in exception_chain(e) if _storage_busy(x)), None)
    storage_failed(url, given, busy or e)


def _why(e: BaseException) -> str:
    return str(getattr(e, "orig", None) or e)


def _storage_busy(e: BaseException) -> bool:
    return any(m in _why(e) for m in BUSY_MARKERS)


def storage_problem(url: str, e: BaseException) -> Problem:
    """What failed that is not wrong in what was given, read once per failure: ("busy", "") when another process
    holds or is creating the studies file; ("denied", why) when this user cannot write the SQLite studies file or its
    folder (SQLite's "readonly database" or "unable to open database file", and the permissions say so); ("full",
    why) when SQLite said, anywhere in e's chain (Optuna wraps it: StorageInternalError, or the AssertionError its
    `_run_trial` raises when the trial's state could not be stored), that the disk took no more (`disk_full`);
    ("", "") for anything else."""
    from moetune.tuner.search.storage import sqlite_path
    from moetune.tuner.store._folders import not_writable
    from moetune.tuner.store.sqlite_errors import SQLITE_CANNOT_WRITE

    if _storage_busy(e):
        return "busy", ""
    path = sqlite_path(url)
    full = disk_full(url, e)
    if full is not None:
        if full[0] == "io" and path is not None:  # an I/O error where this user may not write: the permission says why
            denied = not_writable(path, side_files=True)
            if denied:
                return "denied", denied
        return "full", full[1]
    if path is None or not any(m in _why(e) for m in SQLITE_CANNOT_WRITE):
        return "", ""
    denied = not_writable(path, side_files=True)
    return ("denied", denied) if denied else ("", "")


def disk_full(url: str, e: BaseException) -> tuple[str, str] | None:
    """(kind, why) when an exception in e's chain is SQLite's answer of a disk that took no more
    (`sqlite_errors.disk_failed`: SQLITE_FULL, kind "full", or SQLITE_IOERR, kind "io": on a full disk the -wal/-shm cannot
    grow), why naming the folder of the studies file; else None."""
    from moetune.tuner.search.storage import sqlite_path
    from moetune.tuner.search.workers import exception_chain
    from moetune.tuner.store.sqlite_errors import disk_failed

    for x in exception_chain(e):
        kind = disk_failed(x)
        if kind is None:
            continue
        path = sqlite_path(url)
        disk = f"the disk holding {Path(os.path.abspath(path)).parent}" if path is not None else "its disk"
        state = "is full" if kind == "full" else "is full or failed"
        return kind, f"{disk} {state} (SQLite: {(_why(x).splitlines() or [''])[0]})"
    return None


def _default_studies(storage_option: bool) -> str:
    """How a message names the default studies file: by the option that replaces it, where the command has one."""
    return "the default --storage, beside the profile database" if storage_option else "beside the profile database"


def _storage_error(url: str, given: bool, e: BaseException, problem: Problem | None = None, *,
                   storage_option: bool = True) -> str:
    """The error for a study storage that cannot be opened, naming --storage (or the default studies file).
    `problem`: `storage_problem(url, e)` where the caller has it already. `storage_option`: as `storage_failed`."""
    from moetune.tuner.search.storage import sqlite_path

    kind, reason = problem or storage_problem(url, e)  # reason: the denial's, the full disk's
    why = (_why(e).splitlines() or [""])[0] or type(e).__name__  # SQLAlchemy's first line
    path = sqlite_path(url)
    with contextlib.suppress(OSError):  # a name too long for the file system: `why`, its own OSError, says so
        if path is not None and path.is_dir():
            why = f"{path} is a directory"
    if kind == "busy":
        where = f"--storage {redacted(url)}" if given else f"the studies file {path or redacted(url)}"
        return (f"{where} is busy: another moetune process is using or creating it ({type(e).__name__}: {why}); "
                "the file is kept as it is: run the command again")
    if "://" not in url:  # SQLAlchemy's "Could not parse SQLAlchemy URL" says nothing of what to type
        shown = redacted(url)
        if shown != url:  # a server URL mistyped (postgresql:/u:pw@h): its password is neither echoed nor made a path
            return (f"--storage {shown}: not a storage URL (a server URL is postgresql://USER:PASSWORD@HOST[:PORT]/DB, "
                    "with `://`)")
        return f"--storage {shown}: not a storage URL (a SQLite file is sqlite:///{Path(shown).expanduser().resolve()})"
    if kind == "full":  # reason: the folder, SQLite's words
        where = f"--storage {redacted(url)}" if given else f"the studies file {path or redacted(url)}"
        check = " (or check the disk)" if "full or failed" in reason else ""
        # the up-front check (no study yet) and a failure while tuning share it: "the study resumes" was untrue there
        return (f"{where}: {reason}; free space there{check}, then run the same command again (the file is kept: a "
                "study it holds resumes with its trials)")
    if kind == "denied":
        return (f"--storage {redacted(url)}: {reason}" if given else
                f"the studies file ({_default_studies(storage_option)}): {reason}")
    if given:
        return f"--storage {redacted(url)}: cannot open the study storage ({type(e).__name__}: {why})"
    return (f"the studies file {path or redacted(url)} ({_default_studies(storage_option)}) cannot be "
            f"opened ({type(e).__name__}: {why}); it is left as it is: move it aside"
            + (" or pass --storage" if storage_option else ""))


def server_lost(url: str, e: BaseException) -> str | None:
    """The error for a server storage (PostgreSQL, ...) that stopped answering while the tune ran, or None: a
    SQLAlchemy OperationalError (the connection failed, or could not be made again) or an error that invalidated its
    connection, anywhere in e's chain. Optuna passes it on as StorageInternalError "...invalid data in the commit..."
    (or its `_run_trial` fails on it with an UnboundLocalError), which sent the user looking for bad data."""
    from sqlalchemy.exc import DBAPIError, OperationalError

    from moetune.tuner.search.storage import is_sqlite
    from moetune.tuner.search.workers import exception_chain

    if is_sqlite(url):  # a file: storage_problem and the messages above say what failed
        return None
    lost = next((x for x in exception_chain(e) if (isinstance(x, DBAPIError) and x.connection_invalidated)
                 or (isinstance(x, OperationalError) and _unreachable(x))), None)
    if lost is None:
        return None
    why = (_why(lost).splitlines() or [""])[0]
    return (f"--storage {redacted(url)}: the storage server stopped answering during the tune ({type(lost).__name__}: "
            f"{why}); the trials it finished are kept there: run the same command again once the server answers, and "
            "the study resumes")


def _unreachable(e: BaseException) -> bool:
    """A driver error of no server's answer: no SQLSTATE (libpq could not reach the server), a connection exception
    (class 08) or the server's shutdown or crash (57P). Not a deadlock or a statement timeout (40P01, 57014): the
    server answered those."""
    orig = getattr(e, "orig", None)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)  # psycopg 3, psycopg2
    return not code or code.startswith(("08", "57P"))


def refuse_memory(storage: str, why: str) -> None:
    """Exit 2 on an in-memory SQLite --storage (`sqlite://`, `sqlite:///:memory:`): it exited 0 and the studies
    vanished."""
    from moetune.tuner.search.storage import is_memory

    if is_memory(storage):
        _fail(f"--storage {redacted(storage)}: an in-memory database: {why}; give a file (sqlite:///PATH) or a server URL "
              "(postgresql://...)")


def check_storage(url: str, given: bool, *, create: bool = True, storage_option: bool = True) -> None:
    """Open the study storage once before anything runs: a bad URL, a folder or a file that is not a database is
    one clear error, not a traceback from Optuna or SQLAlchemy. `create` False: only what can be checked without
    creating anything (`refuse_storage`: a URL that does not parse, another program's file, a missing folder),
    before the profile database is created (a refused storage leaves no new --db file behind). `storage_option`: the
    command has a --storage option (`profile`, which opens the default studies file, has none)."""
    import warnings

    from moetune.tuner.search.storage import (
        StorageRefused,
        make_storage,
        refuse_default_storage,
        refuse_storage,
    )

    try:
        with warnings.catch_warnings():  # Optuna's experimental-feature notes are for the real run, not this check
            warnings.simplefilter("ignore")
            if create:
                st = make_storage(url, own=not given)  # the default studies file is moetune's own (WAL)
                # the check's connections, closed now: its engine lived on in a reference cycle, two server
                # connections for the whole run (64 nodes of one study went past PostgreSQL's max_connections=100)
                st.remove_session()
                st.engine.dispose()
            else:  # the checks that create nothing, once, before the profile database is made
                if not given:
                    refuse_default_storage(url, storage_option=storage_option)
                refuse_storage(url)
    except StorageRefused as e:  # another program's file, a folder that does not exist: the reason is the message
        _fail(f"--storage {redacted(url)}: {e}" if given
              else f"the studies file ({_default_studies(storage_option)}): {e}", e.exit_code)
    except Exception as e:  # SQLAlchemy / sqlite3 / a missing driver / Optuna's schema check: all mean "cannot open"
        storage_failed(url, given, e, storage_option=storage_option)


def read_config(config: Path | None, *, measuring: bool = False):
    """The configuration, or a clear error naming the key and file (never silently the defaults). `measuring`: its
    [runtime] table checked too (a bad key fails here, not in every trial) and --config made the chain the trials
    measure under (`load_config_checked`); `tune show` reads no runtime option and keeps working past a bad one."""
    from moetune.runtime.config import ConfigError, load_config
    from moetune.runtime.options import load_config_checked

    try:
        return load_config_checked(config) if measuring else load_config(config)
    except ConfigError as e:
        _fail(str(e))


def open_store(db: Path | None, *, readonly: bool = False):
    try:
        from moetune.tuner.store.store import Store  # type: ignore[attr-defined]
    except ImportError as e:
        _fail(f"the profile store is not available in this build ({e})")
    try:
        # intact: a damaged file is refused before the trials (they ran for minutes, then the write failed or spread it)
        store = Store(db, readonly=readonly, intact=not readonly)
    except (RuntimeError, OSError, ValueError) as e:  # StoreError: not a database, damaged, newer schema, busy, ...
        _fail(str(e), getattr(e, "exit_code", 2))
    from moetune.tuner.cli.db import say_upgraded

    say_upgraded(store)
    return store


def storage_url(storage: str | None, db: Path | None, store=None) -> str:
    from moetune.tuner.search.storage import default_storage_url

    if storage is not None:
        return storage
    return default_storage_url(db or (store.path if store is not None else None))
