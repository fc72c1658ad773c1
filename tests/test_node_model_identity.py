"""A preset stands as a node's calibrated model (provenance node_model, which outranks preset in the replacement gate
and every pick) only when it records that it was calibrated on that node's fingerprint: `tune --node-model` refuses a
shipped preset, a model calibrated on another node and an older calibrated file that records no node (exit 2, no
database), and so does the daemon's model re-tune for its node-<fingerprint>.toml. The bring-up's calibrate stage
and `moetune model calibrate --this-node` record the node."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app
from moetune.tuner.fabric import discovery
from moetune.tuner.fabric_model.presets import load_preset

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]
CAPTURES = ROOT / "tests" / "captures"
DGX = CAPTURES / "dgx-h100"


def _calibrated(path: Path, fingerprint: str | None, base: str = "ndr-ibrc-h100x8") -> Path:
    """A calibrated preset file; `fingerprint` None: as an older moetune wrote it (no node recorded)."""
    p = load_preset(base)
    calib = {"data": ["rows.jsonl"], "date": "2026-12-01", "points": 6, "mean_abs_rel_err": 0.01,
             "max_abs_rel_err": 0.02}
    if fingerprint is not None:
        calib["fingerprint"] = fingerprint
    path.write_text(replace(p, calibration=calib).to_toml())
    return path


def _tune(tmp_path: Path, preset: str) -> object:
    return CliRunner().invoke(app, ["tune", "--capture", str(DGX), "--backend", "model", "--preset", preset,
                                    "--node-model", "--model", "custom:256,128,8,2", "--tokens", "16", "--trials", "3",
                                    "--ep-size", "2", "--db", str(tmp_path / "home" / "p.db"), "--json"],
                              env={"MOETUNE_HOME": str(tmp_path / "home")})


def _refused(r: object, tmp_path: Path, *words: str) -> None:
    out = " ".join(r.output.split())  # type: ignore[attr-defined]
    assert r.exit_code == 2, out  # type: ignore[attr-defined]
    assert "Traceback" not in out and out.count("--node-model:") == 1, out
    for w in words:
        assert w in out, (w, out)
    assert not (tmp_path / "home").exists()  # refused before any database


def test_a_shipped_preset_is_not_this_nodes_model(tmp_path: Path) -> None:
    r = _tune(tmp_path, "nvlink-h200x2")
    _refused(r, tmp_path, "'nvlink-h200x2' is a shipped preset", discovery.discover(DGX).fingerprint)


def test_a_model_calibrated_on_another_node_is_refused(tmp_path: Path) -> None:
    other = discovery.discover(CAPTURES / "h200x2").fingerprint
    f = _calibrated(tmp_path / "h200.toml", other)
    r = _tune(tmp_path, str(f))
    _refused(r, tmp_path, f"calibrated on node {other}", f"not on this node {discovery.discover(DGX).fingerprint}")


def test_an_older_calibrated_file_without_a_node_is_read_but_refused_with_how_to_recalibrate(tmp_path: Path) -> None:
    f = _calibrated(tmp_path / "old.toml", None)
    assert load_preset(str(f)).calibration["points"] == 6  # still readable (a preset, a calibration base)
    r = _tune(tmp_path, str(f))
    _refused(r, tmp_path, "records no fingerprint", "moetune profile --restart", "--this-node")


def test_a_model_calibrated_on_this_node_is_its_node_model(tmp_path: Path) -> None:
    from moetune.tuner.store.store import Store

    fp = discovery.discover(DGX).fingerprint
    f = _calibrated(tmp_path / "dgx.toml", fp)
    r = _tune(tmp_path, str(f))
    assert r.exit_code == 0, r.output
    with Store(tmp_path / "home" / "p.db", readonly=True) as st:
        recs = [rec for _i, rec in st.list_profiles()]
    assert recs and all(rec.provenance == "node_model" and rec.key.fingerprint == fp for rec in recs)


def test_the_library_refuses_it_too(tmp_path: Path) -> None:
    """tune_profiles_detailed (the daemon's and the bring-up's path): the same rule, not only the CLI's."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.tune import tune_profiles_detailed

    with pytest.raises(ValueError, match="is a shipped preset"):
        tune_profiles_detailed(None, discovery.discover(DGX), models=[get_model("custom:256,128,8,2")], tokens=[16],
                               backend="model", preset="ndr-ibrc-h100x8", node_model=True, trials=2, ep_size=2,
                               storage=f"sqlite:///{tmp_path / 's.db'}")


@pytest.mark.parametrize("recorded", [None, "another"])
def test_the_daemons_model_retune_refuses_a_node_file_not_calibrated_on_its_node(tmp_path: Path,
                                                                                recorded: str | None) -> None:
    from moetune.tuner.daemon.retune import RetuneImpossible, _backend_for
    from moetune.tuner.daemon.server import TuneSettings

    facts = F.FakeFacts({"gpu_model": "H200"})
    ctx = SimpleNamespace(store=F.open_store(tmp_path / "moetune.db"), facts=facts, tune=TuneSettings(backend="model"))
    path = _calibrated(tmp_path / f"node-{facts.fingerprint}.toml", recorded and "f" * 16, base="nvlink-h200x2")
    with pytest.raises(RetuneImpossible) as e:
        _backend_for(ctx)
    msg = str(e.value)
    assert str(path) in msg and ("records no fingerprint" if recorded is None else "calibrated on node ffff") in msg


def test_model_calibrate_records_this_node_only_when_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    live = discovery.discover(DGX)
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: live)
    data = tmp_path / "rows.jsonl"
    lines = [ln for ln in (ROOT / "bench/results/2026-11-30_h200x2_nccl_baseline.jsonl").read_text().splitlines()
             if '"host_staged"' in ln and '"qwen3-30b"' in ln]
    data.write_text("\n".join(lines) + "\n")
    args = ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(data), "--params",
            "collective.host_alpha_us,pcie.h2d_gbps"]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "here.toml"), "--this-node", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["fingerprint"] == live.fingerprint
    assert load_preset(str(tmp_path / "here.toml")).calibration["fingerprint"] == live.fingerprint
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "unknown.toml")])
    assert r.exit_code == 0, r.output
    assert "fingerprint" not in load_preset(str(tmp_path / "unknown.toml")).calibration
    assert "refuses it" in " ".join(r.output.split())
