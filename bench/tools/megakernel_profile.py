"""Drive the megakernel for ncu: build the layer for S tokens, run `--calls` forwards (routing + persistent kernel).

A tool for profiles and timelines, not a benchmark: the whole layer's numbers are `moetune bench moe` / `bench
knobs` and the moe-* scenarios (rows in bench/results/summary.csv). On a GPU machine, from a copy of the tree after
`source bench/tools/device_env.sh`:

    ncu --clock-control none --kernel-name regex:'k_experts|k_logits|k_topk' --launch-skip 3 --launch-count 3 \
        python bench/tools/megakernel_profile.py --tokens 1
    python3 bench/tools/megakernel_profile.py --tokens 1024 --trace --calls 20     # per-kernel time, gaps
    python3 bench/tools/megakernel_profile.py --tokens 1 --calls 3 --timeline $OUT/timeline.jsonl

`--trace`: instead, replay one captured CUDA graph of the layer `--calls` times under torch.profiler and print
each kernel's mean device time and the mean gap between consecutive kernels of a replay, at the clocks a
benchmark runs at (ncu's replays run single kernels, often at idle clocks).

`--timeline FILE`: after the calls, one more forward with the persistent kernel stamping every task
(`MegakernelMoE.task_timeline`): prints where the launch's time goes per task kind and appends the raw
timeline as one JSON line to FILE.

`--feed`: no layer; how fast bulk copies (cp.async.bulk, the TMA engine, completing on mbarriers like the expert
kernel's weight tiles) fill shared memory, one CTA per SM keeping `stages` copies of `chunk` bytes in flight and
discarding them, from a span that stays in L2 (24 MB) and from one that does not (1 GB). Prints GB/s over all SMs
and per SM: the delivery rate a stage pipeline of that depth can reach on this GPU (needs CuPy for the kernel).

`--route-splits S,..`: routing time against the cap on the gate GEMM's H splits (run 46).

`--vs-lib NAME=PATH,..`: the layer's graph replay side by side in this process with the same layer launched from other
builds of the library (e.g. an older commit's, or `-DMK_DEC_PROBE=16`, whose decode kernel returns at entry: the
cost of replaying that launch shape with no work), inputs rotated over 8 tensors, the builds interleaved in rounds;
each build also as one graph of 20 forwards (µs per forward), and a graph of one 1-element torch kernel; then the
single replays and the 20-forward chains each interleaved round by round (a chain shows what a build leaves the
next replay of itself, e.g. dirty L2 lines to write back, which interleaved single replays hand to another build).

`--vs-config` compares MegakernelConfig strings (settings that are not knobs too, e.g. `l2_evict_weights`); knob sets
have the named scenario `moe-megakernel-knobs` and `moetune bench knobs --vs ...` (tuner/measure/moe_compare.py).

`--bench-inputs`: the layer exactly as `moetune bench moe` builds it (seed 0) on the same rotated inputs, each input's
graph replay timed on its own (interleaved, back to back), with its touched experts, the largest expert's rows and a
plain read of that many experts' weights; then each input's task timeline (appended to `--timeline` if given).
Why the benchmark's samples at one S spread (S=16: p10 ~186, median ~210 µs in runs 83-93).

`--sustained SECONDS`: the layer replayed back to back from one CUDA graph for SECONDS, once with this library and
once with each `--vs-lib` build (3 s idle before each), nvidia-smi sampling the SM clock, the power and the software
power cap every 50 ms beside it; per build the second half's mean replay time, clock, power and capped share. Where
a size is bound by the power limit (S=4096 on an H200, run 132), what a build spends on the tensor work and on moving
tiles: `-DMK_PROBE=1` (the wgmma tiles load nothing) and `-DMK_PROBE=2` (they issue no wgmma) split it.

`--feed-tiles`: the wide tile's stage as the expert kernel loads it, without the wgmmas: per stage 32 KB of weights
(either four 64-row x 64-column boxes of a [rows, 2048] bf16 matrix by the tensor-map TMA, 4 KB between rows, or one
contiguous 32 KB bulk copy: a pre-tiled layout) and 16 KB of gathered rows (128 rows x 128 bytes of a 16 MB
activation matrix, cp.async by 128 threads, completing on the same mbarrier). A task is 32 stages (K = 2048) of one
256-row weight tile; `reuse` tasks in a row share a tile (the m-tiles of one expert at S = 4096 read each weight tile
2-3 times), the weights span 768 MB (all of W_gate_up) or 24 MB (L2-resident).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--config", default="")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--back-to-back", action="store_true",
                    help="--trace: replay without a sync between replays (as a benchmark loop does)")
    ap.add_argument("--eager", action="store_true", help="--trace: eager forwards instead of graph replays")
    ap.add_argument("--timeline", default="", help="append the task timeline (JSON line) to this file")
    ap.add_argument("--isolation", action="store_true",
                    help="graph replays back to back vs each behind a sleep kernel (does a layer cost more "
                         "right after another?)")
    ap.add_argument("--vs-lib", default="",
                    help="NAME=PATH,..: graph replays side by side with the layer launched from these library builds")
    ap.add_argument("--vs-config", default="",
                    help="NAME=CONFIG;..: the same, with layers of these configs (same weights) instead of builds")
    ap.add_argument("--sustained", type=float, default=0.0,
                    help="SECONDS of back-to-back graph replays per build (this, then each --vs-lib build) with "
                         "nvidia-smi's clock and power beside them")
    ap.add_argument("--feed", action="store_true", help="bulk-copy delivery rate into shared memory (no layer)")
    ap.add_argument("--feed-tiles", action="store_true", help="the wide tile's stage loads without compute (no layer)")
    ap.add_argument("--bench-inputs", action="store_true",
                    help="per-input times and timelines on `moetune bench moe`'s inputs at --tokens")
    ap.add_argument("--route-splits", default="",
                    help="S list: routing time against the cap on the gate GEMM's H splits (16 8 4 2 1 16)")
    a = ap.parse_args()
    items = a.vs_lib.split(",") if a.vs_lib else []
    libs = dict(v.split("=", 1) for v in items if "=" in v)
    if len(libs) != len(items) or "this" in libs:
        ap.error(f"--vs-lib takes NAME=PATH,.. (names other than 'this'), got {a.vs_lib!r}")
    items = a.vs_config.split(";") if a.vs_config else []
    configs = dict(v.split("=", 1) for v in items if "=" in v)
    if len(configs) != len(items) or "this" in configs:
        ap.error(f"--vs-config takes NAME=CONFIG;.. (names other than 'this'), got {a.vs_config!r}")
    if a.route_splits:
        route_splits([int(v) for v in a.route_splits.split(",")])
        return
    if a.feed:
        feed()
    if a.feed_tiles:
        feed_tiles()
    if a.feed or a.feed_tiles:
        return
    if a.bench_inputs:
        bench_inputs(a.tokens, a.timeline)
        return
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.shapes import get_model

    mk = MegakernelMoE(get_model("qwen3-30b"), max_tokens=a.tokens, config=MegakernelConfig.parse(a.config))
    x = torch.randn(a.tokens, mk.model.hidden, device="cuda").to(torch.bfloat16)
    for _ in range(a.calls):
        mk.forward(x)
    torch.cuda.synchronize()
    mk.check()
    if a.trace:
        trace(mk, x, a.calls, a.tokens, a.config, sync_each=not a.back_to_back, eager=a.eager)
    if a.isolation:
        isolation(mk, x)
    if a.sustained > 0:
        sustained(mk, x, libs, a.sustained)
    elif a.vs_lib:
        vs_libs(mk, a.tokens, libs)
    if a.vs_config:
        vs_configs(mk, a.tokens, configs)
    if a.timeline and mk.decode_grid(a.tokens) is not None:
        tl = mk.decode_timeline(x)
        summarize_decode(tl)
        with open(a.timeline, "a") as f:
            f.write(json.dumps(tl) + "\n")
    elif a.timeline:
        tl = mk.task_timeline(x)
        summarize(tl)
        with open(a.timeline, "a") as f:
            f.write(json.dumps(tl) + "\n")


def bench_inputs(tokens: int, timeline: str, rotate: int = 4, rounds: int = 25) -> None:
    """Per-input graph replay medians on `moetune bench moe`'s inputs (tuner/measure/moe.py, seed 0), inputs
    interleaved call by call as the benchmark rotates them; touched experts and rows of the fullest expert per input;
    a plain read of each input's touched experts; then each input's task timeline."""
    from moetune.runtime import Knobs, MoELayer
    from moetune.runtime.shapes import get_model
    from moetune.runtime.testing.timing import graphs_of, time_calls
    from moetune.tuner.measure.moe import layer_inputs, time_plain_read

    model = get_model("qwen3-30b")
    layer = MoELayer(model, None, Knobs(engine="megakernel"), max_tokens=tokens, device=torch.device("cuda"),
                     dtype=torch.bfloat16, seed=0, engine="megakernel")
    mk = layer.megakernel
    xs = layer_inputs(model, tokens, rotate, torch.device("cuda"), torch.bfloat16, tokens)
    # time_calls rotates the inputs call by call, as the benchmark does: sample j is input j % rotate's
    flat = time_calls(graphs_of(layer.forward, xs), warmup=10, iters=rounds * 4 * len(xs), cuda=True)
    samples = [flat[i::len(xs)] for i in range(len(xs))]
    out = []
    for i, x in enumerate(xs):
        idx = layer.route(x)[0]
        counts = torch.bincount(idx.flatten(), minlength=model.experts)
        touched = int((counts > 0).sum())
        read = statistics.median(time_plain_read(layer.w_gate_up.data, layer.w_down.data, touched, warmup=5, iters=50,
                                                 graph=True, cuda=True))
        med = statistics.median(samples[i])
        out.append({"input": i, "touched": touched, "max_rows": int(counts.max()), "graph_us": med,
                    "p10": sorted(samples[i])[len(samples[i]) // 10], "plain_read_us": read})
        print(f"  S={tokens} input {i}: experts {touched:3d}, max rows {int(counts.max()):3d}, graph {med:7.1f} us "
              f"(p10 {out[-1]['p10']:.1f}), plain read of those experts {read:7.1f} us")
    print(json.dumps({"bench_inputs": {"tokens": tokens, "inputs": out}}))
    if mk.decode_grid(tokens) is not None:
        return
    for i, x in enumerate(xs):
        print(f"-- input {i}")
        tl = mk.task_timeline(x)
        summarize(tl)
        if timeline:
            with open(timeline, "a") as f:
                f.write(json.dumps({"input": i, **tl}) + "\n")


def isolation(mk, x: torch.Tensor, iters: int = 200) -> None:
    """The median graph replay between CUDA events back to back (as the benchmarks time it) against each replay
    queued behind a ~20 µs sleep kernel (the queue stays full, but no layer runs right before it). (Run 75's version
    also timed an empty CuPy kernel in a captured graph and two eager traced launches in a row; neither measured what
    it meant to, the launch floor and the gap between launches, and both were removed: 08b82fb has them.)"""
    from moetune.runtime.testing.timing import graphs_of

    g = graphs_of(mk.forward, [x])[0]

    def timed(before) -> float:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for _ in range(20):
            g()
        for a, b in ev:
            before()
            a.record()
            g()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)

    b2b = timed(lambda: None)
    slept = timed(lambda: torch.cuda._sleep(40_000))
    b2b2 = timed(lambda: None)
    print(f"isolation S={x.shape[0]}: graph replay back to back {b2b:.1f} / {b2b2:.1f} us, behind a sleep kernel "
          f"{slept:.1f} us")


def sustained(mk, x: torch.Tensor, libs: dict[str, str], seconds: float, block: int = 200) -> None:
    """Per build ("this", then `libs`): 3 s idle, then blocks of `block` back-to-back graph replays for `seconds`, with
    nvidia-smi sampling beside them; prints and emits (JSON) each build's second half: replay µs, SM MHz, W, capped."""
    import subprocess
    import threading
    import time

    from moetune.runtime.testing.timing import graphs_of

    query = "clocks.sm,power.draw.instant,clocks_event_reasons.sw_power_cap"
    try:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "50"],
                               stdout=subprocess.PIPE, text=True)
    except OSError as e:
        raise SystemExit(f"--sustained needs nvidia-smi: {e}") from None
    samples: list[tuple[float, float, float, bool]] = []  # (time, MHz, W, capped)

    def read() -> None:
        assert smi.stdout is not None
        for line in smi.stdout:
            f = [v.strip() for v in line.split(",")]
            try:
                samples.append((time.time(), float(f[0]), float(f[1]), f[2].lower().startswith("active")))
            except (ValueError, IndexError):
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    own, out = mk.lib, {}
    try:
        for name in ["this", *libs]:
            use_build(mk, libs, name, own)
            g = graphs_of(mk.forward, [x])[0]
            g()
            torch.cuda.synchronize()
            time.sleep(3.0)  # each build starts from the same idle state
            t0, blocks = time.time(), []
            while time.time() - t0 < seconds:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(block):
                    g()
                b.record()
                blocks.append((a, b))
                if len(blocks) > 1:
                    blocks[-2][1].synchronize()  # one block in flight ahead: the host keeps the queue full
            torch.cuda.synchronize()
            t1 = time.time()
            us = [a.elapsed_time(b) * 1e3 / block for a, b in blocks]
            half = us[len(us) // 2:]
            w = [v for v in samples if (t0 + t1) / 2 <= v[0] <= t1]
            out[name] = {"replay_us": round(statistics.mean(half), 1), "first_block_us": round(us[0], 1),
                         "sm_mhz": round(statistics.mean(v[1] for v in w)) if w else None,
                         "power_w": round(statistics.mean(v[2] for v in w)) if w else None,
                         "capped": f"{sum(v[3] for v in w)} of {len(w)}"}
            r = out[name]
            print(f"  S={x.shape[0]} {name:10s} sustained {seconds:g} s: second half {r['replay_us']} us a replay "
                  f"(first {block}: {r['first_block_us']}), {r['sm_mhz']} MHz, {r['power_w']} W, power cap active in "
                  f"{r['capped']} samples", flush=True)
    finally:
        mk.lib = own
        smi.terminate()
    print(json.dumps({"sustained": {"tokens": x.shape[0], "seconds": seconds, "libs": libs, "builds": out}}))


def paired_lines(res: dict[str, list[float]], base: str = "this") -> list[str]:
    """Per build of an interleaved run: its median and the median, p10 and p90 of its sample minus `base`'s sample of
    the same round (a build against itself comes out near 0 there, whatever the drift between rounds)."""
    out = []
    ref = res.get(base, [])
    for n, v in res.items():
        line = f"  {n:12s} median {statistics.median(v):8.1f} us"
        if n != base and ref:
            d = sorted(a - b for a, b in zip(v, ref, strict=True))
            line += (f", minus {base} per round: median {statistics.median(d):+6.1f} p10 {d[len(d) // 10]:+6.1f} "
                     f"p90 {d[9 * len(d) // 10]:+6.1f} us")
        out.append(line)
    return out


def use_build(mk, libs: dict[str, str], name: str, own) -> None:
    """Launch `mk` from build `name` of `libs` ("this" or any name not in it: its own library `own`)."""
    from pathlib import Path

    from moetune.runtime.megakernel import _lib

    mk.lib = _lib.open_library(Path(libs[name])) if name in libs else own


def vs_libs(mk, tokens: int, libs: dict[str, str], **kw: int) -> None:
    """The layer launched from its own library ("this") and from each build in `libs` side by side (`side_by_side`)."""
    own = mk.lib

    def capture(name: str, fn):
        use_build(mk, libs, name, own)
        try:
            return fn(mk.forward)  # captured with that build's kernels
        finally:
            mk.lib = own

    side_by_side(tokens, mk.model.hidden, ["this", *libs], capture, {"libs": libs}, **kw)


def vs_configs(mk, tokens: int, configs: dict[str, str], **kw: int) -> None:
    """The layer with its own config ("this") and with each config in `configs` (same weights) side by side."""
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE

    layers = {"this": mk}
    for name, text in configs.items():
        layers[name] = MegakernelMoE(mk.model, max_tokens=tokens, config=MegakernelConfig.parse(text),
                                     w_gate_up=mk.w1t, w_down=mk.w2t, gate=mk.gate, tiled=True)
    side_by_side(tokens, mk.model.hidden, list(layers), lambda name, fn: fn(layers[name].forward),
                 {"configs": configs}, **kw)
    for m in layers.values():
        m.check()


def side_by_side(tokens: int, hidden: int, names: list[str], capture, meta: dict, rounds: int = 3, iters: int = 200,
                 rotate: int = 8) -> None:
    """Median graph replay (CUDA events around each, back to back, inputs rotated) of each variant (`capture(name, f)`
    calls f with that variant's forward while the graphs are captured), of a graph of 20 forwards of each (µs per
    forward: layers with no host launch and no events between them), and of a graph holding one 1-element torch
    kernel (what the graph and the events cost by themselves), in `rounds` interleaved rounds; prints the medians; then
    the single replays interleaved one by one (time_interleaved) with each variant's per-round difference to "this".
    Round r times the single replays first, then the chains, each list rotated by r: a fixed order favoured whichever
    build ran first after the previous round's tiny kernel by ~5 µs at S=1024 (run 116: the same library timed twice,
    351.5-356.5 vs 357.0-363.7; the later builds ran right after a chain's sustained load)."""
    from moetune.runtime.testing.timing import graphs_of, interleave_order, time_calls, time_interleaved

    xs = [torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16) for _ in range(rotate)]
    chained = 20

    def chain_of(fwd):
        def chain(x: torch.Tensor) -> None:  # one graph of `chained` forwards: no host launch between layers
            for _ in range(chained):
                fwd(x)
        return chain

    graphs, per = {}, {}
    for name in names:
        graphs[name] = capture(name, lambda fwd: graphs_of(fwd, xs))
        graphs[f"{name}_x{chained}"] = capture(name, lambda fwd: graphs_of(chain_of(fwd), xs[:2]))
        per[f"{name}_x{chained}"] = chained
    one = torch.zeros(1, device="cuda")
    graphs["torch_1elem"] = graphs_of(lambda _: one.add_(1), [None])  # a graph of one tiny torch kernel
    res: dict[str, list[float]] = {n: [] for n in graphs}
    singles = [n for n in graphs if n not in per and n != "torch_1elem"]
    chains = [n for n in graphs if n in per]
    for r in range(rounds):
        for n in interleave_order(singles, r) + interleave_order(chains, r) + ["torch_1elem"]:
            res[n].append(statistics.median(time_calls(graphs[n], warmup=20, iters=iters, cuda=True)) / per.get(n, 1))
    # the single replays once more, interleaved replay by replay (one of each variant per round, order rotated), so the
    # drift between rounds cancels in each variant's difference to "this" (run 117: 10-15 µs between rounds at S=1024)
    paired = time_interleaved({n: graphs[n] for n in singles}, warmup=20, iters=iters * rounds, cuda=True)
    # and the chains the same way, one chain of each variant per round: a layer that changes what the NEXT replay
    # finds in the L2 (dirty lines it leaves to be written back, run 142) gains or loses within its own chain, while
    # single replays interleaved hand that effect to whichever variant runs next
    chain_paired = time_interleaved({n: graphs[n] for n in chains}, warmup=5, iters=iters, cuda=True)
    chain_paired = {n.removesuffix(f"_x{chained}"): [t / chained for t in v] for n, v in chain_paired.items()}
    print(json.dumps({"vs_lib": {"tokens": tokens, **meta, "rounds_us": res,
                                 "interleaved_us": {n: [round(t, 2) for t in v] for n, v in paired.items()},
                                 "interleaved_chain_us": {n: [round(t, 2) for t in v] for n, v in chain_paired.items()}}}))
    for n, v in res.items():
        print(f"  S={tokens} {n:10s} graph replay " + " / ".join(f"{t:.1f}" for t in v) + " us")
    print(f"  S={tokens} interleaved replay by replay ({iters * rounds} rounds):")
    for line in paired_lines(paired):
        print(line)
    print(f"  S={tokens} interleaved chains of {chained} forwards, µs per forward ({iters} rounds):")
    for line in paired_lines(chain_paired):
        print(line)


