"""Whose SQLite file is it: the ONE rule for the store (which refuses to add its tables to another program's file)
and `tune show` (which refuses to read a file without Optuna's schema as a studies storage).

A file is an Optuna studies file when it holds Optuna's core tables (`OPTUNA_TABLES`: every Optuna RDB storage has
them, whatever else a version of Optuna adds). The store may share such a file with Optuna (Optuna keeps its own
`alembic_version`), so it is not another program's: a file is foreign when it has tables, none of them moetune's
version table, and is not an Optuna file. Another Alembic application's file (`alembic_version` and tables of its
own, even one called `trials`) is foreign."""

from __future__ import annotations

from collections.abc import Collection

from moetune.tuner.store._schema import VERSION_TABLE

OPTUNA_TABLES = ("studies", "trials", "version_info")  # what every Optuna RDB storage holds


def is_optuna_file(tables: Collection[str]) -> bool:
    return all(t in tables for t in OPTUNA_TABLES)


def missing_optuna_tables(tables: Collection[str]) -> list[str]:
    return [t for t in OPTUNA_TABLES if t not in tables]


def is_foreign_file(tables: Collection[str]) -> bool:
    """Another program's file: tables (SQLite's own left out by the caller), no moetune version table, not Optuna's."""
    return bool(tables) and VERSION_TABLE not in tables and not is_optuna_file(tables)
