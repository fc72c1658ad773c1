"""`status`'s re-tune notice (why the automatic re-tune cannot run here) is about the settings of the job that left
it. A daemon restarted with other settings showed the old notice ('set [tune] backend = "local"') above the job
running under `backend = "local"`: it is cleared when a job starts, and a restart under another backend does not
bring back a notice left under the old one."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import ProfileRecord
from moetune.runtime.profiles.client import ProfileClient
from moetune.tuner.daemon.retune import RetuneImpossible
from moetune.tuner.daemon.server import Daemon, TuneSettings

pytestmark = pytest.mark.timeout(120)

NOTICE = 'no calibrated model of this node and [tune] backend is "model"; set [tune] backend = "local" to measure'


class Node:
    """A daemon in this process on `tmp`'s database whose re-tune is impossible under backend "model" until `fixed`
    (`moetune profile` ran), and else held open until `release`."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.facts = F.FakeFacts({"gpu_model": "H200"})
        self.release = threading.Event()
        self.fixed = False
        F.seed_profiles(F.open_store(tmp / "moetune.db"), self.facts)

    def retune(self, ctx: Any) -> list[ProfileRecord]:
        if ctx.tune.backend == "model" and not self.fixed:
            raise RetuneImpossible(NOTICE)
        deadline = time.monotonic() + 30
        while not self.release.is_set() and time.monotonic() < deadline:
            ctx.check_cancel()
            time.sleep(0.02)
        return []

    def start(self, backend: str) -> Daemon:
        return Daemon(store=F.open_store(self.tmp / "moetune.db"), endpoint=f"ipc://{self.tmp}/run/daemon.sock",
                      discover=lambda: self.facts, rediscover_interval_s=0.05, retune_job=self.retune,
                      tune=TuneSettings(backend=backend, trials=1, run_on_busy_gpus=True)).start(background=True)


def _notice_under_model(node: Node) -> None:
    d = node.start("model")
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        node.facts = F.FakeFacts({"gpu_model": "H200", "port": "down"})  # a fabric change: the re-tune is refused
        assert F.until(lambda: c.status().tune_notice) == NOTICE
    finally:
        c.close()
        d.stop()


def test_a_job_that_starts_clears_the_notice(tmp_path: Path) -> None:
    node = Node(tmp_path)
    _notice_under_model(node)
    d = node.start("model")  # the same settings: the notice still holds after the restart
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        assert c.status().tune_notice == NOTICE
        node.fixed = True  # the operator ran `moetune profile`, then `moetune retune`
        job = c.retune(all=True, reason="operator").job
        assert job is not None
        st = F.until(lambda: (s := c.status()).jobs.running and s)
        assert st.jobs.running.id == job.id and st.tune_notice == "", st
        node.release.set()
        assert F.until(lambda: any(j.id == job.id and j.state == "done" for j in c.status().jobs.recent))
        assert c.status().tune_notice == ""
    finally:
        node.release.set()
        c.close()
        d.stop()


def test_a_restart_under_another_backend_drops_the_notice(tmp_path: Path) -> None:
    node = Node(tmp_path)
    _notice_under_model(node)
    d = node.start("local")
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        assert c.status().tune_notice == ""
    finally:
        c.close()
        d.stop()


def test_a_restart_after_a_job_that_started_shows_no_old_notice(tmp_path: Path) -> None:
    """As a running daemon (cleared when the job started): a job that started after the notice, and failed
    otherwise, leaves none for the next daemon either; an event of an older moetune (no backend) keeps it."""
    from moetune.tuner.daemon.recovery import tune_notice_of

    store = F.open_store(tmp_path / "m.db")
    store.add_event(kind="job_started", reason="started job 1", details={"job_id": 1, "state": "running"})
    store.add_event(kind="job_finished", reason=NOTICE, details={"job_id": 1, "state": "failed", "impossible": True,
                                                                "message": NOTICE})
    assert tune_notice_of(store, backend="local") == NOTICE
    store.add_event(kind="job_started", reason="started job 2", details={"job_id": 2, "state": "running"})
    store.add_event(kind="job_finished", reason="boom", details={"job_id": 2, "state": "failed", "message": "boom"})
    assert tune_notice_of(store, backend="local") == ""


def test_a_notice_survives_thousands_of_cancelled_jobs_after_it(tmp_path: Path) -> None:
    """Cancelled queued re-tunes end in job_finished events (state cancelled) that decide nothing: read back page by
    page, the notice behind 1,200 of them is still found (a window of the newest 2,000 job events lost it)."""
    from moetune.tuner.daemon.recovery import tune_notice_of

    store = F.open_store(tmp_path / "m.db")
    store.add_event(kind="job_finished", reason=NOTICE, details={"job_id": 1, "state": "failed", "impossible": True,
                                                                "message": NOTICE, "backend": "local"})
    for j in range(2, 2102):
        store.add_event(kind="job_finished", reason="cancelled", details={"job_id": j, "state": "cancelled"})
    assert tune_notice_of(store, backend="local") == NOTICE
    assert tune_notice_of(store, backend="local", page=7) == NOTICE  # across page boundaries
    store.add_event(kind="job_started", reason="started job 2102", details={"job_id": 2102, "state": "running"})
    assert tune_notice_of(store, backend="local", page=7) == ""
