"""A re-tune job the last daemon left unfinished is resumed at start, before the start-up discovery runs. When that
discovery failed (a transient nvidia-smi error) or was incomplete and differed from the known fabric, the daemon has
no facts: the job waits queued, said in `status`, until a discovery round gives facts, and then runs. Taken at once,
it would fail "no fabric facts" and be recorded finished, and no later start would resume it (its stale keys never
re-tuned, though discovery succeeds a second later)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


def _left_unfinished(store: Any, facts: Any) -> list[Any]:
    """A store as a daemon killed with job 7 queued for the node's stale keys left it."""
    recs = F.seed_profiles(store, facts)
    store.mark_stale(fingerprint=facts.fingerprint, reason="test")
    F.record_fabric_seen(store, facts, "first discovery")
    store.add_event(kind="job_queued", reason="fabric changed",
                    details={"job_id": 7, "keys": [r.key.to_dict() for r in recs], "old_fingerprint": None,
                             "fingerprint": None, "software": None, "all_current": False, "state": "queued"})
    return recs


class Discovery:
    """Fails (or reads incomplete facts of another fabric) until `ok` is set; then the node's facts."""

    def __init__(self, facts: Any, how: str) -> None:
        self.facts, self.how, self.ok = facts, how, threading.Event()

    def __call__(self) -> Any:
        if self.ok.is_set():
            return self.facts
        if self.how == "fails":
            raise RuntimeError("nvidia-smi: transient failure")
        partial = F.FakeFacts({"gpu_model": "H200", "gpu_count": 1})  # a GPU did not answer: not a change
        partial.complete, partial.warnings = False, ["nvidia-smi timed out"]
        return partial


def _job_events(store: Any, kind: str, job_id: int) -> list[dict[str, Any]]:
    return [e["details"] for e in store.list_events(limit=100, kinds=(kind,)) if e["details"].get("job_id") == job_id]


@pytest.mark.parametrize("how", ["fails", "incomplete"])
def test_a_resumed_job_waits_for_the_fabric_facts_then_runs(tmp_path: Path, how: str) -> None:
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    recs = _left_unfinished(store, facts)
    discover = Discovery(facts, how)
    endpoint = f"ipc://{tmp_path}/run/d.sock"
    d = Daemon(store=store, endpoint=endpoint, discover=discover, rediscover_interval_s=0.2,
               retune_job=F.fake_retune).start(background=True)
    try:
        assert d.facts is None
        c = ProfileClient(endpoint, timeout_ms=5000)
        try:
            st = F.until(lambda: (s := c.status()).jobs.queued and s.jobs.queued[0].message and s)
            (job,) = st.jobs.queued
            assert job.state == "queued" and "no fabric facts" in job.message, job
            assert st.jobs.running is None and not st.jobs.recent
        finally:
            c.close()
        assert not _job_events(store, "job_finished", job.id)  # never recorded as ended: nothing is lost
        assert not _job_events(store, "job_started", job.id)
        discover.ok.set()  # the next round reads the fabric
        F.until(lambda: _job_events(store, "job_finished", job.id), timeout=10)
        (end,) = _job_events(store, "job_finished", job.id)
        assert end["state"] == "done", end
        F.until(lambda: d.index.current_count == len(recs), timeout=10)  # the re-tuned keys are served
    finally:
        d.stop()


def test_a_job_held_for_facts_when_the_daemon_stops_is_resumed_by_the_next_one(tmp_path: Path) -> None:
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    recs = _left_unfinished(store, facts)
    endpoint = f"ipc://{tmp_path}/run/d.sock"
    d = Daemon(store=store, endpoint=endpoint, discover=Discovery(facts, "fails"), rediscover_interval_s=0,
               retune_job=F.fake_retune).start(background=True)
    try:
        F.until(lambda: d.jobs.info()[0] and d.jobs.info()[0][0].message)
        held = d.jobs.info()[0][0].id
    finally:
        d.stop()
    assert not _job_events(store, "job_finished", held)
    d = Daemon(store=store, endpoint=endpoint, discover=lambda: facts, rediscover_interval_s=0,
               retune_job=F.fake_retune).start(background=True)
    try:
        F.until(lambda: d.index.current_count == len(recs), timeout=10)
        assert _job_events(store, "job_finished", held)[0]["state"] == "cancelled"  # closed as resumed, not failed
    finally:
        d.stop()


def test_a_change_the_last_daemon_did_not_queue_is_queued_once_discovery_succeeds(tmp_path: Path) -> None:
    """The same start-up failure left a fabric change the last daemon recorded but did not queue (killed between
    fabric_changed and its job) for good: the start's check needs the facts and was never run again."""
    store, _old, new, seeded = F.unqueued_fabric_change(tmp_path / "moetune.db")
    discover = Discovery(new, "fails")
    ran: list[list[Any]] = []
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=discover, rediscover_interval_s=0.2,
               retune_job=lambda ctx: ran.append(list(ctx.keys)) or []).start(background=True)
    try:
        assert d.facts is None and not d.jobs.info()[0]
        discover.ok.set()
        F.until(lambda: ran, timeout=10)
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
        F.until(lambda: d.index.current_count == 0 and len(d.index.stale) == len(seeded), timeout=10)
    finally:
        d.stop()
