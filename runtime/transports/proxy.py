"""`proxy` transport: a C++ CPU proxy engine drives copy engines, as NVSHMEM's proxy transports do.

One CPU thread per GPU (csrc/proxy_engine.cpp) drains a request FIFO in pinned host memory; a GPU
kernel (csrc/proxy_gpu.cu) produces the requests -- count words, PUTs, signals -- and then waits for
the signals of what the other ranks sent. PUTs are cudaMemcpyAsync on CUDA streams, the queue pairs:
`qps_per_pe` of them for each peer (world x qps_per_pe streams per engine); signals are cuStreamWriteValue64
into the receiver's signal slots.

Knobs used: fence_mode (`proxy_drain`: the thread stops until every earlier transfer completed;
`nic_ordered`: the signal is queued behind its data on its stream), qp_mapping (within a peer's streams:
`peer_hash` keeps a signal group's PUTs and SIGNAL on one and rotates the groups over them, `round_robin` gives each
request the next), qps_per_pe (streams per peer), signalling (`coupled`: a signal per PUT; `decoupled`: one signal
per group of `group_size` PUTs, 0 = per PE), chunk_tokens (rows per PUT; 0 = one PUT per peer).
Not capturable in a CUDA graph: each call's epoch is a kernel argument from the host, which a replay would repeat, so
exchange() and exchange_counts() raise OneSidedError inside a capture (use nvlink there).
The runtime option `proxy_batch=N` (> 1; `MOETUNE_PROXY_BATCH`) lets the proxy issue consecutive unsignalled PUTs of one QP stream as
one cudaMemcpyBatchAsync (off by default; bench/proxy_micro.py measures both). The runtime option `proxy_cpu`
(`numa` by default, `none`, or a CPU list) says where the proxy thread pins itself: to the set of CPUs local to the
GPU's NUMA node that the process may use, the OS placing it within the set, so that the engines of a process's
many EP buffers (one per MoE layer) spread over the set instead of sharing one core
(runtime/transports/_affinity.py); `ProxyTransport.proxy_cpu()` says where it runs.

`ProxyEngine` is the engine on its own (used by bench/proxy_micro.py); its constructor validates the
fence/QP combination through `Knobs` unless a test helper passes `_allow_unsafe=True`.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moetune.runtime import _args, csrc_build
from moetune.runtime._capture import capturing
from moetune.runtime.knobs import MAX_SLOTS, KnobError, Knobs, chunk_tokens_fit
from moetune.runtime.options import RuntimeOptions, proxy_cpu_setting
from moetune.runtime.transports import _affinity
from moetune.runtime.transports._onesided import (
    OneSidedError,
    OneSidedTransport,
    destroy_leak,
    destroy_native,
    on_collect,
    one_sided_availability,
    report_leaks,
    run_now,
    u64_array,
)
from moetune.runtime.transports.base import Availability

FENCE_MODES = {"none": 0, "proxy_drain": 1, "nic_ordered": 2}
QP_MAPPINGS = {"round_robin": 0, "peer_hash": 1}
OP_PUT, OP_SIGNAL, OP_WRITE64, OP_ACK = 1, 2, 3, 4
F_SIGNAL = 1
STAT_NAMES = ("processed", "puts", "signals", "drains", "drain_ns", "write64", "bytes", "acks", "busy_ns", "batches",
              "ack_writes")
# mt_proxy_cpu's fields and states (csrc/proxy_engine.h MtProxyCpuField, MtProxyCpuState)
CPU_FIELDS = ("ncpus", "state", "errno", "current", "tid")
CPU_STATES = ("pending", "unpinned", "pinned", "failed")
# mt_proxy_mem's fields and states (csrc/proxy_engine.h MtProxyMemField, MtProxyMemState)
MEM_FIELDS = ("state", "want", "node", "errno", "query_errno")
MEM_STATES = ("default", "bound", "fallback")


@dataclass(frozen=True)
class ProxyCpu:
    """Where a proxy thread runs, as its engine (and the kernel) report it."""

    requested: tuple[int, ...] | None  # the CPU set it was asked to pin itself to (None: no pinning asked)
    state: str  # "pinned", "unpinned" (none asked), "failed" (asked, refused: runs unpinned), "pending" (not yet run)
    error: str  # why pinning failed ("" unless failed)
    current: int | None  # the CPU the thread last saw itself on (after pinning, and whenever it idles long)
    tid: int | None  # the thread's kernel id (/proc/self/task/<tid>)
    reason: str = ""  # why this set, or why none (the transport's choice; "" for an engine built directly)
    allowed: tuple[int, ...] | None = None  # the kernel's affinity mask of the thread now (None: not readable)


@dataclass(frozen=True)
class FifoPlacement:
    """Where an engine's request FIFO and control page are, as the engine (and the kernel) report it."""

    state: str  # "bound" (on node `want`), "default" (no CPU set: the creating thread's node), "fallback" (see reason)
    want: int | None  # the NUMA node chosen for them (most CPUs of the pinned set); None: no set, or no node known
    node: int | None  # the node the FIFO's first page is on now (get_mempolicy); None: the kernel would not say (as for
    # cudaHostAlloc's pages, the "default" and "fallback" states, on a real GPU)
    reason: str  # how they were placed, or why not; and why `node` is unknown


