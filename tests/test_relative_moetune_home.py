"""A relative MOETUNE_HOME (`MOETUNE_HOME=relhome moetune status`) made the daemon's socket
`ipc://relhome/run/daemon.sock`, which status, query, retune and serve refused as "invalid client.socket (config)
... expected ipc:///absolute/path" (serve after creating relhome/moetune.db). runtime/paths.py's moetune_home
makes it absolute against the current directory, so every path under it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime import paths
from moetune.runtime.config import load_config
from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(60)


def test_a_relative_moetune_home_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = {"MOETUNE_HOME": "relhome", "HOME": str(tmp_path)}
    assert paths.moetune_home(env) == tmp_path / "relhome"
    assert paths.default_db_path(env) == tmp_path / "relhome" / "moetune.db"
    assert paths.runtime_dir(env) == tmp_path / "relhome" / "run"
    cfg = load_config(env=env)
    assert cfg.client.socket == f"ipc://{tmp_path / 'relhome' / 'run' / 'daemon.sock'}"
    assert paths.endpoint_problem(cfg.client.socket, bind=True) is None


def test_status_with_a_relative_moetune_home_looks_for_the_daemon_there(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = {"MOETUNE_HOME": "relhome", "HOME": str(tmp_path), "MOETUNE_CONFIG": "",
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_RUNTIME_DIR": ""}
    r = CliRunner().invoke(app, ["status", "--timeout-ms", "50"], env=env)
    assert r.exit_code == 1, r.output  # no daemon: not a refused socket (exit 2)
    assert "invalid client.socket" not in r.output and "absolute" not in r.output, r.output
    assert str(tmp_path / "relhome" / "run" / "daemon.sock") in " ".join(r.output.split()), r.output


def test_a_deep_moetune_home_falls_back_in_query_and_says_what_to_do_in_status(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A MOETUNE_HOME deep enough that its run/daemon.sock passes the 107 bytes of a unix socket path made `query`
    exit 2 ("invalid client.socket (config)", a key the user never set) where the runtime's lookup fell back to the
    database; `status` refused naming no way out. Now `query` falls back as the runtime does and says why, and
    `status` names the byte count and what to change."""
    home = tmp_path / ("h" * 110)
    monkeypatch.chdir(tmp_path)
    env = {"MOETUNE_HOME": str(home), "HOME": str(tmp_path), "MOETUNE_CONFIG": "",
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_RUNTIME_DIR": "", "COLUMNS": "400"}
    sock = len(str(home / "run" / "daemon.sock").encode())
    r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--json",
                                 "--timeout-ms", "50"], env=env)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["source"] == "policy", res  # the policy default: no database there
    assert f"a unix socket path is at most 107 bytes, this one is {sock}" in res["message"], res
    r = CliRunner().invoke(app, ["status", "--timeout-ms", "50"], env=env)
    flat = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert f"this one is {sock}" in flat and "use a shorter MOETUNE_HOME" in flat and "Traceback" not in flat, flat


def test_serve_on_a_deep_moetune_home_says_what_to_do_and_creates_nothing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` on a MOETUNE_HOME whose run/daemon.sock passes 107 bytes gave the byte count but no way out (`query`
    and `status` name one), and said it only after it had created the database there. Now it says what to change,
    as they do, before anything is made."""
    home = tmp_path / ("h" * 110)
    home.mkdir()
    monkeypatch.chdir(tmp_path)
    env = {"MOETUNE_HOME": str(home), "HOME": str(tmp_path), "MOETUNE_CONFIG": "",
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_RUNTIME_DIR": "", "COLUMNS": "400"}
    sock = len(str(home / "run" / "daemon.sock").encode())
    r = CliRunner().invoke(app, ["serve"], env=env)
    flat = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert f"this one is {sock}" in flat and "use a shorter MOETUNE_HOME" in flat and "daemon.socket" in flat, flat
    assert list(home.iterdir()) == [], list(home.iterdir())  # no database, no lock file, no run/ folder


def test_a_socket_given_too_long_gets_no_moetune_home_hint(tmp_path: Path) -> None:
    """The hint is for a socket the user never set: one typed with --socket is theirs to shorten."""
    from moetune.tuner.daemon.endpoints import check_endpoint
    from moetune.tuner.daemon.errors import DaemonConfigError

    long = f"ipc://{tmp_path / ('s' * 120)}"
    with pytest.raises(DaemonConfigError) as e:
        check_endpoint(long, "--socket")
    assert "MOETUNE_HOME" not in str(e.value) and "at most 107 bytes" in str(e.value)
    # outside moetune's runtime folder: the hint names the key to set, not MOETUNE_HOME (the test below)
    with pytest.raises(DaemonConfigError, match=r"name a shorter socket with daemon\.socket"):
        check_endpoint(long, "daemon.socket (defaults)")


def test_a_long_socket_set_by_a_variable_is_not_called_the_default(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """MOETUNE_DAEMON_SOCKET (or a file) naming a socket too long got the default socket's hint: "it is the default
    under $MOETUNE_HOME/run ...: use a shorter MOETUNE_HOME", which neither is nor helps. That hint is for a socket in
    moetune's runtime folder; one set elsewhere is told to name a shorter one."""
    from moetune.tuner.daemon.endpoints import check_endpoint
    from moetune.tuner.daemon.errors import DaemonConfigError

    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    mine = f"ipc://{tmp_path / ('s' * 120) / 'daemon.sock'}"
    with pytest.raises(DaemonConfigError) as e:
        check_endpoint(mine, "daemon.socket (environment variable MOETUNE_DAEMON_SOCKET)")
    said = str(e.value)
    assert "MOETUNE_HOME" not in said and "the default" not in said, said
    assert "name a shorter socket with daemon.socket" in said, said
    deep = tmp_path / ("h" * 110)
    monkeypatch.setenv("MOETUNE_HOME", str(deep))
    with pytest.raises(DaemonConfigError, match="use a shorter MOETUNE_HOME"):
        check_endpoint(f"ipc://{deep / 'run' / 'daemon.sock'}", "daemon.socket (defaults)")


def test_status_names_the_daemon_socket_variable_a_too_long_client_socket_came_from(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's socket defaults to the daemon's: a too-long MOETUNE_DAEMON_SOCKET made `status` refuse
    "client.socket (config)", a key the user never set. The error names the variable the socket came from."""
    monkeypatch.chdir(tmp_path)
    sock = tmp_path / ("s" * 120) / "d.sock"
    env = {"MOETUNE_HOME": str(tmp_path / "home"), "HOME": str(tmp_path), "MOETUNE_CONFIG": "",
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_RUNTIME_DIR": "", "COLUMNS": "400",
           "MOETUNE_DAEMON_SOCKET": f"ipc://{sock}"}
    r = CliRunner().invoke(app, ["status", "--timeout-ms", "50"], env=env)
    flat = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "invalid daemon.socket (environment variable MOETUNE_DAEMON_SOCKET" in flat and "client.socket (config)" not in flat, flat
    assert "Traceback" not in flat, flat
