"""Can the nvlink-h200x2 collective model fit both NCCL baselines within 20%? (CPU only, seconds.)

A tool, not a benchmark (bench/tools/README.md): its numbers are not rows of bench/results/summary.csv; an analysis
of committed measurements (the fabric model's calibration), not a measurement.

    python bench/tools/calib_feasibility.py > calibration_feasibility.txt

It reads 2026-11-30_h200x2_run2c/h200x2_nccl_baseline_warm.jsonl, which is in bench/results/archive/2026-11-30.tar.xz:
unpack that under bench/results/ first (the last output: bench/results/2026-12-05_cpu_modelled/).

On one node the model's NCCL all-to-all (tuner/fabric_model/phases/collective.py `phase_collective`, NVLink path) is
    t = (alpha_us + per_peer_us) + max(sync_us, remote_bytes / intra_gbps)
so its three free numbers are A = alpha + per_peer, sync and the bandwidth. This script takes each
row's remote bytes from the model itself, grid-searches (A, sync, bandwidth) for the smallest possible
WORST relative error (the minimax: no fitting objective, weighting or norm can do better), checks the
closed form against the model at the optimum, and prints the rows that set the bound. It also reruns
the project's default fit on shared + warm + proxy probe (the earlier calibration_combined.txt) and
lists the rows that drive its maximum. Every prediction here is MODELLED.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from moetune.tuner.fabric_model.calibration import calibrate, read_rows, rows_to_points
from moetune.tuner.fabric_model.presets import load_preset

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT / "bench/results/2026-11-30_h200x2_nccl_baseline.jsonl"  # the 2026-11-30 NCCL baseline (the "shared" file)
WARM = ROOT / "bench/results/2026-11-30_h200x2_run2c/h200x2_nccl_baseline_warm.jsonl"
PROBE = ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl"
RUN11 = ROOT / "bench/results/2026-11-30_h200x2_run11/2026-11-30_h200x2_run11_nccl_baseline_warm.jsonl"
COLD = "nccl_a2a nvlink qwen3-30b S=128"  # first row measured in the shared file
GO = "nccl_a2a nvlink gpt-oss-120b S=4096"  # the warm file's outlier

Row = tuple[str, str, float, float]  # (file tag, label, remote MB, measured us)


def nvlink_rows(path: Path, tag: str) -> list[Row]:
    unit = load_preset("nvlink-h200x2").with_params(
        {"collective.alpha_us": 0.0, "collective.sync_us": 0.0, "collective.per_peer_us": 0.0,
         "collective.intra_gbps": 1.0})  # 1 GB/s and no latency: predicted us = remote bytes / 1e3
    pts = [p for p in rows_to_points(read_rows([path]))[0] if p.group == "collective/nvlink"]
    return [(tag, p.label, p.evaluate(unit) / 1e3, p.measured_us) for p in pts]


def minimax(rows: list[Row]) -> tuple[float, float, float, float]:
    """(worst |rel err|, A us, sync us, GB/s) minimising the worst error over the grid."""
    x = np.array([r[2] for r in rows])
    m = np.array([r[3] for r in rows])
    a = np.linspace(20.0, 90.0, 281)[:, None, None]
    inv = np.linspace(2.5, 4.0, 376)[None, :, None]  # us per MB: 250..400 GB/s
    best = (np.inf, 0.0, 0.0, 0.0)
    for c in np.linspace(0.0, 100.0, 101):
        e = np.abs((a + np.maximum(c, x * inv)) / m - 1.0).max(-1)
        i = np.unravel_index(e.argmin(), e.shape)
        if e[i] < best[0]:
            best = (float(e[i]), float(a.ravel()[i[0]]), float(c), 1e3 / float(inv.ravel()[i[1]]))
    return best


def show(title: str, rows: list[Row], extra: list[Row] = ()) -> None:
    err, a, c, gb = minimax(rows)
    # the closed form against the model itself at the optimum
    pr = load_preset("nvlink-h200x2")
    pr = pr.with_params({"collective.alpha_us": a - pr.numeric()["collective.per_peer_us"],
                         "collective.sync_us": c, "collective.intra_gbps": gb})
    model = {p.label: p.evaluate(pr) for f in (SHARED, WARM, RUN11) for p in rows_to_points(read_rows([f]))[0]}
    print(f"\n{title}: {len(rows)} rows, best possible worst error {100 * err:.1f}% "
          f"(A = alpha+per_peer {a:.2f} us, sync {c:.1f} us, {gb:.1f} GB/s)")
    out = []
    for tag, label, mb, us in list(rows) + list(extra):
        pred = a + max(c, mb * 1e3 / gb)
        assert abs(pred - model[label]) < 1e-6 * pred, (label, pred, model[label])
        out.append((abs(pred / us - 1), tag, label, mb, us, pred, (tag, label, mb, us) in extra))
    top = sorted(out, reverse=True)[:5]
    for _e, tag, label, mb, us, pred, ex in top + [o for o in out if o[-1] and o not in top]:
        print(f"  {tag:6} {label:48} {mb:7.2f} MB  measured {us:7.1f}  modelled {pred:7.1f}  "
              f"{100 * (pred / us - 1):+6.1f}%{'  (not fitted)' if ex else ''}")


def main() -> int:
    if not WARM.is_file():
        print(f"{WARM.relative_to(ROOT)} is missing: unpack bench/results/archive/2026-11-30.tar.xz under bench/results/",
              file=sys.stderr)
        return 2
    sh, wa = nvlink_rows(SHARED, "shared"), nvlink_rows(WARM, "warm")
    cold = [r for r in sh if r[1] == COLD]
    go = [r for r in wa if r[1] == GO]
    sh_nc = [r for r in sh if r[1] != COLD]
    wa_ng = [r for r in wa if r[1] != GO]
    print("# python bench/tools/calib_feasibility.py (CPU analysis of the committed 2x H200 measurements: "
          f"{SHARED.relative_to(ROOT)}, {WARM.relative_to(ROOT)}; 2026-11-30)")
    print("nvlink-h200x2, collective/nvlink rows; minimax over (A, sync, bandwidth); MODELLED predictions")
    show("shared, all rows", sh)
    show("shared without the cold first row", sh_nc, cold)
    show("warm, all rows", wa)
    three = [r for r in wa if r[1] in (GO, "nccl_a2a nvlink deepseek-v3 S=16384",
                                          "nccl_a2a_fp8payload nvlink deepseek-v3 S=128")]
    show("warm, the three rows that alone exceed 20%", three)
    show("warm without gpt-oss-120b bf16 S=4096", wa_ng, go)
    show("warm + shared without the cold row", wa + sh_nc, cold)
    show("warm without gpt-oss S=4096 + shared without the cold row", wa_ng + sh_nc, cold + go)
    r11 = nvlink_rows(RUN11, "run11")
    show("run 11 warm (30 warm-up + 150 timed calls per row), all rows", r11)
    show("run 11 + shared (the same calls measured twice)", r11 + sh)

    print("\nthe shipped preset (tuner/fabric_model/presets/nvlink-h200x2.toml: run 11 + the shared file's S >= 4096 rows + proxy probe) per file:")
    shipped = load_preset("nvlink-h200x2")
    for path, tag in ((RUN11, "run11"), (SHARED, "shared"), (WARM, "warm")):
        pts = rows_to_points(read_rows([path]))[0]
        errs = sorted(((p.evaluate(shipped) / p.measured_us - 1, p) for p in pts), key=lambda t: -abs(t[0]))
        worst = ", ".join(f"{p.label} {p.measured_us:.1f} us {100 * e:+.1f}%" for e, p in errs[:2])
        print(f"  {tag:6} {len(pts)} rows  max {100 * abs(errs[0][0]):4.1f}%  worst: {worst}")

    print("\nthe project's default fit (calibrate(), all default parameters) on shared + warm + proxy probe:")
    rep = calibrate("nvlink-h200x2", read_rows([SHARED, WARM, PROBE]))
    for path, tag in ((SHARED, "shared"), (WARM, "warm")):
        pts = rows_to_points(read_rows([path]))[0]
        for g in ("collective/nvlink", "collective/host_staged"):
            errs = sorted(((p.evaluate(rep.preset) / p.measured_us - 1, p) for p in pts if p.group == g),
                          key=lambda t: -abs(t[0]))
            mean = sum(abs(e) for e, _ in errs) / len(errs)
            worst = ", ".join(f"{p.label} {p.measured_us:.1f} us {100 * e:+.1f}%" for e, p in errs[:2])
            print(f"  {tag:6} {g:22} mean {100 * mean:4.1f}%  max {100 * abs(errs[0][0]):4.1f}%  worst: {worst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
