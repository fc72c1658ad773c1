"""GPU tests of the MoE megakernel (runtime/megakernel, csrc/megakernel) on the Qwen3-30B-A3B shape.

Against the fp32 `dense_reference` (same weights, same routing): relative error <= 1e-2 for
S in {1, 7, 128, 1000, 4096}, routing from the gate, uniform and Zipf; all tokens to one expert (most
experts empty); the output is poisoned (NaN) before each run, so an unwritten row fails; bit-identical
outputs across runs; CUDA-graph capture and replays; a task whose input never becomes ready ends in a
reported error after the timeout, never a hang. The kernel's own task counts are compared with the CPU
scheduler model's `plan`. Skipped with a reason without CUDA or without the library.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megakernel_fakes import need_megakernel_gpu

pytestmark = pytest.mark.gpu

SIZES = [1, 7, 128, 1000, 4096]


@pytest.fixture(scope="module")
def model():
    from moetune.runtime.shapes import get_model

    return get_model("qwen3-30b")


@pytest.fixture(scope="module")
def layer(model):
    need_megakernel_gpu()
    from moetune.runtime.megakernel import MegakernelMoE

    return MegakernelMoE(model, max_tokens=4096, seed=0)


def _x(s: int, h: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randn(s, h, generator=g, device="cuda").to(torch.bfloat16)


def _routing(s: int, e: int, k: int, mode: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    if mode == "uniform":
        probs = torch.ones(s, e, device="cuda")
    elif mode == "zipf":
        probs = (1.0 / torch.arange(1, e + 1, device="cuda", dtype=torch.float32) ** 1.2).expand(s, e)
    elif mode == "one":  # every token's first slot to expert 0: one expert holds S rows, E-K experts none
        idx = torch.arange(k, device="cuda").expand(s, k).contiguous()
        w = torch.rand(s, k, generator=g, device="cuda")
        return idx, w / w.sum(1, keepdim=True)
    else:
        raise ValueError(mode)
    idx = torch.multinomial(probs, k, replacement=False, generator=g)
    w = torch.rand(s, k, generator=g, device="cuda")
    return idx, w / w.sum(1, keepdim=True)


def _poisoned(s: int, h: int) -> torch.Tensor:
    return torch.full((s, h), float("nan"), dtype=torch.bfloat16, device="cuda")


def _check(layer, model, x, out, idx, w, tol=1e-2):
    from moetune.runtime.megakernel import schedule
    from moetune.runtime.megakernel.config import split_room
    from moetune.runtime.moe_layer import dense_reference, max_rel_err

    torch.cuda.synchronize()
    layer.check()
    assert torch.isfinite(out.float()).all(), "rows left unwritten (poison survived) or non-finite"
    ref = dense_reference(x, model, seed=0, topk_idx=idx, topk_weights=w)
    err = max_rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e}"
    cfg = layer.launch.for_tokens(x.shape[0])  # the config this launch ran (its token bucket's, else the layer's)
    c = layer.counters()
    dg = layer.decode_grid(x.shape[0])
    if dg is not None:  # the decode kernel counts its phase-1 ranges and row blocks (runtime/megakernel/decode.py)
        from moetune.runtime.megakernel import decode

        d = decode.plan(tokens=x.shape[0], topk=model.topk, hidden=model.hidden, intermediate=model.intermediate,
                        grid=dg[0])
        assert d.rows == dg[1]
        assert (c["total"], c["tiles"], c["published"]) == (d.total, d.n_tiles, d.total)
        return err
    bm = cfg.pick_bm(x.shape[0], model.topk, model.experts)
    p = schedule.plan(idx.tolist(), experts=model.experts, hidden=model.hidden, intermediate=model.intermediate,
                      bm=bm, combine_tokens=cfg.combine_tile(bm, cfg.pick_bn(bm), x.shape[0], model.topk, model.experts),
                      split_k1=cfg.split_k1, split_k2=cfg.split_k2,
                      split_max_tiles=split_room(cfg, layer.max_tiles)[0], bn=cfg.pick_bn(bm), tail=cfg.tail(bm, cfg.pick_bn(bm)))
    assert (c["total"], c["tiles"], c["published"]) == (p.total, p.n_tiles, p.total)
    return err


@pytest.mark.parametrize("s", SIZES)
def test_gate_routing_matches_reference(layer, model, s):
    from moetune.runtime.moe_layer import route

    x = _x(s, model.hidden, seed=s)
    out = layer.forward(x, out=_poisoned(s, model.hidden))
    idx, w = layer.routing(s)
    idx, w = idx.clone(), w.clone()
    _check(layer, model, x, out, idx, w)
    # the routing kernel against torch's route (fp32 logits; near-ties may order differently)
    ridx, rw = route(x, layer.gate, model.topk)
    same = (idx.sort(1).values == ridx.sort(1).values).all(1)
    assert same.float().mean().item() >= 0.99
    assert torch.allclose(w[same].sort(1).values, rw[same].float().sort(1).values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("s", [8, 16, 129, 256, 300, 513, 1000, 1024, 1025, 2048])
def test_cluster_routing(layer, model, s):
    """Routing for 8..1024 tokens runs as one cluster kernel (k_route: 8 H splits added across the cluster's
    shared memory, tiles of 16 or 64 tokens by S, a last tile part empty), above that as k_logits + k_topk (1025,
    2048): torch's route's experts for >= 99% of the tokens with its weights, each expert's list exactly its
    (token, slot) rows, the same bits on a second run, and
    the layer's output against the dense reference."""
    from moetune.runtime.moe_layer import route

    x = _x(s, model.hidden, seed=2600 + s)
    out = layer.forward(x, out=_poisoned(s, model.hidden)).clone()
    idx, w = (t.clone() for t in layer.routing(s))
    _check(layer, model, x, out, idx, w)
    ridx, rw = route(x, layer.gate, model.topk)
    same = (idx.sort(1).values == ridx.sort(1).values).all(1)
    assert same.float().mean().item() >= 0.99
    assert torch.allclose(w[same].sort(1).values, rw[same].float().sort(1).values, atol=1e-5, rtol=1e-4)
    assert (idx.sort(1).values.diff(dim=1) > 0).all(), "an expert picked twice for one token"
    counts = layer.counts.view(model.experts, -1)[:, 0].tolist()
    flat = idx.flatten().tolist()
    for e in range(model.experts):  # the expert's list holds exactly the (token, slot) rows routed to it
        assert sorted(layer.lists[e, :counts[e]].tolist()) == [r for r, x in enumerate(flat) if x == e], f"expert {e}"
    out2 = layer.forward(x, out=_poisoned(s, model.hidden))
    idx2, w2 = layer.routing(s)
    torch.cuda.synchronize()
    assert torch.equal(idx, idx2) and torch.equal(w.view(torch.int32), w2.view(torch.int32))
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16))


@pytest.mark.parametrize("s", SIZES)
@pytest.mark.parametrize("mode", ["uniform", "zipf"])
def test_given_routing_matches_reference(layer, model, s, mode):
    x = _x(s, model.hidden, seed=100 + s)
    idx, w = _routing(s, model.experts, model.topk, mode, seed=s)
    out = layer.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    _check(layer, model, x, out, idx, w)


@pytest.mark.parametrize("s", [7, 1000, 4096])
def test_all_tokens_to_one_expert(layer, model, s):
    x = _x(s, model.hidden, seed=200 + s)
    idx, w = _routing(s, model.experts, model.topk, "one", seed=s)
    out = layer.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    _check(layer, model, x, out, idx, w)


@pytest.mark.parametrize("cfg", ["bm=16,stages=2", "bm=16,stages=12", "bm=64,stages=8",
                                 "bm=64,stages=6", "bm=128,stages=3", "bm=128,stages=5", "bm=16,stages=3,ctas_per_sm=1,combine_tokens=5",
                                 "processor_ctas=7"])
def test_configs(model, layer, cfg):
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE

    other = MegakernelMoE(model, max_tokens=1024, config=MegakernelConfig.parse(cfg), w_gate_up=layer.w_gate_up,
                          w_down=layer.w_down, gate=layer.gate)
    for s in (5, 1000):
        x = _x(s, model.hidden, seed=300 + s)
        idx, w = _routing(s, model.experts, model.topk, "zipf", seed=s)
        out = other.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
        _check(other, model, x, out, idx, w)


