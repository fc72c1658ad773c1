"""Re-tune jobs of the daemon: a bounded queue, one job at a time, cancellable, persisted in the store.

Persistence (so that a `kill -9` leaves nothing ambiguous): every job state change is an event in the
store (`job_queued`, `job_started`, `job_finished`, details carry the job id, the tuning-run id and the
keys), and a running job holds a `tuning_runs` row with status `running`. On restart,
`recover_jobs()` marks every run the previous daemon left `running` as `failed` (and its job as
failed, reason "interrupted"), then re-queues the interrupted and the still-queued jobs as new jobs:
the job is both marked failed and resumed. An interrupted job resumes only the keys it had not finished:
a key whose transport family got a current profile of the job's fingerprint and software after its
`job_started` event is left out (when that cannot be told, every key is tuned again).

Confirmation: `submit(confirm=True)` and `cancel` return only once the job_queued / job_cancelled / job_finished they
imply is committed (the `retune` op replies after that, from the list worker, never the serving loop), so a reply
that says "queued" or "cancelling" survives a kill -9 right after it, and a job id handed out is on disk (the next
daemon's ids start past it).

Cancellation: a queued job is dropped at once (its slot freed; its job_finished written after its job_queued); a
running job is told through `ctx.cancel` (an Event): the default re-tune stops the study after its running trial
and looks again before every study and side-by-side check, and a re-tune that never looks still ends the job
`cancelled`; a user's cancel of a running job is recorded when asked (`job_cancelled`), so a daemon stopped before
the job ends does not leave it to be resumed. Whatever a cancelled or failed job had already
written stays (a profile is whole once stored) and is counted and published like a finished job's. A job
stopped by the daemon's own shutdown is not cancelled in the store: it stays queued (or started), so the
next daemon resumes it as after a kill -9.

A job whose fabric changed under it (the fingerprint it tuned for is no longer the node's) leaves nothing
current for the old fingerprint and queues its keys again for the new one (the watch cancels it early).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.runtime.profile_record import (
    ENGINE_FAMILIES,
    MEGAKERNEL_FAMILY,
    UNIFORM_ROUTING,
    ProfileKey,
    ProfileRecord,
)
from moetune.runtime.shapes import MODELS, ModelShape
from moetune.runtime.wire import JobInfo
from moetune.tuner.store import StoreBusy, StoreDamaged, StoreError, StoreFull

if TYPE_CHECKING:
    from moetune.tuner.daemon.server import TuneSettings
    from moetune.tuner.search.backends import BenchmarkBackend
    from moetune.tuner.store.models import EventKind
    from moetune.tuner.store.store import Store

log = logging.getLogger("moetune.daemon.jobs")

# job_cancelled: a user's cancel of a running job, recorded when asked (its job_finished comes when the job ends)
JOB_EVENTS: tuple[EventKind, ...] = ("job_queued", "job_started", "job_cancelled", "job_finished")
# (busy: True / False / None when it cannot be told, what was seen): are other processes on this node's GPUs?
GpuProbe = Callable[[], tuple[bool | None, str]]
# how often a job held for want of fabric facts looks again (an attribute read: the discovery rounds set them)
FACTS_RECHECK_S = 0.25


def now() -> str:
    return datetime.now(UTC).isoformat()


class JobCancelled(Exception):
    pass


class JobNotRecorded(RuntimeError):
    """A confirmed submit or a cancel whose event the store refused: it must not be answered as done."""


class Job:
    def __init__(self, job_id: int, *, reason: str, old_fingerprint: str | None, keys: list[ProfileKey], all_current: bool = False,
                 resumes: int | None = None):
        self.id = job_id
        self.resumes = resumes  # the job of the last daemon this one takes over (recover_jobs reads it back)
        self.reason = reason
        self.old_fingerprint = old_fingerprint
        self.keys = keys  # the stale (or current, with all_current) keys to re-tune
        self.all_current = all_current
        self.state = "queued"
        self.run_id: int | None = None
        self.written = 0
        self.message = ""
        self.created = now()
        self.finished = ""
        self.cancel = threading.Event()
        self.fingerprint: str | None = None
        self.software: str | None = None  # the node's software hash when the job started (what it writes)
        self.queued_recorded = False  # the job_queued event is in the store (a resumption closes its old job then)
        self.started_recorded = False  # the job_started event is in the store
        self.impossible = False  # failed because no profile true for this node could be produced
        self.backend: str | None = None  # the [tune] backend it ran under (a notice it leaves is about that one)
        self.cancelled_by = ""  # "user" (the retune op), "fabric" (the watch: its fabric changed), "shutdown"
        self.refused: list[str] = []  # keys the re-tune would not produce here, and why (they stay as they are)
        self.kept = 0  # keys re-tuned whose current profile stayed (the new result did not replace it)
        self.kept_why: list[str] = []  # the distinct reasons they stayed (the store's rule, the side-by-side check)
        self.no_result: list[str] = []  # keys re-tuned that got nothing (no successful trial, the budget), and why
        # routing -> keys the re-tune tuned under it, other than uniform (each key under its profile's routing)
        self.routings: dict[str, int] = {}
        self.deferred = ""  # why the job waits (the GPUs are busy or their state unknown), "" once it runs
        self.dropped = False  # a queued job `cancel` finished: its job_finished is written then, not by the worker
        self.persisted = False  # its job_queued write was tried (`_persist_and_enqueue`)
        self.end_recorded = threading.Event()  # a dropped job's job_finished write was tried (`_finish_dropped`)
        self.end_ok = False  # ... and committed

    def info(self) -> JobInfo:
        return JobInfo(id=self.id, state=self.state, reason=self.reason, fingerprint=self.fingerprint or self.old_fingerprint,
                       keys=len(self.keys), run_id=self.run_id if self.started_recorded else None, written=self.written, message=self.message,
                       created=self.created, finished=self.finished,
                       cancelling=self.state == "running" and self.cancel.is_set())

    def details(self) -> dict[str, Any]:
        return {"job_id": self.id, "run_id": self.run_id, "old_fingerprint": self.old_fingerprint,
                "fingerprint": self.fingerprint, "software": self.software, "all_current": self.all_current,
                "keys": [k.to_dict() for k in self.keys], "state": self.state, "written": self.written,
                "message": self.message, "impossible": self.impossible, "refused": list(self.refused),
                "kept": self.kept, "kept_why": list(self.kept_why), "no_result": list(self.no_result),
                "routings": dict(self.routings),
                "resumes": self.resumes, "backend": self.backend}


class JobContext:
    """What a re-tune function gets: the store, the new facts, the keys, a cancel flag, the tune config."""

    def __init__(self, *, store: Any, facts: Any, job: Job, tune: TuneSettings):
        self.store = store
        self.facts = facts
        self.job = job
        self.keys = job.keys
        self.cancel = job.cancel
        self.tune = tune
        self.refused = job.refused  # why keys were left as they are (said in the job's message and events)

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise JobCancelled(f"job {self.job.id} cancelled")


RetuneFn = Callable[[JobContext], list[ProfileRecord]]


def _shape_of(key: ProfileKey) -> ModelShape:
    for m in MODELS.values():
        if (m.hidden, m.intermediate, m.experts, m.topk, m.dtype) == (key.hidden, key.intermediate, key.experts, key.topk, key.dtype):
            return m
    name = f"custom:{key.hidden},{key.intermediate},{key.experts},{key.topk},{key.dtype}"
    return ModelShape(name=name, hidden=key.hidden, intermediate=key.intermediate, experts=key.experts, topk=key.topk, dtype=key.dtype)


def group_keys(keys: list[ProfileKey], routing_of: Callable[[ProfileKey], str] | None = None,
               ) -> dict[tuple[int, int], dict[tuple[str, str], tuple[ModelShape, list[int]]]]:
    """(ep_size, nodes) -> {(routing, shape name): (shape, its token buckets)} to re-tune: each shape is one tune call
    with the buckets its keys have, never another shape's (a cross product tuned keys nobody asked for), under the
    routing `routing_of` says its key was tuned under (uniform without it): a call tunes one routing, and a key
    re-tuned under another than its profile's comes back as another routing's profile (`Store.routing_of`)."""
    groups: dict[tuple[int, int], dict[tuple[str, str], tuple[ModelShape, set[int]]]] = {}
    for k in keys:
        m = _shape_of(k)
        routing = routing_of(k) if routing_of is not None else UNIFORM_ROUTING
        groups.setdefault((k.ep_size, k.nodes), {}).setdefault((routing, m.name), (m, set()))[1].add(k.token_bucket)
    return {g: {n: (m, sorted(b)) for n, (m, b) in shapes.items()} for g, shapes in groups.items()}


TUNE_BACKENDS = ("model", "local")  # [tune] backend: this node's calibrated model, or measure on this node


class RetuneImpossible(RuntimeError):
    """The automatic re-tune cannot produce a profile that is true for this node (said, not guessed)."""


def node_model_file(store: Store, fingerprint: str, directory: str | Path | None = None) -> Path:
    """Where `moetune profile` leaves this node's calibrated fabric model: node-<fingerprint>.toml in the
    bring-up state directory, which is the database's directory."""
    base = Path(directory) if directory else Path(store.path).parent
    return base / f"node-{fingerprint}.toml"


