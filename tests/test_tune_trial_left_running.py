"""No trial of this process is left RUNNING by an interrupt: Ctrl-C (or SIGTERM) inside Optuna's `ask()` (the trial's
creation, an enqueued trial taken, the sampler's `before_trial`), between `ask()` and the objective, inside a suggest
call or inside `tell()` before the state is written. A trial cut there and left RUNNING would stay so as long as this
process lives (the daemon, for weeks), on a server storage for good (it has no heartbeat), listed as running by `tune
show`. The study resumes to the trials asked. A RUNNING trial of a dead owner
is failed when the study is opened again; a live concurrent owner's is left alone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from moetune.runtime import _proc
from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import MODELS
from moetune.tuner.search import storage, workers
from moetune.tuner.search import study as study_mod
from moetune.tuner.search.backends import CallableBackend, Measurement, TuneWorkload
from moetune.tuner.search.interrupt_guard import deliver, guarded
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import open_study, run_study
from moetune.tuner.search.trials import INTERRUPTED, finished_trials
from moetune.tuner.search.workers import Terminated

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.timeout(180)

WL = TuneWorkload(model=MODELS["qwen3-30b"], tokens=128, nodes=1, gpus_per_node=4)
TRIALS = 10


def value(k: Knobs) -> float:
    return 100.0 + k.num_sms + (50.0 if k.signalling == "coupled" else 0.0)


def _space() -> SearchSpace:
    return SearchSpace(load_policy("proxy:ibrc"), experts=WL.model.experts, ep_size=WL.ep_size)


def _sigint() -> None:
    """A real Ctrl-C: the handler (`ctrl_c`) runs at the next bytecode, here (inside a study-storage call it is kept
    until the call returns)."""
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def ctrl_c() -> Any:
    """SIGINT handled as the CLI's handler does (`signals_interrupt`: `interrupt_guard.deliver`), without recording
    it for the CLI's end of a command."""
    def on_int(_signum: int, _frame: object) -> None:
        deliver(KeyboardInterrupt())

    old = signal.signal(signal.SIGINT, on_int)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def python_sigint_handler() -> Any:
    """Python's own SIGINT handler, as in a terminal, for a test of the CLI's: a pytest started with SIGINT ignored
    (`nohup`, `cmd &` in a non-interactive shell) keeps it ignored, and the CLI then leaves SIGINT alone, as it must:
    the Ctrl-C would never arrive and the test would fail for how it was started."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _once(when: Callable[..., bool], then: Callable[[], None] = _sigint) -> Callable[..., bool]:
    """`when`, true the first time only, running `then` there."""
    fired: list[bool] = []

    def check(*a: Any) -> bool:
        if not fired and when(*a):
            fired.append(True)
            then()
            return True
        return False

    check.fired = fired  # type: ignore[attr-defined]
    return check


def _in_create(mp: pytest.MonkeyPatch, nth: int) -> Callable[..., bool]:
    """Ctrl-C inside the storage call creating the `nth` new RUNNING trial (ask() never gets its id)."""
    real = optuna.storages.RDBStorage._create_new_trial
    made: list[int] = []

    def create(self: Any, study_id: int, template_trial: Any = None) -> Any:
        frozen = real(self, study_id, template_trial)
        if frozen.state == TrialState.RUNNING:
            made.append(frozen._trial_id)
            hit(len(made))
        return frozen

    hit = _once(lambda n: n == nth)
    mp.setattr(optuna.storages.RDBStorage, "_create_new_trial", create)
    return hit


def _in_take(mp: pytest.MonkeyPatch, nth: int) -> Callable[..., bool]:
    """Ctrl-C inside the storage call taking the `nth` enqueued trial (WAITING -> RUNNING: a warm-start point)."""
    real = optuna.storages.RDBStorage.set_trial_state_values
    taken: list[int] = []

    def take(self: Any, trial_id: int, state: TrialState, values: Any = None) -> bool:
        changed = real(self, trial_id, state, values)
        if changed and state == TrialState.RUNNING:
            taken.append(trial_id)
            hit(len(taken))
        return changed

    hit = _once(lambda n: n == nth)
    mp.setattr(optuna.storages.RDBStorage, "set_trial_state_values", take)
    return hit


def _in_before_trial(mp: pytest.MonkeyPatch, nth: int) -> Callable[..., bool]:
    """Ctrl-C in the sampler's `before_trial` (inside ask(): the trial created, no parameter suggested yet)."""
    real = optuna.samplers.TPESampler.before_trial

    def before(self: Any, study: optuna.Study, trial: Any) -> None:
        real(self, study, trial)
        hit(trial.number)

    hit = _once(lambda n: n == nth - 1)
    mp.setattr(optuna.samplers.TPESampler, "before_trial", before)
    return hit


