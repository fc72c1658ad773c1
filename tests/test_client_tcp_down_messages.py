"""A query against a tcp:// daemon that is down or does not answer said only "no reply from the daemon at ... within N
ms" where the IPC path says what is wrong and what to do ("no daemon socket ...; start one with `moetune serve`"). The
request socket's monitor (CONNECTED / CONNECT_RETRIED) now watches every tcp:// endpoint, plain text too (the tests'
loopback allowance; the CLI refuses plain TCP up front), so a refused connection says nothing listens there, and a
time-out names the endpoint, the budget and where it is set, and what to check (the daemon running: `moetune serve`,
`systemctl status moetune`; with CURVE its key and allow-list)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonTimeout, DaemonUnavailable
from moetune.runtime.testing.launch import free_port
from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def mute_port(taken_port: int) -> int:
    """A loopback port whose listener never accepts nor answers (conftest's `taken_port`): the kernel completes the
    connection (backlog), as for a daemon that is hung, or something that is not a daemon."""
    return taken_port


def _ask(endpoint: str) -> Exception:
    c = ProfileClient(endpoint, timeout_ms=300, allow_insecure_tcp=True)
    try:
        with pytest.raises(DaemonUnavailable) as ei:
            c.status()
        return ei.value
    finally:
        c.close()


def test_plain_tcp_to_a_stopped_daemon_says_nothing_listens_there() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    e = _ask(endpoint)
    assert not isinstance(e, DaemonTimeout) and "no reply" not in str(e), e
    assert f"nothing accepts connections at {endpoint}" in str(e), e
    assert "`moetune serve`" in str(e) and "`systemctl status moetune`" in str(e), e


def test_a_tcp_time_out_names_the_endpoint_the_budget_and_what_to_check(mute_port: int) -> None:
    endpoint = f"tcp://127.0.0.1:{mute_port}"
    e = _ask(endpoint)
    said = str(e)
    assert isinstance(e, DaemonTimeout), e
    assert said.startswith(f"no reply from the daemon at {endpoint} within 300 ms"), said
    assert "client.timeout_ms" in said and "--timeout-ms" in said, said
    assert "the connection was made but nothing answered" in said and "`systemctl status moetune`" in said, said
    assert "allow-list" not in said, said  # plain text: no CURVE key to check


def test_the_cli_says_it_for_a_curve_client(tmp_path: Path, mute_port: int) -> None:
    from moetune.tuner.cli.keys import generate_keys

    server_pub, _ = generate_keys(tmp_path / "keys")
    endpoint = f"tcp://127.0.0.1:{mute_port}"
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[client]\nsocket = "{endpoint}"\ncurve_server_key_file = "{server_pub}"\n')
    home = tmp_path / "h"
    r = CliRunner().invoke(app, ["status", "--config", str(cfg), "--timeout-ms", "300"],
                           env={"MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"),
                                "MOETUNE_CONFIG": "", "COLUMNS": "200"})
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and "Traceback" not in out, r.output
    assert f"no reply from the daemon at {endpoint} within 300 ms" in out, out
    assert "`systemctl status moetune`" in out and "`moetune keys allow`" in out and "allow-list" in out, out


@pytest.mark.parametrize("curve", [False, True])
def test_a_daemon_that_closes_the_connection_mid_request_is_said_so_without_keys(curve: bool) -> None:
    """A daemon that accepted the connection and took the request, then vanished (SIGKILL: its side of the connection
    closed) was said as a connection "made but nothing answered", with CURVE keys and the allow-list to check: the
    client's monitor saw that connection closed (DISCONNECTED after CONNECTED). A real ROUTER on loopback stands for
    it: it receives the request, then closes without answering."""
    import threading

    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    kw: dict = {"allow_insecure_tcp": True}
    if curve:  # a CURVE daemon without a ZAP handler takes any client key: the handshake completes
        server_pub, server_sec = zmq.curve_keypair()
        router.curve_server, router.curve_secretkey = True, server_sec
        pub, sec = zmq.curve_keypair()
        kw = {"curve_server_key": server_pub, "curve_public_key": pub, "curve_secret_key": sec}
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got = threading.Event()

    def serve_then_vanish() -> None:
        try:
            if router.poll(5000):
                router.recv_multipart()
                got.set()
        finally:
            router.close(linger=0)  # the daemon's side closes, no reply sent

    t = threading.Thread(target=serve_then_vanish)
    t.start()
    endpoint = f"tcp://127.0.0.1:{port}"
    c = ProfileClient(endpoint, timeout_ms=1000, **kw)
    try:
        with pytest.raises(DaemonTimeout) as ei:
            c.status()
    finally:
        c.close()
        t.join(10)
        ctx.term()
    assert got.is_set()  # the request reached it: the connection was made
    said = str(ei.value)
    assert said.startswith(f"no reply from the daemon at {endpoint} within 1000 ms"), said
    assert ("the connection was made, then closed by the daemon's side before it answered (daemon stopped or "
            "restarted?)") in said, said
    assert "allow-list" not in said and "curve_server_key_file" not in said, said
    # the refused reconnection after the close rules out a PUB socket (it is never reconnected to): not said
    assert "pub_socket" not in said, said


@pytest.mark.parametrize("peer", ["curve daemon", "other zmtp service"])
def test_a_plain_client_whose_handshake_is_broken_off_is_not_told_the_peer_uses_curve(peer: str) -> None:
    """A plain-text client whose handshake the peer broke off was told "the daemon ... uses CURVE", also where the
    peer was no moetune daemon (another ZMTP service: here one speaking the PLAIN mechanism). The client cannot tell
    them apart: it says both, the CURVE key to set and the daemon.socket to check."""
    import zmq

    ctx = zmq.Context()
    peer_sock = ctx.socket(zmq.ROUTER)
    peer_sock.linger = 0
    if peer == "curve daemon":
        _, server_sec = zmq.curve_keypair()
        peer_sock.curve_server, peer_sock.curve_secretkey = True, server_sec
    else:
        peer_sock.plain_server = True
    endpoint = f"tcp://127.0.0.1:{peer_sock.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        said = str(_ask(endpoint))
    finally:
        peer_sock.close(linger=0)
        ctx.term()
    assert said.startswith(f"the peer at {endpoint} broke off the handshake: a daemon using CURVE"), said
    assert "client.curve_server_key_file" in said, said
    assert "not a moetune daemon request socket (is this its daemon.socket, not its pub_socket?)" in said, said
    assert "it uses CURVE" not in said, said


def _pub_hint_asked(endpoint: str) -> str:
    """What a plain client asking `endpoint` (a PUB socket) is told: mostly a time-out after CONNECTED then DISCONNECTED
    (libzmq 4.3.5 gives no handshake-failed event for the socket-type mismatch), at times a broken-off handshake
    (whichever side reads the other's READY first): both must name the pub_socket."""
    said = str(_ask(endpoint))
    assert said.startswith((f"no reply from the daemon at {endpoint} within 300 ms", f"the peer at {endpoint}")), said
    return said


def test_a_plain_client_at_a_pub_socket_is_told_it_may_not_be_the_request_socket() -> None:
    """A plain client pointed at a PUB socket (a daemon's pub_socket: port + 1, a common mistake) was told only that
    the daemon's side closed the connection "(daemon stopped or restarted?)". Nothing reconnects nor refuses after
    that close (libzmq drops the mismatched session for good), so the client says the endpoint may be a pub_socket."""
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        said = _pub_hint_asked(endpoint)
    finally:
        pub.close(linger=0)
        ctx.term()
    assert "pub_socket" in said and "daemon.socket" in said, said


def test_a_plain_client_at_a_real_daemons_pub_socket_is_told_so(tmp_path: Path) -> None:
    d = F.in_process_daemon(tmp_path, endpoint=f"tcp://127.0.0.1:{free_port()}", allow_insecure_tcp=True)
    d.start(background=True)
    try:
        said = _pub_hint_asked(d.pub_endpoint)
    finally:
        d.stop()
    assert "pub_socket" in said and "daemon.socket" in said, said


def test_an_ipc_client_at_the_daemons_pub_socket_is_told_which_socket_to_use(tmp_path: Path) -> None:
    """Over ipc:// the daemon.json beside the sockets names the pub_socket: the client says the endpoint is it, and
    names the daemon's request socket, instead of "its socket is there but nothing answered"."""
    d = F.in_process_daemon(tmp_path).start(background=True)
    try:
        c = ProfileClient(d.pub_endpoint, timeout_ms=300)
        try:
            with pytest.raises(DaemonTimeout) as ei:
                c.status()
        finally:
            c.close()
    finally:
        d.stop()
    said = str(ei.value)
    assert (f"{d.pub_endpoint} is the daemon's pub_socket (its daemon.json says so), not its request socket: point "
            f"client.socket at its daemon.socket {d.endpoint}") in said, said
    assert "nothing answered" not in said, said


def _curve_daemon(tmp: Path) -> tuple[object, bytes, bytes, bytes]:
    """A real CURVE daemon on loopback TCP (its pub_socket on another port) and one allowed client:
    (daemon, server public key, client public key, client secret key)."""
    import zmq.auth

    from moetune.tuner.cli.keys import allow_everywhere, generate_keys

    server_pub, server_sec = generate_keys(tmp / "keys")
    alice_pub, alice_sec = generate_keys(tmp / "alice", "alice")
    allow_everywhere(alice_pub, tmp / "keys", None, None, admin=False, force=False)
    d = F.in_process_daemon(tmp, endpoint=f"tcp://127.0.0.1:{free_port()}",
                            pub_endpoint=f"tcp://127.0.0.1:{free_port()}", curve_secret_key_file=str(server_sec))
    server_key, _ = zmq.auth.load_certificate(str(server_pub))
    cp, cs = zmq.auth.load_certificate(str(alice_sec))
    assert cs is not None
    return d, server_key, cp, cs


@pytest.mark.parametrize("where", ["bare curve pub", "daemon's pub_socket", "request socket, wrong server key"])
def test_a_curve_client_at_a_pub_socket_is_told_it_may_not_be_the_request_socket(tmp_path: Path, where: str) -> None:
    """A CURVE client pointed at a CURVE PUB socket (a daemon's pub_socket: port + 1) gets HANDSHAKE_FAILED_NO_DETAIL
    and reconnects, exactly as with a wrong server key at the request socket: it was told only that its server key is
    wrong. The two cannot be told apart from the events, so each is said with both causes."""
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    d = None
    try:
        if where == "bare curve pub":
            server_key, server_sec = zmq.curve_keypair()
            pub.curve_server, pub.curve_secretkey = True, server_sec
            endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
            cp, cs = zmq.curve_keypair()
        else:
            d, server_key, cp, cs = _curve_daemon(tmp_path)
            d.start(background=True)
            endpoint = d.pub_endpoint if where == "daemon's pub_socket" else d.endpoint
            if where.endswith("wrong server key"):
                server_key, _ = zmq.curve_keypair()
        c = ProfileClient(endpoint, timeout_ms=500, curve_server_key=server_key, curve_public_key=cp,
                          curve_secret_key=cs)
        try:
            with pytest.raises(DaemonUnavailable) as ei:
                c.status()
        finally:
            c.close()
    finally:
        if d is not None:
            d.stop()
        pub.close(linger=0)
        ctx.term()
    said = str(ei.value)
    assert said.startswith(f"the daemon at {endpoint} broke off the CURVE handshake"), said
    assert "is not that daemon's public key" in said, said
    assert (f"or this is not the daemon's request socket (its pub_socket is {endpoint}? by default that is "
            "daemon.socket's port + 1): point client.socket at its daemon.socket") in said, said
