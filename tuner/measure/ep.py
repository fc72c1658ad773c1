"""`moetune bench ep`: time EP dispatch/combine and the whole MoE layer on this node.

Each rank gets S tokens (random activations, routing from `--routing`, deterministic seeds). The timed
iterations rotate over `rotate` input sets (default DEFAULT_ROTATE; activations and routing, each set
seeded from the case's seed, set 0 the one a single-input run used), as the megakernel bench does, so the
timings average over several routings' imbalance instead of one. Nothing is flushed from the L2 between
iterations: the sets together are small beside it (4 x 128 tokens x 2048 bf16 = 2 MB against an H100's 50 MB),
so at decode sizes every set's rows are read warm from the L2, as a serving engine's would be. Per iteration,
every rank times
  dispatch   : EPBuffer.dispatch (packed layout: counts + pack + payload transfer; dense: all-gather; + unpack)
  combine    : EPBuffer.combine of one row per received row
  roundtrip  : dispatch → identity experts (rows × their local weights) → combine as one span; with
               pipeline_depth > 1 it runs pipelined (chunk i's combine travels while later chunks dispatch)
  layer      : MoELayer.forward_routed (dispatch → SwiGLU experts → combine; the gate is skipped because
               the benchmark injects the routing)
On GPUs with CUDA events (then synchronise); on CPU with perf_counter after a barrier. The step time of an
iteration is the slowest rank's; the report gives median, p10 and p90 over iterations (after warm-up: at least one
iteration per input set, `moe.warmup_for`; a lower warm-up is raised, said in the report's `warmup_note`).

`impl="plain"` times the NCCL baseline (bench/results/2026-11-30_h200x2_nccl_baseline.jsonl) instead: plain
`all_to_all_single` without the once-per-rank packing: every (token, expert) pair is one row (k copies of a
token), sorted by expert, counts exchanged first; combine sends the k rows back and the source sums them with
their weights.

Used by the CLI (spawned ranks or torchrun), the bench worker (tuner/measure/worker.py) and the scenario driver
`ep` (tuner/measure/scenarios/drivers/ep.py: many cases in one spawned world).
"""

from __future__ import annotations

import datetime
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from moetune.runtime import EPBuffer, Knobs, MoELayer, dense_reference, get_model
from moetune.runtime.buffer.facade import TORCH_DTYPES
from moetune.runtime.fp8 import FP8_LAYER_REL_ERR_BOUND
from moetune.runtime.knobs import KnobError, default_knobs
from moetune.runtime.moe_layer import max_rel_err
from moetune.runtime.pipeline import pipelined_moe, weighted_rows
from moetune.runtime.routing import generate_routing
from moetune.runtime.testing.launch import init_dist
from moetune.tuner.measure.moe import warmup_for
from moetune.tuner.measure.stats import Summary

VERIFY_BOUNDS = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}


def verify_bound(dtype: str, compression: str) -> float:
    return VERIFY_BOUNDS[dtype] + (FP8_LAYER_REL_ERR_BOUND if compression != "none" else 0.0)


def worst_err(err: float) -> float:
    """A relative error as a maximum keeps it: NaN (a non-finite output, a row left poisoned) as +inf. Python's
    max() and a MAX all-reduce may drop a NaN, and the round trip reported 0.0 for an output of NaN."""
    return math.inf if math.isnan(err) else err


def timing(values: list[float]) -> dict[str, float]:
    """One timing of the report: {"median", "p10", "p90"} of `values` (NaN when nothing was timed)."""
    if not values:
        return {"median": float("nan"), "p10": float("nan"), "p90": float("nan")}
    return Summary.of(values).quantiles()


