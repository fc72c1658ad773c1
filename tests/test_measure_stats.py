"""The one statistics summary (tuner/measure/stats.py) and that every measurement path uses it."""

from __future__ import annotations

import math
import statistics

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import MODELS
from moetune.tuner.measure import ep, micro
from moetune.tuner.measure.stats import MIN_QUANTILE_SAMPLES, Summary, quantile
from moetune.tuner.search.backends import CallableBackend, Measurement, TuneWorkload


def test_summary_of_many_samples_uses_p10_p90() -> None:
    s = Summary.of([float(x) for x in range(11)])
    assert (s.median, s.p10, s.p90, s.n) == (5.0, 1.0, 9.0, 11)
    assert s.spread == pytest.approx(4.0)


def test_quantiles_interpolate_like_statistics_inclusive() -> None:
    xs = [3.0, 1.0, 7.5, 2.25, 9.0, 4.0, 4.5]
    s = Summary.of(xs)
    q = statistics.quantiles(xs, n=10, method="inclusive")
    assert s.p10 == pytest.approx(q[0]) and s.p90 == pytest.approx(q[-1])
    assert s.spread == pytest.approx((q[-1] - q[0]) / 2)


def test_few_samples_use_half_the_range() -> None:
    # below MIN_QUANTILE_SAMPLES the quantiles would understate the noise
    assert MIN_QUANTILE_SAMPLES == 5
    s = Summary.of([3.0, 1.0, 2.0])
    assert (s.median, s.spread, s.n) == (2.0, 1.0, 3)
    assert s.p10 == pytest.approx(1.2) and s.p90 == pytest.approx(2.8)
    four = Summary.of([1.0, 2.0, 3.0, 11.0])
    assert four.spread == 5.0


def test_one_sample_has_no_spread() -> None:
    s = Summary.of([4.0])
    assert (s.median, s.p10, s.p90, s.spread, s.n) == (4.0, 4.0, 4.0, 0.0, 1)


def test_bad_samples_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        Summary.of([])
    with pytest.raises(ValueError, match="finite"):
        Summary.of([1.0, math.nan])
    with pytest.raises(ValueError, match="quantile"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quantile([1.0], 1.5)


def test_bench_report_timing_is_the_summary() -> None:
    xs = [10.0, 12.0, 11.0, 30.0, 10.5, 11.5]
    assert ep.timing(xs) == Summary.of(xs).quantiles()
    assert set(ep.timing(xs)) == {"median", "p10", "p90"}
    assert all(math.isnan(v) for v in ep.timing([]).values())


def test_microbenchmark_rows_use_the_summary() -> None:
    xs = [5.0, 6.0]  # two samples: half the range (the old private helper said 0)
    assert micro._median_spread(xs) == (5.5, 0.5)
    assert not hasattr(micro, "_spread")


def test_backend_compare_pools_through_the_summary() -> None:
    wl = TuneWorkload(MODELS["qwen3-30b"], 1024)
    rounds = iter([[1.0, 2.0], [3.0, 4.0], [5.0, 20.0]])
    be = CallableBackend(lambda k, w: (lambda s: Measurement(statistics.median(s), 0.0, s, True))(next(rounds)))
    (m,) = be.compare([Knobs()], wl, rounds=3)
    ref = Summary.of([1.0, 2.0, 3.0, 4.0, 5.0, 20.0])
    assert (m.median_us, m.spread_us) == (ref.median, ref.spread)
