#!/usr/bin/env python3
"""Time the EP buffer's own kernels (csrc/ep_pack.cu) on ONE GPU, each replayed from a CUDA graph.

A tool, not a benchmark (bench/tools/README.md): its numbers are not rows of bench/results/summary.csv; a probe of
single kernels below EPBuffer (one GPU). EPBuffer end to end: `moetune bench ep` and the ep scenarios.

For each model, world size and S tokens (uniform routing): the plan as one CTA (mode 1) and as a grid
(mode 2), both checked equal first; the row-packing kernel; combine's reduce kernel. A graph holds
`--reps` back-to-back launches of one kernel; the time per launch is the replay time / reps (median over
`--iters` replays, CUDA events), so host issue is not in it. Output: $OUT/ep_kernels.jsonl, a table.

    python bench/tools/ep_kernels.py [--out DIR] [--tokens 128,1024,4096,16384] [--worlds 2,8] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def _graph_us(fn, reps: int, iters: int) -> float:
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(out)


def _case(lib, m, world: int, s: int, reps: int, iters: int) -> dict:
    import torch

    from moetune.runtime import csrc_build

    h, k, e = m.hidden, m.topk, m.experts
    dev = torch.device("cuda", 0)
    g = torch.Generator(device="cpu").manual_seed(s * 31 + world)
    idx = torch.rand(s, e, generator=g).topk(k, dim=1).indices.to(dev)
    x = torch.randn(s, h, generator=g).to(torch.bfloat16).to(dev)
    w = torch.rand(s, k, generator=g).to(dev)

    def stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    outs = {}
    for mode in (1, 2):
        outs[mode] = (torch.empty(s * world, dtype=torch.int64, device=dev),
                      torch.empty(s, world, dtype=torch.int64, device=dev),
                      torch.empty(world, dtype=torch.int64, device=dev),
                      torch.empty(max(1, lib.mt_pack_plan_scratch(s, world)), dtype=torch.int32, device=dev))

    def plan(mode: int) -> None:
        tok, inv, cnt, scr = outs[mode]
        csrc_build.check(lib, lib.mt_pack_plan(idx.data_ptr(), s, k, e, world, tok.data_ptr(), cnt.data_ptr(),
                                               inv.data_ptr(), scr.data_ptr(), mode, stream()), "plan")

    plan(1)
    plan(2)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(outs[1][:3], outs[2][:3], strict=True))
    tok, inv, cnt, _ = outs[1]
    payload = h * 2
    id_off = (payload + 7) // 8 * 8
    weight_off = id_off + 8 * k
    row_bytes = (weight_off + 4 * k + 15) // 16 * 16
    send = torch.empty(s * world, row_bytes, dtype=torch.uint8, device=dev)

    def rows_k() -> None:
        csrc_build.check(lib, lib.mt_pack_rows(x.data_ptr(), payload, idx.data_ptr(), w.data_ptr(), s, k, s * world,
                                               tok.data_ptr(), send.data_ptr(), row_bytes, id_off, weight_off,
                                               stream()), "rows")

    back = torch.randn(s * world + 1, h, generator=g).to(torch.bfloat16).to(dev)
    out = torch.empty(s, h, dtype=torch.bfloat16, device=dev)

    def reduce_k() -> None:
        csrc_build.check(lib, lib.mt_combine_reduce(back.data_ptr(), h, inv.data_ptr(), s, world, h, 1,
                                                    out.data_ptr(), stream()), "reduce")

    return {"bench": "ep_kernels", "model": m.name, "world": world, "S": s, "plan_modes_equal": same,
            "rows_sent": int(cnt.sum()), "plan_one_cta_us": _graph_us(lambda: plan(1), reps, iters),
            "plan_grid_us": _graph_us(lambda: plan(2), reps, iters), "pack_rows_us": _graph_us(rows_k, reps, iters),
            "combine_reduce_us": _graph_us(reduce_k, reps, iters), "device": torch.cuda.get_device_name(dev),
            "torch": torch.__version__, "reps": reps, "iters": iters}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--models", default="qwen3-30b,deepseek-v3")
    ap.add_argument("--tokens", default="128,1024,4096,16384")
    ap.add_argument("--worlds", default="2,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    from moetune.runtime.shapes import get_model

    models = [get_model(m) for m in args.models.split(",") if m]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    worlds = [int(w) for w in args.worlds.split(",") if w]
    if args.dry_run:
        print(f"dry-run: {len(models)} models x {len(tokens)} S x {len(worlds)} worlds")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("ep_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moetune.runtime import csrc_build

    lib = csrc_build.load()
    rows = []
    for m in models:
        for world in worlds:
            for s_tok in tokens:
                rec = _case(lib, m, world, s_tok, args.reps, args.iters)
                rows.append(rec)
                print(f"{m.name:12s} world {world} S {s_tok:6d}: plan 1-CTA {rec['plan_one_cta_us']:8.1f} us, grid "
                      f"{rec['plan_grid_us']:8.1f} us (equal {rec['plan_modes_equal']}); pack rows "
                      f"{rec['pack_rows_us']:8.1f} us; reduce {rec['combine_reduce_us']:8.1f} us", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "ep_kernels.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0 if all(r["plan_modes_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
