"""Argument checks shared by the runtime's public constructors (EPBuffer, MoELayer, MegakernelMoE, the transports).

A wrong type or value raises TypeError / ValueError naming the argument before anything is built from it, instead
of an AttributeError deep inside (`'str' object has no attribute 'dtype'`) or a value taken silently (max_tokens=2.5
truncated to 2, dense="no" read as True). Written once here so the entry points say the same thing. One check of
their calls too: `grad_problem`, inputs that want a gradient from a forward-only op (the layers, EPBuffer.dispatch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import ModelShape


def check_model(model: Any, who: str = "") -> None:
    if not isinstance(model, ModelShape):
        hint = f"; for a model name use moetune.runtime.get_model({model!r})" if isinstance(model, str) else ""
        raise TypeError(f"{who}model must be a ModelShape, got {type(model).__name__}{hint}")


def check_knobs(knobs: Any, who: str = "", *, optional: bool = True) -> None:
    if (knobs is None and optional) or isinstance(knobs, Knobs):
        return
    hint = "; build one with Knobs.from_dict(...)" if isinstance(knobs, Mapping) else ""
    raise TypeError(f"{who}knobs must be a Knobs{' or None' if optional else ''}, got {type(knobs).__name__}{hint}")


def check_int(name: str, value: Any, minimum: int, who: str = "") -> None:
    """An int (not a bool, not a float that would be truncated) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{who}{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{who}{name} must be >= {minimum}, got {value}")


def check_flag(name: str, value: Any, who: str = "", *, optional: bool = False) -> None:
    """A bool (or None where allowed): a truthy string such as "no" must not switch a layout on."""
    if (value is None and optional) or isinstance(value, bool):
        return
    raise TypeError(f"{who}{name} must be a bool{' or None' if optional else ''}, got {type(value).__name__} {value!r}")


def check_device(device: Any, who: str = "") -> None:
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"{who}device must be a torch.device, a str such as 'cuda:0', or None, got "
                        f"{type(device).__name__}")


def indexed_device(device: Any) -> torch.device:
    """`device` as a torch.device, "cuda" without an index being the current CUDA device (as EPBuffer, MoELayer and
    MegakernelMoE take it), so that tensors made on `cuda:0` compare equal to it; "cpu:N" is "cpu" (the device every
    CPU tensor reports, whatever index it was made with: kept as "cpu:1", no input would ever be on it)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type == "cpu" and dev.index is not None:
        dev = torch.device("cpu")
    return dev


def cuda_device_problem(device: torch.device) -> str | None:
    """Why this process cannot use CUDA device `device` (indexed, as `indexed_device` gives it), or None (None too
    for a device that is not CUDA): no CUDA, or an index past the devices it sees, which torch takes as given until
    the first allocation fails with "CUDA error: invalid device ordinal"."""
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"device {device}: CUDA is not available to torch"
    n = torch.cuda.device_count()
    if device.index is not None and device.index >= n:
        return f"device {device}: this process sees {n} CUDA device(s)"
    return None


def usable_device(device: Any, who: str = "") -> torch.device:
    """`device` (not None) indexed as `indexed_device` gives it, checked usable by this process: ValueError naming
    `who` and the device where torch cannot parse it, it is no cpu or cuda device, or CUDA cannot serve it (EPBuffer's
    check, and MoELayer's before its buffer is built: the layer's refusal named "EPBuffer: device=...")."""
    try:  # named: torch's own refusal ('Torch not compiled with CUDA enabled') names no argument
        dev = indexed_device(device)
    except Exception as e:
        raise ValueError(f"{who}device={device!r}: {e}") from None
    if dev.type not in ("cpu", "cuda"):  # meta, xla, ...: no transport moves rows there
        raise ValueError(f"{who}device must be a cpu or cuda device, got {dev}")
    why = cuda_device_problem(dev)  # the device named, not the transport or an invalid ordinal
    if why is not None:
        raise ValueError(f"{who}{why}")
    return dev


# The activation dtypes the EP buffer and the layers run (a row's payload; the model shapes allow the same three)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_dtype(dtype: Any, who: str = "") -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{who}dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {type(dtype).__name__} "
                        f"{dtype!r}")
    if dtype is not None and dtype not in ACTIVATION_DTYPES:
        # named here, with the caller: the buffer's later check said "activation dtype ..." without the argument,
        # and a MoELayer's refusal named neither the layer nor `dtype`
        raise ValueError(f"{who}dtype must be {', '.join(map(str, ACTIVATION_DTYPES))} (the activation dtype) or None "
                         f"(the model's), got {dtype}")


def check_group(group: Any, who: str = "") -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{who}group must be a torch.distributed ProcessGroup or None (the default group), got "
                        f"{type(group).__name__}")


def grad_problem(who: str, *, noun: str = "", fix: str = "pass detached tensors", **tensors: Any) -> str | None:
    """Why a call of `who` (a forward-only op: no backward) must not take these tensors now, or None: grad mode is on
    and one of them requires grad, so autograd would expect the output to carry a gradient back to it, and the output
    comes back detached instead (the gradient silently stops there). Grad mode off (torch.no_grad, inference_mode, an
    autograd.Function's forward, whose backward is the caller's) takes them. `noun` ("parameter") goes before the
    names, `fix` is the way out named after no_grad and inference_mode."""
    if not torch.is_grad_enabled():
        return None
    wanted = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanted:
        return None
    one = len(wanted) == 1
    names = wanted[0] if one else f"{', '.join(wanted[:-1])} and {wanted[-1]}"
    if noun:
        names = f"{noun}{'' if one else 's'} {names}"
    return (f"{names} require{'s' if one else ''} grad, but {who} is forward-only (no backward: its output would "
            f"silently carry no gradient back); call it under torch.no_grad() or torch.inference_mode(), or {fix}")
