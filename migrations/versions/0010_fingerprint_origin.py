"""Fingerprints record where their facts came from (fingerprints.origin) and, for this node's, which node recorded
them (fingerprints.node).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

A store holds other nodes' facts beside this node's: `moetune profiles import` brings another node's fingerprints,
`fabric show --record --capture` records a capture's. The daemon's first start compares the node with what this
node's bring-up recorded (a fabric that changed between `moetune profile` and the start is a change: its profiles
stale, re-tuned); it must not compare with another node's facts. `origin` says where a row's facts came from:
'local' (measured or discovered on the node that recorded them: profile, a tune of this node, the daemon's
discovery, `fabric show --record` of this node), 'import' (a profiles file) or 'capture' (a capture read); `node`
the recording node of a 'local' row (a hash of its machine id, else of its host name: tuner/store/_owner.py
node_id). Existing rows get NULL in both: nothing says where their facts came from, and a row of unknown origin is
never taken for this node's (the daemon's first start then records a first discovery, as before). The allowed
origins are written here as of this revision (a later list in the models must not change what this migration
made). Batch mode (the table is copied), every row kept. The downgrade drops both columns and keeps every row: an
upgrade after it finds the origins unknown, which is never taken for this node's (the safe side).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fingerprints") as batch:
        batch.add_column(sa.Column("origin", sa.String(16), nullable=True))
        batch.add_column(sa.Column("node", sa.String(64), nullable=True))
        batch.create_check_constraint("origin", "origin IN ('local', 'import', 'capture')")


def downgrade() -> None:
    with op.batch_alter_table("fingerprints") as batch:
        batch.drop_constraint("origin", type_="check")
        batch.drop_column("node")
        batch.drop_column("origin")