def summarize_decode(tl: dict) -> None:
    """Per decode-kernel phase stamp: min / median / max over the CTAs (µs from the first CTA's start)."""
    print(f"decode timeline S={tl['tokens']} grid={tl['grid']} rows/CTA={tl['rows']}")
    for name in tl["ctas"][0]:
        v = sorted(c[name] for c in tl["ctas"] if c[name] is not None)
        if v:
            print(f"  {name:10s} n={len(v):4d} min {v[0]:7.2f} p50 {v[len(v) // 2]:7.2f} max {v[-1]:7.2f} us")


def phase_times(mk, xs: list[torch.Tensor], warmup: int, iters: int) -> dict[str, float]:
    """Median µs of the routing launches and of the persistent launch, each between its own events (eager). A decode
    launch (`decode_grid`) routes inside its one kernel: routing reads ~0 and the second figure is the whole layer.
    Each call's launch fields are set as a forward sets them (`MegakernelMoE._launch_params`, its token bucket's
    config included), and a launch the library refuses raises with the library's error text."""
    import ctypes

    from moetune.runtime.megakernel import _lib

    s = xs[0].shape[0]
    out = torch.empty_like(xs[0])
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    with torch.cuda.device(mk.device):  # the library launches on the current device (as a forward does)
        stream = torch.cuda.current_stream(mk.device).cuda_stream
        for j in range(warmup + iters):
            p = mk._launch_params(xs[j % len(xs)], s, out, given=False)  # x: fresh randn tensors, aligned
            ref = ctypes.byref(p)
            e = ev[j - warmup] if j >= warmup else None
            if e:
                e[0].record()
            if not p.decode:
                _lib.check(mk.lib, mk.lib.mk_route(ref, stream), "mk_route")
            if e:
                e[1].record()
            _lib.check(mk.lib, mk.lib.mk_experts(ref, stream), "mk_experts")
            if e:
                e[2].record()
    torch.cuda.synchronize(mk.device)
    return {"mk_route_us": statistics.median(e[0].elapsed_time(e[1]) * 1e3 for e in ev),
            "mk_experts_us": statistics.median(e[1].elapsed_time(e[2]) * 1e3 for e in ev)}


