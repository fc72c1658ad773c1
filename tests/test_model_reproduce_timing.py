"""bench/model_reproduce.py's predict timings: every timed workload gets an untimed warm-up call first, so no
stored median / max (predict_max_ms) includes a cold first call (caches filled, code paths first taken)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("model_reproduce_under_test", ROOT / "bench" / "model_reproduce.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_timed_predict_workload_is_warmed_up_before_timing(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _load()
    real = mod.predict
    seen: set = set()

    def cold_first(preset, w, knobs, **kw):  # a first call per (workload, knobs) pays a cold start of 150 ms
        key = (repr(w), repr(knobs), repr(kw))
        if key not in seen:
            seen.add(key)
            time.sleep(0.15)
        return real(preset, w, knobs, **kw)

    monkeypatch.setattr(mod, "predict", cold_first)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["model_reproduce.py", "--out", str(out)])
    mod.main()
    timing = json.loads(out.read_text())["predict_timing"]["results"]
    assert "coupled/proxy_drain 64K tokens zipf:1.2" in timing
    for label, v in timing.items():
        assert v["max_ms"] < 150, f"{label}: a timed call paid the cold start ({v['max_ms']:.1f} ms)"
