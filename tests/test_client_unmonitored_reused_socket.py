"""A tcp:// request socket whose monitor could not be made is kept between requests (only a time-out discards it), but
`request` forgot that at every new request: a later request on the same socket that timed out said "no connection
was made and none was refused" (what a monitored socket with no event tells), where nothing was known, and a
connection had in fact answered the request before. It now says that whether a connection was made is not known."""

from __future__ import annotations

import threading

import pytest
import zmq

from moetune.runtime import wire
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonError, DaemonTimeout

pytestmark = pytest.mark.timeout(60)


def test_a_kept_socket_without_a_monitor_says_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_once() -> None:  # one error reply (the connection works, the socket is kept), then silence
        *route, frame = router.recv_multipart()
        req = wire.decode_request(frame)
        router.send_multipart([*route, wire.encode_error(req.id, "e", wire.E_INTERNAL, "refused by this test")])

    def no_monitor(self: zmq.Socket, *_a: object, **_k: object) -> zmq.Socket:
        raise zmq.ZMQError(zmq.EINVAL, "no monitor (this test)")

    monkeypatch.setattr(zmq.Socket, "get_monitor_socket", no_monitor)
    t = threading.Thread(target=answer_once, daemon=True)
    t.start()
    c = ProfileClient(f"tcp://127.0.0.1:{port}", timeout_ms=2000, retries=0, allow_insecure_tcp=True, context=ctx)
    try:
        with pytest.raises(DaemonError, match="refused by this test"):
            c.status()
        t.join(10)
        with pytest.raises(DaemonTimeout) as ei:
            c.request("status", timeout_ms=300)
        said = str(ei.value)
        assert "whether a connection was made is not known (no socket monitor)" in said, said
        assert "no connection was made" not in said, said
    finally:
        c.close()
        router.close(linger=0)
        ctx.term()
