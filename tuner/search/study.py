"""The Optuna study of one tuning key: storage, sampler, seeding, warm start, resume, and reading studies back.

- Sampler: TPE, multivariate with `group=True` (it decomposes the conditional space), seeded.
- Warm start: `enqueue_trial` of the policy default and the analytic priors (per-PE groups; SM and QP
  counts from link bandwidth), then the best settings of the previous token bucket of the same shape. Each point
  is enqueued once per study, by whichever process claims it first (`_claim_warm_point`: SQLite and server alike).
- Storage: Optuna's own RDB storage. SQLite by default (its own file next to the store, WAL; the store's own file
  is accepted too: the store shares a file with Optuna's tables, never another program's; a SQLite file moetune did
  not create keeps its journal mode, WAL or not: `make_storage`) — processes of one host may share a study (the daemon's re-tune and a `moetune tune`): every
  process registers itself in the study before it asks for a trial (and leaves when done), a trial records
  its worker as Optuna creates it (the sampler's `before_trial`), and opening a study fails only the
  running trials no live process can own (`fail_interrupted`); the schema is created under a file lock
  beside the file (two first runs at once). `--storage postgresql://...` lets several nodes share a study
  (heartbeats fail the trials of a worker that died; a trial beats from its creation on, and opening a study
  gives a running trial without a heartbeat one: `beat_unbeaten`). `tune show` opens a storage read-only
  (`open_readonly_storage`). Same study name → the study resumes; the
  name carries a digest of the routing, policy and backend settings (`study_config`), so a rerun that
  measures something else opens its own study.
- Trial budget: finished trials (complete, pruned, failed) of the study count, so a rerun after a
  crash only runs what is missing and several workers on one study stop together. A trial cut short
  (Ctrl-C, a killed process, a worker whose heartbeat stopped) is FAIL and marked `interrupted` (a FAIL with
  no `error` is one too: `is_interrupted`): it is not a finished trial, and a warm-start point it carried is enqueued again (the policy default is
  measured even when its first run was the one interrupted). No trial this process made RUNNING is left so by an
  interrupt or an error, wherever it lands (inside Optuna's `ask()` or `tell()` too: `fail_in_flight`).
- A failed or hung run is a FAIL trial with its error in user attrs; a setting the backend calls unsafe
  is PRUNED with `infeasible` set; neither stops the study.
- Across token buckets: `neighbour_bucket` finds the nearest smaller bucket's study of the same key in
  the storage; its best settings warm-start the next bucket and, with the local backend, a setting it
  measured ≥ 1.5× slower than its best is pruned without being run (warm-start points are always measured).
- Pruning within a trial: with the local backend and several repeats per trial, a MedianPruner stops a
  trial whose first repeats are already worse than the median. Both pay only where a measurement is
  expensive (a process launch); the model backend evaluates every sampled point (about a millisecond).

`tune.py` drives these studies over families, shapes and buckets and writes the profiles.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import inspect
import json
import logging
import math
import os
import socket
import sqlite3
import stat
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import optuna
from optuna.trial import TrialState

from moetune.runtime import _proc
from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import TOKEN_BUCKETS, ProfileKey
from moetune.runtime.shapes import MODELS, ModelShape
from moetune.tuner.search.backends import (
    BenchmarkBackend,
    Measurement,
    TuneWorkload,
)
from moetune.tuner.search.interrupt_guard import guard_methods, uninterrupted
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.store._folders import make_parent, not_writable
from moetune.tuner.store._tables import (
    connect_existing,
    existing_tables,
    is_foreign_file,
    is_optuna_file,
    missing_optuna_tables,
    shown_tables,
)

log = logging.getLogger("moetune.tuner.search.study")
T = TypeVar("T")

STUDY_PREFIX = "moetune/"
# This process in a trial's `worker` attr and the study's worker registry: host:pid:run:ticks. The run id tells this
# process from an earlier one that had the same pid (containers reuse pids run after run); the ticks (its start, in
# clock ticks since boot: /proc) let another process tell whether that pid is still this process.
_RUN = uuid.uuid4().hex[:12]
_REGISTERED_AT = datetime.now()  # before this process asks for any trial (Optuna's datetime_start: local, naive)
WORKER_KEY = "worker:"  # study system attr `worker:host:pid` -> {"run": id, "since": ISO time, "ticks": int}
# A worker's registration and a trial's start are read off one host's clock: a little slack for a clock step.
CLOCK_SLACK = timedelta(seconds=2)
# A RUNNING trial without a `worker` attr: its creator records itself in the sampler's `before_trial`, right after
# Optuna creates the trial. One older than this lost its creator in between (a process that died): it is failed
# even while other registered workers live (the daemon is one for weeks).
FRESH_TRIAL = timedelta(seconds=60)


def _now() -> datetime:
    """Local, naive: the clock of Optuna's datetime_start."""
    return datetime.now()


_TICKS: dict[int, int | None] = {}  # pid -> its start ticks (a forked child has its own)


def _start_ticks() -> int | None:
    """When this process started, in clock ticks since boot (/proc/self/stat's field 22); None without /proc."""
    pid = os.getpid()
    if pid not in _TICKS:
        _TICKS[pid] = _proc.start_ticks()
    return _TICKS[pid]


def _worker_id(host_pid: str, run: object, ticks: int | None) -> str:
    """host:pid:run:ticks, or host:pid:run where the start ticks are unknown."""
    return f"{host_pid}:{run}" + (f":{ticks}" if ticks is not None else "")


def _host_pid() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def current_worker() -> str:
    """host:pid:run:ticks of this process (host:pid:run without /proc); computed each time: a forked child has its
    own pid and ticks."""
    return _worker_id(_host_pid(), _RUN, _start_ticks())