def route_splits(tokens: list[int]) -> None:
    """Routing (mk_route: k_logits + k_topk) between CUDA events, each call followed by the experts kernel, median of
    60 after 20 (`phase_times`), against the cap on the gate GEMM's H splits (`MegakernelMoE.logit_splits`), 16 first
    and last."""
    from moetune.runtime.megakernel import MegakernelMoE
    from moetune.runtime.shapes import get_model

    m = MegakernelMoE(get_model("qwen3-30b"), max_tokens=max(tokens))
    for s in tokens:
        x = torch.randn(s, m.model.hidden, device="cuda").to(torch.bfloat16)
        res: dict[int, list[float]] = {}
        for cap in (16, 8, 4, 2, 1, 16):
            m.logit_splits = cap
            m._params.clear()  # the launch templates carry the cap
            res.setdefault(cap, []).append(phase_times(m, [x], 20, 60)["mk_route_us"])
            m.check()
        print(f"S={s} routing us by split cap: "
              + ", ".join(f"{c}: {' / '.join(f'{v:.1f}' for v in r)}" for c, r in res.items()))


def summarize(tl: dict) -> None:
    """Where the persistent launch's time goes: per task kind, when tasks were published, claimed and done."""
    tasks = [t for t in tl["tasks"] if t["done"] is not None]
    ends = [c[1] for c in tl["ctas"] if c[1] is not None]
    span = max(ends) if ends else 0.0
    busy = sum(t["done"] - t["claimed"] for t in tasks)
    sch = tl["sched"]
    print(f"timeline S={tl['tokens']} bm={tl['bm']} grid={tl['grid']} span {span:.1f} us, CTA busy "
          f"{100 * busy / max(1e-9, span * (tl['grid'] - 1)):.0f}%, scheduler start {sch['start']} "
          f"gemm1 published {sch['gemm1_published']} end {sch['end']}")
    for kind in ("gemm1", "gemm2", "combine"):
        ts = [t for t in tasks if t["kind"] == kind]
        if not ts:
            continue
        dur = sorted(t["done"] - t["claimed"] for t in ts)
        wait = sorted(t["claimed"] - t["published"] for t in ts if t["published"] is not None)
        print(f"  {kind:8s} n={len(ts):5d} published {min(t['published'] for t in ts):8.1f}.."
              f"{max(t['published'] for t in ts):8.1f}  claimed {min(t['claimed'] for t in ts):8.1f}.."
              f"{max(t['claimed'] for t in ts):8.1f}  done ..{max(t['done'] for t in ts):8.1f}  task us "
              f"p50 {dur[len(dur) // 2]:7.2f} p90 {dur[9 * len(dur) // 10]:7.2f}  publish->claim p50 "
              f"{wait[len(wait) // 2] if wait else 0:6.2f}")
    # per CTA, done to done of consecutive tasks (the overlap kernel claims ahead, so claim-to-done overstates a task);
    # and the epilogue + signal: mainloop done -> done
    per_slot = steady_of(tasks)
    steady: dict[str, list[float]] = {}
    loops: dict[str, list[float]] = {}  # previous done -> mainloop done: the k loop of a task
    for t in tasks:
        if t["slot"] not in per_slot:
            continue
        steady.setdefault(t["kind"], []).append(per_slot[t["slot"]])
        if t.get("mainloop_done"):  # the consumers start a task when they finish the one before on this CTA
            loops.setdefault(t["kind"], []).append(t["mainloop_done"] - (t["done"] - per_slot[t["slot"]]))
    for kind, v in sorted(steady.items()):
        v.sort()
        line = f"  {kind:8s} done-to-done p50 {v[len(v) // 2]:7.2f} us"
        if kind in loops:
            lp = sorted(loops[kind])
            line += f", previous done -> mainloop done p50 {lp[len(lp) // 2]:6.2f} us"
        for stamp, label in (("mainloop_done", "mainloop done"), ("stores_issued", "stores issued")):
            d = sorted(t["done"] - t[stamp] for t in tasks if t["kind"] == kind and t.get(stamp))
            if d:
                line += f", {label} -> done p50 {d[len(d) // 2]:6.2f} us"
        print(line)
    for line in fill_lines(tl, per_slot):
        print(line)
    # GEMM2 release latency: last GEMM1 done of the m-tile -> its GEMM2 published
    last_g1: dict[int, float] = {}
    for t in tasks:
        if t["kind"] == "gemm1":
            last_g1[t["tile"]] = max(last_g1.get(t["tile"], 0.0), t["done"])
    rel = sorted(t["published"] - last_g1[t["tile"]] for t in tasks if t["kind"] == "gemm2" and t["tile"] in last_g1)
    if rel:
        print(f"  gemm1 done -> gemm2 published: p50 {rel[len(rel) // 2]:.2f} us, max {rel[-1]:.2f} us")
    tail = combine_tail(tasks)
    if tail:
        print(tail)


