"""What a dispatch hands back and what combine needs: RecvMeta, Handle, and the wire's dtype tables.

Shared by every wire layout (runtime/buffer/_packed.py, _dense.py, _resident.py); nothing here talks to a
transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc's activation dtype codes

# Error codes carried in the counts exchange (column 0).
_ERRORS: dict[int, str] = {
    1: "x has the wrong shape or layout",
    2: "x has the wrong dtype",
    3: "x is on the wrong device",
    4: "more tokens than max_tokens",
    5: "topk_idx has the wrong shape or layout",
    6: "topk_idx has the wrong dtype (needs an integer tensor)",
    7: "topk_weights has the wrong shape or layout",
    8: "topk_weights has the wrong dtype (needs a floating-point tensor)",
    9: "topk_idx/topk_weights on the wrong device",
    10: "topk_idx holds expert ids out of range",
    11: "x or topk_weights requires grad in grad mode (dispatch is forward-only)",
    12: "the layer's weights are not what it was built with (that rank's error says which)",
    13: "the layer's parameters require grad in grad mode (the layer is forward-only)",
}
_RANGE_ERROR = 10
_GRAD_ERROR = 11
_LAYER_STATE_ERROR = 12  # a layer refused its own state before the dispatch (EPBuffer.refuse_dispatch)
_LAYER_GRAD_ERROR = 13  # a layer refused its parameters that require grad (EPBuffer.refuse_dispatch(grad=True))
# What a combine's input check sends in the slot where a dispatch's check sends its error code (negated, as those
# are): a rank that dispatches while another combines (out of step) pairs the two checks' collective and reads it
_COMBINE_OK = 100
_COMBINE_BAD = 101  # this rank's expert_out is refused
# runtime/routing.py's routed-input faults as the codes above (its ROUTED_FAULTS; a test checks they match)
_ROUTED_CODES: dict[str, int] = {"idx_shape": 5, "idx_dtype": 6, "weights_shape": 7, "weights_dtype": 8,
                                 "idx_device": 9, "weights_device": 9}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dense_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, contiguous (what the kernels read through raw pointers); no copy when it already is."""
    return (t if t.dtype == dtype else t.to(dtype)).contiguous()


def _nonzero_rows(mask: torch.Tensor, size: int, fill: int = 0) -> torch.Tensor:
    """nonzero() of a bool matrix with a known upper bound `size` on the count (no device sync where torch
    allows it); rows past the real count hold `fill` in every column."""
    if hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=size, fill_value=fill)
        except (RuntimeError, NotImplementedError):  # no kernel for this device in this torch build
            pass
    return torch.nonzero(mask)  # exact count, no padding: one host sync


