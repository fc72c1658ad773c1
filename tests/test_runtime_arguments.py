"""EPBuffer's and the transports' constructors on CPU: a wrong argument is named (TypeError / ValueError) before
anything is built from it, instead of an AttributeError deep inside, a float truncated or a truthy string taken as
True. The checks are the ones MoELayer already had (runtime/_args.py holds them once)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moetune.runtime.buffer.facade import EPBuffer
from moetune.runtime.knobs import Knobs
from moetune.runtime.options import RuntimeOptionError, RuntimeOptions
from moetune.runtime.shapes import ModelShape
from moetune.runtime.transports.registry import get_transport

pytestmark = pytest.mark.timeout(120)
M = ModelShape(name="tiny", hidden=64, intermediate=32, experts=8, topk=2, dtype="float32")


@pytest.fixture(autouse=True)
def _no_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETUNE_AUTOLOAD", "0")  # no daemon or database


@pytest.mark.parametrize(("kw", "exc", "match"), [
    (dict(model="qwen3-30b"), TypeError, r"EPBuffer: model must be a ModelShape, got str; .*get_model\('qwen3-30b'\)"),
    (dict(knobs={"transport": "collective"}), TypeError, r"EPBuffer: knobs must be a Knobs or None, got dict"),
    (dict(max_tokens="8"), TypeError, r"EPBuffer: max_tokens must be an int >= 0, got str '8'"),
    (dict(max_tokens=2.5), TypeError, r"max_tokens must be an int >= 0, got float 2.5"),  # not truncated to 2
    (dict(max_tokens=True), TypeError, r"max_tokens must be an int >= 0, got bool"),  # not taken as 1
    (dict(max_tokens=-1), ValueError, r"max_tokens must be >= 0, got -1"),
    (dict(dtype="bfloat16"), TypeError, r"EPBuffer: dtype must be a torch.dtype"),
    # the argument named ("activation dtype must be ..." said neither `dtype` nor who refused it)
    (dict(dtype=torch.float64), ValueError, r"EPBuffer: dtype must be torch.bfloat16, torch.float16, torch.float32 .*"
                                            r"got torch.float64"),
    (dict(device=0.5), TypeError, r"EPBuffer: device must be a torch.device"),
    (dict(dense="no"), TypeError, r"EPBuffer: dense must be a bool or None, got str 'no'"),  # not the dense layout
    (dict(check_inputs="no"), TypeError, r"EPBuffer: check_inputs must be a bool, got str"),  # not taken as true
    (dict(check_inputs=None), TypeError, r"check_inputs must be a bool"),
    (dict(group="world"), TypeError, r"EPBuffer: group must be a torch.distributed ProcessGroup or None"),
])
def test_epbuffer_names_a_wrong_argument(kw: dict[str, Any], exc: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"group": None, "knobs": Knobs(), "model": M, "max_tokens": 8, "device": "cpu", **kw}
    with pytest.raises(exc, match=match):
        EPBuffer(args.pop("group"), args.pop("knobs"), **args)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64])
def test_moelayer_names_a_dtype_it_cannot_run(dtype: torch.dtype) -> None:
    from moetune.runtime.moe_layer import MoELayer

    with pytest.raises(ValueError, match=rf"^MoELayer: dtype must be torch.bfloat16, .* got {dtype}$"):
        MoELayer(M, None, Knobs(), max_tokens=8, device="cpu", dtype=dtype)


def test_epbuffer_still_takes_what_it_documents() -> None:
    for dense in (None, False, True):
        b = EPBuffer(None, Knobs(), model=M, max_tokens=0, device=torch.device("cpu"), dtype=torch.float32,
                     check_inputs=False, dense=dense)
        assert b.max_tokens == 0 and b.check_inputs is False


@pytest.mark.parametrize("name", ["collective", "host_staged"])
def test_transport_constructor_checks_its_arguments(name: str) -> None:
    cls = get_transport(name)
    knobs = Knobs(transport=name)
    cpu = torch.device("cpu")
    with pytest.raises(TypeError, match=rf"{cls.__name__}: knobs must be a Knobs, got dict; build one with"):
        cls(None, {"transport": name}, cpu)
    with pytest.raises(TypeError, match=rf"{cls.__name__}: device must be a torch.device or a str"):
        cls(None, knobs, 0.5)
    with pytest.raises(TypeError, match=r"options must be a RuntimeOptions, a mapping of option names or None"):
        cls(None, knobs, cpu, options="symm=ipc")
    with pytest.raises(RuntimeOptionError, match="symm"):
        cls(None, knobs, cpu, options={"symm": "nvshmem"})
    for bad, exc in (("2", TypeError), (0, ValueError), (2.0, TypeError)):
        with pytest.raises(exc, match=rf"{cls.__name__}: channels must be"):
            cls(None, knobs, cpu, channels=bad)
    # a str device and a mapping of options are taken as EPBuffer takes them (the collective stored a dict of
    # options as is, to fail later as an AttributeError; host_staged failed on `device.type` of a str)
    t = cls(None, knobs, "cpu", options={"onesided_timeout_s": 3.0})
    assert t.device == cpu and isinstance(t.options, RuntimeOptions) and t.options.onesided_timeout_s == 3.0


@pytest.mark.parametrize("name", ["nvlink", "proxy"])
def test_one_sided_constructor_names_wrong_knobs(name: str) -> None:
    cls = get_transport(name)
    with pytest.raises(TypeError, match=rf"{cls.__name__}: knobs must be a Knobs"):
        cls(None, {"transport": name}, torch.device("cpu"))


# -- the routed inputs: one check (runtime/routing.py) for the EP buffer and the world-1 layer --------------------
_ROUTING_MISTAKES = {
    "idx_shape": lambda idx, w: (idx[:, :1], w),
    "idx_float": lambda idx, w: (idx.float(), w),
    "idx_bool": lambda idx, w: (idx.bool(), w),
    "weights_shape": lambda idx, w: (idx, w[:, :1]),
    "weights_int": lambda idx, w: (idx, idx),
    "idx_device": lambda idx, w: (idx.to("meta"), w),
    "weights_device": lambda idx, w: (idx, w.to("meta")),
    "idx_range": lambda idx, w: (idx.clone().fill_(M.experts), w),
    "idx_negative": lambda idx, w: (torch.where(idx == idx[0, 0], -3, idx), w),
}


@pytest.mark.parametrize("mistake", sorted(_ROUTING_MISTAKES))
def test_buffer_and_layer_report_a_routing_mistake_alike(mistake: str) -> None:
    from moetune.runtime.moe_layer import MoELayer

    layer = MoELayer(M, None, Knobs(), max_tokens=8, device="cpu", engine="unfused")
    x = torch.randn(5, M.hidden)
    idx, w = layer.route(x)
    bad_idx, bad_w = _ROUTING_MISTAKES[mistake](idx, w)
    with pytest.raises(ValueError) as at_world1:
        layer.forward_routed(x, bad_idx, bad_w)
    for dense in (False, True):
        buf = EPBuffer(None, Knobs(), model=M, max_tokens=8, device="cpu", dense=dense)
        with pytest.raises(ValueError) as in_buffer:
            buf.dispatch(x, bad_idx, bad_w)
        assert str(in_buffer.value) == f"EPBuffer.dispatch on rank 0: {at_world1.value}"


def test_every_routing_fault_has_a_wire_code() -> None:
    from moetune.runtime.buffer._meta import _ERRORS, _ROUTED_CODES
    from moetune.runtime.routing import ROUTED_FAULTS

    assert set(_ROUTED_CODES) == set(ROUTED_FAULTS) and set(_ROUTED_CODES.values()) <= set(_ERRORS)


def test_lazy_packages_name_a_missing_attribute() -> None:
    import moetune.runtime as rt
    import moetune.runtime.buffer as buf
    import moetune.runtime.megakernel as mk

    for pkg in (rt, buf, mk):
        with pytest.raises(AttributeError, match=rf"module '{pkg.__name__}' has no attribute 'Nope'"):
            pkg.Nope  # noqa: B018
    assert mk.MegakernelMoE.__name__ == "MegakernelMoE" and issubclass(mk.MegakernelError, RuntimeError)


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1", torch.device("cpu", 0)])
def test_an_indexed_cpu_device_is_the_cpu(device: Any) -> None:
    """CPU tensors report device "cpu" whatever index they were made with ("cpu:1" included): a buffer or layer built
    with an indexed CPU device takes it as "cpu", instead of refusing every input as "on the wrong device"."""
    from moetune.runtime.moe_layer import MoELayer

    buf = EPBuffer(None, Knobs(), model=M, max_tokens=8, device=device)
    assert buf.device == torch.device("cpu")
    x = torch.randn(3, M.hidden, device=device)
    idx = torch.tensor([[0, 1]] * 3, device=device)
    buf.dispatch(x, idx, torch.full((3, 2), 0.5, device=device))
    layer = MoELayer(M, None, Knobs(), max_tokens=8, device=device, engine="unfused")
    assert layer.device == torch.device("cpu") and layer(x).shape == x.shape
    assert MoELayer(M, max_tokens=8, buffer=buf, device=device, engine="unfused").buffer is buf  # agrees


@pytest.mark.parametrize("dense", [False, True])
def test_epbuffer_dispatch_refuses_inputs_that_want_a_gradient(dense: bool) -> None:
    """dispatch moves rows by copies and collectives autograd does not see: in grad mode an x or topk_weights that
    requires grad came back as rows that did not (the gradient silently stopped here). Named now; grad mode off (an
    autograd.Function around dispatch, whose backward is the caller's) takes them."""
    buf = EPBuffer(None, Knobs(), model=M, max_tokens=8, device="cpu", dense=dense)
    x = torch.randn(3, M.hidden, requires_grad=True)
    idx, w = torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match=r"EPBuffer.dispatch on rank 0: x requires grad, but EPBuffer.dispatch is "
                                         r"forward-only .*torch.no_grad\(\)"):
        buf.dispatch(x, idx, w)
    with pytest.raises(ValueError, match=r"EPBuffer.dispatch on rank 0: topk_weights requires grad"):
        buf.dispatch(x.detach(), idx, w.clone().requires_grad_())

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return buf.dispatch(t, idx, w)[0].clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g[:3]

    assert Dispatch.apply(x).requires_grad
    with torch.no_grad():
        buf.dispatch(x, idx, w)


