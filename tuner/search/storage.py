"""Optuna's storage of the studies: URLs, the SQLite studies file and its rules, read-only opening."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import sqlite3
import stat
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from moetune.tuner.search.interrupt_guard import guard_methods, uninterrupted
from moetune.tuner.search.trials import INTERRUPTED, requeue_warm_start
from moetune.tuner.store._folders import make_parent, not_writable
from moetune.tuner.store._tables import (
    connect_existing,
    existing_tables,
    is_foreign_file,
    is_optuna_file,
    missing_optuna_tables,
    shown_tables,
)

log = logging.getLogger("moetune.tuner.search.storage")

STUDIES_SUFFIX = "-studies.db"  # the default studies file of DIR/NAME.db is DIR/NAME-studies.db
OPTUNA_DB_NAME = "moetune" + STUDIES_SUFFIX  # that of the default profile database, moetune.db


_in_flight = threading.local()  # .sets: the `_InFlight` sets of this thread's run_study in progress


class _InFlight(set[int]):
    """Trial ids that a storage made RUNNING in this thread and has not finished since (`GuardedRDBStorage`), while
    a `trials_in_flight` of that storage is open: what an interrupt (or an error) may have left RUNNING."""

    def __init__(self, storage: optuna.storages.BaseStorage):
        super().__init__()
        self.storage = getattr(storage, "_backend", storage)  # Optuna wraps an RDB storage in a cache


class GuardedRDBStorage(optuna.storages.RDBStorage):
    """Optuna's RDBStorage whose every call holds back the CLI's Ctrl-C / SIGTERM until it returns
    (`interrupt_guard`): an interrupt inside SQLAlchemy's transaction bookkeeping left a connection holding the
    SQLite write lock, and Optuna's FAIL of the interrupted trial then failed "database is locked" (a traceback,
    exit 1, the trial left RUNNING). Every method RDBStorage defines is wrapped (below).

    A trial it makes RUNNING (a new one, or an enqueued one taken: Optuna's `ask()`) is noted, before a kept
    interrupt is raised, in this thread's open `trials_in_flight` sets (a trial it finishes leaves them): `run_study`
    fails the ones an interrupt left RUNNING, though `ask()` never returned their id. Where heartbeats are on (a
    server storage) it gets its first heartbeat at once: Optuna starts beating only after `ask()` returns, and a
    trial without any heartbeat is never stale, so a worker killed inside `ask()` left it RUNNING for good."""

    def _create_new_trial(self, study_id: int,
                          template_trial: optuna.trial.FrozenTrial | None = None) -> optuna.trial.FrozenTrial:
        with uninterrupted():
            frozen = super()._create_new_trial(study_id, template_trial)
            if frozen.state == TrialState.RUNNING:
                self._made_running(frozen._trial_id)
            return frozen

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        with uninterrupted():
            changed = super().set_trial_state_values(trial_id, state, values)
            if changed and state == TrialState.RUNNING:
                self._made_running(trial_id)
            elif changed and state.is_finished():
                for ids in self._in_flight():
                    ids.discard(trial_id)
            return changed

    def record_heartbeat(self, trial_id: int) -> None:
        """A beat that fails (a database restart, a dropped connection) is skipped: Optuna's heartbeat thread ended at
        the first error (a traceback on stderr) and never beat again, so a grace period later another worker failed
        this live worker's trial as stale and its measurement was lost. The next beat, an interval later, tries again."""
        with uninterrupted():
            try:
                super().record_heartbeat(trial_id)
            except Exception as e:  # broad: a beat is best effort; the trial's own storage calls say what fails
                log.debug("heartbeat of trial %s failed, the next one tries again: %s", trial_id, e)

    def _in_flight(self) -> list[_InFlight]:
        return [ids for ids in getattr(_in_flight, "sets", ()) if ids.storage is self]

    def _made_running(self, trial_id: int) -> None:
        for ids in self._in_flight():
            ids.add(trial_id)
        if self.heartbeat_interval is not None:
            try:
                self.record_heartbeat(trial_id)
            except Exception as e:  # broad: the trial stands; `beat_unbeaten` gives it one when a worker opens the study
                log.debug("no first heartbeat for trial %s: %s", trial_id, e)


guard_methods(GuardedRDBStorage, optuna.storages.RDBStorage)


@contextmanager
def trials_in_flight(storage: optuna.storages.BaseStorage) -> Iterator[_InFlight]:
    """The trials `storage` (a `GuardedRDBStorage`, cached or not) makes RUNNING in this thread in the body and has
    not finished by the body's end (another storage: none are noted)."""
    ids = _InFlight(storage)
    sets = _in_flight.__dict__.setdefault("sets", [])
    sets.append(ids)
    try:
        yield ids
    finally:
        sets[:] = [x for x in sets if x is not ids]


def studies_file_name(db_path: str | Path) -> str:
    """The default studies file's name for the profile database `db_path`: `NAME-studies.db` for `NAME.db`
    (`moetune-studies.db` for the default `moetune.db`, as before). One per database: two databases of one folder
    shared `moetune-studies.db`, so a tune of the second resumed the first one's finished studies and ran no trial.
    Another name keeps its whole name (`x.sqlite` → `x.sqlite.studies.db`, `x` → `x.studies.db`): `x.db`, `x.sqlite`
    and `x` of one folder must not share one either."""
    p = Path(db_path)
    return p.stem + STUDIES_SUFFIX if p.suffix == ".db" else p.name + ".studies.db"


def _tuned_in(db: Path, studies: Path) -> bool:
    """Whether the profile database `db` records a tuning run in a studies file named as `studies` (its tuning_runs
    table; by name, not by the whole path: a data folder moved or restored elsewhere still resumes; read-only, best
    effort: False for anything it cannot read)."""
    from moetune.runtime.profiles import sqlite_open

    if not db.is_file():
        return False
    try:  # read as the store's read-only looks are (sqlite_open: a torn immutable read retried)
        return sqlite_open.read(db, lambda con: con.execute(  # the name holds no LIKE wildcard (% or _)
            "SELECT 1 FROM tuning_runs WHERE storage LIKE ? LIMIT 1", (f"%/{studies.name}",)).fetchone() is not None,
            timeout_s=1.0)
    except (sqlite3.Error, OSError):  # not a profile database, an older schema, locked: no run recorded
        return False


def default_storage_url(db_path: str | Path | None = None) -> str:
    """SQLite file for Optuna's tables, beside the profile database (never inside it): `studies_file_name`.
    A database tuned before the studies file was per database (its runs name `moetune-studies.db` beside it) keeps
    that file while it has no studies file of its own: its studies still resume. `db_path` None: the configured
    database (`[store] db`, else runtime/paths.py `default_db_path`: $MOETUNE_HOME, $XDG_DATA_HOME, ~/.local/share);
    a broken config raises its ConfigError (naming the key and the file) rather than put the studies elsewhere."""
    if db_path is None:
        from moetune.runtime.config import resolve_db_path

        db_path = resolve_db_path()
    path = Path(db_path).expanduser().resolve()
    own, shared = path.parent / studies_file_name(path), path.parent / OPTUNA_DB_NAME
    if own != shared and not own.exists() and shared.is_file() and _tuned_in(path, shared):
        return f"sqlite:///{shared}"
    return f"sqlite:///{own}"


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite:")


def sqlite_path(url: str) -> Path | None:
    """The file of a `sqlite:///PATH` URL, without its query string (`sqlite_query`); None for another URL (an
    in-memory `sqlite://` included: `is_memory`)."""
    if not url.startswith("sqlite:///"):
        return None
    return Path(url[len("sqlite:///"):].split("?", 1)[0])


def sqlite_query(url: str) -> str:
    """The query string of a SQLite URL ('' when none)."""
    return url.split("?", 1)[1] if is_sqlite(url) and "?" in url else ""


def is_memory(url: str) -> bool:
    """A SQLite URL of an in-memory database (`sqlite://`, `sqlite:///:memory:`, `?mode=memory`): gone at exit."""
    if not is_sqlite(url):
        return False
    path = sqlite_path(url)
    return path is None or str(path) == ":memory:" or "mode=memory" in sqlite_query(url)


def refuse_query(url: str) -> None:
    """StorageRefused for a SQLite studies URL with a query string: moetune opens the file itself (read-write, or
    read-only for `tune show`) and by its path, so `?mode=rw` and the like would be ignored in some opens and not in
    others."""
    query = sqlite_query(url)
    if query:
        raise StorageRefused(f"query parameters ({query}) are not taken on a SQLite studies URL: moetune opens the "
                             f"file itself; give sqlite:///{sqlite_path(url)}")


def normalize_url(url: str) -> str:
    """A PostgreSQL URL naming no driver gets one that is installed. `postgres://` is `postgresql://` (SQLAlchemy
    dropped that name in 1.4: it failed "Can't load plugin: sqlalchemy.dialects:postgres" wherever psycopg2 was
    installed). SQLAlchemy's default driver for `postgresql://` is psycopg2 up to 2.0 and psycopg (3) from 2.1
    (both are supported): where that default is not installed and the other is, the other is named, so a psycopg-only
    install works under 2.0 and a psycopg2-only one under 2.1 (it failed "No module named 'psycopg'")."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    if url.startswith("postgresql://"):
        import importlib.util

        import sqlalchemy

        default = sqlalchemy.engine.make_url("postgresql://").get_driver_name()  # loads no driver
        if importlib.util.find_spec(default) is None:
            other = next((d for d in ("psycopg", "psycopg2") if d != default and importlib.util.find_spec(d)), None)
            if other is not None:
                return f"postgresql+{other}://" + url[len("postgresql://"):]
    return url


# libpq's parameters that carry a secret, which a server URL may give in its query as well as in `user:password@`
_SECRET_QUERY = re.compile(r"([?&](?:ssl)?password=)[^&]*", re.IGNORECASE)
# ... and of a libpq keyword string (`host=h user=u password=... dbname=x`, not a URL): a keyword at the start or after
# white space, its value bare (to the next white space) or single-quoted with `\'` escapes (an unclosed quote: to the end)
_SECRET_KEYWORD = re.compile(r"(?<!\S)((?:ssl)?password\s*=\s*)(?:'(?:\\.|[^'\\])*'?|\S*)", re.IGNORECASE)
# a scheme and the slashes after it, in a URL mistyped without `://` (`postgresql:/`, `postgresql//`)
_SCHEME_SLASHES = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:?/+")


def redact_url(url: str) -> str:
    """A storage URL without its secrets, for messages and the run table: the password of `user:password@`, and of a
    `password=` or `sslpassword=` query parameter (`postgresql://h/db?user=u&password=...`: it was printed and stored
    as it was given). A SQLite URL holds none: it is kept whole (its path was cut at an `@` as if at a password).
    Text mistyped without `://` (`postgresql:/u:pw@h/db`) that holds a `user:password@` shape loses its password too:
    it was echoed whole in the 'not a storage URL' error, as was a libpq keyword string's `password=`/`sslpassword=`
    (`host=h user=u password='a b' dbname=x`)."""
    if is_sqlite(url):
        return url
    url = _SECRET_QUERY.sub(r"\1***", url)  # first: a password holding an `@` is then gone with its parameter
    url = _SECRET_KEYWORD.sub(r"\1***", url)
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        user = cred.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    if "@" in url:  # mistyped without `://` (postgresql:/u:pw@h, postgresql//u:pw@h): its password is still one
        cred, host = url.rsplit("@", 1)
        lead = _SCHEME_SLASHES.match(cred)
        start = lead.end() if lead else 0
        if ":" in cred[start:]:  # a `user:password` shape; a file path's `@` (/data/u@h/s.db) is kept
            user = cred[start:].split(":", 1)[0]  # a scheme without slashes is masked with it: never a password's part
            return f"{cred[:start]}{user}:***@{host}"
    return url


# Seconds a PostgreSQL connection may take to open, unless the URL's `connect_timeout` or $PGCONNECT_TIMEOUT says
# otherwise: libpq waits without bound by itself, so a firewalled host hung every worker ~2 minutes (the kernel's SYN
# retries) before the clear error, and a host that takes the connection but never answers hung it for good
CONNECT_TIMEOUT_S = 10
_LIBPQ_DRIVERS = ("psycopg", "psycopg2", "psycopg2cffi")  # the drivers that take libpq's connect_timeout


def connect_args(url: str) -> dict[str, Any]:
    """The driver arguments moetune adds to a server storage URL: a bounded connect_timeout for PostgreSQL through
    libpq (`CONNECT_TIMEOUT_S`) where neither the URL's query nor $PGCONNECT_TIMEOUT gives one (an argument would
    override both); none for another database or driver."""
    import sqlalchemy

    u = sqlalchemy.engine.make_url(url)
    if (u.get_backend_name() != "postgresql" or u.get_driver_name() not in _LIBPQ_DRIVERS
            or "connect_timeout" in u.query or os.environ.get("PGCONNECT_TIMEOUT")):
        return {}
    return {"connect_timeout": CONNECT_TIMEOUT_S}


class StorageRefused(ValueError):
    """A SQLite studies storage moetune will not create or write: another program's file, or a missing folder.
    `exit_code`: what a command exits with on it (2: what was given is wrong)."""

    exit_code = 2


class StorageNotWritable(StorageRefused):
    """This user may not write the SQLite studies file, or create it in its folder (a failure: exit 1)."""

    exit_code = 1


def _schema_ready(path: Path, tables: set[str]) -> bool:
    """Optuna's schema is there and stamped: opening the file creates no table and writes no version."""
    if not is_optuna_file(tables) or "alembic_version" not in tables:
        return False
    con = connect_existing(path, timeout_s=30)
    try:
        return all(con.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone() is not None
                   for t in ("version_info", "alembic_version"))
    except sqlite3.Error:
        return False
    finally:
        con.close()


