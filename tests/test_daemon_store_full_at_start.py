"""A daemon started on a database it cannot write (a full disk: StoreFull; the lock held past the busy timeout) starts
and serves what the database holds: the last daemon's jobs it cannot close stay open in the store (the next start
closes or resumes them), the start's discovery is not adopted and status says why (last_discovery_ok false, the
store's words), and a later discovery round records it once the store takes writes again. The first write of the
start (a recovered job's job_finished, the fingerprint's upsert) must not raise out of `start`: `moetune serve` would
exit 1 and its service restart it every few seconds, to fail the same way, serving nothing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon import jobs as J
from moetune.tuner.daemon import recovery as R
from moetune.tuner.daemon.server import Daemon
from moetune.tuner.store.store import StoreFull

pytestmark = pytest.mark.timeout(60)
WRITES = ("upsert_fingerprint", "add_event", "finish_run", "mark_stale", "start_run", "close_orphaned_runs")


def _full(store: Any) -> dict[str, Any]:
    """Make every write of `store` fail as on a full disk; the real methods, to put back."""
    real = {m: getattr(store, m) for m in WRITES}

    def full(*_a: Any, **_kw: Any) -> Any:
        raise StoreFull(f"{store.path}: database or disk is full: the disk holding {store.path.parent} is full")

    for m in WRITES:
        setattr(store, m, full)
    return real


def test_a_daemon_on_a_full_disk_starts_serves_and_records_the_fabric_once_it_can(tmp_path: Path) -> None:
    from moetune.runtime.profiles.client import ProfileClient

    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts)
    # the last daemon's jobs: one whose keys are gone (closed at start), one cancelled while it ran
    store.add_event(kind="job_queued", reason="j1", details={"job_id": 1, "keys": []})
    store.add_event(kind="job_queued", reason="j2", details={"job_id": 2, "keys": []})
    store.add_event(kind="job_cancelled", reason="j2", details={"job_id": 2, "keys": []})
    real = _full(store)
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=lambda: facts,
               rediscover_interval_s=0, retune_job=lambda ctx: []).start(background=True)
    c = ProfileClient(d.endpoint, timeout_ms=5000)
    try:
        st = c.status()
        assert st.profiles_current > 0  # serving what the database holds
        assert not st.last_discovery_ok and "disk is full" in st.last_discovery_message, st.last_discovery_message
        assert d.facts is None
        ids, _events, _top = store.open_jobs(kinds=J.JOB_EVENTS, finished="job_finished")
        assert ids == [1, 2]  # not closed: the next start does it
        for m, f in real.items():  # room again
            setattr(store, m, f)
        d.rediscover()  # the next discovery round
        st = c.status()
        assert st.fingerprint == facts.fingerprint and st.last_discovery_ok
        assert store.list_events(kinds=("fabric_seen",))  # recorded by a discovery round
    finally:
        c.close()
        d.stop()
    resume, _next = R.recover_jobs(store)  # the next start closes them
    assert resume == [] and store.open_jobs(kinds=J.JOB_EVENTS, finished="job_finished")[0] == []
    store.close()


def test_a_round_whose_writes_fail_is_said_in_status(tmp_path: Path) -> None:
    """A round whose discovery went through and whose fabric-change writes failed said last_discovery_ok true."""
    a, b = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, a)
    now = [a]
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=lambda: now[0],
               rediscover_interval_s=0.05, retune_job=lambda ctx: []).start(background=True)
    try:
        assert d.facts.fingerprint == a.fingerprint and d._last_discovery[1]
        real = _full(store)
        now[0] = b
        F.until(lambda: not d._last_discovery[1] and "disk is full" in d._last_discovery[2])
        assert d.facts.fingerprint == a.fingerprint
        for m, f in real.items():
            setattr(store, m, f)
        F.until(lambda: d.facts.fingerprint == b.fingerprint and d._last_discovery[1])
    finally:
        d.stop()
        store.close()
