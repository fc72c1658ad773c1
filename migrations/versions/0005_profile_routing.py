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
routing of each row that had one is kept in an event (kind `routing_dropped`), with what the row was, so nothing it
said is lost; the upgrade gives each routing back to its row while that is still the same row (migrations/_kept.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from moetune.migrations import _kept

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
    # a downgrade's kept routings, back where they were measured (a routing said nowhere else: an upgrade that
    # left them in the event had the next import of an export skip the row as present, routing and all)
    _kept.restore(op.get_bind(), dropped="routing_dropped", restored="routing_restored", column="routing",
                  empty="routing = ''", only="1", valid=_is_routing, stored=str)


def _is_routing(value: object) -> bool:
    # what the column held: `uniform` / `zipf:S` as the store spells them, within the column's 32
    return isinstance(value, str) and 0 < len(value) <= 32 and (value == "uniform" or value.startswith("zipf:"))


def downgrade() -> None:
    _kept.keep(op.get_bind(), kind="routing_dropped", column="routing", where="routing <> ''",
               reason="schema downgrade below 0005 drops the routing label of {n} profile(s); their routings are in "
                      "this event's details, and an upgrade gives them back",
               value=lambda r: r.routing)
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("routing")
