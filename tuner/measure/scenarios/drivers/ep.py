"""The ep driver: EP dispatch/combine cases through one spawned world, and their `moetune bench ep` command."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from moetune.tuner.measure.scenarios.drivers.registry import driver
from moetune.tuner.measure.scenarios.errors import ScenarioError
from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved, Stat, type_problem


def _from_report(rep: dict[str, Any]) -> dict[str, Stat]:
    """Every timed phase of a `moetune bench ep --json` report (dicts with median/p10/p90) as a Stat."""
    n = int(rep.get("iters") or 1)
    return {k: Stat(v["median"], v.get("p10"), v.get("p90"), n, "us") for k, v in rep.items()
            if isinstance(v, dict) and "median" in v and v["median"] is not None}


def _ep_cases(rank: int, world: int, cfgs: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """launch() target: every case of one group through the same spawned world, in order."""
    from moetune.tuner.measure import ep as bench_ep

    out: list[dict[str, Any]] = []
    for cfg in cfgs:
        try:
            out.append(bench_ep.bench_case(rank, world, cfg) or {})
        except Exception as e:  # raised alike on every rank (bad case): recorded, the next case runs
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out if rank == 0 else None


_EP_KEYS = ("model", "tokens", "knobs", "transport", "layout", "iters", "warmup", "layer", "impl", "routing", "seed",
            "verify", "cuda_graph")


def option_env(options: dict[str, Any]) -> dict[str, str]:
    """Runtime options as the `MOETUNE_*` variables that set them for a command run on its own (`moetune bench ep`
    reads them through RuntimeOptions.resolve): booleans 1/0, lists comma-separated."""
    from moetune.runtime.options import OPTION_DOCS

    def text(v: Any) -> str:
        if isinstance(v, bool):
            return "1" if v else "0"
        return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    return {doc.env: text(options[doc.name]) for doc in OPTION_DOCS if doc.name in options}


def _command_knobs(args: dict[str, Any]) -> Any:
    """The --knobs of a case's `moetune bench ep` command. The case runs `knobs` on the defaults with `transport` put
    in (worker.case_config); `bench ep --transport T` starts from T's safe defaults (`default_knobs`: nvlink's
    signalling is coupled, the defaults' decoupled), so where they differ the command names each knob that ran
    apart from T's defaults. A case whose knobs do not parse (it fails) keeps its own."""
    from moetune.runtime.knobs import KnobError, Knobs, default_knobs

    given, t = args.get("knobs"), args.get("transport")
    if not t or not isinstance(given, str | None):
        return given
    try:
        ran = Knobs.parse(given or "").replace(transport=t)
        if Knobs.parse(given or "", base=default_knobs(t)).replace(transport=t) == ran:
            return given  # `--transport` runs them already: the command as the scenario gives it
        base = default_knobs(t).to_dict()
    except KnobError:
        return given
    return ",".join(f"{k}={v}" for k, v in ran.to_dict().items() if k != "transport" and v != base[k])


def ep_command(args: dict[str, Any], env: dict[str, str], world: int, backend: str,
               options: dict[str, Any] | None = None) -> str:
    """The `moetune bench ep` command that runs this one case on its own (its runtime options as their variables)."""
    env = {**env, **option_env(options or {})}
    a = ["moetune", "bench", "ep", "--world", str(world), "--backend", backend]
    knobs = _command_knobs(args)
    for k in ("model", "tokens", "transport", "layout", "knobs", "routing", "impl", "iters", "warmup", "seed"):
        v = knobs if k == "knobs" else args.get(k)
        if v not in (None, ""):
            a += ["--" + k, str(v)]
    if args.get("layer") is False:
        a.append("--no-layer")
    if args.get("cuda_graph"):
        a.append("--cuda-graph")
    if args.get("verify"):
        a.append("--verify")
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, a), "--json"])


# the note of a case run that was not side by side with the baseline's first run (another spawned world: another set of
# processes): its timings stand, but no ratio to the baseline is taken from them (`scenario_table`)
OTHER_WORLD = "not side by side with the baseline: another spawned world (its env differs)"


