"""The node daemon: serving profiles over ZeroMQ, re-tune jobs, rediscovery, metrics.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from typing import Any

_LAZY = {
    "CACHE_LIMIT": ".server",
    "Daemon": ".server",
    "DaemonConfigError": ".server",
    "HARD_CAP_FACTOR": ".server",
    "JsonFormatter": ".server",
    "ProfileIndex": ".server",
    "ShapeKey": ".server",
    "TuneSettings": ".server",
    "default_diff": ".server",
    "derive_pub_endpoint": ".server",
    "load_curve_keys": ".server",
    "log": ".server",
    "main": ".server",
    "make_discover": ".server",
    "now": ".server",
    "prepare_runtime_dir": ".server",
    "run_daemon": ".server",
    "setup_logging": ".server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CACHE_LIMIT",
    "HARD_CAP_FACTOR",
    "Daemon",
    "DaemonConfigError",
    "JsonFormatter",
    "ProfileIndex",
    "ShapeKey",
    "TuneSettings",
    "default_diff",
    "derive_pub_endpoint",
    "load_curve_keys",
    "log",
    "main",
    "make_discover",
    "now",
    "prepare_runtime_dir",
    "run_daemon",
    "setup_logging",
]
