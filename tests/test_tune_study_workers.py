"""Whose RUNNING trial is it, and who is registered in a SQLite study: a trial records its worker when Optuna creates
it (the sampler's `before_trial`, before sampling), so a dead process's trial is failed even while another worker
(the daemon, for weeks) lives; a worker-less trial is kept only while fresh; a process leaves the study's worker
registry when it is done (the end of run_study, Ctrl-C, exit) and a registration of a process that is gone is
deleted by the next opening on its host. Every interleaving is forced with child processes held open or killed."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from moetune.runtime.shapes import MODELS
from moetune.tuner.search import study as study_mod
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import INTERRUPTED, WORKER_KEY, open_study, run_study

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.timeout(180)

WL = TuneWorkload(model=MODELS["qwen3-30b"], tokens=128, nodes=1, gpus_per_node=4)

HOLD_OPEN = """
import sys
from moetune.tuner.search.study import open_study
open_study("moetune/t", sys.argv[1], seed=0)
print("ready", flush=True)
sys.stdin.read()  # alive (and registered) until the test closes stdin
"""

ASK_AND_DIE = """
import os, sys
from moetune.tuner.search.study import open_study
t = open_study("moetune/t", sys.argv[1], seed=0).ask()
print(t._trial_id, flush=True)
os._exit(0)  # killed: no atexit, its trial never told
"""

OPEN_AND_EXIT = """
import sys
from moetune.tuner.search.study import open_study
open_study("moetune/t", sys.argv[1], seed=0)
if sys.argv[2] == "killed":
    import os
    os._exit(0)
"""


def _python(code: str, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, **kw)


class _Holder:
    """A child process that opened the study (it is a registered worker) and stays alive until closed."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", self.proc.stderr.read() if self.proc.stderr else ""

    def close(self) -> None:
        self.proc.communicate(input="", timeout=60)


def _registrations(url: str) -> dict[str, object]:
    st = optuna.storages.RDBStorage(url)
    sid = st.get_study_id_from_name("moetune/t")
    return {k: v for k, v in st.get_study_system_attrs(sid).items() if k.startswith(WORKER_KEY)}