def _capture_elsewhere(facts: Any) -> str:
    """'' unless `facts` were read from a capture (`serve --capture`) of another node than this one: why then (a
    number measured here may be stored only under this node's identity, as `tune --capture` refuses)."""
    src = str(getattr(facts, "source", ""))
    if not src.startswith("capture:"):
        return ""
    from moetune.tuner.fabric.discovery import capture_not_this_node

    return capture_not_this_node(facts, src.removeprefix("capture:"))


def _backend_for(ctx: JobContext) -> tuple[Any, str | None]:
    """(backend, calibrated preset file or None) for this node; RetuneImpossible otherwise. The search labels
    what it writes from these: a local measurement is measured, this node's calibrated model node_model."""
    return node_backend(ctx.store, ctx.facts, ctx.tune)


def node_backend(store: Store, facts: Any, tune: TuneSettings) -> tuple[Any, str | None]:
    """`_backend_for` of a store, facts and [tune] settings: also asked before a user's `retune` is queued
    (`retune_refusal`)."""
    backend = tune.backend
    if backend == "local":  # (a capture of another node is refused before: tuner_retune)
        return "local", None
    if backend != "model":
        raise RetuneImpossible(f"unknown tune.backend {backend!r} (expected one of {', '.join(TUNE_BACKENDS)})")
    path = node_model_file(store, facts.fingerprint, tune.node_model_dir)
    if not path.is_file():
        # `moetune profile` alone is no advice after a bring-up whose calibration was refused: a rerun resumes its
        # finished stages ("calibrate (done earlier; resuming)") and writes no model again
        raise RetuneImpossible(
            f"cannot re-tune fabric {facts.fingerprint}: no calibrated model of this node ({path} does not exist) "
            "and [tune] backend is \"model\"; set [tune] backend = \"local\" to measure, or run `moetune profile` "
            "on this node to calibrate one (where a bring-up already finished with its calibration refused, a rerun "
            "only resumes it and writes none: `moetune profile --restart` measures and calibrates again). Still "
            "serving the profiles that remain valid.")
    from moetune.tuner.fabric_model.predict import forced_fit_warning, load_preset
    from moetune.tuner.search.backends import ModelBackend

    try:
        preset = load_preset(path, fresh=True)  # as on disk now: `moetune profile` may have re-written it since
    except (OSError, ValueError) as e:
        raise RetuneImpossible(f"cannot re-tune fabric {facts.fingerprint}: the calibrated model {path} is unreadable: {e}") from None
    warning = forced_fit_warning(preset)
    if warning:
        # the calibration checks refused this fit (`--force` wrote it): it must not silently become the
        # basis of the profiles served for this node
        raise RetuneImpossible(
            f"cannot re-tune fabric {facts.fingerprint}: the calibrated model {path} is a fit the calibration checks "
            f"refused ([calibration] warning: {warning}); re-run `moetune profile` on this node, "
            "or `moetune model calibrate` without --force, or set [tune] backend = \"local\" to measure. "
            "Still serving the profiles that remain valid.")
    from moetune.tuner.fabric_model.presets import node_model_refusal

    # the file's name is no proof: a file copied from another node, or written before presets recorded their node,
    # would have its predictions stored as THIS node's model (node_model, outranking every preset)
    why = node_model_refusal(preset, facts.fingerprint)
    if why:
        raise RetuneImpossible(f"cannot re-tune fabric {facts.fingerprint} with the calibrated model {path}: {why}. "
                               "Still serving the profiles that remain valid.")
    return ModelBackend(preset), str(path)


def retune_refusal(store: Store, facts: Any, tune: TuneSettings, keys: list[ProfileKey]) -> str:
    """Why the default re-tune (`tuner_retune`) of `keys` cannot run at all ('' when it may): with [tune] backend =
    "model", EP keys need this node's accepted node model (`node_backend`), and without it the whole job fails as
    impossible. Asked before a user's `retune` queues a job that could only fail that way. Nothing else is asked
    here: a local job's refusals depend on what it finds when it runs (the GPUs, the megakernel's library), and a
    job of megakernel keys alone says its own reason."""
    if tune.backend != "model" or facts is None or all(k.transport_family in ENGINE_FAMILIES for k in keys):
        return ""
    try:
        node_backend(store, facts, tune)
    except RetuneImpossible as e:
        return str(e)
    return ""


def local_refusal(ep_size: int, nodes: int, gpus: int) -> str:
    """Why a local re-tune cannot measure the EP group (ep_size, nodes) on this node ('' when it can): it launches
    ep_size ranks on this one host, one per GPU (a node without GPUs runs them as gloo processes on its CPUs, as
    its bring-up did), and stores what it ran as MEASURED."""
    if nodes > 1:
        return (f"a local re-tune measures on this one node, the group spans {nodes} nodes "
                "(measuring it needs every node of the group)")
    if gpus >= 1 and ep_size > gpus:
        return f"EP {ep_size} needs {ep_size} GPUs, this node has {gpus}"
    return ""


