"""`moetune profile`'s calibrate stage: a fit the calibration refuses writes no node model, the stage and the
report say why, and the bring-up goes on (tuning measures on the node; the daemon's model re-tune finds no
node model and says so, as on a node never calibrated). A fit it accepts is written as before."""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.fabric_model.calibration import rows_to_points
from moetune.tuner.fabric_model.presets import load_preset

# their bring-ups inject the timings of a GPU node's capture: run as ON that node (conftest), the only place a
# measurement may be stored under its key
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"
ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl"


def _bringup(tmp_path: Path, capture: str = "h200x2") -> tuple[Any, io.StringIO]:
    from moetune.tuner.bringup.flow import Bringup, Plan

    out = io.StringIO()
    plan = Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=5, compare_rounds=1)
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                console=Console(file=out, width=300), capture=CAPTURES / capture,
                storage=f"sqlite:///{tmp_path / 'opt.db'}")
    return b, out


def _one_probe_row() -> dict:
    import json

    return next(json.loads(ln) for ln in PROBE.read_text().splitlines() if '"coupled_drain"' in ln)


def _a2a_rows() -> list[dict]:
    """The rows the bring-up's a2a microbenchmark gives (collective_a2a, S = 64/256/1024, both fabrics), timed as
    the nvlink-h200x2 model predicts them, +-3%."""
    rng = random.Random(7)
    rows = [{"probe": "collective_a2a", "fabric": f, "model": "qwen3-30b", "S": s, "world": 2, "ms": 1.0}
            for f in ("nvlink", "host_staged") for s in (64, 256, 1024)]
    points, _ = rows_to_points(rows)
    preset = load_preset("nvlink-h200x2")
    for r, p in zip(rows, points, strict=True):
        r["ms"] = p.evaluate(preset) / 1e3 * rng.uniform(0.97, 1.03)
    return rows


def _measured(extra: dict) -> dict:
    """A microbenchmark result as the microbench stage keeps it (MicroResult as a dict), carrying `extra`."""
    from dataclasses import asdict

    from moetune.tuner.measure.micro import MicroResult

    us = extra["us"] if "us" in extra else extra["ms"] * 1e3
    return asdict(MicroResult("proxy" if extra["probe"] == "proxy_ce" else extra["fabric"], "latency", "0->1",
                              int(extra.get("size", 4096)), us, 0.0, "us", extra))


def _node_models(b: Any) -> list[Path]:
    return sorted(b.state.path.parent.glob("node-*.toml"))


def test_a_refused_fit_writes_no_node_model_and_says_why(tmp_path: Path) -> None:
    from moetune.tuner.daemon.retune import node_model_file

    b, out = _bringup(tmp_path)
    b.state.mark("discover", b.stage_discover())
    b.state.mark("microbench", [_measured(_one_probe_row())])
    res = b.stage_calibrate()
    assert res["node_model"] is None and "preset_file" not in res and "mean_abs_rel_err" not in res
    assert res["refused"] and res["refused"][0].startswith("too few measured rows: 1 distinct row")
    assert _node_models(b) == []
    assert not node_model_file(b.store, b.facts.fingerprint, b.state.path.parent).exists()  # what the daemon reads
    said = " ".join(out.getvalue().split())
    assert "node fabric model not written (calibration refused): too few measured rows" in said
    b.state.mark("calibrate", res)
    # the report says so too
    b.state.mark("tune", [])
    b.state.mark("compare", [])
    report = Path(b.stage_report())
    text = " ".join(report.read_text().split())
    assert "node fabric model NOT written" in text and "too few measured rows" in text


def test_the_bring_up_goes_on_after_a_refused_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [_measured(_one_probe_row())])
    monkeypatch.setattr(flow.Bringup, "stage_tune", lambda self: [])  # no subprocesses
    b, _out = _bringup(tmp_path)
    done = b.run()
    assert set(done) == set(flow.STAGES)
    assert done["calibrate"]["refused"] and _node_models(b) == []
    assert Path(done["report"]).exists()


def test_a_calibration_error_is_a_refusal_not_a_crash(tmp_path: Path) -> None:
    b, out = _bringup(tmp_path)
    b.state.mark("microbench", [_measured({"probe": "collective_a2a", "fabric": "nvlink", "model": "qwen3-30b",
                                           "S": 64, "world": 3, "ms": 0.05})])
    res = b.stage_calibrate()
    assert res.get("refused") and _node_models(b) == [], res
    assert "calibration refused" in out.getvalue()


def test_an_accepted_fit_is_written_as_the_node_model(tmp_path: Path) -> None:
    b, _out = _bringup(tmp_path)
    b.state.mark("microbench", [_measured(r) for r in _a2a_rows()])
    res = b.stage_calibrate()
    assert "refused" not in res, res
    assert [str(p) for p in _node_models(b)] == [res["preset_file"]]
    node = load_preset(res["preset_file"])
    assert "warning" not in node.calibration and node.calibration["points"] == 6
    assert node.calibration["fingerprint"] == b.facts.fingerprint  # the node measured: only there a node model
    assert res["max_abs_rel_err"] <= 0.05
    # parameters 3 rows per fabric cannot separate keep the base preset's values and sources
    assert "collective.sync_us" in res["kept"]
    assert node.sources["collective.sync_us"] == load_preset("nvlink-h200x2").sources["collective.sync_us"]


