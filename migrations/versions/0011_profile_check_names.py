"""The profiles table's status and latency CHECK constraints get the names the models give them
(ck_profiles_status, ck_profiles_latency).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07

0001 named them `ck_profiles_status` and `ck_profiles_latency`, and the metadata's naming convention
(`ck_%(table_name)s_%(constraint_name)s`) prefixed those names again: every database upgraded through 0001 has
`ck_profiles_ck_profiles_status` and `ck_profiles_ck_profiles_latency`, where the models (and a migration that
drops or changes one of them by the models' name) say `ck_profiles_status` and `ck_profiles_latency`. `moetune db
check` did not see it: Alembic's comparison does not look at CHECK constraints. 0001 stays as it is (databases
already migrated went through it); this renames them. Only the names change: the conditions are the same (written
here as of this revision, not read from the models, so a later change there does not change what this migration
does), and a constraint already under its new name is left alone. Batch mode (the table is copied), every profile
kept. The downgrade gives them 0010's names back.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# (condition, name 0001 gave, the models' name), as of this revision
_CHECKS = (
    ("status IN ('current', 'stale', 'superseded')", "ck_profiles_ck_profiles_status", "ck_profiles_status"),
    ("latency_us >= 0 AND spread_us >= 0", "ck_profiles_ck_profiles_latency", "ck_profiles_latency"),
)


def _rename(renames: list[tuple[str, str, str]]) -> None:
    """(condition, old name, new name): each CHECK constraint of profiles named `old` is named `new` (op.f: the names
    are final, the naming convention must not prefix them again); one already under its new name is left alone."""
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_check_constraints("profiles")}
    todo = [(cond, old, new) for cond, old, new in renames if old in present]
    if not todo:
        return
    with op.batch_alter_table("profiles") as batch:
        for cond, old, new in todo:
            batch.drop_constraint(op.f(old), type_="check")
            batch.create_check_constraint(op.f(new), cond)


def upgrade() -> None:
    _rename([(cond, old, new) for cond, old, new in _CHECKS])


def downgrade() -> None:
    _rename([(cond, new, old) for cond, old, new in _CHECKS])
