"""A request sent as several ZeroMQ frames was dropped without a word (the client waited out its time-out): it is
answered `bad_request`, saying that a request is one frame, through a DEALER's or a REQ's envelope alike."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", [zmq.DEALER, zmq.REQ])
def test_a_request_in_several_frames_is_answered_bad_request(tmp_path: Path, kind: int) -> None:
    facts = F.FakeFacts({"gpu_model": "H200"})
    d = Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint=f"ipc://{tmp_path}/run/d.sock",
               discover=lambda: facts, rediscover_interval_s=0).start(background=True)
    ctx = zmq.Context()
    s = ctx.socket(kind)
    try:
        s.linger = 0
        s.rcvtimeo = 3000
        s.connect(d.endpoint)
        s.send_multipart([b'{"v":1,"id":7,', b'"op":"hello"}'])
        reply = json.loads(s.recv())
        assert reply["ok"] is False and reply["error"]["code"] == wire.E_BAD_REQUEST
        assert "one ZeroMQ frame" in reply["error"]["message"] and "got 2 frames" in reply["error"]["message"]
        s.send(b'{"v":1,"id":8,"op":"hello"}')  # the connection still serves
        assert json.loads(s.recv())["ok"] is True
    finally:
        s.close(linger=0)
        ctx.term()
        d.stop()
