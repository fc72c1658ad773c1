"""Anatomy of a host-staged transfer on 2 GPUs: what the copy engines give, and what the host_staged
transport makes of it.

A tool, not a benchmark (bench/tools/README.md): its numbers are not rows of bench/results/summary.csv; a probe of
the copy engines below the host_staged transport. The transport end to end: the scenario host-staged-fp8-pipelined.

Per rank, both ranks at once (as in an exchange), median of --iters after --warmup, GPU time from CUDA events:
  raw_d2h / raw_h2d   one cudaMemcpyAsync of --mb MB between device memory and pinned host memory
  raw_both            both at once, on two streams (the link's two directions)
  staged_n{N}         the transport's dense dispatch (gather_async) of --mb MB per rank cut into N chunks, all
                      on one lane and posted back to back, then waited for (N=1: store-and-forward)
  host_n{N}           the host's time to post those N chunks
  pieces{R}           one such block staged in pieces of R rows (chunk_tokens=R): double buffering in one call
Writes one JSON line per environment setting to --out/host_staged_micro.jsonl.
  source bench/tools/device_env.sh; python3 bench/tools/host_staged_micro.py --out $OUT/micro
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _events_us(fn, iters: int, warmup: int, device, barrier) -> float:
    import torch

    out = []
    for i in range(warmup + iters):
        barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(device)
        if i >= warmup:
            out.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(out)


def rank_main(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from moetune.runtime.knobs import Knobs
    from moetune.runtime.transports.host_staged import HostStagedTransport

    dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = int(cfg["mb"] * 1e6) // 4096 * 4096
    iters, warmup = cfg["iters"], cfg["warmup"]

    def barrier() -> None:
        dist.barrier()

    rep: dict = {"rank": rank}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    d2 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    rep["raw_d2h_us"] = _events_us(lambda: host.copy_(d, non_blocking=True), iters, warmup, dev, barrier)
    rep["raw_h2d_us"] = _events_us(lambda: d.copy_(host, non_blocking=True), iters, warmup, dev, barrier)

    def both() -> None:
        cur = torch.cuda.current_stream()
        e = cur.record_event()
        s1.wait_event(e)
        s2.wait_event(e)
        with torch.cuda.stream(s1):
            host.copy_(d, non_blocking=True)
        with torch.cuda.stream(s2):
            d2.copy_(host2, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    rep["raw_both_us"] = _events_us(both, iters, warmup, dev, barrier)
    rep["mb"] = nbytes / 1e6
    t = HostStagedTransport(None, Knobs(transport="host_staged"), dev, channels=1)
    rows = nbytes // 4096
    src = torch.randint(0, 255, (rows, 4096), dtype=torch.uint8, device=dev)
    t.stage_capacity(rows, 4096)
    tmps = {n: [torch.empty(world * (rows // n), 4096, dtype=torch.uint8, device=dev) for _ in range(n)]
            for n in cfg["chunks"]}

    def staged(n: int, host_times: list[float]) -> None:
        cs = rows // n
        h0 = time.perf_counter()
        works = [t.gather_async(tmps[n][c], src[c * cs : (c + 1) * cs]) for c in range(n)]
        host_times.append((time.perf_counter() - h0) * 1e6)
        for w in works:
            w.wait()

    ok = True
    for n in cfg["chunks"]:
        host_times: list[float] = []
        rep[f"staged_n{n}_us"] = _events_us(lambda n=n, h=host_times: staged(n, h), iters, warmup, dev, barrier)
        rep[f"host_n{n}_us"] = statistics.median(host_times[warmup:])
        # chunk 0's rows from the peer must be the peer's src rows: compare checksums across the ranks
        cs = rows // n
        mine = src[:cs].float().sum().item()
        got = tmps[n][0][(1 - rank) * cs : (2 - rank) * cs].float().sum().item()
        sums = torch.tensor([mine, got], dtype=torch.float64, device=dev)
        allsums = [torch.empty_like(sums) for _ in range(world)]
        dist.all_gather(allsums, sums)
        a = [x.tolist() for x in allsums]
        ok = ok and a[0][1] == a[1][0] and a[1][1] == a[0][0]
    rep["bytes_ok"] = ok
    # one block staged in pieces of chunk_tokens rows (the staging message size), double-buffered in one call
    for pr in cfg["pieces"]:
        tp = HostStagedTransport(None, Knobs(transport="host_staged", chunk_tokens=pr), dev, channels=1)
        tp.stage_capacity(rows, 4096)
        tmp = torch.empty(world * rows, 4096, dtype=torch.uint8, device=dev)
        ph: list[float] = []

        def piece_run(tp=tp, tmp=tmp, ph=ph) -> None:
            h0 = time.perf_counter()
            w = tp.gather_async(tmp, src)
            ph.append((time.perf_counter() - h0) * 1e6)
            w.wait()

        rep[f"pieces{pr}_us"] = _events_us(piece_run, iters, warmup, dev, barrier)
        rep[f"pieces{pr}_host_us"] = statistics.median(ph[warmup:])
        torch.cuda.synchronize()
        tp.check()
        tp.close()
    rep["host_stats"] = {k: (round(us, 1), n) for k, (us, n) in t.host_stats().items()}
    t0 = time.perf_counter()
    for _ in range(100):
        t.check()
    rep["check_us"] = (time.perf_counter() - t0) * 1e4
    rep["flags"] = {f"{x}->{y}": t.flag_values(0, x, y) for x, y in ((0, 1), (1, 0))}
    torch.cuda.synchronize()
    t.check()
    t.close()
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--mb", type=float, default=17.17, help="MB per rank (default: Qwen3-30B S=4096 bf16 dispatch rows)")
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--pieces", default="256,512,1024", help="chunk_tokens values (rows of 4096 B) for one staged block")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--label", default="", help="a name for this environment setting in the output")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and exit")
    a = ap.parse_args()
    cfg = {"mb": a.mb, "chunks": [int(c) for c in a.chunks.split(",")], "iters": a.iters, "warmup": a.warmup,
           "pieces": [int(c) for c in a.pieces.split(",") if c]}
    if a.dry_run:
        print("dry-run", json.dumps(cfg))
        return 0
    from moetune.runtime.testing.launch import launch

    res = launch(rank_main, 2, backend="nccl", args=(cfg,), timeout_s=60, join_timeout_s=240)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    line = {"label": a.label, "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA_DEVICE_MAX", "MOETUNE_HS", "NCCL_P2P"))},
            "ranks": res}
    with open(Path(a.out) / "host_staged_micro.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    for r in res:
        print(a.label, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
