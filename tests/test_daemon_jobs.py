"""The re-tune jobs as a cluster operator relies on them: a daemon stopped cleanly (SIGTERM, a restart) resumes
its running and queued jobs like after a kill -9; a cancelled job's profiles are counted and published; a job
whose fabric changed under it leaves nothing current for the old fingerprint and the keys are tuned for the
new one. Each failed before its fix."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(120)


class Node:
    """A daemon in this process on `tmp`'s database, whose fabric the test switches (`become`). `this_node`: its
    facts are this node's (GPUs, driver, this process's packages; `F.this_node_fake_facts`), so that a client here
    takes its measured profiles as tuned; else some other node's."""

    def __init__(self, tmp: Path, retune: Any = F.fake_retune, this_node: bool = False):
        self.tmp = tmp
        self.make = F.this_node_fake_facts if this_node else (lambda **d: F.FakeFacts(d))
        self.facts = self.make(gpu_model="H200")
        self.retune = retune
        F.seed_profiles(F.open_store(tmp / "moetune.db"), self.facts)

    def start(self) -> Daemon:
        return Daemon(store=F.open_store(self.tmp / "moetune.db"), endpoint=f"ipc://{self.tmp}/run/daemon.sock",
                      discover=lambda: self.facts, rediscover_interval_s=0.05, retune_job=self.retune).start(background=True)

    def become(self, **d: Any) -> F.FakeFacts:
        self.facts = self.make(gpu_model="H200", **d)
        return self.facts


def _hold(ctx: Any, release: threading.Event, timeout: float = 30.0) -> None:
    """Hold a job open (cancellable) until `release` is set."""
    deadline = time.monotonic() + timeout
    while not release.is_set() and time.monotonic() < deadline:
        ctx.check_cancel()
        time.sleep(0.02)


def _write(ctx: Any, key: ProfileKey) -> ProfileRecord | None:
    nk = ProfileKey(**{**key.to_dict(), "fingerprint": ctx.facts.fingerprint, "software": ctx.facts.software_hash})
    rec = F.make_record(nk, latency_us=8.0, num_sms=32)
    return rec if ctx.store.put_profile(rec)[0] else None


def test_clean_stop_resumes_the_running_and_the_queued_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(tmp_path)
    monkeypatch.setenv("MOETUNE_FAKE_JOB_SLEEP", "60")
    d = node.start()
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        new = node.become(port="down")
        running = F.until(lambda: (j := c.status().jobs.running) is not None and j.run_id is not None and j)
        queued = c.retune(all=True, reason="operator").job
        assert queued is not None and queued.state == "queued"
    finally:
        c.close()
        d.stop()  # what SIGTERM does (systemctl restart)
    monkeypatch.setenv("MOETUNE_FAKE_JOB_SLEEP", "0")
    d2 = node.start()
    c = ProfileClient(d2.endpoint, timeout_ms=2000)
    try:
        # both jobs are resumed (not recorded cancelled by the stop: nothing re-tuned, 3 profiles stale for good)
        def resumed() -> list:
            done = [j for j in c.status().jobs.recent if j.state == "done"]
            return len(done) == 2 and done
        done = F.until(resumed)
        assert {j.reason for j in done} == {f"resumed job {running.id} after a restart", f"resumed job {queued.id} after a restart"}
        assert sum(j.written for j in done) == 3
        prof = c.get_profile(ep_size=2, tokens=3000, model="qwen3-30b")
        assert prof.key.fingerprint == new.fingerprint and prof.status == "current"
    finally:
        c.close()
        d2.stop()
    finished = {e["details"]["job_id"]: e["details"] for e in F.open_store(tmp_path / "moetune.db").list_events(200)[::-1]
                if e["kind"] == "job_finished"}
    assert finished[running.id]["state"] == "failed" and "interrupted" in finished[running.id]["message"]
    assert finished[queued.id]["state"] == "cancelled" and "re-queued" in finished[queued.id]["message"]


def test_a_cancelled_job_publishes_the_profiles_it_wrote(tmp_path: Path) -> None:
    wrote = threading.Event()

    def retune(ctx: Any) -> list[ProfileRecord]:
        key = next(k for k in ctx.keys if k.token_bucket == 64)
        assert _write(ctx, key) is not None
        wrote.set()
        _hold(ctx, threading.Event())  # until cancelled
        raise AssertionError("never cancelled")

    node = Node(tmp_path, retune, this_node=True)  # the tracking client runs on the daemon's node
    d = node.start()
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        tracked = c.track(ep_size=2, tokens=64, model="qwen3-30b")
        new = node.become(port="down")
        running = F.until(lambda: c.status().jobs.running)
        assert wrote.wait(15)
        c.retune(cancel=running.id)
        job = F.until(lambda: next((j for j in c.status().jobs.recent if j.id == running.id), None))
        # status says what the job left behind (not written=0 although one profile became current)
        assert job.state == "cancelled" and job.written == 1 and "1 profile(s) written" in job.message

        # a client tracking that key is told (without profile_updated it would never ask again)
        def picked_up() -> bool:
            tracked.refresh(100)
            return tracked.current is not None and tracked.current.key.fingerprint == new.fingerprint
        F.until(picked_up)
    finally:
        c.close()
        d.stop()


