"""The distribution maps the repository's folders under the `moetune` namespace only."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_is_listed() -> None:
    cfg = _pyproject()["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join((pkg, *rel.parts)) if rel.parts else pkg
            if "__pycache__" in name:
                continue
            assert name in listed, f"{name} ({init.parent}) is missing from [tool.setuptools] packages"


def test_runtime_never_imports_tuner_side() -> None:
    banned = ("moetune.tuner", "optuna", "sqlalchemy", "alembic", "typer")
    for path in (ROOT / "runtime").rglob("*.py"):
        text = path.read_text()
        for name in banned:
            assert f"import {name}" not in text and f"from {name}" not in text, f"{path} imports {name}"
