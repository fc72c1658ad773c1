"""The dense wire layout: every token slot of the capacity goes to every rank (no counts, no host sync).

The dispatch is one all-gather of the token rows, the combine one reduce-scatter (the sum over ranks happens
in the collective); see the EPBuffer module doc (runtime/buffer/facade.py) for when it pays.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moetune.runtime.buffer._meta import _RANGE_ERROR, Handle, _Chunk
from moetune.runtime.buffer.layout_choice import equal_chunk_bounds
from moetune.runtime.knobs import KnobError
from moetune.runtime.routing import comparable_ids
from moetune.runtime.transports.collective import _ALL_GATHER

if TYPE_CHECKING:
    from moetune.runtime.buffer.facade import EPBuffer

def _chunk_weights(n: int, weights: tuple[float, ...] = ()) -> list[float]:
    """Relative chunk sizes of the dense layout: equal, or the option chunk_weights (n positive numbers, for
    side-by-side measurements of uneven chunks; ignored with one chunk)."""
    if not weights or n == 1:
        return [1.0] * n
    if len(weights) != n:
        raise KnobError(f"the runtime option chunk_weights (MOETUNE_EP_CHUNK_WEIGHTS) has {len(weights)} weights, "
                        f"pipeline_depth is {n}: expected one positive number per pipeline chunk", ("pipeline_depth",))
    return list(weights)


def _dense_bounds(cap: int, n: int, weights: tuple[float, ...] = ()) -> list[int]:
    """Token boundaries of the dense layout's n chunks over cap slots (n + 1 values from 0 to cap)."""
    w = _chunk_weights(n, weights)
    if len(set(w)) == 1:
        return equal_chunk_bounds(cap, n)
    tot, acc, out = sum(w), 0.0, [0]
    for v in w:
        acc += v
        out.append(min(cap, round(cap * acc / tot)))
    return out


class _DenseLayout:
    """EPBuffer's dense-layout steps (a mixin: the state lives on the EPBuffer)."""

    def _dense_status(self: EPBuffer, status: torch.Tensor) -> list[int]:
        """Every rank's `status` (one int64: the dispatch's or the combine's input check), all-gathered beside its
        buffer's max_tokens on the EP group. The rows' all-gather that follows sends max_tokens rows per rank: ranks
        calling buffers of other sizes (a prefill buffer on some, a decode one on the others) would pair it with one of another size
        (gloo aborts the process, NCCL reads past the rows), so every rank raises here instead, naming them."""
        mine = torch.cat([status, torch.full((1,), self.max_tokens, dtype=torch.int64, device=self.device)])
        got = torch.empty(2 * self.world, dtype=torch.int64, device=self.device)
        if self.world > 1 and dist.is_initialized():
            # on the EP group, not through the transport: host_staged's copy-engine gather moves between one
            # buffer's staging rings only, so ranks on two buffers would never meet there (each waits until its
            # timeout); the group is every buffer's, as the packed layout's counts exchange is
            _ALL_GATHER(got, mine, group=self.group)
        else:
            got.copy_(mine)
        vals = got.tolist()
        caps = vals[1::2]
        other = [r for r, c in enumerate(caps) if c != self.max_tokens]
        if other:
            raise ValueError(f"EPBuffer on rank {self.rank}: rank(s) {other} called another EPBuffer (max_tokens "
                             f"{caps}, by rank) than this rank's (max_tokens {self.max_tokens}); every rank must call "
                             "the same buffer at the same step (a prefill buffer on some ranks, a decode one on the "
                             "others?)")
        return vals[0::2]

    def _plan_dense(self: EPBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Handle:
        """Dense layout: write the tokens into the reused send rows; no counts, no host sync (one tiny
        status all-gather and one sync when check_inputs is on)."""
        w, e = self.world, self.model.experts
        code, msg = self._local_check(x, topk_idx, topk_weights)
        if self.check_inputs:
            if code:
                st = torch.full((1,), -code, dtype=torch.int64, device=self.device)
            else:
                ids = comparable_ids(topk_idx)  # torch cannot compare uint16/32/64: read those as int64
                st = ((ids < 0) | (ids >= e)).sum().reshape(1).to(torch.int64)
            vals = self._dense_status(st)
            codes = {r: (-v if v < 0 else (_RANGE_ERROR if v > 0 else 0)) for r, v in enumerate(vals)}
            self._raise_errors(codes, msg, topk_idx if code == 0 else None)
        elif code:
            # unchecked mode: only this rank knows (the others wait in the collective until its timeout)
            raise ValueError(f"EPBuffer.dispatch on rank {self.rank}: {msg}")
        s, cap = x.shape[0], self.max_tokens
        self._write_stage(x, topk_idx, topk_weights, s)
        if self._stage_hi > s:  # rows a larger earlier dispatch filled: mark them empty again
            self._stage_views[1].narrow(0, s, self._stage_hi - s).fill_(-1)
        self._stage_hi = s
        chunks = []
        for c0, c1 in itertools.pairwise(self._dense_chunks):
            chunks.append(_Chunk(c0, c1, [c1 - c0] * w, [c1 - c0] * w, w * c0, []))
        handle = Handle(s, self.hidden, self.dtype, self.device, chunks, w * cap, dense=True, owner=id(self))
        handle._recv_buf = torch.empty(w * cap, self.row_bytes, dtype=torch.uint8, device=self.device)
        return handle
