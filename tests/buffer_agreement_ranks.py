"""Rank functions for tests/test_buffer_agreement.py (imported by name in the spawned ranks; no tests here)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from moetune.runtime import EPBuffer, Knobs, get_model
from moetune.runtime.knobs import default_knobs
from moetune.runtime.pipeline import pipelined_moe, weighted_rows
from moetune.runtime.transports.registry import register_transport

MODEL = "custom:64,32,8,2,float32"


def _outcome(build: Callable[[], Any]) -> tuple[str, str, float]:
    """(exception type or "NO ERROR", its message, seconds it took)."""
    t0 = time.monotonic()
    try:
        build()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "NO ERROR", "", time.monotonic() - t0


def case_knobs_none_on_one_rank(rank: int, world: int) -> tuple[str, str, float]:
    """Rank 0 passes knobs=None (autoload, whose collectives have other shapes), rank 1 explicit knobs."""
    model = get_model(MODEL)
    return _outcome(lambda: EPBuffer(knobs=None if rank == 0 else Knobs(channels=2), model=model, max_tokens=16))


def case_local_check_on_one_rank(rank: int, world: int, kinds: list[str]) -> dict[str, Any]:
    """Rank 1 passes an argument its own checks refuse, rank 0 a valid one; after each, a valid buffer is built
    (the group still works)."""
    model = get_model(MODEL)
    register_transport("nvlink", "runtime_cases:GlooResident")  # a one-sided transport on CPU
    bad = rank == 1
    out: dict[str, Any] = {}
    for kind in kinds:
        kw: dict[str, Any] = dict(knobs=Knobs(), model=model, max_tokens=32)
        if bad and kind == "expected_tokens":
            kw["expected_tokens"] = 64
        elif bad and kind == "max_tokens":
            kw["max_tokens"] = 2.5
        elif bad and kind == "dense":
            kw.update(knobs=default_knobs("nvlink"), dense=True)
        elif bad and kind == "transport":
            kw["knobs"] = default_knobs("ibgda")
        elif bad and kind == "device":
            kw["device"] = "no-such-device"
        elif bad and kind == "meta":
            kw["device"] = "meta"
        elif kind == "unavailable":  # the same knobs everywhere; rank 1's transport says it cannot run there
            kw["knobs"] = default_knobs("nvlink")
            if bad:
                register_transport("nvlink", "runtime_cases:UnavailableResident")
        out[kind] = _outcome(lambda kw=kw: EPBuffer(**kw))
        register_transport("nvlink", "runtime_cases:GlooResident")
        EPBuffer(knobs=Knobs(), model=model, max_tokens=32)
    return out


def case_loaded_knobs_fail_on_one_rank(rank: int, world: int) -> tuple[str, str, float]:
    """knobs=None on every rank; the loaded knobs' transport cannot be imported on rank 1 only."""
    if rank == 1:
        register_transport("collective", "no_such_module_here:Transport")
    return _outcome(lambda: EPBuffer(knobs=None, model=get_model(MODEL), max_tokens=16))


def case_construction(rank: int, world: int, kinds: list[str]) -> dict[str, Any]:
    """The three cases above in one launch (spawning ranks is most of a case's time); the loaded knobs' last, as it
    breaks rank 1's collective transport."""
    return {"local": case_local_check_on_one_rank(rank, world, kinds), "none": case_knobs_none_on_one_rank(rank, world),
            "loaded": case_loaded_knobs_fail_on_one_rank(rank, world)}


def _bad_expert_fn(kind: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    def fn(recv_x: torch.Tensor, meta: Any) -> torch.Tensor:
        rows = weighted_rows(recv_x, meta)
        if kind == "shape":
            return rows[:, :10]
        if kind == "dtype":
            return rows.double()
        if kind == "device":
            return torch.empty(rows.shape, dtype=rows.dtype, device="meta")
        raise RuntimeError("expert kernel failed")
    return fn


def case_pipelined(rank: int, world: int, layouts: list[tuple[str, bool]], kinds: list[str]) -> list[dict[str, Any]]:
    """case_pipelined_bad_expert_fn for each (transport, dense), in one launch."""
    return [case_pipelined_bad_expert_fn(rank, world, transport, dense, kinds) for transport, dense in layouts]


def case_pipelined_bad_expert_fn(rank: int, world: int, transport: str, dense: bool,
                                 kinds: list[str]) -> dict[str, Any]:
    """Rank 1's expert_fn fails (wrong shape, dtype, device, or raises) in pipelined_moe; then a valid call on every
    rank must still run and give what dispatch/combine give."""
    model = get_model(MODEL)
    if transport == "nvlink":
        register_transport("nvlink", "runtime_cases:GlooResident")
        knobs = default_knobs("nvlink")
    else:
        knobs = Knobs(pipeline_depth=2)
    buf = EPBuffer(knobs=knobs, model=model, max_tokens=32, dense=dense)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, model.hidden, generator=g)
    idx = torch.randint(0, model.experts, (8, model.topk), generator=g)
    w = torch.rand(8, model.topk, generator=g)
    out: dict[str, Any] = {}
    for kind in kinds:
        fn = _bad_expert_fn(kind) if rank == 1 else weighted_rows
        out[kind] = _outcome(lambda fn=fn: pipelined_moe(buf, x, idx, w, fn))
    y = pipelined_moe(buf, x, idx, w, weighted_rows)
    recv_x, meta, handle = buf.dispatch(x, idx, w)
    ref = buf.combine(weighted_rows(recv_x, meta), handle)
    out["after"] = bool(torch.allclose(y, ref, atol=1e-5))
    out["gathers"] = [_all_gathers(lambda a=a: pipelined_moe(buf, x, idx, w, weighted_rows, agree=a))
                      for a in (None, False)]  # the default (check_inputs: agree), and as MoELayer calls it
    # an explicit agree=True holds on a buffer built with check_inputs=False (it was ignored: rank 0 hung)
    unchecked = EPBuffer(knobs=knobs, model=model, max_tokens=32, dense=dense, check_inputs=False)
    fn = _bad_expert_fn("raise") if rank == 1 else weighted_rows
    out["agree_unchecked"] = _outcome(lambda: pipelined_moe(unchecked, x, idx, w, fn, agree=True))
    return out


