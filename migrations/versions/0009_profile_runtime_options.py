"""Profiles record the data-path runtime options they were measured under (profiles.runtime_options and
profiles.runtime_options_digest).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-09

The runtime options that change the data path (hs_native, symm, fused_pack, proxy_host_wait, ...:
moetune.runtime.options DATA_PATH_OPTIONS; set through MOETUNE_* variables, the config's [runtime] table or
EPBuffer(options=...)) of the measuring ranks, as JSON (`ProfileRecord.runtime_options`), and the digest of that copy.
Not part of the key: the runtime compares them with the job's options and applies a profile as tuned only where they
agree. Existing rows get NULL in both (not recorded): nothing in the database says which options an older tune ran
under, and unknown options are shown as unknown, never as matching a job's (as 0006 did for perf_env). Batch mode (the
table is copied), every profile kept. The downgrade drops both columns and keeps every profile; the options of each
row that had them are kept in an event (kind `runtime_options_dropped`) with what the row was, and the upgrade gives
them back to the row while it is still the same measured row (migrations/_kept.py), its digest computed again.
"""

from __future__ import annotations

import hashlib
import json
import math

import msgspec
import sqlalchemy as sa
from alembic import op

from moetune.migrations import _kept

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def _digest(values: dict) -> str:
    # runtime.options.data_path_digest as of this revision, frozen here: a later change to that function must not
    # change what this migration writes
    return hashlib.sha256(msgspec.json.encode(dict(values), order="sorted")).hexdigest()[:16]


# runtime.options.data_path_problem as of this revision, frozen here (a migration must not run live runtime logic):
# the DATA_PATH_OPTIONS names and their canonical JSON values. A kept value that fails it would make its measured row
# unreadable (the store refuses such a record): it stays NULL (unknown) instead.
_OPTION_NAMES = ("hs_native", "symm", "chunk_weights", "proxy_batch", "proxy_peer_access", "proxy_host_wait",
                 "plan_mode", "nvl_gather", "fused_pack", "fused_fp8")
_BOOLS = frozenset({"hs_native", "proxy_peer_access", "proxy_host_wait", "nvl_gather", "fused_pack", "fused_fp8"})


def _valid_options(values: object) -> bool:
    if not isinstance(values, dict) or any(k not in _OPTION_NAMES for k in values):
        return False
    for name, v in values.items():
        if name in _BOOLS:
            ok = type(v) is bool
        elif name == "symm":
            ok = v in ("torch", "ipc")
        elif name == "proxy_batch":
            ok = type(v) is int and v >= 1
        elif name == "plan_mode":
            ok = type(v) is int and 0 <= v <= 2
        else:  # chunk_weights: floats (spelt as floats) > 0 and finite
            ok = isinstance(v, list) and all(type(w) is float and 0 < w < math.inf for w in v)
        if not ok:
            return False
    return True


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("runtime_options", sa.JSON(none_as_null=True), nullable=True))
        batch.add_column(sa.Column("runtime_options_digest", sa.String(16), nullable=True))
    bind = op.get_bind()
    # a downgrade's kept options, back on their rows; only a measured row has them (the store refuses them on a
    # modelled one), so a row relabelled since gets none; and only options this revision would record
    _kept.restore(bind, dropped="runtime_options_dropped", restored="runtime_options_restored",
                  column="runtime_options", empty="runtime_options IS NULL", only="provenance = 'measured'",
                  valid=_valid_options, stored=json.dumps)
    for row_id, text in bind.execute(sa.text("SELECT id, runtime_options FROM profiles WHERE runtime_options IS NOT "
                                             "NULL AND runtime_options_digest IS NULL")).fetchall():
        bind.execute(sa.text("UPDATE profiles SET runtime_options_digest = :d WHERE id = :id"),
                     {"d": _digest(json.loads(text)), "id": row_id})


def downgrade() -> None:
    _kept.keep(op.get_bind(), kind="runtime_options_dropped", column="runtime_options",
               where="runtime_options IS NOT NULL",
               reason="schema downgrade below 0009 drops the recorded runtime options of {n} profile(s); they are in "
                      "this event's details, and an upgrade gives them back",
               value=lambda r: json.loads(r.runtime_options))
    with op.batch_alter_table("profiles") as batch:
        batch.drop_column("runtime_options_digest")
        batch.drop_column("runtime_options")
