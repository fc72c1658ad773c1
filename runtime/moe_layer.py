"""MoELayer: gate (softmax top-k, renormalised) → dispatch → experts → combine, over an EPBuffer.

Experts are SwiGLU FFNs, the form of Qwen3-MoE, gpt-oss and DeepSeek-V3 experts:

    h = x @ W_gate_up^T        (W_gate_up: [2I, H]; first I columns = gate, last I = up)
    y = (silu(h_gate) * h_up) @ W_down^T      (W_down: [H, I])

The local experts run as two grouped GEMMs (`torch._grouped_mm` over the rows sorted by local expert)
where torch has it and it works for this device and dtype (probed once, checked against a plain matmul),
otherwise as a loop over experts. The layer is forward-only (inference): parameters do not require grad, and an
input or a parameter (`layer.requires_grad_()`) that requires grad in grad mode is refused (its output would silently
carry no gradient back).

The layer checks its arguments and inputs, holds the weights and the EP buffer, and hands every call to ONE
engine (`runtime/engines/`), chosen at construction (the knob `engine`, or `engine=` here): `unfused` runs the
torch chain (world 1: `local_forward`, no exchange; world > 1: dispatch → `experts` → combine) and `megakernel`
(world 1) routing + one persistent kernel (`runtime/megakernel`) on the same weight tensors. How the engine is
chosen and when it falls back: runtime/engines/choice.py.

Weights are generated deterministically from `seed` (one generator per expert, on the layer's device), so
every rank builds only its own experts and `dense_reference` rebuilds any expert for verification.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetune.runtime import _args
from moetune.runtime.buffer.facade import TORCH_DTYPES, EPBuffer, RecvMeta
from moetune.runtime.engines.base import MoEEngine
from moetune.runtime.engines.choice import choose_engine, refuse_unrunnable_megakernel
from moetune.runtime.engines.unfused import UnfusedEngine
from moetune.runtime.knobs import ENGINES, MK_KNOBS, Knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.routing import expert_ids_problem, routed_inputs_problem, strided_problem
from moetune.runtime.shapes import ModelShape
from moetune.runtime.weights import _generator, check_seed, expert_weights, gate_weight

__all__ = ["MoELayer", "dense_reference", "expert_weights", "gate_weight", "grouped_mm_usable", "max_rel_err", "route",
           "swiglu"]


def route(x: torch.Tensor, gate_w: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the gate logits (fp32), top-k, renormalised: (topk_idx int64 [S, k], weights fp32 [S, k]).

    Equal probabilities go to the lower expert first, in pick order, as in the megakernel's routing kernels
    (runtime/megakernel/topk.py `select`; a row of NaNs picks experts 0..k-1 there too). ValueError where `topk` is
    not in 0..experts (the gate's rows)."""
    experts = gate_w.shape[0]
    if not 0 <= topk <= experts:  # the slice below would hand back fewer than topk picks, silently (topk raised)
        raise ValueError(f"route: topk must be in 0..{experts} (the gate's experts), got {topk}")
    logits = x.float() @ gate_w.float().t()
    probs = torch.softmax(logits, dim=-1)
    # a stable sort, not topk: topk leaves the order of ties unspecified (on the CPU a row of 128 equal
    # probabilities, as a zero gate gives, picked experts 84, 87, 86, ...), so the unfused engine and
    # dense_reference routed such tokens to other experts than the megakernel
    w, idx = probs.sort(dim=-1, descending=True, stable=True)
    w, idx = w[:, :topk].contiguous(), idx[:, :topk].contiguous()  # as topk returned them: the same sums below
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return idx, w


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's FFN on rows x; `row_scale` ([rows, 1]) multiplies the activation before the down projection
    (the routing weight, applied where the rows are I wide rather than H wide)."""
    i = w2.shape[1]
    h = x @ w1.t()
    a = F.silu(h[:, :i]) * h[:, i:]
    return (a if row_scale is None else a * row_scale) @ w2.t()


def grouped_mm_usable(device_type: str, device_index: int | None, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether torch._grouped_mm runs (and is right) for these shapes on this device/dtype (probed once per process;
    a probe that ran out of memory answers False for this call only, not for every later layer)."""
    try:
        return _grouped_mm_probe(device_type, device_index, dtype, hidden, inter)
    except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError from 2.5) not cached: the next layer probes again
        return False


