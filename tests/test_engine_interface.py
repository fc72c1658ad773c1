"""The MoE layer's engines (runtime/engines/): one interface with its capabilities declared on the class, chosen
once at construction, and a layer that delegates to its engine instead of testing which one it holds. CPU only: the
megakernel is the CPU stand-in of tests/megakernel_fakes.py."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megakernel_fakes import use_fake_megakernel

from moetune.runtime.engines import base
from moetune.runtime.engines.choice import ENGINE_CLASSES
from moetune.runtime.engines.megakernel import MegakernelEngine
from moetune.runtime.engines.unfused import UnfusedEngine
from moetune.runtime.knobs import ENGINES, Knobs
from moetune.runtime.megakernel import engine as E
from moetune.runtime.moe_layer import MoELayer
from moetune.runtime.shapes import ModelShape

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("autoload_off")]
TINY = ModelShape(name="tiny", hidden=128, intermediate=64, experts=4, topk=2, dtype="bfloat16")


def test_every_engine_of_the_knob_has_a_class_declaring_every_capability() -> None:
    assert set(ENGINE_CLASSES) == set(ENGINES)
    for name, cls in ENGINE_CLASSES.items():
        assert cls.name == name and issubclass(cls, base.MoEEngine) and not inspect.isabstract(cls)
        for cap in base.CAPABILITIES:
            assert isinstance(getattr(cls, cap), bool), f"{name} does not declare {cap} as a bool"
    assert MegakernelEngine.distinct_expert_ids and MegakernelEngine.tiled_weights
    assert not UnfusedEngine.distinct_expert_ids and not UnfusedEngine.tiled_weights


def test_the_megakernel_engine_refuses_a_group_of_several_ranks() -> None:
    why = MegakernelEngine.problem("cpu", torch.bfloat16, TINY, 2)
    assert why == "it runs the layer on one GPU (world 1); this group has 2 ranks"
    assert "no CUDA device" in str(MegakernelEngine.problem("cpu", torch.bfloat16, TINY, 1))
    assert UnfusedEngine.problem("cpu", torch.float32, TINY, 8) is None


def test_the_layer_does_not_test_which_engine_it_holds() -> None:
    """MoELayer hands calls to its engine: no comparison of `megakernel` / `engine` and no isinstance of an engine
    class in runtime/moe_layer.py (a capability on the engine class says what differs)."""
    import moetune.runtime.moe_layer as ml

    found = []
    for node in ast.walk(ast.parse(Path(ml.__file__).read_text())):
        if isinstance(node, ast.Compare):  # `self.megakernel is not None`, `layer.engine == "megakernel"`, ...
            if any(isinstance(n, ast.Attribute) and n.attr in ("megakernel", "engine", "_engine") for n in ast.walk(node)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            if "Engine" in ast.unparse(node.args[1]):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    assert found == []


def _spy(monkeypatch: pytest.MonkeyPatch, answer: str | None) -> list[Any]:
    """Counts the layer's `megakernel_problem` calls (those naming a model: the autoload chain asks with the device
    only)."""
    calls: list[Any] = []

    def problem(device: Any, dtype: Any = None, model: Any = None) -> str | None:
        if model is not None:
            calls.append(device)
        return answer

    monkeypatch.setattr(E, "megakernel_problem", problem)
    return calls


@pytest.mark.parametrize(("kw", "engine"), [({}, "megakernel"),  # auto: the policy default names the megakernel
                                           ({"knobs": Knobs(engine="megakernel")}, "megakernel"),
                                           ({"engine": "megakernel"}, "megakernel"),
                                           ({"engine": "unfused"}, "unfused")])
def test_megakernel_problem_is_asked_at_most_once_per_decision(monkeypatch: pytest.MonkeyPatch, kw: dict,
                                                               engine: str) -> None:
    use_fake_megakernel(monkeypatch)
    calls = _spy(monkeypatch, None)
    layer = MoELayer(TINY, None, kw.pop("knobs", None), max_tokens=16, device="cpu", dtype=torch.bfloat16, **kw)
    assert layer.engine == engine
    assert len(calls) == (engine == "megakernel")


def test_a_fallback_asks_once_too(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_megakernel(monkeypatch)
    calls = _spy(monkeypatch, "sm_80 (test)")
    with pytest.warns(E.EngineFallbackWarning, match="sm_80"):
        layer = MoELayer(TINY, None, Knobs(engine="megakernel"), max_tokens=16, device="cpu", dtype=torch.bfloat16)
    assert layer.engine == "unfused" and layer.engine_note == "sm_80 (test)" and len(calls) == 1
    with pytest.raises(E.MegakernelUnavailable, match="cannot run here: sm_80"):
        MoELayer(TINY, None, None, max_tokens=16, device="cpu", dtype=torch.bfloat16, engine="megakernel")
    assert len(calls) == 2


def test_a_request_the_megakernel_cannot_serve_looks_up_no_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine="megakernel" without knobs, for a layer on the CPU, raises MegakernelUnavailable before any lookup of
    the megakernel profile (daemon, database; on a miss a "NO tuned profile ... policy default" warning), which
    would be wasted work and a misleading warning."""
    from moetune.runtime.profiles import autoload

    families: list[str] = []
    real = autoload.autoload_profile
    monkeypatch.setattr(autoload, "autoload_profile",
                        lambda **kw: families.append(kw["transport_family"]) or real(**kw))
    with pytest.raises(E.MegakernelUnavailable, match=r"cannot run here: no CUDA device \(the layer is on cpu\)"):
        MoELayer(TINY, None, None, max_tokens=16, device="cpu", dtype=torch.bfloat16, engine="megakernel")
    assert families == []  # nor the EP profile: a world-1 layer's buffer never exchanges, so it looks none up
    use_fake_megakernel(monkeypatch)  # where it can run, the request still runs the stored profile
    layer = MoELayer(TINY, None, None, max_tokens=16, device="cpu", dtype=torch.bfloat16, engine="megakernel")
    assert layer.engine == "megakernel" and families == [E.ENGINE_FAMILY]


