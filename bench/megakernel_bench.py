"""Benchmark: the MoE megakernel against the plain torch path, side by side in ONE process, eager and graph.

Whole layer from x to output with routing included, Qwen3-30B-A3B shape by default (hidden 2048,
intermediate 768, 128 experts, top-8, bf16). Torch path: gate GEMM (fp32), softmax, top-k, renormalise,
stable sort by expert, two `torch._grouped_mm`, SwiGLU, weighted `index_add_` in fp32. Each case: median of
`--iters` timed calls after `--warmup`, CUDA events around each call, inputs rotated over `--rotate` tensors
(graph mode: one captured graph per input). Prints a table (last) and writes JSON with git SHA, date, GPU,
torch version and the command. `--sweep` also times the megakernel's settings (graph replay) per S.

    python bench/megakernel_bench.py --tokens 1,16,128,1024,4096 --out results.json [--sweep]
        [--compare "core=mma;core=wgmma;split_k1=4,split_k2=2"]

`--compare`: ';'-separated MegakernelConfig texts, each timed per S in the same process on the same inputs
(graph replay, eager, experts-kernel alone) with its error against the torch path: the side-by-side table of
core=mma vs core=wgmma (and split-K) that NEXT_RUN.md asks for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import torch

from moetune.runtime.testing.baselines import plain_torch_moe as torch_layer
from moetune.runtime.testing.timing import graphs_of
from moetune.runtime.testing.timing import time_calls as timed


def time_calls(fns: list, warmup: int, iters: int) -> float:
    """Median µs of single calls (CUDA events), rotating over `fns` (one per input set)."""
    return statistics.median(timed(fns, warmup=warmup, iters=iters, cuda=True))


def phase_times(mk, xs: list[torch.Tensor], warmup: int, iters: int) -> dict[str, float]:
    """Median µs of the routing launches and of the persistent launch, each between its own events (eager). A decode
    launch (`decode_grid`) routes inside its one kernel: routing reads ~0 and the second figure is the whole layer.
    Each call's launch fields are set as a forward sets them (`MegakernelMoE._launch_params`, its token bucket's
    config included), and a launch the library refuses raises with the library's error text."""
    import ctypes

    from moetune.runtime.megakernel import _lib

    s = xs[0].shape[0]
    out = torch.empty_like(xs[0])
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    with torch.cuda.device(mk.device):  # the library launches on the current device (as a forward does)
        stream = torch.cuda.current_stream(mk.device).cuda_stream
        for j in range(warmup + iters):
            p = mk._launch_params(xs[j % len(xs)], s, out, given=False)  # x: fresh randn tensors, aligned
            ref = ctypes.byref(p)
            e = ev[j - warmup] if j >= warmup else None
            if e:
                e[0].record()
            if not p.decode:
                _lib.check(mk.lib, mk.lib.mk_route(ref, stream), "mk_route")
            if e:
                e[1].record()
            _lib.check(mk.lib, mk.lib.mk_experts(ref, stream), "mk_experts")
            if e:
                e[2].record()
    torch.cuda.synchronize(mk.device)
    return {"mk_route_us": statistics.median(e[0].elapsed_time(e[1]) * 1e3 for e in ev),
            "mk_experts_us": statistics.median(e[1].elapsed_time(e[2]) * 1e3 for e in ev)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b")
    ap.add_argument("--tokens", default="1,16,128,1024,4096")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rotate", type=int, default=4)
    ap.add_argument("--config", default="", help="MegakernelConfig text, e.g. bm=16,stages=4")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-tokens", default="1,16,128,1024,4096")
    ap.add_argument("--compare", default="", help="';'-separated configs timed side by side per S")
    ap.add_argument("--sha", default=os.environ.get("GIT_SHA", "unknown"))
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.moe_layer import max_rel_err
    from moetune.runtime.shapes import get_model

    model = get_model(a.model)
    tokens = [int(t) for t in a.tokens.split(",")]
    smax = max(tokens + [int(t) for t in a.sweep_tokens.split(",")] if a.sweep else tokens)
    mk = MegakernelMoE(model, max_tokens=smax, config=MegakernelConfig.parse(a.config))
    w1, w2, gate, k = mk.w_gate_up, mk.w_down, mk.gate, model.topk
    wbytes_expert = (w1[0].numel() + w2[0].numel()) * 2
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    rows = []
    for s in tokens:
        xs = [torch.randn(s, model.hidden, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(a.rotate)]
        ref = torch_layer(xs[0], gate, w1, w2, k)
        got = mk.forward(xs[0])
        torch.cuda.synchronize()
        mk.check()
        err = max_rel_err(got, ref)
        touched = int(torch.unique(mk.routing(s)[0]).numel())
        floor_us = touched * wbytes_expert / 4.2e12 * 1e6
        r = {"S": s, "rel_err_vs_torch": err, "experts_touched": touched, "weight_floor_us_at_4.2TBps": floor_us}
        r.update(phase_times(mk, xs, a.warmup, a.iters))
        r["megakernel_eager_us"] = time_calls([lambda x=x: mk.forward(x) for x in xs], a.warmup, a.iters)
        r["megakernel_graph_us"] = time_calls(graphs_of(mk.forward, xs), a.warmup, a.iters)
        r["torch_eager_us"] = time_calls([lambda x=x: torch_layer(x, gate, w1, w2, k) for x in xs], a.warmup, a.iters)
        r["torch_graph_us"] = time_calls(graphs_of(lambda x: torch_layer(x, gate, w1, w2, k), xs), a.warmup, a.iters)
        # what a plain read of as many experts' weights takes here (graph replay of two sums over the contiguous
        # w_gate_up[:n] and w_down[:n]): the floor with this GPU's ramp-up and tail, not the 4.2 TB/s of a 1.2 GB read
        r["plain_read_us"] = time_calls(graphs_of(lambda _x, n=touched: (w1[:n].sum(), w2[:n].sum()), xs[:1]),
                                        a.warmup, a.iters)
        mk.check()
        rows.append(r)
        print(json.dumps(r), flush=True)

    sweep = []
    if a.sweep:
        base = MegakernelConfig.parse(a.config)
        variants = [{}, {"bm": 16}, {"bm": 64}, {"bm": 128}, {"stages": 2}, {"stages": 3}, {"stages": 6},
                    {"stages": 8}, {"stages": 12}, {"ctas_per_sm": 1}, {"ctas_per_sm": 2}, {"combine_tokens": 2},
                    {"combine_tokens": 32}, {"processor_ctas": 66}]
        for s in [int(t) for t in a.sweep_tokens.split(",")]:
            xs = [torch.randn(s, model.hidden, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(a.rotate)]
            for v in variants:
                cfg = MegakernelConfig.from_dict({**base.to_dict(), **v})
                m = None
                try:
                    m = MegakernelMoE(model, max_tokens=s, config=cfg, w_gate_up=w1, w_down=w2, gate=gate)
                    us = time_calls(graphs_of(m.forward, xs), a.warmup, a.iters)
                    m.check()
                    rec = {"S": s, "change": v, "graph_us": us}
                except Exception as e:  # a setting that does not fit (e.g. ctas_per_sm over occupancy)
                    rec = {"S": s, "change": v, "error": str(e)[:200]}
                sweep.append(rec)
                print(json.dumps(rec), flush=True)
                del m
            torch.cuda.empty_cache()

    compare = []
    if a.compare:
        cfgs = [c.strip() for c in a.compare.split(";")]
        for s in tokens:
            xs = [torch.randn(s, model.hidden, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(a.rotate)]
            ref = torch_layer(xs[0], gate, w1, w2, k)
            for text in cfgs:
                m = None
                try:
                    cfg = MegakernelConfig.parse(text)
                    m = MegakernelMoE(model, max_tokens=s, config=cfg, w_gate_up=w1, w_down=w2, gate=gate)
                    got = m.forward(xs[0])
                    torch.cuda.synchronize()
                    m.check()
                    rec = {"S": s, "config": text, "bm": m.config.pick_bm(s, k, model.experts),  # resolved (bn auto)
                           "rel_err_vs_torch": max_rel_err(got, ref)}
                    rec.update(phase_times(m, xs, a.warmup, a.iters))
                    rec["graph_us"] = time_calls(graphs_of(m.forward, xs), a.warmup, a.iters)
                    rec["eager_us"] = time_calls([lambda x=x, m=m: m.forward(x) for x in xs], a.warmup, a.iters)
                    m.check()
                except Exception as e:  # a path that fails must not hide the others' figures
                    rec = {"S": s, "config": text, "error": str(e)[:300]}
                compare.append(rec)
                print(json.dumps(rec), flush=True)
                del m
            torch.cuda.empty_cache()

    meta = {
        "git_sha": a.sha, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "host": platform.node(), "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "model": a.model, "config": MegakernelConfig.parse(a.config).to_dict(), "warmup": a.warmup,
        "iters": a.iters, "rotate": a.rotate, "statistic": "median of single-call CUDA-event times (us)",
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows, "sweep": sweep, "compare": compare}, f, indent=1)
    if sweep:
        print("\nsweep (graph replay us; change vs the base config):")
        for s in sorted({r["S"] for r in sweep}):
            cells = [f"{json.dumps(r['change'])}:{r.get('graph_us', float('nan')):.1f}" for r in sweep if r["S"] == s]
            print(f"S={s}: " + "  ".join(cells))
    if compare:
        print("\nside by side (us; graph / eager / experts kernel; err vs torch):")
        print(f"{'S':>6} {'config':<34} {'bm':>4} {'graph':>8} {'eager':>8} {'experts':>8} {'err':>8}")
        for r in compare:
            if "error" in r:
                print(f"{r['S']:>6} {r['config']:<34} ERROR {r['error'][:80]}")
            else:
                print(f"{r['S']:>6} {r['config']:<34} {r['bm']:>4} {r['graph_us']:>8.1f} {r['eager_us']:>8.1f} "
                      f"{r['mk_experts_us']:>8.1f} {r['rel_err_vs_torch']:>8.1e}")
    print(f"\n{meta['gpu']}  torch {meta['torch']}  sha {a.sha}")
    print(f"{'S':>6} {'mk graph':>9} {'mk eager':>9} {'route':>6} {'experts':>7} {'torch graph':>11} {'torch eager':>11} "
          f"{'floor':>7} {'read':>7} {'err':>8}")
    for r in rows:
        print(f"{r['S']:>6} {r['megakernel_graph_us']:>9.1f} {r['megakernel_eager_us']:>9.1f} {r['mk_route_us']:>6.1f} "
              f"{r['mk_experts_us']:>7.1f} {r['torch_graph_us']:>11.1f} {r['torch_eager_us']:>11.1f} "
              f"{r['weight_floor_us_at_4.2TBps']:>7.1f} {r.get('plain_read_us', float('nan')):>7.1f} "
              f"{r['rel_err_vs_torch']:>8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
