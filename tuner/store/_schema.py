"""Schema versions: which Alembic revision a database is at, and moving it (Optuna's `_VersionManager`).

moetune's revision lives in `moetune_alembic_version`, so an Optuna study can share the file. Every error
says what to run.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from moetune.tuner.store.store import Store

VERSION_TABLE = "moetune_alembic_version"
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class StoreError(RuntimeError):
    """The database cannot be opened, is at an unknown revision, or a stored value is invalid.

    `exit_code`: what a command exits with on it: 2 (the database given is wrong: not a database, a newer schema,
    a file this user cannot read, ...), 1 for a failure with nothing wrong in what was given (`StoreBusy`,
    `StoreNotWritable`, `StoreFull`)."""

    exit_code = 2


class StoreBusy(StoreError):
    """Another process held the database's write lock past the busy timeout: the file is fine, a retry works."""

    exit_code = 1


class StoreStopping(StoreBusy):
    """A write of a process that is stopping (`Store.stop_waiting`) found the lock held by another connection: not
    written, and not waited for (that wait held the daemon's stop for as long as the other transaction ran). What it
    would have written is left as a crash leaves it: the next start resolves it (the daemon re-queues the job)."""


class StoreDamaged(StoreError):
    """The database file fails SQLite's integrity check (a damaged page): nothing is written to it; `moetune db
    check` names the problem, a backup (or `sqlite3 .recover`) mends it."""


class StoreReplaced(StoreDamaged):
    """The database file a writing store opened was deleted, moved away or replaced by another file since (`mv`, a
    backup restored over it): its connections still write the file they opened, which is no longer at the path (its
    writes would be lost when the process ends, or mixed into the new file by its -wal), so nothing more is written.
    A restart opens the file now at the path. Exit 1: nothing is wrong in what was given."""

    exit_code = 1


class StoreNotDatabase(StoreError):
    """SQLite finds no database in the file ("file is not a database": another kind of file, or a damaged header).
    A command given it exits 2 (the wrong file); `moetune db check` reports it as NOT OK, exit 1."""


class StoreNotWritable(StoreError):
    """This user may not write the database file, or the folder it is (or would be) in."""

    exit_code = 1


class StoreFull(StoreError):
    """SQLite's "database or disk is full", or its "disk I/O error" (what a full disk usually gives first: the -wal or
    -shm could not grow): a write failed for want of room (disk or quota) or on the disk's failure, not on what was
    given: exit 1, as for any output that fills the disk. The message names the folder."""

    exit_code = 1


def db_option(path: Path | str) -> str:
    """` --db PATH`, shell-quoted, for a command a message suggests (the one builder of it: a path with a space
    must still paste as one argument). The CLI leaves it out for the default database (`cli.db.db_flag`)."""
    import shlex

    return f" --db {shlex.quote(str(path))}"


