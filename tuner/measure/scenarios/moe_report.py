"""A `moetune bench moe --json` report measured elsewhere, imported as one launch of a moe scenario."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from moetune.tuner.measure import results as R
from moetune.tuner.measure.scenarios.checkout import SUMMARY_CSV
from moetune.tuner.measure.scenarios.definitions import Scenario
from moetune.tuner.measure.scenarios.drivers.moe import (
    MOE_TIMINGS,
    PLAIN_READ,
    failed_rows,
    moe_tokens,
    per_case,
)
from moetune.tuner.measure.scenarios.errors import ScenarioError
from moetune.tuner.measure.scenarios.records import CaseResult
from moetune.tuner.measure.scenarios.runner import launch_rows, plan

_REPORT_FACTS = ("git_sha", "git_dirty", "moetune", "torch", "nccl", "cuda", "gpu", "gpu_count", "fabric_fingerprint",
                 "hardware", "date", "command")
# the stamp a results row cannot stand without: what code, when, on what, by which command
_REPORT_STAMP = ("git_sha", "date", "gpu", "hardware", "command")


def import_moe_report(s: Scenario, rep: dict[str, Any], *, origin: str, results: Path = SUMMARY_CSV
                      ) -> list[dict[str, Any]]:
    """A `moetune bench moe --json` report measured outside `bench run` (on a GPU machine the tree was copied to) as
    one launch of scenario `s`, rows marked source=imported and stamped with the report's own code, versions,
    hardware, date and command. Refused unless the report measured what the scenario asks (its driver is `moe`; the
    same model, tokens, iterations, warm-ups, rotation, graph mode, idle and engines) and unless that launch is not
    in `results` yet."""
    if s.driver != "moe":
        raise ScenarioError(f"{s.name}: only scenarios of driver moe take a bench moe report (this one: {s.driver})")
    meta = rep.get("meta") if isinstance(rep, dict) else None
    if not isinstance(meta, dict) or any(k not in meta for k in _REPORT_FACTS) or not isinstance(rep.get("cases"), list):
        raise ScenarioError(f"{origin}: not a `moetune bench moe --json` report (its meta needs {', '.join(_REPORT_FACTS)})")
    blank = [k for k in _REPORT_STAMP if not isinstance(meta[k], str) or not meta[k].strip()]
    if blank:  # kept as is, the rows would carry no SHA (or date, machine, command): a claim nobody can trace
        raise ScenarioError(f"{origin}: the report's meta has no {', '.join(blank)} (empty or not text): rows "
                            "without it cannot be traced to the code, date and machine that measured them")
    try:
        out = _report_cases(s, rep, meta, origin)
    except ScenarioError:  # what it says is what is wrong (not "of the expected shape")
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a hand-made or truncated report
        raise ScenarioError(f"{origin}: not a `moetune bench moe --json` report of the expected shape (its cases: "
                            f"{type(e).__name__} {e})") from None
    if not any(st.median is not None for c in out for st in c.metrics.values()) and not any(c.error for c in out):
        raise ScenarioError(f"{origin}: the report holds no measured number (every median is null): nothing to import")
    launch_id = f"{str(meta['date']).replace('-', '').replace(':', '')}-imported"

    def held(table: list[dict[str, str]]) -> bool:
        return any(r["launch"] == launch_id and r["scenario"] == s.name for r in table)

    held_msg = f"{origin}: launch {launch_id} of {s.name} is in {results} already"
    if held(R.read_rows(results)):  # refused early, before the rows are built
        raise ScenarioError(held_msg)
    stamp = {k: meta[k] for k in _REPORT_FACTS if k != "command"}
    rows = launch_rows(s, out, launch_id, {**stamp, "source": "imported", "world": s.needs.world,
                                            "backend": s.needs.backend})
    for r in rows:
        r["note"] = (f"{r['note']}; " if r.get("note") else "") + f"imported from {origin}"
    # asked again under the append's lock: two imports of one report at once both pass the early look
    if not R.append_or_keep(results, rows, skip_if=held):
        raise ScenarioError(held_msg)
    return rows


def _report_seed(rep: dict[str, Any], meta: dict[str, Any]) -> int | None:
    """The seed a bench moe report's weights and inputs were built from: its `seed` (reports since it is written),
    else its command's `--seed N` (the CLI always writes it); None where neither says (refused: unknown weights)."""
    if isinstance(rep.get("seed"), int):
        return rep["seed"]
    m = re.search(r"--seed[ =](\d+)\b", str(meta.get("command", "")))
    return int(m.group(1)) if m else None


