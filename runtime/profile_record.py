"""The profile record: what a tuned profile is keyed by and what it holds (how the runtime picks one:
docs/runtime.md, "Which tuned profile runs").

Shared by the store (tuner side), the daemon's wire messages and the runtime client.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from typing import Any, Literal, Protocol, TypeVar, get_args

import msgspec

from moetune.runtime.knobs import (
    FORMER_MK_DEFAULTS,
    Knobs,
    group_world_problem,
    missing_transport_problem,
)
from moetune.runtime.options import data_path_digest
from moetune.runtime.shapes import check_experts_divide

# The one definition of a profile's statuses and provenances: the store, its CHECK constraints, the CLI and the
# wire messages import these (the runtime may not import the tuner, so they live here).
ProfileStatus = Literal["current", "stale", "superseded"]
PROFILE_STATUSES: tuple[ProfileStatus, ...] = get_args(ProfileStatus)
# What a profile's numbers are: measured on the key's fingerprint and software, predicted by this node's
# calibrated fabric model, or predicted by a shipped preset (another machine's model). Most trusted first: the
# lookups' tiers and the store's rank rule go by this order.
Provenance = Literal["measured", "node_model", "preset"]
PROVENANCES: tuple[Provenance, ...] = get_args(Provenance)

# Profile families that are engines, not transports: the whole one-GPU MoE layer (ep_size 1). A lookup gets
# one only when it names it; an EP buffer asking for "any transport" never does.
MEGAKERNEL_FAMILY = "megakernel"
ENGINE_FAMILIES: frozenset[str] = frozenset({MEGAKERNEL_FAMILY})
# A libfabric provider's name in a family (`proxy:libfabric/cxi`): what NVSHMEM_LIBFABRIC_PROVIDER may be set to
# (launcher_env's rule), so a family the store, a policy or a key takes is one the runtime can export.
LIBFABRIC_PROVIDER = r"[a-z][a-z0-9_]{0,31}"
# The transport families moetune names (tuner/fabric/families.py; `proxy:ucx` is NVSHMEM's UCX transport), plus
# `proxy:libfabric/<provider>` for any libfabric provider: what a stored key (the store's import check) and a fabric
# preset's `family` (its loader) may name. KNOWN_FAMILIES adds the engine families (a key's, never a fabric's).
TRANSPORT_FAMILIES: frozenset[str] = frozenset(
    {"nvlink", "proxy:ibrc", "proxy:ucx", "proxy:libfabric", "ibgda", "host_staged", "collective"}
)
KNOWN_FAMILIES: frozenset[str] = TRANSPORT_FAMILIES | ENGINE_FAMILIES
_LIBFABRIC_FAMILY = re.compile(rf"proxy:libfabric/{LIBFABRIC_PROVIDER}")


def is_transport_family(family: str) -> bool:
    """Whether `family` is a transport family moetune names (`TRANSPORT_FAMILIES`, any libfabric provider's)."""
    return family in TRANSPORT_FAMILIES or _LIBFABRIC_FAMILY.fullmatch(family) is not None


def is_known_family(family: str) -> bool:
    """A transport family (`is_transport_family`) or an engine family."""
    return family in ENGINE_FAMILIES or is_transport_family(family)

TOKEN_BUCKETS: tuple[int, ...] = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def nearest_bucket(tokens: int, buckets: tuple[int, ...] | list[int] = TOKEN_BUCKETS) -> int:
    """The bucket closest to `tokens` on a log scale (ties go to the larger bucket)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if not buckets:
        raise ValueError("no token buckets to choose from")
    import math

    t = max(tokens, 1)
    return min(sorted(buckets), key=lambda b: (abs(math.log(b) - math.log(t)), -b))


def nearest_bucket_within(tokens: int, buckets: tuple[int, ...] | list[int], max_steps: int = 1) -> int | None:
    """The stored bucket nearest to `tokens`, or None when it is more than `max_steps` steps of the
    TOKEN_BUCKETS ladder away from the bucket `tokens` falls in (a profile tuned for 16 tokens says
    nothing about 4096: the caller falls back instead)."""
    if not buckets:
        return None
    chosen = nearest_bucket(tokens, buckets)
    rung = TOKEN_BUCKETS.index(nearest_bucket(tokens))
    # A bucket off the ladder (an old database) counts as the rung it is nearest to.
    got = TOKEN_BUCKETS.index(nearest_bucket(chosen))
    return chosen if abs(got - rung) <= max_steps else None


NODE_MODEL_BACKEND = "model:node:"  # + the fingerprint whose calibrated model predicted the numbers


def provenance_of_backend(backend: str, fingerprint: str | None = None) -> Provenance:
    """What a backend's numbers are: `local:*` measured, `model:node:*` this node's calibrated model,
    any other `model:*` a preset. An unknown backend is modelled: never trusted as measured. With the key's
    `fingerprint`, `model:node:<fp>` of another fingerprint is a preset: another node's model (another machine's
    model, as a shipped preset is) says nothing more of this node than a preset does; and under a what-if preset's
    key (`preset:NAME`: a modelled fabric, no node) any `model:node:*` is a preset: no node's model is of it."""
    if backend.startswith(NODE_MODEL_BACKEND):
        if fingerprint is not None and (backend.removeprefix(NODE_MODEL_BACKEND) != fingerprint
                                        or is_preset_fingerprint(fingerprint)):
            return "preset"
        return "node_model"
    if backend.startswith("model:"):
        return "preset"
    if backend.startswith("local:"):
        return "measured"
    return "node_model"


