"""The one summary of repeated timings: median, p10, p90, spread and sample count.

Every measurement in the tuner (a benchmark report, a tuning trial, a microbenchmark row) is summarised
here, so "spread" means the same thing wherever it is compared. It matters: the tuner keeps a re-measured
winner only when it beats the incumbent by more than the larger of the two spreads, and the store replaces
a profile by the same rule.

Spread is half the p10..p90 range: a robust "plus or minus" around the median that one slow outlier
(a context switch, a page fault, the first touch of a buffer) does not move, unlike the standard deviation
or the full range. Below `MIN_QUANTILE_SAMPLES` samples the p10 and p90 only interpolate between the two
extremes and would understate the noise, so the spread is half the full range instead. One sample has no
spread (0).

Quantiles are linear interpolations between the sorted samples at position q·(n-1) (NumPy's default,
`statistics.quantiles(method="inclusive")`), so they are defined for any n >= 1.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

# From this many samples on, the p10..p90 range stands for the noise; below, the full range does.
MIN_QUANTILE_SAMPLES = 5


def quantile(sorted_samples: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of already sorted samples, by linear interpolation."""
    if not sorted_samples:
        raise ValueError("quantile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    pos = q * (len(sorted_samples) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_samples) - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (pos - lo)


def half_range(p10: float, p90: float) -> float:
    """Spread from a p10 and a p90 reported elsewhere (e.g. by `moetune bench ep`): half their distance."""
    return (p90 - p10) / 2


@dataclass(frozen=True)
class Summary:
    """Median, p10, p90, spread (see the module docstring) and n of a set of samples, in their unit."""

    median: float
    p10: float
    p90: float
    spread: float
    n: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Summary:
        """Summarise `samples` (at least one, all finite). Raises ValueError naming what is wrong."""
        xs = sorted(float(x) for x in samples)
        if not xs:
            raise ValueError("cannot summarise an empty set of samples")
        bad = [x for x in xs if not math.isfinite(x)]
        if bad:
            raise ValueError(f"samples must be finite numbers, got {bad[0]!r}")
        p10, p90 = quantile(xs, 0.1), quantile(xs, 0.9)
        enough = len(xs) >= MIN_QUANTILE_SAMPLES
        spread = half_range(p10, p90) if enough else half_range(xs[0], xs[-1])
        return cls(statistics.median(xs), p10, p90, spread, len(xs))

    def quantiles(self, ndigits: int = 3) -> dict[str, float]:
        """{"median", "p10", "p90"} rounded to `ndigits`: the shape of each timing in a bench report."""
        return {"median": round(self.median, ndigits), "p10": round(self.p10, ndigits),
                "p90": round(self.p90, ndigits)}
