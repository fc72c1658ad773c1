"""The Optuna study of one tuning key: its name, sampler, seeding, warm start, resume, run and summary.

- Sampler: TPE, multivariate with `group=True` (it decomposes the conditional space), seeded per trial (the seed
  and the trial's number: the workers of a shared study, all of one --seed, draw apart).
- Warm start: `enqueue_trial` of the policy default and the analytic priors (per-PE groups; SM and QP
  counts from link bandwidth), then the best settings of the previous token bucket of the same shape. Each point
  is enqueued once per study, by whichever process claims it first (`_claim_warm_point`: SQLite and server alike);
  a claim whose process died before it enqueued the point is taken over by the next run (`_claimed_by_the_dead`).
- Storage: Optuna's own RDB storage. SQLite by default (its own file next to the store, WAL; the store's own file
  is accepted too: the store shares a file with Optuna's tables, never another program's; a SQLite file moetune did
  not create keeps its journal mode, WAL or not: `make_storage`) — processes of one host may share a study (the daemon's re-tune and a `moetune tune`): every
  process registers itself in the study before it asks for a trial (and leaves when done), a trial records
  its worker as Optuna creates it (the sampler's `before_trial`), and opening a study fails only the
  running trials no live process can own (`fail_interrupted`); the schema is created under a file lock
  beside the file (two first runs at once). `--storage postgresql://...` lets several nodes share a study
  (heartbeats fail the trials of a worker that died; a trial beats from its creation on, and opening a study
  gives a running trial without a heartbeat one: `beat_unbeaten`). `tune show` opens a storage read-only
  (`open_readonly_storage`). Same study name → the study resumes; the
  name carries a digest of the routing, policy and backend settings (`study_config`), so a rerun that
  measures something else opens its own study.
- Trial budget: finished trials (complete, pruned, failed) of the study count, so a rerun after a
  crash only runs what is missing and several workers on one study stop together. A trial cut short
  (Ctrl-C, a killed process, a worker whose heartbeat stopped) is FAIL and marked `interrupted` (a FAIL with
  no `error` is one too: `is_interrupted`): it is not a finished trial, and a warm-start point it carried is enqueued again (the policy default is
  measured even when its first run was the one interrupted; a process killed between failing such a trial and
  enqueuing its point left it enqueued nowhere: the next open does it, `requeue_lost_points`). No trial this process
  made RUNNING is left so by an interrupt or an error, wherever it lands (inside Optuna's `ask()` or `tell()` too:
  `fail_in_flight`). A live worker whose running trial another worker failed as stale (its heartbeat came late)
  drops that result and goes on (`_taken_over`): it no longer ends its tune on "Cannot tell a FAIL trial.".
- A failed or hung run is a FAIL trial with its error in user attrs; a setting the backend calls unsafe
  is PRUNED with `infeasible` set; neither stops the study.
- Across token buckets: `neighbour_bucket` finds the nearest smaller bucket's study of the same key in
  the storage; its best settings warm-start the next bucket and, with the local backend, a setting it
  measured ≥ 1.5× slower than its best is pruned without being run (warm-start points are always measured).
- Pruning within a trial: with the local backend and several repeats per trial, a MedianPruner stops a
  trial whose first repeats are already worse than the median. Both pay only where a measurement is
  expensive (a process launch); the model backend evaluates every sampled point (about a millisecond).

Beside it: `storage.py` (the storage and its refusals), `workers.py` (the processes sharing a study), `trials.py`
(what a trial counts as) and `readback.py` (`tune show`). `tune.py` drives these studies over families, shapes
and buckets and writes the profiles.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import TOKEN_BUCKETS, ProfileKey
from moetune.runtime.shapes import MODELS, ModelShape
from moetune.tuner.search.backends import (
    BenchmarkBackend,
    Measurement,
    TuneWorkload,
)
from moetune.tuner.search.interrupt_guard import uninterrupted
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.storage import (
    claim_study_attr,
    is_sqlite,
    make_storage,
    rdb_backend,
    storage_id,
    take_over_study_attr,
    trials_in_flight,
)
from moetune.tuner.search.trials import (
    FINISHED,
    INTERRUPTED,
    completed,
    failed_before,
    finished_trials,
    first_error,
    interrupted_ids,
    is_interrupted,
    requeue_warm_start,
)
from moetune.tuner.search.workers import (
    ASKED,
    REGISTRIES,
    current_worker,
    cut_short_by,
    fail_in_flight,
    fail_interrupted,
    register_worker,
    unregister_worker,
    worker_gone,
)

log = logging.getLogger("moetune.tuner.search.study")

STUDY_PREFIX = "moetune/"


def study_name(key: ProfileKey, backend_label: str, model_name: str, config: str = "") -> str:
    """Deterministic: the same key, backend and `config` (`study_config`) always open the same study
    (resume after a crash); other measurement settings open another."""
    return (f"{STUDY_PREFIX}{key.transport_family}/{model_name}/S{key.token_bucket}/ep{key.ep_size}n{key.nodes}/"
            f"{backend_label}/{_short(key.fingerprint, 12)}-{_short(key.software, 8)}" + (f"-{config}" if config else ""))


def study_model_name(model: ModelShape) -> str:
    """The model's name in a study name: one per shape, however the shape was spelt. A known model's shape is its name
    (`custom:2048,768,128,8` is qwen3-30b), another custom shape `custom:H,I,E,K` with `,DTYPE` unless bfloat16 (what
    `custom:H,I,E,K` and `custom:H,I,E,K,bfloat16` both are: the daemon's re-tune spells the dtype out), whatever the
    shape is named: a program's own ModelShape too (its name kept, two programs' shapes of one name and other
    dimensions shared one study, each resuming the other's trials measured on another shape). Two spellings of one
    shape were two studies of one key: a rerun started over, and the neighbouring bucket's study was not found."""
    shape = (model.hidden, model.intermediate, model.experts, model.topk, model.dtype)
    known = next((m.name for m in MODELS.values() if (m.hidden, m.intermediate, m.experts, m.topk, m.dtype) == shape),
                 None)
    if known is not None:
        return known
    return f"custom:{model.hidden},{model.intermediate},{model.experts},{model.topk}" + (
        "" if model.dtype == "bfloat16" else f",{model.dtype}")


def study_config(space: SearchSpace, backend: BenchmarkBackend, workload: TuneWorkload) -> str:
    """A short digest of what decides a trial's number besides the key and the backend's label: the routing,
    the policy (the space searched) and the backend's settings (the metric of a local run, a model's preset).
    A rerun with other settings must not resume a study whose trials measured something else."""
    policy = {k: v for k, v in space.policy.to_dict().items() if k not in ("description", "sources")}
    config: dict[str, Any] = {"routing": workload.routing, "policy": policy, "backend": backend.settings()}
    grid = space.grid_rule()  # proxy/ibgda PUT grid bounded by the bucket's token count: another digest
    if grid:  # (absent otherwise: the digests of other spaces stay as they were)
        config["space"] = grid
    blob = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def _short(h: str, n: int) -> str:
    """A hex hash's first n digits; anything else (e.g. `preset:NAME:DIGEST`) is hashed first."""
    if all(c in "0123456789abcdef" for c in h.lower()) and len(h) >= n:
        return h[:n]
    return hashlib.sha256(h.encode()).hexdigest()[:n]


class _Sampler(optuna.samplers.TPESampler):
    """TPE that records whose trial it is as soon as Optuna has created it: `before_trial` runs in
    `Trial.__init__` (from `ask`), before any parameter is sampled, and writes the trial's `worker` attr through
    the storage. A RUNNING trial without one is then a trial whose creator died between Optuna's create and this
    hook (or this process's own within that instant: noted in `ASKED`).

    With a seed, each trial draws from generators seeded by the seed and the trial's number (`_trial_seed`), not
    from one stream per process: every worker of a shared study runs with the same --seed (0 by default), and
    their samplers drew the same points, trial after trial (the random startup trials all of them). Trial numbers
    are the study's, one per trial, so workers draw apart; a run alone with one seed samples the same points."""

    def __init__(self, *, seed: int | None = None, **kwargs: Any):
        super().__init__(seed=seed, **kwargs)
        self._seed = seed

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        ASKED.add((storage_id(study._storage), trial._trial_id))
        if "worker" not in trial.user_attrs:
            study._storage.set_trial_user_attr(trial._trial_id, "worker", current_worker())
        if self._seed is not None:  # before any parameter is sampled (relative ones are sampled on the first suggest)
            _reseed(self, _trial_seed(self._seed, trial.number, "tpe"))
            _reseed(getattr(self, "_random_sampler", None), _trial_seed(self._seed, trial.number, "random"))
        super().before_trial(study, trial)


_RESEED_WARNED: list[bool] = []  # the fallback below is said once per process


def _reseed(sampler: Any, seed: int) -> None:
    """Seed `sampler`'s generator (Optuna's private `_rng.rng`, a numpy RandomState: in every release from 4.0,
    which pyproject allows, to 5.1). Where a release keeps it otherwise, the sampler draws from its one stream per
    process, as before the per-trial seed, and this is said once: an AttributeError here ended every seeded tune."""
    rng = getattr(getattr(sampler, "_rng", None), "rng", None)
    if callable(getattr(rng, "seed", None)):
        rng.seed(seed)
        return
    if not _RESEED_WARNED:
        _RESEED_WARNED.append(True)
        log.warning("this Optuna (%s) keeps its sampler's generator otherwise: no draws per trial, so workers of one "
                    "shared study with one --seed may sample the same points (give each node its own --seed)",
                    optuna.__version__)


def _trial_seed(seed: int, number: int, stream: str) -> int:
    """A 32-bit seed (numpy's range) for trial `number`'s draws of `stream` under the study's `seed`."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{number}:{stream}".encode()).digest()[:4], "little")


def make_sampler(seed: int | None, n_startup_trials: int = 10) -> optuna.samplers.TPESampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _Sampler(multivariate=True, group=True, seed=seed, n_startup_trials=n_startup_trials)


def open_study(name: str, storage: str | optuna.storages.BaseStorage, *, seed: int | None = None,
               n_startup_trials: int = 10, pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    """Create or load the study. On SQLite this process registers itself in it and fails the running trials of
    processes that are gone (`fail_interrupted`), before it asks for any trial. With heartbeats (a server storage) a
    running trial without a heartbeat is given one (`beat_unbeaten`) and the stale ones are failed. A trial failed
    before its objective tagged it has its warm-start point enqueued again (`record_untagged`)."""
    st = make_storage(storage) if isinstance(storage, str) else storage
    study = optuna.create_study(study_name=name, storage=st, direction="minimize", load_if_exists=True,
                                sampler=make_sampler(seed, n_startup_trials), pruner=pruner or optuna.pruners.NopPruner())
    url = storage if isinstance(storage, str) else getattr(storage, "url", "")
    if isinstance(url, str) and is_sqlite(url):
        fail_interrupted(study)
    elif beat_unbeaten(study) is not None:  # heartbeats on (a server storage)
        with warnings.catch_warnings():  # "experimental": a note for Optuna users, not ours
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)  # before the budget is counted (Optuna's loop does it per trial)
    record_untagged(study)
    requeue_lost_points(study)
    return study


def beat_unbeaten(study: optuna.Study) -> int | None:
    """On a storage with heartbeats (a server one): give each RUNNING trial of the study that has no heartbeat one,
    dated now by the database's clock, so it is failed as stale (`_stale_trial`) a grace period later unless its
    worker beats. Optuna never finds a trial without a heartbeat stale: a worker killed after creating a trial and
    before its first beat (this version beats at creation, `GuardedRDBStorage`; an older one after `ask()`, its
    sampling included) left it RUNNING for good. A live worker's trial is not failed: its own beats (every
    `heartbeat_interval`, 10 s) update the row, well within the grace period (60 s). Several hosts share such a
    storage, so no pid is checked here (another host's cannot be). Returns how many it gave one; None where
    heartbeats are off (nothing done)."""
    import sqlalchemy
    from optuna.storages._rdb import models

    backend = rdb_backend(study)
    if backend is None or backend.heartbeat_interval is None:
        return None
    trials, beats = models.TrialModel.__table__, models.TrialHeartbeatModel.__table__
    unbeaten = sqlalchemy.select(trials.c.trial_id, sqlalchemy.func.now()).where(
        trials.c.study_id == study._study_id, trials.c.state == TrialState.RUNNING,
        ~sqlalchemy.exists().where(beats.c.trial_id == trials.c.trial_id))
    try:
        with uninterrupted(), backend.engine.begin() as conn:  # a storage call as Optuna's are (`GuardedRDBStorage`)
            return conn.execute(beats.insert().from_select(["trial_id", "heartbeat"], unbeaten)).rowcount or 0
    except sqlalchemy.exc.IntegrityError:  # a worker (or another opening) gave one of them a heartbeat meanwhile
        return 0


def record_untagged(study: optuna.Study) -> int:
    """Record in the study (`interrupted:<id>`, as a stale trial is) each FAIL trial cut short before its objective
    tagged it (no `interrupted` tag, no `error`: `is_interrupted`), and enqueue again the warm-start point it carried,
    which its objective's handler did not. Each is claimed by one INSERT (`claim_study_attr`): of two processes
    opening the study at once one enqueues it, once. Returns how many this call recorded."""
    recorded = interrupted_ids(study)
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        if INTERRUPTED in t.user_attrs or "error" in t.user_attrs or t._trial_id in recorded:
            continue
        if not claim_study_attr(study, f"{INTERRUPTED}:{t._trial_id}", "failed before its objective tagged it"):
            continue
        n += 1
        requeue_warm_start(study, t._trial_id)
    return n


def _claimer_gone(claim: Any) -> bool:
    """Whether a claim (`claim_study_attr`'s value) names a process of this host that is gone."""
    return isinstance(claim, dict) and worker_gone(claim.get("worker"))


def _held_later(t: optuna.trial.FrozenTrial, fixed: dict[str, Any], trials: Sequence[optuna.trial.FrozenTrial]) -> bool:
    """Whether a trial of `trials` after `t` holds its warm-start point `fixed` (enqueued again, or sampled)."""
    return any(u._trial_id > t._trial_id and (u.system_attrs.get("fixed_params") == fixed or u.params == fixed)
               for u in trials)


REQUEUED_KEY = "requeued:"  # study system attr `requeued:<trial id>`: its lost warm-start point was enqueued again


def requeue_lost_points(study: optuna.Study) -> int:
    """Enqueue again the warm-start point of each interrupted trial (`is_interrupted`) that no later trial of the
    study holds. Failing a dead process's trial and enqueuing its point again are two storage writes
    (`fail_interrupted`, the heartbeat's `_stale_trial`, the objective's Ctrl-C handler): a process killed between
    them left the trial failed and its point (the policy default first of all) enqueued nowhere, and no later open
    found a running trial to act on, so the point was never measured in the study. A point some later trial holds
    (enqueued again, or sampled) is not lost. Of two processes opening the study at once one enqueues it
    (`claim_study_attr`); a claim whose process died before it enqueued the point is taken over by the next open
    (`take_over_study_attr`). Returns how many points this call enqueued."""
    trials = study.get_trials(deepcopy=False)
    ids = interrupted_ids(study)
    n = 0
    for t in trials:
        fixed = t.system_attrs.get("fixed_params")
        if "warm_start" not in t.user_attrs or not fixed or not is_interrupted(t, ids):
            continue
        if _held_later(t, fixed, trials):
            continue
        key, mine = f"{REQUEUED_KEY}{t._trial_id}", {"worker": current_worker()}
        # a claim whose process died before it enqueued the point is taken over: else it was lost for good again
        if not claim_study_attr(study, key, mine) and not take_over_study_attr(study, key, mine, _claimer_gone):
            continue
        # read again: a claimer that enqueued the point and exited normally after `trials` was read is "gone" too,
        # and its point, taken over, was enqueued twice
        if _held_later(t, fixed, study.get_trials(deepcopy=False)):
            continue
        log.info("warm start %s enqueued again: its trial %d was cut short and nothing enqueued it",
                 t.user_attrs["warm_start"], t.number)
        n += requeue_warm_start(study, t._trial_id)
    return n


# ---------------------------------------------------------------------------------------------------
# one study


@dataclass
class StudyResult:
    study_name: str
    family: str
    workload: TuneWorkload
    best_knobs: Knobs | None
    best: Measurement | None
    trials: int
    complete: int
    failed: int
    pruned: int
    default_value: float | None = None
    top: list[Knobs] = field(default_factory=list)
    # the error of the first failed trial (`first_error`), read as the study is summed up: why a study without a
    # successful trial gave nothing, for the caller to say without loading the study again (where none failed, the
    # first infeasible trial's reason; "" where neither is recorded)
    first_error: str = ""


@dataclass
class BucketPrior:
    """What a neighbouring (smaller) token bucket's study already measured."""

    bucket: int
    study_name: str
    values: dict[Knobs, float]

    @property
    def best(self) -> float:
        return min(self.values.values())

    def top(self, n: int = 3) -> list[Knobs]:
        return [k for k, _ in sorted(self.values.items(), key=lambda kv: kv[1])[:n]]


class _Objective:
    def __init__(self, space: SearchSpace, backend: BenchmarkBackend, workload: TuneWorkload, prune: bool,
                 cross: BucketPrior | None = None, cross_factor: float = 1.5):
        self.space = space
        self.backend = backend
        self.workload = workload
        self.prune = prune
        self.cross = cross
        self.cross_factor = cross_factor

    def _cross_bucket_prune(self, trial: optuna.Trial, knobs: Knobs) -> None:
        """Skip a setting that the neighbouring bucket already measured clearly bad (no benchmark run).
        Warm-start points (the policy default, priors) are always measured."""
        c = self.cross
        if c is None or "warm_start" in trial.user_attrs:
            return
        v = c.values.get(knobs)
        if v is not None and v > self.cross_factor * c.best:
            trial.set_user_attr("pruned_by", {"bucket": c.bucket, "value_us": v, "best_us": c.best,
                                              "factor": self.cross_factor})
            raise optuna.TrialPruned(f"{v:.1f} µs at bucket {c.bucket}, over {self.cross_factor}× its best")

    def __call__(self, trial: optuna.Trial) -> float:
        try:
            return self._run(trial)
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: Optuna fails the trial; mark it cut short, not finished
            trial.set_user_attr(INTERRUPTED, cut_short_by(e))
            requeue_warm_start(trial.study, trial._trial_id)
            raise

    def _run(self, trial: optuna.Trial) -> float:
        if not isinstance(trial.study.sampler, _Sampler):  # ours recorded it before sampling (`before_trial`)
            trial.set_user_attr("worker", current_worker())  # first: whoever opens the study sees whose trial it is
        knobs = self.space.suggest(trial)
        trial.set_user_attr("knobs", knobs.to_dict())
        ok, why = self.space.feasible(knobs)
        if not ok:  # cannot happen by construction; never benchmark it if it does
            trial.set_user_attr("infeasible", why)
            raise optuna.TrialPruned(f"infeasible: {why}")
        self._cross_bucket_prune(trial, knobs)

        def report(step: int, value: float) -> bool:
            if not self.prune:
                return False
            trial.report(value, step)
            return trial.should_prune()

        m = self.backend.evaluate(knobs, self.workload, report=report)
        trial.set_user_attr("samples", [float(x) for x in m.samples])
        if m.details:
            trial.set_user_attr("details", m.details)
        if m.infeasible:
            trial.set_user_attr("infeasible", m.error or "infeasible")
            raise optuna.TrialPruned(f"infeasible: {m.error}")
        if not m.ok or math.isnan(m.median_us):  # a FAIL with its `error`: a failure, not a trial cut short
            trial.set_user_attr("error", m.error or ("failed" if not m.ok else "no time measured (NaN)"))
            return math.nan  # recorded as FAIL; the study goes on
        trial.set_user_attr("spread_us", float(m.spread_us))
        if m.pruned:
            raise optuna.TrialPruned(f"worse than the median after {len(m.samples)} repeat(s)")
        return float(m.median_us)


class _BudgetCallback:
    """Stop once the study holds `n` finished trials (counted across every worker on the storage)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if finished_trials(study) >= self.n:
            study.stop()


# The marker study by which earlier versions let one worker of a shared study enqueue the whole warm start (`tune
# show` leaves such markers out); each point is now claimed on its own (`_claim_warm_point`).
WARM_LOCK_SUFFIX = "/.warm-start-lock"
WARM_POINT_KEY = "warm-start:"  # study system attr `warm-start:<digest of the params>`: that point was enqueued
# `warm-start-again:<digest>`: a point whose claimer died before enqueuing it was enqueued by this attr's writer
WARM_AGAIN_KEY = "warm-start-again:"


def _warm_digest(params: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _claimed_by_the_dead(study: optuna.Study, params: dict[str, Any], name: str,
                         trials: Callable[[], list[optuna.trial.FrozenTrial]]) -> bool:
    """Whether this process enqueues warm-start point `params`, which another process claimed and died before it
    enqueued (`_claim_warm_point`): the claim names a process of this host that is gone, and no trial of the study
    holds the point. Without this the point was lost for the study for good (every later run found it claimed),
    the policy default among them. Of two processes finding it so, one enqueues it (`claim_study_attr`; that
    second claim, where its process died in turn before enqueuing, is taken over: `take_over_study_attr`)."""
    digest = _warm_digest(params)
    claim = study._storage.get_study_system_attrs(study._study_id).get(WARM_POINT_KEY + digest)
    if not isinstance(claim, dict) or not worker_gone(claim.get("worker")):
        return False
    if any(t.system_attrs.get("fixed_params") == params or t.params == params for t in trials()):
        return False
    again = {"name": name, "worker": current_worker()}  # taken over too where its claimer died in turn
    if not claim_study_attr(study, WARM_AGAIN_KEY + digest, again) and not take_over_study_attr(
            study, WARM_AGAIN_KEY + digest, again, _claimer_gone):
        return False
    log.info("warm start %s enqueued: the process that claimed it (%s) died before it enqueued it", name,
             claim.get("worker"))
    return True


def _claim_warm_point(study: optuna.Study, params: dict[str, Any], name: str) -> bool:
    """Whether this process enqueues warm-start point `params`: the first to claim it in the study does, on every RDB
    storage (the SQLite file is shared too: the daemon's re-tune and a `moetune tune`). `enqueue_trial`'s
    `skip_if_exists` checks and inserts in two transactions, so two processes both found the point missing and both
    enqueued it (Optuna#2925). The claim is one INSERT of a study system attr: Optuna's table has a unique
    (study_id, key), so of two processes exactly one inserts it. A process killed between its claim and its
    enqueue left it claimed and enqueued nowhere: the next run enqueues it (`_claimed_by_the_dead`). Another storage
    (in memory) is one process's: True."""
    return claim_study_attr(study, WARM_POINT_KEY + _warm_digest(params), {"name": name, "worker": current_worker()})


def enqueue_warm_start(study: optuna.Study, space: SearchSpace, extra: Sequence[tuple[str, Knobs]] = ()) -> int:
    """Enqueue the policy default, the analytic priors and `extra`, each once per study, however many processes
    open it at once (`_claim_warm_point`), and not when the study already holds a trial of it (`skip_if_exists`: a
    study enqueued before the claims, or a point TPE sampled). A resumed study gets the points that are new (the
    best settings of a neighbouring bucket measured since). Returns how many points this call claimed."""
    n = 0
    # the study's trials, read once and only where a claim's process is gone (every earlier run's, normally)
    trials = functools.cache(lambda: study.get_trials(deepcopy=False))
    for name, knobs in [*space.priors(), *extra]:
        try:
            params = space.params_of(knobs)
        except KnobError as e:
            log.info("warm start %s skipped: %s", name, e)
            continue
        if not _claim_warm_point(study, params, name) and not _claimed_by_the_dead(study, params, name, trials):
            continue
        study.enqueue_trial(params, user_attrs={"warm_start": name}, skip_if_exists=True)
        n += 1
    return n


def run_study(study: optuna.Study, space: SearchSpace, backend: BenchmarkBackend, workload: TuneWorkload, *,
              trials: int, timeout_s: float | None = None, callbacks: Sequence[Callable[..., None]] = (),
              extra_warm: Sequence[tuple[str, Knobs]] = (), prune: bool | None = None,
              warm_start: bool = True, cross: BucketPrior | None = None) -> StudyResult:
    """Run (or resume) a study until it holds `trials` finished trials or `timeout_s` passes."""
    if prune is None:
        prune = backend.remeasures and backend.repeats > 1
    if prune and isinstance(study.pruner, optuna.pruners.NopPruner):
        study.pruner = optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=0)
    family = space.policy.family
    study.set_user_attr("family", family)
    study.set_user_attr("workload", workload.to_dict())
    study.set_user_attr("backend", backend.label)
    study.set_user_attr("modelled", backend.modelled)
    study.set_user_attr("policy", space.policy.to_dict())
    if warm_start:
        enqueue_warm_start(study, space, extra_warm)
    # a study of failed trials only is tried again with the whole budget (`failed_before`)
    base = failed_before(study)
    remaining = trials + base - finished_trials(study)
    if remaining > 0 and (timeout_s is None or timeout_s > 0):
        objective = _Objective(space, backend, workload, prune, cross=cross)
        registry = (storage_id(study._storage), study._study_id) in REGISTRIES
        if registry:
            register_worker(study)  # again when an earlier run_study on this study object left it
        until = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            with warnings.catch_warnings(), trials_in_flight(study._storage) as in_flight:
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                for _ in range(trials + 1):  # a trial taken over costs a round; bounded all the same
                    try:
                        study.optimize(objective, n_trials=remaining,
                                       timeout=None if until is None else until - time.monotonic(),
                                       callbacks=[_BudgetCallback(trials + base), *callbacks], gc_after_trial=False)
                        break
                    except Exception as e:
                        if not _taken_over(study, in_flight, e):
                            fail_in_flight(study, in_flight, cut_short_by(e))
                            raise
                    except BaseException as e:  # no trial of this process is left RUNNING (`fail_in_flight`)
                        fail_in_flight(study, in_flight, cut_short_by(e))
                        raise
                    remaining = trials + base - finished_trials(study)
                    if remaining <= 0 or (until is not None and time.monotonic() >= until):
                        break
        finally:  # done asking (or interrupted): this process leaves the study's worker registry
            if registry:
                unregister_worker(study)
    return summarize_study(study, space, workload)


def _taken_over(study: optuna.Study, in_flight: set[int], e: Exception) -> bool:
    """Whether `e` ended `optimize` because another worker finished a trial this process was running: on a server
    storage, one that failed it as stale (this process's heartbeat came late: paused, or the database out of reach
    past the grace period). Optuna then raises on this process's result ("Cannot tell a FAIL trial."), which ended
    the whole tune; the trial is the study's as interrupted (not counted), and this worker goes on. Such trials leave
    `in_flight`; an error of anything else (a trial this process failed itself, a storage that fails) is not this."""
    try:
        gone = {i for i in in_flight if study._storage.get_trial(i).state.is_finished()}
    except Exception:  # broad: the storage fails too; the error stands as it is
        return False
    if not gone:
        return False
    in_flight.difference_update(gone)
    log.warning("trial(s) %s of study %s were failed by another worker while this one ran them (a heartbeat came "
                "late), so their result was dropped; going on with the study (%s: %s)",
                ", ".join(str(study._storage.get_trial(i).number) for i in sorted(gone)), study.study_name,
                type(e).__name__, e)
    return True


def summarize_study(study: optuna.Study, space: SearchSpace, workload: TuneWorkload) -> StudyResult:
    trials = study.get_trials(deepcopy=False)
    done = sorted(completed(study), key=lambda t: t.value)  # type: ignore[arg-type, return-value]
    best_knobs = best = None
    top: list[Knobs] = []
    for t in done:
        try:
            k = Knobs.from_dict(t.user_attrs["knobs"]) if "knobs" in t.user_attrs else space.knobs_from_params(t.params)
        except (KnobError, KeyError):
            continue
        if best_knobs is None:
            best_knobs = k
            best = Measurement(float(t.value), float(t.user_attrs.get("spread_us", 0.0)),  # type: ignore[arg-type]
                               list(t.user_attrs.get("samples", [t.value])), True,
                               details=dict(t.user_attrs.get("details", {})))
        if k not in top:
            top.append(k)
        if len(top) >= 3:
            break
    default_value = None
    for t in done:
        if t.user_attrs.get("warm_start") == "policy_default":
            default_value = float(t.value)  # type: ignore[arg-type]
            break
    cut = interrupted_ids(study)
    count = {s: sum(1 for t in trials if t.state == s and not is_interrupted(t, cut)) for s in FINISHED}
    return StudyResult(study.study_name, space.policy.family, workload, best_knobs, best,
                       trials=sum(count.values()), complete=count[TrialState.COMPLETE], failed=count[TrialState.FAIL],
                       pruned=count[TrialState.PRUNED], default_value=default_value, top=top,
                       first_error=first_error(trials, cut))


# ---------------------------------------------------------------------------------------------------
# neighbouring token buckets


def neighbour_bucket(storage: optuna.storages.BaseStorage, key: ProfileKey, backend_label: str,
                     model_name: str, config: str = "") -> BucketPrior | None:
    """The nearest smaller token bucket's study of the same key and backend in `storage`, if any
    (from this run or an earlier one): its best settings warm-start this bucket, and with an expensive
    backend its clearly bad settings are not measured again."""
    import msgspec

    try:
        names = set(optuna.get_all_study_names(storage))
    except Exception:  # broad: the warm start is optional; an unreadable storage only means no neighbour
        return None
    for b in sorted((b for b in TOKEN_BUCKETS if b < key.token_bucket), reverse=True):
        name = study_name(msgspec.structs.replace(key, token_bucket=b), backend_label, model_name, config)
        if name not in names:
            continue
        study = optuna.load_study(study_name=name, storage=storage)
        values: dict[Knobs, float] = {}
        for t in completed(study):
            try:
                values[Knobs.from_dict(t.user_attrs["knobs"])] = float(t.value)  # type: ignore[arg-type]
            except (KeyError, KnobError):
                continue
        if values:
            return BucketPrior(b, name, values)
    return None