def combine_tail(tasks: list[dict]) -> str:
    """The end of the layer after its last GEMM2: when the COMBINEs were published and done, relative to it (runs 128
    and 140: is the tail the subscriber's publishing or the combines' own work?). '' without GEMM2s or COMBINEs."""
    g2 = [t["done"] for t in tasks if t["kind"] == "gemm2" and t["done"] is not None]
    cb = [t for t in tasks if t["kind"] == "combine" and t["done"] is not None and t["published"] is not None]
    if not g2 or not cb:
        return ""
    last = max(g2)
    after = sum(t["published"] > last for t in cb)
    return (f"  combine tail: last gemm2 done {last:.1f} us; combines published until "
            f"{max(t['published'] for t in cb) - last:+.1f}, done until {max(t['done'] for t in cb) - last:+.1f} us "
            f"after it ({after} of {len(cb)} published after it)")


def steady_of(tasks: list[dict]) -> dict[int, float]:
    """Per queue slot, the time from the previous task's done on the same CTA to this one's (the first task of a CTA
    has none): what a task cost its CTA, since the overlap kernel claims the next task before this one ends."""
    by_cta: dict[int, list[dict]] = {}
    for t in tasks:
        by_cta.setdefault(t["cta"], []).append(t)
    out: dict[int, float] = {}
    for ts in by_cta.values():
        ts.sort(key=lambda t: t["done"])
        for a, b in itertools.pairwise(ts):
            out[b["slot"]] = b["done"] - a["done"]
    return out


