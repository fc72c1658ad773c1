"""A run whose output was wrong gives no timing: the EP round trip (the tuner's trials and the `ep` scenario driver),
`bench moe` / `bench knobs` (and their scenario drivers) and the proxy micro-benchmark's scenario driver.

Each compares the error it computes or records with its bound: otherwise a transport that moved stale rows, or
nothing, is timed, stored and could win a tuning run."""

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
from moetune.tuner.measure import results as R
from moetune.tuner.measure.outputs import ep_report_problem, rel_err_problem
from moetune.tuner.measure.scenarios import definitions, records, runner, summary
from moetune.tuner.measure.scenarios.drivers import ep as ep_driver
from moetune.tuner.measure.scenarios.drivers import moe as moe_drivers
from moetune.tuner.measure.scenarios.drivers import proxy as proxy_drivers

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


def _ep_cases() -> list[records.Resolved]:
    args = {k: v for k, v in EP_CASE.items() if k != "backend"}
    return [records.Resolved("collective", args, {}), records.Resolved("again", dict(args, seed=2), {})]


def test_ep_scenario_fails_a_case_whose_transport_moved_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _in_process_launch(monkeypatch)
    ctx = records.Ctx(world=1, backend="gloo", smoke=True, tmp=tmp_path)
    good = ep_driver.run_ep(_ep_cases(), ctx)
    assert all(r.metrics and "roundtrip_us" in r.metrics and r.error == "" for r in good), good
    _broken_combine(monkeypatch, 0.0)
    bad = ep_driver.run_ep(_ep_cases(), ctx)
    for r in bad:
        assert r.metrics == {} and "wrong output: the round trip" in r.error and "exceeds its bound" in r.error, r
    rows = runner.launch_rows(definitions.get("ep-roundtrip-qwen3-s128"), bad, "L1", {"source": "smoke"})
    s = definitions.get("ep-roundtrip-qwen3-s128")  # a failed case: a FAILED row per metric the scenario lists
    assert len(rows) == 2 * len(s.metrics) and all("median" not in r for r in rows), rows
    assert {r["note"][:30] for r in rows} == {"FAILED: wrong output: the roun"}, rows


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
    from moetune.tuner.search.backends import TuneWorkload
    from moetune.tuner.search.local_backend import LocalBackend

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
    from moetune.tuner.search.backends import TuneWorkload
    from moetune.tuner.search.local_backend import LocalBackend
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


# -- bench moe and bench knobs -------------------------------------------------------------------------------------

TINY_MODEL = "custom:128,64,4,2"


