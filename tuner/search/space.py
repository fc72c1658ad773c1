"""The search space: one transport family's policy applied to one workload.

One decision tree serves Optuna's define-by-run sampling (`suggest`) and the exhaustive grid
(`enumerate`), so the grid is exactly the space the search samples. The tree is built so that it
cannot produce an infeasible setting:

- `group_size` is asked only when signalling is decoupled. For nvlink it counts CTAs: the kernel signals
  per group of group_size CTAs out of num_sms // world per peer (`nvlink_ctas_per_peer`), so num_sms is
  asked first and group_size among per PE (0) and the proper divisors of that CTA count. For proxy (and
  ibgda, which the fabric model gives the same requests) it counts PUTs per peer: a signal per group of
  group_size PUTs, a last partial group included (csrc/proxy_xchg.h produce_exchange), and a peer gets
  ceil(rows / chunk_tokens) PUTs, ONE with chunk_tokens 0. So chunk_tokens is asked first and group_size
  only with chunk_tokens > 0 (with one PUT every group size is the same run), among per peer (0) and
  `PUT_GROUP_SIZES` (`put_groups`). Given the workload's tokens per rank (`tokens`, with `topk`), the space
  also knows the rows a peer gets (S x P(token needs the peer), `fabric_model.routing.rank_hits`), so it
  offers only chunk_tokens values with distinct PUTs as the fabric model counts them (`wire_rows.expected_puts`:
  E[ceil(X / chunk_tokens)] over the X ~ Binomial(S, p) rows a peer gets, a whole PUT over the other ranks
  apart; a chunk no peer's rows plausibly exceed is one PUT, the same run as chunk_tokens 0) and only group
  sizes < the most PUTs the model sends a peer with the chunk (`put_grid`). It never offers
  a chunk_tokens with more than MAX_SLOTS PUTs for the `tokens` rows a call may send one peer (`chunk_fits`):
  the kernel would cut larger chunks than named and the runtime refuses it (EPBuffer, as the benchmark builds
  it with max_tokens = tokens);
- knobs the transport's runtime does not read (`RUNTIME_READS`) are never asked: they stay at the
  policy default, so a stored profile never records a value that did not change the run;
- `fence_mode` only where the transport has more than one way to order (proxy transports);
- `qps_per_pe` only on queued transports (proxy, ibgda); `qp_mapping` only with more than one QP and
  never with `nic_ordered` (a peer's PUTs and SIGNAL must share a QP: peer_hash is implied);
- `scale_granularity` only with compression; a compression is offered only within the error budget;
- collective / host_staged: the EP buffer puts pipeline chunk c on communicator (lane) c mod channels, and gives
  pipelined combines lanes of their own only with more than one chunk (runtime/buffer/facade.py `comm_channels`,
  `_combine_base`; the fabric model's `min(channels, calls)` lanes). So pipeline_depth is asked first, `channels`
  only among values that use distinct lane counts, min(channels, pipeline_depth) (`channel_values`: at depth 1
  every channels value is the same run), and `combine_lanes` only with pipeline_depth > 1 (`LANES_RULE`);
- megakernel: the tile knobs the chosen m-tile and core read (runtime/megakernel/config.py; `MK_TILE_RULE`): the
  bm=16 decode tile always runs the mma core with 128 columns and no overlap, so with mk_bm 16 mk_core, mk_bn and
  mk_overlap stay at the policy default; split-K splits only bm=16 tasks, so with mk_bm 64/128 mk_split_k does; the
  mma core ignores mk_bn (auto is the wide tile only on wgmma) and mk_overlap; auto mk_bn is 128 (never the wide
  tile) with mk_bm 64 or more than 4 stages, so mk_bn is not asked there. With mk_bm 0 (by the rows) all are asked;
- host_staged at a known token count (`tokens`): a staging slot holds min(chunk_tokens, a chunk's tokens) rows
  (runtime/buffer/facade.py `stage_capacity` of ceil(tokens / pipeline_depth) rows; host_staged.py), so every
  chunk_tokens value at or above a pipeline chunk's tokens is the same run as 0: pipeline_depth is asked first, and
  chunk_tokens among the values that give distinct slots (`staged_chunk_values`, `STAGING_RULE`).

Parameters with a single possible value are fixed, not asked. `check` re-validates any knob set
(e.g. a warm-start point) against the same rules before it can be benchmarked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moetune.runtime.knobs import (
    ALLOWED_FENCE_MODES,
    KNOB_VALUES,
    MAX_SLOTS,
    ONE_SIDED,
    PER_PE,
    QUEUED,
    KnobError,
    Knobs,
    chunk_tokens_fit,
    num_scale_groups,
)
from moetune.tuner.search.policy import KnobSpec, Policy

Chooser = Callable[[str, KnobSpec], Any]

# The knobs each transport's runtime reads beyond transport, compression and scale_granularity (which
# every transport reads) and the structural ones the decision tree already restricts (signalling,
# group_size, fence_mode, qp_mapping, qps_per_pe: one-sided / queued transports only). A plain knob
# not listed for a transport is pinned at the policy default whatever the policy file says. Sources:
# - nvlink: runtime/transports/nvlink.py passes num_sms (CTAs: num_sms // world per peer), signalling and
#   group_size to csrc/ep_nvlink.cu; the device-resident layout (runtime/buffer/facade.py) moves each
#   direction in one launch: pipeline_depth, channels and chunk_tokens do not apply.
# - proxy: runtime/transports/proxy.py passes signalling, group_size, chunk_tokens (rows per PUT) to
#   csrc/proxy_gpu.cu, whose kernels launch <<<1, 32>>> (num_sms is never passed); device-resident
#   layout: pipeline_depth and channels do not apply.
# - collective: the buffer reads pipeline_depth (chunks) and channels (communicators); num_sms and
#   chunk_tokens are ignored (runtime/buffer/facade.py module doc).
# - host_staged: as collective, plus chunk_tokens (staging message), staging_slots, wait_mode,
#   combine_lanes (runtime/transports/host_staged.py); the copy engines move the bytes: no num_sms.
# Families whose engine is the megakernel, and transports not listed (ibgda: no runtime transport, the
# fabric model only), are not restricted here.
RUNTIME_READS: dict[str, frozenset[str]] = {
    "nvlink": frozenset({"num_sms"}),
    "proxy": frozenset({"chunk_tokens"}),
    "collective": frozenset({"pipeline_depth", "channels"}),
    "host_staged": frozenset({"pipeline_depth", "channels", "chunk_tokens", "staging_slots", "wait_mode",
                              "combine_lanes"}),
}


def nvlink_ctas_per_peer(num_sms: int, world: int) -> int:
    """CTAs the nvlink kernel gives each destination (csrc/ep_nvlink.cu mt_nvl_ctas_per_peer; its further
    cap of sm_count / world only binds when num_sms exceeds the GPU's SMs)."""
    return max(1, num_sms // max(1, world))


def runtime_ignores(policy: Policy) -> frozenset[str]:
    """The plain knobs (_PLAIN) the runtime does not read for this policy's transport."""
    reads = RUNTIME_READS.get(policy.transport)
    if reads is None or policy.defaults.engine == "megakernel":
        return frozenset()
    return frozenset(n for n in _PLAIN if n not in reads)


# Order in which the plain (unconditional) knobs are asked, after the structural ones.
_PLAIN = ("chunk_tokens", "pipeline_depth", "num_sms", "channels", "staging_slots", "wait_mode", "combine_lanes",
          "engine", "mk_bm", "mk_stages", "mk_ctas_per_sm", "mk_processor_ctas", "mk_combine_tokens",
          "mk_core", "mk_split_k", "mk_bn", "mk_overlap")


# Group sizes (PUTs per signal) offered to proxy/ibgda with chunk_tokens > 0, besides per peer (0). Without the
# token count (SearchSpace(tokens=None)) this is a fixed set, not bounded by the PUTs a peer gets at the workload:
# - 1 is left out: a signal per PUT is what `coupled` does (the same signals and fences; only the requests
#   differ: PUT+flag vs PUT then SIGNAL), so it would spend trials on a near-duplicate of coupled;
# - a size >= the PUTs per peer is one signal per peer, i.e. per peer (0): at chunk_tokens 256 a peer gets
#   ceil(rows / 256) PUTs, e.g. about 11 at 4096 tokens per GPU (128 experts, top-8, EP 8; the fabric model's
#   `transfers_per_peer`), so 2, 4 and 8 give 6, 3 and 2 signals there. At small token counts (rows <=
#   chunk_tokens: one PUT) they still all behave as per peer. With `tokens` the space drops them (and the
#   chunks that repeat another's PUTs): only sizes < the PUTs per peer of the chosen chunk are offered.
PUT_GROUP_SIZES: tuple[int, ...] = (2, 4, 8)
# Given the token count (SearchSpace(tokens=..., topk=...)) the set is bounded by the PUTs per peer: a study
# config carries this marker (`SearchSpace.grid_rule`), so a study that offered the fixed set is not resumed
# with the bounded one (Optuna refuses changed categorical choices). Since the grid counts the fabric model's
# expected PUTs (`SearchSpace._put_key`) it is another marker: a study of the ceil(S x p) grid is not resumed; and
# since it asks the model's charge of each peer set (NVLink peers apart on a preset with NVLink) another again.
PUT_GRID_RULE = "distinct_charged_puts"
# collective / host_staged: channels offered by the lanes the chunks use, combine_lanes only when pipelined (module
# doc); in the study config (`SearchSpace.grid_rule`), so a study that offered every channels value at every depth is
# not resumed with the narrower grid
LANES_RULE = "lanes_used_by_chunks"
# megakernel: tile knobs asked only where the chosen m-tile / core reads them (module doc); in the study config too
MK_TILE_RULE = "tile_knobs_read"
_MK_TILE_KNOBS = ("mk_core", "mk_split_k", "mk_bn", "mk_overlap")
# host_staged with the token count: chunk_tokens offered by the slot rows they give (module doc); constant across
# buckets, so the neighbouring bucket's study (same config) is still found
STAGING_RULE = "distinct_slot_rows"


def expected_rows_per_peer(experts: int, topk: int, ep_size: int, tokens: int, routing: str = "uniform") -> float:
    """The rows one rank sends its busiest destination per dispatch: S x P(token needs that rank)
    (`fabric_model.routing.rank_hits`, what the fabric model's `transfers_per_peer` uses; exact under uniform
    routing, the hottest rank under zipf). At most `tokens`: a token goes once to each rank that needs it."""
    if tokens <= 0:
        return 0.0
    return tokens * float(max(_rank_hits(experts, topk, ep_size, routing)))  # rank_hits caps each probability at 1


def _rank_hits(experts: int, topk: int, ep_size: int, routing: str) -> Any:
    """P(a token needs rank r) for every rank, as the fabric model routes (`fabric_model.routing.rank_hits`)."""
    from moetune.runtime.routing import parse_routing
    from moetune.tuner.fabric_model.routing import rank_hits

    _, zipf_s = parse_routing(routing)
    return rank_hits(max(1, experts), max(1, min(topk, experts)), zipf_s, max(1, ep_size))


def chunk_fits(tokens: int, chunk_tokens: int) -> bool:
    """Whether `chunk_tokens` acts as named on a buffer of max_tokens = `tokens`: a call may send one peer every
    token (`runtime.knobs.chunk_tokens_fit`, the rule the runtime's proxy refuses by)."""
    return chunk_tokens_fit(chunk_tokens, max(1, tokens))


def put_chunking(rows: float, chunk_tokens: int) -> tuple[int, int]:
    """(rows per PUT, PUTs) one peer gets for `rows` rows: csrc/proxy_xchg.h `chunking` as the fabric model
    follows it (`wire_rows.chunking`: chunk_tokens rows per PUT, 0 one PUT, at most MAX_SLOTS PUTs with larger
    chunks then), with at least one PUT, and the rows per PUT of a single PUT being all the rows (so every
    chunk that gives one PUT has the same key as chunk_tokens 0)."""
    from moetune.tuner.fabric_model.wire_rows import chunking

    cnt = max(1, math.ceil(rows - 1e-9))
    c, n = chunking(float(cnt), chunk_tokens)
    return (cnt, 1) if n <= 1 else (c, n)


def groups_puts(transport: str) -> bool:
    """Whether `transport`'s group_size counts PUTs per peer (proxy, ibgda), asked only with chunk_tokens > 0."""
    return transport in QUEUED


def put_group_choices(policy: Policy) -> tuple[int, ...]:
    """proxy/ibgda group sizes with chunk_tokens > 0: per peer (0), then `PUT_GROUP_SIZES` ("put_groups") or
    the policy's explicit sizes (any positive size is valid: a last partial group is sent as is)."""
    if policy.group_size is None:
        return (PER_PE,)
    sizes = PUT_GROUP_SIZES if isinstance(policy.group_size, str) else policy.group_size
    out = [PER_PE]
    for g in sizes:
        if g > 0 and g not in out:
            out.append(g)
    return tuple(out)


def transfers_per_peer(experts: int, ep_size: int) -> int:
    """Transfers one PE sends to one remote PE per dispatch: one per expert that PE holds."""
    return max(1, experts // max(1, ep_size))


def group_choices(policy: Policy, tpp: int) -> tuple[int, ...]:
    """Group sizes for decoupled signalling: per PE (0) first, then proper divisors of `tpp`."""
    divisors = [d for d in range(1, tpp) if tpp % d == 0]
    if policy.group_size is None:
        return (PER_PE,)
    if isinstance(policy.group_size, str):  # "divisors" ("put_groups" is proxy/ibgda's: put_group_choices)
        return (PER_PE, *divisors)
    # An explicit list: keep what applies to this workload (0 always; a size equal to tpp is per PE).
    out = [PER_PE]
    for g in policy.group_size:  # type: ignore[union-attr]
        if g > 0 and g < tpp and tpp % g == 0 and g not in out:
            out.append(g)
    return tuple(out)


@dataclass(frozen=True)
class Infeasible:
    knobs: dict[str, Any]
    reason: str


class SearchSpace:
    """The feasible knob sets of one family for one workload."""

    def __init__(self, policy: Policy, *, experts: int, ep_size: int, link_rates: Mapping[str, float] | None = None,
                 pinned: Collection[str] = (), tokens: int | None = None, topk: int | None = None,
                 routing: str = "uniform", hidden: int | None = None, gpus_per_node: int | None = None,
                 nvlink_apart: bool = False):
        """`pinned`: plain knobs held at the policy default (a backend that cannot tell their values apart,
        e.g. the fabric model, `ModelBackend.pinned_knobs`), so a tie is not stored as a tuned choice.
        `tokens` (tokens per rank, with the model's `topk` and the `routing`): proxy/ibgda offer only the
        chunk_tokens values and group sizes that are distinct runs at that token count (module doc); None
        keeps the fixed set (every chunk_tokens value of the policy, group sizes 0, 2, 4, 8). `hidden` (the model's):
        fp8 scale granularities the runtime refuses on it are not offered (per_128 where 128 does not divide it:
        `num_scale_groups`); None offers every one the policy's error budget allows. `gpus_per_node` (default: the
        whole EP group on one node) and `nvlink_apart` (a modelled fabric whose PEs reach this node's peers over
        NVLink, `phases.queued.nvlink_apart`; default no: every peer through the queue, as the runtime's proxy sends
        them): the peer sets the fabric model charges PUTs apart, so the PUT grid asks its charge as it is priced."""
        self.policy = policy
        self.transport = policy.transport
        self.ep_size = max(1, ep_size)
        self.tpp = transfers_per_peer(experts, ep_size)
        # knobs the runtime does not read for this transport: held at the policy default
        self.ignored = runtime_ignores(policy)
        pinned = set(pinned) | self.ignored
        self.link_rates = dict(link_rates or {})
        d = policy.defaults
        one_sided = self.transport in ONE_SIDED
        self.spec: dict[str, KnobSpec] = {}

        def spec(name: str, values: tuple[Any, ...]) -> None:
            self.spec[name] = KnobSpec(name, choices=tuple(values))

        # signalling and a CTA group size (nvlink) held by the backend too (`pinned`: the fabric model's nvlink signal
        # cost is one round of device writes whatever they are, `predict.KNOBS_READ`); PUT groups (proxy/ibgda) are
        # read wherever they are offered. In the study config (`grid_rule`): a study that asked them is not resumed
        self._pinned_structure = tuple(n for n in ("signalling", "group_size") if n in pinned and one_sided
                                       and not groups_puts(self.transport)
                                       and (len(policy.allowed("signalling")) > 1 if n == "signalling"
                                            else policy.group_size is not None))
        sig = policy.allowed("signalling") if one_sided and "signalling" not in self._pinned_structure \
            else (d.signalling,)
        spec("signalling", sig)
        spec("group_size", group_choices(policy, self.tpp) if "group_size" not in self._pinned_structure
             else (d.group_size,))
        fences = tuple(f for f in policy.allowed("fence_mode") if f in ALLOWED_FENCE_MODES[self.transport])
        spec("fence_mode", fences or (ALLOWED_FENCE_MODES[self.transport][0],))
        queued = self.transport in QUEUED
        spec("qps_per_pe", policy.allowed("qps_per_pe") if queued else (1,))
        spec("qp_mapping", policy.allowed("qp_mapping") if queued else (d.qp_mapping,))
        self.hidden = hidden
        # a granularity the runtime refuses on this hidden left out (grid_rule): its trials could only fail
        self._scales_cut = any(policy.compression_allowed(c, g) and not self._scales_fit(g)
                               for c in policy.allowed("compression") if c != "none"
                               for g in policy.allowed("scale_granularity"))
        comps = tuple(c for c in policy.allowed("compression")
                      if c == "none" or self.granularities(c))
        spec("compression", comps or ("none",))
        for name in _PLAIN:
            s = policy.knobs.get(name) if name not in pinned else None
            self.spec[name] = s if s is not None else KnobSpec(name, choices=(getattr(d, name),))
        # nvlink: group_size counts CTAs, so its choices depend on num_sms (asked first)
        self._nvlink_groups = (self.transport == "nvlink" and policy.group_size is not None
                               and "group_size" not in self._pinned_structure)
        # proxy/ibgda: group_size counts PUTs per peer, asked only when chunk_tokens > 0 (asked first)
        self._put_groups = groups_puts(self.transport)
        if self._put_groups:
            self.spec["group_size"] = KnobSpec("group_size", choices=put_group_choices(policy))
        # the rows a peer gets at the workload's token count (proxy/ibgda with `tokens`): bounds the grid
        self.tokens = tokens
        self.rows_per_peer: float | None = None
        self.gpus_per_node = gpus_per_node if gpus_per_node is not None and gpus_per_node > 0 else self.ep_size
        self.nvlink_apart = nvlink_apart
        self._hits: Any = None  # P(a token needs rank r), the fabric model's (`rank_hits`): its PUT charge's input
        self._put_keys: dict[tuple[int, bool, bool], tuple[int, ...]] = {}
        self._policy_chunks: tuple[int, ...] = tuple(self.spec["chunk_tokens"].values())
        self._over_slots = False  # a policy chunk_tokens left out: more than MAX_SLOTS PUTs at `tokens` (grid_rule)
        if self._put_groups and tokens is not None:
            if topk is None:
                raise ValueError("SearchSpace(tokens=...) needs the model's topk (the rows a peer gets)")
            self.rows_per_peer = expected_rows_per_peer(experts, topk, self.ep_size, tokens, routing)
            self._hits = _rank_hits(experts, topk, self.ep_size, routing)
            fitting = tuple(c for c in self._policy_chunks if chunk_fits(tokens, c))
            self._over_slots = len(fitting) < len(self._policy_chunks)
            kept = self._distinct_chunks(fitting)
            if kept != self._policy_chunks:
                self.spec["chunk_tokens"] = KnobSpec("chunk_tokens", choices=kept)
            groups: list[int] = []
            for c in kept:
                groups += [g for g in self.group_values(chunk_tokens=c) if g not in groups]
            self.spec["group_size"] = KnobSpec("group_size", choices=tuple(groups))
        # host_staged: a slot holds min(chunk_tokens, a pipeline chunk's tokens) rows (module doc)
        self._staged = (self.transport == "host_staged" and tokens is not None and d.engine != "megakernel"
                        and len(self.spec["chunk_tokens"].values()) > 1)
        if self._nvlink_groups:
            self.spec["group_size"] = KnobSpec("group_size", choices=tuple(sorted(
                {g for n in self.spec["num_sms"].values() for g in self.group_values(n)})))
        # collective / host_staged: channels and combine_lanes act only through the pipeline's chunks (module doc)
        self._lanes = (self.transport not in ONE_SIDED and d.engine != "megakernel"
                       and any(len(self.spec[n].values()) > 1 for n in ("channels", "combine_lanes")))
        # megakernel: tile knobs only where the m-tile and core read them (module doc)
        self._mk_tiles = d.engine == "megakernel" and any(len(self.spec[n].values()) > 1 for n in _MK_TILE_KNOBS)

    def _scales_fit(self, granularity: str) -> bool:
        """Whether the runtime takes fp8 scales of `granularity` on this space's hidden (unknown: yes)."""
        if self.hidden is None:
            return True
        try:
            num_scale_groups(self.hidden, granularity)
        except ValueError:
            return False
        return True

    def granularities(self, compression: str) -> tuple[str, ...]:
        """The scale granularities offered with `compression`: within the policy's error budget and taken by the
        runtime on this hidden."""
        return tuple(g for g in self.policy.allowed("scale_granularity")
                     if self.policy.compression_allowed(compression, g) and self._scales_fit(g))

    def group_values(self, num_sms: int | None = None, chunk_tokens: int | None = None) -> tuple[int, ...]:
        """The group sizes offered (with decoupled signalling): per the transfers per PE, or for nvlink per
        the CTAs per peer that `num_sms` gives; proxy/ibgda: per peer only without chunking (chunk_tokens 0,
        one PUT per peer), else `put_group_choices`."""
        if self._nvlink_groups:
            n = num_sms if num_sms is not None else self.policy.defaults.num_sms
            return group_choices(self.policy, nvlink_ctas_per_peer(n, self.ep_size))
        if self._put_groups:
            ck = chunk_tokens if chunk_tokens is not None else self.policy.defaults.chunk_tokens
            if ck <= 0:
                return (PER_PE,)
            if self.rows_per_peer is None:
                return put_group_choices(self.policy)
            # a group of >= the PUTs a peer gets is one signal per peer: per peer (0)
            puts = self.puts_per_peer(ck)
            return tuple(g for g in put_group_choices(self.policy) if g < puts)
        return group_choices(self.policy, self.tpp)

    def channel_values(self, pipeline_depth: int) -> tuple[int, ...]:
        """collective / host_staged: the channels values offered at `pipeline_depth`, one per lane count the chunks
        use (min(channels, pipeline_depth): chunk c goes on lane c mod channels, so lanes past the chunk count carry
        nothing): of the values that use the same count the policy default, else the smallest. Every value where the
        rule does not apply."""
        vals = self.spec["channels"].values()
        if not self._lanes:
            return vals
        return _one_per_run(vals, self.policy.defaults.channels, self._lanes_used(pipeline_depth))

    @staticmethod
    def _lanes_used(pipeline_depth: int) -> Callable[[int], int]:
        """channels -> the lanes the chunks use at `pipeline_depth` (the run a channels value makes)."""
        return lambda channels: min(channels, max(1, pipeline_depth))

    def combine_lane_values(self, pipeline_depth: int) -> tuple[str, ...]:
        """The combine_lanes values offered: every one with pipelined chunks, the policy default alone without (one
        chunk: combine runs on the dispatch lanes whatever the knob says)."""
        if self._lanes and pipeline_depth <= 1:
            return (self.policy.defaults.combine_lanes,)
        return self.spec["combine_lanes"].values()

    def staged_chunk_values(self, pipeline_depth: int) -> tuple[int, ...]:
        """host_staged at the workload's token count: the chunk_tokens values offered at `pipeline_depth`, one per
        slot size (a slot holds min(chunk_tokens, the chunk's tokens) rows, 0: the chunk's tokens): of the values that
        give the same slot the policy default, else the smallest. Every value where the rule does not apply."""
        vals = self.spec["chunk_tokens"].values()
        if not self._staged:
            return vals
        return _one_per_run(vals, self.policy.defaults.chunk_tokens, self._slot_of(pipeline_depth))

    def _slot_rows(self, pipeline_depth: int) -> int:
        """The rows of the largest block host_staged stages at this token count: one pipeline chunk's tokens."""
        from moetune.runtime.buffer.layout_choice import equal_chunk_size

        return equal_chunk_size(max(1, self.tokens or 1), max(1, pipeline_depth))

    def _same_staged_chunk(self, chunk_tokens: int, pipeline_depth: int) -> int | None:
        """The offered chunk_tokens value that gives the same slot as `chunk_tokens` at `pipeline_depth`."""
        return _same_run(chunk_tokens, self.staged_chunk_values(pipeline_depth), self._slot_of(pipeline_depth))

    def _slot_of(self, pipeline_depth: int) -> Callable[[int], int]:
        """chunk_tokens -> the rows of its staging slot at `pipeline_depth` (the run a chunk_tokens value makes)."""
        rows = self._slot_rows(pipeline_depth)
        return lambda c: rows if c <= 0 or c >= rows else c

    def mk_tile_values(self, name: str, knobs: Mapping[str, Any]) -> tuple[Any, ...]:
        """The values of megakernel tile knob `name` offered after mk_bm, mk_stages and mk_core of `knobs`: the policy
        default alone where the tile they choose does not read it (module doc), else every value."""
        vals = self.spec[name].values()
        if not self._mk_tiles:
            return vals
        bm, core, stages = knobs.get("mk_bm", 0), knobs.get("mk_core", "wgmma"), knobs.get("mk_stages", 0)
        ignored = {
            "mk_core": bm == 16,  # the decode tile always runs mma
            "mk_split_k": bm in (64, 128),  # split-K splits the bm=16 tasks only
            # decode tile: 128 columns; mma: never the wide tile; auto is the wide tile only at bm 0/128, <= 4 stages
            "mk_bn": bm in (16, 64) or core == "mma" or stages > 4,
            "mk_overlap": bm == 16 or core == "mma",  # the wgmma tiles' overlap
        }[name]
        return (getattr(self.policy.defaults, name),) if ignored else vals

    # -- PUTs per peer at the workload's token count (proxy/ibgda with `tokens`) -------------------------
    def puts_per_peer(self, chunk_tokens: int) -> int:
        """The most PUTs the fabric model charges one peer with `chunk_tokens` (1 without chunking); needs `tokens`."""
        return max(1, max(self._put_key(chunk_tokens), default=1))

    def _put_key(self, chunk_tokens: int, *, own: bool = True, apart: bool | None = None) -> tuple[int, ...]:
        """What the runtime does with `chunk_tokens` at this token count, as the fabric model charges it: the PUTs
        of each peer in dispatch and combine, and those the rank sends itself (`phases.queued.puts_charged_each_peer`,
        the function `phase_queued` and `model sweep`'s grid use: each set of peers, the queue's and the NVLink ones,
        its own rounded sum of E[chunking(X)], X ~ Binomial(tokens, p), shared out by largest remainder; the own rows
        a set of one). Two chunks with the same key are charged the same PUTs everywhere; a copy of the rule here
        (all peers one set, peers x E rounded) dropped or kept chunks the model prices otherwise. `own` and `apart`
        (default: this space's `nvlink_apart`) give the grids `grid_rule` compares."""
        apart = self.nvlink_apart if apart is None else apart
        key = self._put_keys.get((chunk_tokens, own, apart))
        if key is None:
            from moetune.tuner.fabric_model.phases.queued import puts_charged_each_peer

            assert self._hits is not None and self.tokens is not None
            key = puts_charged_each_peer(self._hits, self.ep_size, self.gpus_per_node, apart, self.tokens,
                                         chunk_tokens, own=own)
            self._put_keys[(chunk_tokens, own, apart)] = key
        return key

    def _distinct_chunks(self, values: tuple[int, ...], *, own: bool = True,
                         apart: bool | None = None) -> tuple[int, ...]:
        """`values` (the policy's order) less those that repeat an earlier value's PUTs; a chunk that gives one
        PUT per peer is the same run as chunk_tokens 0, which is kept when offered."""
        seen = {self._put_key(0, own=own, apart=apart)} if 0 in values else set()
        out: list[int] = []
        for c in values:
            key = self._put_key(c, own=own, apart=apart)
            if c == 0 or key not in seen:
                out.append(c)
                seen.add(key)
        return tuple(out)

    def _put_grid(self, *, own: bool = True, apart: bool | None = None) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The chunk_tokens offered, each with its group sizes, had the PUTs been counted with `own` / `apart`
        (this space's grid with the defaults): what `grid_rule` compares."""
        fitting = tuple(c for c in self._policy_chunks if self.tokens is not None and chunk_fits(self.tokens, c))
        out = []
        for c in self._distinct_chunks(fitting, own=own, apart=apart):
            puts = max(1, max(self._put_key(c, own=own, apart=apart), default=1)) if c > 0 else 1
            out.append((c, tuple(g for g in put_group_choices(self.policy) if g < puts) if c > 0 else (PER_PE,)))
        return tuple(out)

    def _equivalent_chunk(self, chunk_tokens: int) -> int | None:
        """The offered chunk_tokens value that is the same run as `chunk_tokens` here (None: none is); only where
        the space knows its rows per peer."""
        key = self._put_key(chunk_tokens)
        return next((c for c in self.spec["chunk_tokens"].values() if self._put_key(c) == key), None)

    def grid_rule(self) -> dict[str, Any]:
        """What, besides the policy, decides the offered choices (in the study config digest): empty unless
        the PUT grid is bounded by the token count. Constant across token buckets, so the nearest smaller
        bucket's study (`study.neighbour_bucket`, same config) is still found; a study name carries its bucket,
        so one name always offers one grid. Where a policy chunk_tokens is left out for needing more than MAX_SLOTS
        PUTs (`chunk_fits`; no stock policy at any real token count) the config says so: a study that offered it
        (before that rule) is not resumed without it; likewise where an fp8 scale granularity the policy allows is
        left out for the model's hidden (`scales`). The peer sets (`peer_sets`: a preset's NVLink peers apart across
        nodes) are named at every bucket; the own PUTs (`own_puts`) only at a bucket whose grid they change, whose
        neighbour's study may then not be found (its warm start only)."""
        lanes = {"lanes": LANES_RULE} if self._lanes else {"mk_tiles": MK_TILE_RULE} if self._mk_tiles else {}
        if self._pinned_structure:
            lanes["pinned"] = ",".join(self._pinned_structure)
        if self._staged:
            lanes["staging"] = STAGING_RULE
        if self._scales_cut:
            lanes["scales"] = "divide_hidden"
        if self.rows_per_peer is None:
            return lanes
        rule = {"put_grid": PUT_GRID_RULE, **({"chunk_slots": "at_most_max_slots"} if self._over_slots else {})}
        # the same marker named the grid of one set of peers and, from 43a9194e, that of a preset's NVLink set apart
        # (a ModelBackend with a predictor on a preset: the same name and config, one set): where the sets are apart
        # across nodes (the only spaces whose grid they can change) the config says so, at every bucket (the
        # neighbour bucket's study is still found); a one-set space's config is as before
        if self.nvlink_apart and self.gpus_per_node < self.ep_size:
            rule["peer_sets"] = f"nvlink_apart_{self.gpus_per_node}_per_node"
        # the PUTs a rank sends itself: only where they change this bucket's grid (rare: qwen3-30b-like at EP 4 on
        # 2 x 2 GPUs, zipf:1.2, S = 4 keeps chunk_tokens 3 beside 2), so every other study resumes
        if self._put_grid() != self._put_grid(own=False):
            rule["own_puts"] = "charged"
        return {**rule, **lanes}

    # -- the decision tree ---------------------------------------------------------------------------
    def _build(self, choose: Chooser) -> Knobs:
        d = self.policy.defaults
        k: dict[str, Any] = {"transport": self.transport}

        def ask(name: str, values: tuple[Any, ...] | None = None) -> Any:
            s = self.spec[name] if values is None else KnobSpec(name, choices=values)
            vals = s.values()
            if len(vals) == 1:
                return vals[0]
            return choose(name, s)

        if self._put_groups:
            # PUTs per peer: chunk_tokens decides whether there is more than one PUT to group
            k["chunk_tokens"] = ask("chunk_tokens")
        k["signalling"] = ask("signalling")
        if self._put_groups:
            groups = self.group_values(chunk_tokens=k["chunk_tokens"])
            # a bounded set (fewer PUTs per peer than the largest size) is a parameter of its own, named by its
            # largest size (one name, one set of choices, as Optuna requires): the set is every size below the
            # PUTs per peer, so its largest size names it even where the policy lists sizes unsorted (its last
            # would not); a sorted set's name is its last size, as before (stored studies keep resuming)
            full = self.rows_per_peer is None or groups == put_group_choices(self.policy)
            pname = "group_size" if full else f"group_size_max{max(groups)}"
            k["group_size"] = ask(pname, groups) if k["signalling"] == "decoupled" else PER_PE
        elif self._nvlink_groups:
            # CTAs per group: a distinct parameter per CTA count, so each has a fixed set of choices
            k["num_sms"] = ask("num_sms")
            cpp = nvlink_ctas_per_peer(k["num_sms"], self.ep_size)
            groups = self.group_values(k["num_sms"])
            k["group_size"] = (ask(f"group_size_cpp{cpp}", groups) if k["signalling"] == "decoupled"
                               else PER_PE)
        else:
            k["group_size"] = ask("group_size") if k["signalling"] == "decoupled" else PER_PE
        k["fence_mode"] = ask("fence_mode")
        k["qps_per_pe"] = ask("qps_per_pe")
        if k["qps_per_pe"] == 1:
            # One QP: mapping makes no difference; keep the policy default (valid with any fence mode).
            k["qp_mapping"] = d.qp_mapping
        elif k["fence_mode"] == "nic_ordered":
            k["qp_mapping"] = "peer_hash"  # the only safe mapping: never ask
        else:
            k["qp_mapping"] = ask("qp_mapping")
        k["compression"] = ask("compression")
        if k["compression"] == "none":
            k["scale_granularity"] = "per_token"
        else:
            # Same choices for every compression value that can reach here (one compression today).
            k["scale_granularity"] = ask("scale_granularity", self.granularities(k["compression"]))
        if self._staged:
            # the slot a chunk_tokens value gives depends on a pipeline chunk's tokens: the depth first
            k["pipeline_depth"] = ask("pipeline_depth")
            chunks = self.staged_chunk_values(k["pipeline_depth"])
            k["chunk_tokens"] = ask(_subset_param("chunk_tokens", chunks, self.spec["chunk_tokens"].values()), chunks)
        for name in _PLAIN:
            if name in k:
                continue
            if self._lanes and name == "channels":
                # lanes the chunks use: a parameter per set of choices (`_subset_param`)
                chans = self.channel_values(k["pipeline_depth"])
                k[name] = ask(_subset_param(name, chans, self.spec[name].values()), chans)
            elif self._lanes and name == "combine_lanes":
                k[name] = ask(name, self.combine_lane_values(k["pipeline_depth"]))
            elif self._mk_tiles and name in _MK_TILE_KNOBS:
                k[name] = ask(name, self.mk_tile_values(name, k))
            else:
                k[name] = ask(name)
        return Knobs.from_dict(k)

    # -- Optuna ----------------------------------------------------------------------------------------
    def suggest(self, trial: Any) -> Knobs:
        """Ask `trial` (an optuna.Trial) for one feasible knob set."""

        def choose(name: str, s: KnobSpec) -> Any:
            if s.is_range:
                return trial.suggest_int(name, s.low, s.high, step=s.step)
            return trial.suggest_categorical(name, list(s.choices))

        return self._build(choose)

    def params_of(self, knobs: Knobs) -> dict[str, Any]:
        """The Optuna parameters that produce `knobs` (for enqueue_trial). Raises KnobError if it can't."""
        self.check(knobs)
        params: dict[str, Any] = {}
        target = knobs.to_dict()

        def choose(name: str, s: KnobSpec) -> Any:
            v = target[_knob_of_param(name)]
            if not s.contains(v):
                raise KnobError(f"{v!r} is not in this search space ({list(s.values())})", (name,))
            params[name] = v
            return v

        got = self._build(choose)
        if got != knobs:
            diff = sorted(n for n, v in got.to_dict().items() if target[n] != v)
            raise KnobError("the knob set is outside the search space's structure", tuple(diff))
        return params

    def knobs_from_params(self, params: Mapping[str, Any]) -> Knobs:
        """Rebuild the knob set of a finished trial from its parameters."""
        return self._build(lambda name, s: params[name])

    # -- grid ------------------------------------------------------------------------------------------
    def enumerate(self) -> Iterator[Knobs]:
        """Every point of the space (depth-first over the same decision tree as `suggest`)."""
        stack: list[list[int]] = [[]]
        while stack:
            prefix = stack.pop()
            taken: list[int] = []

            def choose(name: str, s: KnobSpec, prefix: list[int] = prefix, taken: list[int] = taken) -> Any:
                vals = s.values()
                depth = len(taken)
                if depth < len(prefix):
                    idx = prefix[depth]
                else:
                    idx = 0
                    for j in range(len(vals) - 1, 0, -1):
                        stack.append([*taken, j])
                taken.append(idx)
                return vals[idx]

            yield self._build(choose)

    def size(self) -> int:
        return sum(1 for _ in self.enumerate())

    # -- constraints -------------------------------------------------------------------------------------
    def check(self, knobs: Knobs) -> None:
        """Raise KnobError when `knobs` may not be benchmarked under this policy and workload."""
        p = self.policy
        if knobs.transport != self.transport:
            raise KnobError(f"transport {knobs.transport!r} is not this family's ({self.transport!r})", ("transport",))
        if not (self._nvlink_groups or self._put_groups):  # CTA / PUT groups: checked below
            knobs.check_workload(self.tpp)
        if knobs.compression != "none" and not p.compression_allowed(knobs.compression, knobs.scale_granularity):
            raise KnobError(
                f"{knobs.compression}/{knobs.scale_granularity} has an error bound of "
                f"{p.compression_error(knobs.compression, knobs.scale_granularity):g}, over the policy's budget of "
                f"{p.error_budget:g}", ("compression", "scale_granularity"))
        if knobs.compression != "none" and not self._scales_fit(knobs.scale_granularity):
            raise KnobError(f"scale_granularity {knobs.scale_granularity} on hidden {self.hidden}: 128 does not divide "
                            "it (the runtime's EP buffer refuses it); offered: "
                            f"{list(self.granularities(knobs.compression))}", ("scale_granularity",))
        if self.rows_per_peer is not None and self.tokens is not None and not chunk_fits(self.tokens, knobs.chunk_tokens):
            raise KnobError(f"chunk_tokens {knobs.chunk_tokens} at {self.tokens} tokens per rank: up to "
                            f"{-(-self.tokens // knobs.chunk_tokens)} PUTs per peer, more than the {MAX_SLOTS} signal "
                            f"slots (the kernel would cut larger chunks; the runtime refuses it); offered: "
                            f"{list(self.spec['chunk_tokens'].values())}", ("chunk_tokens",))
        if self.rows_per_peer is not None and not self.spec["chunk_tokens"].contains(knobs.chunk_tokens) \
                and knobs.chunk_tokens in self._policy_chunks:
            same = self._equivalent_chunk(knobs.chunk_tokens)
            key = self._put_key(knobs.chunk_tokens)
            all_puts = sum(key[:self.ep_size - 1])  # dispatch's peers (then combine's)
            raise KnobError(f"chunk_tokens {knobs.chunk_tokens} at {self.tokens} tokens per rank (~{self.rows_per_peer:.1f} "
                            f"rows per peer): at most ~{max(key, default=1)} PUT(s) per peer that gets rows, ~{all_puts} "
                            f"to all peers, the same run as chunk_tokens {same}; offered: "
                            f"{list(self.spec['chunk_tokens'].values())}", ("chunk_tokens",))
        for name, s in self.spec.items():
            if name in ("group_size", "qp_mapping", "scale_granularity"):
                continue
            v = getattr(knobs, name)
            if not s.contains(v):
                raise KnobError(f"{v!r} is not allowed by the {p.family} policy ({list(s.values())})", (name,))
        if self._staged and knobs.chunk_tokens not in self.staged_chunk_values(knobs.pipeline_depth):
            raise KnobError(f"chunk_tokens {knobs.chunk_tokens} at {self.tokens} tokens per rank and pipeline_depth "
                            f"{knobs.pipeline_depth}: a staging slot of "
                            f"{min(knobs.chunk_tokens or self._slot_rows(knobs.pipeline_depth), self._slot_rows(knobs.pipeline_depth))} "
                            f"rows, the same run as chunk_tokens "
                            f"{self._same_staged_chunk(knobs.chunk_tokens, knobs.pipeline_depth)}; offered: "
                            f"{list(self.staged_chunk_values(knobs.pipeline_depth))}", ("chunk_tokens", "pipeline_depth"))
        if self._lanes and knobs.channels not in self.channel_values(knobs.pipeline_depth):
            raise KnobError(f"channels {knobs.channels} at pipeline_depth {knobs.pipeline_depth}: the chunks use "
                            f"{min(knobs.channels, knobs.pipeline_depth)} lane(s), the same run as channels "
                            f"{self._same_channels(knobs.channels, knobs.pipeline_depth)}; offered: "
                            f"{list(self.channel_values(knobs.pipeline_depth))}", ("channels", "pipeline_depth"))
        if self._lanes and knobs.combine_lanes not in self.combine_lane_values(knobs.pipeline_depth):
            raise KnobError(f"combine_lanes {knobs.combine_lanes} at pipeline_depth {knobs.pipeline_depth}: one chunk, "
                            "combine runs on the dispatch lanes whatever the knob says; only the policy default "
                            f"({self.policy.defaults.combine_lanes}) is offered", ("combine_lanes", "pipeline_depth"))
        if self._mk_tiles:
            for name in _MK_TILE_KNOBS:
                if getattr(knobs, name) not in self.mk_tile_values(name, knobs.to_dict()):
                    raise KnobError(f"{name} {getattr(knobs, name)!r} with mk_bm {knobs.mk_bm}, mk_core {knobs.mk_core}, "
                                    f"mk_stages {knobs.mk_stages}: the tile they choose does not read it, the same run "
                                    f"as the policy default ({getattr(self.policy.defaults, name)!r})",
                                    (name, "mk_bm", "mk_core"))
        if knobs.signalling == "decoupled" and knobs.group_size not in self.group_values(knobs.num_sms,
                                                                                          knobs.chunk_tokens):
            if self._put_groups:
                if knobs.chunk_tokens <= 0:
                    raise KnobError(f"group size {knobs.group_size} with chunk_tokens 0: one PUT per peer, every group "
                                    "size is the same run; only per peer (0) is offered", ("group_size",))
                if self.rows_per_peer is not None and knobs.group_size >= self.puts_per_peer(knobs.chunk_tokens):
                    raise KnobError(f"group size {knobs.group_size} with chunk_tokens {knobs.chunk_tokens} at {self.tokens} "
                                    f"tokens per rank: at most {self.puts_per_peer(knobs.chunk_tokens)} PUT(s) per peer, one "
                                    f"signal per peer like per peer (0); offered: "
                                    f"{list(self.group_values(chunk_tokens=knobs.chunk_tokens))}", ("group_size",))
                raise KnobError(f"group size {knobs.group_size} is not offered for PUT groups "
                                f"({list(self.group_values(chunk_tokens=knobs.chunk_tokens))})", ("group_size",))
            if self._nvlink_groups:
                cpp = nvlink_ctas_per_peer(knobs.num_sms, self.ep_size)
                raise KnobError(f"group size {knobs.group_size} is not offered for {cpp} CTAs per peer "
                                f"(num_sms {knobs.num_sms} over {self.ep_size} ranks)", ("group_size",))
            raise KnobError(f"group size {knobs.group_size} is not offered for {self.tpp} transfers per PE", ("group_size",))

    def _same_channels(self, channels: int, pipeline_depth: int) -> int | None:
        """The offered channels value that uses as many lanes as `channels` at `pipeline_depth` (None: none does)."""
        return _same_run(channels, self.channel_values(pipeline_depth), self._lanes_used(pipeline_depth))

    def feasible(self, knobs: Knobs) -> tuple[bool, str]:
        try:
            self.check(knobs)
        except KnobError as e:
            return False, str(e)
        return True, ""

    # -- warm start ------------------------------------------------------------------------------------
    def project(self, knobs: Knobs) -> Knobs:
        """The nearest point of the space to `knobs` (each knob snapped to its allowed values)."""
        target = knobs.to_dict()
        chosen: dict[str, Any] = {}

        def choose(name: str, s: KnobSpec) -> Any:
            knob = _knob_of_param(name)
            v = target.get(knob)
            if knob == "chunk_tokens" and self._staged and isinstance(v, int) and not s.contains(v):
                same = self._same_staged_chunk(v, chosen.get("pipeline_depth", self.spec["pipeline_depth"].values()[0]))
                v = same if same is not None else v
            if knob == "channels" and self._lanes and isinstance(v, int) and not s.contains(v):
                depth = chosen.get("pipeline_depth", self.spec["pipeline_depth"].values()[0])  # not asked: one value
                same = self._same_channels(v, depth)  # as many lanes used: the same run
                v = same if same is not None else v
            if self.rows_per_peer is not None and isinstance(v, int):
                # proxy/ibgda at a known token count (a set from another bucket): the same run first, then nearest
                if knob == "chunk_tokens" and not s.contains(v):
                    same = self._equivalent_chunk(v)
                    if same is not None:
                        v = same
                elif knob == "group_size" and v >= self.puts_per_peer(
                        chosen.get("chunk_tokens", self.spec["chunk_tokens"].values()[0])):  # not asked: one value
                    v = PER_PE  # a group of >= the PUTs per peer: one signal per peer
            out = s.nearest(v)
            chosen[knob] = out
            return out

        return self._build(choose)

    def priors(self) -> list[tuple[str, Knobs]]:
        """Warm-start points: the policy default, then analytic priors (per-PE groups; SM and QP counts
        from link bandwidth, DeepEP-style), each projected into the space, duplicates dropped."""
        p = self.policy
        pr = p.priors
        eff = pr.get("link_efficiency", 0.9)
        link = self.link_rates.get("link_gbps", pr.get("link_gbps"))
        sms = math.ceil(link * eff / pr.get("sm_copy_gbps", 20.0)) if link else p.defaults.num_sms
        nic_gbit = self.link_rates.get("nic_gbit", pr.get("nic_gbit"))
        qps = math.ceil(nic_gbit / 8 * eff / pr.get("qp_gbps", 12.5)) if nic_gbit else p.defaults.qps_per_pe
        base = p.defaults.to_dict()
        fences = self.spec["fence_mode"].values()
        fence = "nic_ordered" if "nic_ordered" in fences else base["fence_mode"]
        analytic = dict(base, signalling="decoupled" if "decoupled" in self.spec["signalling"].values() else base["signalling"],
                        group_size=PER_PE, fence_mode=fence, qp_mapping="peer_hash", num_sms=sms, qps_per_pe=qps)
        points: list[tuple[str, dict[str, Any]]] = [("policy_default", base), ("prior:per_pe", analytic)]
        if "fp8_e4m3" in self.spec["compression"].values():
            grans = self.granularities("fp8_e4m3")
            points.append(("prior:per_pe+fp8", dict(analytic, compression="fp8_e4m3", scale_granularity=grans[-1])))
        depths = self.spec["pipeline_depth"].values()
        if len(depths) > 1:
            chunks = [c for c in self.spec["chunk_tokens"].values() if c > 0]
            pipelined = dict(analytic, pipeline_depth=2 if 2 in depths else depths[1])
            if chunks:
                pipelined["chunk_tokens"] = chunks[0]
            if "fp8_e4m3" in self.spec["compression"].values():
                pipelined.update(compression=points[-1][1]["compression"], scale_granularity=points[-1][1]["scale_granularity"])
            points.append(("prior:pipelined", pipelined))
        out: list[tuple[str, Knobs]] = []
        seen: set[Knobs] = set()
        for name, raw in points:
            try:
                kn = self.project(_lenient_knobs(raw))
            except KnobError:
                continue
            if kn not in seen and self.feasible(kn)[0]:
                seen.add(kn)
                out.append((name, kn))
        return out


def _one_per_run(values: tuple[int, ...], default: int, run: Callable[[int], int]) -> tuple[int, ...]:
    """`values` (their order) with one value per run (`run`: value -> what the runtime does with it): of the values
    that make the same run the policy `default`, else the smallest."""
    keep: dict[int, int] = {}
    for v in sorted(values, key=lambda v: (v != default, v)):
        keep.setdefault(run(v), v)
    chosen = set(keep.values())
    return tuple(v for v in values if v in chosen)


def _same_run(value: int, offered: tuple[int, ...], run: Callable[[int], int]) -> int | None:
    """The `offered` value that makes the same run as `value` (None: none does)."""
    return next((v for v in offered if run(v) == run(value)), None)


def _subset_param(knob: str, values: tuple[Any, ...], full: tuple[Any, ...]) -> str:
    """The Optuna parameter of `knob` offering `values`: the knob's name with all of `full`, else one name per set
    (`channels_of_1_4`), as Optuna requires one set of choices per name."""
    return knob if values == full else f"{knob}_of_{'_'.join(map(str, values))}"


def _knob_of_param(name: str) -> str:
    """The knob an Optuna parameter sets (nvlink's `group_size_cpp<N>` and a bounded PUT group set's
    `group_size_max<N>` set group_size; `<knob>_of_<values>` sets that knob: `_subset_param`)."""
    for knob in ("channels", "chunk_tokens"):
        if name.startswith(f"{knob}_of_"):
            return knob
    return "group_size" if name.startswith(("group_size_cpp", "group_size_max")) else name


def _lenient_knobs(raw: dict[str, Any]) -> Knobs:
    """A Knobs from a raw dict, dropping combinations projection will fix anyway."""
    raw = dict(raw)
    if raw.get("signalling") == "coupled":
        raw["group_size"] = PER_PE
    if raw.get("transport") not in QUEUED:
        raw["qps_per_pe"] = 1
    for name, fallback in (("qps_per_pe", 1), ("num_sms", 24)):  # clamped into the knob's range (KNOB_VALUES)
        v = KNOB_VALUES[name]
        raw[name] = max(v.low, min(v.high, int(raw.get(name, fallback))))
    if raw.get("compression") == "none":
        raw["scale_granularity"] = "per_token"
    if raw.get("fence_mode") == "nic_ordered" and raw.get("qps_per_pe", 1) > 1:
        raw["qp_mapping"] = "peer_hash"
    return Knobs.from_dict(raw)


def sample_infeasible_free(space: SearchSpace, n: int, seed: int = 0) -> list[Knobs]:
    """n random points drawn through the decision tree (used by tests and the CLI's dry run)."""
    import random

    rng = random.Random(seed)
    return [space._build(lambda name, s: rng.choice(s.values())) for _ in range(n)]
