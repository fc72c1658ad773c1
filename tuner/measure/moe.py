"""Timing the whole MoE layer on one device: the megakernel and the unfused engine, side by side in one process.

Used by the tuner's local backend (family `megakernel`: one knob set at one token count), by
`moetune bench moe` and by the `moe` scenario driver. Every figure is the whole layer from `x` to the output
with routing included: single calls timed with CUDA events (perf_counter on CPU), `warmup` untimed calls
first, inputs rotated over `rotate` tensors; with `graph`, one CUDA graph captured per input and replayed.
The floors printed beside the figures: reading the touched experts' weights and the SwiGLU GEMMs at the rates
measured on this GPU model (`GPU_RATES`: the `gpu-rates` scenario; an H200's, said so, on a GPU with none); and,
measured here in the same process, a plain read of as many experts' weights as S tokens are expected to touch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import ModelShape
from moetune.runtime.testing import bounds
from moetune.runtime.testing.timing import graphs_of, time_calls
from moetune.tuner.measure.outputs import WrongOutput, rel_err_problem
from moetune.tuner.measure.stats import Summary
from moetune.tuner.progress import Progress


@dataclass(frozen=True)
class GpuRates:
    """What one GPU model reaches on the floors' two kinds of work (measured: the gpu-rates and gpu-gemm-rate
    scenarios, their faster decile of calls back to back: the rate this GPU reaches, not its datasheet's)."""

    gpu: str  # the name torch gives the GPU it was measured on
    read_tbps: float  # reading bf16 weights from HBM (a sum or a batched GEMV over 1.21 GB, the better)
    tensor_tflops: float  # bf16 tensor-core GEMM
    measured: str  # where the numbers come from


# the fallback on a GPU model with no rates of its own (said so beside the floors). Runs 198-199 (2026-12-05,
# a7d1e81, one H200, calls back to back): read-sum p90 4.172 / 4.172 TB/s (medians 4.17; read-gemv 3.16), GEMM p90
# 796.0 / 800.6 TFLOP/s (medians 683 / 688); the figures were 4.2 / 790
H200_RATES = GpuRates("NVIDIA H200", 4.17, 800.0,
                      "gpu-rates and gpu-gemm-rate scenarios, runs 198-199: the faster decile (p90) of calls back to back")
GPU_RATES = (
    H200_RATES,
    # runs 195 and 195b (2026-12-05, 591a5c5, calls back to back): read-sum p90 2.995 / 2.993 TB/s (medians 2.96 /
    # 2.99; read-gemv 2.66 / 2.63), GEMM p90 772.7 / 774.7 TFLOP/s; run 194's 2.89 / 717 were medians of single
    # calls, each with its launch gap and ramp, and the layer read its weights faster than that "floor". Another
    # H100 (run 196, 11d75e5): read p90 3.00 TB/s, GEMM p90 733: cards of one model differ by ~5 % in the GEMM
    GpuRates("NVIDIA H100 80GB HBM3", 2.99, 774.0,
             "gpu-rates and gpu-gemm-rate scenarios, runs 195-195b: the faster decile (p90) of calls back to back"),
)


def rates_for(gpu: str) -> tuple[GpuRates, bool]:
    """The rates measured on the GPU model named `gpu` (torch's name), and True; an H200's, and False, where none
    were measured for it (a CPU, another GPU): the floors then say whose rates they are."""
    for r in GPU_RATES:
        if gpu == r.gpu:
            return r, True
    return H200_RATES, False


ENGINES = ("megakernel", "unfused", "torch")  # torch: the plain torch path (runtime.testing.baselines)


def experts_touched(model: ModelShape, tokens: int) -> float:
    """Expected distinct experts that S tokens route to (uniform top-k): E (1 - (1 - K/E)^S)."""
    return model.experts * (1.0 - (1.0 - model.topk / model.experts) ** max(tokens, 0))


