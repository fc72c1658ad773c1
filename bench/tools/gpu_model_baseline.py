"""Re-measure the NCCL all-to-all baseline (bench/results/2026-11-30_h200x2_nccl_baseline.jsonl) with warm-up,
for the fabric model's calibration.

A tool, not a benchmark (bench/tools/README.md): its numbers are not rows of bench/results/summary.csv; it writes
calibration data for `moetune model calibrate --data`, not a benchmark's rows.

One command on the 2x H200 box (writes JSON lines to $OUT, default ./bench_out, prints a table last):

    OUT=./bench_out python bench/tools/gpu_model_baseline.py

Same experiment as bench/results/2026-11-30_h200x2_nccl_baseline.jsonl (NCCL all_to_all_single, world 2, bf16, uniform
routing, k copies per token, one call = dispatch only; fp8 payload = 1 byte per element; host_staged =
NCCL_P2P_DISABLE=1), but every configuration gets `--warmup` untimed calls before `--iters` timed ones
(CUDA events per call, median). Then calibrate:

    moetune model calibrate --preset nvlink-h200x2 --data $OUT/h200x2_nccl_baseline_warm.jsonl \
        --data bench/results/2026-11-30_h200x2_proxy_probe.jsonl --out tuner/fabric_model/presets/nvlink-h200x2.toml

CPU smoke test (gloo, tiny sizes, no GPU):  python bench/tools/gpu_model_baseline.py --cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

MODELS = {"qwen3-30b": (2048, 8), "gpt-oss-120b": (2880, 4), "deepseek-v3": (7168, 8)}
TOKENS = (128, 1024, 4096, 16384)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, fabric: str, q) -> None:
    import torch
    import torch.distributed as dist

    from moetune.runtime.testing.launch import init_dist

    dev = init_dist(rank, world, backend="gloo" if args.cpu else "nccl", port=port)
    rows = []
    tokens = (8, 16) if args.cpu else TOKENS
    for model, (h, k) in MODELS.items():
        hh = 64 if args.cpu else h
        for s in tokens:
            for fp8 in (False, True):
                dtype = torch.uint8 if fp8 else torch.bfloat16
                x = torch.zeros(s * k, hh, dtype=dtype, device=dev)
                y = torch.empty_like(x)
                for _ in range(args.warmup):
                    dist.all_to_all_single(y, x)
                times = []
                for _ in range(args.iters):
                    if args.cpu:
                        t = time.perf_counter()
                        dist.all_to_all_single(y, x)
                        times.append((time.perf_counter() - t) * 1e3)
                    else:
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        dist.barrier()
                        torch.cuda.synchronize()
                        a.record()
                        dist.all_to_all_single(y, x)
                        b.record()
                        b.synchronize()
                        times.append(a.elapsed_time(b))
                ms = statistics.median(times)
                row = {"probe": "nccl_a2a_fp8payload" if fp8 else "nccl_a2a", "fabric": fabric, "model": model,
                       "S": s, "world": world, "ms": ms, "warmup": args.warmup, "iters": args.iters,
                       "p10_ms": sorted(times)[len(times) // 10], "p90_ms": sorted(times)[(9 * len(times)) // 10]}
                if args.cpu:
                    row["cpu_smoke_test"] = True
                rows.append(row)
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _run(fabric: str, args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    if fabric == "host_staged":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    else:
        os.environ.pop("NCCL_P2P_DISABLE", None)
    from moetune.runtime.testing.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, fabric, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=args.timeout)
    for p in procs:
        p.join(timeout=60)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU with tiny sizes (smoke test only)")
    ap.add_argument("--timeout", type=float, default=540.0)
    args = ap.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    out = Path(os.environ.get("OUT", "./bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    if not args.cpu:
        import torch

        if torch.cuda.device_count() < 2:
            print("needs 2 GPUs (use --cpu for a smoke test)", file=sys.stderr)
            return 2
    rows = []
    for fabric in ("nvlink", "host_staged"):
        rows += _run(fabric, args)
    name = "cpu_smoke_nccl_baseline.jsonl" if args.cpu else "h200x2_nccl_baseline_warm.jsonl"
    path = out / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{'fabric':12} {'model':14} {'S':>6} {'payload':8} {'ms':>9}")
    for r in rows:
        print(f"{r['fabric']:12} {r['model']:14} {r['S']:>6} {'fp8' if 'fp8' in r['probe'] else 'bf16':8} {r['ms']:9.4f}")
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
