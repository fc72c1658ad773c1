"""The environment of a CLI child process a test starts: only what the test names, plus the parent's PYTHONPATH.

Where moetune runs from a checkout on PYTHONPATH rather than an installed package (a GPU machine's run, which
links the checkout's folders into a namespace package), a child given a bare environment could not import the
code under test and failed with ModuleNotFoundError instead of the behaviour the test asserts."""

from __future__ import annotations

import os


def child_env(**values: str) -> dict[str, str]:
    """PATH=/usr/bin:/bin (unless given), the given variables, and the parent's PYTHONPATH where it has one."""
    env = {"PATH": "/usr/bin:/bin", **values}
    if os.environ.get("PYTHONPATH") and "PYTHONPATH" not in values:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env