def plain_read_experts(model: ModelShape, tokens: int) -> int:
    """How many experts' weights the plain read sums at S = `tokens`: `experts_touched` rounded up, never more than
    S tokens route to (S·K) nor than the model has. The expectation is a float a hair above the whole count where
    it is one (8.000000000000004 at S=1 of 72 experts, top-8): its bare ceiling read an expert more than a token
    touches, so the tolerance below rounding is dropped first."""
    return max(1, min(model.experts, tokens * model.topk, math.ceil(experts_touched(model, tokens) - 1e-9)))


def floors(model: ModelShape, tokens: int, rates: GpuRates = H200_RATES) -> dict[str, float]:
    """µs the layer cannot beat on a GPU of `rates`: reading the weights it touches, and its tensor-core work."""
    per_expert = 3 * model.hidden * model.intermediate * 2  # W_gate_up [2I, H] + W_down [H, I], bf16
    read = experts_touched(model, tokens) * per_expert + model.experts * model.hidden * 2
    flops = 2.0 * tokens * model.topk * 3 * model.hidden * model.intermediate
    return {"weight_floor_us": read / (rates.read_tbps * 1e12) * 1e6,
            "tensor_floor_us": flops / (rates.tensor_tflops * 1e12) * 1e6}


def layer_inputs(model: ModelShape, tokens: int, rotate: int, device: Any, dtype: Any, seed: int) -> list[Any]:
    """The `rotate` input tensors [tokens, hidden] the benchmarks time a layer on (CPU generator, then `device`)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(tokens, model.hidden, generator=g).to(device=device, dtype=dtype) for _ in range(rotate)]


def warmup_for(warmup: int, rotate: int) -> tuple[int, str]:
    """The warm-up a timing of `rotate` rotated inputs runs, and the note saying it was raised ("" where it was not).

    The eager calls rotate over the inputs after the untimed warm-up calls (`time_calls`, `time_interleaved`), so an
    input the warm-up did not reach had its first call timed. The only meaningful warm-up is at least one call per
    input: a `warmup` below `rotate` is raised to `rotate` (not refused: a quick plumbing check passes --warmup 0),
    never silently. The one rule for every caller: `bench moe` and `bench knobs` (said before they time anything),
    `bench_moe` and `compare_knobs` themselves (the `moe` and `moe-knobs` scenario drivers call them directly; their
    reports' "warmup" is the raised value and "warmup_note" the note)."""
    if warmup >= rotate:
        return warmup, ""
    return rotate, (f"--warmup {warmup} is below --rotate {rotate}: raised to {rotate}, one untimed call per rotated "
                    "input")


def settle(rest_s: float, cuda: bool) -> None:
    """Idle `rest_s` seconds with the device drained, so the next timed block starts from a rested GPU.

    Where a layer draws the GPU's power limit (an H200 at S=4096), a block timed right after another is clocked
    down: in run 153 the megakernel layer took 696-698 µs a call in 60-call blocks after 2 s idle, graph or eager,
    and 767-808 µs back to back, whichever mode ran first. So without a rest, the engine or mode timed second pays
    for the first one's heat."""
    if rest_s <= 0:
        return
    if cuda:
        import torch

        torch.cuda.synchronize()
    time.sleep(rest_s)


def time_layer(forward: Callable[[Any], Any], xs: Sequence[Any], *, warmup: int, iters: int, graph: bool,
               cuda: bool, rest_s: float = 0.0) -> dict[str, list[float]]:
    """{"eager_us": samples, "graph_us": samples (graph and cuda only)} for one layer callable; `rest_s` idle
    seconds before each block (`settle`)."""
    settle(rest_s, cuda)
    out = {"eager_us": time_calls([lambda x=x: forward(x) for x in xs], warmup=warmup, iters=iters, cuda=cuda)}
    if graph and cuda:
        fns = graphs_of(forward, xs)
        settle(rest_s, cuda)
        out["graph_us"] = time_calls(fns, warmup=warmup, iters=iters, cuda=True)
    return out


def time_plain_read(w_gate_up: Any, w_down: Any, experts: int, *, warmup: int, iters: int, graph: bool,
                    cuda: bool, rest_s: float = 0.0) -> list[float]:
    """Samples (µs) of a plain read of `experts` experts' weights: two sums over the contiguous w_gate_up[:n] and
    w_down[:n], replayed from a CUDA graph where `graph` (as the layers are). The floor as this device reaches it for
    that many bytes (ramp-up and tail included), beside the arithmetic one at `GpuRates.read_tbps`: on an H200 the 75 MB of
    eight experts read in 34 µs, 2.2 TB/s (bench/results/megakernel, run 20)."""
    n = max(1, min(experts, w_gate_up.shape[0]))
    out = time_layer(lambda _x: (w_gate_up[:n].sum(), w_down[:n].sum()), [None], warmup=warmup, iters=iters,
                     graph=graph, cuda=cuda, rest_s=rest_s)
    return out["graph_us" if graph and cuda else "eager_us"]


# What the megakernel's output may differ from the fp32 dense reference with the same routing by (max_rel_err): the
# GPU tests' bound (tests/test_megakernel_gpu.py `_check`), which every tile, stage and core setting meets.
MK_REL_ERR_BOUND = 1e-2
# What two engines' (or knob sets') bf16 outputs may differ by where one is the other's reference (`bench moe`:
# against the unfused engine; `bench knobs`: against the base): each is within MK_REL_ERR_BOUND of the fp32
# reference, so within about twice that of each other. 1e-2 is too tight against a bf16 reference: 14 stored `bench moe`
# runs (bench/results/megakernel, runs 83-188) give rel_err_vs_unfused 0.00985 at S=4096 for both the megakernel and
# the plain torch path (the unfused output's own bf16 rounding). A wrong output (stale, zero, unwritten rows) is ~1.
PAIR_REL_ERR_BOUND = 2 * MK_REL_ERR_BOUND
# What a bf16 layer of torch ops (the unfused engine, the plain torch path) may differ from the fp32 dense reference by:
# the runtime's bf16 bound for the layer, defined once in the runtime (also runtime.testing.selftest's layer_bound).
# The megakernel's is MK_REL_ERR_BOUND.
BF16_LAYER_REL_ERR_BOUND = bounds.BF16_LAYER_REL_ERR_BOUND


def reference_bound(engine: str) -> float:
    """What an engine's output may differ from the fp32 `dense_reference` (same weights, routing from the gate) by."""
    return MK_REL_ERR_BOUND if engine == "megakernel" else BF16_LAYER_REL_ERR_BOUND


def rel_err(out: Any, ref: Any) -> float:
    """`max_rel_err(out, ref)`, inf where the shapes differ (an output of another shape is as wrong as can be)."""
    from moetune.runtime.moe_layer import max_rel_err

    return max_rel_err(out, ref) if tuple(out.shape) == tuple(ref.shape) else math.inf


def fp32_reference(model: ModelShape, x: Any, seed: int) -> Any:
    """The fp32 `dense_reference` of the layer built from `seed` (weights in x's dtype, as the engines hold them;
    routing from its gate, as the engines route) at input `x`: what a layer checked without the unfused engine beside
    it (`bench moe --engine megakernel`, `bench knobs`' base) is checked against."""
    from moetune.runtime.moe_layer import dense_reference

    return dense_reference(x, model, seed=seed, weight_dtype=x.dtype)


def output_problem(out: Any, ref: Any, bound: float, what: str) -> str | None:
    """Why `out` is not `ref` within `bound` (max |out - ref| / max |ref|), None when it is: another shape, a value
    that is not finite (a row left poisoned: never written) or a relative error over the bound. A pure function of
    the two tensors (any device)."""
    import torch

    from moetune.runtime.moe_layer import max_rel_err

    if tuple(out.shape) != tuple(ref.shape):
        return f"wrong output: {what}: shape {tuple(out.shape)}, the reference's {tuple(ref.shape)}"
    bad = int((~torch.isfinite(out.float())).any(dim=-1).sum()) if out.numel() else 0
    if bad:
        return f"wrong output: {what}: {bad} of {out.shape[0]} rows hold non-finite values (never written?)"
    return rel_err_problem(max_rel_err(out, ref), bound, what)


_references: dict[tuple[Any, ...], tuple[Any, Any, Any, Any]] = {}


def megakernel_reference(model: ModelShape, tokens: int, seed: int, device: Any, gate: Any) -> tuple[Any, Any, Any, Any]:
    """(x, topk_idx, topk_weights, ref) that every knob set's output at `tokens` tokens is checked against: x the
    first input `measure_megakernel` times, the routing torch's `route` picks from `gate`, ref the fp32
    `dense_reference` of the layer built from `seed` with that routing. Computed once per (model, device, tokens,
    seed) (one at a time: a study's trials share it)."""
    import torch

    from moetune.runtime.moe_layer import dense_reference, route

    key = (model, str(device), tokens, seed)
    if key not in _references:
        x = layer_inputs(model, tokens, 1, device, torch.bfloat16, seed + 1)[0]
        idx, w = route(x, gate, model.topk)
        # bf16 weights, as measure_megakernel builds them whatever the model's dtype
        ref = dense_reference(x, model, seed=seed, topk_idx=idx, topk_weights=w, weight_dtype=torch.bfloat16)
        _references.clear()
        _references[key] = (x, idx, w, ref)
    return _references[key]


def megakernel_output_problem(layer: Any, model: ModelShape, tokens: int, seed: int, gate: Any) -> str | None:
    """Why a megakernel layer's output at `tokens` tokens is wrong (`output_problem` against `megakernel_reference`,
    `MK_REL_ERR_BOUND`), None when it is right. Two calls, each into a NaN-poisoned output (a row never written
    fails): with the reference's routing (`forward_routed`: every row is checked), and as timed (`forward`: the
    layer routes from the gate itself; the rows it routed as the reference did are checked, since a near-tie may
    pick another expert for a row, and every row must be finite). Not timed: call it outside the timed calls."""
    import torch

    x, idx, w, ref = megakernel_reference(model, tokens, seed, layer.device, gate)

    def poisoned() -> Any:
        return torch.full(tuple(x.shape), float("nan"), dtype=torch.bfloat16, device=x.device)

    why = output_problem(layer.forward_routed(x, idx, w, out=poisoned()), ref, MK_REL_ERR_BOUND,
                         "the layer with the reference's routing")
    if why is not None:
        return why
    out = layer.forward(x, out=poisoned())
    got = layer.routing(tokens)[0].long()
    same = (got.sort(1).values == idx.long().sort(1).values).all(1)
    # a row routed otherwise is compared with itself (its finiteness is still checked)
    return output_problem(out, torch.where(same.unsqueeze(1), ref, out.float()), MK_REL_ERR_BOUND,
                          "the layer routing from its gate")


_weights: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}


