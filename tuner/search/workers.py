"""This process as a worker of shared studies: id, registration, liveness, the trials it leaves cut short."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import uuid
from datetime import datetime, timedelta
from typing import Any

import optuna
from optuna.trial import TrialState

from moetune.runtime import _proc
from moetune.tuner.search.interrupt_guard import uninterrupted
from moetune.tuner.search.storage import storage_id
from moetune.tuner.search.trials import INTERRUPTED, requeue_warm_start

log = logging.getLogger("moetune.tuner.search.workers")

# This process in a trial's `worker` attr and the study's worker registry: host:pid:run:ticks. The run id tells this
# process from an earlier one that had the same pid (containers reuse pids run after run); the ticks (its start, in
# clock ticks since boot: /proc) let another process tell whether that pid is still this process.
_RUN = uuid.uuid4().hex[:12]
_REGISTERED_AT = datetime.now()  # before this process asks for any trial (Optuna's datetime_start: local, naive)
WORKER_KEY = "worker:"  # study system attr `worker:host:pid` -> {"run": id, "since": ISO time, "ticks": int}
# A worker's registration and a trial's start are read off one host's clock: a little slack for a clock step.
CLOCK_SLACK = timedelta(seconds=2)
# A RUNNING trial without a `worker` attr: its creator records itself in the sampler's `before_trial`, right after
# Optuna creates the trial. One older than this lost its creator in between (a process that died): it is failed
# even while other registered workers live (the daemon is one for weeks).
FRESH_TRIAL = timedelta(seconds=60)


def _now() -> datetime:
    """Local, naive: the clock of Optuna's datetime_start."""
    return datetime.now()


_TICKS: dict[int, int | None] = {}  # pid -> its start ticks (a forked child has its own)


def _start_ticks() -> int | None:
    """When this process started, in clock ticks since boot (/proc/self/stat's field 22); None without /proc."""
    pid = os.getpid()
    if pid not in _TICKS:
        _TICKS[pid] = _proc.start_ticks()
    return _TICKS[pid]


def _worker_id(host_pid: str, run: object, ticks: int | None) -> str:
    """host:pid:run:ticks, or host:pid:run where the start ticks are unknown."""
    return f"{host_pid}:{run}" + (f":{ticks}" if ticks is not None else "")


def _host_pid() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def current_worker() -> str:
    """host:pid:run:ticks of this process (host:pid:run without /proc); computed each time: a forked child has its
    own pid and ticks."""
    return _worker_id(_host_pid(), _RUN, _start_ticks())


