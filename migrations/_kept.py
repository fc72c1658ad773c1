"""What a downgrade that drops a profile column keeps in an event, and how the upgrade that adds the column back
gives it back (migrations 0005 `routing`, 0006 `perf_env`, 0009 `runtime_options`; 0003 does the same for provenance
with its own rules).

Each kept value names the row it belonged to by more than its id: a moetune at the older schema may delete a row
and give its id to a new one (SQLite reuses the highest id), or store new numbers for it. A value goes back only
to the same row (id, backend, key + knobs hash, creation date, latency and spread: the measurement it describes),
only into an empty column, and only once (the event's kind becomes `<what>_restored`, kept as history). Events
from before rows were named this way (no `row` in an entry) cannot tell the row apart from a new one with its id:
they are left as they are (their values stay readable in `moetune`'s events), never applied on a guess."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

# The columns that say a row is still the measurement a downgrade kept a value of.
IDENTITY = ("backend", "profile_hash", "created", "latency_us", "spread_us")


def keep(bind: sa.engine.Connection, *, kind: str, column: str, where: str, reason: str,
         value: Callable[[Any], Any]) -> None:
    """Before a downgrade drops `column`: an event `kind` with the value (`value(row)`), status and identity of each
    row `where` selects (the rows that have one)."""
    rows = bind.execute(sa.text(f"SELECT id, status, {column}, {', '.join(IDENTITY)} FROM profiles "
                                f"WHERE {where} ORDER BY id")).fetchall()
    if not rows:
        return
    details = {"profiles": {str(r.id): {column: value(r), "status": r.status,
                                        "row": {c: getattr(r, c) for c in IDENTITY}} for r in rows}}
    bind.execute(
        sa.text("INSERT INTO events(created, kind, reason, details) VALUES (:created, :kind, :reason, :details)"),
        {"created": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"), "kind": kind,
         "reason": reason.format(n=len(rows)), "details": json.dumps(details)},
    )


def restore(bind: sa.engine.Connection, *, dropped: str, restored: str, column: str, empty: str, only: str,
            valid: Callable[[Any], bool], stored: Callable[[Any], Any]) -> None:
    """After an upgrade added `column` back: the values of the `dropped` events into the rows they name, where the
    row is the same row, its column is `empty` (SQL condition) and `only` holds (SQL condition; "1" for none); an
    event whose entries all name their row becomes `restored`. Newest event first: its value is the latest word."""
    events = bind.execute(sa.text("SELECT id, details FROM events WHERE kind = :kind ORDER BY id DESC"),
                          {"kind": dropped}).fetchall()
    for event_id, details in events:
        try:
            kept = (json.loads(details) if isinstance(details, str) else details)["profiles"]
            items = [(int(pid), k[column], k.get("row")) for pid, k in kept.items()]
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # not what a downgrade wrote: left as it is
        named = True
        for pid, value, row in items:
            if not isinstance(row, dict) or any(c not in row for c in IDENTITY):
                named = False  # written before rows were named: which row it was cannot be told
                continue
            if not valid(value):
                continue
            same = " AND ".join(f"{c} = :{c}" for c in IDENTITY)
            bind.execute(
                sa.text(f"UPDATE profiles SET {column} = :value WHERE id = :id AND {same} AND {empty} AND {only}"),
                {"value": stored(value), "id": pid, **{c: row[c] for c in IDENTITY}},
            )
        if named:  # applied once, as 0003's: the event is history from here on
            bind.execute(sa.text("UPDATE events SET kind = :done WHERE id = :id"), {"done": restored, "id": event_id})