class _Megakernel:
    """Stands in for MegakernelMoE on the CPU: the layer's right output (the dense reference of the layer's seed, from
    its gate), times `scale` (1: right; 0: a kernel that wrote nothing, or zeros)."""

    scale = 1.0

    def __init__(self, model: Any, **kw: Any) -> None:
        self.model, self.seed = model, kw["seed"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from moetune.runtime.moe_layer import dense_reference

        return (dense_reference(x, self.model, seed=self.seed, weight_dtype=x.dtype) * self.scale).to(x.dtype)

    def rebind(self, *args: object) -> None:
        pass

    def check(self) -> None:
        pass


def _megakernel_on_cpu(monkeypatch: pytest.MonkeyPatch, scale: float) -> None:
    from moetune.runtime.megakernel import engine as E

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    monkeypatch.setattr(_Megakernel, "scale", scale)
    monkeypatch.setattr(E, "build_megakernel", _Megakernel)


def _cli(*args: str) -> Any:
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.mark.parametrize("scale", [0.0, 1.05])
def test_bench_moe_fails_an_engine_whose_output_is_wrong(monkeypatch: pytest.MonkeyPatch, scale: float) -> None:
    """rel_err_vs_unfused is bounded, not only reported beside the timings: over PAIR_REL_ERR_BOUND (0.02: two right
    bf16 layers' difference) the case fails at that S, so an engine computing zeros is no timing row."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    _megakernel_on_cpu(monkeypatch, 1.0)
    rep = M.bench_moe(get_model(TINY_MODEL), [1, 2], ["unfused", "megakernel"], iters=1, warmup=0, rotate=1)
    right = {(c["engine"], c["S"]): c for c in rep["cases"]}
    assert right[("megakernel", 1)]["rel_err_vs_unfused"] < 1e-5 and "eager_us" in right[("megakernel", 2)]
    _megakernel_on_cpu(monkeypatch, scale)
    rep = M.bench_moe(get_model(TINY_MODEL), [1, 2], ["unfused", "megakernel"], iters=1, warmup=0, rotate=1)
    rows = {(c["engine"], c["S"]): c for c in rep["cases"]}
    assert "eager_us" in rows[("unfused", 1)] and "eager_us" in rows[("unfused", 2)]
    for s in (1, 2):  # each S is checked (and run) on its own
        row = rows[("megakernel", s)]
        assert "eager_us" not in row and row["rel_err_vs_unfused"] == pytest.approx(abs(1 - scale), rel=1e-3)
        assert row["failed"].startswith("wrong output: the layer against the unfused engine's output: relative error")
        assert "exceeds its bound 0.02" in row["failed"]
    r = _cli("bench", "moe", "--engine", "unfused,megakernel", "--model", TINY_MODEL, "--tokens", "1", "--iters", "1",
             "--warmup", "0")
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and "megakernel S=1 failed: wrong output" in flat and "a case failed" in flat, r.output


def test_moe_scenario_records_a_wrong_engine_as_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _megakernel_on_cpu(monkeypatch, 0.0)
    args = {"model": TINY_MODEL, "tokens": [1], "iters": 1, "warmup": 0, "rotate": 1}
    out = moe_drivers.run_moe([records.Resolved("unfused", dict(args, engine="unfused"), {}),
                               records.Resolved("megakernel", dict(args, engine="megakernel"), {})],
                              records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path))
    by = {r.case: r for r in out}
    assert by["unfused"].metrics and by["unfused"].error == ""
    assert by["megakernel"].metrics == {} and by["megakernel"].error.startswith("S=1 failed: wrong output")


def test_bench_knobs_fails_a_variant_whose_output_is_wrong(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """rel_err_vs_base is bounded, not only reported beside the differences: over 0.02 the variant fails."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe_compare as MC

    _megakernel_on_cpu(monkeypatch, 1.0)
    variants = {"base": Knobs(engine="unfused"), "mk": Knobs(engine="megakernel")}
    rep = MC.compare_knobs(get_model(TINY_MODEL), [1], variants, iters=1, warmup=0, rotate=1, chained=1)
    (mk,) = [c for c in rep["cases"] if c["variant"] == "mk"]
    assert mk["rel_err_vs_base"] < 1e-5 and "single_us" in mk and "minus_base_us" in mk
    _megakernel_on_cpu(monkeypatch, 0.0)
    rep = MC.compare_knobs(get_model(TINY_MODEL), [1, 2], variants, iters=1, warmup=0, rotate=1, chained=1)
    rows = {(c["variant"], c["S"]): c for c in rep["cases"]}
    assert "single_us" in rows[("base", 1)] and "single_us" in rows[("base", 2)]
    for s in (1, 2):
        row = rows[("mk", s)]
        assert "single_us" not in row and "minus_base_us" not in row and row["rel_err_vs_base"] == pytest.approx(1.0)
        assert row["failed"].startswith("wrong output: the layer against the base's output: relative error 1 exceeds")
    r = _cli("bench", "knobs", "--knobs", "engine=unfused", "--vs", "mk=engine=megakernel", "--model", TINY_MODEL,
             "--tokens", "1", "--iters", "1", "--warmup", "0", "--rotate", "1", "--chain", "1")
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and "mk S=1 failed: wrong output" in flat, r.output
    out = moe_drivers.run_moe_knobs([records.Resolved("base", {"model": TINY_MODEL, "tokens": [1], "knobs": "engine=unfused",
                                                "iters": 1, "warmup": 0, "rotate": 1, "chain": 1}, {}),
                                     records.Resolved("mk", {"knobs": "engine=megakernel"}, {})],
                                    records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path))
    by = {r.case: r for r in out}
    assert by["base"].metrics and by["mk"].metrics == {} and by["mk"].error.startswith("S=1 failed: wrong output")


def test_bench_moe_without_the_unfused_engine_checks_each_engine_against_the_fp32_reference(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where the unfused engine is not beside it (`bench moe --engine megakernel`), each engine is checked against
    the fp32 dense reference: checked against the unfused engine's output only, it would be checked against nothing,
    and a megakernel writing zeros stored as a timing."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    _megakernel_on_cpu(monkeypatch, 1.0)
    rep = M.bench_moe(get_model(TINY_MODEL), [1, 2], ["megakernel"], iters=1, warmup=0, rotate=1)
    assert all("eager_us" in c and c["rel_err_vs_reference"] < 1e-5 for c in rep["cases"]), rep["cases"]
    _megakernel_on_cpu(monkeypatch, 0.0)
    rep = M.bench_moe(get_model(TINY_MODEL), [1, 2], ["megakernel"], iters=1, warmup=0, rotate=1)
    for c in rep["cases"]:
        assert "eager_us" not in c and c["rel_err_vs_reference"] == pytest.approx(1.0), c
        assert c["failed"].startswith("wrong output: the layer against the fp32 dense reference: relative error 1 "
                                      "exceeds its bound 0.01"), c
    r = _cli("bench", "moe", "--engine", "megakernel", "--model", TINY_MODEL, "--tokens", "1", "--iters", "1",
             "--warmup", "0")
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and "megakernel S=1 failed: wrong output" in flat and "a case failed" in flat, r.output
    args = {"model": TINY_MODEL, "tokens": [1], "iters": 1, "warmup": 0, "rotate": 1}
    (mk,) = moe_drivers.run_moe([records.Resolved("megakernel", dict(args, engine="megakernel"), {})],
                                records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path))
    assert mk.metrics == {} and mk.error.startswith("S=1 failed: wrong output: the layer against the fp32 dense"), mk


