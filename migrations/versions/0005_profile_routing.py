"""Profiles say which routing their numbers were measured under (profiles.routing).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

`uniform` or `zipf:S` (`ProfileRecord.routing`); "" where it was not recorded. Routing is not part of the key:
the runtime cannot know the skew of its traffic ahead, so one key keeps one current profile; the store uses the
label only to refuse comparing latencies measured under different routings (`tuner/store/_rows.decide`).
Existing rows get "" (not recorded): nothing in the database says which routing an older tune used (the
tuner's default was uniform, but `moetune tune --routing zipf:S` existed), and "" compares like before. Batch
mode (the table is copied), every profile kept. The downgrade drops the column and keeps every profile; the
routing of each row that had one is kept in an event (kind `routing_dropped`), so nothing it said is lost.
"""

from __future__ import annotations

import datetime as _dt
import json

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("routing", sa.String(32), nullable=False, server_default=""))
    # The default served the existing rows only: new rows must say (the store writes "" for not recorded).
    with op.batch_alter_table("profiles") as batch:
        batch.alter_column("routing", server_default=None, existing_type=sa.String(32), existing_nullable=False)


def downgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT id, status, routing FROM profiles WHERE routing <> '' ORDER BY id")).fetchall()
    if rows:
        reason = (f"schema downgrade below 0005 drops the routing label of {len(rows)} profile(s); "
                  "their routings are in this event's details")
        details = {"profiles": {str(r.id): {"routing": r.routing, "status": r.status} for r in rows}}
        bind.execute(
            sa.text("INSERT INTO events(created, kind, reason, details) "
                    "VALUES (:created, 'routing_dropped', :reason, :details)"),
            {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"), "reason": reason,
             "details": json.dumps(details)},
        )
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("routing")