def _report_cases(s: Scenario, rep: dict[str, Any], meta: dict[str, Any], origin: str) -> list[CaseResult]:
    """The scenario's cases from a bench moe report, refused where it measured something else."""
    # every case names its engine, and its S or why it was skipped (a KeyError / TypeError: not of the expected shape)
    for c in rep["cases"]:
        c["engine"], (c["skipped"] if "skipped" in c else c["S"])
    from moetune.tuner.measure.moe import warmup_for

    a = plan(s, None, False)[0].args
    want = {"model": str(a.get("model", "qwen3-30b")), "tokens": sorted(moe_tokens(a)),
            # the warm-up bench moe runs for these args (moe.warmup_for: raised to the rotation where below it)
            "iters": int(a.get("iters", 50)), "warmup": warmup_for(int(a.get("warmup", 10)), int(a.get("rotate", 4)))[0],
            "rotate": int(a.get("rotate", 4)),
            "graph": bool(a.get("cuda_graph")), "rest_s": float(a.get("rest", 0.0)), "seed": int(a.get("seed", 0))}
    # a skipped engine has no S: the tokens are those the engines that ran were timed at
    got = {"model": rep.get("model"), "tokens": sorted({c["S"] for c in rep["cases"] if "skipped" not in c}),
           "iters": rep.get("iters"), "warmup": rep.get("warmup"), "rotate": rep.get("rotate"), "graph": rep.get("graph"),
           "rest_s": rep.get("rest_s"), "seed": _report_seed(rep, meta)}
    # the order too: under a power cap the engine timed second pays for the first one's heat (`settle`), so a
    # launch of another order is another measurement (the scenario times its cases in their listed order)
    listed = [str(c.args.get("engine", c.name)) for c in s.cases]
    ran = list(dict.fromkeys(str(c.get("engine")) for c in rep["cases"] if not c.get("skipped")))
    want["engine order"], got["engine order"] = [e for e in listed if e in ran], [e for e in ran if e in listed]
    # the machine: a report measured where the scenario cannot run (a CPU's plumbing check) is not its measurement
    if s.needs.gpus and (int(meta.get("gpu_count") or 0) < s.needs.gpus or str(meta.get("gpu", "")).lower() in ("", "none")):
        want["machine"], got["machine"] = s.needs.hardware, f"{meta.get('gpu_count')} x {meta.get('gpu')}"
    differ = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    if a.get("knobs") or "--knobs" in str(meta["command"]):
        differ["knobs"] = (meta["command"], a.get("knobs", ""))
    if differ:
        raise ScenarioError(f"{origin}: the report did not measure what {s.name} asks: "
                            + "; ".join(f"{k} {g!r} (scenario: {w!r})" for k, (g, w) in differ.items()))
    per, skipped = per_case(rep, "engine", (*MOE_TIMINGS, PLAIN_READ))
    failed = failed_rows(rep, "engine", MOE_TIMINGS)
    for eng, metrics in per.items():  # a timing is a positive finite number, its deciles around its median
        for name, st in metrics.items():
            vals = (st.median, st.p10, st.p90)
            if all(v is None for v in vals):  # not measured (null): the report's "no measured number" check
                continue
            if not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in vals) or not (
                    st.p10 <= st.median <= st.p90):
                raise ScenarioError(f"{origin}: engine {eng} {name}: median {st.median!r}, p10 {st.p10!r}, p90 "
                                    f"{st.p90!r} is no timing (finite, > 0, p10 <= median <= p90)")
    out = []
    for c in s.cases:
        eng = str(c.args.get("engine", c.name))
        if eng not in per and eng not in skipped:
            raise ScenarioError(f"{origin}: the report has no engine {eng!r} (case {c.name} of {s.name})")
        out.append(CaseResult(c.name, per.get(eng, {}), str(meta["command"]), skipped.get(eng, ""), failed.get(eng, {})))
    return out
