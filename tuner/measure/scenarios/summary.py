"""BENCHMARKS.md from summary.csv: per scenario its latest batch, per case medians and the paired ratio."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from moetune.tuner.measure import results as R
from moetune.tuner.measure.scenarios.checkout import ROOT, SUMMARY_CSV
from moetune.tuner.measure.scenarios.definitions import Scenario
from moetune.tuner.measure.scenarios.drivers.ep import OTHER_WORLD


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _f(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _num(v: str) -> float | None:
    """A numeric cell as the summary takes it: None where empty, not a number or not finite ("nan", "inf": such a
    row is left out, as `results.row_problems` warns; it was shown as median "nan" and ratio "nan×")."""
    x = R.fnum(v)
    return x if x is not None and math.isfinite(x) else None


def _failed(r: dict[str, str]) -> bool:
    return str(r.get("note", "")).startswith("FAILED")


def _when(r: dict[str, str]) -> str:
    """A row's date as a sort key: an imported date without a time ("2026-11-30", "2026-11-30Z") is that day's start,
    never later than a timed row of the same day (as a string, "2026-11-30Z" sorted after every one of them)."""
    d = r["date"].removesuffix("Z")
    return d if "T" in d else f"{d}T00:00:00"


def _why(note: str, width: int = 100) -> str:
    """A FAILED row's reason for a Markdown table cell: one line, no column separator, at most `width` characters."""
    w = " ".join(note.removeprefix("FAILED:").split()).replace("|", "/")
    return w if len(w) <= width else w[:width - 1] + "…"


def _origin(r: dict[str, str]) -> str:
    """How a row's launch ran: `imported`, `smoke`, or `run` (by `moetune bench run`; its rows are `measured` or
    `modelled` by metric: one launch of fabric-model holds both, and is one launch)."""
    return r["source"] if r["source"] in ("imported", "smoke") else "run"


# what makes a batch: one tree state (a dirty tree at the same SHA is other code), one machine, one kind of run
_BATCH = ("git_sha", "git_dirty", "hardware")
# the summary's first line: `bench summarize --out` replaces only a file that starts with it (one it wrote)
TITLE = "# moetune benchmarks"


def _batch_key(r: dict[str, str]) -> tuple[str, ...]:
    key = (*(r[k] for k in _BATCH), _origin(r))
    # code not known ("unknown": an imported run no commit can be shown to be, a tree without git), or a dirty tree (a
    # commit with changes on top: two launches at that commit can be any two trees, e.g. before and after an edit):
    # no tree state to pool by, so each launch is a batch of its own (launches of different code never pool as one)
    return (*key, r["launch"]) if r["git_sha"] in ("", "unknown") or r["git_dirty"] == "1" else key