SQLITE_MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def is_sqlite_file(path: Path) -> bool:
    """Whether `path` is a file that starts with SQLite's header (unreadable, empty, not a regular file: False).

    Asked of SQLite (an immutable=1 connection: no lock taken, nothing created beside the file), not read through a
    file of our own: closing any descriptor of a file drops every POSIX lock this process holds on it, SQLite's for
    this process's open connections to it included (another store's, a studies storage's), whereas SQLite keeps its
    own descriptor open while those locks are held. Only a file SQLite does not read as a database (a damaged header)
    has its first bytes read directly: no connection of this process can be holding a lock on it."""
    import sqlite3

    from moetune.runtime.profiles.sqlite_open import readonly_uri

    try:
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:  # SQLite takes an empty file for an empty database
        return False
    uri = readonly_uri(Path(path)) + "&immutable=1"
    try:
        con = sqlite3.connect(uri, uri=True)
        try:
            con.execute("PRAGMA schema_version").fetchone()
        finally:
            con.close()
        return True
    except sqlite3.Error as e:
        if getattr(e, "sqlite_errorname", None) not in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
            return False  # cannot be opened or read (permissions, I/O): unreadable, as before
    try:  # the header itself decides, as before (its magic followed by bytes SQLite refuses is still SQLite's)
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def alembic_config(connection: Any = None) -> Any:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def head_revision() -> str:
    """The newest schema revision this moetune knows."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


@functools.cache
def known_revisions() -> frozenset[str]:
    from alembic.script import ScriptDirectory

    return frozenset(sc.revision for sc in ScriptDirectory.from_config(alembic_config()).walk_revisions())


@dataclass(frozen=True)
class Upgraded:
    """A migration a store's open made: from `from_revision` (None: a database moetune never migrated; "base": one
    migrated down to base) to head."""

    from_revision: str | None
    to_revision: str


class SchemaVersionManager:
    """The schema of one store's database: its revision, compatibility, upgrade/downgrade, check."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def _where(self) -> str:
        return "" if self._store.memory else db_option(self._store.path)

    def current_revision(self) -> str | None:
        """The revision recorded in the database (None: empty or not a moetune database)."""
        from alembic.runtime.migration import MigrationContext

        with self._store._connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            rev = ctx.get_current_revision()
            conn.rollback()
        return rev

    def refuse_newer(self, rev: str | None) -> None:
        """A StoreError when `rev` (the database's revision) is unknown here: a newer moetune wrote it, and neither
        reading it nor migrating it (Alembic cannot find the revision to start from) is right."""
        if rev is None or rev in known_revisions():
            return
        head = head_revision()
        raise StoreError(
            f"{self._store.path} is at schema revision {rev}, unknown to this moetune (newest known: {head}); it was "
            f"written by a newer moetune: upgrade moetune, or with the newer one run "
            f"`moetune db downgrade {head} --yes{self._where()}`"
        )

    def ensure(self, *, upgrade: bool) -> Upgraded | None:
        """At head, or upgraded to it when allowed (what this call migrated; None: nothing); else a StoreError naming
        the command to run."""
        head = head_revision()
        rev = self.current_revision()
        if rev == head:
            return None
        path = self._store.path
        self.refuse_newer(rev)
        if not upgrade:
            raise StoreError(
                f"{path} is at schema revision {rev or 'none'}, this moetune needs {head}: "
                f"run `moetune db upgrade{self._where()}`"
            )
        before = self.migrate("upgrade", "head")
        return None if before == head else Upgraded(before, head)

    def migrate(self, direction: Literal["upgrade", "downgrade"], revision: str) -> str | None:
        """One transaction; concurrent openers wait on the write lock, then find it done. Returns the revision the
        database was at under the write lock, before this migration: None for a database moetune never migrated,
        "base" for one migrated down to base."""
        from alembic import command
        from alembic.runtime.migration import MigrationContext

        store = self._store
        if store.readonly:
            raise StoreError(f"{store.path} is opened read-only")
        self.refuse_newer(self.current_revision())
        store.refuse_if_damaged()
        store._after_fork()
        with store._db_errors(), store._writer.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            # Table rebuilds (batch migrations) need foreign keys off; they can only change outside a
            # transaction. Checked again before commit.
            raw.execute("PRAGMA foreign_keys = OFF")
            try:
                with conn.begin():
                    # read under the lock: another opener may have migrated it since current_revision()
                    before = MigrationContext.configure(
                        conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
                    if before is None and conn.exec_driver_sql(
                            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (VERSION_TABLE,)).first():
                        before = "base"  # moetune's tables were there once: `db downgrade base`, not a new file
                    getattr(command, direction)(alembic_config(conn), revision)
                    bad = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if bad:
                        raise StoreError(f"migration {direction} to {revision} broke foreign keys: {bad[:5]}")
            finally:
                raw.execute("PRAGMA foreign_keys = ON")
        return before

    def check(self) -> dict[str, Any]:
        """Revision vs head, schema drift against the models, `PRAGMA integrity_check`, foreign keys."""
        from alembic.autogenerate import compare_metadata
        from alembic.runtime.migration import MigrationContext

        from moetune.tuner.store.models import Base

        head = head_revision()
        rev = self.current_revision()
        from sqlalchemy.exc import DatabaseError

        with self._store._connect() as conn:
            # a damaged page can stop SQLite's own checks ("database disk image is malformed"): that is their
            # answer, reported as the check's result, not an error of the command
            try:
                integrity = [r[0] for r in conn.exec_driver_sql("PRAGMA integrity_check").fetchall()]
            except DatabaseError as e:
                integrity = [f"{e.orig} (the integrity check stopped there)"]
            try:
                fk = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            except DatabaseError as e:
                fk, integrity = [], [*integrity, f"foreign key check: {e.orig}"]
            if integrity != ["ok"]:  # a schema comparison reads every table: not on a damaged file
                conn.rollback()
                return {"path": str(self._store.path), "revision": rev, "head": head, "at_head": rev == head,
                        "integrity": integrity, "foreign_key_errors": len(fk), "schema_diff": [], "ok": False}
            own = set(Base.metadata.tables) | {VERSION_TABLE}
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "version_table": VERSION_TABLE,
                    "compare_type": True,
                    "include_name": lambda name, type_, _p: type_ != "table" or name in own,
                },
            )
            diff = [*(line for d in compare_metadata(ctx, Base.metadata) for line in describe_schema_diff(d)),
                    *check_constraint_diff(conn, Base.metadata)] if rev is not None else []
            conn.rollback()
        ok = rev == head and integrity == ["ok"] and not fk and not diff
        return {
            "path": str(self._store.path),
            "revision": rev,
            "head": head,
            "at_head": rev == head,
            "integrity": integrity,
            "foreign_key_errors": len(fk),
            "schema_diff": diff,
            "ok": ok,
        }