@pytest.mark.parametrize(("device", "gpus", "match"), [
    ("cuda:7", 1, r"device cuda:7: this process sees 1 CUDA device"),
    (torch.device("cuda", 2), 2, r"device cuda:2: this process sees 2 CUDA device"),
    ("cuda:0", 0, r"device cuda:0: CUDA is not available to torch"),
])
def test_a_cuda_device_this_process_cannot_use_is_named(monkeypatch: pytest.MonkeyPatch, device: Any, gpus: int,
                                                        match: str) -> None:
    """A CUDA index past the devices this process sees (cuda:8 on an 8-GPU node) passed every check and failed at the
    first allocation with "CUDA error: invalid device ordinal"; without CUDA the message blamed the knob `transport`.
    Named as the device argument now, before anything is built (tests/test_runtime_gpu.py asks a real GPU too)."""
    from moetune.runtime.moe_layer import MoELayer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ValueError, match=rf"EPBuffer: {match}"):
        EPBuffer(None, Knobs(), model=M, max_tokens=8, device=device)
    with pytest.raises(ValueError, match=rf"MoELayer: {match}"):  # the layer's own argument: "EPBuffer: " before
        MoELayer(M, None, Knobs(), max_tokens=8, device=device, engine="unfused")


@pytest.mark.parametrize("dense", [False, True])
def test_epbuffer_combine_refuses_an_expert_out_that_wants_a_gradient(dense: bool) -> None:
    """combine at world 1 was plain torch ops (differentiable), at world > 1 copies and collectives autograd does not
    see (the gradient silently stopped there): one rule at every world now, as dispatch's. Grad mode off (an
    autograd.Function around combine, whose backward is the caller's) takes it."""
    buf = EPBuffer(None, Knobs(), model=M, max_tokens=8, device="cpu", dense=dense)
    x = torch.randn(3, M.hidden)
    idx, w = torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
    recv_x, _meta, handle = buf.dispatch(x, idx, w)
    eo = recv_x.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"EPBuffer.combine on rank 0: expert_out requires grad, but EPBuffer.combine "
                                         r"is forward-only .*torch.no_grad\(\)"):
        buf.combine(eo, handle)

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return buf.combine(t, handle).clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(eo)

    assert Combine.apply(eo).requires_grad
    with torch.no_grad():
        assert buf.combine(eo, handle).shape == x.shape
    assert buf.combine(eo.detach(), handle).shape == x.shape


def test_a_buffer_or_layer_copied_or_pickled_is_refused_naming_why() -> None:
    """copy.deepcopy(layer) / torch.save(layer) raised "cannot pickle '_thread.lock' object" from inside pickle."""
    import copy
    import io
    import pickle

    from moetune.runtime.moe_layer import MoELayer

    layer = MoELayer(M, None, Knobs(), max_tokens=8, device="cpu", engine="unfused")
    for what in (lambda: copy.deepcopy(layer), lambda: copy.copy(layer.buffer), lambda: pickle.dumps(layer.buffer),
                 lambda: torch.save(layer, io.BytesIO())):
        with pytest.raises(TypeError, match=r"^EPBuffer cannot be copied or pickled .* save a layer's weights with "
                                            r"state_dict\(\)$"):
            what()
    torch.save(layer.state_dict(), io.BytesIO())  # the weights still save
