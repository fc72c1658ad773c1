"""The packed wire layout (counts first): each token travels once per destination rank it needs.

Rows for a destination are packed contiguously in (chunk, rank) order, so one all-to-all with split sizes per
chunk moves them; the counts travel first in one small all-to-all that doubles as the input check (see the
EPBuffer module doc, runtime/buffer/facade.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moetune.runtime.buffer._meta import _RANGE_ERROR, Handle, _Chunk, _nonzero_rows
from moetune.runtime.buffer.layout_choice import equal_chunk_bounds, equal_chunk_size

if TYPE_CHECKING:
    from moetune.runtime.buffer.facade import EPBuffer


class _PackedLayout:
    """EPBuffer's packed-layout steps (a mixin: the state lives on the EPBuffer)."""

    def _plan_packed(self: EPBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Handle:
        """Packed layout: the counts exchange (the input check) and the send rows in (chunk, rank) order."""
        w, e, epr, n_chunks = self.world, self.model.experts, self.experts_per_rank, self.num_chunks
        code, msg = self._local_check(x, topk_idx, topk_weights)
        width = 2 + epr
        s = x.shape[0] if code == 0 else 0
        cs = equal_chunk_size(s, n_chunks)
        idx = tok_all = send_all = None
        if code == 0:
            idx = topk_idx if topk_idx.dtype == torch.int64 else topk_idx.to(torch.int64)
            # ids out of range (< 0 or >= E) all land in bucket E: counted, never indexed
            key = idx.clamp(-1, e).remainder_(e + 1)
            rank_key = torch.div(key, epr, rounding_mode="floor")  # W = the bad bucket
            mask = torch.zeros(n_chunks * cs, w + 1, dtype=torch.bool, device=self.device)
            mask[:s].scatter_(1, rank_key, True)
            mask3 = mask.view(n_chunks, cs, w + 1)
            rows = mask3.sum(1)  # [chunks, W+1]
            if n_chunks > 1:
                chunk_id = torch.div(torch.arange(s, device=self.device), cs, rounding_mode="floor")
                key = torch.add(key, chunk_id.unsqueeze(1), alpha=e + 1)
            cnt = torch.zeros(n_chunks * (e + 1), dtype=torch.int64, device=self.device)
            flat = key.reshape(-1)
            cnt.scatter_add_(0, flat, self._one.expand(flat.shape[0]))
            cnt = cnt.view(n_chunks, e + 1)
            nbad = cnt[:, e].reshape(1, n_chunks, 1).expand(w, n_chunks, 1)  # bad ids per chunk
            counts = torch.cat(
                [nbad, rows[:, :w].t().unsqueeze(2), cnt[:, :e].view(n_chunks, w, epr).permute(1, 0, 2)], dim=2
            )
            if s:
                # Everything the payload needs is queued before the sync below, so the GPU builds the send
                # rows while the host waits for the counts: token rows once (payload or fp8 + scale, ids,
                # weights), then ONE gather of them in (chunk, destination, token) order. The order list is
                # padded to its upper bound s*W (nonzero_static: no sync); the splits say how much is real.
                self._write_stage(x, topk_idx, topk_weights, s)
                pairs = _nonzero_rows(mask3[:, :, :w].permute(0, 2, 1), s * w)
                tok_all = torch.add(pairs[:, 2], pairs[:, 0], alpha=cs)  # token index of every send row
                send_all = self._send_rows(tok_all.shape[0])
                torch.index_select(self._stage, 0, tok_all, out=send_all)  # type: ignore[arg-type]
        else:
            counts = torch.zeros(w, n_chunks, width, dtype=torch.int64, device=self.device)
            counts[:, :, 0] = -code
        recv = self._exchange_blocks(counts)
        host = torch.cat([counts[:, :, :2].reshape(-1), recv.reshape(-1)]).tolist()
        nsend = w * n_chunks * 2
        send_h = [host[i : i + 2] for i in range(0, nsend, 2)]  # [(err, rows)] for (d, c)
        recv_h = host[nsend:]
        peer_err = {r: [recv_h[(r * n_chunks + c) * width] for c in range(n_chunks)] for r in range(w)}
        peer_codes = {r: (_RANGE_ERROR if max(v) > 0 else -min(v)) for r, v in peer_err.items()}
        self._raise_errors(peer_codes, msg, idx)
        chunks: list[_Chunk] = []
        off = soff = 0
        bounds = equal_chunk_bounds(s, n_chunks)
        for c in range(n_chunks):
            t0, t1 = bounds[c], bounds[c + 1]
            send_splits = [send_h[d * n_chunks + c][1] for d in range(w)]
            base = [(r * n_chunks + c) * width for r in range(w)]
            recv_splits = [recv_h[b + 1] for b in base]
            ppe = [sum(recv_h[b + 2 + j] for b in base) for j in range(epr)]
            n = sum(send_splits)
            ch = _Chunk(t0, t1, send_splits, recv_splits, off, ppe, send_offset=soff)
            if tok_all is not None:
                ch.send_tok = tok_all[soff : soff + n]
            chunks.append(ch)
            off += sum(recv_splits)
            soff += n
        handle = Handle(s, self.hidden, self.dtype, self.device, chunks, off, owner=id(self))
        handle.num_send = soff
        handle._send_all = send_all
        handle._send_tok = tok_all[:soff] if tok_all is not None else None
        handle._recv_buf = torch.empty(off, self.row_bytes, dtype=torch.uint8, device=self.device)
        return handle

    def _exchange_blocks(self: EPBuffer, blocks: torch.Tensor) -> torch.Tensor:
        if self._fast:
            return self.transport.exchange_blocks(blocks)
        w = self.world
        ones = torch.ones(w, dtype=torch.int64, device=blocks.device)
        out = self.transport.exchange(blocks.reshape(w, -1).contiguous(), ones, ones)
        return out[:w].reshape(blocks.shape)

    def _post(self: EPBuffer, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], out: torch.Tensor, channel: int):
        if self._fast:
            _, work = self.transport.exchange_async(send, send_splits, recv_splits, out, channel=channel)
            return work
        got = self.transport.exchange(
            send,
            torch.tensor(send_splits, dtype=torch.int64, device=send.device),
            torch.tensor(recv_splits, dtype=torch.int64, device=send.device),
        )
        out.copy_(got[: out.shape[0]])
        return None

    def _send_rows(self: EPBuffer, n: int) -> torch.Tensor:
        """The packed layout's send rows: a reused buffer of max_tokens × world rows (the most one dispatch
        can send: every token once to every rank). Safe to reuse: dispatch returns only after the current
        stream has waited for its payload transfers."""
        if self._send is None:
            self._send = torch.empty(self.max_tokens * self.world, self.row_bytes, dtype=torch.uint8, device=self.device)
        return self._send[:n]
