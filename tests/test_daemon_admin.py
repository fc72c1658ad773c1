"""Who may re-tune: reading profiles is open to every peer the daemon lets in, the administrative op
(`retune`: queue or cancel a re-tune, which runs benchmarks on the node's GPUs) only to admins: on IPC the
daemon's own user or root (and, with `group_may_retune`, members of `group`), on TCP a CURVE client in the
admin list, never a plain-text TCP peer. Before this, any peer allowed to connect could queue and cancel."""

from __future__ import annotations

import grp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonError
from moetune.runtime.testing.launch import free_port
from moetune.tuner.daemon.auth import peer_credentials
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(120)

RETUNE = b'{"v":1,"id":7,"op":"retune","all":true,"reason":"test"}'


def _seeded(tmp: Path, **kw) -> Daemon:
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp / "moetune.db")
    F.seed_profiles(store, facts)
    kw.setdefault("endpoint", f"ipc://{tmp}/run/daemon.sock")
    return Daemon(store=store, discover=lambda: facts, rediscover_interval_s=0, retune_job=F.fake_retune,
                  **kw).start(background=True)


class _Peer:
    """A stand-in for a request's frame: the connection metadata libzmq would attach."""

    def __init__(self, **props: str) -> None:
        self.props = props

    def get(self, name: str) -> str:
        if name not in self.props:
            raise zmq.ZMQError(zmq.EINVAL)
        return self.props[name]


def _code(reply: bytes | None) -> str | None:
    assert reply is not None
    rep = msgspec.json.decode(reply)
    return None if rep["ok"] else rep["error"]["code"]


def test_ipc_credentials_are_the_connecting_process() -> None:
    """The admin check rests on libzmq reporting SO_PEERCRED in Peer-Address: if a libzmq build stops doing
    so, the owner would be refused, and this says why."""
    d = Path(tempfile.mkdtemp())
    ctx = zmq.Context()
    r, c = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        r.bind(f"ipc://{d}/s")
        c.connect(f"ipc://{d}/s")
        c.send(b"x")
        assert r.poll(5000)
        first = r.recv(copy=False)
        assert peer_credentials(first) == (os.geteuid(), os.getegid())
    finally:
        r.close(0)
        c.close(0)
        ctx.term()
        shutil.rmtree(d)


def test_ipc_peer_of_another_user_is_refused_and_nothing_is_queued(tmp_path: Path) -> None:
    d = _seeded(tmp_path)
    try:
        stranger = _Peer(**{"Peer-Address": "localhost:4242:4242:999"})
        reply, op, outcome = d._handle(RETUNE, [b"id"], stranger)  # type: ignore[arg-type]
        assert (op, outcome, _code(reply)) == ("retune", wire.E_FORBIDDEN, wire.E_FORBIDDEN)
        assert "uid 4242" in msgspec.json.decode(reply)["error"]["message"]
        cancel = b'{"v":1,"id":8,"op":"retune","cancel":1}'
        assert _code(d._handle(cancel, [b"id"], stranger)[0]) == wire.E_FORBIDDEN  # type: ignore[arg-type]
        no_creds = _Peer(**{"Peer-Address": "localhost"})
        assert _code(d._handle(RETUNE, [b"id"], no_creds)[0]) == wire.E_FORBIDDEN  # type: ignore[arg-type]
        # reading stays open to the same peer
        hello = b'{"v":1,"id":9,"op":"hello"}'
        assert _code(d._handle(hello, [b"id"], stranger)[0]) is None  # type: ignore[arg-type]
        assert d.jobs.info() == ([], None, [])
        # the owner, over the real socket: allowed
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        assert c.retune(all=True, reason="owner").job is not None
        c.close()
    finally:
        d.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_ipc_group_member_reads_but_retunes_only_with_group_may_retune() -> None:
    try:
        gid = grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pytest.skip("no 'nogroup' group on this machine")
    def as_nobody(endpoint: str) -> str:
        """hello then retune from a forked child running as nobody:nogroup (a new ZeroMQ context there: the
        parent's is never used across the fork); the reply codes come back through a pipe."""
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            out = "error"
            try:
                os.close(rfd)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(65534)
                ctx = zmq.Context()
                s = ctx.socket(zmq.DEALER)
                s.linger = 0
                s.connect(endpoint)
                codes = []
                for body in (b'{"v":1,"id":1,"op":"hello"}', RETUNE):
                    s.send(body)
                    if not s.poll(5000):
                        codes.append("no-reply")
                        break
                    rep = msgspec.json.decode(s.recv())
                    codes.append("ok" if rep["ok"] else rep["error"]["code"])
                out = " ".join(codes)
            finally:
                os.write(wfd, out.encode())
                os._exit(0)
        os.close(wfd)
        with os.fdopen(rfd) as f:
            got = f.read()
        os.waitpid(pid, 0)
        return got

    for may, expected in ((False, "ok forbidden"), (True, "ok ok")):
        base = Path(tempfile.mkdtemp(dir="/tmp"))
        base.chmod(0o755)  # the other user must reach the runtime dir (0750, group nogroup) inside it
        try:
            d = _seeded(base, group="nogroup", group_may_retune=may)
            try:
                assert as_nobody(d.endpoint) == expected
            finally:
                d.stop()
        finally:
            shutil.rmtree(base)



