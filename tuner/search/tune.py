"""`tune_profiles`: turn Optuna studies into stored profiles.

For each transport family found on the fabric × model shape × token bucket (smallest first): make the
backend (the fabric model on a preset, or real runs of `moetune bench ep`), open or resume the study
(`study.py`), run it, then write the winner through `store.put_profile`.

- Facts: discovery's `FabricFacts` of this node, or `PresetFacts` standing for a modelled fabric.
- Across token buckets: the nearest smaller bucket's study of the same key (from this run or an earlier
  one) warm-starts the next with its best settings (see `study.neighbour_bucket`).
- Writing: with the local backend the winner is measured again side by side with the incumbent (or the
  policy default); it replaces the incumbent only when the gain beats the larger spread of the two. A current
  profile whose knobs contradict its family (no lookup serves it) is no incumbent: it is replaced, never kept.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import optuna

from moetune.runtime.config import MAX_TRIALS
from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import (
    COMM_METRIC,
    LAYER_METRIC,
    PRESET_PREFIX,
    ProfileKey,
    ProfileRecord,
    contradiction_reason,
    is_preset_fingerprint,
    metric_of_backend,
    nearest_bucket,
    runtime_refusal,
)
from moetune.runtime.shapes import ModelShape
from moetune.tuner.search.backends import (
    BenchmarkBackend,
    Measurement,
    TuneWorkload,
    provenance_fields,
    too_few_samples,
)
from moetune.tuner.search.local_backend import LocalBackend
from moetune.tuner.search.model_backend import (
    ModelBackend,
    preset_family,
    preset_gpus_per_node,
    preset_link_rates,
    space_peer_sets,
)
from moetune.tuner.search.policy import Policy, PolicyError, load_policy
from moetune.tuner.search.progress import NoProgress, Progress
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.storage import default_storage_url, make_storage, redact_url, storage_id
from moetune.tuner.search.study import (
    BucketPrior,
    StudyResult,
    neighbour_bucket,
    open_study,
    run_study,
    study_config,
    study_model_name,
    study_name,
)
from moetune.tuner.search.trials import completed, failed_before, finished_ids, finished_trials
from moetune.tuner.search.workers import ASKED
from moetune.tuner.store import StoreError
from moetune.tuner.store import now as store_now

if TYPE_CHECKING:
    from moetune.tuner.fabric_model.presets import Preset

log = logging.getLogger("moetune.tuner.search.tune")


# ---------------------------------------------------------------------------------------------------
# facts


class FamilyLike(Protocol):
    """A transport family as facts list it (`TransportFamily` of discovery, `_Fam` of a preset)."""

    @property
    def name(self) -> str: ...


class TuneFacts(Protocol):
    """What tuning reads from facts: discovery's `FabricFacts` or `PresetFacts` (test fakes follow it)."""

    @property
    def fingerprint(self) -> str: ...

    @property
    def software_hash(self) -> str: ...

    @property
    def software(self) -> Mapping[str, str]: ...

    @property
    def gpu_count(self) -> int: ...

    @property
    def transports(self) -> Sequence[FamilyLike]: ...

    @property
    def link_rates(self) -> Mapping[str, float]: ...


@dataclass
class PresetFacts:
    """Facts standing for a modelled fabric (a fabric-model preset, not this node)."""

    preset: Preset
    name: str
    family: str
    gpus_per_node: int
    link_rates: dict[str, float]

    @classmethod
    def from_preset(cls, preset: Preset) -> PresetFacts:
        return cls(preset, preset.name, preset_family(preset), preset_gpus_per_node(preset), preset_link_rates(preset))

    @property
    def transports(self) -> list[_Fam]:
        return [_Fam(self.family, f"modelled by preset {self.name}")]

    @property
    def fingerprint(self) -> str:
        # The digest is of the preset's content, not its name: a calibrated or edited copy keeps the shipped
        # preset's name, and must not keep (or replace) the other fabric's profiles under one key.
        from moetune.tuner.fabric_model.presets import preset_digest

        return f"{PRESET_PREFIX}{self.name}:{preset_digest(self.preset)}"

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


def family_names(facts: TuneFacts) -> list[str]:
    """The transport families of `facts`, in order, each once."""
    return list(dict.fromkeys(t.name for t in facts.transports))


def facts_link_rates(facts: TuneFacts) -> dict[str, float]:
    """Link rates for the analytic priors: link_gbps (GB/s), nic_gbit (Gbit/s); empty where unknown."""
    return dict(facts.link_rates)


# ---------------------------------------------------------------------------------------------------
# tune_profiles