def _check_sqlite_studies_path(path: Path) -> set[str]:
    """The rules an explicit --db follows, for a SQLite studies file: moetune adds Optuna's tables (and WAL) to no
    other program's file, and creates no folder but its own data folder; a file this user may not write, or a new one
    in a folder this user may not write, is StorageNotWritable. Returns the file's tables (none: new)."""
    if path.exists():
        if not path.is_file():
            return set()  # a folder or a device: SQLite says what is wrong
        if path.stat().st_size == 0:  # an empty file is a new one
            _need_writable(path)
            return set()
        tables = existing_tables(path, timeout_s=30)  # a plain mode=rw connection: it creates and switches nothing
        # Optuna's file (one whose first opening was cut short too: its schema is finished below, under the
        # creation lock), or the profile store's (the store shares its file with Optuna): not another program's
        if is_foreign_file(tables):
            raise StorageRefused(
                f"{path} is another program's database (it has tables {shown_tables(tables)}, neither Optuna's studies "
                f"tables nor moetune's): moetune does not add Optuna's tables to it; it is left as it is: give a new "
                f"file or a studies file")
        _need_writable(path)
        return tables
    make_parent(path, StorageRefused)  # no folder made but moetune's own data folder (the store's rule)
    _need_writable(path)
    return set()