FILL_BUCKETS = ((1, 16), (17, 64), (65, 127))  # routed rows of an m-tile short of bm; the rest: full


def fill_lines(tl: dict, steady: dict[int, float]) -> list[str]:
    """What GEMM tasks cost by how full their m-tile is (`rows`, from task_timeline): per kind and bucket the tasks,
    their done-to-done p50 and their summed time per processor CTA, so a few rows that stream a whole weight tile show
    (run 117: S=4096's third m-tiles of ~13 rows took 98 us of each CTA's 702)."""
    procs = max(1, tl["grid"] - 1)
    out = []
    for kind in ("gemm1", "gemm2"):
        ts = [t for t in tl["tasks"] if t["kind"] == kind and t.get("rows") is not None and t["slot"] in steady]
        if not ts:
            continue
        total = sum(steady[t["slot"]] for t in ts)
        cells = []
        bm = tl["bm"]
        for lo, hi in [(lo, min(hi, bm - 1)) for lo, hi in FILL_BUCKETS if lo < bm] + [(bm, bm)]:
            d = sorted(steady[t["slot"]] for t in ts if lo <= t["rows"] <= hi)
            if d:
                name = "full" if lo == bm else f"{lo}-{hi} rows"
                cells.append(f"{name}: {len(d)} p50 {d[len(d) // 2]:.1f} us, {sum(d) / procs:.1f} us/CTA "
                             f"({100 * sum(d) / total:.0f}%)")
        out.append(f"  {kind:8s} by m-tile rows: " + "; ".join(cells))
    return out


