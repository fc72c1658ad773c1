"""Whether the megakernel can run a layer here, and what a layer says when it cannot.

`megakernel_problem` is cheap (no build, no launch): a CUDA sm_90 device, bf16, the shape within the kernel's
limits and a way to get the library. `build_megakernel` is the one seam through which a layer builds
`MegakernelMoE` (CPU tests stand a fake in). `MegakernelUnavailable` and `EngineFallbackWarning` are what the
engine choice (runtime/engines/choice.py: which engine a `MoELayer` runs, its rules) raises or warns where the
megakernel was asked for or named and cannot run; the megakernel engine itself is runtime/engines/megakernel.py.
Imports torch lazily (the autoload chain calls `megakernel_problem` for the `megakernel` family).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from moetune.runtime import _once
from moetune.runtime.megakernel.config import limits_problem
from moetune.runtime.profile_record import MEGAKERNEL_FAMILY

log = logging.getLogger("moetune.megakernel")

ENGINE_FAMILY = MEGAKERNEL_FAMILY  # the ProfileKey transport_family of megakernel profiles (ep_size 1, nodes 1)


class MegakernelUnavailable(RuntimeError):
    """`engine="megakernel"` was asked for where the megakernel cannot run; the message says why."""


class EngineFallbackWarning(UserWarning):
    """The layer runs the unfused engine although the knobs or the profile named the megakernel."""


def warn_fallback_once(reason: str) -> None:
    """One warning per process and reason (many layers of one model share it)."""
    msg = f"moetune: MoE layer runs the UNFUSED engine: the megakernel cannot run here ({reason})"
    _once.say_once("megakernel.fallback", reason, msg, category=EngineFallbackWarning, logger=log, stacklevel=3)


def megakernel_problem(device: Any, dtype: Any = None, model: Any = None) -> str | None:
    """Why the megakernel cannot run a layer on `device` (with `dtype` activations and `model`'s shape), or None.

    Checks: a CUDA device, an sm_90 GPU (the kernel is built for sm_90a only), bf16, the model's shape within the
    kernel's limits (`limits_problem`), and a way to get the library (nvcc, or a prebuilt one in MOETUNE_MK_LIB)."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return f"no CUDA device (the layer is on {dev})"
    if not torch.cuda.is_available():
        return "CUDA is not available to torch"
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    if (major, minor) != (9, 0):
        return f"it needs an sm_90 (Hopper) GPU; {torch.cuda.get_device_name(idx)} is sm_{major}{minor}"
    if dtype is not None and dtype != torch.bfloat16:
        return f"it runs bfloat16 activations, the layer's are {dtype}"
    if model is not None:
        why = limits_problem(model)
        if why is not None:
            return why
    return library_problem()


def library_problem() -> str | None:
    """Why the megakernel's library can be neither loaded nor built here (None: it can): no prebuilt one in
    MOETUNE_MK_LIB and no nvcc to build csrc/megakernel. A MOETUNE_MK_LIB that does not exist fails at load."""
    if not os.environ.get("MOETUNE_MK_LIB"):
        from moetune.runtime import csrc_build

        if csrc_build.find_nvcc() is None:
            return "no nvcc to build csrc/megakernel (set MOETUNE_NVCC or CUDA_HOME, or MOETUNE_MK_LIB to a prebuilt library)"
    return None


def build_megakernel(model: Any, **kwargs: Any) -> Any:
    """`MegakernelMoE(model, **kwargs)`: one seam, so CPU tests can stand a fake in for the CUDA layer."""
    from moetune.runtime.megakernel.layer import MegakernelMoE

    return MegakernelMoE(model, **kwargs)
