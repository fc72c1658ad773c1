"""Whose RUNNING trial is it, and who is registered in a SQLite study: a trial records its worker when Optuna creates
it (the sampler's `before_trial`, before sampling), so a dead process's trial is failed even while another worker
(the daemon, for weeks) lives; a worker-less trial is kept only while fresh; a process leaves the study's worker
registry when it is done (the end of run_study, Ctrl-C, exit) and a registration of a process that is gone is
deleted by the next opening on its host. Every interleaving is forced with child processes held open or killed."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from moetune.runtime import _proc
from moetune.runtime.shapes import MODELS
from moetune.tuner.search import workers
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import open_study, run_study
from moetune.tuner.search.trials import INTERRUPTED
from moetune.tuner.search.workers import WORKER_KEY

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

ASK_AND_HOLD = """
import sys
from moetune.tuner.search.study import open_study
t = open_study("moetune/t", sys.argv[1], seed=0).ask()
print(t._trial_id, flush=True)
sys.stdin.read()  # alive, its trial RUNNING, until the test closes stdin
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
    its objective runs. B's trial is failed and the policy default queued again, though A registered before it
    started: without B's `worker` attr the trial would stay RUNNING until A exits."""
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
        monkeypatch.setattr(workers, "_now", lambda: datetime.now() + timedelta(minutes=2))
        open_study("moetune/t", url, seed=1)  # the holder is still alive
        t = study._storage.get_trial(trial_id)
        assert t.state == TrialState.FAIL and INTERRUPTED in t.user_attrs
    finally:
        holder.close()


def test_a_trial_records_its_worker_before_sampling(tmp_path: Path) -> None:
    study = open_study("moetune/t", f"sqlite:///{tmp_path / 's.db'}", seed=0)
    trial = study.ask()  # no objective ran
    assert study._storage.get_trial(trial._trial_id).user_attrs["worker"] == workers.current_worker()


def _space() -> SearchSpace:
    return SearchSpace(load_policy("proxy:ibrc"), experts=WL.model.experts, ep_size=WL.ep_size)


@pytest.mark.parametrize("interrupt", [False, True])
def test_run_study_leaves_the_registry(tmp_path: Path, interrupt: bool) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url, seed=0)
    assert list(_registrations(url)) == [WORKER_KEY + ":".join(workers.current_worker().split(":")[:2])]

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
    workers.unregister_worker(study)
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
    me = WORKER_KEY + ":".join(workers.current_worker().split(":")[:2])
    assert set(_registrations(url)) == {other_host, me}


HAS_PROC = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="start ticks are read from /proc (Linux)")


def _sleeper() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True)


@HAS_PROC
def test_a_pid_reused_by_a_later_process_owns_no_trial(tmp_path: Path) -> None:
    """A dead worker's pid, reused by an unrelated long-lived process of this host: os.kill(pid, 0) succeeds, and its
    trial stayed RUNNING for ever. The worker records its start ticks: a process with that pid and other ticks is
    another one. The reuse is forged: a live child named with ticks that are not its own."""
    import socket

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url, seed=0)
    child = _sleeper()
    try:
        ticks = _proc.start_ticks(child.pid)
        assert ticks is not None
        host = socket.gethostname()
        old = study._storage.create_new_trial(study._study_id)
        study._storage.set_trial_user_attr(old, "worker", f"{host}:{child.pid}:dead0run:{ticks + 1}")
        young = study._storage.create_new_trial(study._study_id)  # the child's own: it owns it
        study._storage.set_trial_user_attr(young, "worker", f"{host}:{child.pid}:itsrun:{ticks}")
        study._storage.set_study_system_attr(study._study_id, f"{WORKER_KEY}{host}:{child.pid}",
                                             {"run": "dead0run", "since": datetime.now().isoformat(),
                                              "ticks": ticks - 1})
        study = open_study("moetune/t", url, seed=1)
        t = study._storage.get_trial(old)
        assert t.state == TrialState.FAIL and INTERRUPTED in t.user_attrs  # was: RUNNING while the child lived
        assert study._storage.get_trial(young).state == TrialState.RUNNING
        assert f"{WORKER_KEY}{host}:{child.pid}" not in _registrations(url)  # deleted: not its
    finally:
        child.communicate(input="", timeout=60)