def kname(full: str) -> str:
    """`k_experts_ov<...>` from a demangled signature (`void (anonymous namespace)::k_experts_ov<...>(...)`)."""
    m = re.search(r"(k_\w+)(<[^(]*>)?", full)
    return m.group(1) + ("<" + m.group(2)[1:40] + ">" if m.group(2) else "") if m else full[:40]


def trace(mk, x: torch.Tensor, calls: int, tokens: int, config: str, sync_each: bool = True,
          eager: bool = False) -> None:
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    if eager:
        def call() -> None:
            mk.forward(x)
    else:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mk.forward(x)
        call = g.replay
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
            if sync_each:
                torch.cuda.synchronize()  # one replay at a time: gaps inside a replay only
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=8))
    kern = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    dur: dict[str, list[float]] = defaultdict(list)
    gaps: dict[str, list[float]] = defaultdict(list)
    prev = None
    for e in kern:
        name = kname(e.name)
        dur[name].append(e.time_range.end - e.time_range.start)
        if prev is not None and 0 <= e.time_range.start - prev.time_range.end < (50 if sync_each else 5000):
            gaps[f"{kname(prev.name)} -> {name}"].append(e.time_range.start - prev.time_range.end)
        prev = e
    print(f"trace S={tokens} config={config or 'default'} replays={calls} "
          f"{'one at a time' if sync_each else 'back to back'}{', eager' if eager else ''}")
    for n, v in dur.items():
        print(f"  kernel {n:28s} n={len(v):4d} mean {sum(v) / len(v):8.2f} us")
    for n, v in gaps.items():
        print(f"  gap    {n:40s} n={len(v):4d} mean {sum(v) / len(v):6.2f} us")


_WAIT_SRC = r"""
// Spin until the mbarrier at shared address `bar` completed the phase of parity `ph` (both probes' stage wait).
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned ph) {
  unsigned ok = 0;
  while (!ok)
    asm volatile("{\n.reg .pred q;\nmbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\nselp.u32 %0, 1, 0, q;\n}"
                 : "=r"(ok) : "r"(bar), "r"(ph) : "memory");
}
"""

