#!/usr/bin/env python3
"""Summarise a bench/gpu_onesided.sh output directory as markdown (targets checked against the data).

    python bench/onesided_report.py bench_out > report.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(p: Path) -> list[dict]:
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def _med(r: dict, key: str) -> float | None:
    v = r.get(key)
    return v.get("median") if isinstance(v, dict) else None


def report(out: Path) -> str:
    lines: list[str] = []
    ep = [r for r in _load(out / "onesided_ep.jsonl") if r.get("rank") == 0 and "error" not in r and "model" in r]
    micro = _load(out / "proxy_micro.jsonl")
    tests = _load(out / "gpu_onesided_tests.jsonl")
    stages = _load(out / "stages.jsonl")
    env = (out / "env.txt").read_text().strip() if (out / "env.txt").exists() else "(no env.txt)"
    lines += ["## Environment", "```", env, "```", ""]
    lines += ["## Stages", "| stage | rc | s |", "| --- | --- | --- |"]
    lines += [f"| {s['stage']} | {s['rc']} | {s['seconds']} |" for s in stages]
    lines += ["", "## GPU tests"]
    for t in tests:
        keep = {k: t[k] for k in ("test", "transport", "knobs", "iters", "mismatch_iters", "count_mismatch_iters",
                                  "poison_overwritten_iters", "symm_backend", "symm_torch_error", "qp_mapping", "size", "stale_transfers",
                                  "trials_with_stale", "trials", "signals_missing", "ok", "skipped") if k in t}
        err = t.get("error")
        lines.append(f"- {json.dumps(keep)}" + (f" ERROR: `{str(err).strip().splitlines()[-1][:160]}`" if err else ""))

    lines += ["", "## EP exchange (rank 0, median µs; world 2, bf16; layout rank = each token once per rank, "
              "expert = once per expert, k copies)",
              "| transport | knobs | model | S | layout | dispatch | combine | pair | pair (graph) | host issue | GB/s | ok |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in ep:
        g = _med(r, "layer_us_graph")
        h = _med(r, "host_issue_us")
        lines.append(
            f"| {r['transport']} | {r['knobs']} | {r['model']} | {r['tokens']} | {r.get('layout', 'rank')} | "
            f"{_med(r, 'dispatch_us'):.1f} | "
            f"{_med(r, 'combine_us'):.1f} | {_med(r, 'layer_us'):.1f} | {'' if g is None else f'{g:.1f}'} | "
            f"{'' if h is None else f'{h:.1f}'} | {r['GBps_dispatch']:.1f} | {r['roundtrip_equal']} |")

    lines += ["", "## Targets"]
    nv = [r for r in ep if r["transport"] == "nvlink"]
    small = [r for r in nv if r["model"] == "qwen3-30b" and r["tokens"] == 128]
    if small:
        best = min(small, key=lambda r: _med(r, "layer_us"))
        gbest = [(_med(r, "layer_us_graph"), r["knobs"]) for r in small if _med(r, "layer_us_graph") is not None]
        gtxt = f"; CUDA-graph replay best {min(gbest)[0]:.1f} µs ({min(gbest)[1]})" if gbest else ""
        lines.append(f"- nvlink Qwen3-30B S=128 dispatch+combine ≤ 40 µs: eager best {_med(best, 'layer_us'):.1f} µs "
                     f"({best['knobs']}){gtxt} → {'MET' if _med(best, 'layer_us') <= 40 else 'NOT MET eagerly'}")
    big = [r for r in nv if r["model"] == "qwen3-30b" and r["tokens"] == 16384]
    if big:
        for lay in ("rank", "expert"):
            cand = [r for r in big if r.get("layout", "rank") == lay]
            if cand:
                best = max(cand, key=lambda r: r["GBps_dispatch"])
                lines.append(f"- nvlink dispatch S=16384 ({lay} layout) ≥ 330 GB/s per rank: best {best['GBps_dispatch']:.1f} "
                             f"GB/s ({best['knobs']}) → {'MET' if best['GBps_dispatch'] >= 330 else 'NOT MET'}")
    nccl = [r for r in ep if r["transport"] == "nccl" and r["model"] == "qwen3-30b" and r["tokens"] in (128, 16384)]
    for r in nccl:
        lines.append(f"- (NCCL same bytes, S={r['tokens']} {r.get('layout', 'rank')} layout: pair {_med(r, 'layer_us'):.1f} µs, "
                     f"dispatch {r['GBps_dispatch']:.1f} GB/s)")
    pm = {r["mode"]: r for r in micro if r.get("bench") == "proxy_micro" and r.get("concurrency") == 96 and r.get("size") == 16384}
    if pm:
        d = pm.get("decoupled_ordered", {}).get("ratio_vs_put_only")
        c = pm.get("coupled_drain", {}).get("ratio_vs_put_only")
        lines.append(f"- proxy 96 × 16 KB: decoupled+nic_ordered {d if d is None else f'{d:.0%}'} of put-only (target ≥ 70%: "
                     f"{'MET' if d and d >= 0.7 else 'NOT MET'}); coupled+proxy_drain {c if c is None else f'{c:.0%}'}")
    for r in micro:
        if r.get("bench") == "proxy_race":
            lines.append(f"- race {r['qp_mapping']} + nic_ordered, 4 QPs, {r['size'] >> 10} KB × {r['transfers']}: "
                         f"{r['stale_transfers']} stale transfers in {r['trials_with_stale']}/{r['trials']} trials")
    lines += ["", "## Proxy microbenchmark (median µs per batch; ratio = put-only / mode)",
              "| mode | c | size | µs | GB/s | ratio | issue µs/op (excl. drain) | drains/iter |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in micro:
        if r.get("bench") == "proxy_micro" and "us_median" in r:
            lines.append(f"| {r['mode']} | {r['concurrency']} | {r['size'] >> 10} KB | {r['us_median']:.1f} | {r['GBps']:.2f} | "
                         f"{r.get('ratio_vs_put_only', 0):.2f} | {r.get('issue_us_per_op_excl_drain', 0):.2f} | "
                         f"{r.get('drains_per_iter', 0):.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(report(Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out")))