@functools.lru_cache(maxsize=32)
def _grouped_mm_probe(device_type: str, device_index: int | None, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        g = _generator(device, 12345)
        a = torch.randn(7, hidden, generator=g, device=device).to(dtype)
        b = (torch.randn(3, 2 * inter, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
        offs = torch.tensor([2, 2, 7], dtype=torch.int32, device=device)
        y = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        ref = torch.cat([a[:2].float() @ b[0].float().t(), a[2:].float() @ b[2].float().t()])
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        return bool(((y.float() - ref).abs().max() <= tol * (ref.abs().max() + 1e-6)).item())
    except torch.cuda.OutOfMemoryError:  # says nothing of the op: grouped_mm_usable answers it without caching
        raise
    except Exception:  # broad: a probe; any failure of the private op means "not usable here", never a crash
        return False


class MoELayer(nn.Module):
    """An expert-parallel MoE layer. Construction is collective over `group`: it builds an EPBuffer, then checks that
    every rank passed the same `seed` (the weights and the gate are built from it) and that no rank's layer failed
    (its arguments, its weights, its engine), raising on every rank otherwise. Without knobs, the buffer looks up
    the EP profile at world > 1 only: at world 1 the layer never exchanges (no EP knob acts), so its buffer runs the
    built-in collective default and the only lookup is the megakernel's (`engine` below).

    `engine`: None (the knobs' `engine`; without knobs, at world 1, the `megakernel` profile's), `"unfused"`
    or `"megakernel"` (world 1 only; raises `MegakernelUnavailable` where it cannot run). After construction
    `self.engine` says which engine runs and `self.engine_note` why, when it is not the one asked for.
    With the megakernel, `w_gate_up` / `w_down` hold its k-tiled layout in place (`weights_tiled`; shapes unchanged,
    runtime/megakernel/weights.py): `state_dict` and `load_state_dict` convert, so checkpoints stay row-major, and
    `experts` / `local_forward` compute on row-major copies. Parameters replaced by `load_state_dict(assign=True)`
    or `.to()` are handed to the megakernel again (it runs bf16 on the layer's device only: anything else raises);
    the unfused engine too runs the dtype and device the layer was built with (its inputs' and its buffer's), and a
    call after `.float()`, `.half()`, `.to()` or an assigned checkpoint of another dtype raises ValueError naming the
    parameter.

    `use_grouped_mm` (the unfused engine's local experts): None, the grouped GEMM where it runs for the layer's device
    and dtype (probed once), else the loop over experts; True, the grouped GEMM (ValueError here where it does not
    run; a probe that ran out of memory leaves it True); False, the loop.

    `max_tokens` (an int >= 1) is the most tokens S one call takes, whatever the engine. `buffer`: an EPBuffer to
    use instead of building one; it must agree with `model`, `max_tokens` and whichever of `group`, `knobs`, `dtype`,
    `device` and `options` are given. `options`: `RuntimeOptions` or a mapping of option names (see EPBuffer).
    `expected_tokens` (1..max_tokens; None: the buffer's): the token count the auto-loaded profiles are picked for.

    Not thread-safe: one layer instance must not be called from two threads at once (the megakernel's launch
    templates and scratch buffers and the EP buffer's staging are shared by every call).

    `close()` frees the EPBuffer the layer built (its proxy thread and symmetric buffers); forward afterwards raises.
    """

    _closed = False  # close() was called
    _owns_buffer = False  # the layer built its EPBuffer (close() closes it)

    def __init__(
        self,
        model: ModelShape,
        group: dist.ProcessGroup | None = None,
        knobs: Knobs | None = None,
        *,
        max_tokens: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        use_grouped_mm: bool | None = None,
        buffer: EPBuffer | None = None,
        engine: str | None = None,
        options: RuntimeOptions | Mapping[str, Any] | None = None,
        expected_tokens: int | None = None,
    ):
        super().__init__()
        try:
            _check_arguments(model, knobs, max_tokens, device, dtype, seed, use_grouped_mm, buffer, options,
                             expected_tokens)
            if engine is not None and engine not in ENGINES:
                raise ValueError(f"MoELayer: engine must be one of {', '.join(ENGINES)} or None, got {engine!r}")
            if buffer is not None:
                _check_buffer(buffer, model, group, knobs, max_tokens, device, dtype, options)
        except Exception as e:
            # the other ranks wait in the first collective: the buffer's agreement, or with a given buffer the
            # layer's own (of the same shape); this rank takes part with its refusal, so they raise too (then it
            # raises `e`)
            if isinstance(buffer, EPBuffer):
                _agree(buffer, e, 0)
            EPBuffer.refuse(group, e)
        self.model = model
        self.max_tokens = max_tokens
        self._owns_buffer = buffer is None  # close() closes a buffer the layer built, never a caller's
        # autoload_at_world1=False: at world 1 both engines run without an exchange (local_forward, the megakernel),
        # so no EP knob acts and the buffer looks no EP profile up (no daemon round trip, no fallback warning about
        # a collective profile one GPU never uses); the megakernel's own lookup (choice.py) stays
        self.buffer = buffer or EPBuffer(group, knobs, model=model, max_tokens=max_tokens, device=device, dtype=dtype,
                                         options=options, expected_tokens=expected_tokens, autoload_at_world1=False)
        try:
            self._build(engine, knobs, max_tokens, seed, use_grouped_mm, expected_tokens)
        except BaseException:
            if self._owns_buffer:  # the caller never gets this layer to close: the buffer's thread and memory go now
                self.buffer.close()
            raise

    def _build(self, engine: str | None, knobs: Knobs | None, max_tokens: int, seed: int,
               use_grouped_mm: bool | None, expected_tokens: int | None) -> None:
        """The layer past its buffer: weights, engine and the ranks' agreement (the constructor closes a buffer it
        built when this raises)."""
        self.expected_tokens = expected_tokens if expected_tokens is not None else self.buffer.expected_tokens
        self.device = self.buffer.device
        self.dtype = self.buffer.dtype
        self.seed = seed
        epr = self.buffer.experts_per_rank
        first = self.buffer.rank * epr
        self.local_experts = range(first, first + epr)
        self._engine: MoEEngine = UnfusedEngine()  # the engine every call goes to (_setup_engine chooses it)
        self.engine_note = ""  # why the engine is not the one the knobs or the profile named
        self.engine_resolution: Any = None  # the autoload Resolution when the megakernel profile was looked up
        self.register_state_dict_post_hook(_state_dict_row_major)
        self.register_load_state_dict_pre_hook(_load_state_dict_tiled)
        self.register_load_state_dict_post_hook(_load_state_dict_rebind)
        fault: Exception | None = None
        try:
            if engine == "megakernel":  # before the weights: a large model's take minutes (or all memory) on a CPU
                refuse_unrunnable_megakernel(self)
            self._build_weights(seed, use_grouped_mm)
            self._setup_engine(engine, knobs, max_tokens)
        except Exception as e:  # out of memory, engine="megakernel" refused, ... on this rank: the others are told in
            if self.buffer.world == 1 or not dist.is_initialized():  # the agreement rather than left waiting there
                raise
            fault = e
        _agree(self.buffer, fault, seed)

    def _build_weights(self, seed: int, use_grouped_mm: bool | None) -> None:
        """This rank's experts' weights and the gate from `seed`, and the unfused path's constants."""
        model = self.model
        w1s, w2s = zip(*(expert_weights(model, e, seed=seed, device=self.device, dtype=self.dtype) for e in self.local_experts), strict=True)
        self.w_gate_up = nn.Parameter(torch.stack(w1s), requires_grad=False)  # [E_local, 2I, H]
        self.w_down = nn.Parameter(torch.stack(w2s), requires_grad=False)  # [E_local, H, I]
        self.gate = nn.Parameter(gate_weight(model, seed=seed, device=self.device, dtype=self.dtype), requires_grad=False)
        # the unfused path's constant: searchsorted's expert edges 1..E (int64, as the expert ids)
        self.register_buffer("_expert_ends", torch.arange(1, len(self.local_experts) + 1, device=self.device),
                             persistent=False)
        probe = (self.device.type, self.device.index, self.dtype, model.hidden, model.intermediate)
        if use_grouped_mm:
            try:
                usable = _grouped_mm_probe(*probe)
            except torch.cuda.OutOfMemoryError:  # says nothing of the op: the caller's True stands (as before the probe)
                usable = True
        else:
            usable = grouped_mm_usable(*probe) if use_grouped_mm is None else False
        if use_grouped_mm and not usable:  # now, not as a failure deep inside the first forward's grouped GEMM
            raise ValueError(f"MoELayer: use_grouped_mm=True, but torch._grouped_mm does not run (or does not match a "
                             f"plain matmul) for {self.dtype} on {self.device} in this torch build; pass None (use it "
                             "where it runs) or False")
        self.use_grouped_mm = usable

    # -- engine ------------------------------------------------------------------------------------------
    def _setup_engine(self, engine: str | None, knobs: Knobs | None, max_tokens: int) -> None:
        """Choose the engine (runtime/engines/choice.py has the rules) and build it."""
        choice = choose_engine(self, engine, knobs, max_tokens, runnable=engine == "megakernel")
        self._engine, self.engine_note, self.engine_resolution = choice.engine, choice.note, choice.resolution

    # what the layer shows of its engine (names tests, benchmarks and docs use)
    @property
    def engine(self) -> str:
        """The engine that runs: "unfused" or "megakernel"."""
        return self._engine.name

    @property
    def megakernel(self) -> Any:
        """The MegakernelMoE the megakernel engine launches; None for the unfused engine and after close()."""
        return self._engine.megakernel

    @property
    def engine_knobs(self) -> Knobs | None:
        """The knob set the megakernel runs with; None for the unfused engine."""
        return self._engine.knobs

    @property
    def engine_buckets(self) -> dict[int, Knobs] | None:
        """The megakernel's per token bucket knobs when they come from stored profiles ({bucket: knobs}; None with
        explicit knobs, which hold for every S, and for the unfused engine); buckets are resolved on the first eager
        call of each S."""
        return self._engine.buckets

    @property
    def weights_tiled(self) -> bool:
        """True while the expert weights hold the megakernel's k-tiled layout (runtime/megakernel/weights.py): the
        parameters keep their shapes, and state_dict / load_state_dict speak the row-major layout either way."""
        return self._engine.tiled_weights

    def resolve_buckets(self) -> dict[int, Knobs]:
        """Look up the megakernel profile of every token bucket a call of 1..max_tokens tokens falls in, now (call it
        before capturing CUDA graphs). Returns {bucket: knobs}; {} where the knobs are not per bucket (explicit
        knobs, or the unfused engine)."""
        self._refuse_closed()  # installing a bucket's profile needs the megakernel close() let go
        return self._engine.resolve_buckets(self.max_tokens)

    def close(self) -> None:
        """Free the layer's communication and engine: close the EPBuffer it built (its proxy thread stops, its
        symmetric buffers are freed; a buffer passed in as `buffer=` is the caller's to close) and let go of the
        megakernel (`megakernel` is None from now on; its scratch is freed once nothing else refers to it). Every
        rank closes its own layer, after its last forward. A second call does nothing; forward, `check`,
        `clear_error` and `resolve_buckets` afterwards raise RuntimeError (state_dict and load_state_dict still
        work). A CUDA graph that captured this layer's forward must not be replayed after close(): its launches use
        the scratch let go here. A layer (and the buffer it built) dropped without close() stops its proxy thread
        when collected."""
        if self._closed:
            return
        if self._owns_buffer:
            # first: where the buffer refuses (another thread inside a call of it) the layer stays open and a later
            # close() closes both, rather than a closed layer over a buffer nothing closes any more
            self.buffer.close()
        self._engine.close()
        self._closed = True

    def _refuse_closed(self) -> None:
        if self._closed:
            raise RuntimeError("MoELayer: closed (close() was called): build a new layer")

    def check(self) -> None:
        """Raise the megakernel's device-side error (a wait that timed out, an expert id out of range: its
        `MegakernelError`) if a launch since the last `clear_error()` reported one (the record is sticky: every
        later check raises it until cleared); a host sync. The unfused engine has no such record (its errors raise
        at the call): nothing to do."""
        self._refuse_closed()  # close() let the megakernel's error record go
        self._engine.check()

    def clear_error(self) -> None:
        """Forget the megakernel's error record after handling it (`check()` raises it until then); the launches
        after this run and report afresh. Nothing to do for the unfused engine."""
        self._refuse_closed()
        self._engine.clear_error()

    def _row_major_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_gate_up, w_down) row-major: the parameters, or where they hold the megakernel's k-tiled layout new
        row-major copies. Made per call, not cached: a cache would keep a second copy of every expert's weights (GBs
        on real shapes) for methods the megakernel engine's forward never calls; a call pays one copy of them."""
        if not self.weights_tiled:
            return self.w_gate_up, self.w_down
        from moetune.runtime.megakernel.weights import from_tiled

        return from_tiled(self.w_gate_up), from_tiled(self.w_down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` with this layer's gate, widened to fp32 in the call. No fp32 copy is kept across calls: no test
        tells when one is stale (a write through `gate.data`, e.g. `gate.data.copy_(w)`, leaves the version counter
        as it was, and a CUDA graph captured with the copy would replay it after any in-place write to the gate,
        which the megakernel and the expert weights read as written)."""
        return route(x, self.gate, self.model.topk)

    @torch.no_grad()
    def experts(self, recv_x: torch.Tensor, meta: RecvMeta) -> torch.Tensor:
        """One output row per received row: its local experts' SwiGLU outputs, weighted and summed."""
        m, h = recv_x.shape[0], self.model.hidden
        out = torch.zeros(m, h, dtype=torch.float32, device=self.device)
        if meta.num_pairs:
            w1, w2 = self._row_major_experts()
            rows, wp = meta.expert_layout()
            xs = recv_x.index_select(0, rows)
            if self.use_grouped_mm:
                offs = torch.cumsum(meta.tokens_per_expert_tensor, 0).to(torch.int32)
                hg = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
                i = self.model.intermediate
                a = F.silu(hg[:, :i]) * hg[:, i:]
                y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
            else:
                parts = []
                start = 0
                for j, n in enumerate(meta.tokens_per_expert):
                    if n:
                        parts.append(swiglu(xs[start : start + n], w1[j], w2[j]))
                    start += n
                y = torch.cat(parts)
            out.index_add_(0, rows, y.float() * wp.unsqueeze(1))
        return out.to(self.dtype)

    @torch.no_grad()
    def local_forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The whole layer on this rank's experts, no exchange: the path for world 1.

        Sort the (token, slot) pairs by expert, two grouped GEMMs, then each row back to its (token, slot) place
        and the token's k rows summed. Every step stays on the device (expert offsets from `searchsorted`, no
        `.item()`), so it captures in a CUDA graph; an EPBuffer round trip at world 1 only adds launches and, in
        the packed layout, a host copy. The routing weight scales the SwiGLU output (I wide) before the down
        projection, which is linear, instead of y (H wide) after it; the rows are put back in place
        (`index_copy_`, no atomics: the same bits every run) and summed in fp32 by the reduction, so no
        [S*k, H] fp32 copy of y is written, scaled and scattered as in the plain torch path.
        """
        s, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        experts_sorted, order = torch.sort(flat, stable=True)  # the sorted ids too: the offsets need no gather
        tok = torch.div(order, k, rounding_mode="floor")
        xs = x.index_select(0, tok)
        wp = topk_weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
        w1, w2 = self._row_major_experts()
        n_exp = w1.shape[0]
        i = self.model.intermediate
        if self.use_grouped_mm:
            offs = torch.searchsorted(experts_sorted, self._expert_ends, out_int32=True)
            hg = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
            a = F.silu(hg[:, :i]).mul_(hg[:, i:]).mul_(wp)
            y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
        else:  # CPU / no grouped GEMM: a loop over the experts present (syncs; not capturable)
            counts = torch.bincount(flat, minlength=n_exp).tolist()
            parts, start = [], 0
            for e, n in enumerate(counts):
                if n:
                    parts.append(swiglu(xs[start : start + n], w1[e], w2[e], wp[start : start + n]))
                start += n
            y = torch.cat(parts) if parts else xs.new_zeros(0, self.model.hidden)
        placed = torch.empty_like(y).index_copy_(0, order, y)  # row r of y is pair order[r] = (token, slot)
        return placed.view(s, k, self.model.hidden).sum(dim=1)  # fp32 accumulation in the reduction, rounded once

    def _check_x(self, x: torch.Tensor) -> None:
        h = self.model.hidden
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a [S, {h}] tensor, got {got}")
        why = strided_problem("x", x)
        if why is not None:
            raise ValueError(why)
        if x.device != self.device or x.dtype != self.dtype:
            # after .float() / .to() the caller's x follows the parameters: name them (the engine's check), not x
            # ("x must be torch.bfloat16" sent them back to bf16 inputs, only to be refused for the weights then)
            self._engine.rebind(self)
            raise ValueError(f"x must be {self.dtype} on {self.device}, got {x.dtype} on {x.device}")
        if x.shape[0] > self.max_tokens:  # every engine: the megakernel's scratch and the buffer are sized for it
            raise ValueError(f"x has {x.shape[0]} tokens, more than max_tokens={self.max_tokens}")

    def _check_local(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """The routed inputs at world 1 (the EP buffer checks them at world > 1). The expert ids are range-checked
        too, and for the megakernel a token's ids must be distinct experts (its per-expert row lists hold one row
        per token; the torch engines add a repeated expert's rows like any others): one host sync, skipped while a
        CUDA graph is captured and where the buffer was built with check_inputs=False (as the EP buffer skips its
        own check; the megakernel then drops an overflowing row itself and records it for `check()`)."""
        self._check_x(x)
        why = routed_inputs_problem(x.shape[0], self.model.topk, self.device, topk_idx, topk_weights)
        if why is None and self.buffer.check_inputs:
            why = expert_ids_problem(topk_idx, self.model.experts, distinct=self._engine.distinct_expert_ids)
        if why is not None:
            raise ValueError(why)

    def _refuse_parameter_grad(self) -> None:
        """ValueError where grad mode is on and a parameter requires grad (`layer.requires_grad_()`, a training loop):
        the layer runs with grad mode off, so its output would come back detached and the parameters' gradient
        silently None. At world > 1 every rank hears it through the dispatch's input check (`refuse_dispatch`), not
        this rank alone while the others wait in their dispatch. Host-side flags only: no sync."""
        if not torch.is_grad_enabled():  # every call passes here: no parameter walk under no_grad / inference_mode
            return
        why = _args.grad_problem("MoELayer", noun="parameter", fix="layer.requires_grad_(False)",
                                 **dict(self.named_parameters(recurse=False)))
        if why is None:
            return
        error = ValueError(f"MoELayer: {why}")
        if self.buffer.world == 1:
            raise error
        self.buffer.refuse_dispatch(error, grad=True)

    def forward_routed(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The layer with given routing (benchmarks inject uniform/Zipf routing here): topk_idx integer [S, topk]
        expert ids in [0, experts), distinct within a token where the megakernel runs, topk_weights floating [S,
        topk], on the layer's device. Ids that break that raise ValueError (a host sync; see `_check_local` for when
        it is skipped), and so does an x or topk_weights that requires grad in grad mode (the layer has no
        backward)."""
        self._refuse_closed()
        grad = _args.grad_problem("MoELayer", x=x, topk_weights=topk_weights)
        if self.buffer.world == 1:  # one rank (every megakernel layer): checked here; the EP buffer checks at world > 1
            self._check_local(x, topk_idx, topk_weights)
            if grad is not None:
                raise ValueError(f"MoELayer: {grad}")
        self._refuse_parameter_grad()
        # grad mode off for the call; at world > 1 it stays on where the inputs want a gradient, so that the EP
        # buffer's input check refuses them on every rank (raising here would leave the others waiting in dispatch)
        with torch.set_grad_enabled(grad is not None):
            return self._engine.forward_routed(self, x, topk_idx, topk_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for x [S, H] (the layer's dtype, on its device, S <= max_tokens): ValueError otherwise,
        and for an x that requires grad in grad mode (the layer has no backward)."""
        self._refuse_closed()
        grad = _args.grad_problem("MoELayer", x=x)
        if self.buffer.world == 1:  # one rank (every megakernel layer): no exchange, checked once here
            self._check_x(x)
            if grad is not None:
                raise ValueError(f"MoELayer: {grad}")
        self._refuse_parameter_grad()
        with torch.set_grad_enabled(grad is not None):  # as in forward_routed: the EP buffer refuses it at world > 1
            return self._engine.forward(self, x)


_TILED = ("w_gate_up", "w_down")


def _state_dict_row_major(module: MoELayer, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    """state_dict post-hook: the expert weights row-major (copies) where the layer holds them k-tiled."""
    if module.weights_tiled:
        from moetune.runtime.megakernel.weights import from_tiled

        for name in _TILED:
            if prefix + name in state_dict:
                state_dict[prefix + name] = from_tiled(state_dict[prefix + name])


def _load_state_dict_tiled(module: MoELayer, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: row-major expert weights into the k-tiled layout where the layer holds that
    (a wrong shape is left for load_state_dict to report)."""
    if module.weights_tiled:
        from moetune.runtime.megakernel.weights import to_tiled

        for name in _TILED:
            v = state_dict.get(prefix + name)
            if isinstance(v, torch.Tensor) and v.shape == getattr(module, name).shape:
                state_dict[prefix + name] = to_tiled(v)


def _load_state_dict_rebind(module: MoELayer, _incompatible: Any) -> None:
    """load_state_dict post-hook: with assign=True the parameters are new tensors; the megakernel reads them from
    now on (a wrong dtype or device raises here, not at the next forward)."""
    module._engine.rebind(module)


def _agree(buf: EPBuffer, fault: Exception | None, seed: int) -> None:
    """The layer's own agreement after the buffer's (one int64 all-gather over the buffer's group, of the buffer
    agreement's shape: `EPBuffer.layer_agreement`): whether any rank's layer failed (its weights or its engine; with a
    given buffer, its arguments), and the seed. Ranks with different
    seeds would route by different gates and hold experts of different weights: wrong outputs, silently; a refused
    rank would leave the others waiting in their first dispatch. Raises on every rank; `fault` on its own."""
    if buf.world == 1 or not dist.is_initialized():
        if fault is not None:
            raise fault
        return
    rows, why = buf.layer_agreement([int(fault is not None), seed])
    failed = [r for r, row in enumerate(rows) if row[0] and r != buf.rank]
    if fault is not None:
        if failed or why:
            fault.add_note(f"MoELayer: {why or f'also refused on rank(s) {failed}'}")
        raise fault
    if why is not None:
        raise ValueError(f"MoELayer on rank {buf.rank}: {why}")
    if failed:
        raise ValueError(f"MoELayer on rank {buf.rank}: the layer was refused on rank(s) {failed} (its arguments, "
                         "its weights or its engine); every rank must build the layer alike (that rank's error says why)")
    seeds = [row[1] for row in rows]
    if any(s != seeds[0] for s in seeds):
        raise ValueError(f"MoELayer: the ranks were given different seeds ({seeds}, by rank); the layer's weights "
                         "and gate are built from the seed, so every rank must pass the same one")


def _check_arguments(model: Any, knobs: Any, max_tokens: Any, device: Any, dtype: Any, seed: Any,
                     use_grouped_mm: Any, buffer: Any, options: Any, expected_tokens: Any) -> None:
    """TypeError / ValueError naming the argument (and the layer: the other ranks' errors name it too), before
    anything is built from it."""
    who = "MoELayer: "
    _args.check_model(model, who)
    _args.check_knobs(knobs, who)
    _args.check_int("max_tokens", max_tokens, 1, who)
    if expected_tokens is not None:  # here too, not only in EPBuffer: a given buffer bypasses its check
        _args.check_int("expected_tokens", expected_tokens, 1, who)
        if expected_tokens > max_tokens:
            raise ValueError(f"{who}expected_tokens={expected_tokens} is more than max_tokens={max_tokens}")
    _args.check_device(device, who)
    if device is not None:  # here, not first in its buffer: that refusal named "EPBuffer: device=..."
        _args.usable_device(device, who)
    _args.check_dtype(dtype, who)
    check_seed(seed, who)
    _args.check_flag("use_grouped_mm", use_grouped_mm, who, optional=True)
    if buffer is not None and not isinstance(buffer, EPBuffer):
        raise TypeError(f"{who}buffer must be an EPBuffer or None, got {type(buffer).__name__}")
    if options is not None and not isinstance(options, (RuntimeOptions, Mapping)):
        raise TypeError(f"{who}options must be a RuntimeOptions, a mapping of option names or None, got "
                        f"{type(options).__name__}")


def _check_buffer(buffer: EPBuffer, model: ModelShape, group: Any, knobs: Knobs | None, max_tokens: int, device: Any,
                  dtype: Any, options: Any) -> None:
    """A given EP buffer must agree with the layer's own arguments (those given): the layer sizes its weights and
    checks its inputs by them, the buffer its transfers."""
    bad = []
    if buffer.model != model:
        bad.append(f"model {model} vs the buffer's {buffer.model}")
    if buffer.max_tokens != max_tokens:
        bad.append(f"max_tokens {max_tokens} vs the buffer's {buffer.max_tokens}")
    if group is not None and group is not buffer.group:
        bad.append("group is not the buffer's group")
    if knobs is not None:  # the buffer runs its own exchange knobs: others given here would be ignored
        # (engine and mk_* are the layer's own, read from `knobs` by the megakernel, never by the buffer)
        diff = [f"{n}={getattr(knobs, n)!r} vs the buffer's {getattr(buffer.knobs, n)!r}"
                for n in Knobs.__struct_fields__ if n not in MK_KNOBS and getattr(knobs, n) != getattr(buffer.knobs, n)]
        if diff:
            bad.append(f"knobs {', '.join(diff)}")
    if dtype is not None and dtype != buffer.dtype:
        bad.append(f"dtype {dtype} vs the buffer's {buffer.dtype}")
    if device is not None:
        dev = _args.indexed_device(device)  # the current device for "cuda", as EPBuffer takes it
        if dev != buffer.device:
            bad.append(f"device {dev} vs the buffer's {buffer.device}")
    if options is not None and RuntimeOptions.resolve(options) != buffer.options:
        bad.append("options differ from the buffer's")
    if bad:
        raise ValueError(f"MoELayer: buffer disagrees with the layer's arguments: {'; '.join(bad)} (build the buffer "
                         "with the same arguments, or leave them out)")


@torch.no_grad()
def dense_reference(
    x: torch.Tensor,
    model: ModelShape,
    *,
    seed: int = 0,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    weight_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The same layer on one process, no communication: out[t] = sum_j w[t,j] * expert_{idx[t,j]}(x[t]).

    Weights are rebuilt from `seed` on x's device in `weight_dtype` (default: the model dtype), math in fp32.
    Routing comes from the gate when topk_idx/topk_weights are not given (both or neither: ValueError otherwise); given
    routing is checked as the layer checks it (integer ids and floating weights, [S, topk], on x's device).
    Returns fp32 [S, H].
    """
    if (topk_idx is None) != (topk_weights is None):
        # one of them alone was either replaced by the gate's routing without a word (weights given, ids not) or
        # failed on a bare assert (ids given, weights not)
        given, missing = ("topk_idx", "topk_weights") if topk_weights is None else ("topk_weights", "topk_idx")
        raise ValueError(f"dense_reference: {given} was given without {missing}: pass both (the routing to check) "
                         "or neither (the gate's routing from `seed`)")
    # as the layer checks its inputs: other shapes computed a 'reference' of other routing without a word, or failed
    # deep inside (a matmul's shapes, an IndexError in the loop below)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != model.hidden:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"dense_reference: x must be a [S, {model.hidden}] tensor, got {got}")
    why = strided_problem("x", x)
    if why is not None:
        raise ValueError(f"dense_reference: {why}")
    if topk_idx is not None:
        why = routed_inputs_problem(x.shape[0], model.topk, x.device, topk_idx, topk_weights)
        if why is not None:
            raise ValueError(f"dense_reference: {why}")
    wdt = weight_dtype if weight_dtype is not None else TORCH_DTYPES[model.dtype]
    if topk_idx is None:
        gate = gate_weight(model, seed=seed, device=x.device, dtype=wdt)
        topk_idx, topk_weights = route(x.to(wdt), gate, model.topk)
    assert topk_weights is not None
    xf = x.float()
    out = torch.zeros(x.shape[0], model.hidden, dtype=torch.float32, device=x.device)
    idx = topk_idx.long()
    for e in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        w1, w2 = expert_weights(model, e, seed=seed, device=x.device, dtype=wdt)
        y = swiglu(xf[tok], w1.float(), w2.float())
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (normwise; 0 for empty outputs; inf where the shapes differ)."""
    if tuple(out.shape) != tuple(ref.shape):  # not broadcast: one row equal to ref's first would measure 0
        return math.inf
    if ref.numel() == 0:
        return 0.0
    denom = ref.float().abs().max().clamp_min(1e-30)
    return float((out.float() - ref.float()).abs().max() / denom)