WORKER = current_worker()
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
INTERRUPTED = "interrupted"  # user attr of a FAIL trial whose run was cut short: not a finished trial
STUDIES_SUFFIX = "-studies.db"  # the default studies file of DIR/NAME.db is DIR/NAME-studies.db
OPTUNA_DB_NAME = "moetune" + STUDIES_SUFFIX  # that of the default profile database, moetune.db


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a batch scheduler ending the job) while tuning, raised by the CLI's handler: a
    KeyboardInterrupt, so all that Ctrl-C does happens (the trial marked cut short, the bench workers ended, the
    run recorded as interrupted)."""


# ---------------------------------------------------------------------------------------------------
# storage


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
    """`postgresql://` means psycopg 3 when psycopg2 is not installed (SQLAlchemy defaults to psycopg2)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


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


def refuse_default_storage(url: str) -> None:
    """StorageRefused where the default studies file beside a profile database is itself a moetune profile database
    (a database named `x-studies.db` beside `x.db`): the default is never inside a profile database (an explicit
    --storage may share one on purpose)."""
    from moetune.tuner.store._schema import VERSION_TABLE

    path = sqlite_path(url) if is_sqlite(url) else None
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return
    try:
        tables = existing_tables(path, timeout_s=30)
    except sqlite3.Error:
        return  # not readable as SQLite: make_storage says what is wrong
    if VERSION_TABLE in tables:
        raise StorageRefused(f"{path} is a moetune profile database, not a studies file: the default studies file is "
                             "never inside one; pass --storage (a new file, or this one to share it on purpose)")


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
        return GuardedRDBStorage(url, engine_kwargs={"pool_pre_ping": True}, heartbeat_interval=10,
                                          grace_period=60, **{cb: _stale_trial})


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

    engine = sqlalchemy.create_engine(url, **({"pool_pre_ping": True} if not is_sqlite(url) else {}))
    try:
        tables = set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    _need_tables(url.split("@")[-1], tables)
    return optuna.storages.RDBStorage(url, skip_table_creation=True)


def _need_tables(where: str, tables: set[str]) -> None:
    missing = missing_optuna_tables(tables)
    if missing:
        raise NotAStudiesFile(f"{where} is not an Optuna studies storage (no {', '.join(missing)} table"
                              f"{'s' if len(missing) > 1 else ''}); it is left as it is")


def study_name(key: ProfileKey, backend_label: str, model_name: str, config: str = "") -> str:
    """Deterministic: the same key, backend and `config` (`study_config`) always open the same study
    (resume after a crash); other measurement settings open another."""
    return (f"{STUDY_PREFIX}{key.transport_family}/{model_name}/S{key.token_bucket}/ep{key.ep_size}n{key.nodes}/"
            f"{backend_label}/{_short(key.fingerprint, 12)}-{_short(key.software, 8)}" + (f"-{config}" if config else ""))


def study_model_name(model: ModelShape) -> str:
    """The model's name in a study name: one per shape, however the shape was spelt. A known model's shape is its name
    (`custom:2048,768,128,8` is qwen3-30b), another custom shape `custom:H,I,E,K` with `,DTYPE` unless bfloat16 (what
    `custom:H,I,E,K` and `custom:H,I,E,K,bfloat16` both are: the daemon's re-tune spells the dtype out). A shape named
    otherwise (a program's own ModelShape) keeps its name. Two spellings of one shape were two studies of one key: a
    rerun started over, and the neighbouring bucket's study was not found."""
    shape = (model.hidden, model.intermediate, model.experts, model.topk, model.dtype)
    known = next((m.name for m in MODELS.values() if (m.hidden, m.intermediate, m.experts, m.topk, m.dtype) == shape),
                 None)
    if known is not None:
        return known
    if not model.name.startswith("custom:"):
        return model.name
    return f"custom:{model.hidden},{model.intermediate},{model.experts},{model.topk}" + (
        "" if model.dtype == "bfloat16" else f",{model.dtype}")


def study_config(space: SearchSpace, backend: BenchmarkBackend, workload: TuneWorkload) -> str:
    """A short digest of what decides a trial's number besides the key and the backend's label: the routing,
    the policy (the space searched) and the backend's settings (the metric of a local run, a model's preset).
    A rerun with other settings must not resume a study whose trials measured something else."""
    policy = {k: v for k, v in space.policy.to_dict().items() if k not in ("description", "sources")}
    config: dict[str, Any] = {"routing": workload.routing, "policy": policy, "backend": backend.settings()}
    grid = space.grid_rule()  # proxy/ibgda PUT grid bounded by the bucket's token count: another digest
    if grid:  # (absent otherwise: the digests of other spaces stay as they were)
        config["space"] = grid
    blob = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def _short(h: str, n: int) -> str:
    """A hex hash's first n digits; anything else (e.g. `preset:NAME:DIGEST`) is hashed first."""
    if all(c in "0123456789abcdef" for c in h.lower()) and len(h) >= n:
        return h[:n]
    return hashlib.sha256(h.encode()).hexdigest()[:n]


_ASKED: set[tuple[str, int]] = set()  # (storage, trial id) of every trial this process asked for


def _storage_id(storage: optuna.storages.BaseStorage) -> str:
    backend = getattr(storage, "_backend", storage)  # Optuna wraps an RDB storage in a cache
    return str(getattr(backend, "url", id(backend)))


class _Sampler(optuna.samplers.TPESampler):
    """TPE that records whose trial it is as soon as Optuna has created it: `before_trial` runs in
    `Trial.__init__` (from `ask`), before any parameter is sampled, and writes the trial's `worker` attr through
    the storage. A RUNNING trial without one is then a trial whose creator died between Optuna's create and this
    hook (or this process's own within that instant: noted in `_ASKED`)."""

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        _ASKED.add((_storage_id(study._storage), trial._trial_id))
        if "worker" not in trial.user_attrs:
            study._storage.set_trial_user_attr(trial._trial_id, "worker", current_worker())
        super().before_trial(study, trial)


def make_sampler(seed: int | None, n_startup_trials: int = 10) -> optuna.samplers.TPESampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _Sampler(multivariate=True, group=True, seed=seed, n_startup_trials=n_startup_trials)


