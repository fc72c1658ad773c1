"""The calibration's fit may move a parameter to where the rows no longer see it (run 182's bring-up on an H200:
collective.host_alpha_us fitted to 16.64 where its sensitivity was 0.019 < 0.02, so the whole node model was
refused although run 180 on the same kind of node accepted it). Such a parameter keeps the preset's sourced value,
as one the rows never constrained does, the others are fitted again, and the fit error decides."""

from __future__ import annotations

import random

import pytest

from moetune.tuner.fabric_model import calibration as C
from moetune.tuner.fabric_model.presets import load_preset

HOST = "collective.host_alpha_us"


def _rows(host_scale: float) -> list[dict]:
    """a2a rows (both fabrics, S = 64/256/1024) timed as nvlink-h200x2 predicts them with the host latency scaled,
    +-3%."""
    base = load_preset("nvlink-h200x2")
    truth = base.with_params({HOST: base.numeric()[HOST] * host_scale})
    rng = random.Random(7)
    rows = [{"probe": "collective_a2a", "fabric": f, "model": "qwen3-30b", "S": s, "world": 2, "ms": 1.0}
            for f in ("nvlink", "host_staged") for s in (64, 256, 1024)]
    points, _ = C.rows_to_points(rows)
    for r, p in zip(rows, points, strict=True):
        r["ms"] = p.evaluate(truth) / 1e3 * rng.uniform(0.97, 1.03)
    return rows


def _sensitivity(value: float) -> float:
    base = load_preset("nvlink-h200x2")
    points, _ = C.rows_to_points(_rows(0.5))
    _b, cols = C._sensitivities(base.with_params({HOST: value}), points, [HOST])
    return C._norm(cols[HOST])


def test_a_parameter_fitted_out_of_the_rows_sight_keeps_the_preset_value(monkeypatch: pytest.MonkeyPatch) -> None:
    base = load_preset("nvlink-h200x2")
    start = base.numeric()[HOST]
    # the threshold between the host latency's sensitivity at the preset's value and at the value a free fit gives
    free = C.calibrate(base, _rows(0.5), rounds=15)
    at_fit = free.params_after[HOST]
    assert HOST in free.fitted and at_fit < 0.6 * start, free.params_after
    lo, hi = _sensitivity(at_fit), _sensitivity(start)
    assert lo < hi
    monkeypatch.setattr(C, "MIN_SENSITIVITY", (lo + hi) / 2)
    rep = C.calibrate(base, _rows(0.5), rounds=15)
    assert rep.usable, rep.problems  # not refused with "... at its fitted value ...: so its value is arbitrary"
    assert HOST not in rep.fitted and rep.params_after[HOST] == start
    assert HOST in rep.kept and rep.kept[HOST].startswith("fitted to ") and "preset's value kept" in rep.kept[HOST]
    assert rep.summary()["max_abs_rel_err"] <= 0.10
    # the same rows, the same fit: nothing random between passes
    again = C.calibrate(base, _rows(0.5), rounds=15)
    assert again.params_after == rep.params_after and again.kept == rep.kept

