"""MoELayer: gate (softmax top-k, renormalised) → dispatch → experts → combine, over an EPBuffer.

Experts are SwiGLU FFNs, the form of Qwen3-MoE, gpt-oss and DeepSeek-V3 experts:

    h = x @ W_gate_up^T        (W_gate_up: [2I, H]; first I columns = gate, last I = up)
    y = (silu(h_gate) * h_up) @ W_down^T      (W_down: [H, I])

The local experts run as two grouped GEMMs (`torch._grouped_mm` over the rows sorted by local expert)
where torch has it and it works for this device and dtype (probed once, checked against a plain matmul),
otherwise as a loop over experts. The layer is forward-only (inference): parameters do not require grad.

At world 1 the layer has two engines (the knob `engine`, or `engine=` here): `unfused` runs `local_forward`
(the chain below, no exchange) and `megakernel` runs routing + one persistent kernel (`runtime/megakernel`)
on the same weight tensors. How the engine is chosen and when it falls back: runtime/megakernel/engine.py.

Weights are generated deterministically from `seed` (one generator per expert, on the layer's device), so
every rank builds only its own experts and `dense_reference` rebuilds any expert for verification.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetune.runtime.buffer.facade import TORCH_DTYPES, EPBuffer, RecvMeta
from moetune.runtime.knobs import ENGINES, Knobs
from moetune.runtime.megakernel import engine as _engine
from moetune.runtime.pipeline import pipelined_moe
from moetune.runtime.shapes import ModelShape
from moetune.runtime.weights import _generator, expert_weights, gate_weight

__all__ = ["MoELayer", "dense_reference", "expert_weights", "gate_weight", "grouped_mm_usable", "max_rel_err", "route",
           "swiglu"]


def route(x: torch.Tensor, gate_w: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the gate logits (fp32), top-k, renormalised: (topk_idx int64 [S, k], weights fp32 [S, k])."""
    logits = x.float() @ gate_w.float().t()
    probs = torch.softmax(logits, dim=-1)
    w, idx = probs.topk(topk, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return idx, w


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's FFN on rows x; `row_scale` ([rows, 1]) multiplies the activation before the down projection
    (the routing weight, applied where the rows are I wide rather than H wide)."""
    i = w2.shape[1]
    h = x @ w1.t()
    a = F.silu(h[:, :i]) * h[:, i:]
    return (a if row_scale is None else a * row_scale) @ w2.t()


@functools.lru_cache(maxsize=32)
def grouped_mm_usable(device_type: str, device_index: int | None, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether torch._grouped_mm runs (and is right) for these shapes on this device/dtype."""
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
    except Exception:  # broad: a probe; any failure of the private op means "not usable here", never a crash
        return False


class MoELayer(nn.Module):
    """An expert-parallel MoE layer. Construction is collective over `group` (it builds an EPBuffer).

    `engine`: None (the knobs' `engine`; without knobs, at world 1, the `megakernel` profile's), `"unfused"`
    or `"megakernel"` (world 1 only; raises `MegakernelUnavailable` where it cannot run). After construction
    `self.engine` says which engine runs and `self.engine_note` why, when it is not the one asked for.
    With the megakernel, `w_gate_up` / `w_down` hold its k-tiled layout in place (`weights_tiled`; shapes unchanged,
    runtime/megakernel/weights.py): `state_dict` and `load_state_dict` convert, so checkpoints stay row-major.
    """

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
    ):
        super().__init__()
        if engine is not None and engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)} or None, got {engine!r}")
        self.model = model
        self.buffer = buffer or EPBuffer(group, knobs, model=model, max_tokens=max_tokens, device=device, dtype=dtype)
        self.device = self.buffer.device
        self.dtype = self.buffer.dtype
        self.seed = seed
        epr = self.buffer.experts_per_rank
        first = self.buffer.rank * epr
        self.local_experts = range(first, first + epr)
        w1s, w2s = zip(*(expert_weights(model, e, seed=seed, device=self.device, dtype=self.dtype) for e in self.local_experts), strict=True)
        self.w_gate_up = nn.Parameter(torch.stack(w1s), requires_grad=False)  # [E_local, 2I, H]
        self.w_down = nn.Parameter(torch.stack(w2s), requires_grad=False)  # [E_local, H, I]
        self.gate = nn.Parameter(gate_weight(model, seed=seed, device=self.device, dtype=self.dtype), requires_grad=False)
        # the unfused path's constants: the gate in fp32 (route() widens it every call otherwise; remade when the
        # gate is written, e.g. by load_state_dict) and searchsorted's expert edges 1..E (int64, as the expert ids)
        self._gate_f32: tuple[int, int, torch.Tensor] | None = None
        self.register_buffer("_expert_ends", torch.arange(1, epr + 1, device=self.device), persistent=False)
        if use_grouped_mm is None:
            use_grouped_mm = grouped_mm_usable(self.device.type, self.device.index, self.dtype, model.hidden, model.intermediate)
        self.use_grouped_mm = use_grouped_mm
        self.engine = "unfused"
        self.engine_note = ""
        self.engine_knobs: Knobs | None = None  # the knob set the megakernel runs with
        self.engine_resolution: Any = None  # the autoload Resolution when the megakernel profile was looked up
        self.megakernel: Any = None
        # True while the expert weights hold the megakernel's k-tiled layout (runtime/megakernel/weights.py): the
        # parameters keep their shapes, and state_dict / load_state_dict speak the row-major layout either way
        self.weights_tiled = False
        self.register_state_dict_post_hook(_state_dict_row_major)
        self.register_load_state_dict_pre_hook(_load_state_dict_tiled)
        self._setup_engine(engine, knobs, max_tokens)

    # -- engine ------------------------------------------------------------------------------------------
    def _setup_engine(self, engine: str | None, knobs: Knobs | None, max_tokens: int) -> None:
        """Pick the engine (runtime/megakernel/engine.py has the rules) and build the megakernel when chosen."""
        if engine == "unfused":
            return
        world1 = self.buffer.world == 1
        wanted: Knobs | None = None
        if knobs is not None:
            wanted = knobs if knobs.engine == "megakernel" else None
            if engine == "megakernel" and wanted is None:
                wanted = knobs.replace(engine="megakernel")
        elif engine == "megakernel" or (world1 and _engine.megakernel_problem(self.device, self.dtype, self.model) is None):
            if world1:
                from moetune.runtime.profiles.autoload import autoload_profile

                res = autoload_profile(model=self.model, ep_size=1, nodes=1, max_tokens=max(1, max_tokens),
                                       device=self.device, transport_family=_engine.ENGINE_FAMILY)
                self.engine_resolution = res
                if res.knobs.engine == "megakernel":
                    wanted = res.knobs
                elif engine == "megakernel":
                    wanted = res.knobs.replace(engine="megakernel")
            else:
                wanted = Knobs(engine="megakernel")
        elif world1 and self.device.type == "cuda":  # auto on a GPU that cannot run it: say so once
            why = _engine.megakernel_problem(self.device, self.dtype, self.model)
            self.engine_note = str(why)
            _engine.warn_fallback_once(str(why))
            return
        if wanted is None:
            return
        if not world1:
            why: str | None = (f"it runs the layer on one GPU (world 1); this group has {self.buffer.world} ranks")
        else:
            why = _engine.megakernel_problem(self.device, self.dtype, self.model)
        if why is None:
            from moetune.runtime.megakernel.config import MegakernelConfig
            from moetune.runtime.megakernel.weights import tile_, untile_

            # the megakernel reads the expert weights k-tiled: this layer's parameters become that layout in place
            # (no second copy of the weights); state_dict / load_state_dict convert (the hooks in __init__)
            tile_(self.w_gate_up.data)
            tile_(self.w_down.data)
            try:
                self.megakernel = _engine.build_megakernel(
                    self.model, max_tokens=max(1, max_tokens), device=self.device, seed=self.seed,
                    config=MegakernelConfig.from_knobs(wanted, self.buffer.options),
                    w_gate_up=self.w_gate_up.data, w_down=self.w_down.data, gate=self.gate.data, tiled=True)
                self.weights_tiled = True
            except (RuntimeError, ValueError, OSError) as e:  # build/load errors, a setting that does not fit
                why = f"{type(e).__name__}: {e}"
                untile_(self.w_gate_up.data)  # the unfused path reads them row-major
                untile_(self.w_down.data)
        if why is not None:
            self.engine_note = why
            if engine == "megakernel":
                raise _engine.MegakernelUnavailable(f"engine='megakernel' was asked for, but the megakernel cannot "
                                                    f"run here: {why}")
            _engine.warn_fallback_once(why)
            return
        self.engine = "megakernel"
        self.engine_knobs = wanted

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` with this layer's gate; its fp32 copy is kept while the gate's data and version stay the same
        (the same bits: widening bf16 to fp32 is exact)."""
        g = self.gate
        if g.is_inference():  # made under inference_mode: no version counter to tell a rewrite by
            return route(x, g, self.model.topk)
        key = (g.data_ptr(), g._version)
        if self._gate_f32 is None or self._gate_f32[:2] != key:
            self._gate_f32 = (*key, g.detach().float())
        return route(x, self._gate_f32[2], self.model.topk)

    @torch.no_grad()
    def experts(self, recv_x: torch.Tensor, meta: RecvMeta) -> torch.Tensor:
        """One output row per received row: its local experts' SwiGLU outputs, weighted and summed."""
        m, h = recv_x.shape[0], self.model.hidden
        out = torch.zeros(m, h, dtype=torch.float32, device=self.device)
        if meta.num_pairs:
            rows, wp = meta.expert_layout()
            xs = recv_x.index_select(0, rows)
            if self.use_grouped_mm:
                offs = torch.cumsum(meta.tokens_per_expert_tensor, 0).to(torch.int32)
                hg = torch._grouped_mm(xs, self.w_gate_up.transpose(-2, -1), offs=offs)
                i = self.model.intermediate
                a = F.silu(hg[:, :i]) * hg[:, i:]
                y = torch._grouped_mm(a, self.w_down.transpose(-2, -1), offs=offs)
            else:
                parts = []
                start = 0
                for j, n in enumerate(meta.tokens_per_expert):
                    if n:
                        parts.append(swiglu(xs[start : start + n], self.w_gate_up[j], self.w_down[j]))
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
        n_exp = self.w_gate_up.shape[0]
        i = self.model.intermediate
        if self.use_grouped_mm:
            offs = torch.searchsorted(experts_sorted, self._expert_ends, out_int32=True)
            hg = torch._grouped_mm(xs, self.w_gate_up.transpose(-2, -1), offs=offs)
            a = F.silu(hg[:, :i]).mul_(hg[:, i:]).mul_(wp)
            y = torch._grouped_mm(a, self.w_down.transpose(-2, -1), offs=offs)
        else:  # CPU / no grouped GEMM: a loop over the experts present (syncs; not capturable)
            counts = torch.bincount(flat, minlength=n_exp).tolist()
            parts, start = [], 0
            for e, n in enumerate(counts):
                if n:
                    parts.append(swiglu(xs[start : start + n], self.w_gate_up[e], self.w_down[e], wp[start : start + n]))
                start += n
            y = torch.cat(parts) if parts else xs.new_zeros(0, self.model.hidden)
        placed = torch.empty_like(y).index_copy_(0, order, y)  # row r of y is pair order[r] = (token, slot)
        return placed.view(s, k, self.model.hidden).sum(dim=1)  # fp32 accumulation in the reduction, rounded once

    def _check_x(self, x: torch.Tensor) -> None:
        h = self.model.hidden
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a [S, {h}] tensor, got {got}")
        if x.device != self.device or x.dtype != self.dtype:
            raise ValueError(f"x must be {self.dtype} on {self.device}, got {x.dtype} on {x.device}")

    def _check_local(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self._check_x(x)
        s, k = x.shape[0], self.model.topk
        if tuple(topk_idx.shape) != (s, k) or tuple(topk_weights.shape) != (s, k):
            raise ValueError(f"topk_idx and topk_weights must be [{s}, {k}], got {tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}")

    @torch.no_grad()
    def forward_routed(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The layer with given routing (benchmarks inject uniform/Zipf routing here)."""
        if self.megakernel is not None:
            self._check_local(x, topk_idx, topk_weights)
            return self.megakernel.forward_routed(x, topk_idx, topk_weights)
        if self.buffer.world == 1:
            self._check_local(x, topk_idx, topk_weights)
            return self.local_forward(x, topk_idx.long(), topk_weights)
        if self.buffer.num_chunks > 1:
            return pipelined_moe(self.buffer, x, topk_idx, topk_weights, self.experts)
        recv_x, meta, handle = self.buffer.dispatch(x, topk_idx, topk_weights)
        return self.buffer.combine(self.experts(recv_x, meta), handle)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.megakernel is not None or self.buffer.world == 1:  # one rank: no exchange, checked once here
            self._check_x(x)
            if self.megakernel is not None:  # routing + one persistent kernel, no host sync (capturable)
                return self.megakernel.forward(x)
            return self.local_forward(x, *self.route(x))
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.model.hidden:
            # Still take part in the collective input check so every rank reports the problem.
            s = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else 0
            idx = torch.zeros(s, self.model.topk, dtype=torch.int64, device=self.device)
            return self.forward_routed(x, idx, torch.zeros(s, self.model.topk, device=self.device))
        idx, w = self.route(x)
        return self.forward_routed(x, idx, w)


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
    Routing comes from the gate when topk_idx/topk_weights are not given. Returns fp32 [S, H].
    """
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
    """max |out - ref| / max |ref| (normwise; 0 for empty outputs)."""
    if ref.numel() == 0:
        return 0.0
    denom = ref.float().abs().max().clamp_min(1e-30)
    return float((out.float() - ref.float()).abs().max() / denom)
