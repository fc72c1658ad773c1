#!/usr/bin/env python3
"""moetune runtime on 2 GPUs, in one command: correctness, then the collective vs plain all_to_all_single.

    python bench/gpu_runtime.py                 # 2x H200: writes $OUT/runtime_results.jsonl (default ./bench_out)
    python bench/gpu_runtime.py --cpu           # dry run on CPU/gloo with tiny shapes (checks the script itself)

For each fabric — nvlink (NCCL over NVLink) and host_staged (NCCL_P2P_DISABLE=1, set in freshly spawned
ranks before NCCL initialises) — it runs:
  1. verify: the MoE layer vs the single-process dense reference, each model, S=256, bf16 depth 1 and
     fp8 depth 2 (max relative error, bound as in `moetune bench ep --verify`);
  2. for qwen3-30b, gpt-oss-120b, deepseek-v3 and S in {128, 1024, 4096, 16384} tokens per rank:
       plain      : NCCL all_to_all_single without packing (k copies of each token, bf16; as in
                    bench/results/2026-11-30_h200x2_nccl_baseline.jsonl)
       packed     : moetune collective with the buffer's own layout choice (on 2 ranks: dense, i.e. all-gather
                    dispatch / reduce-scatter combine, no counts, no host sync), bf16, pipeline_depth 1
       packed_a2a : the packed layout forced (counts first, one host sync, all_to_all_single with splits)
       fp8_d1     : packed + fp8 e4m3 dispatch (per-token scales), depth 1 (separates fp8 from pipelining)
       fp8_d2/d4  : packed + fp8 + pipeline_depth 2 / 4 (dispatch and combine on their own communicators)
     and, only for host_staged qwen3-30b S=4096/16384 (the issue's check): fp8_d2c2, fp8_d4c2, fp8_d4c4, fp8_d8c4
     (channels = communicators per direction) and a2a_fp8_d2, a2a_fp8_d4c2 (packed layout forced).
     dispatch_us and combine_us are each timed alone; total_us is dispatch → identity experts → combine
     as one span (pipelined for depth > 1), the same span for plain; for qwen3-30b also layer_us, the MoE
     layer with its SwiGLU experts between dispatch and combine. CUDA events, median and p10/p90 over
     >= 30 iterations after warm-up; the slowest rank's time per iteration counts.
  3. --profile [fabric:model:S:variant,...]: torch.profiler key_averages tables (top 25 by self device time
     and by CPU time) of 5 round trips of those cases, written to OUT/profile_*.txt.
One JSON line per case (errors recorded as lines with "error"), a compact table and the issue checks last.
A failing case is recorded and skipped; if a launch dies, the remaining cases are relaunched.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)


def _ensure_moetune() -> None:
    """Import moetune from this checkout even when it is not pip-installed (a namespace shim on sys.path,
    inherited by the spawned ranks)."""
    try:
        import moetune.runtime
        import moetune.tuner.measure.ep

        return
    except ImportError as e:
        if "msgspec" in str(e):
            sys.exit(f"moetune needs msgspec on this machine (pip install msgspec): {e}")
    shim = Path(tempfile.mkdtemp(prefix="moetune_shim_")) / "moetune"
    shim.mkdir()
    (shim / "__init__.py").write_text("")
    for sub in ("runtime", "tuner", "csrc", "policies"):
        if (ROOT / sub).exists():
            (shim / sub).symlink_to(ROOT / sub)
    sys.path.insert(0, str(shim.parent))
    for name in [m for m in sys.modules if m == "moetune" or m.startswith("moetune.")]:
        del sys.modules[name]
    import moetune.tuner.measure.ep  # noqa: F401


MODELS = ("qwen3-30b", "gpt-oss-120b", "deepseek-v3")
TOKENS = (128, 1024, 4096, 16384)
VARIANTS: dict[str, dict] = {
    "plain": {"impl": "plain", "knobs": {}},
    "packed": {"impl": "moetune", "knobs": {}},  # EPBuffer's own layout choice (dense on 2 ranks)
    "packed_a2a": {"impl": "moetune", "knobs": {}, "dense": False},  # forced: counts + all_to_all_single
    "fp8_d1": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3"}},
    "fp8_d2": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3", "pipeline_depth": 2}},
    "fp8_d4": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3", "pipeline_depth": 4}},
}
# Extra variants only where the host-staged check is decided (more communicators per direction).
EXTRA_VARIANTS: dict[str, dict] = {
    "fp8_d2c2": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3", "pipeline_depth": 2, "channels": 2}},
    "fp8_d4c2": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3", "pipeline_depth": 4, "channels": 2}},
    "fp8_d4c4": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3", "pipeline_depth": 4, "channels": 4}},
    "fp8_d8c4": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3", "pipeline_depth": 8, "channels": 4}},
    # the same with the packed (counts + all_to_all) layout forced, in case NCCL's all-to-all stages through
    # host memory faster than its all-gather / reduce-scatter
    "a2a_fp8_d2": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3", "pipeline_depth": 2}, "dense": False},
    "a2a_fp8_d4c2": {"impl": "moetune", "knobs": {"compression": "fp8_e4m3", "pipeline_depth": 4, "channels": 2},
                     "dense": False},
}
EXTRA_AT = {("host_staged", "qwen3-30b", 4096), ("host_staged", "qwen3-30b", 16384)}
ALL_VARIANTS = {**VARIANTS, **EXTRA_VARIANTS}
DEFAULT_PROFILE = "nvlink:qwen3-30b:128:packed,nvlink:qwen3-30b:128:plain,host_staged:qwen3-30b:4096:fp8_d2"
CPU_MODELS = {"qwen3-30b": "custom:256,128,16,8", "gpt-oss-120b": "custom:384,384,16,4", "deepseek-v3": "custom:512,256,32,8"}


def build_cases(args) -> list[dict]:
    models = args.models.split(",") if args.models else list(MODELS)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([16, 64] if args.cpu else list(TOKENS))
    cases = []
    for m in models:
        spec = CPU_MODELS.get(m, m) if args.cpu else m
        for vname in ("packed", "fp8_d2"):
            v = VARIANTS[vname]
            cases.append({"kind": "verify", "name": m, "model": spec, "tokens": 32 if args.cpu else 256, "variant": vname,
                          "impl": "moetune", "knobs": dict(v["knobs"]), "iters": 2 if args.cpu else 3, "warmup": 1,
                          "verify": True, "layer": True})
    profile = {tuple(p.split(":")) for p in args.profile.split(",") if p} if args.profile else set()
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    for m in models:
        spec = CPU_MODELS.get(m, m) if args.cpu else m
        for s in tokens:
            extra = [(f, v) for f in ("nvlink", "host_staged") if (f, m, s) in EXTRA_AT for v in EXTRA_VARIANTS]
            for fabric, vname in [(None, v) for v in variants] + extra:
                v = ALL_VARIANTS[vname]
                cases.append({"kind": "time", "name": m, "model": spec, "tokens": s, "variant": vname,
                              "impl": v["impl"], "knobs": dict(v["knobs"]), "dense": v.get("dense"),
                              "iters": args.iters, "warmup": args.warmup, "verify": False, "fabric_only": fabric,
                              "profile_on": sorted(f for f in ("nvlink", "host_staged") if (f, m, str(s), vname) in profile),
                              # the whole layer (SwiGLU experts between dispatch and combine) for Qwen3-30B,
                              # where pipelining can also hide expert compute
                              "layer": m == "qwen3-30b" and v["impl"] == "moetune" and vname != "packed_a2a"})
    for i, c in enumerate(cases):
        c["id"] = i
    return cases


def rank_main(rank: int, world: int, cases: list[dict], fabric: str, results: str, progress: str,
              command: str, inject: str, run_id: str) -> int:
    """Runs inside each spawned rank: every case in lockstep; rank 0 appends one JSON line per case."""
    import torch
    import torch.distributed as dist

    from moetune.tuner.measure.ep import bench_case

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    hardware = torch.cuda.get_device_name() if cuda else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    done = 0
    for case in cases:
        if rank == 0:
            Path(progress).write_text(json.dumps({"started": case["id"]}))
        err = ""
        rep = None
        try:
            if inject and case["variant"] == inject and rank == 0:
                raise RuntimeError(f"injected failure in variant {inject}")
            cfg = dict(case, routing="uniform", seed=0, profile=fabric in case.get("profile_on", ()))
            if fabric == "host_staged":  # the same collective; the knob records that NCCL stages through host memory
                cfg["knobs"] = dict(cfg["knobs"], transport="host_staged")
            rep = bench_case(rank, world, cfg)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        if cuda:
            torch.cuda.empty_cache()
        # lockstep: every rank learns whether any rank failed this case
        flag = torch.tensor([1 if err else 0], device="cuda" if cuda else "cpu")
        dist.all_reduce(flag)
        if rank == 0:
            rec = {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "run_id": run_id,
                "hardware": hardware, "torch": torch.__version__, "nccl": nccl, "command": command,
                "fabric": fabric, "model": case["name"], "model_spec": case["model"], "S": case["tokens"],
                "variant": case["variant"], "kind": case["kind"], "world": world, "case_id": case["id"],
                "backend": dist.get_backend(),
            }
            if rep is not None and not flag.item():
                for src, dst in (("dispatch_us", "dispatch"), ("combine_us", "combine"), ("roundtrip_us", "total")):
                    rec[f"{dst}_us"] = rep[src]["median"]
                    rec[f"{dst}_p10"] = rep[src]["p10"]
                    rec[f"{dst}_p90"] = rep[src]["p90"]
                rec["layer_us"] = rep["layer_us"]["median"] if rep.get("layer_us") else None
                rec["roundtrip_rel_err"] = rep["roundtrip_rel_err"]
                rec["roundtrip_ok"] = rep["roundtrip_rel_err"] <= rep["roundtrip_bound"]
                rec["max_rel_err"] = rep["max_rel_err"]
                rec["verify_bound"] = rep["verify_bound"]
                rec["verify_ok"] = (rep["max_rel_err"] <= rep["verify_bound"]) if rep["max_rel_err"] is not None else None
                rec["iters"], rec["warmup"] = rep["iters"], rep["warmup"]
                rec["wire_bytes_per_row"] = rep["wire_bytes_per_row"]
                rec["dispatch_remote_bytes_rank0"] = rep["dispatch_remote_bytes_rank0"]
                rec["knobs"] = rep["knobs"]
                rec["layout"] = rep["layout"]
                if rep.get("profile"):
                    name = f"profile_{fabric}_{case['name']}_{case['tokens']}_{case['variant']}.txt"
                    (Path(results).parent / name).write_text(rep["profile"])
                    rec["profile_file"] = name
            else:
                rec["error"] = err or "failed on another rank"
            with open(results, "a") as f:
                f.write(json.dumps(rec) + "\n")
        done += 1
    return done


def run_fabric(fabric: str, cases: list[dict], args, results: Path, deadline: float, run_id: str) -> None:
    from moetune.runtime.testing.launch import LaunchError, launch

    env = {"NCCL_P2P_DISABLE": "1"} if fabric == "host_staged" else {}
    backend = "gloo" if args.cpu else "nccl"
    remaining = [c for c in cases if c.get("fabric_only") in (None, fabric)]
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    while remaining:
        left = deadline - time.monotonic()
        if left < 20:
            _record_skipped(results, fabric, remaining, "time budget exhausted", run_id)
            return
        progress = Path(tempfile.mkstemp(prefix="moetune_progress_")[1])
        progress.write_text("{}")
        try:
            launch(rank_main, 2, backend=backend, args=(remaining, fabric, str(results), str(progress), command,
                                                      args.inject_failure, run_id),
                   timeout_s=args.collective_timeout, join_timeout_s=left - 5, env=env)
            return
        except LaunchError as e:
            started = json.loads(progress.read_text() or "{}").get("started")
            first = next(iter(e.errors.values())).splitlines()[0]
            print(f"[{fabric}] launch failed at case {started}: {first}", file=sys.stderr)
            done_ids = _done_ids(results, fabric, run_id)
            failed = [c for c in remaining if c["id"] == started and c["id"] not in done_ids]
            _record_skipped(results, fabric, failed, f"rank crashed or timed out: {first}", run_id)
            remaining = [c for c in remaining if c["id"] not in done_ids and c["id"] != started]
            if started is None:
                _record_skipped(results, fabric, remaining, f"launch failed before any case: {first}", run_id)
                return


def _done_ids(results: Path, fabric: str, run_id: str) -> set[int]:
    out: set[int] = set()
    if results.exists():
        for line in results.read_text().splitlines():
            r = json.loads(line)
            if r.get("fabric") == fabric and r.get("run_id") == run_id and "case_id" in r:
                out.add(r["case_id"])
    return out


def _record_skipped(results: Path, fabric: str, cases: list[dict], why: str, run_id: str) -> None:
    with open(results, "a") as f:
        for c in cases:
            f.write(json.dumps({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                                "run_id": run_id,
                                "fabric": fabric, "model": c["name"], "S": c["tokens"], "variant": c["variant"],
                                "kind": c["kind"], "case_id": c["id"], "error": why}) + "\n")


def summarise(results: Path, run_id: str) -> int:
    rows = [json.loads(x) for x in results.read_text().splitlines() if x.strip()] if results.exists() else []
    rows = [r for r in rows if r.get("run_id") == run_id]
    bad = 0
    print("\nverify (max relative error vs dense reference):")
    for r in rows:
        if r["kind"] == "verify":
            if "error" in r:
                print(f"  {r['fabric']:<11} {r['model']:<13} {r['variant']:<7} ERROR {r['error'][:90]}")
                bad += 1
            else:
                ok = "ok" if r["verify_ok"] else "FAIL"
                bad += 0 if r["verify_ok"] else 1
                print(f"  {r['fabric']:<11} {r['model']:<13} {r['variant']:<7} {r['max_rel_err']:.3g} "
                      f"(bound {r['verify_bound']:.3g}) {ok}")
    t = {(r["fabric"], r["model"], r["S"], r["variant"]): r for r in rows if r["kind"] == "time"}
    print("\ntotal = dispatch -> combine round trip, median µs (dispatch / combine alone in brackets)")
    shown = [v for v in ALL_VARIANTS if any(k[3] == v for k in t)]
    header = f"{'fabric':<11} {'model':<13} {'S':>6} " + " ".join(f"{v:>22}" for v in shown)
    print(header)
    for (fabric, model, s) in sorted({k[:3] for k in t}, key=lambda k: (k[0], k[1], k[2])):
        cells = []
        for v in shown:
            r = t.get((fabric, model, s, v))
            if r is None:
                cells.append(f"{'-':>22}")
            elif "error" in r:
                cells.append(f"{'ERR':>22}")
                bad += 1
            elif not r.get("roundtrip_ok", True):
                cells.append(f"{'WRONG':>22}")
                bad += 1
            else:
                cells.append(f"{r['total_us']:>7.0f} ({r['dispatch_us']:.0f}/{r['combine_us']:.0f})".rjust(22))
        print(f"{fabric:<11} {model:<13} {s:>6} " + " ".join(cells))
    print("\nissue checks:")
    base = t.get(("host_staged", "qwen3-30b", 4096, "packed"))
    best = [t.get(("host_staged", "qwen3-30b", 4096, v)) for v in ALL_VARIANTS
            if "fp8_d" in v and v not in ("fp8_d1",)]
    best = [b for b in best if b and "error" not in b]
    plain = t.get(("host_staged", "qwen3-30b", 4096, "plain"))
    if base and "error" not in base and best:
        b = min(best, key=lambda r: r["total_us"])
        ratio = base["total_us"] / b["total_us"]
        print(f"  host_staged qwen3-30b S=4096: packed bf16 depth1 ({base.get('layout', '?')} layout) "
              f"{base['total_us']:.0f} µs / {b['variant']} "
              f"{b['total_us']:.0f} µs = {ratio:.2f}x ({'PASS' if ratio >= 1.8 else 'FAIL'} >= 1.8x)")
        if plain and "error" not in plain:
            print(f"    (vs plain all_to_all_single bf16 {plain['total_us']:.0f} µs: {plain['total_us'] / b['total_us']:.2f}x)")
        a2a = t.get(("host_staged", "qwen3-30b", 4096, "packed_a2a"))
        if a2a and "error" not in a2a:
            print(f"    (vs packed_a2a bf16 depth1 {a2a['total_us']:.0f} µs: {a2a['total_us'] / b['total_us']:.2f}x)")
        layers = [r for r in [base, *best] if r.get("layer_us")]
        if len(layers) > 1:
            print("    whole layer (experts between dispatch and combine), µs: "
                  + ", ".join(f"{r['variant']} {r['layer_us']:.0f}" for r in layers))
    else:
        print("  host_staged qwen3-30b S=4096: not measured")
    for variant in ("packed", "packed_a2a"):  # the check is on `packed`; packed_a2a for information
        compared, slower = 0, []
        for (fabric, model, s, v), r in sorted(t.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            p = t.get((fabric, model, s, "plain"))
            if fabric != "nvlink" or v != variant or "error" in r or not p or "error" in p:
                continue
            compared += 1
            noise = max(p["total_p90"] - p["total_us"], r["total_p90"] - r["total_us"])
            if r["total_us"] - p["total_us"] > noise:
                slower.append(f"    {model} S={s}: {variant} ({r.get('layout', '?')}) {r['total_us']:.0f} µs vs plain "
                              f"{p['total_us']:.0f} µs (noise {noise:.0f} µs)")
        label = f"  nvlink {variant} vs plain" + (" (information only)" if variant != "packed" else "")
        if not compared:
            print(f"{label}: not measured")
        elif slower:
            print(f"{label}: SLOWER beyond noise in {len(slower)} of {compared} cases" + (" FAIL" if variant == "packed" else "") + ":")
            print("\n".join(slower))
        else:
            print(f"{label}: never slower beyond noise ({compared} cases)" + (" PASS" if variant == "packed" else ""))
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help="gloo on CPU with tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--models", default="", help="comma list (default: qwen3-30b,gpt-oss-120b,deepseek-v3)")
    ap.add_argument("--tokens", default="", help="comma list (default: 128,1024,4096,16384)")
    ap.add_argument("--fabrics", default="nvlink,host_staged")
    ap.add_argument("--variants", default="", help=f"comma list (default: {','.join(VARIANTS)})")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop launching new cases after this")
    ap.add_argument("--profile", nargs="?", const=DEFAULT_PROFILE, default="",
                    help="torch.profiler tables for these cases, fabric:model:S:variant,... "
                         f"(flag alone: {DEFAULT_PROFILE}); written to OUT/profile_*.txt")
    ap.add_argument("--collective-timeout", type=float, default=60.0)
    ap.add_argument("--inject-failure", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpu and args.iters == 30:
        args.iters, args.warmup = 3, 1
    _ensure_moetune()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "runtime_results.jsonl"
    run_id = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    cases = build_cases(args)
    if not args.cpu:
        import torch

        if torch.cuda.device_count() < 2:
            print("needs 2 GPUs (use --cpu for the dry run)", file=sys.stderr)
            return 2
    fabrics = [f for f in args.fabrics.split(",") if f]
    for i, fabric in enumerate(fabrics):
        # share what is left of the budget between the fabrics still to run
        share = (deadline - time.monotonic()) / (len(fabrics) - i)
        print(f"[{fabric}] {len(cases)} cases, budget {share:.0f} s", file=sys.stderr)
        run_fabric(fabric, cases, args, results, time.monotonic() + share, run_id)
    bad = summarise(results, run_id)
    print(f"\n{results} ({time.monotonic() - t0:.0f} s; {bad} failed/erroneous entries)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