@driver("ep")
def run_ep(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    """EP dispatch/combine (`moetune bench ep`'s code): consecutive cases with the same environment share one
    spawned world (started once, then every case through it), so they run side by side; a case's runtime options
    go to its EP buffer (`options=`), so cases that differ only in them share a world too. A case whose round trip
    (or verified layer) gave a wrong output (`outputs.ep_report_problem`) fails with that reason: no timing. A case
    run in another world than the baseline's first run (an env of its own, or the closing baseline run after one)
    says so in its note (`OTHER_WORLD`): its ratio to the baseline would be one across processes."""
    from moetune.runtime.testing.launch import LaunchError, launch
    from moetune.tuner.measure.outputs import ep_report_problem
    from moetune.tuner.measure.worker import case_config

    results: list[CaseResult] = []
    i = 0
    while i < len(cases):
        j = i
        while j < len(cases) and cases[j].env == cases[i].env:
            j += 1
        group, cfgs, bad = cases[i:j], [], {}
        for c in group:
            unknown = set(c.args) - set(_EP_KEYS)
            if unknown:
                raise ScenarioError(f"case {c.name}: unknown ep argument(s) {sorted(unknown)}; known: {', '.join(_EP_KEYS)}")
            try:
                cfg = case_config({k: v for k, v in c.args.items() if k != "cuda_graph"}, ctx.world, ctx.backend)
            except ValueError as e:
                bad[c.name] = str(e)
                cfg = {}
            except TypeError as e:  # `tokens = [16, 128]`: the case fails, not `bench run` (a traceback)
                bad[c.name] = type_problem(e, c.args)
                cfg = {}
            cfg["graph"] = bool(c.args.get("cuda_graph"))
            if c.options:  # the EP buffer's `options=` (RuntimeOptions over the config and the variables)
                cfg["options"] = dict(c.options)
            cfgs.append(cfg)
        todo = [cfg for c, cfg in zip(group, cfgs, strict=True) if c.name not in bad]
        reps: list[dict[str, Any]] = []
        err = ""
        if todo:
            try:
                reps = launch(_ep_cases, ctx.world, backend=ctx.backend, args=(todo,), timeout_s=min(120.0, ctx.timeout_s),
                              join_timeout_s=ctx.timeout_s, env=dict(group[0].env))[0] or []
            except LaunchError as e:
                first = next(iter(sorted(e.errors.items())))
                err = f"launch failed on {len(e.errors)} rank(s); rank {first[0]}: {first[1].splitlines()[0]}"
        it = iter(reps)
        apart = OTHER_WORLD if i > 0 else ""  # the first group holds the baseline's first run
        for c in group:
            cmd = ep_command(c.args, c.env, ctx.world, ctx.backend, c.options)
            if c.name in bad:
                results.append(CaseResult(c.name, {}, cmd, bad[c.name]))
                continue
            rep = next(it, None) if not err else None
            if rep is None or rep.get("error"):
                results.append(CaseResult(c.name, {}, cmd, err or (rep or {}).get("error", "no report")))
            elif (wrong := ep_report_problem(rep)) is not None:  # a wrong output's timings are no measurement
                results.append(CaseResult(c.name, {}, cmd, wrong))
            else:
                # the round trip's graph failed: every graph metric is missing (the error fails each listed one);
                # only dispatch + combine's (graph_pair_error): that metric fails, named, not silently absent
                pair, whole = rep.get("graph_pair_error"), rep.get("graph_error")
                failed = {"graph_pair_us": f"dispatch + combine from a CUDA graph: {pair}"} if pair and not whole else {}
                error = whole or "; ".join(failed.values())
                # a warm-up below the rotation was raised (bench_case): said in the rows' note, as the moe driver does
                note = "; ".join(x for x in (apart, rep.get("warmup_note", "")) if x)
                results.append(CaseResult(c.name, _from_report(rep), cmd, error, failed, note=note))
        i = j
    return results