ALIVE = """
import sys
from moetune.tuner.search.workers import _worker_alive
print(*(_worker_alive(w) for w in sys.argv[1:]))
"""


@HAS_PROC
@pytest.mark.parametrize("tz", ["UTC", "Asia/Tokyo", "America/New_York", "JST-9"])
def test_a_worker_is_known_by_its_start_ticks_under_any_time_zone(tz: str) -> None:
    """Only the start ticks are compared: right ticks alive, wrong ticks dead, in any zone. A live worker's trial
    start (recorded under TZ=UTC) compared with its /proc start time converted to the reader's zone (TZ=Asia/Tokyo)
    would look started 9 hours after its trial, be judged dead, and its RUNNING trial failed."""
    import os
    import socket

    child = _sleeper()
    try:
        ticks = _proc.start_ticks(child.pid)
        base = f"{socket.gethostname()}:{child.pid}:somerun"
        r = _python(ALIVE, f"{base}:{ticks}", f"{base}:{ticks + 1}", f"{base}:{ticks - 100}",
                    env={**os.environ, "TZ": tz})
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["True", "False", "False"]
    finally:
        child.communicate(input="", timeout=60)


@HAS_PROC
def test_a_live_workers_trial_survives_a_reader_in_another_time_zone(tmp_path: Path) -> None:
    """The reproduction: the holder (TZ=UTC) asks a trial and lives; a process under TZ=Asia/Tokyo opens the study.
    The holder's trial must not be failed as interrupted, nor its registration deleted."""
    import os
    import socket

    url = f"sqlite:///{tmp_path / 's.db'}"
    open_study("moetune/t", url, seed=0)
    holder = subprocess.Popen([sys.executable, "-c", ASK_AND_HOLD, url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TZ": "UTC"})
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.strip().isdigit(), holder.stderr.read() if holder.stderr else ""
        trial_id = int(line)
        r = _python(OPEN_AND_EXIT, url, "exits", env={**os.environ, "TZ": "Asia/Tokyo"})
        assert r.returncode == 0, r.stderr
        st = optuna.storages.RDBStorage(url)
        assert st.get_trial(trial_id).state == TrialState.RUNNING
        assert f"{WORKER_KEY}{socket.gethostname()}:{holder.pid}" in _registrations(url)
    finally:
        holder.communicate(input="", timeout=60)


def test_an_old_worker_record_falls_back_to_os_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """host:pid:run and host:pid (records without ticks): os.kill(pid, 0) alone, no time compared; a zombie (killed,
    not yet reaped) is gone, as `_proc.pid_gone` has it."""
    import os
    import socket

    killed: list[int] = []
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        killed.append(pid)
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    child = _sleeper()
    host = socket.gethostname()
    try:
        assert workers._worker_alive(f"{host}:{child.pid}:oldrun")
        assert workers._worker_alive(f"{host}:{child.pid}")
        assert killed == [child.pid, child.pid]
    finally:
        child.kill()
    for _ in range(200):  # killed, not reaped: a zombie
        if _proc.is_zombie(child.pid) or not Path("/proc/self/stat").exists():
            break
        time.sleep(0.01)
    try:
        assert not workers._worker_alive(f"{host}:{child.pid}:oldrun")
        if Path("/proc/self/stat").exists():
            ticks = _proc.start_ticks(child.pid)
            assert not workers._worker_alive(f"{host}:{child.pid}:oldrun:{ticks}")  # its ticks, but a zombie
    finally:
        child.wait(timeout=60)
    assert not workers._worker_alive(f"{host}:{child.pid}:oldrun")


@HAS_PROC
def test_proc_stat_is_split_at_the_last_parenthesis(tmp_path: Path) -> None:
    """The command name (field 2) may hold spaces and parentheses: `x) S 1 (y` must not be read as the fields."""
    exe = tmp_path / "x) Z 1 2 (y"
    exe.symlink_to(sys.executable)
    child = subprocess.Popen([str(exe), "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True)
    try:
        ticks = _proc.start_ticks(child.pid)
        assert ticks is not None and ticks >= _proc.start_ticks()  # started after this process
        assert not _proc.is_zombie(child.pid) and not _proc.pid_gone(child.pid)
        assert _proc.same_process(child.pid, ticks) is True
    finally:
        child.communicate(input="", timeout=60)


def test_opening_a_studies_file_again_keeps_this_processs_sqlite_locks(tmp_path: Path) -> None:
    """Each make_storage of an existing studies file read its header through a file of its own (`not_writable`'s
    WAL check), and closing it dropped every POSIX lock of this process on the file, SQLite's for the connections
    this process still had open (an earlier storage, the daemon's). Another process then took itself for the last
    connection: a child's committed trial went unseen here, and one closing normally deleted the -wal and -shm under
    this process's open connections."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    first = open_study("moetune/t", url, seed=0)  # its connections stay open
    open_study("moetune/t", url, seed=1)  # the file opened again (make_storage)
    r = _python(ASK_AND_DIE, url)
    assert r.returncode == 0, r.stderr
    again = open_study("moetune/t", url, seed=2)
    assert int(r.stdout) in {t._trial_id for t in again.trials}  # was: not there
    r = _python(ASK_AND_DIE.replace("os._exit(0)", "sys.exit(0)"), url)  # a normal close of its connection
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "s.db-shm").exists() and (tmp_path / "s.db-wal").exists()  # was: deleted under `first`
    assert int(r.stdout) in {t._trial_id for t in first.get_trials(deepcopy=False)}


def test_a_sqlite_study_used_from_another_host_is_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A SQLite studies file on a network file system, tuned from two hosts: neither can tell whether the other's
    processes live, so each one's opening failed the other's running trials as interrupted, in silence (the other
    host's measurement lost). The opening that fails a trial of another host's worker says so, and that a study
    shared by hosts needs a server storage. The other host is forged: a live child whose host name is not ours."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/t", url, seed=0)
    workers.unregister_worker(study)
    other = subprocess.Popen([sys.executable, "-c", "import socket; socket.gethostname = lambda: 'other-host.invalid'"
                              + ASK_AND_HOLD, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        trial_id = int(other.stdout.readline())
        assert study._storage.get_trial(trial_id).user_attrs["worker"].startswith("other-host.invalid:")
        with caplog.at_level("WARNING", logger="moetune.tuner.search.workers"):
            open_study("moetune/t", url, seed=1)
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "other-host.invalid" in said and "another host" in said, said  # was: nothing said
        assert "--storage postgresql://" in said, said
    finally:
        other.communicate(input="", timeout=60)
    caplog.clear()
    r = _python(ASK_AND_DIE, url)  # a dead process of this host: failed as before, nothing to warn of
    assert r.returncode == 0, r.stderr
    with caplog.at_level("WARNING", logger="moetune.tuner.search.workers"):
        again = open_study("moetune/t", url, seed=2)
    assert again._storage.get_trial(int(r.stdout)).state == TrialState.FAIL
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_the_wal_check_of_a_studies_file_makes_nothing_beside_it_and_takes_any_name(tmp_path: Path) -> None:
    """not_writable(side_files=True)'s WAL check (every make_storage of an existing studies file) opened the file
    through a mode=ro connection: on a WAL file without its -wal/-shm that made both beside the user's file (a
    read-only connection cannot remove them again) and then answered that no new side file was needed; and a name
    that is not UTF-8 raised UnicodeEncodeError out of its URI (a traceback where open() had read the header)."""
    import os
    import sqlite3

    from moetune.tuner.store._folders import _needs_new_side_files, not_writable

    for name in ("s.db", os.fsdecode(b"\xff.db")):
        p = tmp_path / name
        con = sqlite3.connect(p)
        con.execute("PRAGMA journal_mode=wal")
        con.execute("CREATE TABLE t (x)")
        con.commit()
        con.close()  # the last connection: -wal and -shm removed
        assert sorted(os.listdir(tmp_path)) == [name]
        assert not_writable(p, side_files=True) == ""
        assert _needs_new_side_files(p)  # a write makes its -wal and -shm
        assert sorted(os.listdir(tmp_path)) == [name], "the check made files beside the studies file"
        p.unlink()
