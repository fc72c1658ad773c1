"""What counts as a change of this node's fabric: the daemon's discovery rounds (`moetune.tuner.daemon.watch`) and the
measuring runs' check before they store (`moetune.tuner.fabric.moved`) apply the same rule. Another fingerprint is a
change, and so is the same fingerprint on other physical GPUs; facts discovery could not read whole are no evidence
of one."""

from __future__ import annotations

from typing import Any, NamedTuple


def facts_dict(facts: Any) -> dict[str, Any]:
    try:
        d = facts.to_dict()
    except AttributeError:
        d = dict(facts)
    return d if isinstance(d, dict) else {}


def default_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    from moetune.tuner.fabric.fingerprint import diff_facts, fingerprint

    reasons = list(diff_facts(old, new))
    if reasons:
        return reasons
    if fingerprint(old) == fingerprint(new):
        # the stored fingerprint was computed by another moetune from these very facts
        return ["same facts, fingerprint computed differently (moetune upgraded)"]
    return ["facts changed"]


def identity(facts: Any) -> str | None:
    """Which physical GPUs the facts describe (`identity_hash`), None where unknown."""
    return facts.identity_hash or None


def incomplete(facts: Any) -> str:
    """Why discovery could not read everything (`FabricFacts.warnings`, e.g. nvidia-smi timed out), '' when
    it could. Such facts are no evidence of a change: GPUs nvidia-smi did not answer for are not GPUs gone,
    and taking them for a new fabric would make every profile stale and queue a re-tune on each slow round."""
    if getattr(facts, "complete", True):
        return ""
    return "; ".join(str(w) for w in getattr(facts, "warnings", []) or []) or "facts incomplete"


def same_hardware(old_fp: str | None, old_identity: str | None, facts: Any) -> bool:
    """Same fingerprint and, where both sides know it, the same physical parts (a replaced GPU is a change)."""
    if old_fp != facts.fingerprint:
        return False
    new_identity = identity(facts)
    return old_identity is None or new_identity is None or old_identity == new_identity


# -- the node's recorded fabric: what the daemon and every writer of this node's facts compare with -------------------

FABRIC_EVENTS = ("fabric_seen", "fabric_changed")


NODE_EVENTS = 20  # this node's newest fabric events `node_fabric_events` returns


def node_fabric_events(store: Any) -> list[dict[str, Any]]:
    """This node's newest 20 fabric events, newest first (however many other events came after them): those another
    node recorded (`node` in their details: a database shared by nodes) are passed over, as comparing this node with
    one took identical nodes' other GPUs for a replaced one and made their shared profiles stale. An event without
    `node` (a moetune before it) is kept, as before. Filtered by node in SQL (`list_events(node=...)`: details that name no
    other node): a window of every node's newest events, or a scan of a bounded number of them, held none of
    this node's once enough others had recorded since, and its last fabric then read as never recorded."""
    return store.list_events(limit=NODE_EVENTS, kinds=FABRIC_EVENTS, node=store.node)


def last_fabric_event(store: Any) -> dict[str, Any] | None:
    """The details of this node's newest fabric event that names a fingerprint (`node_fabric_events`), None where
    none is recorded."""
    for e in node_fabric_events(store):
        d = e["details"]
        if e["kind"] in FABRIC_EVENTS and isinstance(d, dict) and d.get("fingerprint"):
            return d
    return None


def seen_details(facts: Any, node: str) -> dict[str, Any]:
    """A fabric_seen event's details (this node's first discovery, or its first with GPU identities); `node`: this
    node's id (`Store.node`), which `last_fabric_event` reads back."""
    return {"fingerprint": facts.fingerprint, "identity": identity(facts), "facts": facts_dict(facts), "node": node}


def bringup_fabric(store: Any) -> dict[str, Any] | None:
    """The newest fingerprint THIS node recorded as its own with facts that read (`Store.local_fingerprints`), in a
    fabric event's form; None where there is none (another node's facts, a capture's, rows from before migration 0010
    are never this node's past)."""
    from moetune.tuner.fabric.facts import FactsError, read_facts

    for row in store.local_fingerprints():  # newest last_seen first
        d = row["facts"]
        if not d:  # a placeholder: no facts to compare with
            continue
        try:
            f = read_facts(d)
        except FactsError:
            continue  # facts that do not decode (a hand edit) are no base
        return {"fingerprint": row["hash"], "identity": identity(f), "facts": d}
    return None