def test_bucket_split_k_grows_the_partial_buffers(model, layer):
    """A token bucket's split-K installed on a layer built without it (set_bucket_config): the layer grows its
    partial buffers and task queue, the bucket's launches run split (the counters match the split plan) and match
    the reference; a CUDA graph captured before the growth keeps launching with the old buffers and still replays
    its eager output; a bucket asking more parts grows them again."""
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE

    # decode=0: the task graph runs S=1-2 (the decode kernel would take them and split-K never runs there)
    mk = MegakernelMoE(model, max_tokens=256, config=MegakernelConfig.parse("decode=0"), w_gate_up=layer.w_gate_up,
                       w_down=layer.w_down, gate=layer.gate)
    assert mk.sk_room == (0, 1)
    s = 2
    x = _x(s, model.hidden, seed=700)
    idx, w = _routing(s, model.experts, model.topk, "uniform", seed=700)
    before = mk.forward_routed(x, idx, w).clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = mk.forward_routed(x, idx, w, check_ids=False)
    why = mk.set_bucket_config(1, MegakernelConfig.parse("decode=0,bm=16,split_k1=2,split_k2=2"))
    assert why is None and mk.sk_room == (16, 2)
    assert mk.launch.for_tokens(s).split_k1 == 2
    out = mk.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    _check(mk, model, x, out, idx, w)  # the counters are the split plan's (16 rows: <= 16 m-tiles split)
    captured.zero_()
    g.replay()
    torch.cuda.synchronize()
    mk.check()
    assert torch.equal(captured.view(torch.int16), before.view(torch.int16))  # the old buffers, the old config
    assert mk.set_bucket_config(1, MegakernelConfig.parse("decode=0,bm=16,split_k1=4,split_k2=2")) is None
    assert mk.sk_room == (16, 4)
    out4 = mk.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    _check(mk, model, x, out4, idx, w)


@pytest.mark.parametrize("s", [1, 128, 4096])
def test_bit_identical_across_runs(layer, model, s):
    x = _x(s, model.hidden, seed=400 + s)
    first = layer.forward(x).clone()
    for _ in range(3):
        again = layer.forward(x, out=_poisoned(s, model.hidden))
        torch.cuda.synchronize()
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    layer.check()


def _graph_replays(layer, model, s: int, n: int):
    x = _x(s, model.hidden, seed=500 + s)
    eager = layer.forward(x).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.forward(x)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layer.forward(x)
    for i in range(n):
        g.replay()
        if i % 1000 == 999 or i == n - 1:
            torch.cuda.synchronize()
            layer.check()
            assert torch.equal(out.view(torch.int16), eager.view(torch.int16)), f"replay {i} differs"


@pytest.mark.parametrize("s", [1, 128, 4096])
def test_cuda_graph_replays(layer, model, s):
    _graph_replays(layer, model, s, 200)


@pytest.mark.slow
def test_cuda_graph_10000_replays(layer, model):
    _graph_replays(layer, model, 128, int(os.environ.get("MK_GRAPH_REPLAYS", "10000")))


@pytest.mark.parametrize("cfg", ["", "overlap=1,bm=64", "overlap=1,bm=128,bn=256", "publish_all=0",
                                 "publish_all=1,tma=0", "pdl=0", "pdl=1,bm=128,bn=256"])
def test_never_ready_task_times_out(model, layer, cfg):
    """A GEMM2 that is never released: the launch ends (no hang), the error is recorded, the layer recovers. The
    overlap kernel too: its producer spins on the queue slot while the consumers wait for a task word."""
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelError, MegakernelMoE

    m = MegakernelMoE(model, max_tokens=256, config=MegakernelConfig.parse(cfg + ",timeout_ms=100"),
                      w_gate_up=layer.w_gate_up, w_down=layer.w_down, gate=layer.gate)
    x = _x(64, model.hidden, seed=600)
    m.stall_tile = 0
    t0 = time.monotonic()
    m.forward(x)
    torch.cuda.synchronize()
    waited = time.monotonic() - t0
    assert waited < 10.0
    with pytest.raises(MegakernelError, match="timed out"):
        m.check()
    rec = m.error()
    assert rec is not None and rec[2][3] >= 100_000_000  # waited at least the timeout (ns)
    # the layer recovers: clear the record, lift the stall, run again correctly
    m.clear_error()
    m.stall_tile = -1
    idx, w = _routing(64, model.experts, model.topk, "uniform", seed=1)
    out = m.forward_routed(x, idx, w, out=_poisoned(64, model.hidden))
    _check(m, model, x, out, idx, w)


@pytest.mark.parametrize("cfg", ["", "overlap=1,bm=64", "overlap=1,bm=128,bn=256,tma=1"])
def test_forwards_right_after_aborts_are_bit_identical(model, layer, cfg):
    """A launch that aborts (a never-released task, timeout_ms=20) ends with its CTAs' weight-tile copies (TMA /
    cp.async into shared memory) possibly still in flight: the PTX ISA does not say that a CTA's shared memory is held
    until they land. If it were not, the next launch's CTAs on those SMs could read tiles the aborted launch's copies
    overwrite. Twelve rounds of an aborted launch then a forward at once, on the same stream: every forward bit-identical
    to the one before the first abort and within the reference bound."""
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelError, MegakernelMoE

    m = MegakernelMoE(model, max_tokens=256, config=MegakernelConfig.parse(cfg + ("," if cfg else "") + "timeout_ms=20"),
                      w_gate_up=layer.w_gate_up, w_down=layer.w_down, gate=layer.gate)
    x = _x(256, model.hidden, seed=610)
    idx, w = _routing(256, model.experts, model.topk, "uniform", seed=610)
    first = m.forward_routed(x, idx, w, out=_poisoned(256, model.hidden)).clone()
    _check(m, model, x, first, idx, w)
    for i in range(12):
        m.stall_tile = i % 4
        m.forward_routed(x, idx, w)
        torch.cuda.synchronize()
        with pytest.raises(MegakernelError, match="timed out"):
            m.check()
        m.clear_error()
        m.stall_tile = -1
        out = m.forward_routed(x, idx, w, out=_poisoned(256, model.hidden))  # no sync before it: the next launch
        torch.cuda.synchronize()
        m.check()
        assert torch.equal(out.view(torch.int16), first.view(torch.int16)), f"round {i}: the forward after an abort differs"


@pytest.mark.parametrize("cfg", ["", "overlap=1,bm=64"])
def test_launch_epoch_wraps_without_stale_flags(model, layer, cfg):
    """The launch epoch (ctl word 3) that queue flags and release marks are compared with for equality: bumped from
    INT_MAX it goes on as an unsigned count (an int overflow is undefined behaviour), and where it wraps to 0 (made 1)
    the flags are cleared. Here every flag and mark holds 1, as if written 2^32 launches ago, and every queue slot a
    task word of 0 ("no more work"): taken as published, the launch ends early or hangs to its timeout. Each forward
    is bit-identical to the one before."""
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.megakernel.layer import CTL_EPOCH

    m = MegakernelMoE(model, max_tokens=256, config=MegakernelConfig.parse(cfg + ("," if cfg else "") + "timeout_ms=200"),
                      w_gate_up=layer.w_gate_up, w_down=layer.w_down, gate=layer.gate)
    x = _x(256, model.hidden, seed=620)
    idx, w = _routing(256, model.experts, model.topk, "uniform", seed=620)
    first = m.forward_routed(x, idx, w, out=_poisoned(256, model.hidden)).clone()
    _check(m, model, x, first, idx, w)
    assert m.decode_grid(256) is None  # the task graph: the kernel with the queue flags
    for start, then in ((2**31 - 1, -2**31), (-1, 1)):
        m.ctl[CTL_EPOCH] = start
        if then == 1:  # the wrap: every flag and mark stale at the epoch the launch takes
            m.q_flag.fill_(1)
            m.rel.fill_(1)
            m.q_task.fill_(0)
        out = m.forward_routed(x, idx, w, out=_poisoned(256, model.hidden))
        torch.cuda.synchronize()
        m.check()
        assert int(m.ctl[CTL_EPOCH]) == then
        assert torch.equal(out.view(torch.int16), first.view(torch.int16)), f"from epoch {start}: the output differs"


def test_decode_forwards_right_after_aborts_are_bit_identical(model, layer):
    """The decode kernel's waits give up once its abort flag is raised, and its W_down bulk copies may still be in
    flight (mk_decode.cuh): twelve rounds of an aborted S=1 decode (an expert id out of range, the kernel's own record)
    then a good decode at once, each bit-identical to the first."""
    from moetune.runtime.megakernel import MegakernelError, MegakernelMoE

    m = MegakernelMoE(model, max_tokens=1, w_gate_up=layer.w_gate_up, w_down=layer.w_down, gate=layer.gate)
    x = _x(1, model.hidden, seed=3310)
    idx, w = _routing(1, model.experts, model.topk, "uniform", seed=7)
    bad = idx.clone()
    bad[0, 2] = model.experts
    first = m.forward_routed(x, idx, w, out=_poisoned(1, model.hidden)).clone()
    _check(m, model, x, first, idx, w)
    for i in range(12):
        m.forward_routed(x, bad, w, check_ids=False)
        torch.cuda.synchronize()
        with pytest.raises(MegakernelError, match="out of range"):
            m.check()
        m.clear_error()
        out = m.forward_routed(x, idx, w, out=_poisoned(1, model.hidden))
        torch.cuda.synchronize()
        m.check()
        assert torch.equal(out.view(torch.int16), first.view(torch.int16)), f"round {i}: the decode after an abort differs"


