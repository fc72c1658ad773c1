"""What a driver is given and gives back: Ctx and Resolved cases in, CaseResult of Stat metrics out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.tuner.measure.stats import Summary


@dataclass
class Stat:
    """One metric of one case in one launch."""

    median: float | None
    p10: float | None = None
    p90: float | None = None
    n: int = 1
    unit: str = ""

    @classmethod
    def of(cls, values: Sequence[float], unit: str) -> Stat:
        """Median, p10, p90 and n of a sample, by the one shared summary (tuner/measure/stats.py `Summary.of`)."""
        s = Summary.of(values)
        return cls(s.median, s.p10, s.p90, s.n, unit)


@dataclass
class CaseResult:
    case: str
    metrics: dict[str, Stat]
    command: str
    error: str = ""
    # {metric: why} of the metrics the driver knows this case failed on (a moe engine's failed S): each gets a FAILED row
    failed: dict[str, str] = field(default_factory=dict)
    # what the numbers leave out, said in their rows' note beside any error (no failure: no FAILED row)
    note: str = ""


@dataclass
class Ctx:
    """What a driver is given besides the cases: the world it runs in, smoke mode, a scratch folder."""

    world: int
    backend: str
    smoke: bool
    tmp: Path
    timeout_s: float = 600.0


@dataclass(frozen=True)
class Resolved:
    """A case with the scenario's arguments, the case's and (in smoke mode) the smoke overrides merged; its
    environment and runtime options likewise (the scenario's, then the case's)."""

    name: str
    args: dict[str, Any]
    env: dict[str, str]
    options: dict[str, Any] = field(default_factory=dict)


def type_problem(e: TypeError, args: dict[str, Any]) -> str:
    """A case's failure where one of its arguments had the wrong type (`tokens = [16, 128]` where one count goes):
    Python's words name no argument, so the case's arguments are given beside them."""
    return f"an argument of the wrong type among {', '.join(f'{k} = {v!r}' for k, v in args.items())}: {e}"
