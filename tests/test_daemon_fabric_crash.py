"""A daemon killed during a fabric change, after fabric_changed (and mark_stale) were written but before the
re-tune job was queued: the next daemon queues that re-tune (job recovery reads job events only, so it was lost
for good and the profiles stayed stale). A change whose re-tune was queued is not queued twice."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("stopped_after", ["fabric_changed", "mark_stale", "job_queued"])
def test_the_retune_of_a_change_the_last_daemon_did_not_queue_is_queued_at_start(tmp_path: Path,
                                                                                  stopped_after: str) -> None:
    old, new = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, old)
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": old.fingerprint, "identity": None, "facts": old.to_dict()})
    # what _fabric_changed had written when the daemon was killed
    store.upsert_fingerprint(new.fingerprint, new.to_dict())
    store.add_event(kind="fabric_changed", reason="gpu_model: H200 -> H100",
                    details={"old_fingerprint": old.fingerprint, "fingerprint": new.fingerprint, "identity": None,
                             "reasons": ["gpu_model: H200 -> H100"], "facts": new.to_dict()})
    if stopped_after != "fabric_changed":
        store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    if stopped_after == "job_queued":  # its job was queued (and cancelled, say): nothing more to queue
        store.add_event(kind="job_queued", reason="fabric changed",
                        details={"job_id": 1, "keys": [r.key.to_dict() for r in seeded]})
        store.add_event(kind="job_finished", reason="cancelled", details={"job_id": 1, "state": "cancelled"})

    ran: list[list[Any]] = []
    done = threading.Event()

    def retune(ctx: Any) -> list[Any]:
        ran.append(list(ctx.keys))
        done.set()
        return []

    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=lambda: new, rediscover_interval_s=0,
               retune_job=retune).start(background=True)
    try:
        if stopped_after == "job_queued":
            assert not done.wait(1.0) and not d.jobs.info()[0]
            return
        assert done.wait(10), "no re-tune queued for the change"
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
        assert all(k.fingerprint == old.fingerprint for k in ran[0])
        assert d.index.current_count == 0 and len(d.index.stale) == len(seeded)  # the old ones stale, not served
    finally:
        d.stop()
