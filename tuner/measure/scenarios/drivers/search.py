"""The search-efficiency driver: how many evaluations each search needs (MODELLED latencies)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moetune.tuner.measure.scenarios.drivers.registry import driver
from moetune.tuner.measure.scenarios.drivers.scripts import run_script, script_command
from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved, Stat


def search_metrics(d: dict[str, Any]) -> dict[str, dict[str, Stat]]:
    """bench/search_efficiency.py's JSON per search (random, tpe, cold-tpe): over the preset x model x tokens
    cases, the evaluations each needed to get within 3% of the grid optimum (median over seeds; budget + 1 where it
    never did), the median gap to the optimum (%) and the share of seeds within 0.1% of it (%). Latencies are the
    fabric model's (MODELLED). A case without a feasible grid point has no optimum to measure any search against: it
    is left out of every search alike (`search_left_out` says so in the rows' note; their n counts the cases kept)."""
    out: dict[str, dict[str, Stat]] = {}
    cases = [c for c in d.get("cases", []) if "error" not in c]  # an error case: dropped for every search alike

    def evals_of(c: dict[str, Any], pre: str) -> float | None:
        # never within the budget is budget + 1 for every search (null in an older file: the case was dropped, which
        # favoured the search that missed); a search the file has no count for at all gives none
        key = f"{pre}_evals_to_3pct_median"
        if key not in c:
            return None
        return c[key] if c[key] is not None else c["budget"] + 1

    for name, pre in (("random", "random"), ("tpe", "tpe"), ("cold-tpe", "cold_tpe")):
        evals = [v for c in cases if (v := evals_of(c, pre)) is not None]
        gaps = [100.0 * c[f"{pre}_median_gap"] for c in cases if c.get(f"{pre}_median_gap") is not None]
        hits = [100.0 * c[f"{pre}_hit_rate"] for c in cases if c.get(f"{pre}_hit_rate") is not None]
        m = {}
        # all three come from the fabric model's latencies: predictions, labelled so (results.is_modelled)
        if evals:
            m["evals_to_3pct"] = Stat.of(evals, "evaluations MODELLED")
        if gaps:
            m["median_gap_pct"] = Stat.of(gaps, "% MODELLED")
        if hits:
            m["hit_rate_pct"] = Stat.of(hits, "% MODELLED")
        out[name] = m
    return out


def search_left_out(d: dict[str, Any]) -> str:
    """What bench/search_efficiency.py's cases with an error (no feasible grid point: no optimum) took out of every
    search's numbers, for the rows' note ("" when none)."""
    all_cases = d.get("cases", [])
    bad = [c for c in all_cases if "error" in c]
    if not bad:
        return ""
    named = "; ".join(f"{c.get('preset')} {c.get('model')} S={c.get('tokens')}: {c['error']}" for c in bad[:3])
    return (f"{len(bad)} of {len(all_cases)} cases left out of every search alike (no optimum to measure against): "
            f"{named}{'; ...' if len(bad) > 3 else ''}")


_RESULTS_LINE = re.compile(r"results: (\S+search_efficiency\.json)")
# the script's verdict on its pass check (each case's median best within 3% of the optimum, <= 10% of the grid)
_VERDICT = re.compile(r"^(\d+) of (\d+) cases pass\b.*$", re.MULTILINE)


def _missed_its_check(status: int, stdout: str) -> bool:
    """bench/search_efficiency.py exits 1 where a case misses its pass check, after writing every number (its results
    line): a result, not a failed run (how often a search misses is what the scenario asks). A crash prints no
    results line."""
    return status == 1 and _RESULTS_LINE.search(stdout) is not None


@driver("search-efficiency", single_shot=True)
def run_search(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    """bench/search_efficiency.py runs every search on the same budget in one process; the cases pick one. Where a
    case missed the script's pass check, its verdict goes in the rows' note (a result: `_missed_its_check`)."""
    out = ctx.tmp / "search"
    args = {**cases[0].args, "out": str(out)}
    cmd = script_command("search_efficiency.py", args, cases[0].env)
    try:
        stdout, _ = run_script("search_efficiency.py", args, cases[0].env, ctx, result_anyway=_missed_its_check)
        mm = _RESULTS_LINE.search(stdout)
        doc = json.loads(Path(mm.group(1) if mm else out / "search_efficiency.json").read_text())
        per, left_out = search_metrics(doc), search_left_out(doc)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        return [CaseResult(c.name, {}, cmd, str(e)) for c in cases]
    verdict = _VERDICT.search(stdout)  # said where a case missed the check (every case passing: nothing to say)
    missed = verdict.group(0) if verdict and verdict.group(1) != verdict.group(2) else ""
    note = "; ".join(x for x in (left_out, missed) if x)
    return [CaseResult(c.name, per.get(c.name, {}), cmd,
                       "" if per.get(c.name) else left_out or f"no {c.name} search in the output", note=note)
            for c in cases]