def megakernel_refusal(facts: Any, backend: str) -> str:
    """Why the re-tune cannot re-tune a `megakernel` key on this node ('' when it can).

    The megakernel (family `megakernel`, ep_size 1, nodes 1) is the whole MoE layer in one kernel on one GPU, not
    an EP exchange: only a measurement of it on this node makes its profile (the bring-up's megakernel backend,
    `megakernel_backend`). The fabric model predicts exchanges, so the model backend has nothing to say of it; a
    measurement needs an sm_90 (Hopper) GPU and the megakernel's library (a prebuilt one in MOETUNE_MK_LIB, or nvcc
    to build it) and torch to time it. Checked before anything runs: a node without them refuses, it never tunes
    another family in the megakernel's place."""
    if backend != "local":
        return ("the fabric model ([tune] backend = \"model\") predicts EP exchanges, not the MoE megakernel's "
                "kernel (it has no prediction for family megakernel); only a measurement on this node re-tunes it: "
                "set [tune] backend = \"local\" or re-run `moetune profile` on this node")
    from moetune.tuner.fabric.families import megakernel_family

    if not hasattr(facts, "gpus"):
        return "this node's facts list no GPU (the megakernel needs an sm_90 GPU)"
    ok, why = megakernel_family(facts)
    if not ok:
        return f"the megakernel cannot run here: {why}"
    pre = os.environ.get("MOETUNE_MK_LIB")
    if pre and not Path(pre).is_file():
        return f"the megakernel library MOETUNE_MK_LIB={pre} does not exist"
    from moetune.runtime.megakernel.engine import library_problem

    why = library_problem()
    if why is not None:
        return f"the megakernel library is not built and cannot be: {why}"
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (the megakernel is timed through torch on the GPU)"
    return ""


def megakernel_backend(tune: TuneSettings) -> BenchmarkBackend:
    """The backend that measures the megakernel family: the one GPU, in this process (as `moetune profile`'s
    bring-up measures it, Bringup._mk_backend). Tests replace it with one whose measurement is injected."""
    from moetune.tuner.search.backends import LocalBackend

    return LocalBackend(world=1, comm_backend="nccl", family=MEGAKERNEL_FAMILY)


def tuner_retune(ctx: JobContext) -> list[ProfileRecord]:
    """The default re-tune: the tuner's `tune_profiles` on the new facts, per (EP size, nodes) group, and the
    megakernel keys as the megakernel family.

    EP keys: it measures on this node (`[tune] backend = "local"`, world = the key's EP size) or predicts with this
    node's calibrated fabric model (what `moetune profile` wrote for this fingerprint). It never takes a shipped
    preset (another machine) as this node's profile: without a calibrated model it fails with RetuneImpossible,
    which the daemon reports in the job, its log and `status`.

    Megakernel keys (family `megakernel`, EP 1 on one node): measured as that family only, with the bring-up's
    megakernel backend (`megakernel_backend`), when `megakernel_refusal` allows it; otherwise (the model backend,
    no Hopper GPU, no library) they are refused and stay stale, with the reason in the job. They are never tuned as
    the node's transport families at EP 1.

    Routing (EP and megakernel keys alike): each key is tuned under the routing its profile was tuned under
    (`Store.routing_of`: a `moetune tune --routing zipf:S` profile again under zipf:S, a row that records none under
    uniform), one call per routing; the job's message and events count the keys of each routing but uniform.

    Cancellation: the `on_trial` callback stops the study after its running trial, `stop` is asked before every
    study and side-by-side check, and what the calls did is tallied before JobCancelled ends the job."""
    from moetune.tuner.search.backends import one_rank_exchange
    from moetune.tuner.search.tune import make_backend, tune_profiles_detailed

    tune = ctx.tune
    local = tune.backend == "local"
    why = _capture_elsewhere(ctx.facts) if local else ""
    if why:  # before any key: the megakernel's keys measure here too, and would be stored as the captured node's
        raise RetuneImpossible(f"cannot re-tune fabric {ctx.facts.fingerprint} by measuring here: {why}; a daemon "
                               "serving a capture of another node re-tunes with [tune] backend = \"model\" only")

    def on_trial(_name: str, study: Any, _trial: Any) -> None:
        if ctx.cancel.is_set():  # the study ends here; `stop` then returns what the call did, tallied below
            study.stop()

    def refuse(msg: str) -> None:
        ctx.refused.append(msg)
        log.warning("re-tune job %d: %s", ctx.job.id, msg)

    gpus = int(ctx.facts.gpu_count or 0)
    # each key is tuned under the routing its profile was: the default (uniform) brought a zipf key back as a uniform
    # profile, or, beside its current zipf profile, one the store never compares with it (the key stayed as it was)
    routings = {k: ctx.store.routing_of(k) for k in ctx.keys}
    ep_keys = [k for k in ctx.keys if k.transport_family not in ENGINE_FAMILIES]
    mk_keys = [k for k in ctx.keys if k.transport_family == MEGAKERNEL_FAMILY]
    ep_refused = False
    runnable = []
    tuned: list[ProfileKey] = []
    for (ep, nodes), shapes in sorted(group_keys(ep_keys, routings.__getitem__).items()):
        group = [k for k in ep_keys if (k.ep_size, k.nodes) == (ep, nodes)]
        one = one_rank_exchange(ep, sorted({k.transport_family for k in group}),
                                done="a re-tune of {families} would store a profile",
                                fix="Neither backend tunes a transport family at EP 1 (both refuse it)")
        if one:
            # a key of a transport family at EP 1 (stored before EP 1 was refused for them): the search refuses it
            # (a ValueError that failed the whole job, every other group's keys untuned with it): refused here
            refuse(f"{len(group)} key(s) of EP {ep} over {nodes} node(s) not re-tuned: {one}; they stay stale")
            continue
        why = local_refusal(ep, nodes, gpus) if local else ""
        if why:
            refuse(f"{len(group)} key(s) of EP {ep} over {nodes} node(s) not re-measured: {why}; they stay stale")
            ep_refused = True
            continue
        runnable.append((ep, nodes, [(r, m, b) for (r, _name), (m, b) in shapes.items()]))
        tuned += group
    mk_shapes: list[tuple[str, ModelShape, list[int]]] = []
    if mk_keys:
        bad = [k for k in mk_keys if (k.ep_size, k.nodes) != (1, 1)]
        if bad:
            refuse(f"{len(bad)} megakernel key(s) not at EP 1 on 1 node (the megakernel runs on one GPU) not "
                   "re-tuned; they stay stale")
        good = [k for k in mk_keys if (k.ep_size, k.nodes) == (1, 1)]
        why = megakernel_refusal(ctx.facts, tune.backend) if good else ""
        if why:
            refuse(f"{len(good)} megakernel key(s) not re-tuned: {why}; they stay stale")
        elif good:
            mk_shapes = [(r, m, b) for (r, _name), (m, b) in group_keys(good, routings.__getitem__)[(1, 1)].items()]
            tuned += good
    if not runnable and not mk_shapes:
        advice = (". Re-tune them where the group can be measured, or set [tune] backend = \"model\" to predict "
                  "them (stored as node_model)") if ep_refused else ""
        raise RetuneImpossible(f"cannot re-tune fabric {ctx.facts.fingerprint} here: " + "; ".join(ctx.refused) + advice)
    be: Any = None
    preset_file: str | None = None
    if runnable:
        try:
            be, preset_file = _backend_for(ctx)
        except RetuneImpossible as e:
            if not ctx.refused:
                raise
            raise RetuneImpossible(f"{e} Also: " + "; ".join(ctx.refused)) from None
    # said in the job's message and events: a routing other than uniform is no default of the tuner
    ctx.job.routings = dict(collections.Counter(routings[k] for k in tuned if routings[k] != UNIFORM_ROUTING))
    written: list[ProfileRecord] = []
    # one time budget for the whole job, whatever the number of calls, shared by bucket: a call gets the time left in
    # the proportion of its buckets to the buckets not tuned yet (unused time passes on to the later calls), as one
    # call shares its own over its studies; before, the first shape could spend the whole job's budget
    deadline = None if tune.timeout_s is None else time.monotonic() + tune.timeout_s
    buckets_left = (sum(len(b) for _ep, _n, shapes in runnable for _r, _m, b in shapes)
                    + sum(len(b) for _r, _m, b in mk_shapes))

    def share(buckets: list[int]) -> float | None:
        nonlocal buckets_left
        n = len(buckets)
        part = n / max(1, buckets_left)  # of the buckets not tuned yet, this call's
        buckets_left -= n
        return None if deadline is None else max(0.0, deadline - time.monotonic()) * part

    # each shape is one call (its own buckets only); a cancel is seen between studies and before each side-by-side
    # check (`stop`), what was done by then is tallied, then the job ends cancelled
    for ep, nodes, shapes in runnable:
        ctx.check_cancel()
        # a local measurement launches ep ranks on this node (the key it stores is the group it ran): one backend
        # (its bench workers) for the group's shapes
        group_be = make_backend("local", facts=ctx.facts, world=ep) if be == "local" else be
        try:
            for routing, m, buckets in shapes:
                ctx.check_cancel()
                _say_routing(ctx, routing, f"EP {ep} over {nodes} node(s)", m, buckets)
                written += _tally(ctx.job, tune_profiles_detailed(
                    ctx.store, ctx.facts, models=[m], tokens=buckets, backend=group_be, preset=preset_file,
                    trials=tune.trials, timeout_s=share(buckets), ep_size=ep, nodes=nodes, routing=routing,
                    on_trial=on_trial, node_model=preset_file is not None, stop=ctx.cancel.is_set))
        finally:
            if group_be is not be:
                group_be.close()
    if mk_shapes:
        ctx.check_cancel()
        mk_be = megakernel_backend(tune)
        try:
            for routing, m, buckets in mk_shapes:
                ctx.check_cancel()
                _say_routing(ctx, routing, "the megakernel", m, buckets)
                written += _tally(ctx.job, tune_profiles_detailed(
                    ctx.store, ctx.facts, models=[m], tokens=buckets, backend=mk_be, trials=tune.trials,
                    timeout_s=share(buckets), ep_size=1, nodes=1, families=[MEGAKERNEL_FAMILY], routing=routing,
                    on_trial=on_trial, stop=ctx.cancel.is_set))
        finally:
            mk_be.close()  # every backend has one (a no-op where nothing is held)
    ctx.check_cancel()
    return written