# ---- new paths (off by default until a GPU run verifies them): the wgmma core for bm 64/128 and decode split-K ----------------------------
# Each runs every S against dense_reference with poisoned output, twice more for bit-identical bits, and its
# task counts against the CPU model. NEXT_RUN.md: if these pass, the bench decides the defaults.
NEW_PATHS = [# the mma core and no split-K: the defaults before run 10, still selectable (mk_core, mk_split_k)
             "core=mma", "core=mma,bm=64", "core=mma,bm=128", "split_k1=1,split_k2=1", "core=mma,split_k1=1,split_k2=1",
             "core=wgmma", "core=wgmma,bm=64", "core=wgmma,bm=128", "core=wgmma,bm=64,stages=6",
             "core=wgmma,bm=128,stages=6", "core=wgmma,bm=128,stages=2", "split_k1=4,split_k2=2",
             "split_k1=2,split_k2=1", "split_k1=8,split_k2=4,stages=3", "core=wgmma,split_k1=4,split_k2=2",
             # weight tiles by TMA (tma=1): wgmma producer, and the bm=16 mma tile (also with split-K)
             "core=wgmma,tma=1", "core=wgmma,bm=128,tma=1", "core=wgmma,bm=64,stages=8,tma=1", "bm=16,tma=1",
             "bm=16,tma=1,stages=12", "bm=16,tma=1,split_k1=4,split_k2=2",
             # cp.async weight tiles (tma=0), the default before run 11
             "tma=0", "core=wgmma,bm=128,tma=0", "bm=16,tma=0,split_k1=1,split_k2=1",
             # the wide tile (bn=256: 128 x 256 per task, m64n256k16 consumers; bm=0 runs it from S=1000 up, bm=16
             # below), B by TMA or cp.async, 2..4 stages
             "bm=128,bn=256,tma=1", "bn=256,tma=1", "bm=128,bn=256,tma=1,stages=3", "bm=128,bn=256,tma=1,stages=2",
             "bm=128,bn=256,tma=0", "bm=128,bn=256,stages=3,tma=0",
             # the cross-task overlap kernel (overlap=1: producer warpgroup claims ahead, double-buffered task slots,
             # COMBINE on the consumer warpgroups); bm=0 runs it from the bm=64 sizes up, bm=16 below
             "overlap=1", "overlap=1,bm=64", "overlap=1,bm=128,bn=128", "overlap=1,tma=0", "overlap=1,bm=128,bn=128,tma=0",
             "overlap=1,bm=128,bn=256", "overlap=1,bm=128,bn=256,tma=0", "overlap=1,stages=3", "overlap=1,bm=64,stages=2",
             "overlap=1,bm=64,stages=8",
             # run 12 made bn auto (256 where the shape allows) and overlap=1 the defaults: the narrow bm=128 tile
             # and the run-11 default (no overlap, bm=64 x 128) stay covered
             "bm=128,bn=128", "bm=128,bn=128,overlap=0", "overlap=0,bn=128", "overlap=0",
             # publish_all (ABI 11): every task at launch, GEMM2 / COMBINE wait for their inputs in the processor
             "publish_all=1", "publish_all=1,tma=0", "publish_all=1,split_k1=1,split_k2=1",
             "publish_all=1,split_k1=4,split_k2=2", "publish_all=1,bm=16,stages=12", "publish_all=1,core=mma,bm=64",
             "publish_all=1,core=mma,bm=128", "publish_all=0", "publish_all=0,tma=0",
             # the task graph where the decode kernel would run (S = 1 here)
             "decode=0", "decode=0,tma=0", "decode=0,split_k1=2,split_k2=2", "decode=0,publish_all=0"]


@pytest.fixture(scope="module")
def new_layers(model, layer):
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE

    cache: dict[str, object] = {}

    # every config reads the one layer's k-tiled weights: a row-major pair per config (w_gate_up/w_down are copies)
    # tiled again held ~1.2 GB each, 77 GB over this module's configs, more than an 80 GB H100 has (run 192)
    def get(cfg: str):
        if cfg not in cache:
            cache[cfg] = MegakernelMoE(model, max_tokens=4096, config=MegakernelConfig.parse(cfg),
                                       w_gate_up=layer.w1t, w_down=layer.w2t, gate=layer.gate, tiled=True)
        return cache[cfg]

    return get


@pytest.mark.parametrize("s", SIZES)
@pytest.mark.parametrize("cfg", NEW_PATHS)
def test_new_path_matches_reference(new_layers, model, cfg, s):
    m = new_layers(cfg)
    x = _x(s, model.hidden, seed=700 + s)
    idx, w = _routing(s, model.experts, model.topk, "zipf" if s % 2 else "uniform", seed=s)
    out = m.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    _check(m, model, x, out, idx, w)
    first = out.clone()
    for _ in range(2):
        again = m.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
        torch.cuda.synchronize()
        assert torch.equal(first.view(torch.int16), again.view(torch.int16)), "not bit-identical across runs"
    m.check()


@pytest.mark.parametrize("cfg", ["core=wgmma", "split_k1=4,split_k2=2", "core=wgmma,tma=1", "bm=16,tma=1",
                                 "bm=128,bn=256,tma=1", "overlap=1", "overlap=1,bm=128,bn=128", "overlap=1,bm=128,bn=256",
                                 "publish_all=1", "pdl=0", "pdl=1,overlap=0"])
@pytest.mark.parametrize("s", [1, 1000, 4096])
def test_new_path_gate_routing_and_graph(new_layers, model, cfg, s):
    m = new_layers(cfg)
    x = _x(s, model.hidden, seed=800 + s)
    out = m.forward(x, out=_poisoned(s, model.hidden))
    idx, w = m.routing(s)
    _check(m, model, x, out, idx.clone(), w.clone())
    _graph_replays(m, model, s, 50)


@pytest.mark.parametrize("s", [7, 4096])
def test_new_path_all_tokens_to_one_expert(new_layers, model, s):
    for cfg in ("core=wgmma", "split_k1=4,split_k2=2", "bm=128,bn=256,tma=1", "bm=128,bn=256", "overlap=1,bm=64",
                "overlap=1,bm=128,bn=256"):
        m = new_layers(cfg)
        x = _x(s, model.hidden, seed=900 + s)
        idx, w = _routing(s, model.experts, model.topk, "one", seed=s)
        out = m.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
        _check(m, model, x, out, idx, w)


def test_wgmma_matches_mma_closely(new_layers, layer, model):
    """Same routing, both cores at bm=128: fp32 accumulation in a different order, so close, not equal."""
    from moetune.runtime.moe_layer import max_rel_err

    s = 4096
    x = _x(s, model.hidden, seed=1000)
    idx, w = _routing(s, model.experts, model.topk, "uniform", seed=1)
    a = layer.forward_routed(x, idx, w).clone()
    b = new_layers("core=wgmma").forward_routed(x, idx, w)
    torch.cuda.synchronize()
    assert max_rel_err(b, a) <= 1e-2


def test_wide_tile_matches_narrow_closely(new_layers, model):
    """The wide tile (bn=256) against the 128-column wgmma tile at bm=128, same routing: the same products per
    output element (k16 steps in the same order are expected, not assumed), so at least close."""
    from moetune.runtime.moe_layer import max_rel_err

    for s in (1000, 4096):
        x = _x(s, model.hidden, seed=1200 + s)
        idx, w = _routing(s, model.experts, model.topk, "uniform", seed=s)
        a = new_layers("core=wgmma,bm=128,tma=1").forward_routed(x, idx, w).clone()
        b = new_layers("bm=128,bn=256,tma=1").forward_routed(x, idx, w)
        torch.cuda.synchronize()
        assert max_rel_err(b, a) <= 1e-2, f"S={s}"


@pytest.mark.parametrize(("cfg", "exact"), [("bm=16,tma=0", True), ("core=wgmma,bm=64,tma=0", False),
                                           ("core=wgmma,bm=128,tma=0", False), ("bm=128,bn=256,tma=0", False)])
def test_tma_matches_cp_async(new_layers, model, cfg, exact):
    """tma=1 changes how the weight tiles arrive and which tile column holds which weight row, not the
    products: on the mma core every output element is the same mma sequence (bit-identical); on the wgmma
    core at least close (the same k order per element is expected, not assumed)."""
    from moetune.runtime.moe_layer import max_rel_err

    for s in (1, 200, 4096):
        x = _x(s, model.hidden, seed=1100 + s)
        idx, w = _routing(s, model.experts, model.topk, "zipf", seed=s)
        a = new_layers(cfg).forward_routed(x, idx, w).clone()
        b = new_layers(cfg.replace("tma=0", "tma=1")).forward_routed(x, idx, w)
        torch.cuda.synchronize()
        if exact:
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"S={s}"
        else:
            assert max_rel_err(b, a) <= 1e-2, f"S={s}"