def open_study(name: str, storage: str | optuna.storages.BaseStorage, *, seed: int | None = None,
               n_startup_trials: int = 10, pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    """Create or load the study. On SQLite this process registers itself in it and fails the running trials of
    processes that are gone (`fail_interrupted`), before it asks for any trial. With heartbeats (a server storage) a
    running trial without a heartbeat is given one (`beat_unbeaten`) and the stale ones are failed. A trial failed
    before its objective tagged it has its warm-start point enqueued again (`record_untagged`)."""
    st = make_storage(storage) if isinstance(storage, str) else storage
    study = optuna.create_study(study_name=name, storage=st, direction="minimize", load_if_exists=True,
                                sampler=make_sampler(seed, n_startup_trials), pruner=pruner or optuna.pruners.NopPruner())
    url = storage if isinstance(storage, str) else getattr(storage, "url", "")
    if isinstance(url, str) and is_sqlite(url):
        fail_interrupted(study)
    elif beat_unbeaten(study) is not None:  # heartbeats on (a server storage)
        with warnings.catch_warnings():  # "experimental": a note for Optuna users, not ours
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)  # before the budget is counted (Optuna's loop does it per trial)
    record_untagged(study)
    return study


def beat_unbeaten(study: optuna.Study) -> int | None:
    """On a storage with heartbeats (a server one): give each RUNNING trial of the study that has no heartbeat one,
    dated now by the database's clock, so it is failed as stale (`_stale_trial`) a grace period later unless its
    worker beats. Optuna never finds a trial without a heartbeat stale: a worker killed after creating a trial and
    before its first beat (this version beats at creation, `GuardedRDBStorage`; an older one after `ask()`, its
    sampling included) left it RUNNING for good. A live worker's trial is not failed: its own beats (every
    `heartbeat_interval`, 10 s) update the row, well within the grace period (60 s). Several hosts share such a
    storage, so no pid is checked here (another host's cannot be). Returns how many it gave one; None where
    heartbeats are off (nothing done)."""
    import sqlalchemy
    from optuna.storages._rdb import models

    backend = getattr(study._storage, "_backend", study._storage)
    if not isinstance(backend, optuna.storages.RDBStorage) or backend.heartbeat_interval is None:
        return None
    trials, beats = models.TrialModel.__table__, models.TrialHeartbeatModel.__table__
    unbeaten = sqlalchemy.select(trials.c.trial_id, sqlalchemy.func.now()).where(
        trials.c.study_id == study._study_id, trials.c.state == TrialState.RUNNING,
        ~sqlalchemy.exists().where(beats.c.trial_id == trials.c.trial_id))
    try:
        with uninterrupted(), backend.engine.begin() as conn:  # a storage call as Optuna's are (`GuardedRDBStorage`)
            return conn.execute(beats.insert().from_select(["trial_id", "heartbeat"], unbeaten)).rowcount or 0
    except sqlalchemy.exc.IntegrityError:  # a worker (or another opening) gave one of them a heartbeat meanwhile
        return 0


def _worker_alive(worker: Any) -> bool:
    """Whether the process a `worker` (host:pid:run:ticks; host:pid:run and host:pid in older records) names still
    runs on this host. `ticks`: its start in clock ticks since boot (/proc/<pid>/stat's field 22): on Linux it is
    alive iff that pid's stat has those ticks and is not a zombie's (a pid reused by a later process has other
    ticks). No clock is compared: the time zone, a DST change or an NTP step of the writer cannot make it look dead.
    Without ticks (an older record) or without /proc: os.kill(pid, 0), a zombie being gone."""
    text = str(worker or "")
    if text == current_worker():
        return True  # this process: its trial is in flight (another study object of it, or a thread)
    parts = text.split(":")
    if len(parts) not in (2, 3, 4):
        return False
    host, pid = parts[0], parts[1]
    if host != socket.gethostname() or not pid.isdigit():
        return False  # no attr, or another host (cannot tell)
    if int(pid) == os.getpid():
        return False  # this pid with another (or no) run id: an earlier process whose pid this one reuses
    if len(parts) == 4 and parts[3].isdigit():
        same = _proc.same_process(int(pid), int(parts[3]))
        if same is not None:
            return same
    return not _proc.pid_gone(int(pid))


# (storage, study id) -> (storage, study id) of every study this process registered in and has not left yet
_REGISTERED: dict[tuple[str, int], tuple[optuna.storages.BaseStorage, int]] = {}
_REGISTRIES: set[tuple[str, int]] = set()  # every study this process has registered in (a study with a registry)


def _registration() -> tuple[str, dict[str, Any]]:
    """This process's key and value in a study's worker registry."""
    value: dict[str, Any] = {"run": _RUN, "since": _REGISTERED_AT.isoformat()}
    ticks = _start_ticks()
    if ticks is not None:
        value["ticks"] = ticks
    return f"{WORKER_KEY}{_host_pid()}", value


def register_worker(study: optuna.Study) -> None:
    """Record this process in the study before it asks for a trial. Optuna creates a trial RUNNING before the
    sampler's `before_trial` records its `worker`: a process opening the study in that instant must see that a
    live process may own the trial. One key per host:pid (a reused pid overwrites a dead one's). Removed again
    when this process is done with the study (`unregister_worker`: the end of `run_study`, else at exit)."""
    key, value = _registration()
    study._storage.set_study_system_attr(study._study_id, key, value)
    if not _REGISTERED:
        atexit.register(_unregister_all)
    _REGISTERED[(_storage_id(study._storage), study._study_id)] = (study._storage, study._study_id)
    _REGISTRIES.add((_storage_id(study._storage), study._study_id))


