"""`moetune model predict/sweep` say what they modelled: the workload (JSON and titles), the phase (the other one
is "not modelled", never 0.0 µs), and a transport named in --knobs starts from that transport's defaults."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from moetune.tuner.cli import app


def _run(*args: str):
    r = CliRunner().invoke(app, ["model", *args], env={"MOETUNE_CONFIG": "", "COLUMNS": "300"}, terminal_width=300)
    assert "Traceback" not in r.output
    return r


def test_a_transport_named_in_knobs_takes_its_own_defaults() -> None:
    """`-k transport=collective` on a libfabric preset was refused for the preset's first transport's fence mode
    (proxy_drain), a knob the user never set."""
    r = _run("predict", "-p", "slingshot11-libfabric-a100x4", "-k", "transport=collective", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["knobs"]["transport"] == "collective"
    r = _run("predict", "-p", "nvlink-h200x2", "-m", "deepseek-v3", "-t", "4096", "-k", "transport=proxy", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["knobs"]["fence_mode"] == "proxy_drain"
    # a fence mode given with it still holds, and a transport the preset lacks is still refused by name
    r = _run("predict", "-p", "nvlink-h200x2", "-k", "transport=proxy,fence_mode=nic_ordered", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["knobs"]["fence_mode"] == "nic_ordered", r.output
    r = _run("predict", "-p", "nvlink-h200x2", "-k", "transport=ibgda")
    assert r.exit_code == 2 and "not available on preset 'nvlink-h200x2'" in r.output, r.output


def test_one_phase_leaves_the_other_unmodelled() -> None:
    r = _run("predict", "-p", "slingshot11-libfabric-a100x4", "-n", "4", "-t", "256", "--phase", "dispatch", "--json")
    d = json.loads(r.stdout)
    assert d["workload"]["phase"] == "dispatch" and d["combine_us"] is None and d["dispatch_us"] > 0
    r = _run("predict", "-p", "slingshot11-libfabric-a100x4", "-n", "4", "-t", "256", "--phase", "dispatch")
    out = " ".join(r.output.split())
    assert "combine │ not modelled" in out and "layer (dispatch + FFN)" in out and "dispatch only" in out, out
    assert "0.0 µs" not in out


def test_a_sweep_records_its_workload() -> None:
    """Two sweeps of other node counts differed 4x with nothing in their JSON or titles saying why."""
    a = json.loads(_run("sweep", "-p", "ndr-ibrc-h100x8", "--over", "tokens", "-n", "2", "--routing", "zipf:1.2",
                        "--json").stdout)
    assert a["workload"] == {"model": "qwen3-30b", "tokens_per_gpu": None, "nodes": 2, "gpus_per_node": 8,
                             "routing": "zipf:1.2", "tile": 128}
    r = _run("sweep", "-p", "ndr-ibrc-h100x8", "--over", "tokens", "-n", "4")
    assert "4x8 GPUs · uniform · tile 128 · sweep over tokens" in " ".join(r.output.split()), r.output


def test_a_bad_routing_is_refused_naming_the_option() -> None:
    """`model predict/sweep --routing ""` said "unknown routing ''", naming no option."""
    for cmd in ("predict", "sweep"):
        for routing in ("", "gauss", "zipf:x"):
            r = _run(cmd, "-p", "nvlink-h200x2", "--routing", routing)
            assert r.exit_code == 2 and "--routing: " in r.output and repr(routing) in r.output, r.output