@pytest.mark.parametrize("cfg", ["bm=64", "bm=128,bn=128", "bm=128,bn=256", "bm=64,tma=0", "bm=64,stages=3"])
@pytest.mark.parametrize("s", [7, 1000, 4096])
def test_overlap_matches_plain_exactly(new_layers, model, cfg, s):
    """overlap=1 runs the same wgmma sequence per tile (k stages in order) and the same epilogue and combine
    arithmetic as overlap=0: the same bits, whatever CTA ran which task (its tail rows' mma.sync too: test_tail_rows)."""
    x = _x(s, model.hidden, seed=1100 + s)
    idx, w = _routing(s, model.experts, model.topk, "zipf", seed=s)
    a = new_layers("overlap=0," + cfg).forward_routed(x, idx, w, out=_poisoned(s, model.hidden)).clone()
    b = new_layers("overlap=1," + cfg).forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    torch.cuda.synchronize()
    new_layers("overlap=1," + cfg).check()
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def _tail_routing(s: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing whose first five slots give experts 0..11 the row counts below (an expert's rows all in one slot, each
    slot's experts its own, so a token's picks stay distinct); slots 5.. pick among experts 12.. at random."""
    cols = [[(0, 129), (1, 144), (2, s - 273)], [(3, 145), (4, 128), (5, s - 273)], [(6, 257), (7, s - 257)],
            [(8, 272), (9, s - 272)], [(10, 273), (11, s - 273)]]
    idx = torch.empty(s, k, dtype=torch.int64)
    for j, col in enumerate(cols):
        idx[:, j] = torch.cat([torch.full((n,), e) for e, n in col])
    g = torch.Generator().manual_seed(seed)
    idx[:, 5:] = 12 + torch.rand(s, 116, generator=g).argsort(1)[:, : k - 5]
    w = torch.rand(s, k, generator=g)
    return idx.cuda(), (w / w.sum(1, keepdim=True)).cuda()


@pytest.mark.parametrize("cfg", ["bm=128,bn=256", "bm=128,bn=256,tail_rows=1"])
def test_tail_rows(new_layers, model, cfg):
    """An expert's last rows past a multiple of 128 (up to tail_rows) ride in its last full m-tile on mma.sync: experts
    of 129, 144, 145, 128, 257, 272 and 273 rows. Reference within 1e-2 and the kernel's m-tile count the plan's (in
    _check); the same bits as tail_rows=0 and run to run."""
    from moetune.runtime.megakernel import _lib, schedule

    s = 300
    m, ref = new_layers(cfg), new_layers("bm=128,bn=256,tail_rows=0")
    assert m.config.tail(128, 256) == (1 if "tail_rows=1" in cfg else 16) and ref.config.tail(128, 256) == 0
    x = _x(s, model.hidden, seed=1900)
    idx, w = _tail_routing(s, model.topk, seed=1901)
    out = m.forward_routed(x, idx, w, out=_poisoned(s, model.hidden)).clone()
    _check(m, model, x, out, idx, w)
    base = ref.forward_routed(x, idx, w, out=_poisoned(s, model.hidden)).clone()
    again = m.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    torch.cuda.synchronize()
    m.check()
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "not bit-identical across runs"
    tail = m.config.tail(128, 256)
    p = schedule.plan(idx.tolist(), experts=model.experts, hidden=model.hidden, intermediate=model.intermediate,
                      bm=128, combine_tokens=m.config.combine_tile(128, 256, s, model.topk, model.experts), bn=256,
                      tail=tail)
    tails = {e: len(p.tile_rows(e, mt)) - 128 for e in range(model.experts)
             for mt in range(p.tile_base[e + 1] - p.tile_base[e]) if len(p.tile_rows(e, mt)) > 128}
    assert tails == ({0: 1, 1: 16, 6: 1, 8: 16} if tail == 16 else {0: 1, 6: 1})
    counts = m.counts[::_lib.COUNT_STRIDE].tolist()
    assert all(counts[e] % 128 == n for e, n in tails.items())
    # mma.sync m16n8k16 adds each k16 step's products into the fp32 accumulator as wgmma does: the same bits (run 123),
    # so which rows ride in a tail (the routing atomics' list order) never shows in the output
    assert torch.equal(out.view(torch.int16), base.view(torch.int16))


def _both_topk_kernels(spec: str, s: int, max_tokens: int, seed: int):
    """One layer of shape `spec` routing with k_topk (route_small_max=0) and one with k_topk_small (4096) on the same
    weights, each run on the same S tokens: (model, x, a, b, (ya, ia, wa), (yb, ib, wb)), a's output poisoned first."""
    need_megakernel_gpu()
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.shapes import get_model

    m = get_model(spec)
    x = _x(s, m.hidden, seed=seed)
    a = MegakernelMoE(m, max_tokens=max_tokens, seed=0, config=MegakernelConfig.parse("route_small_max=0"))
    b = MegakernelMoE(m, max_tokens=max_tokens, config=MegakernelConfig.parse("route_small_max=4096"),
                      w_gate_up=a.w_gate_up, w_down=a.w_down, gate=a.gate)
    ya = a.forward(x, out=_poisoned(s, m.hidden)).clone()
    ia, wa = (t.clone() for t in a.routing(s))
    yb = b.forward(x)
    ib, wb = b.routing(s)
    torch.cuda.synchronize()
    return m, x, a, b, (ya, ia, wa), (yb, ib, wb)


@pytest.mark.parametrize("s", [1, 7, 200, 255])
def test_small_topk_is_k_topks_bits(s):
    """k_topk_small (one block per token, rank selection; S <= route_small_max) against k_topk (one warp per
    token; route_small_max=0): the same experts in the same order and the same weights, bit for bit, and the
    same layer output. On a hidden size that is not a multiple of 512 (128 experts, top-8), where routing is these
    two kernels at every S; on the Qwen3 shape from S=8 it is k_route's (test_cluster_routing)."""
    m, x, a, b, (ya, ia, wa), (yb, ib, wb) = _both_topk_kernels("custom:768,256,128,8", s, 256, seed=1300 + s)
    assert torch.equal(ia, ib) and torch.equal(wa.view(torch.int32), wb.view(torch.int32)), f"S={s}"
    assert torch.equal(ya.view(torch.int16), yb.view(torch.int16))
    _check(a, m, x, ya, ia, wa)
    a.check()
    b.check()


@pytest.mark.parametrize("spec", ["custom:256,128,16,4", "custom:256,128,40,6", "custom:256,128,256,8"])
def test_topk_other_expert_counts(spec):
    """k_topk is instantiated per experts-per-lane bound (E <= 32, 64, 128, 256, 512): for E = 16, 40 (not a
    multiple of 32) and 256 its picks and weights are k_topk_small's bits, torch's route's experts for >= 99% of
    the tokens, and the layer's output matches the dense reference."""
    from moetune.runtime.moe_layer import route
    from moetune.runtime.shapes import get_model

    s = 300
    m, x, a, b, (ya, ia, wa), (yb, ib, wb) = _both_topk_kernels(spec, s, s, seed=1600 + get_model(spec).experts)
    assert torch.equal(ia, ib) and torch.equal(wa.view(torch.int32), wb.view(torch.int32)), spec
    assert torch.equal(ya.view(torch.int16), yb.view(torch.int16))
    assert int(ia.min()) >= 0 and int(ia.max()) < m.experts
    ridx, _ = route(x, a.gate, m.topk)
    same = (ia.sort(1).values == ridx.sort(1).values).all(1)
    assert same.float().mean().item() >= 0.99
    _check(a, m, x, ya, ia, wa)
    b.check()


@pytest.mark.parametrize("spec", ["custom:256,128,128,8", "custom:256,128,256,8"])
def test_overlap_other_expert_counts(spec):
    """The wide tile's overlap kernel on a small shape with 128 and 256 experts (the Qwen3 tests run 128 only): the
    output matches the dense reference, every row is written (including the top-k-8 COMBINE's fast path), and the
    kernel counts the tasks the CPU model plans."""
    need_megakernel_gpu()
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.shapes import get_model

    m, s = get_model(spec), 2048
    layer = MegakernelMoE(m, max_tokens=s, seed=0, config=MegakernelConfig.parse("bm=128,bn=256"))
    x = _x(s, m.hidden, seed=1900 + m.experts)
    out = layer.forward(x, out=_poisoned(s, m.hidden))
    idx, w = (t.clone() for t in layer.routing(s))
    _check(layer, m, x, out, idx, w)


@pytest.mark.parametrize("cfg", ["decode=0", "decode=0,bm=16", "decode=0,bm=16,split_k1=2,split_k2=2",
                                 "decode=0,bm=64", "decode=0,bm=64,overlap=0", "decode=0,core=mma,bm=64",
                                 "decode=0,bm=128,bn=256"])
@pytest.mark.parametrize("spec", ["custom:1024,256,48,1", "custom:1024,256,96,2", "custom:384,192,40,2",
                                  "custom:1024,256,160,1"])
def test_task_graph_topk_1_2_and_other_expert_counts(spec, cfg):
    """The task graph at top-k 1 and 2 (the COMBINE's general loop, not the top-k-8 fast path; one or two rows per
    token in the readiness counts) and expert counts that are not powers of two, on every routing kernel: k_route
    (H % 512 == 0, E <= 128, S = 13 and 300), k_logits + k_topk (S = 3, S = 1290 > 1024, H = 384 at every S, and
    E = 160 > 128, where processors also wait for published GEMM1 words instead of computing them); H = 384 with
    I = 192 also has odd n-block counts (3 and 3) and I % 128 == 64. Other GPU tests run top-k 8 (the Qwen3 shape,
    the custom shapes) and top-k 2 only in the decode kernel. Each launch: the dense reference, every row written,
    the kernel's task counts as modelled; the gate picks as torch's routing, top-1 weights exactly 1. Then given
    routing: Zipf, and every token to experts 0..K-1 (at S = 1290 = 10 x 128 + 10 their last rows are a tail of 10
    in the wide tile's last m-tile)."""
    need_megakernel_gpu()
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.megakernel.config import limits_problem
    from moetune.runtime.moe_layer import route
    from moetune.runtime.shapes import get_model

    m, cap = get_model(spec), 1290
    config = MegakernelConfig.parse(cfg)
    why = limits_problem(m, cap, config)
    if why is not None:  # bn=256 or split_k2=2 on the 384 x 192 shape: refused on the host, as it should be
        pytest.skip(why)
    layer = MegakernelMoE(m, max_tokens=cap, seed=0, config=config)
    for s in (3, 13, 300, cap):
        assert layer.decode_grid(s) is None, (spec, cfg, s)  # the task graph, not the decode kernel
        x = _x(s, m.hidden, seed=5100 + s)
        out = layer.forward(x, out=_poisoned(s, m.hidden))
        idx, w = (t.clone() for t in layer.routing(s))
        _check(layer, m, x, out, idx, w)
        assert int(idx.min()) >= 0 and int(idx.max()) < m.experts, (spec, cfg, s)
        if m.topk == 1:
            assert torch.equal(w, torch.ones_like(w)), (spec, cfg, s)
        ridx, _ = route(x, layer.gate, m.topk)
        same = (idx.sort(1).values == ridx.sort(1).values).all(1)
        assert same.float().mean().item() >= 0.99, (spec, cfg, s)
        for mode in ("zipf", "one"):
            idx, w = _routing(s, m.experts, m.topk, mode, seed=5200 + s)
            out = layer.forward_routed(x, idx, w, out=_poisoned(s, m.hidden))
            _check(layer, m, x, out, idx, w)


@pytest.mark.parametrize("cfg", ["", "bm=16", "bm=16,combine_tokens=8", "bm=64", "bm=128", "bm=64,overlap=0",
                                 "bm=128,overlap=0,combine_tokens=8", "core=mma,bm=64", "bm=16,split_k1=3,split_k2=2"])
@pytest.mark.parametrize("spec", ["custom:384,256,64,8", "custom:1152,256,64,8"])
def test_combine_hidden_odd_multiple_of_128(spec, cfg):
    """Top-k 8 on hidden sizes that are odd multiples of 128 (chunks = H/32 of a column block not a multiple of 8): a
    128-byte y line there may straddle two column blocks' COMBINE tasks or two rounds of one warp, and the combine's
    L2 discard (MK_Y_L2 bit 2) must leave it alone (schedule.combine_discards: a straddling line discarded could leave
    its other reader undefined bytes). Two inputs in turn, then the first again: each
    within 1e-2 of the dense reference, every row written, and the repeat the first run's bits."""
    need_megakernel_gpu()
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.shapes import get_model

    m = get_model(spec)
    layer = MegakernelMoE(m, max_tokens=1000, seed=0, config=MegakernelConfig.parse(cfg))
    for s in (13, 300, 1000):
        assert layer.decode_grid(s) is None, (spec, cfg, s)  # the task graph's COMBINE, not the decode kernel
        xa, xb = _x(s, m.hidden, seed=4100 + s), _x(s, m.hidden, seed=4200 + s)
        outs = []
        for x in (xa, xb, xa):
            out = layer.forward(x, out=_poisoned(s, m.hidden))
            idx, w = (t.clone() for t in layer.routing(s))
            _check(layer, m, x, out, idx, w)
            outs.append(out.clone())
        assert torch.equal(outs[0].view(torch.int16), outs[2].view(torch.int16)), (spec, cfg, s)
        idx, w = _routing(s, m.experts, m.topk, "zipf", seed=s)
        out = layer.forward_routed(xb, idx, w, out=_poisoned(s, m.hidden))
        _check(layer, m, xb, out, idx, w)


@pytest.mark.parametrize(("cfg", "s"), [("", 1), ("", 7), ("", 128), ("", 300), ("split_k1=1,split_k2=1", 1),
                                        ("tma=0", 7), ("core=mma,bm=64", 1000)])
def test_publish_all_matches_plain_exactly(new_layers, model, cfg, s):
    """publish_all changes who waits for a task's inputs, not the task's arithmetic: the same bits as publish_all=0."""
    x = _x(s, model.hidden, seed=1400 + s)
    idx, w = _routing(s, model.experts, model.topk, "zipf", seed=s)
    a = new_layers(f"publish_all=0,{cfg}").forward_routed(x, idx, w, out=_poisoned(s, model.hidden)).clone()
    m = new_layers(f"publish_all=1,{cfg}")
    b = m.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    torch.cuda.synchronize()
    m.check()
    assert m.counters()["published"] == m.counters()["total"]
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(("cfg", "s"), [("decode=0", 1), ("publish_all=1,decode=0", 1), ("", 128), ("", 1000),
                                        ("", 2048)])
def test_task_timeline(new_layers, model, cfg, s):
    """Every executed task carries its stamps (published <= done, claimed <= done), the kinds add up to the
    kernel's own total, and a traced forward leaves the layer's output unchanged."""
    m = new_layers(cfg or "publish_all=0")
    x = _x(s, model.hidden, seed=1500 + s)
    ref = m.forward(x).clone()
    tl = m.task_timeline(x)
    tasks = tl["tasks"]
    assert len(tasks) == m.counters()["total"] > 0
    for t in tasks:
        assert None not in (t["published"], t["claimed"], t["done"]), t
        assert t["claimed"] <= t["done"] + 1e-3, t
        if not cfg.startswith("publish_all=1"):  # publish_all: processors derive their tasks without waiting for the publish
            assert t["published"] <= t["done"] + 1e-3, t
        assert 1 <= t["cta"] < tl["grid"]
    assert {t["kind"] for t in tasks} == {"gemm1", "gemm2", "combine"}
    assert all(c[0] is not None and c[1] is not None and c[0] <= c[1] for c in tl["ctas"])
    # each GEMM's m-tile rows: 1..bm, and per (kind, n-field) an expert's m-tiles add up to its routed rows
    idx, _ = m.routing(s)
    routed = torch.bincount(idx.flatten().long(), minlength=model.experts).tolist()
    per: dict[tuple[str, int, int], int] = {}
    bm = tl["bm"]
    tail = m.config.tail(bm, m.config.pick_bn(bm))
    assert tail == (16 if s >= 1000 else 0)  # (the wide tile by TMA on the overlap kernel: S=1000, 2048 here)
    if s == 2048:  # at ~128 +- 11 rows per expert some experts' last rows ride in their full m-tile (run 123: 50)
        assert any(t["rows"] > bm for t in tasks if t["kind"] != "combine")
    for t in tasks:
        if t["kind"] != "combine":
            assert 1 <= t["rows"] <= bm + tail, t
            key = (t["kind"], t["nfield"], t["expert"])
            if t["parts"] == 1:
                per[key] = per.get(key, 0) + t["rows"]
    assert per and all(v == routed[e] for (_, _, e), v in per.items())
    torch.testing.assert_close(m.forward(x), ref, rtol=0, atol=0)


def test_decode_stages_fit_one_wave(new_layers, model):
    """Auto stages for decode: 6 while the GEMM1 tasks (split parts included) fit the processors of the 6-stage grid,
    4 once they do not, and a set `stages` always wins. With 2 + 2 split parts: S=1 8 rows x 12 n-blocks x 2 = 192
    fit, S=2 384 do not; without split-K (the default since run 40) S=2's 192 fit."""
    m = new_layers("split_k1=2,split_k2=2,decode=0")
    assert m.stages_for(16, 1) == 6 and m.stages_for(16, 2) == 4 and m.stages_for(16, 16) == 3
    assert new_layers("stages=6,split_k1=2,split_k2=2").stages_for(16, 2) == 6
    assert new_layers("").stages_for(16, 2) == 6
    for s in (1, 2, 3):
        x = _x(s, model.hidden, seed=1700 + s)
        idx, w = _routing(s, model.experts, model.topk, "uniform", seed=s)
        out = m.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
        _check(m, model, x, out, idx, w)


def _forward_pair(a, b, x):
    """One eager forward of layers a and b on the same x (outputs poisoned first), both checked for kernel errors."""
    s, hidden = x.shape
    ya = a.forward(x, out=_poisoned(s, hidden)).clone()
    yb = b.forward(x, out=_poisoned(s, hidden)).clone()
    torch.cuda.synchronize()
    a.check()
    b.check()
    return ya, yb


@pytest.mark.parametrize("cfg", ["pdl=1", "pdl=1,route_small_max=256", "pdl=1,overlap=0", "pdl=1,core=mma,bm=64",
                                 "pdl=1,bm=128,bn=256"])
@pytest.mark.parametrize("s", [1, 16, 128, 1000, 4096])
def test_pdl_same_bits(new_layers, model, cfg, s):
    """Programmatic dependent launch changes when kernels start, not what they compute: the same routing and output
    bits as plain stream order, eagerly and from a CUDA graph; and a forward with given routing (k_lists before the
    persistent kernel) too."""
    a, b = new_layers(cfg), new_layers(cfg.replace("pdl=1", "pdl=0"))
    x = _x(s, model.hidden, seed=2300 + s)
    ya, yb = _forward_pair(a, b, x)
    assert torch.equal(a.routing(s)[0], b.routing(s)[0])
    assert torch.equal(ya.view(torch.int16), yb.view(torch.int16))
    idx, w = _routing(s, model.experts, model.topk, "zipf", seed=s)
    ga = a.forward_routed(x, idx, w, out=_poisoned(s, model.hidden)).clone()
    gb = b.forward_routed(x, idx, w, out=_poisoned(s, model.hidden))
    torch.cuda.synchronize()
    a.check()
    assert torch.equal(ga.view(torch.int16), gb.view(torch.int16))
    _graph_replays(a, model, s, 30)


@pytest.mark.parametrize("s", [1, 16, 128, 1000, 4096])
def test_l2_evict_weights_same_bits(new_layers, model, s):
    """The weight tiles' L2 policy changes what stays cached, not what is computed: evict-first at every S and the
    default policy give the same output bits, eagerly and from a CUDA graph."""
    a, b = new_layers("l2_evict_weights=1"), new_layers("l2_evict_weights=0")
    x = _x(s, model.hidden, seed=2700 + s)
    ya, yb = _forward_pair(a, b, x)
    idx, w = a.routing(s)
    _check(a, model, x, ya, idx.clone(), w.clone())
    assert torch.equal(ya.view(torch.int16), yb.view(torch.int16))
    _graph_replays(a, model, s, 30)


# ---- the decode kernel (csrc/megakernel/mk_decode.cuh): S x topk routed rows whose W_down rows fit each CTA -----------
def test_decode_runs_where_it_fits(new_layers, model):
    """On the Qwen3-30B shape one token fits (8 slots x 16 rows x 768 x 2 bytes per CTA), two do not; decode=0 never."""
    m = new_layers("")
    grid, rows = m.decode_grid(1)
    assert grid == torch.cuda.get_device_properties(0).multi_processor_count and rows == -(-model.hidden // grid)
    assert m.decode_grid(2) is None and m.decode_grid(0) is None
    assert new_layers("decode=0").decode_grid(1) is None
    from moetune.tuner.measure.moe import decode_kernel_takes

    # what the tuner asks before searching a size (no layer built): the library's answer, as the layer's
    assert decode_kernel_takes(model, 1) and not decode_kernel_takes(model, 2)
    x = _x(1, model.hidden, seed=3000)
    with pytest.raises(ValueError, match="decode kernel"):
        m.task_timeline(x)
    ref = m.forward(x).clone()
    tl = m.decode_timeline(x)  # every CTA's phases in order; the rows' owners also wait for W_down and the slots
    assert tl["grid"] == grid and len(tl["ctas"]) == grid
    for c, st in enumerate(tl["ctas"]):
        owner = c * rows < model.hidden
        order = ["start", "routed", "phase1", "signalled"] + (["ready", "h_loaded", "summed"] if owner else [])
        times = [st[n] for n in [*order, "end"]]
        assert None not in times and times == sorted(times), (c, st)
        # the copies land after the picks and before the sums (stamped by thread 0 after its own pairs)
        assert (st["w_down"] is not None and st["routed"] <= st["w_down"] <= st["ready"]) if owner else st["w_down"] is None
        # routing in the kernel (decode=2): every logit written between the start and the picks
        assert st["logits"] is None or st["start"] <= st["logits"] <= st["routed"], (c, st)
    torch.testing.assert_close(m.forward(x), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not run the decode kernel"):
        m.decode_timeline(_x(2, model.hidden, seed=3001))


@pytest.mark.parametrize("mode", ["gate", "uniform", "zipf", "one"])
def test_decode_matches_reference_and_task_graph(new_layers, model, mode):
    """Against the fp32 reference (every row written: the output is poisoned), bit-identical across runs and CUDA
    graph replays, and close to the task graph's output for the same routing (different summation orders)."""
    from moetune.runtime.moe_layer import max_rel_err

    m, tg = new_layers(""), new_layers("decode=0")
    for seed in range(3):
        x = _x(1, model.hidden, seed=3100 + seed)
        if mode == "gate":
            out = m.forward(x, out=_poisoned(1, model.hidden))
            idx, w = (t.clone() for t in m.routing(1))
        else:
            idx, w = _routing(1, model.experts, model.topk, mode, seed=seed)
            out = m.forward_routed(x, idx, w, out=_poisoned(1, model.hidden))
        _check(m, model, x, out, idx, w)
        first = out.clone()
        again = m.forward_routed(x, idx, w, out=_poisoned(1, model.hidden))
        ref = tg.forward_routed(x, idx, w, out=_poisoned(1, model.hidden))
        torch.cuda.synchronize()
        tg.check()
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))
        assert max_rel_err(first, ref.float()) <= 1e-2
    _graph_replays(m, model, 1, 100)


def test_decode_stalled_slot_times_out(model, layer):
    """A slot whose up projection never completes (test hook): the decode launch ends after the timeout with the error
    recorded, and the layer recovers."""
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelError, MegakernelMoE

    m = MegakernelMoE(model, max_tokens=4, config=MegakernelConfig.parse("timeout_ms=100"), w_gate_up=layer.w_gate_up,
                      w_down=layer.w_down, gate=layer.gate)
    assert m.decode_grid(1) is not None
    x = _x(1, model.hidden, seed=3200)
    m.stall_tile = 3
    t0 = time.monotonic()
    m.forward(x)
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 10.0
    with pytest.raises(MegakernelError, match="timed out"):
        m.check()
    rec = m.error()
    assert rec is not None and rec[2][1] == 3 and rec[2][3] >= 100_000_000
    # the launch's abort was its own (its flag lifted by its last CTA): the next decode launch computes before the
    # record is cleared, and the record still names the stalled slot
    from moetune.runtime.megakernel import _lib
    from moetune.runtime.moe_layer import dense_reference, max_rel_err

    assert int(m.dec_cnt[_lib.DEC_ABORT]) == 0
    m.stall_tile = -1
    idx, w = _routing(1, model.experts, model.topk, "uniform", seed=4)
    out = m.forward_routed(x, idx, w, out=_poisoned(1, model.hidden))
    torch.cuda.synchronize()
    ref = dense_reference(x, model, seed=0, topk_idx=idx, topk_weights=w)
    assert torch.isfinite(out.float()).all() and max_rel_err(out, ref) <= 1e-2
    assert m.error()[2][1] == 3
    m.clear_error()
    idx, w = _routing(1, model.experts, model.topk, "uniform", seed=5)
    out = m.forward_routed(x, idx, w, out=_poisoned(1, model.hidden))
    _check(m, model, x, out, idx, w)


def test_decode_bad_expert_is_reported(model, layer):
    """Given routing naming an expert out of range: the error is recorded (as k_lists does for the task graph)."""
    from moetune.runtime.megakernel import MegakernelError, MegakernelMoE

    m = MegakernelMoE(model, max_tokens=1, w_gate_up=layer.w_gate_up, w_down=layer.w_down, gate=layer.gate)
    idx, w = _routing(1, model.experts, model.topk, "uniform", seed=6)
    idx[0, 2] = model.experts
    with pytest.raises(ValueError, match="out of range"):  # the host check by default
        m.forward_routed(_x(1, model.hidden, seed=3300), idx, w)
    m.forward_routed(_x(1, model.hidden, seed=3300), idx, w, check_ids=False)  # the kernel's own record
    torch.cuda.synchronize()
    with pytest.raises(MegakernelError, match="out of range"):
        m.check()
    m.clear_error()  # nothing read out of bounds: the context still works
    idx[0, 2] = 0 if int(idx[0].min()) > 0 else int(idx[0].max()) + 1
    x = _x(1, model.hidden, seed=3301)
    out = m.forward_routed(x, idx, w, out=_poisoned(1, model.hidden))
    _check(m, model, x, out, idx, w)


def test_decode_after_an_earlier_launchs_error(model, layer):
    """An error in an earlier launch, not cleared: forward_routed(check_ids=False) at a prefill size (the task graph)
    with an expert id out of range, which k_lists records and aborts after k_reset ran, leaving ctl's abort flag
    raised. The decode kernel polls its own flag: a later decode launch (no reset kernel before it) polling ctl's
    would give up each CTA's logit waits at once (routing from NaN for the logits not yet written) and its slot waits
    too (sums of h never completed): wrong outputs, silently, until clear_error. The S=1 forwards after it, routing
    in the kernel (decode=2) and given picks (decode=1), match the reference, while check() still raises the first
    error, unchanged, until clear_error."""
    from moetune.runtime.megakernel import MegakernelError, MegakernelMoE, _lib
    from moetune.runtime.megakernel.layer import CTL_ABORT
    from moetune.runtime.moe_layer import dense_reference, max_rel_err

    s, h, k, n_exp = 64, model.hidden, model.topk, model.experts
    m = MegakernelMoE(model, max_tokens=s, w_gate_up=layer.w1t, w_down=layer.w2t, gate=layer.gate, tiled=True)
    assert m.decode_grid(s) is None and m.decode_grid(1) is not None
    x = _x(s, h, seed=3900)
    idx, w = _routing(s, n_exp, k, "uniform", seed=3900)
    idx[5, 2] = n_exp
    m.forward_routed(x, idx, w, check_ids=False)
    torch.cuda.synchronize()
    assert int(m.ctl[CTL_ABORT]) == 1  # the task graph's flag, left raised (its next routing lifts it)

    def first_error():
        with pytest.raises(MegakernelError, match="megakernel error 4: routing names an expert out of range"):
            m.check()
        code, _, rec = m.error()
        assert (code, rec[1], rec[2]) == (4, 5 * k + 2, n_exp), rec

    first_error()
    for n in range(3):
        x1 = _x(1, h, seed=3910 + n)
        out = m.forward(x1, out=_poisoned(1, h))  # decode = 2: routing in the kernel
        gi, gw = (t.clone() for t in m.routing(1))
        torch.cuda.synchronize()
        assert int(gi.min()) >= 0 and int(gi.max()) < n_exp
        # the gate's top-k (up to near-ties: fp32 sums in another order), with its renormalised softmax weights
        logits = x1.float() @ m.gate.float().t()
        picked = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, gi, True)
        assert logits[picked].min() >= logits[~picked].max() - 1e-3
        p = torch.softmax(logits, 1).gather(1, gi)
        assert torch.allclose(gw, p / p.sum(1, keepdim=True), atol=1e-5, rtol=1e-4)
        ref = dense_reference(x1, model, seed=0, topk_idx=gi, topk_weights=gw)
        assert torch.isfinite(out.float()).all() and max_rel_err(out, ref) <= 1e-2
        idx1, w1 = _routing(1, n_exp, k, "zipf", seed=3920 + n)
        out = m.forward_routed(x1, idx1, w1, out=_poisoned(1, h))  # decode = 1: given picks
        torch.cuda.synchronize()
        ref = dense_reference(x1, model, seed=0, topk_idx=idx1, topk_weights=w1)
        assert torch.isfinite(out.float()).all() and max_rel_err(out, ref) <= 1e-2
        assert int(m.dec_cnt[_lib.DEC_ABORT]) == 0
        assert int(m.ctl[CTL_ABORT]) == 1  # still raised: these launches ran with it and did not read it
        first_error()  # sticky: the decode launches neither clear nor replace it
    m.clear_error()
    assert m.error() is None


