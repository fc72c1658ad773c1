"""The collective transports' wire layouts (packed, dense): bytes, payload calls, the pieces around them."""

from __future__ import annotations

import itertools

import numpy as np

from moetune.runtime.buffer.layout_choice import equal_chunk_bounds, picks_dense
from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import DTYPES
from moetune.tuner.fabric_model.params import Params
from moetune.tuner.fabric_model.phases.phase import Phase, reduce_us
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.wire_rows import token_bytes


def runs_dense(w: Workload, knobs: Knobs) -> bool:
    """Whether a collective transport runs the dense layout: `Workload.dense`, or where it is None the runtime's
    own rule (runtime/buffer/layout_choice.py `picks_dense`, EPBuffer(dense=None) with max_tokens = S, as the
    tuner builds it), asked with the dispatch wire row."""
    if w.dense is not None:
        return w.dense
    return picks_dense(w.model.experts, w.model.topk, w.pes, w.tokens_per_gpu,
                       token_bytes(w.model, knobs, dispatch=True))


def wire_hits(hits, dense: bool):
    """P(a token's row goes to rank r) on the wire: the routing's `hits` in the packed layout; 1 for every rank
    in the dense layout, which sends every capacity slot (max_tokens = S rows) to every rank whatever the
    routing (runtime/buffer/_dense.py: dispatch an all-gather of the stage rows, combine a reduce-scatter of
    one row per received row)."""
    return np.ones_like(hits) if dense else hits


def bytes_out_in(w: Workload, loads, hits, tb: float, dispatch: bool, copies: bool) -> tuple[float, float, int]:
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


def _packed_counts_us(p: Params, w: Workload) -> float:
    """The packed layout's counts exchange: ONE NCCL all_to_all_single per dispatch call (runtime/buffer/
    _packed.py `_exchange_blocks` -> CollectiveTransport.exchange_blocks, which host_staged inherits: its counts
    never take the copy-engine staging), with next to no bytes: the collective's fixed costs on the path its
    payload call takes (NVLink / P2P, or staged through host memory, one tiny copy down and up, without it;
    a NIC round trip across nodes) plus its per-peer cost."""
    staged = not (p.has_nvl and w.p2p)
    intra = p.c_host_alpha + 2 * p.memcpy if staged else p.c_alpha + p.c_sync
    inter = p.c_alpha + p.c_sync + p.rtt if w.nodes > 1 else 0.0
    return max(intra, inter) + (w.pes - 1) * p.c_peer


def layout_extras(p: Params, w: Workload, knobs: Knobs, ph: Phase, hits, tb: float, *, dispatch: bool,
                  dense: bool) -> None:
    """The pieces around a collective transport's payload calls.

    Packed layout (runtime/buffer/_packed.py `_plan_packed`), dispatch: the counts go first in ONE small exchange
    per call whatever pipeline_depth (`_packed_counts_us`; the block to each rank holds every chunk's [error
    word, rows, rows per local expert], int64), then the host reads them (`.tolist()`, the one host sync of a
    dispatch) before any payload call is posted: `host_sync`, one small device-to-host copy (`pcie.memcpy_us`;
    the payload call's launch after it is already in its own alpha / launch). Combine reuses the counts (no
    exchange, no sync) and ends in the reduce over every returned row (index_add: the bytes of `reduce_us`).

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
    wire = wire_hits(hits, dense)
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
        ph.parts["reduce"] = red = reduce_us(p, w, wire, tb)
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


def _stage_us(p: Params, w: Workload, knobs: Knobs, tb: float) -> float:
    """Dispatch's stage write (runtime/buffer/facade.py `_write_stage`), both collective layouts, before anything
    is exchanged: the S tokens as wire rows (x read, one row of `tb` bytes written per token) at HBM speed, in
    three launches (payload, ids, weights copies) or one (fp8: the quantiser writes all of a row)."""
    S = w.tokens_per_gpu
    launches = 1 if knobs.compression == "fp8_e4m3" else 3
    return launches * p.launch + S * (w.model.hidden * DTYPES[w.model.dtype] + tb) / p.hbm


def _send_rows_us(p: Params, w: Workload, knobs: Knobs, tb: float) -> float:
    """The packed layout's send rows, built on the GPU before the counts exchange is posted on the same stream
    (runtime/buffer/_packed.py): the planning ops (`_PACKED_PLAN_OPS`, one launch each) and ONE gather of the
    stage rows in (chunk, rank, token) order whose order list is padded to its upper bound S x world (no host
    sync before the counts): S x world rows read and written at HBM speed, however few of them the routing
    needs (at EP 8 with top-8 of 128 experts about 2/3 are real rows, at EP 64 about 1/8)."""
    S = w.tokens_per_gpu
    ops = _PACKED_PLAN_OPS + (_PACKED_CHUNK_OPS if knobs.pipeline_depth > 1 else 0)
    return ops * p.launch + 2.0 * S * w.pes * tb / p.hbm


def _staged_sums_us(p: Params, w: Workload, calls: list[int]) -> list[float]:
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
