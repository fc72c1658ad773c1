"""What counts as a change of this node's fabric: the daemon's discovery rounds (`moetune.tuner.daemon.watch`) and the
measuring runs' check before they store (`moetune.tuner.fabric.moved`) apply the same rule. Another fingerprint is a
change, and so is the same fingerprint on other physical GPUs; facts discovery could not read whole are no evidence
of one."""

from __future__ import annotations

from typing import Any


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
