"""A peer that sends many list_profiles and never reads the replies: the daemon queues at most a bounded number of
replies for it (the ROUTER's send HWM, sized from the largest reply) and drops the rest, its memory stays bounded,
and other peers are answered meanwhile (unbounded, 10000 replies of up to ~1 MB each could be queued per peer)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient

pytestmark = pytest.mark.timeout(120)


def test_a_peer_that_never_reads_its_list_replies_does_not_grow_the_daemon(tmp_path: Path) -> None:
    facts = F.make_capture(tmp_path / "capture")
    store = F.open_store(tmp_path / "moetune.db")
    buckets = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    # nvlink serves at most 8 ranks: a measured nvlink profile of a larger EP group is refused by the store (1e09ade)
    for model in ("qwen3-30b", "gpt-oss-120b", "deepseek-v3"):
        for ep in (2, 4, 8):
            F.seed_profiles(store, facts, model=model, ep_size=ep, buckets=buckets)  # 117 profiles
    d = F.DaemonProc(tmp_path, interval=0)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        d.wait_ready()
        s.linger = 0
        s.rcvhwm = 1
        s.connect(d.endpoint)
        req = b'{"v":1,"id":1,"op":"list_profiles"}'
        s.send(req)
        assert s.poll(10000)
        size = len(s.recv())
        assert size > 100_000, size  # big replies: what makes the queue cost memory
        c = ProfileClient(d.endpoint, timeout_ms=30000)
        try:
            answered = c.status().requests  # the requests the daemon has answered so far (this status not counted)
            before = d.rss_kb()
            for _ in range(2000):  # ~2000 x size bytes (~220 MB) if every reply were kept
                s.send(req)
            assert c.hello().protocol == 1  # another peer is answered meanwhile
            # memory is measured once the loop has answered (or dropped) every request, not after a fixed sleep: a
            # loaded machine measured part way through and passed whatever the queue held then
            want, deadline = answered + 1 + 2000 + 1, time.monotonic() + 90  # + that status, the list requests, hello
            while (done := c.status().requests) < want:
                assert time.monotonic() < deadline, f"the daemon answered {done - answered} of the requests in 90 s"
                want += 1  # this status is counted by the next
                time.sleep(0.05)
        finally:
            c.close()
        grown_mb = (d.rss_kb() - before) / 1024
        assert grown_mb < 150, f"the daemon grew {grown_mb:.0f} MB for one peer's unread replies ({size} B each)"
    finally:
        s.close(linger=0)
        ctx.term()
        d.kill()
