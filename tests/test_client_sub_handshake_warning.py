"""A SUB (change notices) subscriber whose CURVE handshake with the daemon's PUB socket fails was told nothing: the
socket retries quietly for ever and a tracked profile simply never refreshed. Its monitor's first handshake failure
is now said once, as a warning naming the endpoint (`ProfileClient.poll_changes`)."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.testing.launch import free_port

pytestmark = pytest.mark.timeout(60)


def _curve_pub(ctx: zmq.Context) -> tuple[zmq.Socket, int, bytes]:
    """A CURVE PUB bound on a free loopback port: (socket, port, its server public key)."""
    pub = ctx.socket(zmq.PUB)
    server_pub, server_secret = zmq.curve_keypair()
    pub.curve_secretkey, pub.curve_publickey, pub.curve_server = server_secret, server_pub, True
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    return pub, port, server_pub


def test_a_failed_sub_handshake_is_warned_once_naming_the_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.Context()
    pub, port, _ = _curve_pub(ctx)
    other_pub, _ = zmq.curve_keypair()  # not the daemon's key: the handshake breaks off
    c = ProfileClient(f"tcp://127.0.0.1:{free_port()}", curve_server_key=other_pub, timeout_ms=200, context=ctx)
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        c.subscribe(endpoint)
        with caplog.at_level(logging.WARNING, logger="moetune.client"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not caplog.records:
                assert c.poll_changes(100) == []
            for _ in range(5):  # the socket keeps retrying (and failing): said once, not at every poll
                c.poll_changes(100)
        said = [r.getMessage() for r in caplog.records if r.name == "moetune.client"]
        assert len(said) == 1, said
        assert f"no change notices from {endpoint}" in said[0] and "CURVE handshake" in said[0], said
    finally:
        c.close()
        pub.close(linger=0)
        ctx.term()


def test_a_sub_whose_handshake_succeeds_is_not_warned(caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.Context()
    pub, port, server_pub = _curve_pub(ctx)
    c = ProfileClient(f"tcp://127.0.0.1:{free_port()}", curve_server_key=server_pub, timeout_ms=200, context=ctx)
    try:
        c.subscribe(f"tcp://127.0.0.1:{port}")
        with caplog.at_level(logging.WARNING, logger="moetune.client"):
            for _ in range(10):
                c.poll_changes(100)
        assert not [r for r in caplog.records if r.name == "moetune.client"], caplog.records
    finally:
        c.close()
        pub.close(linger=0)
        ctx.term()


def test_a_sub_whose_key_the_daemon_refuses_is_told_what_to_do(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """A key not on the daemon's allow-list: the warning says which public key to allow, and that the daemon must be
    restarted (it reads its allow-list at start), not only "not on its allow-list?"."""
    from zmq.auth.thread import ThreadAuthenticator

    from moetune.tuner.cli.keys import generate_keys

    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    (tmp_path / "clients").mkdir()
    auth.configure_curve(domain="*", location=str(tmp_path / "clients"))  # an empty allow-list: every key refused
    pub, port, server_pub = _curve_pub(ctx)
    own_pub, own_secret = generate_keys(tmp_path / "bob", "bob")
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[client]\ncurve_secret_key_file = "{own_secret}"\n')
    c = ProfileClient(f"tcp://127.0.0.1:{free_port()}", curve_server_key=server_pub, timeout_ms=200, context=ctx,
                      env={"MOETUNE_CONFIG": str(cfg), "MOETUNE_SYSTEM_CONFIG": str(tmp_path / "none.toml")})
    try:
        c.subscribe(f"tcp://127.0.0.1:{port}")
        with caplog.at_level(logging.WARNING, logger="moetune.client"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not caplog.records:
                c.poll_changes(100)
        said = [r.getMessage() for r in caplog.records if r.name == "moetune.client"]
        assert len(said) == 1, said
        assert "refused this client's key" in said[0] and f"allow its public key {own_pub}" in said[0], said
        assert "restart the daemon" in said[0], said
    finally:
        c.close()
        pub.close(linger=0)
        auth.stop()
        ctx.term()
