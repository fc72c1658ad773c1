"""What the benchmarks' numbers are: the statistics every timing in summary.csv is summarised by (tuner/measure/stats.py),
and which device a timed region runs on."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

from moetune.tuner.measure.stats import Summary

ROOT = Path(__file__).resolve().parents[1]


def _script(monkeypatch: pytest.MonkeyPatch, rel: str) -> ModuleType:
    """bench/<rel> imported as a module (its environment defaults land in a copy of os.environ, dropped after)."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("xs", [[float(i) for i in range(20)], [3.0, 1.0, 7.5, 2.25, 9.0, 4.0, 4.5]])
def test_proxy_micro_quantiles_are_the_shared_ones(monkeypatch: pytest.MonkeyPatch, xs: list[float]) -> None:
    # bench/proxy_micro.py took the nearest sample's rank: its p10 / p90 in summary.csv (proxy-fences, proxy-ack-cost)
    # were another statistic than every other row's (of 0..19: p10 2.0 where the others say 1.9)
    pm = _script(monkeypatch, "bench/proxy_micro.py")
    s = Summary.of(xs)
    assert pm._pct(xs, 10) == pytest.approx(s.p10) and pm._pct(xs, 90) == pytest.approx(s.p90)
    assert pm._pct(xs, 50) == pytest.approx(s.median)
