"""One function per wire op: `(daemon, request) -> (ok, result | (code, message))`.

They run on the serving loop and read only the in-memory index, the job manager's cheap `info()` and
the last discovery; the exceptions, an uncached `list_profiles` and `retune`, are handed to the list worker
(`DEFERRED`) so that a burst of list requests never holds up `get_profile`, and a re-tune is answered only once
what it says is committed to the store (`run_retune`) without the serving loop waiting on the database.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from datetime import UTC, datetime
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import msgspec

from moetune.runtime import wire
from moetune.runtime.profile_record import ProfileKey
from moetune.tuner import __version__
from moetune.tuner.daemon.index import ProfileIndex
from moetune.tuner.daemon.jobs import JobNotRecorded
from moetune.tuner.daemon.retune import (
    MEASURE_ELSEWHERE,
    key_holds_a_profile,
    key_refusals,
    model_family,
    retune_refusal,
    served_tuning_keys,
    tuner_retune,
    tuning_key,
)
from moetune.tuner.daemon.watch import facts_dict, transport_names

if TYPE_CHECKING:
    from moetune.tuner.daemon.server import Daemon

Result = tuple[bool, Any]
DEFERRED: Result = (True, None)  # the list worker sends the reply

_GP_KEY_FIELDS = tuple(f for f in wire.GetProfile.__struct_fields__ if f not in ("v", "id"))
_gp_key = attrgetter(*_GP_KEY_FIELDS)


def get_profile(d: Daemon, req: wire.GetProfile) -> Result:
    idx = d.index
    if not idx.built_for(d.facts):
        # the fabric changed and the index is not rebuilt yet: its profiles (and cached replies) are the old fabric's,
        # which `fabric` no longer reports; answered as before discovery, never served
        return False, (wire.E_NOT_FOUND, "the fabric changed; the daemon is re-reading its profiles for the new one "
                                         "(no profile is current until then)")
    key = _gp_key(req)  # every field but v/id
    entry = idx.cache.get(key)
    if entry is None:
        entry = idx.find(req)  # the reply and its profile's provenance (the served counter's label)
        idx.cache.put(key, entry)  # bounded (CACHE_LIMIT): the least recently used reply goes
    hit, provenance = entry
    if hit[0] and provenance is not None:
        d.metrics.profile_served(provenance)
    return hit


def hello(d: Daemon, req: wire.Hello) -> Result:
    idx = d.index
    return True, wire.HelloResult(protocol=wire.PROTOCOL_VERSION, daemon_version=__version__, epoch=d.epoch,
                                  pub_endpoint=d.pub_endpoint, version=idx.version, fingerprint=idx.fingerprint,
                                  ops=list(wire.OPS))


def list_profiles(d: Daemon, req: wire.ListProfiles) -> Result:
    idx = d.index
    raw = idx.list_cache.get(idx.list_key(req.status, req.fingerprint, req.limit))
    if raw is not None:
        return True, msgspec.Raw(raw)
    return DEFERRED


def fabric(d: Daemon, req: wire.Fabric) -> Result:
    f = d.facts
    when, ok, msg = d._last_discovery
    return True, wire.FabricResult(fingerprint=f.fingerprint if f is not None else None,
                                   software=f.software_hash if f is not None else None,
                                   transports=transport_names(f) if f is not None else [],
                                   facts=facts_dict(f) if f is not None else {}, discovered_at=when, ok=ok, message=msg)


def _jobs_info(d: Daemon) -> wire.JobsInfo:
    queued, running, recent = d.jobs.info()
    return wire.JobsInfo(queued=queued, running=running, recent=recent, capacity=d.jobs.capacity)


def status(d: Daemon, req: wire.Status) -> Result:
    idx = d.index
    when, ok, msg = d._last_discovery
    return True, wire.StatusResult(
        epoch=d.epoch, daemon_version=__version__, pid=os.getpid(), uptime_s=time.time() - d.started,
        db=d.db_path, endpoint=d.endpoint, pub_endpoint=d.pub_endpoint, version=idx.version,
        fingerprint=idx.fingerprint, last_discovery=when, last_discovery_ok=ok, last_discovery_message=msg,
        profiles_current=idx.current_count, profiles_stale=len(idx.stale), requests=d.metrics.total_requests(),
        jobs=_jobs_info(d), provenance=idx.provenance_counts(), tune_notice=d.tune_notice,
        store_damaged=d.store.damaged or "", profiles_not_served=idx.not_served_count,
        retune_refusals=list(d.retune_refusals),
    )


def retune(d: Daemon, req: wire.Retune) -> Result:
    return DEFERRED  # run_retune, on the list worker: it waits for the store


def run_retune(d: Daemon, req: wire.Retune) -> Result:
    """Queue or cancel a re-tune; a success reply means its job_queued / job_cancelled is committed (a kill -9
    right after it loses nothing, and the job id is never handed out again)."""
    if req.cancel is not None:
        try:
            job = d.jobs.cancel(req.cancel)
        except JobNotRecorded as e:
            return False, (wire.E_INTERNAL, str(e))
        if job is None:
            return False, (wire.E_NOT_FOUND, f"no queued or running job {req.cancel}")
        # as the queued reply's job: no left_out (a client one version older refuses it and says the cancel failed)
        return True, wire.RetuneResult(job=job.info(left_out=False), message=f"cancelling job {job.id}")
    idx = d.index
    if idx.fingerprint is None:
        return False, (wire.E_NOT_FOUND, "the fabric is unknown (discovery failed); nothing to re-tune for")
    keys, asked = planned_keys(idx, all_current=req.all)
    if not keys:
        # --all re-tunes current profiles too: with none of those either, there is nothing of any kind
        why = ("this fabric has no current profile, and no stale one lacks a current one" if req.all
               else "no stale profile lacks a served current one, and every current one is served or of a key no "
                     "re-tune can answer (one that contradicts its family: `moetune db check` names it) (--all "
                     "re-tunes the current ones too)")
        return True, wire.RetuneResult(job=None, message=f"nothing to re-tune: {why}")
    left_out: list[str] = []
    left_out_said = brief = ""
    if d.jobs.retune is tuner_retune:  # a job that could only fail as impossible is refused, not queued
        # keys the job would refuse on this node (`key_refusals`, its own rule) are left out of it and named: a
        # current key whose rows are what-if ones (2 nodes, EP 16) queued a job that failed at every `retune`
        refusals = (key_refusals(keys, d.facts, d.tune.backend, model_family(d.store, d.facts, d.tune))
                    if d.facts is not None else [])
        if refusals:
            refused = {k for r in refusals for k in r.keys}
            keys = [k for k in keys if k not in refused]
            backend = f'[tune] backend = "{d.tune.backend}"'
            left_out = [r.said(naming=True) for r in refusals]
            advice = ". " + MEASURE_ELSEWHERE if any(r.measuring for r in refusals) else ""
            said = "; ".join(left_out) + advice
            # an error's message is cut at wire.ERROR_MESSAGE_MAX: there each group is said without its shapes and
            # buckets, so every group and the advice fit (many keys' names took both past the cut)
            brief = "; ".join(r.said() for r in refusals)
            if not keys:
                if any(tuning_key(k) in asked for k in refused):
                    # stale keys (or --all's current ones) asked for by name: the job could only fail
                    msg = f"not queued: {backend} cannot re-tune any of the {len(refused)} key(s) here: {brief}{advice}"
                    _note_refusal(d, req, msg, left_out)
                    return False, (wire.E_NOT_FOUND, msg)
                # current keys planned only because no row of theirs is served: as before they were planned
                msg = ("nothing to re-tune: no stale profile lacks a served current one, and the current keys no "
                       f"lookup serves are ones {backend} cannot re-tune here: ")
                _note_refusal(d, req, msg + brief + advice, left_out)
                return True, wire.RetuneResult(job=None, left_out=left_out, message=msg + said)
            left_out_said = f"; {backend} leaves out {len(refused)} key(s) it cannot re-tune here: {said}"
        why = retune_refusal(d.store, d.facts, d.tune, keys)
        if why:
            also = f" Also, {backend} leaves out: {brief}" if left_out else ""
            if left_out:
                _note_refusal(d, req, f"not queued: {why}{also}", left_out)
            return False, (wire.E_NOT_FOUND, f"not queued: {why}{also}")
    try:
        # the keys left out are kept on the job (its events, `status`): after this reply nothing else named them
        job = d.jobs.submit(reason=req.reason, old_fingerprint=None, keys=keys, all_current=req.all, confirm=True,
                            left_out=left_out)
    except JobNotRecorded as e:
        return False, (wire.E_INTERNAL, str(e))
    except queue.Full:
        return False, (wire.E_BUSY, f"the job queue is full ({d.jobs.capacity} jobs)")
    # no left_out beside a queued job, in the reply or its job: a client one version older refuses a reply with a field
    # it does not know, and its user, told the retune failed, would queue the job again; the message names the keys
    return True, wire.RetuneResult(job=job.info(left_out=False),
                                   message=f"queued job {job.id} for {len(keys)} key(s)" + left_out_said)


def _note_refusal(d: Daemon, req: wire.Retune, message: str, left_out: list[str]) -> None:
    """Keep a `retune` that queued nothing for keys it left out, for `status` (the newest RETUNE_REFUSALS_KEPT): once
    its reply is gone, nothing else says why those keys were not re-tuned."""
    at = datetime.now(UTC).isoformat(timespec="seconds")
    # a deque with maxlen, appended here (the list worker) and copied by `status` (the serving loop): each is one
    # C-level operation under the GIL, so the copy never sees it half-changed
    d.retune_refusals.append(wire.RetuneRefusal(at=at, reason=req.reason, message=message[:wire.ERROR_MESSAGE_MAX],
                                                left_out=list(left_out)))


def planned_keys(idx: ProfileIndex, *, all_current: bool) -> tuple[list[ProfileKey], set[tuple]]:
    """`retune_keys`, and the `tuning_key`s of those asked for by name: the stale ones and, with `all_current`,
    every current one (the rest are current keys planned only because no row of theirs is served)."""
    mine = [r for r in idx.records if r.key.fingerprint == idx.fingerprint]
    have = served_tuning_keys(mine)
    out: dict[tuple, ProfileKey] = {}
    asked: set[tuple] = set()
    for r in idx.stale:
        if tuning_key(r.key) not in have:
            out.setdefault(tuning_key(r.key), r.key)
            asked.add(tuning_key(r.key))
    for r in filter(key_holds_a_profile, mine):
        if tuning_key(r.key) not in have:
            out.setdefault(tuning_key(r.key), r.key)
    if all_current:
        for r in mine:
            out.setdefault(tuning_key(r.key), r.key)
            asked.add(tuning_key(r.key))
    return list(out.values()), asked


def retune_keys(idx: ProfileIndex, *, all_current: bool) -> list[ProfileKey]:
    """Stale keys without a served current profile of this fingerprint, and this fingerprint's current keys none of
    whose rows is served (`served_tuning_keys`: their lookups fall back, as for a missing row) where a re-tune can
    store a sound one (`key_holds_a_profile`), + every current one with `all_current`. What the configured backend
    cannot answer here is left out after (`run_retune`, `key_refusals`)."""
    return planned_keys(idx, all_current=all_current)[0]


# Ops only an admin peer may run (Daemon._admin_refusal says who): a re-tune occupies the node's GPUs.
ADMIN_OPS: frozenset[type] = frozenset({wire.Retune})

HANDLERS: dict[type, Callable[[Any, Any], Result]] = {
    wire.Hello: hello,
    wire.GetProfile: get_profile,
    wire.ListProfiles: list_profiles,
    wire.Fabric: fabric,
    wire.Status: status,
    wire.Retune: retune,
}