def test_a_job_whose_fabric_changes_under_it_is_redone_for_the_new_one(tmp_path: Path) -> None:
    release = threading.Event()
    tuned_for: list[str] = []

    def retune(ctx: Any) -> list[ProfileRecord]:
        tuned_for.append(ctx.facts.fingerprint)
        if len(tuned_for) == 1:
            _hold(ctx, release)  # the first job is still tuning when the fabric changes again
        return [r for k in ctx.keys if (r := _write(ctx, k)) is not None]

    node = Node(tmp_path, retune)
    d = node.start()
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        second = node.become(port="down")
        F.until(lambda: (j := c.status().jobs.running) is not None and j.fingerprint == second.fingerprint)
        third = node.become(port="down", gpu="replaced")
        F.until(lambda: c.status().fingerprint == third.fingerprint)
        release.set()  # the first job must not now write 3 profiles for `second` and leave `third` unqueued

        def served() -> Any:
            try:
                return c.get_profile(ep_size=2, tokens=3000, model="qwen3-30b")
            except DaemonError:
                return None
        prof = F.until(served)
        assert prof.key.fingerprint == third.fingerprint
        F.until(lambda: c.status().jobs.running is None and not c.status().jobs.queued)
        assert c.status().profiles_current == 3
    finally:
        c.close()
        d.stop()
    store = F.open_store(tmp_path / "moetune.db")
    assert store.list_profiles(status="current", fingerprint=second.fingerprint) == []
    assert {r.key.fingerprint for _, r in store.list_profiles(status="current")} == {third.fingerprint}


def test_a_change_while_stopped_is_seen_after_many_events(tmp_path: Path) -> None:
    """The fabric a restarted daemon compares with is the last one recorded, however many events (a year of
    re-tune jobs) came after it (a search of the newest 500 events only would, past them, take a new fabric for
    the first one, leave the old profiles current and queue no re-tune)."""
    node = Node(tmp_path)
    node.start().stop()  # records the fabric it discovered
    store = F.open_store(tmp_path / "moetune.db")
    for i in range(600):
        store.add_event(kind="job_finished", reason="an old job", details={"job_id": 1000 + i, "state": "done"})
    new = node.become(port="down")  # changed while no daemon ran
    d = node.start()
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        st = c.status()
        assert st.fingerprint == new.fingerprint and st.profiles_stale == 3
        assert F.until(lambda: c.status().jobs.recent or c.status().jobs.running or c.status().jobs.queued)
    finally:
        c.close()
        d.stop()
    assert [e["kind"] for e in store.list_events(700)].count("fabric_seen") == 1


def test_an_incomplete_discovery_is_not_counted_ok(tmp_path: Path) -> None:
    """moetune_discoveries{outcome} agrees with `status`: an nvidia-smi time-out, whose facts the daemon keeps out,
    is not counted `ok` while status says the discovery failed."""
    node = Node(tmp_path)
    d = node.start()
    try:
        F.until(lambda: d.metrics.discoveries.get("ok"))
        broken = node.become(gpus="unanswered")
        broken.complete, broken.warnings = False, ["nvidia-smi timed out"]
        F.until(lambda: d.metrics.discoveries.get("incomplete", 0) >= 3)
        ok = d.metrics.discoveries["ok"]
        F.until(lambda: d.metrics.discoveries["incomplete"] >= 6)
        assert d.metrics.discoveries["ok"] == ok
        assert not d._last_discovery[1] and "nvidia-smi timed out" in d._last_discovery[2]
    finally:
        d.stop()


def test_why_a_retune_cannot_run_survives_a_restart(tmp_path: Path) -> None:
    """`status` still says why the stale profiles are not re-tuned after the daemon restarts: a notice kept only in
    memory would leave the restarted daemon showing stale profiles and no reason, and queueing nothing."""
    from moetune.tuner.daemon.retune import RetuneImpossible

    def retune(ctx: Any) -> list[ProfileRecord]:
        raise RetuneImpossible("no calibrated model of this node: run `moetune profile`")

    node = Node(tmp_path, retune)
    d = node.start()
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        node.become(port="down")
        notice = F.until(lambda: c.status().tune_notice)
    finally:
        c.close()
        d.stop()
    d = node.start()
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        st = c.status()
        assert st.tune_notice == notice and st.profiles_stale == 3
    finally:
        c.close()
        d.stop()


