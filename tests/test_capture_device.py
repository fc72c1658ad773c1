"""The "is a CUDA graph being captured?" checks ask about the stream of the object's own device.

`torch.cuda.is_current_stream_capturing()` has no device argument: it reads the current stream of the *current*
device. Before, the megakernel engine's bucket lookup (`resolve`), the routing-id check (`expert_ids_problem`), the
EP buffer's stream ordering (`_enter`) and the proxy's chunk check asked it as it was: with their device cuda:1
while cuda:0 was current (a stream set with `torch.cuda.set_stream`, which does not switch the device), a capture
on cuda:1's stream was not seen, and a profile lookup, a host sync or a cross-stream wait ran inside the capture and
broke it. Now they ask `runtime._capture.capturing(device)`, which makes that device current around the query.

On the CPU, torch.cuda's device context and query are replaced by a fake that captures on cuda:1 only; the GPU test
needs two GPUs."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from moetune.runtime._capture import capturing
from moetune.runtime.buffer.facade import EPBuffer
from moetune.runtime.engines.megakernel import MegakernelEngine
from moetune.runtime.knobs import Knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.routing import expert_ids_problem
from moetune.runtime.shapes import ModelShape
from moetune.runtime.transports.proxy import ProxyTransport

pytestmark = pytest.mark.timeout(60)
TINY = ModelShape(name="tiny", hidden=128, intermediate=64, experts=4, topk=2, dtype="bfloat16")
CUDA1 = torch.device("cuda", 1)


class FakeCuda:
    """cuda:0 is current; a graph is captured on cuda:1's current stream only (`capture_on`, None: none)."""

    def __init__(self) -> None:
        self.current, self.capture_on = 0, 1
        self.asked: list[int] = []  # the current device at each capture query

    @contextlib.contextmanager
    def device(self, dev: Any) -> Iterator[None]:
        before, self.current = self.current, torch.device(dev).index
        try:
            yield
        finally:
            self.current = before

    def is_current_stream_capturing(self) -> bool:
        self.asked.append(self.current)
        return self.current == self.capture_on


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", fake.is_current_stream_capturing)
    return fake


class DeviceIds:
    """Routing ids on cuda:1 (on the CPU): any read of them (the host sync) fails the test."""

    device, is_cuda, dtype = CUDA1, True, torch.int64

    def numel(self) -> int:
        return 4

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the ids were read ({name}) while their device's stream is captured")


def test_capturing_asks_about_the_given_device(cuda: FakeCuda) -> None:
    assert capturing(CUDA1) and cuda.asked == [1] and cuda.current == 0  # the current device is restored
    assert not capturing(torch.device("cuda", 0))
    assert not capturing(torch.device("cpu")) and cuda.asked == [1, 0]  # a CPU device asks nothing


def test_expert_ids_problem_reads_nothing_while_the_ids_device_is_captured(cuda: FakeCuda) -> None:
    """Before: asked about cuda:0 (not capturing), then read the ids (a sync inside cuda:1's capture)."""
    assert expert_ids_problem(DeviceIds(), TINY.experts, distinct=True) is None  # type: ignore[arg-type]
    assert cuda.asked == [1]


def _engine() -> MegakernelEngine:
    engine = MegakernelEngine(None, Knobs(engine="megakernel"), model=TINY, device=CUDA1, dtype=torch.bfloat16,
                              options=RuntimeOptions(), expected_tokens=1, ptrs=(0, 0, 0))
    engine.buckets = {}  # per-bucket profiles: a new bucket is looked up on its first eager call
    return engine


def test_the_engine_looks_up_no_profile_while_its_device_is_captured(cuda: FakeCuda,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `resolve` asked about cuda:0, so a layer on cuda:1 looked its bucket's profile up (I/O, a daemon
    round trip) inside cuda:1's capture. Now nothing is looked up, and the bucket is resolved at its next eager
    call."""
    from moetune.runtime.profiles import autoload

    looked: list[int] = []

    def lookup(**kw: Any) -> Any:
        looked.append(kw["max_tokens"])
        raise RuntimeError("stop: looked up")

    monkeypatch.setattr(autoload, "autoload_profile", lookup)
    engine = _engine()
    engine.resolve(5)
    assert looked == [] and cuda.asked == [1] and 5 not in engine._seen
    cuda.capture_on = None  # the capture ended: the next call looks the bucket up
    with pytest.raises(RuntimeError, match="stop: looked up"):
        engine.resolve(5)
    assert len(looked) == 1


def test_the_buffer_waits_for_no_other_stream_while_its_device_is_captured(cuda: FakeCuda,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: EPBuffer's call on another stream than its previous call's asked about cuda:0 and made cuda:1's
    capturing stream wait for work outside the capture (which invalidates the capture)."""
    waited: list[str] = []
    a = types.SimpleNamespace(name="a", wait_stream=lambda other: waited.append(other.name))
    b = types.SimpleNamespace(name="b")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: a)
    buf: Any = types.SimpleNamespace(device=CUDA1, _last_stream=b, _refuse_closed=lambda: None)
    EPBuffer._enter(buf)
    assert waited == [] and cuda.asked == [1] and buf._last_stream is a
    cuda.capture_on, buf._last_stream = None, b  # eager: the call waits for the previous call's stream
    EPBuffer._enter(buf)
    assert waited == ["b"]


def test_the_proxy_reads_no_counts_while_their_device_is_captured(cuda: FakeCuda) -> None:
    """Before: the chunk check of a call of many rows asked about cuda:0 and read cuda:1's send counts (a sync)."""
    proxy: Any = types.SimpleNamespace(knobs=Knobs(chunk_tokens=1), name="proxy")
    counts: Any = types.SimpleNamespace(device=CUDA1)  # any read of it (.max(), .numel()) fails
    ProxyTransport._check_call_chunks(proxy, 10**6, counts)
    assert cuda.asked == [1]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_capture_on_the_second_gpu_is_seen_with_the_first_current() -> None:
    """A graph captured on cuda:1's stream while cuda:0 is made current inside it: torch's own query (cuda:0's
    stream) says no capture, `capturing(cuda:1)` says there is one, and the id check, which syncs otherwise, leaves
    the capture intact."""
    dev = torch.device("cuda", 1)
    ids = torch.tensor([[0, 1], [2, 3]], device=dev)
    out = torch.zeros(2, 2, dtype=torch.int64, device=dev)
    graph = torch.cuda.CUDAGraph()
    seen: list[tuple[bool, bool, str | None]] = []
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(device=dev)):
        with torch.cuda.device(0):
            seen.append((torch.cuda.is_current_stream_capturing(), capturing(dev),
                         expert_ids_problem(ids, TINY.experts, distinct=True)))
        out.copy_(ids + 1)
    graph.replay()
    torch.cuda.synchronize(dev)
    assert seen == [(False, True, None)]
    assert torch.equal(out.cpu(), torch.tensor([[1, 2], [3, 4]]))
