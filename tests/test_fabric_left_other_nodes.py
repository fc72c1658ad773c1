"""When this node's fabric last left a fingerprint (`fabric_left`, which `restorable` reads for a fabric back on the
same GPUs) is read from this node's fabric events only. In a database shared by nodes, another node that later left
the same fingerprint (identical nodes share it) hid this node's own change: its GPUs and profiles were taken for
this node's, so a fabric back here restored nothing and its profiles were re-tuned instead."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.fabric.change import fabric_left, restorable


def _this_nodes(event: dict[str, Any], here: str) -> bool:
    """The rule in Python: an event is this node's where its details name no other node (one without `node`, from a
    moetune before it, counts as this node's)."""
    d = event["details"]
    return not (isinstance(d, dict) and d.get("node") not in (None, here))


def _left_a_serving_1_2(tmp_path: Path) -> tuple[Any, Any]:
    """A store where this node first saw fabric `a` (on GPUs "gpus-here") and then left it, serving profiles 1 and
    2 until then; (the store, a)."""
    store = F.open_store(tmp_path / "m.db")
    a, b = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    a.identity_hash = "gpus-here"
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": a.fingerprint, "identity": "gpus-here", "facts": a.to_dict(),
                             "node": store.node})
    store.add_event(kind="fabric_changed", reason="gpu model",
                    details={"old_fingerprint": a.fingerprint, "fingerprint": b.fingerprint, "identity": None,
                             "profiles": [1, 2], "node": store.node})
    return store, a


def test_another_nodes_later_change_does_not_hide_this_nodes_own(tmp_path: Path) -> None:
    store, a = _left_a_serving_1_2(tmp_path)
    here = store.node
    # an identical node on the same database leaves the same fingerprint afterwards
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": a.fingerprint, "identity": "gpus-there", "node": "other-node"})
    store.add_event(kind="fabric_changed", reason="port down",
                    details={"old_fingerprint": a.fingerprint, "fingerprint": "0" * 16, "identity": "gpus-there",
                             "profiles": [7], "node": "other-node"})
    left, was = fabric_left(store, a.fingerprint)
    assert left is not None and left["node"] == here and left["profiles"] == [1, 2]
    assert was == "gpus-here"
    assert restorable(store, a) == [1, 2]  # back here on the same GPUs: what this node served until it left


def test_this_nodes_change_is_found_behind_many_other_nodes_events(tmp_path: Path) -> None:
    """However many fabric events other nodes recorded since (a database shared by many nodes), this node's change
    is found: a window of the newest fabric events of every node lost it, and a fabric back restored nothing."""
    store, a = _left_a_serving_1_2(tmp_path)
    here = store.node
    with store.atomic():  # one transaction: thousands of commits would make the test slow
        for n in range(2100):
            store.add_event(kind="fabric_seen", reason="first discovery",
                            details={"fingerprint": f"{n:016x}", "identity": f"gpus-{n}", "node": f"node-{n}"})
    left, was = fabric_left(store, a.fingerprint)
    assert left is not None and left["node"] == here and left["profiles"] == [1, 2]
    assert was == "gpus-here"
    assert restorable(store, a) == [1, 2]


def test_the_change_is_found_behind_a_long_history_of_this_nodes_own(tmp_path: Path) -> None:
    """A node that moved between other fabrics many times since it left `fp` still finds that change (paged back
    through its own events, not a window of the newest)."""
    store = F.open_store(tmp_path / "m.db")
    here = store.node
    a = F.FakeFacts({"gpu_model": "H200"})
    a.identity_hash = "gpus-here"
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": a.fingerprint, "identity": "gpus-here", "node": here})
    store.add_event(kind="fabric_changed", reason="gpu model",
                    details={"old_fingerprint": a.fingerprint, "fingerprint": "1" * 16, "identity": "gpus-here",
                             "profiles": [3], "node": here})
    with store.atomic():
        for n in range(2100):  # back and forth between two other fabrics
            old, new = ("1" * 16, "2" * 16) if n % 2 == 0 else ("2" * 16, "1" * 16)
            store.add_event(kind="fabric_changed", reason="port flap",
                            details={"old_fingerprint": old, "fingerprint": new, "identity": "gpus-here",
                                     "profiles": [], "node": here})
    left, was = fabric_left(store, a.fingerprint)
    assert left is not None and left["profiles"] == [3]
    assert was == "gpus-here"


def test_the_stores_node_filter_is_the_rule_of_this_nodes(tmp_path: Path) -> None:
    """`list_events(node=...)` (SQL, which `fabric_left` and `node_fabric_events` read) keeps exactly the events whose
    details name no other node (`_this_nodes`, the rule in Python), details that are no object included."""
    import sqlite3

    store = F.open_store(tmp_path / "m.db")
    here = store.node
    for d in ({"node": here}, {"node": "other"}, {}, {"node": None}, {"node": 7}, {"node": ""}, {"node": [here]}):
        store.add_event(kind="fabric_seen", reason="r", details=d)
    con = sqlite3.connect(tmp_path / "m.db")
    try:
        first = con.execute("SELECT id FROM events WHERE kind = 'fabric_seen' ORDER BY id LIMIT 1").fetchone()[0]
        for n, raw in enumerate(("null", "[1, 2]", '"text"')):  # no object: what an older or hand-edited row may hold
            con.execute("INSERT INTO events (created, kind, reason, details) SELECT created, kind, ?, ? FROM events "
                        "WHERE id = ?", (f"raw {n}", raw, first))
        con.commit()
    finally:
        con.close()
    every = store.list_events(limit=100, kinds=("fabric_seen",))
    kept = {e["id"] for e in store.list_events(limit=100, kinds=("fabric_seen",), node=here)}
    assert kept == {e["id"] for e in every if _this_nodes(e, here)}
    assert len(kept) == 3 + 3


def test_node_fabric_events_finds_this_nodes_behind_any_number_of_other_nodes(tmp_path: Path,
                                                                                 monkeypatch: Any) -> None:
    """`node_fabric_events` (the daemon's recorded fabric: `last_fabric_event`) finds this node's events however many
    fabric events other nodes recorded since: it read back at most NODE_EVENTS_SCAN events of every node, and past
    that this node's last fabric read as never recorded (its next discovery no change). The scan cap is lowered here
    so that a few hundred events show it; filtered by node in SQL there is no cap to lower."""
    from moetune.tuner.fabric import change

    monkeypatch.setattr(change, "NODE_EVENTS_SCAN", 500, raising=False)
    store = F.open_store(tmp_path / "m.db")
    here = store.node
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": "a" * 16, "identity": "gpus-here", "node": here})
    with store.atomic():
        for n in range(600):
            store.add_event(kind="fabric_seen", reason="first discovery",
                            details={"fingerprint": f"{n:016x}", "identity": f"gpus-{n}", "node": f"node-{n}"})
    events = change.node_fabric_events(store)
    assert [e["details"]["fingerprint"] for e in events] == ["a" * 16]
    assert change.last_fabric_event(store)["fingerprint"] == "a" * 16
