"""Two daemons in one runtime folder keep to their own daemon.json; a socket set in a config file gets its PUB beside
it, as --socket does; `serve` refuses a metrics port in use (naming the address and option) and a rediscovery
interval the discovery loop cannot wait (inf, nan, absurdly large) with exit 2."""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.config import load_config
from moetune.tuner.cli import app
from moetune.tuner.daemon import server
from moetune.tuner.daemon.endpoints import derive_pub_endpoint
from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


def _daemon(tmp: Path, name: str, sock: str, gpu: str, **kw: Any) -> Daemon:
    facts = F.FakeFacts({"gpu_model": gpu})
    return Daemon(store=F.open_store(tmp / f"{name}.db"), endpoint=f"ipc://{tmp}/run/{sock}",
                  pub_endpoint=f"ipc://{tmp}/run/{name}-events.sock", discover=lambda: facts, rediscover_interval_s=0, **kw)


def _info(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / "run" / "daemon.json").read_text())


# -- 1. a second daemon in the same runtime folder --------------------------------------------------------------
def test_a_second_daemon_leaves_the_live_first_ones_daemon_json(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "run").mkdir(mode=0o700)
    a = _daemon(tmp_path, "a", "daemon.sock", "H100").start(background=True)
    try:
        assert _info(tmp_path)["epoch"] == a.epoch
        with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
            b = _daemon(tmp_path, "b", "b.sock", "H200").start(background=True)
            try:
                info = _info(tmp_path)  # still A's: A's clients judge A's profiles against A's fingerprint
                assert info["epoch"] == a.epoch and info["endpoint"] == a.endpoint and info["running"] is True
                b.rediscover()  # a later write of B's (a rediscovery) leaves it too
                b._write_info(running=True)
                assert _info(tmp_path)["epoch"] == a.epoch
            finally:
                b.stop()
        info = _info(tmp_path)  # B's exit did not mark it stopped: A still runs
        assert info["epoch"] == a.epoch and info["running"] is True
        warned = [r.getMessage() for r in caplog.records if "not writing" in r.getMessage()]
        assert warned and str(tmp_path / "run" / "daemon.json") in warned[0] and a.endpoint in warned[0]
        assert f"pid {info['pid']}" in warned[0]
    finally:
        a.stop()
    assert _info(tmp_path)["epoch"] == a.epoch and _info(tmp_path)["running"] is False


def test_a_stopped_daemons_daemon_json_is_taken_over(tmp_path: Path) -> None:
    """Only a live daemon keeps its file: once it stopped, the next daemon's start replaces it (as before)."""
    (tmp_path / "run").mkdir(mode=0o700)
    _daemon(tmp_path, "a", "daemon.sock", "H100").start(background=True).stop()
    b = _daemon(tmp_path, "b", "b.sock", "H200").start(background=True)
    try:
        assert _info(tmp_path)["epoch"] == b.epoch and _info(tmp_path)["running"] is True
    finally:
        b.stop()


# -- 2. the PUB socket's default: one rule for a config file and --socket ------------------------------------------
def _config(tmp: Path, body: str) -> Path:
    f = tmp / "moetune.toml"
    f.write_text(body)
    return f