def test_bench_moe_checks_the_unfused_engine_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unfused engine's output, every other engine's reference, is itself checked against the fp32 reference,
    and where it is wrong the others are checked against that reference instead: a wrong unfused layer must not be
    a timing row, nor fail the right engines beside it."""
    from moetune.runtime.moe_layer import MoELayer
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    _megakernel_on_cpu(monkeypatch, 1.0)
    rep = M.bench_moe(get_model(TINY_MODEL), [1], ["unfused", "megakernel"], iters=1, warmup=0, rotate=1)
    rows = {c["engine"]: c for c in rep["cases"]}
    assert rows["unfused"]["rel_err_vs_reference"] < 1e-5 and rows["megakernel"]["rel_err_vs_unfused"] < 1e-5
    forward = MoELayer.forward
    monkeypatch.setattr(MoELayer, "forward", lambda self, x: forward(self, x) * 0 if self.engine == "unfused"
                        else forward(self, x))
    rep = M.bench_moe(get_model(TINY_MODEL), [1], ["unfused", "megakernel"], iters=1, warmup=0, rotate=1)
    rows = {c["engine"]: c for c in rep["cases"]}
    assert rows["unfused"]["failed"].startswith("wrong output: the unfused layer against the fp32 dense reference")
    assert "eager_us" in rows["megakernel"] and rows["megakernel"]["rel_err_vs_reference"] < 1e-5, rows


def test_bench_knobs_checks_the_base_against_the_fp32_reference(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """The base variant is checked too: a megakernel base writing zeros fails, and the others are checked against the
    fp32 reference, with no difference to the wrong base, rather than timed as the base with every right variant
    beside it failing as 'not the base's output'."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe_compare as MC

    _megakernel_on_cpu(monkeypatch, 1.0)
    variants = {"base": Knobs(engine="megakernel"), "u": Knobs(engine="unfused")}
    rep = MC.compare_knobs(get_model(TINY_MODEL), [1], variants, iters=1, warmup=0, rotate=1, chained=1)
    rows = {c["variant"]: c for c in rep["cases"]}
    assert rows["base"]["rel_err_vs_reference"] < 1e-5 and "single_us" in rows["base"]
    assert rows["u"]["rel_err_vs_base"] < 1e-5 and "minus_base_us" in rows["u"]
    _megakernel_on_cpu(monkeypatch, 0.0)
    rep = MC.compare_knobs(get_model(TINY_MODEL), [1, 2], variants, iters=1, warmup=0, rotate=1, chained=1)
    rows = {(c["variant"], c["S"]): c for c in rep["cases"]}
    for s in (1, 2):
        base, u = rows[("base", s)], rows[("u", s)]
        assert "single_us" not in base and base["rel_err_vs_reference"] == pytest.approx(1.0)
        assert base["failed"].startswith("wrong output: the base's layer against the fp32 dense reference: relative "
                                         "error 1 exceeds its bound 0.01"), base
        assert "single_us" in u and "minus_base_us" not in u and u["rel_err_vs_reference"] < 1e-5, u
    r = _cli("bench", "knobs", "--vs", "u=engine=unfused", "--model", TINY_MODEL, "--tokens", "1", "--iters", "1",
             "--warmup", "0", "--rotate", "1", "--chain", "1")
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and "base S=1 failed: wrong output" in flat, r.output
    out = moe_drivers.run_moe_knobs([records.Resolved("base", {"model": TINY_MODEL, "tokens": [1], "iters": 1, "warmup": 0,
                                                "rotate": 1, "chain": 1}, {}),
                                     records.Resolved("u", {"knobs": "engine=unfused"}, {})],
                                    records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path))
    by = {r.case: r for r in out}
    assert by["base"].metrics == {} and by["base"].error.startswith("S=1 failed: wrong output: the base's layer"), by
    assert by["u"].metrics and "minus_base_us[S=1]" not in by["u"].metrics, by["u"]



