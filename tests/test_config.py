"""Configuration: file precedence, environment overrides, errors that name key and file."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from moetune.runtime import config as config_mod
from moetune.runtime import paths
from moetune.runtime.config import ConfigError, load_client_config, load_config, resolve_db_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_env import child_env  # beside this file


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A clean environment: HOME in tmp, no system file."""
    monkeypatch.setattr(paths, "SYSTEM_CONFIG", tmp_path / "etc" / "moetune.toml")
    return {"HOME": str(tmp_path / "home")}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def user_file(tmp_path: Path) -> Path:
    return tmp_path / "home" / ".config" / "moetune" / "moetune.toml"


def test_defaults(env, tmp_path):
    cfg = load_config(env=env)
    assert cfg.sources == ()
    assert cfg.store.db == str(tmp_path / "home" / ".local" / "share" / "moetune" / "moetune.db")
    assert cfg.daemon.socket.startswith("ipc://") and cfg.daemon.socket.endswith("daemon.sock")
    assert cfg.client.socket == cfg.daemon.socket
    assert (cfg.daemon.metrics_port, cfg.daemon.max_request_bytes, cfg.daemon.log_level) == (0, 65536, "info")
    assert cfg.daemon.allow_insecure_tcp is False and cfg.daemon.group == ""
    assert (cfg.tune.trials, cfg.tune.timeout_s, cfg.tune.backend) == (40, 600.0, "model")
    assert cfg.client.timeout_ms == 200 and cfg.daemon.rediscover_interval_s == 60.0
    assert set(cfg.to_dict()) == {"store", "daemon", "tune", "client", "runtime"}


def test_moetune_home_and_xdg(env, tmp_path):
    cfg = load_config(env={**env, "MOETUNE_HOME": str(tmp_path / "mh")})
    assert cfg.store.db == str(tmp_path / "mh" / "moetune.db")
    assert cfg.daemon.socket == f"ipc://{tmp_path / 'mh' / 'run' / 'daemon.sock'}"
    cfg = load_config(env={**env, "XDG_DATA_HOME": str(tmp_path / "xd"), "XDG_RUNTIME_DIR": str(tmp_path / "xr")})
    assert cfg.store.db == str(tmp_path / "xd" / "moetune" / "moetune.db")
    assert cfg.daemon.pub_socket == f"ipc://{tmp_path / 'xr' / 'moetune' / 'events.sock'}"


def test_an_empty_store_db_is_the_documented_default(env, tmp_path):
    """`[store] db = ""` was reported as silently ignored. Decided: not refused. An empty value is the key's default
    (docs/settings.md lists it as "(empty: $MOETUNE_HOME/moetune.db, else ...)", as `curve_secret_key_file = ""` in
    the README is "no key"), so a later file can set the database back to the default over an earlier file's."""
    write(paths.SYSTEM_CONFIG, '[store]\ndb = "/var/lib/moetune/moetune.db"\n')
    explicit = write(tmp_path / "x.toml", '[store]\ndb = ""\n')
    e = {**env, "MOETUNE_HOME": str(tmp_path / "mh")}
    assert load_config(env=e).store.db == "/var/lib/moetune/moetune.db"
    assert load_config(explicit, env=e).store.db == str(tmp_path / "mh" / "moetune.db")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    assert "| `store.db` | a string | (empty: $MOETUNE_HOME/moetune.db, else $XDG_DATA_HOME/moetune/moetune.db" in doc


