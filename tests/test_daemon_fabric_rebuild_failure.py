"""A fabric change whose index rebuild fails (the store's read of the profiles: StoreBusy after its wait) is retried
by the next discovery round, as a failed write is (test_daemon_fabric_write_failure). Adopted before the rebuild, the
round after the failure saw the new facts as known and did nothing: the index went on serving the old fingerprint's
profiles as current (marked stale in the store), nothing was published and no re-tune queued, until a restart."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon.server import Daemon
from moetune.tuner.store.store import StoreBusy

pytestmark = pytest.mark.timeout(60)


def _index_read_busy_once(store: Any) -> list[int]:
    """The store's next read of every profile (the index's rebuild) fails StoreBusy, once; the list returned gets an
    item when it has."""
    real = store.list_profiles
    failed: list[int] = []

    def once_busy(**kw: Any) -> Any:
        if not failed and kw.get("fingerprint") is None:  # the index's read of every profile
            failed.append(1)
            raise StoreBusy("the database was locked by another process for 30 s (simulated)")
        return real(**kw)

    store.list_profiles = once_busy
    return failed


def test_a_fabric_change_whose_index_rebuild_failed_is_retried_by_the_next_round(tmp_path: Path) -> None:
    a, b = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store, seeded, now, ran, d = F.fabric_daemon(tmp_path, a)
    try:
        assert d.index.fingerprint == a.fingerprint
        published: list[str] = []
        rebuild = d._rebuild

        def recording_rebuild(changes: list[dict[str, Any]] | None = None) -> None:
            rebuild(changes)
            published.extend(c["kind"] for c in changes or [])

        d._rebuild = recording_rebuild  # type: ignore[method-assign]
        failed = _index_read_busy_once(store)
        now[0] = b
        with pytest.raises(StoreBusy):
            d.rediscover()  # what the discovery loop logs as "discovery round failed"
        assert failed == [1]
        assert published == []

        d.rediscover()  # retries the change's rebuild, notices and re-tune
        assert d.facts.fingerprint == b.fingerprint
        assert d.index.fingerprint == b.fingerprint
        assert not [r for r in d.index.records if r.key.fingerprint == a.fingerprint]  # a's are stale, not served
        assert len(store.list_events(limit=20, kinds=("fabric_changed",))) == 1
        assert published.count("fabric_changed") == 1 and published.count("profile_stale") == 1, published
        assert d.metrics.fabric_changes == 1
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ran and sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
    finally:
        d.stop()


def test_a_first_discovery_whose_index_rebuild_failed_is_retried_by_the_next_round(tmp_path: Path) -> None:
    a = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, a)
    now: list[Any] = [None]

    def discover() -> Any:
        if now[0] is None:
            raise RuntimeError("nvidia-smi failed (simulated)")
        return now[0]

    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=discover, rediscover_interval_s=0,
               retune_job=lambda ctx: []).start(background=True)
    try:
        assert d.facts is None and d.index.fingerprint is None  # the start-up discovery failed
        failed = _index_read_busy_once(store)
        now[0] = a
        with pytest.raises(StoreBusy):
            d.rediscover()
        assert failed == [1]

        d.rediscover()  # retried: the index has the facts and serves this node's profiles
        assert d.facts is not None and d.facts.fingerprint == a.fingerprint
        assert d.index.fingerprint == a.fingerprint
        assert len(store.list_events(limit=20, kinds=("fabric_seen",))) == 1
    finally:
        d.stop()


def test_the_running_job_is_cancelled_by_the_round_that_gets_the_change_through(tmp_path: Path) -> None:
    a, b = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, a)
    now = [a]
    started = __import__("threading").Event()

    def job(ctx: Any) -> list[Any]:
        if not started.is_set():
            started.set()
            deadline = time.monotonic() + 20
            while not ctx.job.cancel.is_set() and time.monotonic() < deadline:
                time.sleep(0.02)
        return []

    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=lambda: now[0], rediscover_interval_s=0,
               retune_job=job).start(background=True)
    try:
        running = d.jobs.submit(reason="operator", old_fingerprint=a.fingerprint, keys=[seeded[0].key])
        assert running is not None and started.wait(15)
        _index_read_busy_once(store)
        now[0] = b
        with pytest.raises(StoreBusy):
            d.rediscover()
        # not cancelled yet: ended under the old facts (put back), it would count as unmoved and its keys not queued
        assert not running.cancel.is_set()
        d.rediscover()
        # the worker sets the state before it writes the job's end (the fabric check appends to the message then):
        # waited for until the message says the change, not only until the state leaves running
        said = f"the fabric changed to {b.fingerprint}"
        deadline = time.monotonic() + 15
        while said not in running.message and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running.state == "cancelled" and said in running.message, running.message
    finally:
        d.stop()
