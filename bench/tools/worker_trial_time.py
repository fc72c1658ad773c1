"""Per-trial wall time of LocalBackend: persistent bench worker vs one `moetune bench ep` subprocess per trial.

A tool, not a benchmark (bench/tools/README.md): its numbers are not rows of bench/results/summary.csv; a check of
the tuner's trial overhead (docs/tuner.md cites it), which spawns torch worlds per trial: too slow for the
scenarios' smoke test.

    python bench/tools/worker_trial_time.py [--backend gloo|nccl] [--world 2] [--trials 5] [--model custom:256,128,16,4]
                                      [--tokens 128] [--out bench_out]

Runs `trials` evaluations (repeats=1, metric=comm as in `moetune profile`) with each mode and prints the
wall time of every trial; the first persistent trial includes starting the worker (imports, process group).
Writes one JSON line per mode to $OUT/worker_trial_time.jsonl (OUT defaults to ./bench_out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.search.backends import TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--model", default="custom:256,128,16,4")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = ap.parse_args()
    if a.backend == "nccl":  # the GPU box's rules; inherited by the workers and the subprocesses
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            os.environ.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")
    wl = TuneWorkload(model=get_model(a.model), tokens=a.tokens, nodes=1, gpus_per_node=a.world)
    knobs = [Knobs(pipeline_depth=1 + i % 2) for i in range(a.trials)]
    rows = []
    for persistent in (True, False):
        be = LocalBackend(world=a.world, comm_backend=a.backend, repeats=1, timeout_s=300, metric="comm",
                          persistent=persistent)
        times, meds = [], []
        try:
            for k in knobs:
                t0 = time.monotonic()
                m = be.evaluate(k, wl)
                times.append(time.monotonic() - t0)
                if not m.ok:
                    raise SystemExit(f"trial failed ({'persistent' if persistent else 'subprocess'}): {m.error}")
                meds.append(m.median_us)
        finally:
            be.close()
        rows.append({"mode": "persistent" if persistent else "subprocess", "backend": a.backend, "world": a.world,
                     "model": a.model, "tokens": a.tokens, "trials": a.trials, "trial_s": [round(t, 3) for t in times],
                     "first_s": round(times[0], 3),
                     "steady_median_s": round(statistics.median(times[1:] or times), 3),
                     "mean_s": round(statistics.mean(times), 3), "comm_us": [round(v, 1) for v in meds],
                     "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                     "host": platform.node(), "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine()})
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "worker_trial_time.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{'mode':<11} {'first s':>8} {'steady median s':>16} {'mean s':>7}  per-trial s")
    for r in rows:
        print(f"{r['mode']:<11} {r['first_s']:>8.2f} {r['steady_median_s']:>16.2f} {r['mean_s']:>7.2f}  {r['trial_s']}")


if __name__ == "__main__":
    main()