def test_repeated_expert_rows_past_the_list_are_dropped_and_reported(model, layer):
    """Given routing whose picks repeat an expert, unchecked (check_ids=False: MoELayer's own check; or captured into
    a CUDA graph, where the host check cannot run): every pick of 64 tokens names one expert, S * topk = 512 rows for
    a list of max_tokens = 64. Rows 64.. must never be written past the expert's list (into the next experts'
    lists, past the buffer for the last expert): they are dropped and recorded (code 7) and that launch is aborted
    (its outputs are not checked: none is valid), the count stops at max_tokens, the other lists are untouched, and
    the layer's later launches compute."""
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelError, MegakernelMoE

    s, k, n_exp = 64, model.topk, model.experts
    m = MegakernelMoE(model, max_tokens=s, config=MegakernelConfig.parse("decode=0"), w_gate_up=layer.w1t,
                      w_down=layer.w2t, gate=layer.gate, tiled=True)
    x = _x(s, model.hidden, seed=3600)
    w = torch.full((s, k), 1.0 / k, device="cuda")
    for e in (0, n_exp - 1):
        idx = torch.full((s, k), e, dtype=torch.int64, device="cuda")
        with pytest.raises(ValueError, match=f"topk_idx row 0 picks expert {e} more than once"):  # the host check
            m.forward_routed(x, idx, w)
        m.lists.fill_(-7)
        m.forward_routed(x, idx, w, check_ids=False)
        torch.cuda.synchronize()
        with pytest.raises(MegakernelError, match="error 7: an expert got more than max_tokens rows"):
            m.check()
        rec = m.error()
        assert rec is not None and rec[2][2] == e and 0 <= rec[2][1] < s * k  # detail = the expert, where = a row
        counts = m.counts.view(n_exp, -1)[:, 0].tolist()
        assert counts[e] == s and sum(counts) == s  # stopped at max_tokens
        rows = m.lists[e].tolist()
        assert len(set(rows)) == s and all(0 <= r < s * k for r in rows)  # each place written once, with a row
        others = torch.cat([m.lists[:e], m.lists[e + 1:]])
        assert (others == -7).all(), "a row written into another expert's list"
        m.clear_error()
    # captured: the host check is skipped while capturing, the kernel's record is what remains
    idx = torch.zeros(s, k, dtype=torch.int64, device="cuda")
    good, gw = _routing(s, n_exp, k, "uniform", seed=3601)
    m.forward_routed(x, good, gw)  # warm the launch caches before capturing
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        m.forward_routed(x, idx, w)
    g.replay()
    torch.cuda.synchronize()
    with pytest.raises(MegakernelError, match="error 7"):
        m.check()
    m.clear_error()
    # nothing beyond the lists was overwritten: the layer and the shared weights still give the reference's output
    for seed in (3602, 3603):
        x2 = _x(s, model.hidden, seed=seed)
        idx2, w2 = _routing(s, n_exp, k, "zipf", seed=seed)
        out = m.forward_routed(x2, idx2, w2, out=_poisoned(s, model.hidden))
        _check(m, model, x2, out, idx2, w2)
    out = layer.forward_routed(x2, idx2, w2, out=_poisoned(s, model.hidden))
    _check(layer, model, x2, out, idx2, w2)


