"""Bounded input from a peer (security review): the daemon's PUB socket caps the frames a subscriber sends, the
client caps the replies and change notices it takes, daemon.json is read bounded and never from a FIFO, and
CURVE sockets refuse every client when no ZAP handler answers (never all of them)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.profiles import daemon_info
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonUnavailable
from moetune.runtime.testing.launch import free_port

pytestmark = pytest.mark.timeout(60)


_daemon = F.in_process_daemon


# -- the daemon's PUB socket ---------------------------------------------------------------------------------------
def test_pub_socket_drops_an_oversized_subscription(tmp_path: Path) -> None:
    """A peer of the PUB endpoint (a SUB sends subscriptions, one frame each) could send one frame of any size, which
    libzmq buffers whole: the ROUTER was capped (ZMQ_MAXMSGSIZE), the PUB was not."""
    d = _daemon(tmp_path).start(background=True)
    ctx = zmq.Context()
    try:
        assert d._pub is not None and 0 < d._pub.getsockopt(zmq.MAXMSGSIZE) <= 1 << 16
        x = ctx.socket(zmq.XSUB)
        x.linger = 0
        # a monitor name of its own (pyzmq's default, by fd, crashed the process at exit here)
        mon = x.get_monitor_socket(zmq.EVENT_DISCONNECTED, addr="inproc://test-frame-caps-xsub")
        x.connect(d.pub_endpoint)
        # a 64 KiB "subscription" (an XSUB keeps its own subscriptions in a recursive trie: a much longer one crashes
        # this test's process when the socket is closed, whatever the daemon does)
        x.send(b"\x01" + b"x" * (64 << 10))
        dropped = bool(mon.poll(3000))
        x.disable_monitor()
        mon.close(linger=0)
        x.close()
        assert dropped, "the daemon kept the connection of a peer that sent a 64 KiB frame to its PUB socket"
        # a real subscriber still gets the daemon's notices
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        c.subscribe()
        c.close()
    finally:
        ctx.term()
        d.stop()


# -- the client: replies and change notices ------------------------------------------------------------------------
@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """A ROUTER at ipc://TMP/run/daemon.sock (a directory of this user's, 0700: trusted) answering every request with
    a valid `hello` reply padded with `pad` bytes of JSON whitespace; and a PUB beside it (`pub`)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.linger = 0
    r.bind(f"ipc://{run}/daemon.sock")
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    pub.bind(f"ipc://{run}/events.sock")
    state: dict[str, Any] = {"pad": 0, "pub": pub, "pub_endpoint": f"ipc://{run}/events.sock"}
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not r.poll(50):
                continue
            ident, body = r.recv_multipart()
            rid = msgspec.json.decode(body)["id"]
            hello = wire.HelloResult(protocol=1, daemon_version="0", epoch="e", pub_endpoint=state["pub_endpoint"],
                                     version=0, fingerprint=None, ops=list(wire.OPS))
            r.send_multipart([ident, b" " * state["pad"] + wire.encode_ok(rid, "e", hello)])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"ipc://{run}/daemon.sock", state
    finally:
        stop.set()
        t.join(5)
        r.close()
        pub.close()
        ctx.term()


def test_client_refuses_an_oversized_reply(fake_daemon: tuple[str, dict[str, Any]]) -> None:
    """A reply frame is taken whole by libzmq before the client looks at it: without a cap, whoever answers on the
    daemon's socket had the client (a training job) allocate any size it sent."""
    endpoint, state = fake_daemon
    c = ProfileClient(endpoint, timeout_ms=1500, retries=0)
    try:
        assert c.hello().protocol == 1  # control: the fake answers
        state["pad"] = wire.MAX_REPLY_BYTES + 1
        with pytest.raises(DaemonUnavailable):
            c.hello()
        state["pad"] = 0
        assert c.hello().protocol == 1  # a fresh socket after the dropped one
    finally:
        c.close()


def test_client_drops_an_oversized_change_notice(fake_daemon: tuple[str, dict[str, Any]]) -> None:
    endpoint, state = fake_daemon
    c = ProfileClient(endpoint, timeout_ms=1500, retries=0)
    try:
        c.subscribe(state["pub_endpoint"])
        assert c._sub is not None and c._sub.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_REPLY_BYTES
        pub = state["pub"]

        def notice(version: int, pad: int = 0) -> list[bytes]:
            change = wire.Change(version=version, epoch="e", kind="profile_stale")
            return [b"profile_stale", b" " * pad + wire.encoder.encode(change)]

        def until(version: int) -> list[int]:
            seen: list[int] = []
            for _ in range(50):  # a (re)connected SUB's subscription reaches the PUB asynchronously
                pub.send_multipart(notice(version))
                seen += [ch.version for ch in c.poll_changes(timeout_ms=100)]
                if version in seen:
                    return seen
            raise AssertionError(f"notice {version} never arrived (got {seen})")

        until(1)  # subscribed
        # over the cap: the connection is dropped (and libzmq does not reconnect after such a protocol error: a daemon
        # that sends one gets no more notices to this client, which only means it gets no more of them)
        pub.send_multipart(notice(2, pad=wire.MAX_REPLY_BYTES + 1))
        seen: list[int] = []
        for _ in range(10):
            pub.send_multipart(notice(3))
            seen += [ch.version for ch in c.poll_changes(timeout_ms=100)]
        assert 2 not in seen
    finally:
        c.close()


