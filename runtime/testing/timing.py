"""Timing helpers shared by the tuner's MoE measurements and the device-side benchmark scripts (which carry
`runtime/` but not `tuner/`): single calls between CUDA events, and one CUDA graph per input."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["graphs_of", "time_calls"]


def time_calls(fns: Sequence[Callable[[], Any]], *, warmup: int, iters: int, cuda: bool) -> list[float]:
    """µs of each of `iters` single calls, rotating over `fns` (one per input), after `warmup` calls."""
    for j in range(warmup):
        fns[j % len(fns)]()
    if not cuda:
        out = []
        for j in range(iters):
            t0 = time.perf_counter()
            fns[j % len(fns)]()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    import torch

    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for j, (a, b) in enumerate(ev):
        a.record()
        fns[j % len(fns)]()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1000.0 for a, b in ev]


def graphs_of(fn: Callable[[Any], Any], xs: Sequence[Any]) -> list[Callable[[], Any]]:
    """One captured CUDA graph per input (after a warm-up call on a side stream); replay callables."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x in xs:
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    out = []
    for x in xs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(x)
        out.append(g.replay)
    return out