def _delete_registration(storage: optuna.storages.BaseStorage, study_id: int, key: str, value: Any) -> bool:
    """Delete worker registration `key` of the study if it still holds `value` (a live process that has just
    registered under the same host:pid is left alone). Optuna has no call to delete a study attr: a plain DELETE
    on its standard table, on an RDB storage only."""
    import sqlalchemy

    backend = getattr(storage, "_backend", storage)
    if not isinstance(backend, optuna.storages.RDBStorage):
        return False
    with backend.engine.begin() as conn:
        n = conn.execute(sqlalchemy.text("DELETE FROM study_system_attributes WHERE study_id = :s AND key = :k "
                                         "AND value_json = :v"),
                         {"s": study_id, "k": key, "v": json.dumps(value)}).rowcount
    return bool(n)


def unregister_worker(study: optuna.Study) -> None:
    """Remove this process's registration from the study (it asks for no more trials of it). Best effort: one
    left behind (a process killed) is deleted by the next `fail_interrupted` on this host."""
    _leave(study._storage, study._study_id)


def _leave(storage: optuna.storages.BaseStorage, study_id: int) -> None:
    if _REGISTERED.pop((_storage_id(storage), study_id), None) is None:
        return
    key, value = _registration()
    try:
        _delete_registration(storage, study_id, key, value)
    except Exception as e:  # broad: never fail a run (or its Ctrl-C) over a registration fail_interrupted cleans
        log.debug("could not remove this process's worker registration from study %s: %s", study_id, e)


def _unregister_all() -> None:
    """At exit (a normal end, or one by an exception or Ctrl-C): every registration this process still holds."""
    for storage, study_id in list(_REGISTERED.values()):
        _leave(storage, study_id)


def _registered_worker(name: str, value: dict[str, Any]) -> str:
    """The worker (host:pid:run:ticks, or host:pid:run from a registration without ticks) a registration names."""
    ticks = value.get("ticks")
    return _worker_id(name, value.get("run"), ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else None)


def _live_registrations(study: optuna.Study) -> list[datetime]:
    """The `since` of each live registered worker of the study other than this process: when that process loaded
    this module (`_REGISTERED_AT`), before it asked for any trial, not when it registered. A registration of this
    host whose process is gone is deleted (another host's cannot be checked: it is kept)."""
    out = []
    me = _registration()[0]
    host = socket.gethostname()
    for k, v in study._storage.get_study_system_attrs(study._study_id).items():
        if not k.startswith(WORKER_KEY) or k == me:
            continue  # this process's own trials are known by `_ASKED`
        name = k[len(WORKER_KEY):]
        since = None
        if isinstance(v, dict):
            with contextlib.suppress(ValueError):
                since = datetime.fromisoformat(str(v.get("since")))
        if since is not None and _worker_alive(_registered_worker(name, v)):
            out.append(since)
        elif name.split(":")[0] == host:
            try:
                _delete_registration(study._storage, study._study_id, k, v)
            except Exception as e:  # broad: a registration left behind costs one os.kill per opening, no more
                log.debug("could not delete the worker registration %s of a process that is gone: %s", k, e)
    return out


def _maybe_owned(study: optuna.Study, t: optuna.trial.FrozenTrial, live: list[datetime]) -> bool:
    """Whether a live process may own RUNNING trial `t`. With a `worker` attr: that process is alive (and started
    before the trial). Without one (its creator had not yet reached the sampler's `before_trial`): this process
    asked for it, or the trial is fresh (at most FRESH_TRIAL old) and another live registered worker was already
    running when it started (its `since` is no later than the trial's start: any trial a worker creates starts after
    its `since`, and it registers before it asks, so a live creator is among these)."""
    if "worker" in t.user_attrs:
        return _worker_alive(t.user_attrs["worker"])
    if (_storage_id(study._storage), t._trial_id) in _ASKED:
        return True
    start = t.datetime_start
    if start is None or _now() - start > FRESH_TRIAL:
        return False
    return any(since <= start + CLOCK_SLACK for since in live)


def fail_interrupted(study: optuna.Study) -> int:
    """Register this process, then mark FAIL the RUNNING trials no live process can own. A live one's are left
    alone: two processes may open one SQLite study (the daemon's re-tune and a `moetune tune`), and failing the
    other's running trial made it crash on its result ("Cannot tell a COMPLETE trial") and lose the measurement;
    that included a trial so fresh that its creator had not yet recorded its worker. Registrations of this host's
    processes that are gone are deleted."""
    register_worker(study)
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    live = _live_registrations(study)
    n = 0
    for t in running:
        if _maybe_owned(study, t, live):
            continue
        try:
            study._storage.set_trial_user_attr(t._trial_id, "error", "interrupted (the tuning process died)")
            study._storage.set_trial_user_attr(t._trial_id, INTERRUPTED, "the tuning process died")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        except Exception:  # another worker finished it meanwhile
            continue
        n += 1
        requeue_warm_start(study, t._trial_id)
    return n


def record_untagged(study: optuna.Study) -> int:
    """Record in the study (`interrupted:<id>`, as a stale trial is) each FAIL trial cut short before its objective
    tagged it (no `interrupted` tag, no `error`: `is_interrupted`), and enqueue again the warm-start point it carried,
    which its objective's handler did not. Each is claimed by one INSERT (`_claim_study_attr`): of two processes
    opening the study at once one enqueues it, once. Returns how many this call recorded."""
    recorded = interrupted_ids(study)
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        if INTERRUPTED in t.user_attrs or "error" in t.user_attrs or t._trial_id in recorded:
            continue
        if not _claim_study_attr(study, f"{INTERRUPTED}:{t._trial_id}", "failed before its objective tagged it"):
            continue
        n += 1
        requeue_warm_start(study, t._trial_id)
    return n


def cut_short_by(e: BaseException) -> str:
    """What the `interrupted` attr of a trial that `e` cut short says: Ctrl-C or SIGTERM where `e` is one or was
    raised while one unwound (Optuna's "UnboundLocalError: ... 'updated_state'" after an interrupt in its tell)."""
    interrupt = next((x for x in exception_chain(e) if isinstance(x, KeyboardInterrupt)), None)
    if interrupt is not None:
        return "interrupted (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted (Ctrl-C)"
    return f"cut short by an error ({type(e).__name__}: {str(e)[:200]})"


