"""Bring-up: `moetune profile`'s flow (discover → measure → calibrate → tune → store) and its report.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "Bringup": ".flow",
    "BringupState": ".flow",
    "BucketResult": ".flow",
    "Plan": ".flow",
    "STAGES": ".flow",
    "StageFn": ".flow",
    "base_preset_for": ".flow",
    "report_from_store": ".flow",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "STAGES",
    "Bringup",
    "BringupState",
    "BucketResult",
    "Plan",
    "StageFn",
    "base_preset_for",
    "report_from_store",
]
