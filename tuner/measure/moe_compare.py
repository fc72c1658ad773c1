"""Knob sets of the MoE layer side by side in one process, interleaved call by call.

What this answers ("is combine_tokens=2 faster than 8 at S=16?") is often a few µs on a layer of 200-800 µs. On an
H200, whole rounds of 200 replays drift 10-15 µs against each other within one process and GPUs of one kind differ
by up to ~55 µs at S=4096 (bench/results/megakernel, runs 117 and 145-146), so timing each variant in its own
block, or in its own process, cannot resolve it. Here every variant is timed in rounds of one call each, the order
rotated every round, and what is reported besides each variant's own median is its per-round difference to the
base (the first variant): the drift moves both calls of a round alike and cancels in the difference.

Two kinds of calls, each interleaved that way: single calls (a CUDA-graph replay per input on a GPU), and chains of
`chained` forwards in one graph (µs per forward). A setting that changes what a layer leaves behind for the next
one (dirty L2 lines to write back, run 142) shows within its own chain, while interleaved single calls hand that
effect to whichever variant runs next. On a CPU (no graphs) both are eager calls timed with perf_counter: a
plumbing check, not a measurement of the megakernel.

Used by `moetune bench knobs` and the `moe-knobs` scenario driver.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moetune.runtime.knobs import MK_KNOBS, Knobs
from moetune.runtime.shapes import ModelShape
from moetune.runtime.testing.timing import graphs_of, time_interleaved
from moetune.tuner.measure.moe import (
    PAIR_REL_ERR_BOUND,
    device_error,
    fp32_reference,
    layer_inputs,
    output_problem,
    reference_bound,
    rel_err,
    warmup_for,
)
from moetune.tuner.measure.outputs import rel_err_problem
from moetune.tuner.measure.stats import Summary

_DEFAULT_KNOBS = Knobs().to_dict()  # the EP knobs' defaults: what a one-device layer runs whatever they say


def parse_variants(text: str, base: Knobs) -> dict[str, Knobs]:
    """`NAME=KNOBS;NAME=KNOBS` (each KNOBS as `--knobs` takes them, on top of `base`) -> {name: Knobs}.

    Raises ValueError naming the item that is malformed or repeats a name, KnobError for a bad knob."""
    out: dict[str, Knobs] = {}
    items = [p.strip() for p in text.split(";")]
    if text.strip() and "" in items:  # "a=mk_bm=16;;b=mk_bm=64": a lost variant, not to skip without a word
        raise ValueError(f"expected NAME=KNOBS;NAME=KNOBS, got {text!r} (an empty item)")
    for item in items if text.strip() else []:
        name, sep, knobs = item.partition("=")
        name = name.strip()
        # KNOBS without any "=" ("compression=fp8_e4m3": a knob where the variant's name goes) was parsed as the
        # knobs and refused with the knob parser's "expected name=value, got 'fp8_e4m3'", which names no variant
        if not sep or not name or "," in name or (knobs.strip() and "=" not in knobs):
            knob = (f"; {name!r} is a knob: name the variant first (e.g. v1={item})"
                    if name in base.to_dict() else "")
            raise ValueError(f"a variant is NAME=KNOBS, its name then its knobs (e.g. narrow=mk_bn=128), "
                             f"got {item!r}{knob}")
        if name in out or name == "base":
            raise ValueError(f"variant name {name!r} given twice (or 'base', the name of --knobs' variant)")
        if not knobs.strip():  # `a=` parsed to the base's knobs: the base measured again under another name
            raise ValueError(f"variant {name!r} sets no knob ({item!r}): it would be the base variant again; give "
                             f"its knobs after the name (e.g. {name}=mk_bn=128), or, to time the base against "
                             f"itself on purpose, one of the base's own (e.g. {name}=engine={base.engine})")
        out[name] = Knobs.parse(knobs, base=base)
    if not out:
        raise ValueError("give at least one variant: NAME=KNOBS;NAME=KNOBS")
    return out


def changed_knobs(k: Knobs, base: Knobs | None = None) -> str:
    """The knobs of `k` that differ from `base` (default: the defaults), as `name=value,..` (`--knobs`' form)."""
    ref = (base or Knobs()).to_dict()
    return ",".join(f"{n}={v}" for n, v in k.to_dict().items() if ref.get(n) != v)


def paired(samples: Mapping[str, Sequence[float]], base: str) -> dict[str, dict[str, float]]:
    """Per variant other than `base`: median / p10 / p90 of its samples minus `base`'s of the same round."""
    ref = samples[base]
    return {n: Summary.of([a - b for a, b in zip(v, ref, strict=True)]).quantiles()
            for n, v in samples.items() if n != base}


def compare_knobs(model: ModelShape, tokens: Sequence[int], variants: Mapping[str, Knobs], *, iters: int = 200,
                  warmup: int = 20, rotate: int = 8, chained: int = 20, seed: int = 0, device: str | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`_compare_knobs` with `device` (a CUDA one) the current device throughout, as `moe.bench_moe` makes it: the
    timers, graphs and syncs use the current device's stream, so with another GPU current they timed that GPU's idle
    stream while the layers launched on theirs, and captured graphs that hold none of the layers' launches."""
    import contextlib

    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        return _compare_knobs(model, tokens, variants, iters=iters, warmup=warmup, rotate=rotate, chained=chained,
                              seed=seed, dev=dev, progress=progress)


def _compare_knobs(model: ModelShape, tokens: Sequence[int], variants: Mapping[str, Knobs], *, iters: int,
                   warmup: int, rotate: int, chained: int, seed: int, dev: Any,
                   progress: Callable[[str], None] | None) -> dict[str, Any]:
    """Every variant (the first is the base) at every S, side by side: {"cases": [{variant, S, single_us, chain_us,
    minus_base_us, chain_minus_base_us, rel_err_vs_base}], ...}; the quantiles are µs (chains: per forward).

    Each variant is one `MoELayer` built with its knobs (its `engine` knob picks the engine; the same seed, so the
    same weights); a variant whose engine cannot run here is a case `{"variant", "skipped": why}`, and one whose
    launches recorded a device-side error while timed (`device_error`) a case `{"variant", "S", "failed": why}`
    instead of its timing row; it is not run at later S (none is once the base failed: every difference is to it).
    Outputs are checked after the timed calls, outside them: the base's against the fp32 dense reference
    (`moe.fp32_reference` within `moe.reference_bound` of its engine; its `rel_err_vs_reference`), every other
    variant's against the base's within PAIR_REL_ERR_BOUND (`rel_err_vs_base`), or, where the base was skipped or
    its output is wrong or its launches failed at that S, against the fp32 reference (`rel_err_vs_reference`). A
    variant whose output at S is wrong is a failed case at that S (with that error). The base is the first variant
    whether it ran or not: a variant timed without a difference to it says why in `no_difference`."""
    import torch

    from moetune.runtime.megakernel.engine import MegakernelUnavailable
    from moetune.runtime.moe_layer import MoELayer

    names = list(variants)
    if not names:
        raise ValueError("compare_knobs needs at least one variant")
    if not tokens or any(t < 1 for t in tokens):
        raise ValueError(f"tokens must be positive integers, got {list(tokens)}")
    if min(iters, rotate, chained) < 1 or warmup < 0:
        raise ValueError(f"iters, rotate and chained must be >= 1 and warmup >= 0, got {iters}, {rotate}, {chained}, "
                         f"{warmup}")
    for n in names:
        # the layers run on one device (world 1): no EP exchange reads a transport knob, so a variant of num_sms=8
        # was timed as the base again and its difference reported as that knob's effect
        other = [k for k, v in variants[n].to_dict().items() if k not in MK_KNOBS and v != _DEFAULT_KNOBS[k]]
        if other:
            raise ValueError(f"variant {n!r}: {', '.join(other)} {'is' if len(other) == 1 else 'are'} not read by the "
                             "MoE layer on one device (no EP exchange): compare engine and mk_* knobs")
    warmup, raised = warmup_for(warmup, rotate)  # no rotated input has its first eager call timed (moe.warmup_for)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    layers: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for n in names:
        try:
            layers[n] = MoELayer(model, None, variants[n], max_tokens=max(tokens), device=dev, dtype=dtype, seed=seed,
                                 engine=variants[n].engine)
        except MegakernelUnavailable as e:
            skipped[n] = str(e)
    cases: list[dict[str, Any]] = [{"variant": n, "skipped": why} for n, why in skipped.items()]
    run = [n for n in names if n in layers]
    # the base is the first variant, run or not: where it was skipped the others are timed without a difference to
    # it (said in each row), never against the next variant instead (that rebased every "minus base" silently)
    base = names[0]
    failed: dict[str, str] = {}  # variant -> why its launches failed (not run at later S)
    for s in tokens:
        # after a failure the failed variants are not run again, and none once the base failed
        stop = set(run) if base in failed else set(failed)
        why_not = "the base's launches failed at an earlier S" if base in failed else "its launches failed at an earlier S"
        cases += [{"variant": n, "S": s, "failed": f"not run: {why_not}"} for n in run if n in stop]
        live = [n for n in run if n not in stop]
        if not live:
            continue
        if progress:
            progress(f"S={s}: {len(live)} variants, {iters} interleaved rounds")
        xs = layer_inputs(model, s, rotate, dev, dtype, seed + s)
        ref32 = fp32_reference(model, xs[0], seed)
        ref = layers[base](xs[0]) if base in live else None
        # the base is checked too (before, never): a wrong base fails the right variants beside it ("not the base's
        # output") and makes their differences differences to a wrong layer
        base_wrong = None if ref is None else output_problem(ref, ref32, reference_bound(variants[base].engine),
                                                             "the base's layer against the fp32 dense reference")
        single, chain = {}, {}
        for n in live:
            fwd = layers[n].forward

            def chain_of(x: Any, fwd: Callable[[Any], Any] = fwd) -> None:  # forwards back to back, no host step between
                for _ in range(chained):
                    fwd(x)

            if cuda:
                single[n] = graphs_of(fwd, xs)
                chain[n] = graphs_of(chain_of, xs[:2])
            else:
                single[n] = [lambda x=x, f=fwd: f(x) for x in xs]
                chain[n] = [lambda x=x, c=chain_of: c(x) for x in xs[:2]]
        one = time_interleaved(single, warmup=warmup, iters=iters, cuda=cuda)
        # the chains rotate over (up to) two inputs: the same rule, at least one untimed round per input
        many = {n: [t / chained for t in v]
                for n, v in time_interleaved(chain, warmup=max(len(xs[:2]), warmup // 4), iters=iters,
                                             cuda=cuda).items()}
        d1, dn = (paired(one, base), paired(many, base)) if base in live else ({}, {})
        outs = {n: layers[n](xs[0]) for n in live if n != base}
        # a failed launch (e.g. a timed-out wait) returns as fast as a good one: its samples are not a timing
        failed.update((n, why) for n in live if (why := device_error(layers[n])) is not None)
        # the base's output is the others' reference at this S, and their differences are to it, only where it ran
        # right; else why there is no difference to it
        no_diff = (f"the base variant {base!r} was skipped ({skipped[base]})" if base in skipped
                   else f"the base's launches failed at S={s}" if base in failed
                   else f"the base's output was wrong at S={s}" if base_wrong is not None else None)
        base_ok = no_diff is None
        for n in live:
            if n in failed:
                cases.append({"variant": n, "S": s, "failed": failed[n]})
                continue
            if n == base:
                key, err, wrong = "rel_err_vs_reference", rel_err(ref, ref32), base_wrong
            elif base_ok:
                key, err = "rel_err_vs_base", rel_err(outs[n], ref)
                wrong = rel_err_problem(err, PAIR_REL_ERR_BOUND, "the layer against the base's output")
            else:
                key, err = "rel_err_vs_reference", rel_err(outs[n], ref32)
                wrong = output_problem(outs[n], ref32, reference_bound(variants[n].engine),
                                       "the layer against the fp32 dense reference")
            if wrong is not None:  # a wrong output's calls are no timing (runs again at the next S)
                cases.append({"variant": n, "S": s, "failed": wrong, key: err})
                continue
            row: dict[str, Any] = {"variant": n, "S": s, "single_us": Summary.of(one[n]).quantiles(),
                                   "chain_us": Summary.of(many[n]).quantiles()}
            if n != base and base_ok:  # a difference to a skipped, failed or wrong base is no measurement
                row.update(minus_base_us=d1[n], chain_minus_base_us=dn[n])
            elif n != base:
                row["no_difference"] = f"no difference to the base at S={s}: {no_diff}"
            row[key] = err
            cases.append(row)
    return {"model": model.name, "device": str(dev), "graph": cuda, "iters": iters, "warmup": warmup, "rotate": rotate,
            **({"warmup_note": raised} if raised else {}), "chained": chained, "base": base, "variants": {n: changed_knobs(k) for n, k in variants.items()},
            "cases": cases}
