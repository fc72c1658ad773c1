"""Benchmark backends: the interface, where a knob set is measured, and the records it gives.

One small base (`BenchmarkBackend.evaluate(knobs, workload) -> Measurement`) that declares every capability, and
plain implementations, as Optuna's samplers subclass `BaseSampler`:

- `ModelBackend` (model_backend.py): the fabric model (`moetune.tuner.fabric_model.predict.predict`) on a preset,
  or any predictor callable (tests inject synthetic objectives). Every number it gives is modelled.
- `LocalBackend` (local_backend.py): the real runtime on this node, in its own process group so that
  environment-level knobs (NCCL_*, NVSHMEM_*) take effect: by default a persistent bench worker per environment
  (`moetune.tuner.measure.worker`, driven by bench_workers.py: the ranks stay up across trials), or `moetune bench
  ep --json` in a fresh subprocess per run (`persistent=False`); a timeout per run (a hung run is killed with its
  whole group and recorded as failed; a fresh worker serves the next run), repeats, median and spread.
- `CallableBackend` (here): any `f(knobs, workload) -> float` (synthetic objectives, tests).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.profile_record import PROVENANCES, Provenance, backend_label
from moetune.runtime.profiles.perf_env import PerfEnv
from moetune.runtime.shapes import ModelShape
from moetune.tuner.measure.stats import Summary

MEGAKERNEL = "megakernel"  # the engine family: measured in-process on one GPU, not through `bench ep`

# Called after each repeat with (step, value so far); returns True when the trial should stop (pruned).
ReportFn = Callable[[int, float], bool]


@dataclass(frozen=True)
class TuneWorkload:
    """What one study tunes for: a model shape, tokens per GPU, the EP layout and the routing."""

    model: ModelShape
    tokens: int
    nodes: int = 1
    gpus_per_node: int = 1
    routing: str = "uniform"

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens}")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes and gpus_per_node must be >= 1, got {self.nodes}, {self.gpus_per_node}")

    @property
    def ep_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_dict(self) -> dict[str, Any]:
        m = self.model
        return {"model": m.name, "hidden": m.hidden, "intermediate": m.intermediate, "experts": m.experts,
                "topk": m.topk, "dtype": m.dtype, "tokens": self.tokens, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "routing": self.routing}


@dataclass
class Measurement:
    median_us: float
    spread_us: float
    samples: list[float]
    ok: bool
    error: str | None = None
    # The setting may never run here (unsafe / outside the policy): recorded as infeasible, not failed.
    infeasible: bool = False
    pruned: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def failed(cls, error: str, *, infeasible: bool = False, details: dict[str, Any] | None = None) -> Measurement:
        return cls(math.nan, math.nan, [], False, error, infeasible, False, details or {})

    def to_dict(self) -> dict[str, Any]:
        return {"median_us": self.median_us, "spread_us": self.spread_us, "samples": list(self.samples),
                "ok": self.ok, "error": self.error, "infeasible": self.infeasible, "pruned": self.pruned,
                "details": self.details}


class BenchmarkBackend(ABC):
    # What this class's numbers are (ProfileRecord.provenance), declared by every class, never read from its name:
    # "measured" only by a backend that runs the setting on this node; the stored label (`label`), `modelled` and the
    # provenance a profile records all follow from it.
    provenance: ClassVar[Provenance]
    # Its numbers are runs on this node, with noise and seconds each: the winner is measured again side by side with
    # the incumbent and the policy default before it is stored, and trials are pruned (between repeats, on a
    # neighbour bucket's evidence). A prediction (or a synthetic objective) is neither noisy nor costly.
    remeasures: ClassVar[bool] = False
    name: str = "backend"
    world: int | None = None  # the ranks one measurement launches on this node (None: it launches none)
    repeats: int = 1  # runs per trial

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if getattr(cls, "provenance", None) not in PROVENANCES:  # a forgotten declaration is no default
            raise TypeError(f"{cls.__name__} must declare its provenance (one of {', '.join(PROVENANCES)})")

    @property
    def label(self) -> str:
        """What measured a profile (ProfileRecord.backend), e.g. `model:ndr-ibrc-h100x8`, `local:nccl`: the name
        under the prefix of the class's provenance (`backend_label`)."""
        return backend_label(self.provenance, self.name)

    @property
    def modelled(self) -> bool:
        return self.provenance != "measured"

    def refusal(self, *, ep_size: int, nodes: int, families: Sequence[str], gpu_count: int) -> str:
        """Why this backend's numbers cannot stand for profiles of (ep_size, nodes) on a node of `gpu_count` GPUs,
        '' when they can (a prediction stands for what it predicts)."""
        return ""

    def group_problem(self, family: str, *, ep_size: int, nodes: int) -> str:
        """Why `family`'s transport cannot serve an EP group of `ep_size` ranks on `nodes` hosts on this backend ('' when
        it can, or the backend knows no bound): every trial would fail on it, so the tune asks before its first study."""
        return ""

    def for_family(self, family: str, error_budget: float | None) -> None:
        """Set up for a study of `family`, whose policy allows compressed settings `error_budget` of measured error
        (a backend that measures no error ignores it)."""

    def close(self) -> None:
        """Free what the backend holds (processes, GPU memory); nothing to free by default."""

    def supports(self, family: str) -> bool:
        return True

    def pinned_knobs(self, transport: str) -> frozenset[str]:
        """Knobs this backend cannot tell apart on `transport` (held at the policy default by the search, so a
        tie is never stored as a tuned choice); a measuring backend tells them all apart."""
        return frozenset()

    def inert_reason(self, family: str, workload: TuneWorkload) -> str:
        """Why no knob of `family` acts on what this backend measures at `workload` ('' when they act): the tune
        then measures the policy default only, so noise between equal runs is never stored as a tuned choice."""
        return ""

    def settings(self) -> dict[str, Any]:
        """What, besides the label, decides the numbers this backend gives: a study is resumed only under the
        same settings (its trials measured them), so they are part of its name."""
        return {}

    def perf_environment(self) -> PerfEnv | None:
        """The performance environment (NCCL_*, NVSHMEM_*, FI_*, ...: runtime/profiles/perf_env.py) this backend's
        measurements run in, recorded with every profile it measures; None for a backend that measures nothing (a
        model's prediction ran in no process's environment)."""
        return None

    def runtime_options(self) -> RuntimeOptions | None:
        """The runtime options (MOETUNE_* variables, the config's [runtime] table) this backend's measurements run
        under, whose data-path ones are recorded with every profile it measures; None for a backend that runs no
        runtime (a prediction, a synthetic objective)."""
        return None

    @abstractmethod
    def evaluate(self, knobs: Knobs, workload: TuneWorkload, *, report: ReportFn | None = None) -> Measurement:
        """Measure one knob set. Never raises for a bad setting or a failed run: returns ok=False."""

    def compare(self, candidates: Sequence[Knobs], workload: TuneWorkload, *, rounds: int = 3) -> list[Measurement]:
        """Measure several settings side by side: interleaved rounds, the order rotated each round (A B C, B C A,
        C A B, ...), pooled per setting. Rotated, so no setting always holds one place in the rounds (the first round's
        first ran on a device rested since the study's last trial, the others after it; each later round's first
        right after the round before). A setting's
        spread is at least the largest spread of its rounds: the pooled samples are each run's median, and a
        single run's (or two equal runs') would otherwise hide the noise within the runs (spread 0)."""
        pooled: list[list[float]] = [[] for _ in candidates]
        inner = [0.0] * len(candidates)
        errors: list[str | None] = [None] * len(candidates)
        details: list[dict[str, Any]] = [{} for _ in candidates]
        n = len(candidates)
        for r in range(rounds):
            for i in ((r + j) % n for j in range(n)):
                k = candidates[i]
                if errors[i]:
                    continue
                m = self.evaluate(k, workload)
                if not m.ok:
                    errors[i] = m.error or "failed"
                    continue
                pooled[i].extend(m.samples)
                if math.isfinite(m.spread_us):
                    inner[i] = max(inner[i], m.spread_us)
                details[i] = m.details
        out = []
        for i in range(len(candidates)):
            if errors[i] or not pooled[i]:
                out.append(Measurement.failed(errors[i] or "no samples"))
            else:
                s = Summary.of(pooled[i])
                out.append(Measurement(s.median, max(s.spread, inner[i]), pooled[i], True, details=details[i]))
        return out


