"""Bring-up: `moetune profile`'s flow (discover → measure → calibrate → tune → store) and its report.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from typing import Any

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
