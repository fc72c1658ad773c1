"""Rediscovery and hardware-change handling of the daemon (the discovery worker's side).

Every `rediscover_interval_s` the fabric is discovered again; on a fingerprint change the daemon records
an event with `diff_facts` reasons (a replaced GPU included), marks the old fingerprint's profiles
`stale` (with the facts and a fabric back's restore: one transaction, `fabric.change.write_change`), rebuilds the index, publishes `fabric_changed` and `profile_stale`, and queues a re-tune job.
An incomplete discovery (a command timed out) is never taken for a change: the known facts are kept.
Before any daemon recorded a fabric event (its first start), the base is the newest fingerprint this node recorded
as its own (`moetune profile`, a tune of this node: origin 'local' with this node's id): a fabric that changed since
the bring-up is a change too. Another node's facts in the store (imported, a capture's) are never the base; with
none of this node's the first discovery is recorded as such.
`FabricWatch` is mixed into `Daemon`; it uses the daemon's store, index and job manager.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from moetune.tuner.fabric.change import (
    change_reasons,
    fabric_left,
    facts_dict,
    identity,
    incomplete,
    last_fabric_event,
    node_fabric_events,
    recorded_base,
    same_hardware,
    seen_details,
    write_change,
)

log = logging.getLogger("moetune.daemon")


def now() -> str:
    return datetime.now(UTC).isoformat()


def transport_names(facts: Any) -> list[str]:
    return [t.name for t in facts.transports]


def make_discover(capture: Path | None) -> Callable[[], Any]:
    def _discover() -> Any:
        from moetune.tuner.fabric.discovery import discover

        return discover(capture)

    return _discover



def retune_keys(made_stale: list[Any], new_stale: list[tuple[int, Any]], have: set[tuple]) -> dict[tuple, Any]:
    """The keys a fabric change re-tunes, by `tuning_key`, in one rule for the daemon's change (`_fabric_changed`)
    and the start's finish of one recorded but not queued (`_retune_after_interrupted_change`): those of the old
    fingerprint's records the change made stale (`made_stale`) and of the new fingerprint's stale rows (`new_stale`:
    (id, record)), both less the keys it has a served current profile for (`have`: `served_tuning_keys`)."""
    from moetune.tuner.daemon.retune import tuning_key

    keys: dict[tuple, Any] = {}
    for r in [*made_stale, *(r for _, r in new_stale)]:
        if tuning_key(r.key) not in have:
            keys.setdefault(tuning_key(r.key), r.key)
    return keys


class FabricWatch:
    """Discovery rounds and fabric changes; mixed into Daemon (which sets the attributes used here)."""

    store: Any
    facts: Any
    index: Any  # the ProfileIndex get_profile answers from (`built_for` the facts held)
    # where the discovered facts come from (`Store.upsert_fingerprint`): 'local' (this node), 'capture' (a daemon
    # serving a capture: another node's facts, never compared with this node's bring-up)
    fabric_origin: str
    interval: float
    metrics: Any
    jobs: Any
    _discover: Callable[[], Any] | None
    _diff: Callable[[dict, dict], list[str]]
    _last_discovery: tuple[str, bool, str]

    def _fabric_events(self) -> list[Any]:
        """This node's newest fabric events, newest first (`node_fabric_events`: another node's in a shared database
        are no change of this node's to finish)."""
        return node_fabric_events(self.store)

    def _last_fabric_event(self) -> dict[str, Any] | None:
        return last_fabric_event(self.store)

    def _base(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(the newest fabric event, what discovery is compared with): `recorded_base`, the rule every writer of
        this node's facts applies (`record_node_facts`). No daemon event yet: this node's bring-up is the base, so a
        fabric that changed between `moetune profile` and the first start is a change; a daemon serving a capture
        has none (what it discovers is not this node)."""
        return recorded_base(self.store, self.fabric_origin)

    def _discover_once(self) -> Any:
        """Run discovery once and record the outcome (status op, metrics); None when it failed."""
        try:
            facts = self._discover()  # type: ignore[misc]
        except Exception as e:  # broad: discovery runs commands and a user's hook; its failure is a status, not a crash
            self._last_discovery = (now(), False, f"{type(e).__name__}: {e}")
            self.metrics.discovery("error")
            log.error("fabric discovery failed: %s", e)
            return None
        # facts that could not be read whole are no `ok` discovery (an nvidia-smi time-out is what to alert on)
        self.metrics.discovery("incomplete" if incomplete(facts) else "ok")
        self._last_discovery = (now(), True, "")
        return facts

    def _kept(self, facts: Any, why: str) -> None:
        """An incomplete discovery that differs from the known fabric: keep what is known, say why in status."""
        self._last_discovery = (now(), False, f"incomplete discovery, previous facts kept: {why}"[:1000])
        log.warning("incomplete discovery ignored", extra={"fingerprint": facts.fingerprint, "why": why})

    def _startup_discovery(self) -> None:
        """The start's discovery and its writes. A write that fails for now (a full disk: StoreFull; the lock held past
        the busy timeout: StoreBusy) does not stop the start: the facts are not adopted (as after a failed discovery:
        the daemon serves what the store holds), status says why, and the next discovery round writes them again.
        Raised, it ended the start: `moetune serve` exited 1 and its service restarted it, to fail the same way every
        few seconds, serving nothing, until the disk had room. A file this user may not write, or a damaged one, is
        still refused at start (a setting to fix, not a wait)."""
        from moetune.tuner.store import StoreBusy, StoreFull

        try:
            self._startup_discovery_writes()
        except (StoreFull, StoreBusy) as e:
            with self._commit_lock:
                self.facts = None
            self._last_discovery = (now(), False, f"the fabric's facts could not be recorded ({e}); the next "
                                                  "discovery round records them"[:1000])
            log.error("start-up discovery not recorded: %s; serving what the database holds, the next discovery "
                      "round retries", e)

    def _startup_discovery_writes(self) -> None:
        if self._discover is None:
            self._last_discovery = (now(), False, "no discovery configured")
            return
        facts = self._discover_once()
        if facts is None:
            return
        # no daemon event yet: this node's bring-up is the base (a change since it is a change, not a first discovery)
        last, base = self._base()
        if base is not None and not same_hardware(base.get("fingerprint"), base.get("identity"), facts):
            if why := incomplete(facts):
                self._kept(facts, why)  # nothing served until a round reads everything (as after a failure)
                return
            self._fabric_changed(base.get("fingerprint"), base.get("facts") or {}, facts, rebuild=False)
            return
        self.facts = facts
        self.store.upsert_fingerprint(facts.fingerprint, facts_dict(facts), origin=self.fabric_origin)
        if last is None or (last.get("identity") is None and identity(facts) is not None):
            # the first discovery, or the first since GPU identities are recorded: the base to compare with
            self.store.add_event(kind="fabric_seen", reason="first discovery" if last is None else "GPU identities recorded",
                                 details=seen_details(facts, self.store.node))

    def _retune_after_interrupted_change(self) -> None:
        """At start, finish the newest recorded fabric change the last daemon did not: `_fabric_changed` writes
        fabric_changed and marks the old fingerprint's profiles stale (one transaction) and only then queues their
        re-tune, so a daemon killed in between left them stale with no job, for good (job recovery reads job events
        only); a daemon before that transaction may have left them still current.

        Only that crash window is acted on: keys a job queued since the change holds are left to it, and only the
        rows the change concerns are touched: the old
        fingerprint's profiles that were current at the change (their ids are in its event; for an event without
        them, rows created before it and rows made stale at or after it). A profile of the old fingerprint imported
        or tuned since, or stale before the change, is left alone. Of those rows, the still-current ones are made
        stale, and the keys no job queued since the change holds and no current profile of the new fingerprint
        has are queued, with the new fingerprint's older stale keys: the keys `_fabric_changed` queues
        (`retune_keys`), for a change recorded by a CLI writer while no daemon ran too. A change of GPUs only (same fingerprint) too: the rows it concerns are the old GPUs'."""
        from moetune.tuner.daemon.recovery import keys_from_details
        from moetune.tuner.daemon.retune import served_tuning_keys, tuning_key
        from moetune.tuner.store import StoreError

        if self.facts is None:
            return
        try:
            # the newest fabric event itself (a window of fabric and job_queued events together lost it behind 2000
            # job_queued events: a submit and cancel loop, or a long run of re-tunes)
            change = next(iter(self._fabric_events()), None)
            d = (change["details"] or {}) if change is not None and change["kind"] == "fabric_changed" else {}
            old_fp = d.get("old_fingerprint")
            # a change of GPUs only (a replaced GPU of the same model: old_fp is the fingerprint now) is finished the
            # same way: its rows (the old GPUs' profiles, listed in its event) stale, their keys re-tuned on the new
            # GPUs; a start on them finds no change to act on (same_hardware), so nothing else would
            if not old_fp or d.get("fingerprint") != self.facts.fingerprint:
                return
            ids = d.get("profiles")
            if isinstance(ids, list):
                ids = {i for i in ids if isinstance(i, int)}
                concerned = lambda i, r: i in ids  # noqa: E731
            else:  # an event of an older daemon: by time (an import keeps its rows' old `created`: best effort)
                when = str(change["created"])
                concerned = lambda i, r: (r.created <= when if r.status == "current" else r.updated >= when)  # noqa: E731
            reason = str(change["reason"] or "")
            current = [i for i, r in self.store.list_profiles(status="current", fingerprint=old_fp) if concerned(i, r)]
            if current:  # stopped before mark_stale
                self.store.mark_stale(fingerprint=old_fp, reason=f"fabric changed: {reason}"[:4000], ids=current)
            # a current row no lookup serves (its knobs contradict its family, or beyond the runtime) has no key
            have = served_tuning_keys(r for _, r in self.store.list_profiles(status="current",
                                                                            fingerprint=self.facts.fingerprint))
            # the rows of old_fp this change made stale, and the new fingerprint's own stale keys nothing current
            # replaced, as `_fabric_changed` queues them (`retune_keys`): a fabric back to one it had on other GPUs
            # keeps that one's profiles stale. Without the latter a change finished here (recorded by `fabric show
            # --record`, a local tune or `profile` while no daemon ran, or by a daemon stopped before queuing) left
            # those keys served nothing, for good
            made_stale = [r for i, r in self.store.list_profiles(status="stale", fingerprint=old_fp)
                          if i in current or concerned(i, r)]
            keys = retune_keys(made_stale, self.store.list_profiles(status="stale", fingerprint=self.facts.fingerprint),
                               have)
            # the keys a job queued since the change holds are its business, whatever that job was (the change's own
            # re-tune, or a job of the last daemon resumed at this start: "any later job_queued of the old
            # fingerprint" let a resumed job of one key hide the change's other keys for good); read a page at a time,
            # oldest first, until none of the keys is left
            after = change["id"]
            while keys:
                later = self.store.events_after(after, kinds=("job_queued",), limit=200)
                if not later:
                    break
                for e in later:
                    for k in keys_from_details(e["details"] if isinstance(e["details"], dict) else {}):
                        keys.pop(tuning_key(k), None)
                after = later[-1]["id"]
        except StoreError as e:
            log.error("cannot check the last fabric change for a re-tune it did not queue: %s", e)
            return
        if not keys:
            return
        by = d.get("recorded_by")
        cli = isinstance(by, str) and bool(by)
        why = f"recorded by `{by}` while no daemon ran" if cli else "the daemon stopped before"
        log.warning("queuing the re-tune of the last fabric change (%s)", why if cli else f"{why} queuing it",
                    extra={"old_fingerprint": old_fp, "fingerprint": self.facts.fingerprint, "keys": len(keys)})
        try:
            self.jobs.submit(reason=f"fabric changed: {reason} (queued at start: {why})"[:512],
                             old_fingerprint=old_fp, keys=list(keys.values()), skip_queued=True)
        except queue.Full:
            log.error("job queue full: the re-tune after the fabric change was not queued")

    def _recorded_change(self, old_fp: str | None, facts: Any) -> dict[str, Any] | None:
        """The newest fabric event's details when it already records this very change (old_fp → these facts): a
        round whose later write failed wrote it, and the facts were not adopted, so this round retries it. None
        otherwise (a change back and forth since writes its own events: the newest is then another one)."""
        d = self._last_fabric_event()
        if (d is not None and "old_fingerprint" in d  # a fabric_changed event's (fabric_seen has no old fingerprint)
                and d["old_fingerprint"] == old_fp and d.get("fingerprint") == facts.fingerprint
                and d.get("identity") == identity(facts)):
            return d
        return None

    def _fabric_changed(self, old_fp: str | None, old_facts: dict[str, Any], facts: Any, *, rebuild: bool = True) -> None:
        reasons = change_reasons(self._diff, old_facts, facts)
        reason = "; ".join(reasons)[:4000]
        log.warning("fabric changed", extra={"old_fingerprint": old_fp, "fingerprint": facts.fingerprint, "reasons": reasons})
        # The store writes below may fail (StoreBusy after its wait, StoreFull, StoreDamaged): then the facts the
        # daemon had are put back, so the next discovery round sees the change again and retries it (adopting the
        # new facts for good before the writes made the change forgotten: the old fingerprint's profiles stayed
        # current, nothing was published or re-tuned until a restart). The retry writes no second event for it.
        kept = self.facts
        try:
            from moetune.tuner.daemon.retune import served_tuning_keys

            recorded = self._recorded_change(old_fp, facts)
            with self._commit_lock:
                # the new facts first: a job still tuning for old_fp that ends from here on sees that its fabric
                # moved on (it makes its profiles stale and queues its keys again); one that ended before wrote
                # everything it wrote before this listing. The ids are the rows this change makes stale, recorded in its
                # event (a daemon stopped before queuing their re-tune has the next one finish it for these rows only,
                # `_retune_after_interrupted_change`) and the rows made stale below: one list for both
                cur = self.store.list_profiles(status="current", fingerprint=old_fp) if old_fp else []
                self.facts = facts
            ids = [i for i, _ in cur]
            if recorded is not None and old_fp:
                # a retry (of a change whose event is in: its later reads failed, or an older daemon wrote it in
                # steps): the rows the recorded event lists (made stale already where its marks got through) and any
                # current since are this change's
                listed = recorded.get("profiles")
                listed = {i for i in listed if isinstance(i, int)} if isinstance(listed, list) else set()
                listed |= set(ids)
                cur = [(i, r) for i, r in self.store.list_profiles(fingerprint=old_fp) if i in listed]
                ids = [i for i, _ in cur]
            stale_recs = [r for _, r in cur]
            # the facts, the event, the marks and, for a fabric back to one it had (a GPU off the bus and back, a
            # driver rolled back), its profiles current again: one transaction, the writes `record_node_facts` makes
            # (`write_change`). Restored are only the rows it served until it left, on the same GPUs (`restorable`):
            # a row a job wrote for it after the fabric had moved on (`_fabric_moved_on` made it stale) is no
            # measurement of it, nor is a row of an earlier stay on other GPUs; nothing to re-tune for their keys
            written = write_change(self.store, facts, old_fp=old_fp, reasons=reasons, ids=ids, origin=self.fabric_origin,
                                   recorded=recorded is not None)
            if written.restored:
                log.warning("profiles of a fabric seen before made current again",
                            extra={"fingerprint": facts.fingerprint, "profiles": written.restored})
            elif (old_fp != facts.fingerprint and written.served is None
                  and self.store.list_profiles(status="stale", fingerprint=facts.fingerprint)):
                log.warning("profiles of a fabric seen before left stale: measured on other GPUs, or on GPUs not "
                            "recorded, or which ones it served is not recorded (re-tuned instead)",
                            extra={"fingerprint": facts.fingerprint, "identity": identity(facts),
                                   "measured_on": fabric_left(self.store, facts.fingerprint)[1]})
            # and the new fingerprint's own stale keys that nothing current replaced: a fabric back to one it had (a
            # port down, then up; a package downgraded, then restored) left its profiles stale from the first change,
            # and with nothing current of the fingerprint in between nothing was re-tuned. Read here, before the
            # change is published, so that a failed read is retried with the rest
            have = served_tuning_keys(r for _, r in self.store.list_profiles(status="current", fingerprint=facts.fingerprint))
            keys = retune_keys(stale_recs, self.store.list_profiles(status="stale", fingerprint=facts.fingerprint), have)
        except BaseException:
            with self._commit_lock:
                if self.facts is facts:
                    self.facts = kept
            log.error("fabric change not recorded whole; the previous facts are kept and the next round retries it",
                      extra={"old_fingerprint": old_fp, "fingerprint": facts.fingerprint})
            raise
        with self._commit_lock:
            self._write_info(running=True)
            changes = [dict(kind="fabric_changed", fingerprint=facts.fingerprint, old_fingerprint=old_fp, reasons=reasons)]
            if stale_recs:
                changes.append(dict(kind="profile_stale", fingerprint=old_fp, profiles=[r.profile_hash for r in stale_recs],
                                    keys=[r.key for r in stale_recs], reasons=reasons))
            if rebuild:
                try:
                    self._rebuild(changes)
                except BaseException:
                    # its reads failed (StoreBusy): the facts the daemon had are put back, as for a failed write, so
                    # the next round retries the change (its event is in: no second one). Kept adopted, the next
                    # round saw nothing to do: the index served the old fingerprint's profiles as current, nothing
                    # was published and the re-tune below never queued, until a restart
                    if self.facts is facts:
                        self.facts = kept
                    log.error("fabric change recorded but its index not rebuilt; the previous facts are kept and the "
                              "next round retries it",
                              extra={"old_fingerprint": old_fp, "fingerprint": facts.fingerprint})
                    raise
        self.metrics.fabric_changes += 1  # once per change, not per retried round
        if old_fp:
            # its work is for a fabric that is gone; after the rebuild: cancelled with the old facts put back, the job
            # ended unmoved (its keys not queued again) and the retry found nothing running to cancel
            self.jobs.cancel_fingerprint(old_fp)
        if keys:
            try:
                self.jobs.submit(reason=f"fabric changed: {reason}"[:512], old_fingerprint=old_fp,
                                 keys=list(keys.values()), skip_queued=True)
            except queue.Full:
                log.error("job queue full: the re-tune after the fabric change was not queued")

    def rediscover(self) -> None:
        """One discovery round (the worker calls this every interval)."""
        facts = self._discover_once()
        if facts is None:
            return
        old = self.facts
        if not self.index.built_for(old):
            # facts put back after a change's failed write, while a job's end rebuilt the index for the new ones:
            # get_profile refused until a rebuild, and a round that finds the old fabric again (or an incomplete one)
            # has no change to make one
            self._rebuild()
        if old is not None and same_hardware(old.fingerprint, identity(old), facts):
            return
        if old is None:
            last, base = self._base()  # as `_startup_discovery`
            if base is None or same_hardware(base.get("fingerprint"), base.get("identity"), facts):
                with self._commit_lock:
                    # the facts are adopted once their writes are in (a failed write: the next round tries again)
                    self.store.upsert_fingerprint(facts.fingerprint, facts_dict(facts), origin=self.fabric_origin)
                    if last is None:
                        self.store.add_event(kind="fabric_seen", reason="first discovery", details=seen_details(facts, self.store.node))
                    self.facts = facts
                    # the start-up discovery failed, so the start could not finish a change the last daemon recorded
                    # but did not queue (it needs the facts): done now, before the index is rebuilt
                    try:
                        self._retune_after_interrupted_change()
                        self._write_info(running=True)
                        self._rebuild([dict(kind="fabric_changed", fingerprint=facts.fingerprint,
                                            reasons=["fabric discovered"])])
                    except BaseException:
                        # not adopted (the rebuild's read failed: StoreBusy): the next round sees no facts and tries
                        # again (its event is in: no second one). Kept, the index had no facts and answered "not
                        # discovered yet" to every lookup, nothing published, until a job ended or a restart
                        self.facts = None
                        raise
                return
            if why := incomplete(facts):
                self._kept(facts, why)
                return
            self._fabric_changed(base.get("fingerprint"), base.get("facts") or {}, facts)
            return
        if why := incomplete(facts):
            self._kept(facts, why)
            return
        self._fabric_changed(old.fingerprint, facts_dict(old), facts)

    def _discovery_loop(self) -> None:
        from moetune.tuner.store import StoreStopping

        while not self._stop.wait(self.interval):
            try:
                self.rediscover()
            except StoreStopping as e:  # the daemon's stop gave up this round's wait for another writer's lock
                log.info("discovery round not recorded: %s", e)  # the next start discovers anew; no traceback
                return
            except Exception as e:  # broad: the discovery thread's loop must outlive one bad round
                log.exception("discovery round failed")
                # status says it (a round whose discovery went through, then its writes failed on a full disk, left
                # "ok" there while the change or the facts were not recorded)
                self._last_discovery = (now(), False, f"discovery round failed: {type(e).__name__}: {e}"[:1000])

