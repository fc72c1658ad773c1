"""The environment of a CLI child process a test starts: only what the test names, plus the parent's PYTHONPATH.

Where moetune runs from a checkout on PYTHONPATH rather than an installed package (a GPU machine's run, which
links the checkout's folders into a namespace package), a child given a bare environment could not import the
code under test and failed with ModuleNotFoundError instead of the behaviour the test asserts. A bare environment
also lacked the test suite's MOETUNE_SYSTEM_CONFIG, so the child read this machine's system config file."""

from __future__ import annotations

import os

# What the parent passes on unless the test names it: the code under test, and the system config file the test
# suite moved away (tests/conftest.py): else a child read this machine's /etc/moetune/moetune.toml
_PASSED_ON = ("PYTHONPATH", "MOETUNE_SYSTEM_CONFIG")


def child_env(**values: str) -> dict[str, str]:
    """PATH=/usr/bin:/bin (unless given), the given variables, and the parent's PYTHONPATH and MOETUNE_SYSTEM_CONFIG
    where it has them."""
    env = {"PATH": "/usr/bin:/bin", **values}
    for name in _PASSED_ON:
        if os.environ.get(name) and name not in values:
            env[name] = os.environ[name]
    return env