class _Timer:
    """Times spans on the device timeline (CUDA events) or the host clock (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def us(self, a: Any, b: Any) -> float:
        if self.cuda:
            return a.elapsed_time(b) * 1e3
        return (b - a) * 1e6

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized() and dist.get_world_size() > 1:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()


class PlainA2A:
    """The unpacked baseline: one row per (token, expert), plain all_to_all_single, sorted by expert."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype):
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.model, self.device, self.dtype = model, device, dtype
        self.epr = model.experts // self.world

    def _a2a(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        out = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype, device=send.device)
        if self.world == 1:
            out.copy_(send)
        else:
            dist.all_to_all_single(out, send, recv_splits, send_splits)
        return out

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = torch.div(order, k, rounding_mode="floor")
        per_expert = torch.bincount(flat, minlength=self.model.experts).view(self.world, self.epr)
        recv_counts = torch.empty_like(per_expert)
        if self.world > 1:
            dist.all_to_all_single(recv_counts, per_expert)
        else:
            recv_counts.copy_(per_expert)
        host = torch.cat([per_expert.sum(1), recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = host[: self.world], host[self.world :]
        recv = self._a2a(x.index_select(0, tok), send_splits, recv_splits)
        return recv, (order, w, send_splits, recv_splits, x.shape[0])

    def combine(self, rows: torch.Tensor, handle) -> torch.Tensor:
        """Rows back, put into (token, slot) order with one scatter, then a batched weighted sum over the
        k slots (bmm: fp32 accumulation, one pass)."""
        order, w, send_splits, recv_splits, s = handle
        back = self._a2a(rows.contiguous(), recv_splits, send_splits)
        k = w.shape[1] if w.dim() == 2 else 1
        unsorted = torch.empty_like(back)
        unsorted.index_copy_(0, order, back)
        h = self.model.hidden
        return torch.bmm(w.to(back.dtype).view(s, 1, k), unsorted.view(s, k, h)).view(s, h)


DEFAULT_ROTATE = 4  # input sets the timed iterations rotate over (the megakernel bench's default too)
_SET_STRIDE = 1_000_003  # seed offset between input sets (set 0 keeps the single-set seeds)

_INPUTS: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}


def _inputs(rank: int, model, dtype: torch.dtype, tokens: int, routing: str, seed: int, device: torch.device,
            rotate: int = 1) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's `rotate` input sets (x, topk_idx, topk_weights), deterministic by (seed, rank, set); set 0 is
    the one a single-set run used. The last case's sets are cached for the next case."""
    if rotate < 1:
        raise ValueError(f"rotate must be >= 1, got {rotate}")
    key = (rank, model.name, model.hidden, model.experts, model.topk, dtype, tokens, routing, seed, str(device), rotate)
    if key not in _INPUTS:
        _INPUTS.clear()
        sets = []
        for j in range(rotate):
            g = torch.Generator(device=device)
            g.manual_seed(seed * 1009 + rank + j * _SET_STRIDE)
            x = torch.randn(tokens, model.hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
            idx, w = generate_routing(tokens, model.experts, model.topk, routing=routing,
                                      seed=seed * 7 + rank + 1 + j * _SET_STRIDE, device=device)
            sets.append((x, idx, w))
        _INPUTS[key] = sets
    return _INPUTS[key]


def bench_case(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Run one benchmark case on this rank (process group already initialised). Rank 0 returns the report."""
    backend = dist.get_backend() if dist.is_initialized() else cfg.get("backend", "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    model = get_model(cfg["model"])
    dtype = TORCH_DTYPES[model.dtype]
    knobs = Knobs.from_dict(cfg["knobs"]) if isinstance(cfg.get("knobs"), dict) else Knobs.parse(cfg.get("knobs") or "")
    if cfg.get("transport") and cfg["transport"] != knobs.transport:
        try:
            knobs = knobs.replace(transport=cfg["transport"])
        except KnobError:  # e.g. a fence mode the new transport does not have: take its default one
            knobs = knobs.replace(transport=cfg["transport"], fence_mode=default_knobs(cfg["transport"]).fence_mode)
    impl = cfg.get("impl", "moetune")
    tokens = int(cfg["tokens"])
    iters, warmup = int(cfg.get("iters", 20)), int(cfg.get("warmup", 5))
    seed = int(cfg.get("seed", 0))
    routing = cfg.get("routing", "uniform")
    measure_layer = bool(cfg.get("layer", True))
    verify = bool(cfg.get("verify", False))
    dense = cfg.get("dense")  # None: the buffer picks its layout (see EPBuffer); True/False force it
    rotate = int(cfg.get("rotate", DEFAULT_ROTATE))
    # at least one untimed iteration per input set (the MoE timings' rule, moe.warmup_for): a set the warm-up did not
    # reach had its first calls timed (the tuner's max(1, iters // 4) warmed 2 of 4 sets at iters 10)
    warmup, warmup_note = warmup_for(warmup, rotate)

    sets = _inputs(rank, model, dtype, tokens, routing, seed, device, rotate)
    # set 0: the CUDA-graph timings (captured on one input), the verification and the byte count
    x, idx, w = sets[0]
    timer = _Timer(device)

    layer = None
    if impl == "plain":
        comm: Any = PlainA2A(model, device, dtype)
        buf = None
    else:
        # unchecked: the cross-rank input checks cost a collective and a sync; keep them out of the timings
        buf = EPBuffer(knobs=knobs, model=model, max_tokens=max(tokens, 1), device=device, dtype=dtype,
                       check_inputs=False, dense=dense, options=cfg.get("options"))
        if measure_layer or verify:
            layer = MoELayer(model, max_tokens=max(tokens, 1), device=device, dtype=dtype, seed=seed, buffer=buf)
        comm = buf

    def roundtrip() -> torch.Tensor:
        """dispatch → identity experts → combine (pipelined when pipeline_depth > 1), on the current set."""
        if impl == "plain":
            recv, handle = comm.dispatch(x, idx, w)
            return comm.combine(recv, handle)
        if buf is not None and buf.num_chunks > 1:
            return pipelined_moe(buf, x, idx, w, weighted_rows)
        recv, meta, handle = comm.dispatch(x, idx, w)
        return comm.combine(weighted_rows(recv, meta), handle)

    times: dict[str, list[float]] = {"dispatch": [], "combine": [], "roundtrip": [], "layer": []}
    host: dict[str, list[float]] = {"dispatch": [], "combine": [], "roundtrip": []}  # host time to issue (no sync)
    rt_out = None
    rt_worst = 0.0
    for it in range(warmup + iters):
        keep = it >= warmup
        x, idx, w = sets[it % rotate]  # rotate the inputs (roundtrip() reads these names too)
        # dispatch and combine, each timed alone
        _barrier(device)
        t0 = timer.mark()
        h0 = time.perf_counter()
        if impl == "plain":
            recv, handle = comm.dispatch(x, idx, w)
            h1 = time.perf_counter()
            t1 = timer.mark()
            rows = recv
        else:
            recv, meta, handle = comm.dispatch(x, idx, w)
            h1 = time.perf_counter()
            t1 = timer.mark()
            rows = weighted_rows(recv, meta)
        _barrier(device)
        t2 = timer.mark()
        h2 = time.perf_counter()
        comm.combine(rows, handle)
        h3 = time.perf_counter()
        t3 = timer.mark()
        timer.sync()
        if keep:
            times["dispatch"].append(timer.us(t0, t1))
            times["combine"].append(timer.us(t2, t3))
            host["dispatch"].append((h1 - h0) * 1e6)
            host["combine"].append((h3 - h2) * 1e6)
        # the round trip as one span (pipelined when pipeline_depth > 1)
        _barrier(device)
        t0 = timer.mark()
        h0 = time.perf_counter()
        rt_out = roundtrip()
        h1 = time.perf_counter()
        t1 = timer.mark()
        timer.sync()
        if keep:
            times["roundtrip"].append(timer.us(t0, t1))
            host["roundtrip"].append((h1 - h0) * 1e6)
        if it >= warmup + iters - rotate:  # every set's round trip is checked once (outside the timings)
            # the round trip with identity experts must give back x times the sum of its weights
            rt_worst = max(rt_worst, worst_err(max_rel_err(rt_out, x.float() * w.float().sum(1, keepdim=True))))
        if layer is not None and measure_layer:
            _barrier(device)
            t0 = timer.mark()
            layer.forward_routed(x, idx, w)
            t1 = timer.mark()
            timer.sync()
            if keep:
                times["layer"].append(timer.us(t0, t1))

    x, idx, w = sets[0]  # from here on: set 0
    profile_table = _profile(roundtrip, device, rank) if cfg.get("profile") else None
    graph_us = graph_err = graph_rel = None
    pair_us = pair_err = pair_rel = None
    if cfg.get("graph"):
        if buf is not None and not type(buf.transport).graph_capturable:
            graph_err = f"transport {knobs.transport} cannot be replayed from a CUDA graph (per-call host state)"
        else:
            def check_output(out: torch.Tensor) -> float:
                return max_rel_err(out, x.float() * w.float().sum(1, keepdim=True))

            poison = None
            if buf is not None and buf.resident:  # a replay that moved nothing would leave these bytes behind
                poison = buf.transport.data.local.fill_  # type: ignore[attr-defined]
            graph_us, graph_err, graph_rel = _graph_roundtrip(roundtrip, device, iters, warmup, check_output, poison, x)
            if buf is not None and graph_err is None and buf.num_chunks == 1:
                # dispatch and combine alone (no expert op between): the received rows go straight back, so
                # every token comes back times the number of ranks that received it -- those holding one of
                # its experts (packed/resident layouts), or every rank (dense layout: all slots go everywhere)
                epr = model.experts // world
                if buf.dense:
                    hits = torch.full((x.shape[0], 1), float(world), device=device)
                else:
                    hits = torch.zeros(x.shape[0], world, device=device).scatter_(1, idx.long() // epr, 1.0).sum(1, keepdim=True)

                def pair() -> torch.Tensor:
                    recv, _meta, h = buf.dispatch(x, idx, w)
                    return buf.combine(recv, h)

                def check_pair(out: torch.Tensor) -> float:
                    return max_rel_err(out, x.float() * hits)

                pair_us, pair_err, pair_rel = _graph_roundtrip(pair, device, iters, warmup, check_pair, poison, x)

    err = None
    if verify and layer is not None:
        out = layer.forward_routed(x, idx, w)
        ref = dense_reference(x, model, seed=seed, topk_idx=idx, topk_weights=w)
        err = worst_err(max_rel_err(out, ref))

    # the step time of an iteration is the slowest rank's
    mine = torch.tensor([times["dispatch"], times["combine"], times["roundtrip"], times["layer"] or [0.0] * iters],
                        dtype=torch.float64, device=device)
    # bytes this rank sends to other ranks in one dispatch (counted from the split sizes)
    if impl == "plain":
        _, hp = comm.dispatch(x, idx, w)
        splits, row = hp[2], model.token_bytes
    else:
        _, _, hp = comm.dispatch(x, idx, w)
        splits = hp.send_splits()
        row = buf.row_bytes
    remote_bytes = (sum(splits) - splits[rank]) * row
    rt_err = rt_worst if rt_out is not None else 0.0
    errs = torch.tensor([err if err is not None else -1.0, rt_err], dtype=torch.float64, device=device)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    worst = mine.cpu().tolist()
    if buf is not None:
        # free this case's transport resources (symmetric memory, IPC mappings, proxy threads): benchmarks
        # and the persistent worker run many cases per process; wait until every rank is past its last transfer
        _barrier(device)
        buf.close()
    if rank != 0:
        return None
    rep: dict[str, Any] = {
        "dispatch_us": timing(worst[0]),
        "combine_us": timing(worst[1]),
        "roundtrip_us": timing(worst[2]),
        "layer_us": timing(worst[3]) if times["layer"] else None,
        # this rank's (rank 0's) host time to issue each call; includes any host sync inside the call
        "dispatch_host_us": timing(host["dispatch"]),
        "combine_host_us": timing(host["combine"]),
        "roundtrip_host_us": timing(host["roundtrip"]),
        "graph_roundtrip_us": graph_us,
        "graph_error": graph_err,
        "graph_roundtrip_rel_err": graph_rel,
        # dispatch + combine alone, replayed from a CUDA graph (no expert op between)
        "graph_pair_us": pair_us,
        "graph_pair_error": pair_err,
        "graph_pair_rel_err": pair_rel,
        "max_rel_err": (float(errs[0].item()) if verify and layer is not None else None),
        "roundtrip_rel_err": float(errs[1].item()),
        "roundtrip_bound": verify_bound(model.dtype, "none" if impl == "plain" else knobs.compression),
        "verify_bound": verify_bound(model.dtype, knobs.compression) if verify else None,
        "knobs": knobs.to_dict(),
        "impl": impl,
        "world": world,
        "backend": backend,
        "model": model.name,
        "hidden": model.hidden,
        "experts": model.experts,
        "topk": model.topk,
        "dtype": model.dtype,
        "tokens": tokens,
        "routing": routing,
        "iters": iters,
        "warmup": warmup,
        **({"warmup_note": warmup_note} if warmup_note else {}),
        "rotate": rotate,
        "wire_bytes_per_row": buf.row_bytes if buf is not None else model.token_bytes,
        "layout": "plain" if buf is None else ("dense" if buf.dense else "packed"),
        "profile": profile_table,
        "dispatch_remote_bytes_rank0": remote_bytes,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if device.type == "cuda" and hasattr(torch.cuda, "nccl"):
        try:
            rep["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # broad: a best-effort version stamp
            pass
    return rep


def _graph_roundtrip(roundtrip, device: torch.device, iters: int, warmup: int, check_output, poison=None,
                     x: torch.Tensor | None = None) -> tuple[dict | None, str | None, float | None]:
    """Capture one round trip in a CUDA graph (every rank) and time `iters` replays, each started together
    after a barrier. Then one more replay whose output is checked (`check_output(out)` -> relative error),
    with the graph's input `x` replaced by new values first (restored after) and the receive buffer
    poisoned (`poison(255)`: NaN bytes), so a graph that moves nothing, or moves stale rows, cannot pass.
    Returns (the slowest rank's median and spread, None, the worst rank's error) or (None, why it failed,
    None). Capture fails where the layout syncs with the host (packed collective)."""
    if device.type != "cuda":
        return None, "CUDA graphs need a GPU", None
    err = ""
    out = None
    g = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm the allocator on the capture stream, as torch recommends
            for _ in range(2):
                roundtrip()
        torch.cuda.current_stream(device).wait_stream(side)
        _barrier(device)
        with torch.cuda.graph(g):
            out = roundtrip()
    except Exception as e:  # the capture failed: keep the ranks in step and say why
        err = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    ok = torch.tensor([0.0 if err else 1.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        torch.cuda.synchronize(device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() < 1.0:
        return None, err or "capture failed on another rank", None
    timer = _Timer(device)
    samples = []
    for it in range(warmup + iters):
        _barrier(device)
        t0 = timer.mark()
        g.replay()
        t1 = timer.mark()
        timer.sync()
        if it >= warmup:
            samples.append(timer.us(t0, t1))
    _barrier(device)  # every rank's last replay (and the peers' stores into the buffers) is complete
    if poison is not None:
        poison(255)
    kept = None
    if x is not None:  # check_output reads x: it expects the new values
        kept = x.clone()
        x.copy_((x.float() * -0.75 + 0.25).to(x.dtype))
    _barrier(device)
    g.replay()
    torch.cuda.synchronize(device)
    rel = torch.tensor([worst_err(check_output(out))], dtype=torch.float64, device=device)
    if kept is not None:
        x.copy_(kept)
    t = torch.tensor(samples, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    del g
    return timing(t.cpu().tolist()), None, float(rel.item())


def _profile(roundtrip, device: torch.device, rank: int, iters: int = 5) -> str | None:
    """Run `iters` round trips under torch.profiler (every rank: the collectives need both); rank 0 returns
    the key_averages tables (top 25 by self device time and by CPU time)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _barrier(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(iters):
            with record_function("moetune_roundtrip"):
                roundtrip()
            if device.type == "cuda":
                torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e6
    trace = os.environ.get("MOETUNE_PROFILE_TRACE")
    if trace:  # the timeline too (every rank: copies on both sides), for chrome://tracing or Perfetto
        prof.export_chrome_trace(f"{trace}.rank{rank}.json")
    if rank != 0:
        return None
    ka = prof.key_averages()
    parts = [f"{iters} round trips under the profiler, {wall:.0f} us wall each (profiler overhead included)\n"]
    keys = (["self_cuda_time_total", "self_device_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]
    for key in keys:
        try:
            parts.append(f"== top 25 by {key} ==\n" + ka.table(sort_by=key, row_limit=25, max_name_column_width=60))
            break
        except Exception:  # the name of the device-time column changed across torch versions
            continue
    parts.append("== top 25 by cpu_time_total ==\n" + ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    return "\n".join(parts)


def finish_report(rep: dict[str, Any], verify: bool) -> dict[str, Any]:
    """What `moetune bench ep --json` prints for a case's report: with verify, `verify_ok` added."""
    if verify and rep.get("max_rel_err") is not None:
        rep["verify_ok"] = rep["max_rel_err"] <= rep["verify_bound"]
    return rep


def bench_entry(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """launch() target: one case per launch."""
    return bench_case(rank, world, cfg)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_torchrun(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
    """Join the group torchrun set up (env://) and run the case; rank 0 returns the report."""
    backend = cfg.get("backend", "gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        init_dist(rank, world, backend=backend, timeout_s=timeout_s)
    try:
        return bench_case(rank, world, cfg)
    finally:
        dist.destroy_process_group()
