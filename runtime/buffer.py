"""EPBuffer: one object owning the EP communication state (DeepEP's shape).

    buf = EPBuffer(group, knobs, model=get_model("qwen3-30b"), max_tokens=4096)
    recv_x, recv_meta, handle = buf.dispatch(x, topk_idx, topk_weights)
    ...  # experts: one output row per received row (its local experts' outputs, weighted and summed)
    out = buf.combine(expert_out, handle)

Sharding: expert e lives on rank e // (E / world) as local expert e % (E / world).

Wire format. Each token travels once per destination *rank* (not once per expert): the row carries the
token's payload and its k routing slots (expert id, weight). Rows for a destination
are packed contiguously in rank order (rank-major `nonzero` of the token × rank mask: one gather, no
scatter, no argsort), so one `all_to_all_single` with split sizes moves them: one transfer per peer.
One row, all bytes (uint8):

    [payload: H × itemsize (bf16/fp32) or H fp8 bytes][int64 ids × k][fp32 weights × k]
    [fp32 scales (fp8 only)][padding to 16 bytes]

The k ids are the global expert ids as given (one gather, no per-destination select on the sender); the
receiver keeps the slots whose expert it holds (expert - rank × E/world in [0, E/world)) and ignores the rest.

Counts go first: every rank sends each peer, per pipeline chunk, [error code, rows, pairs per local
expert] in one small int64 all-to-all. That exchange doubles as the input check: a rank whose input is
wrong (shape, dtype, expert id out of range) reports its error code there instead of sending rows, and
every rank raises ValueError naming the offending rank and problem — no rank enters the payload
collective, none hangs. The counts come to the host once per dispatch (one `.tolist()`), and combine
reuses them (no second sync).

Combine: one row per received row goes back (the expert side has already summed its local experts per
(token, rank)); the source adds the rows of each token, one per rank that held its experts. Combine is
never compressed (activation dtype); with bf16 the per-token sum over ranks is accumulated in bf16.

Knobs used by the collective transport: compression / scale_granularity (fp8 dispatch), pipeline_depth
(tokens split into that many chunks, see pipeline.py) and channels (communicators per direction, chunks
round-robin over them; at most MAX_COMM_CHANNELS). chunk_tokens, signalling, fences, QPs and num_sms
belong to the one-sided transports and are ignored here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .fp8 import dequantise, fp8_available, num_scale_groups, quantise
from .knobs import KnobError, Knobs
from .shapes import ModelShape
from .transports.base import EPTransport
from .transports.registry import get_transport

TORCH_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Error codes carried in the counts exchange (column 0).
_ERRORS: dict[int, str] = {
    1: "x has the wrong shape",
    2: "x has the wrong dtype",
    3: "x is on the wrong device",
    4: "more tokens than max_tokens",
    5: "topk_idx has the wrong shape",
    6: "topk_idx has the wrong dtype (needs an integer tensor)",
    7: "topk_weights has the wrong shape",
    8: "topk_weights has the wrong dtype (needs a floating-point tensor)",
    9: "topk_idx/topk_weights on the wrong device",
    10: "topk_idx holds expert ids out of range",
}
_RANGE_ERROR = 10
MAX_COMM_CHANNELS = 8  # communicators per direction the collective transport spreads chunks over


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _nonzero_rows(mask: torch.Tensor, size: int) -> torch.Tensor:
    """nonzero() of a bool matrix with a known count (no device sync where torch allows it)."""
    if hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=size)
        except (RuntimeError, NotImplementedError):
            pass
    return torch.nonzero(mask)


class RecvMeta:
    """What arrived with the rows. M rows; k = model top-k.

    local_expert_ids: int64 [M, k], the slot's expert id on this rank (0..E/world-1) or -1 when that slot's
      expert lives on another rank. weights: float32 [M, k] (0 where the id is -1). Both are computed on
      first use from the raw wire columns (`raw_ids`, `raw_weights`).
    tokens_per_expert: (row, expert) pairs per local expert (host ints; also `.tokens_per_expert_tensor`).
    rows_per_rank: rows received from each source rank. num_pairs: sum(tokens_per_expert).
    """

    def __init__(self, raw_ids: torch.Tensor, raw_weights: torch.Tensor, tokens_per_expert: list[int],
                 rows_per_rank: list[int], first_expert: int = 0):
        self.raw_ids = raw_ids  # global expert ids as sent
        self.first_expert = first_expert
        self.raw_weights = raw_weights
        self.tokens_per_expert = tokens_per_expert
        self.rows_per_rank = rows_per_rank
        self.num_pairs = sum(tokens_per_expert)
        self._valid: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        if self._valid is None:
            n_local = len(self.tokens_per_expert)
            self._valid = (self.raw_ids >= self.first_expert) & (self.raw_ids < self.first_expert + n_local)
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
        n_local = len(self.tokens_per_expert)
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

    def release_inputs(self) -> None:
        self._x = self._idx = self._w = self._mask = None


class EPBuffer:
    """Dispatch/combine over the ranks of `group` with the knobs' transport (DESIGN §1–2).

    Construction is collective (every rank of the group, same arguments): ranks compare model, dtype,
    max_tokens and knob digest, and raise ValueError on every rank when they differ.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        knobs: Knobs | None = None,
        *,
        model: ModelShape,
        max_tokens: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        check_inputs: bool = True,
    ):
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if device is None:
            backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = model
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.dtype = dtype if dtype is not None else TORCH_DTYPES[model.dtype]
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"activation dtype must be bfloat16, float16 or float32, got {self.dtype}")
        if model.experts % self.world:
            raise ValueError(f"{model.experts} experts cannot be split evenly over {self.world} ranks")
        if knobs is None:
            from .autoload import autoload_knobs

            knobs = autoload_knobs(model=model, ep_size=self.world, nodes=1, max_tokens=self.max_tokens, device=self.device)
        self.knobs = knobs
        if knobs.compression == "fp8_e4m3":
            if not fp8_available():
                raise KnobError("this torch build has no float8_e4m3fn", ("compression",))
            try:
                num_scale_groups(model.hidden, knobs.scale_granularity)
            except ValueError as e:
                raise KnobError(str(e), ("scale_granularity",)) from None
        self.check_inputs = check_inputs
        self.experts_per_rank = model.experts // self.world
        self.topk = model.topk
        self.hidden = model.hidden
        self.num_chunks = knobs.pipeline_depth
        self._layout()
        self._agree()
        # `channels`: communicators the chunks of one direction are spread over (round-robin by chunk);
        # with pipelining, combine gets its own set so it travels while later dispatch chunks still move.
        self.comm_channels = min(knobs.channels, MAX_COMM_CHANNELS)
        n_groups = self.comm_channels * (2 if self.num_chunks > 1 else 1)
        cls = get_transport(knobs.transport)
        if hasattr(cls, "exchange_async"):
            self.transport: EPTransport = cls(group, knobs, self.device, channels=n_groups)
        else:
            self.transport = cls(group, knobs, self.device)
        self._fast = hasattr(self.transport, "exchange_async") and hasattr(self.transport, "exchange_blocks")
        self._one = torch.ones(1, dtype=torch.int64, device=self.device)

    # -- layout of one wire row ---------------------------------------------------------------------
    def _layout(self) -> None:
        h, k = self.hidden, self.topk
        self.fp8 = self.knobs.compression == "fp8_e4m3"
        if self.fp8:
            self.scale_groups = num_scale_groups(h, self.knobs.scale_granularity)
            self.payload_bytes = h
        else:
            self.scale_groups = 0
            self.payload_bytes = h * torch.empty((), dtype=self.dtype).element_size()
        self.id_off = _align(self.payload_bytes, 8)
        self.weight_off = self.id_off + 8 * k
        self.scale_off = self.weight_off + 4 * k
        self.row_bytes = _align(self.scale_off + 4 * self.scale_groups, 16)

    @property
    def wire_bytes_per_row(self) -> int:
        return self.row_bytes

    def _agree(self) -> None:
        """Every rank must run the same setting (the row size and count layout depend on it)."""
        if self.world == 1 or not dist.is_initialized():
            return
        digest = int(self.knobs.digest()[:15], 16)
        mine = torch.tensor(
            [digest, self.model.hidden, self.model.intermediate, self.model.experts, self.model.topk,
             self.max_tokens, list(TORCH_DTYPES.values()).index(self.dtype)],
            dtype=torch.int64,
            device=self.device,
        )
        got = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(got, mine, group=self.group)
        rows = torch.stack(got).cpu().tolist()
        bad = [r for r, row in enumerate(rows) if row != rows[0]]
        if bad:
            names = ["knobs", "hidden", "intermediate", "experts", "topk", "max_tokens", "dtype"]
            diff = sorted({names[i] for r in bad for i in range(len(names)) if rows[r][i] != rows[0][i]})
            raise ValueError(f"EPBuffer: ranks {bad} differ from rank 0 in {', '.join(diff)}; every rank must "
                             "build the buffer with the same model, dtype, max_tokens and knobs")

    # -- input checks (host-side, no device sync) -----------------------------------------------------
    def _local_check(self, x: Any, topk_idx: Any, topk_weights: Any) -> tuple[int, str]:
        h, k = self.hidden, self.topk
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return 1, f"x must have shape [S, {h}] (hidden={h}), got {shape}"
        if x.dtype != self.dtype:
            return 2, f"x must have dtype {self.dtype}, got {x.dtype}"
        if x.device != self.device:
            return 3, f"x must be on {self.device}, got {x.device}"
        s = x.shape[0]
        if s > self.max_tokens:
            return 4, f"x has {s} tokens, more than max_tokens={self.max_tokens}"
        if not isinstance(topk_idx, torch.Tensor) or tuple(topk_idx.shape) != (s, k):
            shape = tuple(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__
            return 5, f"topk_idx must have shape [S, topk] = [{s}, {k}], got {shape}"
        if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
            return 6, f"topk_idx must be an integer tensor, got {topk_idx.dtype}"
        if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (s, k):
            shape = tuple(topk_weights.shape) if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__
            return 7, f"topk_weights must have shape [S, topk] = [{s}, {k}], got {shape}"
        if not topk_weights.dtype.is_floating_point:
            return 8, f"topk_weights must be a floating-point tensor, got {topk_weights.dtype}"
        if topk_idx.device != self.device or topk_weights.device != self.device:
            return 9, f"topk_idx/topk_weights must be on {self.device}, got {topk_idx.device}/{topk_weights.device}"
        return 0, ""

    # -- transport adapters -------------------------------------------------------------------------
    def _exchange_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        if self._fast:
            return self.transport.exchange_blocks(blocks)  # type: ignore[attr-defined]
        w = self.world
        ones = torch.ones(w, dtype=torch.int64, device=blocks.device)
        out = self.transport.exchange(blocks.reshape(w, -1).contiguous(), ones, ones)
        return out[:w].reshape(blocks.shape)

    def _post(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], out: torch.Tensor, channel: int):
        if self._fast:
            _, work = self.transport.exchange_async(send, send_splits, recv_splits, out, channel=channel)  # type: ignore[attr-defined]
            return work
        got = self.transport.exchange(
            send,
            torch.tensor(send_splits, dtype=torch.int64, device=send.device),
            torch.tensor(recv_splits, dtype=torch.int64, device=send.device),
        )
        out.copy_(got[: out.shape[0]])
        return None

    # -- dispatch -------------------------------------------------------------------------------------
    def plan(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Handle:
        """Check the inputs on every rank and exchange the counts (the one host sync of a dispatch).

        Kept to a dozen small kernels and no hidden syncs (no bincount/nonzero: they sync on CUDA).
        """
        w, e, epr, n_chunks = self.world, self.model.experts, self.experts_per_rank, self.num_chunks
        code, msg = self._local_check(x, topk_idx, topk_weights)
        width = 2 + epr
        s = x.shape[0] if code == 0 else 0
        cs = max(1, math.ceil(s / n_chunks))
        idx = wts = mask = None
        if code == 0:
            idx = topk_idx if topk_idx.dtype == torch.int64 else topk_idx.to(torch.int64)
            wts = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
            # ids out of range (< 0 or >= E) all land in bucket E: counted, never indexed
            key = idx.clamp(-1, e).remainder(e + 1)
            rank_key = torch.div(key, epr, rounding_mode="floor")  # W = the bad bucket
            mask = torch.zeros(n_chunks * cs, w + 1, dtype=torch.bool, device=self.device)
            mask[:s].scatter_(1, rank_key, True)
            rows = mask.view(n_chunks, cs, w + 1).sum(1)  # [chunks, W+1]
            if n_chunks > 1:
                chunk_id = torch.div(torch.arange(s, device=self.device), cs, rounding_mode="floor")
                key = key + chunk_id.unsqueeze(1) * (e + 1)
            cnt = torch.zeros(n_chunks * (e + 1), dtype=torch.int64, device=self.device)
            flat = key.reshape(-1)
            cnt.scatter_add_(0, flat, self._one.expand(flat.shape[0]))
            cnt = cnt.view(n_chunks, e + 1)
            nbad = cnt[:, e].reshape(1, n_chunks, 1).expand(w, n_chunks, 1)  # bad ids per chunk
            counts = torch.cat(
                [nbad, rows[:, :w].t().unsqueeze(2), cnt[:, :e].view(n_chunks, w, epr).permute(1, 0, 2)], dim=2
            )
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
        my_code = peer_codes[self.rank]
        if any(peer_codes.values()):
            if my_code == _RANGE_ERROR and idx is not None:
                bad_vals = idx[(idx < 0) | (idx >= e)]
                msg = (f"topk_idx holds expert ids out of range [0, {e}): found {bad_vals.numel()} bad ids "
                       f"(min {int(bad_vals.min())}, max {int(bad_vals.max())})")
            others = [f"rank {r}: {_ERRORS.get(c, f'error {c}')}" for r, c in peer_codes.items() if c and r != self.rank]
            text = f"EPBuffer.dispatch on rank {self.rank}: "
            text += msg if my_code else "invalid input on another rank"
            if others:
                text += "; reported by " + "; ".join(others)
            raise ValueError(text)
        chunks: list[_Chunk] = []
        off = 0
        for c in range(n_chunks):
            t0, t1 = min(c * cs, s), min((c + 1) * cs, s)
            send_splits = [send_h[d * n_chunks + c][1] for d in range(w)]
            base = [(r * n_chunks + c) * width for r in range(w)]
            recv_splits = [recv_h[b + 1] for b in base]
            ppe = [sum(recv_h[b + 2 + j] for b in base) for j in range(epr)]
            chunks.append(_Chunk(t0, t1, send_splits, recv_splits, off, ppe))
            off += sum(recv_splits)
        handle = Handle(s, self.hidden, self.dtype, self.device, chunks, off, x, idx, wts, mask)
        handle._recv_buf = torch.empty(off, self.row_bytes, dtype=torch.uint8, device=self.device)
        return handle

    def pack(self, handle: Handle, c: int) -> torch.Tensor:
        """Build chunk c's send rows (grouped by destination rank, rank order): one gather per column block,
        written straight into the wire rows."""
        ch = handle.chunks[c]
        n = sum(ch.send_splits)
        send = torch.empty(n, self.row_bytes, dtype=torch.uint8, device=self.device)
        if n == 0:
            ch.send_tok = torch.empty(0, dtype=torch.int64, device=self.device)
            return send
        # rank-major (dest, token) pairs: rows for rank 0 first, then rank 1, ...
        pairs = _nonzero_rows(handle._mask[ch.t0 : ch.t1, : self.world].t(), n)
        tok_local = pairs[:, 1].contiguous()  # one tiny copy: index kernels get a dense index
        tok = tok_local + ch.t0 if ch.t0 else tok_local
        ch.send_tok = tok
        x = handle._x
        if self.fp8:
            # quantise each token of the chunk once, then gather the fp8 rows and their scales
            q, scales = quantise(x[ch.t0 : ch.t1], self.knobs.scale_granularity)
            torch.index_select(q, 0, tok_local, out=send[:, : self.payload_bytes])
            sv = send[:, self.scale_off : self.scale_off + 4 * self.scale_groups].view(torch.float32)
            torch.index_select(scales, 0, tok_local, out=sv)
        else:
            torch.index_select(x, 0, tok, out=send[:, : self.payload_bytes].view(self.dtype))
        k = self.topk
        torch.index_select(handle._idx, 0, tok, out=send[:, self.id_off : self.id_off + 8 * k].view(torch.int64))
        torch.index_select(handle._w, 0, tok, out=send[:, self.weight_off : self.weight_off + 4 * k].view(torch.float32))
        return send

    def post_dispatch(self, handle: Handle, c: int, send: torch.Tensor):
        ch = handle.chunks[c]
        out = handle._recv_buf[ch.recv_offset : ch.recv_offset + ch.recv_rows]
        return self._post(send, ch.send_splits, ch.recv_splits, out, channel=c % self.comm_channels)

    def unpack(self, handle: Handle, c: int | None = None) -> tuple[torch.Tensor, RecvMeta]:
        """Received rows of chunk c (all chunks when None) as (recv_x, RecvMeta); views, no copies
        (except the fp8 dequantisation)."""
        if c is None:
            a, b = 0, handle.num_recv
            chunks = handle.chunks
        else:
            ch = handle.chunks[c]
            a, b = ch.recv_offset, ch.recv_offset + ch.recv_rows
            chunks = [ch]
        rb = handle._recv_buf[a:b]
        if self.fp8:
            scales = rb[:, self.scale_off : self.scale_off + 4 * self.scale_groups].view(torch.float32)
            recv_x = dequantise(rb[:, : self.payload_bytes], scales, self.dtype)
        else:
            recv_x = rb[:, : self.payload_bytes].view(self.dtype)
        k = self.topk
        ids = rb[:, self.id_off : self.id_off + 8 * k].view(torch.int64)
        wts = rb[:, self.weight_off : self.weight_off + 4 * k].view(torch.float32)
        tpe = [sum(ch.pairs_per_expert[j] for ch in chunks) for j in range(self.experts_per_rank)]
        rpr = [sum(ch.recv_splits[r] for ch in chunks) for r in range(self.world)]
        return recv_x, RecvMeta(ids, wts, tpe, rpr, first_expert=self.rank * self.experts_per_rank)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, RecvMeta, Handle]:
        """Send each token once to every rank holding one of its top-k experts.

        x [S, H] (the buffer's dtype, S <= max_tokens), topk_idx int [S, k] global expert ids,
        topk_weights float [S, k]. Returns recv_x [M, H] (rows grouped by source rank; with pipeline_depth
        chunks: by chunk, then source rank), RecvMeta and the handle for combine. Raises ValueError on
        every rank when any rank's input is wrong (before any payload moves).

        Without compression recv_x is a view into the receive buffer (no copy; its rows are strided by the
        wire row size): use it as is for index_select/matmul, or call .contiguous() for a dense tensor.
        """
        handle = self.plan(x, topk_idx, topk_weights)
        works = []
        for c in range(len(handle.chunks)):
            send = self.pack(handle, c)
            works.append((self.post_dispatch(handle, c, send), send))
        for work, _ in works:
            if work is not None:
                work.wait()
        handle.release_inputs()
        recv_x, meta = self.unpack(handle)
        return recv_x, meta, handle

    # -- combine --------------------------------------------------------------------------------------
    def _check_combine(self, expert_out: Any, handle: Handle, rows: int) -> None:
        problem = ""
        if not isinstance(handle, Handle):
            problem = f"handle must be the Handle returned by dispatch, got {type(handle).__name__}"
        elif not isinstance(expert_out, torch.Tensor) or tuple(expert_out.shape) != (rows, handle.hidden):
            shape = tuple(expert_out.shape) if isinstance(expert_out, torch.Tensor) else type(expert_out).__name__
            problem = f"expert_out must have shape [{rows}, {handle.hidden}] (one row per received row), got {shape}"
        elif expert_out.dtype != handle.dtype:
            problem = f"expert_out must have dtype {handle.dtype}, got {expert_out.dtype}"
        elif expert_out.device != handle.device:
            problem = f"expert_out must be on {handle.device}, got {expert_out.device}"
        if self.check_inputs and self.world > 1 and dist.is_initialized():
            # One tiny agreement so that a wrong input on one rank is an error on every rank, not a hang.
            flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=self.device)
            got = [torch.empty_like(flag) for _ in range(self.world)]
            dist.all_gather(got, flag, group=self.group)
            bad = [r for r, t in enumerate(torch.cat(got).tolist()) if t]
            if bad and not problem:
                raise ValueError(f"EPBuffer.combine on rank {self.rank}: invalid expert_out on rank(s) {bad}")
        if problem:
            raise ValueError(f"EPBuffer.combine on rank {self.rank}: {problem}")

    def post_combine(self, handle: Handle, c: int, rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Send chunk c's expert output rows back (the reverse of its dispatch)."""
        ch = handle.chunks[c]
        rows = rows.contiguous()
        out = torch.empty(sum(ch.send_splits), handle.hidden, dtype=handle.dtype, device=handle.device)
        channel = c % self.comm_channels + (self.comm_channels if self.num_chunks > 1 else 0)
        return out, self._post(rows, ch.recv_splits, ch.send_splits, out, channel=channel)

    @staticmethod
    def finish_combine(handle: Handle, received: list[tuple[torch.Tensor, Any]]) -> torch.Tensor:
        """Wait for every chunk's rows and add each token's rows (one per rank that held its experts)."""
        out = torch.zeros(handle.num_tokens, handle.hidden, dtype=handle.dtype, device=handle.device)
        for ch, (rows, work) in zip(handle.chunks, received, strict=True):
            if work is not None:
                work.wait()
            if rows.shape[0]:
                out.index_add_(0, ch.send_tok, rows)
        return out

    def combine(self, expert_out: torch.Tensor, handle: Handle) -> torch.Tensor:
        """expert_out [M, H]: one row per received row (that row's local experts' outputs, weighted by
        RecvMeta.weights and summed). Returns out [S, H]: for every token, the sum over its ranks."""
        self._check_combine(expert_out, handle, handle.num_recv if isinstance(handle, Handle) else 0)
        received = []
        for c, ch in enumerate(handle.chunks):
            received.append(self.post_combine(handle, c, expert_out[ch.recv_offset : ch.recv_offset + ch.recv_rows]))
        return self.finish_combine(handle, received)

    def close(self) -> None:
        self.transport.close()

    def __repr__(self) -> str:
        return (f"EPBuffer(world={self.world}, rank={self.rank}, model={self.model.name}, "
                f"transport={self.knobs.transport}, compression={self.knobs.compression}, "
                f"pipeline_depth={self.knobs.pipeline_depth}, row_bytes={self.row_bytes})")
