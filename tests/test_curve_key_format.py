"""A CURVE key file whose key is not a CURVE key (40 Z85 characters) is refused by name.

zmq takes such a key only when it is set on a socket, and then says a bare "Invalid argument": the client's fallback
said "cannot connect to tcp://...: Invalid argument", naming no file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.curve_keys import read_curve_key_file
from moetune.runtime.profiles.errors import DaemonUnavailable
from moetune.runtime.testing.launch import free_port
from moetune.tuner.cli.keys import allow_everywhere, generate_keys

pytestmark = pytest.mark.timeout(60)


def _setup(tmp: Path) -> tuple[Path, Path, Path]:
    """(the daemon's secret key file, its keys dir, a client's public key file allowed there)."""
    keys = tmp / "keys"
    _, secret = generate_keys(keys)
    pub, _ = generate_keys(tmp / "alice", "alice")
    allowed = allow_everywhere(pub, keys, None, None, admin=False, force=False)
    return secret, keys, allowed[0]


def _spoil(path: Path, field: str) -> None:
    """Replace the `field` key ("public-key" or "secret-key") of a key file by a string that is no CURVE key."""
    text = path.read_text()
    path.write_text(re.sub(rf'{field} = "[^"]*"', f'{field} = "not-a-curve-key"', text))


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
