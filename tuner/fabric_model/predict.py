"""The fabric model: predicted (MODELLED) cost of one EP dispatch and combine on a fabric.

Nothing here is a curve fit of end results; the model carries the mechanisms (docs/fabric-model.md,
"Mechanisms"):

* queued transports (`proxy`, `ibgda`): one representative source PE's requests are replayed in FIFO
  order. A CPU proxy drains its FIFO with one thread (a per-request issue cost); IBGDA posts from GPU
  CTAs instead (SM time, which competes with compute). Each request lands on a queue pair (QP mapping
  `peer_hash`: a group's PUTs and its signals share one QP; `round_robin`: requests rotate over the
  peer's QPs). A QP is an in-order pipeline (per-message overhead + per-byte cost); all QPs share the
  NIC link (per-byte cost). A message completes (ack back) one round trip after it left the wire; the
  round trip of each destination is the median plus a deterministic, seeded quantile of an exponential
  tail, so the slowest destination sets a drain's cost.
* fences: `proxy_drain` stops the proxy until everything earlier on its channel completed (NVSHMEM:
  libfabric fence = quiet; IBRC fence = quiet once a device has more than one RC QP), then the proxy
  walks every PE once (per-PE cost); `nic_ordered` only flags the next signal, which the NIC holds
  until the earlier requests on its own QP completed (a NIC stall; the proxy never waits).
* signals are extra small messages: coupled, PUT, FENCE, SIGNAL per transfer; decoupled, a group's PUTs,
  one FENCE, then one SIGNAL (the runtime's layout) or the group's signals, one per PUT (`expert_tiles`).
* intra-node peers go over NVLink (no proxy: launch latency + bytes / bandwidth, signals as device
  writes) when the preset has NVLink; `host_staged` crosses PCIe twice (device→host, host→device) in
  chunks with double buffering (the pieces overlap at any pipeline_depth) and duplex links; `collective` is an NCCL all-to-all.

What goes on the wire follows the runtime's layouts (runtime/buffer/facade.py): every transport sends a
token ONCE PER DESTINATION RANK that holds one of its k experts (packed layout for collective and
host_staged, runtime/buffer/_packed.py; device-resident layout for nvlink and proxy, _resident.py), as a
wire row of payload + k int64 ids + k fp32 weights (+ fp32 scales with fp8), padded to 16 bytes; combine
sends one activation-dtype row back per row received. The expected rows one source sends PE r is
S x P(token needs r) (`routing.rank_hits`: exact hypergeometric under uniform routing). Per peer:
* nvlink: one kernel, `num_sms / world` CTAs per destination (csrc/ep_nvlink.cu mt_nvl_ctas_per_peer),
  each one transfer with its own signal slot; coupled: a system fence per CTA, decoupled: one per group
  of group_size CTAs (0: all of a peer's).
* proxy: the runtime packs the rows for every peer first (one pack kernel, csrc/ep_pack.cu: a grid over
  every SM, so HBM-bound; combine sends the expert output as it is), then its single producer thread
  posts per peer ONE PUT, or ceil(rows / chunk_tokens) PUTs of chunk_tokens rows, the last one partial
  (csrc/proxy_xchg.h produce_exchange; at most MT_MAX_SLOTS = 1024 per peer: a chunk_tokens giving more for S rows
  is refused, as the runtime refuses it); coupled:
  a signal (and fence) per PUT, decoupled: one per group_size PUTs (0: one per peer; a last partial group
  is allowed, so any group size is valid). The model replays these requests on the queue above; intra-node
  peers go over NVLink (same rows, same signal count) unless the preset's proxy serves them.
  Around the data, as the runtime does: dispatch's exchange_counts kernel (one word per rank, waits for every
  rank's word; queued behind the pack kernel); the proxy's calls are host-completed (csrc/proxy_gpu.cu
  host_wait_done): the host spins on each kernel's completion word (`proxy.poll_us`, phases host_wait_counts /
  host_wait_exchange) before it launches the exchange kernel or whatever follows; every exchange's count-matrix row first (world x world 8-byte writes, each posted like a
  signal: proxy.signal_us, nic.signal_overhead_us, landing half a round trip later), the PUTs to rank d
  waiting for d's first word and the lower ranks' column d (`_CountWords`); the PUTs to its own rank (put_us
  each, a local copy at HBM/2, their signals drained/flagged like a peer's: counted in `fences`); after
  combine, the reduce kernel (`_reduce_us`: every returned row read, every token written, at HBM speed).
  Count words to other ranks are in `bytes_on_wire`; the self copy is not (no wire).
* ibgda (no runtime transport): the same per-rank layout and request sequence, posted from GPU CTAs (the
  CTAs take the destinations' runs of PUTs in turn); the posting time is SM time taken from compute.
* `predict(..., layout="expert_tiles")` (proxy, ibgda): one bare copy per (token, expert) in tiles of
  `tile` tokens per expert, each tile a signalled PUT (decoupled: the group's signals, one per PUT), what
  the tile-based EP kernels Perseus (Oh & Singh, arXiv 2605.00686) measured send and a megakernel spanning
  GPUs (FlashDMoE, arXiv 2506.04667) would put across nodes; no moetune transport sends it. The Perseus
  reproductions use it.
* nvlink also: the count words stored in the same launch (one NVLink latency before the rows move), this
  PE's own rows copied by its own slot's CTAs, the reduce after combine. collective / host_staged run the
  packed or the dense layout as the runtime's rule picks it (`Workload.dense`). Dense (runtime/buffer/_dense.py):
  every capacity slot (S rows) to every rank whatever the routing, an all-gather in dispatch, a reduce-scatter
  in combine (summed inside the collective; host_staged's copy-engine path sums the world blocks afterwards in
  torch passes, `_staged_sums_us`; the part past its copies, `reduce_exposed`); no
  counts, no sync. Both write the S token rows into the stage first (`_stage_us`). Packed: the send rows built by
  a gather padded to S x world rows before the counts (`_send_rows_us`), then ONE counts exchange per dispatch call (an NCCL all_to_all_single for both; its block to each rank
  carries every pipeline chunk's counts), then the host sync that reads them (`.tolist()`: phase
  `host_sync`, pcie.memcpy_us) before any payload is posted; the own rows copied locally beside the
  exchange, the reduce (index_add) after combine; combine has no counts and no sync.
* collective: one payload call per pipeline chunk (`payload_calls`: pipeline_depth chunks of ceil(S / depth)
  tokens or slots), chunk c on communicator c mod channels; one communicator's calls in order, different ones
  side by side on shared links (`_payload_floor`: MODELLED, assumed; the PCIe links and host memory on the staged
  path, one call's calibrated rate on direct NVLink as measured there). `predict(..., layout="nccl_k_copies")` instead
  describes a plain NCCL all_to_all_single of k copies of each H-wide token (the NCCL baseline,
  bench/results/2026-11-30_h200x2_nccl_baseline.jsonl, and the calibration rows): what those measurements
  moved, not what the runtime sends.
* fp8 halves payload bytes and adds scale bytes (per token: 4 B; per 128 channels: H/128 × 4 B).

Every number this module returns is modelled (`Prediction.modelled` is always True).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
import numpy as np

from moetune.runtime.buffer.layout_choice import MAX_COMM_CHANNELS, equal_chunk_bounds, picks_dense
from moetune.runtime.knobs import MAX_SLOTS, KnobError, Knobs, chunk_tokens_fit, num_scale_groups
from moetune.runtime.routing import parse_routing
from moetune.runtime.shapes import DTYPES, ModelShape, get_model, tokens_per_gpu_problem
from moetune.tuner.fabric_model.presets import Preset, PresetError, list_presets, load_preset
from moetune.tuner.fabric_model.queue import run_queue
from moetune.tuner.fabric_model.routing import pe_loads, rank_hits, spread_quantiles

__all__ = [
    "KNOBS_READ",
    "Prediction",
    "Preset",
    "PresetError",
    "TransferPrediction",
    "Workload",
    "calibrated_tokens",
    "calibrated_world",
    "chunking",
    "forced_fit_warning",
    "list_presets",
    "load_preset",
    "payload_calls",
    "predict",
    "predict_transfers",
]

SIGNAL_BYTES = 8
MAX_MESSAGES = 2_000_000  # guard against absurd chunking
# MAX_COMM_CHANNELS (communicators per direction a pipelined payload is spread over) and the equal-chunk rule come
# from runtime/buffer/layout_choice.py, the torch-free module the EP buffer takes them from too
LAYOUTS = ("runtime", "nccl_k_copies", "expert_tiles")

# The knobs `predict` reads, per transport (compression and scale_granularity set the dispatch's bytes on
# every transport). Any other knob leaves the prediction unchanged: a search on the model must keep it at
# its policy default instead of storing whichever value it happened to try first.
_PAYLOAD = frozenset({"transport", "compression", "scale_granularity"})
_QUEUED_READ = _PAYLOAD | {"signalling", "group_size", "fence_mode", "qp_mapping", "qps_per_pe", "chunk_tokens",
                           "num_sms"}
KNOBS_READ: dict[str, frozenset[str]] = {
    "proxy": _QUEUED_READ,
    "ibgda": _QUEUED_READ,
    # nvlink: signalling and group_size set the fences per peer (`_nvlink_signals`), but at most (world - 1) x CTAs per
    # peer < num_sms groups signal, spread over num_sms CTAs: one round of signals (`_nvlink_time`) whatever they are,
    # so no prediction changes with them (`model sweep --over group_size` says so); a model search asked them and
    # stored a tie's first value (decoupled, group_size 2) as the tuned MODELLED choice
    "nvlink": _PAYLOAD | {"num_sms"},
    "collective": _PAYLOAD | {"pipeline_depth", "channels"},
    # the copy engines move host_staged's bytes: no kernel of it reads num_sms (runtime/transports/host_staged.py)
    "host_staged": _PAYLOAD | {"chunk_tokens", "pipeline_depth"},
}


class Workload(msgspec.Struct, frozen=True):
    """One EP layer's workload. `model` may be a ModelShape or a name/`custom:H,I,E,K` spec."""

    model: ModelShape
    tokens_per_gpu: int
    nodes: int
    gpus_per_node: int
    routing: str = "uniform"
    # tokens per tile: the expert GEMMs' row padding, and the PUT size of layout `expert_tiles`
    tile: int = 128
    # False: GPUs of a node may not talk peer-to-peer (NCCL_P2P_DISABLE=1): intra-node traffic is staged.
    p2p: bool = True
    # The collective transports' wire layout, as EPBuffer(dense=...): None takes the runtime's own rule
    # (runtime/buffer/layout_choice.py `picks_dense`, what the tuner measures), False the packed layout, True the
    # dense one (every capacity slot, S rows, to every rank).
    dense: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            msgspec.structs.force_setattr(self, "model", get_model(self.model))
        if not isinstance(self.model, ModelShape):
            raise ValueError(f"model must be a ModelShape or a model name, got {type(self.model).__name__}")
        for name in ("tokens_per_gpu", "nodes", "gpus_per_node", "tile"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        problem = tokens_per_gpu_problem(self.tokens_per_gpu)  # the rule `query --tokens` shares
        if problem:
            raise ValueError(f"tokens_per_gpu {problem}")
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.tile < 1:
            raise ValueError(f"tile must be >= 1, got {self.tile}")
        try:
            self.model.check_ep(self.nodes * self.gpus_per_node)  # the runtime's one rule (runtime/shapes.py)
        except ValueError as e:
            raise ValueError(f"{e} ({self.nodes} nodes x {self.gpus_per_node} GPUs)") from None
        parse_routing(self.routing)

    @property
    def pes(self) -> int:
        return self.nodes * self.gpus_per_node


class Prediction(msgspec.Struct, kw_only=True):
    """A MODELLED prediction for one dispatch + combine of one EP layer, per GPU (PE)."""

    latency_us: float
    dispatch_us: float
    combine_us: float
    fences: int
    proxy_stalls: int
    nic_stalls: int
    bytes_on_wire: float
    transfers: int
    phases: dict[str, float]
    modelled: bool = True
    layer_us: float = 0.0  # dispatch + expert compute (modelled) + combine
    expert_us: float = 0.0
    preset: str = ""
    transport: str = ""
    notes: list[str] = msgspec.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class TransferPrediction(msgspec.Struct, kw_only=True):
    """MODELLED microbenchmark: N concurrent transfers of one size from one PE (Perseus-style)."""

    time_us: float
    put_only_us: float
    throughput_gbps: float
    put_only_gbps: float
    relative_throughput: float
    fence_time_us: float
    fence_share: float
    fences: int
    proxy_stalls: int
    nic_stalls: int
    modelled: bool = True

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


# ---------------------------------------------------------------------------------------------------
# parameters, flattened for speed
# ---------------------------------------------------------------------------------------------------
class _P:
    __slots__ = tuple(
        ["name", "sms", "tflops", "eff", "hbm", "sm_copy", "launch", "has_nvl", "nvl_egress", "nvl_peer", "nvl_lat", "nvl_sig", "d2h", "h2d", "memcpy", "host_mem", "duplex", "c_alpha", "c_sync", "c_peer", "c_intra", "c_nic_eff", "c_host_alpha", "c_host_chunk", "has_nic", "nic_bw", "qp_bw", "msg_o", "sig_o", "rtt", "tail", "shared_qps", "has_proxy", "put_us", "sig_us", "flag_us", "fence_us", "fence_pe_us", "poll_us", "fence_quiet", "proxy_intra", "has_ibgda", "post_sm_us", "wqe_fetch_us"]
    )


_PCACHE: dict[int, tuple[Preset, _P]] = {}


def _params(preset: Preset) -> _P:
    hit = _PCACHE.get(id(preset))
    if hit is not None and hit[0] is preset:
        return hit[1]
    g = preset.get
    p = _P()
    p.name = preset.name
    p.sms, p.tflops, p.eff = g("gpu.sms"), g("gpu.tflops_bf16"), g("gpu.gemm_efficiency")
    p.hbm, p.sm_copy, p.launch = g("gpu.hbm_gbps") * 1e3, g("gpu.sm_copy_gbps") * 1e3, g("gpu.launch_us")
    p.has_nvl = preset.has("nvlink")
    if p.has_nvl:
        p.nvl_egress, p.nvl_peer = g("nvlink.egress_gbps") * 1e3, g("nvlink.peer_gbps") * 1e3
        p.nvl_lat, p.nvl_sig = g("nvlink.latency_us"), g("nvlink.signal_us")
    p.d2h, p.h2d = g("pcie.d2h_gbps") * 1e3, g("pcie.h2d_gbps") * 1e3
    p.memcpy, p.host_mem, p.duplex = g("pcie.memcpy_us"), g("pcie.host_mem_gbps") * 1e3, bool(g("pcie.duplex"))
    p.c_alpha, p.c_peer = g("collective.alpha_us"), g("collective.per_peer_us")
    p.c_sync = g("collective.sync_us")
    p.c_intra, p.c_nic_eff = g("collective.intra_gbps") * 1e3, g("collective.nic_efficiency")
    p.c_host_alpha, p.c_host_chunk = g("collective.host_alpha_us"), g("collective.host_chunk_kb") * 1024.0
    p.has_nic = preset.has("nic")
    if p.has_nic:
        p.nic_bw, p.qp_bw = g("nic.gbps") * 1e3, g("nic.qp_gbps") * 1e3
        p.msg_o, p.sig_o = g("nic.msg_overhead_us"), g("nic.signal_overhead_us")
        p.rtt, p.tail, p.shared_qps = g("nic.rtt_us"), g("nic.tail_us"), int(g("nic.shared_qps"))
    p.has_proxy = preset.has("proxy")
    if p.has_proxy:
        p.put_us, p.sig_us, p.flag_us = g("proxy.put_us"), g("proxy.signal_us"), g("proxy.fence_flag_us")
        p.fence_us, p.fence_pe_us, p.poll_us = g("proxy.fence_us"), g("proxy.fence_per_pe_us"), g("proxy.poll_us")
        p.fence_quiet, p.proxy_intra = g("proxy.fence_quiet"), bool(g("proxy.serves_intra_node"))
    p.has_ibgda = preset.has("ibgda")
    if p.has_ibgda:
        p.post_sm_us, p.wqe_fetch_us = g("ibgda.post_sm_us"), g("ibgda.wqe_fetch_us")
    if len(_PCACHE) > 256:  # calibration builds many short-lived presets
        _PCACHE.clear()
    _PCACHE[id(preset)] = (preset, p)
    return p


def _as_preset(preset: Preset | str) -> Preset:
    return preset if isinstance(preset, Preset) else load_preset(preset)


def forced_fit_warning(preset: object) -> str:
    """The `[calibration] warning` of a fit the calibration checks refused and `moetune model calibrate --force`
    wrote anyway ('' for an accepted calibration or a shipped preset)."""
    calib = getattr(preset, "calibration", None)
    warning = calib.get("warning") if isinstance(calib, Mapping) else None
    return str(warning) if warning else ""


def calibrated_world(preset: object) -> int | None:
    """The most ranks (GPUs, or gloo host processes) a row of the preset's calibration measured together
    (`[calibration] world`); None where the preset records no measured scale (a datasheet preset, a calibration of
    rows that state no world, a file written by an older moetune)."""
    calib = getattr(preset, "calibration", None)
    world = calib.get("world") if isinstance(calib, Mapping) else None
    return world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else None


def calibrated_tokens(preset: object) -> tuple[int, int] | None:
    """(least, most) tokens per GPU the rows of the preset's calibration measured (`[calibration] tokens`); None where
    the preset records no range (a datasheet preset, a calibration of rows that state no S, an older moetune's file)."""
    calib = getattr(preset, "calibration", None)
    tokens = calib.get("tokens") if isinstance(calib, Mapping) else None
    if (isinstance(tokens, list | tuple) and len(tokens) == 2
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tokens)):
        return int(tokens[0]), int(tokens[1])
    return None


