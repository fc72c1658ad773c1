"""CPU tests of the routing kernels' top-k order (runtime/megakernel/topk.py models csrc/megakernel/mk_moe.cu's
warp_topk and k_topk_small): finite probabilities pick exactly what the float compares picked (ties: the lower expert);
NaN probabilities (a NaN or +inf logit, or all -inf) still give K distinct experts in 0..E-1, and the launch records
the error code the layer names; -inf among finite logits routes as usual and records nothing. The GPU side:
tests/test_megakernel_gpu.py test_nonfinite_logits_*."""

from __future__ import annotations

import math
import random
import re

import pytest

from moetune.runtime.megakernel import topk

NAN, INF = math.nan, math.inf
SHAPES = [(16, 4), (40, 6), (64, 8), (128, 8), (128, 16), (256, 8), (512, 16), (1, 1), (33, 33)]


def _by_compares(p: list[float], k: int) -> list[int]:
    """warp_topk before the key: float compares, a lane's best starting at -2, lanes past E holding -1."""
    return topk.select_warp(p, k, key=float, pad=-1.0, none=-2.0)


def _probs(rng: random.Random, e: int, mode: str) -> list[float]:
    if mode == "random":
        return [topk.f32(rng.random()) for _ in range(e)]
    if mode == "ties":  # a handful of values, many experts on each (the lower index must go first)
        vals = [topk.f32(v) for v in (0.0, 1e-30, 0.125, 0.5, 0.5000001)]
        return [rng.choice(vals) for _ in range(e)]
    if mode == "zeros":  # underflowed probabilities: +0 for all but a few
        p = [0.0] * e
        for i in rng.sample(range(e), min(e, 3)):
            p[i] = topk.f32(rng.random())
        return p
    raise ValueError(mode)


@pytest.mark.parametrize(("e", "k"), SHAPES)
@pytest.mark.parametrize("mode", ["random", "ties", "zeros"])
def test_finite_picks_are_the_float_compares(e, k, mode):
    """The key changes nothing for numbers: warp_topk's rounds and k_topk_small's ranks pick what plain float
    compares pick, in the same order, and that is the (value desc, lower expert) sort."""
    rng = random.Random(e * 1000 + k)
    for _ in range(20):
        p = _probs(rng, e, mode)
        want = _by_compares(p, k)
        assert topk.select_warp(p, k) == want == topk.select_rank(p, k) == topk.select(p, k)
        assert len(set(want)) == k and all(0 <= x < e for x in want)


@pytest.mark.parametrize(("e", "k"), SHAPES)
def test_nan_probabilities_still_pick_k_distinct_experts(e, k):
    """All NaN (what a NaN or +inf logit, or all -inf, makes of a token): experts 0..K-1 in order, never out of range
    (the sentinel 1 << 30 where E is a multiple of 32, else the padding lanes past E). Mixed (never made by the softmax,
    the key orders it anyway): every number before every NaN, ties by index; never an expert past E."""
    assert topk.select_warp([NAN] * e, k) == list(range(k)) == topk.select_rank([NAN] * e, k)
    old = _by_compares([NAN] * e, k)
    assert all(x >= e for x in old), old  # the out-of-range picks the kernels wrote at
    rng = random.Random(e + k)
    for _ in range(20):
        p = [NAN if rng.random() < 0.5 else topk.f32(rng.choice([0.0, 0.25, rng.random()])) for _ in range(e)]
        got = topk.select_warp(p, k)
        assert got == topk.select_rank(p, k) == topk.select(p, k)
        assert len(set(got)) == k and all(0 <= x < e for x in got)
        numbers = [x for x in got if not math.isnan(p[x])]
        assert got[:len(numbers)] == numbers  # numbers first
        nans = got[len(numbers):]
        assert nans == sorted(x for x in range(e) if math.isnan(p[x]))[:len(nans)]


def test_key_order():
    """NaN below every number (+0 and the smallest denormal included), the padding key below NaN; numbers in float
    order; ord_val inverts ord_key and gives a NaN for the NaN key."""
    nums = [topk.f32(x) for x in (0.0, 1e-45, 1e-30, 0.125, 0.5, 1.0, 3e38, INF)]
    keys = [topk.pick_key(x) for x in nums]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert topk.PAD_KEY < topk.NAN_KEY == topk.pick_key(NAN) < keys[0]
    assert all(topk.ord_val(topk.ord_key(x)) == x for x in nums)
    assert math.isnan(topk.ord_val(topk.NAN_KEY)) and math.isnan(topk.ord_val(topk.PAD_KEY))