# -- daemon.json ---------------------------------------------------------------------------------------------------
def test_read_daemon_info_never_blocks_on_a_fifo(tmp_path: Path) -> None:
    """The client's resolution is bounded in time (200 ms by default): a FIFO at daemon.json blocked its open for
    ever (the daemon's own reads and stale_daemon_reason open it O_NONBLOCK and read only a regular file)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.mkfifo(run / "daemon.json", 0o600)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(daemon_info.read_daemon_info(f"ipc://{run}/daemon.sock")), daemon=True)
    t.start()
    t.join(5)
    blocked = t.is_alive()
    if blocked:  # release the reader (a writer opened and closed: it reads EOF)
        os.close(os.open(run / "daemon.json", os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not blocked, "read_daemon_info blocked on a FIFO at daemon.json"
    assert out == [None]


def test_read_daemon_info_reads_a_bounded_regular_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    info = run / "daemon.json"
    info.write_text(json_text := '{"db": "/x/moetune.db", "running": false}')
    assert daemon_info.read_daemon_info(f"ipc://{run}/daemon.sock")["db"] == "/x/moetune.db"  # control
    info.write_text(" " * (daemon_info.MAX_INFO_BYTES + 1) + json_text)  # no daemon writes that much: not read whole
    assert daemon_info.read_daemon_info(f"ipc://{run}/daemon.sock") is None
    info.unlink()
    other = tmp_path / "elsewhere.json"
    other.write_text(json_text)
    info.symlink_to(other)  # the daemon writes a regular file (mkstemp + rename), never a link
    assert daemon_info.read_daemon_info(f"ipc://{run}/daemon.sock") is None


# -- ZAP -----------------------------------------------------------------------------------------------------------
def test_curve_sockets_refuse_everyone_without_a_zap_handler(tmp_path: Path) -> None:
    """libzmq lets every CURVE client in when no ZAP handler is bound (ZMQ_ZAP_ENFORCE_DOMAIN off: the "Stonehouse"
    legacy mode): the allow-list held only while pyzmq's authenticator thread was there. With the domain enforced,
    a missing handler refuses every client instead."""
    import zmq.auth

    from moetune.tuner.cli.keys import allow_client, generate_keys

    public, secret = generate_keys(tmp_path / "keys", "server")
    good_pub, good_sec = generate_keys(tmp_path / "good", "good")
    allow_client(good_pub, tmp_path / "keys" / "clients")
    _evil_pub, evil_sec = generate_keys(tmp_path / "evil", "evil")
    port, pub_port = free_port(), free_port()
    d = _daemon(tmp_path, endpoint=f"tcp://127.0.0.1:{port}", pub_endpoint=f"tcp://127.0.0.1:{pub_port}",
                curve_secret_key_file=str(secret)).start(background=True)
    server_pub, _ = zmq.auth.load_certificate(str(public))

    def client(secret_file: Path) -> ProfileClient:
        cp, cs = zmq.auth.load_certificate(str(secret_file))
        return ProfileClient(d.endpoint, timeout_ms=1000, retries=0, curve_server_key=server_pub,
                             curve_public_key=cp, curve_secret_key=cs)

    try:
        for s in (d._router, d._pub):
            assert s is not None and s.getsockopt(zmq.ZAP_ENFORCE_DOMAIN) == 1
        good = client(good_sec)
        assert good.hello().protocol == 1
        good.close()
        d._auth.stop()  # the handler gone (as if its thread had ended)
        evil = client(evil_sec)
        with pytest.raises(DaemonUnavailable):
            evil.hello()
        evil.close()
    finally:
        d.stop()


def test_poll_changes_reads_a_bounded_number_of_notices_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher that never stops sending: poll_changes returns after MAX_NOTICES_PER_POLL notices, the rest wait."""
    from moetune.runtime.profiles import client as client_mod

    class Endless:
        sent = 0

        def poll(self, timeout: int, flags: int) -> int:
            return zmq.POLLIN

        def recv_multipart(self) -> list[bytes]:
            self.sent += 1
            change = wire.Change(version=self.sent, epoch="e", kind="profile_stale")
            return [b"profile_stale", wire.encoder.encode(change)]

    monkeypatch.setattr(client_mod, "MAX_NOTICES_PER_POLL", 50)
    c = ProfileClient("ipc:///nowhere/daemon.sock", timeout_ms=10, retries=0)
    try:
        c._sub = Endless()  # type: ignore[assignment]
        assert [ch.version for ch in c.poll_changes()] == list(range(1, 51))
        assert [ch.version for ch in c.poll_changes()] == list(range(51, 101))
    finally:
        c._sub = None
        c.close()