# The label prefix of each provenance. A tuner backend declares its provenance (a class capability) and its label is
# that provenance's prefix + its name, so `provenance_of_backend` reads back what the class declared, whatever the
# name says (a modelling backend named "local:x" is labelled "model:local:x").
PROVENANCE_PREFIX: dict[str, str] = {"measured": "local:", "node_model": NODE_MODEL_BACKEND, "preset": "model:"}


def backend_label(provenance: Provenance, name: str) -> str:
    """The label (`ProfileRecord.backend`) a backend of `provenance` stores under `name`: `name` where it already
    reads as that provenance (`local:nccl` measured, `model:<preset>` a preset), else the provenance's prefix + `name`.
    The name never decides the provenance; at most it saves writing the prefix twice."""
    prefix = PROVENANCE_PREFIX[provenance]
    if name.startswith(prefix) and provenance_of_backend(name) == provenance:
        return name
    label = prefix + name
    # a preset named "node:<fp>" would read as the calibrated model of node <fp> (`model:node:<fp>`): the prefix once
    # more makes it read as what it is (`model:model:node:<fp>`, as a name `model:node:<fp>` is labelled)
    return label if provenance_of_backend(label) == provenance else prefix + label


def unlabelled_provenance(backend: str, fingerprint: str | None = None) -> Provenance:
    """The provenance of a record that carries none (an older peer or export): modelled, never measured,
    since nothing says which fingerprint and software it was measured on."""
    p = provenance_of_backend(backend, fingerprint)
    return "node_model" if p == "measured" else p


def node_model_label_problem(provenance: str, backend: str, fingerprint: str) -> str:
    """Why a `node_model` label is false for a record of key `fingerprint` ('' when it may stand): its backend is a
    shipped preset (`model:<preset>`) or another node's model (`model:node:<other fp>`; under a what-if preset's key,
    `preset:NAME`, any `model:node:*`: that key names no node). node_model outranks preset
    (the store's rank rule, the lookups' tiers), so such a label would let a preset's prediction displace a better
    preset profile and be served as this node's model. A `local:*` or unknown backend may be labelled node_model: an
    unlabelled import of a measurement becomes node_model by design (nothing says where it was measured)."""
    if provenance != "node_model" or provenance_of_backend(backend, fingerprint) != "preset":
        return ""
    if backend.startswith(NODE_MODEL_BACKEND) and is_preset_fingerprint(fingerprint):
        return (f"node_model, but the key's fingerprint {fingerprint[:64]!r} is a what-if preset's modelled fabric, no "
                f"node: backend {backend[:80]!r} is no node's calibrated model (a preset to it)")
    if backend.startswith(NODE_MODEL_BACKEND):
        return (f"node_model, but backend {backend[:80]!r} is the calibrated model of another node than the key's "
                f"fingerprint {fingerprint[:64]!r} (a preset to it)")
    return f"node_model, but backend {backend[:80]!r} is a shipped preset (model:<preset>), not this node's model"


