"""The fabric model: predictions for fabrics the node may not have. Every number here is MODELLED.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from typing import Any

_LAZY = {
    "MAX_MESSAGES": ".predict",
    "Prediction": ".predict",
    "SIGNAL_BYTES": ".predict",
    "TransferPrediction": ".predict",
    "Workload": ".predict",
    "predict_transfers": ".predict",
    "transfers_per_peer": ".predict",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MAX_MESSAGES",
    "SIGNAL_BYTES",
    "Prediction",
    "TransferPrediction",
    "Workload",
    "predict_transfers",
    "transfers_per_peer",
]
