#!/usr/bin/env python3
"""Host-side cost of one EP round trip per implementation, on CPU, one process, tiny shapes.

No collectives run (world 1) and the kernels are tiny, so the time is Python + op-dispatch overhead: a
proxy for the launch overhead that dominated the first GPU run at small S. Not a GPU measurement.

    python bench/runtime_host_cost.py [--n 2000]
"""

from __future__ import annotations

import argparse
import time

import torch

from moetune.runtime import EPBuffer, Knobs, get_model
from moetune.runtime.pipeline import pipelined_moe, weighted_rows
from moetune.runtime.routing import generate_routing
from moetune.tuner.measure.ep import PlainA2A


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
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
        t = time.perf_counter()
        for _ in range(args.n):
            f()
        print(f"{name:15s} {(time.perf_counter() - t) / args.n * 1e6:7.1f} us/roundtrip")


if __name__ == "__main__":
    main()
