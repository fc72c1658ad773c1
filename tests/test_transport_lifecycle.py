"""One-sided transports (nvlink, proxy) on CPU, with the compiled library and the symmetric buffers faked:
a constructor that fails part way frees what it allocated, a transport that is closed or never started says so
(instead of an AttributeError, or a NULL handle handed to C), every transport refuses another family's knobs, and
bad arguments are refused before any collective. The symmetric buffer itself (CUDA IPC calls and collectives faked)
frees what it allocated when its constructor fails part way."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from moetune.runtime import csrc_build
from moetune.runtime.knobs import KnobError, Knobs, default_knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.transports import _onesided
from moetune.runtime.transports._onesided import OneSidedError
from moetune.runtime.transports.collective import CollectiveTransport
from moetune.runtime.transports.host_staged import HostStagedTransport
from moetune.runtime.transports.nvlink import NvlinkTransport
from moetune.runtime.transports.proxy import ProxyEngine, ProxyTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_mtlib import FakeMtLib

_NO_HANDLE_OK = ("_create", "_destroy")  # the only calls of the library that may see no (or a NULL) handle


class FakeLib(FakeMtLib):
    """The calls the one-sided transports make, logged; those named in `fail` return an error code. Every call
    taking a context/engine handle asserts it got one (the C side dereferences it)."""

    def __init__(self, log: list[tuple], fail: set[str]):
        self.log, self.fail = log, fail

    def mt_last_error(self) -> bytes:
        return b"injected failure"

    def call(self, name: str, args: tuple) -> int:
        self.log.append((name, args[0] if name.endswith("_destroy") else None))
        if not name.endswith(_NO_HANDLE_OK):
            assert args[0] is not None and getattr(args[0], "value", 1), f"{name} given a NULL handle"
        return 7 if name in self.fail else super().call(name, args)


class FakeSymm:
    """A symmetric buffer that only records its life."""

    def __init__(self, log: list[tuple], nbytes: int):
        self.log, self.nbytes = log, nbytes
        self.peer_ptrs = [0x100000]
        self.local = torch.zeros(nbytes, dtype=torch.uint8)
        self.backend = "fake"
        log.append(("symm", nbytes))

    def close(self) -> None:
        self.log.append(("symm_close", self.nbytes))


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple], set[str]]:
    """(log, fail): a world of 1 over the fakes; put a library call's name in `fail` to make it fail."""
    log: list[tuple] = []
    fail: set[str] = set()
    lib = FakeLib(log, fail)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(csrc_build, "load", lambda **kw: lib)
    monkeypatch.setattr(_onesided, "SymmBuffer", lambda nbytes, group, device, lib, mode="torch", timeout_s=20.0: FakeSymm(log, nbytes))
    monkeypatch.setattr(_onesided, "_all_gather_ints", lambda values, group, device: [list(values)])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(_onesided.OneSidedTransport, "_current_stream_done", lambda self, timeout_s: True)
    return log, fail


def _build(cls: type, **kw: Any) -> Any:
    return cls(None, default_knobs(cls.name), torch.device("cuda", 0), options=RuntimeOptions(), **kw)


def _names(log: list[tuple]) -> list[str]:
    return [e[0] for e in log]


# -- a failing constructor frees what it allocated ----------------------------------------------------------------
def test_nvlink_whose_context_cannot_be_created_frees_its_control_buffer(fake_gpu: tuple) -> None:
    log, fail = fake_gpu
    fail.add("mt_nvl_create")
    with pytest.raises(csrc_build.CsrcError, match="mt_nvl_create failed"):
        _build(NvlinkTransport)
    assert _names(log) == ["symm", "mt_nvl_create", "symm_close"]  # no destroy of a context never made


def test_nvlink_whose_reserve_fails_frees_context_and_both_buffers(fake_gpu: tuple) -> None:
    log, fail = fake_gpu
    fail.add("mt_nvl_set_data")
    with pytest.raises(csrc_build.CsrcError, match="mt_nvl_set_data"):
        _build(NvlinkTransport, max_send_rows=8, row_bytes=256)
    names = _names(log)
    assert names.count("symm") == 2 and names.count("symm_close") == 2
    # the context goes before the memory it addresses
    assert names.index("mt_nvl_destroy") < names.index("symm_close")


def test_proxy_whose_engine_does_not_start_frees_its_control_buffer(fake_gpu: tuple) -> None:
    log, fail = fake_gpu
    fail.add("mt_proxy_create")
    with pytest.raises(csrc_build.CsrcError, match="mt_proxy_create failed"):
        _build(ProxyTransport)
    assert _names(log) == ["symm", "mt_proxy_create", "symm_close"]