def test_the_nic_line_rate_bound_comes_from_discovery(tmp_path: Path) -> None:
    b, _out = _bringup(tmp_path, "dgx-h100")
    gbit = b.facts.link_rates["nic_gbit"]
    assert b.nic_line_rate_gbs("ndr-ibrc-h100x8") == pytest.approx(gbit / 8.0)
    # nvlink-h200x2's [nic] is the copy-engine proxy probe, not a NIC: no line rate applies to it
    assert b.nic_line_rate_gbs("nvlink-h200x2") is None


def test_a_one_gpu_node_is_not_calibrated(tmp_path: Path) -> None:
    """One GPU has no EP exchange: its only rows were gloo processes' all-to-all on the host, fitted to a GPU preset
    (runs 180, 182, 183 on one H200: accepted once, refused twice, each a model of nothing the node runs)."""
    from moetune.tuner.measure import micro

    b, out = _bringup(tmp_path, "h200x1")
    assert b.facts.gpu_count == 1
    b.state.mark("microbench", [_measured(r) for r in _a2a_rows()])
    res = b.stage_calibrate()
    assert res.get("skipped", "").startswith("one GPU") and _node_models(b) == [], res
    assert "node fabric model not calibrated: one GPU" in " ".join(out.getvalue().split())
    applicable = [bench for bench, ok, _why in micro.plan(b.facts.transport_names, 1) if ok]
    assert not any(isinstance(bench, micro.CollectiveA2A) for bench in applicable)
    b.state.mark("calibrate", res)
    b.state.mark("tune", [])
    b.state.mark("compare", [])
    text = " ".join(Path(b.stage_report()).read_text().split())
    assert "node fabric model not calibrated: one GPU" in text


def test_a_node_without_gpus_is_calibrated_on_its_gloo_rows(tmp_path: Path) -> None:
    """The rows moetune's microbenchmark writes on a node without GPUs name the fabric `collective` (gloo between
    host processes): the calibration's fabric check refused them ('must be one of nvlink, host_staged'), so no
    node model was written on such a node any more."""
    from moetune.tuner.measure.micro import plan

    benches = [b for b, ok, _why in plan(["collective"], 0) if ok]
    assert any(getattr(b, "transport", None) == "collective" for b in benches)  # what micro.py runs there
    rows = [{"probe": "collective_a2a", "fabric": "collective", "model": "qwen3-30b", "S": s, "world": 2, "ms": 1.0}
            for s in (64, 256, 1024)]
    points, _ = rows_to_points(rows)
    preset = load_preset("pcie4-consumer-4090x4")  # the base preset of a node without GPUs
    for r, p in zip(rows, points, strict=True):
        r["ms"] = p.evaluate(preset) / 1e3
    b, _out = _bringup(tmp_path, "cpu-laptop")
    b.state.mark("microbench", [_measured(r) for r in rows])
    res = b.stage_calibrate()
    assert "field 'fabric'" not in str(res), res
    # the model describes the family the node has and a model tune of it tunes (the base preset's host_staged
    # is not on a node without GPUs: `tune --node-model` refused the file)
    assert load_preset(res["preset_file"], fresh=True).family == "collective", res
    import json

    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    r = CliRunner().invoke(app, ["tune", "--backend", "model", "--preset", res["preset_file"], "--node-model", "--model",
                                 "qwen3-30b", "--tokens", "128", "--trials", "3", "--from", str(CAPTURES / "cpu-laptop"),
                                 "--db", str(tmp_path / "t.db"), "--json"],
                           env={"MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""})
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)
    # EP 2, the two host processes the bring-up measured: EP 1 (the default from 0 GPUs) exchanges nothing
    assert row["family"] == "collective" and "/ep2n1/" in row["study"] and row["stored"] == "new", row


def test_a_failed_node_model_write_leaves_the_earlier_one_whole(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The node model is replaced atomically: written in place (Path.write_text), a crash or a full disk mid-write
    would leave the earlier node model of this fingerprint truncated (and the daemon's model re-tune without one)."""
    import errno
    import os

    b, _out = _bringup(tmp_path)
    b.state.mark("microbench", [_measured(r) for r in _a2a_rows()])
    first = Path(b.stage_calibrate()["preset_file"])
    before = first.read_bytes()

    def enospc(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def write_text(self: Path, *_a: object, **_k: object) -> None:
        self.open("w").close()  # a plain write truncates the file before the first byte fails
        enospc()

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(os, "fsync", enospc)  # the atomic write fails before its rename
    with pytest.raises(OSError, match="No space left"):
        b.stage_calibrate()
    assert first.read_bytes() == before
    assert [p.name for p in first.parent.iterdir() if p.name.endswith(".tmp")] == []
