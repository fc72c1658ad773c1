"""Transport registry: name → EPTransport subclass, registered lazily by module path.

A transport whose module is missing (e.g. the csrc extension was not built) or fails to import reports
itself absent through `available_transports()` with the reason, instead of breaking the runtime's import.
"""

from __future__ import annotations

import importlib

import torch

from moetune.runtime.transports.base import Availability, EPTransport

# name → "module:ClassName" (module relative to moetune.runtime.transports or absolute).
_REGISTRY: dict[str, str] = {
    "collective": ".collective:CollectiveTransport",
    # Through pinned host memory by the copy engines (NCCL's staging with NCCL_P2P_DISABLE=1 where the
    # compiled library is missing or MOETUNE_HS_NATIVE=0).
    "host_staged": ".host_staged:HostStagedTransport",
    # One-sided transports (csrc/ kernels); without a CUDA device or the compiled library they say why not.
    "nvlink": ".nvlink:NvlinkTransport",
    "proxy": ".proxy:ProxyTransport",
}


def register_transport(name: str, target: str) -> None:
    """Register (or replace) `name` → "module:Class" (relative modules resolve inside this package)."""
    if ":" not in target:
        raise ValueError(f"transport target must look like 'module:Class', got {target!r}")
    _REGISTRY[name] = target


def registered_transports() -> list[str]:
    return list(_REGISTRY)


def _load(name: str) -> type[EPTransport]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown transport {name!r}; registered: {', '.join(_REGISTRY)}")
    mod_name, _, cls_name = _REGISTRY[name].partition(":")
    module = importlib.import_module(mod_name, package=__package__) if mod_name.startswith(".") else importlib.import_module(mod_name)
    cls = getattr(module, cls_name)
    if not (isinstance(cls, type) and issubclass(cls, EPTransport)):
        raise TypeError(f"{_REGISTRY[name]} is not an EPTransport subclass")
    return cls


def get_transport(name: str) -> type[EPTransport]:
    """The transport class registered as `name`. KeyError for an unknown name; ImportError (with the
    module path) when its module cannot be imported."""
    try:
        return _load(name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"transport {name!r} ({_REGISTRY.get(name)}) is not importable: {e}") from e


def available_transports(device: torch.device | str | None = None) -> dict[str, Availability]:
    """Every registered transport and whether it can run on `device` here (with the reason)."""
    dev = torch.device(device) if device is not None else None
    out: dict[str, Availability] = {}
    for name in _REGISTRY:
        try:
            cls = _load(name)
        except Exception as e:  # a missing module is a fact about this install, not an error
            out[name] = Availability(False, f"module {_REGISTRY[name].split(':')[0]} not importable: {type(e).__name__}: {e}")
            continue
        try:
            out[name] = cls.availability(dev)
        except Exception as e:
            out[name] = Availability(False, f"availability check failed: {type(e).__name__}: {e}")
    return out
