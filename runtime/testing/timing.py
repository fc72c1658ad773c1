"""Timing helpers shared by the tuner's MoE measurements and the device-side benchmark scripts (which carry
`runtime/` but not `tuner/`): single calls between CUDA events, and one CUDA graph per input."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["graphs_of", "interleave_order", "time_calls", "time_interleaved"]


def time_calls(fns: Sequence[Callable[[], Any]], *, warmup: int, iters: int, cuda: bool) -> list[float]:
    """µs of each of `iters` single calls, rotating over `fns` (one per input), after `warmup` calls."""
    if not fns:  # the rotation takes j % len(fns): no functions would be a bare ZeroDivisionError
        raise ValueError("time_calls: fns is empty; give at least one function to time")
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


def interleave_order(names: Sequence[str], j: int) -> list[str]:
    """`names` rotated left by j: over as many rounds as names, each is called first once (time_interleaved)."""
    k = j % len(names) if names else 0
    return [*names[k:], *names[:k]]


def time_interleaved(fns: dict[str, Sequence[Callable[[], Any]]], *, warmup: int, iters: int,
                     cuda: bool) -> dict[str, list[float]]:
    """µs of single calls of every entry, one call of each per round for `iters` rounds in an order rotated each round
    (each entry's inputs rotated as time_calls does), after `warmup` such rounds. Entries are timed microseconds apart,
    so a drift of the device's clock or temperature over the run moves them alike and the difference of two entries'
    samples in the same round cancels it (run 117: whole rounds of 200 calls drifted 10-15 µs at S=1024)."""
    names = list(fns)
    empty = [n for n in names if not fns[n]]
    if empty:  # as in time_calls: each entry's inputs rotate by j % len
        raise ValueError(f"time_interleaved: no functions to time for {', '.join(map(repr, empty))}")

    def call(name: str, j: int) -> None:
        f = fns[name]
        f[j % len(f)]()

    for j in range(warmup):
        for n in interleave_order(names, j):
            call(n, j)
    out: dict[str, list[float]] = {n: [] for n in names}
    if not cuda:
        for j in range(iters):
            for n in interleave_order(names, j):
                t0 = time.perf_counter()
                call(n, j)
                out[n].append((time.perf_counter() - t0) * 1e6)
        return out
    import torch

    torch.cuda.synchronize()
    ev: list[tuple[str, Any, Any]] = []
    for j in range(iters):
        for n in interleave_order(names, j):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            call(n, j)
            b.record()
            ev.append((n, a, b))
    torch.cuda.synchronize()
    for n, a, b in ev:
        out[n].append(a.elapsed_time(b) * 1000.0)
    return out


def graphs_of(fn: Callable[[Any], Any], xs: Sequence[Any]) -> list[Callable[[], Any]]:
    """One captured CUDA graph per input (after a warm-up call on a side stream); replay callables, each replayed once
    (untimed) before they are returned.

    A graph's first launch uploads it to the device, work its stream runs before the graph's own: where a caller's
    untimed warm-up calls did not reach every input (`time_calls` with warmup < inputs: the tuner's megakernel trials
    at iters 10 warm 3 calls up over 4 graphs), that upload was timed as a replay of the layer."""
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
    for replay in out:  # the first launch of each graph (its upload) here, outside every caller's timed region
        replay()
    torch.cuda.synchronize()
    return out