def refuse_default_storage(url: str, *, storage_option: bool = True) -> None:
    """StorageRefused where the default studies file beside a profile database is itself a moetune profile database
    (a database named `x-studies.db` beside `x.db`): the default is never inside a profile database (an explicit
    --storage may share one on purpose). `storage_option`: the command has --storage (`profile` has not: its
    message offers another --db, whose studies file has another name, or moving the file aside)."""
    from moetune.tuner.store._schema import VERSION_TABLE

    path = sqlite_path(url) if is_sqlite(url) else None
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return
    try:
        tables = existing_tables(path, timeout_s=30)
    except sqlite3.Error:
        return  # not readable as SQLite: make_storage says what is wrong
    if VERSION_TABLE in tables:
        way = ("pass --storage (a new file, or this one to share it on purpose)" if storage_option else
               "move it aside, or pass another --db (whose studies file has another name)")
        raise StorageRefused(f"{path} is a moetune profile database, not a studies file: the default studies file is "
                             f"never inside one; {way}")


def _need_writable(path: Path) -> None:
    """StorageNotWritable naming the file (read-only for this user) or the folder (a new file, or the journal of a
    write, cannot be made there)."""
    why = not_writable(path, side_files=True)
    if why:
        raise StorageNotWritable(why)


@contextmanager
def _creation_lock(path: Path) -> Iterator[bool]:
    """Serialize the creation of a SQLite studies file's schema between processes: two first runs at once raced
    in Optuna's create_all / version stamp ("UNIQUE constraint failed: alembic_version.version_num", "table trials
    already exists") though the file was fine. An flock on `<file>.lock` (released when the process dies). flock
    needs no write access: the lock file is opened read-only (whoever created it, a root-owned 0644 one included),
    never through a link, never blocking on the open, with the studies file's mode (as SQLite gives its -wal/-shm).
    Yields whether it holds the lock; when the lock file cannot be opened or is not a regular file (a FIFO, a
    device), says why at debug level and yields False (the caller retries)."""
    import fcntl

    lock = Path(f"{path}.lock")
    try:
        mode = stat.S_IMODE(path.stat().st_mode) & 0o666
    except OSError:
        mode = 0o644  # SQLite's mode for a new file (less the umask)
    try:
        # O_NONBLOCK: a FIFO planted at that name (a shared sticky folder, another user) would block the open forever
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        log.debug("no creation lock for %s (%s: %s): retrying the schema creation instead", path, lock, e)
        yield False
        return
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        log.debug("no creation lock for %s (%s: not a regular file): retrying the schema creation instead", path, lock)
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


