"""A stored profile labelled node_model whose backend is another node's model (or a shipped preset) is relabelled preset.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06

0003 backfilled the provenance in SQL from the backend alone: `model:node:<fp>` became node_model with measured_on
the row's own fingerprint, whatever `<fp>` was. The rule the runtime, the store and `moetune db check` apply
(`provenance_of_backend` with the key's fingerprint; `node_model_label_problem`) takes another node's calibrated
model as a preset (measured_on `preset:node:<fp>`): such a row was served and ranked as a preset, shown with a
node's measured_on, and `db check` failed right after a clean upgrade. 0004 relabelled only rows stored as
measured (and with the backend alone, so one of another node's model became node_model too).

This upgrade relabels every row, in every status (current, stale and superseded history alike), whose stored
label is not the effective one (`effective_provenance` with the key's fingerprint: the runtime record module's rule,
copied below as it was when this migration was written, 2026-12, so that a later change of the rule does not change
what this upgrade does), with the label and measured_on the effective record has (`effective_measured_on`: a
preset's `preset:NAME`, `preset:node:<fp>` for another node's model). Each changed row
gets an event (kind `relabelled`) holding its old and new label and measured_on, so nothing it said is lost. No
row is deleted; keys, statuses, numbers and dates are untouched (so the partial unique index on current keys
cannot be violated). The downgrade changes nothing, as 0004's: the schema is the same, and the old label was a
false claim (a preset's prediction ranked as this node's model).
"""

from __future__ import annotations

import datetime as _dt
import json

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


# -- frozen: runtime/profile_record.py's rules as they were when this migration was written -------------------
# Not imported: a change of the runtime's rule must not change what this upgrade does to a database at 0006.
_PROVENANCES = ("measured", "node_model", "preset")
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


def _unlabelled_provenance(backend: str, fingerprint: str | None = None) -> str:
    p = _provenance_of_backend(backend, fingerprint)
    return "node_model" if p == "measured" else p


def _effective_provenance(provenance: str, backend: str, fingerprint: str | None = None) -> str:
    if provenance == "measured" and _provenance_of_backend(backend) != "measured":
        return _unlabelled_provenance(backend, fingerprint)
    if provenance == "node_model" and _provenance_of_backend(backend, fingerprint) == "preset":
        return "preset"
    return provenance if provenance in _PROVENANCES else _unlabelled_provenance(backend, fingerprint)


def _default_measured_on(provenance: str, backend: str, fingerprint: str) -> str:
    if provenance == "preset":
        return _PRESET_PREFIX + backend.removeprefix("model:")
    if provenance == "measured":
        return fingerprint
    return ""


def _effective_measured_on(provenance: str, measured_on: str, backend: str, fingerprint: str) -> str:
    prov = _effective_provenance(provenance, backend, fingerprint)
    if prov == provenance or prov == "node_model":
        return measured_on
    return _default_measured_on(prov, backend, fingerprint)


def upgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(
        sa.text("SELECT id, fingerprint, backend, status, provenance, measured_on FROM profiles "
                "WHERE provenance IN ('measured', 'node_model') ORDER BY id")
    ).fetchall()
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")
    for row in rows:
        label = _effective_provenance(row.provenance, row.backend, row.fingerprint)
        if label == row.provenance:
            continue
        measured_on = _effective_measured_on(row.provenance, row.measured_on, row.backend, row.fingerprint)
        bind.execute(
            sa.text("UPDATE profiles SET provenance = :label, measured_on = :measured_on WHERE id = :id"),
            {"label": label, "measured_on": measured_on, "id": row.id},
        )
        reason = (f"schema upgrade to 0007: profile {row.id} was labelled {row.provenance}, but its backend "
                  f"{row.backend[:64]!r} under fingerprint {row.fingerprint[:64]!r} makes it a {label} "
                  "(another node's model or a shipped preset); relabelled")
        details = {
            "profile": row.id,
            "fingerprint": row.fingerprint,
            "status": row.status,
            "backend": row.backend,
            "provenance": {"from": row.provenance, "to": label},
            "measured_on": {"from": row.measured_on, "to": measured_on},
        }
        bind.execute(
            sa.text("INSERT INTO events(created, kind, reason, details) VALUES (:created, 'relabelled', :reason, :details)"),
            {"created": created, "reason": reason, "details": json.dumps(details)},
        )


def downgrade() -> None:
    # Nothing to undo, on purpose (as 0004): the schema of 0006 is the same, and putting node_model back would
    # restore a false claim (another node's model or a preset ranked as this node's model, which the store refuses
    # to write and `db check` names). Every row keeps its relabelled values; the old label and measured_on of each
    # one are in its `relabelled` event. An upgrade after this finds nothing to relabel.
    pass