def _after_ask(mp: pytest.MonkeyPatch, nth: int) -> Callable[..., bool]:
    """Ctrl-C after ask() returned, before the objective runs (Optuna starts the trial's heartbeat thread there)."""
    import optuna.study._optimize as optimize

    real = optimize.get_heartbeat_thread
    calls: list[int] = []

    def beat(trial_id: int, storage: Any) -> Any:
        calls.append(trial_id)
        hit(len(calls))
        return real(trial_id, storage)

    hit = _once(lambda n: n == nth)
    mp.setattr(optimize, "get_heartbeat_thread", beat)
    return hit


def _in_suggest(mp: pytest.MonkeyPatch, nth: int) -> Callable[..., bool]:
    """Ctrl-C inside the storage call writing a suggested parameter (the objective's first: Optuna fails the trial)."""
    real = optuna.storages.RDBStorage._set_trial_param
    trials: list[int] = []

    def write(self: Any, trial_id: int, *a: Any) -> Any:
        out = real(self, trial_id, *a)
        if trial_id not in trials:
            trials.append(trial_id)
        hit(len(trials))
        return out

    hit = _once(lambda n: n == nth)
    # the storage's own (guarded) method: GuardedRDBStorage wraps each RDBStorage method it does not define
    mp.setattr(storage.GuardedRDBStorage, "_set_trial_param", guarded(write))
    return hit


def _in_tell(mp: pytest.MonkeyPatch, nth: int) -> Callable[..., bool]:
    """Ctrl-C in tell(), before the trial's state is written (its measurement is lost: the trial is cut short)."""
    import optuna.study._optimize as optimize

    real = optimize._tell_with_warning
    calls: list[int] = []

    def tell(*a: Any, **k: Any) -> Any:
        calls.append(1)
        hit(len(calls))
        return real(*a, **k)

    def interrupt() -> None:
        raise KeyboardInterrupt

    hit = _once(lambda n: n == nth, interrupt)
    mp.setattr(optimize, "_tell_with_warning", tell)
    return hit


def _running(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))


def _cut(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.FAIL and INTERRUPTED in t.user_attrs]


# the warm-start points come first (each an enqueued trial taken), then TPE's (each a new trial created)
WARM = len(_space().priors())


@pytest.mark.parametrize(("inject", "nth"), [
    (_in_create, 2),  # the 2nd trial TPE samples: created RUNNING, its id never returned by ask()
    (_in_take, 1),  # the policy default taken from the queue: its id never returned either
    (_in_take, 3),
    (_in_before_trial, WARM + 2),  # between the trial's creation and its first suggest
    (_after_ask, 2),
    (_in_suggest, WARM + 1),
    (_in_tell, 3),
])
def test_an_interrupt_leaves_no_running_trial_and_the_study_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    ctrl_c: None, inject: Callable[..., Any],
                                                                    nth: int) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    space = _space()
    with monkeypatch.context() as mp:
        hit = inject(mp, nth)
        study = open_study("moetune/t", url, seed=0)
        with pytest.raises(BaseException) as raised:
            run_study(study, space, CallableBackend(lambda k, w: value(k)), WL, trials=TRIALS)
        assert hit.fired  # type: ignore[attr-defined]
    # the interrupt, or an error Optuna raised while it unwound (in tell: "UnboundLocalError: ... 'updated_state'")
    assert any(isinstance(e, KeyboardInterrupt) for e in workers.exception_chain(raised.value)), raised.value
    assert _running(study) == []
    cut = _cut(study)
    assert len(cut) == 1 and cut[0].user_attrs[INTERRUPTED] == "interrupted (Ctrl-C)", [
        (t.number, t.state.name, t.user_attrs) for t in study.get_trials()]
    before = finished_trials(study)
    assert before < TRIALS  # the cut trial is none of the budget's
    # the next run (another process's: this one's trials are its own) resumes to the trials asked
    seen: list[Knobs] = []
    res = run_study(open_study("moetune/t", url, seed=0), space,
                    CallableBackend(lambda k, w: seen.append(k) or value(k)), WL, trials=TRIALS)
    assert res.trials == res.complete == TRIALS and len(seen) == TRIALS - before
    assert _running(study) == [] and len(_cut(study)) == 1
    # the policy default is measured, even where its run was the one cut short (it is enqueued again)
    assert res.default_value == pytest.approx(value(space.policy.defaults))


