"""Shared machinery of the one-sided transports (nvlink, proxy): symmetric buffers, epochs, errors.

Symmetric memory comes from torch (`torch.distributed._symmetric_memory`: `empty` + `rendezvous`,
whose handle gives every peer's mapped buffer address), with plain CUDA IPC handles exchanged through
the process group as the fallback (the runtime option `symm="ipc"` forces it). Why torch and not NVSHMEM here: it
works in one build step on the target image (plain nvcc, no -rdc, no NVSHMEM device library, no
module registration), and the kernels only need peer addresses to store into. NVSHMEM through
nvshmem4py stays the road to more than one node (its IBRC/IBGDA/libfabric transports); nvshmem4py's
Numba device API does not import on the image (nvshmem4py 0.4.1's numba-cuda 0.30.4 calls np.row_stack,
which the image's numpy 2.5 lacks), so device-side NVSHMEM would mean linking libnvshmem_device into
csrc/ -- a later step.
"""

from __future__ import annotations

import ctypes
import os
import time
import warnings
import weakref
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moetune.runtime import _args, csrc_build
from moetune.runtime.knobs import MAX_SLOTS as MAX_SLOTS  # the one-sided signal slot layout (MT_MAX_SLOTS)
from moetune.runtime.knobs import MAX_WORLD as MAX_WORLD  # its ranks, one node (MT_MAX_WORLD)
from moetune.runtime.knobs import KnobError, Knobs, one_sided_world_problem
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.transports.base import Availability, EPTransport

_ALIGN = 4096

ERR_NAMES = {
    1: "timeout waiting for a peer's count word",
    2: "timeout waiting for a data signal",
    3: "receive buffer capacity exceeded",
    4: "recv_counts differ from what the senders sent",
    5: "proxy FIFO stayed full (proxy thread dead or stalled)",
    6: "own outgoing transfers did not complete",
    7: "too many signal slots",
    8: "send_counts do not fit the send rows",
    9: "a peer refused its send counts",
}


class OneSidedError(RuntimeError):
    """A one-sided exchange failed on the GPU (timeout, overflow, mismatch) or in the proxy."""


def decode_error(words: list[int]) -> str:
    code = words[0]
    what = ERR_NAMES.get(code, f"error {code}")
    seen = (words[5] & 0xFFFFFFFF) | ((words[6] & 0xFFFFFFFF) << 32)
    if code == 3:  # capacity: seen = rows, expected = the rows one receive area holds (csrc: MT_ERR_CAPACITY)
        cap = words[7] & 0xFFFFFFFF
        if words[2] == -1:  # the receiver's own check over its whole column of the count matrix
            where = f"the ranks send rank {words[1]} {seen} rows in all; its receive area holds {cap}"
        else:  # a sender's check of where its own rows end
            where = (f"rank {words[1]}'s {words[3]} rows to rank {words[2]} would end at row {seen}; the receive "
                     f"area holds {cap}")
        return (f"{what}: {where} rows per call (epoch {words[4]}); reserve(max_send_rows, row_bytes) "
                "collectively for more rows")
    if code == 8:  # csrc: MT_ERR_SEND_COUNTS (slot 0: a negative count, 1: the counts run past the send rows,
        # 2: a gathered token outside x, 3: exchange_counts' count outside a count word)
        signed = seen - (1 << 64) if seen >= 1 << 63 else seen
        rows = words[7] & 0xFFFFFFFF
        if words[3] == 3:  # exchange_counts: a count no count word carries (sent marked as refused)
            return (f"{what}: exchange_counts: rank {words[1]}'s count for rank {words[2]} is {signed}, outside "
                    f"0..{(1 << 39) - 1} (epoch {words[4]}); rank {words[2]} received 0 rows from it and fails at once "
                    "(peer refused); clear_error() on every rank lets the next call run (before any other call)")
        if words[3] == 2:
            where = (f"rank {words[1]}'s send row for rank {words[2]} gathers token {signed}; x holds {rows} "
                     "tokens")
        else:
            if words[3] == 0:
                where = f"rank {words[1]}'s send count to rank {words[2]} is {signed}"
            else:
                where = f"rank {words[1]}'s send counts through rank {words[2]} add up to {signed} rows"
            where += f"; send holds {rows} rows"
        return (f"{what}: {where} (epoch {words[4]}); nothing was sent, the other ranks' calls fail at once "
                "(peer refused); clear_error() on every rank lets the next call run (before any other call)")
    if code == 9:  # csrc: MT_ERR_PEER_REFUSED (peer = the refusing rank; it reports why)
        return (f"{what}: rank {words[2]} refused its send counts in this call (epoch {words[4]}; its own error says "
                f"why), so rank {words[1]} exchanged no rows with it and its receive area lacks them; clear_error() "
                "on every rank lets the next call run (before any other call)")
    return (
        f"{what} (rank {words[1]}, peer {words[2]}, slot {words[3]}, epoch {words[4]}, "
        f"seen {seen:#x}, expected {words[7] & 0xFFFFFFFF})"
    )


