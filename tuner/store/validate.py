"""What a profile record must satisfy to be stored (`check_record`) and, stricter, to be imported from a
file someone else wrote (`check_import_record`). Errors name the field."""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Callable
from typing import Any

import msgspec

from moetune.runtime.knobs import TRANSPORTS
from moetune.runtime.options import data_path_problem
from moetune.runtime.profile_record import (  # KNOWN_FAMILIES, is_known_family: the CLI imports them from here
    ENGINE_FAMILIES,
    KNOWN_FAMILIES,
    PROFILE_STATUSES,
    PROVENANCES,
    TOKEN_BUCKETS,
    ProfileRecord,
    is_known_family,
    is_preset_fingerprint,
    node_model_label_problem,
    provenance_of_backend,
    runtime_refusal,
)
from moetune.runtime.profile_record import key_knobs_problem as record_key_knobs_problem
from moetune.runtime.profiles.perf_env import perf_env_problem
from moetune.runtime.shapes import DTYPES, MAX_DIMENSION
from moetune.tuner.store.models import Fingerprint, Profile

# The text a record stores and the column that holds it: SQLite does not enforce a String(N), so a record is held
# to the length the schema declares (taken from the models: one place says it).
TEXT_COLUMNS = (
    ("key.fingerprint", Fingerprint.__table__.c.hash),  # profiles.fingerprint references it
    ("key.software", Profile.__table__.c.software),
    ("key.transport_family", Profile.__table__.c.transport_family),
    ("key.dtype", Profile.__table__.c.dtype),
    ("backend", Profile.__table__.c.backend),
    ("created", Profile.__table__.c.created),
    ("updated", Profile.__table__.c.updated),
    ("measured_on", Profile.__table__.c.measured_on),
)  # and routing (Profile.routing), checked as stored: its canonical spelling
# JSON columns have no declared length: what a real one holds, with wide room (a node's facts are a few KiB; the
# software versions a few dozen names). Past these a file is not an export of a real database.
MAX_FACTS_BYTES = 256 * 1024
MAX_SOFTWARE_VERSIONS_BYTES = 64 * 1024
SQLITE_INT_MAX = (1 << 63) - 1
# A clock a little ahead of ours is not a forged date; more than this is.
FUTURE_SLACK = _dt.timedelta(minutes=5)
EARLIEST_IMPORT_TIME = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)  # an imported date before it is no store's


class FieldError(ValueError):
    """A record field that is not acceptable; str() is `field: why`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# C0 controls, DEL and C1 controls: ESC starts a terminal escape sequence; a CSI (0x9b) is one on its own.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def has_control(text: str) -> bool:
    return _CONTROL.search(text) is not None


def printable(text: str) -> str:
    """`text` with each control character written as its escape (`\\x1b`): safe to print to a terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def control_field(obj: Any, path: str) -> tuple[str, str] | None:
    """(field, value) of the first string in `obj` (JSON data, dict keys too) that holds a control character."""
    stack = [(path, obj)]
    while stack:  # not recursive: the depth of imported JSON is the file's to choose
        where, v = stack.pop()
        if isinstance(v, str):
            if has_control(v):
                return where, v
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                k = str(k)
                if has_control(k):  # the key itself: named by its repr
                    return f"{where}[{k!r}]", k
                stack.append((f"{where}.{k}" if where else k, item))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(v))))
    return None


def check_no_control(obj: Any, path: str = "") -> None:
    """FieldError naming the first string of `obj` with a control character, and its value (repr)."""
    found = control_field(obj, path)
    if found is not None:
        field, value = found
        raise FieldError(field, f"control character in {value[:64]!r}: refused (it would reach a terminal)")


def family_transport(family: str) -> str:
    """Knobs.transport for a transport family name (`proxy:libfabric/cxi` → `proxy`; the one-GPU `megakernel`
    engine family runs with the world-1 layer's `collective`)."""
    head = family.split(":", 1)[0].split("/", 1)[0]
    return "collective" if head in ENGINE_FAMILIES else head


