"""Profiles say where their numbers come from (profiles.provenance, profiles.measured_on).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Existing rows are labelled from their backend: `local:*` was measured (on the row's own fingerprint),
`model:node:*` is this node's calibrated model, any other `model:*` a shipped preset (measured_on
`preset:<name>`); a backend of neither kind is labelled node_model, never measured. Batch mode (the
table is copied), every profile kept. The downgrade drops both columns and keeps every profile.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("provenance", sa.String(16), nullable=False, server_default="node_model"))
        batch.add_column(sa.Column("measured_on", sa.String(160), nullable=False, server_default=""))
    op.execute(
        """
        UPDATE profiles SET
          provenance = CASE
            WHEN backend LIKE 'model:node:%' THEN 'node_model'
            WHEN backend LIKE 'model:%' THEN 'preset'
            WHEN backend LIKE 'local:%' THEN 'measured'
            ELSE 'node_model' END,
          measured_on = CASE
            WHEN backend LIKE 'model:node:%' THEN fingerprint
            WHEN backend LIKE 'model:%' THEN 'preset:' || substr(backend, 7)
            WHEN backend LIKE 'local:%' THEN fingerprint
            ELSE '' END
        """
    )
    # The defaults served the backfill only: new rows must say what they are.
    with op.batch_alter_table("profiles") as batch:
        batch.alter_column("provenance", server_default=None, existing_type=sa.String(16), existing_nullable=False)
        batch.alter_column("measured_on", server_default=None, existing_type=sa.String(160), existing_nullable=False)
        batch.create_check_constraint("provenance", "provenance IN ('measured', 'node_model', 'preset')")


def downgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.drop_constraint("provenance", type_="check")
        batch.drop_column("measured_on")
        batch.drop_column("provenance")