def effective_provenance(provenance: str, backend: str, fingerprint: str | None = None) -> Provenance:
    """What a record's numbers are taken to be: its label, except that a claimed measurement by a backend that
    does not measure (`model:*`, unknown) is modelled, and a claimed node model by a preset's backend or another
    node's model (with the key's `fingerprint`: `node_model_label_problem`) is a preset, and so is a claimed
    measurement under a what-if preset's key (`preset:NAME`: a modelled fabric, no node, so nothing was measured on
    it; stored before the store refused it, it outranked the preset's own prediction). The label alone never makes a
    number measured nor this node's model; the ONE rule for records, replies and `ProfileRecord.is_tuned_for`."""
    if provenance == "measured" and provenance_of_backend(backend) != "measured":
        return unlabelled_provenance(backend, fingerprint)
    if provenance == "measured" and fingerprint is not None and is_preset_fingerprint(fingerprint):
        return "preset"
    if provenance == "node_model" and provenance_of_backend(backend, fingerprint) == "preset":
        return "preset"
    return provenance if provenance in PROVENANCES else unlabelled_provenance(backend, fingerprint)  # type: ignore[return-value]


# Which figure a stored latency is, read from the backend label the profile records. A local measurement minimises
# either the whole layer (`layer_us`, the label `local:<comm>` it always had) or the exchange's round trip
# (`roundtrip_us`, labelled `local:<comm>:comm`): two figures of the same knobs, never compared with each other (the
# store's decision, and the pick among families at one bucket).
COMM_METRIC = "comm"  # the round trip (`moetune profile`'s bring-up tune, LocalBackend(metric="comm"))
LAYER_METRIC = "layer"  # the whole layer (`moetune tune --backend local`)
MODELLED_METRIC = "modelled"  # a prediction: compared only within its provenance (the rank rule comes first)


def metric_of_backend(backend: str) -> str:
    """The metric of a profile's number by its backend label. A label without a metric suffix is a layer number:
    the label `moetune tune` has always stored (a bring-up before the suffix stored round trips under it too; such
    a row reads as a layer number)."""
    if not backend.startswith("local:"):
        return MODELLED_METRIC
    return COMM_METRIC if backend.endswith(f":{COMM_METRIC}") else LAYER_METRIC


def one_metric(records: list[ProfileRecord]) -> list[ProfileRecord]:
    """`records` whose latencies may be compared, for a pick by latency among families: where round trips and whole
    layers are both there, the whole layers (what a job runs end to end; a round trip always looked faster)."""
    if {LAYER_METRIC, COMM_METRIC} <= {metric_of_backend(r.backend) for r in records}:
        return [r for r in records if metric_of_backend(r.backend) != COMM_METRIC]
    return records


UNIFORM_ROUTING = "uniform"  # what `moetune tune` and a bring-up tune under unless told otherwise


def one_routing(records: list[ProfileRecord]) -> list[ProfileRecord]:
    """`records` whose latencies may be compared, for a pick by latency among families: where they were measured
    under different routings (each recorded: `ProfileRecord.routing`), those of one routing only (a zipf layer is
    slower than a uniform one whatever the knobs: two workloads, never compared, as the store never compares them):
    uniform where it is there (the tuner's default, and what the runtime assumes of traffic it cannot know), else
    the first by name. A record that does not say its routing (an older moetune's) is compared with any, as the
    store's rule has it."""
    routings = {r.tuned_routing for r in records} - {""}
    if len(routings) <= 1:
        return records
    keep = UNIFORM_ROUTING if UNIFORM_ROUTING in routings else min(routings)
    return [r for r in records if r.tuned_routing in ("", keep)]


