"""Every registered transport declares the capabilities the EP buffer reads, and implements what it declares."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from moetune.runtime.transports import base
from moetune.runtime.transports.registry import get_transport, registered_transports

_METHODS = {
    "async_exchange": ("exchange_async", "exchange_blocks"),
    "dense_collectives": ("gather_async", "reduce_scatter_async"),
    "fused_counts": ("exchange_fused",),
    "strided_combine": ("exchange_strided",),
    "gathers_tokens": ("dispatch_gather",),
}


def test_the_base_class_declares_every_capability_with_a_default() -> None:
    for name in base.CAPABILITIES:
        assert isinstance(getattr(base.EPTransport, name), bool), name
    assert set(_METHODS) <= set(base.CAPABILITIES)


@pytest.mark.parametrize("name", registered_transports())
def test_registered_transport_implements_what_it_declares(name: str) -> None:
    cls = get_transport(name)
    for cap in base.CAPABILITIES:
        assert isinstance(getattr(cls, cap), bool), (name, cap)
    for cap, methods in _METHODS.items():
        for m in methods:
            overridden = getattr(cls, m) is not getattr(base.EPTransport, m)
            assert overridden == getattr(cls, cap), f"{name}: {cap}={getattr(cls, cap)} but {m} overridden={overridden}"
    params = inspect.signature(cls.__init__).parameters
    assert "options" in params, f"{name} must take options=RuntimeOptions"
    if cls.async_exchange:
        assert "channels" in params


def test_graph_capture_is_promised_by_each_transport_itself() -> None:
    """graph_capturable is a correctness promise: the base class does not make it (a new transport would inherit it
    untested); each capturable transport declares it in its own class body, where a capture test backs it."""
    assert base.EPTransport.graph_capturable is False
    capturable = {n for n in registered_transports() if get_transport(n).graph_capturable}
    assert capturable == {"collective", "nvlink", "host_staged"}
    for name in capturable:
        assert "graph_capturable" in vars(get_transport(name)), name
    assert get_transport("proxy").graph_capturable is False  # its call epoch comes from the host


def test_the_buffer_does_not_probe_its_transport() -> None:
    root = Path(base.__file__).resolve().parents[1] / "buffer"
    probes = []
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
                target = ast.unparse(node.args[0]) if node.args else ""
                if "transport" in target or target in ("cls", "t"):
                    probes.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes


# the data path's modules that hold transports or engines: none probes them (or itself) for an attribute
_DATA_PATH = ("transports", "buffer", "megakernel", "engines", "moe_layer.py", "pipeline.py")
_PROBED = ("self", "cls", "t", "mk")


def _probes(tree: ast.AST) -> list[tuple[int, str]]:
    """hasattr(x, ...) and three-argument getattr(x, name, default) where x is a transport, an engine or self."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
            target = ast.unparse(node.args[0])
            if target in _PROBED or any(w in target for w in ("transport", "engine", "megakernel")):
                out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_attribute_probes_on_transports_or_engines() -> None:
    root = Path(base.__file__).resolve().parents[1]
    found = []
    for part in _DATA_PATH:
        for path in ([root / part] if part.endswith(".py") else sorted((root / part).glob("*.py"))):
            found += [f"{path.relative_to(root)}:{line} {code}" for line, code in _probes(ast.parse(path.read_text()))]
    assert not found, "declare the attribute on the class instead of probing for it:\n" + "\n".join(found)


def test_the_probe_scan_sees_a_probe() -> None:
    code = "def close(self):\n    if getattr(self, '_closed', True):\n        return\n    hasattr(self.transport, 'x')\n"
    assert [line for line, _ in _probes(ast.parse(code))] == [2, 4]
    assert _probes(ast.parse("getattr(dist, 'all_gather_single', None)\ngetattr(self, name)\n")) == []
