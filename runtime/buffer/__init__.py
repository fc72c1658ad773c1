"""The EP dispatch/combine buffer (`EPBuffer`): one facade over the wire layouts.

`facade` holds EPBuffer (construction, dispatch/combine entry points); `_meta` what a dispatch returns
(RecvMeta, Handle, dtype tables); `_packed`, `_dense`, `_resident` one wire layout each. The public names
load lazily from their modules, so importing one submodule does not import the rest.
"""

from typing import Any

_LAZY = {
    "DENSE_AUTO_MAX_BYTES": "._dense",
    "DENSE_AUTO_MAX_WASTE": "._dense",
    "EPBuffer": ".facade",
    "Handle": "._meta",
    "MAX_COMM_CHANNELS": ".facade",
    "RecvMeta": "._meta",
    "TORCH_DTYPES": "._meta",
    "hit_probability": "._dense",
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
