"""The daemon's own key files (its CURVE secret key, each `*.key` of its client allow-list) were checked by path
(owner, mode: `check_key_path`) and then read by path again (zmq.auth.load_certificate), and the secret key a third
time at each TCP bind: a file put at the path between the check and the read was read unchecked (a world-readable
secret key, an allow-list key nobody vetted). Each is now opened once (O_NONBLOCK: a FIFO cannot hang the start),
judged on fstat of that descriptor and read from it, and the binds use the keys read at start."""

from __future__ import annotations

import builtins
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.testing.launch import free_port
from moetune.tuner.cli.keys import allow_everywhere, generate_keys
from moetune.tuner.daemon import auth
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


def _swap_after_check(monkeypatch: pytest.MonkeyPatch, target: Path, replacement: Path) -> list[Path]:
    """Once `target` has been judged (auth.loose_key_path), put `replacement` at its path: what another process
    could do between a check by path and a read by path. Returns the list of swaps made (one at most)."""
    real = auth.loose_key_path
    swapped: list[Path] = []

    def judge_then_swap(p: object, **kw: object) -> object:
        got = real(p, **kw)  # type: ignore[arg-type]
        if Path(str(p)) == target and not swapped:
            os.replace(replacement, target)
            swapped.append(target)
        return got

    monkeypatch.setattr(auth, "loose_key_path", judge_then_swap)
    return swapped


def test_an_allow_list_key_put_in_place_after_its_check_is_not_read(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import zmq.auth

    keys = tmp_path / "keys"
    generate_keys(keys)
    alice, _ = generate_keys(tmp_path / "alice", "alice")
    allow_everywhere(alice, keys, None, None, admin=False, force=False)
    mallory, _ = generate_keys(tmp_path / "mallory", "mallory")
    os.chmod(mallory, 0o666)  # loose: judged by path after the swap, it would be refused
    listed = keys / "clients" / "alice.key"
    swapped = _swap_after_check(monkeypatch, listed, mallory)
    got = auth.load_client_keys(keys / "clients")
    assert swapped == [listed]
    assert got == [zmq.auth.load_certificate(str(alice))[0]], "the key read is not the key judged"


def test_the_secret_key_served_is_the_one_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zmq.auth

    keys = tmp_path / "keys"
    spub_file, secret = generate_keys(keys)
    alice_pub, alice_sec = generate_keys(tmp_path / "alice", "alice")
    allow_everywhere(alice_pub, keys, None, None, admin=False, force=False)
    _, other_secret = generate_keys(tmp_path / "other", "other")
    os.chmod(other_secret, 0o644)  # readable by all: the daemon must never take it as its key
    swapped = _swap_after_check(monkeypatch, secret, other_secret)
    d = Daemon(store=F.open_store(tmp_path / "m.db"), discover=lambda: F.FakeFacts({"gpu_model": "H200"}),
               rediscover_interval_s=0, endpoint=f"tcp://127.0.0.1:{free_port()}",
               pub_endpoint=f"tcp://127.0.0.1:{free_port()}", curve_secret_key_file=str(secret))
    d.start(background=True)
    try:
        assert swapped == [secret]
        apub, asec = zmq.auth.load_certificate(str(alice_sec))
        c = ProfileClient(d.endpoint, timeout_ms=3000, curve_server_key=zmq.auth.load_certificate(str(spub_file))[0],
                          curve_public_key=apub, curve_secret_key=asec)
        try:
            c.request("status")  # the CURVE handshake with the judged key: the daemon serves with it
        finally:
            c.close()
    finally:
        d.stop()


def test_the_daemons_key_reads_need_no_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the descriptor, parsed here: no /proc/self/fd path (the daemon serves where /proc is not mounted)."""
    import zmq.auth

    _public, secret = generate_keys(tmp_path / "keys")
    want = zmq.auth.load_certificate(str(secret))
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if str(p).startswith("/proc/") else real(p))
    # as where /proc is not mounted: opening a path under it fails too (patching exists alone let a read through
    # /proc/self/fd/N pass here, where /proc is mounted)
    real_open, real_os_open = builtins.open, os.open

    def no_proc(p: object) -> None:
        if str(p).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory (no /proc in this test)", str(p))

    monkeypatch.setattr(builtins, "open", lambda p, *a, **kw: no_proc(p) or real_open(p, *a, **kw))
    monkeypatch.setattr(os, "open", lambda p, *a, **kw: no_proc(p) or real_os_open(p, *a, **kw))
    assert auth.load_curve_keys(secret, check=True) == want
    with pytest.raises(DaemonConfigError, match=r"cannot read the CURVE key file .*: it does not exist"):
        auth.load_curve_keys(tmp_path / "none.key_secret")
    junk = tmp_path / "keys" / "junk.key_secret"
    junk.write_text("# no keys here\npublic-key\n")
    os.chmod(junk, 0o600)
    with pytest.raises(DaemonConfigError, match="No public key found in"):
        auth.load_curve_keys(junk, check=True)


# key texts zmq.auth.load_certificate and a reader of its own could read apart (hand-edited files)
_A, _B, _S = b"A" * 40, b"B" * 40, b"S" * 40
_TEXTS = {
    "two public-key lines": b"curve\n    public-key = \"%s\"\n    public-key = \"%s\"\n" % (_A, _B),
    "a second one after both": b"public-key = '%s'\nsecret-key = '%s'\npublic-key = '%s'\n" % (_A, _S, _B),
    "an empty one first": b"public-key = \"\"\npublic-key = \"%s\"\n" % _A,
    "a longer name": b"public-key-of-b = \"%s\"\n" % _B,
    "no equals sign": b"curve\n    public-key\n",
    "carriage returns": b"public-key = \"%s\"\r\nsecret-key = \"%s\"\r\n" % (_A, _S),
    "comment": b"# public-key = \"%s\"\npublic-key = \"%s\"\n" % (_B, _A),
}


@pytest.mark.parametrize("name", sorted(_TEXTS))
def test_the_daemon_reads_a_key_file_as_zmq_and_the_clients_do(tmp_path: Path, name: str) -> None:
    """The daemon parses its key files from the descriptor it judged (`auth._keys_in`), while `moetune keys allow`,
    `query` and the clients read them through zmq.auth.load_certificate: the daemon took the FIRST of two
    `public-key` lines and zmq the last, so an allow-list file edited by hand let in another key than the one the
    tools read from it. Both now read the same key, or both refuse the file; and a `public-key` line without `=`
    (zmq raised IndexError, a traceback out of `keys allow` and the client) is refused in words."""
    import zmq.auth

    from moetune.runtime.profiles.curve_keys import read_key_file_as_opened

    f = tmp_path / "k.key"
    f.write_bytes(_TEXTS[name])
    try:
        theirs: tuple[bytes, bytes | None] | None = zmq.auth.load_certificate(str(f))
    except (ValueError, IndexError):
        theirs = None
    ours = auth._keys_in(_TEXTS[name])
    assert (None if ours[0] is None else ours) == theirs, (ours, theirs)
    if theirs is None:
        with pytest.raises(ValueError, match="holds no CURVE public key"):
            read_key_file_as_opened(f)
    else:
        assert read_key_file_as_opened(f)[:2] == theirs
