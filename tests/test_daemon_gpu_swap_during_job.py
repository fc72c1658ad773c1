"""A GPU replaced by one of the same model while a re-tune job runs (same fingerprint, another identity): what the job
stores from then on was measured (or predicted) for the GPUs it started on, so it is made stale and its keys queued
again, as for a job whose fingerprint moved on. Compared by fingerprint alone, the job's rows stayed current and were
served as this node's profiles for GPUs they were never measured on (and the change's re-tune left those keys out:
it re-tunes only keys with no current profile)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import ProfileKey
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


def test_a_jobs_profiles_written_across_a_gpu_swap_are_not_left_current(tmp_path: Path) -> None:
    x, y = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H200"})
    x.identity_hash, y.identity_hash = "gpus-X", "gpus-Y"
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, x)
    now = [x]
    go, started = threading.Event(), threading.Event()
    ran: list[list[int]] = []

    def job(ctx: Any) -> list[Any]:
        ran.append(sorted(k.token_bucket for k in ctx.keys))
        if len(ran) > 1:
            return []
        started.set()
        go.wait(20)
        key = ProfileKey(**{**seeded[0].key.to_dict(), "token_bucket": 8192})  # a key with no profile yet
        rec = F.make_record(key)
        assert ctx.store.put_profile(rec)[0]
        return [rec]

    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=lambda: now[0], rediscover_interval_s=0,
               retune_job=job).start(background=True)
    try:
        d.jobs.submit(reason="operator", old_fingerprint=x.fingerprint, keys=[seeded[0].key])
        assert started.wait(15)
        now[0] = y  # the GPUs replaced while the job runs
        d.rediscover()
        go.set()
        deadline = time.monotonic() + 15
        while (d.jobs.running is not None or d.jobs.queued_count() or len(ran) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        current = [r for _, r in store.list_profiles(status="current", fingerprint=x.fingerprint)]
        assert not [r for r in current if r.key.token_bucket == 8192], current  # measured for gpus-X
        assert [r for r in d.index.records if r.key.token_bucket == 8192] == []
        assert any(8192 in keys or 64 in keys for keys in ran[1:]), ran  # its keys re-tuned on the new GPUs
    finally:
        d.stop()
