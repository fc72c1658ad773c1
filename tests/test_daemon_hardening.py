"""Hardening after the security review: hostile nesting never ends the daemon, the client takes only a reply
that answers its request (and recomputes its environment), frames are capped near the request cap, the
runtime directory, daemon.json and the lock file cannot be redirected, TCP is never plain text by accident,
the PUB endpoint a daemon names is checked, and plain-text TCP is loopback only."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import paths, wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles import client, launcher_env, replies, tracked_profile
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import BadReply, DaemonUnavailable, FallbackWarning, ProfileRefused
from moetune.runtime.shapes import MODELS
from moetune.runtime.testing.launch import free_port
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.runtime_dir import prepare_runtime_dir

pytestmark = pytest.mark.timeout(120)
QWEN = MODELS["qwen3-30b"]
# this node: the fingerprint daemon.json names and the fakes' `fabric` reports, with the software hash of this
# machine's and this process's facts (what the client checks a daemon's reported facts against)
FP, SW = "f" * 16, F.this_node_software()
# deep enough for a RecursionError on Python 3.11 and 3.12 alike (3.12's decoder went past 5000 levels on the GPU
# machine), under the 64 KB request cap
DEEP = b"[" * 30000 + b"]" * 30000
DEEP_FIELD = b'{"v":1,"id":1,"op":"hello","client":' + DEEP + b"}"
DEEP_UNKNOWN = b'{"v":1,"id":1,"op":"hello","x":' + DEEP + b"}"  # the typed decode stops early; _classify does not


def _dealer(ctx: zmq.Context, endpoint: str, timeout_ms: int = 3000) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.rcvtimeo = timeout_ms
    s.connect(endpoint)
    return s


_daemon = F.in_process_daemon


# -- 1: deep nesting is bad JSON; one frame never ends the serving loop ---------------------------------------
# What a too-deep frame is called depends on where the decoder gives up (Python's recursion limit): any of these,
# never an exception that escapes
REFUSED = {wire.E_BAD_JSON, wire.E_BAD_REQUEST, wire.E_INVALID_FIELD, wire.E_UNKNOWN_FIELD}


@pytest.mark.parametrize("frame", [DEEP, DEEP_FIELD, DEEP_UNKNOWN])
def test_deep_nesting_is_a_wire_error(frame: bytes) -> None:
    with pytest.raises(wire.WireError) as e:
        wire.decode_request(frame)
    assert e.value.code in REFUSED


class _Recursing:
    def decode(self, _frame: bytes) -> None:
        raise RecursionError("maximum recursion depth exceeded while deserializing an object")


def test_a_recursion_error_in_either_decode_is_bad_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "request_decoder", _Recursing())
    with pytest.raises(wire.WireError) as e:
        wire.decode_request(b'{"v":1,"id":1,"op":"hello"}')
    assert e.value.code == wire.E_BAD_JSON and "nested too deeply" in e.value.message
    monkeypatch.undo()
    monkeypatch.setattr(wire.msgspec.json, "decode", _Recursing().decode)  # _classify's untyped decode
    with pytest.raises(wire.WireError) as e:
        wire.decode_request(b'{"v":1,"id":1,"op":"hello","x":1}')
    assert e.value.code == wire.E_BAD_JSON and "nested too deeply" in e.value.message


def test_deeply_nested_frames_do_not_kill_serve(tmp_path: Path) -> None:
    with F.seeded_daemon(tmp_path, interval=0) as (d, _facts):
        ctx = zmq.Context()
        s = _dealer(ctx, d.endpoint)
        try:
            for frame in (DEEP, DEEP_FIELD, DEEP_UNKNOWN):
                s.send(frame)
                rep = msgspec.json.decode(s.recv())
                assert rep["ok"] is False and rep["error"]["code"] in REFUSED
            s.send(b'{"v":1,"id":7,"op":"hello"}')
            rep = msgspec.json.decode(s.recv())
            assert rep["id"] == 7 and rep["ok"] is True
        finally:
            s.close()
            ctx.term()
        assert d.proc.poll() is None


def test_a_failing_frame_is_answered_internal_and_serving_goes_on(tmp_path: Path) -> None:
    d = _daemon(tmp_path)
    real = d._handle

    def handle(frame: bytes, head: list[bytes] | None = None, peer: zmq.Frame | None = None) -> tuple[bytes | None, str, str]:
        if frame == b"boom":
            raise RuntimeError("unexpected")
        return real(frame, head, peer)

    d._handle = handle  # type: ignore[method-assign]
    d.start(background=True)
    ctx = zmq.Context()
    s = _dealer(ctx, d.endpoint)
    try:
        s.send(b"boom")
        rep = msgspec.json.decode(s.recv())
        assert rep["ok"] is False and rep["error"]["code"] == wire.E_INTERNAL
        s.send(b'{"v":1,"id":2,"op":"hello"}')
        assert msgspec.json.decode(s.recv())["ok"] is True
    finally:
        s.close()
        ctx.term()
        d.stop()


# -- 3: a frame is capped at the request cap + 1 KiB -----------------------------------------------------------
def test_frames_capped_near_the_request_cap(tmp_path: Path) -> None:
    d = _daemon(tmp_path, max_request_bytes=4096).start(background=True)
    ctx = zmq.Context()
    try:
        assert d._router is not None and d._router.getsockopt(zmq.MAXMSGSIZE) == 4096 + 1024
        s = _dealer(ctx, d.endpoint)
        s.send(b"x" * 4200)  # over the cap, inside the slack: a clear error
        assert msgspec.json.decode(s.recv())["error"]["code"] == wire.E_TOO_LARGE
        big = _dealer(ctx, d.endpoint, timeout_ms=500)
        big.send(b"x" * (4096 + 2048))  # over ZMQ_MAXMSGSIZE: the connection is dropped
        with pytest.raises(zmq.Again):
            big.recv()
        big.close()
        s.send(b'{"v":1,"id":3,"op":"hello"}')
        assert msgspec.json.decode(s.recv())["ok"] is True
        s.close()
    finally:
        ctx.term()
        d.stop()


# -- 4: runtime directory, daemon.json, lock file --------------------------------------------------------------
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o730])
def test_writable_runtime_dir_is_refused_whoever_owns_it(tmp_path: Path, mode: int) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, mode)
    with pytest.raises(DaemonConfigError, match=f"{run}.*mode {mode:o}"):
        prepare_runtime_dir(run)
    assert stat.S_IMODE(os.stat(run).st_mode) == mode  # refused, never chmod-ed
    os.chmod(run, 0o1777)  # sticky: only a file's owner may replace it
    assert prepare_runtime_dir(run) is False
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o1777


@pytest.mark.parametrize("group", [False, True])
def test_missing_ancestors_of_the_runtime_dir_are_created_private_under_umask_0(tmp_path: Path, group: bool) -> None:
    """A service started with UMask=0000: the ancestors created with the socket directory were 0777 (the caller's
    umask, outside the 077 block), which check_socket_ancestors had not seen (they did not exist yet) and the next
    start refused."""
    import grp

    from moetune.tuner.daemon.runtime_dir import check_socket_ancestors

    run = tmp_path / "a" / "b" / "run"
    name = grp.getgrgid(os.getgid()).gr_name if group else ""
    check_socket_ancestors(run)
    old = os.umask(0)
    try:
        assert prepare_runtime_dir(run, name) is True
    finally:
        os.umask(old)
    ancestor = 0o711 if group else 0o700  # the group's members pass through to the 0750 directory
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == ancestor
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b").st_mode) == ancestor
    assert stat.S_IMODE(os.stat(run).st_mode) == (0o750 if group else 0o700)
    check_socket_ancestors(run)  # the next start takes them
    assert prepare_runtime_dir(run, name) is False


def _owned_by_another_user(d: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `d` another user's: chown it where this is root, else pretend to be another uid."""
    if os.getuid() == 0:
        os.chown(d, 65534, 65534)
    else:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)