# (shape, config, S, the routing kernel that runs): the decode kernel's own routing at S=1; k_logits + k_topk (S=1
# with decode=0; S=128 where H is not a multiple of 512, so k_route cannot run); k_route (S=128 on Qwen3);
# k_topk_small (route_small_max)
NONFINITE_CASES = [("qwen3-30b", "", 1, "decode"), ("qwen3-30b", "decode=0", 1, "k_topk"),
                   ("qwen3-30b", "", 128, "k_route"), ("qwen3-30b", "route_small_max=4096", 128, "k_topk_small"),
                   ("custom:768,256,128,8", "", 128, "k_topk")]


@pytest.mark.parametrize(("spec", "cfg", "s", "kernel"), NONFINITE_CASES, ids=[f"{c[3]}-S{c[2]}" for c in NONFINITE_CASES])
def test_nonfinite_logits_are_reported_never_a_fault(model, layer, spec, cfg, s, kernel):
    """x rows holding a NaN, +inf or -inf make those tokens' gate logits non-finite: every probability NaN, no
    expert ever compares greater, and left as they come every pick is out of range (1 << 30, or a padding lane past
    E), so the routing kernels would append at lists[2^30 S_cap] (an illegal address: the CUDA context lost) and the
    decode kernel read weights past W. Checked: check() raises error 8 naming a bad token row (detail = its lowest
    non-finite expert: 0, every logit of such a row is NaN / inf); the bad tokens take experts 0..topk-1 with NaN
    weights and NaN output rows; every other
    token's routing is distinct in-range experts, its list rows exact, its output row the reference's (recorded
    without the abort: the launch computed them); the next forward, before and after clear_error, is right."""
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelError, MegakernelMoE
    from moetune.runtime.moe_layer import dense_reference, max_rel_err
    from moetune.runtime.shapes import get_model

    need_megakernel_gpu()
    if spec == "qwen3-30b":
        m_shape = model
        m = MegakernelMoE(model, max_tokens=s, config=MegakernelConfig.parse(cfg), w_gate_up=layer.w1t,
                          w_down=layer.w2t, gate=layer.gate, tiled=True)
    else:
        m_shape = get_model(spec)
        m = MegakernelMoE(m_shape, max_tokens=s, seed=0, config=MegakernelConfig.parse(cfg))
    assert (m.decode_grid(s) is not None) == (kernel == "decode")
    h, k, n_exp = m_shape.hidden, m_shape.topk, m_shape.experts
    cases = [{0: float("nan")}, {0: float("inf")}] if s == 1 else [{3: float("nan"), 77: float("inf"), 100: -float("inf")}]
    for n, bad in enumerate(cases):
        x = _x(s, h, seed=3700 + n)
        for t, v in bad.items():
            x[t, (37 * t) % h] = v
        out = m.forward(x, out=_poisoned(s, h)).clone()
        torch.cuda.synchronize()  # a fault would raise here (and every CUDA call after it)
        with pytest.raises(MegakernelError, match="megakernel error 8: non-finite gate logits"):
            m.check()
        code, _, rec = m.error()
        assert code == 8 and rec[1] in bad and rec[2] == 0, rec
        idx, w = (t.clone() for t in m.routing(s))
        assert int(idx.min()) >= 0 and int(idx.max()) < n_exp
        assert (idx.sort(1).values.diff(dim=1) > 0).all(), "an expert picked twice for one token"
        rows = sorted(bad)
        good = [t for t in range(s) if t not in bad]
        assert (idx[rows] == torch.arange(k, device="cuda")).all() and torch.isnan(w[rows]).all()
        assert not torch.isfinite(out[rows].float()).any()
        if m.decode_grid(s) is None:  # the task graph's lists: exactly the (token, slot) rows routed to each expert
            counts = m.counts.view(n_exp, -1)[:, 0].tolist()
            flat = idx.flatten().tolist()
            for e in range(n_exp):
                assert sorted(m.lists[e, :counts[e]].tolist()) == [r for r, y in enumerate(flat) if y == e], e
        if good:
            assert torch.isfinite(w[good]).all() and torch.isfinite(out[good].float()).all()
            ref = dense_reference(x[good], m_shape, seed=0, topk_idx=idx[good], topk_weights=w[good])
            assert max_rel_err(out[good], ref) <= 1e-2
        # not aborted: the next forward computes before the record is cleared, and after
        x2 = _x(s, h, seed=3750 + n)
        out2 = m.forward(x2, out=_poisoned(s, h))
        idx2, w2 = (t.clone() for t in m.routing(s))
        torch.cuda.synchronize()
        ref2 = dense_reference(x2, m_shape, seed=0, topk_idx=idx2, topk_weights=w2)
        assert torch.isfinite(out2.float()).all() and max_rel_err(out2, ref2) <= 1e-2
        with pytest.raises(MegakernelError, match="error 8"):  # sticky until cleared
            m.check()
        m.clear_error()
        out3 = m.forward(x2, out=_poisoned(s, h))
        _check(m, m_shape, x2, out3, *(t.clone() for t in m.routing(s)))