def test_precedence_system_user_explicit_env(env, tmp_path):
    write(paths.SYSTEM_CONFIG, '[store]\ndb = "/var/lib/moetune/moetune.db"\n[tune]\ntrials = 10\nbackend = "local"\n[daemon]\nlog_level = "debug"\n')
    write(user_file(tmp_path), '[tune]\ntrials = 20\n[daemon]\nmetrics_port = 9100\n')
    explicit = write(tmp_path / "x.toml", '[tune]\ntrials = 30\n[client]\ntimeout_ms = 50\n')

    cfg = load_config(env=env)
    assert cfg.store.db == "/var/lib/moetune/moetune.db"
    assert (cfg.tune.trials, cfg.tune.backend, cfg.daemon.log_level, cfg.daemon.metrics_port) == (20, "local", "debug", 9100)
    assert cfg.sources == (str(paths.SYSTEM_CONFIG), str(user_file(tmp_path)))

    cfg = load_config(explicit, env=env)
    assert (cfg.tune.trials, cfg.client.timeout_ms, cfg.daemon.metrics_port) == (30, 50, 9100)

    cfg = load_config(env={**env, "MOETUNE_CONFIG": str(explicit)})
    assert cfg.tune.trials == 30

    e = {**env, "MOETUNE_TUNE_TRIALS": "99", "MOETUNE_DAEMON_ALLOW_INSECURE_TCP": "yes",
         "MOETUNE_DAEMON_SOCKET": "tcp://127.0.0.1:5555", "MOETUNE_STORE_DB": "/tmp/e.db",
         "MOETUNE_TUNE_TIMEOUT_S": "1.5", "MOETUNE_UNRELATED_THING": "x"}
    cfg = load_config(explicit, env=e)
    assert cfg.tune.trials == 99 and cfg.daemon.allow_insecure_tcp is True and cfg.tune.timeout_s == 1.5
    assert cfg.daemon.socket == "tcp://127.0.0.1:5555" and cfg.client.socket == "tcp://127.0.0.1:5555"
    assert cfg.store.db == "/tmp/e.db" and cfg.sources[-1] == "environment"
    # The config's db wins over MOETUNE_HOME; --db wins over everything.
    assert resolve_db_path(None, explicit, env={**env, "MOETUNE_HOME": "/nowhere"}) == Path("/var/lib/moetune/moetune.db")
    assert resolve_db_path(tmp_path / "cli.db", explicit, env=e) == tmp_path / "cli.db"


def test_relative_paths_are_relative_to_the_file(env, tmp_path):
    f = write(tmp_path / "conf" / "m.toml", '[store]\ndb = "data/m.db"\n[daemon]\ncurve_secret_key_file = "~/k.secret"\n')
    cfg = load_config(f, env=env)
    assert cfg.store.db == str(tmp_path / "conf" / "data" / "m.db")
    assert cfg.daemon.curve_secret_key_file.endswith("k.secret") and "~" not in cfg.daemon.curve_secret_key_file


def test_the_clients_key_files_are_relative_to_the_file_too(env, tmp_path):
    """A bare name there was opened in the job's working directory: whoever could write `daemon.key` in it chose
    the server key the client trusts."""
    f = write(tmp_path / "conf" / "m.toml",
              '[client]\ncurve_server_key_file = "daemon.key"\ncurve_secret_key_file = "~/client.key_secret"\n')
    for cfg in (load_config(f, env=env), load_client_config({**env, "MOETUNE_CONFIG": str(f)})[0]):
        assert cfg.client.curve_server_key_file == str(tmp_path / "conf" / "daemon.key")
        assert cfg.client.curve_secret_key_file == str(Path("~/client.key_secret").expanduser())


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[daemon]\nsokcet = 'ipc:///x'\n", ["unknown key daemon.sokcet", "known: socket"]),
        ("[deamon]\nsocket = 'ipc:///x'\n", ["unknown section [deamon]"]),
        ("[tune]\ntrials = '40'\n", ["tune.trials", "expected an integer, got str"]),
        ("[tune]\ntrials = true\n", ["tune.trials", "expected an integer, got bool"]),
        ("[daemon]\nallow_insecure_tcp = 1\n", ["daemon.allow_insecure_tcp", "expected true or false"]),
        ("[daemon]\nsocket = 5\n", ["daemon.socket", "expected a string"]),
        ("[daemon]\nrediscover_interval_s = 'soon'\n", ["daemon.rediscover_interval_s", "expected a number"]),
        ("[daemon]\nlog_level = 'loud'\n", ["daemon.log_level", "must be one of"]),
        ("[daemon]\nmetrics_port = 70000\n", ["daemon.metrics_port", "0..65535"]),
        ("[daemon]\nsocket = '/tmp/sock'\n", ["daemon.socket", "ZeroMQ endpoint"]),
        # a client's endpoint zmq's connect refuses with a bare "Invalid argument" (or takes and never reaches)
        ("[client]\nsocket = 'tcp://node1'\n", ["client.socket", "no ':PORT'", "tcp://HOST:PORT"]),
        ("[client]\nsocket = 'tcp://node1:notaport'\n", ["client.socket", "port in 1..65535"]),
        ("[client]\nsocket = 'tcp://:5555'\n", ["client.socket", "no host"]),
        ("[client]\nsocket = 'tcp://*:5555'\n", ["client.socket", "where a daemon binds"]),
        ("[client]\nsocket = 'ipc://relative/daemon.sock'\n", ["client.socket", "ipc:///absolute/path"]),
        ("[tune]\ntrials = 0\n", ["tune.trials", "must be 1 to 100000"]),
        ("[tune]\ntrials = 100001\n", ["tune.trials", "must be 1 to 100000"]),  # 10**20: a study that never ends
        ("store = 3\n", ["store", "expected a table"]),
        ("[tune\ntrials = 1\n", ["not valid TOML"]),
    ],
)
def test_errors_name_key_and_file(env, tmp_path, text, needles):
    f = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as ei:
        load_config(f, env=env)
    msg = str(ei.value)
    assert str(f) in msg, msg
    for n in needles:
        assert n in msg, msg