def recorded_base(store: Any, origin: str = "local") -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the newest fabric event, the base this node's facts are compared with): that event, else where none was
    recorded yet this node's newest own facts (a fabric that changed since `moetune profile` is a change). Facts of
    another origin (a capture's) have no base: they are not this node."""
    last = last_fabric_event(store)
    if last is not None:
        return last, last
    return None, (bringup_fabric(store) if origin == "local" else None)


FABRIC_LEFT_PAGE = 500  # this node's fabric events `fabric_left` reads back at a time


def fabric_left(store: Any, fp: str) -> tuple[dict[str, Any] | None, str | None]:
    """When the fabric last left `fp`: that fabric_changed event's details and the GPU identity `fp` had until then
    (of the fabric event before it, which saw or entered `fp`); (None, None) where no such change is recorded, the
    identity None where it is not recorded (never shown equal to any). This node's events only (as
    `node_fabric_events`): in a database shared by nodes, an identical node that left `fp` later hid this node's
    change, and its GPUs and profiles were taken for this node's (a fabric back restored nothing). Paged back through
    this node's fabric events, filtered by node in the store's query: a window of the newest 2000 fabric events of
    every node lost the change once other nodes (or this node's own later moves) had recorded that many since."""
    here = store.node
    found: dict[str, Any] | None = None
    before: int | None = None
    while True:
        page = store.list_events(limit=FABRIC_LEFT_PAGE, kinds=FABRIC_EVENTS, before_id=before, node=here)
        for e in page:  # newest first
            d = e["details"] if isinstance(e["details"], dict) else {}
            if found is not None:  # the event just before the change: the fabric it left
                was = d.get("identity") if d.get("fingerprint") == fp else None
                return found, (was if isinstance(was, str) and was else None)
            if e["kind"] == "fabric_changed" and d.get("old_fingerprint") == fp:
                found = d
        if len(page) < FABRIC_LEFT_PAGE:
            return found, None  # the oldest event reached: (None, None), or a change with no event before it
        before = page[-1]["id"]


def restorable(store: Any, facts: Any) -> list[int] | None:
    """The ids of the profiles a fabric back to `facts.fingerprint` may make current again: those it served until it
    last left it, and only on the same GPUs (a replaced GPU is a change); None where nothing may be restored."""
    left, was = fabric_left(store, facts.fingerprint)
    served = left.get("profiles") if left is not None else None
    if was is None or was != identity(facts) or not isinstance(served, list):
        return None
    return [i for i in served if isinstance(i, int)]


def change_details(old_fp: str | None, facts: Any, reasons: list[str], ids: list[int], node: str,
                   **more: Any) -> dict[str, Any]:
    """A fabric_changed event's details: the daemon's start reads the newest one as the node's recorded fabric, and
    finishes its re-tune from `profiles` (the rows the change made stale) where none was queued."""
    return {"old_fingerprint": old_fp, "fingerprint": facts.fingerprint, "identity": identity(facts),
            "reasons": reasons, "facts": facts_dict(facts), "profiles": ids, "node": node, **more}


def change_reasons(diff: Any, old_facts: dict[str, Any], facts: Any) -> list[str]:
    try:
        return list(diff(old_facts, facts_dict(facts))) if old_facts else ["no previous facts recorded"]
    except Exception as e:  # broad: old stored facts or a diff hook may fail; the change is handled anyway
        return [f"facts changed (diff failed: {e})"]


class Recorded:
    """What `record_node_facts` did: `stale` profiles made stale by a change (`reasons`), `restored` made current
    again; `kept`: why the facts were not recorded (discovery could not read everything)."""

    def __init__(self, *, reasons: list[str] | None = None, stale: int = 0, restored: int = 0, kept: str = "") -> None:
        self.reasons, self.stale, self.restored, self.kept = reasons or [], stale, restored, kept

    @property
    def changed(self) -> bool:
        return bool(self.reasons)

    def note(self) -> str:
        """One line for the user ('' when nothing is to be said)."""
        if self.kept:
            return f"this node's facts were not recorded: discovery could not read everything ({self.kept})"
        if not self.changed:
            return ""
        shown = "; ".join(self.reasons[:3]) + (f"; and {len(self.reasons) - 3} more" if len(self.reasons) > 3 else "")
        return (f"this node's fabric changed since it was last recorded ({shown}): {self.stale} profile(s) measured "
                f"before the change marked stale" + (f", {self.restored} of this fabric made current again"
                                                     if self.restored else "")
                + "; a daemon on this database re-tunes the keys not measured since")


def record_node_facts(store: Any, facts: Any, *, by: str, diff: Any = default_diff) -> Recorded:
    """Record `facts` as this node's (origin 'local') with the daemon's change rule: where they are another fabric
    than the node's recorded one (another fingerprint, or the same one on other GPUs: `same_hardware`), the change
    is recorded as the daemon records it (a fabric_changed event, the old fingerprint's current profiles stale, a
    fabric back on the same GPUs gets its profiles back), in the same transaction as the facts. Without it, a writer
    run while no daemon runs (`fabric show --record`, a local tune, `profile`) recorded the new GPUs over the old
    ones: the runtime's database fallback served the old parts' profiles as tuned, and the daemon's next start took
    the swap for a change then, making stale what had been measured on the new GPUs meanwhile. Incomplete facts are
    not recorded (`Recorded.kept`): no evidence of a change, and no base to compare the next discovery with. `by`:
    the command, kept in the event."""
    if why := incomplete(facts):
        # never the node's recorded facts: the daemon's first start compared its complete discovery with them and
        # recorded a fabric change that was none (the profiles stale, a re-tune queued)
        return Recorded(kept=why)
    _last, base = recorded_base(store)
    if base is None or same_hardware(base.get("fingerprint"), base.get("identity"), facts):
        store.upsert_fingerprint(facts.fingerprint, facts_dict(facts), origin="local")
        return Recorded()
    old_fp = base.get("fingerprint")
    reasons = change_reasons(diff, base.get("facts") or {}, facts)
    ids = [i for i, _ in store.list_profiles(status="current", fingerprint=old_fp)] if old_fp else []
    w = write_change(store, facts, old_fp=old_fp, reasons=reasons, ids=ids, origin="local", recorded_by=by)
    return Recorded(reasons=reasons, stale=w.stale, restored=w.restored)


class Written(NamedTuple):
    """What `write_change` wrote: `stale` rows of the old fingerprint made stale, `restored` rows of the new one made
    current again; `served`: the rows a fabric back on the same GPUs could restore (`restorable`), None where none."""

    stale: int
    restored: int
    served: list[int] | None


def write_change(store: Any, facts: Any, *, old_fp: str | None, reasons: list[str], ids: list[int],
                 origin: str = "local", recorded: bool = False, **more: Any) -> Written:
    """The writes of a change of this node's fabric from `old_fp` to `facts`, the same for every writer
    (`record_node_facts`, the daemon's `_fabric_changed`), in ONE transaction (`store.atomic()`): the new facts (of
    `origin`), the fabric_changed event (`change_details`, `more` added to them; none where `recorded`: a retry of a
    change whose event is in already), the rows `ids` of `old_fp` made stale (those current at the change: the event
    lists them), and a fabric back to one it had on the same GPUs its profiles current again (`restorable`). A crash
    or a failed write leaves none of it: the old fabric still recorded and nothing marked, which the next writer or
    the daemon's next start finds a change again and records whole. Written in steps, a daemon killed between them
    left the event without the marks, or the marks without the restore (its next start found the recorded fabric
    unchanged and re-tuned the keys whose profiles it should have made current again)."""
    reason = "; ".join(reasons)[:4000]
    # read before the transaction (reads in its body do not see its writes; the new event, of old_fp, changes nothing
    # of when the fabric last left facts.fingerprint)
    served = restorable(store, facts) if old_fp != facts.fingerprint else None
    with store.atomic():
        store.upsert_fingerprint(facts.fingerprint, facts_dict(facts), origin=origin)
        if not recorded:
            store.add_event(kind="fabric_changed", reason=reason,
                            details=change_details(old_fp, facts, reasons, ids, store.node, **more))
        n = store.mark_stale(fingerprint=old_fp, reason=f"fabric changed: {reason}"[:4000], ids=ids) if old_fp else 0
        back = 0
        if served is not None:
            back = store.restore_stale(fingerprint=facts.fingerprint, ids=served,
                                       reason=f"fabric back to {facts.fingerprint} (from {old_fp}): {reason}"[:4000])
    return Written(stale=n, restored=back, served=served)
