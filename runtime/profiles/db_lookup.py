"""The runtime's read-only lookups in the store's SQLite file: the fallback when the daemon does not answer.

Opened with the stdlib sqlite3 module through `sqlite_open` (never SQLAlchemy, never a write): a database a newer
moetune wrote is refused (`newer_schema_problem`), profile rows are read by the columns each schema revision has
(`query_db_profiles`), this node's identity comes from the recorded fingerprints (`node_identity_from_db`), and
`pick_profile` chooses among records as the daemon's index does (the daemon imports it and `provenance_of`, the
one rule of what counts as measured: one rule for both).
"""

from __future__ import annotations

import json
import logging
import shlex
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from moetune.runtime import wire
from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import (
    ENGINE_FAMILIES,
    PRESET_PREFIX,
    PROVENANCES,
    ProfileKey,
    ProfileRecord,
    comparable,
    effective_provenance,
    nearest_bucket_within,
)
from moetune.runtime.profiles import node_identity, sqlite_open
from moetune.runtime.profiles.perf_env import parse_recorded
from moetune.runtime.profiles.tuned_options import parse_recorded_options

__all__ = [
    "KNOWN_SCHEMA_REVISIONS",
    "db_read",
    "db_read_with",
    "newer_schema_problem",
    "node_identity_from_db",
    "pick_profile",
    "provenance_of",
    "query_db_profiles",
]

log = logging.getLogger("moetune.client")  # the client's logger: the CLI filters its records by it


def provenance_of(rec: ProfileRecord | wire.ProfileResult) -> str:
    """measured | node_model | preset, as the record says (records and replies without the field derive it
    from the backend in their own `__post_init__`). A claimed measurement by a backend that does not measure
    (`model:*`, unknown) is taken as modelled: the label alone never makes a number measured."""
    return effective_provenance(str(rec.provenance), rec.backend, rec.key.fingerprint)  # the one rule (is_tuned_for's)


T = TypeVar("T")
_PROFILE_COLUMNS = (
    "fingerprint, software, transport_family, ep_size, nodes, hidden, intermediate, experts, topk, dtype, "
    "token_bucket, knobs, latency_us, spread_us, backend, status, software_versions, created, updated"
)
_BASE_COLUMNS = len(_PROFILE_COLUMNS.split(","))
# The columns after _PROFILE_COLUMNS each schema has, newest first (read by name: `query_db_profiles`)
_EXTRA_COLUMNS: tuple[tuple[str, ...], ...] = (
    ("provenance", "measured_on", "routing", "perf_env", "runtime_options", "runtime_options_digest"),  # 0009
    ("provenance", "measured_on", "routing", "perf_env"),  # 0006 .. 0008: no runtime options
    ("provenance", "measured_on", "routing"),  # 0005: no perf_env
    ("provenance", "measured_on"),  # 0003, 0004: no routing
    (),  # from before issue 19 (migration 0003): no provenance either
)


def db_read(db_path: str | Path, sql: str, args: list[Any] | tuple[Any, ...] = (), timeout_s: float = 0.05) -> list[tuple]:
    """Rows of one query on the database opened read-only (stdlib sqlite3, never SQLAlchemy, never a write).

    Opened as the store opens it read-only (`sqlite_open`: mode=ro; immutable=1 only where a folder we may not write
    has no -shm and no -wal/-journal holds changes, and such a read is retried, then refused, when the file changed
    under it). Raises FileNotFoundError, sqlite3.Error or OSError when the file cannot be read.
    """
    return db_read_with(db_path, lambda con: con.execute(sql, list(args)).fetchall(), timeout_s)


def db_read_with(db_path: str | Path, use: Callable[[sqlite3.Connection], T], timeout_s: float = 0.05) -> T:
    """`use(connection)`, its queries read as `db_read` reads one (one connection: they see one state of the file):
    `use` reads only what it needs, and runs again from a fresh connection if the file changed under the read, so it
    must not act on what it reads."""
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"no database at {path}")
    try:
        return sqlite_open.read(path.resolve(), use, timeout_s=timeout_s)
    except sqlite3.OperationalError as e:
        if not str(e).startswith("no such table"):
            raise
        # an empty file or another program's database: SQLite's own words named a table, not what is wrong
        raise sqlite3.OperationalError(f"not a moetune profile database ({e}): `moetune db upgrade --db "
                                       f"{shlex.quote(str(path))}` makes one, `moetune profile` fills it") from None


# The store's schema revisions whose `profiles` table this runtime reads (migrations/versions; a test holds the two
# equal): a database at another revision was written by a newer moetune, refused as every `moetune` command refuses
# it (its columns may mean what this runtime does not know)
KNOWN_SCHEMA_REVISIONS = frozenset({"0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010",
                                    "0011"})
_VERSION_TABLE = "moetune_alembic_version"


