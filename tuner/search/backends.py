"""Benchmark backends: where a knob set is measured.

One small base (`BenchmarkBackend.evaluate(knobs, workload) -> Measurement`) and plain
implementations, as Optuna's samplers subclass `BaseSampler`:

- `ModelBackend`: the fabric model (`moetune.tuner.fabric_model.predict.predict`) on a preset, or any
  predictor callable (tests inject synthetic objectives). Every number it gives is modelled.
- `LocalBackend`: the real runtime on this node, in its own process group so that environment-level knobs
  (NCCL_*, NVSHMEM_*) take effect: by default a persistent bench worker per environment
  (`moetune.tuner.measure.worker`: the ranks stay up across trials), or `moetune bench ep --json` in a fresh
  subprocess per run (`persistent=False`); a timeout per run (a hung run is killed with its whole group
  and recorded as failed; a fresh worker serves the next run), repeats, median and spread.
- `CallableBackend`: any `f(knobs, workload) -> float` (synthetic objectives, tests).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.options import RuntimeOptions, data_path_digest
from moetune.runtime.profile_record import (
    COMM_METRIC,
    NODE_MODEL_BACKEND,
    PROVENANCES,
    Provenance,
    backend_label,
)
from moetune.runtime.profiles.launcher_env import launcher_env
from moetune.runtime.profiles.perf_env import PerfEnv, perf_env_digest, performance_environment, relevant_to
from moetune.runtime.profiles.tuned_options import relevant_options
from moetune.runtime.shapes import MODELS, ModelShape
from moetune.tuner.measure.outputs import WrongOutput, ep_report_problem
from moetune.tuner.measure.stats import Summary, half_range

_log = logging.getLogger("moetune.tuner.search.backends")

if TYPE_CHECKING:
    from moetune.tuner.fabric_model.presets import Preset

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
        """Measure several settings side by side: interleaved rounds (A B A B ...), pooled per setting. A setting's
        spread is at least the largest spread of its rounds: the pooled samples are each run's median, and a
        single run's (or two equal runs') would otherwise hide the noise within the runs (spread 0)."""
        pooled: list[list[float]] = [[] for _ in candidates]
        inner = [0.0] * len(candidates)
        errors: list[str | None] = [None] * len(candidates)
        details: list[dict[str, Any]] = [{} for _ in candidates]
        for _ in range(rounds):
            for i, k in enumerate(candidates):
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
# the fabric model


def _preset_name(preset: Preset) -> str:
    return preset.name


def preset_gpus_per_node(preset: Preset) -> int:
    return preset.gpus_per_node


def preset_family(preset: Preset) -> str:
    if not preset.family:
        raise ValueError(f"preset {preset.name!r} names no transport family")
    return preset.family


def preset_link_rates(preset: Preset) -> dict[str, float]:
    """The rates a preset states, for the analytic priors: link_gbps (NVLink egress, GB/s) and nic_gbit
    (the NIC's rate in Gbit/s; the preset gives GB/s); a key is absent where the preset has no such link."""
    out: dict[str, float] = {}
    link = preset.params.get("nvlink", {}).get("egress_gbps")
    if isinstance(link, (int, float)) and link > 0:
        out["link_gbps"] = float(link)
    nic = preset.params.get("nic", {}).get("gbps")
    if isinstance(nic, (int, float)) and nic > 0:
        out["nic_gbit"] = float(nic) * 8
    return out


class ModelBackend(BenchmarkBackend):
    """The fabric model on a preset (or a predictor callable for tests). Deterministic: spread 0. Its numbers are
    a preset's prediction; `NodeModelBackend` is this node's calibrated model."""

    provenance: ClassVar[Provenance] = "preset"

    def __init__(self, preset: Any = None, *, predictor: Callable[[Knobs, TuneWorkload], Any] | None = None,
                 routing: str | None = None, tile: int | None = None, warn_forced: bool = True):
        """`warn_forced=False`: a caller that tells the user of a forced fit itself (`moetune tune`'s FORCED MODEL
        banner) is not given the same warning a second time as a log line; `forced_fit` is set either way."""
        if preset is None and predictor is None:
            raise ValueError("ModelBackend needs a preset (name, path or Preset) or a predictor")
        if predictor is None:
            # The fabric model loads only when a preset is modelled (imported here, not at module level).
            from moetune.tuner.fabric_model.predict import forced_fit_warning
            from moetune.tuner.fabric_model.presets import load_preset

            self.preset = load_preset(preset) if isinstance(preset, str) else preset
            # a fit the calibration checks refused (`model calibrate --force`): usable when asked for, never quietly
            self.forced_fit = forced_fit_warning(self.preset)
            if self.forced_fit and warn_forced:
                _log.warning("preset %s is a forced fit the calibration checks refused: %s",
                             getattr(self.preset, "path", None) or _preset_name(self.preset), self.forced_fit)
        else:
            self.preset = preset
            self.forced_fit = ""
        self.predictor = predictor
        self.tile = tile
        self.routing = routing
        self.name = f"model:{_preset_name(self.preset)}" if self.preset is not None else "model:custom"

    def as_node_model(self, fingerprint: str) -> NodeModelBackend:
        """This preset as the calibrated model of the node `fingerprint` (the caller checked that it is one:
        `node_model_refusal`), labelled `model:node:<fingerprint>`."""
        node = NodeModelBackend.__new__(NodeModelBackend)
        node.__dict__.update(self.__dict__)  # the loaded preset as it is (no second load, no second warning)
        node.name = NODE_MODEL_BACKEND + fingerprint
        return node

    def settings(self) -> dict[str, Any]:
        # the preset's content, not only its name: a recalibrated node model predicts other numbers
        from moetune.tuner.fabric_model.presets import preset_content

        preset = None if self.preset is None else preset_content(self.preset)
        return {"preset": preset, "routing": self.routing, "tile": self.tile}

    def pinned_knobs(self, transport: str) -> frozenset[str]:
        """Knobs the fabric model does not read on `transport` (its predictions cannot tell their values
        apart): the search keeps them at the policy default (SearchSpace(pinned=...)). None with a predictor."""
        if self.predictor is not None:
            return frozenset()
        from moetune.tuner.fabric_model.predict import KNOBS_READ

        return frozenset(Knobs.__struct_fields__) - KNOBS_READ[transport]

    def refusal(self, *, ep_size: int, nodes: int, families: Sequence[str], gpu_count: int) -> str:
        # a prediction stands for what it predicts, but at EP 1 that is no exchange (a ~14 µs "profile" of nothing)
        return one_rank_exchange(ep_size, families, done='a prediction of {families} would store a "modelled" profile',
                                 fix="Tune a transport family at EP size 2 or more (--ep-size 2; the default is the "
                                     "preset's GPUs per node × --nodes); the one-GPU MoE layer is measured with "
                                     "--backend local --family megakernel")

    def supports(self, family: str) -> bool:
        if family == MEGAKERNEL:  # the fabric model predicts exchanges, not a kernel's tiles
            return False
        if self.preset is None:
            return True
        from moetune.tuner.search.policy import transport_of_family

        fams = self.preset.transports
        try:
            return family == preset_family(self.preset) or (transport_of_family(family) in fams
                                                              and transport_of_family(family) != "proxy")
        except (ValueError, KnobError):
            return False

    def _predict(self, knobs: Knobs, workload: TuneWorkload) -> Any:
        if self.predictor is not None:
            return self.predictor(knobs, workload)
        kw: dict[str, Any] = {"routing": self.routing or workload.routing}
        if self.tile is not None:
            kw["tile"] = self.tile
        from moetune.tuner.fabric_model.predict import Workload, predict

        wl = Workload(model=workload.model, tokens_per_gpu=workload.tokens, nodes=workload.nodes,
                      gpus_per_node=workload.gpus_per_node, **kw)
        return predict(self.preset, wl, knobs)

    def evaluate(self, knobs: Knobs, workload: TuneWorkload, *, report: ReportFn | None = None) -> Measurement:
        try:
            pred = self._predict(knobs, workload)
        except KnobError as e:
            return Measurement.failed(f"unsafe or impossible setting: {e}", infeasible=True)
        except Exception as e:  # broad: a trial's failure is recorded, the study goes on
            return Measurement.failed(f"model error: {type(e).__name__}: {e}")
        if isinstance(pred, (int, float)):
            lat, details = float(pred), {}
        else:
            lat = float(pred.latency_us)
            details = {k: getattr(pred, k) for k in ("dispatch_us", "combine_us", "fences", "proxy_stalls",
                                                    "nic_stalls", "bytes_on_wire", "transfers") if hasattr(pred, k)}
        details["modelled"] = True
        if not math.isfinite(lat) or lat <= 0:
            return Measurement.failed(f"model returned a non-positive latency {lat}")
        return Measurement(lat, 0.0, [lat], True, details=_jsonable(details))


class NodeModelBackend(ModelBackend):
    """The fabric model on this node's calibrated preset (`ModelBackend.as_node_model`): this node's model."""

    provenance: ClassVar[Provenance] = "node_model"


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, (str, bool, int, float)) or v is None:
            out[k] = v
        elif isinstance(v, Mapping):
            out[k] = _jsonable(dict(v))
        else:
            try:
                out[k] = float(v)
            except (TypeError, ValueError):
                out[k] = str(v)
    return out


