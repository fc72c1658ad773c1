"""When this node's fabric last left a fingerprint (`fabric_left`, which `restorable` reads for a fabric back on the
same GPUs) is read from this node's fabric events only. In a database shared by nodes, another node that later left
the same fingerprint (identical nodes share it) hid this node's own change: its GPUs and profiles were taken for
this node's, so a fabric back here restored nothing and its profiles were re-tuned instead."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.fabric.change import fabric_left, restorable


def test_another_nodes_later_change_does_not_hide_this_nodes_own(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    here = store.node
    a, b = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    a.identity_hash = "gpus-here"
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": a.fingerprint, "identity": "gpus-here", "facts": a.to_dict(), "node": here})
    store.add_event(kind="fabric_changed", reason="gpu model",
                    details={"old_fingerprint": a.fingerprint, "fingerprint": b.fingerprint, "identity": None,
                             "profiles": [1, 2], "node": here})
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
