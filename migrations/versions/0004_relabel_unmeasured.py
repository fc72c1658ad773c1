"""A stored profile labelled measured whose backend does not measure is relabelled node_model or preset.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04

Before e645822 the store took a record labelled `measured` from any backend (a put, an imported file), so a
database at 0003 can hold a preset's or a node model's prediction labelled measured: `profiles list`,
`Store.find_profile` and the daemon treated it as measured and it competed with real measurements (only the
runtime client downgraded it on read). The store refuses such records now (`validate.check_record`); this
upgrade relabels the rows already stored, in every status (current, stale and superseded history alike), with
the label their backend implies: `provenance_of_backend`, the rule check_record and the runtime client applied when
this migration was written (copied below as it was then, 2026-12: an old migration must do what it did whatever the
runtime's rule becomes later). A row relabelled preset gets a preset's `measured_on` (`preset:NAME`,
`default_measured_on`); a node_model row keeps the one it has. Each changed row gets an event
(kind `relabelled`) holding its old and new label and measured_on, so nothing it said is lost. No row is
deleted; keys, statuses, numbers and dates are untouched (so the partial unique index on current keys cannot
be violated). The downgrade changes nothing: see there.
"""

from __future__ import annotations

import datetime as _dt
import json

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


# -- frozen: runtime/profile_record.py's rules as they were when this migration was written -------------------
# Not imported: a change of the runtime's rule must not change what this upgrade does to a database at 0003.
_NODE_MODEL_BACKEND = "model:node:"
_PRESET_PREFIX = "preset:"


def _provenance_of_backend(backend: str, fingerprint: str | None = None) -> str:
    if backend.startswith(_NODE_MODEL_BACKEND):
        if fingerprint is not None and backend.removeprefix(_NODE_MODEL_BACKEND) != fingerprint:
            return "preset"
        return "node_model"
    if backend.startswith("model:"):
        return "preset"
    if backend.startswith("local:"):
        return "measured"
    return "node_model"


def _default_measured_on(provenance: str, backend: str, fingerprint: str) -> str:
    if provenance == "preset":
        return _PRESET_PREFIX + backend.removeprefix("model:")
    if provenance == "measured":
        return fingerprint
    return ""


def upgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(
        sa.text("SELECT id, fingerprint, backend, status, measured_on FROM profiles WHERE provenance = 'measured' "
                "ORDER BY id")
    ).fetchall()
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")
    for row in rows:
        label = _provenance_of_backend(row.backend)
        if label == "measured":
            continue
        measured_on = _default_measured_on(label, row.backend, row.fingerprint) if label == "preset" else row.measured_on
        bind.execute(
            sa.text("UPDATE profiles SET provenance = :label, measured_on = :measured_on WHERE id = :id"),
            {"label": label, "measured_on": measured_on, "id": row.id},
        )
        reason = (f"schema upgrade to 0004: profile {row.id} was labelled measured, but its backend "
                  f"{row.backend[:64]!r} does not measure (local:*); relabelled {label}")
        details = {
            "profile": row.id,
            "fingerprint": row.fingerprint,
            "status": row.status,
            "backend": row.backend,
            "provenance": {"from": "measured", "to": label},
            "measured_on": {"from": row.measured_on, "to": measured_on},
        }
        bind.execute(
            sa.text("INSERT INTO events(created, kind, reason, details) VALUES (:created, 'relabelled', :reason, :details)"),
            {"created": created, "reason": reason, "details": json.dumps(details)},
        )


def downgrade() -> None:
    # Nothing to undo, on purpose. The schema of 0003 is the same, so no column has to go, and putting the
    # `measured` label back would restore a claim that is false: a number from a backend that does not measure,
    # which the store refuses to write (validate.check_record), find_profile would offer as measured and 0003's
    # own downgrade would then have to retire. Every row keeps its relabelled values; the old label and
    # measured_on of each one are in its `relabelled` event. An upgrade after this finds nothing to relabel.
    pass
