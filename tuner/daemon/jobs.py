"""Re-tune jobs of the daemon: a bounded queue, one job at a time, cancellable, persisted in the store.

Persistence (so that a `kill -9` leaves nothing ambiguous): every job state change is an event in the
store (`job_queued`, `job_started`, `job_finished`, details carry the job id, the tuning-run id and the
keys), and a running job holds a `tuning_runs` row with status `running`. On restart,
`recovery.recover_jobs()` marks every run the previous daemon left `running` as `failed` (and its job as
failed, reason "interrupted"), then re-queues the interrupted and the still-queued jobs as new jobs:
the job is both marked failed and resumed. An interrupted job resumes only the keys it had not finished:
a key whose transport family got a current profile of the job's fingerprint and software after its
`job_started` event is left out (when that cannot be told, every key is tuned again).

Confirmation: `submit(confirm=True)` and `cancel` return only once the job_queued / job_cancelled / job_finished they
imply is committed (the `retune` op replies after that, from the list worker, never the serving loop), so a reply
that says "queued" or "cancelling" survives a kill -9 right after it, and a job id handed out is on disk (the next
daemon's ids start past it).

Cancellation: a queued job is dropped at once (its slot freed; its job_finished written after its job_queued); a
running job is told through `ctx.cancel` (an Event): the default re-tune stops the study after its running trial
and looks again before every study and side-by-side check, and a re-tune that never looks still ends the job
`cancelled`; a user's cancel of a running job is recorded when asked (`job_cancelled`), so a daemon stopped before
the job ends does not leave it to be resumed. Whatever a cancelled or failed job had already
written stays (a profile is whole once stored) and is counted and published like a finished job's. A job
stopped by the daemon's own shutdown is not cancelled in the store: it stays queued (or started), so the
next daemon resumes it as after a kill -9.

A job whose fabric changed under it (the fingerprint it tuned for is no longer the node's, or its GPUs were replaced)
leaves nothing it wrote current for the old fabric and queues its keys again for the new one (the watch cancels it
early); the new job's job_queued is written before the old job's job_finished and names it (`resumes`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.wire import JobInfo
from moetune.tuner.daemon.gpu_procs import GpuProbe, gpu_processes
from moetune.tuner.daemon.retune import RetuneImpossible, key_refusals, tuner_retune, tuning_key
from moetune.tuner.store import StoreDamaged, StoreStopping

if TYPE_CHECKING:
    from moetune.tuner.daemon.server import TuneSettings
    from moetune.tuner.store.models import EventKind

log = logging.getLogger("moetune.daemon.jobs")

# job_cancelled: a user's cancel of a running job, recorded when asked (its job_finished comes when the job ends)
JOB_EVENTS: tuple[EventKind, ...] = ("job_queued", "job_started", "job_cancelled", "job_finished")
# how often a job held for want of fabric facts looks again (an attribute read: the discovery rounds set them)
FACTS_RECHECK_S = 0.25
# a job worker whose write transaction has been open this long when the daemon stops is not waited for (a store write
# takes milliseconds): only it can end its transaction, which the process's exit rolls back as a crash would
HELD_TRANSACTION_S = 0.5


def now() -> str:
    return datetime.now(UTC).isoformat()


class JobCancelled(Exception):
    pass


class JobNotRecorded(RuntimeError):
    """A confirmed submit or a cancel whose event the store refused: it must not be answered as done."""


class Job:
    def __init__(self, job_id: int, *, reason: str, old_fingerprint: str | None, keys: list[ProfileKey], all_current: bool = False,
                 resumes: int | None = None, left_out: list[str] | None = None):
        self.id = job_id
        self.resumes = resumes  # the job of the last daemon this one takes over (recover_jobs reads it back)
        self.reason = reason
        self.old_fingerprint = old_fingerprint
        self.keys = keys  # the stale (or current, with all_current) keys to re-tune
        self.all_current = all_current
        self.state = "queued"
        self.run_id: int | None = None
        self.written = 0
        self.message = ""
        self.created = now()
        self.finished = ""
        self.cancel = threading.Event()
        self.fingerprint: str | None = None
        self.software: str | None = None  # the node's software hash when the job started (what it writes)
        self.identity: str | None = None  # its GPUs' identity then (None: unknown): a swap during it is a change too
        self.queued_recorded = False  # the job_queued event is in the store (a resumption closes its old job then)
        self.started_recorded = False  # the job_started event is in the store
        self.impossible = False  # failed because no profile true for this node could be produced
        self.backend: str | None = None  # the [tune] backend it ran under (a notice it leaves is about that one)
        self.cancelled_by = ""  # "user" (the retune op), "fabric" (the watch: its fabric changed), "shutdown"
        self.refused: list[str] = []  # keys the re-tune would not produce here, and why (they stay as they are)
        # keys the `retune` that queued it left out (the backend cannot answer them here), a line a group: never in it
        self.left_out: list[str] = list(left_out or [])
        self.kept = 0  # keys re-tuned whose current profile stayed (the new result did not replace it)
        self.kept_why: list[str] = []  # the distinct reasons they stayed (the store's rule, the side-by-side check)
        self.no_result: list[str] = []  # keys re-tuned that got nothing (no successful trial, the budget), and why
        # routing -> keys the re-tune tuned under it, other than uniform (each key under its profile's routing)
        self.routings: dict[str, int] = {}
        self.deferred = ""  # why the job waits (the GPUs are busy or their state unknown), "" once it runs
        self.dropped = False  # a queued job `cancel` finished: its job_finished is written then, not by the worker
        self.persisted = False  # its job_queued write was tried (`_persist_and_enqueue`)
        self.end_recorded = threading.Event()  # a dropped job's job_finished write was tried (`_finish_dropped`)
        self.end_ok = False  # ... and committed

    def info(self, *, left_out: bool = True) -> JobInfo:
        """As `status` lists it; without `left_out` as a retune reply carries it (queued or cancelled: run_retune)."""
        return JobInfo(id=self.id, state=self.state, reason=self.reason, fingerprint=self.fingerprint or self.old_fingerprint,
                       keys=len(self.keys), run_id=self.run_id if self.started_recorded else None, written=self.written, message=self.message,
                       created=self.created, finished=self.finished,
                       cancelling=self.state == "running" and self.cancel.is_set(),
                       left_out=list(self.left_out) if left_out else [])

    def details(self) -> dict[str, Any]:
        return {"job_id": self.id, "run_id": self.run_id, "old_fingerprint": self.old_fingerprint,
                "fingerprint": self.fingerprint, "software": self.software, "all_current": self.all_current,
                "keys": [k.to_dict() for k in self.keys], "state": self.state, "written": self.written,
                "message": self.message, "impossible": self.impossible, "refused": list(self.refused),
                "kept": self.kept, "kept_why": list(self.kept_why), "no_result": list(self.no_result),
                "routings": dict(self.routings), "left_out": list(self.left_out),
                "resumes": self.resumes, "backend": self.backend}


class JobContext:
    """What a re-tune function gets: the store, the new facts, the keys, a cancel flag, the tune config."""

    def __init__(self, *, store: Any, facts: Any, job: Job, tune: TuneSettings):
        self.store = store
        self.facts = facts
        self.job = job
        self.keys = job.keys
        self.cancel = job.cancel
        self.tune = tune
        self.refused = job.refused  # why keys were left as they are (said in the job's message and events)

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise JobCancelled(f"job {self.job.id} cancelled")


RetuneFn = Callable[[JobContext], list[ProfileRecord]]


def _said(items: list[str], most: int = 3) -> str:
    return "; ".join(items[:most]) + (f"; {len(items) - most} more" if len(items) > most else "")


def _modelled(written: list[ProfileRecord]) -> str:
    """What the job's message says of the profiles it wrote that are predictions, not measurements ("" when none): how
    many, by provenance (`moetune status` and the job_finished event show the message; a count alone read as
    measurements)."""
    c = collections.Counter(str(r.effective_provenance) for r in written if r.effective_provenance != "measured")
    if not c:
        return ""
    n = sum(c.values())
    kinds = next(iter(c)) if len(c) == 1 else ", ".join(f"{k} {p}" for p, k in sorted(c.items()))
    return f" ({'all' if n == len(written) else n} of them MODELLED ({kinds}), not measured)"


def _routed(job: Job) -> str:
    """What the job's message says of the keys it tuned under a routing other than uniform ("" when none): the
    tuner's default is uniform, so a count alone read as uniform profiles."""
    return "".join(f"; {n} key(s) re-tuned under routing {r} (as their profiles were tuned)"
                   for r, n in sorted(job.routings.items()))