def newer_schema_problem(db_path: str | Path, timeout_s: float = 0.05) -> str:
    """Why the database at `db_path` is not one this runtime may read ('' when it may): its schema revision is
    unknown here. A database without the version table (from before the migrations) is read as before."""
    try:
        rows = db_read(db_path, f"SELECT version_num FROM {_VERSION_TABLE}", (), timeout_s)
    except sqlite3.OperationalError as e:
        if _VERSION_TABLE in str(e):  # no version table
            return ""
        raise
    revs = sorted({str(r[0]) for r in rows} - KNOWN_SCHEMA_REVISIONS)
    if not revs:
        return ""
    return (f"schema revision {revs[0][:40]}, written by a newer moetune (this one reads up to "
            f"{max(KNOWN_SCHEMA_REVISIONS)}): not read; upgrade moetune on this node")


def query_db_profiles(
    db_path: str | Path,
    *,
    ep_size: int,
    nodes: int,
    hidden: int,
    intermediate: int,
    experts: int,
    topk: int,
    dtype: str,
    fingerprint: str | None = None,
    transport_family: str | None = None,
    timeout_s: float = 0.05,
    check_schema: bool = True,
) -> list[ProfileRecord]:
    """Current profiles of one shape/EP size from the store's `profiles` table, opened read-only.

    The ONE place the runtime reads profiles from the database. Columns as defined by moetune's store
    (`moetune.tuner.store.models`, table `profiles`). Rows that do not parse are skipped. Each record's
    provenance is the column's where the store has one, else what the backend name says (`provenance_of`); its
    routing the column's (migration 0005; "" or no column: not recorded); its perf_env the column's (migration 0006; NULL or no column: not recorded), a row whose perf_env is not one the
    tuner records (`perf_env_problem`) is skipped; so are its runtime options (migration 0009), a row whose recorded
    options are not data-path options as the tuner records them, or not those its digest column names, skipped.
    """
    newer = newer_schema_problem(db_path, timeout_s) if check_schema else ""  # (False: the caller checked it)
    if newer:
        raise sqlite3.OperationalError(newer)
    where = (" FROM profiles WHERE status = 'current' AND ep_size = ? AND nodes = ? "
             "AND hidden = ? AND intermediate = ? AND experts = ? AND topk = ? AND dtype = ?")
    args: list[Any] = [ep_size, nodes, hidden, intermediate, experts, topk, dtype]
    if fingerprint:
        where += " AND fingerprint = ?"
        args.append(fingerprint)
    if transport_family:  # only that family's rows are read and parsed (parsing is most of the read's time)
        where += " AND transport_family = ?"
        args.append(transport_family)
    rows: list[tuple] = []
    names: tuple[str, ...] = ()
    for i, names in enumerate(_EXTRA_COLUMNS):  # newest schema first
        extra = "".join(f", {c}" for c in names)
        try:
            rows = db_read(db_path, f"SELECT {_PROFILE_COLUMNS}{extra}{where}", args, timeout_s)
            break
        except sqlite3.OperationalError as e:
            if "no such column" not in str(e) or i == len(_EXTRA_COLUMNS) - 1:
                raise
    out: list[ProfileRecord] = []
    for r in rows:
        try:
            key = ProfileKey(
                fingerprint=r[0], software=r[1], transport_family=r[2], ep_size=r[3], nodes=r[4], hidden=r[5],
                intermediate=r[6], experts=r[7], topk=r[8], dtype=r[9], token_bucket=r[10],
            )
            knobs = Knobs.from_stored(json.loads(r[11]) if isinstance(r[11], str) else r[11])
            sv = json.loads(r[16]) if isinstance(r[16], str) and r[16] else {}
            x = dict(zip(names, r[_BASE_COLUMNS:], strict=True))
            prov = x.get("provenance", "measured")  # legacy store: the backend name decides below
            if prov not in PROVENANCES:
                raise ValueError(f"unknown provenance {prov!r}")
            perf_env = parse_recorded(x["perf_env"]) if "perf_env" in x else None
            options = (parse_recorded_options(x["runtime_options"], x["runtime_options_digest"])
                       if "runtime_options" in x else None)
            # the routing the numbers were measured under ("" or NULL: not recorded): which latencies a pick among
            # families may compare (`one_routing`)
            routing = x.get("routing")
            rec = ProfileRecord(
                key=key, knobs=knobs, latency_us=float(r[12]), spread_us=float(r[13]), backend=str(r[14]),
                status=r[15], software_versions=sv if isinstance(sv, dict) else {}, created=r[17] or "",
                updated=r[18] or "", provenance=prov, measured_on=str(x.get("measured_on") or ""),
                perf_env=msgspec.UNSET if perf_env is None else perf_env,
                runtime_options=msgspec.UNSET if options is None else options,
                routing=routing if isinstance(routing, str) else msgspec.UNSET,  # "": UNSET (ProfileRecord)
            )
            rec = msgspec.structs.replace(rec, provenance=provenance_of(rec))
            out.append(rec)
        except (ValueError, TypeError, KnobError, msgspec.ValidationError) as e:
            log.debug("skipping an unreadable profile row: %s", e)
    return out


