"""The megakernel's expert-weight layout: k-tiled.

A weight matrix W [rows, K] (row-major: W_gate_up [E, 2I, H] is rows E * 2I of K = H, W_down [E, H, I] rows E * H of
K = I) is held as K / 64 planes of [rows][64]: element (row, k) at ((k / 64) * rows + row) * 64 + k % 64. Each 64 x 64
weight box a GEMM stage loads is then 8 KB of contiguous memory instead of 64 rows of 128 bytes a row pitch apart;
on an H200 that made the DRAM-bound sizes 8-10 µs a forward faster (bench/results/megakernel run 158: S=16, 128, 1024).
The shape of a tiled tensor stays the row-major one ([E, N, K]); only the order of its elements changes, so a tensor
can be tiled in place (`tile_`) and a module's parameters keep their shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PLANE = 64  # k elements per plane (the kernels' BK)


def _rows_planes(t: torch.Tensor) -> tuple[int, int]:
    """(rows, k planes) of a weight tensor [..., N, K]: all leading dims and N are rows."""
    k = t.shape[-1]
    if k % PLANE:
        raise ValueError(f"k-tiled weights need K to be a multiple of {PLANE}, got {k}")
    return t.numel() // k, k // PLANE


def to_tiled(w: torch.Tensor) -> torch.Tensor:
    """A new tensor of w's shape [..., N, K] holding its elements k-tiled (all leading dims and N as the rows)."""
    rows, planes = _rows_planes(w)
    return _new(w.reshape(rows, planes, PLANE).transpose(0, 1).contiguous().view(w.shape), w)


def from_tiled(t: torch.Tensor) -> torch.Tensor:
    """The row-major tensor (a new one) whose k-tiled form is t (both of shape [..., N, K])."""
    rows, planes = _rows_planes(t)
    return _new(t.reshape(planes, rows, PLANE).transpose(0, 1).contiguous().view(t.shape), t)


def _new(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    # one plane (K == 64): the transpose is a no-op and contiguous() hands back src's own storage, not a copy
    return out.clone() if out.data_ptr() == src.data_ptr() else out


@torch.no_grad()
def _in_place(t: torch.Tensor, relaid: Callable[[torch.Tensor], torch.Tensor], what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{what} needs a contiguous tensor")
    return t.copy_(relaid(t))


def tile_(w: torch.Tensor) -> torch.Tensor:
    """Tile a contiguous tensor in place (a temporary copy of it while it runs); returns w."""
    return _in_place(w, to_tiled, "tile_")


def untile_(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `tile_`, in place; returns t."""
    return _in_place(t, from_tiled, "untile_")
