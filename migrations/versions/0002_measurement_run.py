"""Measurements remember the tuning run that produced them (measurements.run_id).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

SQLite cannot add a foreign key to an existing table, so this runs in batch mode (copy the table,
add the column and constraint, swap); every existing measurement is kept. The downgrade drops the
column the same way and keeps every measurement (their run links are lost).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("run_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            "fk_measurements_run_id_tuning_runs", "tuning_runs", ["run_id"], ["id"], ondelete="SET NULL"
        )
        batch.create_index("ix_measurements_run_id", ["run_id"])


def downgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.drop_index("ix_measurements_run_id")
        batch.drop_constraint("fk_measurements_run_id_tuning_runs", type_="foreignkey")
        batch.drop_column("run_id")
