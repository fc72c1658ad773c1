"""Argument checks of the daemon's clients, before anything is sent: `retune --cancel` takes a job id (>= 1) and
not --all; `query --json` is `--format json` and goes with no other format; a tcp:// endpoint's host is checked
(`tcp://[::1` was taken and then waited out, or blamed on CURVE); a key file that is missing says so (zmq.auth says
"Invalid certificate file")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zmq.auth
from typer.testing import CliRunner

from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.curve_keys import read_curve_key_file
from moetune.runtime.profiles.errors import DaemonUnavailable
from moetune.tuner.cli import app
from moetune.tuner.daemon.endpoints import check_endpoint
from moetune.tuner.daemon.errors import DaemonConfigError

runner = CliRunner()


def _run(tmp: Path, *args: str):
    run = tmp / "xdg"
    run.mkdir(mode=0o700, exist_ok=True)
    r = runner.invoke(app, list(args), env={"MOETUNE_HOME": str(tmp / "home"), "XDG_RUNTIME_DIR": str(run),
                                            "MOETUNE_CONFIG": ""})
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r, " ".join(r.output.split())


NO_DAEMON = "ipc:///nonexistent-moetune-dir/daemon.sock"  # reached only when the arguments pass


@pytest.mark.parametrize("job", ["0", "-1", str(1 << 40)])
def test_retune_cancel_needs_a_job_id(tmp_path: Path, job: str) -> None:
    r, text = _run(tmp_path, "retune", "--cancel", job, "--socket", NO_DAEMON)
    assert r.exit_code == 2, r.output
    assert f"--cancel must be a job id (1 to 2147483648, as `moetune status` lists them), got {job}" in text
    assert "no daemon socket" not in text  # refused before any request


@pytest.mark.parametrize(("reason", "got"), [("x" * 513, "513 characters"), ("  ", "a blank one")])
def test_retune_reason_is_checked_before_it_is_sent(tmp_path: Path, reason: str, got: str) -> None:
    """A reason over the wire's 512 characters came back as the daemon's raw validator text, and one over the
    request size limit as "no reply from the daemon"."""
    r, text = _run(tmp_path, "retune", "--reason", reason, "--socket", NO_DAEMON)
    assert r.exit_code == 2 and "--reason must say why in 1 to 512 characters" in text and got in text, r.output
    assert "no daemon socket" not in text


def test_retune_all_and_cancel_conflict(tmp_path: Path) -> None:
    r, text = _run(tmp_path, "retune", "--all", "--cancel", "3", "--socket", NO_DAEMON)
    assert r.exit_code == 2 and "--all and --cancel conflict" in text, r.output
    r, text = _run(tmp_path, "retune", "--cancel", "3", "--socket", NO_DAEMON)
    assert r.exit_code == 1 and "no daemon socket" in text, r.output  # a job id alone goes to the daemon


@pytest.mark.parametrize("fmt", ["env", "table"])
def test_query_json_and_another_format_conflict(tmp_path: Path, fmt: str) -> None:
    q = ["query", "--model", "qwen3-30b", "--ep", "8", "--tokens", "128", "--socket", NO_DAEMON]
    r, text = _run(tmp_path, *q, "--json", "--format", fmt)
    assert r.exit_code == 2, r.output
    assert f"--json and --format {fmt} conflict (--json is --format json): give one of them" in text
    r, _ = _run(tmp_path, *q, "--json", "--format", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["source"] == "policy", r.output
    r, _ = _run(tmp_path, *q, "--format", "env")
    assert r.exit_code == 0 and "export MOETUNE_PROFILE_HASH=" in r.stdout, r.output
    r, _ = _run(tmp_path, *q)
    assert r.exit_code == 0 and "source" in r.stdout and "export" not in r.stdout  # the default stays the table


@pytest.mark.parametrize("endpoint, why", [
    ("tcp://[::1", "no ']' closing the IPv6 address"),
    ("tcp://[::1]x:5555", "expected ':PORT' right after '[::1]'"),
    ("tcp://[xyz]:5555", "'xyz' in brackets is not an IPv6 address"),
    ("tcp://::1:5555", "the host '::1' is not valid: an IPv6 address goes in brackets, tcp://[::1]:PORT"),
    ("tcp://a b:5555", "the host 'a b' is not a host name"),
    ("tcp://:5555", "no host before the port"),
    ("tcp://localhost", "no ':PORT'"),
])
def test_a_malformed_tcp_endpoint_is_refused_before_curve(tmp_path: Path, endpoint: str, why: str) -> None:
    for cmd in ("status", "retune"):
        r, text = _run(tmp_path, cmd, "--socket", endpoint)
        assert r.exit_code == 2, r.output
        assert f"invalid --socket {endpoint!r}: {why}" in text and "CURVE" not in text, text
    r, text = _run(tmp_path, "serve", "--socket", endpoint)
    assert r.exit_code == 2 and why in text, r.output
    with pytest.raises(DaemonConfigError, match="expected tcp://HOST:PORT"):
        check_endpoint(endpoint, "socket")


@pytest.mark.parametrize("endpoint", ["tcp://[::1]:5555", "tcp://127.0.0.1:5555", "tcp://node-7.example:5555",
                                      "tcp://[fe80::1%eth0]:5555", "tcp://*:5555", "tcp://eth0:5555"])
def test_well_formed_tcp_endpoints_pass(endpoint: str) -> None:
    check_endpoint(endpoint, "socket")


@pytest.mark.parametrize("endpoint", ["ipc://relative/sock", "ipc://", "ipc:///" + "x" * 120, "tcp://[::1",
                                      "tcp://host", "tcp://host:0", "tcp://host:70000", "bogus://x", "tcp://*:5555",
                                      "inproc://t", "ipc:///run/moetune/daemon.sock", "tcp://node1:5555"])
def test_the_daemon_and_its_clients_check_endpoints_by_one_rule(endpoint: str) -> None:
    """The daemon's check_endpoint repeated the client's rule (the path's absoluteness, its byte limit as a bare 107, the
    host, the port) with its own messages: one rule now, `paths.endpoint_problem`; a daemon may bind tcp://* and
    inproc://, a client connects to neither."""
    from moetune.runtime import paths

    bind, connect = paths.endpoint_problem(endpoint, bind=True), paths.endpoint_problem(endpoint, bind=False)
    if endpoint in ("tcp://*:5555", "inproc://t"):
        assert bind is None and connect is not None
    else:
        assert bind == connect
    if bind is None:
        check_endpoint(endpoint, "socket")
    else:
        with pytest.raises(DaemonConfigError) as e:
            check_endpoint(endpoint, "socket")
        # the rule's own words first; a too-long path that no option named goes on with what to change (its hint)
        assert str(e.value).startswith(f"socket {endpoint!r}: {bind}"), str(e.value)


