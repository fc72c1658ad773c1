"""Optuna searches over the EP knobs, and `tune_profiles`, which turns studies into stored profiles.

- Sampler: TPE, multivariate with `group=True` (it decomposes the conditional space), seeded.
- Warm start: `enqueue_trial` of the policy default and the analytic priors (per-PE groups; SM and QP
  counts from link bandwidth), then the best settings of the previous token bucket of the same shape.
- Storage: Optuna's own RDB storage, never the profile database. SQLite by default (a file next to the
  store, WAL) — one tuning process per file; `--storage postgresql://...` lets several nodes share a
  study (heartbeats fail the trials of a worker that died). Same study name → the study resumes.
- Trial budget: finished trials (complete, pruned, failed) of the study count, so a rerun after a
  crash only runs what is missing and several workers on one study stop together.
- A failed or hung run is a FAIL trial with its error in user attrs; a setting the backend calls unsafe
  is PRUNED with `infeasible` set; neither stops the study.
- Across token buckets: buckets are tuned smallest first; the nearest smaller bucket's study of the same
  key (from this run or an earlier one, found in the storage) warm-starts the next with its best
  settings, and, with the local backend, a setting it measured ≥ 1.5× slower than its best is pruned
  without being run (warm-start points are always measured).
- Pruning within a trial: with the local backend and several repeats per trial, a MedianPruner stops a
  trial whose first repeats are already worse than the median. Both pay only where a measurement is
  expensive (a process launch); the model backend evaluates every sampled point (about a millisecond).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import sqlite3
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import TOKEN_BUCKETS, ProfileKey, ProfileRecord, nearest_bucket
from moetune.runtime.shapes import ModelShape
from moetune.tuner.search.backends import (
    BenchmarkBackend,
    LocalBackend,
    Measurement,
    ModelBackend,
    TuneWorkload,
    preset_family,
    preset_gpus_per_node,
    preset_link_rates,
)
from moetune.tuner.search.policy import Policy, PolicyError, load_policy
from moetune.tuner.search.space import SearchSpace

log = logging.getLogger("moetune.tuner.search.study")

STUDY_PREFIX = "moetune/"
WORKER = f"{socket.gethostname()}:{os.getpid()}"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
OPTUNA_DB_NAME = "moetune-studies.db"


# ---------------------------------------------------------------------------------------------------
# storage


def default_storage_url(db_path: str | Path | None = None) -> str:
    """SQLite file for Optuna's tables, next to the profile database (never inside it)."""
    if db_path is None:
        try:
            from moetune.runtime.config import load_config

            db_path = load_config().db_path
        except Exception:
            import os

            home = os.environ.get("MOETUNE_HOME") or str(Path.home() / ".local" / "share" / "moetune")
            db_path = Path(home) / "moetune.db"
    return f"sqlite:///{Path(db_path).expanduser().resolve().parent / OPTUNA_DB_NAME}"


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite:")


def sqlite_path(url: str) -> Path | None:
    if not url.startswith("sqlite:///"):
        return None
    return Path(url[len("sqlite:///"):])


def normalize_url(url: str) -> str:
    """`postgresql://` means psycopg 3 when psycopg2 is not installed (SQLAlchemy defaults to psycopg2)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna RDB storage (standard tables: optuna-dashboard opens it as it is)."""
    url = normalize_url(url)
    if is_sqlite(url):
        path = sqlite_path(url)
        if path is not None and str(path) != ":memory:":
            path.parent.mkdir(parents=True, exist_ok=True)
            con = sqlite3.connect(path, timeout=30)
            try:
                con.execute("PRAGMA journal_mode=WAL")
            finally:
                con.close()
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}})
    # Shared server storage: heartbeats let the survivors fail the trials of a worker that died.
    return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True}, heartbeat_interval=10,
                                      grace_period=60)


