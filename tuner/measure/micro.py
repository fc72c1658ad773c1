"""Transport microbenchmarks run at bring-up: latency and bandwidth against message size, both directions.

One small base class with plain implementations, as the transports and tuning backends have:
- `GlooP2P`: two CPU processes, send/recv over gloo (the `collective` family on any machine);
- `NcclP2P`: two GPUs, send/recv over NCCL (`nvlink`), or with NCCL_P2P_DISABLE=1 (`host_staged`);
- `ProxySignalled` (2 GPUs and the csrc proxy engine): signalled against put-only throughput across
  concurrency (Perseus Fig. 5 shape) for each fence mode and signalling, and the cost of one fence.

Each benchmark runs in a subprocess (`python -m moetune.tuner.measure.micro RUNNER ...`) so that
environment-level settings take effect and a hang is bounded by a timeout. The subprocess runs under
`MEASUREMENT_ENV` (NVLink SHARP off), a declared measurement setting: every row records it (`extra.measurement_env`)
and the whole performance environment it ran in (`extra.perf_env`, as runtime/profiles/perf_env.py extracts it),
so a stored row (and the node model calibrated on it) says under which NCCL environment it was measured.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from moetune.tuner.measure.stats import Summary

# What every microbenchmark subprocess runs under, over the caller's environment: NCCL's NVLink SHARP (NVLS)
# collectives stay off (the machines these calibrate must run with NVLS off), and torch's symmetric memory
# without multicast objects, as the runtime's one-sided transports set it themselves. Declared, not silent: each
# row records it (`Microbenchmark.run`).
MEASUREMENT_ENV: dict[str, str] = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

DEFAULT_SIZES: tuple[int, ...] = tuple(2**p for p in range(10, 25, 2))  # 1 KiB .. 16 MiB
QUICK_SIZES: tuple[int, ...] = (1024, 16384, 262144, 4194304)


# a line that names an exception a rank raised ("RuntimeError: ...", "torch.distributed.DistBackendError: ...")
_RAISED = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Interrupt)\b:?")


def failure_summary(output: str) -> str:
    """What a failed run's output says went wrong, in one line: the exceptions its ranks raised (each once, the last
    three) and its last line, without the tracebacks' file and code lines (the last five lines, joined, read as a
    traceback); the last five lines where no exception is named."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    raised = list(dict.fromkeys(ln for ln in lines if _RAISED.match(ln)))[-3:]
    if not raised:
        return " | ".join(lines[-5:])
    return " | ".join(raised + ([lines[-1]] if lines[-1] not in raised else []))


@dataclass(frozen=True)
class MicroResult:
    transport: str  # transport family measured (collective, nvlink, host_staged, proxy)
    kind: str  # latency | bandwidth | signalled_efficiency | fence_cost
    direction: str  # "0->1", "1->0"
    size_bytes: int
    value: float
    spread: float  # stats.Summary.spread of the samples
    unit: str
    extra: dict | None = None


class Microbenchmark(ABC):
    """A microbenchmark of one transport family."""

    transport: str
    runner: str  # name of the subprocess entry in RUNNERS

    @abstractmethod
    def available(self, transports: Sequence[str], gpu_count: int) -> tuple[bool, str]:
        """Whether it can run on this node (from discovery's transport families)."""

    def env(self) -> dict[str, str]:
        return {}

    def _argv_transport(self) -> str:
        return self.transport

    def measurement_env(self) -> dict[str, str]:
        """The variables this benchmark sets over the caller's environment: its own (`env`), then MEASUREMENT_ENV."""
        return {**self.env(), **MEASUREMENT_ENV}

    def run(self, sizes: Sequence[int], *, iters: int = 20, timeout_s: float = 120.0) -> list[MicroResult]:
        from moetune.runtime.profiles.perf_env import performance_environment

        env = {**os.environ, **self.measurement_env()}
        # what each row says it was measured under: the settings declared here, and the whole NCCL/NVSHMEM/FI
        # environment of the process (the caller's variables too)
        recorded = {"measurement_env": self.measurement_env(), "perf_env": performance_environment(env).variables}
        cmd = [sys.executable, "-m", "moetune.tuner.measure.micro", self.runner,
               ",".join(str(s) for s in sizes), str(iters), self._argv_transport()]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"microbenchmark {self.transport} timed out after {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"microbenchmark {self.transport} failed: {failure_summary(proc.stderr or proc.stdout)}")
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        return [MicroResult(**{**r, "extra": {**(r.get("extra") or {}), **{k: dict(v) for k, v in recorded.items()}}})
                for r in rows]


