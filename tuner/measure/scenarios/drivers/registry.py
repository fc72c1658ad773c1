"""The one registry of scenario drivers: DRIVERS, `@driver(name)` and what each kind of driver takes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved

DriverFn = Callable[[Sequence[Resolved], Ctx], list[CaseResult]]
DRIVERS: dict[str, DriverFn] = {}
# drivers whose one invocation measures every case at once (the cases are views of one run): a closing
# baseline run would only copy the first, so plan() leaves it out for them
SINGLE_SHOT: set[str] = set()
# a single-shot driver runs every case with ONE setting (the scenario's arguments and the first case's): the case
# arguments it reads per case, where it reads any (None: every one, it runs each case on its own); `load` refuses
# any other, which the driver would silently ignore on every case but the first
PER_CASE_ARGS: dict[str, tuple[str, ...] | None] = {"moe": ("engine",), "moe-knobs": ("knobs",), "fabric-model": None}
# drivers that measure in `bench run`'s own process (no subprocess, no spawned world): an `env` has nowhere to go
# (a variable set now would come after CUDA and torch read theirs), so `load` refuses one
IN_PROCESS: frozenset[str] = frozenset({"moe", "moe-knobs"})


def driver(name: str, *, single_shot: bool = False) -> Callable[[DriverFn], DriverFn]:
    """Register a driver under the name scenario files use."""
    def deco(fn: DriverFn) -> DriverFn:
        DRIVERS[name] = fn
        if single_shot:
            SINGLE_SHOT.add(name)
        return fn
    return deco
