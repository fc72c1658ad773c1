"""The MoE drivers: moe (the layer's engines) and moe-knobs (knob sets interleaved), in one process each."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from moetune.tuner.measure.scenarios.drivers.registry import driver
from moetune.tuner.measure.scenarios.errors import ScenarioError
from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved, Stat, type_problem


def moe_tokens(args: dict[str, Any]) -> list[Any]:
    """A moe case's `tokens` as the list run_moe times: one count (`tokens = 16`) is [16]."""
    toks = args.get("tokens", [128])
    return toks if isinstance(toks, list) else [toks]


def moe_command(args: dict[str, Any], engines: Sequence[str]) -> str:
    """The `moetune bench moe` command that measures these cases on its own."""
    a = ["moetune", "bench", "moe", "--engine", ",".join(engines), "--model", str(args.get("model", "qwen3-30b")),
         "--tokens", ",".join(map(str, moe_tokens(args)))]
    for k in ("iters", "warmup", "rotate", "knobs", "rest", "seed"):  # seed: the weights and inputs run_moe times
        if args.get(k) not in (None, ""):
            a += ["--" + k, str(args[k])]
    if args.get("cuda_graph"):
        a.append("--cuda-graph")
    return " ".join(map(shlex.quote, a)) + " --json"


def per_case(rep: dict[str, Any], who: str, keys: Sequence[tuple[str, str]]
              ) -> tuple[dict[str, dict[str, Stat]], dict[str, str]]:
    """A moe report's rows by `who` (engine / variant): {who: {"metric[S=N]": Stat}} for each (report key, metric
    name) in `keys`, and {who: the CaseResult error} for the skipped ones ("SKIPPED: why") and those with a failed
    row ("S=N failed: why": their launches reported an error, no timing; the case fails)."""
    per: dict[str, dict[str, Stat]] = {}
    skipped: dict[str, str] = {}
    for r in rep["cases"]:
        if "skipped" in r:
            skipped[r[who]] = f"SKIPPED: {r['skipped']}"
            continue
        if "failed" in r:
            skipped.setdefault(r[who], f"S={r['S']} failed: {r['failed']}")  # the first failure
            continue
        m = per.setdefault(r[who], {})
        for key, name in keys:
            if key in r:
                q = r[key]
                m[f"{name}[S={r['S']}]"] = Stat(q["median"], q["p10"], q["p90"], rep["iters"], "us")
    return per, skipped


