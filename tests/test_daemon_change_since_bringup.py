"""A fabric change between `moetune profile` (or a local tune) and the daemon's first start went unnoticed: the start
compared the node with daemon-written fabric events only, and `profile` writes none, so the daemon recorded a
"first discovery" and served the old fabric's profiles as current. With no daemon event, the start now compares with
the newest fingerprint THIS node recorded as its own (origin 'local', this node's id: migration 0010), and a mismatch
is a fabric change (profiles stale, re-tune queued). Another node's facts in the store (imported, a capture's,
another node's local row in a shared database, rows from before origins were recorded) are never that base: comparing
with them marked that node's profiles stale (1df8ccb, reverted)."""

from __future__ import annotations

import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon.server import Daemon
from moetune.tuner.fabric.discovery import discover

pytestmark = pytest.mark.timeout(60)

CAPTURES = Path(__file__).parent / "captures"


def _profiled(tmp_path: Path, capture: str) -> tuple[Any, Any, list[Any]]:
    """A store as `moetune profile` on `capture` leaves it: the fingerprint with its facts, profiles on it, no event."""
    old = discover(CAPTURES / capture)
    store = F.open_store(tmp_path / "moetune.db")
    store.upsert_fingerprint(old.fingerprint, old.to_dict(), origin="local")
    return store, old, F.seed_profiles(store, old)


def _kinds(store: Any) -> list[str]:
    return [e["kind"] for e in store.list_events(limit=50, kinds=("fabric_seen", "fabric_changed"))]


def test_a_change_since_the_bringup_is_a_change_at_the_first_start(tmp_path: Path) -> None:
    store, old, seeded = _profiled(tmp_path, "h200x1")
    new = discover(CAPTURES / "h200x2")
    assert new.fingerprint != old.fingerprint
    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
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
    d, ran, done = F.start_recording_daemon(store, tmp_path, discover(CAPTURES / "h200x2"))
    try:
        assert not done.wait(1.0), f"re-tuned at start: {ran}"
        assert len(store.list_profiles(status="current", fingerprint=old.fingerprint)) == len(seeded)
        assert _kinds(store) == ["fabric_seen"]
    finally:
        d.stop()


def test_unreadable_stored_facts_are_no_base(tmp_path: Path) -> None:
    """Facts that do not decode (stored by hand, an older import) are passed over: a first discovery, no crash."""
    store = F.open_store(tmp_path / "moetune.db")
    store.upsert_fingerprint("fp-bad", {"gpus": "string"}, origin="local")
    new = discover(CAPTURES / "h200x2")
    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        assert not done.wait(1.0), f"re-tuned at start: {ran}"
        assert _kinds(store) == ["fabric_seen"] and d.facts.fingerprint == new.fingerprint
    finally:
        d.stop()


class _FailsFirst:
    """Discovery that fails at start (a transient nvidia-smi error), then reads `facts`."""

    def __init__(self, facts: Any) -> None:
        self.facts, self.calls = facts, 0

    def __call__(self) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("nvidia-smi: transient failure")
        return self.facts


def test_a_change_since_the_bringup_is_a_change_in_the_first_round_after_a_failed_start(tmp_path: Path) -> None:
    store, old, seeded = _profiled(tmp_path, "h200x1")
    new = discover(CAPTURES / "h200x2")
    ran: list[list[Any]] = []
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=_FailsFirst(new),
               rediscover_interval_s=0.2, retune_job=lambda ctx: ran.append(list(ctx.keys)) or []).start(background=True)
    try:
        F.until(lambda: ran, timeout=10)
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
        assert len(store.list_profiles(status="stale", fingerprint=old.fingerprint)) == len(seeded)
        assert _kinds(store) == ["fabric_changed"] and d.facts.fingerprint == new.fingerprint
    finally:
        d.stop()


def _other_node_export(tmp_path: Path, capture: str) -> tuple[Path, Any, list[Any]]:
    """A profiles file exported on another node (`capture`'s facts, recorded there as that node's own)."""
    facts = discover(CAPTURES / capture)
    src = F.open_store(tmp_path / "other.db")
    src.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local", node="the-other-node")
    seeded = F.seed_profiles(src, facts)
    out = tmp_path / "other.json"
    src.export_profiles(out)
    src.close()
    return out, facts, seeded