@dataclass
class TuneResult:
    record: ProfileRecord | None
    written: bool
    reason: str
    study: StudyResult
    # the time budget (timeout_s) ended the study before it held the trials asked (0 of them: never started)
    budget_ended: bool = False
    # nothing written, and a current profile stored before this run stands for the key (False: the key has none)
    kept: bool = False
    # `stop` said so before the side-by-side check: the study ran, nothing of it was compared or stored
    stopped: bool = False
    # what the backend's numbers are (its class's provenance), whether or not a record was made
    provenance: str = "preset"
    # the time budget's share this study was given (seconds; None: no budget) and the seconds it took, side-by-side
    # check included: a budget is shared over the studies of one call (tune_profiles_detailed)
    budget_s: float | None = None
    used_s: float | None = None

    @property
    def runtime_refusal(self) -> str | None:
        """Why no run of this runtime can take the record (a what-if report: its transport cannot serve the key's EP
        size; autoload passes it over), None when one can or nothing was recorded."""
        return runtime_refusal(self.record.key, self.record.knobs) if self.record is not None else None

    @property
    def effective_provenance(self) -> str:
        """The record's provenance as the runtime takes it, else (nothing recorded) the backend's."""
        return str(self.record.effective_provenance) if self.record is not None else self.provenance

    @property
    def stored(self) -> str:
        """What the store holds for the key after this run: "new" (this run's winner), "kept" (the current profile
        stored before, left as it is) or "none" (nothing written, and no earlier profile for the key)."""
        return "new" if self.written else "kept" if self.kept else "none"


def make_backend(backend: str | BenchmarkBackend, preset: str | None = None, **local_kw: Any) -> BenchmarkBackend:
    if isinstance(backend, BenchmarkBackend):
        return backend
    if backend == "model":
        if preset is None:
            raise ValueError("the model backend needs --preset: a preset name, or a calibrated preset file of "
                             "this node (`moetune model calibrate --out FILE`) with --node-model")
        return ModelBackend(preset)
    if backend == "local":
        local_kw.pop("facts", None)
        return LocalBackend(**local_kw)
    raise ValueError(f"unknown backend {backend!r}; expected model or local")


def gloo_ranks_problem(world: int, gpu_count: int, cpus: int | None = None) -> str:
    """Why `world` gloo ranks (a node without GPUs: one CPU process each) cannot be measured on `cpus` CPUs ('' when
    they can): more ranks than CPUs share them, and a trial takes minutes (8 ranks on 2 CPUs)."""
    cpus = cpus or os.cpu_count() or 1
    if gpu_count > 0 or world <= cpus:
        return ""
    return f"{world} gloo ranks (this node has no GPU) on {cpus} CPUs: at most {cpus} here"


def tune_profiles(store: Any, facts: TuneFacts | None, **options: Any) -> list[ProfileRecord]:
    """Tune each family × shape × token bucket; write the winners through `store.put_profile`.

    Takes the keywords of `tune_profiles_detailed` and returns the best record of every study (status
    "current" when the store took it as current); that function also gives the reasons and study summaries.
    """
    return [r.record for r in tune_profiles_detailed(store, facts, **options) if r.record is not None]


class _Plan(NamedTuple):
    be: BenchmarkBackend  # the backend asked for, or its node-model form (--node-model)
    facts: Any
    ep_size: int
    gpus_per_node: int
    policies: dict[str, Policy]
    # {family: its bound} of the families left out because their transport cannot serve this EP group
    # (`BenchmarkBackend.group_problem`): what the CLI's table and --json, and the bring-up's report, list
    left_out: dict[str, str]


TunePlan = _Plan  # the public name of what `check_tune` returns and `tune_profiles_detailed(plan=)` takes


