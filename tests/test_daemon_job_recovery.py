"""Job recovery after a restart (recover_jobs + Daemon._resume): every job the last daemon left queued or running is
resumed exactly once. Checked: a job past the queue's capacity is not dropped while the store says "re-queued"; the
old job is closed only after its resumption is queued (a crash in between must not lose it); and the jobs are found
however many events came after them (a window of the newest 2000 events of any kind lets a job's per-profile events
push the jobs out of sight, ids restarting at 1)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import ProfileKey
from moetune.runtime.shapes import MODELS
from moetune.tuner.daemon import jobs as J
from moetune.tuner.daemon import recovery as R
from moetune.tuner.daemon.server import Daemon, TuneSettings

pytestmark = pytest.mark.timeout(60)
QWEN = MODELS["qwen3-30b"]


def _key(bucket: int) -> dict[str, Any]:
    return ProfileKey(fingerprint="f" * 16, software="s" * 16, transport_family="nvlink", ep_size=2, nodes=1,
                      hidden=QWEN.hidden, intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk,
                      dtype=QWEN.dtype, token_bucket=bucket).to_dict()


def _queued(store: Any, jid: int, **extra: Any) -> None:
    store.add_event(kind="job_queued", reason=f"job {jid}", details={"job_id": jid, "keys": [_key(64 * jid)], **extra})


def _manager(store: Any, capacity: int = 4) -> J.JobManager:
    return J.JobManager(store=store, facts_fn=lambda: None, retune=lambda ctx: [], on_done=lambda j, w: None,
                        tune=TuneSettings(backend="model", trials=1), capacity=capacity)


def test_jobs_past_the_queues_capacity_are_all_resumed(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    for jid in range(1, 6):  # one running and four queued: the last daemon's whole queue (capacity 4 + 1)
        _queued(store, jid)
    store.add_event(kind="job_started", reason="job 1", details={"job_id": 1, "keys": [_key(64)]})
    resume, next_id = R.recover_jobs(store)
    assert [r.job_id for r in resume] == [1, 2, 3, 4, 5] and next_id == 6
    jm = _manager(store)
    jm._ids = iter(range(next_id, 100))  # type: ignore[assignment]
    Daemon._resume(SimpleNamespace(store=store, jobs=jm), resume)  # type: ignore[arg-type]  # what it reads
    assert sorted(j.resumes for j in jm._queued.values()) == [1, 2, 3, 4, 5]
    # a second restart finds the five new jobs open and the five old ones closed
    again, _ = R.recover_jobs(store)
    assert sorted(r.job_id for r in again) == [6, 7, 8, 9, 10]


def test_a_crash_between_queueing_the_resumption_and_closing_the_old_job_resumes_it_once(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    _queued(store, 1)
    _queued(store, 2, resumes=1)  # job 2 took job 1 over; the daemon died before job 1's job_finished
    resume, next_id = R.recover_jobs(store)
    assert [r.job_id for r in resume] == [2] and next_id == 3
    closed = [e for e in store.list_events(10, kinds=("job_finished",)) if e["details"]["job_id"] == 1]
    assert len(closed) == 1 and "resumed as job 2" in closed[0]["reason"]


def test_many_other_events_do_not_hide_the_jobs(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    _queued(store, 7)
    for i in range(30):
        store.add_event(kind="remeasured", reason=f"profile {i}", details={"n": i})
    resume, next_id = R.recover_jobs(store)
    assert [r.job_id for r in resume] == [7] and next_id == 8


@pytest.mark.parametrize(("all_", "said"), [(False, "--all re-tunes the current ones too"),
                                            (True, "this fabric has no current profile")])
def test_nothing_to_retune_says_what_was_asked(all_: bool, said: str) -> None:
    """`retune --all` was answered "no stale profile lacks a current one": not what --all asks."""
    from moetune.runtime import wire
    from moetune.tuner.daemon import handlers

    d = SimpleNamespace(index=SimpleNamespace(fingerprint="f" * 16, records=[], stale=[]))
    ok, res = handlers.run_retune(d, wire.Retune(v=wire.PROTOCOL_VERSION, id=1, all=all_, reason="t"))  # type: ignore[arg-type]
    assert ok and res.job is None and said in res.message, res


def test_a_resumption_the_store_did_not_record_leaves_the_old_job_open(tmp_path: Path) -> None:
    """The resumption's job_queued refused (a locked database at start): the old job was closed as resuming anyway,
    and a stop before the new job ran lost it."""
    store = F.open_store(tmp_path / "m.db")
    _queued(store, 1)
    resume, next_id = R.recover_jobs(store)
    add = store.add_event

    def refuse_queued(*, kind: str, **kw: Any) -> None:
        if kind == "job_queued":
            raise RuntimeError("database is locked")
        add(kind=kind, **kw)

    store.add_event = refuse_queued  # type: ignore[method-assign]
    jm = _manager(store)
    jm._ids = iter(range(next_id, 100))  # type: ignore[assignment]
    Daemon._resume(SimpleNamespace(store=store, jobs=jm), resume)  # type: ignore[arg-type]
    store.add_event = add  # type: ignore[method-assign]
    assert [r.job_id for r in R.recover_jobs(store)[0]] == [1]  # still open: the next start resumes it


def test_a_job_whose_keys_cannot_be_read_is_closed_as_nothing_to_resume(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    store.add_event(kind="job_queued", reason="old", details={"job_id": 1, "keys": [{"no": "such key"}]})
    resume, _ = R.recover_jobs(store)
    Daemon._resume(SimpleNamespace(store=store, jobs=_manager(store)), resume)  # type: ignore[arg-type]
    closed = store.list_events(10, kinds=("job_finished",))
    assert len(closed) == 1 and "nothing to resume (its keys cannot be read)" in closed[0]["reason"]
    assert R.recover_jobs(store)[0] == []


def test_a_cancel_recorded_before_the_jobs_started_event_is_not_resumed(tmp_path: Path) -> None:
    """A running job's cancel is written by the thread answering `retune`, its job_started by the job worker: the
    cancel may land first. A daemon killed before the job ended must still close it as cancelled, never resume it."""
    store = F.open_store(tmp_path / "m.db")
    _queued(store, 3)
    store.add_event(kind="job_cancelled", reason="job 3", details={"job_id": 3, "keys": [_key(64)]})
    store.add_event(kind="job_started", reason="job 3", details={"job_id": 3, "keys": [_key(64)]})
    resume, next_id = R.recover_jobs(store)
    assert resume == [] and next_id == 4
    closed = [e for e in store.list_events(10, kinds=("job_finished",)) if e["details"]["job_id"] == 3]
    assert len(closed) == 1 and closed[0]["details"]["state"] == "cancelled"


def _cancelled_jobs(db: Path, first: int, n: int, keys: list[dict[str, Any]]) -> None:
    """`n` jobs from `first` on, each queued then cancelled while queued (what a submit + cancel loop leaves: two job
    events carrying all the keys), written in one transaction (thousands of them, quickly)."""
    import json
    import sqlite3

    from moetune.tuner.store.store import now

    rows = [(now(), kind, f"job {jid}", json.dumps({"job_id": jid, "keys": keys, "state": state}))
            for jid in range(first, first + n) for kind, state in (("job_queued", "queued"), ("job_finished", "cancelled"))]
    with contextlib.closing(sqlite3.connect(db)) as c, c:
        c.executemany("INSERT INTO events (created, kind, reason, details) VALUES (?, ?, ?, ?)", rows)


def test_a_job_running_while_thousands_of_jobs_came_and_went_is_resumed(tmp_path: Path) -> None:
    """Only the newest 2000 job events were read: a job running while a submit + cancel loop wrote more (each
    job_queued and job_finished) was out of sight, so after a kill -9 it was neither resumed nor closed."""
    store = F.open_store(tmp_path / "m.db")
    _queued(store, 1)
    store.add_event(kind="job_started", reason="job 1", details={"job_id": 1, "keys": [_key(64)]})
    _cancelled_jobs(tmp_path / "m.db", 2, 1100, [_key(64 * b) for b in range(1, 9)])
    _queued(store, 1102)  # queued behind it, not cancelled
    resume, next_id = R.recover_jobs(store)
    assert [r.job_id for r in resume] == [1, 1102] and next_id == 1103
    assert "interrupted" in resume[0].why


def test_an_open_job_whose_resumption_ran_to_its_end_is_closed_not_resumed(tmp_path: Path) -> None:
    """Job 2 took job 1 over and finished; job 1's job_finished was never written (refused by the store): job 1 is
    closed as resumed, however many job events came since."""
    store = F.open_store(tmp_path / "m.db")
    _queued(store, 1)
    _queued(store, 2, resumes=1)
    store.add_event(kind="job_finished", reason="done", details={"job_id": 2, "resumes": 1, "state": "done"})
    _cancelled_jobs(tmp_path / "m.db", 3, 1100, [_key(64)])
    resume, next_id = R.recover_jobs(store)
    assert resume == [] and next_id == 1103
    closed = [e for e in store.list_events(10, kinds=("job_finished",)) if e["details"]["job_id"] == 1]
    assert len(closed) == 1 and "resumed as job 2" in closed[0]["reason"]


def test_a_job_whose_details_are_damaged_does_not_stop_recovery(tmp_path: Path) -> None:
    import sqlite3

    store = F.open_store(tmp_path / "m.db")
    _queued(store, 1)
    with contextlib.closing(sqlite3.connect(tmp_path / "m.db")) as c, c:
        c.execute("INSERT INTO events (created, kind, reason, details) VALUES ('x', 'job_queued', 'bad', '{not json')")
        c.execute("INSERT INTO events (created, kind, reason, details) VALUES ('x', 'job_queued', 'str', "
                  "'{\"job_id\": \"7\"}')")
    resume, next_id = R.recover_jobs(store)
    assert [r.job_id for r in resume] == [1] and next_id == 2


def test_a_cancelled_queued_job_leaves_the_workers_queue_at_once() -> None:
    """A queued job `cancel` dropped stayed in the worker's (unbounded) queue until the worker reached it: a job that
    runs for hours under a submit + cancel loop had the daemon hold every one of them."""
    import threading

    release = threading.Event()
    store = SimpleNamespace(add_event=lambda **kw: 1)
    jm = J.JobManager(store=store, facts_fn=lambda: object(), retune=lambda ctx: [],
                      on_done=lambda j, w: None, tune=TuneSettings(backend="model", trials=1), capacity=2)
    jm._run = lambda job: release.wait(10)  # type: ignore[method-assign]  # the running job: until released
    jm.start()
    try:
        jm.submit(reason="long", old_fingerprint=None, keys=[], confirm=True)
        for _ in range(50):
            if jm.queued_count() == 0 and not jm._q:
                break
            time.sleep(0.02)
        for _ in range(200):
            job = jm.submit(reason="x", old_fingerprint=None, keys=[], confirm=True)
            assert job is not None and jm.cancel(job.id) is job
        assert jm.queued_count() == 0 and len(jm._q) == 0
        kept = jm.submit(reason="kept", old_fingerprint=None, keys=[], confirm=True)
        assert list(jm._q) == [kept]
    finally:
        release.set()
        jm.stop(timeout=5)


def test_a_restarted_daemon_closes_the_study_runs_of_the_job_killed_with_it(tmp_path: Path) -> None:
    """A daemon killed mid-job left the `running` rows of the studies its job ran (`tune_profiles`' own, named after
    the study, not moetune-daemon-job-N): the next daemon's recovery marks them `interrupted`. `moetune
    tune`/`profile` also close them, but neither runs beside a daemon: left to them, they stay `running` for as long
    as it serves."""
    from test_tuning_run_owner import _killed_run, _status

    db = tmp_path / "m.db"
    killed = _killed_run(db)  # a study's run row of a process killed with kill -9
    store = F.open_store(db)
    live = store.start_run(study_name="live", storage="x", backend="model")  # this process's: left alone
    R.recover_jobs(store)
    st = _status(db)
    assert st[killed][0] == "interrupted" and st[live][0] == "running", st
