"""A `retune` (queue or cancel) is answered only once what it says is committed: a kill -9 right after the reply
loses neither the queued job nor the cancel, and a job id that was answered is never handed out again.

The daemon's job event writes are slowed (daemon_fakes.slow_job_events_store): a reply sent before they commit
(as when they went to a writer thread) is then always seen by the kill -9."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient

pytestmark = pytest.mark.timeout(90)

SLOW = {"MOETUNE_FAKE_JOB_SLEEP": "60", "MOETUNE_FAKE_EVENT_DELAY": "0.5"}
HOOK = ["--store-hook", "daemon_fakes:slow_job_events_store"]


def _job_events(db: Path, job_id: int) -> list[str]:
    store = F.open_store(db)
    return [e["kind"] for e in sorted(store.list_events(limit=500), key=lambda e: e["id"])
            if (e["details"] or {}).get("job_id") == job_id]


def test_a_queued_retune_and_a_cancel_survive_a_kill9_right_after_the_reply(tmp_path: Path) -> None:
    with F.seeded_daemon(tmp_path, extra=HOOK, env=SLOW) as (d, _facts):
        c = ProfileClient(d.endpoint, timeout_ms=5000)
        first = c.retune(all=True, reason="confirmed").job
        d.kill(9)
        c.close()
    assert first is not None
    assert _job_events(d.db, first.id)[:1] == ["job_queued"]

    d2 = F.DaemonProc(tmp_path, extra=HOOK, env=SLOW)
    try:
        d2.wait_ready()
        c = ProfileClient(d2.endpoint, timeout_ms=5000)
        running = F.until(lambda: c.status().jobs.running)  # the first job, resumed under a new id
        assert running.id > first.id
        c.retune(cancel=running.id)
        d2.kill(9)
        c.close()
    finally:
        d2.kill()
    assert "job_cancelled" in _job_events(d.db, running.id)

    d3 = F.DaemonProc(tmp_path, extra=HOOK, env=SLOW)
    try:
        d3.wait_ready()
        c = ProfileClient(d3.endpoint, timeout_ms=5000)
        st = c.status()
        # the cancelled job is not resumed; a new job gets an id past every one answered before
        assert st.jobs.running is None and not st.jobs.queued, st.jobs
        new = c.retune(all=True, reason="after two kills").job
        assert new is not None and new.id > running.id
        c.close()
    finally:
        d3.kill()
