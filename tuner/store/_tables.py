"""Whose SQLite file is it: the ONE rule for the store (which refuses to add its tables to another program's file)
and `tune show` (which refuses to read a file without Optuna's schema as a studies storage).

A file is an Optuna studies file when it holds Optuna's core tables (`OPTUNA_TABLES`: every Optuna RDB storage has
them, whatever else a version of Optuna adds). The store may share such a file with Optuna (Optuna keeps its own
`alembic_version`), so it is not another program's: a file is foreign when it has tables, none of them moetune's
version table, and is neither an Optuna file nor an unfinished one. Another Alembic application's file
(`alembic_version` and tables of its own, even one called `trials`) is foreign.

An unfinished Optuna file is one whose first opening was cut short (Ctrl-C, a kill): Optuna's create_all commits
table by table and stamps `alembic_version` last, so such a file has no `alembic_version` and only tables named
as Optuna's (`OPTUNA_RDB_TABLES`). It is not another program's: opening it as a studies storage finishes its schema.

Also here, for the store and the studies storage alike: the tables of an existing file (`existing_tables`) and how a
refusal lists them (`shown_tables`)."""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Collection
from pathlib import Path

from moetune.tuner.store._schema import VERSION_TABLE

OPTUNA_TABLES = ("studies", "trials", "version_info")  # what every Optuna RDB storage holds
# Every table Optuna's RDB storage creates (optuna.storages._rdb.models' metadata, and the alembic_version its
# stamp adds); tests/test_store_optuna_file_rule.py compares it with the installed Optuna.
OPTUNA_RDB_TABLES = (
    "alembic_version",
    "studies",
    "study_directions",
    "study_system_attributes",
    "study_user_attributes",
    "trial_heartbeats",
    "trial_intermediate_values",
    "trial_params",
    "trial_system_attributes",
    "trial_user_attributes",
    "trial_values",
    "trials",
    "version_info",
)


def is_optuna_file(tables: Collection[str]) -> bool:
    return all(t in tables for t in OPTUNA_TABLES)


def is_unfinished_optuna_file(tables: Collection[str]) -> bool:
    """Optuna's first opening of the file was cut short: some of its tables, no alembic_version (stamped last)."""
    return bool(tables) and "alembic_version" not in tables and all(t in OPTUNA_RDB_TABLES for t in tables)


def missing_optuna_tables(tables: Collection[str]) -> list[str]:
    return [t for t in OPTUNA_TABLES if t not in tables]


def is_foreign_file(tables: Collection[str]) -> bool:
    """Another program's file: tables (SQLite's own left out by the caller), no moetune version table, neither an
    Optuna file nor an unfinished one."""
    return (bool(tables) and VERSION_TABLE not in tables and not is_optuna_file(tables)
            and not is_unfinished_optuna_file(tables))


def table_names(con: sqlite3.Connection) -> set[str]:
    """The tables of a database, less SQLite's own (sqlite_sequence, sqlite_stat1: no program's data)."""
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            if not r[0].startswith("sqlite_")}


def existing_tables(path: Path, *, timeout_s: float) -> set[str]:
    """The tables of an existing SQLite file (`table_names`), through a plain read-write connection that creates
    nothing and does not switch the journal (unlike mode=ro, it leaves no empty -wal/-shm beside a WAL file it
    closes). A sqlite3.Error is the caller's to word."""
    con = sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=rw", uri=True, timeout=timeout_s)
    try:
        return table_names(con)
    finally:
        con.close()


def shown_tables(tables: Collection[str], most: int = 5) -> str:
    """How a refusal names a file's tables: "a, b, c" or "a, b, c, d, e and 3 more" (sorted)."""
    names = sorted(tables)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