class CollectiveA2A(Microbenchmark):
    """The NCCL baseline experiment (bench/results/2026-11-30_h200x2_nccl_baseline.jsonl) on this node: one
    all_to_all_single dispatch of a model shape (k copies of each token, bf16), the rows the fabric model is
    calibrated on (`probe: collective_a2a`)."""

    runner = "a2a"

    def __init__(self, transport: str, backend: str, model: str = "qwen3-30b", tokens: Sequence[int] = (64, 256, 1024)):
        self.transport, self.backend, self.model, self.tokens = transport, backend, model, tuple(tokens)

    def env(self) -> dict[str, str]:
        return {"NCCL_P2P_DISABLE": "1"} if self.transport == "host_staged" else {}

    def available(self, transports: Sequence[str], gpu_count: int) -> tuple[bool, str]:
        if self.backend == "nccl" and gpu_count < 2:
            return False, f"needs 2 GPUs, node has {gpu_count}"
        if gpu_count == 1:  # gloo between host processes stands in for the fabric only where there is no GPU
            return False, "one GPU: no EP exchange here (the fabric model is not calibrated on such a node)"
        if self.transport not in transports:
            return False, f"{self.transport} not found by discovery"
        return True, f"all_to_all_single over {self.backend}"

    def run(self, sizes: Sequence[int] = (), *, iters: int = 20, timeout_s: float = 120.0) -> list[MicroResult]:
        # sizes are token counts here; the row size follows from the model shape
        return super().run(sizes or self.tokens, iters=iters, timeout_s=timeout_s)

    def _argv_transport(self) -> str:
        return f"{self.transport}:{self.backend}:{self.model}"


class GlooP2P(Microbenchmark):
    transport = "collective"
    runner = "gloo_p2p"

    def available(self, transports: Sequence[str], gpu_count: int) -> tuple[bool, str]:
        return True, "gloo runs on any machine"


class NcclP2P(Microbenchmark):
    runner = "nccl_p2p"

    def __init__(self, transport: str = "nvlink"):
        self.transport = transport

    def env(self) -> dict[str, str]:
        return {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "0"} if self.transport == "host_staged" else {}

    def available(self, transports: Sequence[str], gpu_count: int) -> tuple[bool, str]:
        if gpu_count < 2:
            return False, f"needs 2 GPUs, node has {gpu_count}"
        if self.transport not in transports:
            return False, f"{self.transport} not found by discovery"
        return True, f"{gpu_count} GPUs, {self.transport} present"


class ProxySignalled(Microbenchmark):
    """The C++ proxy engine (csrc/) moving c concurrent transfers GPU a -> GPU b over copy-engine streams
    (the queue pairs), for put-only and each (fence_mode, signalling): `signalled_efficiency` rows
    (put-only time / signalled time, against concurrency) and `fence_cost` rows (extra time per fence of
    coupled signalling: (t_coupled - t_put_only) / c), both directions."""

    transport = "proxy"
    runner = "proxy_signalled"
    SIZES: tuple[int, ...] = (4096, 16384, 262144)

    def available(self, transports: Sequence[str], gpu_count: int) -> tuple[bool, str]:
        if gpu_count < 2:
            return False, f"needs 2 GPUs, node has {gpu_count}"
        from moetune.runtime import csrc_build

        ok, why = csrc_build.availability()
        return (True, "csrc proxy engine between GPU 0 and GPU 1") if ok else (False, why)

    def run(self, sizes: Sequence[int] = (), *, iters: int = 20, timeout_s: float = 180.0) -> list[MicroResult]:
        # message sizes of the Perseus experiment, not the latency sweep's
        return super().run(self.SIZES, iters=iters, timeout_s=timeout_s)


def plan(transports: Sequence[str], gpu_count: int, model: str = "qwen3-30b") -> list[tuple[Microbenchmark, bool, str]]:
    """Every microbenchmark with whether it applies here and why."""
    benches: list[Microbenchmark] = [GlooP2P(), NcclP2P("nvlink"), NcclP2P("host_staged")]
    if gpu_count >= 2:
        benches += [CollectiveA2A("nvlink", "nccl", model, (128, 1024, 4096)),
                    CollectiveA2A("host_staged", "nccl", model, (128, 1024, 4096)), ProxySignalled()]
    else:
        benches.append(CollectiveA2A("collective", "gloo", model, (64, 256, 1024)))
    return [(b, *b.available(transports, gpu_count)) for b in benches]


# -- subprocess side ---------------------------------------------------------------------------------


def _median_spread(samples: list[float]) -> tuple[float, float]:
    s = Summary.of(samples)
    return s.median, s.spread


def _init_pair(rank: int, port: int, backend: str):
    """Join the two-rank process group on loopback; returns this rank's device."""
    from moetune.runtime.testing.launch import init_dist

    return init_dist(rank, 2, backend=backend, port=port)


