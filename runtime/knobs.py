"""The knob set: the one vocabulary the runtime executes and the tuner searches (each knob: docs/settings.md).

A `Knobs` value is immutable and validated on construction; combinations that make no sense
raise `KnobError` naming the knobs involved. Workload-dependent checks (a group size that must
divide the transfers per peer) live in `Knobs.check_workload`.
"""

from __future__ import annotations

import hashlib
import re
import typing
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

Transport = Literal["nvlink", "proxy", "ibgda", "host_staged", "collective"]
Signalling = Literal["coupled", "decoupled"]
FenceMode = Literal["proxy_drain", "nic_ordered", "none"]
QpMapping = Literal["round_robin", "peer_hash"]
Compression = Literal["none", "fp8_e4m3"]
ScaleGranularity = Literal["per_token", "per_128"]
WaitMode = Literal["memop", "kernel"]
CombineLanes = Literal["auto", "own", "shared"]
Engine = Literal["unfused", "megakernel"]
MkCore = Literal["mma", "wgmma"]

# Each choice spelt once, in its Literal; the tuples are read from them.
TRANSPORTS: tuple[str, ...] = typing.get_args(Transport)
SIGNALLINGS: tuple[str, ...] = typing.get_args(Signalling)
FENCE_MODES: tuple[str, ...] = typing.get_args(FenceMode)
QP_MAPPINGS: tuple[str, ...] = typing.get_args(QpMapping)
COMPRESSIONS: tuple[str, ...] = typing.get_args(Compression)
SCALE_GRANULARITIES: tuple[str, ...] = typing.get_args(ScaleGranularity)
WAIT_MODES: tuple[str, ...] = typing.get_args(WaitMode)
COMBINE_LANES: tuple[str, ...] = typing.get_args(CombineLanes)
ENGINES: tuple[str, ...] = typing.get_args(Engine)
MK_CORES: tuple[str, ...] = typing.get_args(MkCore)
MK_MAX_SPLIT_K = 16
# The megakernel's m-tile rows (csrc/megakernel: 16 decode, 64/128 prefill; 0 = by rows per expert) and the
# limits of its other knobs (runtime/megakernel/config.py checks the same; shared memory caps stages further).
MK_BMS: tuple[int, ...] = (0, 16, 64, 128)
MK_MAX_STAGES = 12
MK_MAX_CTAS_PER_SM = 32
MK_MAX_PROCESSOR_CTAS = 1 << 16
MK_MAX_COMBINE_TOKENS = 4096


def mk_stage_cap(bm: int, core: str, overlap: int) -> int:
    """The deepest pipeline an explicit m-tile `bm` runs: a CTA's stages plus its metadata must fit the 226 KB of
    dynamic shared memory the library allows (csrc/megakernel/mk_moe.cu: SMEM_MAX, smem_for, check_params). bm=128:
    32 KB stages, 6 on every core; bm=64: 24 KB stages, 9, but 8 on the wgmma core's overlap kernel (its two task
    slots and staged epilogue take 12 KB); bm=16 (and 0, whose tile depends on S): MK_MAX_STAGES."""
    if bm == 128:
        return 6
    if bm == 64:
        return 8 if core == "wgmma" and overlap == 1 else 9
    return MK_MAX_STAGES


# Knobs added with the megakernel (issue 17). Left out of `canonical()` at their defaults, so the digest and
# the profile hash of every setting that existed before them stay what stores and peers hold.
MK_KNOBS: tuple[str, ...] = ("engine", "mk_bm", "mk_stages", "mk_ctas_per_sm", "mk_processor_ctas",
                             "mk_combine_tokens", "mk_core", "mk_split_k", "mk_bn", "mk_overlap")
MK_BNS: tuple[int, ...] = (0, 128, 256)
# Knobs added after profiles were first stored (commit ab0bc7bc) and, unlike MK_KNOBS, hashed even at their
# defaults: canonical() keeps them (rows stored since carry those hashes), so a row stored before them carries a
# hash of `legacy_canonical()`. Readers of stored hashes accept both (profile_record.stored_profile_hashes).
HASHED_LATE_KNOBS: tuple[str, ...] = ("staging_slots", "wait_mode", "combine_lanes")
# Upper bounds of the unbounded-looking integers: the C side takes them as 32-bit ints, and no workload has
# a million transfers per fence or tokens per message
MAX_GROUP_SIZE = MAX_CHUNK_TOKENS = 1 << 20
# the signal slots a source has at each peer (csrc/mt_common.h MT_MAX_SLOTS): the most PUTs a one-sided exchange
# makes to one peer, so the most chunks chunk_tokens may cut a peer's rows into
MAX_SLOTS = 1024
# the ranks a one-sided transport (nvlink, proxy) serves, on one node (csrc/mt_common.h MT_MAX_WORLD: its control
# block's rows): here, torch-free, so the fabric model refuses what the runtime refuses (transports/_onesided.py)
MAX_WORLD = 8
# the transports that store into their peers' memory and so serve at most MAX_WORLD ranks of one node
ONE_SIDED_TRANSPORTS: tuple[str, ...] = ("nvlink", "proxy")
# the transports this runtime implements (runtime/transports/registry.py registers these; a test keeps the two
# equal): here, torch-free, so the store and the tuner's reports say what autoload finds. ibgda is the fabric
# model's only.
RUNTIME_TRANSPORTS: tuple[str, ...] = ("collective", "host_staged", "nvlink", "proxy")


