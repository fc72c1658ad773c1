"""Profiles say where their numbers come from (profiles.provenance, profiles.measured_on).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Existing rows are labelled from their backend: `local:*` was measured (on the row's own fingerprint),
`model:node:*` is this node's calibrated model, any other `model:*` a shipped preset (measured_on
`preset:<name>`); a backend of neither kind is labelled node_model, never measured. The prefixes are
compared case-sensitively, as `provenance_of_backend` does (SQLite's LIKE ignores case: `LOCAL:x` would be
measured). Batch mode (the table is copied), every profile kept. The downgrade drops both columns and keeps
every profile; a current profile whose label an upgrade would not derive from its backend again (an unlabelled
import of a `local:*` record is node_model, the backfill would call it measured) is made stale first, with an
event saying why, so a downgrade and upgrade never turn a modelled profile into a measured one.
"""

from __future__ import annotations

import datetime as _dt
import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


# The label a backend implies (moetune.runtime.profile_record.provenance_of_backend), case-sensitive.
PROVENANCE_OF_BACKEND = """CASE
    WHEN substr(backend, 1, 11) = 'model:node:' THEN 'node_model'
    WHEN substr(backend, 1, 6) = 'model:' THEN 'preset'
    WHEN substr(backend, 1, 6) = 'local:' THEN 'measured'
    ELSE 'node_model' END"""


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("provenance", sa.String(16), nullable=False, server_default="node_model"))
        batch.add_column(sa.Column("measured_on", sa.String(160), nullable=False, server_default=""))
    op.execute(
        f"""
        UPDATE profiles SET
          provenance = {PROVENANCE_OF_BACKEND},
          measured_on = CASE
            WHEN substr(backend, 1, 11) = 'model:node:' THEN fingerprint
            WHEN substr(backend, 1, 6) = 'model:' THEN 'preset:' || substr(backend, 7)
            WHEN substr(backend, 1, 6) = 'local:' THEN fingerprint
            ELSE '' END
        """
    )
    # The defaults served the backfill only: new rows must say what they are.
    with op.batch_alter_table("profiles") as batch:
        batch.alter_column("provenance", server_default=None, existing_type=sa.String(16), existing_nullable=False)
        batch.alter_column("measured_on", server_default=None, existing_type=sa.String(160), existing_nullable=False)
        batch.create_check_constraint("provenance", "provenance IN ('measured', 'node_model', 'preset')")


def downgrade() -> None:
    bind = op.get_bind()
    retired = bind.execute(
        sa.text(f"UPDATE profiles SET status = 'stale' WHERE status = 'current' AND provenance <> {PROVENANCE_OF_BACKEND}")
    ).rowcount
    if retired:
        reason = "schema downgrade below 0003 drops provenance labels an upgrade would not derive again from the backend"
        bind.execute(
            sa.text("INSERT INTO events(created, kind, reason, details) VALUES (:created, 'stale', :reason, :details)"),
            {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"), "reason": reason,
             "details": json.dumps({"profiles": retired})},
        )
    with op.batch_alter_table("profiles") as batch:
        batch.drop_constraint("provenance", type_="check")
        batch.drop_column("measured_on")
        batch.drop_column("provenance")
