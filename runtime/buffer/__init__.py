"""The EP dispatch/combine buffer (`EPBuffer`): one facade over the wire layouts.

`facade` holds EPBuffer (construction, dispatch/combine entry points); `_meta` what a dispatch returns
(RecvMeta, Handle, dtype tables); `_packed`, `_dense`, `_resident` one wire layout each; `layout_choice` which
layout dense=None takes (no torch: the fabric model asks it too). The public names
load lazily from their modules, so importing one submodule does not import the rest.
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "DENSE_AUTO_MAX_BYTES": ".layout_choice",
    "DENSE_AUTO_MAX_WASTE": ".layout_choice",
    "EPBuffer": ".facade",
    "Handle": "._meta",
    "MAX_COMM_CHANNELS": ".facade",
    "RecvMeta": "._meta",
    "TORCH_DTYPES": "._meta",
    "hit_probability": ".layout_choice",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


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
