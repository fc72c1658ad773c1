"""Rank functions for the runtime's distributed tests (imported by name in the spawned ranks)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from moetune.runtime import EPBuffer, Knobs, MoELayer, dense_reference, get_model
from moetune.runtime.knobs import default_knobs
from moetune.runtime.moe_layer import max_rel_err
from moetune.runtime.routing import generate_routing
from moetune.runtime.transports.base import Availability, EPTransport
from moetune.runtime.transports.registry import register_transport


def tokens_for(rank: int, tokens: int | list[int]) -> int:
    return tokens[rank] if isinstance(tokens, list) else tokens


def make_inputs(rank: int, model, tokens, routing: str, seed: int):
    s = tokens_for(rank, tokens)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(s, model.hidden, generator=g)
    if routing.startswith("rank0"):
        # every token picks distinct experts that all live on rank 0: other ranks and experts get nothing
        epr = model.experts // int(routing.split(":")[1])
        scores = torch.rand(s, epr, generator=g)
        idx = scores.topk(model.topk, dim=1).indices
        w = torch.rand(s, model.topk, generator=g) + 0.1
        w = w / w.sum(1, keepdim=True)
    else:
        idx, w = generate_routing(s, model.experts, model.topk, routing=routing, seed=100 * seed + rank)
    return x.to(torch.float32), idx, w


def expected_rows(world: int, model, tokens, routing: str, seed: int, me: int) -> int:
    """Rows rank `me` must receive: tokens (of every rank) with at least one expert on `me`."""
    epr = model.experts // world
    n = 0
    for r in range(world):
        _, idx, _ = make_inputs(r, model, tokens, routing, seed)
        if idx.numel():
            n += int(((idx // epr) == me).any(dim=1).sum())
    return n


def expected_pairs(world: int, model, tokens, routing: str, seed: int, me: int) -> int:
    """(row, local expert) pairs rank `me` must receive."""
    epr = model.experts // world
    return sum(int(((make_inputs(r, model, tokens, routing, seed)[1] // epr) == me).sum()) for r in range(world))


class GlooResident(EPTransport):
    """A CPU stand-in for a one-sided transport: device-side counts (device_counts) and a capacity-padded
    receive view whose rows past the live ones hold random bytes (as a reused symmetric buffer holds the
    previous calls' rows). Moves rows with gloo all_to_all_single; exists to test EPBuffer's
    device-resident layout without a GPU."""

    name = "nvlink"
    device_counts = True

    def __init__(self, group, knobs, device, **kw):
        super().__init__(group, knobs, device, **kw)
        self.cap_rows = 0
        self.gen = torch.Generator().manual_seed(1234 + self.rank)

    @classmethod
    def availability(cls, device=None, options=None) -> Availability:
        return Availability(True, "test double over gloo")

    def reserve(self, max_send_rows: int, row_bytes: int) -> None:
        self.cap_rows = self.world * max_send_rows

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(send_counts)
        torch.distributed.all_to_all_single(out, send_counts.contiguous(), group=self.group)
        return out

    def exchange(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        row_shape = tuple(send.shape[1:])
        row_bytes = send.element_size() * int(torch.Size(row_shape).numel())
        cap = max(self.cap_rows, sum(rc))
        stale = torch.randint(0, 256, (cap, row_bytes), dtype=torch.uint8, generator=self.gen)
        view = stale.view(send.dtype).view(cap, *row_shape)
        got = torch.empty((sum(rc), *row_shape), dtype=send.dtype)
        torch.distributed.all_to_all_single(got, send[: sum(sc)].contiguous(), rc, sc, group=self.group)
        view[: sum(rc)] = got
        return view



class CountWordResident(GlooResident):
    """GlooResident whose exchange_counts carries each count as the one-sided kernels' count word does
    (csrc/mt_common.h `count_word` / `counts_received`): a count outside 0..2^39-1 (a negative one included) is
    refused, sent marked and received as 0 rows, and both sides record the refusal, which their next exchange raises
    (`OneSidedError`, as `check()` does). A GPU-less model of nvlink's and proxy's counts exchange."""

    MASK = (1 << 39) - 1

    def __init__(self, group, knobs, device, **kw):
        super().__init__(group, knobs, device, **kw)
        self.refusal = ""

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        from moetune.runtime.transports._onesided import OneSidedError

        if self.refusal:
            raise OneSidedError(self.refusal)
        sc = send_counts.to(torch.int64)
        refused = (sc < 0) | (sc > self.MASK)
        words = torch.stack([torch.where(refused, torch.zeros_like(sc), sc), refused.to(torch.int64)], dim=1)
        got = torch.empty_like(words)
        torch.distributed.all_to_all_single(got, words.contiguous(), group=self.group)
        if bool(refused.any()):
            self.refusal = f"rank {self.rank}: exchange_counts: a count outside 0..{self.MASK}: {sc.tolist()}"
        elif bool(got[:, 1].any()):
            self.refusal = f"rank {self.rank}: a peer refused its send counts: {got[:, 1].tolist()}"
        return got[:, 0].contiguous()

    def exchange(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        from moetune.runtime.transports._onesided import OneSidedError

        if self.refusal:
            raise OneSidedError(self.refusal)
        return super().exchange(send, send_counts, recv_counts)


class UnavailableResident(GlooResident):
    """GlooResident that says it cannot run (the rank of a test where one rank lacks what the transport needs); its
    constructor would fail before the collectives it shares with the other ranks."""

    @classmethod
    def availability(cls, device=None, options=None) -> Availability:
        return Availability(False, "not on this rank (test double)")

    def __init__(self, group, knobs, device, **kw):
        raise RuntimeError("UnavailableResident: constructed although availability() said no")

def use_resident_stand_in() -> None:
    """Route the `nvlink` transport name to GlooResident in this process."""
    register_transport("nvlink", "runtime_cases:GlooResident")


def case_equivalence(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """For each config: the layer's output vs the dense reference, and the received row count."""
    out = []
    for cfg in configs:
        model = get_model(cfg["model"])
        if cfg.get("transport") == "nvlink":
            use_resident_stand_in()
            knobs = default_knobs("nvlink").replace(compression=cfg.get("compression", "none"))
        else:
            knobs = Knobs(pipeline_depth=cfg.get("depth", 1), compression=cfg.get("compression", "none"),
                          channels=cfg.get("channels", 1), combine_lanes=cfg.get("combine_lanes", "auto"))
        tokens = cfg["tokens"]
        routing = cfg.get("routing", "uniform")
        seed = cfg.get("seed", 0)
        cap = max(64, tokens_for(rank, tokens))
        buf = EPBuffer(knobs=knobs, model=model, max_tokens=cap, dense=cfg.get("dense"))
        layer = MoELayer(model, max_tokens=cap, seed=seed, buffer=buf)
        x, idx, w = make_inputs(rank, model, tokens, routing, seed)
        y = layer.forward_routed(x, idx, w)
        ref = dense_reference(x, model, seed=seed, topk_idx=idx, topk_weights=w)
        # the buffer alone: rows received and the identity round trip
        recv_x, meta, handle = layer.buffer.dispatch(x, idx, w)
        rt = layer.buffer.combine((recv_x.float() * meta.weights.sum(1, keepdim=True)).to(recv_x.dtype), handle)
        rt_err = max_rel_err(rt, x) if x.numel() else 0.0
        out.append({
            "cfg": cfg,
            "err": max_rel_err(y, ref),
            "shape_ok": tuple(y.shape) == tuple(x.shape),
            "rows": sum(meta.rows_per_rank) if buf.resident else recv_x.shape[0],
            # dense layout: every capacity slot of every rank arrives (empty slots carry no expert)
            "expected_rows": world * cap if buf.dense else expected_rows(world, model, tokens, routing, seed, rank),
            "resident": buf.resident,
            "recv_view_rows": recv_x.shape[0],
            "dense": buf.dense,
            "pairs": meta.num_pairs,
            "expected_pairs": expected_pairs(world, model, tokens, routing, seed, rank),
            "roundtrip_err": rt_err,
            "out": y.clone(),
        })
        layer.buffer.close()
    return out


BAD_INPUTS = ("x_shape", "x_dtype", "idx_range", "idx_negative", "idx_shape", "weights_shape", "too_many", "combine_shape",
              "x_grad", "combine_grad")


def case_errors(rank: int, world: int, kinds: list[str], bad_rank: int, dense: bool | None = None,
                transport: str = "collective") -> dict[str, str]:
    """Rank `bad_rank` passes a bad input; every rank must raise ValueError (no hang). After each error the
    group must still work (a good dispatch/combine follows)."""
    model = get_model("custom:64,32,8,2,float32")
    if transport == "nvlink_words":  # the resident layout over the kernels' count words (CountWordResident)
        register_transport("nvlink", "runtime_cases:CountWordResident")
        transport = "nvlink"
    elif transport == "nvlink":
        use_resident_stand_in()
    buf = EPBuffer(knobs=default_knobs(transport), model=model, max_tokens=32, dense=dense)
    msgs: dict[str, str] = {}
    for kind in kinds:
        x, idx, w = make_inputs(rank, model, 8, "uniform", 0)
        if rank == bad_rank:
            if kind == "x_shape":
                x = torch.randn(8, 65)
            elif kind == "x_dtype":
                x = x.to(torch.float64)
            elif kind == "idx_range":
                idx = idx.clone()
                idx[3, 1] = model.experts + 5
            elif kind == "idx_negative":
                idx = idx.clone()
                idx[0, 0] = -1
            elif kind == "idx_shape":
                idx = idx[:, :1]
            elif kind == "weights_shape":
                w = w[:5]
            elif kind == "x_grad":  # in grad mode (these ranks' default): dispatch has no backward
                x = x.clone().requires_grad_()
            elif kind == "too_many":
                x = torch.randn(40, 64)
                idx, w = generate_routing(40, model.experts, model.topk, seed=1)
        t0 = time.monotonic()
        try:
            recv_x, _meta, handle = buf.dispatch(x, idx, w)
            if kind == "combine_shape":
                eo = recv_x if rank != bad_rank else recv_x[:, :10]
                buf.combine(eo.contiguous(), handle)
            elif kind == "combine_grad":  # in grad mode: the rows go back by copies and collectives autograd misses
                eo = recv_x.clone().requires_grad_() if rank == bad_rank else recv_x
                buf.combine(eo.contiguous(), handle)
            msgs[kind] = "NO ERROR"
        except ValueError as e:
            msgs[kind] = f"{time.monotonic() - t0:.2f}s {e}"
        # the group still works
        x, idx, w = make_inputs(rank, model, 8, "uniform", 0)
        recv_x, _meta, handle = buf.dispatch(x, idx, w)
        buf.combine(recv_x.contiguous(), handle)
    return msgs


def _small_unfused_layer(rank: int, dense: bool) -> tuple[MoELayer, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An unfused float32 layer on its own buffer (max_tokens 16) and this rank's 8 uniform tokens (x, ids, weights)."""
    model = get_model("custom:64,32,8,2,float32")
    buf = EPBuffer(knobs=Knobs(), model=model, max_tokens=16, dense=dense)
    return (MoELayer(model, max_tokens=16, buffer=buf, engine="unfused"), *make_inputs(rank, model, 8, "uniform", 0))


def _timed_refusal(call: Callable[..., object], *args: object) -> str:
    """"NO ERROR" where `call(*args)` returns, else "<seconds>s <its ValueError>"."""
    t0 = time.monotonic()
    try:
        call(*args)
        return "NO ERROR"
    except ValueError as e:
        return f"{time.monotonic() - t0:.2f}s {e}"


def case_layer_grad(rank: int, world: int, dense: bool) -> dict[str, str]:
    """Rank 1 calls the layer with an x that requires grad (grad mode on): every rank must raise ValueError (no hang),
    and the layer still works after."""
    layer, x, idx, w = _small_unfused_layer(rank, dense)
    msgs: dict[str, str] = {}
    for kind in ("forward", "forward_routed"):
        xs = x.clone().requires_grad_() if rank == 1 else x
        msgs[kind] = _timed_refusal(layer, xs) if kind == "forward" else _timed_refusal(layer.forward_routed, xs, idx, w)
        layer(x)  # the group still works
    return msgs


def case_knob_mismatch(rank: int, world: int) -> str:
    model = get_model("custom:64,32,8,2,float32")
    try:
        EPBuffer(knobs=Knobs(pipeline_depth=1 + rank), model=model, max_tokens=32)
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def case_options_mismatch(rank: int, world: int) -> str:
    """Same knobs, different runtime options on rank 1: the buffer refuses to build on every rank."""
    model = get_model("custom:64,32,8,2,float32")
    try:
        EPBuffer(knobs=Knobs(), model=model, max_tokens=32, options={"onesided_timeout_s": 20.0 + rank})
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def case_proxy_cpu_differs(rank: int, world: int) -> str:
    """Different proxy_cpu on each rank (it places a thread of one process): the buffer builds on every rank."""
    model = get_model("custom:64,32,8,2,float32")
    try:
        EPBuffer(knobs=Knobs(), model=model, max_tokens=32, options={"proxy_cpu": ("numa", "0")[rank % 2]})
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def case_crash_one(rank: int, world: int) -> int:
    """Rank 1 dies before the collective; rank 0's collective must end with an error (bounded timeout)."""
    import torch.distributed as dist

    if rank == 1:
        raise RuntimeError("boom on rank 1")
    t = torch.ones(4)
    dist.all_reduce(t)
    return 0


def case_gpu(rank: int, world: int) -> list[tuple[str, float, float]]:
    """On CUDA/NCCL: the layer vs the dense reference for bf16 shapes, plain and fp8 + pipelined."""
    from moetune.runtime.fp8 import FP8_LAYER_REL_ERR_BOUND

    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for spec, s in (("custom:256,128,16,4", 40), ("qwen3-30b", 64)):
        model = get_model(spec)
        for comp, depth, dense in (("none", 1, True), ("fp8_e4m3", 2, True), ("none", 1, False), ("fp8_e4m3", 2, False)):
            buf = EPBuffer(knobs=Knobs(compression=comp, pipeline_depth=depth), model=model, max_tokens=s, device=dev,
                           dense=dense)
            layer = MoELayer(model, max_tokens=s, device=dev, seed=1, buffer=buf)
            g = torch.Generator(device=dev).manual_seed(rank + 5)
            x = torch.randn(s, model.hidden, generator=g, device=dev).to(torch.bfloat16)
            idx, w = generate_routing(s, model.experts, model.topk, routing="zipf:1.2", seed=rank, device=dev)
            y = layer.forward_routed(x, idx, w)
            ref = dense_reference(x, model, seed=1, topk_idx=idx, topk_weights=w)
            bound = 3e-2 + (FP8_LAYER_REL_ERR_BOUND if comp != "none" else 0.0)
            out.append((f"{spec}/{comp}/d{depth}/dense={dense}/grouped={layer.use_grouped_mm}", max_rel_err(y, ref), bound))
            del layer
    return out


def _host_staged_graph_replays(dev: torch.device, model, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> list[str]:
    """host_staged round trips captured in a CUDA graph (dense layout, no host sync) give the bytes of the
    same round trips run eagerly, replay after replay, with new inputs and eager calls in between (the
    slots are taken in the captured order each time). Returns what differed."""
    from moetune.runtime.pipeline import pipelined_moe, weighted_rows

    bad = []
    inputs = [x, (x.float() * -0.5 + 1).to(x.dtype), x.flip(0)]
    for kn in ("compression=fp8_e4m3,chunk_tokens=64", "chunk_tokens=0",
               "compression=fp8_e4m3,pipeline_depth=2,channels=2,chunk_tokens=32"):
        buf = EPBuffer(knobs=Knobs.parse(f"transport=host_staged,{kn}"), model=model, max_tokens=400, device=dev,
                       dense=True, check_inputs=False)
        xs = x.clone()

        def rt(buf: EPBuffer = buf, xs: torch.Tensor = xs) -> torch.Tensor:
            if buf.num_chunks > 1:
                return pipelined_moe(buf, xs, idx, w, weighted_rows)
            recv, meta, h = buf.dispatch(xs, idx, w)
            return buf.combine(weighted_rows(recv, meta), h)

        want = []
        for inp in inputs:  # eager
            xs.copy_(inp)
            want.append(rt().clone())
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            rt()
        torch.cuda.current_stream(dev).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = rt()
        for rep in range(2):
            for i, inp in enumerate(inputs):
                xs.copy_(inp)
                g.replay()
                got = out.clone()
                if not torch.equal(got, want[i]):
                    bad.append(f"{kn} replay {rep} input {i}: max diff {(got.float() - want[i].float()).abs().max().item()}")
                if i == 1:  # an eager round trip between replays takes the next slots on both ranks
                    xs.copy_(inputs[0])
                    if not torch.equal(rt(), want[0]):
                        bad.append(f"{kn} eager call between replays differs")
        torch.cuda.synchronize()
        buf.transport.check()
        del g
        buf.close()
    return bad


def case_gpu_host_staged(rank: int, world: int) -> dict:
    """On CUDA: host_staged through the copy engines gives the same bytes as the NCCL collective (same
    inputs, both layouts, pipelined or not, staged whole or in chunk_tokens pieces, repeated calls wrapping
    the slot rings); captured in a CUDA graph it replays correctly; blocks larger than a slot go through
    several; a peer that never posts is a timeout error, not a hang."""
    from moetune.runtime.pipeline import pipelined_moe, weighted_rows
    from moetune.runtime.transports.host_staged import HostStagedError, HostStagedTransport

    dev = torch.device("cuda", torch.cuda.current_device())
    model = get_model("qwen3-30b")
    s = 300 + 17 * rank  # uneven token counts, chunks of different sizes
    g = torch.Generator(device=dev).manual_seed(rank + 11)
    x = torch.randn(s, model.hidden, generator=g, device=dev).to(torch.bfloat16)
    idx, w = generate_routing(s, model.experts, model.topk, routing="zipf:1.2", seed=rank + 3, device=dev)
    rep: dict = {"mismatch": [], "native": []}
    for dense in (True, False):
        for kn in ("pipeline_depth=1", "compression=fp8_e4m3,pipeline_depth=2,channels=2", "pipeline_depth=4",
                   "chunk_tokens=64", "compression=fp8_e4m3,chunk_tokens=32,pipeline_depth=2"):
            outs = {}
            for tr in ("collective", "host_staged"):
                buf = EPBuffer(knobs=Knobs.parse(f"transport={tr},{kn}"), model=model, max_tokens=400, device=dev,
                               dense=dense)
                if tr == "host_staged":
                    rep["native"].append(bool(getattr(buf.transport, "native", False)))
                res = []
                for _ in range(3):  # the rings wrap: 3 calls x (dispatch + combine) x chunks > 2 slots per lane
                    recv, meta, h = buf.dispatch(x, idx, w)
                    res.append(recv.contiguous().clone())
                    res.append(buf.combine(weighted_rows(recv, meta), h))
                    res.append(pipelined_moe(buf, x, idx, w, weighted_rows))
                torch.cuda.synchronize()
                outs[tr] = res
                buf.close()
            for i, (a, b) in enumerate(zip(outs["collective"], outs["host_staged"], strict=True)):
                if not torch.equal(a, b):
                    rep["mismatch"].append(f"dense={dense} {kn} result {i}: max diff {(a.float() - b.float()).abs().max().item()}")
    rep["graph"] = _host_staged_graph_replays(dev, model, x, idx, w)
    # pieces: slots of 64 KiB, a 1 MiB block per peer, through a ring of 3 slots
    t = HostStagedTransport(None, Knobs(transport="host_staged", staging_slots=3), dev, channels=1)
    rep["ring"] = t.ring
    t.stage_capacity(16, 4096)
    rows = torch.arange(world * 256 * 1024, dtype=torch.int32, device=dev).reshape(world * 256, 1024) + rank * 10**8
    out, work = t.exchange_async(rows, [256] * world, [256] * world)
    work.wait()
    want = torch.cat([torch.arange(256 * 1024, dtype=torch.int32, device=dev).reshape(256, 1024) + rank * 256 * 1024
                      + src * 10**8 for src in range(world)])
    rep["pieces_ok"] = bool(torch.equal(out, want))
    t.close()
    # a peer that never posts: rank 0 waits on the GPU until the timeout (the watchdog's for memop waits,
    # the spin kernel's own otherwise), then check() names it, and the device is free again (synchronize returns)
    for mode in ("memop", "kernel"):
        t = HostStagedTransport(None, Knobs(transport="host_staged", wait_mode=mode), dev, channels=1)
        t.stage_capacity(16, 4096)
        rep["flags"] = {f"{a}->{b}": t.flag_values(0, a, b) for a, b in ((0, 1), (1, 0))}
        key = "timeout" if mode == "memop" else "timeout_kernel"
        if rank == 0:
            t.exchange_async(rows, [256] * world, [256] * world)
            torch.cuda.synchronize()
            try:
                t.check()
                rep[key] = "no error"
            except HostStagedError as e:
                rep[key] = str(e)
        else:
            rep[key] = "skipped"
        t.close()
    return rep


def case_rows_without_a_local_slot(rank: int, world: int, dense: bool) -> list[float]:
    """Every token's experts (0 and 1) live on rank 0; each rank's expert code writes 1 in the rows it has a local
    slot for and 7 in the others (rows the docs say combine ignores). The combined output must be 1 everywhere."""
    buf = EPBuffer(knobs=Knobs(), model=get_model("custom:64,32,8,2,float32"), max_tokens=4, dense=dense)
    try:
        x = torch.randn(2, 64)
        idx, w = torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2)
        rx, meta, h = buf.dispatch(x, idx, w)
        eo = torch.ones_like(rx.contiguous())
        eo[meta.local_expert_ids.max(1).values < 0] = 7.0
        return buf.combine(eo, h)[:, 0].tolist()
    finally:
        buf.close()


def case_unchecked_bad_ids(rank: int, world: int, dense: bool) -> tuple[str, float]:
    """check_inputs=False; rank 1 routes one slot of token 0 to expert 99 (8 experts). The packed layout's counts
    exchange refuses it on every rank ('err'); the dense layout cannot see it: ('ok', how far the identity round trip
    is from x * sum(w)), token 0 of rank 1 missing that slot's share."""
    model = get_model("custom:64,32,8,2,float32")
    buf = EPBuffer(knobs=Knobs(), model=model, max_tokens=16, dense=dense, check_inputs=False)
    try:
        x, idx, w = make_inputs(rank, model, 8, "uniform", 0)
        if rank == 1:
            idx = idx.clone()
            idx[0, 0] = 99
        try:
            rx, meta, h = buf.dispatch(x, idx, w)
        except ValueError as e:
            return "err", 0.0 if "out of range" in str(e) else -1.0
        y = buf.combine((rx * meta.weights.sum(1, keepdim=True)).contiguous(), h)
        return "ok", float((y - x * w.sum(1, keepdim=True)).abs().max())
    finally:
        buf.close()


def case_gpu_resident_bad_input(rank: int, world: int) -> dict[str, list]:
    """On the real one-sided kernels (nvlink, proxy): rank `world - 1` dispatches an x of the wrong shape with
    check_inputs; what each rank raised, then the shape a good dispatch and combine gave (the group still works)."""
    model = get_model("custom:64,32,8,2,float32")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    out: dict[str, list] = {}
    for name in ("nvlink", "proxy"):
        buf = EPBuffer(knobs=default_knobs(name), model=model, max_tokens=32, device=device, dense=False)
        try:
            x, idx, w = (t.to(device) for t in make_inputs(rank, model, 8, "uniform", 0))
            bad = torch.randn(8, 65, device=device) if rank == world - 1 else x
            try:
                buf.dispatch(bad, idx, w)
                got = ["NO ERROR", ""]
            except Exception as e:
                got = [type(e).__name__, str(e)[:400]]
            recv_x, _meta, handle = buf.dispatch(x, idx, w)
            y = buf.combine(recv_x.contiguous(), handle)
            torch.cuda.synchronize(device)
            out[name] = [*got, list(y.shape)]
        finally:
            buf.close()
    return out


def case_gpu_host_staged_other_buffers(rank: int, world: int) -> dict:
    """On CUDA, host_staged through the copy engines, dense layout with check_inputs: rank 1 dispatches on a buffer of
    max_tokens 16 (decode), the others on one of 32 (prefill), both built on every rank; what each raised and how
    long it took, whether the copy-engine path ran, then the shape a dispatch and combine on one buffer gave."""
    dev = torch.device("cuda", torch.cuda.current_device())
    model = get_model("custom:64,32,8,2,bfloat16")
    knobs = default_knobs("host_staged")
    prefill = EPBuffer(knobs=knobs, model=model, max_tokens=32, device=dev, dense=True)
    decode = EPBuffer(knobs=knobs, model=model, max_tokens=16, device=dev, dense=True)
    try:
        x, idx, w = (t.to(dev) for t in make_inputs(rank, model, 8, "uniform", 0))
        x = x.to(torch.bfloat16)
        t0 = time.monotonic()
        try:
            (decode if rank == 1 else prefill).dispatch(x, idx, w)
            got = ["NO ERROR", ""]
        except Exception as e:
            got = [type(e).__name__, str(e)[:400]]
        got.append(time.monotonic() - t0)
        recv_x, _meta, handle = decode.dispatch(x, idx, w)
        y = decode.combine(recv_x.contiguous(), handle)
        torch.cuda.synchronize(dev)
        return {"native": bool(decode.transport.native), "step": got, "after": list(y.shape)}
    finally:
        prefill.close()
        decode.close()


def case_layer_param_grad(rank: int, world: int, dense: bool) -> dict[str, str]:
    """Rank 1's layer has parameters that require grad (`layer.requires_grad_()`, as a training loop does), grad mode
    on: every rank must raise ValueError (no hang, no silently detached output), and the layer works again once they
    no longer do."""
    layer, x, idx, w = _small_unfused_layer(rank, dense)
    msgs: dict[str, str] = {}
    for kind in ("forward", "forward_routed"):
        layer.requires_grad_(rank == 1)
        msgs[kind] = _timed_refusal(layer, x) if kind == "forward" else _timed_refusal(layer.forward_routed, x, idx, w)
        layer.requires_grad_(False)
        layer(x)  # the group still works
    return msgs


def case_unchecked_bad_expert_out(rank: int, world: int, dense: bool, transport: str) -> dict[str, str]:
    """check_inputs=False: every rank passes an expert_out of the wrong shape, so each raises on its own (none enters
    the combine's transfer, none waits); {"bad": its message, "after": "ok" once a good round trip ran after it}."""
    model = get_model("custom:64,32,8,2,float32")
    if transport == "nvlink":
        use_resident_stand_in()
    buf = EPBuffer(knobs=default_knobs(transport), model=model, max_tokens=32, dense=dense, check_inputs=False)
    out: dict[str, str] = {}
    try:
        x, idx, w = make_inputs(rank, model, 8, "uniform", 0)
        recv_x, _meta, handle = buf.dispatch(x, idx, w)
        try:
            buf.combine(recv_x[:, :10].contiguous(), handle)
            out["bad"] = "NO ERROR"
        except ValueError as e:
            out["bad"] = str(e)
        recv_x, _meta, handle = buf.dispatch(x, idx, w)
        buf.combine(recv_x.contiguous(), handle)
        out["after"] = "ok"
    finally:
        buf.close()
    return out
