"""Whose SQLite file is it: the ONE rule for the store (which refuses to add its tables to another program's file)
and `tune show` (which refuses to read a file without Optuna's schema as a studies storage).

A file is an Optuna studies file when it holds Optuna's core tables (`OPTUNA_TABLES`: every Optuna RDB storage has
them, whatever else a version of Optuna adds). The store may share such a file with Optuna (Optuna keeps its own
`alembic_version`), so it is not another program's: a file is foreign when it has tables, none of them moetune's
version table, and is neither an Optuna file nor an unfinished one. Another Alembic application's file
(`alembic_version` and tables of its own, even one called `trials`) is foreign.

An unfinished Optuna file is one whose first opening was cut short (Ctrl-C, a kill): Optuna's create_all commits
table by table and stamps `alembic_version` last, so such a file has no `alembic_version` and only Optuna's tables,
each with Optuna's columns (`OPTUNA_COLUMNS`: a user's own table that happens to be called `trials` or `studies` has
other columns, and that file stays foreign). It is not another program's: opening it as a studies storage finishes
its schema. The columns are known only where the tables were read by `table_names` (a `Tables`); a bare set of
names is never taken for an unfinished Optuna file.

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
OPTUNA_COLUMNS: dict[str, tuple[str, ...]] = {
    "studies": ("study_id", "study_name"),
    "study_directions": ("study_direction_id", "direction", "study_id", "objective"),
    "study_system_attributes": ("study_system_attribute_id", "study_id", "key", "value_json"),
    "study_user_attributes": ("study_user_attribute_id", "study_id", "key", "value_json"),
    "trial_heartbeats": ("trial_heartbeat_id", "trial_id", "heartbeat"),
    "trial_intermediate_values": ("trial_intermediate_value_id", "trial_id", "step", "intermediate_value",
                                  "intermediate_value_type"),
    "trial_params": ("param_id", "trial_id", "param_name", "param_value", "distribution_json"),
    "trial_system_attributes": ("trial_system_attribute_id", "trial_id", "key", "value_json"),
    "trial_user_attributes": ("trial_user_attribute_id", "trial_id", "key", "value_json"),
    "trial_values": ("trial_value_id", "trial_id", "objective", "value", "value_type"),
    "trials": ("trial_id", "number", "study_id", "state", "datetime_start", "datetime_complete"),
    "version_info": ("version_info_id", "schema_version", "library_version"),
}
OPTUNA_RDB_TABLES = ("alembic_version", *OPTUNA_COLUMNS)


class Tables(frozenset[str]):
    """A file's table names, with the columns `table_names` read (`columns`: Optuna's tables')."""

    columns: dict[str, frozenset[str]]

    def __new__(cls, columns: dict[str, frozenset[str]]) -> Tables:
        self = super().__new__(cls, columns)
        self.columns = columns
        return self


def is_optuna_file(tables: Collection[str]) -> bool:
    """Optuna's core tables are there, with Optuna's columns where they were read (`Tables`)."""
    columns = getattr(tables, "columns", None)
    return all(t in tables and (columns is None or set(OPTUNA_COLUMNS[t]) <= columns[t]) for t in OPTUNA_TABLES)


def is_unfinished_optuna_file(tables: Collection[str]) -> bool:
    """Optuna's first opening of the file was cut short: some of its tables, each with Optuna's columns, and no
    alembic_version (stamped last). Only for tables read with their columns (`Tables`)."""
    columns = getattr(tables, "columns", None)
    if not tables or columns is None or "alembic_version" in tables:
        return False
    return all(t in OPTUNA_COLUMNS and set(OPTUNA_COLUMNS[t]) <= columns[t] for t in tables)


def missing_optuna_tables(tables: Collection[str]) -> list[str]:
    return [t for t in OPTUNA_TABLES if t not in tables]


def is_foreign_file(tables: Collection[str]) -> bool:
    """Another program's file: tables (SQLite's own left out by the caller), no moetune version table, neither an
    Optuna file nor an unfinished one."""
    return (bool(tables) and VERSION_TABLE not in tables and not is_optuna_file(tables)
            and not is_unfinished_optuna_file(tables))


def table_names(con: sqlite3.Connection) -> Tables:
    """The tables of a database, less SQLite's own (sqlite_sequence, sqlite_stat1: no program's data), with the
    columns of those named as Optuna's (`OPTUNA_COLUMNS`, the only ones the rules here compare; the others' are
    left empty: every store open probes, and nothing reads them)."""
    names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
             if not r[0].startswith("sqlite_")]
    return Tables({n: frozenset(r[1] for r in con.execute("SELECT * FROM pragma_table_info(?)", (n,)))
                   if n in OPTUNA_COLUMNS else frozenset() for n in names})


def connect_existing(path: Path, *, timeout_s: float) -> sqlite3.Connection:
    """A plain read-write connection to an existing SQLite file that creates nothing and does not switch the journal
    (unlike mode=ro, it leaves no empty -wal/-shm beside a WAL file it closes), for looking at a file before deciding
    what to do with it. A sqlite3.Error is the caller's to word."""
    return sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=rw", uri=True, timeout=timeout_s)


def existing_tables(path: Path, *, timeout_s: float) -> Tables:
    """The tables of an existing SQLite file (`table_names`), through `connect_existing`."""
    con = connect_existing(path, timeout_s=timeout_s)
    try:
        return table_names(con)
    finally:
        con.close()


def shown_tables(tables: Collection[str], most: int = 5) -> str:
    """How a refusal names a file's tables: "a, b, c" or "a, b, c, d, e and 3 more" (sorted)."""
    names = sorted(tables)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