def comparable(records: list[ProfileRecord]) -> list[ProfileRecord]:
    """`records` of one routing (`one_routing`) and one metric (`one_metric`): those a pick by latency among
    families compares."""
    return one_metric(one_routing(records))


def _hash_of(key: ProfileKey, canonical_knobs: dict[str, Any]) -> str:
    payload = {"key": key.to_dict(), "knobs": canonical_knobs}
    return hashlib.sha256(msgspec.json.encode(payload, order="sorted")).hexdigest()[:16]


def profile_hash_of(key: ProfileKey, knobs: Knobs) -> str:
    """Hash of key + knobs (`ProfileRecord.profile_hash`): what all ranks compare, and what a daemon's reply must
    carry for its key and knobs."""
    return _hash_of(key, knobs.canonical())  # stable across new knobs (Knobs.canonical)


def stored_profile_hashes(key: ProfileKey, knobs: Knobs, *, former: bool = True) -> tuple[str, ...]:
    """Every profile_hash a stored row of key + knobs may carry, today's (`profile_hash_of`) first, then the one a
    moetune from before `knobs.HASHED_LATE_KNOBS` wrote (`Knobs.legacy_canonical`), where such a row can exist, and for a
    megakernel setting holding a former default (`knobs.FORMER_MK_DEFAULTS`) the forms without it. What
    the store compares a stored hash with: stored hashes are never rewritten (migrations' downgrade events name rows
    by them). A form without a former default is also today's hash of the setting at today's default (another
    setting): a caller matches it with the row's stored knobs (`_rows.row_holds_knobs`); `former=False` leaves those
    forms out (a hash a caller holds is a stored one or today's, never such a form of another row's knobs)."""
    legacy = knobs.legacy_canonical()
    forms = [knobs.canonical()] + ([] if legacy is None else [legacy])
    # a megakernel setting stored while a knob's default was what it holds (FORMER_MK_DEFAULTS) was hashed without
    # that knob (canonical() leaves megakernel knobs out at the defaults of its time); today's hash covers it
    former_at = [n for n, v in FORMER_MK_DEFAULTS.items()
                 if former and knobs.engine == "megakernel" and getattr(knobs, n) == v]
    drops = [set(c) for r in range(1, len(former_at) + 1) for c in itertools.combinations(former_at, r)]
    forms += [{n: v for n, v in f.items() if n not in drop} for drop in drops for f in list(forms)]
    return tuple(dict.fromkeys(_hash_of(key, f) for f in forms))


# What a what-if preset's fingerprint (and a preset profile's measured_on) starts with: "preset:NAME[:digest]" names a
# modelled fabric, never a node. `moetune tune --preset` writes both as preset:NAME:DIGEST, DIGEST of the preset's
# content (an edited copy keeps the shipped NAME); a profile an older moetune stored says preset:NAME only.
PRESET_PREFIX = "preset:"


def is_preset_fingerprint(fingerprint: str) -> bool:
    return fingerprint.startswith(PRESET_PREFIX)


def default_measured_on(provenance: str, backend: str, fingerprint: str) -> str:
    """`measured_on` when a record does not say: the preset's name for a preset, the key's fingerprint
    for a measurement, unknown ("") for a node model of unknown origin. Another node's model taken as a preset
    (`model:node:<other fp>`) gets preset:node:<other fp>: a preset's form (an import requires it), but no preset
    file's name and digest; what reads it as one asks the backend first (`query.preset_note`)."""
    if provenance == "preset":
        return PRESET_PREFIX + backend.removeprefix("model:")
    if provenance == "measured":
        return fingerprint
    return ""


