"""fp8 e4m3 compression for dispatch payloads: per-token or per-128-channel scales.

quantise(x) → (q uint8 [N, H] holding float8_e4m3fn bits, scales float32 [N, G]) with G = 1 (per token)
or H/128 (per 128 channels). Each group is scaled so that its absolute maximum maps to 448 (the e4m3
maximum); dequantise multiplies back. The wire row carries the fp8 bytes and the scale bytes together
(see `EPBuffer`), so one transfer per peer still moves everything.

Error bound: e4m3 keeps 3 mantissa bits, so an element in the normal range is rounded with relative
error <= 2**-4 = 6.25 %; elements far below their group's maximum (more than 2**14 smaller) lose more,
but contribute little. The MoE layer's output error normalised by its largest magnitude
(max|out - ref| / max|ref|) stays well under this because rounding errors average out in the GEMMs;
moetune documents and tests the bound FP8_LAYER_REL_ERR_BOUND = 0.08 for that metric (observed
maximum 0.056 over 80 random small-layer cases, hidden 64..256, uniform and Zipf 1.5 routing; typical 0.035).
Combine is never compressed: it stays in the activation dtype.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP8_LAYER_REL_ERR_BOUND = 0.08
_TINY = 1e-12


def fp8_available() -> bool:
    return hasattr(torch, "float8_e4m3fn")


def num_scale_groups(hidden: int, granularity: str) -> int:
    if granularity == "per_token":
        return 1
    if granularity == "per_128":
        if hidden % 128:
            raise ValueError(f"scale_granularity per_128 needs hidden divisible by 128, got hidden={hidden}")
        return hidden // 128
    raise ValueError(f"unknown scale granularity {granularity!r} (per_token or per_128)")


def quantise(x: torch.Tensor, granularity: str = "per_token") -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (any float dtype) → (fp8 bits as uint8 [N, H], float32 scales [N, G])."""
    if not fp8_available():
        raise RuntimeError("this torch build has no float8_e4m3fn; use compression=none")
    if x.dim() != 2:
        raise ValueError(f"quantise expects a 2-D tensor [N, H], got shape {tuple(x.shape)}")
    n, h = x.shape
    g = num_scale_groups(h, granularity)
    xf = x.float().reshape(n, g, h // g)
    amax = xf.abs().amax(dim=2, keepdim=True)
    scale = (amax / E4M3_MAX).clamp_(min=_TINY)
    q = (xf / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, h).view(torch.uint8), scale.reshape(n, g)


def quantise_into(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, granularity: str) -> None:
    """Quantise x [N, H] writing fp8 bits into q_out (uint8 [N, H], may be a strided view) and scales into
    scale_out (float32 [N, G], may be strided): lets the packer fill the wire rows in place."""
    q, s = quantise(x, granularity)
    q_out.copy_(q)
    scale_out.copy_(s)


def dequantise(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(uint8 fp8 bits [N, H], float32 scales [N, G]) → [N, H] in `dtype` (contiguous)."""
    n, h = q.shape
    g = scales.shape[1] if scales.dim() == 2 else 1
    xf = q.view(torch.float8_e4m3fn).float().reshape(n, g, h // g) * scales.reshape(n, g, 1)
    return xf.reshape(n, h).to(dtype)
