"""EPBuffer: one object owning the EP communication state (DeepEP's shape).

    buf = EPBuffer(group, knobs, model=get_model("qwen3-30b"), max_tokens=4096)
    recv_x, recv_meta, handle = buf.dispatch(x, topk_idx, topk_weights)
    ...  # experts: one output row per received row (its local experts' outputs, weighted and summed)
    out = buf.combine(expert_out, handle)

Sharding: expert e lives on rank e // (E / world) as local expert e % (E / world).

Three wire layouts: packed and dense for the collective transports, device-resident for the one-sided ones.

* packed (counts first): each token travels once per destination *rank* it needs (not once per expert).
  Rows for a destination are packed contiguously in (chunk, rank) order, so one `all_to_all_single` with
  split sizes per chunk moves them: one transfer per peer. Counts go first: every rank sends each peer,
  per pipeline chunk, [error code, rows, pairs per local expert] in one small int64 all-to-all. That
  exchange doubles as the input check: a rank whose input is wrong (shape, dtype, expert id out of range)
  reports its error code there instead of sending rows, and every rank raises ValueError naming the
  offending rank and problem — no rank enters the payload collective, none hangs. The counts come to the
  host once per dispatch (one `.tolist()`, the only host sync), and combine reuses them (no sync). All
  device work of a dispatch (token rows, the (chunk, rank, token) order via `nonzero_static` padded to
  its upper bound, one gather into the reused send buffer) is queued *before* that sync, so the GPU
  builds the rows while the host waits for the counts; after it the host only posts the transfers.
* dense (no counts): every token slot of the capacity (max_tokens) goes to every rank — the dispatch is one
  `all_gather` of the token rows, the combine one `reduce_scatter` (the sum over ranks happens in the
  collective). No counts exchange, no host sync, ~4 kernels per direction; slots a rank does not use carry
  expert id -1 and are ignored. It sends max_tokens rows per peer whatever S is, and rows of tokens with no
  expert on that peer: worth it when bytes are cheap (small S) or when nearly every token needs every rank
  anyway (2 ranks with top-4/8: 94-99.6 % of tokens). `EPBuffer(dense=None)` picks it when one dense send is
  <= DENSE_AUTO_MAX_BYTES per peer or the expected extra rows are <= DENSE_AUTO_MAX_WASTE (uniform routing);
  pass dense=False when S is usually far below max_tokens. With check_inputs the dense dispatch adds one
  tiny status all-gather (and its sync) so that wrong inputs are an error on every rank; without it, a
  wrong input raises on its own rank only (the others wait for the collective timeout).

One row, all bytes (uint8):

    [payload: H × itemsize (bf16/fp32) or H fp8 bytes][int64 ids × k][fp32 weights × k]
    [fp32 scales (fp8 only)][padding to 16 bytes]

The k ids are the global expert ids as given (one copy, no per-destination select on the sender); the
receiver keeps the slots whose expert it holds (expert - rank × E/world in [0, E/world)) and ignores the rest.

Combine: one row per received row goes back (the expert side has already summed its local experts per
(token, rank)); the source adds the rows of each token, one per rank that held its experts (packed: one
index_add over all chunks; dense: inside the reduce-scatter). Combine is never compressed (activation
dtype); with bf16 the per-token sum over ranks is accumulated in bf16. On a GPU, fp8 quantisation into the
rows and dequantisation are one launch each (csrc/ep_fp8.cu, the bytes of fp8.py's torch ops).

Knobs used by the collective transport: compression / scale_granularity (fp8 dispatch), pipeline_depth
(tokens split into that many chunks, see pipeline.py) and channels (communicators per direction, chunks
round-robin over them; at most MAX_COMM_CHANNELS); `host_staged` (copy engines through host memory) also
uses chunk_tokens, its staging message (rows of the wider direction per slot; see host_staged.py).
Signalling, fences, QPs and num_sms belong to the one-sided transports and are ignored here.

* device-resident (one-sided transports, nvlink and proxy): the packed rows, but no count ever reaches the
  host. A plan kernel orders the rows for each rank (rank, token), padded to S × world (csrc/ep_pack.cu);
  nvlink's exchange kernel builds each row from its token inside the receiver's buffer, proxy sends rows a
  second kernel packed (torch ops for fp8 or without the compiled library); the transport reads the per-rank
  counts on the GPU, computes the offsets in every receiver's buffer there and returns the counts it
  received; combine goes back along the same paths and one reduce kernel adds each token's rows in rank
  order in fp32 (torch path: index_add, the padding going to a spare output row). The receiver gets a capacity-padded
  view of its symmetric receive buffer, M = world × max_tokens rows with the live ones first; RecvMeta hides
  the stale rows. With check_inputs=False nothing syncs, so dispatch → experts → combine can be captured in
  a CUDA graph (nvlink; the proxy passes host state per call). pipeline_depth and channels do not apply.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moetune.runtime import csrc_build
from moetune.runtime.fp8 import dequantise, fp8_available, num_scale_groups, quantise_into
from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.shapes import ModelShape
from moetune.runtime.transports.base import EPTransport
from moetune.runtime.transports.registry import get_transport

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


# Automatic dense layout (EPBuffer(dense=None)): when one dispatch's dense send to a peer is at most this many
# bytes (latency-bound: the saved host sync and kernels matter more than bytes), or when uniform routing
# sends all but this fraction of the tokens to every rank anyway (e.g. 2 ranks with top-8).
DENSE_AUTO_MAX_BYTES = 2 << 20
DENSE_AUTO_MAX_WASTE = 0.10
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc's activation dtype codes
# the plan kernel's shape: 0 = by token count (one CTA for small S, a grid above), 1 = one CTA, 2 = grid;
# MOETUNE_PLAN_MODE picks one for side-by-side measurements
_PLAN_MODE = int(os.environ.get("MOETUNE_PLAN_MODE", "0") or 0)


def _combine_shares(cls: type, device: torch.device) -> bool:
    """Whether pipelined combines go on the dispatch communicators/lanes: the transport's preference
    (`combine_shares_lanes(device)`, else no), or MOETUNE_EP_COMBINE_LANES=own|shared (side-by-side runs)."""
    raw = os.environ.get("MOETUNE_EP_COMBINE_LANES", "")
    if raw not in ("", "own", "shared"):
        raise ValueError(f"MOETUNE_EP_COMBINE_LANES={raw!r}: expected 'own' or 'shared'")
    if raw:
        return raw == "shared"
    pref = getattr(cls, "combine_shares_lanes", None)
    return bool(pref(device)) if callable(pref) else False


def _chunk_weights(n: int) -> list[float]:
    """Relative chunk sizes of the dense layout: equal, or MOETUNE_EP_CHUNK_WEIGHTS (n comma-separated
    positive numbers, for side-by-side measurements of uneven chunks; ignored with one chunk)."""
    raw = os.environ.get("MOETUNE_EP_CHUNK_WEIGHTS", "")
    if not raw or n == 1:
        return [1.0] * n
    try:
        w = [float(v) for v in raw.split(",")]
    except ValueError:
        w = []
    if len(w) != n or min(w) <= 0:
        raise KnobError(f"MOETUNE_EP_CHUNK_WEIGHTS={raw!r}: expected {n} positive numbers (one per pipeline chunk)",
                        ("pipeline_depth",))
    return w


def _dense_bounds(cap: int, n: int) -> list[int]:
    """Token boundaries of the dense layout's n chunks over cap slots (n + 1 values from 0 to cap)."""
    w = _chunk_weights(n)
    if len(set(w)) == 1:
        cs = max(1, math.ceil(cap / n))
        return [min(c * cs, cap) for c in range(n + 1)]
    tot, acc, out = sum(w), 0.0, [0]
    for v in w:
        acc += v
        out.append(min(cap, round(cap * acc / tot)))
    return out


