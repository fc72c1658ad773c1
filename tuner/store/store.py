"""The Store API: the profile database (SQLite through SQLAlchemy 2.0, schema by Alembic in migrations/).

Every connection runs with WAL, a busy timeout, foreign keys on and `synchronous=NORMAL`; every write
transaction starts with `BEGIN IMMEDIATE`, so two processes writing at once queue on the busy timeout
instead of failing on a lock upgrade (`connect`, `busy_timeout`). The database upgrades itself on first use
(unless read-only). The file's path, probe and refusal of another program's file: `db_file`; what a SQLite
failure means: `sqlite_errors`. Schema versions: `_schema`; export/import: `io`; record checks: `validate`;
the tables: `models`.

The exchange type is `moetune.runtime.profile_record.ProfileRecord`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Engine,
    Integer,
    String,
    case,
    create_engine,
    delete,
    event,
    func,
    literal,
    or_,
    select,
    type_coerce,
    union_all,
    update,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL
from sqlalchemy.exc import DatabaseError, IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool, StaticPool

from moetune.runtime import _once
from moetune.runtime.profile_record import (
    ENGINE_FAMILIES,
    PROVENANCES,
    UNIFORM_ROUTING,
    ProfileKey,
    ProfileRecord,
    comparable,
    effective_measured_on,
    effective_provenance,
    is_preset_fingerprint,
    nearest_bucket_within,
    node_model_label_problem,
    provenance_of_backend,
    runtime_refusal,
)
from moetune.runtime.profiles import sqlite_open
from moetune.tuner.store import busy_timeout as busy
from moetune.tuner.store import io as _io
from moetune.tuner.store._owner import node_id, owner_gone, run_owner
from moetune.tuner.store._rows import (
    PROVENANCE_RANK,
    current_of,
    decide,
    holds_profile,
    key_filter,
    now,
    records,
    replacement_event,
    row_from_record,
    select_records,
)
from moetune.tuner.store._schema import (
    MIGRATIONS_DIR,
    VERSION_TABLE,
    SchemaVersionManager,
    StoreBusy,
    StoreDamaged,
    StoreError,
    StoreFull,
    StoreNotDatabase,
    StoreNotWritable,
    StoreReplaced,
    StoreStopping,
    Upgraded,
    db_option,
    head_revision,
    is_sqlite_file,
    known_revisions,
)
from moetune.tuner.store.connect import DatabaseChangedError, on_begin, on_connect, readonly_connect, retried
from moetune.tuner.store.db_file import (
    _make_parent,
    database_path,
    foreign_error,
    not_a_file,
    probe,
    refuse_foreign,
    refuse_foreign_link,
    without_moetune_words,
)
from moetune.tuner.store.io import (
    EXPORT_FORMAT,
    EXPORT_VERSION,
    ExportedFingerprint,
    ImportResult,
    ProfileImportError,
    ProfilesFile,
    parse_export,
)
from moetune.tuner.store.models import (
    FINGERPRINT_ORIGINS,
    PROFILE_KEY_COLUMNS,
    Event,
    EventKind,
    Fingerprint,
    FingerprintOrigin,
    Measurement,
    Profile,
    TuningRun,
    check_event_kinds,
)
from moetune.tuner.store.sqlite_errors import damaged_message, is_locked, sqlite_failure
from moetune.tuner.store.validate import check_record, key_knobs_problem, measured_unrunnable_problem

_V = TypeVar("_V")
log = logging.getLogger("moetune.store")
# the _once scope of the unreadable-rows warning: one per process and database (it used to repeat on every read)
UNREADABLE_WARNING = "store.unreadable_profiles"

# Values in one IN (...): SQLite builds before 3.32 (RHEL 8's 3.26, ...) take at most 999 bound parameters in one
# statement ("too many SQL variables"). Every id list a statement takes whole is given in batches of this many.
IN_BATCH = 500


def in_batches(values: Sequence[_V]) -> Iterator[list[_V]]:
    """`values` in lists of at most IN_BATCH (none for none)."""
    values = list(values)
    for i in range(0, len(values), IN_BATCH):
        yield values[i:i + IN_BATCH]

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "MIGRATIONS_DIR",
    "VERSION_TABLE",
    "ExportedFingerprint",
    "ImportResult",
    "ProfileImportError",
    "ProfilesFile",
    "Row",
    "Store",
    "StoreBusy",
    "StoreDamaged",
    "StoreError",
    "StoreFull",
    "StoreNotDatabase",
    "StoreNotWritable",
    "StoreReplaced",
    "StoreStopping",
    "head_revision",
    "is_sqlite_file",
    "now",
    "parse_export",
]


class Row(dict):
    """A plain dict (JSON-ready) whose keys also read as attributes: `row.kind` == `row["kind"]`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Store:
    """The profile database. Cheap to open; close it (or use `with`) when done.

    `path` None → the configured database (`[store] db`, else `$MOETUNE_HOME/moetune.db`, else the XDG
    data dir). `":memory:"` gives a private in-memory database (tests). Safe to share between threads;
    after a fork the child drops the parent's pooled connections and opens its own.
    `intact`: a writer's open (tune, profile, serve, the write commands): an existing file is scanned once
    (`refuse_damaged`) before the schema check or upgrade; a StoreDamaged (the store closed) where it is damaged.

    Once this store finds its file damaged (a scan that fails, or SQLite's "malformed" answer to any of its
    statements), `damaged` holds why, for the store's life, and every write (a write session, a migration, an
    Optuna storage) raises StoreDamaged with it, the same file restored or not (the daemon's store stays open for
    weeks: a restored file is a restart's to open). Reads go on: the daemon keeps serving what it can still read (a
    read of a damaged page is a StoreDamaged of its own), and `moetune status` shows the damage.
    """

    def __init__(
        self, path: str | Path | None = None, *, readonly: bool = False, upgrade: bool = True, check_schema: bool = True,
        intact: bool = False,
    ):
        if path is None:
            from moetune.runtime.config import load_config

            path = load_config().db_path
        self.readonly = readonly
        self.memory = str(path) == ":memory:"
        self._checked_sound = False  # refuse_damaged passed (a full scan: once per open store)
        self._damaged: str | None = None  # why the file is damaged, once found: every later write refuses (`damaged`)
        # (dev, inode) of the file a writing store opened (`_check_same_file`); None until the file exists
        self._file_id: tuple[int, int] | None = None
        self._replaced: str | None = None  # why the file at the path is no longer that one, once seen (`damaged`)
        existing = False  # a non-empty file was there before this open (what `intact` scans)
        self._opened = threading.local()  # .conns: this thread's immutable=1 connections inside `_reads_checked`
        self._atomic = threading.local()  # .session: this thread's write session of an `atomic` body
        self._give_up = threading.Event()  # `stop_waiting`: no write waits for another connection's lock any more
        # thread ident -> when its `_write` transaction took the lock (None: waiting for it), for `write_open_s`
        self._writing: dict[int, float | None] = {}
        if self.memory:
            if readonly:
                raise StoreError("an in-memory database cannot be read-only")
            self.path = Path(":memory:")
            self.url = "sqlite://"
            self._engine = create_engine(
                "sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}
            )
        else:
            self.path = database_path(path)
            try:
                str(self.path).encode()
            except UnicodeEncodeError:  # argv's or the environment's non-UTF-8 bytes: the URL below is UTF-8 only
                raise StoreError(f"database path {str(self.path)!r} is not UTF-8 (the store opens its file through "
                                 "a UTF-8 URL): rename the file (or its folder)") from None
            # another user's link in /tmp (or any sticky, world-writable folder) chooses which file this opens and
            # writes: refused before anything at the path is read or created (fs.protected_symlinks may be off)
            refuse_foreign_link(self.path)
            self.url = URL.create("sqlite", database=str(self.path)).render_as_string(hide_password=False)
            if self.path.exists() and not self.path.is_file():
                raise not_a_file(self.path)
            if readonly and not self.path.is_file():
                raise StoreError(f"no database at {self.path}")
            existing = self.path.is_file() and self.path.stat().st_size > 0
            if existing:
                refuse_foreign(self.path, readonly=readonly)
            if readonly:
                # NullPool: every read opens its connection anew, so the mode=ro / immutable=1 choice and the
                # -wal/-journal guard are made per read, not once for the store's life (a pooled immutable=1
                # connection would read the file as it was, or torn, while a writer changes it).
                self._engine = create_engine(self.url, creator=self._connect_readonly, poolclass=NullPool)
            else:
                _make_parent(self.path)
                self._engine = create_engine(self.url, connect_args={"timeout": busy.BUSY_TIMEOUT_S})
        event.listen(self._engine, "connect", on_connect(readonly or self.memory))
        event.listen(self._engine, "begin", on_begin(self.path, self._give_up, self._began))
        self._writer = self._engine.execution_options(moetune_begin="IMMEDIATE")
        self._pid = os.getpid()
        # what this open migrated (the daemon logs it); None: nothing
        self.upgraded: Upgraded | None = None
        try:
            # intact: a writer's open (tune, profile, serve) refuses a damaged file before the upgrade, which writes too
            if intact and not readonly and not self.memory and existing:
                self.refuse_damaged()
            # check_schema=False: a read-only look at a database at any revision (`moetune db current/check`).
            if check_schema and (upgrade or readonly):
                self.upgraded = self._ensure_schema(upgrade=upgrade and not readonly)
            self._check_same_file()  # records the file opened (a writing store's)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open_existing(cls, path: str | Path, *, write: bool = False, create: bool = False) -> Store:
        """Open a database without the side effects of `Store(path)`, for commands that did not ask to
        create or migrate one. `write` False: an existing moetune database at head, opened read-only (never
        created, migrated or re-upgraded after a `db downgrade`). `write`: an existing moetune database,
        upgraded to head; with `create`, a missing path or an empty file also (created). Never adds
        moetune's tables to another program's SQLite file. A StoreError says what is wrong and what to run."""
        path = database_path(path)
        upgrade_cmd = f"`moetune db upgrade{db_option(path)}`"
        kind, rev, tables = probe(path)
        if kind == "missing" and not (write and create):
            raise StoreError(f"no database at {path} (run {upgrade_cmd})")
        if kind == "foreign":
            raise foreign_error(path, tables)
        if kind == "empty" and not (write and create):
            what = without_moetune_words(tables)
            raise StoreError(f"{path} is not a moetune database ({what}: {upgrade_cmd} makes it one)")
        if write:  # intact: scanned before the upgrade too, a migration writes (and copies tables) like any other write
            return cls(path, intact=True)
        head = head_revision()
        if rev != head and (rev is None or rev in known_revisions()):
            raise StoreError(
                f"database {path} is at schema {rev or 'base'}, this moetune needs {head}: run {upgrade_cmd}"
            )
        return cls(path, readonly=True)  # a newer, unknown revision: the schema check says what to do

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        self._engine.dispose()

    def stop_waiting(self) -> None:
        """For a process that stops (the daemon's stop): from now on no write of this store waits for another
        connection's lock (another process's, or another thread's of this one): a write waiting gives up within
        `busy_timeout.WAIT_SLICE_S`, a later one at once, each raising StoreStopping with nothing of it written (its
        transaction never began). A write whose lock is free still goes through. Not undone: for the end of a run."""
        self._give_up.set()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}{', readonly=True' if self.readonly else ''})"

    @property
    def engine(self) -> Engine:
        return self._engine

    def _after_fork(self) -> None:
        # A pooled SQLite connection must never be used by two processes: drop the parent's.
        if os.getpid() != self._pid:
            self._engine.dispose(close=False)
            self._pid = os.getpid()

    @contextlib.contextmanager
    def _db_errors(self) -> Iterator[None]:
        """SQLite failures become StoreError (`sqlite_failure`): StoreBusy when locked past the timeout by another
        process, StoreNotWritable when this user may not write the file or its folder, else SQLite's message (not a
        database, cannot open); constraint violations stay IntegrityError."""
        try:
            yield
        except IntegrityError:
            raise
        except DatabaseError as e:
            if self._give_up.is_set() and is_locked(e.orig):
                raise StoreStopping(f"the database {self.path} is locked by another writer and this process is "
                                    "stopping: not written (left for the next start)") from None
            err = sqlite_failure(self.path, e.orig, write=not self.readonly and not self.memory)
            if isinstance(err, StoreDamaged) and not self.readonly:  # a read-only store's may be a torn read: retried
                self._latch_damaged(str(err))
            raise err from None

    @property
    def damaged(self) -> str | None:
        """Why this store's file is damaged (the StoreDamaged message), once a scan or a statement found it, or is no
        longer the file at its path (the StoreReplaced message, `_check_same_file`): no write is made from then on;
        None while neither was found."""
        return self._damaged or self._replaced

    def _file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:  # gone (or its folder): no file there
            return None
        return st.st_dev, st.st_ino

    def _check_same_file(self) -> None:
        """StoreReplaced when the file this writing store opened is no longer the one at its path: deleted, moved away
        or replaced (a backup restored over it) while the store was open (the daemon's stays open for weeks). SQLite
        went on writing the file it had open: a deleted file's rows were lost when the process ended, every write
        said it succeeded, and a replaced file got the old one's rows mixed in through its -wal. Latched: every later
        write refuses, the file put back or not (a restart opens what is there then)."""
        if self.readonly or self.memory or self._replaced is not None:
            return
        now_id = self._file_identity()
        if self._file_id is None:  # not created yet when the store opened: the file the first write made
            self._file_id = now_id
            return
        if now_id == self._file_id:
            return
        what = "deleted (or moved away)" if now_id is None else "replaced by another file"
        self._replaced = (f"{self.path} was {what} while this process had it open: nothing more is written by this "
                          "process (its writes would go to the file it opened, no longer at that path, and be lost); "
                          "restart it to use the database now at that path (or put the right file back first)")
        log.error("%s", self._replaced)

    def _latch_damaged(self, message: str) -> None:
        if self._damaged is None:
            self._damaged = message

    def refuse_if_damaged(self) -> None:
        """StoreDamaged when this store found its file damaged, StoreReplaced when the file at its path is no longer
        the one it opened (`damaged`): called before every write."""
        self._check_same_file()
        if self._replaced is not None:
            raise StoreReplaced(self._replaced)
        if self._damaged is not None:
            raise StoreDamaged(self._damaged)

    def _connect_readonly(self) -> sqlite_open.ReadOnlyConnection:
        con = readonly_connect(self.path)
        if con.immutable:
            conns = getattr(self._opened, "conns", None)
            if conns is not None:
                conns.append(con)
        return con

    @contextlib.contextmanager
    def _reads_checked(self) -> Iterator[None]:
        """Around reads of a read-only store: a DatabaseChangedError when a connection opened meanwhile was an
        immutable=1 one and the file changed under it (also in place of the error such a read raised: a torn page
        reads as "database disk image is malformed"). `retried` methods run again on it."""
        if not self.readonly:
            yield
            return
        outer = getattr(self._opened, "conns", None)
        conns: list[sqlite_open.ReadOnlyConnection] = []
        self._opened.conns = conns
        try:
            try:
                yield
            except (DatabaseError, sqlite3.DatabaseError, StoreError) as e:
                if isinstance(e, DatabaseChangedError):
                    raise
                self._check_unchanged(conns, e)
                raise
            self._check_unchanged(conns, None)
        finally:
            self._opened.conns = outer
            if outer is not None:
                outer.extend(conns)

    @staticmethod
    def _check_unchanged(conns: list[sqlite_open.ReadOnlyConnection], error: BaseException | None) -> None:
        for con in conns:
            try:
                con.check_unchanged()
            except sqlite_open.DatabaseChanged as changed:
                raise DatabaseChangedError(str(changed)) from error

    @contextlib.contextmanager
    def _read(self) -> Iterator[Session]:
        self._after_fork()
        with self._db_errors(), self._reads_checked(), Session(self._engine, expire_on_commit=False) as s:
            yield s

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Any]:
        """An engine connection for reads outside the ORM (the schema's revision and check)."""
        self._after_fork()
        with self._db_errors(), self._reads_checked(), self._engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        shared = getattr(self._atomic, "session", None)
        if shared is not None:  # inside `atomic`: its transaction, committed (or rolled back) at its end
            yield shared
            return
        if self.readonly:
            raise StoreError(f"{self.path} is opened read-only")
        self.refuse_if_damaged()
        self._after_fork()
        self._writing[threading.get_ident()] = None
        try:
            with self._db_errors(), Session(self._writer, expire_on_commit=False) as s, s.begin():
                yield s
        finally:
            self._writing.pop(threading.get_ident(), None)

    def _began(self) -> None:
        """A write transaction of this thread took the lock (on_begin): `write_open_s` counts from here (a `_write`'s
        only: the migrations' own connection is not counted)."""
        me = threading.get_ident()
        if me in self._writing:
            self._writing[me] = time.monotonic()

    def write_open_s(self, thread_ident: int | None) -> float | None:
        """How long the thread's write transaction (an `atomic` body included) has held the write lock; None when it
        holds none (a write still waiting for the lock is not counted). What a stopping daemon asks of its job worker
        (`JobManager.stop`)."""
        began = self._writing.get(thread_ident) if thread_ident is not None else None
        return None if began is None else time.monotonic() - began

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """The writes this thread makes in the body (`put_profile`, `add_measurement`, ...) in one transaction: all
        stored at its end, or none where it raises (an interrupt included). A nested `atomic` is the outer one's.
        Reads in the body see the database without its writes (they are not committed yet)."""
        if getattr(self._atomic, "session", None) is not None:
            yield
            return
        with self._write() as s:
            self._atomic.session = s
            try:
                yield
            finally:
                self._atomic.session = None

    def optuna_storage(self) -> Any:
        """An Optuna RDBStorage on this same file (Optuna keeps its own `alembic_version`), with the
        store's busy timeout so Optuna's writes wait instead of failing while moetune writes."""
        import optuna

        if self.memory:
            raise StoreError("an in-memory store has no file for Optuna")
        self.refuse_if_damaged()  # its trials are writes too
        return optuna.storages.RDBStorage(self.url, engine_kwargs={"connect_args": {"timeout": busy.BUSY_TIMEOUT_S}})

    # -- schema ------------------------------------------------------------------------------------
    @property
    def schema(self) -> SchemaVersionManager:
        return SchemaVersionManager(self)

    @retried
    def current_revision(self) -> str | None:
        """The schema revision recorded in the database (None: empty or not a moetune database)."""
        return self.schema.current_revision()

    @retried
    def _ensure_schema(self, *, upgrade: bool) -> Upgraded | None:
        return self.schema.ensure(upgrade=upgrade)

    def upgrade(self, revision: str = "head") -> None:
        """Migrate up to `revision` (one transaction; concurrent openers wait, then find it done)."""
        self.schema.migrate("upgrade", revision)

    def downgrade(self, revision: str) -> None:
        """Migrate down to `revision` ("base" drops every moetune table; other tables are untouched)."""
        self.schema.migrate("downgrade", revision)

    @retried
    def check(self) -> dict[str, Any]:
        """Revision vs head, schema drift against the models, `PRAGMA integrity_check`, foreign keys, and the profile
        rows this moetune cannot read (`unreadable_profiles`: [{id, error}], None where the schema is not this
        moetune's head, whose columns the read needs), and the rows labelled measured that no run can take
        (`unrunnable_measured_profiles`: [{id, error}])."""
        info = self.schema.check()
        bad = self.unreadable_profiles() if info["ok"] else None
        info["unreadable_profiles"] = None if bad is None else [{"id": i, "error": why} for i, why in bad]
        wrong = self.mislabelled_profiles() if info["ok"] else None
        info["mislabelled_profiles"] = None if wrong is None else [{"id": i, "backend": b, "provenance": p}
                                                                   for i, b, p in wrong]
        odd = self.contradicting_profiles() if info["ok"] else None
        info["contradicting_profiles"] = None if odd is None else [{"id": i, "error": why} for i, why in odd]
        beyond = self.unrunnable_measured_profiles() if info["ok"] else None
        info["unrunnable_measured_profiles"] = None if beyond is None else [{"id": i, "error": why} for i, why in beyond]
        info["ok"] = info["ok"] and not bad and not wrong and not odd and not beyond
        return info

    def quick_check(self) -> list[str]:
        """SQLite's `PRAGMA quick_check` (["ok"] when the file is sound); a check SQLite cannot finish on a damaged
        page is a StoreDamaged, as any read of it."""
        with self._connect() as conn:
            return [r[0] for r in conn.exec_driver_sql("PRAGMA quick_check").fetchall()]

    def refuse_damaged(self, *, again: bool = False) -> None:
        """StoreDamaged unless the file passes `quick_check`: nothing is written to a damaged database (a write
        next to a damaged page can spread the damage, and its rows could not all be read back). `again`: scan even
        when this open passed once (the daemon's store stays open for weeks: each re-tune job scans it anew). A scan
        that fails latches (`damaged`): every later write of this store refuses, and so does this, without a scan."""
        self.refuse_if_damaged()
        if self.memory or (self._checked_sound and not again):  # one full scan per open store (the open, the import)
            return
        self._checked_sound = False  # until this scan passes: damage found `again` is not undone by an earlier pass
        found = self.quick_check()  # a check SQLite cannot finish: StoreDamaged, latched by _db_errors
        if found != ["ok"]:
            self._latch_damaged(damaged_message(self.path, "; ".join(found[:3])))
            self.refuse_if_damaged()
        self._checked_sound = True

    @retried
    def contradicting_profiles(self) -> list[tuple[int, str]]:
        """(id, `field: why`) of each readable row whose knobs or key contradict its family (`key_knobs_problem`: a
        megakernel key naming engine=unfused, at ep_size >= 2 or of a dtype other than bf16; a transport key naming
        engine=megakernel). `check_record` refuses them; an older moetune's import stored them, and an auto layer
        runs the engine such a row names. Named by `check`."""
        with self._read() as s:
            got = records(s.execute(select_records().order_by(Profile.id)), [])
        return [(i, f"{p[0]}: {p[1]}") for i, rec in got if (p := key_knobs_problem(rec)) is not None]

    @retried
    def unrunnable_measured_profiles(self) -> list[tuple[int, str]]:
        """(id, why) of each readable row labelled measured that no run of this runtime can take
        (`measured_unrunnable_problem`: ibgda, or proxy or nvlink beyond 8 ranks or across nodes, so nothing measured
        it).
        `check_record` refuses them; one stored before it did (an older moetune's import) is named by `check`. `why` is
        the runtime's refusal alone (`runtime_refusal`): `db check` says "labelled measured, but no run ..." itself."""
        with self._read() as s:
            got = records(s.execute(select_records().where(Profile.provenance == "measured").order_by(Profile.id)), [])
        return [(i, runtime_refusal(rec.key, rec.knobs) or "") for i, rec in got
                if measured_unrunnable_problem(rec) is not None]

    @retried
    def mislabelled_profiles(self) -> list[tuple[int, str, str]]:
        """(id, backend, stored label) of each row labelled measured whose backend does not measure or whose key is a
        what-if preset's (`preset:NAME`: stored before `check_record` refused it), or labelled node_model whose
        backend is a preset or another node's model (`node_model_label_problem`; no writer of this moetune stores either,
        `check_record` refuses them; a hand edit, another tool or an older moetune's import may): the runtime, the
        store's replacement rule, its lookups and `profiles list/show/export` take it as what its backend says;
        named by `check`."""
        with self._read() as s:
            rows = s.execute(select(Profile.id, Profile.provenance, Profile.backend, Profile.fingerprint)
                             .where(Profile.provenance.in_(("measured", "node_model"))).order_by(Profile.id)).all()
        return [(i, b, p) for i, p, b, fp in rows
                if (p == "measured" and (provenance_of_backend(b) != "measured" or is_preset_fingerprint(fp)))
                or node_model_label_problem(p, b, fp)]

    # -- fingerprints ------------------------------------------------------------------------------
    @staticmethod
    def _ensure_fingerprint(s: Session, fp_hash: str, ts: str, origin: str | None) -> None:
        """A placeholder row (no facts) for `fp_hash` where there is none. `origin`: where the key came from
        ('import' for an imported profile's); None where nothing says (a measurement or profile stored under a key:
        a placeholder has no facts to be any node's), learnt with the facts (`upsert_fingerprint`)."""
        s.execute(
            sqlite_insert(Fingerprint)
            .values(hash=fp_hash, facts={}, first_seen=ts, last_seen=ts, origin=origin)
            .on_conflict_do_nothing(index_elements=["hash"])
        )

    def upsert_fingerprint(self, fp_hash: str, facts: dict, *, origin: FingerprintOrigin, node: str | None = None) -> None:
        """Record a fingerprint and its canonical facts (updates facts and last_seen when known), and where they came
        from (`FINGERPRINT_ORIGINS`): 'local' for this node's own (discovered or measured here), recorded with this
        node's id (`node`, default `_owner.node_id()`); 'capture' or 'import' for another node's. A row recorded
        'local' stays this node's: the same hash read from a capture or another node's file changes nothing of it
        (its facts are this node's; a capture's would name another node's GPUs). A 'local' record over a capture's
        or an import's row makes it this node's."""
        if not fp_hash:
            raise ValueError("fingerprint hash must not be empty")
        if origin not in FINGERPRINT_ORIGINS:
            raise ValueError(f"fingerprint origin must be one of {', '.join(FINGERPRINT_ORIGINS)}, not {origin!r}")
        if node is not None and origin != "local":
            raise ValueError(f"a fingerprint of origin {origin!r} is another node's: it records no node of this one")
        ts = now()
        who = (node or node_id()) if origin == "local" else None
        stmt = sqlite_insert(Fingerprint).values(hash=fp_hash, facts=facts, first_seen=ts, last_seen=ts, origin=origin,
                                                 node=who)
        stmt = stmt.on_conflict_do_update(
            index_elements=["hash"],
            set_={"facts": stmt.excluded.facts, "last_seen": stmt.excluded.last_seen, "origin": stmt.excluded.origin,
                  "node": stmt.excluded.node},
            # another node's facts never replace this node's (nor move its last_seen: the daemon's base is the newest)
            where=None if origin == "local" else or_(Fingerprint.origin.is_(None), Fingerprint.origin != "local"),
        )
        with self._write() as s:
            s.execute(stmt)

    @retried
    def get_fingerprint(self, fp_hash: str) -> Row | None:
        with self._read() as s:
            fp = s.scalar(select(Fingerprint).where(Fingerprint.hash == fp_hash))
            return None if fp is None else _fp_row(fp)

    @retried
    def list_fingerprints(self) -> list[Row]:
        with self._read() as s:
            return [_fp_row(fp) for fp in s.scalars(select(Fingerprint).order_by(Fingerprint.last_seen.desc()))]

    @property
    def node(self) -> str:
        """This node's id (`_owner.node_id`): what its own fingerprints and fabric events are recorded under (the
        fabric layer reads it here: it may not import the store's modules)."""
        return node_id()

    @retried
    def local_fingerprints(self, node: str | None = None) -> list[Row]:
        """The fingerprints this node recorded as its own (origin 'local', `node`: default `_owner.node_id()`),
        newest last_seen first: what its bring-up, tunes and daemon discovered here. Never an imported row, a
        capture's, another node's local one (a shared database) or one of unknown origin (from before 0010)."""
        who = node or node_id()
        with self._read() as s:
            return [_fp_row(fp) for fp in s.scalars(
                select(Fingerprint).where(Fingerprint.origin == "local", Fingerprint.node == who)
                .order_by(Fingerprint.last_seen.desc(), Fingerprint.id.desc()))]

    # -- measurements ------------------------------------------------------------------------------
    def add_measurement(
        self,
        *,
        fingerprint: str,
        kind: str,
        transport: str,
        size_bytes: int | None,
        value: float,
        spread: float,
        unit: str,
        extra: dict | None = None,
        run_id: int | None = None,
    ) -> int:
        """Store one measurement; returns its id. An unknown fingerprint gets a placeholder row."""
        ts = now()
        with self._write() as s:
            self._ensure_fingerprint(s, fingerprint, ts, None)
            m = Measurement(
                fingerprint=fingerprint,
                kind=kind,
                transport=transport,
                size_bytes=size_bytes,
                value=float(value),
                spread=float(spread),
                unit=unit,
                extra=dict(extra or {}),
                created=ts,
                run_id=run_id,
            )
            s.add(m)
            s.flush()
            return m.id

    @retried
    def list_measurements(
        self,
        *,
        fingerprint: str | None = None,
        kind: str | None = None,
        run_id: int | None = None,
        limit: int | None = None,
    ) -> list[Row]:
        q = select(Measurement).order_by(Measurement.id)
        if fingerprint is not None:
            q = q.where(Measurement.fingerprint == fingerprint)
        if kind is not None:
            q = q.where(Measurement.kind == kind)
        if run_id is not None:
            q = q.where(Measurement.run_id == run_id)
        if limit is not None:
            q = q.limit(limit)
        with self._read() as s:
            return [_row(m) for m in s.scalars(q)]

    # -- tuning runs -------------------------------------------------------------------------------
    def start_run(self, *, study_name: str, storage: str, backend: str, started: str | None = None) -> int:
        """A `running` row of this process; `started`: when the run began where the row is made after it (a `now()`
        text; default now)."""
        with self._write() as s:
            r = TuningRun(
                study_name=study_name, storage=storage, backend=backend, status="running", trials=0,
                started=started or now(), owner=run_owner(),
            )
            s.add(r)
            s.flush()
            return r.id

    def finish_run(self, run_id: int, *, status: str, trials: int, best_value: float | None,
                   if_running: bool = False) -> bool:
        """End run `run_id` with `status`. `if_running`: only while the row is still `running` (one UPDATE, so a
        run its own process ended meanwhile keeps how it ended); False where it had ended. A missing row raises."""
        with self._write() as s:
            q = update(TuningRun).where(TuningRun.id == run_id)
            if if_running:
                q = q.where(TuningRun.status == "running")
            n = s.execute(q.values(status=status, trials=trials, best_value=best_value, ended=now())).rowcount
            if n == 1:
                return True
            if if_running and s.get(TuningRun, run_id) is not None:
                return False
            raise StoreError(f"no tuning run {run_id}")

    def note_run(self, run_id: int, *, trials: int, best_value: float | None) -> None:
        """The trials a `running` run has finished so far (its own, not its study's) and its study's best value (of
        every run's and worker's trials, not only this run's: `TuningRun.best_value`): kept as they
        are reached, so a run that never gets to `finish_run` (kill -9, a full disk) keeps them when
        `close_orphaned_runs` closes it. A row that has ended is left as it is."""
        with self._write() as s:
            s.execute(update(TuningRun).where(TuningRun.id == run_id, TuningRun.status == "running")
                      .values(trials=trials, best_value=best_value))

    def close_orphaned_runs(self) -> list[int]:
        """Mark `interrupted` the runs left `running` by a process that is gone (killed with kill -9, or stopped by a
        full disk before its `finish_run`), by the owner each recorded (`run_owner`); the ids marked. Their `trials`
        and `best_value` stay those the run reached (`note_run`). A row of a live process, of another host, or without
        an owner (stored before schema 0008) is never touched."""
        with self._read() as s:  # the write lock only where a row is to be closed (every tune and profile asks)
            rows = s.execute(select(TuningRun.id, TuningRun.owner)
                             .where(TuningRun.status == "running", TuningRun.owner.is_not(None))).all()
        gone = [r.id for r in rows if owner_gone(r.owner)]
        if gone:
            with self._write() as s:  # still running: a row its run finished meanwhile is left as it ended
                for part in in_batches(gone):
                    s.execute(update(TuningRun).where(TuningRun.id.in_(part), TuningRun.status == "running")
                              .values(status="interrupted", ended=now()))
        return gone

    @retried
    def has_done_run(self, *, study_name: str, storage: str) -> bool:
        """Whether a run of study `study_name` in `storage` (as `start_run` recorded them) ended `done`."""
        with self._read() as s:
            return s.execute(select(TuningRun.id).where(TuningRun.study_name == study_name,
                                                        TuningRun.storage == storage, TuningRun.status == "done")
                             .limit(1)).first() is not None

    @retried
    def list_runs(self, limit: int = 100) -> list[Row]:
        with self._read() as s:
            return [_row(r) for r in s.scalars(select(TuningRun).order_by(TuningRun.id.desc()).limit(limit))]

    # -- profiles ----------------------------------------------------------------------------------
    def put_profile(
        self, rec: ProfileRecord, *, force_reason: str | None = None, replace_routing: bool = False
    ) -> tuple[bool, str]:
        """Insert a profile; returns (written_as_current, reason).

        The gate (`_rows.decide`): a measured profile always replaces a modelled current one (node_model over
        preset likewise); a modelled profile never displaces a measured one: it is stored as `superseded`
        history, still listed with its provenance. Between two of the same provenance:

        - measured under different routings (both record one, `rec.routing`): latencies are not compared; the
          new one is stored as `superseded` history, and replaces the current one only with `replace_routing`;
        - of different metrics (the backend label says: a round trip `local:<comm>:comm`, a whole layer
          `local:<comm>`): latencies are not compared; the new one replaces only with `force_reason` (a side-by-side
          re-measurement in its metric), else it is stored as `superseded` history;
        - the same knobs from the same source (a re-measurement): the new numbers replace the stored ones,
          slower or faster, and an event (kind `remeasured`) records old -> new latency; identical numbers write
          nothing;
        - other knobs: `force_reason` (the caller re-measured both settings side by side) replaces; else the new
          one must beat the stored number by more than the noise (old.latency_us - new.latency_us >
          max(old.spread_us, new.spread_us)), else nothing is written. The stored number may be older than a
          change the fingerprint does not capture, so a slower new best is not compared as a loss: the reason
          says a side-by-side re-measurement decides.

        A key with no current profile (a `stale` one does not count) takes the new one. A record whose status is
        not `current` is stored as history. `force_reason` and `replace_routing` never skip the provenance order."""
        check_record(rec)
        ts = now()
        with self._write() as s:
            self._ensure_fingerprint(s, rec.key.fingerprint, ts, None)
            if rec.status != "current":
                s.add(row_from_record(rec, ts))
                return False, f"stored as {rec.status}"
            old = s.execute(current_of(rec.key)).first()
            if old is None:
                s.add(row_from_record(rec, ts))
                return True, "no current profile for this key"
            decision = decide(old, rec, force_reason=force_reason, replace_routing=replace_routing)
            if not decision.replace:
                if decision.rule in ("rank", "routing", "metric"):
                    s.add(row_from_record(rec, ts, status="superseded"))
                    return False, decision.reason + " (stored as superseded history)"
                return False, decision.reason
            s.execute(update(Profile).where(Profile.id == old.id).values(status="superseded", updated=ts))
            row = row_from_record(rec, ts)
            s.add(row)
            s.flush()
            ev = replacement_event(old, rec, row.id, decision, ts)
            if ev is not None:
                s.add(ev)
            return True, decision.reason

    @retried
    def get_current(self, key: ProfileKey) -> ProfileRecord | None:
        with self._read() as s:
            got = self._records(s, select_records().where(*key_filter(key), Profile.status == "current"))
        return got[0][1] if got else None

    @retried
    def find_profile(
        self,
        *,
        fingerprint: str,
        software: str,
        ep_size: int,
        nodes: int,
        hidden: int,
        intermediate: int,
        experts: int,
        topk: int,
        dtype: str,
        tokens: int,
        transport_family: str | None = None,
        measured_only: bool = False,
        max_bucket_steps: int = 1,
    ) -> ProfileRecord | None:
        """The current profile at the stored token bucket nearest to `tokens`, at most `max_bucket_steps`
        steps of the bucket ladder away (further: None, the caller falls back). Measured profiles come
        first: a modelled one is returned only where no measured one is stored for this shape
        (never with `measured_only`). Without `transport_family`, the fastest family at that bucket, among numbers of
        one routing (`one_routing`: uniform where several routings are stored) and one metric (`one_metric`: whole
        layers where round trips sit beside them).
        A row whose knobs or key contradict its family (`key_knobs_problem`) is passed over, as the daemon and the
        runtime's lookups pass it over.
        The record carries its `provenance`; `rec.is_tuned_for(fingerprint, software)` says whether it
        may be applied as tuned. An unknown dtype is a ValueError (moetune writes `bfloat16`, not `bf16`)."""
        from moetune.runtime.shapes import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        where = [
            Profile.status == "current",
            Profile.fingerprint == fingerprint,
            Profile.software == software,
            Profile.ep_size == ep_size,
            Profile.nodes == nodes,
            Profile.hidden == hidden,
            Profile.intermediate == intermediate,
            Profile.experts == experts,
            Profile.topk == topk,
            Profile.dtype == dtype,
        ]
        if transport_family is not None:
            where.append(Profile.transport_family == transport_family)
        else:  # an engine family's latency is a whole layer's, not an exchange's: picked by name only
            where.append(Profile.transport_family.not_in(ENGINE_FAMILIES))
        with self._read() as s:
            rows = self._records(s, select_records().where(*where))
        # a row whose knobs or key contradict its family (an older moetune's import; `db check` names it) is passed
        # over as the daemon's index and the client pass it over: a bucket away, or None, as for a missing row
        rows = [(i, r) for i, r in rows if key_knobs_problem(r) is None]
        # tiers by what the numbers are (effective provenance: a hand-edited "measured" label on a modelling backend
        # is modelled), not by the stored label
        for provenance in sorted(PROVENANCES, key=lambda p: -PROVENANCE_RANK[p]):
            if measured_only and provenance != "measured":
                break
            got = [(i, r) for i, r in rows if r.effective_provenance == provenance]
            if not got:
                continue
            bucket = nearest_bucket_within(tokens, sorted({r.key.token_bucket for _i, r in got}), max_bucket_steps)
            if bucket is None:
                continue
            return min(comparable([r for _i, r in got if r.key.token_bucket == bucket]), key=lambda r: r.latency_us)
        return None

    @retried
    def provenance_of(self, key: ProfileKey, profile_hash: str | None = None) -> tuple[str, str, str] | None:
        """(effective provenance, measured_on, backend) of the newest stored profile for `key` (with this hash, if
        given): for callers that hold a key from elsewhere (a daemon reply, the runtime's fallback). A hand-edited
        "measured" label on a modelling backend is answered as what it is (`ProfileRecord.as_effective`); the backend
        tells a preset file's row from another node's model taken as a preset (`query.preset_note`)."""
        q = (select(Profile.provenance, Profile.measured_on, Profile.backend, Profile.profile_hash,
                    type_coerce(Profile.knobs, String).label("knobs"))  # as text: one corrupt row fails no query
             .where(*key_filter(key)).order_by((Profile.status == "current").desc(), Profile.id.desc()))
        with self._read() as s:
            if profile_hash is None:
                row = s.execute(q.limit(1)).first()
            else:  # matched on the row's knobs too: a row stored before knobs.HASHED_LATE_KNOBS has the older hash
                row = next((r for r in s.execute(q).all() if holds_profile(key, r.profile_hash, r.knobs,
                                                                           profile_hash)), None)
        if row is None:
            return None
        return (effective_provenance(row.provenance, row.backend, key.fingerprint),
                effective_measured_on(row.provenance, row.measured_on, row.backend, key.fingerprint), row.backend)

    @retried
    def routing_of(self, key: ProfileKey) -> str:
        """The routing `key`'s profile was tuned under (`uniform`, `zipf:S`), for a caller that tunes the key again
        (the daemon's re-tune). Of the key's rows that record one: the current row, else the newest stale one (what
        a fabric change left), else the newest of any status (history): a `superseded` row of another routing (a
        `moetune tune` the store kept as history beside a zipf profile) never decides over the profile that stands.
        `uniform` where no row records one (rows from before migration 0005 say "": the tuner's default then)."""
        rank = case((Profile.status == "current", 0), (Profile.status == "stale", 1), else_=2)
        with self._read() as s:
            got = s.execute(select(Profile.routing).where(*key_filter(key), Profile.routing.is_not(None),
                                                          Profile.routing != "")
                            .order_by(rank, Profile.id.desc()).limit(1)).scalar()
        return str(got) if got else UNIFORM_ROUTING

    @retried
    def get_profile(self, profile_id: int) -> ProfileRecord | None:
        """One profile by id (None when absent or unreadable: `unreadable_profiles` says why)."""
        with self._read() as s:
            got = self._records(s, select_records().where(Profile.id == profile_id))
        return got[0][1] if got else None

    @retried
    def list_profiles(
        self, *, status: str | None = None, fingerprint: str | None = None, provenance: str | None = None
    ) -> list[tuple[int, ProfileRecord]]:
        """(id, record) in id order; each record says its provenance, and why no lookup serves it where none does
        (`ProfileRecord.not_served`: the listings print it, or such a row read as one in use). A row this moetune
        cannot read is skipped (one bad row must not hide the rest, nor stop a daemon); `_records` warns once about
        such rows."""
        q = select_records().order_by(Profile.id)
        if status is not None:
            q = q.where(Profile.status == status)
        if fingerprint is not None:
            q = q.where(Profile.fingerprint == fingerprint)
        with self._read() as s:
            got = self._records(s, q)
        # by what the numbers are, as list/show print them (a hand-edited "measured" label on a modelling backend
        # is listed as modelled)
        return got if provenance is None else [(i, r) for i, r in got if r.effective_provenance == provenance]

    @retried
    def unreadable_profiles(self, profile_id: int | None = None) -> list[tuple[int, str]]:
        """(id, why) of each stored profile row this moetune cannot read (every read skips them), in id order; with
        `profile_id`, that row only. Such a row is kept, never changed: `delete_profile` removes one."""
        q = select_records().order_by(Profile.id)
        if profile_id is not None:
            q = q.where(Profile.id == profile_id)
        bad: list[tuple[int, str]] = []
        with self._read() as s:
            records(s.execute(q), bad)
        return bad

    def _records(self, s: Session, query: Any) -> list[tuple[int, ProfileRecord]]:
        """`records` of `query`, unreadable rows left out. The first such row this process meets in this database
        warns once, naming every unreadable row of the table and what to do: a warning per read repeated itself on
        every lookup of a daemon or a job."""
        bad: list[tuple[int, str]] = []
        got = records(s.execute(query), bad)
        # an in-memory store is its own database: a fresh object() as its key (an id() could be reused)
        key = self.__dict__.setdefault("_unreadable_key", object()) if self.memory else str(self.path)
        if bad and _once.first_time(UNREADABLE_WARNING, key):
            try:  # the whole table, once: the warning names them all, not just this read's
                every: list[tuple[int, str]] = []
                records(s.execute(select_records().order_by(Profile.id)), every)
                bad = every
            finally:
                log.warning("%s", self._unreadable_message(bad))
        return got

    def _unreadable_message(self, bad: list[tuple[int, str]]) -> str:
        shown = "; ".join(f"profile {i}: {why}" for i, why in bad[:5])
        more = f"; and {len(bad) - 5} more (ids {', '.join(str(i) for i, _ in bad[5:])})" if len(bad) > 5 else ""
        where = "" if self.memory else db_option(self.path)
        return (
            f"skipped {len(bad)} unreadable profile row(s) in {self.path}, left out of every lookup, list and export: "
            f"{shown}{more}. Nothing was changed: `moetune db check{where}` lists them, "
            f"`moetune profiles delete ID{where}` removes one (said once per process)"
        )

    def delete_profile(self, profile_id: int) -> bool:
        with self._write() as s:
            return s.execute(delete(Profile).where(Profile.id == profile_id)).rowcount == 1

    def mark_stale(self, *, fingerprint: str, reason: str, ids: list[int] | None = None) -> int:
        """Current profiles of `fingerprint` become `stale` (and an event says why). Returns how many. With `ids`,
        only those of them (the daemon finishing an interrupted fabric change: rows that came later are not its)."""
        ts = now()
        with self._write() as s:
            q = update(Profile).where(Profile.fingerprint == fingerprint, Profile.status == "current")
            if ids is None:
                n = s.execute(q.values(status="stale", updated=ts)).rowcount
            else:  # in batches, one transaction: a change of more rows than one IN (...) holds (`in_batches`)
                n = sum(s.execute(q.where(Profile.id.in_(part)).values(status="stale", updated=ts)).rowcount
                        for part in in_batches(ids))
            if n:
                s.add(Event(created=ts, kind="stale", reason=reason, details={"fingerprint": fingerprint, "profiles": n}))
            return n

    def restore_stale(self, *, fingerprint: str, reason: str, ids: list[int] | None = None) -> int:
        """The fabric is `fingerprint` again: its `stale` profiles were measured on this very fabric, so each key's
        newest one is `current` again where the key has no current profile (one tuned since stays). With `ids`, only
        those rows are candidates (the daemon: the rows current when the fabric last left `fingerprint`, not one a
        job wrote after it had moved on, nor one of an earlier stay on other GPUs). An event says why. Returns how
        many."""
        ts = now()
        with self._write() as s:
            q = select(Profile).where(Profile.fingerprint == fingerprint, Profile.status == "stale")
            if ids is None:
                rows = list(s.execute(q).scalars().all())
            else:  # in batches (`in_batches`), then in one order
                rows = [r for part in in_batches(ids) for r in s.execute(q.where(Profile.id.in_(part))).scalars().all()]
            rows.sort(key=lambda r: r.id, reverse=True)
            seen: set[tuple[Any, ...]] = set()
            n = 0
            for row in rows:
                key = tuple(getattr(row, c) for c in PROFILE_KEY_COLUMNS)
                if key in seen:
                    continue
                seen.add(key)
                if s.execute(select(Profile.id).where(*key_filter(row), Profile.status == "current")).first() is None:
                    row.status, row.updated = "current", ts
                    s.flush()  # one current row per key (the partial unique index): the next row sees this one
                    n += 1
            if n:
                s.add(Event(created=ts, kind="restored", reason=reason, details={"fingerprint": fingerprint, "profiles": n}))
            return n

    @retried
    def count_profiles(self, status: str | None = None) -> int:
        q = select(func.count(Profile.id))
        if status is not None:
            q = q.where(Profile.status == status)
        with self._read() as s:
            return int(s.scalar(q) or 0)

    # -- events ------------------------------------------------------------------------------------
    def add_event(self, *, kind: EventKind, reason: str, details: dict | None = None) -> int:
        """Record an event; ValueError for a `kind` that is no EventKind (before anything is written)."""
        check_event_kinds([kind])
        with self._write() as s:
            e = Event(created=now(), kind=kind, reason=reason, details=dict(details or {}))
            s.add(e)
            s.flush()
            return e.id

    @retried
    def list_events(self, limit: int = 100, *, kinds: tuple[EventKind, ...] | None = None,
                    before_id: int | None = None, node: str | None = None) -> list[Row]:
        """Newest first: Row(id, created, kind, reason, details); with `kinds`, only events of those kinds (ValueError
        for one that is no EventKind: it would match nothing); with `before_id`, only those older than that event
        (page back with the last one's id); with `node`, only those whose details name no other node (`node` in them
        is that one, or absent or null, or the details are no object: an older moetune's event counts as this
        node's), filtered in SQL so that a page holds `limit` of that node's however many other nodes' events lie
        between."""
        q = select(Event).order_by(Event.id.desc()).limit(limit)
        if kinds is not None:
            check_event_kinds(kinds)
            q = q.where(Event.kind.in_(kinds))
        if before_id is not None:
            q = q.where(Event.id < before_id)
        if node is not None:
            q = q.where(_names_no_other_node(Event.details, node))
        with self._read() as s:
            return [_row(e) for e in s.scalars(q)]

    @retried
    def events_after(self, after_id: int, *, kinds: tuple[EventKind, ...], limit: int = 500) -> list[Row]:
        """Oldest first: up to `limit` events of `kinds` whose id is above `after_id` (page on with the last one's id)."""
        check_event_kinds(kinds)
        q = select(Event).where(Event.id > after_id, Event.kind.in_(kinds)).order_by(Event.id).limit(limit)
        with self._read() as s:
            return [_row(e) for e in s.scalars(q)]

    @retried
    def open_jobs(self, *, kinds: tuple[EventKind, ...], finished: EventKind,
                  also: str = "") -> tuple[list[int], list[Row], int]:
        """The jobs whose events (of `kinds`, naming their job by an integer `details.job_id`) include none of kind
        `finished`: their ids (ascending); their events of `kinds` and those of any job whose integer `details.<also>`
        names one of them, oldest first; and the highest job id an event of `kinds` names (0: none). Found by job id,
        in SQL, however old the job and however many events came after its own (a window of the newest events lost a
        job that ran long while others came and went): one pass over the events of `kinds` (each one's JSON read
        once), and only the events asked for are read into Python."""
        check_event_kinds([*kinds, finished])
        cols = [Event.id.label("id"), _json_int(Event.details, "job_id").label("jid"), Event.kind.label("kind"),
                (_json_int(Event.details, also) if also else literal(None, Integer)).label("also")]
        # LIMIT -1 OFFSET 0: SQLite cannot flatten it into the queries below (which would evaluate the JSON functions
        # again for each use of a column); from SQLite 3.35 a CTE used twice is computed once
        per = select(*cols).where(Event.kind.in_(kinds)).limit(-1).offset(0).cte("per")
        jobs = (select(per.c.jid, func.sum(case((per.c.kind == finished, 1), else_=0)).label("ends"))
                .where(per.c.jid.is_not(None)).group_by(per.c.jid).cte("jobs"))
        unfinished = select(jobs.c.jid).where(jobs.c.ends == 0).scalar_subquery()
        q = union_all(select(per.c.id, per.c.jid, per.c.jid.in_(unfinished))
                      .where(or_(per.c.jid.in_(unfinished), per.c.also.in_(unfinished))),
                      select(literal(None, Integer), func.max(jobs.c.jid), literal(None)))
        with self._read() as s:
            found = s.execute(q).all()
            top = next((int(j) for i, j, _ in found if i is None and j is not None), 0)
            ids = sorted({int(j) for i, j, is_open in found if i is not None and is_open})
            wanted = sorted(int(i) for i, _, _ in found if i is not None)
            rows = [_row(e) for n in range(0, len(wanted), 500)  # bound parameters: 999 at most before SQLite 3.32
                    for e in s.scalars(select(Event).where(Event.id.in_(wanted[n:n + 500])).order_by(Event.id))]
        return ids, rows, top

    # -- export / import (moetune.tuner.store.io) ----------------------------------------------------
    @retried
    def dump_profiles(self, *, status: str | None = None, fingerprint: str | None = None,
                      provenance: str | None = None) -> bytes:
        """The export document (JSON bytes, deterministic: same database → same bytes)."""
        return _io.dump_profiles(self, status=status, fingerprint=fingerprint, provenance=provenance)

    def export_profiles(self, path: str | Path, *, status: str | None = None, fingerprint: str | None = None,
                        provenance: str | None = None, replace: bool = True) -> int:
        """Write the profiles (with their fingerprints' facts) to a JSON file atomically; returns how many.
        `replace=False`: FileExistsError for any existing file."""
        return _io.export_profiles(self, path, status=status, fingerprint=fingerprint, provenance=provenance,
                                   replace=replace)

    def import_profiles(self, path: str | Path, *, skip_invalid: bool = False,
                        check_facts: _io.FactsCheck | None = None) -> ImportResult:
        """Import an export file, all or nothing; ProfileImportError (nothing written) names the problem, every
        invalid record. `skip_invalid`: invalid records are left out (`ImportResult.invalid`), the rest imported.
        `check_facts` (`moetune.tuner.fabric.facts.facts_problem`): fingerprints' facts must pass it."""
        return _io.import_profiles(self, path, skip_invalid=skip_invalid, check_facts=check_facts)

    def import_bytes(self, data: bytes, *, source: str = "<data>", skip_invalid: bool = False,
                     check_facts: _io.FactsCheck | None = None) -> ImportResult:
        return _io.import_bytes(self, data, source=source, skip_invalid=skip_invalid, check_facts=check_facts)


def _json_int(column: Any, field: str) -> Any:
    """SQL for the integer at `field` of a JSON column's object; NULL where it holds none (another type, no such
    field) or is no valid JSON: a damaged row is passed over, never failing the query (CASE evaluates in order)."""
    path = f"$.{field}"
    return case((func.json_valid(column) == 1,
                 case((func.json_type(column, path) == "integer", func.json_extract(column, path, type_=Integer)))))


def _names_no_other_node(column: Any, node: str) -> Any:
    """SQL: whether a JSON column (an event's details) names no node but `node`: no object (no valid JSON, or another
    type), no `node` field, a null one, or the text `node` (CASE evaluates in order: the JSON functions see valid JSON
    only)."""
    at = func.json_type(column, "$.node")
    return case((column.is_(None), True),
                (func.json_valid(column) != 1, True),
                (func.json_type(column) != "object", True),
                (at.is_(None), True),
                (at == "null", True),
                (at == "text", func.json_extract(column, "$.node") == node),
                else_=False)


def _row(obj: Any) -> Row:
    return Row({c.key: getattr(obj, c.key) for c in obj.__table__.columns})


def _fp_row(fp: Fingerprint) -> Row:
    return _row(fp)
