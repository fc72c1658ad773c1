"""The request counters are bumped by the serving loop and by the list and retune workers (for the requests they
answer): `observe` read-modified-wrote dict entries without a lock, so concurrent requests lost counts."""

from __future__ import annotations

import sys
import threading

import pytest

from moetune.tuner.daemon.metrics import DaemonMetrics

pytestmark = pytest.mark.timeout(60)


def test_observe_from_three_threads_loses_no_count() -> None:
    m = DaemonMetrics()
    per_thread, threads = 100000, 3
    start = threading.Barrier(threads)

    def bump() -> None:
        start.wait()
        for _ in range(per_thread):
            m.observe("list_profiles", "ok", 1e-4)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: a lost update shows within a few thousand calls
    try:
        ts = [threading.Thread(target=bump) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert m.requests[("list_profiles", "ok")] == per_thread * threads == m.total_requests()
    assert sum(m._hist["list_profiles"]) == per_thread * threads
    assert m._hist_sum["list_profiles"] == pytest.approx(per_thread * threads * 1e-4)
