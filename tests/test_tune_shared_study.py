"""Several processes on one SQLite studies file (the daemon's re-tune and a user's `moetune tune`, or two tunes):
none fails another's running trial, an enqueued trial is run by one of them only, and two first runs create the
file's schema one after the other. Each interleaving is forced (threads, events, a child process held open), not
left to luck."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from moetune.tuner.search.storage import make_storage
from moetune.tuner.search.study import open_study
from moetune.tuner.search.trials import finished_trials

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.timeout(180)

WAIT_S = 3.0  # how long the first thread waits for the second to reach the same point (it cannot when serialized)


def test_a_fresh_trial_of_another_study_object_is_not_failed(tmp_path: Path) -> None:
    """A trial this process asked for through one study object, still RUNNING (asked, not told): opening the study
    again on the same storage (another study object of this process) failed it, and its owner then crashed on its
    result. (`ask` records the worker in the sampler's `before_trial`; a trial without one is
    tests/test_tune_study_workers.py's.)"""
    url = f"sqlite:///{tmp_path / 's.db'}"
    first = open_study("moetune/t", url, seed=0)
    trial = first.ask()  # RUNNING, its `worker` this process
    open_study("moetune/t", url, seed=1)  # the other tune opens the study
    assert first._storage.get_trial(trial._trial_id).state == TrialState.RUNNING
    first.tell(trial, 1.0)  # was: ValueError "Cannot tell a FAIL trial."
    assert finished_trials(open_study("moetune/t", url)) == 1


def study_worker(url: str, trial_id: int) -> str:
    return str(optuna.storages.RDBStorage(url).get_trial(trial_id).user_attrs.get("worker"))


ASK_AND_WAIT = """
import sys
from moetune.tuner.search.study import open_study
t = open_study("moetune/t", sys.argv[1], seed=0).ask()
print(t._trial_id, flush=True)
sys.stdin.read()  # alive until the test closes stdin
"""


def test_a_live_processes_running_trial_is_left_alone_and_failed_once_it_is_gone(tmp_path: Path) -> None:
    """Another process asked for a trial (its `worker` recorded by `ask`, through the sampler's `before_trial`) and
    is still alive: opening the study leaves the trial RUNNING; once that process has exited without telling it,
    the next opening fails it as interrupted. (A trial without a `worker`, whose creator died between Optuna's
    create and `before_trial`: tests/test_tune_study_workers.py.)"""
    url = f"sqlite:///{tmp_path / 's.db'}"
    proc = subprocess.Popen([sys.executable, "-c", ASK_AND_WAIT, url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read() if proc.stderr else ""
        trial_id = int(line)
        assert study_worker(url, trial_id).split(":")[1] == str(proc.pid)  # `ask` recorded the child as its worker
        study = open_study("moetune/t", url, seed=1)  # the other process is alive: its trial is kept
        assert study._storage.get_trial(trial_id).state == TrialState.RUNNING
    finally:
        proc.communicate(input="", timeout=60)  # it exits without telling its trial
    assert proc.returncode == 0
    study = open_study("moetune/t", url, seed=1)  # now nobody can own it: it is failed as interrupted
    t = study._storage.get_trial(trial_id)
    assert t.state == TrialState.FAIL and "interrupted" in t.user_attrs


def _pause_first(arrived: threading.Event, second_here: threading.Event) -> Callable[[], None]:
    """A hook: the first thread to call it waits (up to WAIT_S) until the second has called it too."""
    lock = threading.Lock()
    order: list[str] = []

    def hook() -> None:
        with lock:
            order.append(threading.current_thread().name)
            first = len(order) == 1
        if first:
            arrived.set()
            second_here.wait(WAIT_S)  # serialized: the second cannot get here until the first has finished
        else:
            second_here.set()

    return hook


def _run_two(target: Callable[[], Any], arrived: threading.Event) -> list[Any]:
    """Run `target` in thread A, then (once A is paused at its hook) in thread B; each one's result or error."""
    out: list[Any] = [None, None]

    def run(i: int) -> None:
        try:
            out[i] = target()
        except Exception as e:  # the outcome under test
            out[i] = e

    a = threading.Thread(target=run, args=(0,), name="A")
    b = threading.Thread(target=run, args=(1,), name="B")
    a.start()
    assert arrived.wait(60)
    b.start()
    a.join(120)
    b.join(120)
    return out


def test_an_enqueued_trial_is_taken_by_one_process_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Optuna takes an enqueued (WAITING) trial by reading its state, then writing RUNNING. Python's sqlite3 read
    outside a transaction, so two processes both read WAITING and both ran it ("Cannot tell a COMPLETE trial")."""
    from optuna.storages._rdb import models

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url)
    study.enqueue_trial({"x": 1})
    waiting = study.get_trials(states=(TrialState.WAITING,))[0]._trial_id
    stores = [make_storage(url), make_storage(url)]  # one connection pool per "process"
    arrived, second_here = threading.Event(), threading.Event()
    hook = _pause_first(arrived, second_here)
    find = models.TrialModel.find_or_raise_by_id

    def paused_find(trial_id: int, session: Any, for_update: bool = False) -> Any:
        t = find(trial_id, session, for_update)
        if for_update and threading.current_thread().name in ("A", "B"):
            hook()  # between the read of the state and its update
        return t

    monkeypatch.setattr(models.TrialModel, "find_or_raise_by_id", staticmethod(paused_find))

    def take() -> bool:
        st = stores[0 if threading.current_thread().name == "A" else 1]
        return st.set_trial_state_values(waiting, TrialState.RUNNING)

    got = _run_two(take, arrived)
    assert sorted(got) == [False, True], got  # not [True, True]


def test_two_first_runs_create_the_studies_file_one_after_the_other(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two first `moetune tune`s in a fresh home both found no schema version and both stamped one: one failed
    with "UNIQUE constraint failed: alembic_version.version_num" (and was told to move a good file aside)."""
    from alembic.runtime.migration import MigrationContext

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    arrived, second_here = threading.Event(), threading.Event()
    hook = _pause_first(arrived, second_here)
    current = MigrationContext.get_current_revision

    def paused_current(self: MigrationContext) -> Any:
        rev = current(self)
        if threading.current_thread().name in ("A", "B"):
            hook()  # between "no schema version yet" and stamping one
        return rev

    monkeypatch.setattr(MigrationContext, "get_current_revision", paused_current)
    got = _run_two(lambda: make_storage(url), arrived)
    assert not [e for e in got if isinstance(e, Exception)], got
    monkeypatch.undo()
    study = open_study("moetune/t", url)  # the file is a working studies file
    study.tell(study.ask(), 1.0)
    assert finished_trials(study) == 1


def test_two_processes_enqueue_each_warm_start_point_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`enqueue_trial(skip_if_exists=True)` checks and inserts in two transactions (Optuna#2925), and on SQLite no
    claim was made (`shared=not is_sqlite(url)`): two processes opening one new study (the daemon's re-tune and a
    `moetune tune`) both found the policy default missing and both enqueued it, and it ran twice."""
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.study import enqueue_warm_start

    url = f"sqlite:///{tmp_path / 's.db'}"
    space = SearchSpace(load_policy("proxy:ibrc"), experts=MODELS["qwen3-30b"].experts, ep_size=4)
    studies = [open_study("moetune/t", make_storage(url), seed=0), open_study("moetune/t", make_storage(url), seed=1)]
    arrived, second_here = threading.Event(), threading.Event()
    hook = _pause_first(arrived, second_here)
    check = optuna.Study._should_skip_enqueue

    def paused_check(self: optuna.Study, params: Any) -> bool:
        skip = check(self, params)
        if threading.current_thread().name in ("A", "B"):
            hook()  # between "not in the study yet" and the insert
        return skip

    monkeypatch.setattr(optuna.Study, "_should_skip_enqueue", paused_check)
    got = _run_two(lambda: enqueue_warm_start(studies[0 if threading.current_thread().name == "A" else 1], space),
                   arrived)
    monkeypatch.undo()
    names = [name for name, _ in space.priors()]
    assert sum(got) == len(names), got  # every point claimed by one of them
    waiting = [t.user_attrs["warm_start"] for t in studies[0].get_trials(states=(TrialState.WAITING,))]
    assert sorted(waiting) == sorted(names), waiting  # was: the first point twice
    assert enqueue_warm_start(studies[1], space) == 0  # a rerun claims nothing again
    extra = [("bucket_transfer:128:0", space.priors()[1][1])]  # a point already there under another name: kept out
    assert enqueue_warm_start(studies[1], space, extra) == 0
    given = {tuple(sorted(space.params_of(k).items())) for _, k in space.priors()}
    sampler = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    new = next(k for k in (space.suggest(sampler.ask()) for _ in range(200))
               if space.feasible(k)[0] and tuple(sorted(space.params_of(k).items())) not in given)
    assert enqueue_warm_start(studies[1], space, [("bucket_transfer:128:0", new)]) == 1  # a resume adds what is new


def _sampled(studies: list[optuna.Study], rounds: int) -> list[list[tuple[tuple[str, Any], ...]]]:
    """Each study object's sampled params, the objects taking turns on one study (as its workers do)."""
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace

    space = SearchSpace(load_policy("proxy:ibrc"), experts=MODELS["qwen3-30b"].experts, ep_size=4)
    got: list[list[tuple[tuple[str, Any], ...]]] = [[] for _ in studies]
    for _ in range(rounds):
        for i, s in enumerate(studies):
            t = s.ask()
            k = space.suggest(t)
            s.tell(t, 100.0 + k.num_sms)
            got[i].append(tuple(sorted(t.params.items())))
    return got


def test_workers_of_one_seed_sample_other_points(tmp_path: Path) -> None:
    """Every node of a shared study runs `moetune tune` with the default --seed 0: each process's sampler drew the
    same random stream, so the workers measured the same points (64 nodes: the startup trials one point 64 times,
    the budget spent on copies). A trial's draws follow the seed and the trial's number: workers of one seed sample
    other points, and a run alone with one seed still samples the same points every time."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    a, b = _sampled([open_study("moetune/t", url, seed=0, n_startup_trials=8),
                     open_study("moetune/t", url, seed=0, n_startup_trials=8)], 6)
    # the 8 startup trials are random, 4 each: they were the same 4 points (so was each later pair, from one history)
    assert set(a[:4]).isdisjoint(b[:4]), (a, b)
    assert all(x != y for x, y in zip(a, b, strict=True)), (a, b)
    alone = [_sampled([open_study("moetune/t", f"sqlite:///{tmp_path / f'{n}.db'}", seed=0, n_startup_trials=8)], 12)
             for n in ("one", "two")]
    assert alone[0] == alone[1]  # reproducible: one seed, the same points


def test_an_optuna_without_the_private_generator_still_tunes(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-trial reseed reaches Optuna's private `_rng.rng` (there in every release 4.0 to 5.1; pyproject allows
    any >= 4.0). A release that renames it made every seeded `ask` raise AttributeError, the whole tune ended on it:
    the sampler then draws from its one stream per process, as before the reseed, and says so once."""
    import logging

    from moetune.tuner.search import study as study_mod

    monkeypatch.setattr(study_mod, "_RESEED_WARNED", [])  # said once per process: not yet in this one
    study = open_study("moetune/t", f"sqlite:///{tmp_path / 's.db'}", seed=0, n_startup_trials=2)
    sampler = study.sampler

    class Renamed:  # Optuna's LazyRandomState with its generator under another name
        def __init__(self, rng: Any) -> None:
            self.generator = rng

    sampler._rng = Renamed(sampler._rng.rng)  # type: ignore[attr-defined]
    sampler._random_sampler._rng = Renamed(sampler._random_sampler._rng.rng)  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="moetune.tuner.search.study"):
        for _ in range(2):
            t = study.ask()  # was: AttributeError: 'Renamed' object has no attribute 'rng'
            study.tell(t, 1.0)
    said = [r.getMessage() for r in caplog.records if "per trial" in r.getMessage()]
    assert len(said) == 1, said


def test_a_warm_start_point_whose_taker_over_died_too_is_enqueued(tmp_path: Path) -> None:
    """A point claimed by a process killed before it enqueued it is taken over by the next run (a second claim,
    `warm-start-again:<digest>`): two storage writes again. A taker-over killed between them held that second claim
    for good, and the point (the policy default first of all) was lost to the study as before. Its dead claim is
    taken over in turn, once."""
    import socket

    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.storage import claim_study_attr
    from moetune.tuner.search.study import WARM_AGAIN_KEY, WARM_POINT_KEY, _warm_digest, enqueue_warm_start

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = f"{socket.gethostname()}:{done.stdout.strip()}"  # a process of this host that is gone
    space = SearchSpace(load_policy("proxy:ibrc"), experts=MODELS["qwen3-30b"].experts, ep_size=4)
    params = space.params_of(space.policy.defaults)
    study = open_study("moetune/t", f"sqlite:///{tmp_path / 's.db'}", seed=0)
    for key in (WARM_POINT_KEY, WARM_AGAIN_KEY):  # claimed, then taken over, each by a process killed before enqueuing
        assert claim_study_attr(study, key + _warm_digest(params), {"name": "policy default", "worker": dead})

    def held() -> int:
        return sum(t.system_attrs.get("fixed_params") == params
                   for t in study.get_trials(states=(TrialState.WAITING,)))

    enqueue_warm_start(study, space)
    assert held() == 1  # was: 0, for good
    enqueue_warm_start(open_study("moetune/t", f"sqlite:///{tmp_path / 's.db'}", seed=0), space)
    assert held() == 1  # once
