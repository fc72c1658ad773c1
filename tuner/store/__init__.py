"""The profile store: `models` (tables; the only thing migrations import), `store` (the Store API),
`_schema` (schema versions and migrating), `io` (export/import), `validate` (record checks); under the Store:
`db_file` (the file: path, probe, refusing another program's), `connect` (how connections run), `sqlite_errors`
(what a SQLite failure means), `busy_timeout` (how long a write waits for another process's lock).

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "BUSY_TIMEOUT_S": ".busy_timeout",
    "EXPORT_FORMAT": ".io",
    "EXPORT_VERSION": ".io",
    "ExportedFingerprint": ".io",
    "ImportResult": ".io",
    "MIGRATIONS_DIR": "._schema",
    "ProfileImportError": ".io",
    "ProfilesFile": ".io",
    "Row": ".store",
    "SchemaVersionManager": "._schema",
    "Store": ".store",
    "StoreBusy": "._schema",
    "StoreDamaged": "._schema",
    "StoreError": "._schema",
    "StoreFull": "._schema",
    "StoreNotWritable": "._schema",
    "StoreReplaced": "._schema",
    "StoreStopping": "._schema",
    "VERSION_TABLE": "._schema",
    "head_revision": "._schema",
    "is_sqlite_file": "._schema",
    "now": ".store",
    "parse_export": ".io",
    "probe_database": ".db_file",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


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
    "SchemaVersionManager",
    "Store",
    "StoreBusy",
    "StoreDamaged",
    "StoreError",
    "StoreFull",
    "StoreNotWritable",
    "StoreReplaced",
    "StoreStopping",
    "head_revision",
    "is_sqlite_file",
    "now",
    "parse_export",
    "probe_database",
]