def _all_gathers(call: Any) -> int:
    """The all-gathers `call` runs (each a host sync)."""
    import torch.distributed as dist

    n, real = [0], dist.all_gather

    def counted(*a: Any, **k: Any) -> Any:
        n[0] += 1
        return real(*a, **k)

    dist.all_gather = counted
    try:
        call()
    finally:
        dist.all_gather = real
    return n[0]


def _prefill_and_decode(rank: int) -> tuple[EPBuffer, EPBuffer, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two dense buffers built on every rank, prefill (max_tokens 32) and decode (16), and this rank's 8 tokens
    (x, expert ids, weights)."""
    model = get_model(MODEL)
    prefill = EPBuffer(knobs=Knobs(), model=model, max_tokens=32, dense=True)
    decode = EPBuffer(knobs=Knobs(), model=model, max_tokens=16, dense=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, model.hidden, generator=g)
    idx = torch.randint(0, model.experts, (8, model.topk), generator=g)
    w = torch.rand(8, model.topk, generator=g)
    return prefill, decode, x, idx, w


def case_foreign_handle(rank: int, world: int) -> tuple[str, str, float]:
    """Rank 1 combines a prefill buffer's handle on a decode buffer (dense: sized by max_tokens); rank 0 does it
    right. Every rank must get a ValueError at once (rank 1's was a gloo RuntimeError, rank 0 waited the timeout)."""
    prefill, decode, x, idx, w = _prefill_and_decode(rank)
    got = {"prefill": prefill.dispatch(x, idx, w), "decode": decode.dispatch(x, idx, w)}  # in step on both ranks
    recv_x, meta, handle = got["prefill" if rank == 1 else "decode"]
    return _outcome(lambda: decode.combine(weighted_rows(recv_x, meta), handle))


def case_channel_timeouts(rank: int, world: int) -> list[float | None]:
    """The timeouts of a channels=3 buffer's communicators (seconds; None where this torch does not say)."""
    buf = EPBuffer(knobs=Knobs(channels=3), model=get_model(MODEL), max_tokens=16)
    out: list[float | None] = []
    for g in buf.transport.groups:
        try:
            pg = g if g is not None else torch.distributed.group.WORLD
            out.append(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        except Exception:
            out.append(None)
    return out


def case_layer_arguments(rank: int, world: int) -> dict[str, Any]:
    """MoELayer's own agreement: rank 1 passes another seed, then engine="megakernel" (world 1 only); after each a
    valid layer is built (the group still works)."""
    from moetune.runtime import MoELayer

    model = get_model(MODEL)
    out: dict[str, Any] = {}
    for kind, kw in (("seed", {"seed": 7 if rank == 1 else 0}),
                     ("engine", {"engine": "megakernel" if rank == 1 else None}),
                     ("argument", {"max_tokens": 2.5 if rank == 1 else 16})):
        kw = {"max_tokens": 16, **kw}
        out[kind] = _outcome(lambda kw=kw: MoELayer(model, knobs=Knobs(), **kw))
        MoELayer(model, knobs=Knobs(), max_tokens=16)
    buf = EPBuffer(knobs=Knobs(), model=model, max_tokens=16)  # a given buffer: the first collective is the layer's
    out["buffer"] = _outcome(lambda: MoELayer(model, buffer=buf, max_tokens=8 if rank == 1 else 16))
    MoELayer(model, buffer=buf, max_tokens=16)
    # a buffer given on rank 1 only (rank 0 builds its own), then one that is no EPBuffer on rank 1, with rank 0's
    # layer given one or not
    out["buffer_on_one"] = _outcome(lambda: MoELayer(model, knobs=Knobs(), max_tokens=16,
                                                     buffer=buf if rank == 1 else None))
    for kind, mine in (("not_a_buffer", None), ("not_a_buffer_given", buf)):
        out[kind] = _outcome(lambda mine=mine: MoELayer(model, knobs=Knobs(), max_tokens=16,
                                                        buffer="not a buffer" if rank == 1 else mine))
    MoELayer(model, buffer=buf, max_tokens=16)
    MoELayer(model, knobs=Knobs(), max_tokens=16)
    # building the weights fails on rank 1 (out of memory, say), after the buffer's agreement
    from moetune.runtime import moe_layer

    real = moe_layer.expert_weights

    def oom(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("CUDA out of memory (simulated)")

    if rank == 1:
        moe_layer.expert_weights = oom
    try:
        out["weights_fail"] = _outcome(lambda: MoELayer(model, knobs=Knobs(), max_tokens=16))
    finally:
        moe_layer.expert_weights = real
    MoELayer(model, knobs=Knobs(), max_tokens=16)
    # the layer's weights changed on rank 1 (.double(), say) after it was built: its forward refuses them
    layer = MoELayer(model, knobs=Knobs(), max_tokens=16)
    x = torch.randn(8, model.hidden, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        layer.double()
    out["weights_changed"] = _outcome(lambda: layer(x))
    layer.float()
    out["weights_changed_after"] = tuple(layer(x).shape)  # the group still works
    # rank 1's experts fail between the dispatch and the combine (out of memory: routing sent it the most rows)
    if rank == 1:
        layer.experts = lambda *a: oom()
    out["experts_fail"] = _outcome(lambda: layer(x))
    if rank == 1:
        del layer.experts
    out["experts_fail_after"] = tuple(layer(x).shape)
    return out



def case_out_of_step(rank: int, world: int, layouts: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """_out_of_step for each (transport, dense), then _other_buffers, in one launch."""
    return [*(_out_of_step(rank, transport, dense) for transport, dense in layouts), _other_buffers(rank)]


def _other_buffers(rank: int) -> dict[str, Any]:
    """Dense layout: rank 1 dispatches on a buffer of max_tokens 16 (decode), the others on one of 32 (prefill), each
    built on every rank; then every rank on the same buffer."""
    prefill, decode, x, idx, w = _prefill_and_decode(rank)
    got = _outcome(lambda: (decode if rank == 1 else prefill).dispatch(x, idx, w))
    recv_x, meta, handle = decode.dispatch(x, idx, w)
    y = decode.combine(weighted_rows(recv_x, meta), handle)
    return {"step": got, "after": tuple(y.shape)}


def _out_of_step(rank: int, transport: str, dense: bool) -> dict[str, Any]:
    """Rank 1 dispatches twice (an exception between its dispatch and combine, caught, and the next step's dispatch)
    while the other ranks combine their first dispatch; then, in step again, a valid dispatch and combine on every
    rank."""
    model = get_model(MODEL)
    knobs = default_knobs(transport) if transport != "collective" else Knobs()
    if transport == "nvlink":
        register_transport("nvlink", "runtime_cases:GlooResident")
    buf = EPBuffer(knobs=knobs, model=model, max_tokens=16, dense=dense)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, model.hidden, generator=g)
    idx = torch.randint(0, model.experts, (8, model.topk), generator=g)
    w = torch.rand(8, model.topk, generator=g)
    recv_x, meta, handle = buf.dispatch(x, idx, w)
    if rank == 1:
        got = _outcome(lambda: buf.dispatch(x, idx, w))
    else:
        got = _outcome(lambda: buf.combine(weighted_rows(recv_x, meta), handle))
    recv_x, meta, handle = buf.dispatch(x, idx, w)
    y = buf.combine(weighted_rows(recv_x, meta), handle)
    return {"step": got, "after": tuple(y.shape)}


class OwnLaneCollective:
    """Made in `_own_lane_transport` (the transport classes import torch.distributed state lazily)."""


def _own_lane_transport() -> None:
    """Route `collective` to a stand-in whose dense collectives run on a communicator of each buffer's own (a gloo
    group made per transport), as host_staged's copy-engine path does on a GPU (its staging rings are per buffer):
    two buffers' collectives never meet there, only those on the EP group do."""
    import torch.distributed as dist

    from moetune.runtime.transports import collective

    class _OwnLane(collective.CollectiveTransport):
        def __init__(self, group: Any, knobs: Any, device: Any, **kw: Any) -> None:
            super().__init__(group, knobs, device, **kw)
            self.lane = dist.new_group(backend="gloo", timeout=collective._group_timeout(group, self.device))

        def gather_async(self, out: torch.Tensor, inp: torch.Tensor, *, channel: int = 0) -> Any:
            return collective._ALL_GATHER(out, inp, group=self.lane, async_op=True)

        def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, *, channel: int = 0) -> Any:
            return collective._REDUCE_SCATTER(out, inp, group=self.lane, async_op=True)

    global OwnLaneCollective
    OwnLaneCollective = _OwnLane  # type: ignore[misc]
    register_transport("collective", "buffer_agreement_ranks:OwnLaneCollective")


def case_other_buffers_own_lanes(rank: int, world: int) -> dict[str, Any]:
    """_other_buffers over a transport whose dense collectives run on each buffer's own communicator."""
    _own_lane_transport()
    return _other_buffers(rank)