_FEED_SRC = _WAIT_SRC + r"""
// One copy of `chunk` bytes into stage s, completing on its mbarrier (which expects them).
__device__ __forceinline__ void issue(unsigned sbase, unsigned bbase, int s, int chunk, const char* from) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bbase + 8 * s), "r"(chunk) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(sbase + s * chunk), "l"(from), "r"(chunk), "r"(bbase + 8 * s) : "memory");
}

extern "C" __global__ void feed(const char* src, unsigned long long span, int iters, int stages, int chunk,
                                unsigned long long* sink) {
  extern __shared__ __align__(1024) unsigned char sm[];
  __shared__ __align__(8) unsigned long long bar[16];
  const unsigned sbase = (unsigned)__cvta_generic_to_shared(sm), bbase = (unsigned)__cvta_generic_to_shared(bar);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bbase + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const unsigned long long slots = span / chunk;
  unsigned long long k = blockIdx.x;  // copy k reads chunk (k mod slots): the grid sweeps the span together
  for (int s = 0; s < stages; ++s, k += gridDim.x) issue(sbase, bbase, s, chunk, src + (k % slots) * chunk);
  for (int i = 0; i < iters + stages; ++i) {
    const int s = i % stages;
    const unsigned ph = (unsigned)(i / stages) & 1u;
    wait_parity(bbase + 8 * s, ph);
    if (i < iters) {
      issue(sbase, bbase, s, chunk, src + (k % slots) * chunk);
      k += gridDim.x;
    }
  }
  sink[blockIdx.x] = k;
}
"""


def _cupy(flag: str):
    """CuPy, the SM count and a per-CTA sink for the probes' kernels (one CTA per SM)."""
    try:
        import cupy as cp
    except ImportError:
        raise SystemExit(f"{flag} needs CuPy (the device image has it)") from None
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    return cp, sms, cp.zeros(sms, dtype=cp.uint64)


def _launch_s(cp, kern, threads: int, args: tuple, smem: int, sms: int) -> float:
    """Median seconds of 5 launches of `kern` on one CTA per SM, after one warm-up launch."""
    import statistics

    kern((sms,), (threads,), args, shared_mem=smem)  # warm-up (and L2 fill for the small spans)
    times = []
    for _ in range(5):
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        t0.record()
        kern((sms,), (threads,), args, shared_mem=smem)
        t1.record()
        t1.synchronize()
        times.append(cp.cuda.get_elapsed_time(t0, t1) * 1e-3)
    return statistics.median(times)


def feed() -> None:
    """Bulk-copy delivery into shared memory (see the module doc); one process, median of 5 launches each."""
    cp, sms, sink = _cupy("--feed")
    kern = cp.RawKernel(_FEED_SRC, "feed")
    big = cp.zeros(1 << 30, dtype=cp.uint8)
    for span_mb, stages, chunk in ((24, 4, 48 << 10), (24, 3, 48 << 10), (24, 8, 24 << 10), (24, 12, 16 << 10),
                                   (1024, 4, 48 << 10), (1024, 12, 16 << 10)):
        span = span_mb << 20
        kern.max_dynamic_shared_size_bytes = stages * chunk
        iters = 400
        args = (big, cp.uint64(span), cp.int32(iters), cp.int32(stages), cp.int32(chunk), sink)
        sec = _launch_s(cp, kern, 32, args, stages * chunk, sms)
        total = sms * (iters + stages) * chunk
        print(f"feed span {span_mb:5d} MB  stages {stages:2d} x {chunk >> 10:2d} KB  {total / sec / 1e9:7.0f} GB/s  "
              f"{total / sec / sms / 1e9:5.1f} GB/s per SM  ({sec * 1e6:.0f} us)")


