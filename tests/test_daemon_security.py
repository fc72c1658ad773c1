"""IPC permissions (owner only; another user cannot connect), TCP refused without CURVE unless allowed,
CURVE round trip, and `moetune keys generate` file modes."""

from __future__ import annotations

import os
import pwd
import socket
import stat
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonUnavailable
from moetune.runtime.testing.launch import free_port
from moetune.tuner.cli import app
from moetune.tuner.cli.keys import generate_keys
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ipc_daemon():
    import shutil
    import tempfile

    # a world-traversable parent (pytest's tmp root is 0700): only the runtime dir's own mode keeps others out
    tmp = Path(tempfile.mkdtemp(prefix="moetune-sec-", dir="/tmp"))
    os.chmod(tmp, 0o755)
    try:
        with F.seeded_daemon(tmp, interval=0) as (d, _facts):
            yield d
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_ipc_dir_and_socket_modes(ipc_daemon: F.DaemonProc) -> None:
    run = ipc_daemon.run_dir
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    for name in ("daemon.sock", "events.sock", "daemon.json"):
        st = os.stat(run / name)
        assert st.st_uid == os.getuid()
        assert stat.S_IMODE(st.st_mode) == 0o600, name


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another user (nobody) in a child")
def test_other_user_cannot_connect(ipc_daemon: F.DaemonProc) -> None:
    nobody = pwd.getpwnam("nobody")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, try the socket both raw and through the client
        code = 0
        try:
            os.close(r)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            if not os.access(ipc_daemon.tmp, os.X_OK):
                code |= 8  # control: the parent must be open, so the runtime dir is what keeps us out
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(str(ipc_daemon.run_dir / "daemon.sock"))
                code |= 1  # connected: permissions failed
            except PermissionError:
                pass
            finally:
                s.close()
            import zmq

            c = ProfileClient(ipc_daemon.endpoint, timeout_ms=200, retries=0, context=zmq.Context())  # fresh after fork
            try:
                c.hello()
                code |= 2
            except DaemonUnavailable:
                pass
            finally:
                c.close()
        except BaseException:
            code |= 4
        os.write(w, bytes([code]))
        os._exit(0)
    os.close(w)
    _, _status = os.waitpid(pid, 0)
    code = os.read(r, 1)
    os.close(r)
    assert code == b"\x00", f"child as nobody: code {code!r} (1=raw connect worked, 2=client got a reply, 4=error, 8=parent not traversable)"
    # the owner still can
    c = ProfileClient(ipc_daemon.endpoint, timeout_ms=1000)
    assert c.hello().protocol == 1
    c.close()


def test_group_mode(tmp_path: Path) -> None:
    """With a configured group the directory is 0750 and the socket 0660 (group of the process here; as root another
    group, nogroup: root's files are of its own group already, whether or not the daemon gives them to the group)."""
    import grp

    gid = os.getgid()
    if os.geteuid() == 0:
        gid = next((g.gr_gid for g in grp.getgrall() if g.gr_name == "nogroup"), 65534)
    group = grp.getgrgid(gid).gr_name
    facts = F.make_capture(tmp_path / "capture")
    store = F.open_store(tmp_path / "db.sqlite")
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=lambda: facts,
               rediscover_interval_s=0, group=group).start(background=True)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o750
        assert stat.S_IMODE(os.stat(tmp_path / "run" / "daemon.sock").st_mode) == 0o660
        assert os.stat(tmp_path / "run" / "daemon.sock").st_gid == gid
        assert os.stat(tmp_path / "run").st_gid == gid
    finally:
        d.stop()
    assert not (tmp_path / "run" / "daemon.sock").exists()


def test_tcp_without_curve_refused(tmp_path: Path) -> None:
    facts = F.make_capture(tmp_path / "capture")
    store = F.open_store(tmp_path / "db.sqlite")
    port = free_port()
    with pytest.raises(DaemonConfigError, match="CURVE"):
        Daemon(store=store, endpoint=f"tcp://127.0.0.1:{port}", discover=lambda: facts, rediscover_interval_s=0).start()
    # and through the command line: exit code 2 with a clear message, nothing listening
    d = F.DaemonProc(tmp_path, endpoint=f"tcp://127.0.0.1:{port}")
    try:
        assert d.proc.wait(20) == 2
        assert "CURVE" in d.read_log()
    finally:
        d.kill()
    # explicitly allowed (trusted loopback test): serves
    d = F.DaemonProc(tmp_path, endpoint=f"tcp://127.0.0.1:{port}", extra=["--allow-insecure-tcp"], interval=0)
    try:
        assert d.wait_ready(allow_insecure_tcp=True).protocol == 1  # the client must opt in to plain text too
        assert "INSECURE" in d.read_log()
    finally:
        d.kill()


