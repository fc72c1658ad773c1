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
is kept in an event (kind `perf_env_dropped`), with what the row was, so nothing it said is lost; the upgrade gives
each environment back to its row while that is still the same measured row (migrations/_kept.py).
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

from moetune.migrations import _kept

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("perf_env", sa.JSON(none_as_null=True), nullable=True))
    # a downgrade's kept environments, back on their rows; only a measured row has one (the store refuses it on a
    # modelled one), so a row relabelled since gets none
    _kept.restore(op.get_bind(), dropped="perf_env_dropped", restored="perf_env_restored", column="perf_env",
                  empty="perf_env IS NULL", only="provenance = 'measured'", valid=_is_env, stored=json.dumps)


def _is_env(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def downgrade() -> None:
    _kept.keep(op.get_bind(), kind="perf_env_dropped", column="perf_env", where="perf_env IS NOT NULL",
               reason="schema downgrade below 0006 drops the recorded performance environment of {n} profile(s); "
                      "they are in this event's details, and an upgrade gives them back",
               value=lambda r: json.loads(r.perf_env))
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("perf_env")