def missing_transport_problem(transport: str) -> str | None:
    """Why the runtime cannot run `transport` at all (None when it implements it: `RUNTIME_TRANSPORTS`)."""
    if transport in RUNTIME_TRANSPORTS:
        return None
    return (f"transport={transport} has no runtime transport (the fabric model predicts it; this runtime runs "
            f"{', '.join(RUNTIME_TRANSPORTS)})")


def one_sided_world_problem(transport: str, world: int, who: str = "", nodes: int = 1) -> str | None:
    """Why the runtime's `transport` cannot serve an EP group of `world` ranks on `nodes` hosts (None when it can):
    nvlink and proxy serve at most MAX_WORLD ranks, of one node. The one-sided part of `group_world_problem` (which
    adds host_staged across nodes), torch-free: the one-sided transports' `check_world` raises it (it knows no node
    count: 1); autoload, the store and the tuner's reports ask `group_world_problem`."""
    if transport not in ONE_SIDED_TRANSPORTS:
        return None
    if world > MAX_WORLD:
        return (f"{who}transport={transport} serves at most {MAX_WORLD} ranks on one node (its GPUs store into each "
                f"other's memory), this EP group has {world}: use transport=collective for a larger group")
    if nodes > 1:  # within MAX_WORLD, but a peer on another host has no memory these GPUs can store into
        return (f"{who}transport={transport} serves the ranks of one node (its GPUs store into each other's memory), "
                f"this EP group spans {nodes} nodes: use transport=collective for a group across nodes")
    return None


def group_world_problem(transport: str, world: int, who: str = "", nodes: int = 1) -> str | None:
    """Why the runtime's `transport` cannot serve an EP group of `world` ranks on `nodes` hosts (None when it can):
    nvlink and proxy as `one_sided_world_problem` says, and host_staged on one host only. The one statement of the
    rule for a group, torch-free: host_staged's constructor raises it (it counts the group's hosts), autoload passes
    such a profile over (`transport_world_problem`), the store and the tuner's reports name it (`runtime_refusal`,
    given the key's node count)."""
    why = one_sided_world_problem(transport, world, who, nodes)
    if why is None and transport == "host_staged" and nodes > 1:
        # the ranks on other hosts cannot open rank 0's /dev/shm file (the copy-engine path failed in its setup)
        why = (f"{who}transport=host_staged serves the ranks of one node (its staging memory is one host's shared "
               f"memory file), this EP group spans {nodes} nodes: use transport=collective for a group across nodes")
    return why


