"""Hostile input: every bad frame is answered with an error (or dropped), the daemon lives, memory stays flat."""

from __future__ import annotations

import contextlib
import json
import pickle
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    with F.seeded_daemon(tmp_path_factory.mktemp("hostile"), interval=0) as (d, _facts):
        yield d


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.rcvtimeo = 3000
    s.connect(endpoint)
    return s


@contextlib.contextmanager
def _client(daemon: F.DaemonProc) -> Iterator[tuple[zmq.Context, zmq.Socket]]:
    """A DEALER to the daemon and its context (for more sockets); both closed after, and then the daemon must still
    run."""
    ctx = zmq.Context()
    s = _dealer(ctx, daemon.endpoint)
    try:
        yield ctx, s
    finally:
        s.close()
        ctx.term()
    assert daemon.proc.poll() is None


def _hostile_frames(rng: random.Random) -> list[tuple[bytes, str]]:
    good = b'{"v":1,"id":1,"op":"get_profile","ep_size":2,"tokens":3000,"model":"qwen3-30b"}'
    out = [
        (rng.randbytes(rng.randint(1, 300)), ""),  # random bytes: bad_json (or, rarely, valid JSON)
        (good[: rng.randint(0, len(good) - 1)], wire.E_BAD_JSON),  # truncated
        (b'{"v":1,"id":2,"op":"get_profile","ep_size":"two","tokens":3000}', wire.E_INVALID_FIELD),
        (b'{"v":1,"id":3,"op":"get_profile","ep_size":2,"tokens":-5,"model":"qwen3-30b"}', wire.E_INVALID_FIELD),
        (b'{"v":1,"id":4,"op":"launch_missiles"}', wire.E_UNKNOWN_OP),
        (b'{"v":1,"id":5,"op":"get_profile","tokens":3000}', wire.E_MISSING_FIELD),
        (b'{"v":1,"id":6,"op":"get_profile","ep_size":2,"tokens":3,"hidden":1}', wire.E_MISSING_FIELD),
        (b'{"v":1,"id":7,"op":"get_profile","ep_size":2,"tokens":3,"model":"no-such-model"}', wire.E_INVALID_FIELD),
        (b'{"v":9,"id":8,"op":"hello"}', wire.E_UNSUPPORTED_VERSION),
        (b"null", wire.E_BAD_REQUEST),
        (b'{"v":1,"id":9,"op":"hello","extra":[1,2,3]}', wire.E_UNKNOWN_FIELD),
        # over max_request_bytes but under ZMQ_MAXMSGSIZE (the cap + 1 KiB): answered, not dropped
        (json.dumps({"v": 1, "id": 10, "op": "hello", "client": "x" * 65600}).encode(), wire.E_TOO_LARGE),
        (b'{"v":1,"id":11,"op":"get_profile","ep_size":2,"tokens":3000,"model":"qwen3-30b","fingerprint":"' + str(rng.random()).encode() + b'"}', wire.E_NOT_FOUND),
        (b"\x80\x81\x82msgpack?", wire.E_BAD_JSON),
        (b"\xac\xed\x00\x05pickle?", wire.E_BAD_JSON),
        # a real Python pickle of a valid request: the frames above only start like serialised objects (0xACED0005 is
        # Java's), so a decoder that fell back to pickle.loads still answered them bad_json; this one it would run
        (pickle.dumps({"v": 1, "id": 12, "op": "hello"}, protocol=4), wire.E_BAD_JSON),
    ]
    return out


def test_every_hostile_frame_answered(daemon: F.DaemonProc) -> None:
    rng = random.Random(1234)
    with _client(daemon) as (_ctx, s):
        # warm up, then take the memory baseline
        for _ in range(3):
            for frame, _code in _hostile_frames(rng):
                s.send(frame)
                s.recv()
        rss0 = daemon.rss_kb()
        n = 0
        t0 = time.monotonic()
        while n < 3000:
            batch = _hostile_frames(rng)
            for frame, _ in batch:
                s.send(frame)
            for frame, code in batch:
                rep = msgspec.json.decode(s.recv())
                n += 1
                if code:
                    assert rep["ok"] is False, (frame[:80], rep)
                    assert rep["error"]["code"] == code, (frame[:80], rep)
                else:
                    assert set(rep) >= {"v", "id", "ok", "epoch"}
                assert rep["v"] == 1 and rep["epoch"]
        elapsed = time.monotonic() - t0
        rss1 = daemon.rss_kb()
        assert rss1 - rss0 < 8 * 1024, f"RSS grew {rss0} -> {rss1} kB over {n} hostile requests"
        assert elapsed < 30
        # still serving good requests
        s.send(b'{"v":1,"id":77,"op":"get_profile","ep_size":2,"tokens":3000,"model":"qwen3-30b"}')
        rep = msgspec.json.decode(s.recv())
        assert rep["ok"] is True and rep["id"] == 77


def test_unparseable_multipart_dropped_and_huge_frames_cut(daemon: F.DaemonProc) -> None:
    with _client(daemon) as (ctx, s):
        # multipart requests are not requests: answered bad_request (a request is one frame), never run
        s.send_multipart([b'{"v":1,"id":1,"op":"hello"}', b"more", b"frames"])
        s.send_multipart([b"x", b"y"])
        s.send(b'{"v":1,"id":2,"op":"hello"}')
        for parts in (3, 2):
            rep = msgspec.json.decode(s.recv())
            assert rep["ok"] is False and rep["error"]["code"] == "bad_request", rep
            assert f"got {parts} frames" in rep["error"]["message"]
        rep = msgspec.json.decode(s.recv())
        assert rep["id"] == 2 and rep["ok"] is True
        # a frame over the transport cap (ZMQ_MAXMSGSIZE) drops that connection, nothing else
        big = _dealer(ctx, daemon.endpoint)
        big.rcvtimeo = 500
        big.send(b"x" * (4 << 20))
        with pytest.raises(zmq.Again):
            big.recv()
        big.close()
        s.send(b'{"v":1,"id":3,"op":"status"}')
        rep = msgspec.json.decode(s.recv())
        assert rep["ok"] is True and rep["result"]["requests"] > 0