def test_proxy_whose_kernel_context_fails_stops_its_engine_and_frees_the_buffer(fake_gpu: tuple) -> None:
    log, fail = fake_gpu
    fail.add("mt_pxy_create")
    with pytest.raises(csrc_build.CsrcError, match="mt_pxy_create failed"):
        _build(ProxyTransport)
    names = _names(log)
    assert "mt_pxy_destroy" not in names  # no context was made
    assert names[-2:] == ["mt_proxy_destroy", "symm_close"]  # the thread stops before the memory it serves goes


def test_proxy_engine_whose_batch_setting_fails_stops_its_thread(fake_gpu: tuple) -> None:
    log, fail = fake_gpu
    fail.add("mt_proxy_set_batch")
    with pytest.raises(csrc_build.CsrcError, match="mt_proxy_set_batch"):
        ProxyEngine(0, [0], [0], [0], batch=4)
    assert _names(log) == ["mt_proxy_create", "mt_proxy_set_batch", "mt_proxy_destroy"]


@pytest.mark.parametrize("cls", [ProxyTransport, NvlinkTransport])
def test_the_configured_timeout_bounds_every_creation(fake_gpu: tuple, monkeypatch: pytest.MonkeyPatch,
                                                      cls: type) -> None:
    """The user's onesided_timeout_s reaches every creation's bounded set-up wait: mt_proxy_create's timeout_s (ABI
    23), both symmetric buffers (control and data: their CUDA IPC fallback's mt_ipc_malloc), and the contexts'
    mt_pxy_create / mt_nvl_create. Before, mt_proxy_create and mt_ipc_malloc waited a fixed 20 s (the default),
    whatever was configured."""
    log, _fail = fake_gpu
    lib = csrc_build.load()
    calls: dict[str, tuple] = {}
    plain = lib.call

    def call(name: str, args: tuple) -> int:
        calls.setdefault(name, args)
        return plain(name, args)

    monkeypatch.setattr(lib, "call", call)
    symm: list[float] = []

    def buffer(nbytes: int, group: Any, device: Any, lib: Any, mode: str = "torch", *, timeout_s: float) -> FakeSymm:
        symm.append(timeout_s)
        return FakeSymm(log, nbytes)

    monkeypatch.setattr(_onesided, "SymmBuffer", buffer)
    t = cls(None, default_knobs(cls.name), torch.device("cuda", 0), options=RuntimeOptions(onesided_timeout_s=45.0),
            max_send_rows=8, row_bytes=256)
    t.close()
    assert symm == [45.0, 45.0]  # control buffer, data buffer
    if cls is ProxyTransport:
        create = calls["mt_proxy_create"]
        assert len(create) == len(csrc_build.SIGNATURES["mt_proxy_create"][1]) and create[-2] == 45.0, create
        assert calls["mt_pxy_create"][-2] == 45.0
        assert "mt_proxy_set_timeout" not in calls  # mt_proxy_create set it: nothing to set twice
    else:
        assert calls["mt_nvl_create"][-2] == 45.0