def _plan(be: BenchmarkBackend, facts: TuneFacts | None, *, models: list[ModelShape], preset: str | None,
          ep_size: int | None, nodes: int, families: Sequence[str] | None, policy_override: str | Path | None,
          node_model: bool) -> _Plan:
    """What a tune will run (its facts, EP size and the families' policies), or the ValueError that refuses it: one
    function for the tune and `check_tune` (the CLI's check before it creates any file), so they cannot disagree."""
    named_by = "--family"  # who asked for the families: said when one is not found
    if isinstance(be, ModelBackend) and be.preset is not None and preset is not None:
        if node_model and facts is not None:
            # A calibrated model of THIS node: profiles carry the node's key and say they are its model
            # (the label decides their provenance, node_model, not a preset's); only its family is tuned.
            # Only a preset calibrated on this fingerprint may be labelled so (node_model outranks preset).
            from moetune.tuner.fabric_model.presets import node_model_refusal

            why = node_model_refusal(be.preset, facts.fingerprint)
            if why:
                raise ValueError(f"--node-model: {why}")
            be = be.as_node_model(facts.fingerprint)
            fam = preset_family(be.preset)
            if families is None:
                families, named_by = [fam], f"the family the calibrated preset models (--node-model {preset})"
            elif fam not in families:
                raise ValueError(f"the calibrated preset models family {fam}, not {', '.join(families)} (--family)")
        else:
            facts = PresetFacts.from_preset(be.preset)
    if facts is None:
        raise ValueError("no fabric facts: run discovery or give a preset")
    # no GPU: the two host processes a bring-up measures there (EP 1 exchanges nothing: a 10 µs "profile")
    gpn = facts.gpu_count or 2
    if ep_size is None:  # a local measurement stands for the ranks it launches on this node, nothing else
        ep_size = be.world if be.world is not None and nodes == 1 else int(gpn) * nodes
    if ep_size % nodes:
        raise ValueError(f"ep_size {ep_size} is not divisible by nodes {nodes}")
    gpus_per_node = ep_size // nodes
    for m in models:
        m.check_ep(ep_size)
    fams = family_names(facts)
    if families and "megakernel" in families:  # an engine family: asked for by name, on a node that can run it
        from moetune.tuner.fabric.facts import FabricFacts
        from moetune.tuner.fabric.families import megakernel_family

        ok, why = megakernel_family(facts) if isinstance(facts, FabricFacts) else (False, "a modelled fabric has no GPU")
        if not ok:
            raise ValueError(f"family megakernel cannot be tuned here: {why}")
        if ep_size != 1 or nodes != 1:
            raise ValueError(f"family megakernel runs on one GPU: tune it with ep_size 1 and nodes 1, got {ep_size}, {nodes}")
        fams = [*fams, "megakernel"]
    if families:
        missing = list(dict.fromkeys(f for f in families if f not in fams))  # a name given twice is said once
        if missing:
            what = (f"transport family {missing[0]} was" if len(missing) == 1
                    else f"transport families {', '.join(missing)} were")
            raise ValueError(f"{what} not found on this fabric ({named_by}; found: {', '.join(fams) or 'none'})")
        fams = [f for f in fams if f in families]
    policies: dict[str, Policy] = {}
    unmeasurable: list[str] = []  # said where nothing is left to tune (the log line alone is not shown)
    for f in fams:
        if not be.supports(f):
            log.info("family %s skipped: backend %s cannot measure it", f, be.label)
            unmeasurable.append(f)
            continue
        try:
            policies[f] = load_policy(f, policy_override)
        except PolicyError as e:
            if "no policy for transport family" in str(e):
                log.warning("family %s skipped: %s", f, e)
                continue
            raise
    if not policies:
        cannot = f"; it cannot measure {', '.join(unmeasurable)}" if unmeasurable else ""
        raise ValueError(f"no transport family to tune (found: {', '.join(fams) or 'none'}; backend {be.label}{cannot})")
    why = be.refusal(ep_size=ep_size, nodes=nodes, families=list(policies), gpu_count=facts.gpu_count)
    if why:
        raise ValueError(why)
    # A family whose transport cannot serve this EP group (nvlink beyond MAX_WORLD ranks, ...): each of its trials
    # would fail on that bound, so it is left out here; with none left the tune is refused before any study.
    bounds = {f: be.group_problem(f, ep_size=ep_size, nodes=nodes) for f in policies}
    cannot = {f: b for f, b in bounds.items() if b}
    if cannot and len(cannot) == len(policies):
        raise NoFamilyServesGroup(ep_size, nodes, f"no transport family considered ({', '.join(policies)}) can "
                                  "serve it: " + "; ".join(f"{f}: {b}" for f, b in cannot.items()))
    for f, b in cannot.items():
        log.warning("%s", group_left_out_note(f, b, ep_size, nodes))
        del policies[f]
    return _Plan(be, facts, ep_size, gpus_per_node, policies, cannot)


class NoFamilyServesGroup(ValueError):
    """No family the tune considers can serve its EP group (each one's transport bound refuses it). A ValueError, as
    every refusal of the tune's settings (the CLI says it); its own type so that the daemon's re-tune refuses that
    one group (`why`: what is wrong, without this call's "nothing was stored") and still re-tunes the others."""

    def __init__(self, ep_size: int, nodes: int, why: str) -> None:
        self.why = why
        super().__init__(f"EP size {ep_size} on {nodes} node(s): {why}. Nothing was tuned or stored")


def group_left_out_note(family: str, reason: str, ep_size: int, nodes: int) -> str:
    """How a family left out of a tune for its EP group (`TunePlan.left_out`) is said: the log, the tune's table, the
    bring-up's output and report use these words, so they say one thing."""
    return f"family {family} left out: it cannot serve EP size {ep_size} on {nodes} node(s): {reason}"


def check_tune(facts: TuneFacts | None, *, models: list[ModelShape], backend: str | BenchmarkBackend = "model",
               preset: str | None = None, ep_size: int | None = None, nodes: int = 1,
               families: Sequence[str] | None = None, policy_override: str | Path | None = None,
               node_model: bool = False, local_options: Mapping[str, Any] | None = None) -> TunePlan:
    """The ValueError `tune_profiles_detailed` would refuse these settings with before its first study (a family
    not on this fabric, an EP size the models cannot split, ...), raised without opening or creating anything: the
    CLI asks before it makes the profile database, the studies file and their lock.
    Returns the plan it built (backend, facts, EP size, policies): handed to `tune_profiles_detailed(plan=...)`
    it is not built again, so its warnings (a forced-fit preset, a skipped family) are said once."""
    be = make_backend(backend, preset, facts=facts, **dict(local_options or {}))
    return _plan(be, facts, models=models, preset=preset, ep_size=ep_size, nodes=nodes, families=families,
                 policy_override=policy_override, node_model=node_model)


