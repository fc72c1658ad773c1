#!/usr/bin/env python3
"""Measure a tuned knob set and the policy default side by side, in ONE run, interleaved.

Both settings are built in the same processes (one EP group, NCCL), then timed in alternating rounds
(A B A B ...) so that clocks, temperature and the neighbours' load hit both alike. Environment-level
knobs (NCCL_*) cannot differ inside one process: the two settings must agree on them (they do when
both use the same transport family); otherwise the script falls back to interleaved subprocess runs of
`moetune bench ep` and says so in the result (`method`).

    python bench/tune_side_by_side.py --tuned-json tune.json --model qwen3-30b --tokens 4096 \
        --family host_staged --world 2 --rounds 10 --out $OUT/tune_local.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _layer_timer(rank: int, world: int, port: int, model_name: str, tokens: int, settings: list[dict[str, Any]],
                 rounds: int, iters: int, out_path: str, comm: str = "nccl") -> None:
    import torch
    import torch.distributed as dist

    from moetune.runtime.knobs import Knobs
    from moetune.runtime.shapes import get_model
    from moetune.runtime.testing.launch import init_dist

    # gloo on CPU: a plumbing check of this script, not a measurement that means anything
    dev = init_dist(rank, world, backend=comm, port=port)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()
    try:
        import moetune.runtime as rt

        model = get_model(model_name)
        layers = [rt.MoELayer(model, None, Knobs.from_dict(s), max_tokens=tokens, device=dev, dtype=torch.bfloat16)
                  for s in settings]
        try:  # the same inputs and routing as `moetune bench ep` (what the tuner measured)
            from moetune.tuner.measure.ep import _inputs

            x, idx, w = _inputs(rank, model, torch.bfloat16, tokens, "uniform", 0, dev)

            def run(layer):
                return layer.forward_routed(x, idx, w)
        except ImportError:
            g = torch.Generator(device=dev).manual_seed(1234 + rank)
            x = torch.randn(tokens, model.hidden, device=dev, dtype=torch.bfloat16, generator=g)

            def run(layer):
                return layer(x)
        times: list[list[float]] = [[] for _ in settings]
        with torch.no_grad():
            for layer in layers:  # warm-up both
                for _ in range(3):
                    run(layer)
            sync()
            for _ in range(rounds):
                for i, layer in enumerate(layers):
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        run(layer)
                    sync()
                    t = torch.tensor([(time.perf_counter() - t0) * 1e6 / iters], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the layer time
                    times[i].append(float(t.item()))
        if rank == 0:
            Path(out_path).write_text(json.dumps({"times_us": times}))
    finally:
        dist.destroy_process_group()


def in_process(model: str, tokens: int, settings: list[dict[str, Any]], world: int, rounds: int, iters: int,
               comm: str = "nccl") -> list[list[float]]:
    import tempfile

    import torch.multiprocessing as mp

    out = Path(tempfile.mkdtemp()) / "times.json"
    port = 29500 + os.getpid() % 1000
    mp.spawn(_layer_timer, args=(world, port, model, tokens, settings, rounds, iters, str(out), comm), nprocs=world,
             join=True)
    return json.loads(out.read_text())["times_us"]


def by_subprocess(model: str, tokens: int, settings: list[dict[str, Any]], world: int, rounds: int, family: str,
                  timeout_s: float, comm: str = "nccl") -> list[list[float]]:
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.backends import LocalBackend, TuneWorkload

    be = LocalBackend(world=world, comm_backend=comm, repeats=1, timeout_s=timeout_s, family=family)
    wl = TuneWorkload(model=get_model(model), tokens=tokens, nodes=1, gpus_per_node=world)
    ms = be.compare([Knobs.from_dict(s) for s in settings], wl, rounds=rounds)
    for m in ms:
        if not m.ok:
            raise RuntimeError(m.error)
    return [m.samples for m in ms]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tuned-json", type=Path, required=True, help="output of `moetune tune --json`")
    ap.add_argument("--model", default="qwen3-30b")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--family", default="host_staged")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--subprocess", action="store_true", help="force the interleaved-subprocess method")
    ap.add_argument("--comm", default="nccl", help="nccl (GPUs) or gloo (CPU plumbing check)")
    a = ap.parse_args()

    from moetune.runtime.profiles.policy_defaults import policy_default_knobs
    from moetune.tuner.search.backends import LocalBackend

    rows = json.loads(a.tuned_json.read_text())
    row = next((r for r in rows if r["tokens"] == a.tokens and r["family"] == a.family and r.get("knobs")), None)
    if row is None:
        print(f"no tuned result for S={a.tokens} family={a.family} in {a.tuned_json}", file=sys.stderr)
        return 2
    tuned = row["knobs"]
    default = policy_default_knobs(a.family).to_dict()
    be = LocalBackend(family=a.family)
    from moetune.runtime.knobs import Knobs

    run_settings = [be.runtime_knobs(Knobs.from_dict(s)).to_dict() for s in (tuned, default)]
    method, note = "in_process_interleaved", ""
    t0 = time.time()
    times = None
    if not a.subprocess:
        try:
            times = in_process(a.model, a.tokens, run_settings, a.world, a.rounds, a.iters, a.comm)
        except Exception as e:  # the runtime API differs or failed: fall back, and say so
            note = f"in-process measurement failed ({type(e).__name__}: {str(e)[:300]}); used interleaved subprocesses"
    if times is None:
        method = "subprocess_interleaved"
        times = by_subprocess(a.model, a.tokens, [tuned, default], a.world, max(3, a.rounds // 3), a.family, 120, a.comm)
    med_t, med_d = statistics.median(times[0]), statistics.median(times[1])
    res = {"comm": a.comm,
        "kind": "side_by_side", "model": a.model, "tokens": a.tokens, "family": a.family, "world": a.world,
        "method": method, "note": note, "rounds": len(times[0]), "iters_per_round": a.iters,
        "tuned_knobs": tuned, "default_knobs": default, "tuned_us": med_t, "default_us": med_d,
        "tuned_samples_us": times[0], "default_samples_us": times[1], "speedup": med_d / med_t,
        "tuned_wins_rounds": sum(1 for x, y in zip(times[0], times[1], strict=True) if x < y),
        "tune_best_us": row.get("best_us"), "tune_default_us": row.get("default_us"), "seconds": time.time() - t0,
        "env": {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE")},
    }
    with a.out.open("a") as f:
        f.write(json.dumps(res) + "\n")
    print(f"S={a.tokens} {a.family}: tuned {med_t:,.1f} µs vs policy default {med_d:,.1f} µs → "
          f"{res['speedup']:.2f}× ({res['tuned_wins_rounds']}/{len(times[0])} rounds won, {method})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