def test_a_failure_while_releasing_is_noted_not_raised_over_the_cause(fake_gpu: tuple,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _log, fail = fake_gpu
    fail.add("mt_nvl_create")

    def lost_device(self: Any, timeout_s: float) -> bool:
        raise RuntimeError("CUDA error: device lost")

    monkeypatch.setattr(_onesided.OneSidedTransport, "_current_stream_done", lost_device)
    with pytest.raises(csrc_build.CsrcError, match="mt_nvl_create failed") as e:
        _build(NvlinkTransport)
    assert any("device lost" in n for n in e.value.__notes__)


# -- closed or never started: a clear error -------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ProxyTransport, NvlinkTransport])
def test_a_transport_never_built_says_it_is_not_running(cls: type) -> None:
    t = object.__new__(cls)  # what a constructor leaves when it fails before the engine / context exist
    with pytest.raises(OneSidedError, match="not running"):
        t.check()
    with pytest.raises(OneSidedError, match="not running"):
        t.error_words()
    with pytest.raises(OneSidedError, match="not running"):
        t.reserve(8, 256)
    t.close()  # nothing to free


def test_a_proxy_without_its_engine_reports_that_not_an_attribute_error() -> None:
    t = object.__new__(ProxyTransport)
    assert t._extra_error() is True
    with pytest.raises(OneSidedError, match="proxy engine is not running"):
        t.proxy_stats()


@pytest.mark.parametrize("cls", [ProxyTransport, NvlinkTransport])
def test_a_closed_transport_says_so_and_never_hands_c_a_freed_handle(fake_gpu: tuple, cls: type) -> None:
    log, _fail = fake_gpu
    t = _build(cls, max_send_rows=8, row_bytes=256)
    t.check()  # running: no error
    t.close()
    names = _names(log)
    assert names.count("symm_close") == 2 and names.count("mt_nvl_destroy" if cls is NvlinkTransport else
                                                           "mt_pxy_destroy") == 1
    with pytest.raises(OneSidedError, match="not running"):
        t.check()
    with pytest.raises(OneSidedError, match="not running"):
        t.error_words()
    with pytest.raises(OneSidedError, match="not running"):
        t.reserve(8, 256)  # would allocate a buffer nobody frees
    if cls is ProxyTransport:
        assert t._extra_error() is True
        with pytest.raises(OneSidedError, match="not running"):
            t.proxy_stats()
        assert t.engine.diag() == "closed" and t.engine.error() == "closed"
    n = len(log)
    t.close()  # twice: nothing more
    assert len(log) == n


# -- a destroy that leaked: close() raises, a finalizer warns -----------------------------------------------------------
@pytest.mark.parametrize(("cls", "destroy"), [(NvlinkTransport, "mt_nvl_destroy"), (ProxyTransport, "mt_pxy_destroy"),
                                              (ProxyTransport, "mt_proxy_destroy")])
def test_close_raises_naming_a_destroy_that_leaked_and_keeps_the_buffers(fake_gpu: tuple, cls: type,
                                                                         destroy: str) -> None:
    """A native destroy past its timeout leaks what a kernel or stream may still write and returns nonzero: close()
    raises a RuntimeError naming the destroy and its message, keeps the symmetric buffers the kernel addresses
    (rather than free them with the leak shown in mt_last_error only), and still stops the rest (the proxy's engine
    after its kernel context)."""
    log, fail = fake_gpu
    t = _build(cls, max_send_rows=8, row_bytes=256)
    fail.add(destroy)
    with pytest.raises(RuntimeError, match=rf"{cls.name} on rank 0: close: {destroy} returned 7: injected failure; "
                                           "its symmetric buffers are leaked rather than freed under it"):
        t.close()
    names = _names(log)
    assert "symm_close" not in names
    if cls is ProxyTransport:
        assert names.index("mt_pxy_destroy") < names.index("mt_proxy_destroy")
    n = len(log)
    t.close()  # once: nothing more, no second raise
    assert len(log) == n


def test_close_leaks_the_buffers_when_the_current_stream_does_not_finish(fake_gpu: tuple,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """close() polls an event on the current stream for timeout_s, not torch.cuda.synchronize (no bound, and every
    library's work on the device). Past it the native context is still destroyed (bounded) but the buffers the
    returned views alias are kept, and close() says so."""
    log, _fail = fake_gpu
    t = _build(NvlinkTransport, max_send_rows=8, row_bytes=256)
    monkeypatch.setattr(_onesided.OneSidedTransport, "_current_stream_done", lambda self, timeout_s: False)
    with pytest.raises(RuntimeError, match=r"close: work on the current stream did not complete within 20 s; its "
                                           "symmetric buffers are leaked"):
        t.close()
    names = _names(log)
    assert "mt_nvl_destroy" in names and "symm_close" not in names


def test_proxy_engine_close_raises_and_its_finalizer_warns_where_destroy_leaked(fake_gpu: tuple) -> None:
    """ProxyEngine.close() raises naming mt_proxy_destroy's leak; an engine or transport dropped without close()
    warns instead (a finalizer must not raise), once."""
    import gc

    _log, fail = fake_gpu
    fail.add("mt_proxy_destroy")
    e = ProxyEngine(0, [0], [0], [0])
    with pytest.raises(RuntimeError, match="proxy engine: close: mt_proxy_destroy returned 7: injected failure"):
        e.close()
    e.close()  # once
    with pytest.warns(RuntimeWarning, match=r"proxy engine: mt_proxy_destroy returned 7: injected failure \(while "
                                            r"collecting it without close\(\)\)"):
        ProxyEngine(0, [0], [0], [0])  # dropped at once
        gc.collect()
    fail.add("mt_pxy_destroy")
    with pytest.warns(RuntimeWarning, match="proxy transport: mt_pxy_destroy returned 7: injected failure; "
                                            "mt_proxy_destroy returned 7"):
        _build(ProxyTransport)
        gc.collect()


@pytest.mark.parametrize("cls", [NvlinkTransport, ProxyTransport])
def test_a_transport_dropped_without_close_destroys_its_native_context_once(fake_gpu: tuple, cls: type) -> None:
    """A transport dropped without close() is finalized: collecting it runs mt_nvl_destroy, once, so its context's
    device memory (error record, abort flag, group counters, epochs) is not leaked, and leaves the symmetric buffers
    alone as the proxy does; a close() before means no second destroy."""
    import gc

    log, _fail = fake_gpu
    destroy = "mt_nvl_destroy" if cls is NvlinkTransport else "mt_pxy_destroy"
    _build(cls, max_send_rows=8, row_bytes=256)  # dropped at once
    gc.collect()
    assert _names(log).count(destroy) == 1 and "symm_close" not in _names(log)
    t = _build(cls, max_send_rows=8, row_bytes=256)
    t.close()
    del t
    gc.collect()
    assert _names(log).count(destroy) == 2  # the close's, not another at collection


@pytest.mark.parametrize("cls", [NvlinkTransport, ProxyTransport])
def test_a_transport_collected_during_a_graph_capture_is_destroyed_after_it(fake_gpu: tuple, cls: type,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection may come at any point, also inside the caller's `torch.cuda.graph` block: a destroy there frees
    device memory and waits for the device, which a capture in progress refuses (the user's capture failed). It is put
    off to the next collection, or close(), outside the capture."""
    import gc

    log, _fail = fake_gpu
    destroy = "mt_nvl_destroy" if cls is NvlinkTransport else "mt_pxy_destroy"
    capturing = [True]
    monkeypatch.setattr(_onesided, "_capturing", lambda: capturing[0])
    _build(cls, max_send_rows=8, row_bytes=256)  # dropped at once, "during the capture"
    gc.collect()
    assert destroy not in _names(log)
    capturing[0] = False
    t = _build(cls, max_send_rows=8, row_bytes=256)
    t.close()  # outside the capture: the deferred destroy first, then this one's
    assert _names(log).count(destroy) == 2 and not _onesided._DEFERRED


def test_an_nvlink_transport_collected_without_close_warns_where_its_destroy_leaked(fake_gpu: tuple) -> None:
    """The finalizer never raises: a destroy that leaked is a RuntimeWarning naming it."""
    import gc

    log, fail = fake_gpu
    fail.add("mt_nvl_destroy")
    with pytest.warns(RuntimeWarning, match=r"nvlink transport: mt_nvl_destroy returned 7: injected failure \(while "
                                            r"collecting it without close\(\)\)"):
        _build(NvlinkTransport)  # dropped at once
        gc.collect()
    assert _names(log).count("mt_nvl_destroy") == 1


# -- another family's knobs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [NvlinkTransport, ProxyTransport])
def test_one_sided_transports_refuse_other_knobs_before_allocating(fake_gpu: tuple, cls: type) -> None:
    log, _fail = fake_gpu
    for other in ("collective", "host_staged", "nvlink", "proxy"):
        if other == cls.name:
            continue
        # not rewritten into this transport's knobs, which would run a setting nobody asked for
        with pytest.raises(KnobError, match=f"needs transport={cls.name} knobs, got transport='{other}'") as e:
            cls(None, default_knobs(other), torch.device("cuda", 0), options=RuntimeOptions())
        assert e.value.knobs == ("transport",)
    assert log == []


def test_collective_transports_refuse_other_knobs() -> None:
    for cls, other in ((CollectiveTransport, "nvlink"), (CollectiveTransport, "host_staged"),
                       (HostStagedTransport, "collective"), (HostStagedTransport, "proxy")):
        with pytest.raises(KnobError, match=f"needs transport={cls.name} knobs"):
            cls(None, default_knobs(other), "cpu", options=RuntimeOptions())
    # their own family's still build (world 1, no process group)
    assert CollectiveTransport(None, Knobs(), "cpu", options=RuntimeOptions()).knobs == Knobs()
    hs = HostStagedTransport(None, Knobs(transport="host_staged", staging_slots=3), "cpu", options=RuntimeOptions())
    assert hs.ring == 3


# -- arguments are refused before any collective ----------------------------------------------------------------------
_BAD_ARGUMENTS: list[tuple[str, dict[str, Any], type, str]] = [
    ("rows_as_str", {"max_send_rows": "8", "row_bytes": 256}, TypeError, "max_send_rows must be an int"),
    ("rows_as_float", {"max_send_rows": 2.5, "row_bytes": 256}, TypeError, "max_send_rows must be an int"),
    ("row_bytes_zero", {"max_send_rows": 8, "row_bytes": 0}, ValueError, "row_bytes must be >= 1"),
    ("rows_without_row_bytes", {"max_send_rows": 8}, ValueError, "max_send_rows and row_bytes go together"),
    ("row_bytes_without_rows", {"row_bytes": 256}, ValueError, "max_send_rows and row_bytes go together"),
    ("cpu_device", {"device": "cpu"}, ValueError, "needs a CUDA device, got cpu"),
]


@pytest.mark.parametrize("cls", [NvlinkTransport, ProxyTransport])
@pytest.mark.parametrize("case", _BAD_ARGUMENTS, ids=[c[0] for c in _BAD_ARGUMENTS])
def test_one_sided_transports_refuse_bad_arguments_before_any_collective(fake_gpu: tuple, monkeypatch: pytest.MonkeyPatch,
                                                                         cls: type, case: tuple) -> None:
    """The sizing arguments were read only by reserve(), after the control buffer's collective allocation (a str
    failed there, a float was truncated, max_send_rows without row_bytes skipped the collective reserve on this
    rank alone), and a CPU device was taken for the current CUDA device. A rank refused after a collective leaves
    its peers waiting in the next one: every collective the constructor could reach is recorded, none may run."""
    log, _fail = fake_gpu
    for name in ("all_gather_into_tensor", "all_reduce", "barrier", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: log.append((_n, None)))
    _name, kw, error, match = case
    kw = dict(kw)
    device = kw.pop("device", torch.device("cuda", 0))
    with pytest.raises(error, match=match):
        cls(None, default_knobs(cls.name), device, options=RuntimeOptions(), **kw)
    assert log == []


@pytest.mark.parametrize(("fifo_slots", "error", "match"), [
    (8, ValueError, "fifo_slots must be >= 16"), (1 << 21, ValueError, "fifo_slots must be <= 1048576"),
    ("8192", TypeError, "fifo_slots must be an int"), (True, TypeError, "fifo_slots must be an int"),
])
def test_proxy_refuses_a_fifo_size_before_any_collective(fake_gpu: tuple, monkeypatch: pytest.MonkeyPatch,
                                                         fifo_slots: Any, error: type, match: str) -> None:
    """The C engine refused a FIFO outside 16..2^20 slots, but only after the control buffer's collective (a str
    reached it as a pointer). The engine alone refuses it too, before starting a thread."""
    log, _fail = fake_gpu
    for name in ("all_gather_into_tensor", "all_reduce", "barrier", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: log.append((_n, None)))
    with pytest.raises(error, match=match):
        _build(ProxyTransport, fifo_slots=fifo_slots)
    with pytest.raises(error, match=match):
        ProxyEngine(0, [0], [0], [0], fifo_slots=fifo_slots)
    assert log == []
    _build(ProxyTransport, fifo_slots=16).close()  # the bounds themselves are accepted
    _build(ProxyTransport, fifo_slots=1 << 20).close()


# -- a symmetric buffer whose constructor fails part way frees what it allocated -------------------------------------
class FakeIpcLib:
    """The CUDA IPC calls of SymmBuffer, logged. `fail` names a call that returns an error: mt_ipc_malloc after it
    allocated (as when cudaIpcGetMemHandle fails), mt_ipc_open at the peer given in `fail_peer`;
    "mt_ipc_malloc_timeout": its zeroing did not complete within the bound (120: the memory leaked, the pointer
    nulled). `timeouts`: the timeout_s each mt_ipc_malloc was given (the bound of its wait for the zeroing)."""

    def __init__(self, log: list[tuple], fail: set[str], fail_peer: int = -1):
        self.log, self.fail, self.fail_peer, self.opened = log, fail, fail_peer, 0
        self.timeouts: list[float] = []

    def mt_last_error(self) -> bytes:
        return b"injected failure"

    def mt_ipc_malloc(self, dev: Any, nbytes: int, timeout_s: float, ptr: Any, handle: Any) -> int:
        self.timeouts.append(timeout_s)
        ptr._obj.value = 0xA000
        self.log.append(("malloc", 0xA000))
        if "mt_ipc_malloc_timeout" in self.fail:  # csrc/mt_common.cu zeroing_timed_out
            ptr._obj.value = None
            return 120
        return 9 if "mt_ipc_malloc" in self.fail else 0

    def mt_ipc_open(self, dev: Any, raw: bytes, ptr: Any) -> int:
        self.opened += 1
        if "mt_ipc_open" in self.fail and self.opened == self.fail_peer:
            return 9
        ptr._obj.value = 0xB000 + self.opened
        self.log.append(("open", 0xB000 + self.opened))
        return 0

    def mt_ipc_close(self, dev: Any, p: int) -> int:
        if "mt_ipc_close" in self.fail:
            raise OSError("driver gone")
        self.log.append(("close", p))
        return 0

    def mt_device_free(self, dev: Any, p: int) -> int:
        self.log.append(("free", p))
        return 0


@pytest.fixture
def ipc_world(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Rank 0 of a world of 3 on the CPU, the collectives faked (each logged); returns the log."""
    log: list[tuple] = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def gather(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
        log.append(("all_gather", None))
        out.copy_(inp.repeat(3))

    monkeypatch.setattr(dist, "all_gather_into_tensor", gather)
    monkeypatch.setattr(_onesided, "_all_gather_ints", lambda values, group, device: [list(values)] * 3)
    monkeypatch.setattr(_onesided, "_barrier", lambda group, device: log.append(("barrier", None)))
    # a CPU stand-in for the view over the raw device pointer
    monkeypatch.setattr(_onesided, "_CaiWrapper", lambda ptr, nbytes: torch.empty(nbytes, dtype=torch.uint8))
    return log


def _symm(lib: FakeIpcLib, timeout_s: float = 20.0) -> _onesided.SymmBuffer:
    return _onesided.SymmBuffer(4096, None, torch.device("cpu"), lib, mode="ipc",  # type: ignore[arg-type]
                                timeout_s=timeout_s)


def _freed(log: list[tuple]) -> list[tuple]:
    return [e for e in log if e[0] in ("close", "free")]


def test_symm_buffer_built_and_closed_frees_everything_once(ipc_world: list[tuple]) -> None:
    b = _symm(FakeIpcLib(ipc_world, set()))
    assert b.backend == "cuda_ipc" and b.peer_ptrs == [0xA000, 0xB001, 0xB002]
    b.close()
    assert _freed(ipc_world) == [("close", 0xB001), ("close", 0xB002), ("free", 0xA000)]
    n = len(ipc_world)
    b.close()
    assert len(ipc_world) == n


def test_symm_buffer_bounds_its_zeroing_by_the_timeout_it_is_given(ipc_world: list[tuple]) -> None:
    """mt_ipc_malloc waits for its zeroing within the timeout_s it is passed (ABI 23), the transport's
    onesided_timeout_s, no longer a fixed 20 s whatever the user configured."""
    lib = FakeIpcLib(ipc_world, set())
    _symm(lib, timeout_s=45.0).close()
    assert lib.timeouts == [45.0]


def test_symm_buffer_whose_handle_exchange_fails_frees_its_memory(ipc_world: list[tuple],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def lost(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
        raise RuntimeError("NCCL error: remote process exited")

    monkeypatch.setattr(dist, "all_gather_into_tensor", lost)
    with pytest.raises(RuntimeError, match="remote process exited"):
        _symm(FakeIpcLib(ipc_world, set()))
    assert _freed(ipc_world) == [("free", 0xA000)]


def test_symm_buffer_whose_allocation_half_succeeds_frees_it(ipc_world: list[tuple]) -> None:
    """mt_ipc_malloc can fail after its cudaMalloc (memset, cudaIpcGetMemHandle): the pointer it wrote is freed."""
    with pytest.raises(csrc_build.CsrcError, match="cudaMalloc\\+IPC failed"):
        _symm(FakeIpcLib(ipc_world, {"mt_ipc_malloc"}))
    assert _freed(ipc_world) == [("free", 0xA000)]
    assert ("all_gather", None) not in ipc_world


def test_symm_buffer_whose_zeroing_timed_out_frees_nothing(ipc_world: list[tuple]) -> None:
    """mt_ipc_malloc past its bounded wait for the zeroing (120: a memset may still be queued behind a kernel that
    never ends) leaks the allocation and nulls the pointer: the buffer's release frees nothing under the memset."""
    with pytest.raises(csrc_build.CsrcError, match=r"cudaMalloc\+IPC failed \(code 120\)"):
        _symm(FakeIpcLib(ipc_world, {"mt_ipc_malloc_timeout"}))
    assert _freed(ipc_world) == []
    assert ("all_gather", None) not in ipc_world


def test_symm_buffer_whose_second_peer_cannot_be_mapped_closes_the_first(ipc_world: list[tuple]) -> None:
    with pytest.raises(csrc_build.CsrcError, match="cudaIpcOpenMemHandle failed"):
        _symm(FakeIpcLib(ipc_world, {"mt_ipc_open"}, fail_peer=2))
    assert _freed(ipc_world) == [("close", 0xB001), ("free", 0xA000)]


def test_symm_buffer_whose_final_barrier_fails_frees_everything(ipc_world: list[tuple],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def lost(group: Any, device: Any) -> None:
        raise RuntimeError("CUDA error: device lost")

    monkeypatch.setattr(_onesided, "_barrier", lost)
    with pytest.raises(RuntimeError, match="device lost"):
        _symm(FakeIpcLib(ipc_world, set()))
    assert _freed(ipc_world) == [("close", 0xB001), ("close", 0xB002), ("free", 0xA000)]


def test_symm_buffer_release_failure_is_a_note_on_the_cause(ipc_world: list[tuple],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def lost(group: Any, device: Any) -> None:
        raise RuntimeError("CUDA error: device lost")

    monkeypatch.setattr(_onesided, "_barrier", lost)
    with pytest.raises(RuntimeError, match="device lost") as e:
        _symm(FakeIpcLib(ipc_world, {"mt_ipc_close"}))
    assert any("releasing the half-built symmetric buffer failed too: OSError: driver gone" in n
               for n in e.value.__notes__)
    assert _freed(ipc_world) == [("free", 0xA000)]  # the local memory goes all the same


def test_a_reserve_whose_new_buffer_fails_keeps_no_freed_buffer(fake_gpu: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """reserve() closes the old receive buffer and then allocates the larger one; when that fails, the transport has
    no data buffer and the next call reserves anew. Keeping the closed buffer (and its size) would let the next
    exchange that fits the old size view freed memory, and close() close it a second time."""
    log, _fail = fake_gpu
    t = _build(NvlinkTransport, max_send_rows=8, row_bytes=256)

    def no_memory(*a: Any, **k: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(_onesided, "SymmBuffer", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        t.reserve(1024, 4096)
    assert t.data is None and t.data_bytes == 0
    t.close()
    assert _names(log).count("symm") == _names(log).count("symm_close") == 2  # control + first data buffer, once each


# -- chunk_tokens acts as named: at most MAX_SLOTS PUTs per peer ---------------------------------------------------
def test_proxy_reserve_takes_a_per_rank_total_and_does_not_refuse_chunk_tokens_on_it(fake_gpu: tuple) -> None:
    """max_send_rows is what one rank sends in all, not to one peer: reserve (and the first call's pow2 reserve)
    cannot tell how many PUTs a peer needs and refuses no chunk_tokens. chunk_tokens=3, a first call of 3000 rows
    spread over 3 peers is 1000 rows (334 PUTs) per peer and must not be refused as 4096 rows (1366 PUTs) to one."""
    t = ProxyTransport(None, default_knobs("proxy").replace(chunk_tokens=3), torch.device("cuda", 0),
                       options=RuntimeOptions())
    try:
        t._ensure_capacity(3000, 256)  # the first call's sizing: reserve(4096, 256)
        assert t.data_bytes >= 4096 * 256
        t._check_call_chunks(3000, torch.tensor([1000, 1000, 1000]))
        t.reserve(1 << 20, 256)  # a large per-rank total: still no refusal
    finally:
        t.close()
    t = ProxyTransport(None, default_knobs("proxy").replace(chunk_tokens=1), torch.device("cuda", 0),
                       options=RuntimeOptions(), max_send_rows=4096, row_bytes=256)
    t.close()


def test_proxy_call_refuses_a_chunk_tokens_past_the_signal_slots_for_its_own_rows_per_peer(fake_gpu: tuple) -> None:
    """Each call checks its own rows per peer: more than 1024 PUTs of chunk_tokens rows to one peer would make the
    kernel cut larger chunks than named (csrc/proxy_xchg.h `chunking`), so the call is refused, naming the knob;
    a call whose total fits reads nothing."""
    t = ProxyTransport(None, default_knobs("proxy").replace(chunk_tokens=1), torch.device("cuda", 0),
                       options=RuntimeOptions())
    try:
        t._check_call_chunks(1024, torch.tensor([1024]))  # 1024 PUTs of one row: as named
        t._check_call_chunks(2000, torch.tensor([1000, 1000]))  # over 1024 in all, 1000 per peer: as named
        with pytest.raises(KnobError, match=r"knob chunk_tokens: proxy: a call sending one peer 4096 rows: "
                                            r"chunk_tokens=1 would cut up to 4096 rows for one peer into 4096 PUTs, "
                                            r"more than the 1024 signal slots .* use chunk_tokens >= 4"):
            t._check_call_chunks(4096, torch.tensor([4096, 0]))
        with pytest.raises(KnobError, match="1025 PUTs"):
            t._check_call_chunks(2000, torch.tensor([1025, 975]))
    finally:
        t.close()
    t = ProxyTransport(None, default_knobs("proxy").replace(chunk_tokens=0), torch.device("cuda", 0),
                       options=RuntimeOptions())
    t._check_call_chunks(1 << 20, torch.tensor([1 << 20]))  # 0: one PUT per peer, never refused
    t.close()


def test_proxy_exchange_checks_the_rows_per_peer_before_launching(fake_gpu: tuple, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """exchange() runs the per-call check on the caller's counts before the kernel: a refused call launches
    nothing and does not advance the epoch."""
    log, _fail = fake_gpu
    t = ProxyTransport(None, default_knobs("proxy").replace(chunk_tokens=1), torch.device("cuda", 0),
                       options=RuntimeOptions(), max_send_rows=4096, row_bytes=256)
    try:
        monkeypatch.setattr(t, "_prepare", lambda send, counts: (send, 256, counts))
        with pytest.raises(KnobError, match="chunk_tokens"):
            t.exchange(torch.zeros(4096, 128, dtype=torch.bfloat16), torch.tensor([4096]), None)
        assert t._epoch == 0 and "mt_pxy_exchange" not in _names(log)
    finally:
        t.close()


def test_proxy_exchange_that_raises_holds_the_tensors_its_copies_may_still_read(fake_gpu: tuple,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A call whose kernel did not complete within its bound (322) may still have copies reading its send rows and
    counts: exchange() raises, but keeps the call's tensors (and an earlier failed call's) referenced rather than hand
    them back to the allocator under those copies."""
    t = ProxyTransport(None, default_knobs("proxy"), torch.device("cuda", 0), options=RuntimeOptions(),
                       max_send_rows=64, row_bytes=256)
    try:
        monkeypatch.setattr(t, "_prepare", lambda send, counts: (send, 256, counts))
        monkeypatch.setattr(t, "_stream", lambda: 0)
        monkeypatch.setattr(t.lib, "mt_pxy_exchange", lambda *args: 322, raising=False)
        held = []
        for _ in range(2):
            send, counts = torch.zeros(4, 256, dtype=torch.uint8), torch.tensor([4])
            held += [weakref.ref(send), weakref.ref(counts)]
            with pytest.raises(OneSidedError, match="mt_pxy_exchange"):
                t.exchange(send, counts, None)
            del send, counts
        gc.collect()
        assert all(r() is not None for r in held)
    finally:
        t.close()


def test_epbuffer_refuses_a_proxy_chunk_tokens_past_the_signal_slots_of_its_max_tokens() -> None:
    """EPBuffer knows the most rows a call sends one peer (max_tokens: each token once per rank) and refuses a
    proxy chunk_tokens that would need more than 1024 PUTs for them, before any transport is built; one that fits
    passes that check (and is refused here only because the proxy needs a CUDA device)."""
    from moetune.runtime.buffer.facade import EPBuffer
    from moetune.runtime.shapes import ModelShape

    tiny = ModelShape(name="tiny", hidden=64, intermediate=32, experts=4, topk=2, dtype="float32")
    with pytest.raises(KnobError, match=r"knob chunk_tokens: EPBuffer: max_tokens=4096: chunk_tokens=1 would cut up to "
                                        r"4096 rows for one peer into 4096 PUTs, more than the 1024 signal slots"):
        EPBuffer(None, default_knobs("proxy").replace(chunk_tokens=1), model=tiny, max_tokens=4096, device="cpu")
    for fits in (default_knobs("proxy").replace(chunk_tokens=4), default_knobs("proxy")):
        with pytest.raises(KnobError, match="cannot run here"):
            EPBuffer(None, fits, model=tiny, max_tokens=4096, device="cpu")
    # host_staged's chunk_tokens is a staging message size: no such limit
    EPBuffer(None, default_knobs("host_staged").replace(chunk_tokens=1), model=tiny, max_tokens=4096,
             device="cpu").close()


@pytest.mark.parametrize("step", ["_build_weights", "_setup_engine"])
def test_a_layer_whose_weights_or_engine_fail_closes_the_buffer_it_built(step: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller never gets a layer whose constructor raised, so it cannot close() it: the EPBuffer the layer built
    (its proxy thread, symmetric memory) is closed before the error leaves; a buffer passed in stays the caller's."""
    from moetune.runtime import moe_layer
    from moetune.runtime.moe_layer import MoELayer
    from moetune.runtime.shapes import ModelShape

    EPBuffer = moe_layer.EPBuffer  # the class the layer builds (a test elsewhere may have reloaded its module)
    tiny = ModelShape(name="tiny", hidden=64, intermediate=32, experts=4, topk=2, dtype="float32")
    closed: list[Any] = []
    real_close = EPBuffer.close
    monkeypatch.setattr(EPBuffer, "close", lambda self: (closed.append(self), real_close(self))[1])

    def refuse(*_args: Any) -> None:
        raise MemoryError(f"{step} refused (test)")

    monkeypatch.setattr(MoELayer, step, refuse)
    with pytest.raises(MemoryError, match="refused"):
        MoELayer(tiny, max_tokens=8, device="cpu")
    assert len(closed) == 1 and closed[0]._closed
    mine = EPBuffer(None, Knobs(), model=tiny, max_tokens=8, device="cpu")
    with pytest.raises(MemoryError, match="refused"):
        MoELayer(tiny, max_tokens=8, device="cpu", buffer=mine)
    assert len(closed) == 1 and not mine._closed
    mine.close()
