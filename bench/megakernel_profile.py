"""Drive the megakernel for ncu: build the layer for S tokens, run `--calls` forwards (routing + persistent kernel).

    ncu --clock-control none --kernel-name regex:'k_experts|k_logits|k_topk' --launch-skip 3 --launch-count 3 \
        python bench/megakernel_profile.py --tokens 1

`--trace`: instead, replay one captured CUDA graph of the layer `--calls` times under torch.profiler and print
each kernel's mean device time and the mean gap between consecutive kernels of a replay, at the clocks a
benchmark runs at (ncu's replays run single kernels, often at idle clocks).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--config", default="")
    ap.add_argument("--trace", action="store_true")
    a = ap.parse_args()
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.shapes import get_model

    mk = MegakernelMoE(get_model("qwen3-30b"), max_tokens=a.tokens, config=MegakernelConfig.parse(a.config))
    x = torch.randn(a.tokens, mk.model.hidden, device="cuda").to(torch.bfloat16)
    for _ in range(a.calls):
        mk.forward(x)
    torch.cuda.synchronize()
    mk.check()
    if a.trace:
        trace(mk, x, a.calls, a.tokens, a.config)


def trace(mk, x: torch.Tensor, calls: int, tokens: int, config: str) -> None:
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mk.forward(x)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            g.replay()
            torch.cuda.synchronize()  # one replay at a time: gaps inside a replay only
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=8))
    kern = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    dur: dict[str, list[float]] = defaultdict(list)
    gaps: dict[str, list[float]] = defaultdict(list)
    prev = None
    for e in kern:
        name = e.name.split("<")[0].split("(")[0]
        dur[name].append(e.time_range.end - e.time_range.start)
        if prev is not None and 0 <= e.time_range.start - prev.time_range.end < 50:  # same replay
            gaps[f"{prev.name.split('<')[0].split('(')[0]} -> {name}"].append(e.time_range.start - prev.time_range.end)
        prev = e
    print(f"trace S={tokens} config={config or 'default'} replays={calls}")
    for n, v in dur.items():
        print(f"  kernel {n:28s} n={len(v):4d} mean {sum(v) / len(v):8.2f} us")
    for n, v in gaps.items():
        print(f"  gap    {n:40s} n={len(v):4d} mean {sum(v) / len(v):6.2f} us")


if __name__ == "__main__":
    main()
