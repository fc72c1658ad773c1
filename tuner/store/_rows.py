"""Profile rows ↔ ProfileRecord, and the replacement gate: shared by the Store API and import."""

from __future__ import annotations

import datetime as _dt
import logging
from typing import Any

import msgspec
from sqlalchemy import Select, String, select, type_coerce

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.models import PROFILE_KEY_COLUMNS, Profile

log = logging.getLogger("moetune.store")

# measured beats this node's calibrated model beats another machine's preset: a profile never replaces
# one of a higher rank, always replaces one of a lower rank, and within a rank must beat the noise.
PROVENANCE_RANK = {"preset": 0, "node_model": 1, "measured": 2}

# JSON columns read as text, so one undecodable row is skipped instead of failing the whole query.
_COLUMNS = (
    Profile.id,
    *(getattr(Profile, c) for c in PROFILE_KEY_COLUMNS),
    type_coerce(Profile.knobs, String).label("knobs"),
    Profile.latency_us,
    Profile.spread_us,
    Profile.backend,
    Profile.status,
    type_coerce(Profile.software_versions, String).label("software_versions"),
    Profile.created,
    Profile.updated,
    Profile.provenance,
    Profile.measured_on,
)


def select_records() -> Select[Any]:
    return select(*_COLUMNS)


def record_from_row(row: Any) -> ProfileRecord:
    """A ProfileRecord from a `select_records()` row; ValueError says what is wrong with it."""
    try:
        key = ProfileKey(**{c: getattr(row, c) for c in PROFILE_KEY_COLUMNS})
        knobs = Knobs.from_dict(msgspec.json.decode(row.knobs or "null"))
        versions = msgspec.json.decode(row.software_versions or "{}", type=dict[str, str])
        return ProfileRecord(
            key=key,
            knobs=knobs,
            latency_us=row.latency_us,
            spread_us=row.spread_us,
            backend=row.backend,
            status=row.status,
            software_versions=versions,
            created=row.created,
            updated=row.updated,
            provenance=row.provenance,
            measured_on=row.measured_on,
        )
    except (KnobError, ValueError, TypeError, msgspec.DecodeError) as e:
        raise ValueError(f"profile {row.id} in the database is invalid for this moetune: {e}") from None


def records(rows: Any) -> list[tuple[int, ProfileRecord]]:
    """Decode rows, skipping (with a warning naming the row) any that cannot be read."""
    out = []
    for row in rows:
        try:
            out.append((row.id, record_from_row(row)))
        except ValueError as e:
            log.warning("skipped an unreadable profile row: %s", e)
    return out


def key_filter(key: ProfileKey) -> list[Any]:
    return [getattr(Profile, c) == getattr(key, c) for c in PROFILE_KEY_COLUMNS]


def current_of(key: ProfileKey) -> Select[Any]:
    """The gate's view of the current profile of a key (no JSON columns: a corrupt one does not block)."""
    return select(Profile.id, Profile.latency_us, Profile.spread_us, Profile.provenance).where(
        *key_filter(key), Profile.status == "current"
    )


def decide(old: Any, new: ProfileRecord, *, force_reason: str | None = None) -> tuple[bool, str]:
    """Whether `new` replaces the current profile `old` (a `current_of` row), and why."""
    old_rank, new_rank = PROVENANCE_RANK.get(old.provenance, 0), PROVENANCE_RANK[str(new.provenance)]
    if new_rank > old_rank:
        return True, f"replaced profile {old.id}: a {new.provenance} profile replaces a {old.provenance} one"
    if new_rank < old_rank:
        return False, f"kept the {old.provenance} profile {old.id}: a {new.provenance} profile never displaces it"
    gain = old.latency_us - new.latency_us
    noise = max(old.spread_us, new.spread_us)
    if force_reason is not None:
        return True, f"replaced profile {old.id}: {force_reason}"
    if gain > noise:
        return True, f"replaced profile {old.id}: gain {gain:.3f} us beats the noise {noise:.3f} us"
    return False, f"kept the current profile {old.id}: gain {gain:.3f} us does not beat the noise {noise:.3f} us"


def row_from_record(rec: ProfileRecord, ts: str, *, keep_times: bool = False, status: str | None = None) -> Profile:
    return Profile(
        **{c: getattr(rec.key, c) for c in PROFILE_KEY_COLUMNS},
        knobs=rec.knobs.to_dict(),
        latency_us=float(rec.latency_us),
        spread_us=float(rec.spread_us),
        backend=rec.backend,
        status=status or rec.status,
        software_versions=dict(rec.software_versions),
        profile_hash=rec.profile_hash,
        created=rec.created or ts,
        updated=(rec.updated or rec.created or ts) if keep_times else ts,
        provenance=rec.provenance,
        measured_on=rec.measured_on,
    )


def now() -> str:
    """UTC now as ISO-8601 (the store's timestamp format)."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")
