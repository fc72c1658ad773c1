"""A measuring run's check, before it stores, that this node's fabric is still the one it measures for.

`moetune tune --backend local` and `moetune profile` discover the fabric once, at their start, and run for minutes
to hours; every number they store goes under that fingerprint, labelled measured. A fabric change meanwhile (a NIC
port down, a GPU replaced, a package upgraded) made them store numbers of the changed fabric under the old
fingerprint. The daemon's jobs guard against it (`Jobs._fabric_moved_on`); these runs discover the node again
(live discovery: ~15 ms) before each store write and, on a change, store nothing more under the old fingerprint
(`FabricMovedOn`, exit 1). The rule is the daemon's (`moetune.tuner.fabric.change`): another fingerprint, or the
same one on other GPUs, is a change; a discovery that failed or could not read everything is no evidence of one.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("moetune")


class FabricMovedOn(RuntimeError):
    """The live fabric is no longer the one the run measures for: nothing more is stored under its fingerprint."""

    exit_code = 1  # the command line was fine; the work could not be finished as asked


class FabricGuard:
    """The fabric a run started on (`facts`); `check` raises FabricMovedOn once the live node is another."""

    def __init__(self, facts: Any, rerun: str) -> None:
        from moetune.tuner.fabric.change import identity

        self.facts = facts
        self.fingerprint = str(facts.fingerprint)
        self.identity = identity(facts)
        self.rerun = rerun  # what to do about it, said last

    def moved_on(self) -> Any | None:
        """The live node's facts when they are another fabric than the run's, else None (the same fabric, or a
        discovery that cannot tell: failed, or incomplete, as the daemon takes them)."""
        from moetune.tuner.fabric import discovery
        from moetune.tuner.fabric.change import incomplete, same_hardware
        from moetune.tuner.fabric.errors import DiscoveryError

        try:
            live = discovery.live_facts()
        except (DiscoveryError, OSError) as e:
            log.warning("live discovery failed; the fabric is taken as unchanged: %s", e)
            return None
        if incomplete(live):
            return None
        return None if same_hardware(self.fingerprint, self.identity, live) else live

    def check(self, what: str) -> None:
        live = self.moved_on()
        if live is None:
            return
        from moetune.tuner.fabric.change import default_diff, facts_dict

        try:
            reasons = default_diff(facts_dict(self.facts), facts_dict(live))
        except Exception as e:  # broad: a readable difference is a nicety; the change is refused anyway
            reasons = [f"facts changed (diff failed: {e})"]
        if live.fingerprint == self.fingerprint:
            reasons = ["the GPUs are other ones (same fingerprint, another GPU identity)", *reasons]
        shown = "; ".join(reasons[:4]) + (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else "")
        raise FabricMovedOn(
            f"the fabric changed during this run: it started on fingerprint {self.fingerprint}, this node is now "
            f"{live.fingerprint} ({shown}). {what} was measured, at least in part, on the changed fabric and is not "
            f"stored under {self.fingerprint}; what was stored before the change stands. {self.rerun}")


class GuardedStore:
    """`store` whose `put_profile` first checks the fabric (`FabricGuard.check`); everything else is the store's."""

    def __init__(self, store: Any, guard: FabricGuard) -> None:
        self._store, self._guard = store, guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put_profile(self, rec: Any, *args: Any, **kw: Any) -> Any:
        k = rec.key
        self._guard.check(f"The profile of {k.transport_family} ep{k.ep_size}x{k.nodes} S={k.token_bucket}")
        return self._store.put_profile(rec, *args, **kw)
