"""A calibrated preset records the tokens per GPU its fitted rows measured (`[calibration] tokens = [least, most]`),
and `model predict`, `model sweep` and `tune --backend model` say so where they predict outside that range, as they
do for a scale beyond its `[calibration] world`. With only the scale checked, nvlink-h200x2 fitted on S = 128 ..
16384 would predict S = 64 or 65536 with no word that no row of that size constrained its parameters (the shipped
file says its own latency-bound rows disagree by up to 2.6x)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.fabric_model.calibration import calibrated_preset, check_preset, read_rows
from moetune.tuner.fabric_model.calibration_record import calibrated_tokens
from moetune.tuner.fabric_model.presets import PresetError, load_preset

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "300"}


def test_calibration_records_the_token_range_of_its_rows() -> None:
    preset = load_preset("nvlink-h200x2")
    files = [ROOT / "bench/results" / (f if "run11" not in f else f"2026-11-30_h200x2_run11/{f}")
             for f in preset.calibration["data"]]
    rep = check_preset(preset, read_rows(files))
    cal = calibrated_preset(rep, [f.name for f in files], "2026-11-30")
    # what a regeneration writes is what the shipped file records
    assert cal.calibration["tokens"] == preset.calibration["tokens"] == [128, 16384]
    assert calibrated_tokens(preset) == (128, 16384)
    # rows that state no tokens per GPU (the proxy probe's) record none: nothing is guessed
    probe = read_rows([ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl"])
    cal = calibrated_preset(check_preset(preset, probe), ["probe.jsonl"], "2026-11-30")
    assert "tokens" not in cal.calibration
    assert calibrated_tokens(load_preset("ndr-ibrc-h100x8")) is None  # a datasheet preset: no range


@pytest.mark.parametrize("bad", ["[128]", "[0, 16]", "[256, 128]", "[1.5, 4]", "\"128..256\""])
def test_a_malformed_token_range_is_refused(tmp_path: Path, bad: str) -> None:
    text = (ROOT / "tuner/fabric_model/presets/nvlink-h200x2.toml").read_text()
    f = tmp_path / "p.toml"
    f.write_text(text.replace("tokens = [128, 16384]", f"tokens = {bad}"))
    with pytest.raises(PresetError, match=r"calibration\.tokens"):
        load_preset(str(f), fresh=True)


def test_predict_notes_tokens_outside_the_calibrated_range() -> None:
    note = ("preset nvlink-h200x2 was calibrated on measurements of 128 to 16384 tokens per GPU ([calibration] tokens); "
            "at 64 tokens per GPU this prediction extrapolates outside the measured range")
    r = runner.invoke(app, ["model", "predict", "-p", "nvlink-h200x2", "-t", "64"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert f"note: {note}" in r.stdout.splitlines(), r.output
    r = runner.invoke(app, ["model", "predict", "-p", "nvlink-h200x2", "-t", "65536", "--json"])
    assert "at 65536 tokens per GPU this prediction extrapolates" in json.loads(r.stdout)["extrapolation"]
    for t in ("128", "4096", "16384"):  # inside: nothing
        r = runner.invoke(app, ["model", "predict", "-p", "nvlink-h200x2", "-t", t, "--json"])
        assert json.loads(r.stdout)["extrapolation"] is None
    # beyond both the scale and the range: both said
    r = runner.invoke(app, ["model", "predict", "-p", "nvlink-h200x2", "-t", "64", "-g", "8", "--json"])
    said = json.loads(r.stdout)["extrapolation"]
    assert "at 8 GPUs this prediction extrapolates 4x" in said and "at 64 tokens per GPU" in said


def test_sweep_over_tokens_notes_the_points_outside_the_range() -> None:
    r = runner.invoke(app, ["model", "sweep", "-p", "nvlink-h200x2", "--over", "tokens", "--json"])
    assert r.exit_code == 0, r.output
    said = json.loads(r.stdout)["extrapolation"]
    assert said == ("preset nvlink-h200x2 was calibrated on measurements of 128 to 16384 tokens per GPU ([calibration] "
                    "tokens); at 64 tokens per GPU this sweep extrapolates outside the measured range")
    r = runner.invoke(app, ["model", "sweep", "-p", "nvlink-h200x2", "--over", "tokens", "--values", "256,1024",
                            "--json"])
    assert json.loads(r.stdout)["extrapolation"] is None
    r = runner.invoke(app, ["model", "sweep", "-p", "nvlink-h200x2", "--over", "nodes", "-t", "32", "--json"])
    assert "at 32 tokens per GPU this sweep" in json.loads(r.stdout)["extrapolation"]


def test_a_model_tune_notes_tokens_outside_the_range() -> None:
    from types import SimpleNamespace

    from moetune.tuner.cli.tune_notes import tune_scale_note

    def result(tokens: int) -> SimpleNamespace:
        return SimpleNamespace(study=SimpleNamespace(workload=SimpleNamespace(nodes=1, gpus_per_node=2, tokens=tokens)))

    said = tune_scale_note("model", "nvlink-h200x2", [result(4096), result(32768)])
    assert said == ("preset nvlink-h200x2 was calibrated on measurements of 128 to 16384 tokens per GPU ([calibration] "
                    "tokens); at 32768 tokens per GPU this tune extrapolates outside the measured range")
    assert tune_scale_note("model", "nvlink-h200x2", [result(4096)]) is None


def test_each_model_tune_json_row_notes_only_its_own_tokens(tmp_path: Path) -> None:
    """A --json row's "extrapolation" is about what that row's profile was predicted at: the row tuned at 4096 tokens
    (inside 128 .. 16384) carried the note of the row at 64 ("at 64 tokens per GPU this tune extrapolates"), so a
    reader picking the extrapolated profiles by that field took an in-range one. The note after the table still
    covers the whole tune."""
    r = runner.invoke(app, ["tune", "--model", "qwen3-30b", "--tokens", "64,4096", "--backend", "model", "--preset",
                            "nvlink-h200x2", "--trials", "2", "--db", str(tmp_path / "m.db"),
                            "--storage", f"sqlite:///{tmp_path / 'st.db'}", "--json"])
    assert r.exit_code == 0, r.output
    said = {row["tokens"]: row["extrapolation"] for row in json.loads(r.stdout)}
    assert said[4096] is None, said
    assert "at 64 tokens per GPU this tune extrapolates outside the measured range" in said[64]
