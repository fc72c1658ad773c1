"""`moetune bench ep` on CPU: spawns gloo ranks, times the phases, verifies against the dense reference."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

runner = CliRunner()


@pytest.mark.timeout(90)
def test_bench_ep_world2_gloo_verify_json() -> None:
    res = runner.invoke(app, ["bench", "ep", "--world", "2", "--backend", "gloo", "--verify", "--model",
                              "custom:256,128,16,4", "--tokens", "32", "--iters", "3", "--warmup", "1", "--json",
                              "--timeout", "30"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    for phase in ("dispatch_us", "combine_us", "layer_us", "roundtrip_us"):
        s = rep[phase]
        assert 0 < s["p10"] <= s["median"] <= s["p90"], (phase, s)
    assert rep["world"] == 2 and rep["backend"] == "gloo" and rep["tokens"] == 32
    assert rep["max_rel_err"] is not None and rep["max_rel_err"] < 3e-2 and rep["verify_ok"]
    assert rep["knobs"]["transport"] == "collective"
    assert rep["layout"] == "dense"  # small sends: the buffer picks the dense layout by itself
    assert rep["roundtrip_rel_err"] <= rep["roundtrip_bound"]


@pytest.mark.timeout(90)
def test_bench_ep_fp8_pipelined_zipf_and_plain_baseline() -> None:
    res = runner.invoke(app, ["bench", "ep", "--world", "2", "--model", "custom:128,64,8,2,float32", "--tokens", "24",
                              "--iters", "2", "--warmup", "1", "--knobs", "compression=fp8_e4m3,pipeline_depth=2",
                              "--routing", "zipf:1.2", "--layout", "packed", "--verify", "--json", "--timeout", "30"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["knobs"]["compression"] == "fp8_e4m3" and rep["knobs"]["pipeline_depth"] == 2
    assert 0 < rep["max_rel_err"] <= rep["verify_bound"]
    assert rep["layout"] == "packed"
    res = runner.invoke(app, ["bench", "ep", "--world", "2", "--model", "custom:128,64,8,2,float32", "--tokens", "24",
                              "--iters", "2", "--warmup", "0", "--impl", "plain", "--json", "--timeout", "30"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["impl"] == "plain" and rep["layer_us"] is None and rep["dispatch_us"]["median"] > 0
    assert rep["roundtrip_rel_err"] < 1e-5  # the baseline moves the data correctly too


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "nope"], "unknown model"),
        (["--knobs", "pipeline_depth=99"], "pipeline_depth"),
        (["--knobs", "bogus=1"], "unknown knob"),
        (["--routing", "gauss"], "unknown routing"),
        (["--world", "3", "--model", "custom:64,32,8,2"], "cannot be split"),
        (["--backend", "mpi"], "--backend"),
        (["--layout", "sparse"], "--layout"),
        (["--backend", "nccl"], "nccl"),
    ],
)
def test_bench_ep_bad_input_is_a_clear_error(args: list[str], needle: str) -> None:
    import torch

    if args[:2] == ["--backend", "nccl"] and torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("has GPUs: nccl is a valid choice here")
    res = runner.invoke(app, ["bench", "ep", *args])
    assert res.exit_code == 2
    assert needle in res.output
    assert "Traceback" not in res.output


def test_bench_ep_cuda_graph_needs_the_nccl_backend() -> None:
    res = runner.invoke(app, ["bench", "ep", "--world", "2", "--backend", "gloo", "--cuda-graph"])
    assert res.exit_code == 2
    assert "--cuda-graph needs --backend nccl" in res.output


@pytest.mark.timeout(90)
def test_bench_ep_reports_host_issue_time_and_profile_tables() -> None:
    res = runner.invoke(app, ["bench", "ep", "--world", "2", "--model", "custom:64,32,8,2,float32", "--tokens", "8",
                              "--iters", "2", "--warmup", "1", "--no-layer", "--profile", "--json", "--timeout", "30"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    for phase in ("dispatch_host_us", "combine_host_us", "roundtrip_host_us"):
        assert rep[phase]["median"] > 0, (phase, rep[phase])
    assert "round trips under the profiler" in rep["profile"] and "cpu_time_total" in rep["profile"]
    assert rep["graph_roundtrip_us"] is None and rep["graph_pair_us"] is None  # not asked for
