"""A CURVE key file whose key is not a CURVE key (40 Z85 characters) is refused by name, by the daemon and the client.

zmq takes such a key only when it is set on a socket, and then says a bare "Invalid argument": the client's fallback
said "cannot connect to tcp://...: Invalid argument", naming no file; `moetune serve` printed "moetune serve: Invalid
argument" for a broken secret key file, and a broken key in the allow-list started a daemon with an entry that lets
nobody in, without a word.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.curve_keys import is_curve_key, read_curve_key_file
from moetune.runtime.profiles.errors import DaemonUnavailable
from moetune.runtime.testing.launch import free_port
from moetune.tuner.cli.keys import allow_everywhere, generate_keys
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


def _setup(tmp: Path) -> tuple[Path, Path, Path]:
    """(the daemon's secret key file, its keys dir, a client's public key file allowed there)."""
    keys = tmp / "keys"
    _, secret = generate_keys(keys)
    pub, _ = generate_keys(tmp / "alice", "alice")
    allowed = allow_everywhere(pub, keys, None, None, admin=False, force=False)
    return secret, keys, allowed[0]


def _spoil(path: Path, field: str, key: str = "not-a-curve-key") -> None:
    """Replace the `field` key ("public-key" or "secret-key") of a key file by `key`, a string that is no CURVE key."""
    text = path.read_text()
    path.write_text(re.sub(rf'{field} = "[^"]*"', f'{field} = "{key}"', text))


# 40 characters of Z85's alphabet whose 5-character groups are each past 32 bits (85**5 > 2**32): zmq's z85.decode
# raised struct.error on it, which no reader caught
PAST_32_BITS = "#" * 40


def test_client_names_a_server_key_file_whose_key_is_not_a_curve_key(tmp_path: Path) -> None:
    _, keys, _ = _setup(tmp_path)
    public = keys / "moetune.key"
    _spoil(public, "public-key")
    with pytest.raises(ValueError, match="not a CURVE key"):
        read_curve_key_file(public)
    c = ProfileClient(f"tcp://127.0.0.1:{free_port()}", timeout_ms=50,
                      env={"MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE": str(public), "HOME": str(tmp_path)})
    with pytest.raises(DaemonUnavailable, match=rf"{re.escape(str(public))}.*not a CURVE key"):
        c.hello()
    c.close()


def test_a_key_pair_file_whose_secret_key_is_not_a_curve_key_is_refused_by_the_reader(tmp_path: Path) -> None:
    """The client's own key pair (client.curve_secret_key_file) is read by the same reader."""
    _, secret = generate_keys(tmp_path / "mine", "mine")
    assert read_curve_key_file(secret)[1] is not None  # as generated: read
    _spoil(secret, "secret-key")
    with pytest.raises(ValueError, match="secret key that is not a CURVE key"):
        read_curve_key_file(secret)


def _daemon(tmp: Path, secret: Path) -> Daemon:
    return Daemon(store=F.open_store(tmp / "moetune.db"), discover=lambda: F.FakeFacts({"gpu_model": "H200"}),
                  rediscover_interval_s=0, endpoint=f"tcp://127.0.0.1:{free_port()}",
                  pub_endpoint=f"tcp://127.0.0.1:{free_port()}", curve_secret_key_file=str(secret))


@pytest.mark.parametrize("field", ["secret-key", "public-key"])
def test_daemon_names_a_secret_key_file_whose_key_is_not_a_curve_key(tmp_path: Path, field: str) -> None:
    secret, _, _ = _setup(tmp_path)
    _spoil(secret, field)
    d = _daemon(tmp_path, secret)
    with pytest.raises(DaemonConfigError, match=rf"{re.escape(str(secret))}.*not a CURVE key"):
        d.start()


@pytest.mark.parametrize("admin", [False, True], ids=["allow-list", "admin-list"])
def test_daemon_names_a_listed_key_that_is_not_a_curve_key(tmp_path: Path, admin: bool) -> None:
    secret, keys, allowed = _setup(tmp_path)
    if admin:
        allowed = allow_everywhere(tmp_path / "alice" / "alice.key", keys, None, None, admin=True, force=False)[1]
    _spoil(allowed, "public-key")
    d = _daemon(tmp_path, secret)
    with pytest.raises(DaemonConfigError, match=rf"{re.escape(str(allowed))}.*not a CURVE key"):
        d.start()


def test_serve_names_a_broken_secret_key_file_without_a_traceback(tmp_path: Path) -> None:
    secret, _, _ = _setup(tmp_path)
    _spoil(secret, "secret-key")
    cfg = tmp_path / "srv.toml"
    cfg.write_text(f'[daemon]\ncurve_secret_key_file = "{secret}"\n')
    # a process of its own: `serve` sets up the daemon's logging, which must not leak into the other tests
    r = subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "serve", "--config", str(cfg),
                        "--create", "--db", str(tmp_path / "moetune.db"), "--socket", f"tcp://127.0.0.1:{free_port()}",
                        "--rediscover-interval", "0"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, r.stderr
    assert str(secret) in r.stderr and "not a CURVE key" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_z85_characters_past_32_bits_are_no_curve_key(tmp_path: Path) -> None:
    """Such a key is refused by name like any other that is no key: it raised struct.error out of the client's
    constructor (the job, instead of its fallback chain) and out of the daemon's start (a traceback)."""
    assert not is_curve_key(PAST_32_BITS.encode())
    secret, keys, allowed = _setup(tmp_path)
    public = keys / "moetune.key"
    _spoil(public, "public-key", PAST_32_BITS)
    with pytest.raises(ValueError, match="not a CURVE key"):
        read_curve_key_file(public)
    c = ProfileClient(f"tcp://127.0.0.1:{free_port()}", timeout_ms=50,
                      env={"MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE": str(public), "HOME": str(tmp_path)})
    with pytest.raises(DaemonUnavailable, match=rf"{re.escape(str(public))}.*not a CURVE key"):
        c.hello()
    c.close()
    _spoil(allowed, "public-key", PAST_32_BITS)
    d = _daemon(tmp_path, secret)
    with pytest.raises(DaemonConfigError, match=rf"{re.escape(str(allowed))}.*not a CURVE key"):
        d.start()