@pytest.mark.parametrize("base", ["wrong", "failed"])
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_bench_knobs_says_why_there_is_no_difference_where_the_base_failed(monkeypatch: pytest.MonkeyPatch,
                                                                            base: str, as_json: bool) -> None:
    """A base whose output was wrong (a megakernel writing zeros) or whose launches failed is a failed case: the
    right variant beside it says why it has no "minus base", then one exit 1 (exiting before `_no_differences` runs
    would leave that row's "minus base" empty without a word)."""
    from moetune.runtime.megakernel.layer import MegakernelError

    _megakernel_on_cpu(monkeypatch, 0.0 if base == "wrong" else 1.0)
    if base == "failed":
        def timed_out(self: _Megakernel) -> None:
            raise MegakernelError("a wait timed out")

        monkeypatch.setattr(_Megakernel, "check", timed_out)
    r = _cli("bench", "knobs", "--vs", "u=engine=unfused", "--model", TINY_MODEL, "--tokens", "1", "--iters", "1",
             "--warmup", "0", "--rotate", "1", "--chain", "1", *(["--json"] if as_json else []))
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    said = "wrong output" if base == "wrong" else "a wait timed out"
    why = "the base's output was wrong at S=1" if base == "wrong" else "the base's launches failed at S=1"
    assert f"base S=1 failed: {said}" in flat and flat.count("a case failed") == 1, r.output
    assert flat.count(f"error: no difference to the base at S=1: {why}") == 1, r.output
    if as_json:
        (line,) = [ln for ln in r.output.splitlines() if ln.startswith("{")]
        rep = json.loads(line)
        (u,) = [c for c in rep["cases"] if c["variant"] == "u"]
        assert "single_us" in u and "minus_base_us" not in u and u["no_difference"].endswith(why), u


# -- proxy_micro ---------------------------------------------------------------------------------------------------

# bench/proxy_micro.py's modes: (fence_mode, signalling, proxy batch)
PROXY_MODES = {"put_only": ("none", "none", 1), "coupled_drain": ("proxy_drain", "coupled", 1),
               "decoupled_drain": ("proxy_drain", "decoupled", 1), "coupled_ordered": ("nic_ordered", "coupled", 1),
               "decoupled_ordered": ("nic_ordered", "decoupled", 1), "put_only+batch": ("none", "none", 64),
               "decoupled_drain+batch": ("proxy_drain", "decoupled", 64),
               "decoupled_ordered+batch": ("nic_ordered", "decoupled", 64)}


def _proxy_row(mode: str, us: float, **kw: Any) -> dict[str, Any]:
    fence, sig, batch = PROXY_MODES[mode]
    return {"bench": "proxy_micro", "mode": mode, "fence_mode": fence, "signalling": sig, "concurrency": 96,
            "size": 4096, "batch": batch, "iters": 20, "us_median": us, "us_p10": us - 1, "us_p90": us + 1,
            "signals_landed": None if sig == "none" else True, "engine_error": None, **kw}


def test_proxy_batch_modes_are_cases_of_their_own() -> None:
    """decoupled_drain+batch's row went into decoupled-proxy-drain's metric (written after it: its number won), and
    put_only+batch's into a case none-none."""
    rows = [_proxy_row(m, 100.0 + i) for i, m in enumerate(PROXY_MODES)]
    per = proxy_drivers.proxy_metrics(rows)
    assert set(per) == {"put-only", "coupled-proxy-drain", "decoupled-proxy-drain", "coupled-nic-ordered",
                        "decoupled-nic-ordered", "put-only-batch", "decoupled-proxy-drain-batch",
                        "decoupled-nic-ordered-batch"}
    assert per["decoupled-proxy-drain"]["batch_us[4096B,c96]"].median == 102.0
    assert per["decoupled-proxy-drain-batch"]["batch_us[4096B,c96]"].median == 106.0
    assert per["put-only"]["batch_us[4096B,c96]"].median == 100.0