def node_identity_from_db(db_path: str | Path, timeout_s: float = 0.05) -> tuple[node_identity.NodeIdentity | None, str]:
    """This node's identity from the database's recorded fingerprints (see `node_identity`). sqlite3.OperationalError
    for a database a newer moetune wrote (`newer_schema_problem`): the first read of the fallback refuses it."""
    newer = newer_schema_problem(db_path, timeout_s)
    if newer:
        raise sqlite3.OperationalError(newer)
    # a what-if preset's fingerprint (`moetune tune --preset`) names a modelled fabric, not a node: never this one's
    # ... nor is a fingerprint recorded without facts (a placeholder the store adds for a profile's key). Every other
    # row is read, newest first: a LIMIT let other nodes' rows newer than this node's own hide it (an import keeps
    # the file's last_seen; `fabric show --capture --record`; other daemons on a shared database), and no profile
    # applied. last_seen only orders rows that each match this node (the newest of them wins). The facts (~24 KB a
    # fingerprint, and a node or a shared database gathers many) are read one row at a time in that order, only up to
    # the newest that matches: reading (and sorting) all of them took 16 ms of the lookup's budget with 100 older
    # fingerprints, 64 ms with 500.
    return db_read_with(db_path, _newest_matching_fingerprint, timeout_s)


def _newest_matching_fingerprint(con: sqlite3.Connection) -> tuple[node_identity.NodeIdentity | None, str]:
    """`node_identity_from_db` on one connection: the rows in order by their small columns, then each one's facts, in one
    read transaction (one state of the file, as the single query read it)."""
    con.execute("BEGIN")
    order = con.execute("SELECT rowid FROM fingerprints WHERE hash NOT LIKE ? ORDER BY last_seen DESC, rowid DESC",
                        (PRESET_PREFIX + "%",)).fetchall()

    def rows() -> Iterator[tuple]:
        for (rowid,) in order:
            yield from con.execute("SELECT hash, facts, last_seen FROM fingerprints WHERE rowid = ? AND facts IS NOT "
                                   "NULL AND trim(facts) NOT IN ('', '{}', 'null')", (rowid,)).fetchall()

    return node_identity.from_fingerprint_rows(rows())


_PROVENANCE_RANK = {p: i for i, p in enumerate(PROVENANCES)}  # most trusted first


def pick_profile(
    records: list[ProfileRecord], tokens: int, *, fingerprint: str | None = None, transport_family: str | None = None
) -> ProfileRecord | None:
    """The profile at the nearest token bucket among `records` (one shape/EP size), or None when that
    bucket is more than one rung of TOKEN_BUCKETS away from `tokens` (`nearest_bucket_within`).

    With several fingerprints (fingerprint unknown) the most recently updated fingerprint wins; with
    several transport families at the chosen bucket, measured beats the node model beats a preset, then
    the lowest latency wins (unless one family is asked for), compared among numbers of one routing (`one_routing`:
    uniform where numbers of several routings are there) and among whole-layer numbers where round trips are
    stored beside them (`one_metric`). Engine families (`megakernel`: a whole layer's
    latency, not an exchange's) are picked only by name.
    """
    recs = [r for r in records if r.status == "current"]
    if fingerprint:
        recs = [r for r in recs if r.key.fingerprint == fingerprint]
    if transport_family:
        recs = [r for r in recs if r.key.transport_family == transport_family]
    else:
        recs = [r for r in recs if r.key.transport_family not in ENGINE_FAMILIES]
    if not recs:
        return None
    if len({r.key.fingerprint for r in recs}) > 1:
        newest = max(recs, key=lambda r: r.updated or r.created)
        recs = [r for r in recs if r.key.fingerprint == newest.key.fingerprint]
    bucket = nearest_bucket_within(tokens, sorted({r.key.token_bucket for r in recs}))
    if bucket is None:  # the nearest stored bucket is too far from `tokens` to say anything about it
        return None
    at = [r for r in recs if r.key.token_bucket == bucket]
    # A measurement beats a prediction whatever the numbers say: modelled and measured latencies are not
    # one kind of number (a preset's 27 µs must not win over a measured 60 µs).
    def rank(r: ProfileRecord) -> int:
        return _PROVENANCE_RANK.get(provenance_of(r), len(_PROVENANCE_RANK))

    best = min(rank(r) for r in at)  # the best provenance first, then one routing and metric among its records
    return min(comparable([r for r in at if rank(r) == best]), key=lambda r: r.latency_us)
