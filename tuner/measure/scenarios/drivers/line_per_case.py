"""Drivers whose script prints a line per case: runtime-host-cost, profiles-import, gpu-rates."""

from __future__ import annotations

import re
from typing import Any

from moetune.tuner.measure.scenarios.drivers.registry import driver
from moetune.tuner.measure.scenarios.drivers.scripts import one_script_picks_lines
from moetune.tuner.measure.scenarios.records import Ctx, Stat


def _host_cost_line(ln: str, _args: dict[str, Any]) -> tuple[str, dict[str, Stat]] | None:
    """bench/runtime_host_cost.py: `<impl> MEDIAN us/roundtrip p10 P p90 Q batches B` (its implementations are the
    cases, `_` as `-`): the median, p10 and p90 of B batch means. A line without the quantiles (the script before
    them, which printed the mean of all its calls) is no median: refused, never stored in the median column."""
    mm = re.match(r"^(\w+)\s+([\d.]+) us/roundtrip p10 ([\d.]+) p90 ([\d.]+) batches (\d+)\s*$", ln)
    if not mm:
        return None
    med, p10, p90 = (float(mm.group(i)) for i in (2, 3, 4))
    return mm.group(1).replace("_", "-"), {"host_us_per_roundtrip": Stat(med, p10, p90, int(mm.group(5)), "us")}


def _import_line(ln: str, _args: dict[str, Any]) -> tuple[str, dict[str, Stat]] | None:
    """bench/profiles_import.py: `<case> import_s S reimport_s S`."""
    mm = re.match(r"^(\S+) import_s ([\d.]+) reimport_s ([\d.]+)", ln)
    return (mm.group(1), {"import_s": Stat(float(mm.group(2)), unit="s"),
                          "reimport_s": Stat(float(mm.group(3)), unit="s")}) if mm else None


def _rates_line(ln: str, args: dict[str, Any]) -> tuple[str, dict[str, Stat]] | None:
    """bench/gpu_rates.py: `<case> median p10 p90 TB/s|TFLOP/s` (read-*: read_tbps, gemm-*: gemm_tflops)."""
    f = ln.split()
    if len(f) != 5 or f[4] not in ("TB/s", "TFLOP/s"):
        return None
    try:
        med, p10, p90 = (float(x) for x in f[1:4])
    except ValueError:
        return None
    metric = "read_tbps" if f[4] == "TB/s" else "gemm_tflops"
    return f[0], {metric: Stat(med, p10, p90, int(args.get("iters", 1)), f[4])}


def _rates_problem(stdout: str, ctx: Ctx) -> str:
    """Why bench/gpu_rates.py's output is no GPU rate ("" when it is one): outside a smoke run, a process that saw no
    CUDA device (its `device cpu` line; none at all) timed the same work on the CPU, and its lines (CPU rates) were
    stored as measured rows stamped with the GPU the parent process saw."""
    dev = next((ln.split()[1] for ln in stdout.splitlines() if ln.startswith("device ") and len(ln.split()) == 2), None)
    if ctx.smoke or dev not in (None, "cpu"):
        return ""
    return (f"bench/gpu_rates.py ran on {'the CPU' if dev else 'no named device'} (its process saw no CUDA device): "
            "CPU rates, not this GPU's")


for _name, _script, _parse, _problem in (("runtime-host-cost", "runtime_host_cost.py", _host_cost_line, None),
                                         ("profiles-import", "profiles_import.py", _import_line, None),
                                         ("gpu-rates", "gpu_rates.py", _rates_line, _rates_problem)):
    driver(_name, single_shot=True)(one_script_picks_lines(_script, _parse, _problem))