def release_megakernel_inputs() -> None:
    """Drop the weights and reference that `measure_megakernel` keeps for a study's trials (GBs of GPU memory: a
    long-lived process such as the daemon, whose re-tune jobs run here, would hold them after the job) and hand the
    freed blocks back to the driver."""
    had = bool(_weights or _references)
    _weights.clear()
    _references.clear()
    if had:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure_megakernel(knobs: Knobs, model: ModelShape, tokens: int, *, iters: int = 50, warmup: int = 10,
                       rotate: int = 4, seed: int = 0, options: Any = None) -> dict[str, list[float]]:
    """The megakernel with `knobs` at `tokens` tokens on the current GPU: {"graph_us": samples} of CUDA-graph replays
    (µs), the figure a tuning trial takes (what a serving engine replays).

    Only the replays are timed: an eager block timed right before them heats a GPU at its power limit and clocks the
    replays down (S=4096: 743 µs a replay right after an eager block of 689 µs a call; `settle`: 696-698 µs rested,
    767-808 µs back to back). After the timed replays the output is checked against the fp32 dense reference
    (`megakernel_output_problem`, not timed).

    Weights are built once per (model, device, seed) and reused across knob sets (a study's trials). Raises
    what the layer raises: `ConfigError` for a setting that does not fit this GPU, `MegakernelError` when
    the kernel reports one, the build's errors; `WrongOutput` when the output is not the reference's."""
    import torch

    from moetune.runtime.megakernel.config import MegakernelConfig
    from moetune.runtime.megakernel.layer import MegakernelMoE
    from moetune.runtime.megakernel.weights import tile_
    from moetune.runtime.moe_layer import expert_weights, gate_weight

    dev = torch.device("cuda", torch.cuda.current_device())
    key = (model, str(dev), seed)
    if key not in _weights:
        bf = torch.bfloat16
        w1, w2 = zip(*(expert_weights(model, e, seed=seed, device=dev, dtype=bf) for e in range(model.experts)), strict=True)
        _weights.clear()  # one model's weights at a time (GBs), k-tiled once for every trial's layer
        _weights[key] = (tile_(torch.stack(w1)), tile_(torch.stack(w2)), gate_weight(model, seed=seed, device=dev, dtype=bf))
    w_gate_up, w_down, gate = _weights[key]
    mk = MegakernelMoE(model, max_tokens=max(1, tokens), device=dev, config=MegakernelConfig.from_knobs(knobs, options),
                       w_gate_up=w_gate_up, w_down=w_down, gate=gate, tiled=True)
    xs = layer_inputs(model, tokens, rotate, dev, torch.bfloat16, seed + 1)
    # graph replays only (graphs_of warms each input up first): no eager block before them to heat the GPU
    res = {"graph_us": time_calls(graphs_of(mk.forward, xs), warmup=warmup, iters=iters, cuda=True)}
    mk.check()  # a timed-out wait is an error, not a fast trial
    why = megakernel_output_problem(mk, model, tokens, seed, gate)
    mk.check()
    if why is not None:  # a setting that computes the wrong layer is no fast trial either
        raise WrongOutput(f"{why} (S={tokens})")
    return res


