"""The database file: its path, the daemon lock beside it, what a file holds, refusing another program's."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Literal

from moetune.runtime.paths import foreign_sticky_link_reason
from moetune.runtime.profiles import sqlite_open
from moetune.tuner.store import busy_timeout as busy
from moetune.tuner.store._folders import make_parent
from moetune.tuner.store._schema import VERSION_TABLE, StoreError
from moetune.tuner.store._tables import existing_tables, is_foreign_file, shown_tables, table_names
from moetune.tuner.store.connect import DatabaseChangedError
from moetune.tuner.store.sqlite_errors import sqlite_failure


def database_path(path: str | Path) -> Path:
    """The file a store given `path` opens: ~ expanded (a config file gives it unexpanded), made absolute (links kept).
    The daemon probes and names the database by it too."""
    return Path(path).expanduser().absolute()


def refuse_foreign_link(path: str | Path) -> None:
    """StoreError where the database path goes through another user's link in a sticky, world-writable folder
    (`paths.foreign_sticky_link_reason`): its owner chooses the file the store opens and writes, and the folder the
    lock files are made in (they are made beside the file the links lead to). Checked before either."""
    if (why := foreign_sticky_link_reason(database_path(path))) is not None:
        raise StoreError(f"database {database_path(path)} refused: {why}")


def daemon_lock_path(path: str | Path) -> Path:
    """The file a daemon serving the database `path` holds flocked while it runs (its pid inside); a migration takes
    it too, so that none serves while the schema changes. Beside the file the links lead to: two paths to one
    database (a link to it or to a folder above it) take one lock, so that two daemons never serve it at once.
    (A bind mount shows the file at a path no link resolves to: it stays out of reach of this rule.)"""
    p = Path(os.path.realpath(database_path(path)))
    return p.with_name(p.name + ".daemon-lock")


DatabaseKind = Literal["missing", "empty", "foreign", "moetune"]


def foreign_error(path: Path, tables: set[str]) -> StoreError:
    return StoreError(
        f"{path} is not a moetune database (it has tables {shown_tables(tables)} and no {VERSION_TABLE}): moetune does "
        f"not add its tables to another program's file; give a new or empty file (--db)"
    )


def not_a_file(path: Path) -> StoreError:
    """The error of a database path that exists and is no file (a folder, a FIFO): every command says it alike (a
    writer's open said SQLite's "unable to open database file")."""
    return StoreError(f"{path} is not a database file")


def probe(path: Path) -> tuple[DatabaseKind, str | None, set[str]]:
    """probe_database, and the tables it found."""
    if not path.exists():
        return "missing", None, set()
    if not path.is_file():
        raise not_a_file(path)
    try:
        if path.stat().st_size == 0:
            return "empty", None, set()

        def look(con: sqlite3.Connection) -> tuple[set[str], str | None]:
            tables = table_names(con)
            if VERSION_TABLE not in tables:
                return tables, None
            row = con.execute(f"SELECT version_num FROM {VERSION_TABLE} LIMIT 1").fetchone()
            return tables, None if row is None else str(row[0])

        tables, rev = sqlite_open.read(path, look, timeout_s=busy.BUSY_TIMEOUT_S)
    except sqlite_open.DatabaseChanged as e:
        raise DatabaseChangedError(str(e)) from None
    except sqlite3.Error as e:
        raise sqlite_failure(path, e, write=False) from None
    except OSError as e:
        raise StoreError(f"{path}: {e}") from None
    if VERSION_TABLE in tables:
        return "moetune", rev, tables
    return ("foreign" if is_foreign_file(tables) else "empty"), None, tables


ONLY_OPTUNA, EMPTY = "it has only Optuna's tables", "it is empty"  # what a file without moetune's tables holds


def without_moetune_words(tables: set[str]) -> str:
    return ONLY_OPTUNA if tables else EMPTY


def without_moetune(path: Path) -> str | None:
    """What an existing file without moetune's tables holds (ONLY_OPTUNA or EMPTY), from one probe; None for a
    moetune database (any revision), a missing file, another program's file or one that cannot be read."""
    try:
        kind, _rev, tables = probe(database_path(path))
    except StoreError:
        return None
    return without_moetune_words(tables) if kind == "empty" else None


def probe_database(path: Path) -> tuple[DatabaseKind, str | None]:
    """What is at `path`, read through a read-only connection (nothing is created, migrated or switched to
    WAL): ("missing", None); ("empty", None) for a 0-byte file, a SQLite file without tables or an Optuna studies
    file without moetune's tables (either may become a store); ("foreign", None) for another program's SQLite file
    (`_tables.is_foreign_file`); ("moetune", revision),
    revision None after `db downgrade base`. A file that is not SQLite is a StoreError."""
    kind, rev, _tables = probe(path)
    return kind, rev


def refuse_foreign(path: Path, *, readonly: bool) -> None:
    """A StoreError when `path` is another program's SQLite file (`_tables.is_foreign_file`), checked before the store's own connections, which switch the file to WAL and add
    moetune's tables. For a write, a plain read-write connection (no create, no journal switch): unlike mode=ro,
    it leaves no empty -wal/-shm beside a WAL file it closes."""
    if readonly:
        tables = probe(path)[2]
    else:
        try:
            tables = existing_tables(path, timeout_s=busy.BUSY_TIMEOUT_S)
        except sqlite3.Error as e:
            raise sqlite_failure(path, e, write=True) from None
    if is_foreign_file(tables):
        raise foreign_error(path, tables)


def _make_parent(path: Path) -> None:
    """Create the folder of a new database only when it is moetune's own data folder (`_folders.make_parent`: the
    rule a SQLite studies storage follows too)."""
    make_parent(path, StoreError)