_TILES_SRC = _WAIT_SRC + r"""
// One CTA of 128 threads per SM keeps `stages` stages in flight. Stage = B (bmode 1: four 64 x 64 TMA boxes,
// 2: one contiguous 32 KB bulk copy, 0: none) + A, 128 rows x 128 bytes (amode 1: gathered rows by cp.async,
// 16 bytes a thread, 8 per thread; 2: gathered rows by TMA, one 1-row box per thread; 3: 16 KB contiguous bulk).
// The gathered rows of a task are drawn once per task (a hash of task and row), as the kernel computes its row
// pointers once per task.
struct Rows {
  int r[8];
};
__device__ __forceinline__ Rows task_rows(long long task, int xrows) {
  Rows w;
  for (int q = 0; q < 8; ++q) {
    const unsigned r = (threadIdx.x >> 3) + 16 * q;
    w.r[q] = (int)(((unsigned)(task * 131 + r) * 2654435761u) >> 8) & (xrows - 1);
  }
  return w;
}
__device__ __forceinline__ void stage(unsigned sb, unsigned bar, const void* tmap, const void* xmap,
                                      const char* wflat, const char* x, int bmode, int amode, long long task,
                                      int kt, int tiles, int reuse, int xrows, const Rows& rows) {
  const int t = threadIdx.x;
  const long long tile = (task / reuse) % tiles;
  const unsigned tx = (bmode ? 32768u : 0u) + (amode >= 2 ? 16384u : 0u);
  if (t == 0 && tx)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(tx) : "memory");
  if (t == 0 && bmode) {
    if (bmode == 1) {
      for (int b = 0; b < 4; ++b)
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                     ::"r"(sb + 16384 + b * 8192), "l"(tmap), "r"(kt * 64), "r"((int)(tile * 256 + 64 * b)), "r"(bar)
                     : "memory");
    } else {
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(sb + 16384), "l"(wflat + (tile * 32 + kt) * 32768), "r"(32768), "r"(bar) : "memory");
    }
  }
  if (amode == 1) {
    const int ch = t & 7, r0 = t >> 3;
    for (int q = 0; q < 8; ++q) {
      const int r = r0 + 16 * q;
      const char* src = x + (long long)rows.r[q] * 4096 + kt * 128 + ch * 16;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sb + r * 128 + ((ch ^ (r & 7)) << 4)), "l"(src)
                   : "memory");
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
  } else if (amode == 2) {  // thread t: tile row t, x row drawn for it (rows.r[0] is row t >> 3: use a hash of t)
    const int xr = (int)(((unsigned)(task * 131 + t) * 2654435761u) >> 8) & (xrows - 1);
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(sb + t * 128), "l"(xmap), "r"(kt * 64), "r"(xr), "r"(bar) : "memory");
  } else if (amode == 3 && t == 0) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sb), "l"(x + ((task * 32 + kt) * 16384) % ((long long)xrows * 4096)), "r"(16384), "r"(bar)
                 : "memory");
  }
}

extern "C" __global__ void feed_tiles(const void* tmap, const void* xmap, const char* wflat, const char* x,
                                      int bmode, int amode, int tiles, int reuse, int xrows, int iters, int stages,
                                      unsigned long long* sink) {
  extern __shared__ __align__(1024) unsigned char sm[];
  __shared__ __align__(8) unsigned long long bar[8];
  const unsigned sbase = ((unsigned)__cvta_generic_to_shared(sm) + 1023u) & ~1023u;
  const unsigned bbase = (unsigned)__cvta_generic_to_shared(bar);
  if (threadIdx.x == 0) {
    const int count = (bmode || amode >= 2 ? 1 : 0) + (amode == 1 ? 128 : 0);
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bbase + 8 * s), "r"(count));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  long long task = blockIdx.x;
  int kt = 0;
  Rows rows = task_rows(task, xrows);
  for (int s = 0; s < stages; ++s) {
    stage(sbase + s * 49152, bbase + 8 * s, tmap, xmap, wflat, x, bmode, amode, task, kt, tiles, reuse, xrows, rows);
    if (++kt == 32) { kt = 0; task += gridDim.x; rows = task_rows(task, xrows); }
  }
  for (int i = 0; i < iters + stages; ++i) {
    const int s = i % stages;
    const unsigned ph = (unsigned)(i / stages) & 1u;
    wait_parity(bbase + 8 * s, ph);
    __syncthreads();  // every thread saw the phase before the slot is refilled
    if (i < iters) {
      stage(sbase + s * 49152, bbase + 8 * s, tmap, xmap, wflat, x, bmode, amode, task, kt, tiles, reuse, xrows, rows);
      if (++kt == 32) { kt = 0; task += gridDim.x; rows = task_rows(task, xrows); }
    }
  }
  if (threadIdx.x == 0) sink[blockIdx.x] = task;
}
"""


def _tensor_map(cp, ptr: int, rows: int, cols: int, box_rows: int = 64):
    """A bf16 [rows, cols] tensor map with box_rows x 64 boxes and the 128-byte swizzle (the kernel's B map)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    tm = (ctypes.c_uint8 * 128)()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims, strides = (u64 * 2)(cols, rows), (u64 * 1)(cols * 2)
    box, estr = (u32 * 2)(64, box_rows), (u32 * 2)(1, 1)
    # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9, INTERLEAVE_NONE = 0, SWIZZLE_128B = 3, L2_PROMOTION_L2_256B = 3, OOB none
    r = cuda.cuTensorMapEncodeTiled(tm, 9, 2, ctypes.c_void_p(ptr), dims, strides, box, estr, 0, 3, 3, 0)
    if r != 0:
        raise SystemExit(f"cuTensorMapEncodeTiled failed ({r})")
    dev = cp.empty(128, dtype=cp.uint8)
    dev.set(__import__("numpy").frombuffer(bytes(tm), dtype="uint8"))
    return dev


def feed_tiles() -> None:
    """The wide tile's stage loads without compute (see the module doc); median of 5 launches each."""
    cp, sms, sink = _cupy("--feed-tiles")
    kern = cp.RawKernel(_TILES_SRC, "feed_tiles")
    w = cp.zeros(768 << 20, dtype=cp.uint8)  # 196608 rows x 4 KB: W_gate_up of 128 experts
    x = cp.ones(16 << 20, dtype=cp.uint8)  # 4096 rows x 4 KB
    tmap = _tensor_map(cp, w.data.ptr, (768 << 20) // 4096, 2048)
    xmap = _tensor_map(cp, x.data.ptr, 4096, 2048, box_rows=1)
    stages, iters = 4, 32 * 12
    kern.max_dynamic_shared_size_bytes = stages * 49152 + 1024
    amodes = ("none", "gather cp.async", "gather tma rows", "bulk 16 KB")
    for span_mb in (768, 24):
        tiles = (span_mb << 20) // (256 * 4096)
        for reuse in (1, 3):
            for bmode, amode in ((1, 0), (2, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (2, 1), (2, 2)):
                ints = (bmode, amode, tiles, reuse, 4096, iters, stages)
                args = (tmap, xmap, w, x, *(cp.int32(v) for v in ints), sink)
                sec = _launch_s(cp, kern, 128, args, stages * 49152 + 1024, sms)
                per = (32768 if bmode else 0) + (16384 if amode else 0)
                total = sms * (iters + stages) * per
                b = ("none", "tma 4 boxes", "bulk 32 KB")[bmode]
                print(
                    f"feed-tiles W {span_mb:4d} MB reuse {reuse}  B {b:11s} A {amodes[amode]:15s} "
                    f"{total / sec / 1e9:6.0f} GB/s {total / sec / sms / 1e9:5.1f} GB/s per SM "
                    f"{sec / (iters + stages) * 1e6:5.2f} us per stage"
                )

if __name__ == "__main__":
    main()