def device_error(layer: Any) -> str | None:
    """The error a megakernel layer's launches recorded on the device (a wait that timed out, an expert id out of
    range: `MoELayer.check`), as text, else None; a host sync. None for layers without such a record (unfused,
    torch). Timing loops call it after each layer's timed calls: a failed launch returns as fast as a good one, so
    its samples are not a measurement."""
    from moetune.runtime.megakernel.layer import MegakernelError

    if layer is None:
        return None
    try:
        layer.check()
    except MegakernelError as e:
        return str(e)
    return None


def decode_kernel_takes(model: ModelShape, tokens: int) -> bool:
    """Whether a megakernel launch of `tokens` tokens of `model` runs the decode kernel on the current GPU (where no
    tile knob acts: the tuner then has nothing to search at that size). Needs the library and a CUDA GPU."""
    import torch

    from moetune.runtime.megakernel.layer import decode_launch

    return decode_launch(model, tokens, torch.device("cuda", torch.cuda.current_device())) is not None


def bench_moe(model: ModelShape, tokens: Sequence[int], engines: Sequence[str], *, graph: bool = False,
              iters: int = 50, warmup: int = 10, rotate: int = 4, seed: int = 0, device: str | None = None,
              knobs: Knobs | None = None, rest_s: float = 0.0, progress: Progress | None = None) -> dict[str, Any]:
    """`_bench_moe` with `device` (a CUDA one) the current device throughout: its timers, graphs and syncs use the
    current device's stream, so on another GPU they would time the host's launches and capture empty graphs."""
    import contextlib

    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        return _bench_moe(model, tokens, engines, graph=graph, iters=iters, warmup=warmup, rotate=rotate, seed=seed,
                          dev=dev, knobs=knobs, rest_s=rest_s, progress=progress)