def study_name(key: ProfileKey, backend_label: str, model_name: str) -> str:
    """Deterministic: the same key and backend always open the same study (resume after a crash)."""
    return (f"{STUDY_PREFIX}{key.transport_family}/{model_name}/S{key.token_bucket}/ep{key.ep_size}n{key.nodes}/"
            f"{backend_label}/{_short(key.fingerprint, 12)}-{_short(key.software, 8)}")


def _short(h: str, n: int) -> str:
    """A hex hash's first n digits; anything else (e.g. `preset:NAME:DIGEST`) is hashed first."""
    if all(c in "0123456789abcdef" for c in h.lower()) and len(h) >= n:
        return h[:n]
    return hashlib.sha256(h.encode()).hexdigest()[:n]


def make_sampler(seed: int | None, n_startup_trials: int = 10) -> optuna.samplers.TPESampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(multivariate=True, group=True, seed=seed,
                                          n_startup_trials=n_startup_trials)


def open_study(name: str, storage: str | optuna.storages.BaseStorage, *, seed: int | None = None,
               n_startup_trials: int = 10, pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    st = make_storage(storage) if isinstance(storage, str) else storage
    study = optuna.create_study(study_name=name, storage=st, direction="minimize", load_if_exists=True,
                                sampler=make_sampler(seed, n_startup_trials), pruner=pruner or optuna.pruners.NopPruner())
    if isinstance(storage, str) and is_sqlite(storage):
        fail_interrupted(study)
    return study


def fail_interrupted(study: optuna.Study) -> int:
    """Mark RUNNING trials FAIL (a SQLite study has one worker: a RUNNING trial is a dead process's)."""
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        try:
            study._storage.set_trial_user_attr(t._trial_id, "error", "interrupted (the tuning process died)")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
        except Exception:  # another worker finished it meanwhile
            pass
    return n


def finished_trials(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def completed(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None and math.isfinite(t.value)]


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
        knobs = self.space.suggest(trial)
        trial.set_user_attr("knobs", knobs.to_dict())
        trial.set_user_attr("worker", WORKER)
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
        if not m.ok:
            trial.set_user_attr("error", m.error or "failed")
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


WARM_LOCK_SUFFIX = "/.warm-start-lock"


def _claim_warm_start(study: optuna.Study) -> bool:
    """Only one worker of a shared study enqueues the warm start (Optuna#2925: enqueued points run more
    than once when several processes enqueue). The claim is the creation of a marker study: its
    unique name makes it atomic on any RDB storage."""
    try:
        optuna.create_study(study_name=study.study_name + WARM_LOCK_SUFFIX, storage=study._storage)
        return True
    except optuna.exceptions.DuplicatedStudyError:
        return False


def enqueue_warm_start(study: optuna.Study, space: SearchSpace, extra: Sequence[tuple[str, Knobs]] = (),
                       *, shared: bool = False) -> int:
    """Enqueue the policy default, the analytic priors and `extra` (skipped if already in the study).

    `shared`: several workers may open this study at once; only the first one enqueues."""
    if shared and not _claim_warm_start(study):
        return 0
    n = 0
    for name, knobs in [*space.priors(), *extra]:
        try:
            params = space.params_of(knobs)
        except KnobError as e:
            log.info("warm start %s skipped: %s", name, e)
            continue
        study.enqueue_trial(params, user_attrs={"warm_start": name}, skip_if_exists=True)
        n += 1
    return n


def run_study(study: optuna.Study, space: SearchSpace, backend: BenchmarkBackend, workload: TuneWorkload, *,
              trials: int, timeout_s: float | None = None, callbacks: Sequence[Callable[..., None]] = (),
              extra_warm: Sequence[tuple[str, Knobs]] = (), prune: bool | None = None,
              shared: bool = False, warm_start: bool = True, cross: BucketPrior | None = None) -> StudyResult:
    """Run (or resume) a study until it holds `trials` finished trials or `timeout_s` passes."""
    if prune is None:
        prune = isinstance(backend, LocalBackend) and backend.repeats > 1
    if prune and isinstance(study.pruner, optuna.pruners.NopPruner):
        study.pruner = optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=0)
    family = space.policy.family
    study.set_user_attr("family", family)
    study.set_user_attr("workload", workload.to_dict())
    study.set_user_attr("backend", backend.label)
    study.set_user_attr("modelled", backend.modelled)
    study.set_user_attr("policy", space.policy.to_dict())
    if warm_start:
        enqueue_warm_start(study, space, extra_warm, shared=shared)
    remaining = trials - finished_trials(study)
    if remaining > 0 and (timeout_s is None or timeout_s > 0):
        objective = _Objective(space, backend, workload, prune, cross=cross)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.optimize(objective, n_trials=remaining, timeout=timeout_s,
                           callbacks=[_BudgetCallback(trials), *callbacks], gc_after_trial=False)
    return summarize_study(study, space, workload)


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
    count = {s: sum(1 for t in trials if t.state == s) for s in FINISHED}
    return StudyResult(study.study_name, space.policy.family, workload, best_knobs, best,
                       trials=sum(count.values()), complete=count[TrialState.COMPLETE], failed=count[TrialState.FAIL],
                       pruned=count[TrialState.PRUNED], default_value=default_value, top=top)


# ---------------------------------------------------------------------------------------------------
# facts


@dataclass
class PresetFacts:
    """Facts standing for a modelled fabric (a fabric-model preset, not this node)."""

    preset: Any
    name: str
    family: str
    gpus_per_node: int
    link_rates: dict[str, float]

    @classmethod
    def from_preset(cls, preset: Any) -> PresetFacts:
        name = getattr(preset, "name", None) or str(preset)
        return cls(preset, name, preset_family(preset), preset_gpus_per_node(preset), preset_link_rates(preset))

    @property
    def transports(self) -> list[Any]:
        return [_Fam(self.family, f"modelled by preset {self.name}")]

    @property
    def fingerprint(self) -> str:
        digest = getattr(self.preset, "digest", None) or getattr(self.preset, "fingerprint", None)
        tail = digest if isinstance(digest, str) and digest else hashlib.sha256(self.name.encode()).hexdigest()[:16]
        return f"preset:{self.name}:{tail}"

    @property
    def software_hash(self) -> str:
        return "modelled"

    @property
    def software(self) -> dict[str, str]:
        return {"fabric_model": "modelled", "preset": self.name}

    @property
    def gpu_count(self) -> int:
        return self.gpus_per_node

    nodes: int = 1


@dataclass
class _Fam:
    name: str
    reason: str = ""


def family_names(facts: Any) -> list[str]:
    out = []
    for t in getattr(facts, "transports", []) or []:
        name = t if isinstance(t, str) else getattr(t, "name", None)
        if name and name not in out:
            out.append(name)
    return out


def facts_link_rates(facts: Any) -> dict[str, float]:
    """Best-effort link rates from discovery facts, for the analytic priors (missing facts are fine)."""
    if isinstance(facts, PresetFacts):
        return dict(facts.link_rates)
    out_attr: dict[str, float] = {}
    nv = getattr(facts, "nvlink_gbs_per_gpu", None)
    if isinstance(nv, (int, float)) and nv > 0:
        out_attr["link_gbps"] = float(nv)
    rates = [float(p.rate_gbps) for n in (getattr(facts, "nics", None) or [])
             for p in (getattr(n, "active_ports", None) or []) if getattr(p, "rate_gbps", 0) > 0]
    if rates:
        out_attr["nic_gbit"] = max(rates)
    if out_attr or hasattr(facts, "nvlink_gbs_per_gpu"):
        return out_attr
    try:
        d = facts.to_dict() if hasattr(facts, "to_dict") else dict(facts)
    except Exception:
        return {}
    out: dict[str, float] = {}
    nic_rates = []
    for nic in d.get("nics", []) or []:
        ports = nic.get("ports", [nic]) if isinstance(nic, Mapping) else []
        for p in ports:
            if not isinstance(p, Mapping) or str(p.get("state", "ACTIVE")).upper().split(":")[-1].strip() not in ("ACTIVE", "4"):
                continue
            for k in ("rate_gbps", "rate_gbit", "rate"):
                v = p.get(k)
                if isinstance(v, str):
                    try:
                        v = float(v.split()[0])
                    except (ValueError, IndexError):
                        v = None
                if isinstance(v, (int, float)) and v > 0:
                    nic_rates.append(float(v))
                    break
    if nic_rates:
        out["nic_gbit"] = max(nic_rates)
    link_totals = []
    for g in d.get("gpus", []) or []:
        if not isinstance(g, Mapping):
            continue
        links = g.get("nvlinks") or g.get("nvlink") or []
        if isinstance(links, list):
            tot = 0.0
            for ln in links:
                if isinstance(ln, Mapping) and str(ln.get("state", "up")).lower() in ("up", "active", "1", "true"):
                    v = ln.get("speed_gbps") or ln.get("gbps") or ln.get("speed")
                    if isinstance(v, (int, float)):
                        tot += float(v)
            if tot:
                link_totals.append(tot)
    if link_totals:
        out["link_gbps"] = min(link_totals)
    return out


# ---------------------------------------------------------------------------------------------------
# tune_profiles


@dataclass
class TuneResult:
    record: ProfileRecord | None
    written: bool
    reason: str
    study: StudyResult


def make_backend(backend: str | BenchmarkBackend, preset: str | None = None, **local_kw: Any) -> BenchmarkBackend:
    if isinstance(backend, BenchmarkBackend):
        return backend
    if backend == "model":
        if preset is None:
            from moetune.tuner.fabric_model import predict as fabric_model

            finder = getattr(fabric_model, "preset_for_facts", None)
            if finder is None:
                raise ValueError("the model backend needs --preset: a preset name, or a calibrated preset file of "
                                 "this node (`moetune model calibrate --out FILE`) with --node-model")
            return ModelBackend(finder(local_kw.get("facts")))
        return ModelBackend(preset)
    if backend == "local":
        local_kw.pop("facts", None)
        return LocalBackend(**local_kw)
    raise ValueError(f"unknown backend {backend!r}; expected model or local")


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def tune_profiles(store: Any, facts: Any, **options: Any) -> list[ProfileRecord]:
    """Tune each family × shape × token bucket; write the winners through `store.put_profile`.

    Takes the keywords of `tune_profiles_detailed` and returns the best record of every study (status
    "current" when the store took it as current); that function also gives the reasons and study summaries.
    """
    return [r.record for r in tune_profiles_detailed(store, facts, **options) if r.record is not None]


def tune_profiles_detailed(store: Any, facts: Any, *, models: list[ModelShape], tokens: list[int],
                           backend: str | BenchmarkBackend = "model", preset: str | None = None, trials: int = 40,
                           timeout_s: float | None = None, ep_size: int | None = None, nodes: int = 1,
                           progress: bool = True, storage: str | None = None, seed: int | None = 0,
                           families: Sequence[str] | None = None, policy_override: str | Path | None = None,
                           routing: str = "uniform", local_options: Mapping[str, Any] | None = None,
                           on_trial: Callable[[str, optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
                           node_model: bool = False) -> list[TuneResult]:
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if not models or not tokens:
        raise ValueError("nothing to tune: give at least one model and one token count")
    if any(t < 1 for t in tokens):
        raise ValueError(f"token counts must be >= 1, got {tokens}")
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    be = make_backend(backend, preset, facts=facts, **dict(local_options or {}))
    if isinstance(be, ModelBackend) and be.preset is not None and preset is not None:
        if node_model and facts is not None:
            # A calibrated model of THIS node: profiles carry the node's key; only its family is tuned.
            fam = preset_family(be.preset)
            if families is None:
                families = [fam]
            elif fam not in families:
                raise ValueError(f"the calibrated preset models {fam!r}, not {list(families)}")
        else:
            facts = PresetFacts.from_preset(be.preset)
    if facts is None:
        raise ValueError("no fabric facts: run discovery or give a preset")
    gpn = getattr(facts, "gpus_per_node", None) or getattr(facts, "gpu_count", None) or 1
    if ep_size is None:
        ep_size = int(gpn) * nodes
    if ep_size % nodes:
        raise ValueError(f"ep_size {ep_size} is not divisible by nodes {nodes}")
    gpus_per_node = ep_size // nodes
    for m in models:
        if m.experts % ep_size:
            raise ValueError(f"{m.name}: {m.experts} experts do not divide evenly over an EP group of {ep_size}")
    fams = family_names(facts)
    if families:
        missing = [f for f in families if f not in fams]
        if missing:
            raise ValueError(f"transport families {missing} were not found on this fabric (found: {', '.join(fams)})")
        fams = [f for f in fams if f in families]
    policies: dict[str, Policy] = {}
    for f in fams:
        if not be.supports(f):
            log.info("family %s skipped: backend %s cannot measure it", f, be.label)
            continue
        try:
            policies[f] = load_policy(f, policy_override)
        except PolicyError as e:
            if "no policy for transport family" in str(e):
                log.warning("family %s skipped: %s", f, e)
                continue
            raise
    if not policies:
        raise ValueError(f"no transport family to tune (found {fams}; backend {be.label})")
    # The measured-error check of compressed trials follows each family's policy unless set explicitly.
    explicit_budget = isinstance(be, LocalBackend) and be.error_budget is not None
    url = storage or default_storage_url(getattr(store, "path", None) or _store_db_path(store))
    st = make_storage(url)
    rates = facts_link_rates(facts)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    bar = _Progress(progress)
    out: list[TuneResult] = []
    try:
        for fam, pol in policies.items():
            for model in models:
                for tok in sorted(set(tokens)):
                    bucket = nearest_bucket(tok)
                    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family=fam,
                                     ep_size=ep_size, nodes=nodes, hidden=model.hidden, intermediate=model.intermediate,
                                     experts=model.experts, topk=model.topk, dtype=model.dtype, token_bucket=bucket)
                    wl = TuneWorkload(model=model, tokens=bucket, nodes=nodes, gpus_per_node=gpus_per_node, routing=routing)
                    space = SearchSpace(pol, experts=model.experts, ep_size=ep_size, link_rates=rates)
                    if isinstance(be, LocalBackend):
                        be.family = fam
                        if not explicit_budget:
                            be.error_budget = pol.error_budget
                    elif isinstance(be, ModelBackend):
                        # A workload the model cannot run at all (too many nodes for the preset, ...) is
                        # one clear error, not a study of failed trials.
                        m = be.evaluate(pol.defaults, wl)
                        if not m.ok and not m.infeasible:
                            raise ValueError(f"{be.label} cannot evaluate {model.name} on {nodes} node(s) × "
                                             f"{gpus_per_node} GPUs at S={bucket}: {m.error}")
                    name = study_name(key, be.label, model.name)
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    out.append(_tune_one(store, st, url, name, key, space, be, wl, trials=trials, timeout_s=left,
                                         seed=seed, bar=bar, facts=facts, on_trial=on_trial,
                                         neighbour=neighbour_bucket(st, key, be.label, model.name)))
    finally:
        bar.close()
        if be is not backend and isinstance(be, LocalBackend):
            be.close()  # built here (a backend name): end its persistent bench workers
    return out


def neighbour_bucket(storage: optuna.storages.BaseStorage, key: ProfileKey, backend_label: str,
                     model_name: str) -> BucketPrior | None:
    """The nearest smaller token bucket's study of the same key and backend in `storage`, if any
    (from this run or an earlier one): its best settings warm-start this bucket, and with an expensive
    backend its clearly bad settings are not measured again."""
    import msgspec

    try:
        names = set(optuna.get_all_study_names(storage))
    except Exception:
        return None
    for b in sorted((b for b in TOKEN_BUCKETS if b < key.token_bucket), reverse=True):
        name = study_name(msgspec.structs.replace(key, token_bucket=b), backend_label, model_name)
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


def _store_db_path(store: Any) -> str | None:
    url = getattr(store, "url", None)
    if isinstance(url, str) and url.startswith("sqlite:///"):
        return url[len("sqlite:///"):]
    return None


def _tune_one(store: Any, st: optuna.storages.BaseStorage, url: str, name: str, key: ProfileKey,
              space: SearchSpace, be: BenchmarkBackend, wl: TuneWorkload, *, trials: int, timeout_s: float | None,
              seed: int | None, bar: _Progress, facts: Any,
              on_trial: Callable[[str, optuna.Study, optuna.trial.FrozenTrial], None] | None,
              neighbour: BucketPrior | None = None) -> TuneResult:
    run_id = store.start_run(study_name=name, storage=_redact(url), backend=be.label) if store is not None else None
    status = "failed"
    result: StudyResult | None = None
    try:
        study = open_study(name, st, seed=seed, n_startup_trials=min(10, max(3, trials // 5)))
        if is_sqlite(url):
            fail_interrupted(study)
        study.set_user_attr("key", key.to_dict())
        task = bar.add(f"{key.transport_family} {wl.model.name} S={wl.tokens}", trials, finished_trials(study))

        def cb(s: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
            bar.update(task, finished_trials(s), _best_value(s))
            if on_trial is not None:
                on_trial(name, s, t)

        extra = []
        if neighbour is not None:
            study.set_user_attr("neighbour_bucket", {"bucket": neighbour.bucket, "study": neighbour.study_name})
            extra = [(f"bucket_transfer:{neighbour.bucket}:{i}", k) for i, k in enumerate(neighbour.top())
                     if space.feasible(k)[0]]
        # Cross-bucket pruning pays where a measurement is expensive (the local backend: a process launch
        # per run); a model prediction costs about a millisecond, so there every sampled point is evaluated.
        cross = neighbour if isinstance(be, LocalBackend) else None
        result = run_study(study, space, be, wl, trials=trials, timeout_s=timeout_s, callbacks=[cb], extra_warm=extra,
                           shared=not is_sqlite(url), cross=cross)
        bar.update(task, finished_trials(study), _best_value(study))
        record, written, reason = _write_profile(store, key, be, result, facts)
        status = "done" if result.best_knobs is not None else "no_result"
        return TuneResult(record, written, reason, result)
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        if store is not None and run_id is not None:
            best_value = result.best.median_us if result is not None and result.best is not None else None
            store.finish_run(run_id, status=status, trials=result.trials if result else 0, best_value=best_value)


def _best_value(study: optuna.Study) -> float | None:
    done = completed(study)
    return min(t.value for t in done) if done else None  # type: ignore[type-var]


def _redact(url: str) -> str:
    """Storage URL without a password (it is recorded in the run table)."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        user = cred.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


def _write_profile(store: Any, key: ProfileKey, be: BenchmarkBackend, result: StudyResult,
                   facts: Any) -> tuple[ProfileRecord | None, bool, str]:
    if result.best_knobs is None or result.best is None:
        return None, False, "no successful trial"
    knobs, meas = result.best_knobs, result.best
    incumbent = store.get_current(key) if store is not None else None
    if isinstance(be, LocalBackend):
        # Measure the winner again beside the incumbent (or the policy default): same conditions.
        rival = incumbent.knobs if incumbent is not None else None
        cands = [knobs] + ([rival] if rival is not None and rival != knobs else [])
        ms = be.compare(cands, result.workload, rounds=max(2, be.repeats))
        if not ms[0].ok:
            return None, False, f"the winner failed when measured again: {ms[0].error}"
        meas = ms[0]
        if len(ms) > 1 and ms[1].ok:
            gain = ms[1].median_us - meas.median_us
            if gain <= max(ms[1].spread_us, meas.spread_us):
                return None, False, (f"incumbent re-measured side by side at {ms[1].median_us:.1f} µs vs "
                                     f"{meas.median_us:.1f} µs: gain within noise, incumbent kept")
    now = _now_iso()
    software = dict(getattr(facts, "software", {}) or {})
    rec = ProfileRecord(key=key, knobs=knobs, latency_us=float(meas.median_us), spread_us=float(meas.spread_us),
                        backend=be.label, status="current", software_versions={str(k): str(v) for k, v in software.items()},
                        created=now, updated=now)
    if store is None:
        return rec, False, "no store"
    written, reason = store.put_profile(rec)
    if not written:
        rec.status = "superseded"
    return rec, written, reason


# ---------------------------------------------------------------------------------------------------
# progress


class _Progress:
    """A Rich progress bar per study (trials, best so far); silent when disabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            # progress goes to stderr, so `--json` output on stdout stays parseable
            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("best {task.fields[best]}"), TimeElapsedColumn(), transient=False,
                               console=Console(stderr=True))
            self._p.start()

    def add(self, desc: str, total: int, done: int) -> Any:
        if self._p is None:
            return None
        return self._p.add_task(desc, total=total, completed=min(done, total), best="-")

    def update(self, task: Any, done: int, best: float | None) -> None:
        if self._p is None or task is None:
            return
        self._p.update(task, completed=done, best="-" if best is None else f"{best:,.1f} µs")

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


# ---------------------------------------------------------------------------------------------------
# reading studies back (`moetune tune show`)


def list_studies(storage: str) -> list[dict[str, Any]]:
    st = make_storage(storage)
    out = []
    for s in optuna.get_all_study_summaries(st, include_best_trial=True):
        if not s.study_name.startswith(STUDY_PREFIX) or s.study_name.endswith(WARM_LOCK_SUFFIX):
            continue
        best = s.best_trial
        out.append({"study": s.study_name, "trials": s.n_trials,
                    "best_us": best.value if best is not None else None,
                    "family": s.user_attrs.get("family"), "backend": s.user_attrs.get("backend"),
                    "modelled": s.user_attrs.get("modelled")})
    return out


def describe_study(storage: str, name: str) -> dict[str, Any]:
    st = make_storage(storage)
    study = optuna.load_study(study_name=name, storage=st)
    trials = study.get_trials(deepcopy=False)
    states = {s.name.lower(): sum(1 for t in trials if t.state == s) for s in TrialState}
    done = completed(study)
    best = min(done, key=lambda t: t.value) if done else None  # type: ignore[arg-type, return-value]
    default = next((t for t in done if t.user_attrs.get("warm_start") == "policy_default"), None)
    importances: dict[str, float] = {}
    importance_note = ""
    try:
        if len(done) >= 2:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importances = {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
        else:
            importance_note = "needs at least 2 complete trials"
    except Exception as e:
        importance_note = f"unavailable: {e}"
    return {
        "study": name,
        "family": study.user_attrs.get("family"),
        "backend": study.user_attrs.get("backend"),
        "modelled": study.user_attrs.get("modelled"),
        "workload": study.user_attrs.get("workload"),
        "key": study.user_attrs.get("key"),
        "trials": len(trials),
        "states": states,
        "best_us": best.value if best else None,
        "best_spread_us": best.user_attrs.get("spread_us") if best else None,
        "best_knobs": best.user_attrs.get("knobs") if best else None,
        "best_trial": best.number if best else None,
        "default_us": default.value if default else None,
        "speedup_vs_default": (default.value / best.value) if (best and default and best.value) else None,
        "importances": importances,
        "importance_note": importance_note,
        "failed": [{"trial": t.number, "error": t.user_attrs.get("error")} for t in trials if t.state == TrialState.FAIL][:20],
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
