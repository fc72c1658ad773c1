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


def test_no_package_reexports_a_name_of_its_own_submodule() -> None:
    """`from pkg import mod` must give the module: a lazily re-exported function of the same name shadows it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    clashes = []
    for init in [*root.glob("tuner/**/__init__.py"), *root.glob("runtime/**/__init__.py")]:
        pkg = init.parent
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.Dict):
                for k in node.keys:
                    if isinstance(k, ast.Constant) and isinstance(k.value, str):
                        if (pkg / f"{k.value}.py").exists() or (pkg / k.value / "__init__.py").exists():
                            clashes.append(f"{pkg.relative_to(root)}: {k.value}")
    assert clashes == []