def _bench_moe(model: ModelShape, tokens: Sequence[int], engines: Sequence[str], *, graph: bool, iters: int,
               warmup: int, rotate: int, seed: int, dev: Any, knobs: Knobs | None, rest_s: float,
               progress: Progress | None) -> dict[str, Any]:
    """Both engines in this process, per S: {"cases": [{engine, S, eager_us, graph_us, ...}], "floors": ...}.

    An engine that cannot run here (the megakernel on CPU) is reported `skipped` with the reason; an engine whose
    launches recorded a device-side error while timed (`device_error`) is a case {engine, S, "failed": why}
    instead of a timing row, and at every later S too (not run again); one whose output at S is wrong is such a case
    at that S. Outputs are checked after the timed calls: the unfused engine's against the fp32 dense reference
    (`fp32_reference`, `reference_bound`; its `rel_err_vs_reference`), and where it is right every other engine's
    against it within PAIR_REL_ERR_BOUND (`rel_err_vs_unfused`); where the unfused engine is not timed (or was wrong)
    every engine's against the fp32 reference (`rel_err_vs_reference`): no engine's output goes unchecked. The
    megakernel runs with `knobs` (default: the `engine=megakernel` defaults). `rest_s`: idle seconds before
    every timed block (`settle`; 0: blocks back to back, each after the previous one's load). `progress`: a
    sink (`tuner.progress.Progress`, drawn by the caller) given one task of every (engine, S) case
    that runs: `update(task, done, description="ENGINE S=N")` as case done+1 starts, `update(task, done)` as
    it ends; the caller closes it."""
    import torch

    from moetune.runtime.megakernel.engine import MegakernelUnavailable, megakernel_problem
    from moetune.runtime.moe_layer import MoELayer

    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise ValueError(f"engines must be among {', '.join(ENGINES)}, got {list(engines)}")
    if not tokens or any(t < 1 for t in tokens):
        raise ValueError(f"tokens must be positive integers, got {list(tokens)}")
    warmup, raised = warmup_for(warmup, rotate)  # no rotated input has its first eager call timed
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    smax = max(tokens)
    layers: dict[str, Any] = {}  # engine -> the MoELayer it runs on (torch: the unfused layer's weights)
    fwd: dict[str, Callable[[Any], Any]] = {}  # engine -> its whole-layer call
    skipped: dict[str, str] = {}
    if "torch" in engines and not cuda:
        skipped["torch"] = "the plain torch path needs torch._grouped_mm on a CUDA device"
    for eng in engines:
        if eng == "torch":
            continue
        mk_knobs = (knobs or Knobs(engine="megakernel")) if eng == "megakernel" else Knobs()
        # refused before the layer builds its weights (seconds to a minute on a CPU, for nothing)
        why = megakernel_problem(dev, dtype, model) if eng == "megakernel" else None
        if why is not None:
            skipped[eng] = why
            continue
        try:
            layers[eng] = MoELayer(model, None, mk_knobs, max_tokens=smax, device=dev, dtype=dtype, seed=seed,
                                   engine=eng)
            fwd[eng] = layers[eng].forward
        except MegakernelUnavailable as e:
            skipped[eng] = str(e)
    gpu = torch.cuda.get_device_name(dev) if cuda else "cpu"
    rates, own = rates_for(gpu)
    report = {"model": model.name, "device": str(dev), "graph": graph and cuda, "iters": iters, "warmup": warmup,
              "rotate": rotate, "rest_s": rest_s, "seed": seed, **({"warmup_note": raised} if raised else {}),
              # the floors are arithmetic at these rates, never timed: labelled as every computed number is
              "floor_rates": {"gpu": rates.gpu, "this_gpu_model": own, "read_tbps": rates.read_tbps,
                              "tensor_tflops": rates.tensor_tflops, "measured": rates.measured, "label": "MODELLED"}}
    cases: list[dict[str, Any]] = [{"engine": e, "skipped": skipped[e]} for e in dict.fromkeys(engines) if e in skipped]
    if len(skipped) == len(set(engines)):  # nothing can run here: no weights built, no plain read timed
        return {**report, "cases": cases}
    src = layers.get("unfused") or layers.get("megakernel")  # whose weights the plain read sums
    if "torch" in engines or src is None:  # same weights as the unfused layer (built for them if not timed)
        src = layers.get("unfused") or MoELayer(model, None, Knobs(), max_tokens=smax, device=dev, dtype=dtype,
                                                seed=seed, engine="unfused")
    if "torch" in engines and "torch" not in skipped:
        from moetune.runtime.testing.baselines import plain_torch_moe

        g, w1, w2, k = src.gate.data, src.w_gate_up.data, src.w_down.data, model.topk
        fwd["torch"] = lambda x: plain_torch_moe(x, g, w1, w2, k)
    timed = [e for e in engines if e in fwd]  # the order asked for
    failed: dict[str, int] = {}  # engine -> the S at which its launches reported an error (not run after it)
    # a case on the CPU, or the default S list on a GPU, takes minutes in all: say which case runs now
    task = progress.add(f"MoE layer on {dev}", len(tokens) * len(timed)) if progress is not None else None
    done = 0
    for s in tokens:
        if progress is not None and timed:  # the reference and plain read below are the first case's wait
            progress.update(task, done, description=f"{timed[0]} S={s}")
        xs = layer_inputs(model, s, rotate, dev, dtype, seed + s)
        ref32 = fp32_reference(model, xs[0], seed)  # every engine is checked against it or against a checked one
        ref = fwd["unfused"](xs[0]) if "unfused" in fwd else None
        # the unfused output is the other engines' reference only where it is the fp32 reference's within its bound
        ref_wrong = None if ref is None else output_problem(ref, ref32, reference_bound("unfused"),
                                                            "the unfused layer against the fp32 dense reference")
        read = Summary.of(time_plain_read(src.w_gate_up.data, src.w_down.data, plain_read_experts(model, s),
                                          warmup=warmup, iters=iters, graph=graph, cuda=cuda, rest_s=rest_s)).quantiles()
        for i, eng in enumerate(timed):
            if progress is not None and i:
                progress.update(task, done, description=f"{eng} S={s}")
            if eng in failed:
                cases.append({"engine": eng, "S": s, "failed": f"not run: its launches failed at S={failed[eng]}"})
            else:
                row: dict[str, Any] = {"engine": eng, "S": s, **floors(model, s, rates), "plain_read_us": read}
                for name, v in time_layer(fwd[eng], xs, warmup=warmup, iters=iters, graph=graph, cuda=cuda,
                                          rest_s=rest_s).items():
                    row[name] = Summary.of(v).quantiles()
                # checked after the timed calls, outside them
                if eng == "unfused":
                    row["rel_err_vs_reference"] = rel_err(ref, ref32)
                    wrong = ref_wrong
                elif ref is not None and ref_wrong is None:
                    row["rel_err_vs_unfused"] = rel_err(fwd[eng](xs[0]), ref)
                    wrong = rel_err_problem(row["rel_err_vs_unfused"], PAIR_REL_ERR_BOUND,
                                            "the layer against the unfused engine's output")
                else:  # no (right) unfused output beside it: the fp32 reference
                    out = fwd[eng](xs[0])
                    row["rel_err_vs_reference"] = rel_err(out, ref32)
                    wrong = output_problem(out, ref32, reference_bound(eng), "the layer against the fp32 dense reference")
                why = device_error(layers.get(eng))  # e.g. a timed-out wait: its fast calls are no timing row
                if why is not None:
                    failed[eng] = s
                    row = {"engine": eng, "S": s, "failed": why}
                elif wrong is not None:  # a wrong output's calls are no timing either (it runs again at the next S)
                    row = {"engine": eng, "S": s, "failed": wrong,
                           **{k: row[k] for k in ("rel_err_vs_unfused", "rel_err_vs_reference") if k in row}}
                cases.append(row)
            done += 1
            if progress is not None:
                progress.update(task, done)
    return {**report, "cases": cases}