def test_proxy_scenario_fails_a_mode_whose_signals_did_not_land(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Rows with signals_landed false, an engine error or an error were kept (the first two as timings) or dropped
    without a word (the third, beside the mode's other points): such a case now fails with that reason."""
    rows = [_proxy_row("put_only", 10.0), _proxy_row("put_only", 11.0, size=16384),
            _proxy_row("coupled_drain", 12.0), _proxy_row("coupled_drain", 9.0, size=16384, signals_landed=False),
            _proxy_row("decoupled_drain", 13.0, engine_error="cudaMemcpyAsync failed (code 7)"),
            _proxy_row("coupled_ordered", 14.0),
            {"bench": "proxy_micro", "mode": "coupled_ordered", "fence_mode": "nic_ordered", "signalling": "coupled",
             "batch": 1, "concurrency": 4, "error": "engine construction failed: out of QPs"},
            _proxy_row("decoupled_ordered", 15.0),
            _proxy_row("decoupled_ordered+batch", 5.0, signals_landed=False)]  # its own case: not decoupled-nic-ordered

    def run_script(script: str, args: dict[str, Any], env: dict[str, str], ctx: records.Ctx) -> tuple[str, str]:
        out = Path(args["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "proxy_micro.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return "", "python bench/proxy_micro.py"

    monkeypatch.setattr(proxy_drivers, "run_script", run_script)
    names = ["put-only", "coupled-proxy-drain", "decoupled-proxy-drain", "coupled-nic-ordered", "decoupled-nic-ordered"]
    out = proxy_drivers.run_proxy_micro([records.Resolved(n, {}, {}) for n in names], records.Ctx(world=1, backend="none", smoke=False,
                                                                           tmp=tmp_path))
    by = {r.case: r for r in out}
    assert by["put-only"].error == "" and len(by["put-only"].metrics) == 2
    assert by["decoupled-nic-ordered"].error == "" and by["decoupled-nic-ordered"].metrics
    for name, said in (("coupled-proxy-drain", "coupled_drain at 16384B, c96: not every signal landed"),
                       ("decoupled-proxy-drain", "the proxy engine recorded an error: cudaMemcpyAsync failed"),
                       ("coupled-nic-ordered", "coupled_ordered failed at c4: engine construction failed")):
        assert by[name].metrics == {} and said in by[name].error, by[name]
    assert "decoupled-nic-ordered-batch" in proxy_drivers.proxy_failures(rows)


def test_an_ep_case_run_in_another_world_gets_no_ratio_to_the_baseline(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """run_ep starts one spawned world per run of consecutive cases with the same env: a case with an env of its own
    (and every case after it, the closing baseline run included) ran in other processes than the baseline's first
    run, and the summary's ratio paired them as if side by side. Those runs now say so in their note, and the table
    takes no ratio from them (their own numbers still show)."""
    _in_process_launch(monkeypatch)
    # a warm-up of one call per input set: a lower one is raised, and its note would join these notes
    args = {**{k: v for k, v in EP_CASE.items() if k != "backend"}, "warmup": ep.DEFAULT_ROTATE}
    seq = [records.Resolved("collective", args, {}), records.Resolved("same-world", dict(args, seed=2), {}),
           records.Resolved("own-env", dict(args, seed=3), {"NCCL_DEBUG": "WARN"}), records.Resolved("collective", args, {})]
    out = ep_driver.run_ep(seq, records.Ctx(world=1, backend="gloo", smoke=True, tmp=tmp_path))
    assert [r.note for r in out] == ["", "", ep_driver.OTHER_WORLD, ep_driver.OTHER_WORLD], out
    s = definitions.get("host-staged-fp8-pipelined")
    metric = s.metrics[0]
    st = records.Stat(100.0, 99.0, 101.0, 3, "us")
    res = [records.CaseResult(s.baseline.name, {metric: st}, "c"),
           records.CaseResult("fp8-depth4", {metric: records.Stat(50.0, 49.0, 51.0, 3, "us")}, "c"),
           records.CaseResult("fp8-depth3", {metric: records.Stat(25.0, 24.0, 26.0, 3, "us")}, "c", note=ep_driver.OTHER_WORLD),
           records.CaseResult(s.baseline.name, {metric: records.Stat(300.0, 299.0, 301.0, 3, "us")}, "c", note=ep_driver.OTHER_WORLD)]
    rows = [{k: R._cell(v) for k, v in r.items()} for r in runner.launch_rows(s, res, "L1", {
        "source": "measured", "date": "2026-12-01T10:00:00Z", "git_sha": "a" * 40, "git_dirty": False,
        "hardware": "2x NVIDIA H200", "gpu": "NVIDIA H200"})]
    table = {ln.split("|")[1].strip().removesuffix(" (baseline)"): ln.split("|")[-2].strip()
             for ln in summary.scenario_table(s, rows) if ln.startswith("| ") and not ln.startswith(("| case", "| ---"))}
    # beside the baseline's first run (100): 2.00x; the closing baseline run (300, another world) is no divisor
    assert table == {s.baseline.name: "1.00×", "fp8-depth4": "2.00×", "fp8-depth3": "-"}, table
