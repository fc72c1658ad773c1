"""The proxy drivers: proxy-micro (signalling modes) and proxy-ack (what an ACK costs), from proxy_micro.jsonl."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moetune.tuner.measure.scenarios.drivers.registry import driver
from moetune.tuner.measure.scenarios.drivers.scripts import run_script, script_command
from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved, Stat


def _proxy_micro_args(case: Resolved, ctx: Ctx, folder: str, **flags: Any) -> dict[str, Any]:
    """bench/proxy_micro.py's arguments: the case's, `flags` and its output folder `folder` in the scratch folder."""
    return {**case.args, **flags, "out": str(ctx.tmp / folder)}


def _proxy_micro_rows(case: Resolved, ctx: Ctx, args: dict[str, Any]) -> list[dict[str, Any]]:
    """bench/proxy_micro.py run with `args` (`_proxy_micro_args`): its proxy_micro.jsonl rows."""
    run_script("proxy_micro.py", args, case.env, ctx)
    return [json.loads(x) for x in (Path(args["out"]) / "proxy_micro.jsonl").read_text().splitlines() if x.strip()]


@driver("proxy-micro", single_shot=True)
def run_proxy_micro(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    """bench/proxy_micro.py (C++ proxy engine, GPU 0 -> GPU 1) times every signalling mode in one process;
    the cases are its modes (put-only, coupled-proxy-drain, ...). A case with a failed point fails (`proxy_failures`)."""
    args = _proxy_micro_args(cases[0], ctx, "proxy")
    cmd = script_command("proxy_micro.py", args, cases[0].env)
    try:
        rows = _proxy_micro_rows(cases[0], ctx, args)
        per, bad = proxy_metrics(rows), proxy_failures(rows)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        return [CaseResult(c.name, {}, cmd, str(e)) for c in cases]
    return [CaseResult(c.name, {}, cmd, bad[c.name]) if c.name in bad else
            CaseResult(c.name, per.get(c.name, {}), cmd, "" if c.name in per else "mode not in the output") for c in cases]


@driver("proxy-ack", single_shot=True)
def run_proxy_ack(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    """bench/proxy_micro.py --ack-only (the proxy engine on one GPU, emulated peers): what an ACK costs against the
    streams it is written on; the cases are its batches (bench/proxy_micro.py ACK_BATCHES), metrics
    `batch_us[P{peers}xQ{qps}]`. A case whose engine recorded an error fails."""
    args = _proxy_micro_args(cases[0], ctx, "proxy-ack", ack_only=True)
    cmd = script_command("proxy_micro.py", args, cases[0].env)
    try:
        rows = _proxy_micro_rows(cases[0], ctx, args)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        return [CaseResult(c.name, {}, cmd, str(e)) for c in cases]
    per: dict[str, dict[str, Stat]] = {}
    bad: dict[str, str] = {}
    for r in rows:
        if r.get("bench") != "proxy_ack":
            if r.get("error"):
                bad.setdefault("*", str(r["error"])[-300:])
            continue
        if r.get("engine_error"):
            bad.setdefault(r["case"], f"the proxy engine recorded an error: {str(r['engine_error'])[-300:]}")
        per.setdefault(r["case"], {})[f"batch_us[P{r['peers']}xQ{r['qps']}]"] = Stat(
            r["us_median"], r.get("us_p10"), r.get("us_p90"), int(r.get("iters", 1)), "us")
    return [CaseResult(c.name, {}, cmd, bad.get(c.name) or bad["*"]) if c.name in bad or "*" in bad else
            CaseResult(c.name, per.get(c.name, {}), cmd, "" if c.name in per else "case not in the output") for c in cases]


def proxy_case(r: dict[str, Any]) -> str:
    """A proxy_micro row's case name: put-only, or signalling-fence_mode (coupled-proxy-drain, ...), with `-batch`
    after it for a mode whose proxy batches its PUTs (batch > 1: put-only-batch, decoupled-proxy-drain-batch, ...),
    which is another measurement (it went into put-only's and decoupled-*'s metrics, or none-none). A row without
    those fields (an error row of an older bench/proxy_micro.py): its mode's name."""
    if "signalling" not in r:
        return str(r["mode"]).replace("_", "-").replace("+", "-")
    sig = r["signalling"] or "none"
    name = "put-only" if sig == "none" else f"{sig}-{r['fence_mode']}".replace("_", "-")
    return f"{name}-batch" if int(r.get("batch") or 1) > 1 else name


def proxy_failures(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Why a case of proxy_micro.jsonl rows failed (its first failed point), for the cases with one: a point whose
    run raised (`error`), whose signals did not all land (`signals_landed` False: a receiver would have read rows
    before they arrived) or whose engine recorded an error (`engine_error`). Its timings are no measurement."""
    out: dict[str, str] = {}
    for r in rows:
        if r.get("bench") != "proxy_micro":
            continue
        at = f"{r['size']}B, c{r.get('concurrency')}" if "size" in r else f"c{r.get('concurrency')}"
        if r.get("error"):
            why = f"{r['mode']} failed at {at}: {str(r['error'])[-300:]}"
        elif r.get("signals_landed") is False:
            why = f"{r['mode']} at {at}: not every signal landed (signals_landed false): the transfers are not done"
        elif r.get("engine_error"):
            why = f"{r['mode']} at {at}: the proxy engine recorded an error: {str(r['engine_error'])[-300:]}"
        else:
            continue
        out.setdefault(proxy_case(r), why)
    return out


def proxy_metrics(rows: list[dict[str, Any]]) -> dict[str, dict[str, Stat]]:
    """proxy_micro.jsonl rows per case as `batch_us[sizeB,cN]`: time per batch of N concurrent transfers."""
    m: dict[str, dict[str, Stat]] = {}
    for r in rows:
        if r.get("bench") == "proxy_micro" and r.get("us_median") is not None:
            m.setdefault(proxy_case(r), {})[f"batch_us[{r['size']}B,c{r['concurrency']}]"] = Stat(
                r["us_median"], r.get("us_p10"), r.get("us_p90"), int(r.get("iters", 1)), "us")
    return m
