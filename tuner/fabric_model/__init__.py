"""The fabric model: predictions for fabrics the node may not have. Every number here is MODELLED.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "KNOBS_READ": ".predict",
    "MAX_MESSAGES": ".phases.queued",
    "Prediction": ".records",
    "SIGNAL_BYTES": ".wire_rows",
    "TransferPrediction": ".records",
    "Workload": ".records",
    "expert_tiles_per_peer": ".group_grids",
    "predict_transfers": ".predict",
    "transfers_per_peer": ".group_grids",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "KNOBS_READ",
    "MAX_MESSAGES",
    "SIGNAL_BYTES",
    "Prediction",
    "TransferPrediction",
    "Workload",
    "expert_tiles_per_peer",
    "predict_transfers",
    "transfers_per_peer",
]
