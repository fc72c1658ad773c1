"""The daemon's in-memory profile index: what the serving loop reads, so the hot path runs no SQL.

An index is built from the store on a worker thread (never the serving loop) and swapped in with one
reference assignment. It is immutable once built except for its bounded caches of encoded replies.
Reading tolerates one bad row: it is skipped with a warning instead of stopping the daemon.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable
from typing import Any

import msgspec

from moetune.runtime import wire
from moetune.runtime._once import say_once
from moetune.runtime.profile_record import PROVENANCES, ProfileRecord, contradiction_reason, not_served_reason
from moetune.runtime.profiles.autoload import launcher_env
from moetune.runtime.profiles.db_lookup import pick_profile, provenance_of
from moetune.runtime.shapes import get_model

log = logging.getLogger("moetune.daemon")

CACHE_LIMIT = 4096  # encoded results kept per index version (bounded: hostile clients cannot grow it)
LIST_CACHE_LIMIT = 64
LIST_PAGE_MAX = 1000  # at most this many profiles in one list_profiles reply, whatever `limit` asks

ShapeKey = tuple[str, int, int, int, int, int, int, str]
_PASSED_OVER = "daemon.index.contradicting"  # the _once scope of "this row is not served" log lines


class ReplyCache:
    """Encoded replies of one index version, at most `limit`, the least recently used evicted first. The caches
    used to keep their first `limit` keys for good: a reader asking for `limit` distinct keys (list_profiles with
    limit=1..64) filled them, and every other client's request was then computed again each time (a list page
    re-read and encoded on the one list worker, whose queue then answered `busy`). `shared`: used from two threads
    (the serving loop reads, the list worker stores): a lock around each call; the get_profile cache is the serving
    loop's alone and takes none."""

    def __init__(self, limit: int, *, shared: bool = False) -> None:
        self.limit = limit
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock() if shared else None

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d

    def get(self, key: Hashable) -> Any:
        if self._lock is None:
            return self._get(key)
        with self._lock:
            return self._get(key)

    def put(self, key: Hashable, value: Any) -> None:
        if self._lock is None:
            self._put(key, value)
            return
        with self._lock:
            self._put(key, value)

    def _get(self, key: Hashable) -> Any:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def _put(self, key: Hashable, value: Any) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.limit:
            self._d.popitem(last=False)


def read_profiles(store: Any, *, status: str | None, fingerprint: str | None = None) -> list[ProfileRecord]:
    """The store's profiles of `status`; a row this moetune cannot read is skipped with a warning (by
    `Store.list_profiles`). A StoreError (a locked or broken database) is the caller's to report."""
    return [r for _, r in store.list_profiles(status=status, fingerprint=fingerprint)]


def encode_profile(rec: ProfileRecord, version: int) -> wire.ProfileResult:
    return wire.ProfileResult.from_record(rec, env=launcher_env(rec.knobs, rec.key.transport_family, rec.key.nodes),
                                         version=version)


def encode_listed(rec: ProfileRecord, version: int) -> wire.ProfileResult:
    """A list_profiles reply's row: `encode_profile`, and why no lookup serves it where none does (a reader of the
    list took such a row for one in use). Not get_profile's: a reply with the field is one an older client refuses."""
    res = encode_profile(rec, version)
    why = rec.not_served
    if why is not None:
        res.not_served = why[:wire.ERROR_MESSAGE_MAX]  # the field's bound: a longer one fails the client's decode
    return res


