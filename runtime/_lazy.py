"""Lazy re-exports for package `__init__`s: a public name loads its module on first use.

So `import moetune.runtime` (the daemon, the profile client) never pays for torch, and importing one
submodule of a tuner package does not import its siblings.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `table` maps a public name to the (relative) module holding it."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            setattr(sys.modules[package], name, value)  # later lookups skip this function
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
