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
  collective). No counts exchange, no host sync, ~4 kernels per direction (the combine ~5 more: it zeroes the
  rows without a local slot before the sum); slots a rank does not use carry
  expert id -1 and are ignored. It sends max_tokens rows per peer whatever S is, and rows of tokens with no
  expert on that peer: worth it when bytes are cheap (small S) or when nearly every token needs every rank
  anyway (2 ranks with top-4/8: 94-99.6 % of tokens). `EPBuffer(dense=None)` picks it when one dense send is
  <= DENSE_AUTO_MAX_BYTES per peer or the expected extra rows are <= DENSE_AUTO_MAX_WASTE (uniform routing);
  pass dense=False when S is usually far below max_tokens. With check_inputs the dense dispatch adds one
  tiny status all-gather (and its sync) so that wrong inputs are an error on every rank; without it, a
  wrong shape, dtype or device raises on its own rank only (the others wait for the collective timeout), and an
  expert id out of range is not seen at all in the dense and device-resident layouts: no rank holds that expert,
  so its share of the token is silently missing from the output (the packed layout's counts exchange still
  refuses it). check_inputs=False is for callers whose routing is known good (ids from their own top-k).
  One EPBuffer serves one stream of calls: its send and stage rows are reused by every dispatch. A call on
  another CUDA stream than the previous call's waits for that stream's work queued so far (one event, no host
  wait; eager calls: a graph replay is ordered by the stream it is replayed on), so switching streams is safe but
  serialises them; two threads calling one buffer at the same time need two buffers (a call made while another
  thread is inside one raises RuntimeError; pipelined_moe is one call from start to end, and close() refuses too).

One row, all bytes (uint8):

    [payload: H × itemsize (bf16/fp32) or H fp8 bytes][int64 ids × k][fp32 weights × k]
    [fp32 scales (fp8 only)][padding to 16 bytes]

The k ids are the global expert ids as given (one copy, no per-destination select on the sender); the
receiver keeps the slots whose expert it holds (expert - rank × E/world in [0, E/world)) and ignores the rest.

Combine: one row per received row goes back (the expert side has already summed its local experts per
(token, rank)); the source adds the rows of each token, one per rank that held its experts (packed: one
index_add over all chunks; dense: inside the reduce-scatter). Combine is never compressed (activation
dtype); with bf16 the per-token sum over ranks is accumulated in bf16, and on a GPU index_add's atomics add a
token's rows in no fixed order, so the packed and device-resident combines may differ in the last bits from run to
run (a fixed-order fp32 sum is not built: it needs a two-GPU machine to check and time). On a GPU, fp8 quantisation into the
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

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from moetune.runtime import _args, csrc_build
from moetune.runtime._capture import capturing
from moetune.runtime.buffer._dense import _dense_bounds, _DenseLayout
from moetune.runtime.buffer._meta import (
    _COMBINE_BAD,
    _COMBINE_OK,
    _DTYPE_CODE,
    _ERRORS,
    _GRAD_ERROR,
    _LAYER_GRAD_ERROR,
    _LAYER_STATE_ERROR,
    _RANGE_ERROR,
    _ROUTED_CODES,
    TORCH_DTYPES,
    Handle,
    RecvMeta,
    _align,
    _dense_as,
    local_slots,
)
from moetune.runtime.buffer._packed import _PackedLayout
from moetune.runtime.buffer._resident import _ResidentLayout
from moetune.runtime.buffer.layout_choice import (
    DENSE_AUTO_MAX_BYTES,
    DENSE_AUTO_MAX_WASTE,
    MAX_COMM_CHANNELS,
    equal_chunk_size,
    hit_probability,
    picks_dense,
)
from moetune.runtime.fp8 import dequantise, fp8_available, num_scale_groups, quantise_into
from moetune.runtime.knobs import KnobError, Knobs, default_knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.routing import expert_ids_problem, routed_inputs_fault, strided_problem
from moetune.runtime.shapes import ModelShape
from moetune.runtime.transports.base import EPTransport
from moetune.runtime.transports.registry import get_transport, registered_transports

__all__ = ["DENSE_AUTO_MAX_BYTES", "DENSE_AUTO_MAX_WASTE", "MAX_COMM_CHANNELS", "TORCH_DTYPES", "EPBuffer", "Handle",
           "RecvMeta", "hit_probability"]


# Ceilings behind EPBuffer._check_capacity: the (row, local expert) pairs one rank may receive (int32 offsets) and the
# bytes of one buffer (1 TiB: no device has it; a larger max_tokens is a mistake, not a workload)
MAX_PAIRS = (1 << 31) - 1
MAX_BUFFER_BYTES = 1 << 40

# What EPBuffer's construction checks locally, in order; a failed check travels as 1 + its index in the first
# agreement, so the other ranks can say which argument which rank refused
_CHECKS = ("knobs", "model", "max_tokens", "device", "dtype", "check_inputs", "dense", "expected_tokens",
           "autoload_at_world1", "options",
           "compression", "scale_granularity", "transport", "chunk_tokens", "layer arguments",
           "buffer (that rank's layer was given one, this rank's was not)")
# the code a layer given an EPBuffer puts first in its own agreement (`layer_agreement`): that agreement has the
# buffer's first agreement's shape, so a rank building its own buffer meanwhile pairs with it and both raise
_GIVEN_BUFFER = len(_CHECKS)  # the code of _CHECKS' last entry
_LAYER_REFUSED = _CHECKS.index("layer arguments") + 1
# What every rank must build alike (the first agreement's columns after the code)
_AGREED = ("knobs=None", "knobs", "runtime options", "hidden", "intermediate", "experts", "topk", "max_tokens",
           "dtype", "dense", "check_inputs")


