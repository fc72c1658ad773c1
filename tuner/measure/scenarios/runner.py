"""Running a scenario: its launches planned and run on this machine, one stamped row per case and metric."""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moetune.tuner.measure import results as R
from moetune.tuner.measure.scenarios.checkout import SUMMARY_CSV
from moetune.tuner.measure.scenarios.definitions import Needs, Scenario
from moetune.tuner.measure.scenarios.drivers.registry import DRIVERS, SINGLE_SHOT
from moetune.tuner.measure.scenarios.errors import ScenarioError
from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved
from moetune.tuner.measure.scenarios.stamp import machine_facts


def plan(s: Scenario, case: str | None, smoke: bool) -> list[Resolved]:
    """The cases of one launch in order: the baseline first and (with more than one case, and a driver that times
    its cases one by one) again last; a single-shot driver times them all in one process, the baseline once."""
    chosen = [c for c in s.cases if (c.smoke or not smoke)]
    if case is not None:
        names = [c.name for c in s.cases]
        if case not in names:
            raise ScenarioError(f"scenario {s.name} has no case {case!r}; its cases: {', '.join(names)}")
        if smoke and not next(c for c in s.cases if c.name == case).smoke:
            raise ScenarioError(f"case {case!r} of {s.name} has no smoke variant (GPU only)")
        chosen = [c for c in chosen if c.name in (s.baseline.name, case)]
    seq = chosen + ([chosen[0]] if len(chosen) > 1 and s.driver not in SINGLE_SHOT else [])
    return [Resolved(c.name, {**s.args, **c.args, **(s.smoke_args if smoke else {}), **(c.smoke_args if smoke else {})},
                     {**s.env, **c.env}, dict(c.options)) for c in seq]


def check_machine(s: Scenario, smoke: bool, gpus: int) -> Needs:
    """The needs that apply, or a ScenarioError saying what this machine lacks."""
    if smoke and s.smoke_skip:
        raise ScenarioError(f"scenario {s.name} has no CPU smoke variant: {s.smoke_skip}")
    n = s.smoke_needs if smoke else s.needs
    if n.gpus > gpus:
        # the smoke run is named only where there is one (proxy-fences has none: it was offered, then refused)
        smoke_hint = (f"it has no CPU smoke variant: {s.smoke_skip}" if s.smoke_skip
                      else f"`moetune bench run {s.name} --smoke` checks its plumbing on CPU")
        raise ScenarioError(f"scenario {s.name} needs {n.describe()} ({n.hardware}); this machine has "
                            f"{gpus} CUDA GPU{'s' if gpus != 1 else ''}. {smoke_hint}")
    if n.world > spawn_limit():
        raise ScenarioError(f"scenario {s.name} needs world {n.world}: too many ranks to spawn here")
    return n


def spawn_limit() -> int:
    """The most ranks a measurement spawns on this machine's CPUs (gloo, or processes beside their GPUs): 8 a CPU
    (8 ranks on 2 CPUs run, slowly; hundreds of torch processes would only exhaust the machine)."""
    return (os.cpu_count() or 1) * 8