def effective_measured_on(provenance: str, measured_on: str, backend: str, fingerprint: str) -> str:
    """`measured_on` as the effective provenance has it: the stored one, except where a "measured" label on a
    modelling backend is taken as modelled (a node model keeps its fingerprint; a preset gets its name). Under a what-if
    preset's key, a record whose backend names no preset (`local:*`) stands for the key's (`preset:NAME:DIGEST`)."""
    prov = effective_provenance(provenance, backend, fingerprint)
    if prov == provenance or prov == "node_model":
        return measured_on
    if prov == "preset" and is_preset_fingerprint(fingerprint) and provenance_of_backend(backend) != "preset":
        return fingerprint
    return default_measured_on(prov, backend, fingerprint)


def megakernel_key_problem(key: ProfileKey) -> tuple[str, str] | None:
    """(field, why) where a megakernel key itself names what the megakernel never runs: a group other than one GPU
    (ep_size 1, nodes 1), or a dtype other than bf16. No profile of such a key can be stored (`key_knobs_problem`),
    so the daemon's re-tune refuses it too (`tuner/daemon/retune.key_refusals`): one rule for both."""
    if key.transport_family != MEGAKERNEL_FAMILY:
        return None
    if (key.ep_size, key.nodes) != (1, 1):
        return "key.ep_size", (f"a megakernel profile runs on one GPU (ep_size 1, nodes 1), got ep_size "
                               f"{key.ep_size}, nodes {key.nodes}")
    if key.dtype != "bfloat16":
        return "key.dtype", f"the megakernel runs bfloat16 only, got {key.dtype[:64]!r}"
    return None


def key_knobs_problem(key: ProfileKey, knobs: Knobs) -> tuple[str, str] | None:
    """(field, why) where the knobs or the key contradict the family: a megakernel profile is one GPU's (ep_size 1,
    nodes 1), bf16 (the only dtype it times and runs) and names engine=megakernel; a transport family's never names
    it (its mk_* knobs then mean nothing). An auto layer runs the engine the row names, so such a row ran the other
    engine, or a number timed for bf16, under this key. The one predicate: the store refuses such a record
    (`check_record`), `db check` names a stored one, and neither the daemon's index nor the client serves one."""
    family, engine = key.transport_family, knobs.engine
    if family == MEGAKERNEL_FAMILY:
        if (why := megakernel_key_problem(key)) is not None:
            return why
        if engine != "megakernel":
            return "knobs.engine", f"engine {engine!r} under a megakernel key (it names engine 'megakernel')"
    elif engine == "megakernel":
        return "knobs.engine", (f"engine 'megakernel' under a {family[:64]!r} key: only family "
                                f"{MEGAKERNEL_FAMILY!r} names it")
    return None


def contradiction_reason(key: ProfileKey, knobs: Knobs) -> str | None:
    """Why a lookup passes over a profile whose knobs or key contradict its family (None: they do not), in the words
    `db check` names such a row with."""
    p = key_knobs_problem(key, knobs)
    if p is None:
        return None
    return (f"its knobs or key contradict its family ({p[0]}: {p[1]}): not served (`moetune db check` names it, "
            "`moetune profiles delete ID` removes it)")


# how a listing says, per row, why a row is never served (`not_served_label`): short, since a table holds it
CONTRADICTS_LABEL = "contradicts its family ({why})"
WHAT_IF_LABEL = "what-if only ({why})"


class _Labelled(Protocol):
    """What the effective-label rule reads of a profile: a ProfileRecord, or a daemon's reply of one
    (wire.ProfileResult, whose fields have the same meaning)."""

    key: ProfileKey
    backend: str
    provenance: Provenance | msgspec.UnsetType
    measured_on: str


_L = TypeVar("_L", bound=_Labelled)


