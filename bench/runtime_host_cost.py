#!/usr/bin/env python3
"""Host-side cost of one EP round trip per implementation, on CPU, one process, tiny shapes.

No collectives run (world 1) and the kernels are tiny, so the time is Python + op-dispatch overhead: a
proxy for the launch overhead that dominated the first GPU run at small S. Not a GPU measurement.

    python bench/runtime_host_cost.py [--n 2000] [--batches 20]

Prints `<impl> MEDIAN us/roundtrip p10 P10 p90 P90 batches B` per implementation: the `--n` calls (after 50 untimed
ones) in B batches, each batch's mean call a sample, and the median / p10 / p90 of those samples
(tuner/measure/stats.py). It printed the mean of all the calls, which the scenario stored in the median column.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from moetune.runtime import EPBuffer, Knobs, get_model
from moetune.runtime.pipeline import pipelined_moe, weighted_rows
from moetune.runtime.routing import generate_routing
from moetune.tuner.measure.ep import PlainA2A
from moetune.tuner.measure.stats import Summary


def batch_means_us(f: Callable[[], object], n: int, batches: int) -> list[float]:
    """µs a call of `f`: `n` calls in `batches` batches (as even as n allows, at least one call each), each
    batch's mean call one sample."""
    batches = max(1, min(batches, n))
    out = []
    for b in range(batches):
        k = n // batches + (1 if b < n % batches else 0)
        t = time.perf_counter()
        for _ in range(k):
            f()
        out.append((time.perf_counter() - t) / k * 1e6)
    return out


def line(name: str, samples: list[float]) -> str:
    s = Summary.of(samples)
    return f"{name:15s} {s.median:7.1f} us/roundtrip p10 {s.p10:.1f} p90 {s.p90:.1f} batches {s.n}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000, help="timed calls per implementation")
    ap.add_argument("--batches", type=int, default=20, help="samples: the calls' batches, each its mean call")
    args = ap.parse_args()
    if args.n < 1 or args.batches < 1:
        raise SystemExit("runtime_host_cost: --n and --batches must be >= 1")
    torch.set_num_threads(1)
    m = get_model("custom:64,32,8,2")
    x = torch.randn(8, 64).to(torch.bfloat16)
    idx, w = generate_routing(8, 8, 2, seed=0)

    def rt(buf: EPBuffer) -> torch.Tensor:
        if buf.num_chunks > 1:
            return pipelined_moe(buf, x, idx, w, weighted_rows)
        r, meta, h = buf.dispatch(x, idx, w)
        return buf.combine(weighted_rows(r, meta), h)

    plain = PlainA2A(m, torch.device("cpu"), torch.bfloat16)

    def rt_plain() -> torch.Tensor:
        r, h = plain.dispatch(x, idx, w)
        return plain.combine(r, h)

    cases = {"plain": rt_plain}
    for name, kn, dense in [("dense", Knobs(), True), ("packed", Knobs(), False),
                            ("dense_fp8_d2", Knobs(compression="fp8_e4m3", pipeline_depth=2), True),
                            ("packed_fp8_d2", Knobs(compression="fp8_e4m3", pipeline_depth=2), False)]:
        b = EPBuffer(knobs=kn, model=m, max_tokens=8, dense=dense, check_inputs=False)
        cases[name] = lambda b=b: rt(b)
    for name, f in cases.items():
        for _ in range(50):
            f()
        print(line(name, batch_means_us(f, args.n, args.batches)), flush=True)


if __name__ == "__main__":
    main()