def _a_group_nobody_is_not_in() -> grp.struct_group:
    """A group that uid 65534 (nobody) is not in: neither its passwd group nor one listing it. The nobody test above
    cannot tell members from others (its peer runs with the configured group as its own: a member whatever the
    check says); a peer outside the group can. As root any group will do (the daemon gives its files to it), else
    one of this process's."""
    import pwd

    try:
        nobody = pwd.getpwuid(65534)
    except KeyError:
        pytest.skip("no user 65534 on this machine")
    mine = None if os.geteuid() == 0 else {os.getgid(), os.getegid(), *os.getgroups()}
    for g in grp.getgrall():
        if g.gr_gid not in (0, nobody.pw_gid) and nobody.pw_name not in g.gr_mem and (mine is None or g.gr_gid in mine):
            return g
    pytest.skip("no group that uid 65534 is not in, which this process may give its files to")


def test_user_in_group_is_true_for_members_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import pwd

    from moetune.tuner.daemon.auth import user_in_group

    g = _a_group_nobody_is_not_in()
    nobody = pwd.getpwuid(65534)
    assert not user_in_group(65534, nobody.pw_gid, g.gr_gid)
    unknown = next(u for u in range(4242, 5242) if u not in {p.pw_uid for p in pwd.getpwall()})
    assert not user_in_group(unknown, nobody.pw_gid, g.gr_gid)  # no passwd entry: no membership to look up
    # members: running with the group, the group of its passwd entry, or listed in the group
    assert user_in_group(65534, g.gr_gid, g.gr_gid)
    assert user_in_group(65534, g.gr_gid, nobody.pw_gid)
    listed, real = grp.struct_group((g.gr_name, "x", g.gr_gid, [nobody.pw_name])), grp.getgrgid
    monkeypatch.setattr(grp, "getgrgid", lambda gid: listed if gid == g.gr_gid else real(gid))
    assert user_in_group(65534, nobody.pw_gid, g.gr_gid)


def test_ipc_peer_outside_the_group_is_refused_a_retune_with_group_may_retune(tmp_path: Path) -> None:
    import pwd

    g = _a_group_nobody_is_not_in()
    nobody = pwd.getpwuid(65534)
    d = _seeded(tmp_path, group=g.gr_name, group_may_retune=True)
    try:
        outsider = _Peer(**{"Peer-Address": f"localhost:65534:{nobody.pw_gid}:999"})
        reply, op, outcome = d._handle(RETUNE, None, outsider)  # type: ignore[arg-type]
        assert (op, outcome, _code(reply)) == ("retune", wire.E_FORBIDDEN, wire.E_FORBIDDEN)
        message = msgspec.json.decode(reply)["error"]["message"]
        assert f"members of group {g.gr_name!r}" in message and "this peer runs as uid 65534" in message, message
        assert d.jobs.info() == ([], None, [])
        # the same user running with the group as its own is a member: allowed (no head: answered inline)
        member = _Peer(**{"Peer-Address": f"localhost:65534:{g.gr_gid}:999"})
        assert _code(d._handle(RETUNE, None, member)[0]) is None  # type: ignore[arg-type]
    finally:
        d.stop()