def test_sigterm_inside_ask_is_recorded_as_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Terminated` (the CLI's SIGTERM) cutting the creation of a trial: the trial says SIGTERM."""
    real = optuna.storages.RDBStorage._create_new_trial

    def create(self: Any, study_id: int, template_trial: Any = None) -> Any:
        frozen = real(self, study_id, template_trial)
        if frozen.state == TrialState.RUNNING:
            deliver(Terminated())  # as the SIGTERM handler does
        return frozen

    monkeypatch.setattr(optuna.storages.RDBStorage, "_create_new_trial", create)
    study = open_study("moetune/t", f"sqlite:///{tmp_path / 's.db'}", seed=0)
    with pytest.raises(Terminated):
        run_study(study, _space(), CallableBackend(lambda k, w: value(k)), WL, trials=WARM + 3, warm_start=False)
    assert _running(study) == []
    assert [t.user_attrs[INTERRUPTED] for t in _cut(study)] == ["interrupted (SIGTERM)"]


def test_an_error_inside_ask_fails_the_trial_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only an interrupt: an error of the sampler inside ask() ends the study with its trial failed, not RUNNING,
    and that trial (never measured) is none of the budget's."""
    def broken(self: Any, study: optuna.Study, trial: Any) -> None:
        raise RuntimeError("sampler broke")

    study = open_study("moetune/t", f"sqlite:///{tmp_path / 's.db'}", seed=0)
    monkeypatch.setattr(optuna.samplers.TPESampler, "before_trial", broken)
    with pytest.raises(RuntimeError, match="sampler broke"):
        run_study(study, _space(), CallableBackend(lambda k, w: value(k)), WL, trials=3)
    assert _running(study) == [] and finished_trials(study) == 0
    assert [t.user_attrs[INTERRUPTED] for t in _cut(study)] == ["cut short by an error (RuntimeError: sampler broke)"]


def _no_such_pid() -> int:
    """A pid no process has: above the kernel's pid_max."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except OSError:
        return 2**22 + 1


def _sleeper() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True)


def test_a_dead_owners_trial_is_failed_on_resume_and_a_live_owners_is_not(tmp_path: Path) -> None:
    """Crashes that skip Python's clean-up (SIGKILL, power loss) leave the trial RUNNING: the next opening of the
    study fails it (its owner, by pid and start ticks, is gone) and the run resumes to the trials asked. A trial of a
    live concurrent worker (a child process, registered in the study) is left RUNNING, as is its registration."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    space = _space()
    study = open_study("moetune/t", url, seed=0)
    run_study(study, space, CallableBackend(lambda k, w: value(k)), WL, trials=3)
    host = socket.gethostname()
    dead = study._storage.create_new_trial(study._study_id)
    study._storage.set_trial_user_attr(dead, "worker", f"{host}:{_no_such_pid()}:deadrun:12345")
    child = _sleeper()
    try:
        ticks = _proc.start_ticks(child.pid)
        live = study._storage.create_new_trial(study._study_id)
        worker = f"{host}:{child.pid}:liverun" + (f":{ticks}" if ticks is not None else "")
        study._storage.set_trial_user_attr(live, "worker", worker)
        reg = {"run": "liverun", "since": datetime.now().isoformat(), **({"ticks": ticks} if ticks is not None else {})}
        study._storage.set_study_system_attr(study._study_id, f"{workers.WORKER_KEY}{host}:{child.pid}", reg)
        seen: list[Knobs] = []
        res = run_study(open_study("moetune/t", url, seed=1), space,
                        CallableBackend(lambda k, w: seen.append(k) or value(k)), WL, trials=8)
        assert res.trials == res.complete == 8 and len(seen) == 5
        t = study._storage.get_trial(dead)
        assert t.state == TrialState.FAIL and INTERRUPTED in t.user_attrs
        assert study._storage.get_trial(live).state == TrialState.RUNNING  # its owner lives: untouched
        attrs = study._storage.get_study_system_attrs(study._study_id)
        assert f"{workers.WORKER_KEY}{host}:{child.pid}" in attrs
    finally:
        child.communicate(input="", timeout=60)


@pytest.mark.usefixtures("python_sigint_handler")
def test_tune_interrupted_inside_ask_says_so_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`moetune tune` with a Ctrl-C (its own handler) inside the creation of a trial: one line, exit 130, no trial
    left RUNNING; `tune show` counts the cut trial as interrupted, not as a trial; the same command resumes to the
    trials asked."""
    import json

    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    runner = CliRunner()
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    url = f"sqlite:///{tmp_path / 'm-studies.db'}"
    tune = ["tune", "-m", "qwen3-30b", "--tokens", "128", "--backend", "model", "--preset", "nvlink-h200x2",
            "--trials", "8", "--db", str(tmp_path / "m.db"), "--json"]
    with monkeypatch.context() as mp:
        hit = _in_create(mp, 2)
        r = runner.invoke(app, tune)
    assert hit.fired  # type: ignore[attr-defined]
    assert r.exit_code == 130, (r.output, r.exception)
    assert "interrupted: the study is saved; run the same command again to resume" in r.output, r.output
    (name,) = optuna.get_all_study_names(url)
    study = optuna.load_study(study_name=name, storage=url)
    assert _running(study) == [] and len(_cut(study)) == 1
    r = runner.invoke(app, ["tune", "show", "--storage", url, "--study", name])
    assert r.exit_code == 0 and "fail 1 (1 interrupted, not counted)" in r.output and "running" not in r.output, r.output
    r = runner.invoke(app, tune)
    assert r.exit_code == 0, r.output
    assert [row["trials"] for row in json.loads(r.stdout)] == [8]
    assert _running(study) == []


class _Raising(CallableBackend):
    """A backend whose evaluate raises (CallableBackend turns an exception of `fn` into a failed measurement)."""

    def evaluate(self, knobs: Knobs, workload: TuneWorkload, *, report: Any = None) -> Any:
        v = float(self.fn(knobs, workload))  # type: ignore[arg-type]
        return Measurement(v, 0.0, [v], True)


@pytest.mark.parametrize("cut_by", ["second Ctrl-C", "error"])
def test_a_trial_failed_before_its_objective_tagged_it_is_cut_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   cut_by: str) -> None:
    """A second Ctrl-C landing in the objective's own clean-up of the first (before it tagged the trial `interrupted`),
    or an error raised out of the objective: Optuna fails the trial with neither the tag nor a measurement's `error`.
    It was counted a finished, failed trial (and the policy default it carried was never measured); it is cut short:
    none of the budget, no failure, its warm-start point measured when the study is opened again."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    space = _space()
    calls: list[int] = []

    def first_cut(k: Knobs, _w: Any) -> float:
        calls.append(1)
        if len(calls) == 1:  # the first trial: the policy default (the warm start comes first)
            if cut_by == "error":
                raise RuntimeError("backend broke")
            raise KeyboardInterrupt
        return value(k)

    def second_interrupt(_e: BaseException) -> str:  # lands in the objective's handler, before the tag is written
        raise KeyboardInterrupt

    study = open_study("moetune/t", url, seed=0)
    with monkeypatch.context() as mp:
        mp.setattr(study_mod, "cut_short_by", second_interrupt)
        with pytest.raises((KeyboardInterrupt, RuntimeError)):
            run_study(study, space, _Raising(first_cut), WL, trials=TRIALS)
    [t] = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    assert INTERRUPTED not in t.user_attrs and "error" not in t.user_attrs and t.user_attrs["warm_start"]
    assert finished_trials(study) == 0  # none of the budget
    res = run_study(open_study("moetune/t", url, seed=0), space, _Raising(first_cut), WL, trials=TRIALS)
    assert res.trials == res.complete == TRIALS and res.failed == 0
    assert res.default_value == pytest.approx(value(space.policy.defaults))  # its point enqueued again
    # opened again: neither counted nor its point enqueued a second time
    res = run_study(open_study("moetune/t", url, seed=0), space, _Raising(first_cut), WL, trials=TRIALS)
    assert res.trials == TRIALS and len(calls) == TRIALS + 1 and _running(study) == []
