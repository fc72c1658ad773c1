"""One EPBuffer called from two CUDA streams: a call on another stream than the previous call's waits for that
stream's work (runtime/buffer/facade.py `EPBuffer._enter`), since every call reuses the same stage, send and
receive rows. World 1, dense layout (no host sync inside a call: the ordering is all on the GPU)."""

from __future__ import annotations

import pytest
import torch

from moetune.runtime import EPBuffer, Knobs, get_model
from moetune.runtime.routing import generate_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA streams)"),
]

MODEL = "custom:64,32,8,2,float32"


def _inputs(s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx, w = generate_routing(s, 8, 2, seed=seed)
    return torch.randn(s, 64, generator=g).cuda(), idx.cuda(), w.cuda()


def _round_trip(buf: EPBuffer, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Dispatch, scale each received row by its local weights (the experts stand-in), combine: x * sum(w)."""
    recv_x, meta, handle = buf.dispatch(x, idx, w)
    return buf.combine((recv_x * meta.weights.sum(1, keepdim=True)).contiguous(), handle)


def test_a_call_on_another_stream_waits_for_the_buffers_previous_stream() -> None:
    """Stream a: a round trip, then ~1 s of GPU sleep; stream b: a round trip. b's call must finish after all that
    was queued on a before it (the sleep included): ordered by events, so neither a host sync inside a call nor a
    slow first call (library loads) can pass or fail it by timing. Without the wait, b's few small kernels finish
    at once, while a sleeps."""
    buf = EPBuffer(knobs=Knobs(), model=get_model(MODEL), max_tokens=16, device="cuda", dense=True,
                   check_inputs=False)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    xa, ia, wa = _inputs(16, 1)
    xb, ib, wb = _inputs(12, 2)
    for s in (a, b):  # warm-up: every lazy first-call cost paid before the timed order
        with torch.cuda.stream(s):
            _round_trip(buf, xa, ia, wa)
    torch.cuda.synchronize()
    a_end, b_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(a):
        out_a = _round_trip(buf, xa, ia, wa)
        torch.cuda._sleep(2_000_000_000)  # ~1 s at 2 GHz, queued on a after its call
        a_end.record(a)
    with torch.cuda.stream(b):
        out_b = _round_trip(buf, xb, ib, wb)
        b_end.record(b)
    torch.cuda.synchronize()
    assert a_end.elapsed_time(b_end) >= 0, "stream b's call finished before the work queued on stream a"
    assert torch.allclose(out_a, xa * wa.sum(1, keepdim=True), atol=1e-5)
    assert torch.allclose(out_b, xb * wb.sum(1, keepdim=True), atol=1e-5)
    buf.close()


def test_a_capture_on_its_own_stream_after_eager_calls_replays_right() -> None:
    """torch.cuda.graph captures on a stream of its own: the buffer adds no wait inside the capture (it would wait
    on work outside it, which CUDA refuses) and the replays give the eager result."""
    buf = EPBuffer(knobs=Knobs(), model=get_model(MODEL), max_tokens=16, device="cuda", dense=True,
                   check_inputs=False)
    x, idx, w = _inputs(16, 3)
    want = x * w.sum(1, keepdim=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's graph recipe does
        assert torch.allclose(_round_trip(buf, x, idx, w), want, atol=1e-5)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.allclose(_round_trip(buf, x, idx, w), want, atol=1e-5)  # eager on the default stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _round_trip(buf, x, idx, w)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out, want, atol=1e-5)
    x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, 2 * want, atol=1e-5)
    buf.close()
