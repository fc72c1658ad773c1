"""The local measuring backend: `LocalBackend`, the real runtime on this node, and the checks of what it may store.

Each run is in its own process group so that environment-level knobs (NCCL_*, NVSHMEM_*) take effect: by default
a persistent bench worker per environment (bench_workers.py; `moetune.tuner.measure.worker`: the ranks stay up
across trials), or `moetune bench ep --json` in a fresh subprocess per run (`persistent=False`); a timeout per run
(a hung run is killed with its whole group and recorded as failed; a fresh worker serves the next run), repeats,
median and spread. Its numbers are measured.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from moetune.runtime.knobs import KnobError, Knobs, group_world_problem, missing_transport_problem
from moetune.runtime.options import RuntimeOptions, data_path_digest
from moetune.runtime.profile_record import COMM_METRIC, Provenance, backend_label, is_transport_family
from moetune.runtime.profiles.launcher_env import launcher_env
from moetune.runtime.profiles.perf_env import PerfEnv, perf_env_digest, performance_environment, relevant_to
from moetune.runtime.profiles.tuned_options import relevant_options
from moetune.runtime.shapes import MODELS, ModelShape
from moetune.tuner.measure.outputs import WrongOutput, ep_report_problem
from moetune.tuner.measure.stats import Summary, half_range
from moetune.tuner.search.backends import (
    MEGAKERNEL,
    BenchmarkBackend,
    Measurement,
    ReportFn,
    TuneWorkload,
    jsonable,
    one_rank_exchange,
)
from moetune.tuner.search.bench_workers import (
    BenchWorker,
    WorkerDied,
    WorkerTimeout,
    close_workers,
    run_in_group,
)
from moetune.tuner.search.policy import transport_of_family

_log = logging.getLogger("moetune.tuner.search.local_backend")


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
        self._finalizer = weakref.finalize(self, close_workers, self._workers)
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

    def group_problem(self, family: str, *, ep_size: int, nodes: int) -> str:
        # the runtime's rule for a group (nvlink/proxy beyond MAX_WORLD ranks or across nodes, host_staged across
        # nodes): the EP buffer refuses such a group in every trial
        if not is_transport_family(family):
            return ""
        return group_world_problem(transport_of_family(family), ep_size, nodes=nodes) or ""

    def supports(self, family: str) -> bool:
        # a transport family this runtime has no transport for (ibgda: the fabric model's only) cannot be measured:
        # every run fails, and the store refuses a measured profile of it (`runtime_refusal`)
        return not is_transport_family(family) or missing_transport_problem(transport_of_family(family)) is None

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
            close_workers(self._workers)
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
        except WorkerTimeout:
            w.kill()
            self._workers.pop(key, None)
            what = f" {phase}" if phase else ""
            return None, time.monotonic() - t0, f"timed out after {self.timeout_s:g} s{what} (process group killed)"
        except WorkerDied as e:
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

    def _measure_megakernel(self, knobs: Knobs, workload: TuneWorkload, *,
                            options: RuntimeOptions | None = None) -> Mapping[str, Sequence[float]]:
        from moetune.tuner.measure.moe import measure_megakernel

        # `options`: the runtime options the layer is built with (its megakernel_timeout_s), as a served layer is
        return measure_megakernel(knobs, workload.model, workload.tokens, iters=self.mk_iters,
                                  warmup=max(3, self.mk_iters // 5), options=options)

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
        from moetune.runtime.megakernel.config import model_problem

        model_why = model_problem(workload.model)
        if model_why is not None:
            # the model (its dtype or shape), not the knobs: said as such before its weights are built (hidden 100
            # failed each trial as "setting does not fit: k-tiled weights need K to be a multiple of 64, got 100"; a
            # float16 model's bf16 timing was stored under a float16 key no layer can run)
            return Measurement.failed(f"the megakernel cannot run model {workload.model.name}: {model_why}",
                                      infeasible=True)
        if self.mk_measure is not None:
            measure = self.mk_measure
        else:
            # the options this backend's runs resolve (`env`, else this process's; the config's [runtime] table): the
            # layer was built with the defaults, so a trial that hung waited 2 s whatever megakernel_timeout_s said.
            # Resolved outside the try below: options that do not resolve are no setting that does not fit
            try:
                options = self.runtime_options()
            except ValueError as e:
                return Measurement.failed(str(e)[:600])
            measure = functools.partial(self._measure_megakernel, options=options)
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
                return Measurement.failed(error, details=jsonable(det))
            # a setting whose output was wrong (a transport that moved stale rows, or nothing) is as fast as a right
            # one, or faster: never a timing, and unsafe to run (infeasible), whatever error_budget says
            wrong = ep_report_problem(det)
            if wrong is not None:
                return Measurement.failed(wrong, infeasible=True, details=jsonable(det))
            err = det.get("max_rel_err")
            if self.error_budget is not None and isinstance(err, (int, float)) and err > self.error_budget:
                return Measurement.failed(f"measured relative error {err:.4g} over the budget {self.error_budget:g}",
                                          infeasible=True, details=jsonable(det))
            samples.append(float(value))  # type: ignore[arg-type]
            details = det
            if report is not None and i < self.repeats - 1 and report(i, statistics.median(samples)):
                s = Summary.of(samples)
                return Measurement(s.median, s.spread, samples, True, pruned=True, details=jsonable(details))
        s = Summary.of(samples)
        spread = s.spread
        # Within-run spread of one repeat (p10..p90 of its iterations) when the runtime reports it.
        key = "layer_us" if self.metric == "layer" else COMM_FIGURE
        inner = details.get(key)
        if isinstance(inner, Mapping) and isinstance(inner.get("p90"), (int, float)) and isinstance(inner.get("p10"), (int, float)):
            spread = max(spread, half_range(inner["p10"], inner["p90"]))
        return Measurement(s.median, spread, samples, True, details=jsonable(details))
