"""What one connected peer can have the daemon's ROUTER hold: libzmq queues up to ZMQ_RCVHWM messages per
connection, each up to ZMQ_MAXMSGSIZE. With an RCVHWM of 10000 that was ~650 MB per connection at the default
request cap (and 160 GB at the largest cap the config allows). The queue of one-frame messages (what clients send)
is now bounded in bytes (a multipart message counts once: libzmq caps frames, not frames per message); a legitimate
client has one request in flight, and a full queue only makes libzmq stop reading that connection (nothing is
lost). The largest legitimate request the wire messages allow fits the default cap with room to spare."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.tuner.daemon import server

pytestmark = pytest.mark.timeout(60)


def _worst_requests() -> list[bytes]:
    """Each op's request at its largest as a client encodes it (msgspec: compact JSON; a control character is
    written as a 6-byte escape, the most bytes one character takes): every bounded field at its bound."""
    ctl, big, name = "\x01", 2**31, "\x01" * wire.NAME_MAX
    common = {"v": -(2**63), "id": ctl * 128}
    return [msgspec.json.encode(r) for r in (
        wire.Hello(client=ctl * 256, **common),
        wire.GetProfile(ep_size=big, tokens=big, nodes=big, model=name, hidden=big, intermediate=big, experts=big,
                        topk=big, dtype=name, fingerprint=name, software=name, transport_family=name, **common),
        wire.ListProfiles(status="superseded", fingerprint=name, limit=10000, **common),
        wire.Fabric(**common), wire.Status(**common),
        wire.Retune(all=False, cancel=big, reason=ctl * wire.REASON_MAX, **common),
    )]


def test_the_largest_legitimate_request_fits_the_default_cap() -> None:
    largest = max(map(len, _worst_requests()))
    assert largest <= wire.LARGEST_REQUEST_BYTES <= wire.DEFAULT_MAX_REQUEST_BYTES


@pytest.mark.parametrize("cap", [wire.DEFAULT_MAX_REQUEST_BYTES, 1 << 20, server.MAX_REQUEST_BYTES_LIMIT])
def test_what_one_connection_can_queue_is_bounded(tmp_path: Path, cap: int) -> None:
    d = F.in_process_daemon(tmp_path, max_request_bytes=cap).start(background=True)
    try:
        assert d._router is not None
        frame = d._router.getsockopt(zmq.MAXMSGSIZE)
        assert frame == cap + server.MAXMSG_SLACK
        hwm = d._router.rcvhwm
        assert hwm * frame <= max(server.REQUEST_QUEUE_BYTES, server.REQUEST_HWM_MIN * frame)
        assert hwm >= server.REQUEST_HWM_MIN
    finally:
        d.stop()


def test_an_oversize_message_is_dropped_and_serving_goes_on(tmp_path: Path) -> None:
    d = F.in_process_daemon(tmp_path).start(background=True)
    ctx = zmq.Context()
    big, s = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        # the served socket's deadline is generous (a loaded CI box may stall the daemon's thread for seconds): a
        # lost request still fails, as zmq.Again; `big` is never answered, so its short deadline decides nothing
        for sock, timeout_ms in ((big, 500), (s, 20000)):
            sock.linger, sock.rcvtimeo = 0, timeout_ms
            sock.connect(d.endpoint)
        big.send(b"x" * (d.max_request_bytes + server.MAXMSG_SLACK + 1))  # over ZMQ_MAXMSGSIZE: connection dropped
        with pytest.raises(zmq.Again):
            big.recv()
        # then more than one queue's worth of requests (16 in flight at a time, under the replies' queue): each answered
        n, window, answered = 3 * d._router.rcvhwm, 16, set()
        for start in range(0, n, window):
            batch = range(start, min(n, start + window))
            for i in batch:
                s.send(msgspec.json.encode({"v": 1, "id": i, "op": "hello"}))
            answered |= {msgspec.json.decode(s.recv())["id"] for _ in batch}
        assert answered == set(range(n))
    finally:
        big.close()
        s.close()
        ctx.term()
        d.stop()


def test_a_full_queue_loses_nothing(tmp_path: Path) -> None:
    """At the largest request cap the ROUTER queues REQUEST_HWM_MIN messages per connection: more requests than that
    in flight at once (the test above never had more than 16, under the default cap's ~127) are all answered, libzmq
    reading the connection again as the loop drains its queue."""
    d = F.in_process_daemon(tmp_path, max_request_bytes=server.MAX_REQUEST_BYTES_LIMIT)
    go, first = threading.Event(), threading.Event()
    real = d._handle

    def held(*a: Any) -> Any:  # the loop holds the first request until every other one is sent: they queue
        first.set()
        go.wait(30)
        return real(*a)

    d._handle = held  # type: ignore[method-assign]
    d.start(background=True)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        assert d._router is not None and d._router.rcvhwm == server.REQUEST_HWM_MIN
        s.linger, s.rcvtimeo = 0, 20000  # generous: a lost reply still fails (zmq.Again), a slow one does not
        s.connect(d.endpoint)
        n = 4 * server.REQUEST_HWM_MIN
        assert n <= server.REPLY_HWM  # the replies' queue holds them all (past it they would be dropped: `unsent`)
        for i in range(n):
            s.send(msgspec.json.encode({"v": 1, "id": i, "op": "hello"}))
        assert first.wait(30)
        time.sleep(0.3)  # the rest arrive meanwhile: REQUEST_HWM_MIN queued, the others left unread
        go.set()
        assert {msgspec.json.decode(s.recv())["id"] for _ in range(n)} == set(range(n))
    finally:
        go.set()
        s.close()
        ctx.term()
        d.stop()
