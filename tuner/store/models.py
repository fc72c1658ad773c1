"""SQLAlchemy 2.0 typed ORM models of the profile database (schema owned by migrations/).

Timestamps are ISO-8601 UTC strings (`2026-11-30T05:00:00.123456+00:00`): exact round trips through
export/import and readable with plain `sqlite3` (the runtime's read-only fallback has no SQLAlchemy).
JSON columns hold canonical facts, knobs, software versions and free-form details.

Plain `sqlite3` readers (the runtime's fallback, which has no SQLAlchemy) read current profiles with:

    SELECT knobs, latency_us, spread_us, backend, token_bucket, transport_family, profile_hash,
           provenance, measured_on
    FROM profiles WHERE status = 'current' AND fingerprint = ? AND software = ? AND ep_size = ?
      AND nodes = ? AND hidden = ? AND intermediate = ? AND experts = ? AND topk = ? AND dtype = ?

and add `AND provenance = 'measured'` for what may be applied as tuned (column added by migration 0003).
`perf_env` (migration 0006) is the JSON of the measuring process's performance environment, NULL when not recorded;
`runtime_options` and `runtime_options_digest` (migration 0009) the data-path runtime options it ran under and their
digest, NULL when not recorded. `fingerprints.origin` and `fingerprints.node` (migration 0010): where a fingerprint's
facts came from ('local', 'import', 'capture'; NULL: not recorded) and which node recorded a 'local' row.

(`knobs` is the JSON of `Knobs.to_dict()`; open with `file:PATH?mode=ro`, uri=True.)
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from sqlalchemy import JSON, CheckConstraint, Float, ForeignKey, Index, Integer, MetaData, String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, validates

from moetune.runtime.profile_record import PROFILE_STATUSES, PROVENANCES

# Stable constraint names so batch migrations on SQLite can find them.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}



def _sql_in(values: tuple[str, ...]) -> str:
    """`'a', 'b'`: the values of a CHECK ... IN (...) written from the runtime's tuple (one definition; a change of
    it still needs a migration, which tests/test_store_schema_head.py asks for; `db check` names a database whose
    CHECK differs, `_schema.check_constraint_diff`)."""
    return ", ".join(f"'{v}'" for v in values)


# The columns that make a profile key (ProfileKey's fields, same names).
PROFILE_KEY_COLUMNS = (
    "fingerprint",
    "software",
    "transport_family",
    "ep_size",
    "nodes",
    "hidden",
    "intermediate",
    "experts",
    "topk",
    "dtype",
    "token_bucket",
)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, dict[str, str]: JSON}  # noqa: RUF012


# Where a fingerprint row's facts came from (migration 0010): 'local' measured or discovered on the node that recorded
# them (`moetune profile`, a tune of this node, `fabric show --record` of this node, the daemon's discovery), 'import'
# from a profiles file, 'capture' a capture read (`fabric show --record --capture`, a daemon serving one): another node's
FingerprintOrigin = Literal["local", "import", "capture"]
FINGERPRINT_ORIGINS: tuple[FingerprintOrigin, ...] = get_args(FingerprintOrigin)


class Fingerprint(Base):
    """A fabric fingerprint: the hash and the canonical facts it was computed from, and where they came from."""

    __tablename__ = "fingerprints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hash: Mapped[str] = mapped_column(String(128), unique=True)
    facts: Mapped[dict[str, Any]]
    first_seen: Mapped[str] = mapped_column(String(40))
    last_seen: Mapped[str] = mapped_column(String(40))
    # Added by migration 0010: FINGERPRINT_ORIGINS, and for 'local' the node that recorded them (`_owner.node_id`).
    # NULL: not recorded (a row from before 0010, a placeholder without facts): never taken for this node's
    origin: Mapped[str | None] = mapped_column(String(16))
    node: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (CheckConstraint(f"origin IN ({_sql_in(FINGERPRINT_ORIGINS)})", name="origin"),)


class TuningRun(Base):
    """One Optuna study run: where its trials live and how it ended."""

    __tablename__ = "tuning_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_name: Mapped[str] = mapped_column(String(256))
    storage: Mapped[str] = mapped_column(String(1024))
    backend: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(32))
    # the trials THIS run finished (a resumed or shared study's others are its other runs' and workers'); a daemon
    # job's row (`moetune-daemon-job-N`) counts the profiles the job wrote
    trials: Mapped[int] = mapped_column(Integer, default=0)
    # unlike `trials`, the STUDY's best value (its trials of every run and worker, earlier ones included) when this
    # run last noted it, not the best of this run's own trials; a daemon job's row: the best latency it stored
    best_value: Mapped[float | None] = mapped_column(Float)
    started: Mapped[str] = mapped_column(String(40))
    ended: Mapped[str | None] = mapped_column(String(40))
    # the process running it, HOST:PID:START (`run_owner`): a later run closes a `running` row whose owner is gone
    owner: Mapped[str | None] = mapped_column(String(320))


class Measurement(Base):
    """One measured quantity on one fingerprint (a bandwidth, a latency, a stall count...)."""

    __tablename__ = "measurements"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(ForeignKey("fingerprints.hash", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    transport: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int | None] = mapped_column(Integer)
    value: Mapped[float] = mapped_column(Float)
    spread: Mapped[float] = mapped_column(Float)
    unit: Mapped[str] = mapped_column(String(32))
    extra: Mapped[dict[str, Any]]
    created: Mapped[str] = mapped_column(String(40))
    # Added by migration 0002: the tuning run that produced it, when there was one.
    run_id: Mapped[int | None] = mapped_column(ForeignKey("tuning_runs.id", ondelete="SET NULL"), index=True)


class Profile(Base):
    """A tuned profile: the key it is valid for, its knobs, and how well they measured."""

    __tablename__ = "profiles"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(ForeignKey("fingerprints.hash", ondelete="CASCADE"))
    software: Mapped[str] = mapped_column(String(128))
    transport_family: Mapped[str] = mapped_column(String(64))
    ep_size: Mapped[int] = mapped_column(Integer)
    nodes: Mapped[int] = mapped_column(Integer)
    hidden: Mapped[int] = mapped_column(Integer)
    intermediate: Mapped[int] = mapped_column(Integer)
    experts: Mapped[int] = mapped_column(Integer)
    topk: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(32))
    token_bucket: Mapped[int] = mapped_column(Integer)
    knobs: Mapped[dict[str, Any]]
    latency_us: Mapped[float] = mapped_column(Float)
    spread_us: Mapped[float] = mapped_column(Float)
    backend: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16))
    software_versions: Mapped[dict[str, str]]
    profile_hash: Mapped[str] = mapped_column(String(32))
    created: Mapped[str] = mapped_column(String(40))
    updated: Mapped[str] = mapped_column(String(40))
    # Added by migration 0003: measured / node_model / preset, and the fingerprint (or `preset:<name>`)
    # the numbers come from.
    provenance: Mapped[str] = mapped_column(String(16))
    measured_on: Mapped[str] = mapped_column(String(160))
    # Added by migration 0005: the routing the numbers were measured under (`uniform`, `zipf:S`; "" not
    # recorded). Not part of the key: latencies of two routings are never compared (`_rows.decide`).
    routing: Mapped[str] = mapped_column(String(32))
    # Added by migration 0006: the performance environment (NCCL_*, NVSHMEM_*, FI_*, ...) of the process that
    # measured the numbers (runtime/profiles/perf_env.py); NULL = not recorded (a modelled profile, a row from
    # before 0006): unknown, never taken to match a job's. Not part of the key.
    perf_env: Mapped[dict[str, str] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    # Added by migration 0009: the data-path runtime options (hs_native, symm, fused_pack, ...: runtime/options.py
    # DATA_PATH_OPTIONS) the measuring ranks ran under, a readable copy, and its digest (`data_path_digest`); NULL =
    # not recorded (a modelled profile, a row from before 0009): unknown, never taken to match a job's. Not part of
    # the key: the runtime applies a profile as tuned only under the options it was measured under.
    runtime_options: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    runtime_options_digest: Mapped[str | None] = mapped_column(String(16), nullable=True)

    __table_args__ = (
        CheckConstraint(f"status IN ({_sql_in(PROFILE_STATUSES)})", name="status"),
        CheckConstraint(f"provenance IN ({_sql_in(PROVENANCES)})", name="provenance"),
        CheckConstraint("latency_us >= 0 AND spread_us >= 0", name="latency"),
        # At most one current profile per key: a partial unique index.
        Index(
            "uq_profiles_current_key",
            *PROFILE_KEY_COLUMNS,
            unique=True,
            sqlite_where=text("status = 'current'"),
            postgresql_where=text("status = 'current'"),
        ),
        Index("ix_profiles_lookup", "fingerprint", "status"),
    )


# What an event records: the one list of the events table's kinds. The store writes no other (Event checks it, as
# Store.add_event does) and a `kinds=` filter naming another is refused (a typo would match nothing, silently).
EventKind = Literal[
    # the daemon's re-tune jobs (tuner/daemon/jobs.py; details.job_id names the job)
    "job_queued", "job_started", "job_cancelled", "job_deferred", "job_finished",
    # the daemon's view of the fabric (tuner/daemon/watch.py)
    "fabric_seen", "fabric_changed",
    # profiles of a fingerprint marked stale, or current again (Store.mark_stale / restore_stale)
    "stale", "restored",
    # a replacement the numbers alone do not explain (_rows.replacement_event: the decision's rule)
    "remeasured", "routing",
    # a file imported (io.import_file)
    "import_completed",
    # written by migrations (as plain SQL, with these spellings frozen there): values a downgrade dropped and an
    # upgrade gave back, and rows relabelled
    "provenance_dropped", "provenance_restored", "routing_dropped", "routing_restored", "perf_env_dropped",
    "perf_env_restored", "runtime_options_dropped", "runtime_options_restored", "relabelled",
]
EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)


def check_event_kinds(kinds: tuple[str, ...] | list[str]) -> None:
    """ValueError naming each kind of `kinds` that is not an EventKind."""
    unknown = [k for k in kinds if k not in EVENT_KINDS]
    if unknown:
        raise ValueError(f"unknown event kind(s) {', '.join(map(repr, unknown))}; known: {', '.join(EVENT_KINDS)}")


class Event(Base):
    """Something that happened: hardware or software changed, profiles went stale, a run ended."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created: Mapped[str] = mapped_column(String(40), index=True)
    kind: Mapped[str] = mapped_column(String(64))  # an EventKind (rows an older moetune wrote may hold others)
    reason: Mapped[str] = mapped_column(String(4096))
    details: Mapped[dict[str, Any]]

    @validates("kind")
    def _known_kind(self, _key: str, kind: str) -> str:
        check_event_kinds([kind])  # every writer, not only add_event (mark_stale, imports, replacements)
        return kind
