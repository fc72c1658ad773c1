"""The import rules of docs ARCHITECTURE ("Import rules"), checked on the AST of every module.

A text grep misses `from ..tuner import x` and imports inside functions; here every `import` and
`from ... import` statement of every module (module level, in functions, in classes) is resolved to the
absolute module it names, relative imports included. Imports under `if TYPE_CHECKING:` are typing only:
they count for no rule.

Each rule is a function from the import graph to a list of violations. It is tested twice: on the real
tree (no violation) and on a small synthetic tree with a planted violation (so the checker
itself is shown to catch it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# top-level folder -> package it installs as (pyproject's package-dir)
PACKAGES = {"tuner": "moetune.tuner", "runtime": "moetune.runtime", "migrations": "moetune.migrations",
            "policies": "moetune.policies"}


@dataclass(frozen=True)
class Import:
    source: str  # module that imports
    target: str  # absolute module name imported
    line: int


@dataclass
class Graph:
    modules: set[str]
    imports: list[Import]

    def of(self, source: str) -> list[Import]:
        return [i for i in self.imports if i.source == source]


def _module_name(path: Path, folder: Path, package: str) -> tuple[str, bool]:
    rel = path.relative_to(folder).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join([package, *parts]), is_pkg


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the statements inside `if TYPE_CHECKING:` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    for sub in ast.walk(stmt):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def build_graph(root: Path, packages: dict[str, str]) -> Graph:
    """Every import of every module under root/<folder> for the folders in `packages`, resolved."""
    files: list[tuple[Path, str, bool]] = []
    for folder, package in packages.items():
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            name, is_pkg = _module_name(path, base, package)
            files.append((path, name, is_pkg))
    modules = {name for _, name, _ in files}
    imports: list[Import] = []
    for path, name, is_pkg in files:
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _type_checking_lines(tree)
        here = name if is_pkg else name.rpartition(".")[0]  # the package relative imports start from
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in typing_only:
                continue
            if isinstance(node, ast.Import):
                imports += [Import(name, a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    if node.level - 1 >= len(parts):
                        raise AssertionError(f"{path}:{node.lineno}: relative import beyond the top package")
                    base_mod = ".".join(parts[: len(parts) - (node.level - 1)])
                    mod = f"{base_mod}.{node.module}" if node.module else base_mod
                else:
                    mod = node.module or ""
                # `from pkg import sub` imports the submodule pkg.sub when there is one, else names of pkg
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
                if len(subs) < len(node.names) or not subs:
                    imports.append(Import(name, mod, node.lineno))
                imports += [Import(name, s, node.lineno) for s in subs]
    return Graph(modules, imports)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _fmt(i: Import, why: str) -> str:
    return f"{i.source} imports {i.target} (line {i.line}): {why}"


# --------------------------------------------------------------------------------------------------
# the rules

FORBIDDEN_IN_RUNTIME = ("moetune.tuner", "moetune.migrations", "optuna", "sqlalchemy", "alembic", "typer",
                        "rich", "matplotlib")


def rule1_runtime_never_imports_the_tuner(g: Graph) -> list[str]:
    return [_fmt(i, "the runtime stays light") for i in g.imports
            if _under(i.source, "moetune.runtime") and any(_under(i.target, f) for f in FORBIDDEN_IN_RUNTIME)]


SCHEMAS = {f"moetune.runtime.{m}" for m in ("knobs", "shapes", "profile_record", "wire", "config", "paths", "options")}
DATA_PATH_EXEMPT = ("moetune.runtime.testing",)


def rule2_inside_the_runtime(g: Graph) -> list[str]:
    out = []
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for i in g.imports:
        top = i.target.split(".")[0]
        if i.source in SCHEMAS and i.target not in SCHEMAS and top not in stdlib and top != "msgspec":
            out.append(_fmt(i, "a schema imports only schemas, the standard library and msgspec"))
        if _under(i.source, "moetune.runtime.transports") and any(
                _under(i.target, f"moetune.runtime.{m}") for m in ("buffer", "moe_layer", "profiles")):
            out.append(_fmt(i, "transports never import the buffer, the MoE layer or the profiles"))
        if _under(i.source, "moetune.runtime.engines") and _under(i.target, "moetune.runtime.moe_layer"):
            out.append(_fmt(i, "engines never import the MoE layer (each call hands them the layer)"))
        if (_under(i.source, "moetune.runtime") and not any(_under(i.source, e) for e in DATA_PATH_EXEMPT)
                and _under(i.target, "moetune.runtime.testing")):
            out.append(_fmt(i, "the data path never imports runtime.testing"))
    return out


# `progress` (tuner/progress.py: the progress sink's protocol) sits below every tuner layer, beside the runtime: any
# layer may take a sink; it imports nothing of moetune (rank 0: importing even the runtime is a violation)
LAYERS = {"progress": 0, "fabric": 1, "fabric_model": 1, "store": 1, "measure": 1, "search": 2, "bringup": 3,
          "daemon": 3, "cli": 4}


def _layer(module: str) -> tuple[str, int] | None:
    """(subpackage, rank) of a module of the tuner or the runtime (rank 0); None for anything else."""
    if _under(module, "moetune.runtime"):
        return "runtime", 0
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["moetune", "tuner"] and parts[2] in LAYERS:
        return parts[2], LAYERS[parts[2]]
    return None


def rule3_tuner_layers(g: Graph) -> list[str]:
    out = []
    for i in g.imports:
        if not _under(i.source, "moetune.tuner"):
            continue
        src, dst = _layer(i.source), _layer(i.target)
        if src is None or src[0] == "runtime":
            continue
        if dst is None:
            if _under(i.target, "moetune.tuner") and i.target != "moetune.tuner":
                out.append(_fmt(i, "a tuner module outside the layers"))
            continue
        if src[0] != dst[0] and dst[1] >= src[1]:
            out.append(_fmt(i, f"layer {src[0]} may import only layers below it, not {dst[0]}"))
    return out


def rule4_migrations_import_only_the_models(g: Graph) -> list[str]:
    return [_fmt(i, "migrations import only moetune.tuner.store.models") for i in g.imports
            if _under(i.source, "moetune.migrations") and _under(i.target, "moetune")
            and i.target != "moetune.tuner.store.models" and not _under(i.target, "moetune.migrations")]


def rule5_typer_and_rich_only_in_the_cli(g: Graph) -> list[str]:
    return [_fmt(i, "typer and rich only in tuner/cli (library code takes a progress callback)") for i in g.imports
            if (_under(i.target, "typer") or _under(i.target, "rich")) and not _under(i.source, "moetune.tuner.cli")]


def find_cycles(g: Graph) -> list[list[str]]:
    """One cycle (as a path a -> b -> ... -> a) per strongly connected component of moetune modules."""
    edges: dict[str, set[str]] = {m: set() for m in g.modules}
    for i in g.imports:
        if i.target in g.modules and i.target != i.source:
            edges[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan, recursive: the graph is a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # a shortest way back to the start, inside the component
        start = min(comp)
        prev: dict[str, str] = {}
        todo, seen, found = [start], {start}, None
        while todo and found is None:
            nxt = []
            for v in todo:
                for w in sorted(edges[v] & comp):
                    if w == start:
                        found = v
                        break
                    if w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if found:
                    break
            todo = nxt
        path = [start]
        v = found
        while v is not None and v != start:
            path.insert(1, v)
            v = prev.get(v)
        cycles.append([*path, start])
    return cycles


def rule6_no_import_cycles(g: Graph) -> list[str]:
    return ["import cycle: " + " -> ".join(c) for c in find_cycles(g)]


RULES: dict[str, Callable[[Graph], list[str]]] = {
    "1": rule1_runtime_never_imports_the_tuner,
    "2": rule2_inside_the_runtime,
    "3": rule3_tuner_layers,
    "4": rule4_migrations_import_only_the_models,
    "5": rule5_typer_and_rich_only_in_the_cli,
    "6": rule6_no_import_cycles,
}

@pytest.fixture(scope="module")
def tree() -> Graph:
    return build_graph(ROOT, PACKAGES)


def test_the_tree_is_read(tree: Graph) -> None:
    # the checker sees relative and function-level imports of the real tree (else the rules prove nothing)
    assert "moetune.runtime.knobs" in tree.modules and "moetune.tuner.cli" in tree.modules
    assert any(i.source == "moetune.runtime.buffer.facade" and i.target == "moetune.runtime.profiles.autoload"
               for i in tree.imports)  # an import inside a function


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule_holds_on_the_tree(tree: Graph, rule: str) -> None:
    left = RULES[rule](tree)
    assert not left, f"rule {rule}:\n" + "\n".join(left)


def test_profile_client_leaves_torch_out() -> None:
    code = ("import sys; import moetune.runtime.profiles.client; "
            "bad = [m for m in ('torch', 'optuna', 'sqlalchemy', 'typer', 'rich', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# --------------------------------------------------------------------------------------------------
# the checker on planted violations


def _plant(tmp_path: Path, files: dict[str, str]) -> Graph:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in list(tmp_path.rglob("*")):  # every folder a package
        if d.is_dir() and not (d / "__init__.py").exists():
            (d / "__init__.py").write_text("")
    return build_graph(tmp_path, PACKAGES)


CLEAN = {
    "runtime/knobs.py": "from __future__ import annotations\nimport msgspec\nimport json\n",
    "runtime/wire.py": "from . import knobs\nfrom moetune.runtime.shapes import ModelShape\n",
    "runtime/shapes.py": "import dataclasses\n",
    "runtime/transports/nvlink.py": "from ..knobs import Knobs\n",
    "runtime/buffer/facade.py": "from moetune.runtime.transports import nvlink\n",
    "runtime/engines/unfused.py": "from .base import MoEEngine\nfrom ..buffer import facade\n",
    "runtime/testing/launch.py": "import torch\nfrom moetune.runtime.buffer import facade\n",
    "tuner/fabric/facts.py": "import msgspec\nfrom moetune.runtime import knobs\n",
    "tuner/search/tune.py": "from ..fabric import facts\nfrom moetune.tuner.measure import stats\n",
    "tuner/measure/stats.py": "import statistics\n",
    "tuner/cli/main.py": "import typer\nfrom rich.console import Console\nfrom moetune.tuner.search import tune\n",
    "migrations/versions/0001.py": "from alembic import op\nfrom moetune.tuner.store import models\n",
    "tuner/store/models.py": "import sqlalchemy\n",
}

PLANTED: dict[str, list[tuple[str, str, str]]] = {
    # rule: (file, code, a fragment of the violation it must produce)
    "1": [("runtime/buffer/facade.py", "def f():\n    from ...tuner.search import tune\n", "moetune.tuner.search.tune"),
          ("runtime/wire.py", "import optuna\n", "optuna"),
          ("runtime/profiles/client.py", "def g():\n    import rich.console\n", "rich.console")],
    "2": [("runtime/knobs.py", "import torch\n", "runtime.knobs imports torch"),
          ("runtime/shapes.py", "from .buffer import facade\n", "buffer.facade"),
          ("runtime/transports/nvlink.py", "from ..profiles import client\n", "imports moetune.runtime.profiles"),
          ("runtime/buffer/facade.py", "def h():\n    from ..testing.launch import free_port\n", "testing.launch"),
          ("runtime/engines/unfused.py", "from ..moe_layer import MoELayer\n", "engines never import the MoE layer")],
    "3": [("tuner/measure/stats.py", "from moetune.tuner.search import tune\n", "layer measure"),
          ("tuner/fabric/facts.py", "from ..fabric_model import routing\n", "layer fabric"),
          ("tuner/search/tune.py", "def k():\n    from moetune.tuner.cli import main\n", "layer search"),
          ("tuner/progress.py", "from moetune.runtime import knobs\n", "layer progress")],
    "4": [("migrations/versions/0001.py", "from moetune.tuner.store import store\n", "imports moetune.tuner.store ")],
    "5": [("tuner/search/tune.py", "def p():\n    from rich.progress import Progress\n", "rich.progress"),
          ("runtime/testing/launch.py", "import typer\n", "typer")],
    "6": [("runtime/shapes.py", "def c():\n    from moetune.runtime import wire\n",
           "moetune.runtime.shapes -> moetune.runtime.wire -> moetune.runtime.shapes")],
}


def test_the_synthetic_tree_is_clean(tmp_path: Path) -> None:
    g = _plant(tmp_path, CLEAN)
    assert {r: f(g) for r, f in RULES.items()} == {r: [] for r in RULES}


@pytest.mark.parametrize("rule,file,code,fragment", [
    pytest.param(r, f, c, frag, id=f"rule{r}-{f}") for r, cases in PLANTED.items() for f, c, frag in cases])
def test_each_rule_catches_a_planted_violation(tmp_path: Path, rule: str, file: str, code: str, fragment: str) -> None:
    files = dict(CLEAN)
    files[file] = files.get(file, "") + code
    g = _plant(tmp_path, files)
    found = RULES[rule](g)
    assert any(fragment in v for v in found), found


def test_relative_imports_resolve(tmp_path: Path) -> None:
    g = _plant(tmp_path, {"runtime/a/b.py": "from .. import c\nfrom ..c import d\nfrom . import e\nfrom ...tuner import x\n",
                          "runtime/c.py": "", "runtime/a/e.py": ""})
    assert {(i.target) for i in g.of("moetune.runtime.a.b")} == {
        "moetune.runtime.c", "moetune.runtime.a.e", "moetune.tuner"}


def test_typing_only_imports_count_for_nothing(tmp_path: Path) -> None:
    g = _plant(tmp_path, {"runtime/knobs.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"})
    assert rule2_inside_the_runtime(g) == []


def test_running_the_runtime_loads_no_tuner(tmp_path: Path) -> None:
    """Rule 1 at run time, for what the AST cannot see: imports by name (the transport registry, the lazy package
    attributes) and third-party modules importing others. Every runtime module is imported, every lazy public name
    resolved, and a layer is built with the autoload chain on (daemon, read-only database, policy) and run."""
    code = """
import importlib, pkgutil, sys, warnings
import moetune.runtime as rt, moetune.runtime.buffer as b, moetune.runtime.megakernel as mk
import moetune.runtime.transports as tr
for m in pkgutil.walk_packages(rt.__path__, "moetune.runtime."):
    importlib.import_module(m.name)
for pkg in (rt, b, mk, tr):
    for name in pkg.__all__:
        getattr(pkg, name)
import torch
from moetune.runtime.transports.registry import available_transports
available_transports("cpu")
warnings.simplefilter("ignore")
layer = rt.MoELayer(rt.get_model("custom:64,32,8,2,float32"), max_tokens=4, device="cpu")
layer(torch.randn(3, 64))
bad = sorted(k for k in sys.modules if k.split(".")[0] in ("optuna", "sqlalchemy", "alembic", "typer", "rich",
             "matplotlib") or k.startswith(("moetune.tuner", "moetune.migrations")))
assert not bad, bad
"""
    # the suite's MOETUNE_SYSTEM_CONFIG is kept: without it the child's profile lookup reads /etc/moetune/moetune.toml
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith("MOETUNE_") or k == "MOETUNE_SYSTEM_CONFIG"}
    env.update(MOETUNE_HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