def test_decode_sizes_in_any_order():
    """Decode launches of different sizes on one layer, the larger after the smaller and back: each launch's shared
    memory fits the kernel's limit (raised once to the most; run 94: raising it to each launch's size in turn failed
    a larger launch that came after a smaller one with "invalid argument")."""
    need_megakernel_gpu()
    from moetune.runtime.megakernel import MegakernelMoE
    from moetune.runtime.shapes import get_model

    m = get_model("custom:256,128,16,4")
    layer = MegakernelMoE(m, max_tokens=7, seed=0)
    for s in (7, 1, 7, 2, 1):
        assert layer.decode_grid(s) is not None, s
        x = _x(s, m.hidden, seed=3500 + s)
        out = layer.forward(x, out=_poisoned(s, m.hidden))
        idx, w = (t.clone() for t in layer.routing(s))
        _check(layer, m, x, out, idx, w)


@pytest.mark.parametrize(("spec", "tokens"), [("custom:256,128,16,4", [1, 2, 7]), ("custom:512,192,40,6", [1, 3]),
                                              ("custom:1024,256,64,2", [1, 5]), ("custom:256,128,256,4", [1, 2])])
def test_decode_other_shapes(spec, tokens):
    """Other shapes, several tokens per launch (slots of different tokens, experts shared between tokens): the dense
    reference, every row written, the kernel's task counts as modelled, the in-kernel picks as torch's routing."""
    need_megakernel_gpu()
    from moetune.runtime.megakernel import MegakernelMoE
    from moetune.runtime.moe_layer import route
    from moetune.runtime.shapes import get_model

    m = get_model(spec)
    layer = MegakernelMoE(m, max_tokens=max(tokens), seed=0)
    for s in tokens:
        assert layer.decode_grid(s) is not None, (spec, s)
        x = _x(s, m.hidden, seed=3400 + s)
        out = layer.forward(x, out=_poisoned(s, m.hidden))
        idx, w = (t.clone() for t in layer.routing(s))
        _check(layer, m, x, out, idx, w)
        ridx, rw = route(x, layer.gate, m.topk)  # the in-kernel picks against torch's routing (fp32 logits)
        assert (idx.long().sort(1).values == ridx.sort(1).values).all(), (spec, s)
        assert torch.allclose(w.sort(1).values, rw.float().sort(1).values, atol=1e-5, rtol=1e-4), (spec, s)
        idx, w = _routing(s, m.experts, m.topk, "zipf", seed=s)
        out = layer.forward_routed(x, idx, w, out=_poisoned(s, m.hidden))
        _check(layer, m, x, out, idx, w)


