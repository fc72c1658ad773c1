#!/usr/bin/env python3
"""`moetune bench ep` over the issue-6 grid in ONE launch (2 ranks, NCCL): nvlink, proxy, collective, plain.

Every case runs `moetune.tuner.measure.ep.bench_case` -- the code behind `moetune bench ep` -- in spawned
ranks that stay up for all cases (a launch per case would cost ~10 s of start-up each):
  models qwen3-30b, deepseek-v3; S in {128, 1024, 16384} tokens per rank; variants
    nvlink          default knobs (num_sms=24)
    nvlink_sms128   num_sms=128
    proxy_drain     proxy, coupled + proxy_drain, 1 QP, chunk_tokens=128
    proxy_ordered   proxy, decoupled + nic_ordered + peer_hash, 2 QPs, chunk_tokens=128
    collective      the runtime's collective transport (NCCL all_to_all_single, packed rows)
    plain           impl=plain: unpacked NCCL all_to_all_single (k copies per token), as in
                    bench/results/2026-11-30_h200x2_nccl_baseline.jsonl
  plus verify cases (the MoE layer vs the dense single-process reference, as `--verify`) at S=128.
Variants marked graph also capture the round trip in a CUDA graph and time its replays (`--cuda-graph`;
the replay's output is checked after poisoning the receive buffer).
dispatch/combine are timed alone (CUDA events, slowest rank, median); every timed case also checks its
identity-expert round trip (roundtrip_ok) -- a case whose output is wrong reports an error, not a time.
Output: $OUT/bench_ep_onesided.jsonl (one line per case), a table printed last.

    python bench/onesided_bench_ep.py [--out DIR] [--iters 10] [--models ...] [--tokens ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

MODELS = ("qwen3-30b", "deepseek-v3")
TOKENS = (128, 1024, 16384)
VARIANTS: dict[str, dict] = {
    "nvlink": {"transport": "nvlink", "knobs": "", "graph": True},
    "nvlink_sms128": {"transport": "nvlink", "knobs": "num_sms=128", "graph": True},
    "proxy_drain": {"transport": "proxy", "knobs": "fence_mode=proxy_drain,signalling=coupled,qps_per_pe=1,chunk_tokens=128"},
    "proxy_ordered": {"transport": "proxy",
                      "knobs": "fence_mode=nic_ordered,signalling=decoupled,qp_mapping=peer_hash,qps_per_pe=2,chunk_tokens=128"},
    "collective": {"transport": "collective", "knobs": "", "graph": True},
    "plain": {"transport": "collective", "knobs": "", "impl": "plain"},
}
VERIFY = (("qwen3-30b", ("nvlink", "proxy_drain", "proxy_ordered", "collective")), ("deepseek-v3", ("nvlink", "proxy_ordered")))


def build_cases(models, tokens, variants, iters: int, warmup: int, verify: bool) -> list[dict]:
    from moetune.runtime.knobs import Knobs, default_knobs

    cases = []
    if verify:
        for m, vs in VERIFY:
            if m not in models:
                continue
            for v in vs:
                if v in variants:
                    cases.append({"kind": "verify", "model": m, "tokens": 128, "variant": v, "iters": 2, "warmup": 1,
                                  "verify": True, "layer": True})
    for m in models:
        for s in tokens:
            for v in variants:
                cases.append({"kind": "time", "model": m, "tokens": s, "variant": v, "iters": iters, "warmup": warmup,
                              "verify": False, "layer": False})
    for i, c in enumerate(cases):
        v = VARIANTS[c["variant"]]
        c["id"] = i
        c["impl"] = v.get("impl", "moetune")
        c["knobs"] = Knobs.parse(v["knobs"], base=default_knobs(v["transport"])).to_dict()  # validated here
        c["routing"], c["seed"] = "uniform", 0
        c["graph"] = bool(v.get("graph")) and c["kind"] == "time"
    return cases


def rank_main(rank: int, world: int, cases: list[dict], results: str) -> int:
    import torch
    import torch.distributed as dist

    from moetune.tuner.measure.ep import bench_case

    for case in cases:
        t0 = time.time()
        err, rep = "", None
        try:
            rep = bench_case(rank, world, dict(case))
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        cuda = dist.get_backend() == "nccl"
        if cuda:
            torch.cuda.empty_cache()
        flag = torch.tensor([1 if err else 0], device="cuda" if cuda else "cpu")
        dist.all_reduce(flag)  # lockstep: every rank learns whether any failed
        if rank == 0:
            rec = {"bench": "bench_ep", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                   "case_id": case["id"], "kind": case["kind"], "variant": case["variant"], "model": case["model"],
                   "S": case["tokens"], "world": world, "seconds": round(time.time() - t0, 2)}
            if rep is not None and not flag.item():
                rt_ok = rep["roundtrip_rel_err"] <= rep["roundtrip_bound"]
                vok = None if rep["max_rel_err"] is None else rep["max_rel_err"] <= rep["verify_bound"]
                rec.update(roundtrip_rel_err=rep["roundtrip_rel_err"], roundtrip_ok=rt_ok, max_rel_err=rep["max_rel_err"],
                           verify_bound=rep["verify_bound"], verify_ok=vok, knobs=rep["knobs"], impl=rep["impl"],
                           wire_bytes_per_row=rep["wire_bytes_per_row"],
                           dispatch_remote_bytes_rank0=rep["dispatch_remote_bytes_rank0"], iters=rep["iters"],
                           device=rep.get("device"), torch=rep.get("torch"), nccl=rep.get("nccl"))
                timing = {k: rep[k] for k in ("dispatch_us", "combine_us", "roundtrip_us", "layer_us")}
                if case.get("graph"):
                    g_err = rep.get("graph_roundtrip_rel_err")
                    g_ok = g_err is not None and g_err == g_err and g_err <= rep["roundtrip_bound"]
                    rec.update(graph_error=rep.get("graph_error"), graph_roundtrip_rel_err=g_err,
                               graph_pair_rel_err=rep.get("graph_pair_rel_err"))
                    if g_ok:
                        rec["graph_roundtrip_us"] = rep["graph_roundtrip_us"]
                    p_err = rep.get("graph_pair_rel_err")
                    if p_err is not None and p_err == p_err and p_err <= rep["roundtrip_bound"]:
                        rec["graph_pair_us"] = rep["graph_pair_us"]
                    elif rep.get("graph_pair_error") or rep.get("graph_pair_us") is not None:
                        rec["graph_pair_error"] = rep.get("graph_pair_error") or f"wrong pair output: rel. err {p_err}"
                    elif rep.get("graph_roundtrip_us") is not None:
                        rec["graph_error"] = f"wrong graph output: rel. err {g_err}"
                if rt_ok and vok is not False:
                    rec.update(timing)
                else:  # a wrong result never reports a time as if it were valid
                    rec["unverified_timing"] = timing
                    rec["error"] = (f"wrong output: round-trip rel. err {rep['roundtrip_rel_err']:.3g}"
                                    + (f", layer rel. err {rep['max_rel_err']:.3g}" if rep["max_rel_err"] is not None else ""))
            else:
                rec["error"] = err or "failed on another rank"
            with open(results, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0


def table(rows: list[dict]) -> list[str]:
    out = [f"{'variant':14s} {'model':12s} {'S':>6s} {'disp us':>9s} {'comb us':>9s} {'rt us':>9s} {'graph rt':>9s} "
           f"{'graph d+c':>9s} {'GB/s':>7s} check"]
    for r in sorted((r for r in rows if r.get("kind") == "time"), key=lambda r: (r["model"], r["S"], r["variant"])):
        if "error" in r:
            out.append(f"{r['variant']:14s} {r['model']:12s} {r['S']:6d} ERROR {r['error'][:90]}")
            continue
        d = r["dispatch_us"]["median"]
        gbps = r["dispatch_remote_bytes_rank0"] / d / 1e3 if d else float("nan")
        g = r.get("graph_roundtrip_us")
        gs = f"{g['median']:9.1f}" if g else f"{'-':>9s}"
        gp = r.get("graph_pair_us")
        gs += f" {gp['median']:9.1f}" if gp else f" {'-':>9s}"
        note = f" graph: {r['graph_error'][:60]}" if r.get("graph_error") else ""
        out.append(f"{r['variant']:14s} {r['model']:12s} {r['S']:6d} {d:9.1f} {r['combine_us']['median']:9.1f} "
                   f"{r['roundtrip_us']['median']:9.1f} {gs} {gbps:7.1f} rt_err={r['roundtrip_rel_err']:.1e}{note}")
    for r in rows:
        if r.get("kind") == "verify":
            ok = "ERROR " + r["error"][:80] if "error" in r else f"max_rel_err {r['max_rel_err']:.4f} <= {r['verify_bound']}: {r['verify_ok']}"
            out.append(f"verify {r['variant']:14s} {r['model']:12s} S={r['S']}: {ok}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--timeout", type=float, default=150, help="seconds for the whole launch")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="smoke run of this script on CPU/gloo (tiny custom shapes)")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"unknown variants {bad}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    from moetune.runtime.shapes import get_model

    for m in models:
        get_model(m)
    cases = build_cases(models, tokens, variants, args.iters, args.warmup, not args.no_verify)
    if args.cpu:
        for c in cases:
            c["model"], c["backend"] = "custom:256,128,16,8", "gloo"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        print(f"dry-run: {len(cases)} cases ({len(models)} models x {len(tokens)} S x {len(variants)} variants + verify); out={out}")
        return 0
    import torch

    if not args.cpu and torch.cuda.device_count() < 2:
        print("onesided_bench_ep: needs 2 GPUs", file=sys.stderr)
        return 2
    from moetune.runtime.testing.launch import LaunchError, launch

    results = out / "bench_ep_onesided.jsonl"
    results.write_text("")
    rc = 0
    try:
        launch(rank_main, 2, backend="gloo" if args.cpu else "nccl", args=(cases, str(results)), timeout_s=60, join_timeout_s=args.timeout)
    except LaunchError as e:
        rc = 1
        first = next(iter(e.errors.values())).splitlines()[0]
        print(f"launch failed: {first}", file=sys.stderr)
        done = {json.loads(ln)["case_id"] for ln in results.read_text().splitlines() if ln.strip()}
        with open(results, "a") as f:
            for c in cases:
                if c["id"] not in done:
                    f.write(json.dumps({"bench": "bench_ep", "case_id": c["id"], "kind": c["kind"], "variant": c["variant"],
                                        "model": c["model"], "S": c["tokens"], "error": f"not run: {first}"}) + "\n")
    rows = [json.loads(ln) for ln in results.read_text().splitlines() if ln.strip()]
    print("\n".join(table(rows)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
