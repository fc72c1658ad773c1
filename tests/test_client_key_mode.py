"""The profile client warns when its own CURVE secret key file could be read or changed by other users."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import zmq.auth

from moetune.runtime import _once
from moetune.runtime.profiles.client import ProfileClient


def _client(tmp: Path, mode: int) -> ProfileClient:
    server_pub, _ = zmq.auth.create_certificates(str(tmp), "server")
    _, client_secret = zmq.auth.create_certificates(str(tmp), "client")
    os.chmod(client_secret, mode)
    cfg = tmp / "moetune.toml"
    cfg.write_text(f'[client]\nsocket = "tcp://127.0.0.1:9"\ncurve_server_key_file = "{server_pub}"\n'
                   f'curve_secret_key_file = "{client_secret}"\n')
    env = {"MOETUNE_CONFIG": str(cfg), "HOME": str(tmp), "XDG_CONFIG_HOME": str(tmp / "xdg")}
    return ProfileClient(timeout_ms=100, env=env)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_secret_key_others_can_read_or_change_is_warned_once(tmp_path: Path, mode: int,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    _once.reset()
    with caplog.at_level(logging.WARNING, logger="moetune"):
        c = _client(tmp_path, mode)
        c.close()
        c = _client(tmp_path, mode)  # same file again: said once per process
        c.close()
    said = [r.getMessage() for r in caplog.records if "can be read or changed by other users" in r.getMessage()]
    assert len(said) == 1, said
    assert f"mode {mode:o}" in said[0] and "client.key_secret" in said[0]


def test_a_private_secret_key_is_not_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _once.reset()
    with caplog.at_level(logging.WARNING, logger="moetune"):
        _client(tmp_path, 0o600).close()
    assert not [r for r in caplog.records if "other users" in r.getMessage()]


def test_the_cli_still_shows_the_loose_key_warning(tmp_path: Path) -> None:
    """`status` drops the client's "not connecting" log line (it reports the reason itself), never its other
    warnings: a secret key readable by others must reach the user."""
    import subprocess
    import sys

    server_pub, _ = zmq.auth.create_certificates(str(tmp_path), "server")
    _, client_secret = zmq.auth.create_certificates(str(tmp_path), "client")
    os.chmod(client_secret, 0o644)
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[client]\nsocket = "tcp://127.0.0.1:9"\ncurve_server_key_file = "{server_pub}"\n'
                   f'curve_secret_key_file = "{client_secret}"\n')
    home = tmp_path / "h"
    env = dict(os.environ, MOETUNE_HOME=str(home), HOME=str(home), XDG_CONFIG_HOME=str(home / "cfg"),
               MOETUNE_CONFIG="", COLUMNS="200")
    r = subprocess.run([sys.executable, "-c", "import sys; from moetune.tuner.cli import main; sys.exit(main())",
                        "status", "--config", str(cfg), "--timeout-ms", "200"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert "Traceback" not in r.stderr, r.stderr
    assert "can be read or changed by other users" in " ".join(r.stderr.split()), r.stderr


def test_a_curve_clients_socket_can_be_remade_at_once_many_times() -> None:
    """Each retry closes the socket and its handshake monitor and makes new ones at once: the new monitor must not
    collide with the old one's inproc name (pyzmq's default name reuses the socket's fd): such a collision escapes
    request() as a ZMQError ("Address already in use") instead of DaemonUnavailable."""
    spub, _ = zmq.curve_keypair()
    c = ProfileClient("tcp://127.0.0.1:9", timeout_ms=1, curve_server_key=spub, env={})
    try:
        for _ in range(400):
            c._socket()
            assert c._mon is not None  # the monitor was made (a name collision would leave it None, quietly)
            c._reset()
    finally:
        c.close()


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o604, 0o620, 0o602, 0o644, 0o666])
@pytest.mark.parametrize("owner", ["self", "self-not-root", "other"])
@pytest.mark.parametrize("folder", [0o700, 0o755, 0o775, 0o757])
def test_the_client_warns_exactly_where_the_daemon_refuses(tmp_path: Path, mode: int, owner: str, folder: int,
                                                           caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule (`paths.secret_key_checks` + `paths.loose_key_path`) for a secret key and its folder: the client
    warns about its own key exactly when the daemon would refuse that key as its own. `self-not-root`: the key of a
    user who is not root (run as root, "self" is root, whose files pass whatever the rule says of this user's)."""
    from moetune.runtime.profiles.curve_keys import warn_loose_secret
    from moetune.tuner.daemon.auth import check_secret_key_file
    from moetune.tuner.daemon.errors import DaemonConfigError

    if owner == "other" and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    keys = tmp_path / "keys"
    keys.mkdir()
    key = keys / "client.key_secret"
    key.write_text("k")
    key.chmod(mode)
    keys.chmod(folder)
    if owner == "other":
        os.chown(key, 65534, 65534)
    if owner == "self-not-root" and os.geteuid() == 0:  # (not root: "self" is such a user already)
        os.chown(key, 65534, 65534)
        monkeypatch.setattr(os, "geteuid", lambda: 65534)  # this process as the key's owner, uid 65534
    try:
        check_secret_key_file(key)
        refused = False
    except DaemonConfigError:
        refused = True
    _once.reset()
    with caplog.at_level(logging.WARNING, logger="moetune"):
        warn_loose_secret(str(key))
    said = [r.getMessage() for r in caplog.records if "other users" in r.getMessage()]
    assert bool(said) == refused == (owner == "other" or bool(mode & 0o066) or bool(folder & 0o022)), said
    if said and not (owner == "other" or mode & 0o066):
        assert f"the folder {keys} (mode {folder:o}" in said[0] and "replace the key" in said[0]


@pytest.mark.parametrize(("mode", "folder", "warned"), [
    (0o644, 0o755, False), (0o600, 0o700, False), (0o664, 0o755, True), (0o646, 0o755, True),
    (0o644, 0o775, True), (0o644, 0o757, True), (0o644, 0o1777, False)])
def test_a_server_key_others_can_change_is_warned_once(tmp_path: Path, mode: int, folder: int, warned: bool,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The daemon's public key file is what the client takes the daemon's key from: whoever may change it, or replace
    it in its folder (writable by group or others, not sticky), can pose as the daemon over TCP. Said once per file,
    like a loose secret key of the client's own; readable by all is fine (a public key), and so is its owner (the
    file is often the daemon operator's, shared with the clients)."""
    keys = tmp_path / "server-keys"
    keys.mkdir()
    server_pub, _ = zmq.auth.create_certificates(str(keys), "server")
    os.chmod(server_pub, mode)
    keys.chmod(folder)
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
           "MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE": str(server_pub)}
    _once.reset()
    with caplog.at_level(logging.WARNING, logger="moetune"):
        for _ in range(2):  # the same file again: said once per process
            ProfileClient("tcp://127.0.0.1:9", timeout_ms=100, env=env).close()
    said = [r.getMessage() for r in caplog.records if "pose as the daemon" in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        where = str(server_pub) if mode & 0o022 else f"the folder {keys}"
        assert where in said[0] and f"mode {(mode if mode & 0o022 else folder) & 0o7777:o}" in said[0], said[0]
