"""The device-resident wire layout (one-sided transports, nvlink and proxy): no count reaches the host.

A plan kernel orders the rows for each rank (rank, token), padded to S x world (csrc/ep_pack.cu); the
transport reads the per-rank counts on the GPU and returns the counts it received; combine goes back along the
same paths and one kernel adds each token's rows in rank order (see the EPBuffer module doc).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moetune.runtime import csrc_build
from moetune.runtime.buffer._meta import (
    _DTYPE_CODE,
    _RANGE_ERROR,
    Handle,
    RecvMeta,
    _Chunk,
    _dense_as,
    _nonzero_rows,
)
from moetune.runtime.routing import comparable_ids

if TYPE_CHECKING:
    from moetune.runtime.buffer.facade import EPBuffer


class _ResidentLayout:
    """EPBuffer's device-resident steps (a mixin: the state lives on the EPBuffer)."""

    def _plan_resident(self: EPBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Handle:
        """Device-resident layout (one-sided transports): the packed rows, with every count kept on the GPU.

        The rows bound for each rank are ordered (rank, token), padded to the upper bound S x world; they are
        packed into the reused send buffer, or (nvlink) built from the tokens by the exchange kernel itself.
        The transport reads the per-rank counts on the GPU,
        places the rows in the receivers' buffers at offsets it computes there, and hands back the counts
        it received. No host sync anywhere (check_inputs=False), so dispatch + combine can be captured in
        a CUDA graph. With check_inputs one tiny status exchange and its sync make a wrong input an error
        on every rank. The receiver sees a capacity-padded view (world x max_tokens rows, the live ones
        first); RecvMeta hides the stale rows.
        """
        w, e = self.world, self.model.experts
        code, msg = self._local_check(x, topk_idx, topk_weights)
        if self.check_inputs:
            # the status travels as a count (the error code itself, 0 when none): the one-sided counts exchange
            # refuses a count outside 0..2^39-1 (csrc/mt_common.h count_word), and a refused one arrives as 0 rows
            if code:
                st = torch.full((w,), code, dtype=torch.int64, device=self.device)
            else:
                ids = comparable_ids(topk_idx)  # torch cannot compare uint16/32/64: read those as int64
                bad = ((ids < 0) | (ids >= e)).any().reshape(1).to(torch.int64)
                st = (bad * _RANGE_ERROR).expand(w).contiguous()
            got = self.transport.exchange_counts(st)
            codes = dict(enumerate(got.tolist()))
            self._raise_errors(codes, msg, topk_idx if code == 0 else None)
        elif code:
            raise ValueError(f"EPBuffer.dispatch on rank {self.rank}: {msg}")
        s = x.shape[0]
        idx = _dense_as(topk_idx, torch.int64)
        if self._pack_lib is not None:  # the kernels read fp32 weights
            topk_weights = _dense_as(topk_weights, torch.float32)
        inv = None
        if self._pack_lib is not None:
            send, tok, send_counts, inv = self._pack_fused(x, idx, topk_weights, s)
        else:
            send, tok, send_counts = self._pack_torch(x, idx, topk_idx, topk_weights, s)
        handle = Handle(s, self.hidden, self.dtype, self.device, [_Chunk(0, s, [], [], 0, [])], w * self.max_tokens,
                        resident=True, owner=id(self))
        handle._send_all = send
        handle._send_tok = tok
        handle._send_counts = send_counts
        handle._inv = inv
        if self._gather:  # the exchange reads the tokens themselves
            handle._x, handle._idx, handle._w = x, idx, topk_weights
        return handle

    def _pack_torch(self: EPBuffer, x: torch.Tensor, idx: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The resident layout's packing with torch ops: (send rows [S*world, row_bytes], token of each row
        padded with S, rows per rank)."""
        w, e, epr = self.world, self.model.experts, self.experts_per_rank
        # ids out of range land in bucket E -> "rank" w: counted nowhere, never sent
        rank_key = torch.div(idx.clamp(-1, e).remainder_(e + 1), epr, rounding_mode="floor")
        mask = torch.zeros(s, w + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(1, rank_key, True)
        need = mask[:, :w]
        send_counts = need.sum(0)  # int64 [w]
        self._write_stage(x, topk_idx, topk_weights, s)
        # (rank, token) pairs, rank-major, padded to S x world with token s: the stage's spare row when
        # sending (never sent: the counts stop short of it) and the output's spare row in combine
        tok = _nonzero_rows(need.t(), s * w, fill=s)[:, 1]
        send = self._send_rows(tok.shape[0])  # S x world, or the exact count where torch lacks nonzero_static
        if s:
            torch.index_select(self._stage, 0, tok, out=send)  # type: ignore[arg-type]
        return send, tok, send_counts

    def _pack_fused(self: EPBuffer, x: torch.Tensor, idx: torch.Tensor, topk_weights: torch.Tensor,
                    s: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same packing in two launches (csrc/ep_pack.cu): plan (counts, token order and the inverse
        map combine reduces with) and rows (the wire rows written straight from x, ids and weights; no
        stage copy). With a gathering transport (nvlink) only the plan: send is None. idx int64 and
        topk_weights fp32, both contiguous."""
        w, lib = self.world, self._pack_lib
        tok = torch.empty(s * w, dtype=torch.int64, device=self.device)
        inv = torch.empty(s, w, dtype=torch.int64, device=self.device)
        send_counts = torch.empty(w, dtype=torch.int64, device=self.device)
        scratch = torch.empty(max(1, lib.mt_pack_plan_scratch(s, w)), dtype=torch.int32, device=self.device)
        stream = self._stream()
        rc = lib.mt_pack_plan(idx.data_ptr(), s, self.topk, self.model.experts, w, tok.data_ptr(),
                              send_counts.data_ptr(), inv.data_ptr(), scratch.data_ptr(), self.options.plan_mode, stream)
        csrc_build.check(lib, rc, "EP packing")
        if self._gather:
            return None, tok, send_counts, inv
        x = x.contiguous()
        send = self._send_rows(s * w)
        if s:
            rc = lib.mt_pack_rows(x.data_ptr(), self.payload_bytes, idx.data_ptr(), topk_weights.data_ptr(), s,
                                  self.topk, s * w, tok.data_ptr(), send.data_ptr(), self.row_bytes, self.id_off,
                                  self.weight_off, stream)
            csrc_build.check(lib, rc, "EP packing")
        return send, tok, send_counts, inv

    def _dispatch_resident(self: EPBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
                           ) -> tuple[torch.Tensor, RecvMeta, Handle]:
        handle = self._plan_resident(x, topk_idx, topk_weights)
        t = self.transport
        send = handle._send_all
        if self._gather:  # nvlink: one launch places the counts and writes the rows from the tokens
            recv, recv_counts = t.dispatch_gather(
                handle._x, handle._send_tok, handle._idx, handle._w, handle._send_counts, row_bytes=self.row_bytes,
                id_off=self.id_off, weight_off=self.weight_off)
        elif t.fused_counts:  # nvlink: the counts travel inside the exchange (one launch)
            recv, recv_counts = t.exchange_fused(send, handle._send_counts)
        else:
            recv_counts = t.exchange_counts(handle._send_counts)
            recv = t.exchange(send, handle._send_counts, recv_counts)
        handle._recv_counts = recv_counts
        handle.release_inputs()
        rows = recv[: handle.num_recv]
        payload, ids, wts, _scales = self._row_views(rows)
        recv_x = self._dequant(rows) if self.fp8 else payload
        meta = RecvMeta(ids, wts, None, recv_counts, first_expert=self.rank * self.experts_per_rank,
                        num_local=self.experts_per_rank, live_counts=recv_counts)
        return recv_x, meta, handle

    def _combine_resident(self: EPBuffer, expert_out: torch.Tensor, handle: Handle) -> torch.Tensor:
        # back along the dispatch's paths: send what was received, receive what was sent (device counts);
        # nvlink reads strided rows in place (e.g. recv_x itself, a view into the receive buffer)
        t = self.transport
        if t.strided_combine:
            back = t.exchange_strided(expert_out, handle._recv_counts, handle._send_counts)
        else:
            back = t.exchange(expert_out.contiguous(), handle._recv_counts, handle._send_counts)
        if handle._inv is not None:  # one kernel: every token's rows summed in rank order
            return self._reduce(back, handle)
        n = handle._send_tok.shape[0]
        out = torch.zeros(handle.num_tokens + 1, handle.hidden, dtype=handle.dtype, device=handle.device)
        if n:
            out.index_add_(0, handle._send_tok, back[:n])
        return out[: handle.num_tokens]

    def _reduce(self: EPBuffer, back: torch.Tensor, handle: Handle) -> torch.Tensor:
        s, h = handle.num_tokens, handle.hidden
        out = torch.empty(s, h, dtype=handle.dtype, device=handle.device)
        if s:
            lib = self._pack_lib
            rc = lib.mt_combine_reduce(back.data_ptr(), back.stride(0), handle._inv.data_ptr(), s, self.world, h,
                                       _DTYPE_CODE[handle.dtype],
                                       out.data_ptr(), self._stream())
            csrc_build.check(lib, rc, "combine reduce")
        return out
