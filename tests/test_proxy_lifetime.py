"""How long a proxy thread lives: `close()` of MoELayer / EPBuffer / the proxy transport / its engine stops it (joined)
and is idempotent, calls after it raise, and an object dropped without close() stops its thread when it is collected
(weakref.finalize, holding no reference to the object). The engine and its kernels' context are the real ones,
compiled with -DMT_HOST_SIM (csrc/sim stands in for CUDA); torch.distributed and the symmetric buffers are faked as in
tests/test_transport_lifecycle.py."""

from __future__ import annotations

import ctypes
import gc
import sys
import time
import weakref
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from moetune.runtime import csrc_build
from moetune.runtime.buffer import facade as B
from moetune.runtime.knobs import Knobs, default_knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.shapes import ModelShape
from moetune.runtime.transports import _affinity, _onesided
from moetune.runtime.transports import proxy as P
from moetune.runtime.transports.base import Availability, EPTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_sim

TINY = ModelShape(name="tiny", hidden=64, intermediate=32, experts=4, topk=2, dtype="float32")
pytestmark = pytest.mark.usefixtures("autoload_off")


@pytest.fixture(scope="module")
def sim_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(proxy_sim.build(tmp_path_factory.mktemp("mtsim_lifetime") / "libmtsim.so")))
    for name in ("mt_proxy_create", "mt_proxy_destroy", "mt_proxy_cpu", "mt_proxy_cpu_list", "mt_proxy_error",
                 "mt_proxy_diag", "mt_proxy_set_batch", "mt_proxy_set_timeout", "mt_last_error", "mt_pxy_create",
                 "mt_pxy_set_host_wait", "mt_pxy_err_ptr", "mt_pxy_error", "mt_pxy_destroy"):
        res, args = csrc_build.SIGNATURES[name]
        getattr(lib, name).restype = res
        getattr(lib, name).argtypes = args
    return lib