def hit_probability(experts: int, topk: int, world: int) -> float:
    """Probability that a token with `topk` distinct uniformly chosen experts has one on a given rank."""
    epr = experts // max(1, world)
    if world <= 1:
        return 1.0
    return 1.0 - math.comb(experts - epr, topk) / math.comb(experts, topk)


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
            n_local = max(1, self.num_local)
            if self.first_expert % n_local == 0:  # rank × E/world: one division tells the owner rank
                self._valid = torch.floor_divide(self.raw_ids, n_local) == self.first_expert // n_local
            else:
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

    def send_splits(self) -> list[int]:
        """Rows this rank sent to each rank in the dispatch (device-resident layout: a host sync)."""
        if self.resident:
            return [int(v) for v in self._send_counts.tolist()]
        w = len(self.chunks[0].send_splits) if self.chunks else 0
        return [sum(ch.send_splits[d] for ch in self.chunks) for d in range(w)]

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
        dense: bool | None = None,
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
            from moetune.runtime.profiles.autoload import autoload_knobs

            knobs = autoload_knobs(model=model, ep_size=self.world, group=group, max_tokens=self.max_tokens, device=self.device)
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
        self.dense = self._choose_dense(dense, get_transport(knobs.transport))
        self._agree()
        # the dense layout's chunk boundaries over the max_tokens slots: fixed for the buffer's life
        self._dense_chunks = _dense_bounds(self.max_tokens, self.num_chunks) if self.dense else []
        # `channels`: communicators the chunks of one direction are spread over (round-robin by chunk);
        # with pipelining, combine gets its own set so it travels while later dispatch chunks still move,
        # unless the transport does better with both on one set (host_staged's copy streams).
        self.comm_channels = min(knobs.channels, MAX_COMM_CHANNELS)
        cls = get_transport(knobs.transport)
        self._combine_base = self.comm_channels if self.num_chunks > 1 and not _combine_shares(cls, self.device) else 0
        n_groups = self.comm_channels + self._combine_base
        if hasattr(cls, "exchange_async"):
            self.transport: EPTransport = cls(group, knobs, self.device, channels=n_groups)
        else:
            self.transport = cls(group, knobs, self.device)
        self._fast = hasattr(self.transport, "exchange_async") and hasattr(self.transport, "exchange_blocks")
        # one-sided transports: the device-resident layout (counts never leave the GPU; see _plan_resident)
        self.resident = bool(getattr(self.transport, "device_counts", False)) and not self.dense
        # its packing in two kernels (csrc/ep_pack.cu) where the transport brought the compiled library;
        # fp8 rows (quantised) and MOETUNE_FUSED_PACK=0 take the torch ops
        lib = getattr(self.transport, "lib", None)
        self._pack_lib = (lib if self.resident and not self.fp8 and self.device.type == "cuda" and lib is not None
                          and os.environ.get("MOETUNE_FUSED_PACK", "1") != "0" else None)
        # fp8 on a GPU: quantise into the wire rows and dequantise in one launch each (csrc/ep_fp8.cu), where
        # the compiled library is at hand; the torch ops otherwise (same bytes). MOETUNE_FUSED_FP8=0: torch.
        self._fp8_lib = self._fp8_library(lib) if self.fp8 and self.device.type == "cuda" else None
        # nvlink: its exchange kernel writes the wire rows straight from the tokens (no packing launch);
        # MOETUNE_NVL_GATHER=0 packs first instead (for side-by-side measurements)
        self._gather = (self._pack_lib is not None and hasattr(self.transport, "dispatch_gather")
                        and os.environ.get("MOETUNE_NVL_GATHER", "1") != "0")
        # transport buffers are sized for the larger of the two directions: with compression the combine rows
        # (activation dtype, never compressed) are wider than the dispatch rows
        widest_row = max(self.row_bytes, self.model.hidden * torch.empty(0, dtype=self.dtype).element_size())
        reserve = getattr(self.transport, "reserve", None)
        if callable(reserve):  # one-sided transports: size the symmetric receive buffer once (collective)
            reserve(max(1, self.max_tokens), widest_row)
        stage = getattr(self.transport, "stage_capacity", None)
        if callable(stage):  # host_staged: one staging slot per block, a block being at most one chunk's tokens
            b = self._dense_chunks or [0, -(-self.max_tokens // self.num_chunks)]
            stage(max(1, *(hi - lo for lo, hi in itertools.pairwise(b))), widest_row)
        self._one = torch.ones(1, dtype=torch.int64, device=self.device)
        self._stage_views: Any = None
        self._stage: torch.Tensor | None = None  # token rows [max_tokens + 1 spare, row_bytes], reused (dense: the send rows)
        self._send: torch.Tensor | None = None  # packed layout: send rows [max_tokens * world, row_bytes], reused
        self._stage_hi = 0  # dense layout: stage rows [0, _stage_hi) may hold real expert ids

    def _stream(self) -> int:
        """The current CUDA stream, as the compiled kernels take it."""
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    @staticmethod
    def _fp8_library(lib: Any) -> Any:
        if os.environ.get("MOETUNE_FUSED_FP8", "1") == "0":
            return None
        if lib is not None:
            return lib
        try:  # builds on first use (cached); a node without nvcc keeps the torch ops
            return csrc_build.load() if csrc_build.availability()[0] else None
        except Exception:
            return None

    def _dequant(self, rows: torch.Tensor) -> torch.Tensor:
        """recv_x [n, H] in the activation dtype from fp8 wire rows uint8 [n, row_bytes]."""
        if self._fp8_lib is None:
            payload, _ids, _wts, scales = self._row_views(rows)
            return dequantise(payload, scales, self.dtype)
        n = rows.shape[0]
        out = torch.empty(n, self.hidden, dtype=self.dtype, device=self.device)
        if n:
            rc = self._fp8_lib.mt_fp8_dequant_rows(rows.data_ptr(), rows.stride(0), n, self.hidden, self.scale_groups,
                                                   self.scale_off, _DTYPE_CODE[self.dtype], out.data_ptr(),
                                                   self._stream())
            csrc_build.check(self._fp8_lib, rc, "fp8 dequantisation")
        return out

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

    def _choose_dense(self, dense: bool | None, cls: type) -> bool:
        """The layout (see the module doc): `dense=None` picks it from the shapes alone, so every rank
        makes the same choice without talking."""
        able = hasattr(cls, "gather_async") and hasattr(cls, "reduce_scatter_async")
        if dense is not None:
            if dense and not able:
                raise ValueError(f"dense=True needs a collective transport, not {self.knobs.transport!r}")
            return bool(dense)
        if not able or self.world == 1:
            return False
        per_peer = self.max_tokens * self.row_bytes
        waste = 1.0 - hit_probability(self.model.experts, self.topk, self.world)
        return per_peer <= DENSE_AUTO_MAX_BYTES or waste <= DENSE_AUTO_MAX_WASTE

    def _agree(self) -> None:
        """Every rank must run the same setting (the row size and count layout depend on it)."""
        if self.world == 1 or not dist.is_initialized():
            return
        digest = int(self.knobs.digest()[:15], 16)
        mine = torch.tensor(
            [digest, self.model.hidden, self.model.intermediate, self.model.experts, self.model.topk,
             self.max_tokens, list(TORCH_DTYPES.values()).index(self.dtype), int(self.dense)],
            dtype=torch.int64,
            device=self.device,
        )
        got = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(got, mine, group=self.group)
        rows = torch.stack(got).cpu().tolist()
        bad = [r for r, row in enumerate(rows) if row != rows[0]]
        if bad:
            names = ["knobs", "hidden", "intermediate", "experts", "topk", "max_tokens", "dtype", "dense"]
            diff = sorted({names[i] for r in bad for i in range(len(names)) if rows[r][i] != rows[0][i]})
            raise ValueError(f"EPBuffer: ranks {bad} differ from rank 0 in {', '.join(diff)}; every rank must "
                             "build the buffer with the same model, dtype, max_tokens, knobs and dense setting")

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
    def _raise_errors(self, peer_codes: dict[int, int], msg: str, idx: torch.Tensor | None) -> None:
        """Raise the same ValueError story on every rank when any rank reported an input error."""
        if not any(peer_codes.values()):
            return
        e = self.model.experts
        my_code = peer_codes[self.rank]
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

    def _plan_dense(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Handle:
        """Dense layout: write the tokens into the reused send rows; no counts, no host sync (one tiny
        status all-gather and one sync when check_inputs is on)."""
        w, e = self.world, self.model.experts
        code, msg = self._local_check(x, topk_idx, topk_weights)
        if self.check_inputs:
            if code:
                st = torch.full((1,), -code, dtype=torch.int64, device=self.device)
            else:
                st = ((topk_idx < 0) | (topk_idx >= e)).sum().reshape(1).to(torch.int64)
            got = torch.empty(w, dtype=torch.int64, device=self.device)
            work = self.transport.gather_async(got, st)  # type: ignore[attr-defined]
            if work is not None:
                work.wait()
            codes = {r: (-v if v < 0 else (_RANGE_ERROR if v > 0 else 0)) for r, v in enumerate(got.tolist())}
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
        handle = Handle(s, self.hidden, self.dtype, self.device, chunks, w * cap, dense=True)
        handle._recv_buf = torch.empty(w * cap, self.row_bytes, dtype=torch.uint8, device=self.device)
        return handle

    def _plan_resident(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Handle:
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
            if code:
                st = torch.full((w,), -code, dtype=torch.int64, device=self.device)
            else:
                st = ((topk_idx < 0) | (topk_idx >= e)).sum().reshape(1).to(torch.int64).expand(w).contiguous()
            got = self.transport.exchange_counts(st)
            codes = {r: (-v if v < 0 else (_RANGE_ERROR if v > 0 else 0)) for r, v in enumerate(got.tolist())}
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
                        resident=True)
        handle._send_all = send
        handle._send_tok = tok
        handle._send_counts = send_counts
        handle._inv = inv
        if self._gather:  # the exchange reads the tokens themselves
            handle._x, handle._idx, handle._w = x, idx, topk_weights
        return handle

    def _pack_torch(self, x: torch.Tensor, idx: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
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

    def _pack_fused(self, x: torch.Tensor, idx: torch.Tensor, topk_weights: torch.Tensor,
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
                              send_counts.data_ptr(), inv.data_ptr(), scratch.data_ptr(), _PLAN_MODE, stream)
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

    def _dispatch_resident(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
                           ) -> tuple[torch.Tensor, RecvMeta, Handle]:
        handle = self._plan_resident(x, topk_idx, topk_weights)
        t = self.transport
        send = handle._send_all
        if self._gather:  # nvlink: one launch places the counts and writes the rows from the tokens
            recv, recv_counts = t.dispatch_gather(  # type: ignore[attr-defined]
                handle._x, handle._send_tok, handle._idx, handle._w, handle._send_counts, row_bytes=self.row_bytes,
                id_off=self.id_off, weight_off=self.weight_off)
        elif hasattr(t, "exchange_fused"):  # nvlink: the counts travel inside the exchange (one launch)
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

    def _combine_resident(self, expert_out: torch.Tensor, handle: Handle) -> torch.Tensor:
        # back along the dispatch's paths: send what was received, receive what was sent (device counts);
        # nvlink reads strided rows in place (e.g. recv_x itself, a view into the receive buffer)
        t = self.transport
        if hasattr(t, "exchange_strided"):
            back = t.exchange_strided(expert_out, handle._recv_counts, handle._send_counts)  # type: ignore[attr-defined]
        else:
            back = t.exchange(expert_out.contiguous(), handle._recv_counts, handle._send_counts)
        if handle._inv is not None:  # one kernel: every token's rows summed in rank order
            return self._reduce(back, handle)
        n = handle._send_tok.shape[0]
        out = torch.zeros(handle.num_tokens + 1, handle.hidden, dtype=handle.dtype, device=handle.device)
        if n:
            out.index_add_(0, handle._send_tok, back[:n])
        return out[: handle.num_tokens]

    def _reduce(self, back: torch.Tensor, handle: Handle) -> torch.Tensor:
        s, h = handle.num_tokens, handle.hidden
        out = torch.empty(s, h, dtype=handle.dtype, device=handle.device)
        if s:
            lib = self._pack_lib
            rc = lib.mt_combine_reduce(back.data_ptr(), back.stride(0), handle._inv.data_ptr(), s, self.world, h,
                                       _DTYPE_CODE[handle.dtype],
                                       out.data_ptr(), self._stream())
            csrc_build.check(lib, rc, "combine reduce")
        return out

    def plan(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Handle:
        """Check the inputs on every rank and exchange the counts (the one host sync of a dispatch).

        Kept to a dozen small kernels and no hidden syncs (no bincount/nonzero: they sync on CUDA).
        Dense layout: see `_plan_dense` (no counts, no sync).
        """
        if self.dense:
            return self._plan_dense(x, topk_idx, topk_weights)
        w, e, epr, n_chunks = self.world, self.model.experts, self.experts_per_rank, self.num_chunks
        code, msg = self._local_check(x, topk_idx, topk_weights)
        width = 2 + epr
        s = x.shape[0] if code == 0 else 0
        cs = max(1, math.ceil(s / n_chunks))
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
        for c in range(n_chunks):
            t0, t1 = min(c * cs, s), min((c + 1) * cs, s)
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
        handle = Handle(s, self.hidden, self.dtype, self.device, chunks, off)
        handle.num_send = soff
        handle._send_all = send_all
        handle._send_tok = tok_all[:soff] if tok_all is not None else None
        handle._recv_buf = torch.empty(off, self.row_bytes, dtype=torch.uint8, device=self.device)
        return handle

    def _row_views(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(payload, ids int64 [n, k], weights float32 [n, k], scales float32 [n, G] or None) views of wire
        rows uint8 [n, row_bytes]; payload is uint8 fp8 bytes [n, H] with compression, else [n, H] in the
        activation dtype. dtype views + narrow: no copies, few Python-level slicing calls."""
        h, k = self.hidden, self.topk
        f32 = rows.view(torch.float32)
        payload = rows.narrow(1, 0, h) if self.fp8 else rows.view(self.dtype).narrow(1, 0, h)
        scales = f32.narrow(1, self.scale_off // 4, self.scale_groups) if self.fp8 else None
        return payload, rows.view(torch.int64).narrow(1, self.id_off // 8, k), f32.narrow(1, self.weight_off // 4, k), scales

    def _write_stage(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, s: int) -> torch.Tensor:
        """Write the s tokens as wire rows into the reused stage buffer [max_tokens, row_bytes]: payload (or
        fp8 bytes + scales, quantised straight into the rows), expert ids, weights. 3 copies for bf16."""
        stage = self._stage
        if stage is None:
            # one spare row past max_tokens: the device-resident layout's padding rows point at it
            stage = self._stage = torch.zeros(self.max_tokens + 1, self.row_bytes, dtype=torch.uint8, device=self.device)
            self._stage_views = self._row_views(stage[: self.max_tokens])
            self._stage_views[1].fill_(-1)
        if not s:
            return stage
        views = self._stage_views if s == self.max_tokens else [v.narrow(0, 0, s) if v is not None else None
                                                                 for v in self._stage_views]
        payload, ids, wts, scales = views
        if self.fp8 and self._fp8_lib is not None:  # payload, scales, ids and weights in one launch
            x, idx, w = x.contiguous(), _dense_as(topk_idx, torch.int64), _dense_as(topk_weights, torch.float32)
            rc = self._fp8_lib.mt_fp8_quant_rows(
                x.data_ptr(), _DTYPE_CODE[x.dtype], s, self.hidden, self.scale_groups, idx.data_ptr(), w.data_ptr(),
                self.topk, stage.data_ptr(), self.row_bytes, self.id_off, self.weight_off, self.scale_off,
                self._stream())
            csrc_build.check(self._fp8_lib, rc, "fp8 quantisation")
            return stage
        if self.fp8:
            quantise_into(x, payload, scales, self.knobs.scale_granularity)
        else:
            payload.copy_(x)
        ids.copy_(topk_idx)
        wts.copy_(topk_weights)
        return stage

    def _send_rows(self, n: int) -> torch.Tensor:
        """The packed layout's send rows: a reused buffer of max_tokens × world rows (the most one dispatch
        can send: every token once to every rank). Safe to reuse: dispatch returns only after the current
        stream has waited for its payload transfers."""
        if self._send is None:
            self._send = torch.empty(self.max_tokens * self.world, self.row_bytes, dtype=torch.uint8, device=self.device)
        return self._send[:n]

    def pack(self, handle: Handle, c: int) -> torch.Tensor:
        """Chunk c's send rows (grouped by destination rank, rank order): a slice of the rows `plan` built."""
        ch = handle.chunks[c]
        if handle.dense:
            return self._stage[ch.t0 : ch.t1]  # type: ignore[index]
        n = sum(ch.send_splits)
        if handle._send_all is None:
            return torch.empty(0, self.row_bytes, dtype=torch.uint8, device=self.device)
        return handle._send_all[ch.send_offset : ch.send_offset + n]

    def post_dispatch(self, handle: Handle, c: int, send: torch.Tensor):
        ch = handle.chunks[c]
        out = handle._recv_buf[ch.recv_offset : ch.recv_offset + ch.recv_rows]
        if handle.dense:
            if ch.t1 == ch.t0:
                return None
            return self.transport.gather_async(out, send, channel=c % self.comm_channels)  # type: ignore[attr-defined]
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
        rb = handle._recv_buf if (a == 0 and b == handle.num_recv) else handle._recv_buf.narrow(0, a, b - a)
        payload, ids, wts, _scales = self._row_views(rb)
        recv_x = self._dequant(rb) if self.fp8 else payload
        tpe = None if handle.dense else [sum(ch.pairs_per_expert[j] for ch in chunks) for j in range(self.experts_per_rank)]
        rpr = [sum(ch.recv_splits[r] for ch in chunks) for r in range(self.world)]
        return recv_x, RecvMeta(ids, wts, tpe, rpr, first_expert=self.rank * self.experts_per_rank,
                                num_local=self.experts_per_rank)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, RecvMeta, Handle]:
        """Send each token once to every rank holding one of its top-k experts.

        x [S, H] (the buffer's dtype, S <= max_tokens), topk_idx int [S, k] global expert ids,
        topk_weights float [S, k]. Returns recv_x [M, H] (rows grouped by source rank; with pipeline_depth
        chunks: by chunk, then source rank), RecvMeta and the handle for combine. Packed layout: M = the
        rows routed here; dense layout: M = world × max_tokens (every slot of every rank; unused slots and
        tokens without a local expert have no local slot in RecvMeta, their expert output row is ignored);
        device-resident layout: M = world × max_tokens, the rows routed here first (sum(meta.rows_per_rank)
        of them), the rest stale and without a local slot in RecvMeta.
        Raises ValueError on every rank when any rank's input is wrong (before any payload moves).

        Without compression recv_x is a view into the receive buffer (no copy; its rows are strided by the
        wire row size): use it as is for index_select/matmul, or call .contiguous() for a dense tensor.
        """
        if self.resident:
            return self._dispatch_resident(x, topk_idx, topk_weights)
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
        channel = c % self.comm_channels + self._combine_base
        if handle.dense:
            if c == 0 or handle._combine_out is None:  # a fresh result per combine (the handle may be reused)
                handle._combine_out = torch.empty(self.max_tokens, handle.hidden, dtype=handle.dtype, device=handle.device)
            out = handle._combine_out[ch.t0 : ch.t1]
            if ch.t1 == ch.t0:
                return out, None
            return out, self.transport.reduce_scatter_async(out, rows, channel=channel)  # type: ignore[attr-defined]
        if c == 0 or handle._combine_out is None:  # one buffer for every chunk's rows (one index_add at the end)
            handle._combine_out = torch.empty(handle.num_send, handle.hidden, dtype=handle.dtype, device=handle.device)
        out = handle._combine_out[ch.send_offset : ch.send_offset + sum(ch.send_splits)]
        return out, self._post(rows, ch.recv_splits, ch.send_splits, out, channel=channel)

    @staticmethod
    def finish_combine(handle: Handle, received: list[tuple[torch.Tensor, Any]]) -> torch.Tensor:
        """Wait for every chunk's rows and add each token's rows (one per rank that held its experts)."""
        if handle.dense:  # the reduce-scatter already summed them
            for _rows, work in received:
                if work is not None:
                    work.wait()
            return handle._combine_out[: handle.num_tokens]
        for _rows, work in received:
            if work is not None:
                work.wait()
        out = torch.zeros(handle.num_tokens, handle.hidden, dtype=handle.dtype, device=handle.device)
        if handle.num_send:
            out.index_add_(0, handle._send_tok, handle._combine_out)
        return out

    def combine(self, expert_out: torch.Tensor, handle: Handle) -> torch.Tensor:
        """expert_out [M, H]: one row per received row (that row's local experts' outputs, weighted by
        RecvMeta.weights and summed). Returns out [S, H]: for every token, the sum over its ranks."""
        self._check_combine(expert_out, handle, handle.num_recv if isinstance(handle, Handle) else 0)
        if handle.resident:
            return self._combine_resident(expert_out, handle)
        received = []
        for c, ch in enumerate(handle.chunks):
            received.append(self.post_combine(handle, c, expert_out[ch.recv_offset : ch.recv_offset + ch.recv_rows]))
        return self.finish_combine(handle, received)

    def close(self) -> None:
        self.transport.close()

    def __repr__(self) -> str:
        return (f"EPBuffer(world={self.world}, rank={self.rank}, model={self.model.name}, "
                f"layout={'dense' if self.dense else 'packed'}, "
                f"transport={self.knobs.transport}, compression={self.knobs.compression}, "
                f"pipeline_depth={self.knobs.pipeline_depth}, row_bytes={self.row_bytes})")