def labelled_as_effective(rec: _L) -> _L:
    """`rec` labelled as what its numbers are (`effective_provenance`; `rec` itself where that is its label), its
    `measured_on` as that label has it (`effective_measured_on`). One rule for the stored record and the daemon's
    reply of it, so the two never disagree on what a profile is."""
    prov = effective_provenance(str(rec.provenance), rec.backend, rec.key.fingerprint)
    if prov == rec.provenance:
        return rec
    on = effective_measured_on(str(rec.provenance), rec.measured_on, rec.backend, rec.key.fingerprint)
    # a modelled profile records no performance environment nor runtime options (no process measured it): an
    # import refuses them
    return msgspec.structs.replace(rec, provenance=prov, measured_on=on, perf_env=msgspec.UNSET,
                                   runtime_options=msgspec.UNSET)


_KEY_TEXTS = ("fingerprint", "software", "transport_family", "dtype")
_KEY_INTS = ("ep_size", "nodes", "hidden", "intermediate", "experts", "topk", "token_bucket")


class ProfileKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a tuned result is valid for. A profile is never used outside its key."""

    fingerprint: str  # fabric fingerprint hash (moetune.tuner.fabric)
    software: str  # hash of the software versions (driver, CUDA, NCCL, NVSHMEM, torch, moetune)
    transport_family: str  # e.g. nvlink, proxy:ibrc, proxy:libfabric/cxi, ibgda, host_staged, collective
    ep_size: int
    nodes: int
    hidden: int
    intermediate: int
    experts: int
    topk: int
    dtype: str
    token_bucket: int

    def __post_init__(self) -> None:
        # the constructor does not type-check (msgspec does so only when decoding): 2048.0 or True would pass here,
        # equal to 2048 and 1 in Python but another key to `profile_hash_of`, which hashes the fields' JSON
        for f in _KEY_TEXTS:
            if not isinstance(getattr(self, f), str):
                raise TypeError(f"profile key: {f} must be a str, got {type(getattr(self, f)).__name__} "
                                f"{str(getattr(self, f))[:64]!r}")
        for f in _KEY_INTS:
            if type(getattr(self, f)) is not int:
                raise TypeError(f"profile key: {f} must be an int, got {type(getattr(self, f)).__name__} "
                                f"{str(getattr(self, f))[:64]!r}")
            if getattr(self, f) <= 0:
                raise ValueError(f"profile key: {f} must be > 0, got {getattr(self, f)}")
        if self.ep_size % self.nodes:
            raise ValueError(f"profile key: ep_size {self.ep_size} not divisible by nodes {self.nodes}")
        # no rank layout exists for such a key: nothing could ever apply its profile (an import used to store it)
        check_experts_divide(self.experts, self.ep_size, "profile key")

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


# a key field added without its type here would go unchecked: fail at import instead
if set(_KEY_TEXTS + _KEY_INTS) != set(ProfileKey.__struct_fields__):
    raise AssertionError(f"ProfileKey's fields and their typed lists differ: "
                         f"{sorted(set(_KEY_TEXTS + _KEY_INTS) ^ set(ProfileKey.__struct_fields__))}")


class ProfileRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tuned profile: its key, the knobs, and how well they measured."""

    key: ProfileKey
    knobs: Knobs
    latency_us: float
    spread_us: float
    backend: str  # which benchmark backend measured it: model:<preset>, model:node:<fp>, local:nccl, ...
    status: ProfileStatus = "current"
    software_versions: dict[str, str] = {}
    created: str = ""
    updated: str = ""
    # Left out (an older peer): derived from the backend, and never "measured" (unlabelled_provenance).
    provenance: Provenance | msgspec.UnsetType = msgspec.UNSET
    measured_on: str = ""  # fingerprint measured or calibrated on; `preset:<name>[:<content digest>]` for a preset
    # The routing the numbers were measured under (`uniform`, `zipf:S`): NOT part of the key, since the runtime
    # cannot know the skew of the traffic ahead; it says which latencies may be compared (the store never compares
    # a zipf number with a uniform one). Left out: not recorded (a record from an older moetune or caller).
    routing: str | msgspec.UnsetType = msgspec.UNSET
    # The performance environment of the process that measured the numbers (NCCL_*, NVSHMEM_*, FI_*, ...: what
    # runtime/profiles/perf_env.py extracts, sorted). NOT part of the key: the runtime compares it with the job's
    # and says where they differ, and never exports it. Left out: not recorded (a modelled profile, which no
    # process measured, or a measurement by an older moetune): unknown, never taken to match.
    perf_env: dict[str, str] | msgspec.UnsetType = msgspec.UNSET
    # The data-path runtime options the measuring ranks ran under (runtime/options.py DATA_PATH_OPTIONS: hs_native,
    # symm, fused_pack, ...; `RuntimeOptions.data_path`), a readable copy (the store keeps its digest beside it). NOT
    # part of the key: the runtime compares it with the job's options (runtime/profiles/tuned_options.py) and applies
    # the profile as tuned only where they agree. Left out: not recorded (a modelled profile, or a measurement by an
    # older moetune): unknown, never taken to match.
    runtime_options: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.provenance is msgspec.UNSET:
            self.provenance = unlabelled_provenance(self.backend, self.key.fingerprint)
        elif self.provenance not in PROVENANCES:
            raise ValueError(f"provenance must be one of {', '.join(PROVENANCES)}, got {self.provenance!r}")
        if not self.measured_on:
            self.measured_on = default_measured_on(self.provenance, self.backend, self.key.fingerprint)
        if self.routing is not msgspec.UNSET:
            self.routing = str(self.routing).strip() or msgspec.UNSET  # "": not recorded (the store checks the spelling)

    @property
    def tuned_routing(self) -> str:
        """The routing the numbers were measured under, "" when not recorded."""
        return "" if self.routing is msgspec.UNSET else str(self.routing)

    @property
    def tuned_perf_env(self) -> dict[str, str] | None:
        """The performance environment the numbers were measured in, None when not recorded."""
        return None if self.perf_env is msgspec.UNSET else dict(self.perf_env)

    @property
    def tuned_runtime_options(self) -> dict[str, Any] | None:
        """The data-path runtime options the numbers were measured under, None when not recorded."""
        return None if self.runtime_options is msgspec.UNSET else dict(self.runtime_options)

    @property
    def runtime_options_digest(self) -> str | None:
        """The digest of the recorded runtime options (`data_path_digest`), None when not recorded."""
        opts = self.tuned_runtime_options
        return None if opts is None else data_path_digest(opts)

    @property
    def not_served(self) -> str | None:
        """Why no lookup ever serves this row, whatever its status (`not_served_label`); None where one may."""
        return not_served_label(self.key, self.knobs)

    @property
    def effective_provenance(self) -> Provenance:
        """The provenance the runtime goes by (`effective_provenance`: "measured" only from a measuring backend)."""
        return effective_provenance(str(self.provenance), self.backend, self.key.fingerprint)

    def as_effective(self) -> ProfileRecord:
        """This record labelled with its effective provenance (itself where that is its label): a "measured" label
        on a backend that does not measure (a hand edit: no writer stores one) shown and exported as what it is."""
        return labelled_as_effective(self)

    def is_tuned_for(self, fingerprint: str, software: str) -> bool:
        """Measured (by a measuring backend) on exactly this fabric and software: what the runtime's client requires
        of a profile it applies as tuned (it also checks that `fingerprint`/`software` are this node's). A `measured_on`
        naming another fingerprint than the key's says it was measured elsewhere: not tuned here."""
        return (
            self.effective_provenance == "measured"
            and self.measured_on == self.key.fingerprint
            and self.key.fingerprint == fingerprint
            and self.key.software == software
        )

    @property
    def profile_hash(self) -> str:
        """Hash of key + knobs: what all ranks compare to be sure they hold the same profile. Not perf_env,
        runtime_options, routing or the latencies: they say where the numbers come from, not what a rank applies (each
        rank compares its own environment and options with them at lookup)."""
        return profile_hash_of(self.key, self.knobs)