def test_curve_round_trip(tmp_path: Path) -> None:
    public, secret = generate_keys(tmp_path / "keys")
    for p in (public, secret):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    import zmq.auth

    server_pub, _ = zmq.auth.load_certificate(str(public))
    facts = F.make_capture(tmp_path / "capture")
    F.seed_profiles(F.open_store(tmp_path / "moetune.db"), facts)
    port, pub_port = free_port(), free_port()
    cfg = tmp_path / "moetune.toml"
    cfg.write_text(f'[daemon]\ncurve_secret_key_file = "{secret}"\ncurve_public_key_file = "{public}"\n')
    # the daemon lets in only allowed client keys (issue 19): this client's public key is in keys/clients/
    from moetune.tuner.cli.keys import allow_client

    cpub_file, csec_file = generate_keys(tmp_path / "client", "client")
    allow_client(cpub_file, tmp_path / "keys" / "clients")
    cpub, csec = zmq.auth.load_certificate(str(csec_file))
    ck = dict(curve_server_key=server_pub, curve_public_key=cpub, curve_secret_key=csec)
    d = F.DaemonProc(tmp_path, endpoint=f"tcp://127.0.0.1:{port}", interval=0,
                     extra=["--config", str(cfg), "--pub-socket", f"tcp://127.0.0.1:{pub_port}"])
    try:
        hello = d.wait_ready(**ck)
        assert hello.pub_endpoint.endswith(str(pub_port))
        c = ProfileClient(d.endpoint, timeout_ms=2000, **ck)
        assert c.get_profile(ep_size=2, tokens=100, model="qwen3-30b").key.token_bucket == 64
        c.subscribe(hello.pub_endpoint)
        c.close()
        # a plain-text client gets nothing (the CURVE handshake fails)
        plain = ProfileClient(d.endpoint, timeout_ms=300, retries=0)
        with pytest.raises(DaemonUnavailable):
            plain.hello()
        plain.close()
        # a client with the wrong server key gets nothing either: the allowed client key pair, so that the server key
        # is the only thing wrong (a throwaway client pair is refused by the allow-list whatever the server key)
        wrong_pub, _ = zmq.curve_keypair()
        bad = ProfileClient(d.endpoint, timeout_ms=300, retries=0, curve_server_key=wrong_pub, curve_public_key=cpub,
                            curve_secret_key=csec)
        with pytest.raises(DaemonUnavailable):
            bad.hello()
        bad.close()
        assert d.proc.poll() is None
    finally:
        d.kill()


def test_keys_generate_cli(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["keys", "generate", str(tmp_path / "k"), "--json"])
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o700
    r2 = CliRunner().invoke(app, ["keys", "generate", str(tmp_path / "k")])
    assert r2.exit_code == 2 and "exists" in r2.output
    time.sleep(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another user (nobody) in a child")
def test_other_user_reads_database_readonly(tmp_path: Path) -> None:
    """The runtime's fallback as an unprivileged user: a WAL database in a directory it cannot write."""
    import shutil
    import tempfile

    from moetune.runtime.profiles.db_lookup import query_db_profiles
    from moetune.runtime.shapes import MODELS

    base = Path(tempfile.mkdtemp(prefix="moetune-ro-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        store = F.open_store(base / "moetune.db")
        F.seed_profiles(store, F.FakeFacts({"gpu_model": "H200"}))
        if hasattr(store, "close"):
            store.close()
        os.chmod(base / "moetune.db", 0o644)
        m = MODELS["qwen3-30b"]
        nobody = pwd.getpwnam("nobody")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            n = 255
            try:
                os.close(r)
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                n = len(query_db_profiles(base / "moetune.db", ep_size=2, nodes=1, hidden=m.hidden,
                                          intermediate=m.intermediate, experts=m.experts, topk=m.topk, dtype=m.dtype))
            except BaseException:
                n = 254
            os.write(w, bytes([n]))
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        got = os.read(r, 1)
        os.close(r)
        assert got == bytes([3]), f"nobody read {got!r} profiles (254 = error)"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_curve_allow_list_path_with_glob_characters(tmp_path: Path) -> None:
    """The allow-list the daemon checked is the one ZAP answers from: a key folder named `keys[1]` let in the keys of
    a sibling `keys1/clients` (pyzmq's configure_curve(location=...) globbed the path, unescaped), and refused the
    keys actually allowed in `keys[1]/clients`."""
    import shutil

    import zmq.auth

    from moetune.tuner.cli.keys import allow_client

    keys = tmp_path / "keys[1]"
    public, secret = generate_keys(keys, "server")
    good_pub, good_sec = generate_keys(tmp_path / "good", "good")
    allow_client(good_pub, keys / "clients")
    evil_dir = tmp_path / "keys1" / "clients"  # what the glob `keys[1]` matches
    evil_dir.mkdir(parents=True)
    evil_pub, evil_sec = generate_keys(tmp_path / "evil", "evil")
    shutil.copy(evil_pub, evil_dir / "evil.key")
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts)
    port, pub_port = free_port(), free_port()
    d = Daemon(store=store, discover=lambda: facts, rediscover_interval_s=0, endpoint=f"tcp://127.0.0.1:{port}",
               pub_endpoint=f"tcp://127.0.0.1:{pub_port}", curve_secret_key_file=str(secret)).start(background=True)
    server_pub, _ = zmq.auth.load_certificate(str(public))

    def client(secret_file: Path) -> ProfileClient:
        cp, cs = zmq.auth.load_certificate(str(secret_file))
        return ProfileClient(d.endpoint, timeout_ms=1500, retries=0, curve_server_key=server_pub,
                             curve_public_key=cp, curve_secret_key=cs)

    try:
        good = client(good_sec)
        assert good.hello().protocol == 1
        good.close()
        evil = client(evil_sec)
        with pytest.raises(DaemonUnavailable):
            evil.hello()
        evil.close()
    finally:
        d.stop()
