"""The collective transport's phase: NCCL all-to-all calls (NVLink or staged, NIC) on communicators."""

from __future__ import annotations

import math

# MAX_COMM_CHANNELS (communicators per direction a pipelined payload is spread over) and the equal-chunk rule come
# from runtime/buffer/layout_choice.py, the torch-free module the EP buffer takes them from too
from moetune.runtime.buffer.layout_choice import MAX_COMM_CHANNELS
from moetune.runtime.knobs import Knobs
from moetune.tuner.fabric_model.params import Params
from moetune.tuner.fabric_model.phases.layouts import (
    bytes_out_in,
    layout_extras,
    payload_calls,
    runs_dense,
    wire_hits,
)
from moetune.tuner.fabric_model.phases.phase import Phase, staged_time
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.wire_rows import token_bytes


def _collective_call(p: Params, w: Workload, io: float, ii: float, eo: float, ei: float,
                     peers: int) -> tuple[float, float, float]:
    """One NCCL call moving io / ii bytes out / in over NVLink (or staged) and eo / ei over the NIC:
    (intra-node time, inter-node time, the call's time with its per-peer cost)."""
    if not (p.has_nvl and w.p2p):
        chunks = max(1, math.ceil(max(io, ii) / p.c_host_chunk))
        t_intra = p.c_host_alpha + staged_time(p, io, ii, chunks, 2, w.gpus_per_node)
    else:
        # launch, then the ranks' handshake and the data streaming overlap: the longer one counts
        t_intra = p.c_alpha + max(p.c_sync, max(io, ii) / p.c_intra)
    t_inter = 0.0
    if eo > 0 or ei > 0:
        t_inter = p.c_alpha + max(p.c_sync, max(eo, ei) / (p.nic_bw * p.c_nic_eff)) + p.rtt
    return t_intra, t_inter, max(t_intra, t_inter) + peers * p.c_peer


def _payload_floor(p: Params, w: Workload, io: float, ii: float, eo: float, ei: float, peers: int) -> float:
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


def phase_collective(p: Params, w: Workload, knobs: Knobs, *, dispatch: bool, loads, hits, layout: str) -> Phase:
    """NCCL all-to-all, intra-node over NVLink or staged, inter-node NIC: the runtime's rows (packed: once per
    destination rank; dense: every slot to every rank), posted as `payload_calls` calls over `channels`
    communicators, or with layout `nccl_k_copies` k bare copies per token in one call (the NCCL baseline's
    calls)."""
    ph = Phase()
    P, G = w.pes, w.gpus_per_node
    tb = token_bytes(w.model, knobs, dispatch=dispatch, layout=layout)
    dense = layout == "runtime" and runs_dense(w, knobs)
    out, inn, peers = bytes_out_in(w, loads, wire_hits(hits, dense), tb, dispatch,
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
        layout_extras(p, w, knobs, ph, hits, tb, dispatch=dispatch, dense=dense)
    return ph
