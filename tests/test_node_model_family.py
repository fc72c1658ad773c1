"""A node model describes a transport family the node runs, or is not made.

`moetune model calibrate --this-node` and the bring-up both ask `presets.node_model_family`: the family is the one
the node runs, and where it runs none of the preset's, the bring-up says "node fabric model not calibrated: ..."
(as for one GPU) and `model calibrate --this-node` refuses before the fit (exit 2). On a node without GPUs the
pcie4 preset's family, host_staged, would give a file `moetune tune --node-model` refuses ("transport family
host_staged was not found on this fabric"), as would a base preset of no family the node runs."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app
from moetune.tuner.fabric_model.presets import load_preset, node_model_family

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"
PRESETS = Path(__file__).resolve().parents[1] / "tuner/fabric_model/presets"
ROWS = [{"probe": "collective_a2a", "fabric": "collective", "model": "qwen3-30b", "S": s, "world": 2, "ms": ms}
        for s, ms in ((64, 5.0), (256, 1.0))]
runner = CliRunner()


def _no_collective(tmp_path: Path) -> Path:
    """ndr-ibrc-h100x8 without its collective transport: no family of it runs on a node without GPUs."""
    text = (PRESETS / "ndr-ibrc-h100x8.toml").read_text()
    p = tmp_path / "ibrc-only.toml"
    p.write_text(text.replace('transports = ["proxy", "collective", "nvlink"]', 'transports = ["proxy", "nvlink"]'))
    assert load_preset(p).transports == ("proxy", "nvlink")
    return p


def test_the_rule() -> None:
    pcie = load_preset("pcie4-consumer-4090x4")
    assert node_model_family(pcie, ["host_staged", "collective"]) == ("host_staged", "")
    assert node_model_family(pcie, ["collective"]) == ("collective", "")
    fam, why = node_model_family(pcie, ["nvlink"])
    assert fam is None and "host_staged" in why and "nvlink" in why


def _discover_cpu_node() -> None:
    from moetune.tuner.fabric.discovery import discover

    discover(CAPTURES / "cpu-laptop")  # on_captured_node: live discovery answers this capture's facts


def test_calibrate_this_node_writes_the_family_the_node_runs(tmp_path: Path) -> None:
    _discover_cpu_node()
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "node.toml"
    r = runner.invoke(app, ["model", "calibrate", "-p", "pcie4-consumer-4090x4", "-d", str(data), "--force",
                            "--this-node", "--out", str(out), "--json"])
    assert r.exit_code in (0, 1), r.output  # a forced fit: written either way
    assert json.loads(r.stdout)["family"] == "collective"
    assert load_preset(out, fresh=True).family == "collective"
    # and `tune --node-model` takes it (it refused host_staged: "not found on this fabric")
    r = runner.invoke(app, ["tune", "--backend", "model", "--preset", str(out), "--node-model", "--model",
                            "qwen3-30b", "--tokens", "128", "--trials", "2", "--from", str(CAPTURES / "cpu-laptop"),
                            "--db", str(tmp_path / "t.db"), "--json"],
                      env={"MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""})
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)
    assert row["family"] == "collective" and row["stored"] == "new", row


def test_calibrate_this_node_refuses_a_preset_of_no_family_here(tmp_path: Path) -> None:
    _discover_cpu_node()
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "node.toml"
    r = runner.invoke(app, ["model", "calibrate", "-p", str(_no_collective(tmp_path)), "-d", str(data), "--force",
                            "--this-node", "--out", str(out)])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "--this-node: this node runs no family" in text and "--node-model" in text, text
    assert "Traceback" not in r.output and not out.exists()


def test_bringup_does_not_calibrate_a_model_of_no_family_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow
    from moetune.tuner.bringup.flow import Bringup, Plan

    monkeypatch.setattr(flow, "base_preset_for", lambda facts: str(_no_collective(tmp_path)))
    out = io.StringIO()
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=Plan(models=["qwen3-30b"], tokens=[16], trials=2),
                state_dir=tmp_path / "state", console=Console(file=out, width=300), capture=CAPTURES / "cpu-laptop",
                storage=f"sqlite:///{tmp_path / 'opt.db'}")
    from dataclasses import asdict

    from moetune.tuner.measure.micro import MicroResult

    b.state.mark("microbench", [asdict(MicroResult("collective", "latency", "0->1", 4096, r["ms"] * 1e3, 0.0, "us", r))
                                for r in ROWS])
    res = b.stage_calibrate()
    assert "node fabric model not calibrated: no transport of this node" in " ".join(out.getvalue().split())
    assert res["skipped"].startswith("no transport of this node") and "node_model" not in res
    assert not list((tmp_path / "state").glob("node-*.toml"))