def _say_routing(ctx: JobContext, routing: str, group: str, m: ModelShape, buckets: list[int]) -> None:
    if routing != UNIFORM_ROUTING:  # the log says what the job's message counts
        log.info("re-tune job %d: %s, %s at %s token(s) under routing %s (as its profile was tuned)", ctx.job.id, group,
                 m.name, ",".join(map(str, buckets)), routing)


def _tally(job: Job, results: list[Any]) -> list[ProfileRecord]:
    """The records a re-tune wrote as current (`TuneResult`s in); the rest said in the job: a key whose current
    profile stayed (a prediction beside a measurement, a result within the noise, the incumbent held its own in
    the side-by-side check: `kept`, with the distinct reasons) or that got no result at all, and why."""
    written = []
    for r in results:
        if r.written and r.record is not None:
            written.append(r.record)
        elif r.stopped:  # the job's cancel: said as cancelled, not as a key that kept its profile
            continue
        elif r.kept and r.study.best_knobs is not None and not r.budget_ended:
            job.kept += 1
            if r.reason and r.reason not in job.kept_why:
                job.kept_why.append(r.reason)
        else:  # nothing to compare (no successful trial, the budget ended), whether or not a profile stands
            job.no_result.append(f"{r.study.study_name}: {r.reason}")
    return written


def _said(items: list[str], most: int = 3) -> str:
    return "; ".join(items[:most]) + (f"; {len(items) - most} more" if len(items) > most else "")


def _modelled(written: list[ProfileRecord]) -> str:
    """What the job's message says of the profiles it wrote that are predictions, not measurements ("" when none): how
    many, by provenance (`moetune status` and the job_finished event show the message; a count alone read as
    measurements)."""
    c = collections.Counter(str(r.effective_provenance) for r in written if r.effective_provenance != "measured")
    if not c:
        return ""
    n = sum(c.values())
    kinds = next(iter(c)) if len(c) == 1 else ", ".join(f"{k} {p}" for p, k in sorted(c.items()))
    return f" ({'all' if n == len(written) else n} of them MODELLED ({kinds}), not measured)"


def _routed(job: Job) -> str:
    """What the job's message says of the keys it tuned under a routing other than uniform ("" when none): the
    tuner's default is uniform, so a count alone read as uniform profiles."""
    return "".join(f"; {n} key(s) re-tuned under routing {r} (as their profiles were tuned)"
                   for r, n in sorted(job.routings.items()))


def _outcomes(job: Job) -> str:
    """What the job's studies left besides what they wrote, for its message ("" when nothing)."""
    # a study is one profile key (a transport family of a job key): the counts are of those
    out = f"; {job.kept} profile key(s) kept their current profile ({_said(job.kept_why)})" if job.kept else ""
    return out + (f"; {len(job.no_result)} profile key(s) got no result ({_said(job.no_result)})"
                  if job.no_result else "")


def _nvml_pids() -> list[str]:
    """`index:pid` of every compute process on this node's GPUs, by NVML (ImportError without pynvml)."""
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            out += [f"GPU {i}: pid {p.pid}" for p in pynvml.nvmlDeviceGetComputeProcesses(handle)]
        return out
    finally:
        pynvml.nvmlShutdown()


def gpu_processes(*, timeout_s: float = 15.0) -> tuple[bool | None, str]:
    """Whether other processes run on this node's GPUs: NVML's compute processes (pynvml), else `nvidia-smi
    --query-compute-apps=pid`. (None, why) when neither can tell: no pynvml and no nvidia-smi, a failure, a time-out.
    A process nvidia-smi lists without a readable pid (a container's `[Not Found]`) counts as a process."""
    me = os.getpid()
    why_not_nvml = ""
    try:
        pids = [p for p in _nvml_pids() if not p.endswith(f"pid {me}")]
        return bool(pids), (", ".join(pids[:8]) + (" ..." if len(pids) > 8 else "")) if pids else "NVML: no compute process"
    except ImportError:
        why_not_nvml = "pynvml not installed"
    except Exception as e:  # broad: pynvml raises its own NVMLError kinds (no driver, not supported, ...)
        why_not_nvml = f"NVML failed: {e}"
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=timeout_s)
    except FileNotFoundError:
        return None, f"{why_not_nvml} and nvidia-smi not found"
    except subprocess.TimeoutExpired:
        return None, f"{why_not_nvml}; nvidia-smi --query-compute-apps timed out after {timeout_s:g} s"
    except OSError as e:
        return None, f"{why_not_nvml}; nvidia-smi could not run: {e}"
    if r.returncode != 0:
        return None, f"{why_not_nvml}; nvidia-smi --query-compute-apps exited {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}"
    seen = [line.strip() for line in r.stdout.splitlines() if line.strip() and line.strip() != str(me)]
    if not seen:
        return False, "nvidia-smi: no compute process"
    return True, "nvidia-smi: pid " + ", ".join(seen[:8]) + (" ..." if len(seen) > 8 else "")