def _curve_daemon(tmp: Path) -> tuple[Daemon, bytes, dict[str, tuple[bytes, bytes]]]:
    import zmq.auth

    from moetune.tuner.cli.keys import allow_everywhere, generate_keys

    keys = tmp / "keys"
    _, server_secret = generate_keys(keys)
    spub, _ = zmq.auth.load_certificate(str(server_secret))
    pairs = {}
    for name, admin in (("alice", False), ("carol", True)):
        pub_file, sec_file = generate_keys(tmp / name, name)
        allow_everywhere(pub_file, keys, None, None, admin=admin, force=False)
        pairs[name] = zmq.auth.load_certificate(str(sec_file))
    port, pub_port = free_port(), free_port()
    d = _seeded(tmp, endpoint=f"tcp://127.0.0.1:{port}", pub_endpoint=f"tcp://127.0.0.1:{pub_port}",
                curve_secret_key_file=str(server_secret))
    return d, spub, pairs


def test_curve_reader_is_refused_a_retune_and_an_admin_may(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETUNE_FAKE_JOB_SLEEP", "20")  # the admin's job is still running when it is cancelled
    d, spub, pairs = _curve_daemon(tmp_path)
    try:
        apub, asec = pairs["alice"]
        alice = ProfileClient(d.endpoint, timeout_ms=2000, curve_server_key=spub, curve_public_key=apub,
                              curve_secret_key=asec)
        assert alice.get_profile(ep_size=2, tokens=100, model="qwen3-30b").key.token_bucket == 64
        with pytest.raises(DaemonError) as e:
            alice.retune(all=True, reason="alice")
        assert e.value.code == wire.E_FORBIDDEN and "admin list" in str(e.value)
        time.sleep(0.2)
        assert d.jobs.info() == ([], None, [])  # the reader queued nothing
        alice.close()
        cpub, csec = pairs["carol"]
        carol = ProfileClient(d.endpoint, timeout_ms=2000, curve_server_key=spub, curve_public_key=cpub,
                              curve_secret_key=csec)
        job = carol.retune(all=True, reason="carol").job
        assert job is not None
        with pytest.raises(DaemonError) as e:  # nor may the reader cancel the admin's job
            alice = ProfileClient(d.endpoint, timeout_ms=2000, curve_server_key=spub, curve_public_key=apub,
                                  curve_secret_key=asec)
            alice.retune(cancel=job.id)
        assert e.value.code == wire.E_FORBIDDEN
        alice.close()
        assert carol.retune(cancel=job.id).job.id == job.id
        carol.close()
    finally:
        d.stop()


def test_plain_text_tcp_peer_is_never_an_admin(tmp_path: Path) -> None:
    port = free_port()
    d = _seeded(tmp_path, endpoint=f"tcp://127.0.0.1:{port}", pub_endpoint=f"tcp://127.0.0.1:{free_port()}",
                allow_insecure_tcp=True)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    try:
        s.connect(d.endpoint)
        s.send(RETUNE)
        assert s.poll(5000)
        rep = msgspec.json.decode(s.recv())
        assert rep["ok"] is False and rep["error"]["code"] == wire.E_FORBIDDEN, rep
        assert d.jobs.info() == ([], None, [])
    finally:
        s.close()
        ctx.term()
        d.stop()


def test_group_may_retune_needs_a_group(tmp_path: Path) -> None:
    with pytest.raises(DaemonConfigError, match=r"group_may_retune needs daemon\.group"):
        Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint=f"ipc://{tmp_path}/run/daemon.sock",
               group_may_retune=True)


