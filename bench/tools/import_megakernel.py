"""One-off import of the megakernel's measured runs (bench/results/megakernel/run5_final.json, run8_sweep.json)
into bench/results/summary.csv as `source=imported` rows of scenario moe-megakernel-vs-unfused.

Cases: `megakernel` and `unfused`; the unfused figures of those runs are bench/megakernel_bench.py's (since removed:
`moetune bench moe` times the same path as engine `torch`) plain torch path (gate GEMM, softmax/top-k, stable sort,
two torch._grouped_mm, weighted index_add_: the steps of MoELayer.local_forward, not the layer object), said in
every row's note. Metrics `graph_us[S=N]` (one CUDA graph per input, replayed) and `layer_us[S=N]` (eager), median
of 50 single calls. Run 8's JSON names d994fa1 but its tree was 711d9d4's content
(bench/results/megakernel/README.md): the rows carry 711d9d4.

A tool: kept so that the import can be reviewed (re-running it refuses).

    python bench/tools/import_megakernel.py            # appends to bench/results/summary.csv (once: re-running refuses)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT.parent))
RUNS = (("run5_final.json", "610d8371d85c6007b76cbfdb36ee793263fb0fad", "run5"),
        ("run8_sweep.json", "711d9d49dc2baa4193a883f545f0366c87268391", "run8"))
SCENARIO = "moe-megakernel-vs-unfused"


def rows() -> list[dict]:
    out = []
    for name, sha, launch in RUNS:
        d = json.loads((ROOT / "bench" / "results" / "megakernel" / name).read_text())
        meta = d["meta"]
        common = {"scenario": SCENARIO, "launch": f"mk-{launch}", "unit": "us", "n": meta["iters"], "source": "imported",
                  "date": meta["date"][:19] + "Z", "git_sha": sha, "git_dirty": False, "torch": meta["torch"],
                  "cuda": meta["cuda"], "gpu": meta["gpu"], "gpu_count": 1, "hardware": f"1x {meta['gpu']}",
                  "world": 1, "backend": "none", "command": meta["command"]}
        for pos, (case, prefix) in enumerate((("unfused", "torch"), ("megakernel", "megakernel"))):
            note = (f"from bench/results/megakernel/{name}"
                    + ("; unfused = the plain torch path of bench/megakernel_bench.py" if case == "unfused" else ""))
            for r in d["rows"]:
                for suffix, metric in (("graph_us", "graph_us"), ("eager_us", "layer_us")):
                    v = r.get(f"{prefix}_{suffix}")
                    if v is not None:
                        out.append({**common, "case": case, "baseline": case == "unfused", "position": pos,
                                    "metric": f"{metric}[S={r['S']}]", "median": v, "note": note})
    return out


def main() -> int:
    from moetune.tuner.measure import results as R

    csv = ROOT / "bench" / "results" / "summary.csv"
    if any(f"{SCENARIO},".encode() in line and b",imported," in line for line in csv.read_bytes().splitlines()):
        print("already imported", file=sys.stderr)
        return 1
    n = R.append_rows(csv, rows())
    print(f"{n} rows imported")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
