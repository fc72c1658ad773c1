#!/usr/bin/env python3
"""Proxy microbenchmark (Perseus Fig. 5 shape) on the C++ proxy engine, plus the unsafe-mode race probe.

GPU0's proxy engine -> emulated remote PEs (regions on GPU1). Concurrency c transfers spread over
min(12, c) PEs; message sizes 4 KB..4 MB; modes: put_only, coupled+drain, decoupled+drain,
coupled+nic_ordered, decoupled+nic_ordered (4 QP streams per PE, peer_hash; results recorded before the
engine's QPs became per peer ran 4 streams shared by all PEs). Time per batch = host enqueue
of all requests until every transfer and signal completed (measured inside C++), median of >= 15.

The race probe runs round_robin + nic_ordered + 4 QPs per PE (refused by Knobs; reached only through
`_allow_unsafe`): a checker kernel on GPU1 reads each transfer's tail as soon as its signal lands and
counts stale (poisoned) words; peer_hash with the same settings is the control (must show 0).

    python bench/proxy_micro.py [--out DIR] [--iters 20] [--quick] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

CONCURRENCY = (1, 4, 16, 48, 96)
SIZES = (4 << 10, 16 << 10, 256 << 10, 4 << 20)
MODES = {
    # name: (fence_mode, signalling or None for put-only, proxy batch)
    "put_only": ("none", None, 1),
    "coupled_drain": ("proxy_drain", "coupled", 1),
    "decoupled_drain": ("proxy_drain", "decoupled", 1),
    "coupled_ordered": ("nic_ordered", "coupled", 1),
    "decoupled_ordered": ("nic_ordered", "decoupled", 1),
    # the proxy issuing consecutive unsignalled PUTs of a stream as one cudaMemcpyBatchAsync
    "put_only+batch": ("none", None, 64),
    "decoupled_drain+batch": ("proxy_drain", "decoupled", 64),
    "decoupled_ordered+batch": ("nic_ordered", "decoupled", 64),
}
SLOTS_PER_PE = 128  # as moetune.tuner.measure.micro.SLOTS_PER_PE


def pes_for(c: int) -> int:
    from moetune.tuner.measure.micro import proxy_pes

    return proxy_pes(c)


def build_requests(P, c: int, size: int, signalling: str | None, src_base: int):
    from moetune.tuner.measure.micro import proxy_requests

    return proxy_requests(c, size, signalling, src_base)


def run_micro(args, out_rows: list[dict]) -> None:
    import torch

    from moetune.runtime.options import RuntimeOptions
    from moetune.runtime.transports import proxy as P

    lib = P.csrc_build.load()
    P.csrc_build.check(lib, lib.mt_enable_peer_access(0, 1), "enable peer access 0->1")
    cpu = P.proxy_cpu_choice(RuntimeOptions.resolve(), torch.device("cuda", 0)).cpus  # as the transport pins it
    max_size = max(args.sizes)
    per_pe_max = 8
    src = torch.empty(96 * max_size, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    dst = torch.zeros(12 * per_pe_max * max_size, dtype=torch.uint8, device="cuda:1")
    flags = torch.zeros(12 * SLOTS_PER_PE, dtype=torch.int64, device="cuda:1")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    value = 1
    for mode, (fence, signalling, batch) in MODES.items():
        for c in args.concurrency:
            npe = pes_for(c)
            region = (c // npe) * max_size
            peer_data = [dst.data_ptr() + p * region for p in range(npe)]
            peer_sig = [flags.data_ptr() + p * SLOTS_PER_PE * 8 for p in range(npe)]
            try:
                eng = P.ProxyEngine(0, peer_data, peer_data, peer_sig, qps=args.qps, qp_mapping="peer_hash",
                                    fence_mode=fence, batch=batch, cpu=cpu)
            except Exception as e:
                out_rows.append({"bench": "proxy_micro", "mode": mode, "fence_mode": fence,
                                 "signalling": signalling or "none", "batch": batch, "concurrency": c,
                                 "error": str(e)[-1500:]})
                print(f"  {mode} c={c}: engine failed: {e}", flush=True)
                continue
            try:
                for size in args.sizes:
                    reqs, npe, per = build_requests(P, c, size, signalling, src.data_ptr())
                    eng.reset_stats()
                    try:
                        t = eng.bench(reqs, args.warmup + args.iters, value_base=value)
                    except Exception as e:  # keep going with the next point; the engine may be unusable
                        out_rows.append({"bench": "proxy_micro", "mode": mode, "fence_mode": fence,
                                         "signalling": signalling or "none", "batch": batch, "concurrency": c,
                                         "size": size, "error": str(e)[-1500:], "engine_error": eng.error()})
                        print(f"  {mode} c={c} size={size}: FAILED {e}", flush=True)
                        break
                    value += args.warmup + args.iters
                    t = t[args.warmup :]
                    med = statistics.median(t)
                    st = eng.stats()
                    ok_flags = None
                    if signalling is not None:
                        f = flags.view(12, SLOTS_PER_PE)[:npe].cpu()
                        want = value - 1
                        nsig = per if signalling == "coupled" else 1
                        ok_flags = bool((f[:, :nsig] == want).all())
                    row = {
                        "bench": "proxy_micro", "mode": mode, "fence_mode": fence, "signalling": signalling or "none",
                        "concurrency": c, "pes": npe, "size": size, "qps": args.qps,
                        "abi": P.csrc_build.ABI_VERSION,  # qps per peer since ABI 19, shared before: the row says which
                        "batch": batch, "iters": len(t),
                        "us_median": med, "us_p10": _pct(t, 10), "us_p90": _pct(t, 90),
                        "GBps": c * size / med / 1e3, "issue_us_per_op": st["busy_ns"] / 1e3 / max(1, st["processed"]),
                        "issue_us_per_op_excl_drain": (st["busy_ns"] - st["drain_ns"]) / 1e3 / max(1, st["processed"]),
                        "drains_per_iter": st["drains"] / (args.warmup + args.iters),
                        "drain_us_per_iter": st["drain_ns"] / 1e3 / (args.warmup + args.iters),
                        "signals_landed": ok_flags, "engine_error": eng.error(),
                    }
                    out_rows.append(row)
                    print(f"  {mode:18s} c={c:3d} size={size >> 10:5d}KB  {med:9.1f} us  {row['GBps']:7.2f} GB/s"
                          f"  issue {row['issue_us_per_op']:.2f} us/op  flags_ok={ok_flags}", flush=True)
            finally:
                eng.close()
    # ratios against put-only
    base = {(r["concurrency"], r["size"]): r["us_median"] for r in out_rows if r.get("mode") == "put_only" and "us_median" in r}
    for r in out_rows:
        if r.get("bench") == "proxy_micro" and "us_median" in r and (r["concurrency"], r["size"]) in base:
            r["ratio_vs_put_only"] = base[(r["concurrency"], r["size"])] / r["us_median"]


def _pct(xs: list[float], p: float) -> float:
    """The p-th percentile of `xs` as every timing in summary.csv has it (tuner/measure/stats.py: linear interpolation
    between the sorted samples). The nearest sample's rank before: these rows' p10 / p90 were another statistic than
    the other scenarios' beside them (of 20 samples 0..19, p10 2 instead of 1.9)."""
    from moetune.tuner.measure.stats import quantile

    return quantile(sorted(xs), p / 100)


