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
    (dict(max_tokens=2.5), TypeError, r"max_tokens must be an int >= 0, got float 2.5"),  # was truncated to 2
    (dict(max_tokens=True), TypeError, r"max_tokens must be an int >= 0, got bool"),  # was 1
    (dict(max_tokens=-1), ValueError, r"max_tokens must be >= 0, got -1"),
    (dict(dtype="bfloat16"), TypeError, r"EPBuffer: dtype must be a torch.dtype"),
    (dict(device=0.5), TypeError, r"EPBuffer: device must be a torch.device"),
    (dict(dense="no"), TypeError, r"EPBuffer: dense must be a bool or None, got str 'no'"),  # was the dense layout
    (dict(check_inputs="no"), TypeError, r"EPBuffer: check_inputs must be a bool, got str"),  # was checking
    (dict(check_inputs=None), TypeError, r"check_inputs must be a bool"),
    (dict(group="world"), TypeError, r"EPBuffer: group must be a torch.distributed ProcessGroup or None"),
])
def test_epbuffer_names_a_wrong_argument(kw: dict[str, Any], exc: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"group": None, "knobs": Knobs(), "model": M, "max_tokens": 8, "device": "cpu", **kw}
    with pytest.raises(exc, match=match):
        EPBuffer(args.pop("group"), args.pop("knobs"), **args)


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
