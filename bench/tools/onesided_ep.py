#!/usr/bin/env python3
"""EP exchange benchmark of the one-sided transports against NCCL, world 2 (one process per GPU).

A tool, not a benchmark (bench/tools/README.md): its numbers are not rows of bench/results/summary.csv; a probe of
the one-sided exchanges below EPBuffer (raw exchange, `--busy-us`). EPBuffer end to end: `moetune bench ep` and the
scenario ep-roundtrip-qwen3-s128.

For each model (hidden H, top-k k, experts E) and S tokens per rank: random top-k routing (uniform),
dispatch sends each token once to every rank holding one of its experts (DeepEP-style, rows of
H x 2 bytes, bf16), combine sends the same rows back. Timed with CUDA events after a barrier,
median of 20:
  nvlink / proxy : exchange_counts + exchange (dispatch), exchange (combine)
  nccl           : all_to_all_single with split sizes already on the host (no count exchange)
  nccl+counts    : all_to_all_single of the counts, .tolist() (a host sync), then the rows -- what a
                   collective transport has to do
GB/s = remote bytes sent by this rank / dispatch time. Also a num_sms sweep of nvlink at the largest
bandwidth shape. Output: $OUT/onesided_ep.jsonl, a table printed last.

`--busy-us N` keeps the GPU busy for N µs (a spin kernel) before the first event of every timed
iteration, for every transport alike: the host then issues the calls while the GPU spins, and the
events time what the GPU does (as a kernel-time profile would), not the host's issue latency of an
idle stream. Rows record `busy_prelude_us`.

    python bench/tools/onesided_ep.py [--out DIR] [--iters 30] [--quick] [--busy-us 300] [--dry-run]
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

MODELS = ("qwen3-30b", "deepseek-v3")
TOKENS = (128, 1024, 16384)
NVLINK_VARIANTS = (  # default knobs (num_sms=24), the fused single-launch dispatch, and num_sms=128 (run-1 best)
    ("nvlink", "signalling=coupled,num_sms=24"),
    ("nvlink", "signalling=coupled,num_sms=24|fused"),
    ("nvlink", "signalling=decoupled,num_sms=24|fused"),
    ("nvlink", "signalling=coupled,num_sms=128"),
    ("nvlink", "signalling=decoupled,num_sms=128"),
)
PROXY_VARIANTS = (  # the two ends of the fence/signalling trade-off
    ("proxy", "fence_mode=proxy_drain,signalling=coupled,qps_per_pe=1,chunk_tokens=128"),
    ("proxy", "fence_mode=nic_ordered,signalling=decoupled,qp_mapping=peer_hash,qps_per_pe=2,chunk_tokens=128"),
)
SMS_SWEEP = (32, 64, 96)


def _stats(xs: list[float]) -> dict:
    s = sorted(xs)
    pick = lambda p: s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]  # noqa: E731
    return {"median": statistics.median(s), "p10": pick(10), "p90": pick(90), "n": len(s)}


def make_shape(model, S: int, world: int, rank: int, device, seed: int = 0, layout: str = "rank"):
    """Packed dispatch rows for this rank: send tensor grouped by destination rank, counts.

    layout "rank": each token once per destination rank holding any of its experts (DeepEP-style);
    "expert": each token once per selected expert (k copies, as the NCCL baseline
    bench/results/2026-11-30_h200x2_nccl_baseline.jsonl sends).
    """
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed * 7919 + rank * 31 + S)
    E, k, H = model.experts, model.topk, model.hidden
    topk = torch.rand(S, E, generator=g).topk(k, dim=1).indices
    epr = E // world
    dest_of = topk // epr  # [S, k]
    order = []
    counts = []
    for d in range(world):
        if layout == "expert":
            idx = (dest_of == d).nonzero()[:, 0]  # token index repeated once per expert on d
        else:
            idx = (dest_of == d).any(dim=1).nonzero().flatten()
        order.append(idx)
        counts.append(int(idx.numel()))
    x = torch.randn(S, H, generator=g).to(torch.bfloat16)
    send = x[torch.cat(order)].to(device)
    return send, counts


def bench_worker(rank: int, world: int, *, models: list[str], tokens: list[int], iters: int, warmup: int,
                 variants: list[tuple[str, str]], sms_sweep: list[int], graphs: bool = True,
                 busy_us: float = 0.0) -> list[dict]:
    import torch
    import torch.distributed as dist

    from moetune.runtime.shapes import get_model
    from moetune.runtime.testing.selftest import barrier, knobs_for, split_spec, transport_class

    device = torch.device("cuda", rank)
    rows: list[dict] = []
    shapes = {}
    max_bytes, max_rb = 1, 1
    for m in models:
        model = get_model(m)
        for S in tokens:
            layouts = ["rank", "expert"] if (m == "qwen3-30b" and max(tokens) == S) else ["rank"]
            for layout in layouts:
                send, counts = make_shape(model, S, world, rank, device, layout=layout)
                shapes[(m, S, layout)] = (model, send, counts)
                max_bytes = max(max_bytes, send.numel() * send.element_size())
                max_rb = max(max_rb, model.hidden * 2)
    max_rows = -(-max_bytes // max_rb)  # capacity by bytes: world x the largest send of any shape

    def remote_bytes(send, counts):
        return sum(c for d, c in enumerate(counts) if d != rank) * send.shape[1] * send.element_size()

    host_us: list[float] = []
    busy_cycles = 0
    if busy_us > 0:  # the spin kernel's clock: cycles per µs, measured
        torch.cuda._sleep(1000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(2_000_000)
        b.record()
        torch.cuda.synchronize(device)
        busy_cycles = int(busy_us * 2_000_000 / (a.elapsed_time(b) * 1e3))

    def agree(err: str | None) -> bool:
        """All ranks learn whether any failed (keeps the collectives in step). True = all fine."""
        flag = torch.tensor([1.0 if err else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0

    def time_pair(dispatch_fn, combine_fn):
        d_us, c_us = [], []
        host_us.clear()
        err = None
        for i in range(warmup + iters):
            barrier(device)  # every rank takes part in every barrier, even after a failure
            if err:
                continue
            try:
                e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                if busy_cycles:
                    torch.cuda._sleep(busy_cycles)
                e0.record()
                h0 = time.perf_counter()
                st = dispatch_fn()
                e1.record()
                combine_fn(st)
                h1 = time.perf_counter()
                e2.record()
                torch.cuda.synchronize(device)
                if i >= warmup:
                    d_us.append(e0.elapsed_time(e1) * 1e3)
                    c_us.append(e1.elapsed_time(e2) * 1e3)
                    host_us.append((h1 - h0) * 1e6)
            except Exception:
                err = traceback.format_exc()[-2000:]
        if not agree(err):
            raise RuntimeError(err or "another rank failed")
        return d_us, c_us

    def time_graph(dispatch_fn, combine_fn):
        """Capture counts + dispatch + combine (two exchanges: parity-stable) in a CUDA graph; time replays."""
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        g = torch.cuda.CUDAGraph()
        barrier(device)
        err = None
        try:
            with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                combine_fn(dispatch_fn())
            torch.cuda.current_stream(device).wait_stream(s)
            torch.cuda.synchronize(device)
        except Exception:
            err = traceback.format_exc()[-1500:]
        if not agree(err):
            raise RuntimeError(err or "capture failed on another rank")
        us = []
        err = None
        for i in range(warmup + iters):
            barrier(device)
            if err:
                continue
            try:
                e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                e0.record()
                g.replay()
                e1.record()
                torch.cuda.synchronize(device)
                if i >= warmup:
                    us.append(e0.elapsed_time(e1) * 1e3)
            except Exception:
                err = traceback.format_exc()[-1500:]
        if not agree(err):
            raise RuntimeError(err or "replay failed on another rank")
        return us, g

    # --- NCCL baselines -----------------------------------------------------------------------------
    for (m, S, layout), (model, send, counts) in shapes.items():
        for name in ("nccl", "nccl+counts"):
            rec = {"bench": "onesided_ep", "transport": name, "knobs": "", "model": m, "tokens": S, "world": world,
                   "rank": rank, "hidden": model.hidden, "layout": layout, "rows_sent": int(send.shape[0]),
                   "busy_prelude_us": busy_us}
            try:
                sc_dev = torch.tensor(counts, dtype=torch.int64, device=device)
                rc_dev = torch.empty_like(sc_dev)
                dist.all_to_all_single(rc_dev, sc_dev)
                rc = rc_dev.tolist()
                recv = torch.empty(sum(rc), send.shape[1], dtype=send.dtype, device=device)
                back = torch.empty_like(send)

                def disp(name=name, send=send, counts=counts, rc=rc, recv=recv, sc_dev=sc_dev):
                    if name == "nccl+counts":
                        r = torch.empty_like(sc_dev)
                        dist.all_to_all_single(r, sc_dev)
                        r.tolist()
                    dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=counts)
                    return recv

                def comb(r, counts=counts, rc=rc, back=back):
                    dist.all_to_all_single(back, r, output_split_sizes=counts, input_split_sizes=rc)

                d_us, c_us = time_pair(disp, comb)
                ok = torch.equal(back, send)
                rec.update(dispatch_us=_stats(d_us), combine_us=_stats(c_us),
                           layer_us=_stats([a + b for a, b in zip(d_us, c_us, strict=True)]),
                           remote_bytes=remote_bytes(send, counts), roundtrip_equal=ok)
                rec["GBps_dispatch"] = rec["remote_bytes"] / rec["dispatch_us"]["median"] / 1e3
            except Exception:
                rec["error"] = traceback.format_exc()[-2000:]
            rows.append(rec)

    # --- one-sided transports -------------------------------------------------------------------------
    def run_transport(tname: str, spec: str, shape_keys, use_graphs: bool = True) -> None:
        t = None
        cerr = None
        fused = "fused" in split_spec(spec)[1]
        try:
            knobs = knobs_for(tname, spec)
            t = transport_class(tname)(None, knobs, device, max_send_rows=max_rows, row_bytes=max_rb)
        except Exception:
            cerr = traceback.format_exc()[-2000:]
        if not agree(cerr):
            rows.append({"bench": "onesided_ep", "transport": tname, "knobs": spec, "rank": rank,
                         "error": cerr or "construction failed on another rank"})
            if t is not None:
                try:
                    t.close()
                except Exception:
                    pass
            return
        try:
            for key in shape_keys:
                m, S, layout = key
                model, send, counts = shapes[key]
                rec = {"bench": "onesided_ep", "transport": tname, "knobs": spec, "model": m, "tokens": S,
                       "world": world, "rank": rank, "hidden": model.hidden, "symm_backend": t.symm_backend,
                       "layout": layout, "rows_sent": int(send.shape[0]), "busy_prelude_us": busy_us}
                try:
                    sc_dev = torch.tensor(counts, dtype=torch.int64, device=device)
                    holder = {}

                    def disp(t=t, send=send, sc_dev=sc_dev, holder=holder):
                        if fused:  # counts ride inside the exchange: one launch
                            out, rc = t.exchange_fused(send, sc_dev)
                        else:
                            rc = t.exchange_counts(sc_dev)
                            out = t.exchange(send, sc_dev, rc)
                        holder["rc"] = rc
                        return out

                    def comb(out, t=t, sc_dev=sc_dev, holder=holder, send=send):
                        rc = holder["rc"]
                        # combine: send back what was received (grouped by source), counts swapped
                        n = int(send.shape[0])  # rows that come back = rows sent
                        holder["back"] = t.exchange(out[: holder["n_recv"]], rc, sc_dev)[:n]

                    # rows received (host value, once, outside the timed loop)
                    rc0 = torch.empty_like(sc_dev)
                    dist.all_to_all_single(rc0, sc_dev)
                    holder["n_recv"] = int(rc0.sum().item())
                    # the NCCL result of this dispatch (once per case): the transport must deliver exactly it
                    ref = torch.empty(holder["n_recv"], send.shape[1], dtype=send.dtype, device=device)
                    dist.all_to_all_single(ref, send, output_split_sizes=rc0.tolist(), input_split_sizes=counts)
                    d_us, c_us = time_pair(disp, comb)  # agrees across ranks before returning/raising
                    torch.cuda.synchronize(device)
                    t.check()
                    ok = torch.equal(holder["back"].view(torch.int16), send.view(torch.int16))
                    got = disp()  # one more dispatch + combine, untimed, checked against NCCL
                    same = torch.equal(got[: holder["n_recv"]].view(torch.int16), ref.view(torch.int16))
                    comb(got)
                    torch.cuda.synchronize(device)
                    t.check()
                    ok = ok and torch.equal(holder["back"].view(torch.int16), send.view(torch.int16))
                    timing = dict(dispatch_us=_stats(d_us), combine_us=_stats(c_us),
                                  layer_us=_stats([a + b for a, b in zip(d_us, c_us, strict=True)]))
                    rec.update(remote_bytes=remote_bytes(send, counts), roundtrip_equal=ok, equals_nccl=same)
                    if not (ok and same):  # a wrong result never prints a time as if it were valid
                        rec["unverified_timing"] = timing
                        raise RuntimeError(f"output differs from NCCL all_to_all_single (dispatch equal={same}, "
                                           f"round trip equal={ok})")
                    rec.update(timing)
                    rec["GBps_dispatch"] = rec["remote_bytes"] / rec["dispatch_us"]["median"] / 1e3
                    rec["host_issue_us"] = _stats(list(host_us))
                    if tname == "proxy":
                        rec["proxy_stats"] = t.proxy_stats()
                except Exception:
                    rec["error"] = traceback.format_exc()[-2000:]
                if not agree(rec.get("error")):
                    rows.append(rec)
                    break  # a failure on some rank: this transport's state is not trusted any more
                if tname == "nvlink" and graphs and use_graphs:
                    gerr = None
                    try:
                        holder["back"] = None
                        g_us, _g = time_graph(disp, comb)  # agrees across ranks internally
                        torch.cuda.synchronize(device)
                        t.check()
                        rec["layer_us_graph"] = _stats(g_us)
                        rec["graph_roundtrip_equal"] = bool(
                            torch.equal(holder["back"].view(torch.int16), send.view(torch.int16)))
                        del _g
                    except Exception:
                        gerr = traceback.format_exc()[-1500:]
                        rec["graph_error"] = gerr
                    if not agree(gerr):
                        rows.append(rec)
                        break
                rows.append(rec)
        finally:
            try:
                t.close()
            except Exception:
                pass

    keys = list(shapes)
    for tname, spec in variants:
        run_transport(tname, spec, keys)
    # num_sms sweep for nvlink bandwidth at the largest shape
    big = [k for k in keys if k[1] == max(tokens) and k[2] == "rank"] or [
        max(keys, key=lambda k: shapes[k][1].numel())]
    for sms in sms_sweep:
        for sig in ("coupled", "decoupled"):
            run_transport("nvlink", f"signalling={sig},num_sms={sms}", big, use_graphs=False)
    return rows


def summarize(rows: list[dict]) -> list[str]:
    lines = [f"{'transport':12s} {'knobs':72s} {'model':14s} {'S':>6s} {'disp us':>9s} {'comb us':>9s} "
             f"{'pair us':>9s} {'graph':>8s} {'host':>7s} {'GB/s':>7s} ok"]
    for r in rows:
        if r.get("rank") != 0 or r.get("bench") != "onesided_ep":
            continue
        if "error" in r:
            lines.append(f"{r.get('transport', '?'):12s} {r.get('knobs', '')[:72]:72s} {r.get('model', '-'):14s} "
                         f"{r.get('tokens', 0):6d} ERROR {r['error'].strip().splitlines()[-1][:80]}")
            continue
        mod = r["model"] + ("/k" if r.get("layout") == "expert" else "")
        lines.append(f"{r['transport']:12s} {r['knobs'][:72]:72s} {mod:14s} {r['tokens']:6d} "
                     f"{r['dispatch_us']['median']:9.1f} {r['combine_us']['median']:9.1f} "
                     f"{r['layer_us']['median']:9.1f} {r.get('layer_us_graph', {}).get('median', float('nan')):8.1f} "
                     f"{r.get('host_issue_us', {}).get('median', float('nan')):7.1f} {r['GBps_dispatch']:7.1f} "
                     f"{r['roundtrip_equal']}{'' if r.get('graph_roundtrip_equal', True) else ' GRAPH-MISMATCH'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--transports", default="nvlink,proxy")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay timing of nvlink")
    ap.add_argument("--busy-us", type=float, default=0.0,
                    help="spin the GPU this long before each timed iteration (time GPU work, not host issue)")
    ap.add_argument("--variants", default="",
                    help="';'-separated transport:knobs (e.g. nvlink:signalling=decoupled,num_sms=64) instead of the "
                         "built-in variants and the num_sms sweep")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    want = set(args.transports.split(","))
    variants = [v for v in (*NVLINK_VARIANTS, *PROXY_VARIANTS) if v[0] in want]
    sms = list(SMS_SWEEP) if "nvlink" in want else []
    if args.variants:  # "transport:knobs" entries replace the built-in variants and the sms sweep
        variants = [tuple(v.split(":", 1)) for v in args.variants.split(";") if v]  # type: ignore[misc]
        bad = [v for v in variants if len(v) != 2 or v[0] not in ("nvlink", "proxy")]
        if bad:
            ap.error(f"--variants entries must be nvlink:KNOBS or proxy:KNOBS, got {bad}")
        sms = []
    if args.quick:
        variants = [v for i, v in enumerate(variants) if i % 2 == 0]
        sms = sms[::3]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from moetune.runtime.shapes import get_model
    from moetune.runtime.testing.selftest import knobs_for

    for tname, spec in variants:
        knobs_for(tname, spec)  # validate every knob set before touching a GPU
    for m in models:
        get_model(m)
    if args.dry_run:
        print(f"dry-run: {len(models)} models x {len(tokens)} token counts; variants: {len(variants)}; "
              f"sms sweep {sms}; out={out}")
        return 0
    import torch

    if torch.cuda.device_count() < args.world:
        print(f"onesided_ep: needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    from moetune.runtime.testing.selftest import spawn_world

    res = spawn_world(bench_worker, args.world, dict(models=models, tokens=tokens, iters=args.iters,
                                                     warmup=args.warmup, variants=variants, sms_sweep=sms,
                                                     graphs=not args.no_graphs, busy_us=args.busy_us),
                      timeout_s=args.timeout)
    rows: list[dict] = []
    rc = 0
    for r, part in enumerate(res):
        if isinstance(part, dict) and "error" in part:
            print(f"rank {r} failed:\n{part['error']}", file=sys.stderr)
            rows.append({"bench": "onesided_ep", "rank": r, "worker_error": part["error"][-3000:]})
            rc = 1
        else:
            rows.extend(part)
    with open(out / "onesided_ep.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print("\n".join(summarize(rows)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