def fail_in_flight(study: optuna.Study, trial_ids: set[int], why: str) -> int:
    """Mark FAIL, as interrupted (`why`), those of `trial_ids` still RUNNING: trials this process made RUNNING whose
    run an interrupt (or an error) cut short where Optuna does not fail them itself: inside `ask()` (between the
    trial's creation and its first parameter), between `ask()` and the objective, or in `tell()` before the
    state is written. Left RUNNING, such a trial was never finished by anyone while this process lived (it is a
    live process's), on a server storage never at all (it had no heartbeat), and `tune show` listed it as running.
    Each carried warm-start point is enqueued again (once: the objective's own clean-up may have done it). Runs
    `uninterrupted`: a second Ctrl-C waits for it (a third is raised at once). Returns how many it failed."""
    n = 0
    with uninterrupted():
        for tid in sorted(trial_ids):
            try:
                t = study._storage.get_trial(tid)
                if t.state != TrialState.RUNNING:
                    continue
                requeued = INTERRUPTED in t.user_attrs  # the objective marked it, and requeued its point
                if not requeued:
                    study._storage.set_trial_user_attr(tid, INTERRUPTED, why)
                if "error" not in t.user_attrs:  # a failed measurement's own error stays
                    study._storage.set_trial_user_attr(tid, "error", why)
                if not study._storage.set_trial_state_values(tid, TrialState.FAIL):
                    continue
            except Exception as e:  # broad: finished meanwhile (a stale check), or the storage fails: never mask
                log.debug("could not fail trial %s left running: %s", tid, e)
                continue
            n += 1
            if not requeued:
                try:
                    requeue_warm_start(study, tid)
                except Exception as e:  # broad, as above
                    log.debug("could not enqueue again the warm-start point of trial %s: %s", tid, e)
    return n


def _stale_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """RDB heartbeat callback: a trial of a worker that stopped beating was failed; it was cut short. It is
    already FAIL (its attrs are frozen), so the study records it."""
    study._storage.set_study_system_attr(study._study_id, f"{INTERRUPTED}:{trial._trial_id}", "its worker stopped")
    requeue_warm_start(study, trial._trial_id)


def requeue_warm_start(study: optuna.Study, trial_id: int) -> bool:
    """Enqueue again the warm-start point an interrupted trial carried (`skip_if_exists` would find the
    failed trial and skip it: the policy default would never be measured)."""
    t = study._storage.get_trial(trial_id)
    fixed = t.system_attrs.get("fixed_params")
    if "warm_start" not in t.user_attrs or not fixed:
        return False
    study.enqueue_trial(dict(fixed), user_attrs={"warm_start": t.user_attrs["warm_start"]})
    return True


def interrupted_ids(study: optuna.Study) -> set[int]:
    """Trial ids the study records as cut short (those failed by the heartbeat check)."""
    return _interrupted_ids(study._storage, study._study_id)


def _interrupted_ids(storage: optuna.storages.BaseStorage, study_id: int) -> set[int]:
    return {int(k.split(":", 1)[1]) for k in storage.get_study_system_attrs(study_id)
            if k.startswith(INTERRUPTED + ":")}


def is_interrupted(t: optuna.trial.FrozenTrial, ids: set[int] | frozenset[int] = frozenset()) -> bool:
    """A FAIL trial cut short, not a failed measurement: tagged `interrupted`, recorded in the study (`ids`), or
    failed with no `error`. The objective writes a failed measurement's `error` before it returns (before Optuna's
    FAIL); its interrupt handler's tag can be missed (a second Ctrl-C before it is written, an error raised out of the
    objective), and Optuna then fails the trial with neither: such a trial measured nothing."""
    return t.state == TrialState.FAIL and (INTERRUPTED in t.user_attrs or t._trial_id in ids
                                           or "error" not in t.user_attrs)


def finished_trials(study: optuna.Study) -> int:
    """Finished trials of the budget: an interrupted one is not (its point was never measured)."""
    return _finished_in(study._storage, study._study_id)


def _finished_in(storage: optuna.storages.BaseStorage, study_id: int) -> int:
    ids = _interrupted_ids(storage, study_id)
    return sum(1 for t in storage.get_all_trials(study_id, deepcopy=False, states=FINISHED) if not is_interrupted(t, ids))


def failed_before(study: optuna.Study) -> int:
    """The finished trials that do not count toward a run's budget: all of them while the study holds no COMPLETE
    trial (every trial failed: timed out, a bad interface), so a rerun tries the study again with its whole budget
    instead of taking it as finished; 0 once a trial completed (a resumed search counts what it ran)."""
    return 0 if completed(study) else finished_trials(study)


def _first_error(trials: Sequence[optuna.trial.FrozenTrial], cut: set[int]) -> str:
    """The error of the first failed trial (what a user needs to fix), or "" where none is recorded. A trial cut short
    (its process died, Ctrl-C: its id in `cut`) says nothing of the setting: a real failure's error comes first."""
    failed = [t for t in trials if t.state == TrialState.FAIL and t.user_attrs.get("error")]
    first = next((t for t in failed if not is_interrupted(t, cut)), failed[0] if failed else None)
    return str(first.user_attrs["error"]) if first is not None else ""


def completed(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None and math.isfinite(t.value)]


# ---------------------------------------------------------------------------------------------------
# one study


@dataclass
class StudyResult:
    study_name: str
    family: str
    workload: TuneWorkload
    best_knobs: Knobs | None
    best: Measurement | None
    trials: int
    complete: int
    failed: int
    pruned: int
    default_value: float | None = None
    top: list[Knobs] = field(default_factory=list)
    # the error of the first failed trial (`_first_error`), read as the study is summed up: why a study without a
    # successful trial gave nothing, for the caller to say without loading the study again ("" where none failed)
    first_error: str = ""


