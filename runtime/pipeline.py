"""pipeline_depth: chunk i+1 travels while chunk i is computed.

The tokens of a dispatch are split into `pipeline_depth` contiguous chunks (the same count on every rank,
so the counts exchange stays one small collective for all chunks and one host sync; the dense layout
chunks the max_tokens slots and needs no counts and no sync at all; `agree`, for an expert_fn of the caller's,
adds one per chunk). Then:

    plan (counts for every chunk, one sync; the send rows of all chunks built by one gather)
    for each chunk: post its dispatch (a slice of the send rows)       # dispatch communicator(s)
    for each chunk: wait for its rows, run the experts on them, post its combine   # combine communicator(s)
    wait for the combines, add each token's rows

On GPUs the collectives run on the communicators' own CUDA streams (NCCL process groups, one per
channel; torch orders them against the compute stream with CUDA events when posting and in
`work.wait()`), so packing chunk i+1 and computing chunk i overlap with the transfers, and the combine of
chunk i travels on its own communicator while later dispatch chunks are still moving. On CPU/gloo the same
structure uses async work handles. pipeline_depth=1 is the plain sequence dispatch → experts → combine.
The `channels` knob spreads the chunks of each direction over that many communicators (round-robin), so
several chunks can be on the wire at once (useful where one communicator cannot fill the link, e.g. NCCL
staging through host memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moetune.runtime._args import check_flag
from moetune.runtime.buffer.facade import EPBuffer, Handle, RecvMeta, _calls_of

ExpertFn = Callable[[torch.Tensor, RecvMeta], torch.Tensor]


def pipelined_moe(
    buffer: EPBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, expert_fn: ExpertFn,
    *, agree: bool | None = None,
) -> torch.Tensor:
    """dispatch → expert_fn per chunk → combine, overlapped chunk by chunk. expert_fn(recv_x, meta) must
    return one row per received row (the row's local experts, weighted and summed), in the buffer's dtype, on its
    device. With `agree` (default: buffer.check_inputs), an expert_fn that raises or returns wrong rows on one rank
    is an error on every rank: one tiny all-gather and host sync per chunk, which stalls the host until that
    chunk's experts ran (less overlap). Without it, that rank raises alone. `MoELayer` passes agree=False: its own
    experts return one row per received row by construction, and the tuner measures the layer so.

    One call of the buffer from start to end: another thread's call of it meanwhile raises RuntimeError (later chunks'
    transfers still read the buffer's reused send rows while expert_fn runs on earlier ones)."""
    check_flag("agree", agree, "pipelined_moe: ", optional=True)  # agree="no" must not switch the check on
    with _calls_of(buffer, "pipelined_moe"):
        return _pipelined(buffer, x, topk_idx, topk_weights, expert_fn, agree)


def _pipelined(buffer: EPBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
               expert_fn: ExpertFn, agree: bool | None) -> torch.Tensor:
    agree = buffer.check_inputs if agree is None else agree
    if buffer.resident:  # one-sided transports: one exchange per direction, no host sync to overlap with
        recv_x, meta, h = buffer.dispatch(x, topk_idx, topk_weights)
        if not agree:  # combine's own check (once, with check_inputs)
            return buffer.combine(expert_fn(recv_x, meta), h)
        rows = _expert_rows(buffer, expert_fn, recv_x, meta, h, h.num_recv, [], agree)
        return buffer._combine_resident(rows, h)  # checked above on every rank: not twice
    handle = buffer.plan(x, topk_idx, topk_weights)
    n = len(handle.chunks)
    posted = []
    for c in range(n):
        send = buffer.pack(handle, c)
        posted.append((buffer.post_dispatch(handle, c, send), send))
    handle.release_inputs()
    received: list[tuple[torch.Tensor, Any]] = []
    for c in range(n):
        work, _send = posted[c]
        if work is not None:
            work.wait()
        recv_x, meta = buffer.unpack(handle, c)
        # on an error, the transfers every rank has posted (later dispatches, earlier combines) finish first
        pending = [w for w, _ in posted[c + 1 :]] + [w for _, w in received]
        rows = _expert_rows(buffer, expert_fn, recv_x, meta, handle, recv_x.shape[0], pending, agree)
        received.append(buffer.post_combine(handle, c, rows))
    return buffer.finish_combine(handle, received)


def _expert_rows(buffer: EPBuffer, expert_fn: ExpertFn, recv_x: torch.Tensor, meta: RecvMeta, handle: Handle,
                 rows: int, pending: list[Any], agree: bool) -> torch.Tensor:
    """expert_fn's output for one chunk, checked as combine checks expert_out (shape, dtype, device, requires grad
    in grad mode). With `agree` the ranks agree on whether any rank's expert_fn failed before this chunk's combine,
    so they all raise instead of the others waiting in it; `pending` (work every rank posted) finishes first, leaving the group usable."""
    failure: Exception | None = None
    out: Any = None
    try:
        out = expert_fn(recv_x, meta)
    except Exception as e:
        if not agree:
            raise
        failure = e
    problem = (f"expert_fn raised {type(failure).__name__}" if failure is not None
               else buffer._combine_problem(out, handle, rows, what="expert_fn's output"))
    bad = buffer._ranks_with_problem(bool(problem), agree)  # an explicit agree=True holds without check_inputs
    if not bad:
        return out
    error = failure or ValueError(f"pipelined_moe on rank {buffer.rank}: " + (
        problem or f"expert_fn failed or returned wrong rows on rank(s) {bad}"))
    try:
        for work in pending:
            if work is not None:
                work.wait()
    finally:
        raise error


def weighted_rows(recv_x: torch.Tensor, meta: RecvMeta) -> torch.Tensor:
    """An 'identity experts' expert_fn: each received row times the sum of its local weights (used to time
    the communication alone, and as a simple check that every weight arrives)."""
    return recv_x * meta.weights.sum(dim=1, keepdim=True).to(recv_x.dtype)
