"""Profile rows ↔ ProfileRecord, and the replacement gate: shared by the Store API and import."""

from __future__ import annotations

import datetime as _dt
import logging
from typing import Any, NamedTuple

import msgspec
from sqlalchemy import Select, String, select, type_coerce

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import (
    PROVENANCES,
    ProfileKey,
    ProfileRecord,
    effective_provenance,
    key_knobs_problem,
    metric_of_backend,
    stored_profile_hashes,
)
from moetune.runtime.profiles.perf_env import parse_recorded
from moetune.runtime.profiles.tuned_options import parse_recorded_options
from moetune.tuner.store.models import PROFILE_KEY_COLUMNS, Event, Profile
from moetune.tuner.store.validate import canonical_routing

log = logging.getLogger("moetune.store")

# measured beats this node's calibrated model beats another machine's preset: a profile never replaces
# one of a higher rank, always replaces one of a lower rank; within a rank `decide` says (same knobs: the newer
# number; other knobs: the noise rule; another routing: only when asked).
PROVENANCE_RANK = {p: len(PROVENANCES) - 1 - i for i, p in enumerate(PROVENANCES)}  # PROVENANCES: most trusted first

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
    Profile.routing,
    type_coerce(Profile.perf_env, String).label("perf_env"),
    type_coerce(Profile.runtime_options, String).label("runtime_options"),
    Profile.runtime_options_digest,
)


def select_records() -> Select[Any]:
    return select(*_COLUMNS)


class UnreadableRow(ValueError):
    """A stored profile row this moetune cannot read: `profile_id`, and `why` (str() names the row too)."""

    def __init__(self, profile_id: int, why: str) -> None:
        super().__init__(f"profile {profile_id} in the database is invalid for this moetune: {why}")
        self.profile_id = profile_id
        self.why = why


def record_from_row(row: Any) -> ProfileRecord:
    """A ProfileRecord from a `select_records()` row; UnreadableRow (a ValueError) says what is wrong with it."""
    try:
        key = ProfileKey(**{c: getattr(row, c) for c in PROFILE_KEY_COLUMNS})
        knobs = Knobs.from_stored(msgspec.json.decode(row.knobs or "null"))
        versions = msgspec.json.decode(row.software_versions or "{}", type=dict[str, str])
        perf_env = parse_recorded(row.perf_env)
        options = parse_recorded_options(row.runtime_options, row.runtime_options_digest)
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
            routing=row.routing or msgspec.UNSET,
            perf_env=msgspec.UNSET if perf_env is None else perf_env,
            runtime_options=msgspec.UNSET if options is None else options,
        )
    except (KnobError, ValueError, TypeError, msgspec.DecodeError) as e:
        raise UnreadableRow(row.id, str(e)) from None


def records(rows: Any, unreadable: list[tuple[int, str]] | None = None) -> list[tuple[int, ProfileRecord]]:
    """Decode rows, leaving out any that cannot be read: (id, why) of each is appended to `unreadable` (the
    Store warns about them once per process and database), else logged here."""
    out = []
    for row in rows:
        try:
            out.append((row.id, record_from_row(row)))
        except UnreadableRow as e:
            if unreadable is None:
                log.warning("skipped an unreadable profile row: %s", e)
            else:
                unreadable.append((e.profile_id, e.why))
    return out


def holds_profile(key: ProfileKey, stored_hash: str, knobs_text: str | None, profile_hash: str) -> bool:
    """Whether a stored row of `key` (its profile_hash column, its knobs JSON as text) is the profile `profile_hash`
    names: the same hash as stored, or one of the forms its key + knobs may carry (`stored_profile_hashes`): a caller
    holds today's hash, a row stored before knobs.HASHED_LATE_KNOBS the older one. Unreadable knobs: the column only.
    Not the forms without a former megakernel default: such a form of these knobs is today's hash of another setting
    (at today's default), and a row stored with it says so in its column."""
    if stored_hash == profile_hash:
        return True
    try:
        knobs = Knobs.from_stored(msgspec.json.decode(knobs_text or "null"))
    except (KnobError, ValueError, TypeError, msgspec.DecodeError):
        return False
    return profile_hash in stored_profile_hashes(key, knobs, former=False)