def test_keys_allow_admin_lists_the_key_twice_and_admins_dir_alone_is_refused(tmp_path: Path) -> None:
    from moetune.tuner.cli.keys import app, generate_keys

    generate_keys(tmp_path / "keys")
    pub_file, _ = generate_keys(tmp_path / "dave", "dave")
    r = CliRunner().invoke(app, ["allow", str(pub_file), str(tmp_path / "keys"), "--admin"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "keys" / "clients" / "dave.key").is_file()
    assert (tmp_path / "keys" / "admins" / "dave.key").is_file()
    assert "may queue and cancel re-tunes" in r.output
    r = CliRunner().invoke(app, ["client", str(tmp_path / "keys"), "--name", "erin", "--admins-dir", str(tmp_path / "a")])
    assert r.exit_code == 2 and "give --admin too" in r.output
    assert not (tmp_path / "keys" / "client-erin").exists() and not (tmp_path / "a").exists()


def test_keys_admins_dir_default_is_beside_the_server_keys_whatever_the_config(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`keys client|allow --admin` reads no config: the key goes to SERVER_KEYS/admins unless --admins-dir names
    another folder, also where daemon.curve_admins_dir is set. Its help said "(default: SERVER_KEYS/admins;
    daemon.curve_admins_dir)", which reads as a default taken from that key."""
    import typer

    from moetune.tuner.cli.keys import app, generate_keys

    monkeypatch.setenv("MOETUNE_DAEMON_CURVE_ADMINS_DIR", str(tmp_path / "elsewhere"))
    generate_keys(tmp_path / "keys")
    pub_file, _ = generate_keys(tmp_path / "dave", "dave")
    r = CliRunner().invoke(app, ["allow", str(pub_file), str(tmp_path / "keys"), "--admin"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "keys" / "admins" / "dave.key").is_file() and not (tmp_path / "elsewhere").exists()
    group = typer.main.get_command(app)
    for sub in ("client", "allow"):
        (param,) = [p for p in group.commands[sub].params if "--admins-dir" in p.opts]
        assert "reads no config" in param.help and "; daemon.curve_admins_dir)" not in param.help, param.help


def test_the_key_pair_fix_is_a_command_that_pastes_for_a_folder_with_a_space(tmp_path: Path) -> None:
    """check_public_beside's message names `moetune keys generate --force DIR --name NAME` to run: a DIR with a space
    was written bare, so the pasted command took two arguments (shell-quoted now, as db_option quotes --db)."""
    import shlex

    from moetune.tuner.cli.keys import generate_keys
    from moetune.tuner.daemon.auth import check_public_beside

    keys = tmp_path / "daemon keys"
    public, secret = generate_keys(keys, name="node-a")
    other, _ = generate_keys(tmp_path / "other", name="node-a")
    public.write_bytes(other.read_bytes())  # NAME.key of another pair: the cut-short --force's state
    from moetune.runtime.profiles.curve_keys import read_curve_key_file

    with pytest.raises(DaemonConfigError) as e:
        check_public_beside(secret, read_curve_key_file(secret)[0])
    cmd = str(e.value).split("again with `moetune ", 1)[1].split("`", 1)[0]
    assert shlex.split(cmd) == ["keys", "generate", "--force", str(keys), "--name", "node-a"], cmd


def test_a_request_given_up_by_the_stop_is_answered_busy_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A retune whose store write the daemon's stop gave up (StoreStopping behind another writer's lock) is answered
    E_BUSY, "the daemon is stopping", and logged in one line: it went to log.exception (a traceback on `moetune
    serve`'s stderr at such stops) and to the client as E_INTERNAL."""
    import logging

    from moetune.tuner.daemon import handlers
    from moetune.tuner.store import StoreStopping

    def stopping(d: Daemon, req: object) -> object:
        raise StoreStopping("the database x.db is locked by another writer and this process is stopping")

    tmp = Path(tempfile.mkdtemp(dir="/tmp"))
    d = _seeded(tmp)
    try:
        monkeypatch.setattr(handlers, "run_retune", stopping)
        with caplog.at_level(logging.INFO, logger="moetune"):
            reply, _, outcome = d._handle(RETUNE)  # a direct call: the deferred retune answered inline
        assert outcome == wire.E_BUSY and _code(reply) == wire.E_BUSY, reply
        assert b"the daemon is stopping" in (reply or b""), reply
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
