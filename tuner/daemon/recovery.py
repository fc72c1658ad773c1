"""After a crash or a stop: the last daemon's open jobs closed or resumed, and the notice its jobs left."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from moetune.runtime.knobs import group_world_problem
from moetune.runtime.profile_record import ProfileKey, is_transport_family
from moetune.tuner.daemon.jobs import JOB_EVENTS
from moetune.tuner.daemon.retune import served_tuning_keys, tuning_key
from moetune.tuner.search.policy import transport_of_family as transport_of
from moetune.tuner.store import StoreBusy, StoreError, StoreFull

# the jobs' logger: what recovery logs is about jobs, under the name the daemon's log has always shown
log = logging.getLogger("moetune.daemon.jobs")


@dataclass(frozen=True)
class Resumable:
    """A job the last daemon left queued or running. `details`: what to queue again (its keys those still to tune);
    `why`/`finish_details`: the job_finished event that closes the old job (its reason `why` and how it ended),
    written only after its resumption is queued (`Daemon._resume`), so a crash in between loses no job: the next
    start finds the resumption (its `resumes`) and closes the old job then."""

    job_id: int
    details: dict[str, Any]
    why: str
    finish_details: dict[str, Any]


def recover_jobs(store: Any) -> tuple[list[Resumable], int]:
    """After a restart: the jobs the last daemon left queued or running, to resume (their runs marked failed), and
    the next free job id. The open jobs (job events, none of them job_finished) are found by job id, however many
    events came after theirs: a window of the newest 2000 job events lost a job that ran while a loop of submits and
    cancels wrote more. A job whose resumption was queued already (a crash before its job_finished) is closed here,
    not resumed again."""
    # the open jobs' events, and those of the jobs that took one over (finished or not), oldest first
    ids, events, max_id = store.open_jobs(kinds=JOB_EVENTS, finished="job_finished", also="resumes")
    open_ids = set(ids)
    last: dict[int, tuple[str, dict[str, Any]]] = {}
    started_at: dict[int, str] = {}  # job id -> when its (last) job_started event was written
    resumed_as: dict[int, int] = {}  # old job id -> the job that took it over
    cancelled: set[int] = set()  # a user cancelled it while it ran
    for e in events:
        kind = e["kind"]
        d = e["details"] if isinstance(e["details"], dict) else {}
        jid = d.get("job_id")
        if not isinstance(jid, int):
            continue
        if isinstance(d.get("resumes"), int):  # any of its events: its job_queued may be the one not written
            resumed_as[d["resumes"]] = jid
        if jid not in open_ids:
            continue  # a job that ended, read for the job it took over only
        if kind == "job_cancelled":
            cancelled.add(jid)
        last[jid] = (kind, d)
        if kind == "job_started":
            started_at[jid] = str(e["created"])
    resume: list[Resumable] = []
    for jid, (kind, d) in sorted(last.items()):
        # the user cancelled it while it ran, and the daemon stopped before it ended (its job_started may come after
        # the cancel: both are written as they happen, from two threads)
        if jid in cancelled:
            _close_run(store, d, "cancelled")
            close_job(store, jid, reason=f"job {jid} cancelled; the daemon stopped before it ended",
                       details={**d, "state": "cancelled", "message": "cancelled (the daemon stopped before the "
                                "job ended; not resumed)"})
            continue
        keys = [k for k in d.get("keys") or [] if isinstance(k, dict)]
        if kind == "job_started":
            _close_run(store, d, "failed")
            # the keys it finished before it stopped are not tuned again (kill -9 after the last profile)
            done = _written_since(store, d, started_at.get(jid, ""))
            left = [k for k in keys if not _done(k, done)]
            msg = "interrupted: the daemon stopped during the job"
            if len(left) < len(keys):
                msg += f" ({len(keys) - len(left)} of {len(keys)} key(s) already tuned, not re-tuned)"
            closed = {**d, "state": "failed", "message": msg}
            why = f"job {jid} interrupted (daemon restarted)"
        else:  # queued, never started
            left = keys
            closed = {**d, "state": "cancelled", "message": "the daemon restarted before the job ran; re-queued"}
            why = f"job {jid} re-queued after a restart"
        if jid in resumed_as or not left:
            how = f"resumed as job {resumed_as[jid]}" if jid in resumed_as else "nothing left to resume"
            close_job(store, jid, reason=f"{why}; {how}", details=closed)
            continue
        resume.append(Resumable(jid, {**d, "keys": left}, why, closed))
    # runs left `running` without a job event (e.g. killed between start_run and the event)
    for r in store.list_runs(limit=200):
        if r["status"] == "running" and str(r["study_name"]).startswith("moetune-daemon-job-"):
            try:
                store.finish_run(r["id"], status="failed", trials=0, best_value=None)
            except StoreError as e:
                log.error("cannot mark run %s failed: %s", r["id"], e)
    # and the rows of the studies a killed job ran (`tune_profiles`' own runs, named after their study), and of any
    # other run whose process is gone: `interrupted`, as `moetune tune` and `profile` close them at their start. Those
    # refuse to run beside a daemon, so nothing else closed them while it served: `running` for good
    try:
        store.close_orphaned_runs()
    except StoreError as e:
        log.error("cannot mark the runs of stopped processes interrupted: %s", e)
    return resume, max_id + 1


def close_job(store: Any, jid: int, *, reason: str, details: dict[str, Any]) -> bool:
    """Write the job_finished that closes job `jid` of the last daemon; a write that fails for now (a full disk: StoreFull;
    the lock held past the busy timeout: StoreBusy) is logged, not raised: the job stays open in the store and the next
    start closes it (or resumes it) then. Raised, it ended the daemon's start: exit 1, restarted by its service to
    fail the same way. Any other store error (a file this user may not write, a damaged one) is raised: refused."""
    try:
        store.add_event(kind="job_finished", reason=reason, details=details)
        return True
    except (StoreFull, StoreBusy) as e:
        log.error("cannot close job %s of the last daemon (%s): %s; the next start does", jid, reason, e)
        return False


def _close_run(store: Any, d: dict[str, Any], status: str) -> None:
    """End the tuning run a job event names (`run_id`), as `status`; a store error is logged, never raised."""
    run_id = d.get("run_id")
    if isinstance(run_id, int):
        try:
            store.finish_run(run_id, status=status, trials=0, best_value=None)
        except StoreError as e:
            log.error("cannot mark run %s %s: %s", run_id, status, e)


def _done(k: dict[str, Any], written: tuple[set[tuple], set[tuple]]) -> bool:
    """Whether the interrupted job finished key `k` (`written`: `_written_since`). A key counts as done when its own
    family got a served profile (a job killed between two families of one shape and bucket leaves the other one to
    do), or when its group's re-tune was written and its family can never have a profile in that group (nvlink past
    its ranks, answered by collective: the runtime's `group_world_problem`, the rule the tune leaves it out by): such
    a key was re-tuned once more at every start. An unreadable key is not done."""
    own, served = written
    try:
        key = ProfileKey(**k)
    except (TypeError, ValueError):
        return False
    if (*tuning_key(key), key.transport_family) in own:
        return True
    if tuning_key(key) not in served or not is_transport_family(key.transport_family):
        return False
    return bool(group_world_problem(transport_of(key.transport_family), key.ep_size, nodes=key.nodes))


def _written_since(store: Any, d: dict[str, Any], since: str) -> tuple[set[tuple], set[tuple]]:
    """What the interrupted job finished before it stopped, from the current profiles of its fingerprint and software
    written after `since` (its job_started event): ((tuning_key..., family) of each row, the `served_tuning_keys`).
    Empty when unsure (an event of an older moetune without the software, an unreadable time, a store error): then
    every key is re-tuned."""
    fp, sw = d.get("fingerprint"), d.get("software")
    if not isinstance(fp, str) or not isinstance(sw, str) or not since:
        return set(), set()
    try:
        t0 = datetime.fromisoformat(since)
        profiles = store.list_profiles(status="current", fingerprint=fp)
    except Exception as e:  # broad: only a saving is lost; the job is resumed whole, as before
        log.error("cannot tell which keys job %s finished: %s", d.get("job_id"), e)
        return set(), set()
    newer = []
    for _, r in profiles:
        if r.key.software != sw:
            continue
        try:
            if datetime.fromisoformat(r.created) > t0:
                newer.append(r)
        except (TypeError, ValueError):
            continue
    return {(*tuning_key(r.key), r.key.transport_family) for r in newer}, served_tuning_keys(newer)


def tune_notice_of(store: Any, *, backend: str | None = None, page: int = 500) -> str:
    """Why the automatic re-tune cannot run here, as the last daemon's jobs left it ('' once one ran, or started: its
    end says anew): a restart must not forget it while the profiles it left stale stay stale. A notice left under
    another [tune] `backend` than this daemon's is dropped: it told how to change settings no longer in force. Read
    back page by page to the first event that decides: cancelled jobs' ends after the notice (thousands of queued
    re-tunes cancelled) do not push it out of a window."""
    before = None
    while True:
        events = store.list_events(limit=page, kinds=("job_started", "job_finished"), before_id=before)  # newest first
        for e in events:
            d = e["details"] or {}
            if not isinstance(d, dict):
                continue
            if e["kind"] == "job_started" or d.get("state") == "done":
                return ""
            if d.get("impossible"):
                ran_under = d.get("backend")  # None: written by an older moetune, which did not record it
                if backend is not None and isinstance(ran_under, str) and ran_under != backend:
                    return ""
                return str(d.get("message") or "")
        if len(events) < page:
            return ""
        before = events[-1]["id"]


def keys_from_details(d: dict[str, Any]) -> list[ProfileKey]:
    out = []
    for k in d.get("keys") or []:
        try:
            out.append(ProfileKey(**k))
        except (TypeError, ValueError):
            continue
    return out
