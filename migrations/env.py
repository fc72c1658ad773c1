"""Alembic environment for moetune's own schema.

moetune keeps its revision in `moetune_alembic_version` (Optuna's storage, which may share the same
SQLite file, uses Alembic's default `alembic_version`). Run programmatically by moetune.tuner.store.store,
which passes an open connection in `config.attributes["connection"]`; no alembic.ini is needed.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

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


config = context.config
conn = config.attributes.get("connection")
if conn is not None:
    _run(conn)
else:  # a developer running the alembic command line with -x / sqlalchemy.url
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set sqlalchemy.url (or use `moetune db upgrade --db PATH`)")
    engine = create_engine(url)
    with engine.begin() as c:
        _run(c)
