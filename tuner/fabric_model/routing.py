"""Routing for the fabric model: expected tokens per expert and per destination, deterministically.

Uniform routing sends each token to k of E experts with equal probability. Zipf routing with
exponent s gives the expert of popularity rank r a weight r^-s; a token picks k distinct experts, so
the probability that an expert is among a token's k is k·w_r capped at 1 (the excess is handed on to
the less popular experts: "water filling"). Experts are laid on PEs by a fixed, seeded permutation of
popularity ranks, so hot experts land on arbitrary (but reproducible) PEs.

A routing spec (`uniform`, `zipf:1.2`) is parsed by `moetune.runtime.routing.parse_routing`, the same
parser the runtime's generators use, so the model and a measurement accept the same workloads.

The runtime's wire layouts send a token once per destination RANK that holds at least one of its k
experts (runtime/buffer/_packed.py, _resident.py), not once per expert: `rank_hits` is the probability
that a token needs a given rank. Uniform: exactly 1 - C(E - E/R, k) / C(E, k) (the same formula as the
runtime's `hit_probability`, runtime/buffer/layout_choice.py). Zipf: the same hypergeometric with the rank's
"effective experts" n_r = E x (its share of the token's k picks), which is exact for uniform routing and
within ~6 % of a Monte Carlo of the runtime's Gumbel-top-k generator in total ranks per token (tests);
per rank the error follows the water-filling marginals above (up to ~20 % on hot ranks).
"""

from __future__ import annotations

import functools

import numpy as np

PLACEMENT_SEED = 20261130
SPREAD_SEED = 7


@functools.lru_cache(maxsize=256)
def expert_inclusion(experts: int, topk: int, zipf_s: float) -> np.ndarray:
    """P(expert of popularity rank r is among a token's top-k), r = 0..E-1; sums to k."""
    if zipf_s == 0.0:
        return np.full(experts, topk / experts)
    w = 1.0 / np.arange(1, experts + 1, dtype=float) ** zipf_s
    w /= w.sum()
    p = topk * w
    capped = np.zeros(experts, dtype=bool)
    for _ in range(experts):
        over = p > 1.0
        if not over.any():
            break
        capped |= over
        excess = float((p[capped] - 1.0).sum())
        p[capped] = 1.0
        free = ~capped
        p[free] += excess * w[free] / w[free].sum()
    p.setflags(write=False)
    return p


@functools.lru_cache(maxsize=256)
def pe_loads(experts: int, topk: int, zipf_s: float, pes: int) -> np.ndarray:
    """[pes, experts_per_pe] inclusion probabilities of the experts each PE hosts (seeded placement)."""
    p = expert_inclusion(experts, topk, zipf_s)
    if zipf_s != 0.0:
        perm = np.random.default_rng(PLACEMENT_SEED).permutation(experts)
        p = p[perm]
    out = p.reshape(pes, experts // pes).copy()
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=256)
def spread_quantiles(n: int) -> tuple[float, ...]:
    """Deterministic exponential quantiles -ln(1-u) for n destinations, in a seeded order.

    Destination j gets the quantile of rank perm[j] among n, so the slowest of n destinations sits at
    ln(2n) tail scales: the tail of the slowest grows with the number of destinations.
    """
    if n <= 0:
        return ()
    ranks = np.random.default_rng(SPREAD_SEED + n).permutation(n)
    u = (ranks + 0.5) / n
    return tuple(float(x) for x in -np.log1p(-u))


@functools.lru_cache(maxsize=256)
def rank_hits(experts: int, topk: int, zipf_s: float, pes: int) -> np.ndarray:
    """[pes] P(a token has at least one of its k experts on PE r): the expected rows one source sends PE r
    per token under the runtime's per-rank layouts (sums to the expected distinct ranks per token)."""
    loads = pe_loads(experts, topk, zipf_s, pes)
    out = np.empty(pes)
    for r, row in enumerate(loads):
        total = float(row.sum())
        n = experts * total / topk  # effective experts of this rank (exactly E/R under uniform routing)
        miss = 1.0
        for i in range(topk):
            miss *= max(0.0, (experts - n - i) / (experts - i))
        # at least its hottest expert's inclusion, at most the expected picks it gets (and 1)
        out[r] = min(max(1.0 - miss, float(row.max())), total, 1.0)
    out.setflags(write=False)
    return out