def test_the_daemon_keeps_no_endpoint_rule_of_its_own() -> None:
    import inspect

    from moetune.tuner.daemon import endpoints, runtime_dir, server

    for module in (server, endpoints, runtime_dir):  # the modules that check or bind endpoints
        src = inspect.getsource(module)
        assert not hasattr(module, "_ipc_path") and "107" not in src and "tcp_host_problem" not in src, module.__name__


def test_a_client_does_not_connect_to_every_interface(tmp_path: Path) -> None:
    r, text = _run(tmp_path, "status", "--socket", "tcp://*:5555")
    assert r.exit_code == 2 and "'*' (every interface) is where a daemon binds" in text, r.output


def test_missing_key_files_are_said_to_be_missing(tmp_path: Path) -> None:
    missing = tmp_path / "gone.key"
    with pytest.raises(ValueError, match=r"^does not exist$"):
        read_curve_key_file(missing)
    with pytest.raises(ValueError, match=r"^is a directory, not a key file$"):
        read_curve_key_file(tmp_path)
    junk = tmp_path / "junk.key"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match="holds no CURVE public key"):
        read_curve_key_file(junk)
    pub, sec = zmq.auth.create_certificates(str(tmp_path), "server")
    assert read_curve_key_file(pub)[1] is None and read_curve_key_file(sec)[1]

    # the client's config: the daemon's public key, then its own secret key
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[client]\nsocket = "tcp://127.0.0.1:5555"\ncurve_server_key_file = "{missing}"\n')
    r, text = _run(tmp_path, "status", "--config", str(cfg))
    assert r.exit_code == 1, r.output
    assert f"the daemon's CURVE public key file {missing} does not exist" in text
    assert "Invalid certificate file" not in text
    cfg.write_text(f'[client]\nsocket = "tcp://127.0.0.1:5555"\ncurve_server_key_file = "{pub}"\n'
                   f'curve_secret_key_file = "{missing}"\n')
    r, text = _run(tmp_path, "status", "--config", str(cfg))
    assert r.exit_code == 1 and f"this client's CURVE secret key file {missing} does not exist" in text, text
    # on the daemon's host the CLI reads daemon.curve_public_key_file: refused as bad input
    cfg.write_text(f'[client]\nsocket = "tcp://127.0.0.1:5555"\n[daemon]\ncurve_public_key_file = "{missing}"\n')
    r, text = _run(tmp_path, "status", "--config", str(cfg))
    assert r.exit_code == 2 and f"daemon.curve_public_key_file {missing} does not exist" in text, text
    c = ProfileClient("tcp://127.0.0.1:5555", timeout_ms=50, env={"MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE": str(missing)})
    with pytest.raises(DaemonUnavailable, match="does not exist"):
        c.status()
    c.close()