def test_the_layer_shows_its_engines_state(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_megakernel(monkeypatch)
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    mk = MoELayer(TINY, None, None, max_tokens=16, device="cpu", dtype=torch.bfloat16)  # auto: per token bucket
    assert (mk.engine, mk.weights_tiled, mk.engine_knobs) == ("megakernel", True, Knobs(engine="megakernel"))
    assert mk.megakernel is mk._engine.megakernel and mk.engine_buckets == {16: Knobs(engine="megakernel")}
    un = MoELayer(TINY, None, None, max_tokens=16, device="cpu", dtype=torch.bfloat16, engine="unfused")
    assert (un.engine, un.weights_tiled, un.engine_knobs, un.engine_buckets, un.megakernel) == (
        "unfused", False, None, None, None)
    assert un.resolve_buckets() == {}


def test_every_declared_capability_and_hook_is_used_by_the_layer() -> None:
    """A capability or optional hook the layer never reads is a contract nobody keeps (graph_capturable and resolve
    were such): each one the base class declares is read or called in runtime/moe_layer.py."""
    src = (Path(base.__file__).resolve().parents[1] / "moe_layer.py").read_text()
    hooks = [n for n, v in vars(base.MoEEngine).items()
             if inspect.isfunction(v) and not n.startswith("_") and n not in ("problem", "forward", "forward_routed")]
    for name in [*base.CAPABILITIES, *hooks]:
        assert f"_engine.{name}" in src, name


def test_unfused_forward_on_several_ranks_reports_x_on_another_device_through_the_collective_check() -> None:
    """At world > 1 an x on another device than the layer's takes the path of a wrongly shaped x: the dispatch's
    input check, which every rank takes part in (its error names x and the device). Sent to the gate first, it
    would raise a device-mismatch RuntimeError from the matmul naming neither x nor the layer, on this rank only,
    while its peers wait in their dispatch."""
    calls: list[tuple[Any, ...]] = []

    def route(x: torch.Tensor) -> Any:
        raise RuntimeError("Expected all tensors to be on the same device")  # what the gate's matmul raises

    layer: Any = type("Layer", (), {})()
    layer.buffer = type("Buffer", (), {"world": 2})()
    layer.model, layer.device = TINY, torch.device("cpu")
    layer.route = route
    layer.forward_routed = lambda x, idx, w: calls.append((x, idx, w)) or "checked"
    engine = UnfusedEngine()
    engine.rebind = lambda layer: None  # the stand-in has no parameters
    x = torch.zeros(3, TINY.hidden, device="meta")
    assert engine.forward(layer, x) == "checked"
    (got_x, idx, w), = calls
    assert got_x is x and idx.shape == w.shape == (3, TINY.topk) and idx.device == w.device == layer.device


def test_a_megakernel_request_that_cannot_run_is_refused_before_the_weights_are_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """engine="megakernel" on a CPU: refused before the layer builds its weights (deepseek-v3's 256 experts take
    minutes and more memory than many nodes have on a CPU), not after them."""
    from moetune.runtime import moe_layer
    from moetune.runtime.shapes import get_model

    built: list[int] = []
    monkeypatch.setattr(moe_layer, "expert_weights", lambda *a, **kw: built.append(1) or (_ for _ in ()).throw(
        AssertionError("weights built before the refusal")))
    with pytest.raises(E.MegakernelUnavailable, match=r"no CUDA device \(the layer is on cpu\)"):
        MoELayer(get_model("deepseek-v3"), None, None, max_tokens=16, device="cpu", dtype=torch.bfloat16,
                 engine="megakernel")
    assert built == []
