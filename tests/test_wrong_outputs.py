"""A run whose output was wrong gives no timing: the EP round trip (the tuner's trials and the `ep` scenario driver),
`bench moe` / `bench knobs` (and their scenario drivers) and the proxy micro-benchmark's scenario driver.

Before, each computed or recorded the error and nothing compared it with its bound: a transport that moved stale rows,
or nothing, was timed, stored and could win a tuning run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch

from moetune.runtime.buffer.facade import EPBuffer
from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import MODELS
from moetune.tuner.measure import ep
from moetune.tuner.measure import scenarios as S
from moetune.tuner.measure.outputs import ep_report_problem, rel_err_problem

optuna.logging.set_verbosity(optuna.logging.ERROR)

EP_MODEL = "custom:64,32,8,2,float32"
EP_CASE = {"model": EP_MODEL, "tokens": 16, "knobs": "transport=collective", "iters": 2, "warmup": 1, "seed": 1,
           "layer": False, "backend": "gloo"}


# -- the verdict ---------------------------------------------------------------------------------------------------


def test_rel_err_verdict_and_ep_report_verdict() -> None:
    assert rel_err_problem(0.01, 0.01, "x") is None and rel_err_problem(0.0, 1e-5, "x") is None
    assert "relative error 0.02 exceeds its bound 0.01" in (rel_err_problem(0.02, 0.01, "x") or "")
    assert "NaN" in (rel_err_problem(math.nan, 0.01, "x") or "")
    assert "inf exceeds" in (rel_err_problem(math.inf, 0.01, "x") or "")
    ok = {"roundtrip_rel_err": 0.004, "roundtrip_bound": 0.03, "graph_roundtrip_rel_err": None,
          "graph_pair_rel_err": None, "max_rel_err": None, "verify_bound": None}
    assert ep_report_problem(ok) is None
    assert ep_report_problem({}) is None  # a report that checked nothing (not the real bench's)
    why = ep_report_problem({**ok, "roundtrip_rel_err": 1.0})
    assert why is not None and "the round trip" in why and "1 exceeds its bound 0.03" in why
    assert "CUDA graph" in (ep_report_problem({**ok, "graph_roundtrip_rel_err": 0.5}) or "")
    assert "dispatch + combine" in (ep_report_problem({**ok, "graph_pair_rel_err": math.nan}) or "")
    assert "dense reference" in (ep_report_problem({**ok, "max_rel_err": 0.2, "verify_bound": 0.11}) or "")
    assert ep_report_problem({**ok, "max_rel_err": 0.05, "verify_bound": 0.11}) is None
    assert ep_report_problem({"max_rel_err": 0.0}) is None  # no bound to check it against
    assert "not a checked number" in (ep_report_problem({"roundtrip_rel_err": "0", "roundtrip_bound": 0.03}) or "")


# -- the EP benchmark's report -------------------------------------------------------------------------------------


def _broken_combine(monkeypatch: pytest.MonkeyPatch, fill: float) -> None:
    """EPBuffer.combine hands back `fill` everywhere: a transport that moved nothing (0) or left poison (NaN)."""
    orig = EPBuffer.combine

    def combine(self: EPBuffer, *a: Any, **kw: Any) -> torch.Tensor:
        return torch.full_like(orig(self, *a, **kw), fill)

    monkeypatch.setattr(EPBuffer, "combine", combine)


def test_a_round_trip_of_nan_is_reported_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """max() kept 0.0 over a NaN error: a round trip that gave back NaN reported roundtrip_rel_err 0.0."""
    rep = ep.bench_case(0, 1, dict(EP_CASE))
    assert rep is not None and rep["roundtrip_rel_err"] <= rep["roundtrip_bound"] and ep_report_problem(rep) is None
    _broken_combine(monkeypatch, math.nan)
    rep = ep.bench_case(0, 1, dict(EP_CASE))
    assert rep is not None and rep["roundtrip_rel_err"] == math.inf
    assert "the round trip" in (ep_report_problem(rep) or "")


def _in_process_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ep driver's spawned world as rank 0 of a world of one in this process (where monkeypatches hold)."""
    from moetune.runtime.testing import launch

    monkeypatch.setattr(launch, "launch", lambda fn, world, *, args, **kw: [fn(0, 1, *args)])


