"""moetune's configuration: TOML files overridden by `MOETUNE_*` environment variables.

Order (later wins): built-in defaults, `/etc/moetune/moetune.toml` (or the file `$MOETUNE_SYSTEM_CONFIG` names),
`~/.config/moetune/moetune.toml` (`$XDG_CONFIG_HOME` respected), the file given with `--config` (or
`$MOETUNE_CONFIG`), then `MOETUNE_<SECTION>_<KEY>` variables (e.g. `MOETUNE_DAEMON_SOCKET`). `MOETUNE_HOME`
moves the default database and socket directory.

An unknown section or key, a wrong type or a bad value in a file is a `ConfigError` that names the key
and the file (or the variable). Unknown `MOETUNE_*` variables are ignored (other tools may own them), but for a key whose
variable is another (`_ENV_NAMES`) its `MOETUNE_<SECTION>_<KEY>` name set is an error naming the one to set. The runtime's
profile client loads with `load_client_config`: only an error in what it reads (client.*, store.db, daemon.socket)
is raised; any other is named and that setting left at its default. The data path's options load with
`load_runtime_config`, alike (the `[runtime]` section raised too).
Paths in a file (`[store] db`, the CURVE key files) are relative to that file's directory.

The `[runtime]` section holds the EP data path's options (runtime/options.py: `RuntimeOptions`, the one
definition of their names, types and defaults). This module keeps the table as the files give it, with where each
key came from; `RuntimeOptions.from_config` checks it (an unknown key, a wrong type or a bad value names the key and
the file). Its variables are the options' own (`MOETUNE_HS_NATIVE`, ...), applied by `RuntimeOptions.resolve`.
(options.py imports this module for that and for the settings doc, so this one cannot import it: no import cycles.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.runtime import paths
from moetune.runtime.knobs import float_of_text, int_of_text

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ENV_MISMATCH_MODES = ("warn", "refuse", "ignore")  # client.env_mismatch (runtime/profiles/client.py)
MAX_CLIENT_TIMEOUT_MS = 86_400_000  # a day: a longer wait overflowed zmq's poll (a C int of milliseconds)
# the most trials one study is asked for ([tune] trials, `tune --trials`, `profile --trials`, a plan's trials): 10**20
# was taken and the study ran until killed. A tune converges in tens to hundreds of trials; 100000 leaves room
MAX_TRIALS = 100_000

_PATH_KEYS = {("store", "db"), ("daemon", "curve_secret_key_file"), ("daemon", "curve_public_key_file"),
              ("daemon", "curve_admins_dir"), ("client", "curve_server_key_file"), ("client", "curve_secret_key_file")}


class ConfigError(ValueError):
    """A configuration file or variable is wrong; the message names the key and where it came from."""


@dataclass(frozen=True)
class StoreConfig:
    db: str = ""  # resolved by load_config to a full path


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = ""  # resolved by load_config: ipc://<runtime dir>/daemon.sock
    pub_socket: str = ""  # resolved by load_config: beside `socket` (pub_socket_beside)
    group: str = ""  # unix group allowed on the IPC directory ("" = owner only)
    group_may_retune: bool = False  # members of `group` may queue and cancel re-tunes (else the owner only)
    allow_insecure_tcp: bool = False
    curve_secret_key_file: str = ""
    curve_public_key_file: str = ""
    curve_admins_dir: str = ""  # TCP clients that may queue and cancel re-tunes ("" = admins/ beside the secret key)
    rediscover_interval_s: float = 60.0
    metrics_port: int = 0  # 0 = no Prometheus endpoint
    max_request_bytes: int = 65536
    log_level: str = "info"


@dataclass(frozen=True)
class TuneConfig:
    trials: int = 40
    timeout_s: float = 600.0
    backend: str = "model"
    run_on_busy_gpus: bool = False  # a local (measuring) re-tune runs even while other processes use the GPUs


@dataclass(frozen=True)
class ClientConfig:
    timeout_ms: int = 200
    socket: str = ""  # resolved by load_config: daemon.socket when set, else paths.find_daemon_socket
    allow_modelled: bool = False  # apply a MODELLED (node model / preset) profile when no measured one exists
    # a tuned profile measured in another NCCL/NVSHMEM/FI environment than the job's (or one not recorded): "warn"
    # (served, warned once naming the variables), "refuse" (passed over: the lookup falls back), "ignore" (served)
    env_mismatch: str = "warn"
    # TCP with CURVE: the daemon's public key file, and this client's key pair (`moetune keys client`), whose
    # public half must be in the daemon's allow-list; "" = a throwaway key pair (refused by the daemon).
    curve_server_key_file: str = ""
    curve_secret_key_file: str = ""
    # an EP buffer / MoE layer built without knobs looks up its tuned profile (daemon, then database); false: the
    # policy defaults, asking nothing (`client_autoload`; its variable is MOETUNE_AUTOLOAD, the name it always had)
    autoload: bool = True
    # seconds an auto-load FALLBACK (the policy or built-in default: the daemon or a hardware check failed) is reused
    # before a later buffer or layer looks up again; a resolved profile is kept for the process. 0: every construction
    fallback_retry_s: float = 30.0


@dataclass(frozen=True)
class Config:
    store: StoreConfig = field(default_factory=StoreConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    # the [runtime] table as the files set it (a later file's key over an earlier one's), checked by
    # RuntimeOptions.from_config: key -> TOML value (where each came from: `origin`)
    runtime: Mapping[str, Any] = field(default_factory=dict)
    # Where the values came from, in the order applied (files and "environment").
    sources: tuple[str, ...] = ()
    # (section, key) -> the file or variable that set it (keys left at their default are absent)
    origin: Mapping[tuple[str, str], str] = field(default_factory=dict, compare=False, repr=False)
    # (section, key) set, by a file or a variable, to "" (the default's spelling: README's `db = ""`): `origin` names
    # where, but the value in effect is the default's, which `configured` does not count
    set_empty: frozenset[tuple[str, str]] = field(default_factory=frozenset, compare=False, repr=False)

    @property
    def db_path(self) -> Path:
        return Path(self.store.db)

    def to_dict(self) -> dict[str, Any]:
        return {**{name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}, RUNTIME: dict(self.runtime)}

    def origin_of(self, section: str, key: str) -> str:
        """Where `section.key` was set: a file, a variable, or "defaults"."""
        return self.origin.get((section, key), "defaults")

    def configured(self, section: str, key: str) -> bool:
        """Whether a file or a variable set `section.key` to a value of its own: not left at its default, nor set
        empty (`[store] db = ""`, an exported `MOETUNE_STORE_DB=""`), which means the default."""
        return (section, key) in self.origin and (section, key) not in self.set_empty


_SECTIONS: dict[str, type] = {
    "store": StoreConfig,
    "daemon": DaemonConfig,
    "tune": TuneConfig,
    "client": ClientConfig,
}
SECTIONS = _SECTIONS  # the schema, for the settings doc (runtime/options.py)
# The data path's options: a section whose schema is RuntimeOptions' (runtime/options.py checks it), with no
# MOETUNE_<SECTION>_<KEY> variables (the options' own variables instead).
RUNTIME = "runtime"
_KNOWN_SECTIONS = (*_SECTIONS, RUNTIME)
_NO_ENV = frozenset({RUNTIME})


# Keys whose variable is not MOETUNE_<SECTION>_<KEY>: the name it had before it was a config key.
_ENV_NAMES = {("client", "autoload"): "MOETUNE_AUTOLOAD"}
# What a key does, where the settings doc should say more than its name (docs/settings.md, under the table).
KEY_NOTES = {("client", "autoload"): "false (or `MOETUNE_AUTOLOAD=0`): an EP buffer or MoE layer built without "
                                     "knobs runs the policy defaults without asking the daemon or the database (no "
                                     "warning); true: it looks up the tuned profile. A value that is not a bool is "
                                     "an error naming the variable or the file.",
             ("client", "fallback_retry_s"): "how long (seconds) an auto-load that ended in the policy or built-in "
                                             "default (the daemon did not answer, a hardware check failed) is reused "
                                             "before a buffer or layer built later looks up again; a tuned or "
                                             "modelled profile it found is kept for the process, and replaces the "
                                             "NVSHMEM_* variables the fallback exported (those still at the "
                                             "fallback's value: one the user set, before or since, wins; one the "
                                             "profile does not set is unset again). 0: every construction looks up "
                                             "again. An EP group over several hosts retries on rank 0's clock: "
                                             "rank 0 decides, and every host's first rank looks up again then (or "
                                             "keeps serving its cached fallback until then), so hosts whose "
                                             "fallbacks were cached at different times do not resolve different "
                                             "profiles and run the group default."}


def env_name(section: str, key: str) -> str:
    """The variable that overrides `section.key` ("" for the [runtime] section: see runtime/options.py)."""
    if section in _NO_ENV:
        return ""
    return _ENV_NAMES.get((section, key), f"MOETUNE_{section.upper()}_{key.upper()}")


@functools.cache
def _fields(section: str) -> dict[str, type]:
    """Key name -> Python type of one section."""
    return typing.get_type_hints(_SECTIONS[section])


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
TYPE_NAMES = _TYPE_NAMES  # for the settings doc


# what an empty value (the key's default) stands for, where load_config puts a value in its place: an explicit
# `db = ""` is that default too (a later file sets it back to the default over an earlier file's value), as
# docs/settings.md says
EMPTY_MEANS = {("store", "db"): "$MOETUNE_HOME/moetune.db, else $XDG_DATA_HOME/moetune/moetune.db, else "
                                "~/.local/share/moetune/moetune.db"}


def type_name(section: str, key: str) -> str:
    """The TOML type of `section.key`, in words."""
    return _TYPE_NAMES[_fields(section)[key]]


def _check_value(section: str, key: str, value: Any, where: str) -> Any:
    """Type-check one value from a file; returns it (ints widened to float where a number is wanted)."""
    return check_toml_value(section, key, _fields(section)[key], value, where)


def check_toml_value(section: str, key: str, want: type, value: Any, where: str) -> Any:
    """`section.key`'s value from a file, of Python type `want` (bool, int, float or str), type-checked: returned
    (ints widened to float where a number is wanted, which must be finite), else a ConfigError naming the key and
    `where`. RuntimeOptions.from_config checks the [runtime] table with it."""
    ok = (
        (want is bool and isinstance(value, bool))
        or (want is int and isinstance(value, int) and not isinstance(value, bool))
        or (want is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (want is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(
            f"{section}.{key} in {where}: expected {_TYPE_NAMES[want]}, got {type(value).__name__} {value!r}"
        )
    return _finite(section, key, float(value), where) if want is float else value


def _finite(section: str, key: str, value: float, where: str) -> float:
    """Every float setting is a finite number: nan passes every `<` / `<=` range check (a timeout_s of nan made every
    re-tune end at once, doing nothing), and inf is no number of seconds either."""
    if not math.isfinite(value):
        raise ConfigError(f"{section}.{key} in {where}: expected a finite number, got {value}")
    return value


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(raw: str, what: str, *, empty: bool = False) -> bool:
    """A boolean variable's text: 1/true/yes/on or 0/false/no/off (any case, white space around), "" = `empty`;
    anything else a ConfigError naming `what` (a typo is never taken as either)."""
    low = raw.strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    if not low:
        return empty
    raise ConfigError(f"{what}: expected true or false, got {raw!r}")


def default_of(section: str, key: str) -> Any:
    """The built-in default of `section.key` (a dataclass section's)."""
    return getattr(_SECTIONS[section](), key)


def _parse_env_value(section: str, key: str, raw: str, var: str) -> Any:
    want = _fields(section)[key]
    where = f"environment variable {var}"
    if want is str:
        return raw
    if want is bool:  # empty: the key's default (false for every bool key but client.autoload)
        return parse_bool(raw, f"{section}.{key} in {where}", empty=default_of(section, key))
    text = raw.strip()
    try:
        # not int() / float(): they take "1_000" and non-ASCII digits, which the runtime's parsers refuse
        value = int_of_text(text) if want is int else float_of_text(text)
        if value is None:
            raise ValueError(text)
    except ValueError:
        raise ConfigError(f"{section}.{key} in {where}: expected {_TYPE_NAMES[want]}, got {raw!r}") from None
    return _finite(section, key, value, where) if want is float else value


# What a load does with a ConfigError about (section, key) (key None: a whole section): raise it, or (a lenient
# load: `load_client_config`) note it and leave that key (section) at its default.
_Report = Callable[[str, "str | None", ConfigError], None]


def _strict(section: str, key: str | None, err: ConfigError) -> None:
    raise err


def _check_ranges(values: dict[str, dict[str, Any]], origin: dict[tuple[str, str], str],
                  report: _Report = _strict) -> None:
    def fail(section: str, key: str, msg: str) -> None:
        where = origin.get((section, key), "defaults")
        report(section, key, ConfigError(f"{section}.{key} in {where}: {msg}"))
        values[section][key] = default_of(section, key)  # ignored (a lenient load): the default
        origin.pop((section, key), None)

    d, t, c = values["daemon"], values["tune"], values["client"]
    if d["log_level"].lower() not in LOG_LEVELS:
        fail("daemon", "log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {d['log_level']!r}")
    if not 0 <= d["metrics_port"] <= 65535:
        fail("daemon", "metrics_port", f"must be in 0..65535, got {d['metrics_port']}")
    if not 64 <= d["max_request_bytes"] <= 1 << 24:
        fail("daemon", "max_request_bytes", f"must be in 64..{1 << 24}, got {d['max_request_bytes']}")
    if t["backend"] not in ("model", "local"):
        fail("tune", "backend", f"must be model (this node's calibrated model) or local (measure), got {t['backend']!r}")
    if d["rediscover_interval_s"] < 0:
        fail("daemon", "rediscover_interval_s", f"must be >= 0, got {d['rediscover_interval_s']}")
    if not 1 <= t["trials"] <= MAX_TRIALS:
        fail("tune", "trials", f"must be 1 to {MAX_TRIALS}, got {t['trials']}")
    if t["timeout_s"] <= 0:
        fail("tune", "timeout_s", f"must be > 0, got {t['timeout_s']}")
    if not 1 <= c["timeout_ms"] <= MAX_CLIENT_TIMEOUT_MS:
        fail("client", "timeout_ms", f"must be 1 to {MAX_CLIENT_TIMEOUT_MS} (milliseconds: up to a day), "
             f"got {c['timeout_ms']}")
    if c["fallback_retry_s"] < 0:
        fail("client", "fallback_retry_s", f"must be >= 0 (seconds), got {c['fallback_retry_s']}")
    c["env_mismatch"] = c["env_mismatch"].strip().lower()
    if c["env_mismatch"] not in ENV_MISMATCH_MODES:
        fail("client", "env_mismatch", f"must be one of {', '.join(ENV_MISMATCH_MODES)}, got {c['env_mismatch']!r}")
    for section, key in (("daemon", "socket"), ("daemon", "pub_socket"), ("client", "socket")):
        v = values[section][key]
        if v and "://" not in v:
            fail(section, key, f"expected a ZeroMQ endpoint like ipc:///path or tcp://host:port, got {v!r}")
    # the one a client connects to: its rule (zmq's connect answered tcp://node1 with a bare "Invalid argument")
    why = paths.endpoint_problem(c["socket"], bind=False) if c["socket"] else None
    if why is not None:
        fail("client", "socket", f"{why}, got {c['socket']!r}")
    # a path the file system cannot name: every later look at it raised "File name too long", a traceback
    for section, key in sorted(_PATH_KEYS):
        v = values[section][key]
        why = paths.too_long_problem(v) if v else None
        if why is not None:
            fail(section, key, f"{v!r}: {why}")


def _resolve_path(value: str, base: Path | None) -> str:
    if not value:
        return value
    p = Path(value).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    return str(p)


def _apply_file(path: Path, values: dict[str, dict[str, Any]], origin: dict[tuple[str, str], str],
                report: _Report = _strict) -> None:
    where = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:  # a whole file: nothing in it can be told apart (never lenient)
        raise ConfigError(f"{where}: not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: cannot read: {e}") from None
    for section, table in data.items():
        if section not in _KNOWN_SECTIONS:
            report(section, None, ConfigError(f"unknown section [{section}] in {where} (known: "
                                              f"{', '.join(_KNOWN_SECTIONS)})"))
            continue
        if not isinstance(table, dict):
            report(section, None, ConfigError(f"{section} in {where}: expected a table [{section}], got "
                                              f"{type(table).__name__}"))
            continue
        if section == RUNTIME:  # kept as given: RuntimeOptions.from_config checks it against the options
            for key, value in table.items():
                values[RUNTIME][key] = value
                origin[(RUNTIME, key)] = where
            continue
        known = _fields(section)
        for key, value in table.items():
            if key not in known:
                report(section, key, ConfigError(f"unknown key {section}.{key} in {where} (known: {', '.join(known)})"))
                continue
            try:
                value = _check_value(section, key, value, where)
            except ConfigError as e:
                report(section, key, e)
                continue
            if (section, key) in _PATH_KEYS:
                value = _resolve_path(value, path.parent)
            values[section][key] = value
            origin[(section, key)] = where


def _apply_env(env: Mapping[str, str], values: dict[str, dict[str, Any]], origin: dict[tuple[str, str], str],
               report: _Report = _strict) -> bool:
    used = False
    for (section, key), var in _ENV_NAMES.items():
        # the name the MOETUNE_<SECTION>_<KEY> rule gives such a key is moetune's own, yet not read: set, it was
        # ignored without a word (MOETUNE_CLIENT_AUTOLOAD=0 still asked the daemon)
        generic = f"MOETUNE_{section.upper()}_{key.upper()}"
        if generic != var and env.get(generic, "").strip():
            report(section, key, ConfigError(f"{section}.{key}: environment variable {generic}={env[generic]!r} is not "
                                             f"read: the variable of {section}.{key} is {var} (set that one and unset "
                                             f"{generic})"))
    for section in _SECTIONS:
        for key in _fields(section):
            var = env_name(section, key)
            if var and var in env:
                try:
                    value = _parse_env_value(section, key, env[var], var)
                except ConfigError as e:
                    report(section, key, e)
                    continue
                if (section, key) in _PATH_KEYS:
                    value = _resolve_path(value, Path.cwd())
                values[section][key] = value
                origin[(section, key)] = f"environment variable {var}"
                used = True
    return used


def config_files(config_file: Path | None = None, env: Mapping[str, str] = os.environ) -> list[Path]:
    """The files load_config reads, in order (those that do not exist are skipped, except --config)."""
    files = [paths.system_config_path(env), paths.user_config_path(env)]
    explicit = config_file or (Path(env["MOETUNE_CONFIG"]) if env.get("MOETUNE_CONFIG") else None)
    if explicit is not None:
        files.append(Path(explicit).expanduser())
    return files


def _not_a_config_file(f: Path, given: str) -> str:
    """Why the config file asked for cannot be read: a folder was said not to exist."""
    if f.is_dir():
        inside = f / paths.SYSTEM_CONFIG.name
        hint = f" ({inside} is there)" if inside.is_file() else ""
        return (f"config file {f} (from {given}) is a directory, not a TOML file: give the file itself, "
                f"e.g. {given if given == '--config' else 'MOETUNE_CONFIG='}{' ' if given == '--config' else ''}"
                f"{inside}{hint}")
    if f.exists():
        return f"config file {f} (from {given}) is not a regular file: give a TOML file"
    return f"config file {f} (from {given}) does not exist"


def pub_socket_beside(socket: str) -> str:
    """The default PUB endpoint of a daemon listening on `socket` (config and `--socket` alike): events.sock in the
    same folder for ipc://, the same host with port + 1 for tcp://; "" where there is none (another scheme, no port,
    port 65535): the daemon then asks for pub_socket."""
    if socket.startswith("ipc://"):
        return f"ipc://{Path(socket[len('ipc://'):]).parent / paths.PUB_SOCKET_NAME}"
    if socket.startswith("tcp://"):
        host, _, port = socket[len("tcp://"):].rpartition(":")
        if host and port.isascii() and port.isdigit() and 1 <= int(port) < 65535:
            return f"tcp://{host}:{int(port) + 1}"
    return ""


def load_config(config_file: Path | None = None, env: Mapping[str, str] = os.environ) -> Config:
    """Defaults ← /etc ← user file ← `config_file` (or $MOETUNE_CONFIG) ← MOETUNE_* variables."""
    return _load(config_file, env, _strict)


# What the runtime's profile client reads of the config: its own section, the database it falls back to, and the
# daemon's socket (client.socket's default)
CLIENT_KEYS = frozenset({("store", "db"), ("daemon", "socket")})


def _client_needs(section: str, key: str | None) -> bool:
    return section == "client" or (section, key) in CLIENT_KEYS or (key is None and section in {"store", "daemon"})


def load_client_config(env: Mapping[str, str] = os.environ) -> tuple[Config, list[str]]:
    """`load_config` for the runtime's profile client: a ConfigError about what the client reads (client.*, store.db,
    daemon.socket; a file that is no TOML) is raised, one about anything else (MOETUNE_TUNE_TRIALS=many, a daemon
    metrics_port out of range, an unknown key) only noted: that key is left at its default and its message listed
    (second value). One bad setting elsewhere dropped the client's own: env_mismatch = "refuse" became "warn", its
    CURVE key files and socket were lost."""
    ignored: list[str] = []

    def report(section: str, key: str | None, err: ConfigError) -> None:
        if _client_needs(section, key):
            raise err
        ignored.append(str(err))

    return _load(None, env, report), ignored


def load_runtime_config(env: Mapping[str, str] = os.environ) -> tuple[Config, list[str]]:
    """`load_config` for the runtime's data path (`RuntimeOptions.resolve`, which every EPBuffer and MoELayer runs):
    a ConfigError about what the runtime reads (its `[runtime]` section, what its profile client reads; a file that is
    no TOML) is raised, one about a setting only the tuner or the daemon reads (MOETUNE_TUNE_TRIALS=many, `[tune]
    trials = 0`, an unknown section) only listed (second value), that key left at its default: it stopped every
    buffer and layer of a serving job, explicit knobs or not, where the profile client only names it."""
    ignored: list[str] = []

    def report(section: str, key: str | None, err: ConfigError) -> None:
        if section == RUNTIME or _client_needs(section, key):
            raise err
        ignored.append(str(err))

    return _load(None, env, report), ignored


class _AutoloadProblem(Exception):
    """Carries a ConfigError about client.autoload out of a lenient load."""


def client_autoload(env: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """client.autoload (variable MOETUNE_AUTOLOAD, then the config files, then true) and where it was set. A bad
    value of it is a ConfigError naming the variable or the file; the rest of the config is not this function's to
    judge (the profile client warns about a config it cannot read, which leaves this setting at its default)."""

    def report(section: str, key: str | None, err: ConfigError) -> None:
        if section == "client" and key in ("autoload", None):  # this key, or a [client] that is no table
            raise _AutoloadProblem(err)

    try:
        cfg = _load(None, env, report)
    except _AutoloadProblem as p:
        raise p.args[0] from None
    except (ConfigError, OSError):
        return default_of("client", "autoload"), "defaults"
    return cfg.client.autoload, cfg.origin_of("client", "autoload")


def _load(config_file: Path | None, env: Mapping[str, str], report: _Report) -> Config:
    values: dict[str, dict[str, Any]] = {**{s: dataclasses.asdict(cls()) for s, cls in _SECTIONS.items()}, RUNTIME: {}}
    origin: dict[tuple[str, str], str] = {}
    sources: list[str] = []
    files = config_files(config_file, env)
    explicit = files[2] if len(files) > 2 else None
    for f in files:
        if f.is_file():
            _apply_file(f, values, origin, report)
            sources.append(str(f))
        elif f is explicit:
            raise ConfigError(_not_a_config_file(f, "--config" if config_file else "$MOETUNE_CONFIG"))
    if _apply_env(env, values, origin, report):
        sources.append("environment")
    _check_ranges(values, origin, report)

    run = paths.runtime_dir(env)
    # the keys set to "" (the last file or variable to set them), before the defaults below fill them in
    set_empty = frozenset(k for k in origin if k[0] in _SECTIONS and values[k[0]].get(k[1]) == "")
    daemon_socket_set = bool(values["daemon"]["socket"])
    if not values["store"]["db"]:
        values["store"]["db"] = str(paths.default_db_path(env))
        why = paths.too_long_problem(values["store"]["db"])
        if why is not None:  # the folder it is in comes from a variable: named, as a bad key is
            var = "MOETUNE_HOME" if paths.moetune_home(env) is not None else "XDG_DATA_HOME or HOME"
            report("store", "db", ConfigError(f"the default database {values['store']['db']!r} (in ${var}): {why}"))
    if not values["daemon"]["socket"]:
        values["daemon"]["socket"] = f"ipc://{run / 'daemon.sock'}"
    if not values["daemon"]["pub_socket"]:
        # beside the socket, as for --socket: a socket set alone in a file put its PUB in the default runtime
        # directory (another daemon's) or on IPC beside a tcp:// socket; "" where none can be told (the daemon says)
        values["daemon"]["pub_socket"] = pub_socket_beside(values["daemon"]["socket"])
    if not values["client"]["socket"]:
        # the daemon's socket when one is configured; else where a daemon of this user is (one started in another
        # environment included), as default_endpoint finds it: the client and the config agree on one rule
        values["client"]["socket"] = values["daemon"]["socket"] if daemon_socket_set else paths.find_daemon_socket(env)
    values["daemon"]["log_level"] = values["daemon"]["log_level"].lower()
    return Config(**{s: cls(**values[s]) for s, cls in _SECTIONS.items()}, runtime=values[RUNTIME],
                  sources=tuple(sources), origin=origin, set_empty=set_empty)


def resolve_db_path(db: Path | str | None = None, config_file: Path | None = None, env: Mapping[str, str] = os.environ) -> Path:
    """`db` when given, else the configured database path (`[store] db`, `$MOETUNE_HOME`, XDG)."""
    if db is not None and str(db) != "":
        return Path(db).expanduser()
    return load_config(config_file, env).db_path
