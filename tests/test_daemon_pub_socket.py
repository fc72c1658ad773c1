"""The daemon's PUB socket over TCP, end to end on loopback.

Where a client subscribes: the advertised PUB port on the host the client's requests go to. `hello` names the PUB
endpoint as the daemon bound it (`tcp://*:5556` for a wildcard bind), and the client refused every PUB host but the
request's, so a client reaching the daemon by another name than its bind string (any remote client of a wildcard
daemon; `localhost` for a daemon bound to 127.0.0.1) could not subscribe: TrackedProfile raised DaemonUnavailable.

Who may subscribe: the PUB socket is CURVE-secured with the same allow-list as the request socket; a subscriber
whose key is not listed, or that does not speak CURVE, gets nothing."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.testing.launch import free_port
from moetune.tuner.cli.keys import allow_client, generate_keys
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
            c.subscribe()  # not refused as "not on the request endpoint's host (localhost)"
            assert c.sub_endpoint == f"tcp://localhost:{port + 1}"
            changes: list[wire.Change] = []
            _publish_until(d, lambda: changes.extend(c.poll_changes(100)) or changes)
            assert changes[0].kind == "fabric_changed" and changes[0].epoch == d.epoch
        finally:
            c.close()
    finally:
        d.stop()


def test_the_tcp_pub_socket_refuses_unlisted_and_plain_text_subscribers(tmp_path: Path) -> None:
    public, secret = generate_keys(tmp_path / "keys")
    server_key, _ = zmq.auth.load_certificate(str(public))
    listed_pub, listed_sec = generate_keys(tmp_path / "client", "client")
    allow_client(listed_pub, tmp_path / "keys" / "clients")
    listed = zmq.auth.load_certificate(str(listed_sec))
    facts = F.make_capture(tmp_path / "capture")
    port = free_port()
    d = Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint=f"tcp://127.0.0.1:{port}",
               discover=lambda: facts, rediscover_interval_s=0, curve_secret_key_file=str(secret)).start(background=True)
    ctx = zmq.Context()
    subs: list[zmq.Socket] = []

    def sub(keys: tuple[bytes, bytes | None] | None) -> zmq.Socket:
        s = ctx.socket(zmq.SUB)
        s.linger = 0
        if keys is not None:
            s.curve_serverkey, (s.curve_publickey, s.curve_secretkey) = server_key, keys
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(d.pub_endpoint)
        subs.append(s)
        return s

    try:
        allowed = sub(listed)  # the control: the listed key hears the notices
        unlisted = sub(zmq.curve_keypair())  # a valid CURVE key the allow-list does not hold
        plain = sub(None)  # no CURVE at all
        _publish_until(d, lambda: allowed.poll(100))
        for v in range(5):  # more notices, now that the listed subscriber is surely joined
            d._publish(wire.Change(version=2000 + v, epoch=d.epoch, kind="fabric_changed"))
        assert not unlisted.poll(300) and not plain.poll(300)
    finally:
        for s in subs:
            s.close(linger=0)
        ctx.term()
        d.stop()