def runtime_refusal(key: ProfileKey, knobs: Knobs) -> str | None:
    """Why no run of this runtime can take a profile of `key` with `knobs` (None when one can): the runtime has no
    transport for the key's family or the knobs' (ibgda: `missing_transport_problem`; autoload asks both, the
    registry's way), or its transport cannot serve the key's EP size or node count (a model tune of a cross-node
    proxy preset: EP 32, or 2 nodes x 4 GPUs; host_staged across nodes: `group_world_problem`). Such a profile is a what-if report: stored only as modelled (the
    store refuses it labelled measured), and autoload passes it over (`runtime_transport_problem`,
    `transport_world_problem`: the same rules)."""
    family = key.transport_family
    # an engine family names no transport; an unknown one is refused by the family check, which says so
    head = [family.split(":", 1)[0]] if is_transport_family(family) else []
    names = list(dict.fromkeys([*head, knobs.transport]))
    for name in names:
        why = missing_transport_problem(name)
        if why is not None:
            return why
    # the world rule of both names too, as autoload's transport_ok asks it of each (`_transport_problem`): a profile
    # keyed nvlink or proxy:* whose knobs name another transport was passed over there and called runnable here
    for name in names:
        why = group_world_problem(name, key.ep_size, nodes=key.nodes)
        if why is not None:
            return why
    return None