def _no_change_at_start(store: Any, tmp_path: Path, node: Any, other_fp: str, n_other: int, **kw: Any) -> Daemon:
    d, ran, done = F.start_recording_daemon(store, tmp_path, node, **kw)
    try:
        assert not done.wait(1.0), f"re-tuned at start: {ran}"
        assert _kinds(store) == ["fabric_seen"] and d.facts.fingerprint == node.fingerprint
        assert len(store.list_profiles(status="current", fingerprint=other_fp)) == n_other  # that node's: untouched
        assert not store.list_profiles(status="stale")
    finally:
        d.stop()
    return d


def test_another_nodes_imported_facts_newer_than_the_bringup_are_no_change(tmp_path: Path) -> None:
    store, mine, seeded = _profiled(tmp_path, "h200x2")
    time.sleep(0.01)  # the other node's facts are the store's newest
    path, other, theirs = _other_node_export(tmp_path, "h200x1")
    store.import_profiles(path)
    assert store.list_fingerprints()[0]["hash"] == other.fingerprint  # what 1df8ccb took for this node's
    _no_change_at_start(store, tmp_path, discover(CAPTURES / "h200x2"), other.fingerprint, len(theirs))
    assert len(store.list_profiles(status="current", fingerprint=mine.fingerprint)) == len(seeded)


def test_a_captures_facts_newer_than_the_bringup_are_no_change(tmp_path: Path) -> None:
    """`fabric show --record --capture` of another node after this node's bring-up."""
    store, _mine, _seeded = _profiled(tmp_path, "h200x2")
    time.sleep(0.01)
    cap = discover(CAPTURES / "h200x1")
    store.upsert_fingerprint(cap.fingerprint, cap.to_dict(), origin="capture")
    theirs = F.seed_profiles(store, cap)
    _no_change_at_start(store, tmp_path, discover(CAPTURES / "h200x2"), cap.fingerprint, len(theirs))


def test_only_other_nodes_facts_is_a_first_discovery(tmp_path: Path) -> None:
    """No bring-up here: an import (and a row from before origins were recorded, origin NULL) is no base."""
    store = F.open_store(tmp_path / "moetune.db")
    path, other, theirs = _other_node_export(tmp_path, "h200x1")
    store.import_profiles(path)
    legacy = discover(CAPTURES / "dgx-h100")
    store.upsert_fingerprint(legacy.fingerprint, legacy.to_dict(), origin="local")
    con = sqlite3.connect(tmp_path / "moetune.db")
    con.execute("UPDATE fingerprints SET origin = NULL, node = NULL WHERE hash = ?", (legacy.fingerprint,))
    con.commit()
    con.close()
    _no_change_at_start(store, tmp_path, discover(CAPTURES / "h200x2"), other.fingerprint, len(theirs))


def test_another_nodes_bringup_in_a_shared_database_is_no_change(tmp_path: Path) -> None:
    store, _mine, _seeded = _profiled(tmp_path, "h200x2")
    time.sleep(0.01)
    theirs = discover(CAPTURES / "h200x1")
    store.upsert_fingerprint(theirs.fingerprint, theirs.to_dict(), origin="local", node="the-other-node")
    recs = F.seed_profiles(store, theirs)
    _no_change_at_start(store, tmp_path, discover(CAPTURES / "h200x2"), theirs.fingerprint, len(recs))


def test_a_daemon_serving_a_capture_does_not_compare_it_with_this_nodes_bringup(tmp_path: Path) -> None:
    """`moetune serve --capture DIR`: what it discovers is the capture's node; recorded as a capture's."""
    store, mine, seeded = _profiled(tmp_path, "h200x1")
    cap = discover(CAPTURES / "h200x2")
    _no_change_at_start(store, tmp_path, cap, mine.fingerprint, len(seeded), fabric_origin="capture")
    row = store.get_fingerprint(cap.fingerprint)
    assert (row["origin"], row["node"]) == ("capture", None)
    assert [r["hash"] for r in store.local_fingerprints()] == [mine.fingerprint]