def test_many_clients_connect_and_vanish(daemon: F.DaemonProc) -> None:
    """Clients that send and disconnect before the reply (ROUTER_MANDATORY: replies dropped, no crash)."""
    ctx = zmq.Context()
    for i in range(200):
        s = _dealer(ctx, daemon.endpoint)
        s.send(b'{"v":1,"id":%d,"op":"hello"}' % i)
        s.close(linger=0 if i % 2 else 100)
    s = _dealer(ctx, daemon.endpoint)
    s.send(b'{"v":1,"id":1,"op":"hello"}')
    assert msgspec.json.decode(s.recv())["ok"] is True
    s.close()
    ctx.term()
    assert daemon.proc.poll() is None


def test_req_socket_also_served(daemon: F.DaemonProc) -> None:
    """REQ clients (envelope delimiter) get the same one-frame reply."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.linger = 0
    s.rcvtimeo = 3000
    s.connect(daemon.endpoint)
    s.send(b'{"v":1,"id":"req-1","op":"hello"}')
    rep = msgspec.json.decode(s.recv())
    assert rep["id"] == "req-1" and rep["ok"] is True and rep["result"]["protocol"] == 1
    s.close()
    ctx.term()


def test_same_id_different_keys_never_mixed(daemon: F.DaemonProc) -> None:
    """The read-through cache is keyed by every request field except v/id."""
    ctx = zmq.Context()
    s = _dealer(ctx, daemon.endpoint)
    answers = {}
    for tokens in (10, 1000, 9000, 10):
        s.send(b'{"v":1,"id":1,"op":"get_profile","ep_size":2,"tokens":%d,"model":"qwen3-30b"}' % tokens)
        rep = msgspec.json.decode(s.recv())
        answers.setdefault(tokens, set()).add(rep["result"]["key"]["token_bucket"])
    s.send(b'{"v":1,"id":1,"op":"get_profile","ep_size":4,"tokens":1000,"model":"qwen3-30b"}')
    rep = msgspec.json.decode(s.recv())
    assert rep["ok"] is False and rep["error"]["code"] == wire.E_NOT_FOUND
    assert answers == {10: {64}, 1000: {1024}, 9000: {4096}}
    s.close()
    ctx.term()


def _db_hash(db: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(db.parent.glob(db.name + "*")):
        if p.suffix != ".daemon-lock":
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def test_hostile_pass_leaves_the_database_byte_identical(tmp_path: Path) -> None:
    """Malformed msgpack, wrong types, huge ints, unknown ops, wrong versions, oversized frames: each gets a
    clear error code (oversized: dropped), the daemon lives, and the database does not change by one byte."""
    with F.seeded_daemon(tmp_path, interval=0) as (d, _facts):
        time.sleep(0.5)  # start-up writes (events) are done
        before = _db_hash(d.db)
        huge = str(1 << 200).encode()
        cases = [
            (msgspec.msgpack.encode({"v": 1, "id": 1, "op": "hello"}), wire.E_BAD_JSON),
            (msgspec.msgpack.encode({"v": 1, "id": 2, "op": "retune", "all": True}), wire.E_BAD_JSON),
            (b'{"v":1,"id":3,"op":"get_profile","ep_size":' + huge + b',"tokens":3,"model":"qwen3-30b"}', None),
            (b'{"v":1,"id":' + huge + b',"op":"hello"}', None),
            (b'{"v":' + huge + b',"id":5,"op":"hello"}', None),
            (b'{"v":1,"id":6,"op":"retune","all":"yes"}', wire.E_INVALID_FIELD),
            (b'{"v":1,"id":7,"op":"retune","cancel":' + huge + b'}', None),
            (b'{"v":1,"id":8,"op":"list_profiles","limit":1e308}', wire.E_INVALID_FIELD),
            (b'{"v":1,"id":9,"op":"list_profiles","status":"deleted"}', wire.E_INVALID_FIELD),
            (b'{"v":1,"id":10,"op":"drop_table"}', wire.E_UNKNOWN_OP),
            (b'{"v":2,"id":11,"op":"retune","all":true}', wire.E_UNSUPPORTED_VERSION),
            (b'{"v":"1","id":12,"op":"retune","all":true}', wire.E_UNSUPPORTED_VERSION),
            (b'{"v":true,"id":13,"op":"retune","all":true}', wire.E_UNSUPPORTED_VERSION),
            (b'[1,2,3]', wire.E_BAD_REQUEST),
            (b'{"v":1,"id":14,"op":"retune","all":true,"reason":"' + b"x" * 600 + b'"}', wire.E_INVALID_FIELD),
        ]
        with _client(d) as (ctx, s):
            for frame, code in cases:
                s.send(frame)
                rep = json.loads(s.recv())
                assert rep["ok"] is False, (frame[:80], rep)
                assert rep["error"]["message"], rep
                if code is not None:
                    assert rep["error"]["code"] == code, (frame[:80], rep)
            s.send(b"{" + b" " * (70 * 1024 * 1024))  # over ZMQ_MAXMSGSIZE: the connection is dropped
            time.sleep(0.5)
            s2 = _dealer(ctx, d.endpoint)
            s2.send(b'{"v":1,"id":99,"op":"hello"}')
            assert json.loads(s2.recv())["ok"] is True  # alive
            s2.close()
        assert _db_hash(d.db) == before