def test_a_socket_set_in_a_config_file_gets_its_pub_beside_it(tmp_path: Path) -> None:
    env = {"MOETUNE_HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    f = _config(tmp_path, f'[daemon]\nsocket = "ipc://{tmp_path}/a-run/daemon.sock"\n')
    assert load_config(f, env).daemon.pub_socket == f"ipc://{tmp_path}/a-run/events.sock"
    f = _config(tmp_path, '[daemon]\nsocket = "tcp://127.0.0.1:45710"\n')
    assert load_config(f, env).daemon.pub_socket == "tcp://127.0.0.1:45711"  # TCP, as the socket (not IPC)
    env_sock = {**env, "MOETUNE_DAEMON_SOCKET": f"ipc://{tmp_path}/e/d.sock"}
    assert load_config(None, env_sock).daemon.pub_socket == f"ipc://{tmp_path}/e/events.sock"
    f = _config(tmp_path, f'[daemon]\nsocket = "tcp://127.0.0.1:45710"\npub_socket = "ipc://{tmp_path}/p.sock"\n')
    assert load_config(f, env).daemon.pub_socket == f"ipc://{tmp_path}/p.sock"  # a pub_socket set is kept
    from moetune.runtime.config import pub_socket_beside

    for sock in (f"ipc://{tmp_path}/x/d.sock", "tcp://127.0.0.1:45710", "tcp://[::1]:7000"):  # --socket: same rule
        assert derive_pub_endpoint(sock) == pub_socket_beside(sock)


def test_serve_with_a_config_socket_publishes_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MOETUNE_CONFIG", raising=False)
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake_daemon(**kw: Any) -> Any:
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(server, "Daemon", fake_daemon)
    for sock, pub in ((f"ipc://{tmp_path}/a-run/daemon.sock", f"ipc://{tmp_path}/a-run/events.sock"),
                      ("tcp://127.0.0.1:45710", "tcp://127.0.0.1:45711")):
        f = _config(tmp_path, f'[daemon]\nsocket = "{sock}"\n')
        with pytest.raises(Stop):
            server.run_daemon(config=f, db=str(tmp_path / "m.db"), store_hook="daemon_fakes:open_store")
        assert seen["endpoint"] == sock and seen["pub_endpoint"] == pub
        assert seen.get("metrics_option", "").startswith("daemon.metrics_port (in ")
    with pytest.raises(Stop):
        server.run_daemon(config=f, db=str(tmp_path / "m.db"), store_hook="daemon_fakes:open_store", metrics_port=9)
    assert seen["metrics_option"] == "--metrics-port"  # the option the error will name
    f = _config(tmp_path, '[daemon]\nsocket = "tcp://127.0.0.1:65535"\n')  # no port + 1: the error says what to set
    with pytest.raises(DaemonConfigError, match="pub_socket"):
        server.run_daemon(config=f, db=str(tmp_path / "m.db"), store_hook="daemon_fakes:open_store")


# -- 3. serve's option checks ---------------------------------------------------------------------------------------
def test_a_metrics_port_in_use_names_the_address_and_option(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir(mode=0o700)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        d = _daemon(tmp_path, "a", "daemon.sock", "H100", metrics_port=port)
        with pytest.raises(DaemonConfigError) as e:
            d.start()
        assert f"daemon.metrics_port {port}" in str(e.value) and f"127.0.0.1:{port}" in str(e.value)
        assert "in use" in str(e.value)
        assert not (tmp_path / "run" / "daemon.sock").exists()  # nothing left serving
    finally:
        taken.close()


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e300", "-1"])
def test_serve_refuses_a_rediscover_interval_it_cannot_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            value: str) -> None:
    started: list[Any] = []
    monkeypatch.setattr(server, "run_daemon", lambda **kw: started.append(kw) or 0)
    r = CliRunner().invoke(app, ["serve", "--rediscover-interval", value, "--db", str(tmp_path / "m.db")],
                           env={"COLUMNS": "200", "MOETUNE_HOME": str(tmp_path / "home")})
    assert r.exit_code == 2, r.output
    assert "--rediscover-interval" in r.output and "0 = never" in r.output
    assert not started and not (tmp_path / "m.db").exists()  # refused before anything starts


def test_a_rediscover_interval_the_loop_cannot_wait_is_refused_from_config_too(tmp_path: Path) -> None:
    env_home = {"MOETUNE_HOME": str(tmp_path / "home")}
    for value in ("inf", "nan", "1e12"):
        f = _config(tmp_path, f"[daemon]\nrediscover_interval_s = {value}\n")
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env_home.items():
                mp.setenv(k, v)
            # ConfigError (inf, nan: not finite, refused by load_config) or DaemonConfigError (1e12): both exit 2
            with pytest.raises(ValueError, match=r"daemon\.rediscover_interval_s in .*moetune\.toml"):
                server.run_daemon(config=f, db=str(tmp_path / "m.db"), store_hook="daemon_fakes:open_store")
        with pytest.raises(DaemonConfigError, match="rediscover_interval_s"):
            Daemon(store=None, endpoint=f"ipc://{tmp_path}/run/d.sock", rediscover_interval_s=float(value))
    assert not (tmp_path / "m.db").exists()
    Daemon(store=None, endpoint=f"ipc://{tmp_path}/run/d.sock", rediscover_interval_s=0)  # 0 = never, as documented
