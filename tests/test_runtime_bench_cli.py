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
        (["--routing", "gauss"], "--routing: unknown routing"),
        (["--routing", ""], "--routing: unknown routing ''"),
        (["--world", "3", "--model", "custom:64,32,8,2"], "do not divide evenly over an EP group of 3"),
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


def _captured_rank_env(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, dict | None, str]:
    """Run `bench ep --backend nccl` with two pretend GPUs and the launch replaced: the env its ranks would get."""
    import torch

    from moetune.runtime.testing import launch as launch_mod

    got: dict = {}

    def fake_launch(fn, world, *, env=None, **kw):
        got["env"] = dict(env or {})
        raise RuntimeError("stop after the environment was chosen")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launch_mod, "launch", fake_launch)
    res = runner.invoke(app, ["bench", "ep", "--world", "2", "--backend", "nccl", "--model", "custom:64,32,8,2",
                              "--tokens", "8", *args])
    return res.exit_code, got.get("env"), res.output


def test_bench_ep_ranks_get_the_tuners_environment_not_a_p2p_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    # 098c541: the tuner measures host_staged without NCCL_P2P_DISABLE (launcher_env); `bench ep`, which the
    # tuner's subprocess mode runs, set it for host_staged on NCCL by itself, so that mode measured another run
    from moetune.runtime import Knobs
    from moetune.runtime.knobs import default_knobs
    from moetune.tuner.search.local_backend import knob_environment

    _, env, out = _captured_rank_env(monkeypatch, "--transport", "host_staged")
    assert env == knob_environment(default_knobs("host_staged"), "host_staged") == {}, out
    _, env, out = _captured_rank_env(monkeypatch, "--transport", "host_staged", "--no-p2p")
    assert env == {"NCCL_P2P_DISABLE": "1"}, out
    _, env, out = _captured_rank_env(monkeypatch, "--no-p2p")  # any transport, when asked for
    assert env == {"NCCL_P2P_DISABLE": "1"}, out
    # the knob variables are launcher_env's, as the tuner's knob_environment gives them
    from moetune.tuner.cli.bench import ep_environment

    for k in (default_knobs("nvlink"), default_knobs("proxy"), Knobs(transport="ibgda", fence_mode="nic_ordered",
                                                                     qps_per_pe=4), default_knobs("collective")):
        assert ep_environment(k) == knob_environment(k, k.transport), k.transport
        assert "NCCL_P2P_DISABLE" not in ep_environment(k)
        assert ep_environment(k, no_p2p=True) == {**knob_environment(k, k.transport), "NCCL_P2P_DISABLE": "1"}


def test_bench_ep_no_p2p_needs_the_nccl_backend() -> None:
    res = runner.invoke(app, ["bench", "ep", "--world", "2", "--backend", "gloo", "--no-p2p"])
    assert res.exit_code == 2
    assert "--no-p2p" in res.output and "nccl" in res.output


def test_bench_ep_refuses_tokens_above_the_cap_before_any_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench ep --tokens 99999999` is refused up front with the cap `query` and `model` apply
    (runtime.shapes.MAX_TOKENS_PER_GPU), exit 2, no rank launched: not 2 ranks failing to allocate 819 GB."""
    from moetune.runtime.testing import launch as launch_mod

    def no_launch(*a: object, **kw: object) -> None:
        raise AssertionError("ranks launched")

    monkeypatch.setattr(launch_mod, "launch", no_launch)
    res = runner.invoke(app, ["bench", "ep", "--tokens", "99999999"])
    assert res.exit_code == 2, res.output
    assert "--tokens 99999999 is beyond what moetune handles (at most 4194304" in " ".join(res.output.split())
    assert "Traceback" not in res.output
    res = runner.invoke(app, ["bench", "moe", "--tokens", "16,99999999"])
    assert res.exit_code == 2, res.output
    assert "--tokens 99999999 is beyond" in " ".join(res.output.split())


@pytest.mark.timeout(90)
def test_bench_ep_json_is_stamped_as_a_result() -> None:
    """`bench ep --json` is a result (bench/results keeps such reports): it carries what every result carries, the
    code's git SHA, the date, the hardware and the command that ran (with the warm-up that ran), as `bench moe` and
    `bench knobs` stamp theirs. It had a date and the device's name, but no SHA, hardware line or command."""
    res = runner.invoke(app, ["bench", "ep", "--world", "1", "--model", "custom:64,32,8,2,float32", "--tokens", "8",
                              "--iters", "2", "--warmup", "1", "--no-layer", "--knobs", "pipeline_depth=2", "--json",
                              "--timeout", "30"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    meta = rep["meta"]
    assert meta["git_sha"] and meta["hardware"] and meta["date"].endswith("Z") and "git_dirty" in meta
    cmd = meta["command"]
    assert cmd.startswith("moetune bench ep --world 1 --backend gloo --model custom:64,32,8,2,float32 --tokens 8 ")
    assert "--knobs pipeline_depth=2" in cmd and "--no-layer" in cmd and "--iters 2" in cmd
    assert f"--warmup {rep['warmup']}" in cmd and rep["warmup"] == 4  # the warm-up that ran (raised to the sets)
