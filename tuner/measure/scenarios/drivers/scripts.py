"""Drivers that run a bench/*.py script: its flags, the run, and the per-case and line-per-case driver makers."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moetune.tuner.measure.scenarios.checkout import ROOT
from moetune.tuner.measure.scenarios.drivers.registry import DriverFn
from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved, Stat


def _flags(args: dict[str, Any]) -> list[str]:
    """{"seconds": 0.3, "pin": True, "out": None} -> ["--seconds", "0.3", "--pin"]."""
    out: list[str] = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False or v is None:
            continue
        else:
            out += [flag, ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return out


def script_command(script: str, args: dict[str, Any], env: dict[str, str]) -> str:
    """The command `run_script` runs, in words (its environment, flags and all): a case's rows carry it, the FAILED
    ones too (they carried `python bench/SCRIPT` alone, not what ran)."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), "python", f"bench/{script}",
                     *map(shlex.quote, _flags(args))])


def run_script(script: str, args: dict[str, Any], env: dict[str, str], ctx: Ctx,
               result_anyway: Callable[[int, str], bool] | None = None) -> tuple[str, str]:
    """Run bench/<script> with args as flags; return (stdout, the command in words). Raises RuntimeError where it
    exits non-zero, unless `result_anyway(exit status, stdout)` says that exit still gave a result (a script that
    is also a check, and says so in its exit status, after writing what it measured)."""
    argv = [sys.executable, str(ROOT / "bench" / script), *_flags(args)]
    cmd = script_command(script, args, env)
    try:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=ctx.timeout_s, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{cmd}: no result within {ctx.timeout_s:.0f} s") from None
    if p.returncode != 0 and not (result_anyway is not None and result_anyway(p.returncode, p.stdout)):
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{cmd} exited {p.returncode}: {' | '.join(tail)}")
    return p.stdout, cmd


# what a per-case parser gives: the metrics, or the metrics and {metric: why} of those the output says failed
Parsed = dict[str, Stat] | tuple[dict[str, Stat], dict[str, str]]


def one_script_per_case(script: str, parse: Callable[[str, Path], Parsed], out_flag: bool = False) -> DriverFn:
    """A driver that runs bench/<script> once per case (case args as flags) and parses its output."""
    def run(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
        res = []
        for c in cases:
            out = ctx.tmp / c.name
            out.mkdir(parents=True, exist_ok=True)
            args = {**c.args, **({"out": str(out)} if out_flag else {})}
            cmd = script_command(script, args, c.env)
            try:
                stdout, _ = run_script(script, args, c.env, ctx)
                got = parse(stdout, out)
                metrics, failed = got if isinstance(got, tuple) else (got, {})
                res.append(CaseResult(c.name, metrics, cmd, "; ".join(dict.fromkeys(failed.values())), failed))
            except (RuntimeError, ValueError, KeyError, OSError) as e:
                res.append(CaseResult(c.name, {}, cmd, str(e)))
        return res
    return run


def one_script_picks_lines(script: str, parse: Callable[[str, dict[str, Any]], tuple[str, dict[str, Stat]] | None],
                            problem: Callable[[str, Ctx], str] | None = None) -> DriverFn:
    """A single-shot driver: bench/<script> runs once with the first case's args and prints a line per case;
    `parse(line, args)` gives (case name, metrics) of a line that is one, None otherwise. `problem(stdout, ctx)`:
    why the whole output is no measurement ("" when it is one): every case then fails with it."""
    def run(cases: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
        args = dict(cases[0].args) if cases else {}
        env = cases[0].env if cases else {}
        cmd = script_command(script, args, env)
        try:
            stdout, _ = run_script(script, args, env, ctx)
        except RuntimeError as e:
            return [CaseResult(c.name, {}, cmd, str(e)) for c in cases]
        if problem is not None and (why := problem(stdout, ctx)):
            return [CaseResult(c.name, {}, cmd, why) for c in cases]
        seen = dict(got for ln in stdout.splitlines() if (got := parse(ln.strip(), args)) is not None)
        return [CaseResult(c.name, seen.get(c.name, {}), cmd,
                           "" if c.name in seen else f"no line for {c.name} in the output") for c in cases]

    return run