def row_holds_knobs(key: ProfileKey, stored_hash: str, knobs_text: str | None, knobs: Knobs) -> bool:
    """Whether a stored row of `key` (its profile_hash column, its knobs JSON as text) is a row of `knobs`: its hash
    one of the forms they may carry (`stored_profile_hashes`) and, where readable, its knobs those. The form without a
    former megakernel default (mk_combine_tokens 8) is also today's hash of the setting at today's default (0): only
    the row's knobs tell which of the two it holds. Unreadable knobs: the hash alone."""
    if stored_hash not in stored_profile_hashes(key, knobs):
        return False
    try:
        held = Knobs.from_stored(msgspec.json.decode(knobs_text or "null"))
    except (KnobError, ValueError, TypeError, msgspec.DecodeError):
        return True
    return held == knobs


def key_filter(key: ProfileKey | Profile) -> list[Any]:
    """WHERE terms for the rows of `key` (a ProfileKey, or a stored row: its key columns as they are)."""
    return [getattr(Profile, c) == getattr(key, c) for c in PROFILE_KEY_COLUMNS]


def current_of(key: ProfileKey) -> Select[Any]:
    """The gate's view of the current profile of a key (no JSON columns: a corrupt one does not block)."""
    return select(
        Profile.id,
        Profile.latency_us,
        Profile.spread_us,
        Profile.provenance,
        Profile.measured_on,
        Profile.backend,
        Profile.profile_hash,
        Profile.routing,
        Profile.updated,
        type_coerce(Profile.knobs, String).label("knobs"),  # which setting a hash of two forms is (row_holds_knobs)
        type_coerce(Profile.perf_env, String).label("perf_env"),
        type_coerce(Profile.runtime_options, String).label("runtime_options"),
        Profile.runtime_options_digest,
    ).where(*key_filter(key), Profile.status == "current")


class Decision(NamedTuple):
    """What `decide` says: whether the new profile becomes current, why, and which rule said so.

    `rule`: "provenance" (a higher rank replaces), "rank" (a lower rank never does), "routing" (measured under
    another routing: latencies not compared), "metric" (a number of another metric, round trip vs whole layer:
    not compared; replaced only with `force_reason`), "remeasured" (the same knobs measured again: the newer number is
    the truth about them), "unchanged" (the same knobs and numbers again: nothing to write), "older" (an import of the
    stored knobs measured before the stored number), "contradiction" (the current row's knobs contradict its
    family: no lookup serves it, any sound profile replaces it), "forced" (the
    caller compared both settings side by side), "gain" / "noise" / "slower" (other knobs against the stored
    number)."""

    replace: bool
    reason: str
    rule: str


def _us(latency: float, spread: float) -> str:
    return f"{latency:.3f} ± {spread:.3f} us"


