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
  combine, the reduce kernel (`reduce_us`: every returned row read, every token written, at HBM speed).
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

Where the pieces live: the records (Workload, Prediction, TransferPrediction) in records.py; the preset's
parameters and its transport checks in params.py; a token's wire row, the routing's rows per rank and the proxy's
chunking in wire_rows.py; one module per transport's phase in phases/ (queued, nvlink, collective, host_staged, the
collective layouts' pieces in layouts, the shared Phase record and costs in phase); the group-size grids in
group_grids.py. This module puts them together: `predict` and `predict_transfers`.

Every number this module returns is modelled (`Prediction.modelled` is always True).
"""

from __future__ import annotations

import math
from typing import Literal

from moetune.runtime.knobs import MAX_SLOTS, KnobError, Knobs, chunk_tokens_fit, num_scale_groups
from moetune.runtime.shapes import DTYPES
from moetune.tuner.fabric_model.group_grids import expert_tiles_per_peer
from moetune.tuner.fabric_model.params import Params, as_preset, check_queued, check_transport, params
from moetune.tuner.fabric_model.phases.collective import phase_collective
from moetune.tuner.fabric_model.phases.host_staged import phase_host_staged
from moetune.tuner.fabric_model.phases.layouts import runs_dense
from moetune.tuner.fabric_model.phases.nvlink import phase_nvlink
from moetune.tuner.fabric_model.phases.phase import Phase
from moetune.tuner.fabric_model.phases.queued import phase_queued, round_trips
from moetune.tuner.fabric_model.presets import Preset
from moetune.tuner.fabric_model.queue import run_queue
from moetune.tuner.fabric_model.records import Prediction, TransferPrediction, Workload
from moetune.tuner.fabric_model.wire_rows import route

__all__ = [
    "KNOBS_READ",
    "predict",
    "predict_transfers",
]

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
    # peer < num_sms groups signal, spread over num_sms CTAs: one round of signals (`nvlink_time`) whatever they are,
    # so no prediction changes with them (`model sweep --over group_size` says so); a model search asked them and
    # stored a tie's first value (decoupled, group_size 2) as the tuned MODELLED choice
    "nvlink": _PAYLOAD | {"num_sms"},
    "collective": _PAYLOAD | {"pipeline_depth", "channels"},
    # the copy engines move host_staged's bytes: no kernel of it reads num_sms (runtime/transports/host_staged.py)
    "host_staged": _PAYLOAD | {"chunk_tokens", "pipeline_depth"},
}


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
    preset = as_preset(preset)
    p = params(preset)
    if knobs.transport not in ("proxy", "ibgda"):
        raise KnobError("the transfer microbenchmark models queued transports (proxy, ibgda)", ("transport",))
    check_transport(preset, knobs)
    check_queued(preset, p, knobs)
    # counts, not amounts: 96.5 transfers were spread as such, True read as 1, a float node count failed in range()
    for name, v in (("nodes", nodes), ("transfers", transfers), ("size_bytes", size_bytes),
                    ("gpus_per_node", gpus_per_node), ("destinations", destinations)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    # None is "not given"; an explicit 0 is refused below (it fell to the preset's GPUs per node)
    gpn = preset.gpus_per_node if gpus_per_node is None else gpus_per_node
    if preset.max_nodes and nodes > preset.max_nodes:
        raise ValueError(f"preset {preset.name!r} has no network between nodes; use nodes=1")
    if nodes < 1 or transfers < 1 or size_bytes < 1 or gpn < 1:
        raise ValueError("nodes, transfers, size_bytes and gpus_per_node must be >= 1")
    if destinations is not None and destinations < 1:  # not "nodes >= 2": nodes is not what was wrong
        raise ValueError(f"destinations must be >= 1, got {destinations}")
    if not p.has_nic:
        raise ValueError(f"preset {preset.name!r} has no NIC to model transfers on")
    ndest = destinations if destinations is not None else (nodes - 1) * gpn
    if ndest < 1:
        raise ValueError("the microbenchmark needs at least one remote destination (nodes >= 2)")
    npes = nodes * gpn if destinations is None else ndest + 1
    per = [transfers // ndest + (1 if i < transfers % ndest else 0) for i in range(ndest)]
    rtts = round_trips(p, ndest)
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


def _expert_us(p: Params, w: Workload, loads) -> float:
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
    preset = as_preset(preset)
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
    check_transport(preset, knobs)
    p = params(preset)
    w = workload
    _check_runtime_takes(w, knobs, layout)
    loads, hits = route(w)
    if knobs.transport in ("proxy", "ibgda"):
        # the runtime's proxy takes any group size (a last partial group); the tile layout's groups must divide
        if layout == "expert_tiles":
            knobs.check_workload(expert_tiles_per_peer(w))
        check_queued(preset, p, knobs)
    if w.nodes > 1 and (not p.has_nic or (preset.max_nodes and w.nodes > preset.max_nodes)):
        raise ValueError(f"preset {preset.name!r} has no network between nodes; use nodes=1")
    phases_out: dict[str, float] = {}
    res: dict[str, Phase] = {}
    for name in ("dispatch", "combine"):
        if phase not in ("both", name):
            continue
        disp = name == "dispatch"
        if knobs.transport in ("proxy", "ibgda"):
            ph = phase_queued(p, w, knobs, dispatch=disp, loads=loads, hits=hits, t0=0.0, layout=layout)
        elif knobs.transport == "nvlink":
            ph = phase_nvlink(p, w, knobs, dispatch=disp, hits=hits)
        elif knobs.transport == "collective":
            ph = phase_collective(p, w, knobs, dispatch=disp, loads=loads, hits=hits, layout=layout)
        else:
            ph = phase_host_staged(p, w, knobs, dispatch=disp, loads=loads, hits=hits)
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
    elif knobs.transport in ("collective", "host_staged") and runs_dense(w, knobs):
        notes.append("dense layout: every capacity slot (S rows) to every rank, combine a reduce-scatter (the "
                     "runtime's layout " + ("chosen by its rule, runtime/buffer/layout_choice.py)" if w.dense is None
                                            else "asked for)"))
    else:
        notes.append("each token once per destination rank that holds one of its experts (the runtime's layout)")
    if DTYPES[w.model.dtype] > 2:  # `_expert_us` knows one compute rate: a GPU's fp32 rate is a fraction of it
        notes.append(f"expert FFN of a {w.model.dtype} model costed at the preset's bf16 rate (gpu.tflops_bf16; a "
                     "preset states no other): its expert and layer times are too small")
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
