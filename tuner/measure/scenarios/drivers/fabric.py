"""The fabric drivers: fabric-discovery (live and captured discovery) and fabric-model (the model's numbers, MODELLED)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moetune.tuner.measure.scenarios.drivers.registry import driver
from moetune.tuner.measure.scenarios.drivers.scripts import run_script, script_command
from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved, Stat


def discovery_metrics(d: dict[str, Any]) -> dict[str, dict[str, Stat]]:
    """bench/fabric_discovery_cpu.py's JSON line: case `live` (this machine) and `capture-NAME` (recorded machines)."""
    # a row's p10 / p90 hold those quantiles only: a max the script gives is a metric of its own
    out = {"live": {"discover_s": Stat(d["live_discover_median_s"], n=20, unit="s"),
                    "discover_max_s": Stat(d["live_discover_max_s"], n=20, unit="s"),
                    "import_s": Stat(d["import_s"], unit="s"),
                    "cli_fabric_show_wall_s": Stat(d["cli_fabric_show_json_wall_median_s"], n=3, unit="s")}}
    for cap, v in d["capture_discover_s"].items():
        out[f"capture-{cap}"] = {"discover_s": Stat(v, n=20, unit="s")}
    return out


@driver("fabric-discovery", single_shot=True)
def run_discovery(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    """bench/fabric_discovery_cpu.py times live discovery and discovery from captures in one process."""
    cmd = script_command("fabric_discovery_cpu.py", cases[0].args, cases[0].env)
    try:
        stdout, _ = run_script("fabric_discovery_cpu.py", cases[0].args, cases[0].env, ctx)
        per = discovery_metrics(json.loads(stdout.strip().splitlines()[-1]))
    except (RuntimeError, ValueError, KeyError, IndexError) as e:
        return [CaseResult(c.name, {}, cmd, str(e)) for c in cases]
    return [CaseResult(c.name, per.get(c.name, {}), cmd, "" if c.name in per else "not in the output") for c in cases]


def model_metrics(d: dict[str, Any]) -> dict[str, Stat]:
    """bench/model_reproduce.py's JSON: the Perseus-shaped numbers (MODELLED) and predict's speed (measured)."""
    m: dict[str, Stat] = {}
    for r in d.get("slingshot_96_transfers_8_nodes", []):
        m[f"coupled_rel_throughput[{r['size']}B]"] = Stat(r["coupled_rel_throughput"], unit="ratio MODELLED")
        m[f"fixed_rel_throughput[{r['size']}B]"] = Stat(r["fixed_rel_throughput"], unit="ratio MODELLED")
    for r in d.get("qwen3_s256_slingshot_speedup", []):
        m[f"speedup[{r['nodes']}nodes]"] = Stat(r["speedup"], unit="x MODELLED")
    for r in d.get("qwen3_4_nodes_ibrc_vs_ibgda", []):
        m[f"ibgda_over_ibrc_fixed[S{r['tokens']}]"] = Stat(r["ibgda_over_ibrc_fixed"], unit="ratio MODELLED")
    for k, v in ((d.get("predict_timing") or {}).get("results") or {}).items():
        # n: the calls the median is of (30, or 5 for the 64K-token case); a file without `runs` says none: 1
        n = int(v.get("runs") or 1)
        m[f"predict_ms[{k}]"] = Stat(v["median_ms"], n=n, unit="ms")
        if v.get("max_ms") is not None:  # its own metric: the p90 column holds a p90 only
            m[f"predict_max_ms[{k}]"] = Stat(v["max_ms"], n=n, unit="ms")
    return m


def _parse_model(_: str, out: Path) -> dict[str, Stat]:
    return model_metrics(json.loads((out / "model.json").read_text()))



@driver("fabric-model", single_shot=True)
def run_fabric_model(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    """bench/model_reproduce.py: one run answers every case (the cases are views of the same document)."""
    res = []
    for c in cases:
        out = ctx.tmp / c.name
        out.mkdir(parents=True, exist_ok=True)
        args = {**c.args, "out": str(out / "model.json")}
        cmd = script_command("model_reproduce.py", args, c.env)
        try:
            run_script("model_reproduce.py", args, c.env, ctx)
            res.append(CaseResult(c.name, _parse_model("", out), cmd))
        except (RuntimeError, ValueError, KeyError, OSError) as e:
            res.append(CaseResult(c.name, {}, cmd, str(e)))
    return res
