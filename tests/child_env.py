"""The environment of a CLI child process a test starts: only what the test names, plus what keeps the child on
the code under test and off this machine's and this user's moetune files.

Where moetune runs from a checkout on PYTHONPATH rather than an installed package (a GPU machine's run, which
links the checkout's folders into a namespace package), a child given a bare environment could not import the
code under test and failed with ModuleNotFoundError instead of the behaviour the test asserts. A bare environment
also lacked the variables tests/conftest.py moves the config files and folders with, so the child read this
machine's /etc/moetune/moetune.toml and (no HOME: the password database's) the user's ~/.config/moetune/moetune.toml."""

from __future__ import annotations

import os

# What the parent passes on unless the test names it: the code under test, the system config file and the
# daemon's runtime folder the suite moved away (tests/conftest.py)
_PASSED_ON = ("PYTHONPATH", "MOETUNE_SYSTEM_CONFIG", "XDG_RUNTIME_DIR")
# the user's config and data folders, unless the test names HOME: then HOME/.config and HOME/.local/share are the
# test's own, which these variables would take the place of
_PASSED_ON_WITHOUT_HOME = ("XDG_CONFIG_HOME", "XDG_DATA_HOME")


def child_env(**values: str) -> dict[str, str]:
    """PATH=/usr/bin:/bin (unless given), the given variables, and the parent's PYTHONPATH, MOETUNE_SYSTEM_CONFIG,
    XDG_RUNTIME_DIR (and XDG_CONFIG_HOME, XDG_DATA_HOME where HOME is not given) where it has them."""
    env = {"PATH": "/usr/bin:/bin", **values}
    names = _PASSED_ON + (() if "HOME" in values else _PASSED_ON_WITHOUT_HOME)
    for name in names:
        if os.environ.get(name) and name not in values:
            env[name] = os.environ[name]
    return env
