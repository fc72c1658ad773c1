"""A CURVE key file that is not a regular file (a FIFO, a device) was opened and read as one: the open of a FIFO
without a writer waits for ever. `ProfileClient(...)` (every EP buffer's autoload, whose lookup is bounded in time)
hung in its constructor on a client.curve_server_key_file / MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE that is a FIFO,
`moetune keys allow FIFO DIR` hung, and so did `moetune serve` on such a secret key or a `*.key` of its allow-list.
Each now says the file is not a regular file, at once (daemon.json, lock files and --db were already read that way)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.curve_keys import read_curve_key_file
from moetune.runtime.testing.launch import free_port
from moetune.tuner.cli import app
from moetune.tuner.cli.keys import generate_keys
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(30)


def _fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)
    return path


def test_the_client_refuses_a_fifo_as_the_daemons_key_at_once(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "daemon.key")
    with pytest.raises(ValueError, match="not a regular file"):
        read_curve_key_file(fifo)
    t0 = time.monotonic()
    c = ProfileClient("tcp://127.0.0.1:5999", env={"MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE": str(fifo),
                                                   "HOME": str(tmp_path), "MOETUNE_CONFIG": ""})
    try:
        assert time.monotonic() - t0 < 5
        assert c._refusal is not None and "not a regular file" in c._refusal
    finally:
        c.close()


def test_keys_allow_refuses_a_fifo(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys")
    fifo = _fifo(tmp_path / "client.key")
    r = CliRunner().invoke(app, ["keys", "allow", str(fifo), str(tmp_path / "keys")])
    assert r.exit_code == 2, r.output
    assert "not a regular file" in r.output


def test_the_daemon_refuses_a_fifo_key_at_start(tmp_path: Path) -> None:
    _public, secret = generate_keys(tmp_path / "keys")
    clients = tmp_path / "keys" / "clients"
    clients.mkdir(mode=0o700)
    _fifo(clients / "stranger.key")

    def daemon(secret_file: Path) -> Daemon:
        return Daemon(store=F.open_store(tmp_path / "m.db"), endpoint=f"tcp://127.0.0.1:{free_port()}", discover=None,
                      rediscover_interval_s=0, curve_secret_key_file=str(secret_file))

    d = daemon(secret)
    with pytest.raises(DaemonConfigError, match="not a regular file"):
        d.start()
    os.unlink(clients / "stranger.key")
    (tmp_path / "fifokeys").mkdir(mode=0o700)
    d = daemon(_fifo(tmp_path / "fifokeys" / "moetune.key_secret"))
    with pytest.raises(DaemonConfigError, match="not a regular file"):
        d.start()