CREATE_RETRIES = 5  # schema creation without the lock: a race with another first run is retried (it is transient)


def _open_sqlite(path: Path, url: str, *, retry: bool, wal: bool) -> optuna.storages.RDBStorage:
    """Open Optuna's storage on the file (creating its schema when missing), switched to WAL first when `wal` (a file
    moetune creates, or its own default studies file); another file's journal mode is left as it is. Without the
    creation lock (`retry`) a race with another process creating the schema is retried."""
    import time

    import sqlalchemy

    for attempt in range(CREATE_RETRIES if retry else 1):
        try:
            if wal:
                con = sqlite3.connect(path, timeout=30)
                try:
                    con.execute("PRAGMA journal_mode=WAL")
                finally:
                    con.close()
            # isolation_level None: the driver's implicit transactions are off, `_immediate_transactions` begins them
            return GuardedRDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30,
                                                                                   "isolation_level": None}})
        except (sqlalchemy.exc.SQLAlchemyError, sqlite3.Error, optuna.exceptions.StorageInternalError) as e:
            why = str(e)
            if not retry or attempt == CREATE_RETRIES - 1 or not any(m in why for m in _CREATION_RACE):
                raise
            log.debug("schema creation of %s raced another process (%s): retrying", path, why.splitlines()[0])
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


