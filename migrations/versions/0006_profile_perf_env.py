"""Profiles record the performance environment they were measured in (profiles.perf_env).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

The NCCL_*, NVSHMEM_*, FI_*, ... variables of the measuring process that steer the data path
(`ProfileRecord.perf_env`, extracted by moetune.runtime.profiles.perf_env), as JSON; NULL where it was not
recorded. Not part of the key: the runtime compares it with the job's environment and says where they differ.
Existing rows get NULL (not recorded): nothing in the database says which environment an older tune ran in, and
an unknown environment is shown as unknown, never as matching a job's. Batch mode (the table is copied), every
profile kept. The downgrade drops the column and keeps every profile; the environment of each row that had one
is kept in an event (kind `perf_env_dropped`), so nothing it said is lost.
"""

from __future__ import annotations

import datetime as _dt
import json

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("perf_env", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT id, status, perf_env FROM profiles WHERE perf_env IS NOT NULL ORDER BY id")).fetchall()
    if rows:
        reason = (f"schema downgrade below 0006 drops the recorded performance environment of {len(rows)} profile(s); "
                  "they are in this event's details")
        details = {"profiles": {str(r.id): {"perf_env": json.loads(r.perf_env), "status": r.status} for r in rows}}
        bind.execute(
            sa.text("INSERT INTO events(created, kind, reason, details) "
                    "VALUES (:created, 'perf_env_dropped', :reason, :details)"),
            {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"), "reason": reason,
             "details": json.dumps(details)},
        )
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("perf_env")