def failed_rows(rep: dict[str, Any], who: str, keys: Sequence[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """A moe report's failed rows by `who`: {who: {"metric[S=N]": why}} for each metric name in `keys` (a failed row
    has no timing at that S: each metric it would have given fails there, with the report's own reason)."""
    out: dict[str, dict[str, str]] = {}
    for r in rep["cases"]:
        if "failed" in r and "skipped" not in r:
            out.setdefault(r[who], {}).update((f"{name}[S={r['S']}]", f"S={r['S']} failed: {r['failed']}")
                                              for _, name in keys)
    return out


_MOE_KEYS = ("model", "tokens", "engine", "iters", "warmup", "rotate", "knobs", "cuda_graph", "seed", "rest")
# (report key, metric name) of a bench moe report's timings of an engine
MOE_TIMINGS = (("eager_us", "layer_us"), ("graph_us", "graph_us"))
# and of the plain read of the weights the layer touches, timed in the same process at each S (`moe.time_plain_read`):
# the floor `bench moe` prints beside the engines, stored with each engine's rows (it was dropped, and numbers quoted
# from `bench moe` tables had no row to come from)
PLAIN_READ = ("plain_read_us", "plain_read_us")


@driver("moe", single_shot=True)
def run_moe(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    """The MoE layer's engines (`engine` per case) in ONE process (tuner/measure/moe.py), per S: metrics
    `layer_us[S=N]` (eager), `graph_us[S=N]` (CUDA-graph replay) and `plain_read_us[S=N]` (the plain read of the
    weights the layer touches, timed beside it at that S: the same figure in every engine's rows). An engine that
    cannot run here is a case without rows and its reason."""
    from moetune.runtime.knobs import KnobError, Knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    for c in cases:
        unknown = set(c.args) - set(_MOE_KEYS)
        if unknown:
            raise ScenarioError(f"case {c.name}: unknown moe argument(s) {sorted(unknown)}; known: {', '.join(_MOE_KEYS)}")
    a = cases[0].args
    engines = list(dict.fromkeys(str(c.args.get("engine", c.name)) for c in cases))
    cmd = moe_command(a, engines)
    try:
        toks = a.get("tokens", [128])
        rep = M.bench_moe(get_model(str(a.get("model", "qwen3-30b"))), toks if isinstance(toks, list) else [int(toks)],
                          engines, graph=bool(a.get("cuda_graph")), iters=int(a.get("iters", 50)),
                          warmup=int(a.get("warmup", 10)), rotate=int(a.get("rotate", 4)), seed=int(a.get("seed", 0)),
                          knobs=Knobs.parse(str(a.get("knobs", "")), base=Knobs(engine="megakernel")),
                          rest_s=float(a.get("rest", 0.0)))
    except (ValueError, KnobError, RuntimeError) as e:
        return [CaseResult(c.name, {}, cmd, str(e)) for c in cases]
    except TypeError as e:  # `iters = [3]`, `tokens = ["4"]`: the cases fail, not `bench run` (a traceback)
        return [CaseResult(c.name, {}, cmd, type_problem(e, a)) for c in cases]
    per, skipped = per_case(rep, "engine", (*MOE_TIMINGS, PLAIN_READ))
    failed = failed_rows(rep, "engine", MOE_TIMINGS)  # the plain read is timed before the engine: it did not fail
    out = []
    for c in cases:
        eng = str(c.args.get("engine", c.name))
        # a warm-up below the rotation was raised (moe.warmup_for): said in the rows' note
        out.append(CaseResult(c.name, per.get(eng, {}), cmd, skipped.get(eng, ""), failed.get(eng, {}),
                              note=rep.get("warmup_note", "")))
    return out


_KNOBS_KEYS = ("model", "tokens", "knobs", "iters", "warmup", "rotate", "chain", "seed")


@driver("moe-knobs", single_shot=True)
def run_moe_knobs(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    """Knob sets of the MoE layer (`knobs` per case: the first case's on top of engine=megakernel is the base, every
    other case's on top of the base, as `moetune bench knobs --knobs BASE --vs ...` takes them) in ONE
    process, interleaved call by call (tuner/measure/moe_compare.py). Metrics per S: `graph_us[S=N]` (single replays;
    `layer_us` without a GPU), `chain_us[S=N]` (per forward in chains of `chain`), and for the other cases
    `minus_base_us[S=N]` / `chain_minus_base_us[S=N]` (per-round differences to the base case)."""
    from moetune.runtime.knobs import KnobError, Knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe_compare as MC

    for c in cases:
        unknown = set(c.args) - set(_KNOBS_KEYS)
        if unknown:
            raise ScenarioError(f"case {c.name}: unknown moe-knobs argument(s) {sorted(unknown)}; known: "
                                f"{', '.join(_KNOBS_KEYS)}")
    a = cases[0].args
    toks = moe_tokens(a)  # each made an int inside the try below: a bad one fails the cases, not `bench run`
    cmd = shlex.join(["moetune", "bench", "knobs", "--knobs", str(a.get("knobs", "")), "--vs",
                      ";".join(f"{c.name}={c.args.get('knobs', '')}" for c in cases[1:]), "--model",
                      str(a.get("model", "qwen3-30b")), "--tokens", ",".join(map(str, toks)),
                      *(x for k in ("iters", "warmup", "rotate", "chain", "seed") if k in a for x in ("--" + k, str(a[k])))])
    try:
        base = Knobs.parse(str(a.get("knobs", "")), base=Knobs(engine="megakernel"))
        variants = {cases[0].name: base, **{c.name: Knobs.parse(str(c.args.get("knobs", "")), base=base) for c in cases[1:]}}
        rep = MC.compare_knobs(get_model(str(a.get("model", "qwen3-30b"))), [int(t) for t in toks], variants,
                               iters=int(a.get("iters", 200)), warmup=int(a.get("warmup", 20)),
                               rotate=int(a.get("rotate", 8)), chained=int(a.get("chain", 20)), seed=int(a.get("seed", 0)))
    except (ValueError, KnobError, RuntimeError) as e:
        return [CaseResult(c.name, {}, cmd, str(e)) for c in cases]
    except TypeError as e:  # `chain = [2]`: the cases fail, not `bench run` (a traceback)
        return [CaseResult(c.name, {}, cmd, type_problem(e, a)) for c in cases]
    single = "graph_us" if rep["graph"] else "layer_us"
    per, skipped = per_case(rep, "variant", (("single_us", single), ("chain_us", "chain_us"),
                                              ("minus_base_us", "minus_base_us"),
                                              ("chain_minus_base_us", "chain_minus_base_us")))
    failed = failed_rows(rep, "variant", (("single_us", single), ("chain_us", "chain_us")))
    diffs = failed_rows(rep, "variant", (("minus_base_us", "minus_base_us"),
                                          ("chain_minus_base_us", "chain_minus_base_us")))
    for n, m in diffs.items():  # the base has no difference to itself: only the other cases fail on one
        if n != cases[0].name:
            failed.setdefault(n, {}).update(m)
    for r in rep["cases"]:  # timed without a difference to the base (skipped, or failed or wrong at that S): said
        if "no_difference" in r:
            failed.setdefault(r["variant"], {}).update(
                (f"{name}[S={r['S']}]", r["no_difference"]) for name in ("minus_base_us", "chain_minus_base_us"))
    return [CaseResult(c.name, per.get(c.name, {}), cmd, skipped.get(c.name, ""), failed.get(c.name, {}),
                       note=rep.get("warmup_note", "")) for c in cases]