@dataclass
class BucketPrior:
    """What a neighbouring (smaller) token bucket's study already measured."""

    bucket: int
    study_name: str
    values: dict[Knobs, float]

    @property
    def best(self) -> float:
        return min(self.values.values())

    def top(self, n: int = 3) -> list[Knobs]:
        return [k for k, _ in sorted(self.values.items(), key=lambda kv: kv[1])[:n]]


class _Objective:
    def __init__(self, space: SearchSpace, backend: BenchmarkBackend, workload: TuneWorkload, prune: bool,
                 cross: BucketPrior | None = None, cross_factor: float = 1.5):
        self.space = space
        self.backend = backend
        self.workload = workload
        self.prune = prune
        self.cross = cross
        self.cross_factor = cross_factor

    def _cross_bucket_prune(self, trial: optuna.Trial, knobs: Knobs) -> None:
        """Skip a setting that the neighbouring bucket already measured clearly bad (no benchmark run).
        Warm-start points (the policy default, priors) are always measured."""
        c = self.cross
        if c is None or "warm_start" in trial.user_attrs:
            return
        v = c.values.get(knobs)
        if v is not None and v > self.cross_factor * c.best:
            trial.set_user_attr("pruned_by", {"bucket": c.bucket, "value_us": v, "best_us": c.best,
                                              "factor": self.cross_factor})
            raise optuna.TrialPruned(f"{v:.1f} µs at bucket {c.bucket}, over {self.cross_factor}× its best")

    def __call__(self, trial: optuna.Trial) -> float:
        try:
            return self._run(trial)
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: Optuna fails the trial; mark it cut short, not finished
            trial.set_user_attr(INTERRUPTED, cut_short_by(e))
            requeue_warm_start(trial.study, trial._trial_id)
            raise

    def _run(self, trial: optuna.Trial) -> float:
        if not isinstance(trial.study.sampler, _Sampler):  # ours recorded it before sampling (`before_trial`)
            trial.set_user_attr("worker", current_worker())  # first: whoever opens the study sees whose trial it is
        knobs = self.space.suggest(trial)
        trial.set_user_attr("knobs", knobs.to_dict())
        ok, why = self.space.feasible(knobs)
        if not ok:  # cannot happen by construction; never benchmark it if it does
            trial.set_user_attr("infeasible", why)
            raise optuna.TrialPruned(f"infeasible: {why}")
        self._cross_bucket_prune(trial, knobs)

        def report(step: int, value: float) -> bool:
            if not self.prune:
                return False
            trial.report(value, step)
            return trial.should_prune()

        m = self.backend.evaluate(knobs, self.workload, report=report)
        trial.set_user_attr("samples", [float(x) for x in m.samples])
        if m.details:
            trial.set_user_attr("details", m.details)
        if m.infeasible:
            trial.set_user_attr("infeasible", m.error or "infeasible")
            raise optuna.TrialPruned(f"infeasible: {m.error}")
        if not m.ok or math.isnan(m.median_us):  # a FAIL with its `error`: a failure, not a trial cut short
            trial.set_user_attr("error", m.error or ("failed" if not m.ok else "no time measured (NaN)"))
            return math.nan  # recorded as FAIL; the study goes on
        trial.set_user_attr("spread_us", float(m.spread_us))
        if m.pruned:
            raise optuna.TrialPruned(f"worse than the median after {len(m.samples)} repeat(s)")
        return float(m.median_us)


