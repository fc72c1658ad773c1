"""Tuning runs record the process that runs them (tuning_runs.owner).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-08

A run killed with kill -9 (or stopped by a full disk) never reached its `finish_run`: its row stayed `running`
forever, beside the runs that really were running (the daemon's recovery closes only its own job runs). Each run
now records its owner while it runs, as `HOST:PID:START` (START: the process's start time, so a pid the kernel
gave to another process since is not taken for the owner), and a later `tune` or `profile` marks the rows whose
owner is gone `interrupted` (`Store.close_orphaned_runs`). Existing rows get NULL: nothing says who ran them, and
they are left as they are. The downgrade drops the column (the rows stay; an owner says only who is running a run).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tuning_runs") as batch:
        batch.add_column(sa.Column("owner", sa.String(320), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tuning_runs") as batch:
        batch.drop_column("owner")