@pytest.mark.parametrize("mode", [0o1777, 0o755, 0o700])
def test_runtime_dir_of_another_user_is_refused_sticky_or_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              mode: int) -> None:
    """A /tmp/moetune-<uid> made first by another user: its owner may remove or replace any file in it, the sticky
    bit notwithstanding (they could swap the socket for a link the daemon then chmods)."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, mode)
    _owned_by_another_user(run, monkeypatch)
    with pytest.raises(DaemonConfigError, match=f"{run} is owned by uid"):
        prepare_runtime_dir(run)
    assert stat.S_IMODE(os.stat(run).st_mode) == mode  # refused, never chmod-ed
    if os.getuid() == 0:
        # its owner, a user who is not root, takes it as it is (as root, this user's directories are root's, taken
        # whatever the rule says of this user's): the process as uid 65534
        monkeypatch.setattr(os, "getuid", lambda: 65534)
        assert prepare_runtime_dir(run) is False
        assert stat.S_IMODE(os.stat(run).st_mode) == mode


def test_daemon_json_never_written_through_a_planted_link(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (run / f".daemon.json.{os.getpid()}").symlink_to(victim)  # a fixed temp name a daemon could have used
    d = _daemon(tmp_path).start(background=True)
    try:
        info = run / "daemon.json"
        assert stat.S_ISREG(os.lstat(info).st_mode) and json.loads(info.read_text())["running"] is True
        assert stat.S_IMODE(os.lstat(info).st_mode) == 0o600
    finally:
        d.stop()
    assert victim.read_text() == "precious"
    assert stat.S_ISREG(os.lstat(run / "daemon.json").st_mode)
    left = sorted(p.name for p in run.iterdir() if p.name.startswith(".daemon.json."))
    # only the planted link and daemon.json's owner record: no temp file of ours left behind
    assert left == [f".daemon.json.{os.getpid()}", ".daemon.json.moetune-owner"]


def test_lock_file_link_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "moetune.db.daemon-lock").symlink_to(victim)
    d = _daemon(tmp_path, db_path=str(tmp_path / "moetune.db"))
    with pytest.raises(DaemonConfigError, match="symbolic link"):
        d.start()
    assert victim.read_text() == "precious"


# -- 6: plain-text TCP on loopback only ------------------------------------------------------------------------
def test_insecure_tcp_only_on_loopback(tmp_path: Path) -> None:
    port = free_port()
    for host in ("0.0.0.0", "*", "10.1.2.3", "[::]", "eth0"):
        d = _daemon(tmp_path, endpoint=f"tcp://{host}:{port}", pub_endpoint=f"tcp://127.0.0.1:{port + 1}",
                    allow_insecure_tcp=True)
        with pytest.raises(DaemonConfigError, match="loopback"):
            d.start()
    for host in ("127.0.0.1", "127.8.9.1", "[::1]", "localhost", "[::ffff:127.0.0.1]"):
        assert paths.is_loopback_host(paths.tcp_host(f"tcp://{host}:1")), host
    for host in ("0.0.0.0", "*", "10.0.0.1", "[::]", "eth0", "localhost.example.com"):
        assert not paths.is_loopback_host(paths.tcp_host(f"tcp://{host}:1")), host


# -- 5: the client never talks plain-text TCP by accident; the PUB endpoint is checked -------------------------
PlainRouter = F.ReplyRouter  # a plain-text ROUTER answering every request with `answer(request)`


def ok_reply(rid: Any, res: Any) -> bytes:
    return json.dumps({"v": 1, "id": rid, "ok": True, "epoch": "e1", "result": res}).encode()


def hello_result(pub: str) -> dict:
    return {"protocol": 1, "daemon_version": "t", "epoch": "e1", "pub_endpoint": pub, "version": 0,
            "fingerprint": FP, "ops": list(wire.OPS)}


@pytest.fixture
def plain() -> Iterator[Callable[..., PlainRouter]]:
    made: list[PlainRouter] = []

    def make(endpoint: str, answer: Callable[[dict], bytes]) -> PlainRouter:
        r = PlainRouter(endpoint, answer)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_tcp_without_server_key_is_refused(plain, tmp_path: Path) -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    r = plain(ep, lambda req: ok_reply(req["id"], hello_result(ep)))
    env = {"HOME": str(tmp_path)}
    c = ProfileClient(ep, timeout_ms=300, retries=0, env=env)
    with pytest.raises(DaemonUnavailable, match="no CURVE public key"):
        c.hello()
    c.close()
    missing = tmp_path / "keys" / "server.key"
    c = ProfileClient(ep, timeout_ms=300, retries=0, env={**env, "MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE": str(missing)})
    with pytest.raises(DaemonUnavailable, match=str(missing)):
        c.hello()
    c.close()
    assert not r.requests  # nothing went out in plain text
    # the explicit test-only opt-in, on loopback, still works
    c = ProfileClient(ep, timeout_ms=2000, env=env, allow_insecure_tcp=True)
    assert c.hello().protocol == 1
    c.close()
    # ... and on any other address it is refused without connecting
    c = ProfileClient("tcp://10.255.255.1:5555", timeout_ms=300, env=env, allow_insecure_tcp=True)
    with pytest.raises(DaemonUnavailable, match="loopback"):
        c.hello()
    c.close()


def test_resolve_falls_back_when_tcp_has_no_key(tmp_path: Path) -> None:
    c = ProfileClient(f"tcp://127.0.0.1:{free_port()}", db_path=tmp_path / "none.db", timeout_ms=200, env={})
    with pytest.warns(FallbackWarning, match="CURVE"):
        res = c.resolve(model=QWEN, ep_size=2, tokens=100)
    assert res.source in ("policy", "default")
    c.close()


def _ipc_run(tmp_path: Path, name: str = "run") -> Path:
    run = tmp_path / name
    run.mkdir(mode=0o700)
    return run


def test_subscribe_refuses_a_pub_endpoint_unlike_the_request_socket(plain, tmp_path: Path) -> None:
    run = _ipc_run(tmp_path)
    ep = f"ipc://{run}/daemon.sock"
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could have put the socket there
    pubs = {"tcp": "tcp://127.0.0.1:5", "shared": f"ipc://{shared}/events.sock", "relative": "ipc://events.sock",
            "ok": f"ipc://{run}/events.sock"}
    want = {"pub": pubs["tcp"]}
    plain(ep, lambda req: ok_reply(req["id"], hello_result(want["pub"])))
    squatter = zmq.Context.instance().socket(zmq.PUB)  # a live socket in the shared directory
    squatter.linger = 0
    squatter.bind(pubs["shared"])
    try:
        for kind, match in (("tcp", "transport"), ("shared", "world-writable"), ("relative", "absolute")):
            want["pub"] = pubs[kind]
            c = ProfileClient(ep, timeout_ms=2000, env={})
            with pytest.raises(DaemonUnavailable, match=match):
                c.subscribe()
            assert c._sub is None
            c.close()
    finally:
        squatter.close(linger=0)
    want["pub"] = pubs["ok"]
    c = ProfileClient(ep, timeout_ms=2000, env={})
    c.subscribe()
    assert c._sub is not None
    c.close()


def test_subscribe_over_tcp_takes_only_the_port_from_the_reply(plain) -> None:
    """The SUB socket connects to the advertised port on the host the requests go to: a reply naming another host
    never sends the client there and is not refused (refusing it would refuse a wildcard-bound daemon's `tcp://*:P`
    and another name of the host, `localhost`, with it), and a PUB endpoint without a port is refused."""
    port = free_port()
    want = {"pub": "tcp://10.9.9.9:5"}
    plain(f"tcp://127.0.0.1:{port}", lambda req: ok_reply(req["id"], hello_result(want["pub"])))
    for ep, pub, host in ((f"tcp://127.0.0.1:{port}", "tcp://10.9.9.9:5", "127.0.0.1"),
                          (f"tcp://127.0.0.1:{port}", f"tcp://*:{port + 1}", "127.0.0.1"),
                          (f"tcp://localhost:{port}", f"tcp://0.0.0.0:{port + 1}", "localhost"),
                          (f"tcp://localhost:{port}", f"tcp://127.0.0.1:{port + 1}", "localhost")):
        want["pub"] = pub
        c = ProfileClient(ep, timeout_ms=2000, env={}, allow_insecure_tcp=True)
        c.subscribe()
        assert c._sub is not None and c.sub_endpoint == f"tcp://{host}:{pub.rpartition(':')[2]}", (pub, c.sub_endpoint)
        c.close()
    for pub, match in (("tcp://127.0.0.1", "port"), ("tcp://127.0.0.1:0", "port"), (f"ipc:///tmp/x{port}", "transport")):
        want["pub"] = pub
        c = ProfileClient(f"tcp://127.0.0.1:{port}", timeout_ms=2000, env={}, allow_insecure_tcp=True)
        with pytest.raises(DaemonUnavailable, match=match):
            c.subscribe()
        assert c._sub is None
        c.close()


# -- 2: the reply must answer the request; its env is never trusted --------------------------------------------
def key(**kw: Any) -> ProfileKey:
    d: dict[str, Any] = dict(fingerprint=FP, software=SW, transport_family="nvlink", ep_size=2, nodes=1,
                             hidden=QWEN.hidden, intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk,
                             dtype=QWEN.dtype, token_bucket=64)
    d.update(kw)
    return ProfileKey(**d)


def result(k: ProfileKey | None = None, *, knobs: Any = None, env: dict | None = None, **over: Any) -> dict:
    rec = ProfileRecord(key=k or key(), knobs=knobs or default_knobs("nvlink").replace(num_sms=40), latency_us=20.0,
                        spread_us=0.1, backend="local:nccl", provenance="measured")
    res = msgspec.to_builtins(wire.ProfileResult.from_record(
        rec, env=env if env is not None else {"NVSHMEM_REMOTE_TRANSPORT": "none"}))
    res.update(over)
    return res


def resolve(plain, tmp_path: Path, res: Any, **kw: Any) -> tuple[client.Resolution, list[str], PlainRouter]:
    run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    run.mkdir(mode=0o700)
    (run / "daemon.json").write_text(json.dumps({"fingerprint": FP, "software": SW, "transports": ["nvlink"],
                                                 "db": str(tmp_path / "none.db"), "host": socket.gethostname(),
                                                 "running": True, "epoch": "e1"}))
    def answer(req: dict) -> bytes:  # bytes: a raw reply frame with `"id":ID` for the request's id
        if req.get("op") == "fabric":  # this node's facts: what makes a measured profile of FP/SW tuned here
            return ok_reply(req["id"], F.this_node_fabric(FP))
        return res.replace(b'"id":ID', b'"id":%d' % req["id"]) if isinstance(res, bytes) else ok_reply(req["id"], res)

    r = plain(f"ipc://{run}/daemon.sock", answer)
    out, warned = F.resolve_warned(ProfileClient(f"ipc://{run}/daemon.sock", db_path=tmp_path / "none.db",
                                                 timeout_ms=300, env={}), **kw)
    return out, warned, r


MISMATCHES = {
    "ep_size": (result(key(ep_size=4)), {}, "ep_size"),
    "nodes": (result(key(nodes=2)), {}, "nodes"),
    "hidden": (result(key(hidden=QWEN.hidden * 2)), {}, "hidden"),
    "experts": (result(key(experts=QWEN.experts * 2)), {}, "experts"),  # still divides over ep_size 2
    "topk": (result(key(topk=QWEN.topk + 1)), {}, "topk"),
    "dtype": (result(key(dtype="float32")), {}, "dtype"),
    "family": (result(key(transport_family="collective"), knobs=default_knobs("collective")),
               {"transport_family": "nvlink"}, "transport family"),
    "engine_unasked": (result(key(transport_family="megakernel", ep_size=2)), {}, "engine family"),
    "far_bucket": (result(key(token_bucket=4096)), {}, "token bucket 4096"),
    "stale": (result(status="stale"), {}, "status"),
    "superseded": (result(status="superseded"), {}, "status"),
    "bogus_status": (result(status="trusted"), {}, "validate"),
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_reply_that_does_not_answer_the_request_falls_back(plain, tmp_path: Path, kind: str) -> None:
    res, kw, needle = MISMATCHES[kind]
    out, warned, r = resolve(plain, tmp_path, res, **kw)
    assert r.requests and out.source in ("policy", "default"), out
    assert len(warned) == 1 and needle in warned[0], warned


@pytest.mark.parametrize("bucket", [64, 128, 256])
def test_reply_at_a_neighbouring_bucket_is_used(plain, tmp_path: Path, bucket: int) -> None:
    out, warned, _ = resolve(plain, tmp_path, result(key(token_bucket=bucket)))
    assert out.source == "daemon" and out.tuned and not warned


def test_reply_env_is_recomputed_from_its_knobs(plain, tmp_path: Path) -> None:
    # each variable here passes the allow-list, but none is what nvlink knobs on one node need
    lying = {"NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NCCL_MIN_NCHANNELS": "64", "NVSHMEM_IB_ENABLE_IBGDA": "1"}
    out, warned, _ = resolve(plain, tmp_path, result(env=lying))
    assert out.source == "daemon" and out.env == {"NVSHMEM_REMOTE_TRANSPORT": "none"}
    assert len(warned) == 1 and "NCCL_MIN_NCHANNELS" in warned[0]
    # a reply with no env at all still gets what its knobs need (channels is the runtime's own: no NCCL caps)
    ch = default_knobs("collective").replace(channels=8)
    out, warned, _ = resolve(plain, tmp_path, result(key(transport_family="collective"), knobs=ch, env={}))
    assert out.source == "daemon" and out.env == {} and not warned
    ib = default_knobs("ibgda").replace(qps_per_pe=8)
    out, warned, _ = resolve(plain, tmp_path, result(key(transport_family="ibgda"), knobs=ib, env={}))
    assert out.source == "daemon" and out.env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "8" and not warned


def test_env_values_bounded_by_the_knob_ranges() -> None:
    refuse = launcher_env.env_refusal
    for name in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):  # job-wide NCCL caps: never exported
        for val in ("2", "8", "64", "1", "65"):
            assert refuse(name, val) is not None, (name, val)
    assert refuse("NVSHMEM_IBGDA_NUM_RC_PER_PE", "1") is None and refuse("NVSHMEM_IBGDA_NUM_RC_PER_PE", "64") is None
    for bad in ("0", "65", "100000", "01"):
        assert refuse("NVSHMEM_IBGDA_NUM_RC_PER_PE", bad) is not None, bad


# -- 7: deep nesting in a reply is a bad reply, never an exception out of resolve --------------------------------
def test_deeply_nested_reply_is_bad_reply(plain, tmp_path: Path) -> None:
    with pytest.raises(BadReply):
        replies.decode_reply(DEEP)
    with pytest.raises(BadReply):
        replies.decode_result("get_profile", msgspec.Raw(DEEP))
    with pytest.raises(BadReply):
        replies.decode_result("get_profile", msgspec.Raw(b'{"key":' + DEEP + b"}"))
    t0 = time.monotonic()
    out, warned, _ = resolve(plain, tmp_path, b'{"v":1,"id":ID,"ok":true,"epoch":"e","result":' + DEEP + b"}")
    assert out.source in ("policy", "default") and len(warned) == 1 and time.monotonic() - t0 < 2



# -- 7b: no pickle on the wire in the client's direction either (the daemon's: test_daemon_hostile) --------------
def test_a_pickled_reply_is_refused_by_the_decoder_error_of_any_non_json_frame(plain) -> None:
    """A real pickle of a valid hello reply (right id, every field valid) is BadReply, the same error as any frame
    that is not JSON, never unpickled; the same reply as JSON is taken (the control)."""
    ep = f"tcp://127.0.0.1:{free_port()}"

    def envelope(rid: int) -> dict:
        return {"v": 1, "id": rid, "ok": True, "epoch": "e1", "result": hello_result(ep)}

    with pytest.raises(BadReply) as pickled:
        replies.decode_reply(pickle.dumps(envelope(1), protocol=4))
    with pytest.raises(BadReply) as garbage:
        replies.decode_reply(b"\x80\x81\x82not json")
    assert str(pickled.value) == str(garbage.value) and str(pickled.value).startswith("reply does not validate: ")
    encode = {"with": lambda rid: pickle.dumps(envelope(rid), protocol=4)}
    plain(ep, lambda req: encode["with"](req["id"]))
    c = ProfileClient(ep, timeout_ms=2000, retries=0, env={}, allow_insecure_tcp=True)
    try:
        with pytest.raises(BadReply) as over_the_wire:
            c.hello()
        assert str(over_the_wire.value) == str(garbage.value)
        encode["with"] = lambda rid: json.dumps(envelope(rid)).encode()
        assert c.hello().protocol == 1
    finally:
        c.close()

# -- 8: a tracked profile takes only what `resolve` would, and follows a restarted daemon ------------------------
_TRACK_DIRS: list[Path] = []  # each _TrackClient's mkdtemp folder, removed after its test (one per client was left in /tmp)


@pytest.fixture(autouse=True)
def _remove_track_dirs() -> Iterator[None]:
    yield
    while _TRACK_DIRS:
        shutil.rmtree(_TRACK_DIRS.pop(), ignore_errors=True)


class _TrackClient(ProfileClient):
    """A ProfileClient whose get_profile and fabric answers, queued changes and subscription are faked; its judgement
    is the real one, with this node FP/SW (the daemon reports this node's facts, which the client checks)."""

    def __init__(self, answer: Any, job_env: dict[str, str] | None = None, **kw: Any) -> None:
        root = Path(tempfile.mkdtemp(prefix="moetune-track-"))  # mkdtemp: 0700, as a runtime directory must be
        _TRACK_DIRS.append(root)
        run = root / "run"
        run.mkdir(mode=0o700)
        (run / "daemon.json").write_text(json.dumps({"fingerprint": FP, "software": SW, "host": socket.gethostname(),
                                                     "running": True, "epoch": "e1"}))
        super().__init__(f"ipc://{run}/daemon.sock", env={"HOME": str(run.parent), **(job_env or {})}, **kw)
        self.answer, self.changes = answer, []
        self.version, self.epoch, self.restarted = 0, "e1", False

    def subscribe(self, pub_endpoint: str | None = None, topics: tuple[str, ...] = ("",)) -> None:
        pass

    def get_profile(self, **query: Any) -> Any:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def fabric(self, *, timeout_ms: int | None = None) -> wire.FabricResult:
        return wire.FabricResult(**F.this_node_fabric(FP))

    def poll_changes(self, timeout_ms: int = 0) -> list[wire.Change]:
        out, self.changes = self.changes, []
        for ch in out:  # as ProfileClient.poll_changes: a new epoch restarts the versions
            if ch.epoch != self.epoch:
                self.restarted, self.epoch, self.version = True, ch.epoch, 0
        return out


QUERY = {"model": "qwen3-30b", "ep_size": 2, "tokens": 64}


@pytest.mark.parametrize(("over", "why"), [
    ({"status": "stale"}, "status is 'stale'"),
    ({"key": key(ep_size=16, experts=16)}, "key ep_size is"),
    ({"perf_env": {"LD_PRELOAD": "/tmp/evil.so"}}, "perf_env does not validate"),
])
def test_a_tracked_profile_refuses_what_resolve_refuses(over: dict, why: str) -> None:
    """track() must not keep just any reply as `current`: a stale profile of another key or a forged perf_env is
    refused, as resolve refuses them."""
    good = msgspec.convert(result(), wire.ProfileResult)
    t = tracked_profile.TrackedProfile(_TrackClient(good), QUERY)  # type: ignore[arg-type]
    assert t.current == good and t.error is None
    bad = msgspec.structs.replace(good, **over)
    t = tracked_profile.TrackedProfile(_TrackClient(bad), QUERY)  # type: ignore[arg-type]
    assert t.current is None and isinstance(t.error, BadReply) and why in str(t.error), t.error
    t = tracked_profile.TrackedProfile(_TrackClient(BadReply("get_profile result does not validate")), QUERY)  # type: ignore[arg-type]
    assert t.current is None and isinstance(t.error, BadReply)  # kept as its error, not raised out of track()


def _preset_result() -> wire.ProfileResult:
    rec = ProfileRecord(key=key(fingerprint="preset:nvlink-h200x2", software="0" * 16), knobs=default_knobs("nvlink"),
                        latency_us=1.0, spread_us=0.0, backend="model:nvlink-h200x2", provenance="preset")
    return wire.ProfileResult.from_record(rec, env={})


@pytest.mark.parametrize(("answer", "kw", "why"), [
    (_preset_result, {}, "allow_modelled=True"),
    (lambda: msgspec.convert(result(key(fingerprint="a" * 16)), wire.ProfileResult), {"allow_modelled": True},
     "measured on another node"),
    (lambda: msgspec.convert(result(), wire.ProfileResult), {"env_mismatch": "refuse"}, "env_mismatch = refuse"),
    (lambda: msgspec.convert(result(), wire.ProfileResult), {"transport_ok": lambda name: "not built"},
     "transport 'nvlink' is not available"),
])
def test_a_tracked_profile_is_judged_as_resolve_judges_it(answer: Callable[[], wire.ProfileResult], kw: dict,
                                                          why: str) -> None:
    """Beyond the reply checks, a tracked profile gets resolve's judgement: a modelled profile (allow_modelled off),
    one measured on another node, one whose transport is missing or whose environment env_mismatch = refuse passes
    over must not stay `current`."""
    ok = kw.pop("transport_ok", None)
    c = _TrackClient(answer(), **kw)
    t = tracked_profile.TrackedProfile(c, QUERY, ok)
    assert t.current is None and not t.tuned and isinstance(t.error, ProfileRefused), t.error
    assert why in str(t.error), t.error


def test_a_tracked_modelled_profile_is_kept_with_allow_modelled_and_not_called_tuned() -> None:
    t = tracked_profile.TrackedProfile(_TrackClient(_preset_result(), allow_modelled=True), QUERY)  # type: ignore[arg-type]
    assert t.current is not None and t.error is None and not t.tuned
    t = tracked_profile.TrackedProfile(_TrackClient(msgspec.convert(result(), wire.ProfileResult)), QUERY)  # type: ignore[arg-type]
    assert t.current is not None and t.tuned


def test_a_tracked_reply_claiming_a_measurement_of_a_modelling_backend_is_kept_as_what_it_is() -> None:
    """A reply labelled "measured" whose backend does not measure (an older daemon sent its rows' stored label): the
    judgement took it as modelled (not tuned), but `current` kept the claim, so a program reading
    `current.provenance` read a preset's prediction as a measurement."""
    claim = msgspec.convert(result(backend="model:nvlink-h200x2", provenance="measured"), wire.ProfileResult)
    assert claim.provenance == "measured" and claim.measured_on == FP  # the claim as it came
    t = tracked_profile.TrackedProfile(_TrackClient(claim, allow_modelled=True), QUERY)  # type: ignore[arg-type]
    assert t.current is not None and not t.tuned and t.error is None
    assert (t.current.provenance, t.current.measured_on) == ("preset", "preset:nvlink-h200x2"), t.current
    assert t.current.profile_hash == claim.profile_hash and t.current.knobs == claim.knobs


def test_a_tracked_profile_is_judged_under_the_tracking_jobs_options() -> None:
    """track() judges every fetch under the job's own options (an EP buffer built with explicit ones), not the
    config's and variables': otherwise a profile tuned under other data-path options stays `current` and tuned, and
    one tuned under the job's is refused because of a variable the job has overridden."""
    from moetune.runtime.options import RuntimeOptions

    tuned = msgspec.convert(result(runtime_options=RuntimeOptions().data_path()), wire.ProfileResult)
    t = _TrackClient(tuned).track(options=RuntimeOptions(fused_pack=False), **QUERY)
    assert t.current is None and isinstance(t.error, ProfileRefused), t.error
    assert "fused_pack: tuned with true, job has false" in str(t.error)
    assert t.options == RuntimeOptions(fused_pack=False)
    # the job's options win over the variables, as in resolve(options=...)
    t = _TrackClient(tuned, job_env={"MOETUNE_FUSED_PACK": "0"}).track(options=RuntimeOptions(), **QUERY)
    assert t.current == tuned and t.tuned and t.error is None
    t = _TrackClient(tuned, job_env={"MOETUNE_FUSED_PACK": "0"}).track(**QUERY)  # None: the variables, as before
    assert t.current is None and "fused_pack" in str(t.error)
    # and so is every later fetch: a refresh keeps judging under them
    c = _TrackClient(tuned, job_env={"MOETUNE_FUSED_PACK": "0"})
    t = c.track(options=RuntimeOptions(), **QUERY)
    c.changes = [wire.Change(version=2, epoch="e1", kind="profile_updated", ts=0.0)]
    c.answer = msgspec.structs.replace(tuned, version=2)
    t.refresh()
    assert t.current == c.answer and t.tuned
    with pytest.raises(TypeError, match="options must be a RuntimeOptions"):
        _TrackClient(tuned).track(options={"fused_pack": False}, **QUERY)  # type: ignore[arg-type]


def test_a_tracked_profile_follows_a_restarted_daemons_changes() -> None:
    """One poll holding the old daemon's v101 and the new one's v1: the new daemon's v2.. must still be seen (a
    client version left at 101 would drop every later change of the new daemon)."""
    good = msgspec.convert(result(), wire.ProfileResult)
    c = _TrackClient(msgspec.structs.replace(good, version=100))
    t = tracked_profile.TrackedProfile(c, QUERY)  # type: ignore[arg-type]
    assert c.version == 100
    ch = {"kind": "profile_updated", "ts": 0.0}
    c.changes = [wire.Change(version=101, epoch="e1", **ch), wire.Change(version=1, epoch="e2", **ch)]
    c.answer = msgspec.structs.replace(good, version=1)  # the new daemon's snapshot
    t.refresh()
    assert c.version == 1 and c.epoch == "e2"


def test_a_change_whose_fetch_failed_is_fetched_by_the_next_refresh() -> None:
    """The notice is taken off the socket before the fetch: when the daemon stops answering in between, refresh
    raises and the change must stay pending (else the next refresh sees no notice and keeps the old profile)."""
    from moetune.runtime.profiles.errors import DaemonUnavailable

    good = msgspec.convert(result(), wire.ProfileResult)
    c = _TrackClient(msgspec.structs.replace(good, version=1))
    t = tracked_profile.TrackedProfile(c, QUERY)  # type: ignore[arg-type]
    newer = msgspec.structs.replace(good, version=2)
    c.changes = [wire.Change(version=2, epoch="e1", kind="profile_updated", ts=0.0)]
    c.answer = DaemonUnavailable("no answer (test)")
    with pytest.raises(DaemonUnavailable):
        t.refresh()
    assert t.current is not None and t.current.version == 1
    c.answer = newer
    t.refresh()  # no new notice: the pending one is fetched
    assert t.current == newer and c.version == 2
    c.answer = DaemonUnavailable("would be fetched (test)")
    assert t.refresh() is False  # nothing pending any more: no fetch


@pytest.mark.parametrize("notices", [
    # the node's fabric changed (a NIC port down, a package upgraded): the profile's fingerprint is left
    [{"kind": "fabric_changed", "fingerprint": "0" * 16, "old_fingerprint": FP}],
    # the same fingerprint on other GPUs: the change names the profiles it made stale
    [{"kind": "fabric_changed", "fingerprint": FP, "old_fingerprint": FP}, {"kind": "profile_stale", "profiles": ["H"]}],
    [{"kind": "profile_stale", "profiles": ["H"]}],
])
def test_a_tracked_profile_announced_stale_is_dropped_even_when_its_fetch_fails(notices: list[dict]) -> None:
    """A notice that the node's fabric changed, or that the held profile was made stale, says the profile no longer
    holds here: when the daemon stops answering before the fetch, `current` must not stay the old fabric's profile
    (served as tuned), as it may after a notice of a new profile (the one held still holds until the fetch)."""
    good = msgspec.convert(result(), wire.ProfileResult)
    c = _TrackClient(msgspec.structs.replace(good, version=1))
    t = tracked_profile.TrackedProfile(c, QUERY)  # type: ignore[arg-type]
    assert t.current is not None and t.tuned
    c.changes = [wire.Change(version=2 + i, epoch="e1", ts=0.0, **{
        k: ([good.profile_hash] if v == ["H"] else v) for k, v in n.items()}) for i, n in enumerate(notices)]
    c.answer = DaemonUnavailable("no answer (test)")
    with pytest.raises(DaemonUnavailable):
        t.refresh()
    assert t.current is None and not t.tuned, t.current
    assert isinstance(t.error, ProfileRefused) and "no longer holds" in str(t.error), t.error
    c.answer = msgspec.structs.replace(good, version=3)  # the daemon answers again: the pending change is fetched
    t.refresh()
    assert t.current is not None and t.tuned and t.error is None


def test_tracking_without_a_daemon_raises_daemon_unavailable(tmp_path: Path) -> None:
    """As documented on ProfileClient.track: tracking needs the daemon's change notices (resolve falls back)."""
    from moetune.runtime.profiles.errors import DaemonUnavailable

    c = ProfileClient(f"ipc://{tmp_path}/none/daemon.sock", timeout_ms=100, retries=0, env={"HOME": str(tmp_path)})
    try:
        with pytest.raises(DaemonUnavailable):
            c.track(**QUERY)
        assert "DaemonUnavailable" in (ProfileClient.track.__doc__ or "")
    finally:
        c.close()