def test_a_resumed_job_and_a_startup_fabric_change_tune_each_key_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A job cut short by a stop is resumed at the next start; if the fabric changed while no daemon ran, that start
    also queues a re-tune of the stale keys. Both cover the same keys, so the resumed jobs are queued first and the
    fabric change's re-tune (skip_queued, as every automatic one) leaves out the keys they hold: queued the other
    way round, each key would be tuned twice."""
    from moetune.tuner.daemon.retune import tuning_key

    node = Node(tmp_path)
    monkeypatch.setenv("MOETUNE_FAKE_JOB_SLEEP", "60")
    d = node.start()
    c = ProfileClient(d.endpoint, timeout_ms=2000)
    try:
        job = c.retune(all=True, reason="operator").job  # the 3 current keys, held open until the stop
        assert job is not None
        F.until(lambda: (j := c.status().jobs.running) is not None and j.id == job.id and j.run_id is not None)
    finally:
        c.close()
        d.stop()
    node.become(port="down")  # changed while stopped: the next start makes the 3 profiles stale and re-tunes them

    tuned: list[tuple] = []

    def retune(ctx: Any) -> list[ProfileRecord]:
        tuned.extend(tuning_key(k) for k in ctx.keys)
        return F.fake_retune(ctx)

    monkeypatch.setenv("MOETUNE_FAKE_JOB_SLEEP", "0")
    node.retune = retune
    d = node.start()
    try:
        def idle() -> bool:  # nothing queued or running, read together under the job manager's lock
            with d.jobs._lock:
                return d.jobs.running is None and not d.jobs._queued
        F.until(idle)
    finally:
        d.stop()
    assert len(tuned) == 3 and len(set(tuned)) == 3, tuned  # not 6, every key twice


def test_a_job_stopped_after_some_profiles_resumes_only_the_keys_it_had_not_tuned(tmp_path: Path) -> None:
    """A job stopped (kill -9, or a stop) after it wrote some of its profiles but before its job_finished event is
    resumed at the next start with only the keys it had not finished, not every key again. The profiles it wrote
    stay current; the one it had not reached is tuned once."""
    from moetune.tuner.daemon.retune import tuning_key

    wrote = threading.Event()
    first: list[tuple] = []

    def retune(ctx: Any) -> list[ProfileRecord]:  # tunes two of the three keys, then is stopped
        out = []
        for k in sorted(ctx.keys, key=lambda k: k.token_bucket)[:2]:
            first.append(tuning_key(k))
            r = _write(ctx, k)
            assert r is not None
            out.append(r)
        wrote.set()
        _hold(ctx, threading.Event())  # until the stop cancels it
        return out

    node = Node(tmp_path, retune)
    d = node.start()
    try:
        new = node.become(port="down")
        assert wrote.wait(15)
        with d.jobs._lock:
            assert d.jobs.running is not None
    finally:
        d.stop()  # the job stays `started` in the store, like after a kill -9
    store = F.open_store(tmp_path / "moetune.db")
    assert len(store.list_profiles(status="current", fingerprint=new.fingerprint)) == 2

    tuned: list[tuple] = []

    def again(ctx: Any) -> list[ProfileRecord]:
        tuned.extend(tuning_key(k) for k in ctx.keys)
        return [r for k in ctx.keys if (r := _write(ctx, k)) is not None]

    node.retune = again
    d = node.start()
    try:
        def idle() -> bool:
            with d.jobs._lock:
                return d.jobs.running is None and not d.jobs._queued and bool(d.jobs._recent)
        F.until(idle)
    finally:
        d.stop()
    assert len(tuned) == 1 and tuned[0] not in first, (tuned, first)  # not all 3 again
    current = store.list_profiles(status="current", fingerprint=new.fingerprint)
    assert sorted(r.key.token_bucket for _, r in current) == [64, 1024, 4096]
    finished = [e for e in store.list_events(200) if e["kind"] == "job_finished"]
    assert any("2 of 3 key(s) already tuned" in e["details"]["message"] for e in finished)


def test_a_job_stopped_after_all_its_profiles_is_not_resumed(tmp_path: Path) -> None:
    """All its keys written before the stop: nothing is re-tuned at the next start."""
    node = Node(tmp_path)
    d = node.start()
    try:
        new = node.become(port="down")
        F.until(lambda: len(F.open_store(tmp_path / "moetune.db").list_profiles(status="current",
                                                                                fingerprint=new.fingerprint)) == 3)
    finally:
        d.stop()
    # as if killed after the last profile, before job_finished: drop that event (the store keeps the rest)
    store = F.open_store(tmp_path / "moetune.db")
    import sqlalchemy as sa

    from moetune.tuner.store.models import Event

    with store._write() as s:
        last = s.scalars(sa.select(Event).where(Event.kind == "job_finished").order_by(Event.id.desc())).first()
        assert last is not None and last.details["state"] == "done"
        s.delete(last)

    tuned: list[ProfileKey] = []

    def again(ctx: Any) -> list[ProfileRecord]:
        tuned.extend(ctx.keys)
        return []

    node.retune = again
    d = node.start()
    try:
        with d.jobs._lock:
            # resumed nothing (no job of the 3 keys); a resumed job is queued by start() itself
            assert d.jobs.running is None and not d.jobs._queued and not d.jobs._recent
    finally:
        d.stop()
    assert tuned == []
    finished = [e for e in store.list_events(200) if e["kind"] == "job_finished"]
    assert "nothing left to resume" in finished[0]["reason"]