WORKER = current_worker()


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a batch scheduler ending the job) while tuning, raised by the CLI's handler: a
    KeyboardInterrupt, so all that Ctrl-C does happens (the trial marked cut short, the bench workers ended, the
    run recorded as interrupted)."""


ASKED: set[tuple[str, int]] = set()  # (storage, trial id) of every trial this process asked for


def _worker_alive(worker: Any) -> bool:
    """Whether the process a `worker` (host:pid:run:ticks; host:pid:run and host:pid in older records) names still
    runs on this host. `ticks`: its start in clock ticks since boot (/proc/<pid>/stat's field 22): on Linux it is
    alive iff that pid's stat has those ticks and is not a zombie's (a pid reused by a later process has other
    ticks). No clock is compared: the time zone, a DST change or an NTP step of the writer cannot make it look dead.
    Without ticks (an older record) or without /proc: os.kill(pid, 0), a zombie being gone."""
    text = str(worker or "")
    if text == current_worker():
        return True  # this process: its trial is in flight (another study object of it, or a thread)
    parts = text.split(":")
    if len(parts) not in (2, 3, 4):
        return False
    host, pid = parts[0], parts[1]
    if host != socket.gethostname() or not pid.isdigit():
        return False  # no attr, or another host (cannot tell)
    if int(pid) == os.getpid():
        return False  # this pid with another (or no) run id: an earlier process whose pid this one reuses
    if len(parts) == 4 and parts[3].isdigit():
        same = _proc.same_process(int(pid), int(parts[3]))
        if same is not None:
            return same
    return not _proc.pid_gone(int(pid))


def worker_gone(worker: Any) -> bool:
    """Whether `worker` names a process of this host that no longer runs (another host's cannot be told: False)."""
    parts = str(worker or "").split(":")
    return len(parts) in (2, 3, 4) and parts[0] == socket.gethostname() and not _worker_alive(worker)


# (storage, study id) -> (storage, study id) of every study this process registered in and has not left yet
_REGISTERED: dict[tuple[str, int], tuple[optuna.storages.BaseStorage, int]] = {}
REGISTRIES: set[tuple[str, int]] = set()  # every study this process has registered in (a study with a registry)


def _registration() -> tuple[str, dict[str, Any]]:
    """This process's key and value in a study's worker registry."""
    value: dict[str, Any] = {"run": _RUN, "since": _REGISTERED_AT.isoformat()}
    ticks = _start_ticks()
    if ticks is not None:
        value["ticks"] = ticks
    return f"{WORKER_KEY}{_host_pid()}", value


def register_worker(study: optuna.Study) -> None:
    """Record this process in the study before it asks for a trial. Optuna creates a trial RUNNING before the
    sampler's `before_trial` records its `worker`: a process opening the study in that instant must see that a
    live process may own the trial. One key per host:pid (a reused pid overwrites a dead one's). Removed again
    when this process is done with the study (`unregister_worker`: the end of `run_study`, else at exit)."""
    key, value = _registration()
    study._storage.set_study_system_attr(study._study_id, key, value)
    if not _REGISTERED:
        atexit.register(_unregister_all)
    _REGISTERED[(storage_id(study._storage), study._study_id)] = (study._storage, study._study_id)
    REGISTRIES.add((storage_id(study._storage), study._study_id))


def _delete_registration(storage: optuna.storages.BaseStorage, study_id: int, key: str, value: Any) -> bool:
    """Delete worker registration `key` of the study if it still holds `value` (a live process that has just
    registered under the same host:pid is left alone). Optuna has no call to delete a study attr: a plain DELETE
    on its standard table, on an RDB storage only."""
    import sqlalchemy

    backend = getattr(storage, "_backend", storage)
    if not isinstance(backend, optuna.storages.RDBStorage):
        return False
    with backend.engine.begin() as conn:
        n = conn.execute(sqlalchemy.text("DELETE FROM study_system_attributes WHERE study_id = :s AND key = :k "
                                         "AND value_json = :v"),
                         {"s": study_id, "k": key, "v": json.dumps(value)}).rowcount
    return bool(n)


def unregister_worker(study: optuna.Study) -> None:
    """Remove this process's registration from the study (it asks for no more trials of it). Best effort: one
    left behind (a process killed) is deleted by the next `fail_interrupted` on this host."""
    _leave(study._storage, study._study_id)


def _leave(storage: optuna.storages.BaseStorage, study_id: int) -> None:
    if _REGISTERED.pop((storage_id(storage), study_id), None) is None:
        return
    key, value = _registration()
    try:
        _delete_registration(storage, study_id, key, value)
    except Exception as e:  # broad: never fail a run (or its Ctrl-C) over a registration fail_interrupted cleans
        log.debug("could not remove this process's worker registration from study %s: %s", study_id, e)


def _unregister_all() -> None:
    """At exit (a normal end, or one by an exception or Ctrl-C): every registration this process still holds."""
    for storage, study_id in list(_REGISTERED.values()):
        _leave(storage, study_id)


def _registered_worker(name: str, value: dict[str, Any]) -> str:
    """The worker (host:pid:run:ticks, or host:pid:run from a registration without ticks) a registration names."""
    ticks = value.get("ticks")
    return _worker_id(name, value.get("run"), ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else None)


def _live_registrations(study: optuna.Study) -> list[datetime]:
    """The `since` of each live registered worker of the study other than this process: when that process loaded
    this module (`_REGISTERED_AT`), before it asked for any trial, not when it registered. A registration of this
    host whose process is gone is deleted (another host's cannot be checked: it is kept)."""
    out = []
    me = _registration()[0]
    host = socket.gethostname()
    for k, v in study._storage.get_study_system_attrs(study._study_id).items():
        if not k.startswith(WORKER_KEY) or k == me:
            continue  # this process's own trials are known by `ASKED`
        name = k[len(WORKER_KEY):]
        since = None
        if isinstance(v, dict):
            with contextlib.suppress(ValueError):
                since = datetime.fromisoformat(str(v.get("since")))
        if since is not None and _worker_alive(_registered_worker(name, v)):
            out.append(since)
        elif name.split(":")[0] == host:
            try:
                _delete_registration(study._storage, study._study_id, k, v)
            except Exception as e:  # broad: a registration left behind costs one os.kill per opening, no more
                log.debug("could not delete the worker registration %s of a process that is gone: %s", k, e)
    return out


def _maybe_owned(study: optuna.Study, t: optuna.trial.FrozenTrial, live: list[datetime]) -> bool:
    """Whether a live process may own RUNNING trial `t`. With a `worker` attr: that process is alive (and started
    before the trial). Without one (its creator had not yet reached the sampler's `before_trial`): this process
    asked for it, or the trial is fresh (at most FRESH_TRIAL old) and another live registered worker was already
    running when it started (its `since` is no later than the trial's start: any trial a worker creates starts after
    its `since`, and it registers before it asks, so a live creator is among these)."""
    if "worker" in t.user_attrs:
        return _worker_alive(t.user_attrs["worker"])
    if (storage_id(study._storage), t._trial_id) in ASKED:
        return True
    start = t.datetime_start
    if start is None or _now() - start > FRESH_TRIAL:
        return False
    return any(since <= start + CLOCK_SLACK for since in live)


def fail_interrupted(study: optuna.Study) -> int:
    """Register this process, then mark FAIL the RUNNING trials no live process can own. A live one's are left
    alone: two processes may open one SQLite study (the daemon's re-tune and a `moetune tune`), and failing the
    other's running trial made it crash on its result ("Cannot tell a COMPLETE trial") and lose the measurement;
    that included a trial so fresh that its creator had not yet recorded its worker. Registrations of this host's
    processes that are gone are deleted. A trial of another host's worker cannot be told alive: it is failed (an
    earlier container, with another host name, that was killed), with a warning (`_other_hosts_warning`)."""
    register_worker(study)
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    live = _live_registrations(study)
    n = 0
    others: dict[str, list[int]] = {}  # another host -> the numbers of its workers' trials failed here
    for t in running:
        if _maybe_owned(study, t, live):
            continue
        try:
            study._storage.set_trial_user_attr(t._trial_id, "error", "interrupted (the tuning process died)")
            study._storage.set_trial_user_attr(t._trial_id, INTERRUPTED, "the tuning process died")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        except Exception:  # another worker finished it meanwhile
            continue
        n += 1
        requeue_warm_start(study, t._trial_id)
        host = str(t.user_attrs.get("worker") or "").split(":")[0]
        if host and host != socket.gethostname():
            others.setdefault(host, []).append(t.number)
    if others:
        log.warning(_other_hosts_warning(study.study_name, others))
    return n


def _other_hosts_warning(study_name: str, others: dict[str, list[int]]) -> str:
    """What is said when a SQLite study's opening failed running trials of other hosts' workers: on a network file
    system shared by several hosts each host took the others' live workers for dead and failed their trials in
    silence (their measurements lost), and SQLite's locking is not safe there either."""
    of = "; ".join(f"{h}: trial(s) {', '.join(map(str, sorted(ns)))}" for h, ns in sorted(others.items()))
    return (f"study {study_name}: running trials of workers on another host ({of}) were failed as interrupted: a SQLite "
            "studies file cannot tell whether another host's process still runs. If moetune runs on several hosts "
            "against this file (a network file system), each fails the others' running trials, and SQLite's locking "
            "is not safe there: share a study between hosts through a server storage (--storage "
            "postgresql://USER@HOST/DB). Where that host's process is gone (an earlier container killed), this is "
            "all that was needed.")


def cut_short_by(e: BaseException) -> str:
    """What the `interrupted` attr of a trial that `e` cut short says: Ctrl-C or SIGTERM where `e` is one or was
    raised while one unwound (Optuna's "UnboundLocalError: ... 'updated_state'" after an interrupt in its tell)."""
    interrupt = next((x for x in exception_chain(e) if isinstance(x, KeyboardInterrupt)), None)
    if interrupt is not None:
        return "interrupted (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted (Ctrl-C)"
    return f"cut short by an error ({type(e).__name__}: {str(e)[:200]})"


def fail_in_flight(study: optuna.Study, trial_ids: set[int], why: str) -> int:
    """Mark FAIL, as interrupted (`why`), those of `trial_ids` still RUNNING: trials this process made RUNNING whose
    run an interrupt (or an error) cut short where Optuna does not fail them itself: inside `ask()` (between the
    trial's creation and its first parameter), between `ask()` and the objective, or in `tell()` before the
    state is written. Left RUNNING, such a trial was never finished by anyone while this process lived (it is a
    live process's), on a server storage never at all (it had no heartbeat), and `tune show` listed it as running.
    Each carried warm-start point is enqueued again (once: the objective's own clean-up may have done it). Runs
    `uninterrupted`: a second Ctrl-C waits for it (a third is raised at once). Returns how many it failed."""
    n = 0
    with uninterrupted():
        for tid in sorted(trial_ids):
            try:
                t = study._storage.get_trial(tid)
                if t.state != TrialState.RUNNING:
                    continue
                requeued = INTERRUPTED in t.user_attrs  # the objective marked it, and requeued its point
                if not requeued:
                    study._storage.set_trial_user_attr(tid, INTERRUPTED, why)
                if "error" not in t.user_attrs:  # a failed measurement's own error stays
                    study._storage.set_trial_user_attr(tid, "error", why)
                if not study._storage.set_trial_state_values(tid, TrialState.FAIL):
                    continue
            except Exception as e:  # broad: finished meanwhile (a stale check), or the storage fails: never mask
                log.debug("could not fail trial %s left running: %s", tid, e)
                continue
            n += 1
            if not requeued:
                try:
                    requeue_warm_start(study, tid)
                except Exception as e:  # broad, as above
                    log.debug("could not enqueue again the warm-start point of trial %s: %s", tid, e)
    return n


def exception_chain(e: BaseException | None) -> list[BaseException]:
    """e and what it was raised from or while handling (`__cause__`, else `__context__`), each once."""
    out: list[BaseException] = []
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out
