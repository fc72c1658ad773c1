"""Backends: a hung or crashing run is killed / recorded failed and the study goes on."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import optuna
import pytest

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.shapes import MODELS
from moetune.tuner.search.backends import CallableBackend, Measurement, TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend, knob_environment
from moetune.tuner.search.model_backend import ModelBackend
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import run_study

optuna.logging.set_verbosity(optuna.logging.ERROR)

WL = TuneWorkload(model=MODELS["qwen3-30b"], tokens=1024, nodes=1, gpus_per_node=2)

# A stand-in for `moetune bench ep --json`: behaviour chosen by the knobs it is given.
FAKE_BENCH = r'''
import json, os, subprocess, sys, time
args = sys.argv[1:]
knobs = dict(kv.split("=", 1) for kv in args[args.index("--knobs") + 1].split(","))
pidfile = os.environ.get("FAKE_PIDFILE")
if knobs["channels"] == "2":                      # hang, with a child in the same process group
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    if pidfile:
        open(pidfile, "w").write(str(child.pid))
    time.sleep(120)
if knobs["pipeline_depth"] == "4":                # crash
    print("CUDA error: an illegal memory access was encountered", file=sys.stderr)
    sys.exit(3)
if knobs["chunk_tokens"] == "128":               # garbage on stdout
    print("not json at all")
    sys.exit(0)
layer = 1000.0 / int(knobs["pipeline_depth"]) * (0.6 if knobs["compression"] != "none" else 1.0)
layer *= 1 + abs(int(knobs["channels"]) - 1) / 100
print("some log line")
print(json.dumps({"dispatch_us": {"median": layer / 3, "p10": layer / 3 - 1, "p90": layer / 3 + 1},
                  "combine_us": {"median": layer / 3, "p10": 0, "p90": 0},
                  "layer_us": {"median": layer, "p10": layer - 2, "p90": layer + 2},
                  "roundtrip_us": {"median": layer / 2, "p10": layer / 2 - 3, "p90": layer / 2 + 3},
                  "max_rel_err": 0.02 if knobs["compression"] != "none" else 0.0,
                  "p2p_disable": os.environ.get("NCCL_P2P_DISABLE"), "argv": args}))
'''


@pytest.fixture
def fake_bench(tmp_path: Path) -> list[str]:
    p = tmp_path / "fake_bench.py"
    p.write_text(FAKE_BENCH)
    return [sys.executable, str(p)]


def _host_staged(**kw) -> Knobs:
    return load_policy("host_staged").defaults.replace(**kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by init) counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_local_backend_measures_with_env_knobs(fake_bench: list[str]) -> None:
    be = LocalBackend(command=fake_bench, repeats=3, timeout_s=20, family="host_staged")
    k = _host_staged(pipeline_depth=2)
    m = be.evaluate(k, WL)
    assert m.ok and m.error is None
    assert m.median_us == pytest.approx(500.0)
    assert len(m.samples) == 3 and m.spread_us == pytest.approx(2.0)  # within-run p10..p90 / 2
    assert "--knobs" in be.argv(k, WL) and "--json" in be.argv(k, WL)
    # measured in what launcher_env serves: no job-wide NCCL_P2P_DISABLE (tests/test_knob_env.py)
    assert knob_environment(k, "host_staged") == {}
    assert be.environment(k).get("NCCL_P2P_DISABLE") == os.environ.get("NCCL_P2P_DISABLE")
    comm = LocalBackend(command=fake_bench, repeats=1, metric="comm").evaluate(k, WL)
    assert comm.median_us == pytest.approx(250.0)  # the round trip (pipeline-aware), not dispatch + combine


def test_hung_run_is_killed_with_its_process_group(fake_bench: list[str], tmp_path: Path, monkeypatch) -> None:
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_PIDFILE", str(pidfile))
    be = LocalBackend(command=fake_bench, repeats=2, timeout_s=1.5)
    t0 = time.monotonic()
    m = be.evaluate(_host_staged(channels=2), WL)
    assert time.monotonic() - t0 < 10
    assert not m.ok and "timed out" in (m.error or "")
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the hung run's child survived the kill"


def test_crashing_and_garbled_runs_are_failures(fake_bench: list[str]) -> None:
    be = LocalBackend(command=fake_bench, repeats=2, timeout_s=20)
    m = be.evaluate(_host_staged(pipeline_depth=4), WL)
    assert not m.ok and "exit status 3" in (m.error or "") and "illegal memory access" in (m.error or "")
    g = be.evaluate(_host_staged(chunk_tokens=128), WL)
    assert not g.ok and "no JSON" in (g.error or "")


def test_measured_error_over_budget_is_infeasible(fake_bench: list[str]) -> None:
    be = LocalBackend(command=fake_bench, repeats=1, error_budget=0.01)
    m = be.evaluate(_host_staged(compression="fp8_e4m3"), WL)
    assert m.infeasible and not m.ok and "over the budget" in (m.error or "")
    assert "--verify" in be.argv(_host_staged(compression="fp8_e4m3"), WL)


def test_study_goes_on_after_hangs_and_crashes(fake_bench: list[str]) -> None:
    """A local-backend study where some settings hang and some crash: they are FAIL trials, the rest run."""
    pol_space = SearchSpace(load_policy("host_staged"), experts=128, ep_size=2)
    be = LocalBackend(command=fake_bench, repeats=1, timeout_s=1.0, family="host_staged")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    # Force one hang and one crash first (as a user's enqueued points would be).
    # (channels 2 at pipeline_depth 2: one chunk would use one lane whatever channels says, not offered)
    study.enqueue_trial(pol_space.params_of(_host_staged(channels=2, pipeline_depth=2)))
    study.enqueue_trial(pol_space.params_of(_host_staged(pipeline_depth=4)))
    res = run_study(study, pol_space, be, WL, trials=12, prune=False)
    states = [t.state for t in study.trials]
    assert len(study.trials) == 12
    fails = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert "timed out" in fails[0].user_attrs["error"]
    assert any("exit status 3" in t.user_attrs.get("error", "") for t in fails)
    assert states.count(optuna.trial.TrialState.COMPLETE) >= 4
    assert res.best_knobs is not None and res.best is not None and res.best.ok
    assert res.best_knobs.channels != 2 and res.best_knobs.pipeline_depth != 4


def test_compare_interleaves(fake_bench: list[str]) -> None:
    be = LocalBackend(command=fake_bench, repeats=1)
    a, b = be.compare([_host_staged(), _host_staged(pipeline_depth=2)], WL, rounds=2)
    assert a.ok and b.ok and len(a.samples) == 2 and b.median_us < a.median_us


def test_compare_rotates_the_order_every_round() -> None:
    """The side-by-side comparison that decides what is stored runs every setting first equally often: the order
    rotates each round (A B C, B C A, C A B), as `bench knobs` rotates its interleaved calls. In the same order every
    round the search's best (always listed first) ran first in each round, and in the first on a GPU rested from
    the study's last trial while the incumbent and the default paid for its heat (`measure.moe.settle`: 696-698 µs a
    call rested, 767-808 µs back to back at S=4096 on an H200), and ran after the default in every later round: a bias in one
    direction, which the noise rule cannot see."""
    order: list[int] = []
    cands = [Knobs(), Knobs(num_sms=16), Knobs(num_sms=32)]
    be = CallableBackend(lambda k, w: order.append(cands.index(k)) or 10.0 + cands.index(k))
    got = be.compare(cands, WL, rounds=3)
    assert [m.median_us for m in got] == [10.0, 11.0, 12.0]  # each setting keeps its own samples
    firsts = [order[3 * r] for r in range(3)]
    assert sorted(firsts) == [0, 1, 2], order  # each setting led one round
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    order.clear()
    be.compare(cands[:2], WL, rounds=2)
    assert order == [0, 1, 1, 0]


def test_model_backend_with_predictor() -> None:
    def pred(k: Knobs, wl: TuneWorkload) -> float:
        if k.num_sms == 32:
            raise KnobError("unsafe", ("num_sms",))
        if k.num_sms == 16:
            raise RuntimeError("boom")
        return 42.0

    be = ModelBackend(predictor=pred)
    assert be.modelled
    ok = be.evaluate(Knobs(), WL)
    assert ok.ok and ok.median_us == 42.0 and ok.spread_us == 0.0 and ok.details["modelled"]
    bad = be.evaluate(Knobs(num_sms=32), WL)
    assert bad.infeasible and not bad.ok
    err = be.evaluate(Knobs(num_sms=16), WL)
    assert not err.ok and not err.infeasible and "boom" in (err.error or "")
    cb = CallableBackend(lambda k, w: Measurement(1.0, 0.1, [1.0], True))
    assert cb.evaluate(Knobs(), WL).spread_us == 0.1


def test_study_user_attrs_are_json(fake_bench: list[str]) -> None:
    space = SearchSpace(load_policy("host_staged"), experts=128, ep_size=2)
    study = optuna.create_study()
    run_study(study, space, LocalBackend(command=fake_bench, repeats=1), WL, trials=2, prune=False)
    json.dumps(study.user_attrs)
    for t in study.trials:
        json.dumps(t.user_attrs)


def test_local_tune_remeasures_incumbent_side_by_side(fake_bench: list[str], tmp_path: Path) -> None:
    """With the local backend the winner is measured again beside the current profile; no gain, no write."""
    from moetune.tuner.search.tune import _Fam, tune_profiles_detailed
    from moetune.tuner.store.store import Store

    class Facts:
        fingerprint, software_hash, gpu_count = "c" * 64, "d" * 64, 2
        software: dict = {}  # noqa: RUF012
        link_rates: dict = {}  # noqa: RUF012
        transports = (_Fam("host_staged"), _Fam("collective"))

    store = Store(tmp_path / "m.db")
    be = LocalBackend(command=fake_bench, comm_backend="nccl", repeats=1, timeout_s=2)
    kw = dict(models=[MODELS["qwen3-30b"]], tokens=[1024], backend=be, trials=5,
              families=["host_staged"])
    first = tune_profiles_detailed(store, Facts(), storage=f"sqlite:///{tmp_path / 'a.db'}", **kw)
    assert first[0].written and first[0].record.backend == "local:nccl"
    assert len(first[0].record.knobs.to_dict()) == len(Knobs.__struct_fields__)
    again = tune_profiles_detailed(store, Facts(), storage=f"sqlite:///{tmp_path / 'b.db'}", **kw)
    # Same winner (the store: the same knobs with the same numbers) or another one measured beside the incumbent
    # (within noise): not written.
    assert not again[0].written and ("noise" in again[0].reason or "same knobs" in again[0].reason), again[0].reason
    assert store.get_current(first[0].record.key).knobs == first[0].record.knobs