class _BudgetCallback:
    """Stop once the study holds `n` finished trials (counted across every worker on the storage)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if finished_trials(study) >= self.n:
            study.stop()


# The marker study by which earlier versions let one worker of a shared study enqueue the whole warm start (`tune
# show` leaves such markers out); each point is now claimed on its own (`_claim_warm_point`).
WARM_LOCK_SUFFIX = "/.warm-start-lock"
WARM_POINT_KEY = "warm-start:"  # study system attr `warm-start:<digest of the params>`: that point was enqueued


def _claim_warm_point(study: optuna.Study, params: dict[str, Any], name: str) -> bool:
    """Whether this process enqueues warm-start point `params`: the first to claim it in the study does, on every RDB
    storage (the SQLite file is shared too: the daemon's re-tune and a `moetune tune`). `enqueue_trial`'s
    `skip_if_exists` checks and inserts in two transactions, so two processes both found the point missing and both
    enqueued it (Optuna#2925). The claim is one INSERT of a study system attr: Optuna's table has a unique
    (study_id, key), so of two processes exactly one inserts it. A process killed between its claim and its
    enqueue loses that point for the study (TPE still runs). Another storage (in memory) is one process's: True."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return _claim_study_attr(study, WARM_POINT_KEY + digest, {"name": name, "worker": current_worker()})


def _claim_study_attr(study: optuna.Study, key: str, value: Any) -> bool:
    """Set study system attr `key` unless it is set: one INSERT on an RDB storage (Optuna's table has a unique
    (study_id, key); Optuna's own setter overwrites), so of two processes exactly one gets True. Another storage (in
    memory) is one process's: set when missing."""
    import sqlalchemy

    backend = getattr(study._storage, "_backend", study._storage)  # Optuna wraps an RDB storage in a cache
    if not isinstance(backend, optuna.storages.RDBStorage):
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


def enqueue_warm_start(study: optuna.Study, space: SearchSpace, extra: Sequence[tuple[str, Knobs]] = ()) -> int:
    """Enqueue the policy default, the analytic priors and `extra`, each once per study, however many processes
    open it at once (`_claim_warm_point`), and not when the study already holds a trial of it (`skip_if_exists`: a
    study enqueued before the claims, or a point TPE sampled). A resumed study gets the points that are new (the
    best settings of a neighbouring bucket measured since). Returns how many points this call claimed."""
    n = 0
    for name, knobs in [*space.priors(), *extra]:
        try:
            params = space.params_of(knobs)
        except KnobError as e:
            log.info("warm start %s skipped: %s", name, e)
            continue
        if not _claim_warm_point(study, params, name):
            continue
        study.enqueue_trial(params, user_attrs={"warm_start": name}, skip_if_exists=True)
        n += 1
    return n


def run_study(study: optuna.Study, space: SearchSpace, backend: BenchmarkBackend, workload: TuneWorkload, *,
              trials: int, timeout_s: float | None = None, callbacks: Sequence[Callable[..., None]] = (),
              extra_warm: Sequence[tuple[str, Knobs]] = (), prune: bool | None = None,
              warm_start: bool = True, cross: BucketPrior | None = None) -> StudyResult:
    """Run (or resume) a study until it holds `trials` finished trials or `timeout_s` passes."""
    if prune is None:
        prune = backend.remeasures and backend.repeats > 1
    if prune and isinstance(study.pruner, optuna.pruners.NopPruner):
        study.pruner = optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=0)
    family = space.policy.family
    study.set_user_attr("family", family)
    study.set_user_attr("workload", workload.to_dict())
    study.set_user_attr("backend", backend.label)
    study.set_user_attr("modelled", backend.modelled)
    study.set_user_attr("policy", space.policy.to_dict())
    if warm_start:
        enqueue_warm_start(study, space, extra_warm)
    # a study of failed trials only is tried again with the whole budget (`failed_before`)
    base = failed_before(study)
    remaining = trials + base - finished_trials(study)
    if remaining > 0 and (timeout_s is None or timeout_s > 0):
        objective = _Objective(space, backend, workload, prune, cross=cross)
        registry = (_storage_id(study._storage), study._study_id) in _REGISTRIES
        if registry:
            register_worker(study)  # again when an earlier run_study on this study object left it
        try:
            with warnings.catch_warnings(), trials_in_flight(study._storage) as in_flight:
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                try:
                    study.optimize(objective, n_trials=remaining, timeout=timeout_s,
                                   callbacks=[_BudgetCallback(trials + base), *callbacks], gc_after_trial=False)
                except BaseException as e:  # no trial of this process is left RUNNING (`fail_in_flight`)
                    fail_in_flight(study, in_flight, cut_short_by(e))
                    raise
        finally:  # done asking (or interrupted): this process leaves the study's worker registry
            if registry:
                unregister_worker(study)
    return summarize_study(study, space, workload)


def summarize_study(study: optuna.Study, space: SearchSpace, workload: TuneWorkload) -> StudyResult:
    trials = study.get_trials(deepcopy=False)
    done = sorted(completed(study), key=lambda t: t.value)  # type: ignore[arg-type, return-value]
    best_knobs = best = None
    top: list[Knobs] = []
    for t in done:
        try:
            k = Knobs.from_dict(t.user_attrs["knobs"]) if "knobs" in t.user_attrs else space.knobs_from_params(t.params)
        except (KnobError, KeyError):
            continue
        if best_knobs is None:
            best_knobs = k
            best = Measurement(float(t.value), float(t.user_attrs.get("spread_us", 0.0)),  # type: ignore[arg-type]
                               list(t.user_attrs.get("samples", [t.value])), True,
                               details=dict(t.user_attrs.get("details", {})))
        if k not in top:
            top.append(k)
        if len(top) >= 3:
            break
    default_value = None
    for t in done:
        if t.user_attrs.get("warm_start") == "policy_default":
            default_value = float(t.value)  # type: ignore[arg-type]
            break
    cut = interrupted_ids(study)
    count = {s: sum(1 for t in trials if t.state == s and not is_interrupted(t, cut)) for s in FINISHED}
    return StudyResult(study.study_name, space.policy.family, workload, best_knobs, best,
                       trials=sum(count.values()), complete=count[TrialState.COMPLETE], failed=count[TrialState.FAIL],
                       pruned=count[TrialState.PRUNED], default_value=default_value, top=top,
                       first_error=_first_error(trials, cut))


# ---------------------------------------------------------------------------------------------------
# neighbouring token buckets


def neighbour_bucket(storage: optuna.storages.BaseStorage, key: ProfileKey, backend_label: str,
                     model_name: str, config: str = "") -> BucketPrior | None:
    """The nearest smaller token bucket's study of the same key and backend in `storage`, if any
    (from this run or an earlier one): its best settings warm-start this bucket, and with an expensive
    backend its clearly bad settings are not measured again."""
    import msgspec

    try:
        names = set(optuna.get_all_study_names(storage))
    except Exception:  # broad: the warm start is optional; an unreadable storage only means no neighbour
        return None
    for b in sorted((b for b in TOKEN_BUCKETS if b < key.token_bucket), reverse=True):
        name = study_name(msgspec.structs.replace(key, token_bucket=b), backend_label, model_name, config)
        if name not in names:
            continue
        study = optuna.load_study(study_name=name, storage=storage)
        values: dict[Knobs, float] = {}
        for t in completed(study):
            try:
                values[Knobs.from_dict(t.user_attrs["knobs"])] = float(t.value)  # type: ignore[arg-type]
            except (KeyError, KnobError):
                continue
        if values:
            return BucketPrior(b, name, values)
    return None



# ---------------------------------------------------------------------------------------------------
# reading studies back (`moetune tune show`)


def exception_chain(e: BaseException | None) -> list[BaseException]:
    """e and what it was raised from or while handling (`__cause__`, else `__context__`), each once."""
    out: list[BaseException] = []
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def changed_while_read(e: BaseException) -> bool:
    """Whether a read failed because a writer changed the SQLite file under it (`sqlite_open.DatabaseChanged`, also
    where Optuna wrapped it: StorageInternalError "...invalid data in the commit...")."""
    from moetune.runtime.profiles import sqlite_open

    return any(isinstance(x, sqlite_open.DatabaseChanged) for x in exception_chain(e))


def _read_again(fn: Callable[[], T]) -> T:
    """fn() run again (a fresh read-only storage each time) while the file changed under it, as `sqlite_open.read`
    does: up to sqlite_open.READ_ATTEMPTS times, then its error."""
    from moetune.runtime.profiles import sqlite_open

    return sqlite_open.retry_changed(fn, changed_while_read)


def list_studies(storage: str) -> list[dict[str, Any]]:
    """Every moetune study in the storage (read only; read again while a writer changed the file under the read)."""
    return _read_again(lambda: _list_studies(storage))


def _list_studies(storage: str) -> list[dict[str, Any]]:
    st = open_readonly_storage(storage)
    out = []
    for s in optuna.get_all_study_summaries(st, include_best_trial=True):
        if not s.study_name.startswith(STUDY_PREFIX) or s.study_name.endswith(WARM_LOCK_SUFFIX):
            continue
        best = s.best_trial
        # the trials the tune counts (finished, not cut short): n_trials also counted the warm-start points still
        # WAITING and the interrupted ones (`tune --trials 1` said 1 trial, `tune show` 3)
        out.append({"study": s.study_name, "trials": _finished_in(st, s._study_id),
                    "best_us": best.value if best is not None else None,
                    "family": s.user_attrs.get("family"), "backend": s.user_attrs.get("backend"),
                    "modelled": s.user_attrs.get("modelled")})
    return out


class NotAMoetuneStudy(ValueError):
    """A study `describe_study` will not describe: not moetune's (another program's values are not latencies)."""


# What the study's numbers are: each trial ran alone, at its own time, so two of them differ by the noise between runs
# too; a ratio of them is no measured speed-up (the side-by-side check decides what is stored).
SEARCH_TRIALS_NOTE = ("search trials, each measured alone (not side by side): their difference includes the noise "
                      "between runs, so no speed-up is read from them")
# A model study's trials were never measured: each is the fabric model's (deterministic) prediction.
MODELLED_TRIALS_NOTE = ("search trials, each a MODELLED prediction of the fabric model (not measured): their "
                        "difference is the model's, so no measured speed-up is read from them")


def describe_study(storage: str, name: str, store: Any = None) -> dict[str, Any]:
    """One moetune study's summary (KeyError: no such study; NotAMoetuneStudy: a study without moetune's prefix);
    read again while a writer changed the file under the read. `store` (a profile Store, or None): what it holds for
    the study's key is added as `stored` (None: nothing), the number a speed-up is read from where one was stored."""
    d = _read_again(lambda: _describe_study(storage, name))
    if store is not None:
        d["stored"] = stored_for_key(store, d.get("key"), d.get("best_knobs"))
    return d


def stored_for_key(store: Any, key: dict[str, Any] | None, best_knobs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The current profile `store` holds for a study's `key` (a dict): its knobs, number, source and provenance (its
    effective one, as the runtime takes it), and whether its knobs are the study's best; None when it holds none (or the study recorded no key)."""
    if not key:
        return None
    rec = store.get_current(ProfileKey(**key))
    if rec is None:
        return None
    return {"knobs": rec.knobs.to_dict(), "latency_us": rec.latency_us, "spread_us": rec.spread_us,
            # what the numbers are, as list/show/query and the runtime take them (a hand-edited "measured" label on a
            # modelling backend is modelled)
            "backend": rec.backend, "provenance": str(rec.effective_provenance), "updated": rec.updated,
            "is_study_best": best_knobs is not None and rec.knobs.to_dict() == dict(best_knobs)}


def _describe_study(storage: str, name: str) -> dict[str, Any]:
    st = open_readonly_storage(storage)
    study = optuna.load_study(study_name=name, storage=st)
    if not name.startswith(STUDY_PREFIX):
        raise NotAMoetuneStudy(f"study {name!r} is not a moetune study (its name does not start with "
                               f"{STUDY_PREFIX!r}): its objective values are not moetune's latencies, so `tune show` "
                               "does not describe it; read it with Optuna (or optuna-dashboard)")
    trials = study.get_trials(deepcopy=False)
    states = {s.name.lower(): sum(1 for t in trials if t.state == s) for s in TrialState}
    cut = interrupted_ids(study)
    done = completed(study)
    best = min(done, key=lambda t: t.value) if done else None  # type: ignore[arg-type, return-value]
    default = next((t for t in done if t.user_attrs.get("warm_start") == "policy_default"), None)
    importances: dict[str, float] = {}
    importance_note = ""
    try:
        if len(done) >= 2:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importances = {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
        else:
            importance_note = "needs at least 2 complete trials"
    except Exception as e:  # broad: importances are a nicety of the summary, never its failure
        importance_note = f"unavailable: {e}"
    return {
        "study": name,
        "family": study.user_attrs.get("family"),
        "backend": study.user_attrs.get("backend"),
        "modelled": study.user_attrs.get("modelled"),
        "workload": study.user_attrs.get("workload"),
        "key": study.user_attrs.get("key"),
        "trials": finished_trials(study),  # as the tune counts them (`states` has every trial, waiting too)
        "states": states,
        # of the `fail` ones, those cut short (Ctrl-C, a process that died): no failed measurement, not counted
        "interrupted": sum(1 for t in trials if is_interrupted(t, cut)),
        "best_us": best.value if best else None,
        "best_spread_us": best.user_attrs.get("spread_us") if best else None,
        "best_knobs": best.user_attrs.get("knobs") if best else None,
        "best_trial": best.number if best else None,
        "default_us": default.value if default else None,
        # no ratio of best_us and default_us: separate trials (SEARCH_TRIALS_NOTE) or predictions, never a measured speed-up
        "trials_note": MODELLED_TRIALS_NOTE if study.user_attrs.get("modelled") else SEARCH_TRIALS_NOTE,
        "importances": importances,
        "importance_note": importance_note,
        # an interrupted trial (SIGTERM, Ctrl-C) has no `error` of its own: "interrupted", never null (shown "None")
        "failed": [{"trial": t.number, "interrupted": is_interrupted(t, cut),
                    "error": str(t.user_attrs.get("error") or ("interrupted" if is_interrupted(t, cut) else
                                                                "no reason recorded"))}
                   for t in trials if t.state == TrialState.FAIL][:20],
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
