"""Resuming studies: a trial cut short (Ctrl-C, a killed process) is not one of the budget's finished trials, and
the warm-start point it carried (the policy default first of all) is measured on resume."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import MODELS
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import open_study, run_study
from moetune.tuner.search.trials import finished_trials

optuna.logging.set_verbosity(optuna.logging.ERROR)

WL = TuneWorkload(model=MODELS["qwen3-30b"], tokens=128, nodes=1, gpus_per_node=4)


def value(k: Knobs) -> float:
    """A fabric-like objective where compression and grouping pay."""
    t = 500.0 * (0.7 if k.compression != "none" else 1.0)
    t *= 0.8 if k.signalling != "coupled" else 1.0
    return t * (1 + abs(k.num_sms - 32) / 64)


def _space() -> SearchSpace:
    return SearchSpace(load_policy("proxy:ibrc"), experts=WL.model.experts, ep_size=WL.ep_size)


def _interrupt_at(n: int, seen: list[Knobs]) -> CallableBackend:
    def f(k: Knobs, wl: TuneWorkload) -> float:
        if len(seen) == n:
            raise KeyboardInterrupt  # Ctrl-C while this run is measuring
        seen.append(k)
        return value(k)

    return CallableBackend(f)


@pytest.mark.parametrize("at", [0, 3])
def test_ctrl_c_mid_trial_is_run_again_on_resume(tmp_path: Path, at: int) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    space, seen = _space(), []
    with pytest.raises(KeyboardInterrupt):
        run_study(open_study("moetune/t", url, seed=0), space, _interrupt_at(at, seen), WL, trials=8)
    assert len(seen) == at
    again: list[Knobs] = []
    res = run_study(open_study("moetune/t", url, seed=0), space,
                    CallableBackend(lambda k, w: again.append(k) or value(k)), WL, trials=8)
    # the budget is 8 measured trials: the interrupted one is not one of them
    assert len(seen) + len(again) == 8 and res.complete == 8
    # the policy default is measured even when its run was the one interrupted (it is the first warm start)
    assert res.default_value == pytest.approx(value(space.policy.defaults))
    assert space.policy.defaults in seen + again


ASK_AND_DIE = """
import os, sys
from moetune.tuner.search.study import open_study
t = open_study("moetune/t", sys.argv[1], seed=0).ask()
print(t._trial_id, flush=True)
os._exit(0)  # killed: no tell, no cleanup
"""


def test_killed_process_trial_is_run_again_on_resume(tmp_path: Path) -> None:
    """A process killed (SIGKILL / SIGTERM) mid-trial leaves it RUNNING: the next open fails it as interrupted,
    does not count it and runs its warm-start point again."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    space = _space()
    study = open_study("moetune/t", url, seed=0)
    run_study(study, space, CallableBackend(lambda k, w: value(k)), WL, trials=2)
    # the next warm-start point, taken by another process that then died (a trial of this very process is a
    # live one's: it is left alone)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ASK_AND_DIE, url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    dead = study._storage.get_trial(int(out.stdout.split()[-1]))
    assert dead.state == optuna.trial.TrialState.RUNNING and "warm_start" in dead.user_attrs
    dead_knobs = space.knobs_from_params(dead.system_attrs["fixed_params"])
    reopened = open_study("moetune/t", url, seed=0)
    assert finished_trials(reopened) == 2  # the dead process's trial is failed, but not a finished trial
    seen: list[Knobs] = []
    n = len(space.priors()) + 2
    res = run_study(reopened, space, CallableBackend(lambda k, w: seen.append(k) or value(k)), WL, trials=n)
    assert res.complete == n and len(seen) == n - 2
    assert dead_knobs in seen  # after the warm-start points still waiting


HELD_WORKER = """
import sys, time, optuna
from pathlib import Path
from moetune.runtime.shapes import MODELS
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import open_study, run_study
optuna.logging.set_verbosity(optuna.logging.ERROR)
wl = TuneWorkload(model=MODELS["qwen3-30b"], tokens=128, nodes=1, gpus_per_node=4)
space = SearchSpace(load_policy("proxy:ibrc"), experts=wl.model.experts, ep_size=4)
held, go = Path(sys.argv[2]), Path(sys.argv[3])

def measure(k, w):
    if not held.exists():  # the first trial, RUNNING with its worker attr: held until the test has opened the study
        held.write_text("")
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return 100.0

res = run_study(open_study("moetune/t", sys.argv[1], seed=0), space, CallableBackend(measure), wl, trials=3)
print("DONE", res.complete, res.failed)
"""


def test_opening_a_study_leaves_a_live_processes_trial_alone(tmp_path: Path) -> None:
    """A second process opening the same SQLite study (the daemon's re-tune and a `moetune tune`, both on the
    default studies file) failed the first one's running trial: the first then crashed on its result
    ("Cannot tell a FAIL trial") and lost the measurement. Only a dead process's trial is failed.

    The worker holds its first trial until the test has opened the study (files `held`, then `go`), so the open
    always meets a live process's running trial, and the test asserts that trial is still RUNNING after it. The worker's
    exit status and "DONE 3 0" alone prove nothing: a worker whose trial another process failed now drops that result
    and goes on (study._taken_over), so both held with every running trial failed on open. The test reads the studies
    file only once the worker has made it (a poll of it raced the worker's creation of the schema)."""
    import subprocess
    import sys
    import time

    url = f"sqlite:///{tmp_path / 's.db'}"
    script, held, go = tmp_path / "worker.py", tmp_path / "held", tmp_path / "go"
    script.write_text(HELD_WORKER)
    proc = subprocess.Popen([sys.executable, str(script), url, str(held), str(go)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not held.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        if not held.exists():
            proc.kill()
            pytest.fail(f"the worker never started its first trial: {proc.communicate()[1][-2000:]}")
        study = open_study("moetune/t", url, seed=0)  # another process opens the study meanwhile
        running = [t for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,)) if "worker" in t.user_attrs]
        assert len(running) == 1, study.get_trials()  # the worker's held trial, left running (was: failed)
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "DONE 3 0" in out