def decide(
    old: Any,
    new: ProfileRecord,
    *,
    force_reason: str | None = None,
    replace_routing: bool = False,
    newer: bool = True,
) -> Decision:
    """Whether `new` replaces the current profile `old` (a `current_of` row), and why.

    In order: provenance (measured > node_model > preset; a higher rank always replaces, a lower never does).
    Routing: two profiles that both record their routing and differ are not compared by latency (a zipf layer
    is slower than a uniform one whatever the knobs); `new` replaces only with `replace_routing`. Metric: numbers of
    two metrics (`profile_record.metric_of_backend`: a round trip, a whole layer) are not compared; `new` replaces only with
    `force_reason` (re-measured side by side in its metric), else the stored one is kept. The same knobs
    from the same source (`profile_hash`, in either form a stored row may carry: `stored_profile_hashes`; `backend` and
    `measured_on` equal): `new` is a re-measurement of what is stored, so
    it replaces whatever the numbers (`newer`: it was measured after the stored one; an import of an older
    record does not), unless the numbers and the recorded performance environment are identical. Other knobs: `force_reason` (a side-by-side
    re-measurement of both settings) replaces; else `new` must beat the STORED number by more than the noise,
    max(old.spread, new.spread). A stored number can be stale (NCCL_* environment, power cap, clocks: what the
    fingerprint does not capture; the environment is recorded, `perf_env`, but not compared here), so a slower new best is not called a loss to it: the reason says that only a
    side-by-side comparison decides, and the stored profile is kept."""
    # a current row whose knobs contradict its family (an older moetune's import: `db check` names it) answers no
    # lookup, so it is no rival: a sound profile (`check_record` refused any other) replaces it, whatever the numbers
    # or the provenance
    contradiction = _held_contradiction(new.key, old.knobs)
    if contradiction is not None:
        return Decision(True, f"replaced profile {old.id}: its knobs or key contradict its family ({contradiction}), "
                              "so no lookup served it", "contradiction")
    # by what the numbers are (a "measured" label on a modelling backend, a hand edit, ranks as modelled: it must
    # not keep a real measurement out), as the runtime takes them
    old_prov, new_prov = effective_provenance(str(old.provenance), old.backend, new.key.fingerprint), new.effective_provenance
    old_rank, new_rank = PROVENANCE_RANK.get(old_prov, 0), PROVENANCE_RANK[new_prov]
    if new_rank > old_rank:
        return Decision(
            True, f"replaced profile {old.id}: a {new_prov} profile replaces a {old_prov} one", "provenance"
        )
    if new_rank < old_rank:
        return Decision(
            False, f"kept the {old_prov} profile {old.id}: a {new_prov} profile never displaces it", "rank"
        )
    old_routing, new_routing = old.routing or "", canonical_routing(new.tuned_routing)
    if old_routing and new_routing and old_routing != new_routing:
        if replace_routing:
            return Decision(
                True,
                f"replaced profile {old.id} (routing {old_routing}) with one measured under routing {new_routing}, "
                f"as asked: their latencies ({_us(old.latency_us, old.spread_us)} vs "
                f"{_us(new.latency_us, new.spread_us)}) are not compared",
                "routing",
            )
        return Decision(
            False,
            f"kept the current profile {old.id}, measured under routing {old_routing}: this one was measured under "
            f"{new_routing}, and latencies under different routings are not compared (replace it explicitly to "
            f"tune for {new_routing})",
            "routing",
        )
    old_metric, new_metric = metric_of_backend(old.backend), metric_of_backend(new.backend)
    if old_metric != new_metric:
        # a round trip and a whole layer are different figures: no gain or loss is read from their difference
        if force_reason is not None:
            return Decision(
                True,
                f"replaced profile {old.id} (a {old_metric} number, {old.backend}): {force_reason}, in the "
                f"{new_metric} metric; the stored {old_metric} number was not compared",
                "metric",
            )
        return Decision(
            False,
            f"kept the current profile {old.id} ({_us(old.latency_us, old.spread_us)}, a {old_metric} number, "
            f"{old.backend}): this one is a {new_metric} number ({_us(new.latency_us, new.spread_us)}, "
            f"{new.backend}), and numbers of different metrics are not compared; only a side-by-side "
            f"re-measurement in the {new_metric} metric replaces it",
            "metric",
        )
    # the stored hash as written: a row from before the knobs knobs.HASHED_LATE_KNOBS holds the older form
    same_knobs = (row_holds_knobs(new.key, old.profile_hash, old.knobs, new.knobs)
                  and (old.backend, old.measured_on) == (new.backend, new.measured_on))
    if same_knobs and newer:
        if ((old.latency_us, old.spread_us) == (new.latency_us, new.spread_us) and _same_perf_env(old, new)
                and _same_options(old, new)):
            return Decision(
                False, f"kept the current profile {old.id}: the same knobs with the same numbers", "unchanged"
            )
        return Decision(
            True,
            f"replaced profile {old.id}: the same knobs re-measured, {_us(old.latency_us, old.spread_us)} -> "
            f"{_us(new.latency_us, new.spread_us)}",
            "remeasured",
        )
    if same_knobs:  # an older record of the stored knobs (an import): the stored number is the newer one
        return Decision(
            False, f"kept the current profile {old.id}: it holds a newer measurement of the same knobs", "older"
        )
    if force_reason is not None:
        return Decision(True, f"replaced profile {old.id}: {force_reason}", "forced")
    gain = old.latency_us - new.latency_us
    noise = max(old.spread_us, new.spread_us)
    if gain > noise:
        return Decision(True, f"replaced profile {old.id}: gain {gain:.3f} us beats the noise {noise:.3f} us", "gain")
    if gain < -noise:
        return Decision(
            False,
            f"kept the current profile {old.id} (other knobs, {_us(old.latency_us, old.spread_us)}, stored "
            f"{str(old.updated)[:19]}): the new best {_us(new.latency_us, new.spread_us)} is slower, but the stored "
            f"number was not re-measured beside it and may be stale; only a side-by-side re-measurement of both "
            f"settings decides (the stored knobs re-measured alone replace their number)",
            "slower",
        )
    return Decision(
        False, f"kept the current profile {old.id}: gain {gain:.3f} us does not beat the noise {noise:.3f} us", "noise"
    )