def test_errors_in_the_user_file_name_it(env, tmp_path):
    f = write(user_file(tmp_path), "[client]\ntimeout_ms = 'fast'\n")
    with pytest.raises(ConfigError, match=re.escape(f"client.timeout_ms in {f}")):
        load_config(env=env)


def test_env_errors_name_the_variable(env):
    with pytest.raises(ConfigError, match=r"tune\.trials in environment variable MOETUNE_TUNE_TRIALS"):
        load_config(env={**env, "MOETUNE_TUNE_TRIALS": "many"})
    with pytest.raises(ConfigError, match="MOETUNE_DAEMON_ALLOW_INSECURE_TCP"):
        load_config(env={**env, "MOETUNE_DAEMON_ALLOW_INSECURE_TCP": "maybe"})
    with pytest.raises(ConfigError, match="MOETUNE_DAEMON_METRICS_PORT"):
        load_config(env={**env, "MOETUNE_DAEMON_METRICS_PORT": "-1"})
    for text in ("1_000", "\u0664\u0660", "0x10"):  # int() takes the first two; the runtime's parsers refuse them
        with pytest.raises(ConfigError, match=r"client\.timeout_ms in environment variable MOETUNE_CLIENT_TIMEOUT_MS: "
                                              "expected an integer"):
            load_config(env={**env, "MOETUNE_CLIENT_TIMEOUT_MS": text})
    assert load_config(env={**env, "MOETUNE_CLIENT_TIMEOUT_MS": " 250 "}).client.timeout_ms == 250