def chunk_tokens_fit(chunk_tokens: int, rows: int) -> bool:
    """Whether chunk_tokens acts as named on calls that send up to `rows` rows to one peer: ceil(rows / chunk_tokens)
    PUTs, at most MAX_SLOTS (0: one PUT). Past that the proxy kernel would cut larger chunks than asked
    (csrc/proxy_xchg.h `chunking`); the runtime refuses it and the tuner never offers it."""
    return chunk_tokens <= 0 or rows <= 0 or -(-rows // chunk_tokens) <= MAX_SLOTS


def num_scale_groups(hidden: int, granularity: str) -> int:
    """fp8 scales per token row of `hidden` values: 1 per token, or hidden / 128 per 128 channels (ValueError where
    128 does not divide hidden, or for an unknown granularity). Here, torch-free, for the fabric model; the runtime
    (runtime/fp8.py, the EP buffer's knob check) uses the same function."""
    if granularity == "per_token":
        return 1
    if granularity == "per_128":
        if hidden % 128:
            raise ValueError(f"scale_granularity per_128 needs hidden divisible by 128, got hidden={hidden}")
        return hidden // 128
    raise ValueError(f"unknown scale granularity {granularity!r} (per_token or per_128)")


# host_staged's ring of staging slots per (lane, sender, receiver): 2 is double buffering
MIN_STAGING_SLOTS, MAX_STAGING_SLOTS = 2, 16
# Communicators per direction a collective transport's EP buffer spreads its pipeline chunks over: `channels`
# beyond it are taken but not used (runtime/buffer/layout_choice.py, facade.py `comm_channels`).
MAX_COMM_CHANNELS = 8

# Who can enforce PUT-before-SIGNAL on each transport.
#  - proxy: the CPU proxy drains (proxy_drain) or the queue/NIC orders it (nic_ordered);
#  - ibgda: no proxy exists, only the NIC's per-QP ordering;
#  - nvlink: stores are ordered by a GPU memory fence inside the kernel ("none": no proxy, no NIC);
#  - collective / host_staged: the collective library orders its own data and completion.
ALLOWED_FENCE_MODES: dict[str, tuple[str, ...]] = {
    "proxy": ("proxy_drain", "nic_ordered"),
    "ibgda": ("nic_ordered",),
    "nvlink": ("none",),
    "collective": ("none",),
    "host_staged": ("none",),
}

# Transports whose transfers are one-sided puts followed by signals.
ONE_SIDED: frozenset[str] = frozenset({"nvlink", "proxy", "ibgda"})
# Transports whose requests go through queue pairs (or the proxy's CUDA streams on one node).
QUEUED: frozenset[str] = frozenset({"proxy", "ibgda"})

PER_PE = 0  # group_size value meaning "one group per remote PE" (the default)


@dataclass(frozen=True)
class KnobValues:
    """The values one knob takes: `choices` (a Literal's strings, or a few integers), else the integers
    `low`..`high`. `meaning` names values that mean something of their own ((0, "auto")); one of them outside
    low..high (mk_stages 0) is taken besides the range."""

    choices: tuple[Any, ...] = ()
    low: int | None = None
    high: int | None = None
    meaning: tuple[tuple[int, str], ...] = ()

    @property
    def is_int(self) -> bool:
        return self.low is not None or all(type(c) is int for c in self.choices)

    @property
    def _outside(self) -> tuple[int, ...]:
        """The named values outside low..high (taken as well)."""
        if self.low is None or self.high is None:
            return ()
        return tuple(v for v, _ in self.meaning if not self.low <= v <= self.high)

    @property
    def limits(self) -> tuple[int, int]:
        """The smallest and largest integer taken (an integer knob's hard bounds)."""
        if self.low is None or self.high is None:
            return min(self.choices), max(self.choices)
        return min((self.low, *self._outside)), max((self.high, *self._outside))

    def allows(self, value: Any) -> bool:
        if self.low is None or self.high is None:
            return value in self.choices
        return type(value) is int and (self.low <= value <= self.high or value in self._outside)

    def refused_in(self, low: int, high: int, step: int = 1) -> list[int]:
        """Values of low..high (by `step`) this knob refuses: all of them below its range, the first above it
        (a wide range inside the knob's own costs nothing: only what lies outside it is looked at)."""
        if self.low is None or self.high is None:
            return [v for v in range(low, high + 1, step) if v not in self.choices]
        below = [v for v in range(low, min(high, self.low - 1) + 1, step) if v not in self._outside]
        first_above = low + max(0, -(-(self.high + 1 - low) // step)) * step  # the first value past self.high
        return below + ([first_above] if first_above <= high and first_above not in self._outside else [])

    def _named(self, value: int) -> str:
        what = dict(self.meaning).get(value)
        return f"{value} ({what})" if what else str(value)

    def requirement(self) -> str:
        """What "must be ..." says: `in 1..64`, `in 0..16 (0 = auto)`, `0 (auto) or in 2..12`, `0 or 1`."""
        if self.low is None:
            if not self.is_int:
                return f"one of {', '.join(self.choices)}"
            *head, last = (self._named(c) for c in self.choices)
            return f"{', '.join(head)} or {last}"
        inside = [f"{v} = {what}" for v, what in self.meaning if v not in self._outside]
        extra = "".join(f"{self._named(v)} or " for v in self._outside)
        return f"{extra}in {self.low}..{self.high}" + (f" ({'; '.join(inside)})" if inside else "")

    def doc(self) -> str:
        """The values column of docs/settings.md: `int 1..64`, `` `0` or int 2..12 ``, `` `a` / `b` ``."""
        if self.low is None:
            return " / ".join(f"`{c}`" for c in self.choices)
        return "".join(f"`{v}` or " for v in self._outside) + f"int {self.low}..{self.high}"


# THE knob table: what each knob takes. `_validate` checks each knob against it, KNOB_DOCS writes its values
# column from it, and the tuner's policies (tuner/search/policy.py) take their hard limits from it (a policy's
# search space may be narrower, never wider). The string knobs' choices are their Literals' (checked below).
KNOB_VALUES: dict[str, KnobValues] = {
    "transport": KnobValues(TRANSPORTS),
    "signalling": KnobValues(SIGNALLINGS),
    "group_size": KnobValues(low=0, high=MAX_GROUP_SIZE, meaning=((PER_PE, "per PE"),)),
    "fence_mode": KnobValues(FENCE_MODES),
    "qp_mapping": KnobValues(QP_MAPPINGS),
    "qps_per_pe": KnobValues(low=1, high=64),
    "compression": KnobValues(COMPRESSIONS),
    "scale_granularity": KnobValues(SCALE_GRANULARITIES),
    "chunk_tokens": KnobValues(low=0, high=MAX_CHUNK_TOKENS, meaning=((0, "no chunking"),)),
    "pipeline_depth": KnobValues(low=1, high=16),
    "num_sms": KnobValues(low=1, high=264),
    "channels": KnobValues(low=1, high=64),
    "staging_slots": KnobValues(low=MIN_STAGING_SLOTS, high=MAX_STAGING_SLOTS),
    "wait_mode": KnobValues(WAIT_MODES),
    "combine_lanes": KnobValues(COMBINE_LANES),
    "engine": KnobValues(ENGINES),
    "mk_bm": KnobValues(MK_BMS, meaning=((0, "auto"),)),
    "mk_stages": KnobValues(low=2, high=MK_MAX_STAGES, meaning=((0, "auto"),)),
    "mk_ctas_per_sm": KnobValues(low=0, high=MK_MAX_CTAS_PER_SM, meaning=((0, "as many as fit"),)),
    "mk_processor_ctas": KnobValues(low=0, high=MK_MAX_PROCESSOR_CTAS,
                                    meaning=((0, "every resident CTA but the scheduler"),)),
    "mk_combine_tokens": KnobValues(low=1, high=MK_MAX_COMBINE_TOKENS, meaning=((0, "auto"),)),
    "mk_core": KnobValues(MK_CORES),
    "mk_split_k": KnobValues(low=1, high=MK_MAX_SPLIT_K, meaning=((1, "no split"),)),
    "mk_bn": KnobValues(MK_BNS, meaning=((0, "auto"),)),
    "mk_overlap": KnobValues((0, 1)),
}


class KnobError(ValueError):
    """A knob value or a combination of knob values is invalid. `knobs` names them."""

    def __init__(self, message: str, knobs: tuple[str, ...] = ()):
        self.knobs = knobs
        prefix = f"knob {', '.join(knobs)}: " if knobs else ""
        super().__init__(prefix + message)


class Knobs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One point in the search space. Defaults are a safe, portable setting."""

    transport: Transport = "collective"
    signalling: Signalling = "decoupled"
    # Transfers per fence when decoupled; 0 means per remote PE (all experts bound for one PE).
    group_size: int = PER_PE
    fence_mode: FenceMode = "none"
    qp_mapping: QpMapping = "peer_hash"
    qps_per_pe: int = 1
    compression: Compression = "none"
    scale_granularity: ScaleGranularity = "per_token"
    # Tokens per message/chunk; 0 means one message per peer (no chunking).
    chunk_tokens: int = 0
    # Chunks in flight: 1 = no pipelining, 2 = double buffering, ...
    pipeline_depth: int = 1
    num_sms: int = 24
    channels: int = 1
    # host_staged only (runs 27-34 measured each; the defaults were the fastest on the H200 node):
    # staging slots per (lane, sender, receiver) ring, and how the GPU waits for a slot's flag
    staging_slots: int = 4
    wait_mode: WaitMode = "memop"
    # pipelined combines on their own communicators/lanes or on the dispatch ones; auto = the transport's choice
    combine_lanes: CombineLanes = "auto"
    # The MoE layer's engine at world 1: the unfused chain (route, sort, grouped GEMMs, combine) or the
    # persistent megakernel (runtime/megakernel). The mk_* knobs are the megakernel's settings that moved its
    # latency by >= 5% on an H200 (bench/results/megakernel/README.md); 0 = auto where the kernel picks.
    engine: Engine = "unfused"
    mk_bm: int = 0
    mk_stages: int = 0
    mk_ctas_per_sm: int = 0
    mk_processor_ctas: int = 0
    mk_combine_tokens: int = 0
    # GEMM core of the bm=64/128 tiles (run 10: wgmma 17% faster at S=1024, 14% at 4096 with bm=64) and the
    # decode split-K factor of both GEMMs (applies while a launch's m-tiles fit the partial buffer, i.e. S <= 2 for
    # Qwen3-30B; run 10: 2 parts 15% faster at S=1; run 40, with the TMA decode tile and publish_all: no split
    # faster, S=1 55.7 vs 59.6 us, S=2 63.9 vs 77.3, so 1)
    mk_core: MkCore = "wgmma"
    mk_split_k: int = 1
    # columns per wgmma GEMM task (0 = auto: the 128 x 256 wide tile where the shape allows) and the wgmma tiles'
    # cross-task overlap (run 12: together 23% faster at S=4096, 8% at 1024; each alone >= 5% somewhere)
    mk_bn: int = 0
    mk_overlap: int = 1

    def __post_init__(self) -> None:
        _validate(self)

    # -- conversions -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Knobs:
        """Build from a plain mapping; unknown names and wrong types raise KnobError."""
        if not isinstance(data, dict):
            raise KnobError(f"expected a mapping of knob names to values, got {type(data).__name__}")
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            if isinstance(e.__cause__, KnobError):  # raised by _validate: keep the names of the knobs in `knobs`
                raise e.__cause__ from None
            raise KnobError(str(e)) from None

    @classmethod
    def parse(cls, text: str, base: Knobs | None = None) -> Knobs:
        """Parse `name=value,name=value` (the CLI's `--knobs`) on top of `base` (or the defaults).

        A value that is not one the knob takes raises KnobError naming the knob and the text as given."""
        if not isinstance(text, str):
            raise KnobError(f"expected a string of name=value pairs, got {type(text).__name__} {text!r}")
        if base is not None and not isinstance(base, Knobs):
            raise KnobError(f"base must be a Knobs or None, got {type(base).__name__}")
        data = (base if base is not None else cls()).to_dict()
        given: set[str] = set()
        items = [p.strip() for p in text.split(",")]
        # "" (or blanks) sets none; an empty item beside others ("num_sms=24,,") is a lost name=value, a typo
        # not to skip silently (as the CLI's integer lists refuse "1,,2")
        if text.strip() and "" in items:
            raise KnobError(f"expected comma-separated name=value pairs, got {text!r} (an empty item)")
        for item in items if text.strip() else []:
            if "=" not in item:
                raise KnobError(f"expected name=value, got {item!r}")
            name, value = (s.strip() for s in item.split("=", 1))
            if name not in data:
                raise KnobError(f"unknown knob {name!r}; known: {', '.join(sorted(data))}")
            if name in given:  # which one was meant cannot be told (the last one silently won)
                raise KnobError(f"given twice in {text!r}", (name,))
            given.add(name)
            data[name] = _parse_value(name, value)
        return cls.from_dict(data)

    @classmethod
    def from_stored(cls, data: Any) -> Knobs:
        """`from_dict` for a setting read back from where an earlier moetune wrote it (a profile row, an export
        file): see `stored_form`."""
        return cls.from_dict(stored_form(data))

    def replace(self, **changes: Any) -> Knobs:
        data = self.to_dict()
        unknown = set(changes) - set(data)
        if unknown:
            raise KnobError(f"unknown knob(s) {sorted(unknown)}")
        data.update(changes)
        return Knobs.from_dict(data)

    def canonical(self) -> dict[str, Any]:
        """What the digest and profile hashes cover: every knob, less the megakernel's at their defaults
        (so settings from before they existed keep their hashes)."""
        d = self.to_dict()
        for name in MK_KNOBS:
            if d[name] == _DEFAULTS[name]:
                del d[name]
        return d

    def legacy_canonical(self) -> dict[str, Any] | None:
        """`canonical()` as a moetune from before HASHED_LATE_KNOBS hashed it: without them, where all three sit at
        their defaults (the only values they had then); None otherwise (no profile stored then holds such knobs)."""
        d = self.canonical()
        if any(d[name] != _DEFAULTS[name] for name in HASHED_LATE_KNOBS):
            return None
        for name in HASHED_LATE_KNOBS:
            del d[name]
        return d

    def digest(self) -> str:
        """Stable short hash of the setting (ranks compare it to be sure they run the same)."""
        return hashlib.sha256(msgspec.json.encode(self.canonical(), order="sorted")).hexdigest()[:16]

    # -- workload-dependent checks ---------------------------------------------------------------
    def effective_group_size(self, transfers_per_peer: int) -> int:
        """Transfers behind one fence. coupled: 1; decoupled per PE: all transfers to that peer."""
        if self.signalling == "coupled":
            return 1
        if self.group_size == PER_PE:
            return max(1, transfers_per_peer)
        return self.group_size

    def check_workload(self, transfers_per_peer: int) -> None:
        """Raise KnobError when the setting cannot be applied to `transfers_per_peer` transfers/PE."""
        if transfers_per_peer < 0:
            raise KnobError(f"transfers per peer must be >= 0, got {transfers_per_peer}")
        if self.signalling == "decoupled" and self.group_size != PER_PE and transfers_per_peer > 0:
            if transfers_per_peer % self.group_size != 0:
                raise KnobError(
                    f"group_size {self.group_size} does not divide the {transfers_per_peer} "
                    "transfers per remote PE",
                    ("group_size",),
                )


# A knob's integer as text: ASCII digits with an optional sign. int() alone would also take "1_0" (10), " 3 " and
# other scripts' digits, so a mistyped value could silently become another number.
_INT_TEXT = re.compile(r"[+-]?[0-9]+")


def int_of_text(text: str) -> int | None:
    """`text` as an integer when it is ASCII digits with an optional sign, else None (every runtime parser of
    typed text uses this, so "1_0" is refused everywhere alike)."""
    return int(text) if _INT_TEXT.fullmatch(text) else None


def float_of_text(text: str) -> float | None:
    """`text` as a float when float() reads it and it is ASCII without digit separators, else None: float() alone
    also takes "1_0" (10.0) and other scripts' digits, the misreadings int_of_text refuses (the float parsers of
    typed text use this; nan and inf stay for the range checks that follow to refuse, naming the setting)."""
    if not text.isascii() or "_" in text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _parse_value(name: str, text: str) -> int | str:
    """One `--knobs` value, typed as knob `name` takes it (the range checks follow in _validate)."""
    if name in _INTS:
        value = int_of_text(text)
        if value is None:
            raise KnobError(f"expected an integer (digits only), got {text!r}", (name,))
        return value
    choices = _CHOICES[name]
    if text not in choices:
        raise KnobError(f"must be one of {', '.join(choices)}, got {text!r}", (name,))
    return text


def _check_types(k: Knobs) -> None:
    # msgspec checks types in convert/decode only, not when a Knobs is constructed directly: a misspelt choice
    # ("fp8") or a float would otherwise pass and be ignored or mis-hashed downstream
    for name, choices in _CHOICES.items():
        v = getattr(k, name)
        if not isinstance(v, str) or v not in choices:
            raise KnobError(f"must be one of {', '.join(choices)}, got {v!r}", (name,))
    for name in _INTS:
        v = getattr(k, name)
        if type(v) is not int:
            raise KnobError(f"must be an int, got {type(v).__name__} {v!r}", (name,))


def _validate(k: Knobs) -> None:
    _check_types(k)
    for name, values in _INT_VALUES.items():  # each integer knob on its own (KNOB_VALUES); combinations below
        v = getattr(k, name)
        if not values.allows(v):
            raise KnobError(f"must be {values.requirement()}, got {v}", (name,))
    if k.signalling == "coupled" and k.group_size not in (PER_PE, 1):
        raise KnobError("a group size only applies when signalling=decoupled", ("group_size", "signalling"))
    allowed = ALLOWED_FENCE_MODES[k.transport]
    if k.fence_mode not in allowed:
        raise KnobError(
            f"fence_mode {k.fence_mode!r} is not possible on transport {k.transport!r} (allowed: {', '.join(allowed)})",
            ("fence_mode", "transport"),
        )
    if k.transport not in QUEUED and k.qps_per_pe != 1:
        raise KnobError(f"queue pairs only exist on proxy/ibgda, not {k.transport!r}", ("qps_per_pe", "transport"))
    # NIC-side ordering holds only when a peer's PUTs and its SIGNAL share one queue pair.
    if k.fence_mode == "nic_ordered" and k.qp_mapping == "round_robin" and k.qps_per_pe > 1:
        raise KnobError(
            "nic_ordered with round_robin over more than one QP lets a signal overtake its data; "
            "use qp_mapping=peer_hash or qps_per_pe=1",
            ("fence_mode", "qp_mapping", "qps_per_pe"),
        )
    if k.compression == "none" and k.scale_granularity != "per_token":
        raise KnobError("a scale granularity only applies with compression", ("scale_granularity", "compression"))
    defaults = Knobs.__struct_defaults__
    for name in ("staging_slots", "wait_mode"):
        if k.transport != "host_staged" and getattr(k, name) != defaults[Knobs.__struct_fields__.index(name)]:
            raise KnobError(f"staging slots and their waits only exist on host_staged, not {k.transport!r}",
                            (name, "transport"))
    if k.transport in ONE_SIDED and k.combine_lanes != "auto":
        raise KnobError(f"combine lanes apply to the collective transports, not {k.transport!r}",
                        ("combine_lanes", "transport"))
    _validate_megakernel(k)


def _validate_megakernel(k: Knobs) -> None:
    if k.mk_bn == 256 and (k.mk_core != "wgmma" or k.mk_bm not in (0, 128)):
        raise KnobError(f"the wide tile (256) needs mk_core=wgmma and mk_bm 0 or 128, got {k.mk_core}, {k.mk_bm}",
                        ("mk_bn", "mk_core", "mk_bm"))
    if k.mk_bn == 256 and k.mk_stages > 4:
        raise KnobError(f"the wide tile holds at most 4 stages (48 KB each), got {k.mk_stages}", ("mk_stages", "mk_bn"))
    cap = mk_stage_cap(k.mk_bm, k.mk_core, k.mk_overlap)
    if k.mk_stages > cap:
        # never launchable: refused here, naming the knobs, not as "no resident CTA" once a GPU layer is built
        extra = " with mk_core=wgmma and mk_overlap=1 (9 with mk_core=mma or mk_overlap=0)" if k.mk_bm == 64 and cap == 8 else ""
        raise KnobError(f"mk_bm={k.mk_bm} holds at most {cap} stages in shared memory{extra}, got {k.mk_stages}",
                        ("mk_stages", "mk_bm"))
    if k.engine != "megakernel":
        changed = [n for n in MK_KNOBS[1:] if getattr(k, n) != _DEFAULTS[n]]
        if changed:
            raise KnobError(f"megakernel settings only apply with engine=megakernel, not {k.engine!r}",
                            (changed[0], "engine"))


_DEFAULTS: dict[str, Any] = dict(zip(Knobs.__struct_fields__, Knobs.__struct_defaults__, strict=True))

# Megakernel knobs whose default changed after settings holding it were stored (a stored setting holds every knob):
# mk_combine_tokens 8 until 579f2ce (2026-12-04, now 0 = auto), mk_split_k 2 from 7100c28 to 8035abb (2026-12-02,
# now 1). Another engine's setting never read them, and _validate_megakernel now refuses them there.
FORMER_MK_DEFAULTS: dict[str, Any] = {"mk_combine_tokens": 8, "mk_split_k": 2}


def stored_form(data: Any) -> Any:
    """A stored knob mapping as this moetune reads it: where the setting is not the megakernel's, a megakernel knob
    at a former default (FORMER_MK_DEFAULTS) is today's default. Such rows stayed unreadable otherwise (skipped by
    every lookup, list and export); their hashes are unchanged (`canonical` left that knob out then as now)."""
    if not isinstance(data, dict) or data.get("engine", _DEFAULTS["engine"]) == "megakernel":
        return data
    return {k: (_DEFAULTS[k] if k in FORMER_MK_DEFAULTS and v == FORMER_MK_DEFAULTS[k] and type(v) is int else v)
            for k, v in data.items()}
# each field's allowed strings (Literal fields) or int-ness, from the struct's own annotations
_FIELD_TYPES = {f.name: f.type for f in msgspec.structs.fields(Knobs)}
_CHOICES: dict[str, tuple[str, ...]] = {n: typing.get_args(tp) for n, tp in _FIELD_TYPES.items()
                                        if typing.get_origin(tp) is Literal}
_INTS: tuple[str, ...] = tuple(n for n, tp in _FIELD_TYPES.items() if tp is int)
_INT_VALUES: dict[str, KnobValues] = {n: KNOB_VALUES[n] for n in _INTS}
# A knob added to the struct without its row in the table (or a table that disagrees with a Literal) fails here,
# at import, not at the first check that misses it.
if set(KNOB_VALUES) != set(Knobs.__struct_fields__):
    raise AssertionError(f"KNOB_VALUES and Knobs differ: {sorted(set(KNOB_VALUES) ^ set(Knobs.__struct_fields__))}")
for _name, _values in KNOB_VALUES.items():
    if _values.is_int != (_name in _INTS) or (_name in _CHOICES and _values.choices != _CHOICES[_name]):
        raise AssertionError(f"KNOB_VALUES[{_name!r}] is not what Knobs.{_name} is typed as")
    if not _values.allows(_DEFAULTS[_name]):
        raise AssertionError(f"Knobs.{_name} default {_DEFAULTS[_name]!r} is not in KNOB_VALUES")


# What each knob means, for docs/settings.md (runtime/options.py generates it). Its values column is written from
# KNOB_VALUES: KNOB_DOCS is name -> (values, meaning).
_KNOB_MEANINGS: dict[str, str] = {
    "transport": "How rows move between the ranks.",
    "signalling": "One-sided transports: a signal per transfer, or one per group.",
    "group_size": "Transfers per fence when decoupled; 0 = all transfers to one peer.",
    "fence_mode": "Who orders PUT before SIGNAL (allowed values depend on the transport).",
    "qp_mapping": "proxy/ibgda: how transfers map to queue pairs.",
    "qps_per_pe": "proxy/ibgda: queue pairs per remote PE.",
    "compression": "Dispatch rows on the wire (combine is never compressed).",
    "scale_granularity": "fp8 scales per token or per 128 values.",
    "chunk_tokens": (f"Tokens per message (proxy: rows per PUT, at most {MAX_SLOTS} PUTs per peer: max_tokens / "
                     f"chunk_tokens <= {MAX_SLOTS}, else refused; host_staged: rows per staging slot); 0 = one message "
                     "per peer."),
    "pipeline_depth": "Chunks the tokens are split into (1 = no pipelining).",
    "num_sms": "SMs the one-sided kernels use.",
    "channels": (f"Communicators (lanes) per direction the chunks are spread over (at most {MAX_COMM_CHANNELS} "
                 "used)."),
    "staging_slots": ("host_staged: slots per (lane, sender, receiver) ring; more let a sender run further ahead "
                      "(was `MOETUNE_HS_SLOTS`)."),
    "wait_mode": ("host_staged: a slot's flag is waited for by cuStreamWaitValue64 (`memop`, a watchdog thread times "
                  "it) or a one-thread spin kernel (was `MOETUNE_HS_WAIT`)."),
    "combine_lanes": ("Pipelined combines on their own communicators/lanes or on the dispatch ones; `auto` = the "
                      "transport's preference (host_staged native: shared; was `MOETUNE_EP_COMBINE_LANES`)."),
    "engine": ("The MoE layer's engine at world 1: the unfused chain (route, sort, two grouped GEMMs, weighted "
               "combine) or one persistent kernel after routing (needs an sm_90 GPU, bf16 and nvcc; elsewhere the "
               "layer falls back to `unfused` with a warning)."),
    "mk_bm": ("megakernel: token rows per m-tile; 0 = by the average rows per expert: on the wide tile (mk_bn "
              "256, auto where the shape allows) 16 below 10 rows, else 128; otherwise 16 below 32 rows, else 64 (128 "
              "from 128 rows with mk_core=mma)."),
    "mk_stages": ("megakernel: cp.async pipeline depth (weight tiles in flight per CTA; shared memory caps bm=64 at "
                  "8, 9 with mk_core=mma or mk_overlap=0, bm=128 at 6); 0 = by tile and rows per expert."),
    "mk_ctas_per_sm": "megakernel: resident CTAs per SM; 0 = as many as fit.",
    "mk_processor_ctas": "megakernel: CTAs that run tasks; 0 = every resident CTA but the scheduler's.",
    "mk_combine_tokens": ("megakernel: tokens per combine tile (each runs as 4 column-block tasks); 0 = 2 on the "
                          "16-row tile, 4 on the wide tile up to 64 rows per expert, else 8."),
    "mk_core": ("megakernel: GEMM core of the 64/128-row tiles (mma.sync, or Hopper's warpgroup MMA fed by a "
                "producer warpgroup); 16-row tiles always use mma."),
    "mk_bn": ("megakernel: columns per wgmma GEMM task; 256 = the 128 x 256 wide tile (two consumer warpgroups of "
              "m64n256k16); 0 = 256 where the shape allows (hidden, 2 x intermediate multiples of 256), else 128."),
    "mk_overlap": ("megakernel: 1 = the wgmma tiles overlap consecutive tasks (the producer warpgroup claims and "
                   "loads the next task while the consumers finish the current one)."),
    "mk_split_k": ("megakernel: decode split-K, parts per GEMM task over K (1 = none); applies while a 16-row "
                   "launch's m-tiles fit the partial buffer (16)."),
}
KNOB_DOCS: dict[str, tuple[str, str]] = {n: (KNOB_VALUES[n].doc(), m) for n, m in _KNOB_MEANINGS.items()}


def default_knobs(transport: str) -> Knobs:
    """A safe default for a transport family (the policies refine these)."""
    if transport not in TRANSPORTS:
        raise KnobError(f"unknown transport {transport!r}; known: {', '.join(TRANSPORTS)}", ("transport",))
    fence = ALLOWED_FENCE_MODES[transport][0]
    return Knobs(transport=transport, fence_mode=fence, signalling="coupled" if transport in ONE_SIDED else "decoupled")