@pytest.mark.parametrize("e", [16, 40, 128])
def test_route_row_of_non_finite_logits(e):
    """Whole tokens: any NaN / +inf logit, or all -inf, gives experts 0..K-1 with NaN weights and names the lowest
    non-finite expert (a -inf beside a NaN included); -inf among finite logits routes as usual (those experts get 0)
    and is not named (error 8 would be raised for a launch whose outputs are all right); all-equal finite logits pick
    0..K-1 with weights 1/K."""
    k = 4
    rng = random.Random(e)
    base = [rng.gauss(0, 1) for _ in range(e)]
    for bad, val in ((3, NAN), (e - 1, INF), (0, -INF)):
        row = list(base)
        row[bad] = val
        row[bad + 1 if bad + 1 < e else 0] = val if val != -INF else row[bad + 1]
        idx, w, where = topk.route_row(row, k)
        assert len(set(idx)) == k and all(0 <= x < e for x in idx)
        if val == -INF:
            assert where == -1
            assert idx == topk.route_row([x if math.isfinite(x) else -1e30 for x in row], k)[0]
            assert all(math.isfinite(x) for x in w) and abs(sum(w) - 1) < 1e-6
        else:
            assert where == min(i for i, x in enumerate(row) if not math.isfinite(x))
            assert idx == list(range(k)) and all(math.isnan(x) for x in w)
    masked = list(base)  # -inf below a NaN: the token is broken, the lowest non-finite expert is the -inf one
    masked[1], masked[4] = -INF, NAN
    idx, w, where = topk.route_row(masked, k)
    assert (idx, where) == (list(range(k)), 1) and all(math.isnan(x) for x in w)
    masked[4] = INF
    assert topk.route_row(masked, k)[2] == 1
    idx, w, where = topk.route_row([-INF] * e, k)
    assert (idx, where) == (list(range(k)), 0) and all(math.isnan(x) for x in w)
    idx, w, where = topk.route_row([-INF] * (e - 1) + [2.0], k)  # one finite: it, then the zeros by index
    assert idx == [e - 1, 0, 1, 2] and w == [1.0, 0.0, 0.0, 0.0] and where == -1
    idx, w, where = topk.route_row([0.75] * e, k)
    assert (idx, where) == (list(range(k)), -1) and w == [0.25] * k


def test_route_row_matches_torch_route_on_finite_logits():
    """The model's fp32 softmax / top-k / renormalise against moe_layer.route (torch): the same experts in the same
    order and weights within 1e-6 for random logits (no exact ties)."""
    torch = pytest.importorskip("torch")
    from moetune.runtime.moe_layer import route

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 32, generator=g)
    wg = torch.randn(128, 32, generator=g)
    ridx, rw = route(x, wg, 8)
    logits = (x.float() @ wg.float().t()).tolist()
    for t in range(64):
        idx, w, bad = topk.route_row(logits[t], 8)
        assert bad == -1 and idx == ridx[t].tolist()
        assert max(abs(a - b) for a, b in zip(w, rw[t].tolist(), strict=True)) < 1e-6


@pytest.mark.parametrize(("e", "k"), [(128, 8), (4, 2), (33, 5), (512, 16)])
def test_torch_route_breaks_ties_as_the_kernels(e, k):
    """Before: moe_layer.route took torch's topk, whose order of equal probabilities is unspecified: a zero gate (every
    probability 1/E) routed each token to experts 84, 87, 86, ... on the CPU, where the kernels pick 0..k-1 (the
    lower expert first), so the unfused engine and dense_reference sent such tokens to other experts than the
    megakernel. Now route picks what `select` picks, ties included (and NaN rows: experts 0..k-1)."""
    torch = pytest.importorskip("torch")
    from moetune.runtime.moe_layer import route

    g = torch.Generator().manual_seed(e)
    x = torch.randn(6, 64, generator=g)
    rows = torch.randn(3, 64, generator=g)
    gates = [torch.zeros(e, 64),  # every probability equal
             rows[torch.randint(0, 3, (e,), generator=g)],  # three distinct logits, many experts on each
             torch.full((e, 64), math.nan)]  # NaN probabilities
    for wg in gates:
        idx, w = route(x, wg, k)
        probs = torch.softmax(x.float() @ wg.float().t(), dim=-1).tolist()
        for t in range(x.shape[0]):
            assert idx[t].tolist() == topk.select(probs[t], k), (t, probs[t][:8])
        assert idx.is_contiguous() and idx.dtype == torch.int64 and w.shape == (x.shape[0], k)



