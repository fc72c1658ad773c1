"""The daemon's PUB socket over TCP, end to end on loopback.

Where a client subscribes: the advertised PUB port on the host the client's requests go to. `hello` names the PUB
endpoint as the daemon bound it (`tcp://*:5556` for a wildcard bind), and the client refused every PUB host but the
request's, so a client reaching the daemon by another name than its bind string (any remote client of a wildcard
daemon; `localhost` for a daemon bound to 127.0.0.1) could not subscribe: TrackedProfile raised DaemonUnavailable."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.testing.launch import free_port
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


def _publish_until(d: Daemon, got: Any, timeout: float = 10.0) -> None:
    """Publish change notices until `got()` is true (a SUB socket joins a moment after it connects)."""
    deadline = time.monotonic() + timeout
    v = 1000
    while time.monotonic() < deadline:
        v += 1
        d._publish(wire.Change(version=v, epoch=d.epoch, kind="fabric_changed"))
        if got():
            return
    raise AssertionError("no change notice arrived")


def test_a_client_using_another_name_for_the_daemons_host_subscribes_there(tmp_path: Path) -> None:
    facts = F.make_capture(tmp_path / "capture")
    port = free_port()
    d = Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint=f"tcp://127.0.0.1:{port}",
               discover=lambda: facts, rediscover_interval_s=0, allow_insecure_tcp=True).start(background=True)
    try:
        c = ProfileClient(f"tcp://localhost:{port}", timeout_ms=2000, env={}, allow_insecure_tcp=True)
        try:
            assert c.hello().pub_endpoint == f"tcp://127.0.0.1:{port + 1}"  # reported as bound, for display
            c.subscribe()  # refused before: "not on the request endpoint's host (localhost)"
            assert c.sub_endpoint == f"tcp://localhost:{port + 1}"
            changes: list[wire.Change] = []
            _publish_until(d, lambda: changes.extend(c.poll_changes(100)) or changes)
            assert changes[0].kind == "fabric_changed" and changes[0].epoch == d.epoch
        finally:
            c.close()
    finally:
        d.stop()