def test_a_dead_processes_trial_is_failed_while_another_worker_lives(tmp_path: Path) -> None:
    """Process A stays registered; process B asks for a trial (the enqueued policy default) and is killed before
    its objective runs. Was: B's trial had no `worker` attr and A registered before it started, so it stayed
    RUNNING until A exited, and the policy default was never queued again."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url, seed=0)
    study.enqueue_trial({"x": 1}, user_attrs={"warm_start": "policy_default"})
    holder = _Holder(url)
    try:
        r = _python(ASK_AND_DIE, url)
        assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stderr
        trial_id = int(r.stdout)
        t = study._storage.get_trial(trial_id)
        assert t.state == TrialState.RUNNING
        study = open_study("moetune/t", url, seed=1)  # A is alive
        t = study._storage.get_trial(trial_id)
        assert t.state == TrialState.FAIL and INTERRUPTED in t.user_attrs
        waiting = study.get_trials(states=(TrialState.WAITING,))
        assert [w.user_attrs.get("warm_start") for w in waiting] == ["policy_default"]  # queued again
    finally:
        holder.close()


def test_a_worker_less_trial_is_kept_only_while_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A RUNNING trial without a `worker` attr (its creator died between Optuna's create and `before_trial`) is
    kept while a live worker registered before it, for a minute at most."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url, seed=0)
    holder = _Holder(url)
    try:
        trial_id = study._storage.create_new_trial(study._study_id)  # RUNNING, no worker, not asked by this process
        assert study._storage.get_trial(trial_id).state == TrialState.RUNNING
        open_study("moetune/t", url, seed=1)
        assert study._storage.get_trial(trial_id).state == TrialState.RUNNING  # fresh: kept
        monkeypatch.setattr(study_mod, "_now", lambda: datetime.now() + timedelta(minutes=2))
        open_study("moetune/t", url, seed=1)  # the holder is still alive
        t = study._storage.get_trial(trial_id)
        assert t.state == TrialState.FAIL and INTERRUPTED in t.user_attrs
    finally:
        holder.close()


def test_a_trial_records_its_worker_before_sampling(tmp_path: Path) -> None:
    study = open_study("moetune/t", f"sqlite:///{tmp_path / 's.db'}", seed=0)
    trial = study.ask()  # no objective ran
    assert study._storage.get_trial(trial._trial_id).user_attrs["worker"] == study_mod.current_worker()


def _space() -> SearchSpace:
    return SearchSpace(load_policy("proxy:ibrc"), experts=WL.model.experts, ep_size=WL.ep_size)


@pytest.mark.parametrize("interrupt", [False, True])
def test_run_study_leaves_the_registry(tmp_path: Path, interrupt: bool) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url, seed=0)
    assert list(_registrations(url)) == [WORKER_KEY + study_mod.current_worker().rsplit(":", 1)[0]]

    def f(k, wl) -> float:
        if interrupt:
            raise KeyboardInterrupt
        return 1.0

    if interrupt:
        with pytest.raises(KeyboardInterrupt):
            run_study(study, _space(), CallableBackend(f), WL, trials=2)
    else:
        run_study(study, _space(), CallableBackend(f), WL, trials=2)
    assert _registrations(url) == {}
    res = run_study(study, _space(), CallableBackend(lambda k, w: 1.0), WL, trials=3)  # the same study object again
    assert res.complete >= 1 and _registrations(url) == {}


def test_exited_and_killed_processes_leave_no_registration(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url, seed=0)
    study_mod.unregister_worker(study)
    r = _python(OPEN_AND_EXIT, url, "exits")
    assert r.returncode == 0, r.stderr
    assert _registrations(url) == {}  # removed at its exit
    r = _python(OPEN_AND_EXIT, url, "killed")
    assert r.returncode == 0, r.stderr
    left = _registrations(url)
    assert len(left) == 1  # a killed process cannot remove its own
    other_host = f"{WORKER_KEY}another-host.invalid:1"
    study._storage.set_study_system_attr(study._study_id, other_host, {"run": "x", "since": datetime.now().isoformat()})
    open_study("moetune/t", url, seed=1)  # deletes the dead one of this host; another host's cannot be checked
    me = WORKER_KEY + study_mod.current_worker().rsplit(":", 1)[0]
    assert set(_registrations(url)) == {other_host, me}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start times are read from /proc (Linux)")
def test_a_pid_reused_by_a_later_process_owns_no_trial(tmp_path: Path) -> None:
    """A dead worker's pid, reused by an unrelated long-lived process of this host: os.kill(pid, 0) succeeds, and its
    trial stayed RUNNING for ever. A process that started after the trial started (or after a registration's
    `since`) cannot own it. The reuse is forged: a live child named in a trial that started a minute before it."""
    import socket
    import sqlite3

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url, seed=0)
    old = study._storage.create_new_trial(study._study_id)
    con = sqlite3.connect(tmp_path / "s.db")
    con.execute("UPDATE trials SET datetime_start = ? WHERE trial_id = ?",
                ((datetime.now() - timedelta(minutes=1)).isoformat(" "), old))
    con.commit()
    con.close()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True)
    try:
        forged = f"{socket.gethostname()}:{child.pid}:dead0run"
        young = study._storage.create_new_trial(study._study_id)  # started after the child: the child may own it
        for t in (old, young):
            study._storage.set_trial_user_attr(t, "worker", forged)
        study._storage.set_study_system_attr(study._study_id, f"{WORKER_KEY}{socket.gethostname()}:{child.pid}",
                                             {"run": "dead0run",
                                              "since": (datetime.now() - timedelta(minutes=1)).isoformat()})
        study = open_study("moetune/t", url, seed=1)
        t = study._storage.get_trial(old)
        assert t.state == TrialState.FAIL and INTERRUPTED in t.user_attrs  # was: RUNNING while the child lived
        assert study._storage.get_trial(young).state == TrialState.RUNNING
        assert f"{WORKER_KEY}{socket.gethostname()}:{child.pid}" not in _registrations(url)  # deleted: not its
    finally:
        child.communicate(input="", timeout=60)
