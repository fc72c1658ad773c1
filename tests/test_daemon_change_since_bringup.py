"""A fabric change between `moetune profile` (or a local tune) and the daemon's first start went unnoticed: the start
compared the node with daemon-written fabric events only, and `profile` writes none, so the daemon recorded a
"first discovery" and served the old fabric's profiles as current. With no daemon event, the start now compares with
the newest fingerprint the store holds facts of, and a mismatch is a fabric change (profiles stale, re-tune queued)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon.server import Daemon
from moetune.tuner.fabric.discovery import discover

pytestmark = pytest.mark.timeout(60)

CAPTURES = Path(__file__).parent / "captures"


def _start(store: Any, tmp_path: Path, facts: Any) -> tuple[Daemon, list[list[Any]], threading.Event]:
    ran: list[list[Any]] = []
    done = threading.Event()

    def retune(ctx: Any) -> list[Any]:
        ran.append(list(ctx.keys))
        done.set()
        return []

    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=lambda: facts, rediscover_interval_s=0,
               retune_job=retune).start(background=True)
    return d, ran, done


def _profiled(tmp_path: Path, capture: str) -> tuple[Any, Any, list[Any]]:
    """A store as `moetune profile` on `capture` leaves it: the fingerprint with its facts, profiles on it, no event."""
    old = discover(CAPTURES / capture)
    store = F.open_store(tmp_path / "moetune.db")
    store.upsert_fingerprint(old.fingerprint, old.to_dict())
    return store, old, F.seed_profiles(store, old)


def _kinds(store: Any) -> list[str]:
    return [e["kind"] for e in store.list_events(limit=50, kinds=("fabric_seen", "fabric_changed"))]


def test_a_change_since_the_bringup_is_a_change_at_the_first_start(tmp_path: Path) -> None:
    store, old, seeded = _profiled(tmp_path, "h200x1")
    new = discover(CAPTURES / "h200x2")
    assert new.fingerprint != old.fingerprint
    d, ran, done = _start(store, tmp_path, new)
    try:
        assert done.wait(10), "no re-tune queued for the change since the bring-up"
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
        assert not store.list_profiles(status="current", fingerprint=old.fingerprint)
        assert len(store.list_profiles(status="stale", fingerprint=old.fingerprint)) == len(seeded)
        assert _kinds(store) == ["fabric_changed"]
        ev = store.list_events(limit=5, kinds=("fabric_changed",))[0]
        assert ev["details"]["old_fingerprint"] == old.fingerprint and ev["details"]["fingerprint"] == new.fingerprint
        assert d.facts.fingerprint == new.fingerprint
    finally:
        d.stop()


def test_the_same_fabric_as_the_bringup_is_a_first_discovery(tmp_path: Path) -> None:
    store, old, seeded = _profiled(tmp_path, "h200x2")
    d, ran, done = _start(store, tmp_path, discover(CAPTURES / "h200x2"))
    try:
        assert not done.wait(1.0), f"re-tuned at start: {ran}"
        assert len(store.list_profiles(status="current", fingerprint=old.fingerprint)) == len(seeded)
        assert _kinds(store) == ["fabric_seen"]
    finally:
        d.stop()


def test_unreadable_stored_facts_are_no_base(tmp_path: Path) -> None:
    """Facts that do not decode (stored by hand, an older import) are passed over: a first discovery, no crash."""
    store = F.open_store(tmp_path / "moetune.db")
    store.upsert_fingerprint("fp-bad", {"gpus": "string"})
    new = discover(CAPTURES / "h200x2")
    d, ran, done = _start(store, tmp_path, new)
    try:
        assert not done.wait(1.0), f"re-tuned at start: {ran}"
        assert _kinds(store) == ["fabric_seen"] and d.facts.fingerprint == new.fingerprint
    finally:
        d.stop()