def _big_ints(obj: Any, path: str) -> list[str]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int):
        return [path] if not -SQLITE_INT_MAX - 1 <= obj <= SQLITE_INT_MAX else []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _big_ints(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _big_ints(v, f"{path}[{i}]")]
    return []


def canonical_routing(spec: str) -> str:
    """The one spelling of a routing a profile was measured under: `uniform` or `zipf:S` (`zipf` is `zipf:1`,
    `ZIPF:1.20` is `zipf:1.2`); "" stays "" (not recorded). ValueError (runtime.routing.parse_routing) else."""
    if not spec:
        return ""
    from moetune.runtime.routing import parse_routing  # no torch at import

    kind, exponent = parse_routing(spec)
    return kind if kind == "uniform" else f"{kind}:{exponent:g}"


def column_length(column: Any) -> int:
    return int(column.type.length)


def check_length(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise FieldError(field, f"{len(value)} characters, the database column holds at most {limit}: "
                                f"{value[:32]!r}...")


def check_json_size(field: str, obj: Any, limit: int) -> None:
    size = len(msgspec.json.encode(obj))
    if size > limit:
        raise FieldError(field, f"{size} bytes of JSON, at most {limit} ({limit // 1024} KiB) accepted")


def _check_measured_only(rec: ProfileRecord, field: str, recorded: dict[str, Any] | None,
                         problem: Callable[[dict[str, Any]], str | None], what: str) -> None:
    """A field that says what a measuring process ran in or under (perf_env, runtime_options), when recorded: a
    prediction ran in no process, so only a measurement has one; then `problem`'s check of its value."""
    if recorded is None:
        return
    if rec.provenance != "measured":
        raise FieldError(field, f"recorded for a {rec.provenance} profile; only a measurement has {what}")
    why = problem(recorded)
    if why is not None:
        raise FieldError(field, why)


def key_knobs_problem(rec: ProfileRecord) -> tuple[str, str] | None:
    """(field, why) where the record's knobs or key contradict its family (`profile_record.key_knobs_problem`, the one
    predicate, which the serving paths use too)."""
    return record_key_knobs_problem(rec.key, rec.knobs)


def measured_unrunnable_problem(rec: ProfileRecord) -> str | None:
    """Why a record labelled measured cannot have been measured, no run of this runtime taking it
    (`profile_record.runtime_refusal`: a transport the runtime lacks, ibgda, or proxy or nvlink beyond MAX_WORLD ranks
    or across nodes), or None. Modelled, it
    is a what-if report (a model tune of a cross-node proxy preset), which autoload passes over. `check_record`
    refuses such a record; `db check` names a stored one."""
    unrunnable = runtime_refusal(rec.key, rec.knobs)
    if rec.provenance == "measured" and unrunnable:
        return f"measured, but no run can take it: {unrunnable}"
    return None


def check_record(rec: ProfileRecord) -> None:
    """What every stored profile satisfies (the database's own constraints, said before it is asked)."""
    for field, column in TEXT_COLUMNS:
        obj: Any = rec
        for part in field.split("."):
            obj = getattr(obj, part)
        check_length(field, str(obj), column_length(column))
    check_json_size("software_versions", rec.software_versions, MAX_SOFTWARE_VERSIONS_BYTES)
    for name in ("latency_us", "spread_us"):
        v = getattr(rec, name)
        if not math.isfinite(v) or v < 0:
            raise FieldError(name, f"must be a finite number >= 0, got {v}")
    if not rec.key.fingerprint:
        raise FieldError("key.fingerprint", "must not be empty")
    # every lookup rounds S to a bucket (another key is never found), and an export of it could not be imported
    if rec.key.token_bucket not in TOKEN_BUCKETS:
        raise FieldError("key.token_bucket", f"{rec.key.token_bucket} is not a token bucket "
                                             f"({', '.join(map(str, TOKEN_BUCKETS))})")
    if rec.status not in PROFILE_STATUSES:
        raise FieldError("status", f"must be one of {', '.join(PROFILE_STATUSES)}, got {rec.status!r}")
    if rec.provenance not in PROVENANCES:
        raise FieldError("provenance", f"must be one of {', '.join(PROVENANCES)}, got {rec.provenance!r}")
    # The label alone never makes a number measured (the client reads such a record as modelled): stored as
    # measured, a preset's prediction would be listed as measured and would compete with real measurements.
    if rec.provenance == "measured" and provenance_of_backend(rec.backend) != "measured":
        raise FieldError("provenance", f"measured, but backend {rec.backend[:64]!r} does not measure (local:*)")
    # nor under a what-if preset's key: `preset:NAME` names a modelled fabric, no node, so nothing was measured on it
    # (stored, the label outranked and replaced the preset's own prediction, and was listed as measured)
    if rec.provenance == "measured" and is_preset_fingerprint(rec.key.fingerprint):
        raise FieldError("provenance", f"measured, but the key's fingerprint {rec.key.fingerprint[:64]!r} is a preset's "
                                       "modelled fabric, on which nothing is measured")
    # nor measured on another fingerprint than its key's: the client would apply that node's numbers as tuned here
    # (import refused it; put_profile stored it, and an export of it was one no import takes)
    if rec.provenance == "measured" and rec.measured_on != rec.key.fingerprint:
        raise FieldError("measured_on", f"a measured profile is measured on its key's fingerprint, got {rec.measured_on[:64]!r}")
    # nor one no run of this runtime can take (ibgda; proxy or nvlink beyond MAX_WORLD ranks or across nodes): nothing can
    # have measured it
    unrunnable = measured_unrunnable_problem(rec)
    if unrunnable:
        raise FieldError("provenance", unrunnable)
    # nor this node's model: node_model outranks preset, so a preset's (or another node's model's) prediction so
    # labelled would displace a faster preset profile and be served as this node's model
    why = node_model_label_problem(str(rec.provenance), rec.backend, rec.key.fingerprint)
    if why:
        raise FieldError("provenance", why)
    contradiction = key_knobs_problem(rec)
    if contradiction is not None:
        raise FieldError(*contradiction)
    try:
        routing = canonical_routing(rec.tuned_routing)
    except ValueError as e:
        raise FieldError("routing", str(e)) from None
    check_length("routing", routing, column_length(Profile.__table__.c.routing))
    _check_measured_only(rec, "perf_env", rec.tuned_perf_env, perf_env_problem, "one")
    _check_measured_only(rec, "runtime_options", rec.tuned_runtime_options, data_path_problem, "them")
    for where, obj in (("key", rec.key.to_dict()), ("knobs", rec.knobs.to_dict())):
        big = _big_ints(obj, where)
        if big:
            raise FieldError(big[0], f"integer out of range (at most {SQLITE_INT_MAX})")
    # the shape is one a ModelShape can be (what a request carries, what the daemon's re-tune tunes): past it, no
    # lookup could ever be answered with the profile, and its re-tune failed the whole job
    for name in ("hidden", "intermediate", "experts", "topk"):
        value = getattr(rec.key, name)
        if value > MAX_DIMENSION:
            raise FieldError(f"key.{name}", f"{value} is past the largest model dimension (at most {MAX_DIMENSION})")


def check_import_time(field: str, value: str, now: _dt.datetime) -> None:
    """An imported date: ISO-8601 with a time zone, not in the future (FieldError names `field`)."""
    try:
        t = _dt.datetime.fromisoformat(value)
    except ValueError:
        raise FieldError(field, f"not an ISO-8601 date: {value[:64]!r}") from None
    if t.tzinfo is None:
        raise FieldError(field, f"date without a time zone: {value[:64]!r}")
    try:  # `utc_text` stores it in UTC: a date near year 1 or 9999 has no UTC date (OverflowError)
        t = t.astimezone(_dt.UTC)
    except (OverflowError, ValueError):
        raise FieldError(field, f"date out of range: {value[:64]!r}") from None
    if t > now + FUTURE_SLACK:
        raise FieldError(field, f"date in the future: {value[:64]!r} (it would win every 'newest' comparison)")
    if t < EARLIEST_IMPORT_TIME:
        # no moetune wrote it (every date is the store's clock); sorted as text it would lose every "newest" comparison
        raise FieldError(field, f"date before 1970: {value[:64]!r} (no moetune wrote it)")


def utc_text(value: str) -> str:
    """An imported date (checked by `check_import_time`) as the store writes its own (`now()`): UTC, ISO-8601,
    microseconds, +00:00. Dates are compared as text (`ORDER BY last_seen`, the newest fingerprint): a `+14:00`
    date, or a `20261101T000000+00:00` (basic format), sorted as the newest whatever its instant."""
    return _dt.datetime.fromisoformat(value).astimezone(_dt.UTC).isoformat(timespec="microseconds")


def check_fingerprint_text(field: str, fp_hash: str, facts: Any) -> None:
    """An imported fingerprint: its hash within the column, its facts within MAX_FACTS_BYTES."""
    check_length(f"{field}.hash", fp_hash, column_length(Fingerprint.__table__.c.hash))
    check_json_size(f"{field}.facts", facts, MAX_FACTS_BYTES)


def check_import_record(rec: ProfileRecord, now: _dt.datetime | None = None) -> None:
    """`check_record` plus what a file from elsewhere may get wrong: a key no moetune would write, a control
    character in any text (listed and shown later, it would reach the terminal)."""
    check_no_control(msgspec.to_builtins(rec))
    # before check_record, whose ">= 0" would be said of a negative latency that a file may not have at 0 either
    if not (math.isfinite(rec.latency_us) and rec.latency_us > 0):
        raise FieldError("latency_us", f"must be a finite number > 0, got {rec.latency_us}")
    check_record(rec)
    key = rec.key
    if key.dtype not in DTYPES:
        raise FieldError("key.dtype", f"unknown dtype {key.dtype[:64]!r} (known: {', '.join(DTYPES)})")
    if key.token_bucket not in TOKEN_BUCKETS:
        raise FieldError("key.token_bucket", f"{key.token_bucket} is not a token bucket ({', '.join(map(str, TOKEN_BUCKETS))})")
    if key.topk > key.experts:
        raise FieldError("key.topk", f"top-k {key.topk} is above the expert count {key.experts}")
    transport = family_transport(key.transport_family)
    # any other text would be listed and shown as a family (an escape sequence in it reaches the terminal)
    if transport not in TRANSPORTS or not is_known_family(key.transport_family):
        raise FieldError(
            "key.transport_family",
            f"unknown transport family {key.transport_family[:64]!r} (known: {', '.join(sorted(KNOWN_FAMILIES))}, "
            "proxy:libfabric/PROVIDER)",
        )
    if rec.knobs.transport != transport:
        raise FieldError(
            "knobs.transport",
            f"knobs for transport {rec.knobs.transport!r} under a {key.transport_family!r} key",
        )
    now = now or _dt.datetime.now(_dt.UTC)
    for name in ("created", "updated"):
        if getattr(rec, name):
            check_import_time(name, getattr(rec, name), now)
    if rec.provenance == "preset" and not is_preset_fingerprint(rec.measured_on):
        raise FieldError("measured_on", f"a preset profile names its preset (preset:NAME[:DIGEST]), got {rec.measured_on[:64]!r}")


def field_of_validation_error(err: msgspec.ValidationError) -> str:
    """`$.profiles[3].key.dtype` → `profiles[3].key.dtype` (msgspec's path, for messages)."""
    msg = str(err)
    return msg.rsplit(" - at `$.", 1)[-1].rstrip("`") if " - at `$." in msg else ""
