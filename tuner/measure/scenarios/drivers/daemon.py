"""The daemon-load driver: bench/daemon_load.py's latencies, throughput and failed phases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moetune.tuner.measure.scenarios.drivers.registry import DRIVERS
from moetune.tuner.measure.scenarios.drivers.scripts import one_script_per_case
from moetune.tuner.measure.scenarios.records import Stat


def _phase_problem(p: dict[str, Any]) -> str:
    """Why a daemon_load phase is no measurement of a daemon answering every request ("" when it is one): its error
    replies and unanswered requests."""
    errors, unanswered = int(p.get("errors") or 0), int(p.get("unanswered") or 0)
    if not errors and not unanswered:
        return ""
    sent = p.get("sent", int(p.get("requests") or 0) + errors + unanswered)
    return (f"c{p['clients']}-{p['mode']}: {errors} error replies and {unanswered} unanswered of {sent} requests "
            "(latencies of the ok replies only in the JSON)")


def daemon_failures(d: dict[str, Any]) -> dict[str, str]:
    """{metric: why} for the latency and throughput metrics of each bench/daemon_load.py phase with error replies or
    unanswered requests: failed, not shown as the latency of a daemon that answered."""
    out: dict[str, str] = {}
    for p in d.get("phases", []):
        if why := _phase_problem(p):
            key = f"c{p['clients']}-{p['mode']}"
            out.update((f"{name}[{key}]", why) for name in ("p99_us", "p50_us", "max_us", "req_per_s"))
    return out


def daemon_metrics(d: dict[str, Any]) -> dict[str, Stat]:
    """bench/daemon_load.py's JSON: per client count and phase, p99 / p50 / max latency and throughput of the ok
    replies, and `errors` (error replies + unanswered requests; a phase with any fails its other metrics:
    daemon_failures); start-up times (median and max). Each is its own metric: a row's p10 / p90 columns hold those
    quantiles only."""
    m: dict[str, Stat] = {}
    for p in d.get("phases", []):
        key, n = f"c{p['clients']}-{p['mode']}", p.get("requests", 1)
        m[f"errors[{key}]"] = Stat(float(int(p.get("errors") or 0) + int(p.get("unanswered") or 0)),
                                   n=p.get("sent", n), unit="requests")
        if _phase_problem(p):
            continue
        m[f"p99_us[{key}]"] = Stat(p["p99_us"], n=n, unit="us")
        m[f"p50_us[{key}]"] = Stat(p["p50_us"], n=n, unit="us")
        if p.get("max_us") is not None:
            m[f"max_us[{key}]"] = Stat(p["max_us"], n=n, unit="us")
        m[f"req_per_s[{key}]"] = Stat(p["req_per_s"], unit="1/s")
    calls = [("daemon-up", d.get("autoload_daemon_up") or {})]
    calls += [(f"down-{k}", v) for k, v in (d.get("autoload_daemon_down") or {}).items() if isinstance(v, dict)]
    for key, v in calls:
        if "call" in v:
            c = v["call"]
            m[f"autoload_ms[{key}]"] = Stat(c["median_ms"], n=c.get("runs", 1), unit="ms")
            if c.get("max_ms") is not None:
                m[f"autoload_max_ms[{key}]"] = Stat(c["max_ms"], n=c.get("runs", 1), unit="ms")
    return m


def _parse_daemon(_: str, out: Path) -> tuple[dict[str, Stat], dict[str, str]]:
    files = sorted(out.glob("*daemon_load*.json"))
    if not files:
        raise ValueError(f"bench/daemon_load.py wrote no JSON into {out}")
    d = json.loads(files[-1].read_text())
    return daemon_metrics(d), daemon_failures(d)


DRIVERS["daemon-load"] = one_script_per_case("daemon_load.py", _parse_daemon, out_flag=True)
