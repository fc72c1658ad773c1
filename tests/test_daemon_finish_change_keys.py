"""A change the daemon's start finishes (recorded, never queued: by a CLI writer while no daemon ran, or by a daemon
killed before queuing its re-tune) queues the keys the daemon queues when it finds the change itself: the old
fingerprint's rows the change made stale AND the new fingerprint's older stale keys nothing current replaced (a
fabric back to one it had, on other GPUs: its profiles stay stale). The start's finish queued only the former, so
the fabric it came back to was served nothing for those keys, for good."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_daemon_fabric_crash import _fabrics, _recording_daemon, _seeded_daemon, _wait

from moetune.tuner.fabric.change import record_node_facts, write_change

pytestmark = pytest.mark.timeout(60)



def _a_then_b(tmp_path: Path) -> tuple[Any, Any, Any, list[Any]]:
    """A daemon on A (GPUs X) saw A → B, re-tuned A's keys for B (storing nothing), and stopped."""
    a, b = _fabrics()
    store, seeded, now, d, ran = _seeded_daemon(tmp_path, a)
    try:
        now[0] = b
        d.rediscover()
        _wait(lambda: ran)
        assert len(ran) == 1
    finally:
        d.stop()
    assert store.list_profiles(status="current", fingerprint=a.fingerprint) == []
    return store, a, b, seeded


@pytest.mark.parametrize("recorded_by", ["cli", "killed daemon"])
def test_the_start_finishing_a_change_back_on_other_gpus_retunes_what_the_daemon_would(
        tmp_path: Path, recorded_by: str) -> None:
    store, a, b, seeded = _a_then_b(tmp_path)
    a_on_y, _ = _fabrics("gpus-Y")  # A back, on other GPUs: A's profiles (measured on X) stay stale
    if recorded_by == "cli":
        res = record_node_facts(store, a_on_y, by="fabric show --record")
        assert res.changed and res.restored == 0
    else:  # what a daemon killed after its change's transaction, before queuing the re-tune, left
        write_change(store, a_on_y, old_fp=b.fingerprint, reasons=["gpu_model: H100 -> H200"], ids=[])
    assert store.list_profiles(status="current", fingerprint=a.fingerprint) == []
    d, ran = _recording_daemon(store, tmp_path, [a_on_y])  # the start on A(Y): no change of its own to find
    try:
        _wait(lambda: ran)
        assert ran, "the start queued no re-tune of A's keys"
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
    finally:
        d.stop()
    assert len(store.list_events(limit=20, kinds=("fabric_changed",))) == 2  # the start recorded no change


def test_the_daemon_finding_the_same_change_itself_retunes_those_keys(tmp_path: Path) -> None:
    """The reference: the daemon's own B → A(Y) queues A's keys (`_fabric_changed`)."""
    store, _a, b, seeded = _a_then_b(tmp_path)
    a_on_y, _ = _fabrics("gpus-Y")
    now = [b]
    d, ran = _recording_daemon(store, tmp_path, now)
    try:
        now[0] = a_on_y
        d.rediscover()
        _wait(lambda: ran)
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
    finally:
        d.stop()


def test_a_finished_change_whose_keys_were_queued_is_not_retuned_again(tmp_path: Path) -> None:
    """The start's re-tune of those keys is queued once: a later start finds them held by its job."""
    store, _a, _b, _seeded = _a_then_b(tmp_path)
    a_on_y, _ = _fabrics("gpus-Y")
    record_node_facts(store, a_on_y, by="fabric show --record")
    d, ran = _recording_daemon(store, tmp_path, [a_on_y])
    try:
        _wait(lambda: ran)
        assert len(ran) == 1
    finally:
        d.stop()
    d, ran = _recording_daemon(store, tmp_path, [a_on_y])
    try:
        time.sleep(1.0)
        assert ran == [], ran
    finally:
        d.stop()


def test_the_start_does_not_finish_another_nodes_change_in_a_shared_database(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Identical nodes sharing one database: the newest fabric_changed may be the other node's (B -> A on its own GPUs,
    never queued there). The start's finish of an unqueued change read the newest fabric event whatever node wrote it
    and re-tuned that change's keys on this node, whose own fabric did not change; it now reads this node's events
    only (`node_fabric_events`)."""
    a, b = _fabrics()
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, a)
    F.seed_profiles(store, b, buckets=(128,))  # a key A has no profile of: the finish would queue it
    d, ran = _recording_daemon(store, tmp_path, [a])  # this node's first start on A: its fabric_seen
    d.stop()
    assert not ran
    here = store.node
    monkeypatch.setattr(type(store), "node", property(lambda self: "the-other-node"))
    ids = [i for i, _ in store.list_profiles(status="current", fingerprint=b.fingerprint)]
    write_change(store, a, old_fp=b.fingerprint, reasons=["the other node: B -> A"], ids=ids)
    monkeypatch.setattr(type(store), "node", property(lambda self: here))
    d, ran = _recording_daemon(store, tmp_path, [a])  # this node's start, on the A it had
    try:
        time.sleep(1.0)
    finally:
        d.stop()
    assert not ran, "this node re-tuned the other node's change"