def run(s: Scenario, *, case: str | None = None, launches: int | None = None, smoke: bool = False,
        results: Path = SUMMARY_CSV, progress: Callable[[str], None] | None = None,
        gpus: int | None = None, fingerprint: Callable[[], str] | None = None,
        on_saved: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Run the scenario's launches, append one row per (case, launch, metric) to `results`, return the rows.
    `on_saved`: called with each launch's rows once they are in `results` (what an interrupted run has kept)."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needs = check_machine(s, smoke, gpus)
    seq = plan(s, case, smoke)
    n_launch = launches if launches is not None else (1 if smoke else s.launches)
    if n_launch < 1:
        raise ScenarioError(f"--launches must be >= 1, got {n_launch}")
    facts = machine_facts(needs.backend, fingerprint)
    rows: list[dict[str, Any]] = []
    for li in range(n_launch):
        stamp = dt.datetime.now(dt.UTC)
        launch_id = f"{stamp:%Y%m%dT%H%M%SZ}-{li + 1}"
        if progress:
            progress(f"{s.name}: launch {li + 1}/{n_launch}, {len(seq)} case runs")
        with tempfile.TemporaryDirectory(prefix="moetune-bench-") as tmp:
            ctx = Ctx(world=needs.world, backend=needs.backend, smoke=smoke, tmp=Path(tmp))
            t0 = time.monotonic()
            out = DRIVERS[s.driver](seq, ctx)
        new_rows = launch_rows(s, out, launch_id, {"source": "smoke" if smoke else "measured",
                                                   "date": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                                   "world": needs.world, "backend": needs.backend, **facts})
        for r in new_rows:  # a prediction a run made is stored as modelled, never as measured
            if r["source"] == "measured" and R.is_modelled(r):
                r["source"] = "modelled"
        try:
            # another run may have started in the same second: a launch id the table holds moves to a free one
            R.append_or_keep(results, new_rows, fresh_launch=True)
        except R.RowsNotSaved as e:  # kept elsewhere; no further launch is run into a table that takes no rows
            if n_launch > 1:
                left = n_launch - li - 1
                e.args = (f"{e}. They are the rows of launch {li + 1} of {n_launch}"
                          + (f"; the {len(rows)} row(s) of the launches before it are in {results}" if rows else "")
                          + (f"; launch {n_launch} was not run" if left == 1 else
                             f"; launches {li + 2}..{n_launch} were not run" if left > 1 else ""),)
            raise
        rows += new_rows
        if on_saved:
            on_saved(new_rows)
        if progress:
            failed = len({r["position"] for r in new_rows if str(r.get("note", "")).startswith("FAILED")})
            progress(f"{s.name}: launch {li + 1} done in {time.monotonic() - t0:.1f} s, {len(new_rows)} rows"
                     + (f", {failed} case run(s) FAILED" if failed else ""))
    return rows


def _failed_metrics(s: Scenario, r: CaseResult) -> dict[str, str]:
    """{metric: why} of the metrics a case failed on: those its driver names, and where it reported an error it gave
    no such list for (or no metric at all), every metric the scenario lists that it did not produce. A listed metric
    missing without an error is one the case does not give (a case without a CUDA graph has no graph_us)."""
    out = {m: why for m, why in r.failed.items() if m not in r.metrics}
    if not r.metrics or (r.error and not r.failed):
        out.update((m, r.error or "no result") for m in s.metrics if m not in r.metrics and m not in out)
    return out


def launch_rows(s: Scenario, out: Sequence[CaseResult], launch_id: str, stamp: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (case, metric) of one launch and one FAILED row per metric a case failed on (`_failed_metrics`),
    each with `stamp` (source, date, world, backend and the machine facts). A metric the scenario declares modelled
    has MODELLED in its unit (`_unit`), so `run` stores its rows as `modelled`, FAILED ones too."""
    # a FAILED row takes the unit another case gave the metric (none gave it: a launch that failed as a whole)
    units = {name: st.unit for r in out for name, st in r.metrics.items()}
    rows: list[dict[str, Any]] = []
    for pos, r in enumerate(out):
        common = {"scenario": s.name, "case": r.case, "baseline": r.case == s.baseline.name, "position": pos,
                  "launch": launch_id, "command": r.command, **stamp}
        for name, st in r.metrics.items():
            rows.append({**common, "metric": name, "unit": _unit(s, name, st.unit), "median": st.median, "p10": st.p10,
                         "p90": st.p90, "n": st.n, "note": "; ".join(x for x in (r.error, r.note) if x)[:300]})
        for name, why in _failed_metrics(s, r).items():
            rows.append({**common, "metric": name, "unit": _unit(s, name, units.get(name, "")),
                         "note": f"FAILED: {why}"[:300]})
    return rows


def _unit(s: Scenario, metric: str, unit: str) -> str:
    """A row's unit: the driver's, with MODELLED added where the scenario declares the metric a prediction and the
    driver's unit does not say so (a FAILED row of a metric no case produced has no unit of the driver's at all: it
    was stored `measured` with unit "" and headed the summary as a measurement)."""
    if s.is_modelled(metric) and "MODELLED" not in unit:
        return f"{unit} MODELLED".strip()
    return unit
