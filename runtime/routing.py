"""Routing generators for tests and benchmarks: uniform and Zipf(s), deterministic with a seed.

Each token picks `topk` *distinct* experts. Uniform: every expert equally likely. Zipf(s): expert of
popularity rank r (1-based) has weight r**-s; which expert holds which popularity rank is a seeded
permutation, so hot experts land on arbitrary EP ranks. Sampling without replacement uses the Gumbel
top-k trick (one vectorised pass). Weights are positive and sum to 1 per token (renormalised top-k).

Everything is drawn on the CPU from a `torch.Generator` (the same stream on every machine) and then moved
to `device`, so all ranks and the single-process reference can regenerate the same routing.

`parse_routing` is the one parser of a routing spec for the whole project (the fabric model and the CLI
use it too). They must not pay for torch, so torch is imported inside the generators, not here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moetune.runtime.knobs import float_of_text

if TYPE_CHECKING:
    import torch


def parse_routing(spec: str) -> tuple[str, float]:
    """`uniform` → ("uniform", 0.0); `zipf:1.2` → ("zipf", 1.2); `zipf` → ("zipf", 1.0).

    Case and surrounding blanks do not matter. Raises ValueError naming the spec otherwise."""
    spec = spec.strip().lower()
    if spec == "uniform":
        return "uniform", 0.0
    name, colon, s = spec.partition(":")
    if name.strip() == "zipf":  # exactly: "zipfian" or "zipf2" were read as zipf:1.0
        if colon and not s.strip():
            raise ValueError(f"routing {spec!r}: give the Zipf exponent after the colon (e.g. zipf:1.2), or plain "
                             "zipf for 1.0")
        exponent = float_of_text(s.strip()) if colon else 1.0  # not float(): it takes "0_5" as 5.0
        if exponent is None:
            raise ValueError(f"routing {spec!r}: the Zipf exponent must be a number (e.g. zipf:1.2)")
        if not 0.0 <= exponent <= 10.0:
            raise ValueError(f"routing {spec!r}: the Zipf exponent must be in [0, 10]")
        return "zipf", exponent
    raise ValueError(f"unknown routing {spec!r}; use uniform or zipf:S (e.g. zipf:1.2)")


def expert_popularity(num_experts: int, s: float, *, seed: int = 0) -> torch.Tensor:
    """Zipf(s) probabilities over experts (float64, sums to 1), assigned through a seeded permutation."""
    import torch

    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
    p = ranks.pow(-s)
    p /= p.sum()
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    perm = torch.randperm(num_experts, generator=g)
    out = torch.empty_like(p)
    out[perm] = p
    return out


def generate_routing(
    num_tokens: int,
    num_experts: int,
    topk: int,
    *,
    routing: str = "uniform",
    seed: int = 0,
    device: torch.device | str | None = None,
    weight_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx int64 [S, k], topk_weights [S, k]) for `num_tokens` tokens.

    `seed` selects the token stream (use a different seed per rank); the Zipf popularity permutation
    depends only on the exponent and `popularity seed` 0, so every rank shares the same hot experts.
    `weight_dtype`: the weights' dtype, float32 when not given.
    """
    import torch

    if weight_dtype is None:
        weight_dtype = torch.float32
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in 1..{num_experts}, got {topk}")
    kind, s = parse_routing(routing)
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform" or s == 0.0:
        logp = torch.zeros(num_experts, dtype=torch.float64)
    else:
        logp = expert_popularity(num_experts, s).log()
    u = torch.rand(num_tokens, num_experts, generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    gumbel = -torch.log(-torch.log(u))
    idx = (logp + gumbel).topk(topk, dim=1).indices
    w = torch.rand(num_tokens, topk, generator=g, dtype=torch.float64) + 0.1
    w = w / w.sum(dim=1, keepdim=True)
    return idx.to(device=device, dtype=torch.int64), w.to(device=device, dtype=weight_dtype)


def expert_load(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert (int64 [E])."""
    import torch

    return torch.bincount(topk_idx.reshape(-1).long().cpu(), minlength=num_experts)


def strided_problem(name: str, t: torch.Tensor) -> str | None:
    """Why tensor `t` (argument `name`) is not in the dense (strided) layout every consumer of the layer's inputs
    needs, or None: a sparse one failed deep inside (index_select, aminmax, copy_ "not implemented" for its
    backend). The layer, the EP buffer, the megakernel and dense_reference check x with it, routed_inputs_fault the
    routing."""
    import torch

    if t.layout != torch.strided:
        return f"{name} must be a dense (strided) tensor, got layout {t.layout}"
    return None


def routed_inputs_fault(s: int, topk: int, device: Any, topk_idx: Any, topk_weights: Any) -> tuple[str, str] | None:
    """Which check given routing for `s` tokens fails on a layer of `topk` on `device`, and why, or None. The first
    item is one of `ROUTED_FAULTS` (the EP buffer sends it to its peers as a code). No host sync: the ids' range is
    `expert_ids_problem`'s. The one check of routed inputs: EPBuffer.dispatch, MoELayer and MegakernelMoE use it."""
    import torch

    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        short = "idx" if name == "topk_idx" else "weights"
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (s, topk):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            return f"{short}_shape", f"{name} must have shape [S, topk] = [{s}, {topk}], got {got}"
        why = strided_problem(name, t)
        if why is not None:  # a sparse tensor of the right shape: its peers hear "the wrong shape or layout"
            return f"{short}_shape", why
        if t.device != device:
            return f"{short}_device", f"{name} must be on {device}, got {t.device}"
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        return "idx_dtype", f"topk_idx must be an integer tensor, got {topk_idx.dtype}"
    if not topk_weights.dtype.is_floating_point:
        return "weights_dtype", f"topk_weights must be a floating-point tensor, got {topk_weights.dtype}"
    return None


ROUTED_FAULTS: tuple[str, ...] = ("idx_shape", "idx_device", "weights_shape", "weights_device", "idx_dtype",
                                  "weights_dtype")


def routed_inputs_problem(s: int, topk: int, device: Any, topk_idx: Any, topk_weights: Any) -> str | None:
    """`routed_inputs_fault`'s message, or None."""
    fault = routed_inputs_fault(s, topk, device, topk_idx, topk_weights)
    return None if fault is None else fault[1]


def comparable_ids(topk_idx: torch.Tensor) -> torch.Tensor:
    """topk_idx as a tensor torch can compare, reduce and sort: itself, or as int64 where its dtype is uint16, uint32
    or uint64 (torch has no aminmax, comparison or sort kernels for those; a uint64 past 2**63 wraps negative, out of
    range as it was). Every range check of given ids reads them through this (expert_ids_problem, the EP buffer's)."""
    import torch

    if topk_idx.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return topk_idx.to(torch.int64)
    return topk_idx


def expert_ids_problem(topk_idx: torch.Tensor, experts: int, *, distinct: bool = False) -> str | None:
    """Why these routing ids are not all in [0, experts), or with `distinct` why a token's ids repeat an expert (the
    megakernel's per-expert row lists hold one row per token: a repeat can overflow them), or None. Reads them on the
    host in one device sync (both checks' numbers in one copy; a refusal's message reads more), so it does nothing
    while the current CUDA stream of the ids' device is being captured into a graph (no sync is allowed there)."""
    import torch

    from moetune.runtime._capture import capturing

    if topk_idx.numel() == 0:
        return None
    if capturing(topk_idx.device):  # the ids' device, not the current one (a layer on cuda:1 while cuda:0 is)
        return None
    topk_idx = comparable_ids(topk_idx)
    lo, hi = torch.aminmax(topk_idx)
    stats = [lo.long(), hi.long()]
    if distinct:
        ordered = topk_idx.sort(dim=1).values
        repeats = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)  # [S]: the token's picks name an expert twice
        stats.append(repeats.sum())
    got = torch.stack(stats).tolist()  # the one sync
    lo_v, hi_v = got[0], got[1]
    if lo_v < 0 or hi_v >= experts:
        bad = int(((topk_idx < 0) | (topk_idx >= experts)).sum())
        return f"topk_idx holds expert ids out of range [0, {experts}): {bad} bad ids (min {lo_v}, max {hi_v})"
    if distinct and got[2]:
        t = int(repeats.int().argmax())  # the first such token
        picks = topk_idx[t].tolist()
        e = next(v for i, v in enumerate(picks) if v in picks[:i])
        more = f" (and {got[2] - 1} more tokens)" if got[2] > 1 else ""
        return (f"topk_idx row {t} picks expert {e} more than once ({picks}){more}: a token's picks must be distinct "
                f"experts (an expert takes at most one row per token)")
    return None