def _p2p_rank(rank: int, port: int, backend: str, sizes: list[int], iters: int, transport: str, q) -> None:
    import torch
    import torch.distributed as dist

    dev = _init_pair(rank, port, backend)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out = []
    warm = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    for _ in range(10):  # connection set-up and first-touch costs stay out of the first size
        if rank == 0:
            dist.send(warm, 1)
            dist.recv(warm, 1)
        else:
            dist.recv(warm, 0)
            dist.send(warm, 0)
    for size in sizes:
        buf = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
        for src in (0, 1):
            # Ping-pong: half the round trip is the one-way latency; a burst gives bandwidth.
            lat, bw = [], []
            for it in range(iters + 3):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                if rank == src:
                    dist.send(buf, 1 - rank)
                    dist.recv(buf, 1 - rank)
                else:
                    dist.recv(buf, 1 - rank)
                    dist.send(buf, 1 - rank)
                sync()
                t1 = time.perf_counter()
                burst = 8
                if rank == src:
                    for _ in range(burst):
                        dist.send(buf, 1 - rank)
                    dist.recv(buf[:1], 1 - rank)
                else:
                    for _ in range(burst):
                        dist.recv(buf, 1 - rank)
                    dist.send(buf[:1], 1 - rank)
                sync()
                t2 = time.perf_counter()
                if it >= 3:
                    lat.append((t1 - t0) / 2 * 1e6)
                    bw.append(size * burst / (t2 - t1) / 1e9)
            if rank == src:
                d = f"{src}->{1 - src}"
                out.append(asdict(MicroResult(transport, "latency", d, size, *_median_spread(lat), "us")))
                out.append(asdict(MicroResult(transport, "bandwidth", d, size, *_median_spread(bw), "GB/s")))
    gathered: list = [None, None]
    dist.all_gather_object(gathered, out)
    if rank == 0:
        q.put([r for part in gathered for r in part])
    dist.destroy_process_group()