def scenario_table(s: Scenario, rows: list[dict[str, str]], max_cases: int = 8, source: str = "summary.csv"
                   ) -> list[str]:
    """Markdown lines for one scenario: its latest batch of rows (the latest launch's git SHA, dirty flag, hardware
    and kind of run: `bench run`, imported or smoke; never split by the rows' source, which differs by metric within
    one launch), per case the median over launches of each launch's median / p10 / p90 of the first metric present,
    and the ratio to the baseline case (baseline / case for lower-is-better metrics, so > 1 means faster): the median
    over the launches that ran both of the ratio within one launch, never a baseline from another launch. FAILED rows
    belong to the batch like numbers: a case that failed shows "FAILED: why", and a launch that failed as a whole is
    the latest batch, never hidden behind an older batch's numbers. Whatever order the rows come in, the table is
    the same."""
    mine = [r for r in rows if r["scenario"] == s.name and (_num(r["median"]) is not None or _failed(r))]
    real = [r for r in mine if r["source"] != "smoke"]
    use = real or mine
    # the heading, then the question and what the scenario needs as one paragraph (BENCHMARKS.md stays a page a
    # reader takes in: ARCHITECTURE's <= 200 lines for every scenario's headline)
    head = [f"### {s.name}", f"{' '.join(s.question.split())} Driver `{s.driver}`; needs {s.needs.describe()} "
            f"({s.needs.hardware}).", ""]
    if not use:
        return [*head, f"No rows yet: `moetune bench run {s.name}`.", ""]
    # the latest launch (ties on the date broken by the launch and its batch, never by the rows' order), then its batch
    latest = max(use, key=lambda r: (_when(r), R.launch_order(r["launch"]), _batch_key(r)))
    batch = [r for r in use if _batch_key(r) == _batch_key(latest)]
    present = {r["metric"] for r in batch}
    metric = next((m for m in s.metrics if m in present), sorted(present)[0])
    batch = [r for r in batch if r["metric"] == metric]
    order = [c.name for c in s.cases]
    cases = sorted({r["case"] for r in batch}, key=lambda c: (order.index(c) if c in order else len(order), c))
    if any(c in order for c in cases):
        cases = [c for c in cases if c in order] + [c for c in cases if c not in order]
    shown, hidden = cases[:max_cases], len(cases) - max_cases

    def per_launch(c: str, k: str) -> dict[str, float]:
        # one value per launch (the baseline's first and last runs pooled)
        per: dict[str, list[float]] = {}
        for r in batch:
            if r["case"] == c and _num(r[k]) is not None:
                per.setdefault(r["launch"], []).append(_num(r[k]))  # type: ignore[arg-type]
        return {launch: statistics.mean(v) for launch, v in per.items()}

    def stat(c: str, k: str) -> float | None:
        return _med(list(per_launch(c, k).values()))

    bname = next((r["case"] for r in batch if r["baseline"] == "1"), cases[0])

    def side_by_side(c: str) -> dict[str, float]:
        # a case's medians per launch from its runs beside the baseline's first run only (not another spawned world:
        # run_ep's OTHER_WORLD), for the ratio
        per: dict[str, list[float]] = {}
        for r in batch:
            if r["case"] == c and _num(r["median"]) is not None and OTHER_WORLD not in r["note"]:
                per.setdefault(r["launch"], []).append(_num(r["median"]))  # type: ignore[arg-type]
        return {launch: statistics.mean(v) for launch, v in per.items()}

    base = side_by_side(bname)

    def ratio_of(c: str) -> float | None:
        # paired within each launch: a case run in other launches than the baseline's (`--case`, a batch of
        # several runs at one SHA) is compared only with the baseline it ran beside, and only where it ran in the
        # same processes (another spawned world's run gives no ratio: ratios are taken side by side in one process)
        mine = side_by_side(c)
        rs = [(base[lc] / m if s.better == "lower" else m / base[lc]) for lc, m in mine.items()
              if lc in base and base[lc] and m]
        return _med(rs)
    origin = _origin(latest)
    kind = {"smoke": "SMOKE (plumbing check on tiny sizes, not a measurement)", "imported": "imported",
            "run": "measured"}[origin]
    dirty = " (dirty tree)" if latest["git_dirty"] == "1" else ""
    unit = next((r["unit"] for r in batch if r["unit"]), "")
    # predictions: said first, whoever made the rows; by the shown metric's rows and the scenario's declaration
    if s.is_modelled(metric) or any(R.is_modelled(r) or r["source"] == "modelled" for r in batch):
        made = {"run": "made by `moetune bench run`", "imported": "imported", "smoke": "of a smoke run"}[origin]
        kind = f"MODELLED (predictions, not measurements; rows {made})"
    # where it ran: a scenario that declares it needs no GPU measures on the host CPU, also where the machine that
    # ran it has one (its rows are stamped with that GPU): the heading says the CPU, not the GPU, measured
    gpu = latest["gpu"] not in ("", "none")
    if s.needs.gpus == 0 and gpu:
        where = f"on the host CPU, no GPU used (the machine: {latest['hardware']})"
    else:
        where = f"{latest['hardware']}{', GPU ' + latest['gpu'] if gpu else ''}"
    lines = [*head, f"{kind}, {latest['date'][:10]}, `{latest['git_sha'][:10]}`{dirty}, {where}"
             f"; metric `{metric}` ({unit}); "
             f"ratio = {'baseline / case' if s.better == 'lower' else 'case / baseline'} (> 1: better than `{bname}`).",
             "",
             "| case | launches | median | p10 | p90 | ratio |", "| --- | --- | --- | --- | --- | --- |"]
    also: dict[str, list[str]] = {}  # why -> the cases with numbers that failed so in other launches of the batch
    for c in shown:
        m = stat(c, "median")
        ratio = ratio_of(c)
        nl = len({r["launch"] for r in batch if r["case"] == c and not _failed(r)})
        fails = sorted((r for r in batch if r["case"] == c and _failed(r)), key=lambda r: (_when(r), R.launch_order(r["launch"])))
        nf = len({r["launch"] for r in fails})
        cell = f"{nl} + {nf} FAILED" if nf else str(nl)
        if not nl:  # no number in this batch: the failure is the result, never an older batch's number
            lines.append(f"| {c}{' (baseline)' if c == bname else ''} | {cell} | FAILED: {_why(fails[-1]['note'])} "
                         "| - | - | - |")
            continue
        if nf:
            also.setdefault(_why(fails[-1]["note"], 160), []).append(f"`{c}` in {nf}")
        lines.append(f"| {c}{' (baseline)' if c == bname else ''} | {cell} | {_f(m)} | {_f(stat(c, 'p10'))} | "
                     f"{_f(stat(c, 'p90'))} | {'-' if ratio is None else f'{ratio:.2f}×'} |")
    if hidden > 0:
        lines.append(f"| … {hidden} more case(s) in {source} | | | | | |")
    if also:
        lines += ["", "Also FAILED in launches of this batch (the numbers above are the launches that ran): "
                  + "; ".join(f"{', '.join(cs)} launch(es): {why}" for why, cs in also.items()) + "."]
    return [*lines, ""]


