"""The routing kernels' top-k (csrc/megakernel/mk_moe.cu: warp_topk, k_topk_small), modelled on the CPU.

A token's E gate logits: softmax in fp32, the K experts of the highest probability (ties: the lower expert first, in
pick order), their probabilities renormalised over the K picks. The kernels order probabilities by a total key
(`pick_key`): a number's order-preserving fp32 bits, and NAN_KEY, below every number and above PAD_KEY (warp_topk's
lanes past E), for NaN. Probabilities are never negative or -0, so on numbers the key's order and ties are the float
compare's: finite logits pick what float compares picked (the kernels before: `select_warp`'s `key=float`). A
NaN or +inf logit, or all E of them -inf, make every probability of the token NaN (NaN: the sum; +inf: inf - inf;
all -inf: -inf - -inf); a NaN never compares greater, so the compares found no expert and every pick was out of
range (the sentinel 1 << 30, or a padding lane's index past E), which the kernels wrote and read at (an illegal
address). With the key such a token takes experts 0..K-1 with NaN weights, and the launch records
MK_ERR_NONFINITE_LOGITS (its lowest expert whose logit is not finite as the detail) without aborting. A -inf logit
among finite ones (what masking leaves) is a probability of +0: the token routes as usual and nothing is recorded
(`broken_softmax`: the sum is NaN exactly where the softmax broke).

`select_warp` follows warp_topk (32 lanes, a lane's best unpicked key, the warp's max key then min index per round),
`select_rank` k_topk_small (each expert's rank against all E), `select` is the sort both must equal. `route_row` runs
a whole token in fp32 with the kernel's order of adds (exp here is libm's rounded to fp32, the GPU's expf may differ
by an ulp: the picks agree except at such near-ties, the weights to about an ulp).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

ERR_NONFINITE_LOGITS = 8  # MK_ERR_NONFINITE_LOGITS (mk_api.h)
NAN_KEY, PAD_KEY = 1, 0   # mk_moe.cu pick_key's NaN, warp_topk's lanes past E
SENTINEL = 1 << 30        # a lane's index when it has no unpicked expert


def f32(x: float) -> float:
    """x rounded to fp32 (inf past its range, as the GPU rounds)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def ord_key(x: float) -> int:
    """mk_moe.cu ord_key: fp32 -> an unsigned key with the float's order (negatives bit-flipped, positives with the
    sign bit set)."""
    u = _bits(x)
    return ~u & 0xFFFFFFFF if u & 0x80000000 else u | 0x80000000


def ord_val(k: int) -> float:
    """mk_moe.cu ord_val: the key back to its float (NAN_KEY and PAD_KEY give NaNs)."""
    u = k & 0x7FFFFFFF if k & 0x80000000 else ~k & 0xFFFFFFFF
    return struct.unpack("<f", struct.pack("<I", u))[0]


def pick_key(p: float) -> int:
    """mk_moe.cu pick_key: the selection's key of a probability."""
    return NAN_KEY if math.isnan(p) else ord_key(p)


def _check_k(k: int, experts: int) -> None:
    """ValueError unless 0 <= k <= experts (as moe_layer.route; the kernels take 1..min(16, E)): past E the models
    gave fewer picks (select), out-of-range ones (select_warp's sentinel) or a bare AssertionError (select_rank)."""
    if not 0 <= k <= experts:
        raise ValueError(f"topk: k must be in 0..{experts} (the experts), got {k}")


def select(probs: Sequence[float], k: int) -> list[int]:
    """The K picks in pick order: key descending, the lower expert first on a tie."""
    _check_k(k, len(probs))
    return sorted(range(len(probs)), key=lambda e: (-pick_key(probs[e]), e))[:k]