def _sql_text(sql: str) -> str:
    """A CHECK's condition as compared: whitespace collapsed, outer parentheses dropped (SQLite keeps the text as
    written, the models compile theirs)."""
    t = " ".join(sql.split())
    while t.startswith("(") and t.endswith(")") and _balanced(t[1:-1]):
        t = t[1:-1].strip()
    return t


def _balanced(t: str) -> bool:
    depth = 0
    for ch in t:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def check_constraint_diff(conn: Any, metadata: Any) -> list[str]:
    """Readable lines for the CHECK constraints of moetune's tables that differ between the database and the models
    (by name, then by condition): Alembic's `compare_metadata` does not look at CHECKs, so a constraint a migration
    dropped, renamed (0001's doubled `ck_profiles_ck_profiles_*` names, which 0011 fixed) or wrote with another
    condition went unseen."""
    import sqlalchemy as sa

    from moetune.tuner.store.models import NAMING

    insp = sa.inspect(conn)
    present = set(insp.get_table_names())
    out: list[str] = []
    for table in metadata.sorted_tables:
        if table.name not in present:
            continue  # a missing table is said by compare_metadata
        want: dict[str, str] = {}
        for c in table.constraints:
            if isinstance(c, sa.CheckConstraint) and c.name is not None:
                name = c.name if isinstance(c.name, sa.sql.elements.conv) else \
                    NAMING["ck"] % {"table_name": table.name, "constraint_name": c.name}
                want[str(name)] = _sql_text(str(c.sqltext))
        have = {str(c["name"]): _sql_text(str(c["sqltext"])) for c in insp.get_check_constraints(table.name)}
        for name in sorted(want.keys() - have.keys()):
            out.append(f"check constraint {table.name}.{name} ({want[name]}) {_MISSING}")
        for name in sorted(have.keys() - want.keys()):
            out.append(f"check constraint {table.name}.{name} ({have[name]}) {_IN_DB}")
        for name in sorted(want.keys() & have.keys()):
            if want[name] != have[name]:
                out.append(f"check constraint {table.name}.{name} is ({have[name]}) in the database, "
                           f"({want[name]}) in moetune's schema")
    return out


def _cols(obj: Any) -> str:
    return ", ".join(str(c.name) for c in getattr(obj, "columns", ()))


def _table_of(obj: Any) -> str:
    t = getattr(obj, "table", None)
    return str(getattr(t, "name", "?"))


_IN_DB = "in the database, not in moetune's schema"
_MISSING = "missing in the database"


def describe_schema_diff(d: Any) -> list[str]:
    """Readable lines for one entry of Alembic's `compare_metadata` (what would turn the database into moetune's
    schema): e.g. "column profiles.routing missing in the database" for ('add_column', None, 'profiles', Column(...)).
    A list of column modifications gives a line each; anything unknown is shown as Alembic gives it."""
    if isinstance(d, list):
        return [line for x in d for line in describe_schema_diff(x)]
    if not isinstance(d, tuple) or not d:
        return [str(d)]
    op = d[0]
    try:
        if op in ("add_table", "remove_table"):
            return [f"table {d[1].name} {_MISSING if op == 'add_table' else _IN_DB}"]
        if op in ("add_column", "remove_column"):
            return [f"column {d[2]}.{d[3].name} {_MISSING if op == 'add_column' else _IN_DB}"]
        if op in ("add_index", "remove_index"):
            ix = d[1]
            kind = "unique index" if getattr(ix, "unique", False) else "index"
            return [f"{kind} {ix.name} on {_table_of(ix)}({_cols(ix)}) "
                    f"{_MISSING if op == 'add_index' else _IN_DB}"]
        if op in ("add_constraint", "remove_constraint", "add_fk", "remove_fk"):
            c = d[1]
            kind = "foreign key" if op.endswith("_fk") else type(c).__name__.replace("Constraint", " constraint").lower()
            name = f" {c.name}" if getattr(c, "name", None) else ""
            target = ""
            if op.endswith("_fk"):
                target = " -> " + ", ".join(str(e.target_fullname) for e in getattr(c, "elements", ()))
            return [f"{kind.strip()}{name} on {_table_of(c)}({_cols(c)}){target} "
                    f"{_MISSING if op.startswith('add') else _IN_DB}"]
        if op.startswith("modify_") and len(d) >= 7:
            what = op[len("modify_"):]
            return [f"column {d[2]}.{d[3]}: {what} is {d[5]} in the database, {d[6]} in moetune's schema"]
    except (AttributeError, IndexError, TypeError):
        pass
    return [str(d)]