# what two processes creating one file's schema at once see (the file is fine: a retry opens it)
_CREATION_RACE = ("already exists", "UNIQUE constraint failed", "database is locked")


def _immediate_transactions(st: optuna.storages.RDBStorage) -> None:
    """Every transaction on the SQLite file takes its write lock at BEGIN (BEGIN IMMEDIATE). Python's sqlite3 runs
    a SELECT outside any transaction, so Optuna's read-then-write steps were not atomic between processes: two
    processes on one study both read an enqueued trial as WAITING and both ran it ("Cannot tell a COMPLETE trial",
    "Trial#N has already finished"); likewise a check of a trial's state and its update."""
    import sqlalchemy

    @sqlalchemy.event.listens_for(st.engine, "begin")
    def _begin(conn: sqlalchemy.engine.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def refuse_storage(url: str) -> None:
    """What `make_storage` refuses, checked without creating a file or a table (`moetune tune` checks this before it
    creates the profile database): a URL that does not parse; for a SQLite file, another program's database or a
    folder moetune does not make (StorageRefused; moetune's own data folder is made)."""
    url = normalize_url(url)
    path = sqlite_path(url) if is_sqlite(url) else None
    if path is not None and str(path) != ":memory:":
        refuse_query(url)
        _check_sqlite_studies_path(path)
        return
    import sqlalchemy

    sqlalchemy.engine.make_url(url)  # ArgumentError: not a URL


def make_storage(url: str, *, own: bool = False) -> optuna.storages.RDBStorage:
    """Optuna RDB storage (standard tables: optuna-dashboard opens it as it is).

    A SQLite file is switched to WAL only when moetune creates it (missing or empty) or it is moetune's `own` default
    studies file (beside the profile database, which moetune made): a user's existing file keeps its journal mode (a
    lasting change to a file moetune did not make; WAL also breaks on network filesystems). In rollback-journal mode
    everything still works, with less concurrency: every write transaction begins IMMEDIATE either way, and a reader
    (`tune show`, another tune's SELECTs) waits on the busy timeout while a writer commits, instead of reading beside it."""
    url = normalize_url(url)
    if is_sqlite(url):
        path = sqlite_path(url)
        if path is None or str(path) == ":memory:":
            return GuardedRDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}})
        refuse_query(url)
        new = not path.exists() or (path.is_file() and path.stat().st_size == 0)
        tables = _check_sqlite_studies_path(path)  # another program's file, a missing folder: refused
        if _schema_ready(path, tables):
            st = _open_sqlite(path, url, retry=False, wal=own or new)  # nothing to create: no lock (no lock file)
        else:
            with _creation_lock(path) as locked:
                st = _open_sqlite(path, url, retry=not locked, wal=own or new)
        _immediate_transactions(st)
        return st
    # Shared server storage: heartbeats let the survivors fail the trials of a worker that died (as
    # interrupted: not counted, a warm-start point run again).
    # Optuna 4.9 renamed the callback (the old name warns); optuna>=4.0 is supported
    cb = ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback"
          in inspect.signature(optuna.storages.RDBStorage).parameters else "failed_trial_callback")
    with warnings.catch_warnings():  # heartbeat_interval is "experimental": a note for Optuna users, not ours
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return GuardedRDBStorage(url, engine_kwargs={"pool_pre_ping": True, "connect_args": connect_args(url)},
                                 heartbeat_interval=10, grace_period=60, **{cb: _stale_trial})