def _ep_cases() -> list[S.Resolved]:
    args = {k: v for k, v in EP_CASE.items() if k != "backend"}
    return [S.Resolved("collective", args, {}), S.Resolved("again", dict(args, seed=2), {})]


def test_ep_scenario_fails_a_case_whose_transport_moved_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _in_process_launch(monkeypatch)
    ctx = S.Ctx(world=1, backend="gloo", smoke=True, tmp=tmp_path)
    good = S.run_ep(_ep_cases(), ctx)
    assert all(r.metrics and "roundtrip_us" in r.metrics and r.error == "" for r in good), good
    _broken_combine(monkeypatch, 0.0)
    bad = S.run_ep(_ep_cases(), ctx)
    for r in bad:
        assert r.metrics == {} and "wrong output: the round trip" in r.error and "exceeds its bound" in r.error, r
    rows = S._launch_rows(S.get("ep-roundtrip-qwen3-s128"), bad, "L1", {"source": "smoke"})
    assert [r["note"][:30] for r in rows] == ["FAILED: wrong output: the roun"] * 2 and all("median" not in r for r in rows)


# -- the tuner's trials --------------------------------------------------------------------------------------------

# A stand-in for `moetune bench ep --json`: pipeline_depth=2 is the fastest setting and its round trip wrong (a
# transport that moved stale rows); pipeline_depth=4 gave back NaN; the rest are right.
FAKE_BENCH = r'''
import json, sys
args = sys.argv[1:]
knobs = dict(kv.split("=", 1) for kv in args[args.index("--knobs") + 1].split(","))
depth = knobs["pipeline_depth"]
us = {"1": 500.0, "2": 100.0, "4": 90.0}[depth]
err = {"1": 0.0, "2": 0.75, "4": float("nan")}[depth]
q = {"median": us, "p10": us - 1, "p90": us + 1}
print(json.dumps({"dispatch_us": q, "combine_us": q, "roundtrip_us": q, "layer_us": q, "max_rel_err": None,
                  "verify_bound": None, "roundtrip_rel_err": err, "roundtrip_bound": 0.03}))
'''


@pytest.fixture
def fake_bench(tmp_path: Path) -> list[str]:
    p = tmp_path / "fake_bench.py"
    p.write_text(FAKE_BENCH)
    return [sys.executable, str(p)]


def _host_staged(**kw: Any) -> Knobs:
    from moetune.tuner.search.policy import load_policy

    return load_policy("host_staged").defaults.replace(**kw)


def test_a_trial_whose_round_trip_was_wrong_is_infeasible(fake_bench: list[str]) -> None:
    from moetune.tuner.search.backends import LocalBackend, TuneWorkload

    wl = TuneWorkload(model=MODELS["qwen3-30b"], tokens=1024, nodes=1, gpus_per_node=2)
    be = LocalBackend(command=fake_bench, repeats=2, metric="comm", family="host_staged")
    ok = be.evaluate(_host_staged(), wl)
    assert ok.ok and ok.median_us == pytest.approx(500.0) and ok.details["roundtrip_rel_err"] == 0.0
    stale = be.evaluate(_host_staged(pipeline_depth=2), wl)
    assert not stale.ok and stale.infeasible and not stale.samples
    assert "wrong output: the round trip" in (stale.error or "") and "0.75 exceeds its bound 0.03" in stale.error
    nan = be.evaluate(_host_staged(pipeline_depth=4), wl)
    assert nan.infeasible and "NaN" in (nan.error or "")
    json.dumps(nan.details)  # stored in the trial's user attrs


def test_a_wrong_fast_setting_does_not_win_a_study(fake_bench: list[str]) -> None:
    from moetune.tuner.search.backends import LocalBackend, TuneWorkload
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.study import run_study

    wl = TuneWorkload(model=MODELS["qwen3-30b"], tokens=1024, nodes=1, gpus_per_node=2)
    space = SearchSpace(load_policy("host_staged"), experts=128, ep_size=2)
    be = LocalBackend(command=fake_bench, repeats=1, metric="comm", family="host_staged")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for depth in (2, 4, 1):
        study.enqueue_trial(space.params_of(_host_staged(pipeline_depth=depth)))
    res = run_study(study, space, be, wl, trials=3, prune=False)
    assert res.best_knobs is not None and res.best_knobs.pipeline_depth == 1
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert len(pruned) == 2 and all("wrong output" in t.user_attrs["infeasible"] for t in pruned)
