"""The plain torch MoE layer that issue-level targets are measured against: no moetune code on its path.

Gate GEMM in fp32, softmax, top-k, renormalise, stable sort by expert, two `torch._grouped_mm` with SwiGLU
between, weighted `index_add_` in fp32, cast back. Benchmarks time it beside the engines in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["plain_torch_moe"]


def plain_torch_moe(x: torch.Tensor, gate: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    topk: int) -> torch.Tensor:
    """x [S, H], gate [E, H], w_gate_up [E, 2I, H], w_down [E, H, I] -> [S, H] in x's dtype."""
    s, e, i = x.shape[0], gate.shape[0], w_down.shape[2]
    probs = torch.softmax(x.float() @ gate.float().t(), dim=-1)
    w, idx = probs.topk(topk, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    rows = order // topk
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    hg = torch._grouped_mm(x.index_select(0, rows), w_gate_up.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(F.silu(hg[:, :i]) * hg[:, i:], w_down.transpose(-2, -1), offs=offs)
    out = torch.zeros(s, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, y.float() * w.reshape(-1)[order].unsqueeze(1))
    return out.to(x.dtype)
