"""Every name a package `__init__` exports lazily (its `_LAZY` table) resolves and is in `__all__`, whose names all resolve.

A lazy table names the module a public name lives in; nothing checks that until a user asks for the name, so a
name moved or renamed in a refactor would raise AttributeError only at that user's first use."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = [
    "moetune.runtime",
    "moetune.runtime.buffer",
    "moetune.runtime.engines",
    "moetune.runtime.transports",
    "moetune.tuner.bringup",
    "moetune.tuner.daemon",
    "moetune.tuner.fabric_model",
    "moetune.tuner.search",
    "moetune.tuner.store",
]


def test_every_package_with_a_lazy_table_is_listed() -> None:
    from pathlib import Path

    found = []
    for top in ("runtime", "tuner"):  # each from its own folder: an editable install maps them, no common root
        root = Path(importlib.import_module(f"moetune.{top}").__path__[0])
        found += [".".join(("moetune", top, *p.parent.relative_to(root).parts))
                  for p in root.rglob("__init__.py") if "_LAZY = {" in p.read_text()]
    assert sorted(found) == sorted(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_lazy_names_resolve(package: str) -> None:
    mod = importlib.import_module(package)
    table = mod._LAZY
    missing = []
    for name, where in table.items():
        try:
            getattr(importlib.import_module(where, package), name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name} -> {where}: {e}")
    assert not missing, f"{package}: lazy names that do not resolve: {missing}"
    public = getattr(mod, "__all__", [])
    assert not set(table) - set(public), f"{package}: lazy names missing from __all__: {sorted(set(table) - set(public))}"
    assert not [n for n in public if not hasattr(mod, n)], f"{package}: __all__ names that do not resolve"