def _outcomes(job: Job) -> str:
    """What the job's studies left besides what they wrote, for its message ("" when nothing)."""
    # a study is one profile key (a transport family of a job key): the counts are of those
    out = f"; {job.kept} profile key(s) kept their current profile ({_said(job.kept_why)})" if job.kept else ""
    return out + (f"; {len(job.no_result)} profile key(s) got no result ({_said(job.no_result)})"
                  if job.no_result else "")


class JobManager:
    """Bounded queue + one worker thread. Thread-safe; `info()` is cheap (read by the serving loop).

    A measuring re-tune (`[tune] backend = "local"` on a node with GPUs) first checks that no other process runs on
    the GPUs (`gpu_probe`, default `gpu_processes`): its benchmarks would disturb a production job and measure that
    job's noise. While they are busy, or their state cannot be told, the job waits queued (a `job_deferred` event says
    why) and is checked again every `tune.busy_retry_s`; the jobs behind it wait too (one job at a time).
    `[tune] run_on_busy_gpus = true` runs it anyway. Every job also waits queued (said the same way) while the daemon
    has no fabric facts (`_wait_for_facts`)."""

    def __init__(
        self,
        *,
        store: Any,
        facts_fn: Callable[[], Any],
        retune: RetuneFn,
        on_done: Callable[[Job, list[ProfileRecord]], None],
        tune: TuneSettings,
        on_start: Callable[[Job], None] | None = None,
        capacity: int = 4,
        metrics: Any = None,
        first_id: int = 1,
        gpu_probe: GpuProbe | None = None,
    ):
        self.store = store
        self.gpu_probe = gpu_probe or gpu_processes
        self.facts_fn = facts_fn
        self.retune = retune
        self.on_done = on_done
        self.on_start = on_start
        self.tune = tune
        self.capacity = capacity
        self.metrics = metrics
        # the worker's queue, under `_lock`: the live queued jobs in order (resumed jobs may go past `capacity`), then
        # the stop sentinel (None). A queued job `cancel` drops leaves it at once (it stayed in an unbounded queue.Queue
        # until the worker reached it: a running job under a submit + cancel loop had it grow without end)
        self._q: collections.deque[Job | None] = collections.deque()
        self._queued: dict[int, Job] = {}
        self._recent: collections.deque[Job] = collections.deque(maxlen=16)
        self.running: Job | None = None
        self._ids = itertools.count(first_id)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # notified when the worker has something in `_q`
        self._thread = threading.Thread(target=self._loop, name="moetune-jobs", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        """The worker thread still runs (a re-tune that did not return within stop()'s wait)."""
        return self._thread.is_alive()

    def _event(self, kind: EventKind, job: Job, reason: str) -> bool:
        """Record one of the job's events; False (logged) where the store refused it."""
        try:
            self.store.add_event(kind=kind, reason=reason, details=job.details())
            return True
        except Exception as e:  # the store is the daemon's; a failed event must not kill the worker
            log.error("cannot record %s for job %s: %s", kind, job.id, e)
            return False

    def submit(self, *, reason: str, old_fingerprint: str | None, keys: list[ProfileKey], all_current: bool = False,
               confirm: bool = False, skip_queued: bool = False, resumes: int | None = None,
               left_out: list[str] | None = None) -> Job | None:
        """Queue a job; raises queue.Full when the queue is at capacity or the daemon is stopping. With
        `skip_queued` (the automatic re-tunes) keys a queued job already holds are left out (a queued job tunes
        for the facts current when it starts), and None is returned when none is left. `resumes`: the id of
        the last daemon's job this one takes over; such a job is queued past the capacity (a stopped daemon
        may leave one running and `capacity` queued: none may be lost). `left_out`: what the user's `retune` left
        out of it (kept on the job for `status` and its events).

        The job_queued event is written (in the caller's thread) BEFORE the worker can see the job, so the events
        of one job are always in order (queued < started < finished) for recover_jobs(). With `confirm` (a user's
        `retune`, answered only after this returns) a job_queued the store refused raises JobNotRecorded and the job
        is not queued: a reply never names a job the store does not hold (its id could be handed out again)."""
        with self._lock:
            if self._stopping:
                raise queue.Full("the daemon is stopping")
            if skip_queued:
                held = {tuning_key(k) for j in self._queued.values() if not j.cancel.is_set() for k in j.keys}
                keys = [k for k in keys if tuning_key(k) not in held]
                if not keys:
                    return None
            if len(self._queued) >= self.capacity and resumes is None:
                raise queue.Full(f"{self.capacity} jobs queued")
            job = Job(next(self._ids), reason=reason, old_fingerprint=old_fingerprint, keys=keys, all_current=all_current,
                      resumes=resumes, left_out=left_out)
            self._queued[job.id] = job  # reserves its place: at most `capacity` jobs queued or being persisted
        self._persist_and_enqueue(job, confirm=confirm)
        log.info("queued re-tune job %d (%d keys): %s", job.id, len(keys), reason)
        return job

    def _persist_and_enqueue(self, job: Job, *, confirm: bool = False) -> None:
        ok = self._event("job_queued", job, job.reason)
        with self._lock:
            job.queued_recorded, job.persisted = ok, True
            dropped = job.dropped
            if confirm and not ok:
                self._queued.pop(job.id, None)  # never run: nobody was told it is queued
            elif not dropped:  # under the lock: a `cancel` from now on finds it in `_q` and takes it out
                self._q.append(job)
                self._ready.notify()
        if confirm and not ok:
            if dropped:
                job.end_recorded.set()  # nothing of it is in the store: there is no end to write
            raise JobNotRecorded(f"job {job.id} could not be recorded in the database (see the daemon's log); "
                                 "it was not queued")
        if dropped:  # cancelled before its job_queued was written: its end is written after it, in order
            self._finish_dropped(job)

    def _finish_dropped(self, job: Job) -> None:
        """The job_finished event of a queued job `cancel` dropped (the worker skips it): after its job_queued, so a
        restarted daemon's recover_jobs sees it finished and never queues it again."""
        job.end_ok = self._event("job_finished", job, job.message)
        job.end_recorded.set()
        if self.metrics:
            self.metrics.job_finished("cancelled")

    def cancel(self, job_id: int, *, wait_s: float = 30.0) -> Job | None:
        """Cancel a queued or running job; returns once its cancel is committed (job_finished of a queued job,
        job_cancelled of a running one). Raises JobNotRecorded (the job is cancelled in this daemon all the same)
        when the store refused that event, or a queued job's job_queued is still being written after `wait_s`."""
        with self._lock:
            job = self._queued.pop(job_id, None)
            write = asked = False
            if job is not None:  # dropped at once: its queue slot is free now, not when the worker reaches it
                job.state, job.finished, job.message = "cancelled", now(), "cancelled while queued"
                job.dropped = True
                with contextlib.suppress(ValueError):  # not there: the worker holds it (waiting), or not enqueued yet
                    self._q.remove(job)
                self._recent.append(job)
                write = job.persisted  # else _persist_and_enqueue writes its end after its job_queued
            elif self.running is not None and self.running.id == job_id and self.running.state == "running":
                # its state read here, under the lock the worker ends it "done" under: a job that has ended (still
                # `running` until the worker lists it recent) is not answered "cancelling"
                job = self.running
                # recorded now: a daemon stopped before the job ends must not resume what the user cancelled
                asked = not job.cancel.is_set()
            if job is None:
                return None
            job.cancelled_by = job.cancelled_by or "user"
            job.cancel.set()
        ok = True
        if asked:
            ok = self._event("job_cancelled", job, f"job {job.id} cancelled while it ran")
        elif job.dropped:
            if write:  # its job_queued is in the store: its end goes after it
                self._finish_dropped(job)
            # else the thread writing its job_queued (an automatic job's) writes its end right after it
            ok = job.end_recorded.wait(wait_s) and job.end_ok
        if not ok:
            raise JobNotRecorded(f"job {job.id} is cancelled in this daemon, but its cancel could not be recorded in "
                                 "the database (see the daemon's log): a restart may resume it")
        return job

    def cancel_fingerprint(self, fingerprint: str) -> Job | None:
        """Cancel the running job if it tunes for `fingerprint` (the fabric moved on: its work is outdated;
        its end queues its keys again)."""
        with self._lock:
            job = self.running
            if job is None or job.fingerprint != fingerprint:
                return None
            job.cancelled_by = job.cancelled_by or "fabric"
            job.cancel.set()
            return job

    def info(self) -> tuple[list[JobInfo], JobInfo | None, list[JobInfo]]:
        with self._lock:
            queued = [j.info() for j in self._queued.values()]
            running = self.running.info() if self.running else None
            recent = [j.info() for j in self._recent]
        return queued, running, recent

    def queued_count(self) -> int:
        return len(self._queued)

    def _busy(self) -> str:
        """Why a measuring re-tune must not run now ('' when it may): other processes on the GPUs, or no way to tell."""
        if self.tune.backend != "local":
            return ""  # a model re-tune predicts: it runs nothing on the GPUs
        try:
            facts = self.facts_fn()
        except Exception:  # broad: the daemon's facts callback; the job itself reports a discovery failure
            facts = None
        if facts is None or not getattr(facts, "gpu_count", 0):
            return ""  # no GPU here: the re-tune runs gloo ranks on the CPUs
        try:
            busy, seen = self.gpu_probe()
        except Exception as e:  # broad: a probe that fails cannot tell
            busy, seen = None, f"the GPU probe failed: {type(e).__name__}: {e}"
        if busy is False:
            return ""
        if busy:
            why = (f"other processes run on this node's GPUs ({seen}): a measuring re-tune would disturb them and "
                   "measure their noise")
        else:
            why = (f"cannot tell whether this node's GPUs are idle ({seen}), so a measuring re-tune does not risk "
                   "disturbing a job on them")
        if self.tune.run_on_busy_gpus:
            log.warning("re-tune runs anyway ([tune] run_on_busy_gpus = true): %s", why)
            return ""
        return (f"deferred: {why}; checked again every {self.tune.busy_retry_s:g} s "
                "([tune] run_on_busy_gpus = true runs it anyway)")

    def _measures_nothing(self, job: Job) -> bool:
        """Whether the default re-tune refuses every key of `job` on this node (`key_refusals`): it runs nothing on
        the GPUs, so it does not wait for them to be idle (where no probe can tell, it waited for good, `status`
        showing it "deferred" instead of the refusal that names its keys)."""
        if self.retune is not tuner_retune or not job.keys:
            return False
        facts = self._facts_or_none()
        if facts is None:
            return False
        try:
            # no tuned family (model_family): it is known with [tune] backend = "model" only, whose re-tune never
            # waits for idle GPUs (`_busy` is '' for it), so this answer does not matter there; loading the calibrated
            # model for it read the store for nothing
            refused = {k for r in key_refusals(job.keys, facts, self.tune.backend) for k in r.keys}
        except Exception:  # broad: in the worker thread; the job itself then says what failed
            return False
        return all(k in refused for k in job.keys)

    def _wait_for_idle_gpus(self, job: Job) -> None:
        """Hold `job` queued while the GPUs are busy (or their state unknown); returns when it may run or is cancelled."""
        while not job.cancel.is_set():
            why = self._busy()
            if not why:
                if job.deferred:  # its "deferred: ..." message is over too (status showed it while it ran)
                    job.deferred = job.message = ""
                return
            if why != job.deferred:  # said once per reason, not every retry
                job.deferred = job.message = why
                log.warning("re-tune job %d %s", job.id, why)
                self._event("job_deferred", job, why)
            job.cancel.wait(self.tune.busy_retry_s)  # a cancel or the daemon's stop wakes it

    def _facts_or_none(self) -> Any:
        try:
            return self.facts_fn()
        except Exception:  # broad: the daemon's facts callback; as no facts yet
            return None

    def _wait_for_facts(self, job: Job) -> None:
        """Hold `job` queued while the daemon has no fabric facts (its start-up discovery failed, or was incomplete and
        differed from the known fabric): returns once a discovery round gave facts, or when it is cancelled. Run now, it
        would fail "no fabric facts" and be recorded finished, and a job resumed from the last daemon would be lost for
        good (no later start re-queues its keys)."""
        while not job.cancel.is_set():
            if self._facts_or_none() is not None:
                if job.deferred:
                    job.deferred = job.message = ""
                return
            if not job.deferred:  # said once (in status and an event), then checked again until facts come
                job.deferred = job.message = ("deferred: no fabric facts yet (the last discovery failed or was "
                                              "incomplete, see status); runs once a discovery round reads the fabric")
                log.warning("re-tune job %d %s", job.id, job.deferred)
                self._event("job_deferred", job, job.deferred)
            job.cancel.wait(FACTS_RECHECK_S)  # reading the facts is cheap; a cancel or the daemon's stop wakes it

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._q:
                    self._ready.wait()
                job = self._q.popleft()
            if job is None:
                return
            if not job.cancel.is_set():
                self._wait_for_facts(job)  # still listed as queued meanwhile
            if not job.cancel.is_set() and not self._measures_nothing(job):
                self._wait_for_idle_gpus(job)
            with self._lock:
                self._queued.pop(job.id, None)
                if job.cancel.is_set():
                    if not job.dropped:  # else `cancel` finished it already (listed, recorded)
                        job.state, job.finished, job.message = "cancelled", now(), "cancelled while queued"
                        self._recent.append(job)
                    cancelled_early = True
                else:
                    self.running = job
                    job.state = "running"
                    cancelled_early = False
            if cancelled_early:
                if job.cancelled_by == "shutdown" or job.dropped:
                    continue  # shutdown: not finished in the store, the next daemon re-queues it; or `cancel` did
                self._event("job_finished", job, job.message)
                if self.metrics:
                    self.metrics.job_finished("cancelled")
                continue
            self._run(job)

    def _current(self, fingerprint: str | None) -> list[tuple[int, ProfileRecord]] | None:
        """(row id, record) of the fingerprint's current profiles: a re-measurement of the same knobs is a new row
        (a new id) with the same profile hash."""
        if fingerprint is None:
            return []
        try:
            return self.store.list_profiles(status="current", fingerprint=fingerprint)
        except Exception as e:  # broad: in the worker thread; only the partial-write accounting is lost
            log.error("cannot read the current profiles of %s: %s", fingerprint, e)
            return None

    def _run(self, job: Job) -> None:
        job.backend = self.tune.backend
        if self.on_start is not None:
            try:
                self.on_start(job)
            except Exception:  # broad: the server's callback runs in the worker thread, which must survive it
                log.exception("before job %d", job.id)
        written: list[ProfileRecord] = []
        before: set[int] | None = None  # the current profiles (row ids) of the job's fingerprint when it started
        t0 = time.monotonic()
        damaged = False  # the store's file is damaged: nothing more of this job is written to it
        try:
            # the daemon's store was scanned when it opened, maybe weeks ago: scanned anew before this job writes or
            # measures (a damaged file found only by the profile write lost the minutes measured)
            self.store.refuse_damaged(again=True)
            facts = self.facts_fn()
            if facts is None:
                raise RuntimeError("no fabric facts (discovery failed)")
            job.fingerprint = facts.fingerprint
            job.software = getattr(facts, "software_hash", None)
            from moetune.tuner.fabric.change import identity

            job.identity = identity(facts)  # its GPUs (None: unknown), as same_hardware compares them
            now_current = self._current(job.fingerprint)  # tells what a cancelled job wrote (None: unknown)
            before = None if now_current is None else {i for i, _ in now_current}
            job.run_id = self.store.start_run(study_name=f"moetune-daemon-job-{job.id}", storage=str(self.store.url),
                                              backend=self.tune.backend)
            self._event("job_started", job, f"started job {job.id}: {job.reason}")
            job.started_recorded = True  # from here on a restart finds this job `started` (run_id shown)
            written = list(self.retune(JobContext(store=self.store, facts=facts, job=job, tune=self.tune)) or [])
            # a re-tune that does not check the flag ran to its end: a user's or the watch's cancel still ends the job
            # cancelled; the daemon's own stop does not (the work is done: nothing is left to resume)
            with self._lock:  # with cancel's check: a job cancel answered "cancelling" never ends done
                cancelled = job.cancel.is_set() and job.cancelled_by != "shutdown"
                if not cancelled:
                    job.state = "done"
            if cancelled:
                raise JobCancelled(f"job {job.id} cancelled")
            job.written = len(written)
            job.message = f"{len(written)} profile(s) written{_modelled(written)} in {time.monotonic() - t0:.1f} s"
            job.message += _routed(job) + _outcomes(job)
            if job.refused:
                job.message += "; " + "; ".join(job.refused)
        except JobCancelled as e:
            job.state, job.message = "cancelled", str(e)
        except StoreStopping as e:  # the stop gave up its wait for another writer's lock: interrupted, as by a crash
            log.info("re-tune job %d interrupted by the stop: %s", job.id, e)
            job.cancelled_by = job.cancelled_by or "shutdown"
            job.state, job.message = "cancelled", str(e)
        except StoreDamaged as e:  # the scan's, or a read or write's on a damaged page: said plainly, no traceback
            log.error("re-tune job %d failed: %s", job.id, e)
            job.state, job.message, damaged = "failed", str(e), True
        except RetuneImpossible as e:  # said plainly, no traceback: the daemon keeps serving what is valid
            log.warning("re-tune job %d cannot run: %s", job.id, e)
            job.state, job.message, job.impossible = "failed", str(e), True
        except Exception as e:  # broad: the worker thread's boundary; the job fails, the daemon serves on
            log.exception("re-tune job %d failed", job.id)
            job.state, job.message = "failed", f"{type(e).__name__}: {e}"
        if job.state != "done" and before is not None:
            # a cancelled or failed job keeps what it stored: count it and publish it like a finished job's
            written = [r for i, r in self._current(job.fingerprint) or [] if i not in before]
            job.written = len(written)
            if written:
                job.message += f" ({len(written)} profile(s) written{_modelled(written)} before it stopped)"
            job.message += _routed(job) + _outcomes(job)
        moved = "" if damaged else self._fabric_moved_on(job, before)  # its mark_stale is a write
        if moved:
            written = []  # nothing of the old fingerprint stays current: nothing to publish
        interrupted = job.state == "cancelled" and job.cancelled_by == "shutdown"
        if interrupted:
            job.state, job.message = "failed", "daemon stopped during the job"
        job.finished = now()
        if job.run_id is not None and not damaged:
            try:
                best = min((r.latency_us for r in written), default=None)
                self.store.finish_run(job.run_id, status=job.state, trials=len(written), best_value=best)
            except StoreStopping as e:  # left `running`: the next start marks it failed (recover_jobs)
                log.info("run %s of job %d left running: %s", job.run_id, job.id, e)
            except Exception as e:  # broad: in the worker thread; a run row left open must not stop the queue
                log.error("cannot finish run %s: %s", job.run_id, e)
        # its keys queued again BEFORE its job_finished, the new job naming it (`resumes`): a daemon killed between
        # the two writes resumes them once (recover_jobs closes this job as taken over); the other way round it left
        # this job finished and nothing holding its keys, never re-tuned for the new fabric
        if moved and job.cancelled_by not in ("user", "shutdown"):
            self._requeue(job, moved)
        # an interrupted job stays `started` in the store: the next daemon resumes it; a job stopped by a damaged file
        # is not recorded in it (said in the log and `status`): the next daemon refuses the file until it is restored
        if not interrupted and not damaged:
            self._event("job_finished", job, job.message)
        if self.metrics:
            self.metrics.job_finished(job.state)
        try:
            self.on_done(job, written)
        except Exception:  # broad: the server's callback runs in the worker thread, which must survive it
            log.exception("after job %d", job.id)
        with self._lock:
            self.running = None
            self._recent.append(job)
        log.info("job %d %s: %s", job.id, job.state, job.message)

    def _fabric_moved_on(self, job: Job, before: set[int] | None = None) -> str:
        """The node's fingerprint when it is no longer the fabric `job` tuned for ('' otherwise): another
        fingerprint, or the same one on other GPUs (`same_hardware`: a GPU replaced by one of the same model). Its
        profiles of the old fingerprint are made stale: the watch's mark_stale may have run before the job wrote.
        `before`: the fingerprint's current rows when the job started (None: unknown)."""
        from moetune.tuner.fabric.change import same_hardware

        if job.fingerprint is None:
            return ""
        try:
            facts = self.facts_fn()
        except Exception:  # broad: the daemon's facts callback; treat as unchanged
            return ""
        if facts is None or same_hardware(job.fingerprint, job.identity, facts):
            return ""
        ids: list[int] | None = None  # another fingerprint: every current row of the old one is outdated
        if facts.fingerprint == job.fingerprint and before is not None:
            # other GPUs, same fingerprint: the change made the old GPUs' rows stale; what is left of the job's writes
            # was measured for the GPUs it started on (compared by fingerprint alone, they stayed current and were
            # served for the new GPUs). Where what it wrote is unknown, every current row of it is made stale
            now_current = self._current(job.fingerprint)
            ids = None if now_current is None else [i for i, _ in now_current if i not in before]
        try:
            n = self.store.mark_stale(fingerprint=job.fingerprint, ids=ids,
                                      reason=f"job {job.id} tuned for {job.fingerprint}; the fabric is now {facts.fingerprint}")
        except Exception as e:  # broad: in the worker thread
            log.error("cannot mark the profiles of %s stale: %s", job.fingerprint, e)
            n = 0
        job.message += f"; the fabric changed to {facts.fingerprint} during the job ({n} profile(s) made stale)"
        return str(facts.fingerprint)

    def _requeue(self, job: Job, fingerprint: str) -> None:
        try:
            self.submit(reason=f"job {job.id} re-queued: the fabric changed to {fingerprint} during it"[:512],
                        old_fingerprint=job.fingerprint, keys=job.keys, all_current=job.all_current, skip_queued=True,
                        resumes=job.id,  # takes this job over (recover_jobs); past the capacity, as it ends
                        left_out=job.left_out)  # still said, as a job resumed after a restart says them
        except queue.Full as e:
            log.error("job %d not re-queued after the fabric changed: %s", job.id, e)

    def _holds_transaction(self) -> bool:
        """The job worker has had a write transaction open for HELD_TRANSACTION_S: one that ignores its cancel (a
        measurement in C inside an `atomic` body) held the stop for as long as it ran."""
        open_s = getattr(self.store, "write_open_s", None)
        held = open_s(self._thread.ident) if open_s is not None else None
        return held is not None and held >= HELD_TRANSACTION_S

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the queue and the running job (left queued / started in the store, for the next daemon to
        resume); wait a bounded time, and not for a worker that holds a write transaction (`_holds_transaction`)."""
        with self._lock:
            self._stopping = True
            for j in [*self._queued.values(), *([self.running] if self.running is not None else [])]:
                j.cancelled_by = j.cancelled_by or "shutdown"
                j.cancel.set()
            self._q.append(None)  # wakes the worker after the queued (cancelled) jobs
            self._ready.notify()
        # after the jobs are marked "shutdown": a job whose write waits for another writer's lock (a tune, an import)
        # gives it up and ends interrupted (left started, resumed by the next start) instead of holding this stop for
        # the join and then the finish_run below behind that transaction (up to the busy timeout, 30 s)
        stop_waiting = getattr(self.store, "stop_waiting", None)
        if stop_waiting is not None:
            stop_waiting()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline and not self._holds_transaction():
            self._thread.join(min(0.05, max(0.0, deadline - time.monotonic())))
        with self._lock:
            job = self.running
            # under the lock with the worker's `done`: a job whose re-tune returned meanwhile keeps its state (marked
            # failed after it, its own finish_run and job_finished would say failed and done)
            overdue = job if job is not None and job.state == "running" and self._thread.is_alive() else None
            if overdue is not None:
                # the re-tune did not return in time (the process is exiting): its run is failed now; the job
                # stays started in the store (no job_finished) so the next daemon resumes it
                overdue.state, overdue.finished, overdue.message = "failed", now(), "daemon stopped during the job"
        if overdue is not None and overdue.run_id is not None:
            try:
                # only a run still `running`: the job may commit and end `done` before this write (overwritten, the row
                # said failed beside its job_finished). It does not wait for a held lock (`stop_waiting` above)
                if not self.store.finish_run(overdue.run_id, status="failed", trials=0, best_value=None, if_running=True):
                    log.info("run %s of job %d ended on its own during the stop: left as it ended", overdue.run_id, overdue.id)
            except StoreStopping as e:  # its lock held (by the job itself, or another process): not waited for
                log.info("run %s of job %d left running (the next start marks it failed): %s", overdue.run_id,
                         overdue.id, e)
            except Exception as e:  # broad: best effort while the daemon exits
                log.error("cannot finish run %s: %s", overdue.run_id, e)