def _spawn_pair(target: Callable, backend: str, sizes: list[int], iters: int, label: str) -> list[dict]:
    """Run target(rank, port, backend, sizes, iters, label, queue) on two spawned ranks; rank 0's rows."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    from moetune.runtime.testing.launch import free_port

    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, backend, sizes, iters, label, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    return q.get()


def _a2a_rank(rank: int, port: int, backend: str, tokens: list[int], iters: int, label: str, q) -> None:
    import torch
    import torch.distributed as dist

    from moetune.runtime.shapes import get_model

    fabric, _, model_name = label.split(":", 2)
    model = get_model(model_name)
    dev = _init_pair(rank, port, backend)
    rows = []
    for s in tokens:
        # k copies of every token, experts spread evenly over the two ranks (uniform routing)
        send = torch.randn(s * model.topk, model.hidden, device=dev).to(torch.bfloat16)
        recv = torch.empty_like(send)
        samples = []
        for it in range(iters + 3):
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if it >= 3:
                samples.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            ms, ms_spread = _median_spread(samples)
            rows.append(asdict(MicroResult(fabric, "a2a_dispatch", "both", s * model.topk * model.hidden * 2, ms * 1e3,
                                           ms_spread * 1e3, "us",
                                           {"probe": "collective_a2a", "fabric": fabric, "model": model.name, "S": s,
                                            "world": 2, "ms": ms, "comm_backend": backend})))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


# (fence_mode, signalling or None for put-only) of each proxy mode measured
PROXY_MODES: dict[str, tuple[str, str | None]] = {
    "put_only": ("none", None),
    "coupled+proxy_drain": ("proxy_drain", "coupled"),
    "decoupled+proxy_drain": ("proxy_drain", "decoupled"),
    "coupled+nic_ordered": ("nic_ordered", "coupled"),
    "decoupled+nic_ordered": ("nic_ordered", "decoupled"),
}
PROXY_CONCURRENCY: tuple[int, ...] = (1, 4, 16, 48, 96)
PROXY_QPS = 4  # per PE (the engine's streams are per peer: 12 PEs x 4 = 48 streams)
SLOTS_PER_PE = 128


def proxy_pes(c: int) -> int:
    """Destinations (emulated PEs) that c concurrent transfers spread over: at most 12, as in Perseus."""
    return {1: 1, 4: 4, 16: 8, 48: 12, 96: 12}.get(c, min(12, c))


def proxy_requests(c: int, size: int, signalling: str | None, src_base: int):
    """c transfers over proxy_pes(c) PEs (PE-major): coupled = a signal with every PUT, decoupled = one
    SIGNAL per PE after its PUTs, None = put-only. A PUT's signal slot is the slot of the signal that covers it (its
    own, or slot 0 of its PE's SIGNAL): the engine's peer_hash keeps them on one stream (nic_ordered needs it).
    Returns (requests, pes, transfers per PE)."""
    from moetune.runtime.transports import proxy as P

    npe = proxy_pes(c)
    per = c // npe
    items = []
    for p in range(npe):
        for t in range(per):
            i = p * per + t
            coupled = signalling == "coupled"
            items.append((P.OP_PUT, p, P.F_SIGNAL if coupled else 0, t if coupled else 0, src_base + i * size,
                          t * size, size))
        if signalling == "decoupled":
            items.append((P.OP_SIGNAL, p, 0, 0, 0, 0, 0))
    return P.make_requests(items), npe, per


def _proxy_signalled(sizes: list[int], iters: int, label: str) -> list[dict]:
    import torch

    from moetune.runtime.options import RuntimeOptions
    from moetune.runtime.transports import proxy as P

    lib = P.csrc_build.load()
    out: list[dict] = []
    warmup, max_c, max_size = 3, max(PROXY_CONCURRENCY), max(sizes)
    # the proxy thread where the runtime's transport puts it (the option proxy_cpu), so the fabric is measured
    # as the runtime will drive it
    opts = RuntimeOptions.resolve()
    cpus = {a: P.proxy_cpu_choice(opts, torch.device("cuda", a)).cpus for a in (0, 1)}
    value = 1
    for a, b in ((0, 1), (1, 0)):
        P.csrc_build.check(lib, lib.mt_enable_peer_access(a, b), f"enable peer access {a}->{b}")
        src = torch.empty(max_c * max_size, dtype=torch.uint8, device=f"cuda:{a}").random_(0, 255)
        dst = torch.zeros(max_c * max_size, dtype=torch.uint8, device=f"cuda:{b}")
        flags = torch.zeros(12 * SLOTS_PER_PE, dtype=torch.int64, device=f"cuda:{b}")
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        t_med: dict[tuple[str, int, int], tuple[float, float]] = {}
        for mode, (fence, signalling) in PROXY_MODES.items():
            for c in PROXY_CONCURRENCY:
                npe = proxy_pes(c)
                region = (c // npe) * max_size
                peers = [dst.data_ptr() + p * region for p in range(npe)]
                sigs = [flags.data_ptr() + p * SLOTS_PER_PE * 8 for p in range(npe)]
                eng = P.ProxyEngine(a, peers, peers, sigs, qps=PROXY_QPS, qp_mapping="peer_hash", fence_mode=fence,
                                    cpu=cpus[a])
                try:
                    for size in sizes:
                        reqs, _, _ = proxy_requests(c, size, signalling, src.data_ptr())
                        t = eng.bench(reqs, warmup + iters, value_base=value)[warmup:]
                        value += warmup + iters
                        t_med[(mode, c, size)] = _median_spread(t)
                finally:
                    eng.close()
        d = f"{a}->{b}"
        for (mode, c, size), (med, spread) in t_med.items():
            fence, signalling = PROXY_MODES[mode]
            put = t_med[("put_only", c, size)][0]
            extra = {"mode": mode, "fence_mode": fence, "signalling": signalling or "none", "concurrency": c,
                     # abi: qps is per peer since library ABI 19 (shared by every peer before): the row says which
                     "qps": PROXY_QPS, "abi": P.csrc_build.ABI_VERSION,
                     "us_median": med, "put_only_us": put, "GBps": c * size / med / 1e3}
            if signalling is not None:
                out.append(asdict(MicroResult("proxy", "signalled_efficiency", d, size, put / med, spread * put / med**2,
                                              "ratio", extra)))
            if signalling == "coupled":  # one fence per transfer
                out.append(asdict(MicroResult("proxy", "fence_cost", d, size, max(0.0, med - put) / c, spread / c,
                                              "us", extra)))
    return out


RUNNERS: dict[str, Callable[[list[int], int, str], list[dict]]] = {
    "proxy_signalled": _proxy_signalled,
    "a2a": lambda sizes, iters, label: _spawn_pair(_a2a_rank, label.split(":")[1], sizes, iters, label),
    "gloo_p2p": lambda sizes, iters, t: _spawn_pair(_p2p_rank, "gloo", sizes, iters, t),
    "nccl_p2p": lambda sizes, iters, t: _spawn_pair(_p2p_rank, "nccl", sizes, iters, t),
}


def _main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] not in RUNNERS:
        print(f"usage: python -m moetune.tuner.measure.micro {{{'|'.join(RUNNERS)}}} SIZES ITERS TRANSPORT", file=sys.stderr)
        return 2
    sizes = [int(s) for s in argv[1].split(",")]
    for row in RUNNERS[argv[0]](sizes, int(argv[2]), argv[3]):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