# ---------------------------------------------------------------------------------------------------
# the real runtime


def knob_environment(knobs: Knobs, family: str, nodes: int = 1) -> dict[str, str]:
    """The environment a measurement of `knobs` runs in (set before communicators exist): exactly what the
    runtime's `launcher_env` gives a launcher for the same knobs, so a profile is served as it was measured."""
    return launcher_env(knobs, family, nodes)


def model_spec(model: ModelShape) -> str:
    """The `--model` argument naming `model` for `moetune bench ep`."""
    if MODELS.get(model.name) == model:
        return model.name
    return f"custom:{model.hidden},{model.intermediate},{model.experts},{model.topk},{model.dtype}"


def knobs_arg(knobs: Knobs) -> str:
    return ",".join(f"{k}={v}" for k, v in knobs.to_dict().items())


def _last_json_object(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        return None


def run_in_group(argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float,
                 cwd: str | None = None) -> tuple[int | None, str, str, float]:
    """Run argv in its own process group; on timeout kill the whole group. Returns (rc|None, out, err, s)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        return None, out or "", err or "", time.monotonic() - t0
    except BaseException:  # kill the run's process group, then re-raise
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


class _WorkerDied(RuntimeError):
    pass


class _WorkerTimeout(RuntimeError):
    pass


class BenchWorker:
    """One persistent bench worker process (`python -m moetune.tuner.measure.worker`) in its own process
    group, with a bounded wait on every answer. Its stdout lines and stderr tail are read by threads."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]):
        self.argv = list(argv)
        self.proc = subprocess.Popen(self.argv, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.ready = False
        self.next_id = 0
        self.started = time.monotonic()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_tail.append, False),
                         daemon=True).start()

    @staticmethod
    def _pump(stream: Any, sink: Callable[[Any], None], eof_marker: bool) -> None:
        try:
            for line in stream:
                sink(line.rstrip("\n"))
        except (ValueError, OSError):
            pass
        finally:
            if eof_marker:
                sink(None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _next(self, deadline: float) -> dict[str, Any]:
        """The next protocol line; _WorkerTimeout at the deadline, _WorkerDied at EOF or garbled output."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _WorkerTimeout()
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise _WorkerDied()
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                raise _WorkerDied(f"garbled worker output (no JSON object): {line[:200]!r}")
            return obj

    def start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self._next(deadline).get("ready"):
                self.ready = True

    def request(self, case: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.next_id += 1
        cid = self.next_id
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({**case, "id": cid}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise _WorkerDied() from None
        deadline = time.monotonic() + timeout_s
        while True:
            obj = self._next(deadline)
            if obj.get("id") == cid:
                return obj

    def exit_status(self, wait_s: float = 10.0) -> int | None:
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def error_tail(self) -> str:
        time.sleep(0.05)  # let the stderr reader catch up
        return " | ".join([ln for ln in self.stderr_tail if ln.strip()][-3:])

    def kill(self) -> None:
        _kill_group(self.proc)
        self.exit_status(10)
        self._close_pipes()

    def close(self, wait_s: float = 10.0) -> None:
        """EOF on stdin ends the worker cleanly; the group is killed if it does not end within wait_s."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
        if self.exit_status(wait_s) is None:
            _kill_group(self.proc)
            self.exit_status(10)
        else:
            try:  # stragglers of the group (the ranks' helpers), if any
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._close_pipes()

    def _close_pipes(self) -> None:
        for s in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if s is not None:
                    s.close()
            except (OSError, ValueError):
                pass


def _close_workers(workers: dict[Any, BenchWorker]) -> None:
    for w in list(workers.values()):
        try:
            w.close(wait_s=5)
        except Exception:  # broad: best effort at shutdown; one worker must not leave the others running
            pass
    workers.clear()


def cuda_gpus() -> int:
    """The CUDA GPUs torch can use in this process (0 without CUDA or torch)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # broad: a torch that fails to load or to ask the driver has no GPU to give a rank
        return 0


def _default_comm_backend(world: int) -> str:
    try:
        import torch

        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    except (ImportError, RuntimeError):
        return "gloo"


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


def unmeasured_key(world: int, ep_size: int, nodes: int, families: Sequence[str]) -> str:
    """Why a local measurement of `world` ranks on this one host cannot stand for (ep_size, nodes), '' when it can.

    The local backend launches `world` ranks on this node only; what it stores is MEASURED, so the key must be
    what ran: ep_size == world on 1 node. The megakernel family runs in this process on one GPU (ep_size 1 and
    nodes 1 are checked where it is chosen), whatever the world."""
    if all(f == MEGAKERNEL for f in families):
        return ""
    why = one_rank_exchange(ep_size, families, done='a local measurement of {families} would store a "measured" profile',
                            fix="Tune a transport family with 2 or more ranks (--world 2), or the one-GPU MoE layer "
                                "with --family megakernel")
    if why:
        return why
    if world == ep_size and nodes == 1:
        return ""
    return (f"the local backend measures {world} rank(s) on this one node, but the profile would be stored for "
            f"EP size {ep_size} over {nodes} node(s), which was never measured: a local tune stores only the "
            f"EP size it runs (ep_size = world = {world}, nodes = 1). Tune EP {ep_size} with world {ep_size} on one "
            "node" + (f" (a {nodes}-node EP group cannot be measured from one host)" if nodes > 1 else "")
            + ", or predict it with the model backend (stored as MODELLED)")


def cpu_comm_on_gpus(comm_backend: str, gpu_count: int, families: Sequence[str]) -> str:
    """Why a local measurement with `comm_backend` cannot stand for a node of `gpu_count` GPUs, '' when it can.

    gloo runs the ranks as CPU processes: its number says nothing of the node's GPUs and NCCL, yet it would be
    stored MEASURED under the node's fingerprint and software and served to its GPU jobs as tuned. So gloo is
    measured only on a node without GPUs (its facts say 0). The megakernel runs on the GPU in this process,
    whatever the comm backend."""
    if comm_backend != "gloo" or gpu_count <= 0 or all(f == MEGAKERNEL for f in families):
        return ""
    return (f"the local backend with gloo measures CPU processes, but this node has {gpu_count} GPU(s): the number "
            "would be stored as the GPU node's measured profile and served to its NCCL/GPU jobs as tuned. Measure "
            "the GPUs with NCCL (`--comm nccl`), or tune gloo on a node (or capture) without GPUs")


# What metric "comm" minimises (and a profile's latency_us holds for a "comm" tune): the bench's round trip.
COMM_FIGURE = "roundtrip_us"


class LocalBackend(BenchmarkBackend):
    """The real runtime: one bench run per repeat, with a timeout, in its own process group. Its numbers are
    measured on this node.

    `metric`: which figure of the bench result is minimised: "layer" (`layer_us`: the whole layer, so
    pipelining that overlaps communication with expert compute counts), or "comm" (`roundtrip_us`: dispatch
    → identity experts → combine timed as one span, run pipelined (`pipelined_moe`) when pipeline_depth > 1,
    so a chunk's combine overlapping later chunks' dispatch counts; no expert weights are built). "comm" is
    not dispatch_us + combine_us: those are timed each alone between a barrier and a sync, which no
    pipelining can shorten (they stay in the details). See COMM_FIGURE.
    `persistent`: keep the ranks up across runs: one bench worker (`moetune.tuner.measure.worker`) per
    distinct environment (`knob_environment`), started lazily; a run that times out or kills its
    worker is recorded failed and the next run starts a fresh worker. Default: persistent unless
    `command` or `extra_args` are given. `close()` ends the workers (also at exit).
    `command`: the argv prefix to run instead of `moetune bench ep` per run (tests point it at fakes;
    implies `persistent=False`).
    """

    provenance: ClassVar[Provenance] = "measured"
    remeasures: ClassVar[bool] = True

    def __init__(self, *, world: int = 2, comm_backend: str | None = None, repeats: int = 3, timeout_s: float = 120.0,
                 metric: str = "layer", family: str | None = None, command: Sequence[str] | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None, verify_compression: bool = True,
                 error_budget: float | None = None, iters: int | None = None, persistent: bool | None = None,
                 worker_command: Sequence[str] | None = None,
                 mk_measure: Callable[[Knobs, TuneWorkload], Mapping[str, Sequence[float]]] | None = None,
                 mk_decode: Callable[[TuneWorkload], bool] | None = None):
        if repeats < 1:
            raise ValueError("repeats must be >= 1")
        if metric not in ("layer", "comm"):
            raise ValueError(f"metric must be 'layer' or 'comm', got {metric!r}")
        self.world = world
        # NCCL when this node has the GPUs for the world, gloo otherwise (a daemon's re-tune on a CPU node)
        self.comm_backend = comm_backend or _default_comm_backend(world)
        self.repeats = repeats
        self.timeout_s = timeout_s
        self.metric = metric
        self.family = family
        self.command = list(command) if command else [sys.executable, "-c", "from moetune.tuner.cli import main; main()",
                                                       "bench", "ep"]
        self.extra_args = list(extra_args)
        self.env = dict(env) if env is not None else None
        self.verify_compression = verify_compression
        self.error_budget = error_budget
        self._explicit_budget = error_budget is not None  # else each family's policy sets it (`for_family`)
        self.iters = iters  # timed iterations inside each repeat (None: the bench's default)
        self.name = f"local:{self.comm_backend}"
        self._runtime_has: dict[str, bool] = {}
        if persistent is None:
            persistent = not command and not extra_args
        elif persistent and extra_args:
            raise ValueError("extra_args apply to the subprocess-per-run mode only (persistent=False)")
        self.persistent = persistent
        self.worker_command = list(worker_command) if worker_command else [sys.executable, "-m",
                                                                           "moetune.tuner.measure.worker"]
        self._own_worker = not worker_command  # the worker module, which takes --parent-pid
        self.collective_timeout_s = 60.0  # what `moetune bench ep --timeout` defaults to
        self._workers: dict[tuple[tuple[str, str], ...], BenchWorker] = {}
        self._lock = threading.Lock()  # one run at a time per worker set (studies may run trials in threads)
        self._finalizer = weakref.finalize(self, _close_workers, self._workers)
        # family `megakernel`: the one-GPU MoE kernel timed in this process (tuner/measure/moe.py); tests inject
        # a fake `(knobs, workload) -> {"graph_us": samples, "eager_us": samples}`
        self.mk_measure = mk_measure
        self.mk_iters = iters or 50
        # whether the workload's launch runs the decode kernel (no tile knob acts on it); tests inject it
        self.mk_decode = mk_decode

    @property
    def label(self) -> str:
        # the metric is in the label a profile records (`metric_of_backend`): a round trip (comm) is never
        # compared with a whole layer; "layer" keeps the label it always had (stored rows and study names)
        if self.family == MEGAKERNEL:
            return backend_label(self.provenance, MEGAKERNEL)
        return backend_label(self.provenance, f"{self.name}:{COMM_METRIC}" if self.metric == COMM_METRIC else self.name)

    def refusal(self, *, ep_size: int, nodes: int, families: Sequence[str], gpu_count: int) -> str:
        # what it stores is measured: the key must be the group it ran, on the GPUs (or CPUs) the node has
        return (unmeasured_key(self.world, ep_size, nodes, families)
                or cpu_comm_on_gpus(self.comm_backend, gpu_count, families))

    def for_family(self, family: str, error_budget: float | None) -> None:
        self.family = family
        if not self._explicit_budget:  # the measured-error check of compressed trials follows the family's policy
            self.error_budget = error_budget

    def inert_reason(self, family: str, workload: TuneWorkload) -> str:
        if family != MEGAKERNEL:
            return ""
        if self.mk_decode is not None:
            takes = self.mk_decode(workload)
        else:
            from moetune.tuner.measure.moe import decode_kernel_takes

            try:
                takes = decode_kernel_takes(workload.model, workload.tokens)
            except Exception as e:  # broad: no library or GPU; the search then runs and its trials fail with why
                _log.info("megakernel: could not ask whether S=%d runs the decode kernel: %s", workload.tokens, e)
                return ""
        if not takes:
            return ""
        return (f"S={workload.tokens} of {workload.model.name} runs the megakernel's decode kernel on this GPU, on "
                "which no tile knob acts: only the policy default was measured")

    def settings(self) -> dict[str, Any]:
        # the figure minimised (the whole layer, or dispatch + combine), how long each run times, and what
        # decides a compressed setting infeasible
        out = {"metric": self.metric, "iters": self.iters, "verify": self.verify_compression,
               "error_budget": self.error_budget}
        if self.metric == "comm":  # a study of dispatch + combine values (before COMM_FIGURE) is not resumed
            out["comm_figure"] = COMM_FIGURE
        # trials measured under other settings of what acts on the family are not resumed (none: as before); the
        # megakernel (one GPU) only by the variables that act on it
        acting = relevant_to(self.perf_environment().variables, self.family)
        if acting:
            out["perf_env"] = perf_env_digest(acting)
        # and under other data-path runtime options that act on the family (options.DATA_PATH_FAMILIES: hs_native
        # for host_staged, symm for nvlink/proxy, ...): another data path's trials. Always where any acts: a study
        # from before they were recorded (its options unknown) is not resumed
        options = relevant_options(self.runtime_options().data_path(), self.family)
        if options:
            out["runtime_options"] = data_path_digest(options)
        return out

    def perf_environment(self) -> PerfEnv:
        """The performance environment of the ranks this backend launches (or of this process, for the in-process
        megakernel): `env`, else this process's, without the variables the knobs set (`knob_environment`)."""
        return performance_environment(os.environ if self.env is None else self.env)

    def runtime_options(self) -> RuntimeOptions:
        """The runtime options the ranks this backend launches resolve (an EP buffer built without options reads the
        config's [runtime] table and the MOETUNE_* variables of `env`, else of this process). ValueError naming the
        option where they do not resolve: every run would fail on it."""
        try:
            return RuntimeOptions.resolve(env=os.environ if self.env is None else self.env)
        except ValueError as e:  # RuntimeOptionError, ConfigError
            raise ValueError(f"the runtime options the measuring ranks would run under do not resolve: {e}") from None

    def close(self) -> None:
        """End the persistent workers (a later run starts fresh ones) and drop the in-process megakernel trials'
        weights and reference (GPU memory the caller's process would otherwise keep)."""
        with self._lock:
            _close_workers(self._workers)
        moe = sys.modules.get("moetune.tuner.measure.moe")  # imported only where megakernel trials ran
        if moe is not None:
            moe.release_megakernel_inputs()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def runtime_has(self, transport: str) -> bool:
        """Whether the runtime registers `transport` (True when the registry cannot be read)."""
        if transport not in self._runtime_has:
            try:
                from moetune.runtime.transports.registry import get_transport  # type: ignore[import-not-found]
            except ImportError:
                return True
            try:
                get_transport(transport)
                self._runtime_has[transport] = True
            except (KeyError, ImportError):  # unknown name; registered but not importable here
                self._runtime_has[transport] = False
        return self._runtime_has[transport]

    def runtime_knobs(self, knobs: Knobs) -> Knobs:
        """host_staged is the collective when the runtime has no transport of that name."""
        if knobs.transport == "host_staged" and not self.runtime_has("host_staged"):
            return knobs.replace(transport="collective")
        return knobs

    def argv(self, knobs: Knobs, workload: TuneWorkload) -> list[str]:
        rk = self.runtime_knobs(knobs)
        argv = [*self.command, "--world", str(self.world), "--backend", self.comm_backend,
                "--model", model_spec(workload.model), "--tokens", str(workload.tokens),
                "--routing", workload.routing, "--knobs", knobs_arg(rk), "--json"]
        if self.verify_compression and knobs.compression != "none":
            argv.append("--verify")
        elif self.metric == "comm":
            argv.append("--no-layer")  # the round trip (identity experts): no expert weights to build
        if self.iters is not None:
            argv += ["--iters", str(self.iters), "--warmup", str(max(1, self.iters // 4))]
        return argv + self.extra_args

    def case(self, knobs: Knobs, workload: TuneWorkload) -> dict[str, Any]:
        """The bench worker's case for one run (the same run `argv` describes)."""
        rk = self.runtime_knobs(knobs)
        verify = bool(self.verify_compression and knobs.compression != "none")
        case: dict[str, Any] = {"model": model_spec(workload.model), "tokens": workload.tokens,
                                "routing": workload.routing, "knobs": rk.to_dict(), "verify": verify,
                                "layer": verify or self.metric != "comm"}
        if self.iters is not None:
            case.update(iters=self.iters, warmup=max(1, self.iters // 4))
        return case

    def worker_argv(self) -> list[str]:
        # --parent-pid: the worker (and its ranks) end when this process does, however it ends (SIGKILL, a signal
        # it does not handle): they kept measuring for a minute, re-parented to init, holding the GPUs
        own = ["--parent-pid", str(os.getpid())] if self._own_worker else []
        return [*self.worker_command, "--world", str(self.world), "--backend", self.comm_backend,
                "--timeout", f"{self.collective_timeout_s:g}", *own]

    def environment(self, knobs: Knobs) -> dict[str, str]:
        env = dict(os.environ if self.env is None else self.env)
        env.update(knob_environment(knobs, self.family or knobs.transport))
        return env

    def _value(self, res: Mapping[str, Any]) -> float:
        def med(key: str) -> float | None:
            v = res.get(key)
            if isinstance(v, Mapping):
                v = v.get("median")
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        # the one figure the metric minimises, never another in its place: dispatch_us + combine_us (no expert work)
        # taken for a missing layer_us scored that trial against whole layers as several times faster
        key, what = ((COMM_FIGURE, "metric comm minimises the round trip") if self.metric == "comm" else
                     ("layer_us", "metric layer minimises the whole layer"))
        v = med(key)
        if v is None:
            raise ValueError(f"bench result has no {key} ({what})")
        # a median of 0, below 0 or not finite is no timing (a run that timed nothing would be the fastest trial)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"bench result's {key} median {v!r} is no timing (a finite number > 0)")
        return v

    def _run_persistent(self, knobs: Knobs, workload: TuneWorkload) -> tuple[dict[str, Any] | None, float, str | None]:
        """One run through this environment's worker: (result, seconds, error)."""
        key = tuple(sorted(knob_environment(knobs, self.family or knobs.transport).items()))
        w = self._workers.get(key)
        if w is not None and not w.alive():
            w.kill()
            del self._workers[key]
            w = None
        if w is None:
            w = self._workers[key] = BenchWorker(self.worker_argv(), self.environment(knobs))
        t0 = time.monotonic()
        phase = "starting the bench worker"
        try:
            if not w.ready:
                w.start(self.timeout_s)
            t0, phase = time.monotonic(), ""
            res = w.request(self.case(knobs, workload), self.timeout_s)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM mid-run: the run is abandoned; close() would wait for it
            w.kill()  # (EOF is read only after the case) up to 5 s before killing the worker's process group
            self._workers.pop(key, None)
            raise
        except _WorkerTimeout:
            w.kill()
            self._workers.pop(key, None)
            what = f" {phase}" if phase else ""
            return None, time.monotonic() - t0, f"timed out after {self.timeout_s:g} s{what} (process group killed)"
        except _WorkerDied as e:
            rc = w.exit_status(2.0 if e.args else 10.0)
            tail = w.error_tail()
            w.kill()
            self._workers.pop(key, None)
            if e.args:  # garbled output from a live worker
                return None, time.monotonic() - t0, str(e.args[0])
            return None, time.monotonic() - t0, f"exit status {rc}: {tail[:400]}"
        secs = time.monotonic() - t0
        if "error" in res:
            return None, secs, f"bench error: {res['error']}"[:600]
        return res, secs, None

    def run_once(self, knobs: Knobs, workload: TuneWorkload) -> tuple[float | None, dict[str, Any], str | None]:
        if self.persistent:
            with self._lock:
                res, secs, error = self._run_persistent(knobs, workload)
            if error is not None:
                return None, {"seconds": secs}, error
        else:
            rc, out, err, secs = run_in_group(self.argv(knobs, workload), env=self.environment(knobs),
                                              timeout_s=self.timeout_s)
            if rc is None:
                return None, {"seconds": secs}, f"timed out after {self.timeout_s:g} s (process group killed)"
            if rc != 0:
                tail = " | ".join((err or out).strip().splitlines()[-3:])
                return None, {"seconds": secs}, f"exit status {rc}: {tail[:400]}"
            res = _last_json_object(out)
            if res is None:
                return None, {"seconds": secs}, "no JSON object on stdout"
        assert res is not None
        try:
            value = self._value(res)
        except ValueError as e:
            return None, {"seconds": secs}, str(e)
        details = {k: res[k] for k in ("dispatch_us", "combine_us", COMM_FIGURE, "layer_us", "max_rel_err", "verify_bound",
                                       "roundtrip_rel_err", "roundtrip_bound", "world", "backend") if k in res}
        details["seconds"] = secs
        return value, details, None

    def _measure_megakernel(self, knobs: Knobs, workload: TuneWorkload) -> Mapping[str, Sequence[float]]:
        from moetune.tuner.measure.moe import measure_megakernel

        return measure_megakernel(knobs, workload.model, workload.tokens, iters=self.mk_iters,
                                  warmup=max(3, self.mk_iters // 5))

    def evaluate_megakernel(self, knobs: Knobs, workload: TuneWorkload) -> Measurement:
        """The whole layer on this GPU: graph-replay samples (what a serving engine replays) are the value,
        eager ones (where the measurement gives any) go in the details. A setting this GPU cannot hold (ConfigError)
        or whose output is wrong (WrongOutput: `measure_megakernel` checks it against the fp32 reference) is
        infeasible."""
        if knobs.engine != "megakernel":
            return Measurement.failed(f"family megakernel needs engine=megakernel, got {knobs.engine!r}", infeasible=True)
        if workload.ep_size != 1:
            return Measurement.failed(f"the megakernel runs on one GPU; workload has ep_size {workload.ep_size}",
                                      infeasible=True)
        measure = self.mk_measure or self._measure_megakernel
        graph: list[float] = []
        eager: list[float] = []
        for _ in range(self.repeats):
            try:
                got = measure(knobs, workload)
            except (KnobError, ValueError) as e:  # ConfigError is a ValueError: a tile/stage/CTA count that does not fit
                return Measurement.failed(f"setting does not fit: {e}", infeasible=True)
            except WrongOutput as e:  # its output was not the fp32 reference's: no timing, and unsafe to serve
                return Measurement.failed(str(e)[:600], infeasible=True)
            except Exception as e:  # build, launch or kernel error: this trial failed, the study goes on
                return Measurement.failed(f"megakernel run failed: {type(e).__name__}: {e}"[:600])
            graph += [float(v) for v in got.get("graph_us", ())]
            eager += [float(v) for v in got.get("eager_us", ())]
        value = graph or eager
        if not value:
            return Measurement.failed("the megakernel measurement returned no samples")
        s = Summary.of(value)
        details: dict[str, Any] = {"timing": "graph" if graph else "eager"}
        if eager:
            details["eager_us"] = round(Summary.of(eager).median, 3)
        return Measurement(s.median, s.spread, value, True, details=details)

    def evaluate(self, knobs: Knobs, workload: TuneWorkload, *, report: ReportFn | None = None) -> Measurement:
        if self.family == MEGAKERNEL:
            return self.evaluate_megakernel(knobs, workload)
        samples: list[float] = []
        details: dict[str, Any] = {}
        for i in range(self.repeats):
            value, det, error = self.run_once(knobs, workload)
            if error is not None:
                return Measurement.failed(error, details=_jsonable(det))
            # a setting whose output was wrong (a transport that moved stale rows, or nothing) is as fast as a right
            # one, or faster: never a timing, and unsafe to run (infeasible), whatever error_budget says
            wrong = ep_report_problem(det)
            if wrong is not None:
                return Measurement.failed(wrong, infeasible=True, details=_jsonable(det))
            err = det.get("max_rel_err")
            if self.error_budget is not None and isinstance(err, (int, float)) and err > self.error_budget:
                return Measurement.failed(f"measured relative error {err:.4g} over the budget {self.error_budget:g}",
                                          infeasible=True, details=_jsonable(det))
            samples.append(float(value))  # type: ignore[arg-type]
            details = det
            if report is not None and i < self.repeats - 1 and report(i, statistics.median(samples)):
                s = Summary.of(samples)
                return Measurement(s.median, s.spread, samples, True, pruned=True, details=_jsonable(details))
        s = Summary.of(samples)
        spread = s.spread
        # Within-run spread of one repeat (p10..p90 of its iterations) when the runtime reports it.
        key = "layer_us" if self.metric == "layer" else COMM_FIGURE
        inner = details.get(key)
        if isinstance(inner, Mapping) and isinstance(inner.get("p90"), (int, float)) and isinstance(inner.get("p10"), (int, float)):
            spread = max(spread, half_range(inner["p10"], inner["p90"]))
        return Measurement(s.median, spread, samples, True, details=_jsonable(details))