def _combine_shares(cls: type[EPTransport], device: torch.device, knobs: Knobs, options: RuntimeOptions) -> bool:
    """Whether pipelined combines go on the dispatch communicators/lanes: the knob `combine_lanes`
    (own / shared), or with `auto` the transport's preference (`combine_shares_lanes`)."""
    if knobs.combine_lanes != "auto":
        return knobs.combine_lanes == "shared"
    return bool(cls.combine_shares_lanes(device, options))


_M = TypeVar("_M", bound=Callable[..., Any])


@contextlib.contextmanager
def _calls_of(buf: EPBuffer, what: str) -> Iterator[None]:
    """The span of one EPBuffer call (`_one_thread`) or of a sequence of them that shares state between its steps
    (pipelined_moe: its later chunks' transfers still read the send and stage rows while it runs the experts on
    earlier ones): the outermost one of a thread runs `_enter` first (a closed buffer refused, the CUDA stream
    ordered), and none runs while another thread is inside one: every call reuses the buffer's stage, send and
    receive rows and its host state (epochs, the handle's scratch), so two threads at once would mix their tokens
    silently. The same thread may nest (dispatch calls plan, pack, ...); a nested step still refuses a buffer closed
    meanwhile (by an expert_fn, say)."""
    me = threading.get_ident()
    with buf._caller_lock:
        if buf._caller not in (None, me):
            raise RuntimeError(f"EPBuffer.{what}: another thread is inside a call of this buffer; one EPBuffer serves "
                               "one thread at a time (its rows are reused by every call): give each thread its own "
                               "buffer")
        buf._caller, buf._depth = me, buf._depth + 1
        outermost = buf._depth == 1
    try:
        if outermost:
            buf._enter()
        else:
            buf._refuse_closed()
        yield
    finally:
        with buf._caller_lock:
            buf._depth -= 1
            if buf._depth == 0:
                buf._caller = None