def _source_name(source: Path) -> str:
    """How the summary names the results file it was made from: relative to the checkout where it lies in it."""
    try:
        return source.resolve().relative_to(ROOT).as_posix()
    except (ValueError, OSError):
        return str(source)


def summarize(scenarios: dict[str, Scenario], rows: list[dict[str, str]], source: Path = SUMMARY_CSV) -> str:
    """BENCHMARKS.md, generated from `rows` (read from `source`, which the text names): per scenario its question,
    needs and a short table of its latest batch."""
    n_imp = sum(r["source"] == "imported" for r in rows)
    committed = _source_name(source) == _source_name(SUMMARY_CSV)
    name = _source_name(source)
    short = "summary.csv" if committed else f"`{name}`"
    # the committed table's imported rows are known: the lab notebook and reports measured on a GPU machine
    imported = ([f"the older numbers are in `docs/perf-notes.md`; {len(rows)} rows in summary.csv ({n_imp} imported: the",
                 "2026-11-30 lab notebook and reports measured on a GPU machine, `bench run --from-report`; raw logs in",
                 "`bench/results/archive/`). MODELLED units are predictions, not measurements."] if committed else
                [f"the older numbers are in `docs/perf-notes.md`; {len(rows)} rows in {short} ({n_imp} imported). MODELLED",
                 "units are predictions, not measurements."])
    lines = [
        TITLE,
        "",
        f"Generated by `moetune bench summarize` from `{name}`; do not edit by hand. Each scenario",
        "is a file in `bench/scenarios/`; `moetune bench list` shows them, `moetune bench run NAME` measures one",
        "(baseline first in every launch, and again last where the driver times its cases one by one; several",
        "launches) and appends stamped rows (git SHA, versions, GPU, fabric fingerprint, exact command). Tables",
        "show each scenario's latest batch (one git SHA and dirty flag, one machine, one kind of run): per case the",
        "median over launches of each launch's median / p10 / p90, and the ratio to the baseline paired within each",
        "launch (baseline / case for times, case / baseline for rates: > 1 is better; the median over the launches",
        "that ran both; - where the case never ran beside the baseline). The run history, the reasoning and",
        *imported,
        "",
    ]
    for s in sorted(scenarios.values(), key=lambda s: s.name):
        lines += scenario_table(s, rows, source=short)
    return "\n".join(lines).rstrip() + "\n"
