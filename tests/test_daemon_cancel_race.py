"""A cancel of a job that has just ended "done" (the worker still lists it running while it publishes its
profiles) is not answered "cancelling job N": cancel reads the job's state under the lock the worker ends it under."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon import TuneSettings
from moetune.tuner.daemon import jobs as J

pytestmark = pytest.mark.timeout(60)


def _manager(tmp_path: Path, retune: Any, on_done: Any) -> tuple[J.JobManager, list]:
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "m.db")
    keys = [r.key for r in F.seed_profiles(store, facts)]
    jm = J.JobManager(store=store, facts_fn=lambda: facts, retune=retune, on_done=on_done,
                      tune=TuneSettings(backend="model", trials=1), gpu_probe=lambda: (False, "idle (test)"))
    return jm, keys


def test_a_job_that_ended_done_is_not_answered_cancelling(tmp_path: Path) -> None:
    publishing, release = threading.Event(), threading.Event()
    ended: list[Any] = []

    def on_done(job: Any, written: Any) -> None:  # the server publishes here, before the job leaves `running`
        publishing.set()
        release.wait(20)
        ended.append(job)

    jm, keys = _manager(tmp_path, lambda ctx: [], on_done)
    jm.start()
    try:
        job = jm.submit(reason="t", old_fingerprint=None, keys=keys, confirm=True)
        assert publishing.wait(10) and jm.running is job and job.state == "done"
        assert jm.cancel(job.id) is None  # answered "no queued or running job", not "cancelling"
        release.set()
        F.until(lambda: ended)
        assert job.state == "done" and not job.cancelled_by
        kinds = [e["kind"] for e in jm.store.list_events(limit=50) if (e["details"] or {}).get("job_id") == job.id]
        assert "job_cancelled" not in kinds
    finally:
        release.set()
        jm.stop()


def test_a_cancel_before_the_job_ends_ends_it_cancelled(tmp_path: Path) -> None:
    """The other order: the cancel came first (answered "cancelling"): a re-tune that ran to its end regardless
    ends cancelled, never done."""
    running, release = threading.Event(), threading.Event()
    ended: list[Any] = []

    def retune(ctx: Any) -> list:
        running.set()
        release.wait(20)  # does not check the cancel flag
        return []

    jm, keys = _manager(tmp_path, retune, lambda j, w: ended.append(j))
    jm.start()
    try:
        job = jm.submit(reason="t", old_fingerprint=None, keys=keys, confirm=True)
        assert running.wait(10)
        assert jm.cancel(job.id) is job
        release.set()
        F.until(lambda: ended)
        assert job.state == "cancelled"
    finally:
        release.set()
        jm.stop()