class JobManager:
    """Bounded queue + one worker thread. Thread-safe; `info()` is cheap (read by the serving loop).

    A measuring re-tune (`[tune] backend = "local"` on a node with GPUs) first checks that no other process runs on
    the GPUs (`gpu_probe`, default `gpu_processes`): its benchmarks would disturb a production job and measure that
    job's noise. While they are busy, or their state cannot be told, the job waits queued (a `job_deferred` event says
    why) and is checked again every `tune.busy_retry_s`; the jobs behind it wait too (one job at a time).
    `[tune] run_on_busy_gpus = true` runs it anyway. Every job also waits queued (said the same way) while the daemon
    has no fabric facts (`_wait_for_facts`)."""

    def __init__(
        self,
        *,
        store: Any,
        facts_fn: Callable[[], Any],
        retune: RetuneFn,
        on_done: Callable[[Job, list[ProfileRecord]], None],
        tune: TuneSettings,
        on_start: Callable[[Job], None] | None = None,
        capacity: int = 4,
        metrics: Any = None,
        first_id: int = 1,
        gpu_probe: GpuProbe | None = None,
    ):
        self.store = store
        self.gpu_probe = gpu_probe or gpu_processes
        self.facts_fn = facts_fn
        self.retune = retune
        self.on_done = on_done
        self.on_start = on_start
        self.tune = tune
        self.capacity = capacity
        self.metrics = metrics
        # the worker's queue, under `_lock`: the live queued jobs in order (resumed jobs may go past `capacity`), then
        # the stop sentinel (None). A queued job `cancel` drops leaves it at once (it stayed in an unbounded queue.Queue
        # until the worker reached it: a running job under a submit + cancel loop had it grow without end)
        self._q: collections.deque[Job | None] = collections.deque()
        self._queued: dict[int, Job] = {}
        self._recent: collections.deque[Job] = collections.deque(maxlen=16)
        self.running: Job | None = None
        self._ids = itertools.count(first_id)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # notified when the worker has something in `_q`
        self._thread = threading.Thread(target=self._loop, name="moetune-jobs", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def _event(self, kind: EventKind, job: Job, reason: str) -> bool:
        """Record one of the job's events; False (logged) where the store refused it."""
        try:
            self.store.add_event(kind=kind, reason=reason, details=job.details())
            return True
        except Exception as e:  # the store is the daemon's; a failed event must not kill the worker
            log.error("cannot record %s for job %s: %s", kind, job.id, e)
            return False

    def submit(self, *, reason: str, old_fingerprint: str | None, keys: list[ProfileKey], all_current: bool = False,
               confirm: bool = False, skip_queued: bool = False, resumes: int | None = None) -> Job | None:
        """Queue a job; raises queue.Full when the queue is at capacity or the daemon is stopping. With
        `skip_queued` (the automatic re-tunes) keys a queued job already holds are left out (a queued job tunes
        for the facts current when it starts), and None is returned when none is left. `resumes`: the id of
        the last daemon's job this one takes over; such a job is queued past the capacity (a stopped daemon
        may leave one running and `capacity` queued: none may be lost).

        The job_queued event is written (in the caller's thread) BEFORE the worker can see the job, so the events
        of one job are always in order (queued < started < finished) for recover_jobs(). With `confirm` (a user's
        `retune`, answered only after this returns) a job_queued the store refused raises JobNotRecorded and the job
        is not queued: a reply never names a job the store does not hold (its id could be handed out again)."""
        with self._lock:
            if self._stopping:
                raise queue.Full("the daemon is stopping")
            if skip_queued:
                held = {tuning_key(k) for j in self._queued.values() if not j.cancel.is_set() for k in j.keys}
                keys = [k for k in keys if tuning_key(k) not in held]
                if not keys:
                    return None
            if len(self._queued) >= self.capacity and resumes is None:
                raise queue.Full(f"{self.capacity} jobs queued")
            job = Job(next(self._ids), reason=reason, old_fingerprint=old_fingerprint, keys=keys, all_current=all_current,
                      resumes=resumes)
            self._queued[job.id] = job  # reserves its place: at most `capacity` jobs queued or being persisted
        self._persist_and_enqueue(job, confirm=confirm)
        log.info("queued re-tune job %d (%d keys): %s", job.id, len(keys), reason)
        return job

    def _persist_and_enqueue(self, job: Job, *, confirm: bool = False) -> None:
        ok = self._event("job_queued", job, job.reason)
        with self._lock:
            job.queued_recorded, job.persisted = ok, True
            dropped = job.dropped
            if confirm and not ok:
                self._queued.pop(job.id, None)  # never run: nobody was told it is queued
            elif not dropped:  # under the lock: a `cancel` from now on finds it in `_q` and takes it out
                self._q.append(job)
                self._ready.notify()
        if confirm and not ok:
            if dropped:
                job.end_recorded.set()  # nothing of it is in the store: there is no end to write
            raise JobNotRecorded(f"job {job.id} could not be recorded in the database (see the daemon's log); "
                                 "it was not queued")
        if dropped:  # cancelled before its job_queued was written: its end is written after it, in order
            self._finish_dropped(job)

    def _finish_dropped(self, job: Job) -> None:
        """The job_finished event of a queued job `cancel` dropped (the worker skips it): after its job_queued, so a
        restarted daemon's recover_jobs sees it finished and never queues it again."""
        job.end_ok = self._event("job_finished", job, job.message)
        job.end_recorded.set()
        if self.metrics:
            self.metrics.job_finished("cancelled")

    def cancel(self, job_id: int, *, wait_s: float = 30.0) -> Job | None:
        """Cancel a queued or running job; returns once its cancel is committed (job_finished of a queued job,
        job_cancelled of a running one). Raises JobNotRecorded (the job is cancelled in this daemon all the same)
        when the store refused that event, or a queued job's job_queued is still being written after `wait_s`."""
        with self._lock:
            job = self._queued.pop(job_id, None)
            write = asked = False
            if job is not None:  # dropped at once: its queue slot is free now, not when the worker reaches it
                job.state, job.finished, job.message = "cancelled", now(), "cancelled while queued"
                job.dropped = True
                with contextlib.suppress(ValueError):  # not there: the worker holds it (waiting), or not enqueued yet
                    self._q.remove(job)
                self._recent.append(job)
                write = job.persisted  # else _persist_and_enqueue writes its end after its job_queued
            elif self.running is not None and self.running.id == job_id and self.running.state == "running":
                # its state read here, under the lock the worker ends it "done" under: a job that has ended (still
                # `running` until the worker lists it recent) is not answered "cancelling"
                job = self.running
                # recorded now: a daemon stopped before the job ends must not resume what the user cancelled
                asked = not job.cancel.is_set()
            if job is None:
                return None
            job.cancelled_by = job.cancelled_by or "user"
            job.cancel.set()
        ok = True
        if asked:
            ok = self._event("job_cancelled", job, f"job {job.id} cancelled while it ran")
        elif job.dropped:
            if write:  # its job_queued is in the store: its end goes after it
                self._finish_dropped(job)
            # else the thread writing its job_queued (an automatic job's) writes its end right after it
            ok = job.end_recorded.wait(wait_s) and job.end_ok
        if not ok:
            raise JobNotRecorded(f"job {job.id} is cancelled in this daemon, but its cancel could not be recorded in "
                                 "the database (see the daemon's log): a restart may resume it")
        return job

    def cancel_fingerprint(self, fingerprint: str) -> Job | None:
        """Cancel the running job if it tunes for `fingerprint` (the fabric moved on: its work is outdated;
        its end queues its keys again)."""
        with self._lock:
            job = self.running
            if job is None or job.fingerprint != fingerprint:
                return None
            job.cancelled_by = job.cancelled_by or "fabric"
            job.cancel.set()
            return job

    def info(self) -> tuple[list[JobInfo], JobInfo | None, list[JobInfo]]:
        with self._lock:
            queued = [j.info() for j in self._queued.values()]
            running = self.running.info() if self.running else None
            recent = [j.info() for j in self._recent]
        return queued, running, recent

    def queued_count(self) -> int:
        return len(self._queued)

    def _busy(self) -> str:
        """Why a measuring re-tune must not run now ('' when it may): other processes on the GPUs, or no way to tell."""
        if self.tune.backend != "local":
            return ""  # a model re-tune predicts: it runs nothing on the GPUs
        try:
            facts = self.facts_fn()
        except Exception:  # broad: the daemon's facts callback; the job itself reports a discovery failure
            facts = None
        if facts is None or not getattr(facts, "gpu_count", 0):
            return ""  # no GPU here: the re-tune runs gloo ranks on the CPUs
        try:
            busy, seen = self.gpu_probe()
        except Exception as e:  # broad: a probe that fails cannot tell
            busy, seen = None, f"the GPU probe failed: {type(e).__name__}: {e}"
        if busy is False:
            return ""
        if busy:
            why = (f"other processes run on this node's GPUs ({seen}): a measuring re-tune would disturb them and "
                   "measure their noise")
        else:
            why = (f"cannot tell whether this node's GPUs are idle ({seen}), so a measuring re-tune does not risk "
                   "disturbing a job on them")
        if self.tune.run_on_busy_gpus:
            log.warning("re-tune runs anyway ([tune] run_on_busy_gpus = true): %s", why)
            return ""
        return (f"deferred: {why}; checked again every {self.tune.busy_retry_s:g} s "
                "([tune] run_on_busy_gpus = true runs it anyway)")

    def _wait_for_idle_gpus(self, job: Job) -> None:
        """Hold `job` queued while the GPUs are busy (or their state unknown); returns when it may run or is cancelled."""
        while not job.cancel.is_set():
            why = self._busy()
            if not why:
                if job.deferred:  # its "deferred: ..." message is over too (status showed it while it ran)
                    job.deferred = job.message = ""
                return
            if why != job.deferred:  # said once per reason, not every retry
                job.deferred = job.message = why
                log.warning("re-tune job %d %s", job.id, why)
                self._event("job_deferred", job, why)
            job.cancel.wait(self.tune.busy_retry_s)  # a cancel or the daemon's stop wakes it

    def _facts_or_none(self) -> Any:
        try:
            return self.facts_fn()
        except Exception:  # broad: the daemon's facts callback; as no facts yet
            return None

    def _wait_for_facts(self, job: Job) -> None:
        """Hold `job` queued while the daemon has no fabric facts (its start-up discovery failed, or was incomplete and
        differed from the known fabric): returns once a discovery round gave facts, or when it is cancelled. Run now, it
        would fail "no fabric facts" and be recorded finished, and a job resumed from the last daemon would be lost for
        good (no later start re-queues its keys)."""
        while not job.cancel.is_set():
            if self._facts_or_none() is not None:
                if job.deferred:
                    job.deferred = job.message = ""
                return
            if not job.deferred:  # said once (in status and an event), then checked again until facts come
                job.deferred = job.message = ("deferred: no fabric facts yet (the last discovery failed or was "
                                              "incomplete, see status); runs once a discovery round reads the fabric")
                log.warning("re-tune job %d %s", job.id, job.deferred)
                self._event("job_deferred", job, job.deferred)
            job.cancel.wait(FACTS_RECHECK_S)  # reading the facts is cheap; a cancel or the daemon's stop wakes it

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._q:
                    self._ready.wait()
                job = self._q.popleft()
            if job is None:
                return
            if not job.cancel.is_set():
                self._wait_for_facts(job)  # still listed as queued meanwhile
            if not job.cancel.is_set():
                self._wait_for_idle_gpus(job)
            with self._lock:
                self._queued.pop(job.id, None)
                if job.cancel.is_set():
                    if not job.dropped:  # else `cancel` finished it already (listed, recorded)
                        job.state, job.finished, job.message = "cancelled", now(), "cancelled while queued"
                        self._recent.append(job)
                    cancelled_early = True
                else:
                    self.running = job
                    job.state = "running"
                    cancelled_early = False
            if cancelled_early:
                if job.cancelled_by == "shutdown" or job.dropped:
                    continue  # shutdown: not finished in the store, the next daemon re-queues it; or `cancel` did
                self._event("job_finished", job, job.message)
                if self.metrics:
                    self.metrics.job_finished("cancelled")
                continue
            self._run(job)

    def _current(self, fingerprint: str | None) -> list[tuple[int, ProfileRecord]] | None:
        """(row id, record) of the fingerprint's current profiles: a re-measurement of the same knobs is a new row
        (a new id) with the same profile hash."""
        if fingerprint is None:
            return []
        try:
            return self.store.list_profiles(status="current", fingerprint=fingerprint)
        except Exception as e:  # broad: in the worker thread; only the partial-write accounting is lost
            log.error("cannot read the current profiles of %s: %s", fingerprint, e)
            return None

    def _run(self, job: Job) -> None:
        job.backend = self.tune.backend
        if self.on_start is not None:
            try:
                self.on_start(job)
            except Exception:  # broad: the server's callback runs in the worker thread, which must survive it
                log.exception("before job %d", job.id)
        written: list[ProfileRecord] = []
        before: set[int] | None = None  # the current profiles (row ids) of the job's fingerprint when it started
        t0 = time.monotonic()
        damaged = False  # the store's file is damaged: nothing more of this job is written to it
        try:
            # the daemon's store was scanned when it opened, maybe weeks ago: scanned anew before this job writes or
            # measures (a damaged file found only by the profile write lost the minutes measured)
            self.store.refuse_damaged(again=True)
            facts = self.facts_fn()
            if facts is None:
                raise RuntimeError("no fabric facts (discovery failed)")
            job.fingerprint = facts.fingerprint
            job.software = getattr(facts, "software_hash", None)
            now_current = self._current(job.fingerprint)  # tells what a cancelled job wrote (None: unknown)
            before = None if now_current is None else {i for i, _ in now_current}
            job.run_id = self.store.start_run(study_name=f"moetune-daemon-job-{job.id}", storage=str(self.store.url),
                                              backend=self.tune.backend)
            self._event("job_started", job, f"started job {job.id}: {job.reason}")
            job.started_recorded = True  # from here on a restart finds this job `started` (run_id shown)
            written = list(self.retune(JobContext(store=self.store, facts=facts, job=job, tune=self.tune)) or [])
            # a re-tune that does not check the flag ran to its end: a user's or the watch's cancel still ends the job
            # cancelled; the daemon's own stop does not (the work is done: nothing is left to resume)
            with self._lock:  # with cancel's check: a job cancel answered "cancelling" never ends done
                cancelled = job.cancel.is_set() and job.cancelled_by != "shutdown"
                if not cancelled:
                    job.state = "done"
            if cancelled:
                raise JobCancelled(f"job {job.id} cancelled")
            job.written = len(written)
            job.message = f"{len(written)} profile(s) written{_modelled(written)} in {time.monotonic() - t0:.1f} s"
            job.message += _routed(job) + _outcomes(job)
            if job.refused:
                job.message += "; " + "; ".join(job.refused)
        except JobCancelled as e:
            job.state, job.message = "cancelled", str(e)
        except StoreDamaged as e:  # the scan's, or a read or write's on a damaged page: said plainly, no traceback
            log.error("re-tune job %d failed: %s", job.id, e)
            job.state, job.message, damaged = "failed", str(e), True
        except RetuneImpossible as e:  # said plainly, no traceback: the daemon keeps serving what is valid
            log.warning("re-tune job %d cannot run: %s", job.id, e)
            job.state, job.message, job.impossible = "failed", str(e), True
        except Exception as e:  # broad: the worker thread's boundary; the job fails, the daemon serves on
            log.exception("re-tune job %d failed", job.id)
            job.state, job.message = "failed", f"{type(e).__name__}: {e}"
        if job.state != "done" and before is not None:
            # a cancelled or failed job keeps what it stored: count it and publish it like a finished job's
            written = [r for i, r in self._current(job.fingerprint) or [] if i not in before]
            job.written = len(written)
            if written:
                job.message += f" ({len(written)} profile(s) written{_modelled(written)} before it stopped)"
            job.message += _routed(job) + _outcomes(job)
        moved = "" if damaged else self._fabric_moved_on(job)  # its mark_stale is a write
        if moved:
            written = []  # nothing of the old fingerprint stays current: nothing to publish
        interrupted = job.state == "cancelled" and job.cancelled_by == "shutdown"
        if interrupted:
            job.state, job.message = "failed", "daemon stopped during the job"
        job.finished = now()
        if job.run_id is not None and not damaged:
            try:
                best = min((r.latency_us for r in written), default=None)
                self.store.finish_run(job.run_id, status=job.state, trials=len(written), best_value=best)
            except Exception as e:  # broad: in the worker thread; a run row left open must not stop the queue
                log.error("cannot finish run %s: %s", job.run_id, e)
        # an interrupted job stays `started` in the store: the next daemon resumes it; a job stopped by a damaged file
        # is not recorded in it (said in the log and `status`): the next daemon refuses the file until it is restored
        if not interrupted and not damaged:
            self._event("job_finished", job, job.message)
        if self.metrics:
            self.metrics.job_finished(job.state)
        if moved and job.cancelled_by not in ("user", "shutdown"):
            self._requeue(job, moved)
        try:
            self.on_done(job, written)
        except Exception:  # broad: the server's callback runs in the worker thread, which must survive it
            log.exception("after job %d", job.id)
        with self._lock:
            self.running = None
            self._recent.append(job)
        log.info("job %d %s: %s", job.id, job.state, job.message)

    def _fabric_moved_on(self, job: Job) -> str:
        """The node's fingerprint when it is no longer the one `job` tuned for ('' otherwise). Its profiles
        of the old fingerprint are made stale: the watch's mark_stale may have run before the job wrote."""
        if job.fingerprint is None:
            return ""
        try:
            facts = self.facts_fn()
        except Exception:  # broad: the daemon's facts callback; treat as unchanged
            return ""
        if facts is None or facts.fingerprint == job.fingerprint:
            return ""
        try:
            n = self.store.mark_stale(fingerprint=job.fingerprint,
                                      reason=f"job {job.id} tuned for {job.fingerprint}; the fabric is now {facts.fingerprint}")
        except Exception as e:  # broad: in the worker thread
            log.error("cannot mark the profiles of %s stale: %s", job.fingerprint, e)
            n = 0
        job.message += f"; the fabric changed to {facts.fingerprint} during the job ({n} profile(s) made stale)"
        return str(facts.fingerprint)

    def _requeue(self, job: Job, fingerprint: str) -> None:
        try:
            self.submit(reason=f"job {job.id} re-queued: the fabric changed to {fingerprint} during it"[:512],
                        old_fingerprint=job.fingerprint, keys=job.keys, all_current=job.all_current, skip_queued=True)
        except queue.Full as e:
            log.error("job %d not re-queued after the fabric changed: %s", job.id, e)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the queue and the running job (left queued / started in the store, for the next daemon to
        resume); wait a bounded time."""
        with self._lock:
            self._stopping = True
            for j in [*self._queued.values(), *([self.running] if self.running is not None else [])]:
                j.cancelled_by = j.cancelled_by or "shutdown"
                j.cancel.set()
            self._q.append(None)  # wakes the worker after the queued (cancelled) jobs
            self._ready.notify()
        self._thread.join(timeout)
        with self._lock:
            job = self.running
        if job is not None and self._thread.is_alive():
            # the re-tune did not return in time (the process is exiting): its run is failed now; the job
            # stays started in the store (no job_finished) so the next daemon resumes it
            job.state, job.finished, job.message = "failed", now(), "daemon stopped during the job"
            if job.run_id is not None:
                try:
                    self.store.finish_run(job.run_id, status="failed", trials=0, best_value=None)
                except Exception as e:  # broad: best effort while the daemon exits
                    log.error("cannot finish run %s: %s", job.run_id, e)


@dataclass(frozen=True)
class Resumable:
    """A job the last daemon left queued or running. `details`: what to queue again (its keys those still to tune);
    `why`/`finish_details`: the job_finished event that closes the old job (its reason `why` and how it ended),
    written only after its resumption is queued (`Daemon._resume`), so a crash in between loses no job: the next
    start finds the resumption (its `resumes`) and closes the old job then."""

    job_id: int
    details: dict[str, Any]
    why: str
    finish_details: dict[str, Any]


def recover_jobs(store: Any) -> tuple[list[Resumable], int]:
    """After a restart: the jobs the last daemon left queued or running, to resume (their runs marked failed), and
    the next free job id. The open jobs (job events, none of them job_finished) are found by job id, however many
    events came after theirs: a window of the newest 2000 job events lost a job that ran while a loop of submits and
    cancels wrote more. A job whose resumption was queued already (a crash before its job_finished) is closed here,
    not resumed again."""
    # the open jobs' events, and those of the jobs that took one over (finished or not), oldest first
    ids, events, max_id = store.open_jobs(kinds=JOB_EVENTS, finished="job_finished", also="resumes")
    open_ids = set(ids)
    last: dict[int, tuple[str, dict[str, Any]]] = {}
    started_at: dict[int, str] = {}  # job id -> when its (last) job_started event was written
    resumed_as: dict[int, int] = {}  # old job id -> the job that took it over
    cancelled: set[int] = set()  # a user cancelled it while it ran
    for e in events:
        kind = e["kind"]
        d = e["details"] if isinstance(e["details"], dict) else {}
        jid = d.get("job_id")
        if not isinstance(jid, int):
            continue
        if isinstance(d.get("resumes"), int):  # any of its events: its job_queued may be the one not written
            resumed_as[d["resumes"]] = jid
        if jid not in open_ids:
            continue  # a job that ended, read for the job it took over only
        if kind == "job_cancelled":
            cancelled.add(jid)
        last[jid] = (kind, d)
        if kind == "job_started":
            started_at[jid] = str(e["created"])
    resume: list[Resumable] = []
    for jid, (kind, d) in sorted(last.items()):
        # the user cancelled it while it ran, and the daemon stopped before it ended (its job_started may come after
        # the cancel: both are written as they happen, from two threads)
        if jid in cancelled:
            _close_run(store, d, "cancelled")
            close_job(store, jid, reason=f"job {jid} cancelled; the daemon stopped before it ended",
                       details={**d, "state": "cancelled", "message": "cancelled (the daemon stopped before the "
                                "job ended; not resumed)"})
            continue
        keys = [k for k in d.get("keys") or [] if isinstance(k, dict)]
        if kind == "job_started":
            _close_run(store, d, "failed")
            # the keys it finished before it stopped are not tuned again (kill -9 after the last profile)
            done = _written_since(store, d, started_at.get(jid, ""))
            left = [k for k in keys if _done_mark(k) not in done]
            msg = "interrupted: the daemon stopped during the job"
            if len(left) < len(keys):
                msg += f" ({len(keys) - len(left)} of {len(keys)} key(s) already tuned, not re-tuned)"
            closed = {**d, "state": "failed", "message": msg}
            why = f"job {jid} interrupted (daemon restarted)"
        else:  # queued, never started
            left = keys
            closed = {**d, "state": "cancelled", "message": "the daemon restarted before the job ran; re-queued"}
            why = f"job {jid} re-queued after a restart"
        if jid in resumed_as or not left:
            how = f"resumed as job {resumed_as[jid]}" if jid in resumed_as else "nothing left to resume"
            close_job(store, jid, reason=f"{why}; {how}", details=closed)
            continue
        resume.append(Resumable(jid, {**d, "keys": left}, why, closed))
    # runs left `running` without a job event (e.g. killed between start_run and the event)
    for r in store.list_runs(limit=200):
        if r["status"] == "running" and str(r["study_name"]).startswith("moetune-daemon-job-"):
            try:
                store.finish_run(r["id"], status="failed", trials=0, best_value=None)
            except StoreError as e:
                log.error("cannot mark run %s failed: %s", r["id"], e)
    # and the rows of the studies a killed job ran (`tune_profiles`' own runs, named after their study), and of any
    # other run whose process is gone: `interrupted`, as `moetune tune` and `profile` close them at their start. Those
    # refuse to run beside a daemon, so nothing else closed them while it served: `running` for good
    try:
        store.close_orphaned_runs()
    except StoreError as e:
        log.error("cannot mark the runs of stopped processes interrupted: %s", e)
    return resume, max_id + 1


def close_job(store: Any, jid: int, *, reason: str, details: dict[str, Any]) -> bool:
    """Write the job_finished that closes job `jid` of the last daemon; a write that fails for now (a full disk: StoreFull;
    the lock held past the busy timeout: StoreBusy) is logged, not raised: the job stays open in the store and the next
    start closes it (or resumes it) then. Raised, it ended the daemon's start: exit 1, restarted by its service to
    fail the same way. Any other store error (a file this user may not write, a damaged one) is raised: refused."""
    try:
        store.add_event(kind="job_finished", reason=reason, details=details)
        return True
    except (StoreFull, StoreBusy) as e:
        log.error("cannot close job %s of the last daemon (%s): %s; the next start does", jid, reason, e)
        return False


def _close_run(store: Any, d: dict[str, Any], status: str) -> None:
    """End the tuning run a job event names (`run_id`), as `status`; a store error is logged, never raised."""
    run_id = d.get("run_id")
    if isinstance(run_id, int):
        try:
            store.finish_run(run_id, status=status, trials=0, best_value=None)
        except StoreError as e:
            log.error("cannot mark run %s %s: %s", run_id, status, e)


def _done_mark(k: dict[str, Any] | ProfileKey) -> tuple | None:
    """(what is tuned, transport family) of a key: a key counts as done only when its own family got a profile
    (a job killed between two families of one shape and bucket left the other one to do)."""
    try:
        key = k if isinstance(k, ProfileKey) else ProfileKey(**k)
    except (TypeError, ValueError):
        return None
    return (*tuning_key(key), key.transport_family)


def _written_since(store: Any, d: dict[str, Any], since: str) -> set[tuple]:
    """_done_mark of the current profiles of the interrupted job's fingerprint and software written after
    `since` (its job_started event): what it finished before it stopped. Empty when unsure (an event of an
    older moetune without the software, an unreadable time, a store error): then every key is re-tuned."""
    fp, sw = d.get("fingerprint"), d.get("software")
    if not isinstance(fp, str) or not isinstance(sw, str) or not since:
        return set()
    try:
        t0 = datetime.fromisoformat(since)
        profiles = store.list_profiles(status="current", fingerprint=fp)
    except Exception as e:  # broad: only a saving is lost; the job is resumed whole, as before
        log.error("cannot tell which keys job %s finished: %s", d.get("job_id"), e)
        return set()
    out: set[tuple] = set()
    for _, r in profiles:
        if r.key.software != sw:
            continue
        try:
            newer = datetime.fromisoformat(r.created) > t0
        except (TypeError, ValueError):
            continue
        if newer:
            out.add(_done_mark(r.key))
    return out


def tune_notice_of(store: Any, *, backend: str | None = None, page: int = 500) -> str:
    """Why the automatic re-tune cannot run here, as the last daemon's jobs left it ('' once one ran, or started: its
    end says anew): a restart must not forget it while the profiles it left stale stay stale. A notice left under
    another [tune] `backend` than this daemon's is dropped: it told how to change settings no longer in force. Read
    back page by page to the first event that decides: cancelled jobs' ends after the notice (thousands of queued
    re-tunes cancelled) do not push it out of a window."""
    before = None
    while True:
        events = store.list_events(limit=page, kinds=("job_started", "job_finished"), before_id=before)  # newest first
        for e in events:
            d = e["details"] or {}
            if not isinstance(d, dict):
                continue
            if e["kind"] == "job_started" or d.get("state") == "done":
                return ""
            if d.get("impossible"):
                ran_under = d.get("backend")  # None: written by an older moetune, which did not record it
                if backend is not None and isinstance(ran_under, str) and ran_under != backend:
                    return ""
                return str(d.get("message") or "")
        if len(events) < page:
            return ""
        before = events[-1]["id"]


def tuning_key(k: ProfileKey) -> tuple:
    """What a re-tune of `k` tunes (its fingerprint and software are the node's at the time): an EP key's group,
    shape and bucket (its re-tune tunes the node's transport families), and for an engine family (the megakernel,
    its own tune at EP 1) that family too, so a transport profile at EP 1 never stands for a megakernel key."""
    engine = k.transport_family if k.transport_family in ENGINE_FAMILIES else ""
    return (k.ep_size, k.nodes, k.hidden, k.intermediate, k.experts, k.topk, k.dtype, k.token_bucket, engine)


def keys_from_details(d: dict[str, Any]) -> list[ProfileKey]:
    out = []
    for k in d.get("keys") or []:
        try:
            out.append(ProfileKey(**k))
        except (TypeError, ValueError):
            continue
    return out