# ---------------------------------------------------------------------------------------------------
# the queued (proxy / IBGDA) mechanism: one source PE's requests replayed in FIFO order
# ---------------------------------------------------------------------------------------------------
def _rtts(p: _P, n: int) -> list[float]:
    q = spread_quantiles(n)
    return [p.rtt + p.tail * x for x in q]


# ---------------------------------------------------------------------------------------------------
# the microbenchmark: N concurrent transfers of one size (what Perseus measured)
# ---------------------------------------------------------------------------------------------------
def predict_transfers(
    preset: Preset | str,
    nodes: int,
    transfers: int,
    size_bytes: int,
    knobs: Knobs,
    *,
    destinations: int | None = None,
    gpus_per_node: int | None = None,
) -> TransferPrediction:
    """MODELLED: one PE issues `transfers` concurrent signalled transfers of `size_bytes` each.

    The transfers spread evenly over `destinations` remote PEs (default: every PE on the other nodes),
    in destination order. Put-only is the same requests without signals and fences, completed by one
    quiet. `fence_share` is the share of the communication time the ordering costs: 1 - T(no ordering)
    / T, where "no ordering" replays the same PUTs and signals with fences removed (a counterfactual).
    Uses the same mechanism code as `predict`.
    """
    preset = _as_preset(preset)
    p = _params(preset)
    if knobs.transport not in ("proxy", "ibgda"):
        raise KnobError("the transfer microbenchmark models queued transports (proxy, ibgda)", ("transport",))
    _check_transport(preset, knobs)
    _check_queued(preset, p, knobs)
    gpn = gpus_per_node or preset.gpus_per_node
    if preset.max_nodes and nodes > preset.max_nodes:
        raise ValueError(f"preset {preset.name!r} has no network between nodes; use nodes=1")
    if nodes < 1 or transfers < 1 or size_bytes < 1 or gpn < 1:
        raise ValueError("nodes, transfers, size_bytes and gpus_per_node must be >= 1")
    if not p.has_nic:
        raise ValueError(f"preset {preset.name!r} has no NIC to model transfers on")
    ndest = destinations if destinations is not None else (nodes - 1) * gpn
    if ndest < 1:
        raise ValueError("the microbenchmark needs at least one remote destination (nodes >= 2)")
    npes = nodes * gpn if destinations is None else ndest + 1
    per = [transfers // ndest + (1 if i < transfers % ndest else 0) for i in range(ndest)]
    rtts = _rtts(p, ndest)
    dests = [(rtts[i], [(float(size_bytes), per[i], 1, 0.0, 0.0)]) for i in range(ndest) if per[i]]
    if knobs.signalling == "decoupled" and knobs.group_size:
        for _, runs in dests:
            if runs[0][1] % knobs.group_size:
                raise KnobError(f"group_size {knobs.group_size} does not divide {runs[0][1]} transfers per "
                                "destination", ("group_size",))
    fence = "drain" if knobs.fence_mode == "proxy_drain" else "nic"
    kw = dict(npes=npes, group=knobs.group_size, qp_mapping=knobs.qp_mapping, qps=knobs.qps_per_pe,
              num_sms=knobs.num_sms)
    r = run_queue(p, knobs.transport, dests, signalling=knobs.signalling, fence=fence, **kw)
    r_off = run_queue(p, knobs.transport, dests, signalling=knobs.signalling, fence="off", **kw)
    r_put = run_queue(p, knobs.transport, dests, signalling="none", fence="off", **kw)
    total = float(transfers) * size_bytes
    t = r.max_ack
    t_put = r_put.max_ack
    fence_time = max(0.0, t - r_off.max_ack)
    return TransferPrediction(
        time_us=t, put_only_us=t_put, throughput_gbps=total / t / 1e3, put_only_gbps=total / t_put / 1e3,
        relative_throughput=t_put / t, fence_time_us=fence_time, fence_share=fence_time / t,
        fences=r.fences, proxy_stalls=r.proxy_stalls, nic_stalls=r.nic_stalls,
    )


# ---------------------------------------------------------------------------------------------------
# predict: one EP dispatch + combine
# ---------------------------------------------------------------------------------------------------
def _check_transport(preset: Preset, knobs: Knobs) -> None:
    if knobs.transport not in preset.transports:
        raise KnobError(
            f"transport {knobs.transport!r} is not available on preset {preset.name!r} "
            f"(available: {', '.join(preset.transports)})",
            ("transport",),
        )


def _check_queued(preset: Preset, p: _P, knobs: Knobs) -> None:
    """A queued transport needs its poster: a preset may list it without the [proxy]/[ibgda] section."""
    if knobs.transport == "proxy" and not p.has_proxy:
        raise KnobError(f"preset {preset.name!r} has no CPU proxy", ("transport",))
    if knobs.transport == "ibgda" and not p.has_ibgda:
        raise KnobError(f"preset {preset.name!r} has no IBGDA", ("transport",))


def _check_runtime_takes(w: Workload, knobs: Knobs, layout: str) -> None:
    """KnobError for a setting the runtime's EP buffer refuses on this workload (facade.py `check_knobs`), so no
    MODELLED number stands for a run that cannot happen: fp8 scales per 128 channels need hidden % 128 == 0; the
    queued transports' chunk_tokens may cut the max_tokens (= S, as the tuner builds the buffer) rows a call may send
    one peer into at most MAX_SLOTS PUTs (runtime/transports/proxy.py `check_chunk_tokens`; the search space's
    `chunk_fits`), where the kernel would silently cut larger chunks (`chunking`). Layout `expert_tiles` reads
    chunk_tokens as NIC messages per tile instead: not checked there."""
    if knobs.compression == "fp8_e4m3":
        try:
            num_scale_groups(w.model.hidden, knobs.scale_granularity)
        except ValueError as e:
            raise KnobError(f"{w.model.name}: {e}", ("scale_granularity",)) from None
    if (knobs.transport in ("proxy", "ibgda") and layout == "runtime"
            and not chunk_tokens_fit(knobs.chunk_tokens, w.tokens_per_gpu)):
        S, ck = w.tokens_per_gpu, knobs.chunk_tokens
        raise KnobError(f"chunk_tokens={ck} would cut up to {S} rows (the tokens per GPU) for one peer into "
                        f"{-(-S // ck)} PUTs, more than the {MAX_SLOTS} signal slots a peer has: the runtime refuses "
                        f"it (the kernel would cut larger chunks); use chunk_tokens >= {-(-S // MAX_SLOTS)} or 0 (one "
                        "PUT per peer)", ("chunk_tokens",))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _token_bytes(model: ModelShape, knobs: Knobs, *, dispatch: bool, layout: str = "runtime") -> float:
    """Bytes of one token on the wire. Runtime layout, dispatch: EPBuffer's wire row (runtime/buffer/
    facade.py `_layout`): payload, k int64 ids, k fp32 weights, fp8 scales, padded to 16 bytes; combine:
    one activation-dtype row. `nccl_k_copies`: the bare payload (fp8: + scales), as the NCCL baseline."""
    h = model.hidden
    fp8 = dispatch and knobs.compression == "fp8_e4m3"
    scales = num_scale_groups(h, knobs.scale_granularity) if fp8 else 0
    payload = h if fp8 else h * DTYPES[model.dtype]
    if not dispatch or layout != "runtime":  # nccl_k_copies or expert_tiles: bare copies of the payload
        return float(payload + 4 * scales)
    k = model.topk
    return float(_align(_align(payload, 8) + 8 * k + 4 * k + 4 * scales, 16))


class _Phase:
    __slots__ = ("bytes", "fences", "nic_stalls", "parts", "proxy_stalls", "sm_us", "transfers", "us")

    def __init__(self) -> None:
        self.us = 0.0
        self.fences = self.proxy_stalls = self.nic_stalls = self.transfers = 0
        self.bytes = 0.0
        self.sm_us = 0.0
        self.parts: dict[str, float] = {}


def _ctas_per_peer(p: _P, num_sms: int, world: int) -> int:
    """CTAs the nvlink kernel gives each destination (csrc/ep_nvlink.cu mt_nvl_ctas_per_peer)."""
    return max(1, min(num_sms // world, p.sms // world, MAX_SLOTS))


def _nvlink_time(p: _P, bytes_per_peer: list[float], groups: int, num_sms: int, cpp: int | None = None) -> float:
    """GPU stores into peers' memory over NVLink: no proxy, signals as device writes. `cpp`: the CTAs
    that copy one peer's bytes (their SM copy rate bounds that peer's stream)."""
    if not bytes_per_peer:
        return p.launch
    total = sum(bytes_per_peer)
    bw = min(p.nvl_egress, num_sms * p.sm_copy, p.hbm)
    peer_bw = min(p.nvl_peer, (cpp if cpp is not None else num_sms) * p.sm_copy)
    t = max(total / bw, max(bytes_per_peer) / peer_bw)
    # each group's signal follows a system fence + flag store; spread over the communicating CTAs
    sig = p.nvl_sig * math.ceil(groups / max(1, num_sms))
    return p.launch + t + p.nvl_lat + sig


def _staged_time(p: _P, bytes_out: float, bytes_in: float, chunks: int, depth: int, gpn: int,
                 nic_bytes: float = 0.0) -> float:
    """Device→host→device through pinned host memory (PCIe crossed twice), in `chunks` pieces, pipelined at any
    `depth`: the pieces go down on one copy stream and come up on another, posted together (runtime/transports/
    host_staged.py `_move`: send j, receive j, send j+1, ...; NCCL's staged path double-buffers its chunks alike), so
    piece j+1 goes down while piece j comes up, whether the pieces are staging messages (chunk_tokens) or blocks of
    other peers. Deeper pipelines (`depth` > 2) also hide part of the per-copy overhead (assumed)."""
    if bytes_out <= 0 and bytes_in <= 0:
        return 0.0
    n = max(1, chunks)
    a = bytes_out / n / p.d2h  # this GPU's outgoing chunk, device → host
    b = bytes_in / n / p.h2d  # an incoming chunk, host → device
    c = (nic_bytes / n / (p.nic_bw * p.c_nic_eff)) if nic_bytes > 0 else 0.0
    # both directions share the GPU's link without duplex: out and in of a pipelined stage cannot
    # overlap on it (unpipelined they run one after the other either way, so only the stage changes)
    link = max(a, b) if p.duplex else a + b
    ov = p.memcpy
    # double buffering: piece i+1 goes out while piece i comes in (was charged one after the other at depth 1, so a
    # staging message size, chunk_tokens, only ever added copy overheads there); deeper pipelines hide the per-copy
    # launch overhead too
    hide = max(1, min(depth - 1, 4))
    stage = max(link, c) + ov / hide
    t = (a + b + c + 2 * ov) + (n - 1) * stage
    # every staged byte is written to host memory once and read back once, by every GPU of the node
    host = gpn * max(bytes_out, bytes_in) * 2.0 / p.host_mem
    return max(t, host)


def _route(w: Workload) -> tuple[Any, Any]:
    """(expert inclusion per PE [P, E/P], P(token needs PE r) [P]) for the workload's routing."""
    _, s = parse_routing(w.routing)
    loads = pe_loads(w.model.experts, w.model.topk, s, w.pes)
    return loads, rank_hits(w.model.experts, w.model.topk, s, w.pes)


def _nvlink_signals(p: _P, knobs: Knobs, world: int) -> tuple[int, int]:
    """(transfers = signal slots, system fences) per peer of the nvlink kernel: one per CTA; decoupled,
    one fence per group of group_size CTAs (clamped to the CTAs; 0 = all of them), csrc/ep_nvlink.cu."""
    cpp = _ctas_per_peer(p, knobs.num_sms, world)
    if knobs.signalling == "coupled":
        return cpp, cpp
    g = cpp if knobs.group_size <= 0 else min(knobs.group_size, cpp)
    return cpp, math.ceil(cpp / g)


def chunking(rows: float, chunk_tokens: int) -> tuple[int, int]:
    """(rows per PUT, PUTs) for `rows` rows to one peer, as the runtime's proxy splits a count (csrc/
    proxy_xchg.h `chunking`, which only the kernel runs: this is its one Python statement, which the search
    space's put_chunking uses too): chunk_tokens rows per PUT (0: one PUT for all), at most MAX_SLOTS PUTs
    (larger chunks then). A fractional expected count is rounded up; no rows, no PUT."""
    if rows <= 0:
        return 1, 0
    cnt = max(1, math.ceil(rows - 1e-9))
    c = chunk_tokens if chunk_tokens > 0 else cnt
    n = -(-cnt // c)
    if n > MAX_SLOTS:
        c = -(-cnt // MAX_SLOTS)
        n = -(-cnt // c)
    return c, n


def _signals_per_peer(knobs: Knobs, puts: int) -> int:
    """Signals (= fences) the runtime's proxy posts for `puts` PUTs to one peer: coupled one per PUT;
    decoupled one per group of group_size PUTs, a last partial group included (0: one per peer)."""
    if puts <= 0:
        return 0
    if knobs.signalling == "coupled":
        return puts
    g = knobs.group_size if knobs.group_size > 0 else puts
    return -(-puts // g)


def _rank_runs(rows: float, tb: float, ck: int, ready: float) -> list[tuple[float, int, int, float, float]]:
    """One peer's PUTs in the runtime layout: full chunks of `c` rows, then the last (partial) chunk; every
    row packed before the exchange starts (all ready at `ready`)."""
    c, n = chunking(rows, ck)
    if n == 0:
        return []
    if n == 1:
        return [(rows * tb, 1, 1, ready, 0.0)]
    return [(c * tb, n - 1, 1, ready, 0.0), ((rows - (n - 1) * c) * tb, 1, 1, ready, 0.0)]


def _queued_peers(p: _P, w: Workload, knobs: Knobs, src: int) -> tuple[list[int], list[int], bool]:
    """(peers reached through the queue in post order, peers reached over NVLink, NVLink used) of PE `src`."""
    P, G = w.pes, w.gpus_per_node
    intra_by_proxy = knobs.transport == "proxy" and p.proxy_intra
    nvl_intra = p.has_nvl and w.p2p and not intra_by_proxy
    node = src // G
    remote = [d for d in range(P) if d // G != node]
    rot = (node * G) % max(1, len(remote))
    remote = remote[rot:] + remote[:rot]
    local = [d for d in range(node * G, node * G + G) if d != src]
    if not nvl_intra:
        # the proxy serves this node's peers too, or there is no NVLink / P2P: they go through the queue
        remote, local = local + remote, []
    if remote and not p.has_nic and not intra_by_proxy:
        raise ValueError(f"preset {p.name!r} has no network: it cannot reach PEs on other nodes")
    return remote, local, nvl_intra


class _CountWords:
    """The count words of the runtime's one-sided exchange (csrc/proxy_xchg.h), for source PE `src` of
    `world`: every rank's poster first writes its count-matrix row (world 8-byte words) to every rank, in
    rank order (the proxy thread: rank q's words are its pushes q*world+1 .. q*world+world); the PUTs to rank
    d wait for d's first word to this PE (d >= src: d has entered the call) and for column d of every lower
    rank's row (the destination offset). exchange_counts (dispatch only) posts one word per rank and waits
    for every rank's. A word is posted like a signal (proxy: signal_us each, one thread; IBGDA: post_sm_us
    each, rank q's words from CTA q mod num_sms) and lands after the signal message overhead plus half the
    peer's round trip (NVLink peers: the NVLink latency; this PE: at once)."""

    def __init__(self, p: _P, kind: str, src: int, world: int, remote: list[int], local: list[int],
                 rtts: list[float], ncta: int) -> None:
        self.p, self.src, self.world = p, src, world
        self.proxy = kind == "proxy"
        self.ncta = max(1, ncta)
        self.issue_each = p.sig_us if self.proxy else p.post_sm_us
        self.poll = p.poll_us if self.proxy else 0.0
        over = (p.sig_o + (0.0 if self.proxy else p.wqe_fetch_us)) if p.has_nic else 0.0
        self.one_way = {d: over + 0.5 * rtts[i] for i, d in enumerate(remote)}
        for d in local:
            self.one_way[d] = p.nvl_lat
        self.one_way[src] = 0.0

    def _pos(self, q: int, col: int, per_rank: int) -> int:
        """Place (1-based) of the word for rank q, column col in its poster's sequence."""
        if self.proxy:
            return q * per_rank + col + 1
        return (q // self.ncta) * per_rank + col + 1

    def counts_kernel(self, launch: bool = True) -> float:
        """exchange_counts: launch (`launch=False`: the kernel is queued behind the pack kernel, whose launch
        the host has already paid), then the later of this PE's `world` words posted and the last peer's word
        here (each peer's word for this PE) landed."""
        start = self.p.launch if launch else 0.0
        if self.world < 2:
            return start
        last = max(v for d, v in self.one_way.items() if d != self.src)
        c = self.issue_each
        own = self.world if self.proxy else -(-self.world // self.ncta)
        return start + self.poll + max(own * c, self._pos(self.src, 0, 1) * c + last)

    def gate(self, x_start: float, d: int) -> float:
        """When the PUTs to rank d may be posted: the words they wait for have landed."""
        c, r, w = self.issue_each, self.src, self.world
        t = x_start
        if d >= r:
            t = max(t, x_start + self.poll + self._pos(r, 0, w) * c + self.one_way.get(d, 0.0))
        for s in range(r):
            t = max(t, x_start + self.poll + self._pos(r, d, w) * c + self.one_way.get(s, 0.0))
        return t

    @property
    def matrix_issue(self) -> float:
        """This PE's poster time for its count-matrix row to every rank (world x world words)."""
        n = self.world * self.world if self.proxy else -(-self.world // self.ncta) * self.world
        return n * self.issue_each


def _reduce_us(p: _P, w: Workload, hits, row_bytes: float) -> float:
    """combine's last kernel (csrc/ep_pack.cu combine_reduce; the packed layout's index_add moves the same
    bytes): every returned row read once (S x sum over ranks of P(token needs r), this PE's own rows
    included), every token's output row written once, at HBM speed, after a launch."""
    S = w.tokens_per_gpu
    out_row = w.model.hidden * DTYPES[w.model.dtype]
    return p.launch + S * (float(hits.sum()) * row_bytes + out_row) / p.hbm


def _phase_queued(p: _P, w: Workload, knobs: Knobs, *, dispatch: bool, loads, hits, t0: float,
                  layout: str = "runtime") -> _Phase:
    """Dispatch (source PE 0 sends every other PE its rows) or combine (the most needed PE returns one row
    per row it received to every token owner) over proxy/IBGDA + NVLink inside the node.

    layout `runtime` (default): what runtime/transports/proxy.py + csrc/proxy_xchg.h send (module docstring):
    one pack kernel writes every peer's rows (dispatch; combine sends the expert output as it is), then per
    peer ceil(rows / chunk_tokens) PUTs (one with chunk_tokens 0, at most MAX_SLOTS), signals by
    `_signals_per_peer`. IBGDA posts the same requests from GPU CTAs. `expert_tiles`: one bare copy per
    (token, expert) in tiles of `tile` tokens per expert, each tile a PUT with its own signal (see
    `predict`)."""
    ph = _Phase()
    S, P, G = w.tokens_per_gpu, w.pes, w.gpus_per_node
    kind = knobs.transport
    tiles = layout == "expert_tiles"
    host_waits = kind == "proxy" and not tiles  # the runtime's proxy transport: host-completed calls
    tb = _token_bytes(w.model, knobs, dispatch=dispatch, layout=layout)
    ck = knobs.chunk_tokens
    if tiles:
        row_sums = loads.sum(axis=1)
        src = 0 if dispatch else int(row_sums.argmax())
    else:
        src = 0 if dispatch else int(hits.argmax())
    remote_pes, local_pes, nvl_intra = _queued_peers(p, w, knobs, src)
    dests = []
    rtts = _rtts(p, len(remote_pes)) if remote_pes else []
    nmsg = 0
    total_bytes = 0.0
    local_bytes = [0.0] * len(local_pes)
    local_groups = 0
    if tiles:
        # one transfer per (source PE, remote expert), split into tiles of `tile` tokens (each tile is one PUT
        # with its own signal, as tile-based EP kernels send them); chunk_tokens splits a tile into NIC messages
        if dispatch:
            per_dest = {d: [S * float(x) * tb for x in loads[d]] for d in range(1, P)}
        else:
            mine = [S * float(x) * tb for x in loads[src]]
            per_dest = {d: mine for d in range(P) if d != src}
        pack_bw = min(max(1, knobs.num_sms) * p.sm_copy, p.hbm / 2.0)
        acc = t0 + p.launch
        for i, d in enumerate(remote_pes):
            runs = []
            for b in per_dest[d]:
                tk = b / tb
                n = max(1, math.ceil(tk / w.tile - 1e-9))
                tile_b = b / n
                m = max(1, math.ceil(tk / n / ck - 1e-9)) if ck else 1
                step = tile_b / pack_bw
                runs.append((tile_b, n, m, acc + step, step))
                acc += b / pack_bw
                nmsg += n * m
                total_bytes += b
            dests.append((rtts[i], runs))
        epp = loads.shape[1]
        local_bytes = [sum(per_dest[d]) for d in local_pes]
        local_groups = len(local_pes) * (epp if knobs.signalling == "coupled" else
                                         max(1, epp // (knobs.group_size or epp)))
        # receiver ingress: the most loaded receiver takes bytes from every other PE
        per_sender = float(row_sums.max() if dispatch else row_sums.mean()) * S * tb
        ready = t0
    else:
        rows_to = {d: S * float(hits[d] if dispatch else hits[src]) for d in range(P) if d != src}
        # dispatch: one pack kernel (csrc/ep_pack.cu rows: a grid over every SM, each byte read and written)
        # writes the rows for every rank, this one's own included, before the exchange kernel starts
        pack = S * float(hits.sum()) * tb / (p.hbm / 2.0) + p.launch if dispatch else 0.0
        if pack:
            ph.parts["pack"] = pack
        cw = _CountWords(p, kind, src, P, remote_pes, local_pes, rtts, knobs.num_sms)
        # dispatch: exchange_counts (runtime/buffer/_resident.py) is its own kernel before the exchange kernel;
        # combine's exchange is given the counts, but still posts its count-matrix row. The proxy's calls are
        # host-completed (csrc/proxy_gpu.cu host_wait_done, option proxy_host_wait, on by default): the counts
        # kernel is launched right behind the pack kernels (its launch hidden by theirs), then the host spins
        # on the kernel's completion word before it launches the exchange kernel (whose launch is exposed).
        # IBGDA has no runtime transport and no host wait: its two launches stay as they were.
        counts = cw.counts_kernel(launch=not (host_waits and pack)) if dispatch else 0.0
        if counts:
            ph.parts["counts"] = counts
        wait_counts = p.poll_us if host_waits and dispatch else 0.0
        if wait_counts:
            ph.parts["host_wait_counts"] = wait_counts
        x_start = t0 + pack + counts + wait_counts + p.launch
        ready = x_start
        gates = {d: cw.gate(x_start, d) for d in remote_pes + local_pes}
        for i, d in enumerate(remote_pes):
            runs = _rank_runs(rows_to[d], tb, ck, gates[d])
            nmsg += sum(r[1] for r in runs)
            total_bytes += rows_to[d] * tb
            dests.append((rtts[i], runs))
        for j, d in enumerate(local_pes):
            local_bytes[j] = rows_to[d] * tb
            local_groups += _signals_per_peer(knobs, chunking(rows_to[d], ck)[1])
        if local_pes:
            ready = max(gates[d] for d in local_pes)
        # the rows this PE sends itself: PUTs through the same poster, a local copy (read + write at HBM speed)
        self_rows = S * float(hits[src])
        self_chunks = [b for b, n, *_ in _rank_runs(self_rows, tb, ck, x_start) for _ in range(n)]
        if self_chunks:
            ph.parts["self_copy"] = self_rows * tb / (p.hbm / 2.0)
        # count words: the matrix row (world words) to every rank; dispatch adds exchange_counts' row
        ph.bytes += (P - 1) * (P + (1 if dispatch else 0)) * SIGNAL_BYTES
        ph.parts["count_matrix_issue"] = cw.matrix_issue
        # receiver ingress: dispatch, the most needed PE takes its rows from every other PE; combine, a token
        # owner takes back one row per row it sent
        per_sender = S * tb * float(hits.max() if dispatch else hits.mean())
    if nmsg > MAX_MESSAGES:
        raise ValueError(f"chunk_tokens={ck} gives {nmsg} messages per PE; use larger chunks")
    fence = "drain" if knobs.fence_mode == "proxy_drain" else "nic"
    t_net = t0
    if dests or (not tiles and P > 1):
        extra = {} if tiles else dict(
            words=P, local_words=len(local_pes) + 1, self_chunks=self_chunks, self_bw=p.hbm / 2.0, self_ready=x_start)
        r = run_queue(
            p, kind, dests, npes=P, signalling=knobs.signalling, group=knobs.group_size, fence=fence,
            qp_mapping=knobs.qp_mapping, qps=knobs.qps_per_pe, num_sms=knobs.num_sms,
            group_signal=not tiles, t0=t0 if tiles else x_start, **extra,
        )
        t_net = r.last_arrive
        if dests:
            ing = per_sender * (P - (G if nvl_intra else 1))
            data0 = min(gates[d] for d in remote_pes) if not tiles else t0 + p.launch
            ing_t = data0 + ing / p.nic_bw + p.rtt
            t_net = max(t_net, ing_t)
            ph.parts["ingress_bound"] = ing_t - t0
        ph.fences, ph.proxy_stalls, ph.nic_stalls = r.fences, r.proxy_stalls, r.nic_stalls
        ph.parts.update({
            "proxy_issue" if kind == "proxy" else "gpu_post": r.issue_busy,
            "fence_proxy_blocked": r.fence_busy,
            "fence_wait_completion": r.fence_wait,
            "nic_stall_held_sum": r.nic_wait,
            "wire": r.wire_us,
        })
        ph.sm_us = 0.0 if kind == "proxy" else r.issue_busy
        ph.transfers = r.transfers
        ph.bytes += total_bytes + r.signals * SIGNAL_BYTES
    t_nvl = t0
    if local_pes:
        t_nvl = ready + _nvlink_time(p, local_bytes, local_groups, knobs.num_sms)
        ph.parts["nvlink"] = t_nvl - t0
        ph.bytes += sum(local_bytes) + (0 if tiles else local_groups * SIGNAL_BYTES)
    # IBGDA: SM time spent posting delays the compute the same SMs would do
    sm_pen = ph.sm_us / p.sms if kind == "ibgda" else 0.0
    ph.parts["sm_contention"] = sm_pen
    ph.us = max(t_net, t_nvl) - t0 + sm_pen
    if not dests and not local_pes:  # EP size 1: the kernel still launches
        ph.us = p.launch
    elif host_waits:
        # the host's wait for the exchange kernel's completion word: what follows (combine's reduce, the
        # caller's next kernel) is launched only after it
        ph.parts["host_wait_exchange"] = p.poll_us
        ph.us += p.poll_us
    if not dispatch and not tiles and (dests or local_pes):
        ph.parts["reduce"] = red = _reduce_us(p, w, hits, tb)
        ph.us += red
    return ph


def _phase_nvlink(p: _P, w: Workload, knobs: Knobs, *, dispatch: bool, hits) -> _Phase:
    ph = _Phase()
    if w.nodes > 1:
        raise KnobError("transport 'nvlink' does not reach other nodes; use proxy, ibgda or collective",
                        ("transport",))
    if not p.has_nvl:
        raise KnobError(f"preset {p.name!r} has no NVLink", ("transport",))
    if not w.p2p and w.gpus_per_node > 1:
        # GPU stores into a peer's memory need peer-to-peer; with it disabled nothing can be stored
        raise KnobError("transport 'nvlink' needs GPU peer-to-peer, which this workload disables (p2p=False); "
                        "use host_staged or collective", ("transport",))
    S, G = w.tokens_per_gpu, w.gpus_per_node
    tb = _token_bytes(w.model, knobs, dispatch=dispatch)
    if dispatch:  # PE 0 sends every other PE the rows of its tokens that PE needs
        bpp = [S * float(hits[d]) * tb for d in range(1, G)]
    else:  # the most needed PE returns one row per row it received, to every other PE
        bpp = [S * float(hits.max()) * tb] * (G - 1)
    cpp, fences = _nvlink_signals(p, knobs, G)
    groups = (G - 1) * fences
    ph.us = _nvlink_time(p, bpp, groups, knobs.num_sms, cpp)
    ph.bytes = sum(bpp) + (G - 1) * cpp * SIGNAL_BYTES
    ph.transfers = (G - 1) * cpp
    ph.parts = {"nvlink": ph.us}
    if G > 1:
        # phase 0/1 of csrc/ep_nvlink.cu: the count-matrix row stored into every rank (tagged words, inside the
        # same launch); a CTA's offset in d's buffer waits for the words of the lower ranks: one NVLink latency
        # before the rows of any rank above the lowest move (dispatch: exchange_fused / dispatch_gather; combine
        # the same kernel)
        ph.parts["counts"] = p.nvl_lat
        ph.us += p.nvl_lat
        ph.bytes += (G - 1) * G * SIGNAL_BYTES
    # the cpp CTAs of this PE's own slot copy its own rows locally (read + write), beside the peers' CTAs
    own = S * float(hits[0] if dispatch else hits.max()) * tb
    ph.parts["self_copy"] = own / min(cpp * p.sm_copy, p.hbm / 2.0)
    ph.us = max(ph.us, p.launch + ph.parts.get("counts", 0.0) + ph.parts["self_copy"])
    if not dispatch:
        ph.parts["reduce"] = red = _reduce_us(p, w, hits, tb)
        ph.us += red
    return ph


def _runs_dense(w: Workload, knobs: Knobs) -> bool:
    """Whether a collective transport runs the dense layout: `Workload.dense`, or where it is None the runtime's
    own rule (runtime/buffer/layout_choice.py `picks_dense`, EPBuffer(dense=None) with max_tokens = S, as the
    tuner builds it), asked with the dispatch wire row."""
    if w.dense is not None:
        return w.dense
    return picks_dense(w.model.experts, w.model.topk, w.pes, w.tokens_per_gpu,
                       _token_bytes(w.model, knobs, dispatch=True))


def _wire_hits(hits, dense: bool):
    """P(a token's row goes to rank r) on the wire: the routing's `hits` in the packed layout; 1 for every rank
    in the dense layout, which sends every capacity slot (max_tokens = S rows) to every rank whatever the
    routing (runtime/buffer/_dense.py: dispatch an all-gather of the stage rows, combine a reduce-scatter of
    one row per received row)."""
    return np.ones_like(hits) if dense else hits


def _bytes_out_in(w: Workload, loads, hits, tb: float, dispatch: bool, copies: bool) -> tuple[float, float, int]:
    """(bytes out to other PEs, bytes in from other PEs, other PEs) of the busiest PE."""
    S, P = w.tokens_per_gpu, w.pes
    if copies:  # a plain NCCL all-to-all of k copies per token, shared out by destination load
        row = loads.sum(axis=1)
        frac_remote = 1.0 - float(row[0]) / w.model.topk
        out = S * w.model.topk * tb * frac_remote
        inn = S * tb * float(row.max()) * (P - 1)
    else:  # the runtime's packed layout: each token once per destination rank it needs
        out = S * tb * float(hits.sum() - hits[0])
        inn = S * tb * float(hits.max()) * (P - 1)
    if not dispatch:
        out, inn = inn, out
    return out, inn, P - 1


def payload_calls(tokens: int, pipeline_depth: int, *, dense: bool) -> list[int]:
    """The tokens (dense: capacity slots; the tuner's max_tokens is S) of each payload call a collective
    transport's EP buffer posts per direction: pipeline_depth contiguous chunks of ceil(S / depth)
    (runtime/buffer/layout_choice.py `equal_chunk_bounds`, which _packed.py `_plan_packed` and _dense.py
    `_dense_bounds` without chunk_weights call), the last ones short or empty. The packed layout posts every chunk, an empty one too (an all_to_all_single of zero rows); the dense
    layout skips empty chunks (facade.py post_dispatch / post_combine)."""
    b = equal_chunk_bounds(tokens, max(1, pipeline_depth))
    sizes = [hi - lo for lo, hi in itertools.pairwise(b)]
    return [t for t in sizes if t > 0] if dense else sizes


def _collective_call(p: _P, w: Workload, io: float, ii: float, eo: float, ei: float,
                     peers: int) -> tuple[float, float, float]:
    """One NCCL call moving io / ii bytes out / in over NVLink (or staged) and eo / ei over the NIC:
    (intra-node time, inter-node time, the call's time with its per-peer cost)."""
    if not (p.has_nvl and w.p2p):
        chunks = max(1, math.ceil(max(io, ii) / p.c_host_chunk))
        t_intra = p.c_host_alpha + _staged_time(p, io, ii, chunks, 2, w.gpus_per_node)
    else:
        # launch, then the ranks' handshake and the data streaming overlap: the longer one counts
        t_intra = p.c_alpha + max(p.c_sync, max(io, ii) / p.c_intra)
    t_inter = 0.0
    if eo > 0 or ei > 0:
        t_inter = p.c_alpha + max(p.c_sync, max(eo, ei) / (p.nic_bw * p.c_nic_eff)) + p.rtt
    return t_intra, t_inter, max(t_intra, t_inter) + peers * p.c_peer


def _payload_floor(p: _P, w: Workload, io: float, ii: float, eo: float, ei: float, peers: int) -> float:
    """The least time the calls of one payload on parallel communicators can take together: MODELLED, an
    assumption (no measurement of it on the staged path). Communicators share the links, so their calls never move
    the bytes faster than the links carry them; each call's own fixed costs overlap with the others'.

    * staged through host memory (no NVLink or p2p=False: NCCL's SHM path): the PCIe links (pcie.d2h_gbps out,
      pcie.h2d_gbps in; one link both ways without duplex) and host memory (every GPU of the node writes and reads
      each staged byte once), after one host_alpha_us. One call is slower than that (a copy overhead per NCCL chunk,
      pcie.memcpy_us, and its staging pipeline's fill and drain), which parallel calls hide: runtime/pipeline.py's
      case for `channels`, one communicator that cannot fill the link.
    * direct NVLink: one call's calibrated rate (collective.intra_gbps), not the NVLink line rate: measured on
      nvlink-h200x2 (docs/perf-notes.md, the bring-up runs), collective qwen3-30b S=4096 with pipeline_depth 2 and
      channels 2 was 0.94x of depth 1 (run 2c), and the tuned channels setting 0.79x (run 5): parallel
      communicators did not beat one call there.
    * across nodes: one call's rate too (nic.gbps x collective.nic_efficiency; not measured).
    Plus the per-peer cost once."""
    if not (p.has_nvl and w.p2p):
        link = max(io / p.d2h, ii / p.h2d) if p.duplex else io / p.d2h + ii / p.h2d
        host = w.gpus_per_node * max(io, ii) * 2.0 / p.host_mem
        t_intra = p.c_host_alpha + max(link, host)
    else:
        t_intra = p.c_alpha + max(p.c_sync, max(io, ii) / p.c_intra)
    t_inter = 0.0
    if eo > 0 or ei > 0:
        t_inter = p.c_alpha + max(p.c_sync, max(eo, ei) / (p.nic_bw * p.c_nic_eff)) + p.rtt
    return max(t_intra, t_inter) + peers * p.c_peer


def _phase_collective(p: _P, w: Workload, knobs: Knobs, *, dispatch: bool, loads, hits, layout: str) -> _Phase:
    """NCCL all-to-all, intra-node over NVLink or staged, inter-node NIC: the runtime's rows (packed: once per
    destination rank; dense: every slot to every rank), posted as `payload_calls` calls over `channels`
    communicators, or with layout `nccl_k_copies` k bare copies per token in one call (the NCCL baseline's
    calls)."""
    ph = _Phase()
    P, G = w.pes, w.gpus_per_node
    tb = _token_bytes(w.model, knobs, dispatch=dispatch, layout=layout)
    dense = layout == "runtime" and _runs_dense(w, knobs)
    out, inn, peers = _bytes_out_in(w, loads, _wire_hits(hits, dense), tb, dispatch,
                                    copies=layout == "nccl_k_copies")
    if peers == 0:
        ph.us = p.launch
        return ph
    intra_share = (G - 1) / (P - 1)
    io, ii = out * intra_share, inn * intra_share
    eo, ei = out - io, inn - ii
    if (eo > 0 or ei > 0) and not p.has_nic:
        raise ValueError(f"preset {p.name!r} has no network: it cannot reach PEs on other nodes")
    S = w.tokens_per_gpu
    calls = payload_calls(S, knobs.pipeline_depth, dense=dense) if layout == "runtime" else [S]
    # chunk c goes on communicator c mod channels (facade.py post_dispatch / post_combine): one communicator runs
    # its calls one after the other; calls on different communicators overlap, bounded by what the shared links
    # carry (`_payload_floor`, MODELLED: an assumption on the staged path, one call's rate on direct NVLink as
    # measured there)
    lanes = [0.0] * min(knobs.channels, MAX_COMM_CHANNELS, len(calls))
    for c, tokens in enumerate(calls):
        f = tokens / S
        lanes[c % len(lanes)] += _collective_call(p, w, io * f, ii * f, eo * f, ei * f, peers)[2]
    t_intra, t_inter, _ = _collective_call(p, w, io, ii, eo, ei, peers)
    floor = _payload_floor(p, w, io, ii, eo, ei, peers)
    ph.us = max(max(lanes), floor)
    ph.bytes = out
    ph.transfers = peers * len(calls)
    ph.parts = {"collective_intra": t_intra, "collective_inter": t_inter, "per_peer": peers * p.c_peer,
                "link_floor": floor, "payload": ph.us}
    if layout == "runtime":
        _layout_extras(p, w, knobs, ph, hits, tb, dispatch=dispatch, dense=dense)
    return ph


def _packed_counts_us(p: _P, w: Workload) -> float:
    """The packed layout's counts exchange: ONE NCCL all_to_all_single per dispatch call (runtime/buffer/
    _packed.py `_exchange_blocks` -> CollectiveTransport.exchange_blocks, which host_staged inherits: its counts
    never take the copy-engine staging), with next to no bytes: the collective's fixed costs on the path its
    payload call takes (NVLink / P2P, or staged through host memory, one tiny copy down and up, without it;
    a NIC round trip across nodes) plus its per-peer cost."""
    staged = not (p.has_nvl and w.p2p)
    intra = p.c_host_alpha + 2 * p.memcpy if staged else p.c_alpha + p.c_sync
    inter = p.c_alpha + p.c_sync + p.rtt if w.nodes > 1 else 0.0
    return max(intra, inter) + (w.pes - 1) * p.c_peer


def _layout_extras(p: _P, w: Workload, knobs: Knobs, ph: _Phase, hits, tb: float, *, dispatch: bool,
                   dense: bool) -> None:
    """The pieces around a collective transport's payload calls.

    Packed layout (runtime/buffer/_packed.py `_plan_packed`), dispatch: the counts go first in ONE small exchange
    per call whatever pipeline_depth (`_packed_counts_us`; the block to each rank holds every chunk's [error
    word, rows, rows per local expert], int64), then the host reads them (`.tolist()`, the one host sync of a
    dispatch) before any payload call is posted: `host_sync`, one small device-to-host copy (`pcie.memcpy_us`;
    the payload call's launch after it is already in its own alpha / launch). Combine reuses the counts (no
    exchange, no sync) and ends in the reduce over every returned row (index_add: the bytes of `_reduce_us`).

    Dense layout (runtime/buffer/_dense.py; EPBuffer(dense=None) takes it where `picks_dense` says so): no counts
    and no host sync; every capacity slot is sent, so the rows of this PE's own block are all S of them; combine's
    sum over ranks happens inside the collective's reduce-scatter (no reduce kernel after it), except on
    host_staged's copy-engine path, whose reduce-scatter sums the `world` blocks afterwards, once per chunk, in
    torch passes (`_staged_sums_us`: at world 2 one add, beyond it fp32 conversions and accumulations), the
    part of them past the copies in phase `reduce_exposed` (`_sums_past_copies`), all of them in `reduce`.

    Both, dispatch: the stage write of the S token rows comes first (`_stage_us`), and in the packed layout the
    send rows' build (`_send_rows_us`: its planning ops and the gather padded to S x world rows) before the counts
    exchange, which waits for them on the stream.

    Both: this PE's own rows are a local copy inside the exchange (read + write at HBM speed, beside the network:
    the longer counts). As the tuner measures (check_inputs=False, tuner/measure/ep.py): the input-check
    exchanges and their syncs are not there."""
    S = w.tokens_per_gpu
    wire = _wire_hits(hits, dense)
    own = S * float(wire[0] if dispatch else wire.max()) * tb
    ph.parts["self_copy"] = own / (p.hbm / 2.0)
    ph.us = max(ph.us, ph.parts["self_copy"])
    if dispatch:
        ph.parts["stage"] = stage = _stage_us(p, w, knobs, tb)
        ph.us += stage
        if dense:
            return
        ph.parts["send_rows"] = rows = _send_rows_us(p, w, knobs, tb)
        ph.us += rows
        ph.parts["counts"] = counts = _packed_counts_us(p, w)
        ph.parts["host_sync"] = p.memcpy
        ph.us += counts + p.memcpy
        # one block per other rank: every pipeline chunk's error word, rows, rows per local expert (int64)
        ph.bytes += (w.pes - 1) * knobs.pipeline_depth * (2 + w.model.experts // w.pes) * 8
    elif not dense:
        ph.parts["reduce"] = red = _reduce_us(p, w, wire, tb)
        ph.us += red
    elif knobs.transport == "host_staged":
        calls = payload_calls(S, knobs.pipeline_depth, dense=True)
        sums = _staged_sums_us(p, w, calls)
        ph.parts["reduce"] = sum(sums)
        ph.parts["reduce_exposed"] = red = _sums_past_copies(ph.us, calls, sums)
        ph.us += red


# The packed layout's planning ops before its counts exchange (runtime/buffer/_packed.py `_plan_packed`), each at
# least one launch, counted from the code (not measured): clamp, remainder_, div (rank of each pick), zeros +
# scatter_ + sum (the destination mask and rows per rank), zeros + scatter_add_ (rows per expert), cat (the count
# block), nonzero_static (the (chunk, rank, token) order list), add (its token indices), index_select (the send
# rows). More than one chunk adds arange, div, add (the chunk of each token).
_PACKED_PLAN_OPS = 12
_PACKED_CHUNK_OPS = 3


def _stage_us(p: _P, w: Workload, knobs: Knobs, tb: float) -> float:
    """Dispatch's stage write (runtime/buffer/facade.py `_write_stage`), both collective layouts, before anything
    is exchanged: the S tokens as wire rows (x read, one row of `tb` bytes written per token) at HBM speed, in
    three launches (payload, ids, weights copies) or one (fp8: the quantiser writes all of a row)."""
    S = w.tokens_per_gpu
    launches = 1 if knobs.compression == "fp8_e4m3" else 3
    return launches * p.launch + S * (w.model.hidden * DTYPES[w.model.dtype] + tb) / p.hbm


def _send_rows_us(p: _P, w: Workload, knobs: Knobs, tb: float) -> float:
    """The packed layout's send rows, built on the GPU before the counts exchange is posted on the same stream
    (runtime/buffer/_packed.py): the planning ops (`_PACKED_PLAN_OPS`, one launch each) and ONE gather of the
    stage rows in (chunk, rank, token) order whose order list is padded to its upper bound S x world (no host
    sync before the counts): S x world rows read and written at HBM speed, however few of them the routing
    needs (at EP 8 with top-8 of 128 experts about 2/3 are real rows, at EP 64 about 1/8)."""
    S = w.tokens_per_gpu
    ops = _PACKED_PLAN_OPS + (_PACKED_CHUNK_OPS if knobs.pipeline_depth > 1 else 0)
    return ops * p.launch + 2.0 * S * w.pes * tb / p.hbm


def _staged_sums_us(p: _P, w: Workload, calls: list[int]) -> list[float]:
    """host_staged's dense combine: the copy-engine reduce-scatter's sum of the `world` blocks (this rank's own and
    one per peer), run once per chunk (one reduce_scatter_async call per non-empty chunk, `calls` slots each) by
    runtime/transports/host_staged.py `reduce_scatter_async` `finish`, pass for pass (bytes per element of the
    chunk's rows x hidden, e = the activation dtype's size; one launch per torch op):
    * world 2: torch.add(a, b, out=out): 2 blocks read, out written (3e B), 1 launch;
    * world W > 2: acc = blocks[0].float() (e read, 4 written), then per further block b.float() (e read, 4 written)
      and acc += it (4 + 4 read, 4 written), then out.copy_(acc) (4 read, e written): 18W - 6 B at e = 2 (66 at
      W = 4), 2W launches. With fp32 activations .float() is the block itself (no pass): 12(W - 1) + 8 B, W
      launches.
    At HBM speed, each launch gpu.launch_us; one time per call (`_sums_past_copies` says how much of them the
    copies leave exposed)."""
    W, e = w.pes, DTYPES[w.model.dtype]
    if W == 2:
        per_elem, launches = 3 * e, 1
    elif e == 4:
        per_elem, launches = 12 * (W - 1) + 8, W
    else:
        per_elem, launches = (e + 4) + (W - 1) * (e + 4 + 12) + (4 + e), 2 * W
    return [launches * p.launch + n * w.model.hidden * per_elem / p.hbm for n in calls]


def _sums_past_copies(copy_us: float, calls: list[int], sums: list[float]) -> float:
    """How long host_staged's dense combine runs past its copies: finish_combine waits for the calls in order, and
    each wait queues that call's sum on the compute stream while later calls' copies still run on the copy engines
    (runtime/buffer/facade.py `finish_combine`, host_staged.py `_move`). Call c's copies are taken to end at its
    share of the rows so far times the copies' time (MODELLED, assumed: the calls share the lanes in proportion
    to their rows); its sum starts then, or when the previous sum ends. One call: its whole sum is exposed."""
    total = sum(calls)
    if not total:
        return 0.0
    done = end = 0.0
    for n, t in zip(calls, sums, strict=True):
        done += n
        end = max(end, copy_us * done / total) + t
    return max(0.0, end - copy_us)


def _phase_host_staged(p: _P, w: Workload, knobs: Knobs, *, dispatch: bool, loads, hits) -> _Phase:
    """moetune's staged transport (runtime/transports/host_staged.py): each peer's block D2H, (NIC), H2D by the
    copy engines, straight from the rows the EP buffer hands it: the dense layout's stage rows (dispatch) or the
    expert output rows (combine), the packed layout's send rows (built by the plan's gather before the counts
    exchange: `_layout_extras`, as for collective). No pack kernel, and no SM count (num_sms is not read)."""
    ph = _Phase()
    G = w.gpus_per_node
    tb = _token_bytes(w.model, knobs, dispatch=dispatch)
    dense = _runs_dense(w, knobs)
    out, inn, peers = _bytes_out_in(w, loads, _wire_hits(hits, dense), tb, dispatch, copies=False)
    if peers == 0:
        ph.us = p.launch
        return ph
    nic_bytes = 0.0
    if w.nodes > 1:
        if not p.has_nic:
            raise ValueError(f"preset {p.name!r} has no network: it cannot reach PEs on other nodes")
        nic_bytes = out * (w.pes - G) / (w.pes - 1)
    per_peer_tokens = out / tb / peers
    ck = knobs.chunk_tokens
    chunks_per_peer = max(1, math.ceil(per_peer_tokens / ck)) if ck else 1
    chunks = peers * chunks_per_peer
    t = _staged_time(p, out, inn, chunks, knobs.pipeline_depth, G, nic_bytes)
    if nic_bytes:
        t += p.rtt
    ph.us = t
    ph.bytes = out
    ph.transfers = chunks
    ph.parts = {"staged": t}
    # packed: the counts exchange is the collective's (an NCCL all_to_all_single), then the host sync
    _layout_extras(p, w, knobs, ph, hits, tb, dispatch=dispatch, dense=dense)
    return ph


def transfers_per_peer(w: Workload, chunk_tokens: int = 0) -> int:
    """The group-size grid of the runtime's layout: the PUTs one PE posts to one peer under uniform routing,
    ceil(S x P(token needs the peer) / chunk_tokens) (1 with chunk_tokens 0; at most MAX_SLOTS), the
    transfers a decoupled group_size groups. Any group size is valid (a last partial group is sent as is,
    csrc/proxy_xchg.h), so this is the range worth sweeping, not a divisibility rule. 1 for EP size 1."""
    if w.pes < 2:
        return 1
    rows = w.tokens_per_gpu * float(rank_hits(w.model.experts, w.model.topk, 0.0, w.pes)[0])
    return max(1, chunking(rows, chunk_tokens)[1])


def busiest_peer_rows(w: Workload) -> float:
    """The rows one PE sends its busiest peer, S x max over ranks of P(token needs the rank) under the workload's
    routing (dispatch sends rank d S x P(d) rows; combine returns the most needed rank's count to every peer)."""
    _, s = parse_routing(w.routing)
    return w.tokens_per_gpu * float(rank_hits(w.model.experts, w.model.topk, s, w.pes).max())


def group_grid(preset: Preset | str, w: Workload, knobs: Knobs) -> int:
    """How many transfers a decoupled `group_size` groups per peer in `predict`'s runtime layout, the most any
    peer gets: proxy/ibgda the PUTs to the busiest peer (`chunking`: ceil(rows / chunk_tokens), ONE with
    chunk_tokens 0, at most MAX_SLOTS), nvlink the kernel's CTAs per peer (`_ctas_per_peer`, which depends on
    num_sms); 0 for the transports whose prediction reads no group_size (collective, host_staged). A group
    size above it makes one group of every peer's transfers: the same run as group_size 0 (one per peer)."""
    preset = _as_preset(preset)
    if knobs.transport in ("proxy", "ibgda"):
        return max(1, chunking(busiest_peer_rows(w), knobs.chunk_tokens)[1])
    if knobs.transport == "nvlink":
        return _ctas_per_peer(_params(preset), knobs.num_sms, w.gpus_per_node)
    return 0


def expert_tiles_per_peer(w: Workload) -> int:
    """The group-size grid of layout `expert_tiles`: experts per PE x tiles of `tile` tokens per expert under
    uniform routing. A decoupled group size must divide it there (Knobs.check_workload)."""
    per_expert = w.tokens_per_gpu * w.model.topk / w.model.experts
    return (w.model.experts // w.pes) * max(1, math.ceil(per_expert / w.tile - 1e-9))


def _expert_us(p: _P, w: Workload, loads) -> float:
    """Modelled expert FFN time on the most loaded PE (tile-padded grouped GEMMs)."""
    S, P = w.tokens_per_gpu, w.pes
    row = loads[int(loads.sum(axis=1).argmax())]
    rows = [math.ceil(S * P * float(x) / w.tile) * w.tile for x in row]
    flops = sum(rows) * 6.0 * w.model.hidden * w.model.intermediate
    return flops / (p.tflops * 1e6 * p.eff)


def predict(
    preset: Preset | str,
    workload: Workload,
    knobs: Knobs,
    *,
    phase: Literal["both", "dispatch", "combine"] = "both",
    layout: Literal["runtime", "nccl_k_copies", "expert_tiles"] = "runtime",
) -> Prediction:
    """MODELLED cost of one dispatch and/or combine per GPU. Unsafe knobs raise KnobError; a workload
    the preset cannot run raises ValueError; an unknown preset raises PresetError (a ValueError).

    `layout`: what goes on the wire. `runtime` (default): the runtime's layouts, each token once per
    destination rank it needs. `nccl_k_copies` (transport collective only): a plain NCCL
    all_to_all_single of k copies of each token, the experiment the NCCL baseline
    (bench/results/2026-11-30_h200x2_nccl_baseline.jsonl) and the calibration rows measured. `expert_tiles`
    (proxy and ibgda only): one bare copy per (token, expert) in tiles of `tile` tokens per expert, each
    tile a PUT with its own signal (decoupled: a group's PUTs, one fence, the group's signals): what the
    tile-based EP kernels Perseus measured send (the transfer counts it reports, arXiv 2605.00686) and what
    a megakernel spanning GPUs (FlashDMoE, arXiv 2506.04667) would put across nodes; no moetune transport
    sends it today. There a decoupled group size must divide `expert_tiles_per_peer`."""
    preset = _as_preset(preset)
    if not isinstance(knobs, Knobs):
        raise KnobError(f"expected Knobs, got {type(knobs).__name__}")
    if phase not in ("both", "dispatch", "combine"):
        raise ValueError(f"phase must be both, dispatch or combine, got {phase!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "nccl_k_copies" and knobs.transport != "collective":
        raise ValueError(f"layout {layout!r} describes an NCCL all-to-all: transport collective only")
    if layout == "expert_tiles" and knobs.transport not in ("proxy", "ibgda"):
        raise ValueError(f"layout {layout!r} describes queued per-expert tile puts: transport proxy or ibgda only")
    _check_transport(preset, knobs)
    p = _params(preset)
    w = workload
    _check_runtime_takes(w, knobs, layout)
    loads, hits = _route(w)
    if knobs.transport in ("proxy", "ibgda"):
        # the runtime's proxy takes any group size (a last partial group); the tile layout's groups must divide
        if layout == "expert_tiles":
            knobs.check_workload(expert_tiles_per_peer(w))
        _check_queued(preset, p, knobs)
    if w.nodes > 1 and (not p.has_nic or (preset.max_nodes and w.nodes > preset.max_nodes)):
        raise ValueError(f"preset {preset.name!r} has no network between nodes; use nodes=1")
    phases_out: dict[str, float] = {}
    res: dict[str, _Phase] = {}
    for name in ("dispatch", "combine"):
        if phase not in ("both", name):
            continue
        disp = name == "dispatch"
        if knobs.transport in ("proxy", "ibgda"):
            ph = _phase_queued(p, w, knobs, dispatch=disp, loads=loads, hits=hits, t0=0.0, layout=layout)
        elif knobs.transport == "nvlink":
            ph = _phase_nvlink(p, w, knobs, dispatch=disp, hits=hits)
        elif knobs.transport == "collective":
            ph = _phase_collective(p, w, knobs, dispatch=disp, loads=loads, hits=hits, layout=layout)
        else:
            ph = _phase_host_staged(p, w, knobs, dispatch=disp, loads=loads, hits=hits)
        res[name] = ph
        phases_out[name] = ph.us
        for k, v in ph.parts.items():
            phases_out[f"{name}.{k}"] = v
    d = res.get("dispatch")
    c = res.get("combine")
    d_us = d.us if d else 0.0
    c_us = c.us if c else 0.0
    e_us = _expert_us(p, w, loads)
    phases_out["expert"] = e_us
    all_ph = [x for x in (d, c) if x]
    notes = ["MODELLED: predicted by the fabric model from preset parameters, not measured"]
    if layout == "nccl_k_copies":
        notes.append("collective: k copies per token on the wire (a plain NCCL all_to_all_single, as the NCCL "
                     "baseline)")
    elif layout == "expert_tiles":
        notes.append("one copy per (token, expert) in per-expert tiles, a signalled PUT each (tile-based kernels "
                     "as Perseus measured; not what moetune's runtime sends)")
    elif knobs.transport in ("collective", "host_staged") and _runs_dense(w, knobs):
        notes.append("dense layout: every capacity slot (S rows) to every rank, combine a reduce-scatter (the "
                     "runtime's layout " + ("chosen by its rule, runtime/buffer/layout_choice.py)" if w.dense is None
                                            else "asked for)"))
    else:
        notes.append("each token once per destination rank that holds one of its experts (the runtime's layout)")
    return Prediction(
        latency_us=d_us + c_us,
        dispatch_us=d_us,
        combine_us=c_us,
        fences=sum(x.fences for x in all_ph),
        proxy_stalls=sum(x.proxy_stalls for x in all_ph),
        nic_stalls=sum(x.nic_stalls for x in all_ph),
        bytes_on_wire=sum(x.bytes for x in all_ph),
        transfers=sum(x.transfers for x in all_ph),
        phases=phases_out,
        layer_us=d_us + e_us + c_us,
        expert_us=e_us,
        preset=preset.name,
        transport=knobs.transport,
        notes=notes,
    )
