"""The profile store: SQLite through SQLAlchemy 2.0, schema managed by Alembic (migrations/).

Every connection runs with WAL, a busy timeout, foreign keys on and `synchronous=NORMAL`; every write
transaction starts with `BEGIN IMMEDIATE`, so two processes writing at once queue on the busy timeout
instead of failing on a lock upgrade. The database upgrades itself on first use (unless read-only).
moetune's Alembic revision lives in `moetune_alembic_version`, so Optuna can share the file.

The exchange type is `moetune.runtime.profile_record.ProfileRecord`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import os
import sqlite3
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
from sqlalchemy import Engine, create_engine, delete, event, func, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL
from sqlalchemy.exc import DatabaseError, IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, nearest_bucket
from moetune.tuner.store.models import (
    PROFILE_KEY_COLUMNS,
    Event,
    Fingerprint,
    Measurement,
    Profile,
    TuningRun,
)

VERSION_TABLE = "moetune_alembic_version"
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
EXPORT_FORMAT = "moetune-profiles"
EXPORT_VERSION = 1
BUSY_TIMEOUT_S = 30.0

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "VERSION_TABLE",
    "ImportResult",
    "ProfileImportError",
    "Row",
    "Store",
    "StoreError",
]


class StoreError(RuntimeError):
    """The database cannot be opened, is at an unknown revision, or a stored value is invalid."""


class ProfileImportError(ValueError):
    """An import file is corrupt or invalid; nothing was written."""


class Row(dict):
    """A plain dict (JSON-ready) whose keys also read as attributes: `row.kind` == `row["kind"]`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class ImportResult(msgspec.Struct, kw_only=True):
    """What `import_profiles` did."""

    inserted: int = 0  # profile rows written
    current: int = 0  # of which now current
    replaced: int = 0  # existing current profiles superseded by an imported one that beat the noise
    kept_superseded: int = 0  # imported current profiles that did not beat the stored one (kept as history)
    skipped: int = 0  # already in the database (same key, knobs and creation time)
    fingerprints: int = 0  # fingerprint rows added


