"""The microbenchmarks that feed the node model's calibration run with NVLink SHARP off (NCCL_NVLS_ENABLE=0) and
torch's symmetric memory without multicast: a declared measurement setting (`micro.MEASUREMENT_ENV`), recorded
with every row (and the node model calibrated on them), never set silently."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles import perf_env
from moetune.tuner.measure import micro

ROW = {"transport": "host_staged", "kind": "latency", "direction": "0->1", "size_bytes": 1024, "value": 5.0,
       "spread": 0.1, "unit": "us", "extra": {"probe": "x"}}


def _fake_run(monkeypatch: pytest.MonkeyPatch, seen: list[dict[str, str]]) -> None:
    def run(cmd: list[str], *, env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess:
        seen.append(env)
        return subprocess.CompletedProcess(cmd, 0, json.dumps(ROW) + "\n", "")

    monkeypatch.setattr(micro.subprocess, "run", run)


def test_every_row_records_the_declared_settings_and_the_environment_it_ran_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    seen: list[dict[str, str]] = []
    _fake_run(monkeypatch, seen)
    [row] = micro.NcclP2P("host_staged").run([1024], iters=1)
    # the subprocess ran under the declared settings (still: NVLS must stay off on the machines measured)
    assert {k: seen[0][k] for k in micro.MEASUREMENT_ENV} == micro.MEASUREMENT_ENV == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    extra = row.extra or {}
    assert extra["probe"] == "x"  # the benchmark's own fields kept
    assert extra["measurement_env"] == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "0", **micro.MEASUREMENT_ENV}
    # the whole NCCL environment, as profiles record theirs: the caller's variables and the declared ones
    assert extra["perf_env"] == perf_env.performance_environment(seen[0]).variables
    assert extra["perf_env"]["NCCL_NVLS_ENABLE"] == "0" and extra["perf_env"]["NCCL_ALGO"] == "Ring"


@pytest.mark.usefixtures("on_captured_node")  # the capture's node is this one: the bring-up measures
def test_the_bring_up_stores_the_settings_with_each_measurement_row(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from moetune.tuner.bringup.flow import Bringup, Plan

    seen: list[dict[str, str]] = []
    _fake_run(monkeypatch, seen)
    bench = micro.GlooP2P()
    monkeypatch.setattr(micro, "plan", lambda *a, **k: [(bench, True, "")])
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=Plan(models=["qwen3-30b"], tokens=[16], trials=2),
                state_dir=tmp_path / "state", console=Console(file=io.StringIO()),
                capture=Path(__file__).resolve().parent / "captures" / "h200x2",
                storage=f"sqlite:///{tmp_path / 'opt.db'}")
    b.state.mark("discover", b.stage_discover())
    b.stage_microbench()
    rows = b.store.list_measurements(fingerprint=b.facts.fingerprint)
    assert rows
    for r in rows:
        extra = r["extra"] if isinstance(r, dict) else r.extra
        assert extra["measurement_env"] == micro.MEASUREMENT_ENV
        assert extra["perf_env"]["NCCL_NVLS_ENABLE"] == "0"


def test_the_calibrated_model_records_what_every_row_was_measured_under() -> None:
    from moetune.tuner.fabric_model.calibration import common_measurement_env

    a = {"measurement_env": {"NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1"}}
    b = {"measurement_env": {"NCCL_NVLS_ENABLE": "0"}}
    assert common_measurement_env([a, b]) == {"NCCL_NVLS_ENABLE": "0"}
    assert common_measurement_env([a, {}]) is None  # a row that says nothing: unknown, not "nothing set"
    assert common_measurement_env([]) is None


def test_the_perf_env_docstring_names_the_one_place_the_tuner_sets_them() -> None:
    doc = " ".join((perf_env.__doc__ or "").split())
    assert "the tuner and the runtime never set them" not in doc
    assert "MEASUREMENT_ENV" in doc


def test_a_node_model_written_from_such_rows_says_the_settings(tmp_path: Path) -> None:
    import random

    from moetune.tuner.fabric_model.calibration import calibrate, calibrated_preset, rows_to_points
    from moetune.tuner.fabric_model.presets import load_preset

    rng = random.Random(7)
    rows = [{"probe": "collective_a2a", "fabric": f, "model": "qwen3-30b", "S": s, "world": 2, "ms": 1.0,
             "measurement_env": dict(micro.MEASUREMENT_ENV)}
            for f in ("nvlink", "host_staged") for s in (64, 256, 1024)]
    points, _ = rows_to_points(rows)
    base = load_preset("nvlink-h200x2")
    for r, p in zip(rows, points, strict=True):
        r["ms"] = p.evaluate(base) / 1e3 * rng.uniform(0.97, 1.03)
    rep = calibrate("nvlink-h200x2", rows, rounds=5)
    assert rep.measurement_env == micro.MEASUREMENT_ENV
    path = tmp_path / "node.toml"
    path.write_text(calibrated_preset(rep, ["rows"], "2026-12-01").to_toml())
    assert load_preset(str(path)).calibration["measurement_env"] == [
        "NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1"]
    # rows that say nothing of it (a file of another tool): nothing claimed
    for r in rows:
        del r["measurement_env"]
    assert "measurement_env" not in calibrated_preset(calibrate("nvlink-h200x2", rows, rounds=5), ["rows"],
                                                      "2026-12-01").calibration