class ProfileIndex:
    """Current profiles grouped by (fingerprint, ep, nodes, shape); immutable once built (except the caches)."""

    def __init__(self, records: list[ProfileRecord], *, version: int, facts: Any, stale: list[ProfileRecord]):
        self.version = version
        self.facts = facts  # the daemon's facts it was built for (`built_for`)
        self.fingerprint: str | None = facts.fingerprint if facts is not None else None
        self.software: str | None = facts.software_hash if facts is not None else None
        self.groups: dict[ShapeKey, list[ProfileRecord]] = {}
        # current rows no lookup serves (`not_served_reason`: knobs or key contradict their family, what `db check`
        # names, or a what-if no run of this runtime can take): never served, their reason kept for a lookup that
        # finds nothing else (said in its not-found reply). A what-if row handed out would only be refused by the
        # client, which then skipped the daemon for its database although a runnable row of another family was here.
        self.passed_over: dict[ShapeKey, list[tuple[ProfileRecord, str]]] = {}
        for r in records:
            if r.status != "current":
                continue  # a stale profile is never served as current
            k = r.key
            group = (k.fingerprint, k.ep_size, k.nodes, k.hidden, k.intermediate, k.experts, k.topk, k.dtype)
            why = not_served_reason(k, r.knobs)
            if why is not None:
                self.passed_over.setdefault(group, []).append((r, why))
                if contradiction_reason(k, r.knobs) is not None:  # a defect to mend; a what-if row is stored as meant
                    # once per process and row: every store change rebuilds the index
                    say_once(_PASSED_OVER, r.profile_hash, f"profile {r.profile_hash}: {why}", logger=log)
                continue
            self.groups.setdefault(group, []).append(r)
        self.records = [r for r in records if r.status == "current"]
        # the rows passed over above: listed as current (the database's status), counted apart by `status`, out of
        # its provenance counts (by identity: a record is not hashable)
        self.not_served = {id(r) for rows in self.passed_over.values() for r, _ in rows}
        self.stale = stale
        self.cache = ReplyCache(CACHE_LIMIT)
        self.list_cache = ReplyCache(LIST_CACHE_LIMIT, shared=True)
        # how many profiles a current/stale page can hold, all fingerprints (None) and each: `list_key`
        self._counts: Counter[tuple[str, str | None]] = Counter()
        for status, recs in (("current", self.records), ("stale", stale)):
            self._counts[(status, None)] = len(recs)
            self._counts.update((status, r.key.fingerprint) for r in recs)

    def built_for(self, facts: Any) -> bool:
        """Whether this index was built for the daemon's `facts`: a daemon that took new facts (a fabric change) holds
        them before its index is rebuilt (the change's store writes come first, up to the busy timeout), and this
        index's profiles are then the fabric's it has left."""
        return facts is self.facts

    def list_key(self, status: str, fingerprint: str | None, limit: int) -> tuple[str, str | None, int]:
        """The list cache's key: the page a request gets, not its spelling. Every limit past LIST_PAGE_MAX gets the
        same page, and for current or stale profiles every limit past their count the same too (limit=100 and
        limit=10000 on a 40-profile index are one entry, not two)."""
        n = min(limit, LIST_PAGE_MAX)
        if status in ("current", "stale"):
            n = min(n, self._counts.get((status, fingerprint or None), 0))
        return status, fingerprint, n

    @property
    def current_count(self) -> int:
        return len(self.records)

    @property
    def not_served_count(self) -> int:
        """Of `current_count`, the rows no lookup serves (`not_served_reason`)."""
        return len(self.not_served)

    def provenance_counts(self) -> dict[str, int]:
        """How the current profiles of this node's fingerprint that lookups serve were obtained (what `status`
        shows; a row no lookup serves is counted apart, `not_served_count`)."""
        mine = [r for r in self.records if (self.fingerprint is None or r.key.fingerprint == self.fingerprint)
                and id(r) not in self.not_served]
        c = Counter(r.effective_provenance for r in mine)  # what the numbers are, as lookups take them
        return {p: c.get(p, 0) for p in PROVENANCES}

    def held_by_provenance(self, which: str) -> dict[str, int]:
        """The `current` (all fingerprints: `current_count`), `stale` or `not_served` (of current) rows, counted by
        the provenance lookups take them as (`provenance_of`), every value of PROVENANCES present: the metrics' gauges."""
        recs = {"current": self.records, "stale": self.stale,
                "not_served": [r for r in self.records if id(r) in self.not_served]}[which]
        c = Counter(provenance_of(r) for r in recs)
        return {p: c.get(p, 0) for p in PROVENANCES}

    def lookup(self, req: wire.GetProfile) -> tuple[bool, Any]:
        """(True, encoded ProfileResult as msgspec.Raw) or (False, (code, message))."""
        return self.find(req)[0]

    def find(self, req: wire.GetProfile) -> tuple[tuple[bool, Any], str | None]:
        """`lookup`'s reply, and the provenance of the profile it carries (None when it carries none): the served
        counter's label, kept beside the encoded reply so a cached hit is counted as what it serves."""
        if req.model is not None:
            try:
                m = get_model(req.model)
            except ValueError as e:
                return (False, (wire.E_INVALID_FIELD, str(e))), None
            h, i, e_, k, dt = m.hidden, m.intermediate, m.experts, m.topk, m.dtype
            h, i, e_, k = req.hidden or h, req.intermediate or i, req.experts or e_, req.topk or k
            dt = req.dtype or dt
        else:
            missing = [f for f in ("hidden", "intermediate", "experts", "topk") if getattr(req, f) is None]
            if missing:
                return (False, (wire.E_MISSING_FIELD, f"give `model` or all of hidden/intermediate/experts/topk (missing {', '.join(missing)})")), None
            h, i, e_, k, dt = req.hidden, req.intermediate, req.experts, req.topk, req.dtype or "bfloat16"
        if req.ep_size % req.nodes:
            return (False, (wire.E_INVALID_FIELD, f"ep_size {req.ep_size} is not divisible by nodes {req.nodes}")), None
        fp = req.fingerprint or self.fingerprint
        if fp is None:
            return (False, (wire.E_NOT_FOUND, "the daemon has not discovered its fabric (yet); no profile is current")), None
        group = (fp, req.ep_size, req.nodes, h, i, e_, k, dt)
        recs = self.groups.get(group, [])
        # The software defaults to the daemon's own with its fingerprint (they default together): a profile
        # of this fingerprint keyed by other software (an import, another version's hash) is not this node's.
        sw = req.software or (self.software if fp == self.fingerprint else None)
        if sw:
            recs = [r for r in recs if r.key.software == sw]
        # Measured first, then the node model, then a preset, each at its nearest bucket within reach: a
        # prediction at a nearer bucket never displaces a measurement one rung away (as the store's
        # find_profile and the client's database fallback pick).
        rec = None
        for tier in PROVENANCES:
            rec = pick_profile([r for r in recs if provenance_of(r) == tier], req.tokens,
                               transport_family=req.transport_family)
            if rec is not None:
                break
        if rec is None:
            passed = [f"{r.profile_hash}: {why}" for r, why in self.passed_over.get(group, [])
                      if (not sw or r.key.software == sw)
                      and (not req.transport_family or r.key.transport_family == req.transport_family)]
            what = f"; passed over: {'; '.join(passed[:4])}" if passed else ""
            return (False, (wire.E_NOT_FOUND, f"no current profile for fingerprint {fp}, software {sw}, ep {req.ep_size}, nodes {req.nodes}, "
                                              f"shape {h}x{i}x{e_}/top{k} {dt}{what}")), None
        return (True, msgspec.Raw(wire.encoder.encode(encode_profile(rec, self.version)))), provenance_of(rec)

    def list_page(self, status: str, fingerprint: str | None, limit: int,
                  history: list[ProfileRecord] | None = None) -> bytes:
        """An encoded ListProfilesResult of at most LIST_PAGE_MAX profiles. `history` (superseded/all)
        comes from the store, read by the caller off the serving thread."""
        recs = self.records if status == "current" else self.stale if status == "stale" else (history or [])
        if fingerprint:
            recs = [r for r in recs if r.key.fingerprint == fingerprint]
        n = min(limit, LIST_PAGE_MAX)
        res = wire.ListProfilesResult(version=self.version, fingerprint=self.fingerprint,
                                      profiles=[encode_listed(r, self.version) for r in recs[:n]])
        return wire.encoder.encode(res)