class SimLib:
    """The simulated library, with the two calls it lacks (csrc/mt_common.cu) answered here."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def mt_ctrl_bytes(self, out: Any) -> int:
        out._obj.value = 8 * 8 * 1024 + 8 * 2 * 8 + 8 * 2 * 8 * 8
        return 0

    def mt_enable_peer_access(self, dev: int, other: int) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)


class Symm:
    def __init__(self, nbytes: int) -> None:
        self.local = torch.zeros(nbytes, dtype=torch.uint8)
        self.peer_ptrs, self.backend = [self.local.data_ptr()], "fake"

    def close(self) -> None:
        pass


@pytest.fixture
def sim_world(sim_lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """One rank whose compiled library is the simulated one."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(csrc_build, "load", lambda **kw: SimLib(sim_lib))
    monkeypatch.setattr(_onesided, "SymmBuffer", lambda nbytes, group, device, lib, mode="torch", timeout_s=20.0: Symm(nbytes))
    monkeypatch.setattr(_onesided, "_all_gather_ints", lambda values, group, device: [list(values)])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(_onesided.OneSidedTransport, "_current_stream_done", lambda self, timeout_s: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(P, "proxy_cpu_choice", lambda options, device: _affinity.CpuChoice((), "test: unpinned"))
    return sim_lib


def thread_alive(tid: int) -> bool:
    return Path(f"/proc/self/task/{tid}").exists()


def gone(tid: int, timeout: float = 5.0) -> bool:
    """The thread has exited (joined threads leave /proc/self/task at once; a little slack for the kernel)."""
    deadline = time.monotonic() + timeout
    while thread_alive(tid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def engine_tid(engine: P.ProxyEngine) -> int:
    deadline = time.monotonic() + 5
    while (tid := engine.cpu_binding().tid) is None:
        assert time.monotonic() < deadline, "the proxy thread never started"
        time.sleep(0.01)
    assert thread_alive(tid)
    return tid


def sim_engine() -> P.ProxyEngine:
    sig = torch.zeros(64, dtype=torch.int64)
    return P.ProxyEngine(0, [sig.data_ptr()], [sig.data_ptr()], [sig.data_ptr()], cpu=())


def dropped_and_stopped(held: list[Any], tid: int, what: str) -> None:
    """Drop the one reference to `what` (`held`'s only item) and collect: it must be gone, and its proxy thread too."""
    ref = weakref.ref(held.pop())
    gc.collect()
    assert ref() is None, f"something (its finalizer?) keeps the {what} alive"
    assert gone(tid), f"the proxy thread of a collected {what} still runs"


def test_a_dropped_engine_stops_its_thread(sim_world: ctypes.CDLL) -> None:
    held = [sim_engine()]
    dropped_and_stopped(held, engine_tid(held[0]), "engine")


def test_engine_close_joins_its_thread_once(sim_world: ctypes.CDLL) -> None:
    e = sim_engine()
    tid = engine_tid(e)
    e.close()
    assert not thread_alive(tid)  # joined: gone when close() returns
    e.close()  # nothing left to destroy
    with pytest.raises(P.OneSidedError, match="closed"):
        e.stats()


def _transport(options: RuntimeOptions | None = None) -> P.ProxyTransport:
    return P.ProxyTransport(None, default_knobs("proxy"), torch.device("cuda", 0), options=options or RuntimeOptions())


def test_a_dropped_proxy_transport_stops_its_thread(sim_world: ctypes.CDLL) -> None:
    """The transport's finalizer destroys the kernels' context, then the engine (its thread joined); it holds
    neither the transport nor anything that holds it."""
    held = [_transport()]
    assert held[0].engine is not None
    dropped_and_stopped(held, engine_tid(held[0].engine), "transport")


def test_proxy_transport_close_stops_the_thread_and_calls_after_it_raise(sim_world: ctypes.CDLL) -> None:
    t = _transport()
    assert t.engine is not None
    tid = engine_tid(t.engine)
    t.close()
    assert not thread_alive(tid)
    t.close()
    with pytest.raises(P.OneSidedError, match="not running"):
        t.check()


class EngineTransport(EPTransport):
    """A world-1 transport that owns a real (simulated) proxy engine, so that what keeps a buffer or layer alive keeps
    the thread running; its exchange hands the rows back."""

    name = "nvlink"
    closes: ClassVar[list[int]] = []

    @classmethod
    def availability(cls, device: Any = None, options: Any = None) -> Availability:
        return Availability(True, "test")

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.engine = sim_engine()

    def reserve(self, max_send_rows: int, row_bytes: int) -> None:
        pass

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        return send_counts.clone()

    def exchange(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        return send.clone()

    def close(self) -> None:
        EngineTransport.closes.append(id(self))
        self.engine.close()


@pytest.fixture
def engine_transport(sim_world: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> type:
    monkeypatch.setattr(B, "get_transport", lambda name: EngineTransport)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # the buffer's collectives: one rank, none
    EngineTransport.closes = []
    return EngineTransport


def _buffer() -> B.EPBuffer:
    return B.EPBuffer(None, Knobs(transport="nvlink"), model=TINY, max_tokens=8, device="cpu", dtype=torch.float32)


def _routed(s: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s, TINY.hidden, generator=g)
    return x, torch.rand(s, TINY.experts, generator=g).topk(TINY.topk, dim=1).indices, torch.rand(s, TINY.topk, generator=g)


def test_epbuffer_close_frees_the_transport_once_and_refuses_calls(engine_transport: type) -> None:
    buf = _buffer()
    x, idx, w = _routed()
    recv_x, _meta, handle = buf.dispatch(x, idx, w)
    assert torch.equal(buf.combine(recv_x.contiguous(), handle), x)
    tid = engine_tid(buf.transport.engine)
    buf.close()
    buf.close()
    assert engine_transport.closes == [id(buf.transport)] and not thread_alive(tid)
    with pytest.raises(RuntimeError, match=r"EPBuffer: closed"):
        buf.dispatch(x, idx, w)
    with pytest.raises(RuntimeError, match=r"EPBuffer: closed"):
        buf.combine(recv_x.contiguous(), handle)
    with pytest.raises(RuntimeError, match=r"EPBuffer: closed"):
        buf.plan(x, idx, w)


def test_a_dropped_epbuffer_stops_its_proxy_thread(engine_transport: type) -> None:
    buf = _buffer()
    x, idx, w = _routed()
    buf.dispatch(x, idx, w)  # a used buffer: its handles and views are gone with it too
    tid, ref = engine_tid(buf.transport.engine), weakref.ref(buf)
    del buf
    gc.collect()
    assert ref() is None
    assert gone(tid), "the proxy thread of a collected EPBuffer still runs"


def _layer(**kw: Any) -> Any:
    from moetune.runtime.moe_layer import MoELayer

    return MoELayer(TINY, None, Knobs(transport="nvlink"), max_tokens=8, device="cpu", dtype=torch.float32,
                    engine="unfused", **kw)


def test_moe_layer_close_frees_its_buffer_once_and_forward_raises(engine_transport: type) -> None:
    layer = _layer()
    x, idx, w = _routed()
    layer(x)
    tid = engine_tid(layer.buffer.transport.engine)
    layer.close()
    layer.close()
    assert engine_transport.closes == [id(layer.buffer.transport)] and not thread_alive(tid)
    with pytest.raises(RuntimeError, match=r"MoELayer: closed"):
        layer(x)
    with pytest.raises(RuntimeError, match=r"MoELayer: closed"):
        layer.forward_routed(x, idx, w)


def test_moe_layer_close_leaves_a_given_buffer_open(engine_transport: type) -> None:
    buf = _buffer()
    layer = _layer(buffer=buf)
    layer.close()
    with pytest.raises(RuntimeError, match=r"MoELayer: closed"):
        layer(_routed()[0])
    assert engine_transport.closes == []  # the caller's buffer: the caller closes it
    x, idx, w = _routed()
    buf.dispatch(x, idx, w)
    buf.close()


def test_a_dropped_moe_layer_stops_its_proxy_thread(engine_transport: type) -> None:
    layer = _layer()
    layer(_routed()[0])
    tid, ref = engine_tid(layer.buffer.transport.engine), weakref.ref(layer)
    del layer
    gc.collect()
    assert ref() is None
    assert gone(tid), "the proxy thread of a collected MoELayer still runs"