def provenance_fields(be: BenchmarkBackend) -> dict[str, Any]:
    """What a profile of `be`'s numbers records of where they come from (ProfileRecord fields): the provenance its
    class declares, its label, and for a measurement the performance environment and the data-path runtime options
    its runs ran under (a prediction ran in no process: none recorded). The ONE place a record's provenance is taken
    from a backend (tune, bring-up)."""
    out: dict[str, Any] = {"provenance": be.provenance, "backend": be.label}
    perf = be.perf_environment() if be.provenance == "measured" else None
    if perf is not None:
        out["perf_env"] = dict(perf.variables)
    opts = be.runtime_options() if be.provenance == "measured" else None
    if opts is not None:  # every data-path option, whatever the family: the runtime compares those that act on it
        out["runtime_options"] = opts.data_path()
    return out


# A setting measured by fewer samples than this in a side-by-side comparison shows no run-to-run noise (one run's
# median has none), so no gain over another setting is called on it.
MIN_COMPARE_SAMPLES = 2


def too_few_samples(*measured: Measurement) -> str:
    """Why the side-by-side measurements `measured` (of `compare`) are too few to call a gain between them, '' when
    they are not."""
    few = [len(m.samples) for m in measured if m.ok and len(m.samples) < MIN_COMPARE_SAMPLES]
    if not few:
        return ""
    return (f"{min(few)} sample(s) of a setting in the side-by-side comparison (at least {MIN_COMPARE_SAMPLES} are "
            "needed to see the noise between runs): no gain can be called; more repeats or compare rounds measure it")


