"""Where moetune keeps its files: the database, the config files, the daemon's sockets.

Every function takes the environment as a mapping (default `os.environ`) so tests can pass their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SYSTEM_CONFIG = Path("/etc/moetune/moetune.toml")
DB_NAME = "moetune.db"


def _home(env: Mapping[str, str]) -> Path:
    home = env.get("HOME")
    return Path(home) if home else Path.home()


def moetune_home(env: Mapping[str, str] = os.environ) -> Path | None:
    """`$MOETUNE_HOME` (expanded) when set and non-empty, else None."""
    value = env.get("MOETUNE_HOME", "")
    return Path(value).expanduser() if value else None


def data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """`$MOETUNE_HOME`, else `$XDG_DATA_HOME/moetune`, else `~/.local/share/moetune`."""
    home = moetune_home(env)
    if home is not None:
        return home
    xdg = env.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else _home(env) / ".local" / "share"
    return base / "moetune"


def default_db_path(env: Mapping[str, str] = os.environ) -> Path:
    """The database when neither `--db` nor the config's `[store] db` names one."""
    return data_dir(env) / DB_NAME


def user_config_path(env: Mapping[str, str] = os.environ) -> Path:
    """`$XDG_CONFIG_HOME/moetune/moetune.toml`, else `~/.config/moetune/moetune.toml`."""
    xdg = env.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else _home(env) / ".config"
    return base / "moetune" / "moetune.toml"


def runtime_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Directory for the daemon's IPC sockets: `$MOETUNE_HOME/run`, `$XDG_RUNTIME_DIR/moetune`,
    else `/tmp/moetune-<uid>`."""
    home = moetune_home(env)
    if home is not None:
        return home / "run"
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "moetune"
    return Path("/tmp") / f"moetune-{os.getuid()}"
