"""Profiles say where their numbers come from (profiles.provenance, profiles.measured_on).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Existing rows are labelled from their backend: `local:*` was measured (on the row's own fingerprint),
`model:node:*` is this node's calibrated model, any other `model:*` a shipped preset (measured_on
`preset:<name>`); a backend of neither kind is labelled node_model, never measured. The prefixes are
compared case-sensitively, as `provenance_of_backend` does (SQLite's LIKE ignores case: `LOCAL:x` would be
measured). Batch mode (the table is copied), every profile kept. The downgrade drops both columns and keeps
every profile; the label and measured_on of each profile (current, stale or superseded) that the backfill would
not derive again from its backend (an unlabelled import of a `local:*` record is node_model, the backfill would
call it measured) are kept in an event (kind `provenance_dropped`: the events table is in 0002's schema), and
such a profile that is current is made stale, with an event saying why (a moetune at 0002 reads a `local:*` row
as measured). The upgrade gives the rows named in such events their kept label back while they are still the
same rows (id, backend, knobs hash, creation date), and never restores `measured` over a label the backfill did
not derive, so a downgrade and upgrade never turn a modelled profile into a measured one.
"""

from __future__ import annotations

import datetime as _dt
import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


# The label a backend implies (moetune.runtime.profile_record.provenance_of_backend), case-sensitive.
PROVENANCE_OF_BACKEND = """CASE
    WHEN substr(backend, 1, 11) = 'model:node:' THEN 'node_model'
    WHEN substr(backend, 1, 6) = 'model:' THEN 'preset'
    WHEN substr(backend, 1, 6) = 'local:' THEN 'measured'
    ELSE 'node_model' END"""
# The measured_on the backfill gives a row.
MEASURED_ON_OF_BACKEND = """CASE
    WHEN substr(backend, 1, 11) = 'model:node:' THEN fingerprint
    WHEN substr(backend, 1, 6) = 'model:' THEN 'preset:' || substr(backend, 7)
    WHEN substr(backend, 1, 6) = 'local:' THEN fingerprint
    ELSE '' END"""
DROPPED = "provenance_dropped"  # the event kind that keeps the labels a downgrade drops
RESTORED = "provenance_restored"  # such an event once an upgrade gave its labels back (kept as history, never again)


def upgrade() -> None:
    with op.batch_alter_table("profiles") as batch:
        batch.add_column(sa.Column("provenance", sa.String(16), nullable=False, server_default="node_model"))
        batch.add_column(sa.Column("measured_on", sa.String(160), nullable=False, server_default=""))
    op.execute(f"UPDATE profiles SET provenance = {PROVENANCE_OF_BACKEND}, measured_on = {MEASURED_ON_OF_BACKEND}")
    _restore_dropped_labels(op.get_bind())
    # The defaults served the backfill only: new rows must say what they are.
    with op.batch_alter_table("profiles") as batch:
        batch.alter_column("provenance", server_default=None, existing_type=sa.String(16), existing_nullable=False)
        batch.alter_column("measured_on", server_default=None, existing_type=sa.String(160), existing_nullable=False)
        batch.create_check_constraint("provenance", "provenance IN ('measured', 'node_model', 'preset')")


def _restore_dropped_labels(bind: sa.engine.Connection) -> None:
    """Give the rows a downgrade kept in `provenance_dropped` events their labels back (older events first: the
    newest downgrade's word stands). A row only while it is the row the event names: a moetune at 0002 may have
    deleted it and given its id to a new row."""
    events = bind.execute(
        sa.text("SELECT id, details FROM events WHERE kind = :kind ORDER BY id"), {"kind": DROPPED}
    ).fetchall()
    # applied once: a later downgrade writes its own event, and an old one applied again would undo a label given
    # since (a row that became measured in place would go back to node_model at every upgrade)
    bind.execute(sa.text("UPDATE events SET kind = :done WHERE kind = :kind"), {"done": RESTORED, "kind": DROPPED})
    for _event_id, details in events:
        try:
            kept = (json.loads(details) if isinstance(details, str) else details)["profiles"]
            items = [(int(pid), k["provenance"], str(k["measured_on"]), k["backend"], k["profile_hash"], k["created"])
                     for pid, k in kept.items()]
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # not what a downgrade wrote: the backfill's labels stand
        for pid, provenance, measured_on, backend, profile_hash, created in items:
            if provenance not in ("measured", "node_model", "preset"):
                continue
            # never measured where the backfill said otherwise: a label alone never makes a number measured
            bind.execute(
                sa.text("UPDATE profiles SET provenance = :provenance, measured_on = :measured_on WHERE id = :id "
                        "AND backend = :backend AND profile_hash = :profile_hash AND created = :created "
                        "AND (:provenance <> 'measured' OR provenance = 'measured')"),
                {"provenance": provenance, "measured_on": measured_on, "id": pid, "backend": backend,
                 "profile_hash": profile_hash, "created": created},
            )


def downgrade() -> None:
    bind = op.get_bind()
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")
    # Labels the backfill would not derive again from the backend: kept, in every status, for an upgrade to give back.
    rows = bind.execute(
        sa.text(f"SELECT id, status, backend, profile_hash, created, provenance, measured_on, "
                f"{PROVENANCE_OF_BACKEND} AS derived FROM profiles "
                f"WHERE provenance <> {PROVENANCE_OF_BACKEND} OR measured_on <> {MEASURED_ON_OF_BACKEND} ORDER BY id")
    ).fetchall()
    if rows:
        kept = {str(r.id): {"provenance": r.provenance, "measured_on": r.measured_on, "status": r.status,
                            "backend": r.backend, "profile_hash": r.profile_hash, "created": r.created} for r in rows}
        reason = (f"schema downgrade below 0003 drops the provenance label of {len(rows)} profile(s) that an upgrade "
                  "would not derive again from the backend; they are in this event's details, and an upgrade gives "
                  "them back")
        bind.execute(
            sa.text("INSERT INTO events(created, kind, reason, details) VALUES (:created, :kind, :reason, :details)"),
            {"created": created, "kind": DROPPED, "reason": reason, "details": json.dumps({"profiles": kept})},
        )
    # A moetune at 0002 reads a local:* row as measured: a current one labelled otherwise is not served meanwhile
    # (which ones: the `provenance_dropped` event holds each one's status then).
    retired = [r.id for r in rows if r.status == "current" and r.provenance != r.derived]
    if retired:
        bind.execute(sa.text(f"UPDATE profiles SET status = 'stale' WHERE status = 'current' "
                             f"AND provenance <> {PROVENANCE_OF_BACKEND}"))
        reason = "schema downgrade below 0003 drops provenance labels an upgrade would not derive again from the backend"
        bind.execute(
            sa.text("INSERT INTO events(created, kind, reason, details) VALUES (:created, 'stale', :reason, :details)"),
            {"created": created, "reason": reason, "details": json.dumps({"profiles": len(retired)})},
        )
    with op.batch_alter_table("profiles") as batch:
        batch.drop_constraint("provenance", type_="check")
        batch.drop_column("measured_on")
        batch.drop_column("provenance")
