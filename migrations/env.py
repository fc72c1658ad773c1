"""Alembic environment for moetune's own schema.

moetune keeps its revision in `moetune_alembic_version` (Optuna's storage, which may share the same
SQLite file, uses Alembic's default `alembic_version`). Run programmatically by moetune.tuner.store.store,
which passes an open connection in `config.attributes["connection"]`; no alembic.ini is needed. Either way every
migration of a run is in one transaction (the store's, or this file's own BEGIN on SQLite): one that fails midway
leaves the database as it was.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import create_engine, event

from moetune.tuner.store.models import Base

VERSION_TABLE = "moetune_alembic_version"
OWN_TABLES = frozenset(Base.metadata.tables) | {VERSION_TABLE}


def _include_name(name, type_, parent_names) -> bool:
    # Compare only moetune's tables: Optuna's (or anyone's) tables in the same file are not ours.
    if type_ == "table":
        return name in OWN_TABLES
    return True


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,
        include_name=_include_name,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # SQLAlchemy's begin event says BEGIN
    # batch migrations copy and drop tables: foreign keys off (as the store's migrate), or a DROP of fingerprints would
    # delete its profiles where SQLite was built with foreign keys on by default
    dbapi_conn.execute("PRAGMA foreign_keys = OFF")


config = context.config
conn = config.attributes.get("connection")
if conn is not None:
    _run(conn)
else:  # a developer running the alembic command line with -x / sqlalchemy.url
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set sqlalchemy.url (or use `moetune db upgrade --db PATH`)")
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        # SQLite's driver begins a transaction only before INSERT/UPDATE/DELETE: a batch migration's CREATE/DROP/RENAME
        # would run outside it, and one failing midway would leave half a migration (as the store, emit BEGIN itself)
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", lambda c: c.exec_driver_sql("BEGIN IMMEDIATE"))
    try:
        with engine.begin() as c:
            _run(c)
    finally:
        engine.dispose()