ACK_SHAPES = ((1, 1), (1, 4), (8, 1), (8, 4), (8, 8))  # (emulated peers, QPs per peer)
ACK_BATCHES = {
    # case: (a PUT on each of a peer's streams (True) or on its first only, an ACK after them)
    "puts-every-stream": (True, False),
    "puts-every-stream-ack": (True, True),
    "put-per-peer": (False, False),
    "put-per-peer-ack": (False, True),
}


def run_ack(args, out_rows: list[dict]) -> None:
    """What an ACK costs the proxy thread against the streams it is written on (one GPU: the peers are regions of one
    buffer on GPU 0). A batch = 4 KB PUTs, peer_hash: one on every stream of every peer (signal_idx k -> stream k)
    or one per peer (all on its first stream), with or without an ACK after them; time per batch from the host's
    enqueue until every stream drained (mt_proxy_bench), and the ACK's stream writes per batch (stat ack_writes:
    the streams the batch picked)."""
    import torch

    from moetune.runtime.options import RuntimeOptions
    from moetune.runtime.transports import proxy as P

    cpu = P.proxy_cpu_choice(RuntimeOptions.resolve(), torch.device("cuda", 0)).cpus
    size = 4096
    src = torch.empty(64 * size, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    dst = torch.zeros(64 * 64 * size, dtype=torch.uint8, device="cuda:0")
    flags = torch.zeros(64 * SLOTS_PER_PE, dtype=torch.int64, device="cuda:0")
    torch.cuda.synchronize()
    value, n = 1, args.warmup + args.iters
    for npe, qps in ACK_SHAPES:
        peer_data = [dst.data_ptr() + p * 64 * size for p in range(npe)]
        peer_sig = [flags.data_ptr() + p * SLOTS_PER_PE * 8 for p in range(npe)]
        eng = P.ProxyEngine(0, peer_data, peer_data, peer_sig, qps=qps, qp_mapping="peer_hash",
                            fence_mode="proxy_drain", cpu=cpu)
        try:
            for case, (spread, ack) in ACK_BATCHES.items():
                ks = range(qps) if spread else range(1)
                items = [(P.OP_PUT, p, 0, k, src.data_ptr() + k * size, k * size, size) for p in range(npe) for k in ks]
                if ack:
                    items.append((P.OP_ACK, 0, 0, 0, 0, 0, 0))
                eng.reset_stats()
                t = eng.bench(P.make_requests(items), n, value_base=value)[args.warmup:]
                value += n
                st = eng.stats()
                out_rows.append({"bench": "proxy_ack", "case": case, "peers": npe, "qps": qps, "size": size,
                                 "iters": len(t), "us_median": statistics.median(t), "us_p10": _pct(t, 10),
                                 "us_p90": _pct(t, 90), "ack_writes_per_batch": st.get("ack_writes", 0) / n,
                                 "engine_error": eng.error()})
                print(f"  ack {case:22s} peers {npe} x qps {qps}: {statistics.median(t):8.2f} us, "
                      f"ack writes/batch {st.get('ack_writes', 0) / n:.0f}", flush=True)
        finally:
            eng.close()


def run_race(args, out_rows: list[dict]) -> None:
    """Unsafe round_robin + nic_ordered + 4 QPs vs. peer_hash control: stale rows seen at signal time."""
    import torch

    from moetune.runtime.transports import proxy as P

    lib = P.csrc_build.load()
    P.csrc_build.check(lib, lib.mt_enable_peer_access(0, 1), "enable peer access 0->1")
    npe, per = 12, 8
    n = npe * per
    for size in args.race_sizes:
        src = torch.empty(n * size // 4, dtype=torch.int32, device="cuda:0")
        dst = torch.empty(n * size // 4, dtype=torch.int32, device="cuda:1")
        flags = torch.zeros(n, dtype=torch.int64, device="cuda:1")
        bad = torch.zeros(n, dtype=torch.int32, device="cuda:1")
        peer_data = [dst.data_ptr() + p * per * size for p in range(npe)]
        peer_sig = [flags.data_ptr() + p * per * 8 for p in range(npe)]
        items = [(P.OP_PUT, p, P.F_SIGNAL, t, src.data_ptr() + (p * per + t) * size, t * size, size)
                 for p in range(npe) for t in range(per)]
        reqs = P.make_requests(items)
        s1 = torch.cuda.Stream(device=1)
        for mapping in ("peer_hash", "round_robin"):
            eng = P.ProxyEngine(0, peer_data, peer_data, peer_sig, qps=4, qp_mapping=mapping,
                                fence_mode="nic_ordered", _allow_unsafe=True)
            stale_transfers = 0
            stale_trials = 0
            missing = 0
            epoch0 = int(flags.max().item()) + 1
            try:
                for trial in range(args.race_trials):
                    epoch = epoch0 + trial
                    pattern = (trial + 1) * 1000
                    src.view(n, -1).copy_((pattern + torch.arange(n, device="cuda:0", dtype=torch.int32)).view(n, 1).expand(n, size // 4))
                    dst.fill_(-1)
                    bad.zero_()
                    torch.cuda.synchronize(0)
                    torch.cuda.synchronize(1)
                    P.csrc_build.check(lib, lib.mt_race_check_launch(
                        1, s1.cuda_stream, flags.data_ptr(), 1, dst.data_ptr(), size, size, min(size, 64 << 10), n,
                        pattern, epoch, 10.0, bad.data_ptr()), "race checker")
                    time.sleep(0.0005)  # let the checker CTAs start spinning
                    for r in reqs:
                        r.value = epoch
                    eng.enqueue(reqs)
                    eng.quiesce()
                    s1.synchronize()
                    b = bad.cpu()
                    missing += int((b < 0).sum())
                    k = int((b > 0).sum())
                    stale_transfers += k
                    stale_trials += int(k > 0)
                    err = eng.error()
                    if err:
                        raise RuntimeError(err)
            finally:
                eng.close()
            row = {"bench": "proxy_race", "qp_mapping": mapping, "fence_mode": "nic_ordered", "qps": 4, "size": size,
                   "transfers": n, "trials": args.race_trials, "stale_transfers": stale_transfers,
                   "trials_with_stale": stale_trials, "signals_missing": missing,
                   "unsafe": mapping == "round_robin"}
            out_rows.append(row)
            print(f"  race {mapping:12s} size={size >> 10}KB trials={args.race_trials}: stale transfers {stale_transfers}"
                  f" in {stale_trials} trials (missing signals {missing})", flush=True)
        del src, dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--qps", type=int, default=4)
    ap.add_argument("--race-trials", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="fewer points (smoke run)")
    ap.add_argument("--skip-race", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="import and plan only; no CUDA")
    ap.add_argument("--ack-only", action="store_true", help="only the ACK cost (one GPU, emulated peers)")
    args = ap.parse_args(argv)
    args.concurrency = (1, 16, 96) if args.quick else CONCURRENCY
    args.sizes = (16 << 10, 4 << 20) if args.quick else SIZES
    args.race_sizes = (1 << 20, 4 << 20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from moetune.runtime.transports import proxy as P  # import check, also in dry-run

    reqs, npe, per = build_requests(P, 96, 16 << 10, "decoupled", 0)
    if args.dry_run and args.ack_only:
        print(f"dry-run: ACK cost, {len(ACK_SHAPES)} peer x QP shapes x {len(ACK_BATCHES)} batches; out={out}")
        return 0
    if args.dry_run:
        print(f"dry-run: {len(MODES)} modes x {len(args.concurrency)} concurrencies x {len(args.sizes)} sizes, "
              f"96 transfers -> {npe} PEs x {per} + {len(reqs) - 96} group signals; out={out}")
        return 0
    import torch

    if torch.cuda.device_count() < (1 if args.ack_only else 2):
        print(f"proxy_micro: needs {1 if args.ack_only else 2} GPU(s)", file=sys.stderr)
        return 2
    rows: list[dict] = []
    rc = 0
    parts = (("ack", run_ack),) if args.ack_only else (("micro", run_micro), ("race", run_race))
    for name, fn in parts:
        if name == "race" and args.skip_race:
            continue
        print(f"== proxy {name}", flush=True)
        try:
            fn(args, rows)
        except Exception:
            rc = 1
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            rows.append({"bench": f"proxy_{name}", "error": tb[-3000:]})
    with open(out / "proxy_micro.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    # compact summary: 96 transfers at 16 KB
    print("\nproxy micro, 96 transfers x 16 KB (ratio = put-only time / mode time):")
    for r in rows:
        if r.get("bench") == "proxy_micro" and "us_median" in r and r["concurrency"] == 96 and r["size"] == 16 << 10:
            print(f"  {r['mode']:18s} {r['us_median']:9.1f} us  {r['GBps']:6.2f} GB/s  ratio {r.get('ratio_vs_put_only', 0):.2f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