def test_the_clients_load_names_what_it_ignores_outside_its_keys(env, tmp_path):
    """load_client_config: a bad value outside what the runtime's client reads is listed and left at its default
    (the client keeps its own section); one in client.*, store.db or daemon.socket, or a file that is no TOML, is
    raised as by load_config."""
    f = write(tmp_path / "c.toml", "[client]\nenv_mismatch = 'refuse'\n[tune]\ntrials = 0\nbogus = 1\n"
                                   "[elsewhere]\nx = 1\n[daemon]\nmetrics_port = 70000\nsocket = 'ipc:///s/d.sock'\n")
    cfg, ignored = config_mod.load_client_config(env={**env, "MOETUNE_CONFIG": str(f),
                                                      "MOETUNE_DAEMON_LOG_LEVEL": "loud"})
    assert cfg.client.env_mismatch == "refuse" and cfg.client.socket == cfg.daemon.socket == "ipc:///s/d.sock"
    assert (cfg.tune.trials, cfg.daemon.metrics_port, cfg.daemon.log_level) == (40, 0, "info")  # the defaults
    assert cfg.origin_of("tune", "trials") == "defaults"
    said = "\n".join(ignored)
    for needle in ("tune.trials", "tune.bogus", "[elsewhere]", "daemon.metrics_port", "MOETUNE_DAEMON_LOG_LEVEL"):
        assert needle in said, said
    with pytest.raises(ConfigError, match=r"tune\.bogus"):  # load_config itself is as strict as ever
        load_config(env={**env, "MOETUNE_CONFIG": str(f)})
    for bad in ({"MOETUNE_CLIENT_TIMEOUT_MS": "soon"}, {"MOETUNE_CLIENT_SOCKET": "tcp://node1"},
                {"MOETUNE_DAEMON_SOCKET": "/tmp/sock"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            config_mod.load_client_config(env={**env, "MOETUNE_CONFIG": str(f), **bad})
    write(f, "[client\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config_mod.load_client_config(env={**env, "MOETUNE_CONFIG": str(f)})


def test_missing_explicit_file_is_an_error(env, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env=env)


def test_config_is_immutable(env):
    cfg = load_config(env=env)
    with pytest.raises(AttributeError):
        cfg.tune.trials = 3  # type: ignore[misc]
    assert config_mod.LOG_LEVELS[1] == "info"


def test_a_client_timeout_past_a_day_is_refused_and_never_reaches_zmq(tmp_path: Path) -> None:
    """MOETUNE_CLIENT_TIMEOUT_MS=99999999999999999999 (or a --timeout-ms of 5e9) overflowed zmq's poll: a traceback
    out of `moetune query` and of the runtime's lookup."""
    from moetune.runtime.profiles.client import ProfileClient

    env = {"HOME": str(tmp_path), "MOETUNE_CLIENT_TIMEOUT_MS": "99999999999999999999"}
    with pytest.raises(ConfigError, match=r"client\.timeout_ms.*must be 1 to 86400000"):
        load_config(env=env)
    c = ProfileClient(endpoint=f"ipc://{tmp_path}/none.sock", env=env, timeout_ms=10**20)
    assert c.timeout_ms == config_mod.MAX_CLIENT_TIMEOUT_MS
    c.close()


@pytest.mark.parametrize("command", [
    ["tune", "--backend", "local", "--model", "qwen3-30b", "--ep-size", "2", "--tokens", "128", "--trials", "1"],
    ["profile", "--quick"],
])
def test_a_measuring_command_refuses_a_bad_runtime_key_before_it_measures(tmp_path, monkeypatch, command):
    """load_config keeps [runtime] raw (options.py checks it); the commands that measure check it first: a bad key
    is one clear error naming it and the file, not a failure repeated in every trial with a database written."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    cfg = write(tmp_path / "moetune.toml", '[runtime]\nsymm = "nvshmem"\n')
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "mh"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(app, [*command, "--config", str(cfg)])
    assert r.exit_code != 0
    assert "runtime.symm" in r.output and str(cfg) in r.output and "Traceback" not in r.output
    assert "trial" not in r.output  # refused before any trial ran
    assert not (tmp_path / "mh").exists()  # and before a database was made


def test_a_tune_measures_under_its_config_file(tmp_path, monkeypatch):
    """--config joins the chain its trials run under ($MOETUNE_CONFIG for this process and the ranks it spawns):
    it was checked, then the ranks and the recorded options came from the default chain without it."""
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.options import RuntimeOptions, load_config_checked
    from moetune.tuner.search.local_backend import LocalBackend

    monkeypatch.delenv("MOETUNE_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = write(tmp_path / "moetune.toml", "[runtime]\nfused_pack = false\n")
    assert RuntimeOptions.resolve().fused_pack  # the default chain
    load_config_checked(cfg)
    assert LocalBackend(world=1).runtime_options().fused_pack is False
    assert LocalBackend(world=1).environment(Knobs())["MOETUNE_CONFIG"] == str(cfg.resolve())


def test_the_clients_read_past_a_bad_runtime_key(tmp_path, monkeypatch):
    """status / query / tune show use no runtime option: a bad [runtime] value stops only what measures."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    cfg = write(tmp_path / "moetune.toml", '[runtime]\nsymm = "nvshmem"\n')
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "mh"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(app, ["status", "--config", str(cfg)])
    assert "runtime.symm" not in r.output and "Traceback" not in r.output


def test_the_system_file_is_the_one_moetune_system_config_names(env, tmp_path):
    """MOETUNE_SYSTEM_CONFIG names the system file (a path with no file there: none is read); unset or empty, it is
    /etc/moetune/moetune.toml (`paths.SYSTEM_CONFIG`) as before."""
    assert paths.system_config_path({}) == paths.SYSTEM_CONFIG
    assert paths.system_config_path({"MOETUNE_SYSTEM_CONFIG": ""}) == paths.SYSTEM_CONFIG
    write(paths.SYSTEM_CONFIG, "[tune]\ntrials = 10\n")
    other = write(tmp_path / "other" / "moetune.toml", "[tune]\ntrials = 11\n")
    assert load_config(env=env).tune.trials == 10
    assert load_config(env={**env, "MOETUNE_SYSTEM_CONFIG": ""}).tune.trials == 10
    cfg = load_config(env={**env, "MOETUNE_SYSTEM_CONFIG": str(other)})
    assert cfg.tune.trials == 11 and cfg.sources == (str(other),)
    cfg = load_config(env={**env, "MOETUNE_SYSTEM_CONFIG": str(tmp_path / "none" / "moetune.toml")})
    assert cfg.tune.trials == 40 and cfg.sources == ()


# A CLI child whose built-in system path is `argv[1]` (a test cannot write /etc): `moetune db path` prints the
# database, which that file moves
_DB_PATH_WITH_SYSTEM_FILE_AT = """
import sys
from pathlib import Path
from moetune.runtime import paths
paths.SYSTEM_CONFIG = Path(sys.argv[1])
sys.argv = ["moetune", "db", "path"]
from moetune.tuner.cli import main
main()
"""


def test_a_cli_child_of_the_test_suite_reads_no_system_config_file(tmp_path):
    """The suite moved the system file in-process only (a monkeypatch of `paths.SYSTEM_CONFIG`): a CLI child read
    this machine's /etc/moetune/moetune.toml, which (on a node deployed with moetune) points at the node's own
    database and daemon. Its MOETUNE_SYSTEM_CONFIG reaches the children, through `child_env` or the inherited
    environment. Without it, the child reads the file it was built with (the user-facing default unchanged)."""
    import os
    import subprocess

    system = write(tmp_path / "etc" / "moetune.toml", f'[store]\ndb = "{tmp_path / "system.db"}"\n')
    home = tmp_path / "home"

    def db_path(env: dict[str, str]) -> str:
        r = subprocess.run([sys.executable, "-c", _DB_PATH_WITH_SYSTEM_FILE_AT, str(system)], capture_output=True,
                           text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip()

    assert os.environ.get("MOETUNE_SYSTEM_CONFIG"), "tests/conftest.py sets it for every test"
    assert db_path(child_env(MOETUNE_HOME=str(home))) == str(home / "moetune.db")
    assert db_path({**os.environ, "MOETUNE_HOME": str(home)}) == str(home / "moetune.db")
    # the control: the same child with the variable unset (or empty) reads the file
    assert db_path(child_env(MOETUNE_HOME=str(home), MOETUNE_SYSTEM_CONFIG="")) == str(tmp_path / "system.db")


def test_a_child_env_child_reads_the_config_files_the_test_does(tmp_path):
    """`child_env` builds a bare environment: without the suite's XDG_CONFIG_HOME and no HOME, a child's user file was
    this user's own ~/.config/moetune/moetune.toml (from the password database). It reads the test's files; a test
    that names HOME gets HOME/.config's."""
    import json
    import subprocess

    code = "import json; from moetune.runtime.config import config_files; print(json.dumps([str(f) for f in config_files()]))"

    def files(env: dict[str, str]) -> list[str]:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    assert files(child_env(MOETUNE_HOME=str(tmp_path / "mh"))) == [str(f) for f in config_mod.config_files()]
    home = tmp_path / "home"
    assert files(child_env(HOME=str(home)))[1] == str(home / ".config" / "moetune" / "moetune.toml")


def test_the_clients_fallback_reads_the_variables_as_the_config_does(tmp_path: Path) -> None:
    """A [client] variable the config refuses makes the profile client ignore the config ("ignoring the config for
    the profile client: ... expected an integer, got '1_000'") and read the variables itself; that read used int(),
    which takes "1_000" as 1000 and Arabic-Indic digits as a number: the value just said to be refused was applied."""
    from moetune.runtime.profiles import client as client_mod
    from moetune.runtime.profiles.client import DEFAULT_TIMEOUT_MS, ProfileClient

    for text in ("1_000", "\u0664\u0660"):
        env = {"HOME": str(tmp_path), "MOETUNE_CLIENT_TIMEOUT_MS": text}
        with pytest.raises(ConfigError):
            load_config(env=env)
        c = ProfileClient(endpoint=f"ipc://{tmp_path}/none.sock", env=env)
        assert c.timeout_ms == DEFAULT_TIMEOUT_MS, text
        c.close()
    env = {"HOME": str(tmp_path), "MOETUNE_CLIENT_TIMEOUT_MS": " 250 ", "MOETUNE_TUNE_TRIALS": "x",
           "MOETUNE_CLIENT_ALLOW_MODELLED": "maybe"}  # the fallback: a client variable the config refuses
    c = ProfileClient(endpoint=f"ipc://{tmp_path}/none.sock", env=env)
    assert (c.timeout_ms, c.allow_modelled) == (250, False)
    c.close()
    # one spelling of a true word for both readers
    assert not hasattr(client_mod, "_TRUE") or client_mod._TRUE == config_mod.TRUE_WORDS


def test_a_float_variable_is_ascii_without_digit_separators(env) -> None:
    """As an integer variable (int_of_text): float() read MOETUNE_TUNE_TIMEOUT_S=6_00 as 600 and other scripts'
    digits as numbers."""
    for text in ("6_00", "\u0666\u0660\u0660"):
        with pytest.raises(ConfigError, match=r"tune\.timeout_s in environment variable MOETUNE_TUNE_TIMEOUT_S: "
                                              "expected a number"):
            load_config(env={**env, "MOETUNE_TUNE_TIMEOUT_S": text})
    assert load_config(env={**env, "MOETUNE_TUNE_TIMEOUT_S": " 6e2 "}).tune.timeout_s == 600.0