def tune_profiles_detailed(store: Any, facts: TuneFacts | None, *, models: list[ModelShape], tokens: list[int],
                           backend: str | BenchmarkBackend = "model", preset: str | None = None, trials: int = 40,
                           timeout_s: float | None = None, ep_size: int | None = None, nodes: int = 1,
                           progress: Progress | None = None, storage: str | None = None, seed: int | None = 0,
                           families: Sequence[str] | None = None, policy_override: str | Path | None = None,
                           routing: str = "uniform", local_options: Mapping[str, Any] | None = None,
                           on_trial: Callable[[str, optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
                           node_model: bool = False, study_tag: str = "", recheck: bool = True,
                           stop: Callable[[], bool] | None = None, plan: TunePlan | None = None,
                           on_left_out: Callable[[str, str], None] | None = None) -> list[TuneResult]:
    """`plan`: what `check_tune` returned for these same settings (its backend, facts, EP size and policies), used
    as it is instead of being built again (which would log its warnings a second time).
    `on_left_out(family, bound)`: told of each family the plan left out, its transport unable to serve the EP group
    (`TunePlan.left_out`), before the first study: a caller without the plan (the daemon's re-tune) says them.
    `study_tag` (letters, digits, `_`, `-`) goes into every study's name: a run that must not resume the
    finished studies of the same settings (`moetune profile --restart`) tunes in studies of its own.
    `recheck=False`: the study's best is returned (`record`), not stored, without `_write_profile`'s side-by-side
    comparison with the incumbent and the policy default, for a caller that makes that comparison itself and
    stores what wins (the bring-up's compare stage), so it is not measured twice nor served unchecked.
    `stop`: asked before every study and before its side-by-side check (a minute a key on a CPU node); once it says
    True the results so far are returned, the study at hand with no record (a cancelled daemon job).
    `timeout_s`: the wall-clock budget of the whole call, shared over its studies (one per family, model and token
    bucket): each study, in turn, gets the time left divided by the studies left (itself included), so time a study
    does not use passes on to the next ones. A study that does not finish its trials in its share is cut there (a
    rerun resumes it); before, the first study could take the whole budget on every rerun, and the later buckets
    never started. Each result says its share and the time it took (`budget_s`, `used_s`)."""
    if not 1 <= trials <= MAX_TRIALS:  # the bound the CLI, config and plan keep: 10**20 trials never ends
        raise ValueError(f"trials must be 1 to {MAX_TRIALS}, got {trials}")
    if not all(c.isascii() and (c.isalnum() or c in "_-") for c in study_tag):
        raise ValueError(f"study_tag must be letters, digits, '_' or '-', got {study_tag!r}")
    if not models or not tokens:
        raise ValueError("nothing to tune: give at least one model and one token count")
    if any(t < 1 for t in tokens):
        raise ValueError(f"token counts must be >= 1, got {tokens}")
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if plan is None:
        plan = check_tune(facts, models=models, backend=backend, preset=preset, ep_size=ep_size, nodes=nodes,
                          families=families, policy_override=policy_override, node_model=node_model,
                          local_options=local_options)
    be, facts, ep_size, gpus_per_node, policies = plan.be, plan.facts, plan.ep_size, plan.gpus_per_node, plan.policies
    if on_left_out is not None:
        for fam, why in plan.left_out.items():
            on_left_out(fam, why)
    url = storage or default_storage_url(store.path if store is not None else None)
    st = make_storage(url, own=storage is None)  # the default studies file is moetune's own (WAL)
    rates = facts_link_rates(facts)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    bar: Progress = progress or NoProgress()
    out: list[TuneResult] = []
    n_studies = len(policies) * len(models) * len({nearest_bucket(t) for t in tokens})
    try:
        for fam, pol in policies.items():
            for model in models:
                # one study a bucket: 16 and 17 tokens are one key (each count was its own study of that key, and
                # whichever ran last replaced the others' profile)
                for bucket in sorted({nearest_bucket(t) for t in tokens}):
                    if stop is not None and stop():
                        return out
                    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family=fam,
                                     ep_size=ep_size, nodes=nodes, hidden=model.hidden, intermediate=model.intermediate,
                                     experts=model.experts, topk=model.topk, dtype=model.dtype, token_bucket=bucket)
                    wl = TuneWorkload(model=model, tokens=bucket, nodes=nodes, gpus_per_node=gpus_per_node, routing=routing)
                    be.for_family(fam, pol.error_budget)
                    # no knob acts on what is measured here (the megakernel's decode kernel): the default only
                    inert = be.inert_reason(fam, wl)
                    pinned = be.pinned_knobs(pol.transport) | (frozenset(pol.knobs) if inert else frozenset())
                    # the bucket's token count bounds proxy/ibgda's PUT grid (chunks and group sizes that are
                    # distinct runs at this many rows per peer; the study config says so: `grid_rule`)
                    # and as the fabric model charges them: its peer sets (a preset's NVLink peers apart)
                    space = SearchSpace(pol, experts=model.experts, ep_size=ep_size, link_rates=rates,
                                        pinned=pinned, tokens=bucket, topk=model.topk, routing=routing,
                                        hidden=model.hidden, **space_peer_sets(be, pol.defaults, wl))
                    if isinstance(be, ModelBackend):
                        # A workload the model cannot run at all (too many nodes for the preset, ...) is
                        # one clear error, not a study of failed trials.
                        m = be.evaluate(pol.defaults, wl)
                        if not m.ok and not m.infeasible:
                            raise ValueError(f"{be.label} cannot evaluate {model.name} on {nodes} node(s) × "
                                             f"{gpus_per_node} GPUs at S={bucket}: {m.error}")
                    config = study_config(space, be, wl)  # other routing/policy/metric: another study
                    if inert:  # a fresh one-trial study each time: never a resumed search or an old number
                        config = f"{config}-default-only-{secrets.token_hex(4)}"
                    if study_tag:  # in the config: the neighbour bucket's study is the same run's too
                        config = f"{config}-{study_tag}"
                    # one shape, one name (`custom:2048,768,128,8` is qwen3-30b): its study, and its neighbour's
                    model_name = study_model_name(model)
                    name = study_name(key, be.label, model_name, config)
                    # a fair share of what is left: the time left over the studies left (this one included)
                    now = time.monotonic()
                    left = None if deadline is None else max(0.0, deadline - now) / max(1, n_studies - len(out))
                    res = _tune_one(store, st, url, name, key, space, be, wl, trials=1 if inert else trials,
                                    timeout_s=left, seed=seed, bar=bar, facts=facts, on_trial=on_trial,
                                    neighbour=None if inert else neighbour_bucket(st, key, be.label, model_name,
                                                                                  config), inert=inert,
                                    recheck=recheck, stop=stop)
                    res = replace(res, budget_s=left, used_s=time.monotonic() - now)
                    out.append(replace(res, reason=f"{res.reason} ({inert})") if inert else res)
    finally:
        if be is not backend:
            be.close()  # built here (a backend name): end its persistent bench workers
        # the studies file's engine is this call's: disposed here, not by a finaliser at some later point (whose WAL
        # checkpoint rewrote the files then), and not kept by a daemon after each re-tune job
        st.engine.dispose()
    return out


def _tune_one(store: Any, st: optuna.storages.BaseStorage, url: str, name: str, key: ProfileKey,
              space: SearchSpace, be: BenchmarkBackend, wl: TuneWorkload, *, trials: int, timeout_s: float | None,
              seed: int | None, bar: Progress, facts: TuneFacts,
              on_trial: Callable[[str, optuna.Study, optuna.trial.FrozenTrial], None] | None,
              neighbour: BucketPrior | None = None, inert: str = "", recheck: bool = True,
              stop: Callable[[], bool] | None = None) -> TuneResult:
    until = None if timeout_s is None else time.monotonic() + timeout_s  # this study's end of the time budget
    started = store_now()  # the run's row is made once the study is open (or at its end: `finally`)
    run_id: int | None = None
    repeat = row_asked = acted = False  # acted: this run re-measured or wrote a profile (a repeat then has a row)
    status = "failed"
    raising = False  # an exception ends the run: a store error closing its row must not replace it (`finally`)
    result: StudyResult | None = None
    study: optuna.Study | None = None
    had: set[int] = set()  # the study's finished trials before this run: not this run's (`_ran_here`)
    try:
        # on SQLite open_study registers this process and fails only dead processes' running trials
        study = open_study(name, st, seed=seed, n_startup_trials=min(10, max(3, trials // 5)))
        had = finished_ids(study._storage, study._study_id)
        study.set_user_attr("key", key.to_dict())
        # a study of failed trials only runs its whole budget again (`failed_before`): its bar counts from 0
        base = failed_before(study)
        # The study holds its trials and a run of it is recorded done: run again (`tune`/`profile` a second time) it
        # runs no trial, and a second "done" row recorded the same work twice. The first row stands for it: this run
        # makes a row only where it ends otherwise (failed, interrupted), which the history must show (`finally`).
        repeat = (store is not None and finished_trials(study) - base >= trials
                  and store.has_done_run(study_name=name, storage=redact_url(url)))
        if store is not None and not repeat:
            row_asked = True  # a store that cannot make it now (busy) is not asked again at the end
            run_id = store.start_run(study_name=name, storage=redact_url(url), backend=be.label, started=started)
        task = bar.add(f"{key.transport_family} {wl.model.name} S={wl.tokens}", trials, finished_trials(study) - base)

        noted = [-1]  # the trials this run finished that its row holds

        def cb(s: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
            done, best = finished_ids(s._storage, s._study_id), _best_value(s)
            bar.update(task, len(done) - base, best)  # the bar: the study's progress toward its budget
            mine = _ran_here(s, done, had)
            if run_id is not None and mine != noted[0]:
                noted[0] = mine
                _note_run(store, run_id, mine, best)
            if on_trial is not None:
                on_trial(name, s, t)

        extra = []
        if neighbour is not None:
            study.set_user_attr("neighbour_bucket", {"bucket": neighbour.bucket, "study": neighbour.study_name})
            # the smaller bucket's sets, projected into this bucket's space (its grid may differ: proxy/ibgda
            # offer chunk and group sizes by the PUTs per peer at this token count)
            seen: set[Knobs] = set()
            for i, k in enumerate(neighbour.top()):
                try:
                    kp = k if space.feasible(k)[0] else space.project(k)
                except KnobError:
                    continue
                if kp not in seen and space.feasible(kp)[0]:
                    seen.add(kp)
                    extra.append((f"bucket_transfer:{neighbour.bucket}:{i}", kp))
        # Cross-bucket pruning pays where a measurement is expensive (the local backend: a process launch
        # per run); a model prediction costs about a millisecond, so there every sampled point is evaluated.
        cross = neighbour if be.remeasures else None
        before = finished_trials(study)
        result = run_study(study, space, be, wl, trials=trials, timeout_s=timeout_s, callbacks=[cb], extra_warm=extra,
                           cross=cross)
        bar.update(task, finished_trials(study) - base, _best_value(study))
        # the side-by-side re-measurement runs the candidates again (minutes on a GPU node): with the budget spent
        # before this run finished a trial of its own (a resumed study with its trials done) it would only overrun
        # --timeout, so nothing is written and a rerun does it. A search the budget cut midway is checked and
        # stored as before: skipping it stored nothing, run after run.
        spent = (until is not None and time.monotonic() >= until and recheck and not inert
                 and be.remeasures and result.best_knobs is not None
                 and finished_trials(study) == before)
        stopped = False
        if spent:
            record, written, reason = None, False, "time budget spent before the side-by-side check; rerun to finish"
        elif stopped := stop is not None and stop():
            record, written, reason = None, False, "stopped before the side-by-side check"
        else:
            # a backend that re-measures does so side by side here (minutes on GPUs), and may write the incumbent's
            # fresh number even where it returns written=False: a repeat that got this far is a run of its own
            acted = recheck and not inert and be.remeasures and result.best is not None
            # a step of its own in the progress: after the study's last trial it ran for minutes (46 s of two gloo
            # ranks on a CPU node) with no line, the study's bar finished and a piped log silent
            # (short: a terminal's bars share one description width, and a long one cut the elapsed time off)
            check = (bar.add(f"{key.transport_family} {wl.model.name} S={wl.tokens}: side-by-side check", 1)
                     if acted and result.best_knobs is not None else None)
            record, written, reason = _write_profile(store, key, be, result, facts, default=space.policy.defaults,
                                                     inert=inert, recheck=recheck)
            if check is not None:
                bar.update(check, 1)
            acted = acted or written
        status = "done" if result.best_knobs is not None else "no_result"
        # fewer finished trials than asked happens only when the budget ran out (an interruption raises)
        cut = spent or (timeout_s is not None and result.trials < trials)
        if cut and result.best is None:
            reason = f"{reason} before the time budget ended ({result.trials} of {trials} trials ran)"
        # after the write: an incumbent that held its own (or a measured one a prediction did not displace) is kept;
        # one no lookup serves stands for nothing (`served_incumbent`)
        kept = not written and store is not None and served_incumbent(store, key)[0] is not None
        return TuneResult(record, written, reason, result, budget_ended=cut, kept=kept, stopped=stopped,
                          provenance=be.provenance)
    except KeyboardInterrupt:
        status, raising = "interrupted", True
        raise
    except BaseException:
        raising = True
        raise
    finally:
        if store is not None and run_id is None and not row_asked and not (repeat and status == "done" and not acted):
            # it ended by an error or an interrupt before its row was made (opening the study), or a repeat did, or a
            # repeat re-measured or wrote a profile (only a pure no-op rerun leaves the first row to stand for it): the
            # history shows it; a store that cannot be written now does not hide the error that ended the run
            try:
                run_id = store.start_run(study_name=name, storage=redact_url(url), backend=be.label, started=started)
            except StoreError as e:
                log.debug("run of %s ended %s; not recorded: %s", name, status, e)
        if store is not None and run_id is not None:
            best_value = result.best.median_us if result is not None and result.best is not None else None
            try:
                store.finish_run(run_id, status=status, trials=_ran_or_0(study, had), best_value=best_value)
            except StoreError as e:
                if not raising:
                    raise
                # a full disk's error replaced the error or the Ctrl-C that ended the run; the row stays 'running'
                # with its owner recorded, whose process is gone: the next tune, profile or daemon start marks it
                # interrupted (Store.close_orphaned_runs)
                log.warning("run of %s ended %s; its row could not be closed: %s", name, status, e)


def _note_run(store: Any, run_id: int, trials: int, best: float | None) -> None:
    """The count reached, in the run's row as trials finish (what a run killed before its `finish_run` keeps). Best
    effort: the study holds the trials, and a store that cannot be written fails the profile's write itself."""
    try:
        store.note_run(run_id, trials=trials, best_value=best)
    except StoreError as e:
        log.debug("tuning run %s: trial count not recorded: %s", run_id, e)


def _ran_here(study: optuna.Study, done: set[int], had: set[int]) -> int:
    """The trials of `done` (the study's finished ones) this process ran since the run began (`had`: those finished
    before): what the run's row counts. Not the study's: a resumed study's earlier runs, and the other workers of a
    study shared by nodes, ran the rest (each row counted them again)."""
    sid = storage_id(study._storage)
    return sum(1 for i in done - had if (sid, i) in ASKED)


def _ran_or_0(study: optuna.Study | None, had: set[int]) -> int:
    """The trials this run finished (`_ran_here`), whether it ended done or not (interrupted, failed: it recorded 0
    though trials had finished); 0 where the study was not opened or cannot be read."""
    if study is None:
        return 0
    try:
        return _ran_here(study, finished_ids(study._storage, study._study_id), had)
    except Exception:  # the storage that failed the run: its row still ends
        return 0


def _best_value(study: optuna.Study) -> float | None:
    done = completed(study)
    return min(t.value for t in done) if done else None  # type: ignore[type-var]


def _beats(a: Measurement, b: Measurement) -> bool:
    """Whether `a` is faster than `b` by more than the noise of either (both measured in one comparison)."""
    return a.ok and b.ok and b.median_us - a.median_us > max(a.spread_us, b.spread_us)


# What is stored when the search's best was measured again in one comparison (`BenchmarkBackend.compare`) beside
# the incumbent and the policy default: `_write_profile` and the bring-up's compare stage decide by these rules.
@dataclass
class SideBySide:
    knobs: Knobs | None  # what to store; None: the incumbent holds its own (its fresh number is `incumbent`)
    meas: Measurement | None
    why: str = ""  # why the default or the incumbent stays ("" where the search's best is stored)
    force: str | None = None  # put_profile's force_reason: the incumbent lost in this comparison
    incumbent: Measurement | None = None


def metric_force(current: ProfileRecord | None, label: str, force: str | None) -> str | None:
    """`force` (a side-by-side's own force_reason), else, where the current profile's number is of another metric
    than `label` measures (a bring-up's round trip, a tune's whole layer: `metric_of_backend`), the reason that lets
    this comparison's result replace it: the settings compared were all measured in the new metric, and the store
    never compares the two numbers (without it the result was kept as superseded history, run after run). Only a
    whole layer replaces a round trip this way, never the reverse."""
    if force is not None or current is None or current.provenance != "measured":
        return force
    old, new = metric_of_backend(current.backend), metric_of_backend(label)
    if old == new or (old == LAYER_METRIC and new == COMM_METRIC):
        # a round trip never displaces a whole layer's number (the tuned layer, what a job runs): the store keeps
        # it and files the round trip as history
        return None
    return "its knobs, the default and the search's best measured side by side anew"


def side_by_side(knobs: Knobs, incumbent: Knobs | None, default: Knobs | None,
                 got: Mapping[Knobs, Measurement]) -> SideBySide:
    """The rules of a side-by-side choice (`got`: the comparison's measurement of each setting; that of `knobs` is
    ok). A choice that does not beat the default beyond the noise gives way to the default; an incumbent of other
    knobs stays where the choice does not beat it beyond the noise and it beats the default itself (one that ties
    the default is replaced). Samples too few to see the noise call no gain: the default is chosen over the search's
    best, and an incumbent of other knobs stays as it is."""
    meas = got[knobs]
    few = too_few_samples(*got.values())

    def beats(a: Measurement, b: Measurement) -> bool:
        return not few and _beats(a, b)

    kept_default = ""
    md = got.get(default) if default is not None else None
    if md is not None and md.ok and knobs != default and not beats(meas, md):
        # "within noise" only where the search's best was faster at all: 7x slower is no gain within the noise
        verdict = (few if few else "the winner's gain is within noise" if meas.median_us < md.median_us
                   else "the search's best is no faster")
        kept_default = (f"the policy default re-measured side by side at {md.median_us:.1f} µs vs "
                        f"{meas.median_us:.1f} µs: {verdict}, the default stored")
        knobs, meas = default, md  # type: ignore[assignment]
    mi = got.get(incumbent) if incumbent is not None else None
    if mi is None or not mi.ok or incumbent == knobs:
        return SideBySide(knobs, meas, kept_default)
    over_default = incumbent == default or md is None or not md.ok or beats(mi, md)
    if few or (not beats(meas, mi) and over_default):
        return SideBySide(None, None, f"incumbent re-measured side by side at {mi.median_us:.1f} µs vs "
                                      f"{meas.median_us:.1f} µs: " + (f"{few}, incumbent kept" if few else
                                                                      "no gain beyond the noise, incumbent kept"),
                          incumbent=mi)
    # the ones compared ran in one comparison: the stored number of the incumbent is not the rival
    force = (f"beat the incumbent side by side: {meas.median_us:.1f} µs vs {mi.median_us:.1f} µs"
             if beats(meas, mi) else
             f"the incumbent ({mi.median_us:.1f} µs) did not beat the policy default side by side")
    return SideBySide(knobs, meas, kept_default, force)


def _write_profile(store: Any, key: ProfileKey, be: BenchmarkBackend, result: StudyResult,
                   facts: TuneFacts, default: Knobs | None = None, inert: str = "",
                   recheck: bool = True) -> tuple[ProfileRecord | None, bool, str]:
    """Store the study's winner, measured again in one comparison beside the incumbent and the policy `default`
    (a local measurement; a prediction is stored as the store's rules say). A winner that does not beat the default
    beyond the noise gives way to the default; an incumbent of other knobs stays where the choice does not beat it
    beyond the noise and it beats the default itself (its fresh number is stored where it came from this backend
    or was a prediction). `inert` (why no knob acts at this size: the study measured the default only) replaces an
    incumbent of other knobs, whatever its number: they cannot act. `recheck=False`: no comparison and nothing
    stored here (the record is returned, unwritten: the caller makes the comparison and stores what wins)."""
    if result.best_knobs is None or result.best is None:
        return None, False, "no successful trial"
    knobs, meas = result.best_knobs, result.best
    incumbent, passed_over = served_incumbent(store, key)
    # Say what the numbers are: a local measurement on this node, or a prediction (node model / preset).
    origin = provenance_fields(be)  # what the backend's class declares, never what its label says
    provenance = origin["provenance"]
    on_node = provenance != "preset"  # measured here, or predicted by this node's own calibrated model
    # where the numbers come from: this node's fingerprint, or the preset's `preset:NAME:DIGEST` (the digest of its
    # content: an edited copy of a shipped preset keeps the name, and must not read as the shipped one's)
    measured_on = facts.fingerprint if on_node or is_preset_fingerprint(facts.fingerprint) else ""
    software = {str(k): str(v) for k, v in dict(facts.software).items()}

    def record(kn: Knobs, m: Measurement) -> ProfileRecord:
        now = store_now()  # to the microsecond: one second held a replaced row and the re-measurement replacing it
        # (with the NCCL/NVSHMEM/FI environment the ranks measured in; a prediction records none)
        return ProfileRecord(key=key, knobs=kn, latency_us=float(m.median_us), spread_us=float(m.spread_us),
                             status="current", software_versions=dict(software), created=now, updated=now,
                             measured_on=measured_on, routing=result.workload.routing, **origin)

    if not recheck:
        # the caller (the bring-up's compare stage) measures this side by side and is the only writer: a best stored
        # here unchecked would be current (served) until then, and after an interruption stay so
        return record(knobs, meas), False, ("not stored yet: the side-by-side check with the policy default and "
                                            "the current profile decides what is stored")
    side_by_side_why: str | None = None
    kept_default = ""
    if inert:
        if incumbent is not None and incumbent.knobs != knobs:
            side_by_side_why = inert
    elif be.remeasures:
        # Measure the winner again beside the incumbent and the policy default: same conditions, one comparison.
        inc = incumbent.knobs if incumbent is not None else None
        cands = list(dict.fromkeys(k for k in (knobs, inc, default) if k is not None))
        got = dict(zip(cands, be.compare(cands, result.workload, rounds=max(2, be.repeats)), strict=True))
        failed = ""
        if not got[knobs].ok:
            md = got.get(default) if default is not None else None
            if md is None or not md.ok:
                return None, False, f"the winner failed when measured again: {got[knobs].error}"
            # a failed winner gives way to the default measured beside it (the bring-up's compare stage's rule): the
            # default, or an incumbent that beats it, is stored with this comparison's number
            failed = f"the search's best failed when measured again ({got[knobs].error})"
            knobs = default  # type: ignore[assignment]
        choice = side_by_side(knobs, inc, default, got)
        if choice.knobs is None or choice.meas is None:  # the incumbent held its own
            why, mi = choice.why, choice.incumbent
            force = metric_force(incumbent, be.label, None)
            if (store is not None and incumbent is not None and mi is not None
                    and (incumbent.backend == be.label or incumbent.provenance != "measured" or force)):
                # its stored number may predate a change the fingerprint does not see (or was a prediction, or
                # another metric's): the fresh measurement replaces it
                written, how = store.put_profile(record(incumbent.knobs, mi), force_reason=force)
                why += f" ({how})" if written else ""
            return None, False, f"{failed}; {why}" if failed else why
        knobs, meas, kept_default = choice.knobs, choice.meas, choice.why
        if failed:
            kept_default = f"{failed}; the policy default re-measured side by side at {meas.median_us:.1f} µs stored"
        side_by_side_why = metric_force(incumbent, be.label, choice.force)
    rec = record(knobs, meas)
    if store is None:
        return rec, False, "no store"
    written, reason = store.put_profile(rec, force_reason=side_by_side_why)
    if not written:
        rec.status = "superseded"
    why = "; ".join(w for w in (reason, kept_default, passed_over) if w)
    return rec, written, why


def served_incumbent(store: Any, key: ProfileKey) -> tuple[ProfileRecord | None, str]:
    """(the current profile of `key` as the incumbent, '') or, where its knobs contradict its family, (None, why):
    no lookup serves such a row, so it is neither compared side by side nor kept nor stored again (the store refuses
    it); the store's gate lets the search's best or the default replace it. A row no run can take (what-if) is not
    set aside here: every profile of its key is one, the winner too."""
    incumbent = store.get_current(key) if store is not None else None
    if incumbent is None:
        return None, ""
    why = contradiction_reason(key, incumbent.knobs)
    if why is None:
        return incumbent, ""
    return None, f"the current profile {incumbent.profile_hash} was not compared: {why}"
