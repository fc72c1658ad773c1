"""EP size 1 with the fabric model: one rank exchanges nothing, so a modelled number for it is of no exchange at all.

`tune --backend local` refuses EP size 1 for transport families; the model backend and `model predict`/`sweep`
apply the same check (`backends.one_rank_exchange`), with the same wording, exit 2, rather than store a MODELLED
EP-1 nvlink profile (~14 µs of nothing) or print one without comment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.shapes import get_model
from moetune.tuner.cli import app
from moetune.tuner.search.backends import one_rank_exchange
from moetune.tuner.search.local_backend import unmeasured_key
from moetune.tuner.search.model_backend import ModelBackend

runner = CliRunner()
SAID = "one rank exchanges nothing"


def _flat(text: str) -> str:
    return " ".join(text.split())


def _refused(r) -> str:
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    out = _flat(r.output)
    assert SAID in out, out
    return out


def test_one_check_for_both_backends() -> None:
    # the local backend's refusal is the shared check's wording; the megakernel (one GPU) is never refused
    assert unmeasured_key(1, 1, 1, ["collective"]).startswith("EP size 1: " + SAID)
    assert one_rank_exchange(1, ["megakernel"], done="x", fix="y") == ""
    assert one_rank_exchange(2, ["nvlink"], done="x", fix="y") == ""
    why = ModelBackend("nvlink-h200x2").refusal(ep_size=1, nodes=1, families=["nvlink"], gpu_count=0)
    assert why.startswith("EP size 1: " + SAID) and '"modelled" profile' in why
    assert ModelBackend("nvlink-h200x2").refusal(ep_size=2, nodes=1, families=["nvlink"], gpu_count=0) == ""


def test_library_model_tune_refuses_ep_one(tmp_path: Path) -> None:
    from moetune.tuner.search.tune import tune_profiles_detailed
    from moetune.tuner.store.store import Store

    store = Store(tmp_path / "p.db")
    with pytest.raises(ValueError, match=SAID):
        tune_profiles_detailed(store, None, models=[get_model("qwen3-30b")], tokens=[128], backend="model",
                               preset="nvlink-h200x2", trials=2, ep_size=1,
                               storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert store.list_profiles() == [] and not (tmp_path / "opt.db").exists()


def test_cli_model_tune_refuses_ep_one_before_any_file(tmp_path: Path) -> None:
    r = runner.invoke(app, ["tune", "--backend", "model", "--preset", "nvlink-h200x2", "--ep-size", "1",
                            "-m", "qwen3-30b", "-t", "128", "-n", "2", "--db", str(tmp_path / "p.db")])
    out = _refused(r)
    assert "--ep-size 2" in out
    assert not (tmp_path / "p.db").exists() and not (tmp_path / "p-studies.db").exists()


def test_cli_model_tune_at_ep_two_still_runs(tmp_path: Path) -> None:
    r = runner.invoke(app, ["tune", "--backend", "model", "--preset", "nvlink-h200x2", "--ep-size", "2",
                            "-m", "qwen3-30b", "-t", "128", "-n", "2", "--db", str(tmp_path / "p.db"), "--json"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args", [["-g", "1"], ["-g", "1", "--json"]])
def test_predict_refuses_one_rank(args: list[str]) -> None:
    out = _refused(runner.invoke(app, ["model", "predict", "-p", "nvlink-h200x2", *args]))
    assert "--gpus-per-node" in out and "latency" not in out.split(SAID)[0]


def test_predict_two_ranks_still_predicts() -> None:
    r = runner.invoke(app, ["model", "predict", "-p", "nvlink-h200x2", "-g", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["label"] == "MODELLED"


@pytest.mark.parametrize("over", ["group_size", "tokens"])
def test_sweep_refuses_one_rank(over: str) -> None:
    _refused(runner.invoke(app, ["model", "sweep", "-p", "nvlink-h200x2", "-g", "1", "--over", over]))


def test_sweep_over_nodes_refuses_a_one_rank_value() -> None:
    out = _refused(runner.invoke(app, ["model", "sweep", "-p", "ndr-ibgda-h100x8", "-g", "1", "--over", "nodes",
                                       "--values", "1,2"]))
    assert out.startswith("error: --values:") or "--values" in out


def test_sweep_over_nodes_leaves_the_one_rank_default_out_with_a_note() -> None:
    r = runner.invoke(app, ["model", "sweep", "-p", "ndr-ibgda-h100x8", "-g", "1", "--over", "nodes", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    xs = {row["x"] for rows in data["series"].values() for row in rows}
    assert 1 not in xs and 2 in xs
    assert any("nodes = 1 left out" in n for n in data["notes"])