class CallableBackend(BenchmarkBackend):
    """`fn(knobs, workload) -> float` (µs) or a Measurement; exceptions become failed measurements.

    An arbitrary function's numbers are no measurement on this node nor its calibrated model: a preset's rank (the
    lowest), whatever `name` says (`name="local:x"` is labelled `model:local:x`). A test that stands in for a
    measuring backend subclasses it and declares `provenance = "measured"`."""

    provenance: ClassVar[Provenance] = "preset"

    def __init__(self, fn: Callable[[Knobs, TuneWorkload], float | Measurement], name: str = "callable"):
        self.fn = fn
        self.name = name

    def evaluate(self, knobs: Knobs, workload: TuneWorkload, *, report: ReportFn | None = None) -> Measurement:
        try:
            v = self.fn(knobs, workload)
        except KnobError as e:
            return Measurement.failed(str(e), infeasible=True)
        except Exception as e:  # broad: a trial's failure is recorded, the study goes on
            return Measurement.failed(f"{type(e).__name__}: {e}")
        if isinstance(v, Measurement):
            return v
        return Measurement(float(v), 0.0, [float(v)], True)


# ---------------------------------------------------------------------------------------------------
# shared by the backends


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """`d` as a Measurement's details can hold it (JSON: numbers, strings, nested dicts; anything else as a float,
    else as its text)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, (str, bool, int, float)) or v is None:
            out[k] = v
        elif isinstance(v, Mapping):
            out[k] = jsonable(dict(v))
        else:
            try:
                out[k] = float(v)
            except (TypeError, ValueError):
                out[k] = str(v)
    return out


def one_rank_exchange(ep_size: int, families: Sequence[str], *, done: str, fix: str) -> str:
    """Why an EP group of `ep_size` ranks cannot stand for an exchange of `families`, '' when it can: one rank
    exchanges nothing, so its number, measured (the local backend) or predicted (the model backend, `moetune model
    predict`/`sweep`), is of no exchange at all. As the bring-up refuses world = 1 / ep_sizes = [1] (Plan.validate).
    The megakernel runs on one GPU (EP 1 is its size), so it is never refused here.
    `done`: what would come of it, with `{families}` for the transport families named; `fix`: what to do instead.
    One check, one wording, for every command that could store or print such a number."""
    transports = [f for f in families if f != MEGAKERNEL]
    if ep_size >= 2 or not transports:
        return ""
    return (f"EP size {ep_size}: one rank exchanges nothing, so {done.format(families=', '.join(transports))} of no "
            f"exchange at all. {fix}")
