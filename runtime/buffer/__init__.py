"""The EP dispatch/combine buffer (`EPBuffer`): one facade over the wire layouts.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from typing import Any

_LAZY = {
    "DENSE_AUTO_MAX_BYTES": ".facade",
    "DENSE_AUTO_MAX_WASTE": ".facade",
    "EPBuffer": ".facade",
    "Handle": ".facade",
    "MAX_COMM_CHANNELS": ".facade",
    "RecvMeta": ".facade",
    "TORCH_DTYPES": ".facade",
    "hit_probability": ".facade",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DENSE_AUTO_MAX_BYTES",
    "DENSE_AUTO_MAX_WASTE",
    "MAX_COMM_CHANNELS",
    "TORCH_DTYPES",
    "EPBuffer",
    "Handle",
    "RecvMeta",
    "hit_probability",
]