def _group_obj(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _all_gather_ints(values: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    world = dist.get_world_size(group)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(world * len(values), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, t, group=group)
    flat = out.cpu().tolist()
    n = len(values)
    return [flat[i * n : (i + 1) * n] for i in range(world)]


def all_ok(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True when `ok` holds on every rank of the group (collective: keeps the ranks' next steps in line)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


# What a close() or finalizer did not free because a destroy past its timeout said a kernel or copy may still write
# it: held for the life of the process, so the memory is never handed to anyone else under that writer.
_LEAKED: list[Any] = []


def keep_leaked(*objs: Any) -> None:
    _LEAKED.append(objs)


def destroy_leak(lib: Any, name: str, rc: int) -> str | None:
    """None when the native destroy `name` returned 0; else what it leaked and why (its mt_last_error)."""
    if rc == 0:
        return None
    msg = lib.mt_last_error()
    return f"{name} returned {rc}: {msg.decode(errors='replace') if msg else 'no message'}"


def report_leaks(who: str, leaks: list[str], *, raise_: bool) -> None:
    """A close() raises RuntimeError naming the leaks; a GC finalizer (raise_=False), which must not raise, warns."""
    if not leaks:
        return
    text = f"{who}: " + "; ".join(leaks)
    if raise_:
        raise RuntimeError(text)
    warnings.warn(f"{text} (while collecting it without close())", RuntimeWarning, stacklevel=2)


def destroy_native(lib: Any, name: str, h: Any, who: str, loud: bool) -> list[str]:
    """lib.`name`(h), a native destroy: what it leaked, returned, and warned about as `who` unless `loud` (close(),
    which raises it; a GC finalizer must not)."""
    leak = destroy_leak(lib, name, getattr(lib, name)(h))
    leaks = [leak] if leak else []
    if not loud:
        report_leaks(who, leaks, raise_=False)
    return leaks


def on_collect(owner: object, func: Any, *args: Any) -> weakref.finalize:
    """func(*args) when `owner` is collected, or at once through run_now (once either way). The arguments must not
    hold `owner` (it would never be collected). Not run at interpreter exit. func(*args, loud=False), the
    collection, warns about what it leaked; run_now's call (loud=True) returns it to be raised. A collection while
    this thread captures a CUDA graph defers the destroy (`_collected`)."""
    f = weakref.finalize(owner, _collected, func, *args)
    f.atexit = False
    return f


# Destroys a collection put off because it came while this thread was capturing a CUDA graph: a destroy frees device
# memory and waits for the device, calls a capture in progress does not allow (it would fail the user's capture, at
# whatever point the garbage collector happened to run). Run at the next collection or run_now outside a capture.
_DEFERRED: list[tuple[Any, tuple[Any, ...]]] = []


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # broad: a collection may come at any time, even while CUDA is going away; never raise there
        return False


def _run_deferred() -> None:
    while _DEFERRED:
        func, args = _DEFERRED.pop()
        func(*args)  # loud=False: a leak is warned about, never raised


def _collected(func: Any, *args: Any) -> None:
    if _capturing():
        _DEFERRED.append((func, args))
        return
    _run_deferred()
    func(*args)


def run_now(f: weakref.finalize | None) -> list[str]:
    """Run an on_collect finalizer now, if it has not run: what it leaked. (Destroys an earlier collection put off
    during a graph capture run first, when no capture is on.)"""
    if not _capturing():
        _run_deferred()
    got = f.detach() if f is not None else None
    if got is None:
        return []
    _owner, _collect, args, kwargs = got
    func, *rest = args
    return func(*rest, **kwargs, loud=True)


def _barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    t = torch.ones(1, device=device)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(device)


class _CaiWrapper:
    """Exposes a raw device pointer through __cuda_array_interface__ so torch can view it."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class SymmBuffer:
    """`nbytes` of device memory on every rank, each rank's copy mapped into every process.

    `.local` is a uint8 tensor over this rank's copy; `.peer_ptrs[r]` the address of rank r's copy
    as seen from this process. Collective: every rank constructs it in the same order. `timeout_s`
    (the transport's onesided_timeout_s): how long the CUDA IPC fallback's mt_ipc_malloc waits for
    its zeroing (code 120 past it, the memory leaked).
    """

    def __init__(self, nbytes: int, group: dist.ProcessGroup | None, device: torch.device, lib: ctypes.CDLL,
                 mode: str = "torch", *, timeout_s: float):
        self.nbytes = int(nbytes)
        self.timeout_s = float(timeout_s)
        self.group = group
        self.device = device
        self.lib = lib
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = ""
        self.torch_error = ""
        self._ipc_ptrs: list[int] = []
        self._ipc_local = 0
        self._hdl: Any = None
        self.local: torch.Tensor | None = None
        try:
            ok = False
            if mode != "ipc":
                try:
                    self._init_torch()
                    ok = True
                except Exception as e:  # fall back to IPC, but say why
                    self.torch_error = f"{type(e).__name__}: {e}"
            # every rank must take the same road
            flags = _all_gather_ints([1 if ok else 0], group, device)
            if not all(f[0] for f in flags):
                if ok:
                    self._drop_torch()
                self._init_ipc()
            assert self.local is not None
            self.local.zero_()
            _barrier(group, device)
        except BaseException as e:  # raw cudaMalloc / opened IPC mappings: nobody holds this object to close it
            try:
                self.close()
            except Exception as c:
                e.add_note(f"releasing the half-built symmetric buffer failed too: {type(c).__name__}: {c}")
            raise

    def _init_torch(self) -> None:
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        try:  # plain CUDA backend (peer-mapped cuMem allocations) unless someone chose another already
            if not symm_mem.get_backend(self.device):
                symm_mem.set_backend("CUDA")
        except Exception:
            pass
        grp = _group_obj(self.group)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required by older torch, a deprecated no-op in newer ones
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(grp.group_name)
            except Exception:
                pass
        t = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        hdl = symm_mem.rendezvous(t, grp)
        bases = [int(p) for p in hdl.buffer_ptrs]
        off = t.data_ptr() - bases[self.rank]
        size = int(getattr(hdl, "buffer_size", self.nbytes + off))
        if off < 0 or off + self.nbytes > size:
            raise RuntimeError(f"tensor at offset {off} outside its symmetric block of {size} bytes")
        offs = _all_gather_ints([off], self.group, self.device)
        self.peer_ptrs = [bases[r] + offs[r][0] for r in range(self.world)]
        self.local = t
        self._hdl = hdl
        self.backend = "torch_symm_mem"

    def _drop_torch(self) -> None:
        self._hdl = None
        self.local = None

    def _init_ipc(self) -> None:
        """Every step records what it allocated at once (close() frees what is recorded), so that a failure part
        way frees the memory and the mappings made before it."""
        lib = self.lib
        ptr = ctypes.c_void_p()
        handle = ctypes.create_string_buffer(64)
        rc = lib.mt_ipc_malloc(self.device.index, self.nbytes, self.timeout_s, ctypes.byref(ptr), handle)
        self._ipc_local = int(ptr.value or 0)  # before the check: the allocation may succeed and a later step fail
        csrc_build.check(lib, rc, "cudaMalloc+IPC")
        h = torch.frombuffer(bytearray(handle.raw), dtype=torch.uint8).to(self.device)
        allh = torch.empty(self.world * 64, dtype=torch.uint8, device=self.device)
        dist.all_gather_into_tensor(allh, h, group=self.group)
        raw = bytes(allh.cpu().tolist())
        ptrs = []
        for r in range(self.world):
            if r == self.rank:
                ptrs.append(self._ipc_local)
                continue
            p = ctypes.c_void_p()
            csrc_build.check(lib, lib.mt_ipc_open(self.device.index, raw[r * 64 : (r + 1) * 64], ctypes.byref(p)), "cudaIpcOpenMemHandle")
            ptrs.append(int(p.value or 0))
            self._ipc_ptrs.append(ptrs[-1])
        self.peer_ptrs = ptrs
        self.local = torch.as_tensor(_CaiWrapper(self._ipc_local, self.nbytes), device=self.device)
        self.backend = "cuda_ipc"

    def close(self) -> None:
        """Free what is recorded as allocated: also the part a constructor that failed part way made (IPC memory
        and mappings exist before `backend` says cuda_ipc). A second call frees nothing."""
        ptrs, self._ipc_ptrs = self._ipc_ptrs, []
        local, self._ipc_local = self._ipc_local, 0
        self._hdl = None
        self.local = None
        try:
            for p in ptrs:
                self.lib.mt_ipc_close(self.device.index, p)
        finally:
            if local:  # the mappings of it in other processes are theirs to close
                self.lib.mt_device_free(self.device.index, local)


def u64_array(values: list[int]) -> Any:
    return (ctypes.c_uint64 * len(values))(*values)


def check_reserve_arguments(max_send_rows: Any, row_bytes: Any, who: str) -> None:
    """The constructor's sizing arguments: both None (reserve later) or both ints >= 1. One without the other would
    skip the collective reserve() on this rank alone; a str or float would fail (or truncate) inside it."""
    if max_send_rows is None and row_bytes is None:
        return
    if max_send_rows is None or row_bytes is None:
        raise ValueError(f"{who}max_send_rows and row_bytes go together (both, or neither to reserve later), got "
                         f"max_send_rows={max_send_rows!r}, row_bytes={row_bytes!r}")
    for name, value in (("max_send_rows", max_send_rows), ("row_bytes", row_bytes)):
        _args.check_int(name, value, 1, who)


def one_sided_availability(device: torch.device | None) -> Availability:
    if device is not None and device.type != "cuda":  # GPU-initiated copies: a CPU buffer cannot take part
        return Availability(False, f"needs a CUDA device, the buffer is on {device.type}")
    ok, why = csrc_build.availability()
    if not ok:
        return Availability(False, why)
    n = torch.cuda.device_count()
    if n < 1:
        return Availability(False, "no CUDA device")
    return Availability(True, f"ok ({n} CUDA devices visible)")


class OneSidedTransport(EPTransport):
    """Common state of nvlink/proxy: control buffer, data buffer (two parity areas), epochs."""

    device_counts: ClassVar[bool] = True
    # declared here, so that close() of a transport whose constructor failed part way reads it without a probe:
    # True until __init__ has built what close() frees, and again once close() has freed it
    _closed: bool = True
    data: SymmBuffer | None = None
    _err0: ctypes.c_int | None = None  # word 0 of the pinned error record, read without a call

    @classmethod
    def check_world(cls, world: int, who: str = "") -> None:
        """At most MAX_WORLD ranks (csrc MT_MAX_WORLD: the control block's signal and count-matrix rows), one node."""
        why = one_sided_world_problem(cls.name, world, who)
        if why:
            raise KnobError(why, ("transport",))

    @property
    def timeout_s(self) -> float:
        """Seconds a GPU wait may last before the peer counts as lost (runtime option onesided_timeout_s)."""
        return self.options.onesided_timeout_s

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        knobs: Knobs,
        device: torch.device | str,
        *,
        max_send_rows: int | None = None,
        row_bytes: int | None = None,
        options: RuntimeOptions | Mapping[str, Any] | None = None,
    ):
        super().__init__(group, knobs, device, options=options)  # the group/knob check, before anything else
        # the rest of the arguments too, before the first collective (the control buffer below): a rank refused
        # after it would leave its peers waiting in the next one
        who = f"{type(self).__name__}: "
        check_reserve_arguments(max_send_rows, row_bytes, who)
        if self.device.type != "cuda":  # (a CPU device was taken for the current CUDA device)
            raise ValueError(f"{who}needs a CUDA device, got {self.device}")
        if not dist.is_initialized():
            raise RuntimeError(f"{self.name}: needs an initialised torch.distributed process group")
        self.check_world(self.world, who)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.lib = csrc_build.load()
        ctrl_bytes = ctypes.c_uint64(0)
        self.lib.mt_ctrl_bytes(ctypes.byref(ctrl_bytes))
        self.ctrl = SymmBuffer(_round(ctrl_bytes.value), group, self.device, self.lib, self.options.symm,
                               timeout_s=self.timeout_s)
        self.data_bytes = 0  # one parity area (data, _err0: the class defaults None until reserve() / the subclass)
        self._epoch = 0
        self._counts_epoch = 0
        self._views: dict = {}
        self._closed = False

    # -- capacity ---------------------------------------------------------------------------------
    def reserve(self, max_send_rows: int, row_bytes: int) -> None:
        """Collective: size the receive buffer for calls in which each rank sends up to `max_send_rows` rows in
        all (summed over its destinations: a per-rank bound, not a per-peer one).

        Capacity = world x max_send_rows rows of row_bytes, twice (two parity areas: a call writes the
        area its epoch selects, so the previous call's output stays intact during the next call). Knob limits that
        depend on the rows sent to one peer (proxy chunk_tokens) are not checked here: the per-rank total only
        bounds them loosely (3000 rows over 3 peers may be 1000 each); EPBuffer checks its max_tokens (a real
        per-peer bound) and the proxy each call's own rows per peer.
        """
        self._refuse_closed()
        torch.cuda.synchronize(self.device)
        need = _all_gather_ints([int(max_send_rows), int(row_bytes)], self.group, self.device)
        rows = max(n[0] for n in need)
        rb = max(n[1] for n in need)
        per_parity = _round(max(1, self.world * rows * rb))
        if self.data is not None and per_parity <= self.data_bytes:
            return
        if self.data is not None:
            # forgotten before it is freed: if the new allocation fails, no call may view (or close again) the old one
            old, self.data, self.data_bytes, self._views = self.data, None, 0, {}
            old.close()
        self.data = SymmBuffer(2 * per_parity, self.group, self.device, self.lib, self.options.symm,
                               timeout_s=self.timeout_s)
        self.data_bytes = per_parity
        self._views = {}
        self._set_data()

    @abstractmethod
    def _set_data(self) -> None:
        """Point the kernels / proxy engine at the (re)allocated data buffer."""

    def _stream(self) -> int:
        """The raw handle of the current stream on this transport's device (cheap)."""
        try:
            return int(torch._C._cuda_getCurrentRawStream(self.device.index))
        except Exception:  # pragma: no cover - older/newer torch without the private helper
            return int(torch.cuda.current_stream(self.device).cuda_stream)

    def _counts_arg(self, counts: torch.Tensor) -> torch.Tensor:
        """Rows per rank as the kernels read them: int64, contiguous, on this device. Any integer tensor is taken
        (converted); a float or bool one is refused, not truncated (2.7 rows became 2)."""
        if not isinstance(counts, torch.Tensor):
            raise TypeError(f"{self.name}: counts must be an integer tensor of {self.world} row counts (one per rank), "
                            f"got {type(counts).__name__}")
        if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
            raise ValueError(f"{self.name}: counts must be an integer tensor (rows per rank), got {counts.dtype}")
        if counts.dtype is not torch.int64 or counts.device != self.device or not counts.is_contiguous():
            counts = counts.to(device=self.device, dtype=torch.int64).contiguous()
        if counts.numel() != self.world:
            raise ValueError(f"{self.name}: counts must have {self.world} entries, got {counts.numel()}")
        return counts

    def _prepare(self, send: torch.Tensor, send_counts: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        self.check()
        if send.device != self.device:
            raise ValueError(f"{self.name}: send must be on {self.device}, got {send.device}")
        if send.dim() < 1:
            raise ValueError(f"{self.name}: send must have a row dimension")
        if not send.is_contiguous():
            send = send.contiguous()
        rows = send.shape[0]
        rb = send.element_size() * (send.numel() // rows if rows > 0 else int(torch.Size(send.shape[1:]).numel()))
        if rb <= 0:
            raise ValueError(f"{self.name}: zero-byte rows")
        self._ensure_capacity(rows, rb)
        return send, rb, self._counts_arg(send_counts)

    def _ensure_capacity(self, rows: int, rb: int) -> None:
        """Reserve on first use; refuse a call whose rows cannot fit one parity area."""
        if self.data is None:
            # first call without reserve(): collective sizing (a one-time host synchronisation), with
            # headroom (next power of two) because later calls may carry more rows
            self.reserve(1 << max(0, rows - 1).bit_length(), rb)
        if rows * rb > self.data_bytes:
            # (the exact per-receiver bound is checked on the GPU, by each sender for its own rows and by each
            # receiver for what all senders send it together: an overflow is reported on both, never written)
            raise OneSidedError(
                f"{self.name}: {rows} rows x {rb} B exceed the reserved receive buffer "
                f"({self.data_bytes} B per call); call reserve(max_send_rows, row_bytes) collectively first"
            )

    def _recv_view(self, send: torch.Tensor, rb: int, epoch: int) -> torch.Tensor:
        """The receive area this call wrote (parity of its epoch), as rows shaped like `send`'s."""
        return self._recv_rows(send.dtype, tuple(send.shape[1:]), rb, epoch)

    def _recv_rows(self, dtype: torch.dtype, tail: tuple, rb: int, epoch: int) -> torch.Tensor:
        """The receive area of the call with this epoch: rows of `rb` bytes viewed as dtype [cap, *tail]."""
        key = (rb, dtype, tail, epoch & 1)
        v = self._views.get(key)
        if v is None:
            assert self.data is not None
            par = epoch & 1
            cap_rows = self.data_bytes // rb
            raw = self.data.local[par * self.data_bytes : par * self.data_bytes + cap_rows * rb]
            v = raw.view(dtype).view(cap_rows, *tail)
            self._views[key] = v
        return v

    # -- errors -----------------------------------------------------------------------------------
    @abstractmethod
    def error_words(self) -> list[int]:
        """The error words the device side wrote (decoded by `check`)."""

    def _map_error_record(self, h: ctypes.c_void_p, err_ptr: Callable[..., Any]) -> None:
        """Once the subclass made its kernels' context `h`: the host copy error_words() reads the record into, and
        word 0 of the pinned record itself, which check() reads without a call (`err_ptr`: the context's
        mt_*_err_ptr)."""
        self._err = (ctypes.c_int * 16)()
        ep = ctypes.c_void_p()
        err_ptr(h, ctypes.byref(ep))
        self._err0 = ctypes.c_int.from_address(ep.value) if ep.value else None

    def _extra_error(self) -> bool:
        """Subclass hook: another failure source (the proxy thread) reports an error."""
        return False

    def _refuse_closed(self) -> None:
        if self._closed:
            raise OneSidedError(f"{self.name}: the transport is not running (closed, or its constructor failed); "
                                "build a new one")

    def clear_error(self) -> None:
        """Forget a refused call so that the next one runs. A call whose send counts one rank refused (`send_counts do
        not fit the send rows` there, `a peer refused its send counts` on the others) keeps the ranks in step: every
        rank still published its count-matrix row and saw the others', and no rows went to or from the refusing
        rank. Each rank that raised such an error clears its own (local, no collective; it waits for this rank's
        earlier calls to finish). Only when the refused call is this rank's last: with a later call launched before
        the refusal was seen (asynchronous callers), a refusal in that call could not be recorded (the record keeps
        the first error) and the ranks may have launched different operations since, so OneSidedError. Any other
        error (a timeout, an overflow, counts that disagree, a failed proxy thread) is not cleared either: that call's
        waits ended early and the ranks may be out of step -- build a new transport. Nothing recorded: nothing to
        do."""
        self._refuse_closed()
        rc = self._clear_native()
        if rc:
            msg = self.lib.mt_last_error()
            raise OneSidedError(f"{self.name}: clear_error: {msg.decode(errors='replace') if msg else f'code {rc}'}")

    @abstractmethod
    def _clear_native(self) -> int:
        """The library's clear of a refusal (mt_*_clear_error): 0, or its error code (the text in mt_last_error)."""

    def check(self) -> None:
        """Raise OneSidedError if a kernel (or the proxy) reported a failure. Reads host memory only."""
        self._refuse_closed()  # a closed transport's error record is freed memory
        if self._err0 is not None and self._err0.value == 0 and not self._extra_error():
            return
        words = self.error_words()
        if words and words[0] != 0:
            raise OneSidedError(f"{self.name}: {decode_error(words)}")

    @property
    def symm_backend(self) -> str:
        return self.ctrl.backend

    def _release_native(self) -> list[str]:
        """Subclass hook: destroy what the subclass built over the symmetric buffers (the kernels' context, the
        proxy thread). close() runs it before the buffers go, also after a constructor that failed part way, so a
        handle not made yet must be a no-op. Returns what a destroy past its timeout leaked (destroy_leak)."""
        return []

    def _release_after_failure(self, error: BaseException) -> None:
        """A subclass constructor failed after this class allocated the symmetric buffers: free everything as
        close() does (nobody holds the half-built object to close it). The caller re-raises `error`; a failure
        while releasing is noted on it rather than raised over it."""
        try:
            self.close()
        except Exception as e:
            error.add_note(f"releasing the half-built {self.name} transport failed too: {type(e).__name__}: {e}")

    def close(self) -> None:
        """Free the native context and the symmetric buffers, once. Where work did not complete within timeout_s
        (the current stream's, or a native destroy's own), the buffers are leaked rather than freed under it and
        close raises RuntimeError naming the leak."""
        if self._closed:
            return
        self._closed = True
        self._err0 = None  # it points into pinned memory that _release_native frees
        leaks: list[str] = []
        try:
            if not self._current_stream_done(self.timeout_s):
                leaks.append(f"work on the current stream did not complete within {self.timeout_s:g} s")
        finally:
            try:
                leaks += self._release_native()  # before the buffers: the proxy thread / kernel context address them
            finally:
                if leaks:
                    keep_leaked(self.data, self.ctrl)
                else:
                    if self.data is not None:
                        self.data.close()
                    self.ctrl.close()
        if leaks:
            raise RuntimeError(f"{self.name} on rank {self.rank}: close: {'; '.join(leaks)}; its symmetric buffers are "
                               "leaked rather than freed under it")

    def _current_stream_done(self, timeout_s: float) -> bool:
        """Whether the work queued on this device's current stream completed within timeout_s (an event polled).
        The kernels launched there and the caller's work reading the returned receive views (they alias the data
        buffer) run on it; the native destroys wait for the kernels on other streams themselves. Not
        torch.cuda.synchronize: that waits, without a bound, for every stream of the device, other libraries' too."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        while not ev.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True


def _round(n: int) -> int:
    return (int(n) + _ALIGN - 1) // _ALIGN * _ALIGN
