"""The profile store: SQLAlchemy models, the Store API, schema migrations and export/import.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from typing import Any

_LAZY = {
    "BUSY_TIMEOUT_S": ".store",
    "EXPORT_FORMAT": ".store",
    "EXPORT_VERSION": ".store",
    "ExportedFingerprint": ".store",
    "ImportResult": ".store",
    "MIGRATIONS_DIR": ".store",
    "ProfileImportError": ".store",
    "ProfilesFile": ".store",
    "Row": ".store",
    "Store": ".store",
    "StoreError": ".store",
    "VERSION_TABLE": ".store",
    "head_revision": ".store",
    "now": ".store",
    "parse_export": ".store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUSY_TIMEOUT_S",
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "MIGRATIONS_DIR",
    "VERSION_TABLE",
    "ExportedFingerprint",
    "ImportResult",
    "ProfileImportError",
    "ProfilesFile",
    "Row",
    "Store",
    "StoreError",
    "head_revision",
    "now",
    "parse_export",
]
