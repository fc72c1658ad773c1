"""The daemon's wire messages: the ONE place they are defined.

Transport: ZeroMQ. Clients use a DEALER socket and send ONE frame per request; the daemon's ROUTER
answers with ONE frame per reply. Frames are JSON (UTF-8). Never pickle.

Request::

    {"v": 1, "id": <int|str>, "op": "<op>", ...op fields...}

Reply::

    {"v": 1, "id": <same id>, "ok": true,  "epoch": "<daemon start id>", "result": {...}}
    {"v": 1, "id": <same id>, "ok": false, "epoch": "<daemon start id>", "error": {"code": ..., "message": ...}}

Ops: ``hello``, ``get_profile``, ``list_profiles``, ``fabric``, ``status``, ``retune``.

Change notifications go out on a PUB socket as two frames ``[topic, json]`` where the topic is the
change kind (``profile_updated``, ``profile_stale``, ``fabric_changed``) and the JSON body is a
`Change` carrying a monotonically increasing ``version``. A client subscribes first, then fetches a
snapshot (``list_profiles`` / ``get_profile`` / ``hello`` carry the current ``version``) and then
applies only changes whose version is above the snapshot's (the ZeroMQ Guide's Clone pattern).

Adding a field to a result: give it a default and leave it off the wire at that default (the struct's
``omit_defaults``, or ``msgspec.UNSET``). A client refuses a reply with a field it does not know (a newer daemon:
`runtime/profiles/replies.py`), so one a version older still reads every reply that says nothing new, and a newer
client reads an older daemon's reply as the default. ``v`` changes only where that cannot hold.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import (
    ProfileKey,
    ProfileRecord,
    ProfileStatus,
    Provenance,
    default_measured_on,
    labelled_as_effective,
    unlabelled_provenance,
)

PROTOCOL_VERSION = 1
# The largest request a client can legitimately send: every field bounded (Name: NAME_MAX characters, Id: 128, a
# reason: REASON_MAX, integers 64-bit), and a character at most 6 bytes as JSON (a control character's \u00XX escape).
# A get_profile with all seven names and the id at their bounds, encoded as the client encodes it (msgspec, compact),
# is 8,784 bytes; the rest are smaller (tests/test_router_queue_bound.py builds each). Rounded up to 9 KiB.
LARGEST_REQUEST_BYTES = 9 << 10
# The daemon's request cap (daemon.max_request_bytes) by default: ~7x the largest legitimate request, room for
# another encoder's escapes (a surrogate pair's 12 bytes a character: ~23 KB) or whitespace; the daemon's ROUTER
# takes frames up to this + 1 KiB (ZMQ_MAXMSGSIZE: `server.MAXMSG_SLACK`) and drops the connection of a bigger one.
DEFAULT_MAX_REQUEST_BYTES = 65536
# The largest frame a client takes (ZMQ_MAXMSGSIZE of its DEALER and SUB sockets): a reply or change notice over it
# drops the connection before libzmq has buffered it whole. The largest a daemon sends, a list_profiles page of
# LIST_PAGE_MAX profiles, is about 1 MB.
MAX_REPLY_BYTES = 16 << 20

# -- error codes -----------------------------------------------------------------------------------
E_BAD_JSON = "bad_json"  # the frame is not valid JSON
E_BAD_REQUEST = "bad_request"  # valid JSON but not a request object
E_UNSUPPORTED_VERSION = "unsupported_version"  # "v" is not PROTOCOL_VERSION
E_UNKNOWN_OP = "unknown_op"
E_MISSING_FIELD = "missing_field"
E_INVALID_FIELD = "invalid_field"  # wrong type or value out of range
E_UNKNOWN_FIELD = "unknown_field"
E_TOO_LARGE = "too_large"  # request over the size cap
E_NOT_FOUND = "not_found"  # no current profile for the key
E_BUSY = "busy"  # the job queue is full
E_FORBIDDEN = "forbidden"  # an administrative op (retune, cancel) from a peer not allowed to run it
E_INTERNAL = "internal"

ERROR_CODES: tuple[str, ...] = (
    E_BAD_JSON,
    E_BAD_REQUEST,
    E_UNSUPPORTED_VERSION,
    E_UNKNOWN_OP,
    E_MISSING_FIELD,
    E_INVALID_FIELD,
    E_UNKNOWN_FIELD,
    E_TOO_LARGE,
    E_NOT_FOUND,
    E_BUSY,
    E_FORBIDDEN,
    E_INTERNAL,
)

Id = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | Annotated[str, Meta(max_length=128)]
NAME_MAX = 256  # characters of a name a request carries (a model, fingerprint, software hash, family, dtype)
Name = Annotated[str, Meta(min_length=1, max_length=NAME_MAX)]
POS_INT_MAX = 1 << 31  # the largest id or size a request may carry
PosInt = Annotated[int, Meta(ge=1, le=POS_INT_MAX)]
Tokens = Annotated[int, Meta(ge=0, le=1 << 31)]
# A recorded performance environment as a reply may carry it: bounded here, its names checked by the client.
PerfEnvMap = Annotated[
    dict[Annotated[str, Meta(max_length=128)], Annotated[str, Meta(max_length=256)]], Meta(max_length=512)
]

# Recorded data-path runtime options as a reply may carry them: bounded here, names and values checked by the client
# (runtime/options.py data_path_problem).
OptionsMap = Annotated[
    dict[Annotated[str, Meta(max_length=64)],
         bool | int | float | Annotated[str, Meta(max_length=64)]
         | Annotated[list[float], Meta(max_length=64)]],
    Meta(max_length=64),
]


# -- requests --------------------------------------------------------------------------------------
class _Request(msgspec.Struct, tag_field="op", kw_only=True, forbid_unknown_fields=True):
    v: int
    id: Id


class Hello(_Request, tag="hello"):
    """Versions, epoch, PUB endpoint and the current change version."""

    client: Annotated[str, Meta(max_length=256)] = ""


class GetProfile(_Request, tag="get_profile"):
    """The current profile for a key, at the nearest token bucket.

    The shape is either `model` (a name known to moetune.runtime.shapes) or the four numbers
    hidden/intermediate/experts/topk (+ dtype). `fingerprint`/`software` default to the daemon's
    current fabric, together: `software` left out with another node's `fingerprint` matches profiles of any
    software (the reply's key names the one it was measured with); `transport_family` picks among profiles of several families (else the fastest, by numbers of one metric).
    """

    ep_size: PosInt
    tokens: Tokens
    nodes: PosInt = 1
    model: Name | None = None
    hidden: PosInt | None = None
    intermediate: PosInt | None = None
    experts: PosInt | None = None
    topk: PosInt | None = None
    dtype: Name | None = None
    fingerprint: Name | None = None
    software: Name | None = None
    transport_family: Name | None = None


class ListProfiles(_Request, tag="list_profiles"):
    """A versioned snapshot of profiles (current ones by default)."""

    status: Literal[ProfileStatus, "all"] = "current"
    fingerprint: Name | None = None
    limit: Annotated[int, Meta(ge=1, le=10000)] = 1000


class Fabric(_Request, tag="fabric"):
    """The facts and fingerprint of the node's fabric, as last discovered."""


class Status(_Request, tag="status"):
    """Uptime, database, last discovery, jobs."""


REASON_MAX = 512  # characters of a re-tune's reason


class Retune(_Request, tag="retune"):
    """Queue a re-tune of the stale profiles (or of all current ones with `all`), or cancel a job."""

    all: bool = False
    cancel: PosInt | None = None
    reason: Annotated[str, Meta(max_length=REASON_MAX)] = "requested"


# ops that change the daemon's state: sent once, never again after a slow reply (a retried `retune` queued a
# second job, and a retried cancel answered not_found for the job the first copy had cancelled)
NOT_RETRIED: frozenset[str] = frozenset({"retune"})


Request = Hello | GetProfile | ListProfiles | Fabric | Status | Retune
OPS: tuple[str, ...] = ("hello", "get_profile", "list_profiles", "fabric", "status", "retune")


# -- replies ---------------------------------------------------------------------------------------
ERROR_MESSAGE_MAX = 1024  # characters of an error's message: encode_error cuts it here


class ErrorInfo(msgspec.Struct):
    # bounded as a daemon sends them (codes are short words, messages cut by encode_error): a client decoding a reply
    # with more refuses it as a bad reply instead of carrying megabytes into its fallback warning
    code: Annotated[str, Meta(max_length=64)]
    message: Annotated[str, Meta(max_length=ERROR_MESSAGE_MAX)]


class Reply(msgspec.Struct, omit_defaults=True):
    v: int
    id: Any
    ok: bool
    epoch: str
    result: Any = None
    error: ErrorInfo | None = None


# A daemon's epoch is uuid4().hex[:16]: a reply or change notice with a longer one is not a daemon's (the client keeps
# the epoch: in its resolution, its per-process identity memo's keys and its messages)
Epoch = Annotated[str, Meta(max_length=64)]


class RawReply(msgspec.Struct):
    """Client side: the reply with its result left undecoded until the op is known."""

    v: int
    id: Any
    ok: bool
    epoch: Epoch
    result: msgspec.Raw = msgspec.Raw(b"null")
    error: ErrorInfo | None = None


class ProfileResult(msgspec.Struct, kw_only=True):
    key: ProfileKey
    knobs: Knobs
    profile_hash: str
    status: ProfileStatus  # the store's statuses are all a daemon can send; anything else is not from one
    latency_us: float
    spread_us: float
    backend: str
    env: dict[str, str] = {}
    updated: str = ""
    version: int = 0  # the daemon's change version when this was read
    # An older daemon sends neither: the profile then counts as modelled, never as measured.
    provenance: Provenance | msgspec.UnsetType = msgspec.UNSET
    measured_on: str = ""
    # The performance environment the profile was measured in (ProfileRecord.perf_env; left out: not recorded).
    # The client only compares it with the job's (names checked by runtime/profiles/perf_env.perf_env_problem,
    # a reply with any other name is a bad reply) and never exports it.
    perf_env: PerfEnvMap | msgspec.UnsetType = msgspec.UNSET
    # The data-path runtime options the profile was measured under (ProfileRecord.runtime_options; left out: not
    # recorded, as an older daemon's replies do). The client compares them with the job's options.
    runtime_options: OptionsMap | msgspec.UnsetType = msgspec.UNSET
    # list_profiles only: why no lookup ever serves this row (`profile_record.not_served_label`: its knobs contradict
    # its family, or a what-if profile no run of this runtime can take). Left out for a row that may be served, so a
    # client one version older still reads a list of such rows; a get_profile reply never carries it.
    not_served: Annotated[str, Meta(max_length=ERROR_MESSAGE_MAX)] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.provenance is msgspec.UNSET:
            self.provenance = unlabelled_provenance(self.backend, self.key.fingerprint)
        if not self.measured_on:
            self.measured_on = default_measured_on(self.provenance, self.backend, self.key.fingerprint)

    def as_effective(self) -> ProfileResult:
        """This reply labelled as what its numbers are (`effective_provenance`; itself where that is its label): an
        older daemon labels a reply by its row's stored label, and a "measured" claim of a modelling backend is a
        prediction, kept so where the reply is handed on (`TrackedProfile.current`), as the client judges it."""
        return labelled_as_effective(self)  # ProfileRecord.as_effective's rule: the same function

    @classmethod
    def from_record(cls, rec: ProfileRecord, *, env: dict[str, str], version: int = 0) -> ProfileResult:
        # labelled as what its numbers are (a hand-edited "measured" row of a modelling backend is modelled), as
        # list/show/export and the store's lookups take it: the client re-derives it too, other readers need not
        rec = rec.as_effective()
        return cls(
            key=rec.key,
            knobs=rec.knobs,
            profile_hash=rec.profile_hash,
            status=rec.status,
            latency_us=rec.latency_us,
            spread_us=rec.spread_us,
            backend=rec.backend,
            env=env,
            updated=rec.updated or rec.created,
            version=version,
            provenance=rec.provenance,
            measured_on=rec.measured_on,
            perf_env=rec.perf_env,
            runtime_options=rec.runtime_options,
        )


class HelloResult(msgspec.Struct, kw_only=True):
    protocol: int
    daemon_version: str
    epoch: str
    pub_endpoint: str
    version: int
    fingerprint: str | None
    ops: list[str]


class ListProfilesResult(msgspec.Struct, kw_only=True):
    version: int
    fingerprint: str | None
    profiles: list[ProfileResult]


class FabricResult(msgspec.Struct, kw_only=True):
    # hashes as a daemon sends them: bounded, so that a client never repeats a hostile megabyte in its messages
    fingerprint: Annotated[str, Meta(max_length=NAME_MAX)] | None
    software: Annotated[str, Meta(max_length=NAME_MAX)] | None
    transports: list[str]
    facts: dict[str, Any]
    discovered_at: str
    ok: bool
    message: str = ""


class JobInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: int
    state: Literal["queued", "running", "done", "failed", "cancelled"]
    reason: str
    fingerprint: str | None = None
    keys: int = 0  # stale profile keys the job re-tunes
    run_id: int | None = None
    written: int = 0
    message: str = ""
    created: str = ""
    finished: str = ""
    # a running job whose cancel was asked: it ends after its current trial (state stays "running" until then, and
    # a new field, not a state, so an older client still reads the reply)
    cancelling: bool = False
    # what the `retune` that queued it left out (keys the daemon's [tune] backend cannot answer here): one line a
    # group, with why; shown by `status` (only the reply's message named them). Left off the wire while empty, and
    # off the retune reply's job always (a client one version older refuses the field there and would queue again)
    left_out: list[str] = []


class JobsInfo(msgspec.Struct, kw_only=True):
    queued: list[JobInfo]
    running: JobInfo | None
    recent: list[JobInfo]
    capacity: int


class RetuneRefusal(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A `retune` that queued no job because its keys were left out (StatusResult.retune_refusals)."""

    at: str  # when it was answered (UTC, ISO 8601)
    reason: str  # the request's reason
    message: str  # what the reply said ("not queued: ..." / "nothing to re-tune: ..."), each group without its keys
    left_out: list[str] = []  # one line a group of keys left out, with its shapes and buckets and why


RETUNE_REFUSALS_KEPT = 5  # how many a daemon keeps for `status` (the newest)


# omit_defaults: a field added here (with its default) is sent only when it says something, as JobInfo's
# `cancelling`: a client refuses a field it does not know, and one a version older then still reads the reply
class StatusResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    epoch: str
    daemon_version: str
    pid: int
    uptime_s: float
    db: str
    endpoint: str
    pub_endpoint: str
    version: int
    fingerprint: str | None
    last_discovery: str
    last_discovery_ok: bool
    last_discovery_message: str
    profiles_current: int
    profiles_stale: int
    requests: int
    jobs: JobsInfo
    provenance: dict[str, int] = {}  # current profiles of this fingerprint by provenance, those served only
    # of profiles_current, the rows no lookup serves (knobs contradicting their family, what `db check` names; or no
    # run of this runtime can take them: what-if reports); 0 from a daemon that does not count them, and left out of
    # the reply while 0 (a client older than this field reads it then)
    profiles_not_served: int = 0
    tune_notice: str = ""  # why the automatic re-tune cannot run on this node, when it cannot
    # the daemon found its database damaged (the message: the file, `moetune db check`, restore it): nothing more is
    # written to it (no job, event or fabric change is recorded) and what it can still read is served; "" while sound
    store_damaged: str = ""
    # the last `retune` requests (RETUNE_REFUSALS_KEPT) that queued no job and left keys out, oldest first: after their
    # reply nothing else says why those keys were not re-tuned. Kept in memory only (a restart forgets them)
    retune_refusals: list[RetuneRefusal] = []


# omit_defaults: `left_out` is sent only where keys were left out and no job was queued (a client one version older
# reads every other reply; one that refuses this one was told nothing was queued, so a retry queues nothing twice)
class RetuneResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    job: JobInfo | None
    message: str
    # keys the daemon's re-tune cannot answer on this node with its [tune] backend, left out of the job (a group
    # over several nodes for a measuring one, say): one line a group, with why
    left_out: list[str] = []


# -- change notifications (PUB) ---------------------------------------------------------------------
ChangeKind = Literal["profile_updated", "profile_stale", "fabric_changed"]
CHANGE_KINDS: tuple[str, ...] = ("profile_updated", "profile_stale", "fabric_changed")


class Change(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = PROTOCOL_VERSION
    version: int
    epoch: Epoch
    kind: ChangeKind
    fingerprint: str | None = None
    old_fingerprint: str | None = None
    profiles: list[str] = []  # profile hashes affected
    keys: list[ProfileKey] = []
    reasons: list[str] = []
    ts: float = 0.0


# -- codecs ----------------------------------------------------------------------------------------
request_decoder = msgspec.json.Decoder(Request)
reply_decoder = msgspec.json.Decoder(RawReply)
change_decoder = msgspec.json.Decoder(Change)
encoder = msgspec.json.Encoder()

RESULT_TYPES: dict[str, type] = {
    "hello": HelloResult,
    "get_profile": ProfileResult,
    "list_profiles": ListProfilesResult,
    "fabric": FabricResult,
    "status": StatusResult,
    "retune": RetuneResult,
}


class WireError(Exception):
    """A request that cannot be served: carries the error code, the message and the request id."""

    def __init__(self, code: str, message: str, req_id: Any = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.req_id = req_id


def _safe_id(obj: Any) -> Any:
    if isinstance(obj, dict):
        rid = obj.get("id")
        if isinstance(rid, bool):
            return None
        if isinstance(rid, int) and -(1 << 63) <= rid < (1 << 63):
            return rid
        if isinstance(rid, str) and len(rid) <= 128:
            return rid
    return None


def decode_request(frame: bytes, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> Request:
    """Decode and validate one request frame. Raises WireError with a code on any problem."""
    if len(frame) > max_bytes:
        raise WireError(E_TOO_LARGE, f"request of {len(frame)} bytes is over the {max_bytes}-byte cap")
    try:
        req = request_decoder.decode(frame)
    except msgspec.ValidationError as e:
        raise _classify(frame, e) from None
    except msgspec.DecodeError as e:
        raise WireError(E_BAD_JSON, f"not valid JSON: {e}") from None
    except Exception as e:  # broad: a hostile frame (e.g. nested 5000 deep: RecursionError) is bad input, not a crash
        raise _undecodable(e) from None
    if req.v != PROTOCOL_VERSION:
        raise WireError(E_UNSUPPORTED_VERSION, f"protocol version {req.v} is not supported (want {PROTOCOL_VERSION})", req.id)
    return req


def _undecodable(e: Exception) -> WireError:
    """The bad-JSON error for a frame the decoder failed on in an unexpected way."""
    if isinstance(e, RecursionError):
        return WireError(E_BAD_JSON, "not valid JSON: nested too deeply")
    return WireError(E_BAD_JSON, f"not valid JSON: {type(e).__name__}")


def _classify(frame: bytes, err: msgspec.ValidationError) -> WireError:
    """Turn a schema failure into a precise error code (slow path, only on bad requests)."""
    msg = str(err)
    try:
        obj = msgspec.json.decode(frame)
    except msgspec.DecodeError as e:  # pragma: no cover - the typed decode would have said so
        return WireError(E_BAD_JSON, f"not valid JSON: {e}")
    except Exception as e:  # broad: the typed decode can fail early on a frame this untyped one chokes on
        return _undecodable(e)
    rid = _safe_id(obj)
    if not isinstance(obj, dict):
        return WireError(E_BAD_REQUEST, f"a request is a JSON object, got {type(obj).__name__}", rid)
    if "op" not in obj:
        return WireError(E_MISSING_FIELD, "missing field `op`", rid)
    op = obj["op"]
    if not isinstance(op, str):
        return WireError(E_INVALID_FIELD, "`op` must be a string", rid)
    if op not in OPS:
        return WireError(E_UNKNOWN_OP, f"unknown op {op[:64]!r}; known: {', '.join(OPS)}", rid)
    v = obj.get("v")
    if "v" in obj and (isinstance(v, bool) or not isinstance(v, int) or v != PROTOCOL_VERSION):
        return WireError(E_UNSUPPORTED_VERSION, f"protocol version {str(v)[:32]} is not supported (want {PROTOCOL_VERSION})", rid)
    if "missing required field" in msg:
        return WireError(E_MISSING_FIELD, msg, rid)
    if "unknown field" in msg:
        return WireError(E_UNKNOWN_FIELD, msg, rid)
    return WireError(E_INVALID_FIELD, msg, rid)


def encode_ok(req_id: Any, epoch: str, result: Any) -> bytes:
    return encoder.encode(Reply(v=PROTOCOL_VERSION, id=req_id, ok=True, epoch=epoch, result=result))


def encode_error(req_id: Any, epoch: str, code: str, message: str) -> bytes:
    return encoder.encode(
        Reply(v=PROTOCOL_VERSION, id=req_id, ok=False, epoch=epoch, error=ErrorInfo(code=code, message=message[:ERROR_MESSAGE_MAX]))
    )


def encode_request(op: str, req_id: Any, **fields: Any) -> bytes:
    """Client side: one request frame. Fields are validated by the daemon, not here."""
    body = {"v": PROTOCOL_VERSION, "id": req_id, "op": op}
    body.update({k: v for k, v in fields.items() if v is not None})
    return encoder.encode(body)


def decode_result(op: str, raw: msgspec.Raw) -> Any:
    """Client side: the typed result of an op."""
    return msgspec.json.decode(raw, type=RESULT_TYPES[op])


def encode_change(change: Change) -> list[bytes]:
    return [change.kind.encode(), encoder.encode(change)]


def decode_change(frames: list[bytes]) -> Change:
    if len(frames) != 2:
        raise WireError(E_BAD_REQUEST, f"a change message has 2 frames, got {len(frames)}")
    return change_decoder.decode(frames[1])