# ~0.5-1 s of one SM spinning (torch.cuda._sleep counts clock cycles): long against any launch here
_SPIN_CYCLES = 2_000_000_000


def test_first_call_on_another_stream_waits_for_the_construction_stream(model, layer):
    """The first forward on a side stream waits for the work queued on the stream the layer was built on (its zeroed
    scratch; here a spin queued after it): the side stream cannot finish before that stream's spin does. Before, the
    layer remembered no stream until its first call and the side stream's launch ran at once."""
    from moetune.runtime.megakernel import MegakernelMoE

    built = torch.cuda.current_stream()
    m = MegakernelMoE(model, max_tokens=8, w_gate_up=layer.w1t, w_down=layer.w2t, gate=layer.gate, tiled=True)
    x = _x(8, model.hidden, seed=4100)
    torch.cuda.synchronize()
    torch.cuda._sleep(_SPIN_CYCLES)
    spun = torch.cuda.Event()
    spun.record(built)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = m(x)
    side.synchronize()
    assert spun.query(), "the first call on another stream ran before the construction stream's queued work"
    torch.cuda.synchronize()
    m.check()
    assert torch.isfinite(out.float()).all()


def test_routing_waits_for_the_launch_on_another_stream(model, layer):
    """routing(s) on the default stream reads the picks the latest launch wrote on a side stream, after it: the
    given routing of that launch, not the previous forward's, and only once the side stream's spin before it ended."""
    from moetune.runtime.megakernel import MegakernelMoE

    s = 8
    m = MegakernelMoE(model, max_tokens=s, w_gate_up=layer.w1t, w_down=layer.w2t, gate=layer.gate, tiled=True)
    x = _x(s, model.hidden, seed=4200)
    idx, w = _routing(s, model.experts, model.topk, "uniform", seed=4200)
    m(x)  # routes from the gate on the default stream: other picks than idx
    torch.cuda.synchronize()
    assert not torch.equal(m.routing(s)[0].long(), idx)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(_SPIN_CYCLES)
        m.forward_routed(x, idx, w, check_ids=False)  # no host sync: the spin is still running when it returns
        done = torch.cuda.Event()
        done.record(side)
    got_idx, got_w = (t.clone() for t in m.routing(s))
    torch.cuda.current_stream().synchronize()
    assert done.query(), "routing() read before the launch on the side stream ended"
    assert torch.equal(got_idx, idx) and torch.allclose(got_w, w)
    torch.cuda.synchronize()


def test_tied_probabilities_route_as_torch_routes_them(model, layer):
    """A zero gate gives every expert the same probability: the kernels pick experts 0..topk-1 (the lower expert
    first), and moe_layer.route (a stable sort since it stopped using topk) the same, so the unfused engine and
    dense_reference agree with the megakernel on such tokens."""
    from moetune.runtime.megakernel import MegakernelMoE
    from moetune.runtime.moe_layer import dense_reference, max_rel_err, route

    for s in (1, 7):  # the decode kernel's routing and the routing kernels'
        m = MegakernelMoE(model, max_tokens=s, w_gate_up=layer.w1t, w_down=layer.w2t,
                          gate=torch.zeros_like(layer.gate), tiled=True)
        x = _x(s, model.hidden, seed=4300 + s)
        out = m(x)
        torch.cuda.synchronize()
        m.check()
        idx, w = (t.clone() for t in m.routing(s))
        ridx, rw = route(x, m.gate, model.topk)
        want = torch.arange(model.topk, device="cuda").expand(s, -1)
        assert torch.equal(idx.long(), want) and torch.equal(ridx, want), (s, idx, ridx)
        assert torch.allclose(w, rw, atol=1e-6)
        ref = dense_reference(x, model, seed=0, topk_idx=ridx, topk_weights=rw)
        assert max_rel_err(out, ref) <= 1e-2


def test_an_in_place_change_of_the_gate_is_seen_and_a_strided_gate_is_refused(model, layer):
    """The gate given at construction is read in place (row-major or k-tiled expert weights alike): a forward after
    an in-place change of it (a training step, load_state_dict into it) routes by the new gate, as a layer built with
    that gate does. A non-contiguous gate was copied once at construction, so such a change was not seen; it is
    refused now, naming the fix."""
    from moetune.runtime.megakernel import MegakernelMoE

    s = 7
    x = _x(s, model.hidden, seed=4400)
    for tiled in (False, True):
        w1, w2 = (layer.w1t, layer.w2t) if tiled else (layer.w_gate_up, layer.w_down)
        gate = layer.gate.clone()
        m = MegakernelMoE(model, max_tokens=s, w_gate_up=w1, w_down=w2, gate=gate, tiled=tiled)
        before = m(x).clone()
        gate.copy_(gate.flip(0))  # every token's experts change
        after = m(x)
        fresh = MegakernelMoE(model, max_tokens=s, w_gate_up=w1, w_down=w2, gate=gate.clone(), tiled=tiled)(x)
        torch.cuda.synchronize()
        m.check()
        assert not torch.equal(after, before) and torch.equal(after, fresh), tiled
        with pytest.raises(ValueError, match=r"gate must be contiguous \(it is read in place"):
            MegakernelMoE(model, max_tokens=s, w_gate_up=w1, w_down=w2, gate=gate.t().contiguous().t(), tiled=tiled)