def cpu_set(cpu: Iterable[int]) -> tuple[int, ...]:
    """ProxyEngine's `cpu` argument, a set of CPU indices (any iterable; () = no pinning), as a sorted tuple.
    TypeError for anything else: one CPU is the set of one, `(3,)`; a lone int or None is refused rather than
    read as a second form. ValueError for a negative index."""
    if isinstance(cpu, str | bytes) or not isinstance(cpu, Iterable):
        raise TypeError(f"proxy engine: cpu must be a set of CPU indices (() for no pinning), "
                        f"got {type(cpu).__name__} {cpu!r}")
    items = list(cpu)
    for c in items:
        _args.check_int("cpu", c, 0, "proxy engine: ")
    return tuple(sorted(set(items)))


class Request(ctypes.Structure):
    """One 64-byte FIFO slot (csrc/proxy_engine.h MtRequest)."""

    _fields_ = [
        ("op", ctypes.c_uint32),
        ("peer", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("signal_idx", ctypes.c_uint32),
        ("src", ctypes.c_uint64),
        ("dst_off", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("reserved0", ctypes.c_uint64),
        ("seq", ctypes.c_uint64),
    ]


assert ctypes.sizeof(Request) == 64


FIFO_SLOTS = (16, 1 << 20)  # what mt_proxy_create accepts (csrc/proxy_engine.cpp)


def check_fifo_slots(fifo_slots: Any, who: str = "") -> None:
    """An int in FIFO_SLOTS, refused here rather than by the C side (for the transport: after a collective)."""
    lo, hi = FIFO_SLOTS
    _args.check_int("fifo_slots", fifo_slots, lo, who)
    if fifo_slots > hi:
        raise ValueError(f"{who}fifo_slots must be <= {hi}, got {fifo_slots}")


def check_chunk_tokens(chunk_tokens: int, max_rows: int, who: str = "") -> None:
    """chunk_tokens rows per PUT on calls that send up to `max_rows` rows to one peer: at most MAX_SLOTS PUTs (one
    signal slot each), else KnobError. Past that the kernel would cut larger chunks than asked (csrc/proxy_xchg.h
    `chunking`), silently: a knob value that does not act as named (the tuner offers none: tuner/search/space.py)."""
    if not chunk_tokens_fit(chunk_tokens, max_rows):
        puts = -(-max_rows // chunk_tokens)
        raise KnobError(f"{who}chunk_tokens={chunk_tokens} would cut up to {max_rows} rows for one peer into {puts} "
                        f"PUTs, more than the {MAX_SLOTS} signal slots a peer has (rows / chunk_tokens must be <= "
                        f"{MAX_SLOTS}); use chunk_tokens >= {-(-max_rows // MAX_SLOTS)}, 0 (one PUT per peer), or fewer "
                        "rows per call (max_tokens)", ("chunk_tokens",))


def validate_modes(fence_mode: str, qp_mapping: str, qps: int) -> None:
    """The same rule Knobs enforces, for engines built outside a Knobs value."""
    if fence_mode == "none":
        return
    Knobs(transport="proxy", fence_mode=fence_mode, qp_mapping=qp_mapping, qps_per_pe=qps)


class ProxyEngine:
    """A proxy thread bound to `device`, serving `len(peer_data)` destinations.

    close() stops the thread (joined) and frees its FIFO, streams and pages; an engine dropped without close() is
    stopped the same way when it is collected (weakref.finalize; not at interpreter exit, where the process
    goes anyway and a CUDA call could wait on a dead peer's kernel)."""

    handle: ctypes.c_void_p | None = None  # the C engine (None until mt_proxy_create made it, and after close)
    _finalizer: weakref.finalize | None = None  # destroys the C engine once: at close(), or when collected

    def __init__(
        self,
        device: int,
        peer_data: list[int],
        peer_ctrl: list[int],
        peer_sig: list[int],
        *,
        qps: int = 1,
        qp_mapping: str = "peer_hash",
        fence_mode: str = "proxy_drain",
        fifo_slots: int = 4096,
        batch: int = 1,
        timeout_s: float = RuntimeOptions().onesided_timeout_s,
        cpu: Iterable[int] = (),
        _allow_unsafe: bool = False,
    ):
        """`cpu`: the set of CPUs the proxy thread pins itself to (the OS places it within the set; empty: no
        pinning), as `CpuChoice.cpus` gives it. A pinning the kernel refuses leaves the thread unpinned and warns
        once (ProxyCpuWarning); `cpu_binding()` says where it runs. `timeout_s`: how long the engine's waits last
        (its drains, close(), and mt_proxy_create's own wait for its set-up work); the C side refuses one that is
        not a finite number > 0 (code 215)."""
        if qp_mapping not in QP_MAPPINGS or fence_mode not in FENCE_MODES:
            raise KnobError(f"unknown qp_mapping {qp_mapping!r} or fence_mode {fence_mode!r}")
        if not _allow_unsafe:
            validate_modes(fence_mode, qp_mapping, qps)
        check_fifo_slots(fifo_slots, "proxy engine: ")
        cpus = cpu_set(cpu)
        self.lib = csrc_build.load()
        self.device = device
        self.fence_mode, self.qp_mapping, self.qps = fence_mode, qp_mapping, qps
        self.npeers = len(peer_data)
        self.timeout_s = float(timeout_s)
        h = ctypes.c_void_p()
        csrc_build.check(
            self.lib,
            self.lib.mt_proxy_create(
                device, self.npeers, u64_array(peer_data), u64_array(peer_ctrl), u64_array(peer_sig), qps,
                QP_MAPPINGS[qp_mapping], FENCE_MODES[fence_mode], fifo_slots, (ctypes.c_int * len(cpus))(*cpus),
                len(cpus), self.timeout_s, ctypes.byref(h),  # the set-up wait's bound: the caller's, not 20 s
            ),
            "mt_proxy_create",
        )
        self.handle = h
        self._finalizer = on_collect(self, _destroy_engine, self.lib, h)
        try:
            # (the engine's timeout, the bound of its drains and destroy, was set by mt_proxy_create: ABI 23)
            if batch > 1:
                csrc_build.check(self.lib, self.lib.mt_proxy_set_batch(h, int(batch)), "mt_proxy_set_batch")
            if cpus:
                b = self.cpu_binding()
                if b.state == "failed":
                    _affinity.warn_once(f"moetune: the proxy thread of GPU {device} could not pin itself to CPUs "
                                        f"{_affinity.format_cpulist(cpus)} ({b.error}); it runs unpinned")
                placed = self.fifo_placement()
                if placed.state == "fallback":  # still works, the polls may cross sockets: a line, not a warning
                    _affinity.note_once(f"moetune: the proxy FIFO of GPU {device} is not on the NUMA node of its "
                                        f"CPUs: {placed.reason}")
        except BaseException as e:  # the thread runs already, and the caller never gets this object to close it
            for leak in self._stop():  # noted, not raised over the cause
                e.add_note(f"stopping the half-built proxy engine: {leak}")
            raise

    def _live(self) -> ctypes.c_void_p:
        """The engine's handle; after close() the C side would dereference NULL, so refuse here."""
        if self.handle is None:
            raise OneSidedError("proxy engine: closed")
        return self.handle

    def set_peer_data(self, peer_data: list[int]) -> None:
        csrc_build.check(self.lib, self.lib.mt_proxy_set_peer_data(self._live(), u64_array(peer_data), len(peer_data)), "set_peer_data")

    def error(self) -> str | None:
        if self.handle is None:
            return "closed"
        buf = ctypes.create_string_buffer(1024)
        code = self.lib.mt_proxy_error(self.handle, buf, 1024)
        return None if code == 0 else f"{buf.value.decode(errors='replace')} (code {code})"

    def diag(self) -> str:
        """One line on the proxy thread's state (requests consumed; inside which CUDA call, or idle)."""
        if self.handle is None:
            return "closed"
        buf = ctypes.create_string_buffer(512)
        self.lib.mt_proxy_diag(self.handle, buf, 512)
        return buf.value.decode(errors="replace")

    def cpu_binding(self) -> ProxyCpu:
        """Where the proxy thread runs: the CPU set asked for, whether it is pinned to it (or why not), the CPU it
        last saw itself on, its thread id and the kernel's affinity mask of that thread now."""
        h = self._live()
        arr = (ctypes.c_int * len(CPU_FIELDS))()
        csrc_build.check(self.lib, self.lib.mt_proxy_cpu(h, arr, len(CPU_FIELDS)), "mt_proxy_cpu")
        v = dict(zip(CPU_FIELDS, list(arr), strict=True))
        requested = None
        if v["ncpus"] > 0:
            listed = (ctypes.c_int * v["ncpus"])()
            csrc_build.check(self.lib, self.lib.mt_proxy_cpu_list(h, listed, v["ncpus"]), "mt_proxy_cpu_list")
            requested = tuple(sorted(listed))
        state = CPU_STATES[v["state"]] if 0 <= v["state"] < len(CPU_STATES) else f"state {v['state']}"
        error = f"{os.strerror(v['errno'])} (errno {v['errno']})" if state == "failed" else ""
        tid = v["tid"] or None
        return ProxyCpu(requested, state, error, v["current"] if v["current"] >= 0 else None, tid,
                        allowed=thread_affinity(tid))

    def fifo_placement(self) -> FifoPlacement:
        """Where the request FIFO and the control page are: on the NUMA node of the pinned CPU set, or allocated by
        the creating thread (no set, or the node could not be bound: why), and the node the kernel says the FIFO's
        first page is on now."""
        arr = (ctypes.c_int * len(MEM_FIELDS))()
        buf = ctypes.create_string_buffer(512)
        csrc_build.check(self.lib, self.lib.mt_proxy_mem(self._live(), arr, len(MEM_FIELDS), buf, 512), "mt_proxy_mem")
        v = dict(zip(MEM_FIELDS, list(arr), strict=True))
        state = MEM_STATES[v["state"]] if 0 <= v["state"] < len(MEM_STATES) else f"state {v['state']}"
        reason = buf.value.decode(errors="replace")
        if v["node"] < 0 and v["query_errno"] == errno.EFAULT and state != "bound":
            # cudaHostAlloc's pages where the driver maps them so that the kernel will not say where they are
            # (a VM_IO mapping; the H200 machine of run 188 did report their node)
            reason += "; the node of its pages is unknown (CUDA's own pinned allocation: the kernel does not report it)"
        elif v["node"] < 0:
            reason += f"; the node of its pages is unknown ({os.strerror(v['query_errno'])}, errno {v['query_errno']})"
        return FifoPlacement(state, v["want"] if v["want"] >= 0 else None, v["node"] if v["node"] >= 0 else None,
                             reason)

    def stats(self) -> dict[str, int]:
        arr = (ctypes.c_uint64 * len(STAT_NAMES))()
        self.lib.mt_proxy_stats(self._live(), arr, len(STAT_NAMES))
        return dict(zip(STAT_NAMES, list(arr), strict=True))

    def reset_stats(self) -> None:
        self.lib.mt_proxy_reset_stats(self._live())

    def _timeout(self, timeout: Any, who: str) -> float:
        """A call's `timeout` in seconds: None is the engine's timeout_s; 0 is a real bound (one look, no wait), not
        "the default" (`timeout or timeout_s` made it one). The C side reads a negative or NaN as 0 and saturates
        inf, so those are refused here instead of taken silently."""
        if timeout is None:
            return self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"proxy engine {who}: timeout must be a number of seconds or None, got "
                            f"{type(timeout).__name__} {timeout!r}")
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"proxy engine {who}: timeout must be finite and >= 0 seconds (None: the engine's "
                             f"timeout_s), got {timeout!r}")
        return float(timeout)

    def enqueue(self, reqs: ctypes.Array, timeout: float | None = None) -> None:
        """Put `reqs` into the FIFO, waiting at most `timeout` seconds (None: timeout_s) while it is full."""
        seconds = self._timeout(timeout, "enqueue")
        csrc_build.check(self.lib, self.lib.mt_proxy_enqueue(self._live(), reqs, len(reqs), seconds), "enqueue")

    def quiesce(self, timeout: float | None = None) -> None:
        """Wait at most `timeout` seconds (None: timeout_s) until everything enqueued was issued and completed."""
        seconds = self._timeout(timeout, "quiesce")
        csrc_build.check(self.lib, self.lib.mt_proxy_quiesce(self._live(), seconds), "quiesce")

    def bench(self, reqs: ctypes.Array, iters: int, value_base: int, value_step: int = 1) -> list[float]:
        out = (ctypes.c_double * iters)()
        csrc_build.check(
            self.lib,
            self.lib.mt_proxy_bench(self._live(), reqs, len(reqs), iters, value_base, value_step, self.timeout_s, out),
            "mt_proxy_bench",
        )
        return list(out)

    def close(self) -> None:
        """Stop the proxy thread (joined) and free the engine; a second call does nothing. Raises RuntimeError
        where a QP stream did not complete within timeout_s (mt_proxy_destroy leaked the engine's memory)."""
        report_leaks("proxy engine: close", self._stop(), raise_=True)

    def _stop(self) -> list[str]:
        """close() without raising: what mt_proxy_destroy leaked."""
        self.handle = None
        return run_now(self._finalizer)  # set with the handle: mt_proxy_destroy(handle), once


def _destroy_engine(lib: Any, h: ctypes.c_void_p, loud: bool = False) -> list[str]:
    """mt_proxy_destroy(h) (`destroy_native`)."""
    return destroy_native(lib, "mt_proxy_destroy", h, "proxy engine", loud)


def _destroy_proxy_native(lib: Any, h: ctypes.c_void_p | None, engine: ProxyEngine | None,
                          loud: bool = False) -> list[str]:
    """The proxy transport's native parts, in order: the kernels' context (it enqueues into the engine and tells
    it which completion word to watch), then the engine (its thread joined). What they leaked: returned, and
    warned about unless `loud` (the caller raises it)."""
    leaks: list[str] = []
    try:
        if h is not None:
            leak = destroy_leak(lib, "mt_pxy_destroy", lib.mt_pxy_destroy(h))
            leaks += [leak] if leak else []
    finally:
        if engine is not None:
            leaks += engine._stop()
    if not loud:
        report_leaks("proxy transport", leaks, raise_=False)
    return leaks


def thread_affinity(tid: int | None) -> tuple[int, ...] | None:
    """The kernel's affinity mask of thread `tid` of this process (sorted), None where it cannot be read."""
    if tid is None:
        return None
    try:
        return tuple(sorted(os.sched_getaffinity(tid)))
    except (OSError, AttributeError):  # the thread is gone, or no sched_getaffinity (not Linux)
        return None


def gpu_pci_address(device: torch.device) -> str:
    """The GPU's PCI address as sysfs names it ('0000:19:00.0'); '' where torch gives none (no CUDA)."""
    try:
        p = torch.cuda.get_device_properties(device)
        return _affinity.sysfs_pci_address(f"{p.pci_domain_id:x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    except (AssertionError, RuntimeError, AttributeError, ValueError):  # CPU-only torch, no driver, older torch
        return ""


def proxy_cpu_choice(options: RuntimeOptions, device: torch.device) -> _affinity.CpuChoice:
    """The CPU set the proxy thread of `device` should pin itself to under `options.proxy_cpu`. When pinning
    cannot be done it chooses none and says why once: a warning (ProxyCpuWarning) for an explicit CPU list, or
    where the GPU's NUMA-local CPUs are known but the process may use none of them (a rank bound to the far
    socket); an info-level log record for the default `numa` on a machine without NUMA information."""
    kind, _ = proxy_cpu_setting(options.proxy_cpu)
    choice = _affinity.resolve(options.proxy_cpu, address=gpu_pci_address(device))
    if not choice.cpus and kind != "none":
        message = f"moetune: the proxy thread of {device} runs unpinned: {choice.reason}"
        (_affinity.warn_once if kind == "cpus" or choice.excluded else _affinity.note_once)(message)
    return choice


def make_requests(items: list[tuple[int, int, int, int, int, int, int]]) -> ctypes.Array:
    """items: (op, peer, flags, signal_idx, src, dst_off, bytes) -> a ctypes array of Request."""
    arr = (Request * len(items))()
    for i, (op, peer, flags, idx, src, dst_off, nbytes) in enumerate(items):
        arr[i] = Request(op, peer, flags, idx, src, dst_off, nbytes, 0, 0, 0)
    return arr


class ProxyTransport(OneSidedTransport):
    name: ClassVar[str] = "proxy"
    graph_capturable: ClassVar[bool] = False  # the call's epoch is a kernel argument from the host
    engine: ProxyEngine | None = None  # the proxy thread (None until the constructor has started it)
    cpu_choice: _affinity.CpuChoice = _affinity.CpuChoice((), "no proxy thread yet")  # where it was to run, why
    _h: ctypes.c_void_p | None = None  # the kernels' context (None until mt_pxy_create made it, and after close)
    _native: weakref.finalize | None = None  # destroys _h then the engine once: at close(), or when collected
    _keep: tuple = ()  # the last exchange's tensors, which its copies read (and those of calls that raised: exchange)

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        knobs: Knobs,
        device: torch.device | str,
        *,
        max_send_rows: int | None = None,
        row_bytes: int | None = None,
        fifo_slots: int = 8192,
        options: RuntimeOptions | Mapping[str, Any] | None = None,
    ):
        # the base class's group/knob check first (as it would run it), then this class's own argument: both before
        # the collective work of the base constructor, so a refused rank never joined a collective
        who = f"{type(self).__name__}: "
        self.check_arguments(group, knobs, who)
        check_fifo_slots(fifo_slots, who)
        super().__init__(group, knobs, device, max_send_rows=max_send_rows, row_bytes=row_bytes, options=options)
        try:
            if self.options.proxy_peer_access:
                # copy engines: enable peer access towards the other local GPUs (errors ignored: the
                # symmetric mappings already grant access; this only helps the runtime pick direct P2P)
                for other in range(torch.cuda.device_count()):
                    if other != self.device.index:
                        self.lib.mt_enable_peer_access(self.device.index, other)
            ctrl = self.ctrl.peer_ptrs
            sig_off = 8 * self.rank * MAX_SLOTS  # my slots at each peer (MT_OFF_SIG = 0)
            self.cpu_choice = proxy_cpu_choice(self.options, self.device)
            self.engine = ProxyEngine(
                self.device.index, list(ctrl), list(ctrl), [p + sig_off for p in ctrl],
                qps=knobs.qps_per_pe, qp_mapping=knobs.qp_mapping, fence_mode=knobs.fence_mode, fifo_slots=fifo_slots,
                batch=self.options.proxy_batch, timeout_s=self.timeout_s, cpu=self.cpu_choice.cpus,
            )
            h = ctypes.c_void_p()
            csrc_build.check(
                self.lib,
                self.lib.mt_pxy_create(self.engine.handle, self.device.index, self.rank, self.world, ctrl[self.rank], self.timeout_s, ctypes.byref(h)),
                "mt_pxy_create",
            )
            self._h = h
            # a transport dropped without close() stops its proxy thread when collected (not its symmetric buffers:
            # freeing those is collective in spirit, other ranks may still write into them)
            self._native = on_collect(self, _destroy_proxy_native, self.lib, h, self.engine)
            # host-completed calls (default): see mt_pxy_set_host_wait in csrc/proxy_gpu.cu for why
            self.host_wait = self.options.proxy_host_wait
            self.lib.mt_pxy_set_host_wait(h, 1 if self.host_wait else 0)
            self._map_error_record(h, self.lib.mt_pxy_err_ptr)
            if max_send_rows is not None and row_bytes is not None:
                self.reserve(max_send_rows, row_bytes)
        except BaseException as e:  # the symmetric buffers exist already: nobody else can free them
            self._release_after_failure(e)
            raise

    @classmethod
    def availability(cls, device: torch.device | None = None, options: RuntimeOptions | None = None) -> Availability:
        return one_sided_availability(device)

    @classmethod
    def check_rows(cls, knobs: Knobs, max_rows: int, who: str = "") -> None:
        check_chunk_tokens(knobs.chunk_tokens, max_rows, who)

    def _set_data(self) -> None:
        assert self.data is not None
        self._running_engine().set_peer_data(list(self.data.peer_ptrs))
        csrc_build.check(self.lib, self.lib.mt_pxy_set_data(self._h, self.data_bytes), "mt_pxy_set_data")

    def _refuse_capture(self, what: str) -> None:
        """The call's epoch is a kernel argument from the host, so a CUDA graph would replay the epoch of its capture:
        every replay after the first (and the first after any eager call) finds its signal slots already at that
        epoch and its count words from an earlier run with the same tag, and reads rows before they land -- wrong
        rows, no error. Refused before anything is launched or counted (graph_capturable is False)."""
        # (a torch without CUDA captures nothing, and its torch.cuda.device would raise)
        if torch.cuda.is_available() and capturing(self.device):
            raise OneSidedError(f"proxy: {what} cannot be captured in a CUDA graph (its epoch comes from the host per "
                                "call, and a replay would reuse the captured one); use transport=nvlink for graphs")

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        self.check()
        self._refuse_capture("exchange_counts")
        sc = self._counts_arg(send_counts)
        out = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self._counts_epoch += 1
        rc = self.lib.mt_pxy_counts(self._h, sc.data_ptr(), out.data_ptr(), self._counts_epoch, self._stream())
        self._after_call(rc, "mt_pxy_counts")
        self._keep_counts = sc
        return out

    def exchange(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Returns a view that stays valid until this rank's second next exchange() call.

        A call that raises (host wait on) has let its kernel end, and with it the copies of `send` that kernel's ACK
        covers (also on a failed proxy engine), except where the error says the kernel did not complete or this
        rank's own transfers timed out: then copies may still read `send`, so do not reuse or free it (the tensors
        this transport made for the call are held rather than freed)."""
        counts_in = send_counts
        self._refuse_capture("exchange")
        send, rb, sc = self._prepare(send, send_counts)
        self._check_call_chunks(send.shape[0], counts_in)
        rcv = self._counts_arg(recv_counts) if recv_counts is not None else None
        self._epoch += 1
        k = self.knobs
        rc = self.lib.mt_pxy_exchange(
            self._h, send.data_ptr(), send.shape[0], rb, sc.data_ptr(), rcv.data_ptr() if rcv is not None else None,
            1 if k.signalling == "coupled" else 0, int(k.group_size), int(k.chunk_tokens), self._epoch, self._stream(),
        )
        try:
            self._after_call(rc, "mt_pxy_exchange")
        except BaseException:
            # a kernel that did not complete (322) or whose ACK timed out may leave copies reading these: held, with
            # the earlier calls' tensors, rather than given back to the allocator under them
            self._keep = (self._keep, send, sc, rcv)
            raise
        self._keep = (send, sc, rcv)
        return self._recv_view(send, rb, self._epoch)

    def _check_call_chunks(self, rows: int, send_counts: torch.Tensor) -> None:
        """chunk_tokens against this call's own rows per peer (reserve's max_send_rows is a per-rank total, no
        per-peer bound): KnobError where one peer would need more than MAX_SLOTS PUTs. Nothing is read when the
        call's total rows fit (no peer gets more); else the counts are read (a synchronisation where they are on the
        GPU, only on calls of more than chunk_tokens x MAX_SLOTS rows; skipped during CUDA-graph capture, where
        they cannot be read). Local: a rank refused here launches nothing, and its peers' exchange
        reports the missing rank at the timeout, as for a capacity overflow."""
        ct = int(self.knobs.chunk_tokens)
        if ct <= 0 or rows <= ct * MAX_SLOTS:
            return
        if capturing(send_counts.device):  # the counts' device, which need not be the current one
            return
        peak = int(send_counts.max()) if send_counts.numel() else 0
        check_chunk_tokens(ct, peak, f"{self.name}: a call sending one peer {peak} rows: ")

    def _after_call(self, rc: int, what: str) -> None:
        if rc in (321, 322):  # host wait: the proxy thread failed / the kernel never completed
            raise OneSidedError(f"proxy: {what}: {(self.lib.mt_last_error() or b'').decode(errors='replace')}")
        if rc:
            csrc_build.check(self.lib, rc, what)
        if self.host_wait:
            self.check()  # the kernel has finished: its verdict is known now

    def _running_engine(self) -> ProxyEngine:
        """The proxy thread; one that never started or was closed is an error, not a NULL handle passed to C."""
        if self.engine is None or self.engine.handle is None:
            raise OneSidedError("proxy: the proxy engine is not running (closed, or the constructor failed)")
        return self.engine

    def check(self) -> None:
        """As OneSidedTransport.check, with the proxy thread's state appended to a failure."""
        try:
            super().check()
        except OneSidedError as e:
            state = self.engine.diag() if self.engine is not None else "not started"
            raise OneSidedError(f"{e} [proxy {state}]") from None

    def _extra_error(self) -> bool:
        engine = self.engine
        if engine is None or engine.handle is None:
            return True  # no thread to serve the requests: error_words says so
        return self.lib.mt_proxy_error(engine.handle, None, 0) != 0

    def error_words(self) -> list[int]:
        err = self._running_engine().error()
        if err:
            raise OneSidedError(f"proxy engine: {err}")
        if self._h is None:  # the C side would read through a NULL context
            raise OneSidedError("proxy: the transport is not running (closed, or its constructor failed)")
        self.lib.mt_pxy_error(self._h, self._err)
        return list(self._err)

    def _clear_native(self) -> int:
        err = self._running_engine().error()
        if err:  # the proxy thread's own failure: its copies or signals may be lost, nothing to clear
            raise OneSidedError(f"proxy: clear_error: the proxy engine failed ({err}); build a new transport")
        if self._h is None:
            raise OneSidedError("proxy: the transport is not running (closed, or its constructor failed)")
        return int(self.lib.mt_pxy_clear_error(self._h))

    def proxy_stats(self) -> dict[str, int]:
        return self._running_engine().stats()

    def proxy_cpu(self) -> ProxyCpu:
        """Where the proxy thread runs (pinned or not, and why: the runtime option `proxy_cpu`)."""
        return replace(self._running_engine().cpu_binding(), reason=self.cpu_choice.reason)

    def _release_native(self) -> list[str]:
        # the kernels' context first: it enqueues into the engine
        h, self._h = self._h, None
        native, self._native = self._native, None
        if native is not None:
            return run_now(native)  # _destroy_proxy_native, once
        # a constructor that failed before the finalizer was made
        return _destroy_proxy_native(self.lib, h, self.engine, loud=True)
