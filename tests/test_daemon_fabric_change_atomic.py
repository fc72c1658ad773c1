"""The daemon's fabric change is written in one transaction (`fabric.change.write_change`, the core
`record_node_facts` uses too): the new facts, the fabric_changed event, the old fingerprint's profiles made stale and
a fabric back on the same GPUs restored, all or none. It wrote them in separate steps: a daemon killed (or a write
failing) between them left a part, which the next start misread (after the event and the marks, before the restore:
the start found the recorded fabric unchanged and re-tuned for hours the keys whose measured profiles it should have
made current again)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_daemon_fabric_crash import _fabrics, _recording_daemon, _seeded_daemon, _wait

pytestmark = pytest.mark.timeout(60)


def _changes(store: Any) -> list[Any]:
    return store.list_events(limit=20, kinds=("fabric_changed",))



def test_a_failure_after_the_first_writes_of_a_change_leaves_nothing_of_it(tmp_path: Path) -> None:
    a, b = _fabrics()
    store, seeded, now, d, ran = _seeded_daemon(tmp_path, a)
    try:
        real = store.mark_stale

        def killed(**kw: Any) -> int:  # the facts and the event are written: the daemon dies here
            raise KeyboardInterrupt

        store.mark_stale = killed  # type: ignore[method-assign]
        now[0] = b
        with pytest.raises(KeyboardInterrupt):
            d.rediscover()
        store.mark_stale = real  # type: ignore[method-assign]
        assert _changes(store) == []
        assert store.get_fingerprint(b.fingerprint) is None  # B's facts are no base a next start compares with
        assert len(store.list_profiles(status="current", fingerprint=a.fingerprint)) == len(seeded)
        assert d.facts.fingerprint == a.fingerprint
        d.rediscover()  # the next round records it whole
        assert len(_changes(store)) == 1 and not store.list_profiles(status="current", fingerprint=a.fingerprint)
        _wait(lambda: ran)
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
    finally:
        d.stop()


def test_a_daemon_killed_between_the_marks_and_the_restore_of_a_fabric_back_loses_nothing(tmp_path: Path) -> None:
    """A → B → A on the same GPUs, the daemon killed in B → A after marking B's profiles stale, before making A's
    current again: the next start (on A) finds the change still to do and restores A's profiles, re-tuning none."""
    a, b = _fabrics()
    store, seeded, now, d, ran = _seeded_daemon(tmp_path, a)
    try:
        now[0] = b
        d.rediscover()  # A → B: A's profiles stale, their re-tune (for B) stores nothing
        _wait(lambda: ran)
        assert len(ran) == 1
        on_b = F.seed_profiles(store, b, buckets=(64,))  # one measured on B since
        real = store.restore_stale

        def killed(**kw: Any) -> int:
            raise KeyboardInterrupt

        store.restore_stale = killed  # type: ignore[method-assign]
        now[0] = a
        with pytest.raises(KeyboardInterrupt):
            d.rediscover()  # B → A, killed before the restore
        store.restore_stale = real  # type: ignore[method-assign]
    finally:
        d.stop()
    assert len(_changes(store)) == 1  # nothing of B → A is recorded
    assert [r.profile_hash for _, r in store.list_profiles(status="current", fingerprint=b.fingerprint)] == \
        [on_b[0].profile_hash]
    assert store.list_profiles(status="current", fingerprint=a.fingerprint) == []
    d2, ran2 = _recording_daemon(store, tmp_path, [a])  # the next start, on A
    try:
        assert d2.facts.fingerprint == a.fingerprint
        cur = store.list_profiles(status="current", fingerprint=a.fingerprint)
        assert {r.profile_hash for _, r in cur} == {r.profile_hash for r in seeded}  # measured here: current again
        assert store.list_profiles(status="current", fingerprint=b.fingerprint) == []
        assert len(_changes(store)) == 2
        time.sleep(0.5)
        assert ran2 == [], ran2  # nothing of A re-tuned
    finally:
        d2.stop()