class NotAStudiesFile(ValueError):
    """A storage `open_readonly_storage` refuses: it holds no Optuna schema."""


def open_readonly_storage(url: str) -> optuna.storages.RDBStorage:
    """The storage for reading studies back (`tune show`): it never creates a table, a file or a version stamp,
    and a file or database without Optuna's tables is refused (NotAStudiesFile) instead of being given them.
    A SQLite file read through immutable=1 (`sqlite_open`) is checked for a change under the read only when SQLite
    reports an error (then DatabaseChanged, not "malformed"): a read that succeeds is not checked, unlike the
    store's. What tune show reads is for display only."""
    url = normalize_url(url)
    path = sqlite_path(url) if is_sqlite(url) else None
    if path is not None and str(path) != ":memory:":
        refuse_query(url)
        if not path.is_file():
            raise NotAStudiesFile(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
        import sqlalchemy
        from sqlalchemy.pool import NullPool

        from moetune.runtime.profiles import sqlite_open

        # The store's read-only opener (mode=ro; immutable=1 only where a folder we may not write has no -shm and no
        # -wal/-journal holds changes: the daemon's studies file while it is down). SQLite refuses any write to it.
        path = path.resolve()
        tables = sqlite_open.read(path, lambda con: {r[0] for r in con.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}, timeout_s=30)
        _need_tables(str(path), tables)
        # NullPool: every session opens anew, so the choice and the guard are made per read, never kept from the first
        st = optuna.storages.RDBStorage(
            f"sqlite:///{path}", skip_table_creation=True,
            engine_kwargs={"creator": lambda: sqlite_open.connect_readonly(path, timeout_s=30), "poolclass": NullPool})

        @sqlalchemy.event.listens_for(st.engine, "handle_error")
        def _changed(ctx: Any) -> None:  # a page torn by a writer under immutable=1 is not "malformed": say so
            raw = getattr(getattr(ctx.connection, "connection", None), "driver_connection", None)
            if isinstance(raw, sqlite_open.ReadOnlyConnection):
                raw.check_unchanged()

        return st
    import sqlalchemy

    args = {} if is_sqlite(url) else connect_args(url)
    engine = sqlalchemy.create_engine(url, **({"pool_pre_ping": True} if not is_sqlite(url) else {}), connect_args=args)
    try:
        tables = set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    _need_tables(redact_url(url).split("@")[-1], tables)
    return optuna.storages.RDBStorage(url, skip_table_creation=True, engine_kwargs={"connect_args": args})


def _need_tables(where: str, tables: set[str]) -> None:
    missing = missing_optuna_tables(tables)
    if missing:
        raise NotAStudiesFile(f"{where} is not an Optuna studies storage (no {', '.join(missing)} table"
                              f"{'s' if len(missing) > 1 else ''}); it is left as it is")


def storage_id(storage: optuna.storages.BaseStorage) -> str:
    backend = getattr(storage, "_backend", storage)  # Optuna wraps an RDB storage in a cache
    return str(getattr(backend, "url", id(backend)))


def _stale_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """RDB heartbeat callback: a trial of a worker that stopped beating was failed; it was cut short. It is
    already FAIL (its attrs are frozen), so the study records it, by a claim (`claim_study_attr`): a worker opening
    the study between the FAIL and this callback recorded it already (`study.record_untagged`) and enqueued its
    warm-start point, which was then enqueued a second time here."""
    if claim_study_attr(study, f"{INTERRUPTED}:{trial._trial_id}", "its worker stopped"):
        requeue_warm_start(study, trial._trial_id)


def rdb_backend(study: optuna.Study) -> optuna.storages.RDBStorage | None:
    """The study's RDB storage (Optuna wraps one in a cache), None for another storage (in memory: one process's)."""
    backend = getattr(study._storage, "_backend", study._storage)
    return backend if isinstance(backend, optuna.storages.RDBStorage) else None


def claim_study_attr(study: optuna.Study, key: str, value: Any) -> bool:
    """Set study system attr `key` unless it is set: one INSERT on an RDB storage (Optuna's table has a unique
    (study_id, key); Optuna's own setter overwrites), so of two processes exactly one gets True. Another storage (in
    memory) is one process's: set when missing."""
    import sqlalchemy

    backend = rdb_backend(study)
    if backend is None:
        if key in study._storage.get_study_system_attrs(study._study_id):
            return False
        study._storage.set_study_system_attr(study._study_id, key, value)
        return True
    try:
        with uninterrupted(), backend.engine.begin() as conn:  # a storage call as Optuna's are (`GuardedRDBStorage`)
            conn.execute(sqlalchemy.text("INSERT INTO study_system_attributes (study_id, key, value_json) "
                                         "VALUES (:s, :k, :v)"),
                         {"s": study._study_id, "k": key, "v": json.dumps(value)})
    except sqlalchemy.exc.IntegrityError:
        return False  # another process (or an earlier run) set it
    return True


def take_over_study_attr(study: optuna.Study, key: str, value: Any, stale: Callable[[Any], bool]) -> bool:
    """Set study system attr `key` to `value` where its value now is `stale` (a claim of `claim_study_attr` whose
    process died before it did what it claimed: its claim was held for good, and what it claimed never done). One
    UPDATE matching the value read (compare and swap), so of two processes taking it over exactly one gets True.
    Another storage (in memory) is one process's."""
    import sqlalchemy

    backend = rdb_backend(study)
    if backend is None:
        attrs = study._storage.get_study_system_attrs(study._study_id)
        if key not in attrs or not stale(attrs[key]):
            return False
        study._storage.set_study_system_attr(study._study_id, key, value)
        return True
    where = {"s": study._study_id, "k": key}
    with uninterrupted(), backend.engine.connect() as conn:  # read apart from the write: no lock upgrade to wait on
        row = conn.execute(sqlalchemy.text("SELECT value_json FROM study_system_attributes WHERE study_id = :s "
                                           "AND key = :k"), where).first()
    if row is None:
        return False
    try:
        held = json.loads(row[0])
    except (TypeError, ValueError):
        return False
    if not stale(held):
        return False
    with uninterrupted(), backend.engine.begin() as conn:
        res = conn.execute(sqlalchemy.text("UPDATE study_system_attributes SET value_json = :v WHERE study_id = :s "
                                           "AND key = :k AND value_json = :old"),
                           {**where, "v": json.dumps(value), "old": row[0]})
    return res.rowcount == 1  # 0: another process took it over first