def family_refusal(family: str, ep_size: int, nodes: int) -> str | None:
    """`runtime_refusal` of every profile of transport family `family` at EP `ep_size` on `nodes` nodes (its knobs
    name the family's transport): why a tune of that family for that group can only store what-if rows (None where a
    run may serve one; an engine family: None, it names no transport)."""
    if not is_transport_family(family):
        return None
    name = family.split(":", 1)[0]
    return missing_transport_problem(name) or group_world_problem(name, ep_size, nodes=nodes)


# how the tuner's report and `profiles show` say it
WHAT_IF_ONLY = "what-if only: the runtime cannot run it ({why}); autoload passes over it"


def _not_served_cause(key: ProfileKey, knobs: Knobs) -> tuple[bool, str] | None:
    """(contradicting, what is wrong) where no lookup serves a current profile of `key` with `knobs`, None where one
    may: the one rule `not_served_reason` and `not_served_label` both say, each in its own words."""
    p = key_knobs_problem(key, knobs)
    if p is not None:
        return True, f"{p[0]}: {p[1]}"
    refusal = runtime_refusal(key, knobs)
    return None if refusal is None else (False, refusal)


def not_served_reason(key: ProfileKey, knobs: Knobs) -> str | None:
    """Why no lookup serves a current profile of `key` with `knobs` (None: one may): its knobs or key contradict its
    family (`contradiction_reason`: the daemon, the client and the store's find_profile pass it over), or no run of
    this runtime can take it (`runtime_refusal`: autoload passes it over). Such a row stands for no key: what counts
    current profiles as served (re-tune planning, the daemon's status) asks this. The tuner's incumbent asks only
    `contradiction_reason` (tune.served_incumbent): a what-if row's rival is a what-if profile too."""
    cause = _not_served_cause(key, knobs)
    if cause is None:
        return None
    contradicting, why = cause
    return contradiction_reason(key, knobs) if contradicting else WHAT_IF_ONLY.format(why=why)


def not_served_label(key: ProfileKey, knobs: Knobs) -> str | None:
    """`not_served_reason` said short, for what lists stored profiles (`profiles list`, `show`, the daemon's
    list_profiles reply): a reader of a list took such a row for one in use. None where a lookup may serve it."""
    cause = _not_served_cause(key, knobs)
    if cause is None:
        return None
    contradicting, why = cause
    return (CONTRADICTS_LABEL if contradicting else WHAT_IF_LABEL).format(why=why)