def select_warp(probs: Sequence[float], k: int, key: Callable[[float], Any] = pick_key, pad: Any = PAD_KEY,
                none: Any = PAD_KEY) -> list[int]:
    """warp_topk's rounds: lane l holds experts l, l + 32, ..; each keeps its best unpicked (key, lowest expert); a
    round takes the warp's max key and, among lanes at it, the lowest expert; the winner's lane rescans.

    `key`, `pad` (a lane's value past E) and `none` (a lane's best before any expert beat it) are the kernel's:
    pick_key, PAD_KEY, PAD_KEY. `key=float, pad=-1.0, none=-2.0` is warp_topk before the key (float compares): the
    order finite probabilities must keep; NaN probabilities never compare greater, so its picks are then experts past
    E (a padding lane's, E not a multiple of 32) or the sentinel 1 << 30: out of range either way."""
    e_n = len(probs)
    _check_k(k, e_n)
    ni = max(1, (e_n + 31) // 32)
    keys = [[key(probs[lane + 32 * i]) if lane + 32 * i < e_n else pad for i in range(ni)] for lane in range(32)]
    taken = [[False] * ni for _ in range(32)]

    def best(lane: int) -> tuple[Any, int]:
        lk, li = none, SENTINEL
        for i in range(ni):
            if not taken[lane][i] and keys[lane][i] > lk:
                lk, li = keys[lane][i], lane + 32 * i
        return lk, li

    lanes = [best(lane) for lane in range(32)]
    picks = []
    for _ in range(k):
        kmax = max(lk for lk, _ in lanes)
        bi = min(li if lk == kmax else 0x7FFFFFFF for lk, li in lanes)
        if bi < e_n:
            taken[bi & 31][bi >> 5] = True
            lanes[bi & 31] = best(bi & 31)
        picks.append(bi)
    return picks


def select_rank(probs: Sequence[float], k: int) -> list[int]:
    """k_topk_small: expert e's rank = the experts of a higher key, or of its key and a lower index; ranks < K are
    the picks in pick order (a total order: every rank once)."""
    _check_k(k, len(probs))
    keys = [pick_key(p) for p in probs]
    slots: list[int | None] = [None] * k
    for e, ke in enumerate(keys):
        r = sum(1 for j, kj in enumerate(keys) if kj > ke or (kj == ke and j < e))
        if r < k:
            assert slots[r] is None, "two experts of one rank"
            slots[r] = e
    assert all(s is not None for s in slots), "a slot left unset"
    return [s for s in slots if s is not None]


def _fmaxf(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def _exp_minus(x: float, m: float) -> float:
    """expf(x - m) in fp32 (x <= m unless NaN; inf - inf is NaN)."""
    d = f32(x - m)
    return d if math.isnan(d) else f32(math.exp(min(d, 0.0)))


def route_row(logits: Sequence[float], k: int) -> tuple[list[int], list[float], int]:
    """One token as warp_topk routes it: (picks, weights, bad): bad is broken_softmax's, where the token's softmax
    sum is NaN (a NaN or +inf logit, or all -inf) its lowest expert whose logit is not finite, else -1."""
    lg = [f32(x) for x in logits]
    e_n = len(lg)
    _check_k(k, e_n)
    nf = next((e for e, x in enumerate(lg) if not math.isfinite(x)), -1)
    m = -math.inf
    for x in lg:
        m = _fmaxf(m, x)
    v = [_exp_minus(x, m) for x in lg]
    part = [0.0] * 32  # lane l adds experts l, l + 32, .., then the xor butterfly
    for e, x in enumerate(v):
        part[e % 32] = f32(part[e % 32] + x)
    o = 16
    while o:
        part = [f32(part[lane] + part[lane ^ o]) for lane in range(32)]
        o >>= 1
    s = part[0]
    bad = nf if math.isnan(s) else -1  # finite logits, -inf among them or not, give 1 <= s <= E
    probs = [math.nan if math.isnan(x) or math.isnan(s) else f32(x / s) for x in v]  # s >= 1 unless NaN
    picks = select_warp(probs, k)
    vals = [probs[e] if e < e_n else math.nan for e in picks]  # the kernel's ord_val(key): the pick's probability
    total = 0.0
    for x in vals:
        total = f32(total + x)
    denom = _fmaxf(total, f32(1e-20))
    return picks, [f32(x / denom) if not math.isnan(x) else math.nan for x in vals], bad