def _held_contradiction(key: ProfileKey, knobs_text: str | None) -> str | None:
    """`field: why` where a stored row of `key` holds knobs (its JSON as text) that contradict its family
    (`key_knobs_problem`), else None; unreadable knobs are not judged here (the row is read as it was)."""
    try:
        held = Knobs.from_stored(msgspec.json.decode(knobs_text or "null"))
    except (KnobError, ValueError, TypeError, msgspec.DecodeError):
        return None
    p = key_knobs_problem(key, held)
    return None if p is None else f"{p[0]}: {p[1]}"


def replacement_event(old: Any, new: ProfileRecord, new_id: int, decision: Decision, ts: str) -> Event | None:
    """The event a replacement leaves where the numbers alone do not say why (a re-measurement of the same
    knobs: old -> new latency; a replacement across routings), else None."""
    if decision.rule not in ("remeasured", "routing") or not decision.replace:
        return None
    details = {
        "key": new.key.to_dict(),
        "profile_hash": new.profile_hash,
        "provenance": str(new.provenance),
        "from": {"profile": old.id, "latency_us": old.latency_us, "spread_us": old.spread_us,
                 "routing": old.routing or "", "updated": old.updated, "perf_env": _stored_perf_env(old),
                 "runtime_options": _stored_options(old)},
        "to": {"profile": new_id, "latency_us": float(new.latency_us), "spread_us": float(new.spread_us),
               "routing": canonical_routing(new.tuned_routing), "perf_env": new.tuned_perf_env,
               "runtime_options": new.tuned_runtime_options},
    }
    return Event(created=ts, kind=decision.rule, reason=decision.reason, details=details)


def is_newer(new: ProfileRecord, old_updated: str) -> bool:
    """Whether `new` (an imported record) was measured after the stored row's `updated`: unknown is not."""
    try:
        t_new = _dt.datetime.fromisoformat(new.updated or new.created)
        t_old = _dt.datetime.fromisoformat(old_updated)
        return t_new > t_old
    except (TypeError, ValueError):  # a date without a zone compared with one with: unknown
        return False


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
        routing=canonical_routing(rec.tuned_routing),
        perf_env=rec.tuned_perf_env,
        runtime_options=rec.tuned_runtime_options,
        runtime_options_digest=rec.runtime_options_digest,
    )


def _stored_perf_env(old: Any) -> dict[str, str] | None:
    try:
        return parse_recorded(old.perf_env)
    except ValueError:
        return None


def _same_perf_env(old: Any, new: ProfileRecord) -> bool:
    """Whether the stored row (a `current_of` row) recorded the same performance environment as `new`."""
    try:
        return parse_recorded(old.perf_env) == new.tuned_perf_env
    except ValueError:  # an unreadable stored one: not the same
        return False


def _stored_options(old: Any) -> dict[str, Any] | None:
    try:
        return parse_recorded_options(old.runtime_options, old.runtime_options_digest)
    except ValueError:
        return None


def _same_options(old: Any, new: ProfileRecord) -> bool:
    """Whether the stored row (a `current_of` row) recorded the same runtime options as `new`."""
    try:
        return parse_recorded_options(old.runtime_options, old.runtime_options_digest) == new.tuned_runtime_options
    except ValueError:  # an unreadable stored one: not the same
        return False


def now() -> str:
    """UTC now as ISO-8601 (the store's timestamp format)."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")