def _one_thread(method: _M) -> _M:
    """An EPBuffer call, run inside `_calls_of` (one thread at a time, a closed buffer refused, streams ordered)."""

    @functools.wraps(method)
    def call(self: EPBuffer, *args: Any, **kwargs: Any) -> Any:
        with _calls_of(self, method.__name__):
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def _capacity_problem(world: int, max_tokens: int, widest_row: int, per_row: int, at_least: bool = False) -> None:
    """ValueError naming max_tokens when its buffers cannot exist. The largest buffer holds world x max_tokens rows
    (the packed send rows, the dense and device-resident receive rows); the (row, local expert) pairs a rank
    receives are counted in int32 (MoELayer's grouped-GEMM offsets). `at_least`: widest_row is a lower bound (the
    knobs' row not known yet), and the message says so."""
    rows = world * max(1, max_tokens)
    least = "at least " if at_least else ""
    over = []
    if rows * widest_row > MAX_BUFFER_BYTES:
        over.append(f"its largest buffer ({world} rank(s) x max_tokens rows of {least}{widest_row} bytes) would be "
                    f"{least}{rows * widest_row} bytes, over the limit of {MAX_BUFFER_BYTES}")
    if rows * per_row > MAX_PAIRS:
        over.append(f"a rank could receive {rows * per_row} (row, expert) pairs, over the int32 limit of {MAX_PAIRS}")
    if over:
        most = min(MAX_BUFFER_BYTES // (world * widest_row), MAX_PAIRS // (world * per_row))
        raise ValueError(f"EPBuffer: max_tokens={max_tokens} is too large: {'; '.join(over)} (at most "
                         f"max_tokens={most} for this model, dtype and world{', fewer with wider rows' if at_least else ''})")


class EPBuffer(_PackedLayout, _DenseLayout, _ResidentLayout):
    """Dispatch/combine over the ranks of `group` with the knobs' transport (docs/runtime.md).

    Construction is collective (every rank of the group, same arguments): ranks compare model, dtype,
    max_tokens, the knobs' and the runtime options' digests (and whether knobs were given), dense and check_inputs,
    and raise ValueError on every rank when they differ. An argument refused on one rank is an error on every rank:
    that rank raises its own error, the others a ValueError naming it (the first collective, before any other).

    Args:
        group: the EP process group (None: the default group; without torch.distributed, one rank).
        knobs: the setting to run (None: the tuned profile for this model, activation dtype, world and
            `expected_tokens`, else the policy default; resolved on rank 0 of the group and broadcast, so every
            rank runs the same one: see runtime/profiles/autoload.py, `autoload_group_profile`). Every knob the
            buffer reads fixes its allocation or its wire protocol (row layout, chunks, communicators, transport
            settings), and ranks dispatch different token counts in one call: the knobs are fixed for the
            buffer's life, never switched per call. A serving engine that runs both prefill and decode sizes
            builds one buffer per phase (or passes the `expected_tokens` it cares most about).
        model: the MoE shape (hidden H, experts E, top-k k, activation dtype).
        max_tokens: the most tokens S one dispatch may carry (sizes every buffer; dense: the slots per rank).
        expected_tokens: the token count the auto-loaded profile is picked for (its nearest tuned token bucket;
            1..max_tokens; None: max_tokens). Ignored with explicit `knobs`. `self.resolution` says what was loaded
            (None where nothing was: explicit knobs, or `autoload_at_world1=False` at world 1).
        device: where the tensors live (None: the current CUDA device with NCCL, else the CPU).
        dtype: activation dtype, bfloat16 / float16 / float32 (None: the model's).
        check_inputs: check dispatch/combine inputs on every rank so a wrong one is an error everywhere (one tiny
            exchange and host sync; False allows CUDA-graph capture of the dense and device-resident layouts). False
            is for routing known to be good: the dense and device-resident layouts then never see an expert id out
            of range (that share of the token is silently missing from the output), and a wrong shape, dtype or
            device raises on its own rank only (the packed layout's counts exchange checks every dispatch anyway).
        dense: the dense layout (True), the packed or device-resident one (False), or chosen from the shapes (None).
        options: `RuntimeOptions`, or a mapping of option names overriding the `MOETUNE_*` variables and the
            config's `[runtime]` section (None: those alone); see docs/settings.md.
        autoload_at_world1: with `knobs=None` and one rank, whether the profile is looked up (True) or the built-in
            collective default taken without a lookup (False: for a caller that never dispatches through the buffer,
            as a world-1 `MoELayer`, where no EP knob acts). At world > 1 the profile is looked up either way.

    `close()` frees the transport (the proxy thread, symmetric buffers, staging); a dispatch or combine after it
    raises RuntimeError. A buffer dropped without close() stops its proxy thread when it is collected.
    """

    _closed = False  # close() was called
    transport: EPTransport | None = None  # made by __init__; None only in a constructor that failed before it
    _caller: int | None = None  # the thread inside a call now (`_one_thread`), None between calls
    _refusal = 0  # the error code this rank's next input check reports whatever the inputs (`refuse_dispatch`)
    _depth = 0  # that thread's nested calls (dispatch calls plan, pack, ...)

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
        options: RuntimeOptions | dict[str, Any] | None = None,
        expected_tokens: int | None = None,
        autoload_at_world1: bool = True,
    ):
        self._caller_lock = threading.Lock()  # guards _caller/_depth (`_one_thread`)
        # the group first: without one there is nobody to agree with
        _args.check_group(group, "EPBuffer: ")
        self._join(group)
        self.resolution: Any = None  # the autoload Resolution (knobs=None), the same on every rank
        # every local check runs before the first collective, and the first collective has one shape whatever the
        # arguments: a rank whose check failed (or that differs in knobs=None) is an error on every rank, not a
        # rank raising while the others wait in a different collective (autoload's, the transport's)
        fault = self._check_arguments(knobs, model, max_tokens, device, dtype, check_inputs, dense, options,
                                      expected_tokens, autoload_at_world1)
        if fault is None and knobs is not None:
            fault = self._check_knobs(knobs, dense)
        self._agree(fault, knobs is not None)
        if knobs is None and self.world == 1 and not autoload_at_world1:
            # the caller never exchanges through this buffer (a world-1 MoELayer): no EP knob acts on its path, so
            # no profile is looked up (no daemon round trip, no "NO tuned profile ... collective" warning); the
            # built-in collective default, which every device runs, keeps dispatch/combine usable all the same
            knobs = default_knobs("collective")
            self._agree_loaded(self._check_knobs(knobs, dense))  # at world 1: raises this rank's refusal, if any
        elif knobs is None:
            from moetune.runtime.profiles.autoload import autoload_group_profile

            # rank 0 resolves (the activation dtype this buffer runs at, the expected token count) and broadcasts
            self.resolution = autoload_group_profile(model=model, ep_size=self.world, group=group,
                                                     max_tokens=self.expected_tokens, device=self.device,
                                                     dtype=self.dtype, options=self.options)
            knobs = self.resolution.knobs
            # the loaded knobs' own checks (fp8 in this torch build, the transport here) may fail on one rank only
            self._agree_loaded(self._check_knobs(knobs, dense))
        # transport buffers are sized for the larger of the two directions: with compression the combine rows
        # (activation dtype, never compressed) are wider than the dispatch rows
        widest_row = max(self.row_bytes, self.model.hidden * torch.empty(0, dtype=self.dtype).element_size())
        self._check_capacity(widest_row)  # after _agree: every rank has the same max_tokens, so all raise alike
        # the dense layout's chunk boundaries over the max_tokens slots: fixed for the buffer's life
        self._dense_chunks = (_dense_bounds(self.max_tokens, self.num_chunks, self.options.chunk_weights)
                              if self.dense else [])
        # `channels`: communicators the chunks of one direction are spread over (round-robin by chunk);
        # with pipelining, combine gets its own set so it travels while later dispatch chunks still move,
        # unless the transport does better with both on one set (host_staged's copy streams).
        self.comm_channels = min(knobs.channels, MAX_COMM_CHANNELS)
        cls = self._transport_cls
        opts = self.options
        # With combine_lanes=auto the built transport decides (`settle_combine_lanes`): host_staged shares only where
        # its copy-engine path runs, not where it fell back to NCCL's staging. It is built with combine lanes of its
        # own, which it may give back; an explicit knob (or one chunk) is followed as it is.
        settle = self.num_chunks > 1 and knobs.combine_lanes == "auto" and cls.async_exchange
        self._combine_base = (self.comm_channels if self.num_chunks > 1
                              and (settle or not _combine_shares(cls, self.device, knobs, opts)) else 0)
        n_groups = self.comm_channels + self._combine_base
        if cls.async_exchange:
            self.transport = cls(group, knobs, self.device, channels=n_groups, options=opts)
        else:
            self.transport = cls(group, knobs, self.device, options=opts)
        try:  # the transport holds threads, pinned or symmetric memory: a failure from here on closes it (the
            # caller never gets this object to close)
            if settle and self.transport.settle_combine_lanes(self.comm_channels):
                self._combine_base = 0
            self._fast = cls.async_exchange
            # one-sided transports: the device-resident layout (counts never leave the GPU; see _plan_resident)
            self.resident = cls.device_counts and not self.dense
            # its packing in two kernels (csrc/ep_pack.cu) where the transport brought the compiled library;
            # fp8 rows (quantised) and the option fused_pack=False take the torch ops
            lib = self.transport.lib
            self._pack_lib = (lib if self.resident and not self.fp8 and self.device.type == "cuda" and lib is not None
                              and opts.fused_pack else None)
            # fp8 on a GPU: quantise into the wire rows and dequantise in one launch each (csrc/ep_fp8.cu), where
            # the compiled library is at hand; the torch ops otherwise (same bytes), or with fused_fp8=False.
            self._fp8_lib = self._fp8_library(lib) if self.fp8 and self.device.type == "cuda" and opts.fused_fp8 else None
            # nvlink: its exchange kernel writes the wire rows straight from the tokens (no packing launch);
            # the option nvl_gather=False packs first instead (for side-by-side measurements)
            self._gather = self._pack_lib is not None and cls.gathers_tokens and opts.nvl_gather
            # one-sided transports size the symmetric receive buffer once (collective); host_staged one staging
            # slot per block, a block being at most one chunk's tokens; the others do nothing
            self.transport.reserve(max(1, self.max_tokens), widest_row)
            b = self._dense_chunks or [0, equal_chunk_size(self.max_tokens, self.num_chunks)]
            self.transport.stage_capacity(max(1, *(hi - lo for lo, hi in itertools.pairwise(b))), widest_row)
        except BaseException:
            self.transport.close()
            raise
        self._one = torch.ones(1, dtype=torch.int64, device=self.device)
        self._stage_views: Any = None
        self._stage: torch.Tensor | None = None  # token rows [max_tokens + 1 spare, row_bytes], reused (dense: the send rows)
        self._send: torch.Tensor | None = None  # packed layout: send rows [max_tokens * world, row_bytes], reused
        self._stage_hi = 0  # dense layout: stage rows [0, _stage_hi) may hold real expert ids
        self._last_stream: torch.cuda.Stream | None = None  # the CUDA stream of the latest call (see _enter)

    def _stream(self) -> int:
        """The current CUDA stream, as the compiled kernels take it."""
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    @staticmethod
    def _fp8_library(lib: Any) -> Any:
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

    def _choose_dense(self, dense: bool | None, cls: type[EPTransport]) -> bool:
        """The layout (see the module doc): `dense=None` picks it from the shapes alone, so every rank
        makes the same choice without talking."""
        able = cls.dense_collectives
        if dense is not None:
            if dense and not able:
                raise ValueError(f"dense=True needs a collective transport, not {self.knobs.transport!r}")
            return bool(dense)
        if not able:
            return False
        return picks_dense(self.model.experts, self.topk, self.world, self.max_tokens, self.row_bytes)

    def _check_capacity(self, widest_row: int) -> None:
        """Refuse a max_tokens whose buffers cannot exist, here rather than as a failed allocation (which does not
        name max_tokens) at the first dispatch (_capacity_problem)."""
        _capacity_problem(self.world, self.max_tokens, widest_row, min(self.topk, self.experts_per_rank))

    # -- construction: local checks, then one agreement ----------------------------------------------
    def _join(self, group: dist.ProcessGroup | None) -> None:
        """The group, this rank's place in it, and the group's device (it carries the agreement when this rank's
        device argument is refused; replaced by the device argument's once checked)."""
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @classmethod
    def refuse(cls, group: Any, error: Exception) -> NoReturn:
        """For a layer that builds an EPBuffer on every rank (MoELayer) and whose own checks refused this rank's
        arguments: take part in the buffer's first agreement with the refusal, so the other ranks raise naming this
        rank (`layer arguments`) instead of waiting there until the group's timeout; then raise `error`. Without a
        usable group (the refused argument may be the group) there is nobody to tell: `error` is raised at once."""
        try:
            _args.check_group(group, "")
        except Exception:
            raise error from None
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            raise error
        buf = cls.__new__(cls)
        buf._join(group)
        buf._agree((_CHECKS.index("layer arguments") + 1, error), knobs_given=False)
        raise error  # _agree raised it already; for the type checker

    def _check_arguments(self, knobs: Any, model: Any, max_tokens: Any, device: Any, dtype: Any, check_inputs: Any,
                         dense: Any, options: Any, expected_tokens: Any,
                         autoload_at_world1: Any) -> tuple[int, Exception] | None:
        """The constructor's checks that need no collective (setting what they resolve); the first that fails as
        (its code: 1 + its index in _CHECKS, the error). Types first: a model name, a dict of knobs or
        max_tokens=2.5 named here, not failing deep inside (or truncated, or a truthy string taken for dense=True)."""
        who = "EPBuffer: "
        step = "knobs"
        try:
            _args.check_knobs(knobs, who)
            step = "model"
            _args.check_model(model, who)
            step = "max_tokens"
            _args.check_int("max_tokens", max_tokens, 0, who)
            step = "device"
            _args.check_device(device, who)
            step = "dtype"
            _args.check_dtype(dtype, who)
            step = "check_inputs"
            _args.check_flag("check_inputs", check_inputs, who)
            step = "dense"
            _args.check_flag("dense", dense, who, optional=True)
            step = "expected_tokens"
            if expected_tokens is not None:
                _args.check_int("expected_tokens", expected_tokens, 1, who)
                if expected_tokens > max(1, max_tokens):
                    raise ValueError(f"{who}expected_tokens={expected_tokens} is more than max_tokens={max_tokens}")
            step = "autoload_at_world1"
            _args.check_flag("autoload_at_world1", autoload_at_world1, who)
            step = "options"
            # the data path's switches, resolved once: explicit > MOETUNE_* variables > config [runtime] > defaults
            self.options = RuntimeOptions.resolve(options)
            step = "device"
            if device is not None:
                self.device = _args.usable_device(device, who)
            step = "dtype"
            self.dtype = dtype if dtype is not None else TORCH_DTYPES[model.dtype]
            step = "model"
            model.check_ep(self.world)
            step = "max_tokens"
            # the bound every knob set shares (a row carries at least the activation), before the knobs are loaded:
            # an absurd max_tokens was refused only after autoload had asked the daemon and warned "NO tuned
            # profile" for a buffer that is never built; _check_capacity checks the knobs' exact row later
            _capacity_problem(self.world, max_tokens, model.hidden * torch.empty(0, dtype=self.dtype).element_size(),
                              min(model.topk, model.experts // self.world), at_least=True)
        except Exception as e:  # any refusal (torch: RuntimeError, AssertionError for cuda on a CPU build) reaches every rank
            return _CHECKS.index(step) + 1, e
        self.model = model
        self.max_tokens = max_tokens
        self.expected_tokens = expected_tokens if expected_tokens is not None else max_tokens
        self.check_inputs = check_inputs
        self.experts_per_rank = model.experts // self.world
        self.topk = model.topk
        self.hidden = model.hidden
        return None

    def _check_knobs(self, knobs: Knobs, dense: bool | None) -> tuple[int, Exception] | None:
        """The checks of the knobs against this runtime and model (no collective), fixing the row layout, the
        transport class and the layout; the first that fails as (its code, the error), as _check_arguments."""
        step = "compression"
        try:
            if knobs.compression == "fp8_e4m3":
                if not fp8_available():
                    raise KnobError("this torch build has no float8_e4m3fn", ("compression",))
                step = "scale_granularity"
                try:
                    num_scale_groups(self.model.hidden, knobs.scale_granularity)
                except ValueError as e:
                    raise KnobError(str(e), ("scale_granularity",)) from None
            step = "transport"
            # a transport the knobs allow (ibgda) that this runtime does not implement: named as the knob, not a
            # KeyError from the registry
            if knobs.transport not in registered_transports():
                raise KnobError(f"{knobs.transport!r} is not available in this runtime (registered: "
                                f"{', '.join(registered_transports())})", ("transport",))
            cls = get_transport(knobs.transport)
            self.knobs = knobs
            self.num_chunks = knobs.pipeline_depth
            self._layout()
            step = "dense"
            self.dense = self._choose_dense(dense, cls)
            # a call sends a peer at most max_tokens rows (each token once per rank; combine returns what came)
            step = "chunk_tokens"
            cls.check_rows(knobs, max(1, self.max_tokens), f"EPBuffer: max_tokens={self.max_tokens}: ")
            # a transport that cannot run on this rank (no CUDA device, no compiled library, no P2P) refused here,
            # in the first agreement: its constructor would fail on this rank only, the others waiting in its
            # collectives until the group's timeout
            step = "transport"
            cls.check_world(self.world, "EPBuffer: ")  # nvlink/proxy: one node, at most 8 ranks
            avail = cls.availability(self.device, self.options)
            if not avail.ok:
                raise KnobError(f"transport {knobs.transport!r} cannot run here: {avail.reason}", ("transport",))
        except Exception as e:  # ImportError: the transport module missing here; any refusal reaches every rank
            return _CHECKS.index(step) + 1, e
        self._transport_cls = cls
        return None

    def _agreement_fields(self, knobs_given: bool) -> list[int]:
        """What every rank must build alike, as int64s in _AGREED's order (only read when no rank's check failed).
        check_inputs too: with it, combine (and the dense dispatch) run one more collective, so ranks that differ
        would wait in different collectives on valid input. Without knobs, their digest and the layout are compared
        after autoload (_agree_loaded)."""
        m = self.model
        return [int(knobs_given), int(self.knobs.digest()[:15], 16) if knobs_given else 0,
                int(self.options.digest()[:15], 16), m.hidden, m.intermediate, m.experts, m.topk, self.max_tokens,
                list(TORCH_DTYPES.values()).index(self.dtype), int(self.dense) if knobs_given else -1,
                int(self.check_inputs)]

    def gather_rows(self, row: list[int]) -> list[list[int]]:
        """Every rank's `row` of int64s (the same length on every rank): one small all-gather over the group and its
        host sync. Collective; the layer built on the buffer agrees its own arguments with it."""
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        got = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(got, mine, group=self.group)
        return torch.stack(got).cpu().tolist()

    def layer_agreement(self, row: list[int]) -> tuple[list[list[int]], str | None]:
        """The first collective of a layer built on this buffer (MoELayer's own agreement): every rank's `row` (at
        most len(_AGREED) int64s), and why not every rank is in it (None when all are): a rank whose layer arguments
        were refused (`refuse`), or one building its own EPBuffer where this rank's layer was given one. The rows
        have the shape of the buffer's first agreement, marked, so those ranks pair with this collective instead of
        running one of another shape (gloo aborted the process; NCCL would hang)."""
        rows = self.gather_rows([_GIVEN_BUFFER, *row, *[0] * (len(_AGREED) - len(row))])
        refused = [r for r, x in enumerate(rows) if x[0] == _LAYER_REFUSED and r != self.rank]
        building = [r for r, x in enumerate(rows) if x[0] not in (_GIVEN_BUFFER, _LAYER_REFUSED)]
        why = None
        if refused:
            why = f"the layer's arguments were refused on rank(s) {refused} (that rank's error says why)"
        elif building:
            why = (f"rank(s) {building} built their own EPBuffer where this rank's layer was given one; every rank "
                   "must pass `buffer`, or none")
        return [x[1:1 + len(row)] for x in rows], why

    def _raise_faults(self, fault: tuple[int, Exception] | None, codes: list[int]) -> None:
        """Every rank raises when any rank's local check failed: that rank its own error, the others a ValueError
        naming the rank(s) and the argument."""
        failed = [f"rank {r}: {_CHECKS[c - 1]}" for r, c in enumerate(codes) if c and r != self.rank]
        if fault is not None:
            if failed:
                fault[1].add_note(f"EPBuffer: also refused on {'; '.join(failed)}")
            raise fault[1]
        if failed:
            raise ValueError(f"EPBuffer on rank {self.rank}: the arguments were refused on another rank "
                             f"({'; '.join(failed)}); every rank must build the buffer with the same, valid "
                             "arguments (that rank's error says what is wrong)")

    def _agree(self, fault: tuple[int, Exception] | None, knobs_given: bool) -> None:
        """The buffer's first collective, of one shape whatever the arguments: [the code of this rank's failed
        check or 0, _AGREED's fields]. Every rank raises when any check failed or any field differs from rank 0."""
        if self.world == 1 or not dist.is_initialized():
            if fault is not None:
                raise fault[1]
            return
        fields = [0] * len(_AGREED) if fault is not None else self._agreement_fields(knobs_given)
        rows = self.gather_rows([fault[0] if fault is not None else 0, *fields])
        self._raise_faults(fault, [row[0] for row in rows])
        rows = [row[1:] for row in rows]
        bad = [r for r, row in enumerate(rows) if row != rows[0]]
        if bad:
            diff = sorted({_AGREED[i] for r in bad for i in range(len(_AGREED)) if rows[r][i] != rows[0][i]})
            if "knobs=None" in diff:  # the other columns are unresolved on the ranks without knobs
                given = [r for r, row in enumerate(rows) if row[0]]
                diff = [f"knobs (given on rank(s) {given}, None on the others)"]
            raise ValueError(f"EPBuffer: ranks {bad} differ from rank 0 in {', '.join(diff)}; every rank must "
                             "build the buffer with the same model, dtype, max_tokens, knobs, runtime options, "
                             "dense and check_inputs settings")

    def _agree_loaded(self, fault: tuple[int, Exception] | None) -> None:
        """After autoload (the same knobs everywhere): whether the loaded knobs' checks passed on every rank, and
        the layout each chose."""
        if self.world == 1 or not dist.is_initialized():
            if fault is not None:
                raise fault[1]
            return
        fields = [0, 0] if fault is not None else [int(self.knobs.digest()[:15], 16), int(self.dense)]
        rows = self.gather_rows([fault[0] if fault is not None else 0, *fields])
        self._raise_faults(fault, [row[0] for row in rows])
        bad = [r for r, row in enumerate(rows) if row[1:] != rows[0][1:]]
        if bad:
            raise ValueError(f"EPBuffer: ranks {bad} loaded other knobs or chose another layout than rank 0")

    # -- input checks (host-side, no device sync) -----------------------------------------------------
    def _local_check(self, x: Any, topk_idx: Any, topk_weights: Any) -> tuple[int, str]:
        if self._refusal:
            return self._refusal, _ERRORS[self._refusal]
        h, k = self.hidden, self.topk
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return 1, f"x must have shape [S, {h}] (hidden={h}), got {shape}"
        why = strided_problem("x", x)
        if why is not None:
            return 1, why
        if x.dtype != self.dtype:
            return 2, f"x must have dtype {self.dtype}, got {x.dtype}"
        if x.device != self.device:
            return 3, f"x must be on {self.device}, got {x.device}"
        s = x.shape[0]
        if s > self.max_tokens:
            return 4, f"x has {s} tokens, more than max_tokens={self.max_tokens}"
        # the routed inputs: the same check (and message) as the world-1 layer's (runtime/routing.py)
        fault = routed_inputs_fault(s, k, self.device, topk_idx, topk_weights)
        if fault is not None:
            return _ROUTED_CODES[fault[0]], fault[1]
        # rows move by copies and collectives autograd does not see: the gradient would silently stop here (a
        # MoELayer at world > 1 keeps grad mode on for such a call, so that every rank hears of it here)
        why = _args.grad_problem("EPBuffer.dispatch", x=x, topk_weights=topk_weights)
        if why is not None:
            return _GRAD_ERROR, why
        return 0, ""

    def refuse_dispatch(self, error: Exception, *, grad: bool = False) -> NoReturn:
        """For a layer on this buffer whose own check of its state failed on this rank just before its dispatch
        (MoELayer: its weights no longer what it was built with; with `grad`, its parameters require grad in grad
        mode): run the dispatch's input check with that refusal, so the other ranks, already in their dispatch, raise
        a ValueError naming this rank instead of waiting there until the group's timeout; then raise `error`. Where
        the check has no collective (dense and device-resident layouts without check_inputs) only this rank raises,
        as for a wrong input."""
        self._refusal = _LAYER_GRAD_ERROR if grad else _LAYER_STATE_ERROR
        try:
            empty = torch.empty(0, self.topk, device=self.device)
            self.dispatch(torch.empty(0, self.hidden, dtype=self.dtype, device=self.device), empty.long(), empty)
        except ValueError:
            pass  # the check's own story; this rank raises `error`
        finally:
            self._refusal = 0
        raise error

    def refuse_combine(self, error: Exception, handle: Handle) -> NoReturn:
        """For a caller whose expert code failed on this rank between `handle`'s dispatch and its combine (MoELayer's
        experts out of memory): with check_inputs, run the combine's input check with no expert output, so the other
        ranks, already in their combine, raise a ValueError naming this rank instead of waiting there until the
        group's timeout; then raise `error`. Without check_inputs the combine has no check: only this rank raises."""
        if self.check_inputs:
            try:
                self.combine(None, handle)  # type: ignore[arg-type]  # refused by the check on every rank
            except ValueError:
                pass  # the check's own story; this rank raises `error`
        raise error

    # -- dispatch -------------------------------------------------------------------------------------
    def _raise_errors(self, peer_codes: dict[int, int], msg: str, idx: torch.Tensor | None) -> None:
        """Raise the same ValueError story on every rank when any rank reported an input error."""
        if not any(peer_codes.values()):
            return
        stepped = [r for r, c in peer_codes.items() if c in (_COMBINE_OK, _COMBINE_BAD)]
        if stepped:  # their combine's check met this dispatch's (see _combine_step_codes)
            raise ValueError(f"EPBuffer.dispatch on rank {self.rank}: out of step with rank(s) {stepped}: they called "
                             "combine where this rank called dispatch; every rank must combine each dispatch before "
                             "its next dispatch (did this rank raise between the two, catch the error and go on?)")
        my_code = peer_codes[self.rank]
        if my_code == _RANGE_ERROR and idx is not None:
            msg = expert_ids_problem(idx, self.model.experts) or _ERRORS[_RANGE_ERROR]
        others = [f"rank {r}: {_ERRORS.get(c, f'error {c}')}" for r, c in peer_codes.items() if c and r != self.rank]
        text = f"EPBuffer.dispatch on rank {self.rank}: "
        text += msg if my_code else "invalid input on another rank"
        if others:
            text += "; reported by " + "; ".join(others)
        raise ValueError(text)


    @_one_thread
    def plan(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Handle:
        """Check the inputs on every rank and exchange the counts (the one host sync of a dispatch).

        Kept to a dozen small kernels and no hidden syncs (no bincount/nonzero: they sync on CUDA).
        Dense layout: see `_plan_dense` (no counts, no sync).
        """
        if self.dense:
            return self._plan_dense(x, topk_idx, topk_weights)
        return self._plan_packed(x, topk_idx, topk_weights)


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


    @_one_thread
    def pack(self, handle: Handle, c: int) -> torch.Tensor:
        """Chunk c's send rows (grouped by destination rank, rank order): a slice of the rows `plan` built."""
        ch = handle.chunks[c]
        if handle.dense:
            return self._stage[ch.t0 : ch.t1]  # type: ignore[index]
        n = sum(ch.send_splits)
        if handle._send_all is None:
            return torch.empty(0, self.row_bytes, dtype=torch.uint8, device=self.device)
        return handle._send_all[ch.send_offset : ch.send_offset + n]

    @_one_thread
    def post_dispatch(self, handle: Handle, c: int, send: torch.Tensor):
        ch = handle.chunks[c]
        out = handle._recv_buf[ch.recv_offset : ch.recv_offset + ch.recv_rows]
        if handle.dense:
            if ch.t1 == ch.t0:
                return None
            return self.transport.gather_async(out, send, channel=c % self.comm_channels)
        return self._post(send, ch.send_splits, ch.recv_splits, out, channel=c % self.comm_channels)

    @_one_thread
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

    @_one_thread
    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, RecvMeta, Handle]:
        """Send each token once to every rank holding one of its top-k experts.

        x [S, H] (the buffer's dtype, S <= max_tokens), topk_idx int [S, k] global expert ids,
        topk_weights float [S, k]. Returns recv_x [M, H] (rows grouped by source rank; with pipeline_depth
        chunks: by chunk, then source rank), RecvMeta and the handle for combine. Packed layout: M = the
        rows routed here; dense layout: M = world × max_tokens (every slot of every rank; unused slots and
        tokens without a local expert have no local slot in RecvMeta, their expert output row is ignored: combine
        adds nothing of it, whatever it holds);
        device-resident layout: M = world × max_tokens, the rows routed here first (sum(meta.rows_per_rank)
        of them), the rest stale and without a local slot in RecvMeta.
        Raises ValueError on every rank when any rank's input is wrong (before any payload moves), an x or
        topk_weights that requires grad in grad mode included: dispatch has no backward (an autograd.Function around
        dispatch and combine, whose forward runs without grad mode, is the way to train through it).

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
    def _combine_problem(self, expert_out: Any, handle: Any, rows: int, what: str = "expert_out") -> str:
        """What is wrong with `expert_out` as the `rows` expert output rows of `handle` ("" when nothing); local."""
        if not isinstance(handle, Handle):
            return f"handle must be the Handle returned by dispatch, got {type(handle).__name__}"
        if handle.owner and handle.owner != id(self):  # a prefill buffer's handle in a decode buffer: sized for the other
            return "handle was returned by another EPBuffer's dispatch: combine it on the buffer that dispatched"
        if not isinstance(expert_out, torch.Tensor) or tuple(expert_out.shape) != (rows, handle.hidden):
            shape = tuple(expert_out.shape) if isinstance(expert_out, torch.Tensor) else type(expert_out).__name__
            return f"{what} must have shape [{rows}, {handle.hidden}] (one row per received row), got {shape}"
        if expert_out.dtype != handle.dtype:
            return f"{what} must have dtype {handle.dtype}, got {expert_out.dtype}"
        if expert_out.device != handle.device:
            return f"{what} must be on {handle.device}, got {expert_out.device}"
        # world > 1 sends the rows back by copies and collectives autograd does not see, so the gradient would
        # silently stop here; world 1 (plain torch ops) is refused too, so that a caller's code means one thing
        # at every world size
        return _args.grad_problem("EPBuffer.combine", **{what: expert_out}) or ""

    def _ranks_with_problem(self, problem: bool, agree: bool | None = None) -> list[int]:
        """The ranks that found a problem: with `agree` (default check_inputs) one tiny all-gather (and its host
        sync), so that a wrong input on one rank is an error on every rank, not a hang; without, this rank's own."""
        agree = self.check_inputs if agree is None else agree
        if not (agree and self.world > 1 and dist.is_initialized()):
            return [self.rank] if problem else []
        flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=self.device)
        got = [torch.empty_like(flag) for _ in range(self.world)]
        dist.all_gather(got, flag, group=self.group)
        return [r for r, t in enumerate(torch.cat(got).tolist()) if t]

    def _combine_step_codes(self, problem: bool) -> list[int]:
        """Combine's input check on the collective layouts: every rank's code, through the collective the dispatch's
        input check runs (packed: the counts exchange's shape; dense: its status all-gather), with _COMBINE_OK or
        _COMBINE_BAD where a dispatch sends its error code. A rank that raised between its dispatch and its combine
        and dispatched again (its error caught) pairs its dispatch's check with the others' combine check: both sides
        raise at once, naming the ranks out of step, instead of waiting in collectives of other kinds until the
        group's timeout (gloo: 'Timed out waiting'; without matching sizes it aborts the process)."""
        code = -(_COMBINE_BAD if problem else _COMBINE_OK)
        if self.dense:
            return [-v for v in self._dense_status(torch.full((1,), code, dtype=torch.int64, device=self.device))]
        blocks = torch.zeros(self.world, self.num_chunks, 2 + self.experts_per_rank, dtype=torch.int64,
                             device=self.device)
        blocks[:, :, 0] = code
        recv = self._exchange_blocks(blocks)
        return [-v for v in recv[:, 0, 0].tolist()]

    def _check_combine(self, expert_out: Any, handle: Handle, rows: int) -> None:
        problem = self._combine_problem(expert_out, handle, rows)
        if self.check_inputs and self.world > 1 and dist.is_initialized() and not self.resident:
            codes = self._combine_step_codes(bool(problem))
            stepped = [r for r, c in enumerate(codes) if c not in (_COMBINE_OK, _COMBINE_BAD)]
            if stepped:
                raise ValueError(f"EPBuffer.combine on rank {self.rank}: out of step with rank(s) {stepped}: they "
                                 "called dispatch where this rank called combine; every rank must combine each "
                                 "dispatch before its next dispatch (did a rank raise between the two, catch the "
                                 "error and go on?)")
            bad = [r for r, c in enumerate(codes) if c == _COMBINE_BAD]
        else:
            bad = self._ranks_with_problem(bool(problem))
        if problem:
            if not self.check_inputs and self.world > 1 and dist.is_initialized():
                # no layout exchanges a status on the combine's path without check_inputs (the packed counts
                # exchange is the dispatch's): the others cannot be told, so say what they will do
                problem += ("; with check_inputs=False the other ranks are not told: they wait in their combine "
                            "until the group's or the transport's timeout (MOETUNE_ONESIDED_TIMEOUT_S for the "
                            "one-sided transports); check_inputs=True makes this an error on every rank at once")
            raise ValueError(f"EPBuffer.combine on rank {self.rank}: {problem}")
        if bad:
            raise ValueError(f"EPBuffer.combine on rank {self.rank}: invalid expert_out on rank(s) {bad}")

    @_one_thread
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
            # the reduce-scatter adds every row: a row without a local slot (an empty slot, a token none of whose
            # experts lives here) must add nothing, whatever the caller's expert code left in it
            ids = self._row_views(handle._recv_buf.narrow(0, ch.recv_offset, ch.recv_rows))[1]
            here = local_slots(ids, self.rank * self.experts_per_rank, self.experts_per_rank).any(1, keepdim=True)
            rows = torch.where(here, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
            return out, self.transport.reduce_scatter_async(out, rows, channel=channel)
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

    @_one_thread
    def combine(self, expert_out: torch.Tensor, handle: Handle) -> torch.Tensor:
        """expert_out [M, H]: one row per received row (that row's local experts' outputs, weighted by
        RecvMeta.weights and summed). Returns out [S, H]: for every token, the sum over its ranks. Forward-only at
        every world size: an expert_out that requires grad in grad mode is refused (wrap combine in an
        autograd.Function, or call it under torch.no_grad())."""
        self._check_combine(expert_out, handle, handle.num_recv if isinstance(handle, Handle) else 0)
        if handle.resident:
            return self._combine_resident(expert_out, handle)
        received = []
        for c, ch in enumerate(handle.chunks):
            received.append(self.post_combine(handle, c, expert_out[ch.recv_offset : ch.recv_offset + ch.recv_rows]))
        return self.finish_combine(handle, received)

    def close(self) -> None:
        """Free the transport: stop its proxy thread (joined), free its symmetric buffers / staging. Every rank
        closes its own (peers may still write into symmetric buffers: close after the last exchange on every rank).
        A second call does nothing; a dispatch or combine afterwards raises RuntimeError. RuntimeError while another
        thread is inside a call of this buffer (its transfers would run on a freed transport): close after it returns."""
        with self._caller_lock:
            if self._caller not in (None, threading.get_ident()):
                raise RuntimeError("EPBuffer.close: another thread is inside a call of this buffer (its transfers use "
                                   "the transport close() frees); close the buffer after that call returns")
            if self._closed:
                return
            self._closed = True
        if self.transport is not None:
            self.transport.close()

    def _refuse_closed(self) -> None:
        if self._closed:
            raise RuntimeError("EPBuffer: closed (close() was called; its transport is freed): build a new buffer")

    def _enter(self) -> None:
        """A call's first step (`_one_thread`): refuse a closed buffer, and order a call made on another CUDA stream
        than the buffer's previous call after everything queued on that stream so far. Every call reuses the same send,
        stage and receive rows, so a call on stream B must not start while stream A's is still using them (nor
        while A's consumer of a returned view, queued before this call, still reads it). Eager calls only: during a
        CUDA-graph capture a wait on work outside the capture is not allowed (torch.cuda.graph orders its capture
        stream after the stream it was entered from), and the stream a graph is replayed on is the caller's to
        order."""
        self._refuse_closed()
        if self.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(self.device)
        last = self._last_stream
        if last is not None and last != stream and not capturing(self.device):  # the buffer's device's stream
            stream.wait_stream(last)  # one event: nothing waits on the host
        self._last_stream = stream

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        # copy.deepcopy(layer) and torch.save(layer) failed deep inside pickle with "cannot pickle '_thread.lock'
        # object", naming neither the buffer nor a way out; a copy could not work anyway (one set of communicators,
        # symmetric memory and proxy threads per buffer, built collectively)
        raise TypeError("EPBuffer cannot be copied or pickled (copy.deepcopy, torch.save of a module holding it, e.g. "
                        "a MoELayer): it owns its group's communicators, transfer memory and threads, built by every "
                        "rank together; build another EPBuffer or MoELayer instead (on every rank), and save a layer's "
                        "weights with state_dict()")

    def __repr__(self) -> str:
        return (f"EPBuffer(world={self.world}, rank={self.rank}, model={self.model.name}, "
                f"layout={'dense' if self.dense else 'packed'}, "
                f"transport={self.knobs.transport}, compression={self.knobs.compression}, "
                f"pipeline_depth={self.knobs.pipeline_depth}, row_bytes={self.row_bytes})")