@pytest.mark.parametrize("k", [5, 9, -1])
def test_torch_route_refuses_a_topk_the_gate_cannot_give(k):
    """route() took torch's topk, which refused k past the gate's experts ("selected index k out of range"); its
    stable sort sliced [:, :k] instead: k=5 of 4 experts gave 4 picks, k=-1 gave 3, [S, k] neither, silently."""
    torch = pytest.importorskip("torch")
    from moetune.runtime.moe_layer import route

    x, wg = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"topk must be in 0\.\.4 \(the gate's experts\), got " + str(k)):
        route(x, wg, k)
    for ok in (0, 1, 4):  # what topk took, 0 included
        idx, w = route(x, wg, ok)
        assert idx.shape == w.shape == (3, ok)

def test_kernel_source_mirrors_the_model():
    """The constants the model mirrors, the error code and its name, and every routing kernel reporting it."""
    from moetune.runtime.megakernel import _lib
    from moetune.runtime.megakernel.layer import ERR_NAMES

    src = (_lib.source_dir() / "mk_moe.cu").read_text()
    dec = (_lib.source_dir() / "mk_decode.cuh").read_text()
    hdr = (_lib.source_dir() / "mk_api.h").read_text()
    assert f"constexpr unsigned NAN_KEY = {topk.NAN_KEY}u, PAD_KEY = {topk.PAD_KEY}u;" in src
    assert "return isnan(v) ? NAN_KEY : ord_key(v);" in src
    assert f"MK_ERR_NONFINITE_LOGITS = {topk.ERR_NONFINITE_LOGITS}," in hdr
    assert ERR_NAMES[topk.ERR_NONFINITE_LOGITS].startswith("non-finite gate logits (NaN/inf in x or the gate weights)")
    codes = [int(c) for c in re.findall(r"MK_ERR_\w+ = (\d+),", hdr)]
    assert codes == list(range(1, topk.ERR_NONFINITE_LOGITS + 1)) and set(ERR_NAMES) == set(codes)
    # recorded without the abort (the other rows are computed); k_topk, k_route and the decode kernel by warp_topk's
    # `bad`, k_topk_small from its own softmax warp, both broken_softmax's: only where the sum is NaN
    assert "if (bad >= 0) record_noabort(p, MK_ERR_NONFINITE_LOGITS, t, bad);" in src
    assert "return nf != NO_BAD && isnan(s) ? (int)nf : -1;" in src
    assert src.count("note_nonfinite(p, t, bad);") == 2 and "note_nonfinite(p, t, broken_softmax(nf, sum));" in src
    assert "note_nonfinite(p, t, bad);" in dec
    warp = src[src.index("__device__ __forceinline__ void warp_topk("):src.index("void append_pick(")]
    assert warp.count("bad =") == 1 and warp.index("s += __shfl_xor_sync") < warp.index("bad = broken_softmax(nf, s);")
    small = src[src.index("void __launch_bounds__(SMALL_THREADS) k_topk_small("):src.index("// ---- Routing as one")]
    assert small.index("sum += __shfl_xor_sync") < small.index("broken_softmax(nf, sum)")
    assert small.count("note_nonfinite(") == 1
    append = src[src.index("void append_row("):src.index("void note_nonfinite(")]  # append_pick goes through it
    assert "e < 0 || e >= p.E" in append and "pos >= p.S_cap" in append and "append_row(p, row, e);" in append
    assert "append_pick(p, t * K + tid" in small and "p.lists[" not in small


@pytest.mark.parametrize("k", [5, 9, -1])
@pytest.mark.parametrize("fn", ["select", "select_warp", "select_rank", "route_row"])
def test_a_k_past_the_experts_is_named(fn: str, k: int) -> None:
    """The kernels take topk in 1..min(16, E) (check_params); the models took a k past E without a word: select
    handed back fewer than k picks, select_warp and route_row picks out of range (the sentinel), select_rank failed
    on a bare assertion. A ValueError naming k and E now, as moe_layer.route says it."""
    probs = [0.25] * 4
    with pytest.raises(ValueError, match=rf"topk: k must be in 0..4 \(the experts\), got {k}"):
        getattr(topk, fn)(probs, k)
    picks = getattr(topk, fn)(probs, 4)
    assert (picks[0] if fn == "route_row" else picks) == [0, 1, 2, 3]