class ExportedFingerprint(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    hash: str
    facts: dict[str, Any]
    first_seen: str
    last_seen: str


class ProfilesFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The export file (JSON)."""

    format: str
    version: int
    moetune_version: str = ""
    fingerprints: list[ExportedFingerprint] = []
    profiles: list[ProfileRecord] = []


def now() -> str:
    """UTC now as ISO-8601 (the store's timestamp format)."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")


def _moetune_version() -> str:
    from moetune.tuner import __version__

    return __version__


def _alembic_config(connection: Any = None) -> Any:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def head_revision() -> str:
    """The newest schema revision this moetune knows."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


@functools.cache
def _known_revisions() -> frozenset[str]:
    from alembic.script import ScriptDirectory

    return frozenset(sc.revision for sc in ScriptDirectory.from_config(_alembic_config()).walk_revisions())


def _on_connect(readonly: bool) -> Any:
    def connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        # Let SQLAlchemy's begin event emit BEGIN (the driver's implicit transactions are off).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            mode = cur.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() not in ("wal", "memory"):
                cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")
        cur.close()

    return connect


def _readonly_creator(path: Path) -> Any:
    """mode=ro; when SQLite cannot open a WAL database read-only (its -shm/-wal files are gone and
    the directory is not writable, e.g. /var/lib/moetune for a user), fall back to immutable=1, which is
    safe only while no one writes: that is when this fallback is needed (the daemon is down)."""
    uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"

    def connect() -> sqlite3.Connection:
        con = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        try:
            con.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return con
        except sqlite3.OperationalError as e:
            if "unable to open" not in str(e):
                raise
            con.close()
            return sqlite3.connect(uri + "&immutable=1", uri=True, check_same_thread=False)

    return connect


def _on_begin(conn: Any) -> None:
    mode = conn.get_execution_options().get("moetune_begin", "DEFERRED")
    conn.exec_driver_sql(f"BEGIN {mode}")


def _record(p: Profile) -> ProfileRecord:
    try:
        key = ProfileKey(**{c: getattr(p, c) for c in PROFILE_KEY_COLUMNS})
        knobs = Knobs.from_dict(dict(p.knobs))
    except (KnobError, ValueError, TypeError) as e:
        raise StoreError(f"profile {p.id} in the database is invalid for this moetune: {e}") from None
    return ProfileRecord(
        key=key,
        knobs=knobs,
        latency_us=p.latency_us,
        spread_us=p.spread_us,
        backend=p.backend,
        status=p.status,  # type: ignore[arg-type]
        software_versions=dict(p.software_versions or {}),
        created=p.created,
        updated=p.updated,
    )


def _key_filter(key: ProfileKey) -> list[Any]:
    return [getattr(Profile, c) == getattr(key, c) for c in PROFILE_KEY_COLUMNS]


def _beats_noise(old: Profile, new: ProfileRecord) -> tuple[bool, float, float]:
    gain = old.latency_us - new.latency_us
    noise = max(old.spread_us, new.spread_us)
    return gain > noise, gain, noise


class Store:
    """The profile database. Cheap to open; close it (or use `with`) when done.

    `path` None → the configured database (`[store] db`, else `$MOETUNE_HOME/moetune.db`, else the XDG
    data dir). `":memory:"` gives a private in-memory database (tests). Safe to share between threads;
    after a fork the child drops the parent's pooled connections and opens its own.
    """

    def __init__(self, path: str | Path | None = None, *, readonly: bool = False, upgrade: bool = True):
        if path is None:
            from moetune.runtime.config import load_config

            path = load_config().db_path
        self.readonly = readonly
        self.memory = str(path) == ":memory:"
        if self.memory:
            if readonly:
                raise StoreError("an in-memory database cannot be read-only")
            self.path = Path(":memory:")
            self.url = "sqlite://"
            self._engine = create_engine(
                "sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}
            )
        else:
            self.path = Path(path).expanduser().absolute()
            self.url = URL.create("sqlite", database=str(self.path)).render_as_string(hide_password=False)
            if readonly:
                if not self.path.is_file():
                    raise StoreError(f"no database at {self.path}")
                self._engine = create_engine(self.url, creator=_readonly_creator(self.path))
            else:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise StoreError(f"cannot create the directory for {self.path}: {e}") from None
                self._engine = create_engine(self.url, connect_args={"timeout": BUSY_TIMEOUT_S})
        event.listen(self._engine, "connect", _on_connect(readonly or self.memory))
        event.listen(self._engine, "begin", _on_begin)
        self._writer = self._engine.execution_options(moetune_begin="IMMEDIATE")
        self._pid = os.getpid()
        if upgrade or readonly:
            self._ensure_schema(upgrade=upgrade and not readonly)

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        self._engine.dispose()

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
        """SQLite failures (not a database, cannot open, locked past the timeout) become StoreError;
        constraint violations stay IntegrityError."""
        try:
            yield
        except IntegrityError:
            raise
        except DatabaseError as e:
            raise StoreError(f"{self.path}: {e.orig}") from None

    @contextlib.contextmanager
    def _read(self) -> Iterator[Session]:
        self._after_fork()
        with self._db_errors(), Session(self._engine, expire_on_commit=False) as s:
            yield s

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        if self.readonly:
            raise StoreError(f"{self.path} is opened read-only")
        self._after_fork()
        with self._db_errors(), Session(self._writer, expire_on_commit=False) as s, s.begin():
            yield s

    def optuna_storage(self) -> Any:
        """An Optuna RDBStorage on this same file (Optuna keeps its own `alembic_version`), with the
        store's busy timeout so Optuna's writes wait instead of failing while moetune writes."""
        import optuna

        if self.memory:
            raise StoreError("an in-memory store has no file for Optuna")
        return optuna.storages.RDBStorage(self.url, engine_kwargs={"connect_args": {"timeout": BUSY_TIMEOUT_S}})

    # -- schema ------------------------------------------------------------------------------------
    def current_revision(self) -> str | None:
        """The schema revision recorded in the database (None: empty or not a moetune database)."""
        from alembic.runtime.migration import MigrationContext

        with self._db_errors(), self._engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            rev = ctx.get_current_revision()
            conn.rollback()
        return rev

    def _ensure_schema(self, *, upgrade: bool) -> None:
        head = head_revision()
        rev = self.current_revision()
        if rev == head:
            return
        if rev is not None and rev not in _known_revisions():
            raise StoreError(
                f"{self.path} is at schema revision {rev}, unknown to this moetune (newest known: {head}); "
                "it was written by a newer moetune"
            )
        if not upgrade:
            raise StoreError(
                f"{self.path} is at schema revision {rev or 'none'}, this moetune needs {head}: "
                "run `moetune db upgrade`"
            )
        self.upgrade()

    def upgrade(self, revision: str = "head") -> None:
        """Migrate up to `revision` (one transaction; concurrent openers wait, then find it done)."""
        self._migrate("upgrade", revision)

    def downgrade(self, revision: str) -> None:
        """Migrate down to `revision` ("base" drops every moetune table; other tables are untouched)."""
        self._migrate("downgrade", revision)

    def _migrate(self, direction: Literal["upgrade", "downgrade"], revision: str) -> None:
        from alembic import command

        if self.readonly:
            raise StoreError(f"{self.path} is opened read-only")
        self._after_fork()
        with self._db_errors(), self._writer.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            # Table rebuilds (batch migrations) need foreign keys off; they can only change outside a
            # transaction. Checked again before commit.
            raw.execute("PRAGMA foreign_keys = OFF")
            try:
                with conn.begin():
                    getattr(command, direction)(_alembic_config(conn), revision)
                    bad = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if bad:
                        raise StoreError(f"migration {direction} to {revision} broke foreign keys: {bad[:5]}")
            finally:
                raw.execute("PRAGMA foreign_keys = ON")

    def check(self) -> dict[str, Any]:
        """Revision vs head, schema drift against the models, `PRAGMA integrity_check`, foreign keys."""
        from alembic.autogenerate import compare_metadata
        from alembic.runtime.migration import MigrationContext

        from moetune.tuner.store.models import Base

        head = head_revision()
        rev = self.current_revision()
        with self._db_errors(), self._engine.connect() as conn:
            integrity = [r[0] for r in conn.exec_driver_sql("PRAGMA integrity_check").fetchall()]
            fk = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            own = set(Base.metadata.tables) | {VERSION_TABLE}
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "version_table": VERSION_TABLE,
                    "compare_type": True,
                    "include_name": lambda name, type_, _p: type_ != "table" or name in own,
                },
            )
            diff = [str(d) for d in compare_metadata(ctx, Base.metadata)] if rev is not None else []
            conn.rollback()
        ok = rev == head and integrity == ["ok"] and not fk and not diff
        return {
            "path": str(self.path),
            "revision": rev,
            "head": head,
            "at_head": rev == head,
            "integrity": integrity,
            "foreign_key_errors": len(fk),
            "schema_diff": diff,
            "ok": ok,
        }

    # -- fingerprints ------------------------------------------------------------------------------
    @staticmethod
    def _ensure_fingerprint(s: Session, fp_hash: str, ts: str) -> None:
        s.execute(
            sqlite_insert(Fingerprint)
            .values(hash=fp_hash, facts={}, first_seen=ts, last_seen=ts)
            .on_conflict_do_nothing(index_elements=["hash"])
        )

    def upsert_fingerprint(self, fp_hash: str, facts: dict) -> None:
        """Record a fingerprint and its canonical facts (updates facts and last_seen when known)."""
        if not fp_hash:
            raise ValueError("fingerprint hash must not be empty")
        ts = now()
        stmt = sqlite_insert(Fingerprint).values(hash=fp_hash, facts=facts, first_seen=ts, last_seen=ts)
        stmt = stmt.on_conflict_do_update(
            index_elements=["hash"], set_={"facts": stmt.excluded.facts, "last_seen": stmt.excluded.last_seen}
        )
        with self._write() as s:
            s.execute(stmt)

    def get_fingerprint(self, fp_hash: str) -> Row | None:
        with self._read() as s:
            fp = s.scalar(select(Fingerprint).where(Fingerprint.hash == fp_hash))
            return None if fp is None else _fp_row(fp)

    def list_fingerprints(self) -> list[Row]:
        with self._read() as s:
            return [_fp_row(fp) for fp in s.scalars(select(Fingerprint).order_by(Fingerprint.last_seen.desc()))]

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
            self._ensure_fingerprint(s, fingerprint, ts)
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
    def start_run(self, *, study_name: str, storage: str, backend: str) -> int:
        with self._write() as s:
            r = TuningRun(
                study_name=study_name, storage=storage, backend=backend, status="running", trials=0, started=now()
            )
            s.add(r)
            s.flush()
            return r.id

    def finish_run(self, run_id: int, *, status: str, trials: int, best_value: float | None) -> None:
        with self._write() as s:
            n = s.execute(
                update(TuningRun)
                .where(TuningRun.id == run_id)
                .values(status=status, trials=trials, best_value=best_value, ended=now())
            ).rowcount
            if n != 1:
                raise StoreError(f"no tuning run {run_id}")

    def list_runs(self, limit: int = 100) -> list[Row]:
        with self._read() as s:
            return [_row(r) for r in s.scalars(select(TuningRun).order_by(TuningRun.id.desc()).limit(limit))]

    # -- profiles ----------------------------------------------------------------------------------
    def put_profile(self, rec: ProfileRecord, *, force_reason: str | None = None) -> tuple[bool, str]:
        """Insert a profile. It becomes `current` when its key has no current profile (a `stale` one
        is always replaced) or when it beats the current one by more than the noise
        (old.latency_us - new.latency_us > max(old.spread_us, new.spread_us)); the old one becomes
        `superseded`. Otherwise nothing is written. A record whose status is not `current` is stored
        as history. `force_reason` replaces the current one without the gate: for a decision taken on
        better evidence (a side-by-side re-measurement of both settings), named in the reason.
        Returns (written_as_current, reason)."""
        _check_record(rec)
        ts = now()
        with self._write() as s:
            self._ensure_fingerprint(s, rec.key.fingerprint, ts)
            if rec.status != "current":
                s.add(_row_from_record(rec, ts))
                return False, f"stored as {rec.status}"
            old = s.scalar(select(Profile).where(*_key_filter(rec.key), Profile.status == "current"))
            if old is None:
                s.add(_row_from_record(rec, ts))
                return True, "no current profile for this key"
            better, gain, noise = _beats_noise(old, rec)
            if force_reason is not None:
                better = True
            if not better:
                return False, (
                    f"kept the current profile {old.id}: gain {gain:.3f} us does not beat the noise {noise:.3f} us"
                )
            old.status = "superseded"
            old.updated = ts
            s.flush()  # the old row leaves `current` before the new one arrives (unique index)
            s.add(_row_from_record(rec, ts))
            if force_reason is not None:
                return True, f"replaced profile {old.id}: {force_reason}"
            return True, f"replaced profile {old.id}: gain {gain:.3f} us beats the noise {noise:.3f} us"

    def get_current(self, key: ProfileKey) -> ProfileRecord | None:
        with self._read() as s:
            p = s.scalar(select(Profile).where(*_key_filter(key), Profile.status == "current"))
            return None if p is None else _record(p)

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
    ) -> ProfileRecord | None:
        """The current profile at the token bucket nearest to `tokens` among those stored for this
        shape; without `transport_family`, the fastest family at that bucket."""
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
        with self._read() as s:
            buckets = sorted(set(s.scalars(select(Profile.token_bucket).where(*where))))
            if not buckets:
                return None
            bucket = nearest_bucket(tokens, buckets)
            p = s.scalar(
                select(Profile)
                .where(*where, Profile.token_bucket == bucket)
                .order_by(Profile.latency_us, Profile.id)
                .limit(1)
            )
            return None if p is None else _record(p)

    def get_profile(self, profile_id: int) -> ProfileRecord | None:
        with self._read() as s:
            p = s.get(Profile, profile_id)
            return None if p is None else _record(p)

    def list_profiles(
        self, *, status: str | None = None, fingerprint: str | None = None
    ) -> list[tuple[int, ProfileRecord]]:
        q = select(Profile).order_by(Profile.id)
        if status is not None:
            q = q.where(Profile.status == status)
        if fingerprint is not None:
            q = q.where(Profile.fingerprint == fingerprint)
        with self._read() as s:
            return [(p.id, _record(p)) for p in s.scalars(q)]

    def delete_profile(self, profile_id: int) -> bool:
        with self._write() as s:
            return s.execute(delete(Profile).where(Profile.id == profile_id)).rowcount == 1

    def mark_stale(self, *, fingerprint: str, reason: str) -> int:
        """Current profiles of `fingerprint` become `stale` (and an event says why). Returns how many."""
        ts = now()
        with self._write() as s:
            n = s.execute(
                update(Profile)
                .where(Profile.fingerprint == fingerprint, Profile.status == "current")
                .values(status="stale", updated=ts)
            ).rowcount
            if n:
                s.add(Event(created=ts, kind="stale", reason=reason, details={"fingerprint": fingerprint, "profiles": n}))
            return n

    def count_profiles(self, status: str | None = None) -> int:
        q = select(func.count(Profile.id))
        if status is not None:
            q = q.where(Profile.status == status)
        with self._read() as s:
            return int(s.scalar(q) or 0)

    # -- events ------------------------------------------------------------------------------------
    def add_event(self, *, kind: str, reason: str, details: dict | None = None) -> int:
        with self._write() as s:
            e = Event(created=now(), kind=kind, reason=reason, details=dict(details or {}))
            s.add(e)
            s.flush()
            return e.id

    def list_events(self, limit: int = 100) -> list[Row]:
        """Newest first: Row(id, created, kind, reason, details)."""
        with self._read() as s:
            return [_row(e) for e in s.scalars(select(Event).order_by(Event.id.desc()).limit(limit))]

    # -- export / import ---------------------------------------------------------------------------
    def dump_profiles(self, *, status: str | None = None, fingerprint: str | None = None) -> bytes:
        """The export document (JSON bytes, deterministic: same database → same bytes)."""
        profiles = [rec for _id, rec in self.list_profiles(status=status, fingerprint=fingerprint)]
        hashes = sorted({r.key.fingerprint for r in profiles})
        with self._read() as s:
            fps = {fp.hash: fp for fp in s.scalars(select(Fingerprint).where(Fingerprint.hash.in_(hashes)))}
        doc = ProfilesFile(
            format=EXPORT_FORMAT,
            version=EXPORT_VERSION,
            moetune_version=_moetune_version(),
            fingerprints=[
                ExportedFingerprint(
                    hash=h, facts=dict(fps[h].facts), first_seen=fps[h].first_seen, last_seen=fps[h].last_seen
                )
                for h in hashes
                if h in fps
            ],
            profiles=profiles,
        )
        return msgspec.json.format(msgspec.json.encode(doc, order="deterministic"), indent=2) + b"\n"

    def export_profiles(
        self, path: str | Path, *, status: str | None = None, fingerprint: str | None = None
    ) -> int:
        """Write the profiles (with their fingerprints' facts) to a JSON file atomically; returns how many."""
        data = self.dump_profiles(status=status, fingerprint=fingerprint)
        n = len(msgspec.json.decode(data)["profiles"])
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return n

    def import_profiles(self, path: str | Path) -> ImportResult:
        """Import an export file: everything is validated first, then written in one transaction.
        Raises ProfileImportError (nothing written) on any problem. Never creates two current profiles
        for one key: an imported current profile replaces a stored one only when it beats the noise,
        else it is kept as `superseded`. Records already present are skipped."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ProfileImportError(f"cannot read {path}: {e.strerror or e}") from None
        return self.import_bytes(data, source=str(path))

    def import_bytes(self, data: bytes, *, source: str = "<data>") -> ImportResult:
        doc = parse_export(data, source=source)
        result = ImportResult()
        ts = now()
        try:
            with self._write() as s:
                for fp in doc.fingerprints:
                    have = s.scalar(select(Fingerprint).where(Fingerprint.hash == fp.hash))
                    if have is None:
                        s.add(Fingerprint(hash=fp.hash, facts=fp.facts, first_seen=fp.first_seen, last_seen=fp.last_seen))
                        result.fingerprints += 1
                    elif not have.facts and fp.facts:  # a placeholder learns its facts
                        have.facts = fp.facts
                s.flush()
                for rec in doc.profiles:
                    before = s.scalar(select(func.count(Fingerprint.id)).where(Fingerprint.hash == rec.key.fingerprint))
                    if not before:
                        self._ensure_fingerprint(s, rec.key.fingerprint, ts)
                        result.fingerprints += 1
                    dup = s.scalar(
                        select(Profile.id).where(
                            *_key_filter(rec.key),
                            Profile.profile_hash == rec.profile_hash,
                            Profile.created == rec.created,
                        )
                    )
                    if dup is not None:
                        result.skipped += 1
                        continue
                    row = _row_from_record(rec, ts, keep_times=True)
                    if rec.status == "current":
                        old = s.scalar(select(Profile).where(*_key_filter(rec.key), Profile.status == "current"))
                        if old is not None:
                            if _beats_noise(old, rec)[0]:
                                old.status = "superseded"
                                old.updated = ts
                                s.flush()
                                result.replaced += 1
                            else:
                                row.status = "superseded"
                                result.kept_superseded += 1
                    s.add(row)
                    s.flush()
                    result.inserted += 1
                    result.current += row.status == "current"
        except IntegrityError as e:
            raise ProfileImportError(f"{source}: rejected by the database, nothing imported: {e.orig}") from None
        return result


def parse_export(data: bytes, *, source: str = "<data>") -> ProfilesFile:
    """Decode and validate an export document completely; raises ProfileImportError naming the problem."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise ProfileImportError(f"{source}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ProfileImportError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != EXPORT_FORMAT:
        raise ProfileImportError(f"{source}: not a moetune profiles file (format {raw.get('format')!r}, expected {EXPORT_FORMAT!r})")
    if raw.get("version") != EXPORT_VERSION:
        raise ProfileImportError(
            f"{source}: unsupported format version {raw.get('version')!r} (this moetune reads {EXPORT_VERSION})"
        )
    try:
        doc = msgspec.convert(raw, ProfilesFile)
    except (msgspec.ValidationError, KnobError, ValueError, TypeError) as e:
        raise ProfileImportError(f"{source}: invalid: {e}") from None
    seen_fp: set[str] = set()
    for i, fp in enumerate(doc.fingerprints):
        if not fp.hash:
            raise ProfileImportError(f"{source}: fingerprints[{i}].hash is empty")
        if fp.hash in seen_fp:
            raise ProfileImportError(f"{source}: fingerprints[{i}]: fingerprint {fp.hash} appears twice")
        seen_fp.add(fp.hash)
    current: dict[ProfileKey, int] = {}
    for i, rec in enumerate(doc.profiles):
        try:
            _check_record(rec)
        except ValueError as e:
            raise ProfileImportError(f"{source}: profiles[{i}]: {e}") from None
        if rec.status == "current":
            if rec.key in current:
                raise ProfileImportError(
                    f"{source}: profiles[{current[rec.key]}] and profiles[{i}] are both current for the same key "
                    f"({_key_text(rec.key)})"
                )
            current[rec.key] = i
    return doc


def _key_text(key: ProfileKey) -> str:
    return (
        f"{key.fingerprint[:12]} {key.transport_family} ep{key.ep_size}x{key.nodes} "
        f"h{key.hidden}/i{key.intermediate}/e{key.experts}/k{key.topk} {key.dtype} t{key.token_bucket}"
    )


def _check_record(rec: ProfileRecord) -> None:
    import math

    for name in ("latency_us", "spread_us"):
        v = getattr(rec, name)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v}")
    if not rec.key.fingerprint:
        raise ValueError("key.fingerprint must not be empty")
    if rec.status not in ("current", "stale", "superseded"):
        raise ValueError(f"status must be current, stale or superseded, got {rec.status!r}")


def _row_from_record(rec: ProfileRecord, ts: str, *, keep_times: bool = False) -> Profile:
    return Profile(
        **{c: getattr(rec.key, c) for c in PROFILE_KEY_COLUMNS},
        knobs=rec.knobs.to_dict(),
        latency_us=float(rec.latency_us),
        spread_us=float(rec.spread_us),
        backend=rec.backend,
        status=rec.status,
        software_versions=dict(rec.software_versions),
        profile_hash=rec.profile_hash,
        created=rec.created or ts,
        updated=(rec.updated or rec.created or ts) if keep_times else ts,
    )


def _row(obj: Any) -> Row:
    return Row({c.key: getattr(obj, c.key) for c in obj.__table__.columns})


def _fp_row(fp: Fingerprint) -> Row:
    return _row(fp)
