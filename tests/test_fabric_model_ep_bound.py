"""The fabric model refuses an EP group past `records.MAX_PES` ranks as bad input. Its cost grows with the ranks:
`moetune model predict -n 1048576` of a custom shape with 8M experts (8M ranks) ran for minutes and gigabytes before
it printed anything, and `tune --backend model` at such a size spent each trial so. Now `Workload` refuses it, so
`model predict`/`sweep` exit 2 naming the size, and a model tune refuses it before any study or database file."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.fabric_model.records import MAX_PES, Workload

# experts = 2 x MAX_PES: an EP group of 2 x MAX_PES ranks divides them, so only the size is wrong
SHAPE = f"custom:2048,768,{2 * MAX_PES},8"


def test_workload_takes_the_bound_and_refuses_past_it() -> None:
    Workload(SHAPE, tokens_per_gpu=16, nodes=MAX_PES // 8, gpus_per_node=8)  # the bound itself is a workload
    with pytest.raises(ValueError, match=rf"{2 * MAX_PES} ranks \({MAX_PES // 4} nodes x 8 GPUs\) is beyond what the "
                                         rf"fabric model predicts \(at most {MAX_PES}\)"):
        Workload(SHAPE, tokens_per_gpu=16, nodes=MAX_PES // 4, gpus_per_node=8)


def _refused(r, needle: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    said = " ".join(r.output.split())  # the console wraps lines
    assert "Traceback" not in said and needle in said, said


def test_model_predict_and_sweep_refuse_it(tmp_path: Path) -> None:
    env = {"MOETUNE_HOME": str(tmp_path), "COLUMNS": "200"}
    r = CliRunner().invoke(app, ["model", "predict", "-p", "ndr-ibrc-h100x8", "-m", SHAPE, "-n", str(MAX_PES // 4),
                                 "-t", "16"], env=env)
    _refused(r, f"an EP group of {2 * MAX_PES} ranks")
    r = CliRunner().invoke(app, ["model", "sweep", "-p", "ndr-ibrc-h100x8", "-m", SHAPE, "--over", "nodes",
                                 "--values", f"2,{MAX_PES // 4}", "-t", "16"], env=env)
    _refused(r, f"--values: nodes = {MAX_PES // 4} is not a valid input")


def test_model_tune_refuses_it_before_any_file(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["tune", "-m", SHAPE, "-t", "16", "--backend", "model", "--preset", "ndr-ibrc-h100x8",
                                 "--trials", "1", "--ep-size", str(2 * MAX_PES), "--db", str(tmp_path / "m.db")],
                           env={"MOETUNE_HOME": str(tmp_path), "COLUMNS": "200"})
    _refused(r, f"EP size {2 * MAX_PES}: beyond what the fabric model predicts (at most {MAX_PES} ranks)")
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "m-studies.db").exists()