def local_slots(raw_ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """bool [M, k]: which slots of received rows name an expert of this rank (first_expert .. + num_local - 1)."""
    n_local = max(1, num_local)
    if first_expert % n_local == 0:  # rank × E/world: one division tells the owner rank
        return torch.floor_divide(raw_ids, n_local) == first_expert // n_local
    return (raw_ids >= first_expert) & (raw_ids < first_expert + n_local)


class RecvMeta:
    """What arrived with the rows. M rows; k = model top-k.

    local_expert_ids: int64 [M, k], the slot's expert id on this rank (0..E/world-1) or -1 when that slot's
      expert lives on another rank. weights: float32 [M, k] (0 where the id is -1). Both are computed on
      first use from the raw wire columns (`raw_ids`, `raw_weights`).
    tokens_per_expert: (row, expert) pairs per local expert (host ints; also `.tokens_per_expert_tensor`).
      The packed layout knows them from the counts exchange; the dense layout counts them on the device
      on first use (that access is a host sync: the communication itself never needs it).
    rows_per_rank: rows received from each source rank. num_pairs: sum(tokens_per_expert).
    """

    def __init__(self, raw_ids: torch.Tensor, raw_weights: torch.Tensor, tokens_per_expert: list[int] | None,
                 rows_per_rank: list[int] | torch.Tensor, first_expert: int = 0, num_local: int | None = None,
                 live_counts: torch.Tensor | None = None):
        # device-resident layout: rows at or past sum(live_counts) (device counts per source rank) are stale
        # buffer contents; on first use of the ids their ids become -1 (no local expert), so every property
        # ignores them with no host sync (and a dispatch whose metadata is never read pays nothing for it)
        self._raw_ids = raw_ids  # global expert ids as sent
        self._live_counts = live_counts
        self.first_expert = first_expert
        self.raw_weights = raw_weights
        self._tpe = tokens_per_expert
        self.num_local = num_local if num_local is not None else len(tokens_per_expert or [])
        self._rows_per_rank = rows_per_rank
        self._valid: torch.Tensor | None = None

    @property
    def raw_ids(self) -> torch.Tensor:
        if self._live_counts is not None:
            ids = self._raw_ids
            live = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) < self._live_counts.sum()
            self._raw_ids, self._live_counts = torch.where(live, ids, -1), None
        return self._raw_ids

    @property
    def rows_per_rank(self) -> list[int]:
        """Rows received from each source rank (device-resident layout: a host sync on first access)."""
        if isinstance(self._rows_per_rank, torch.Tensor):
            self._rows_per_rank = [int(v) for v in self._rows_per_rank.tolist()]
        return self._rows_per_rank

    @property
    def tokens_per_expert(self) -> list[int]:
        if self._tpe is None:
            n = self.num_local
            ids = self.raw_ids - self.first_expert
            key = ids.clamp_(-1, n).remainder_(n + 1).reshape(-1)  # not on this rank -> bucket n
            cnt = torch.zeros(n + 1, dtype=torch.int64, device=key.device)
            cnt.scatter_add_(0, key, torch.ones(1, dtype=torch.int64, device=key.device).expand(key.shape[0]))
            self._tpe = cnt[:n].tolist()
        return self._tpe

    @property
    def num_pairs(self) -> int:
        return sum(self.tokens_per_expert)

    @property
    def valid(self) -> torch.Tensor:
        if self._valid is None:
            self._valid = local_slots(self.raw_ids, self.first_expert, self.num_local)
        return self._valid

    @property
    def local_expert_ids(self) -> torch.Tensor:
        return torch.where(self.valid, self.raw_ids - self.first_expert, -1)

    @property
    def weights(self) -> torch.Tensor:
        return torch.where(self.valid, self.raw_weights, 0.0)

    @property
    def tokens_per_expert_tensor(self) -> torch.Tensor:
        return torch.tensor(self.tokens_per_expert, dtype=torch.int64).to(self.raw_ids.device, non_blocking=True)

    def expert_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, weight) of every (received row, local expert) pair, sorted by local expert: row int64 [P]
        indexes recv_x, weight float32 [P]; expert j's pairs are the j-th block of `tokens_per_expert`."""
        ids = self.raw_ids - self.first_expert
        k = ids.shape[1]
        n_local = self.num_local
        # every slot not on this rank (local id < 0 or >= n_local) sorts last, behind the num_pairs real pairs
        key = ids.clamp_(-1, n_local).remainder_(n_local + 1).reshape(-1)
        order = torch.argsort(key, stable=True)[: self.num_pairs]
        rows = torch.div(order, k, rounding_mode="floor")
        return rows, self.raw_weights.reshape(-1).index_select(0, order)


@dataclass
class _Chunk:
    t0: int
    t1: int
    send_splits: list[int]
    recv_splits: list[int]
    recv_offset: int
    pairs_per_expert: list[int]  # received (row, local expert) pairs per local expert
    send_tok: torch.Tensor | None = None  # token index (into x) of every sent row, in send order
    send_offset: int = 0  # first row of this chunk in the dispatch's send rows

    @property
    def recv_rows(self) -> int:
        return sum(self.recv_splits)


@dataclass
class Handle:
    """Everything combine needs to send the rows back (opaque to users)."""

    num_tokens: int
    hidden: int
    dtype: torch.dtype
    device: torch.device
    chunks: list[_Chunk]
    num_recv: int
    # dispatch-time state used while packing (dropped after the last chunk is packed)
    _x: Any = field(default=None, repr=False)
    _idx: Any = field(default=None, repr=False)
    _w: Any = field(default=None, repr=False)
    _mask: Any = field(default=None, repr=False)
    _recv_buf: Any = field(default=None, repr=False)
    dense: bool = False  # dense layout: every token slot of the capacity goes to every rank (see EPBuffer)
    _combine_out: Any = field(default=None, repr=False)
    num_send: int = 0  # packed layout: rows sent (all chunks)
    _send_all: Any = field(default=None, repr=False)  # packed layout: the send rows of all chunks
    _send_tok: Any = field(default=None, repr=False)  # packed layout: token index of every send row
    # device-resident layout (one-sided transports): counts stay on the GPU
    resident: bool = False
    _send_counts: Any = field(default=None, repr=False)  # int64 [world] rows sent to each rank (device)
    _recv_counts: Any = field(default=None, repr=False)  # int64 [world] rows received from each rank (device)
    _inv: Any = field(default=None, repr=False)  # int64 [S, world]: send row of (token, rank) or -1 (kernels)
    owner: int = field(default=0, repr=False)  # id() of the EPBuffer whose dispatch made it: combine checks it

    def send_splits(self) -> list[int]:
        """Rows this rank sent to each rank in the dispatch (device-resident layout: a host sync)."""
        if self.resident:
            return [int(v) for v in self._send_counts.tolist()]
        w = len(self.chunks[0].send_splits) if self.chunks else 0
        return [sum(ch.send_splits[d] for ch in self.chunks) for d in range(w)]

    def release_inputs(self) -> None:
        self._x = self._idx = self._w = self._mask = None
