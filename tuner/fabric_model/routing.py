"""Routing for the fabric model: expected tokens per expert and per destination, deterministically.

Uniform routing sends each token to k of E experts with equal probability. Zipf routing with
exponent s gives the expert of popularity rank r a weight r^-s; a token picks k distinct experts, so
the probability that an expert is among a token's k is k·w_r capped at 1 (the excess is handed on to
the less popular experts: "water filling"). Experts are laid on PEs by a fixed, seeded permutation of
popularity ranks, so hot experts land on arbitrary (but reproducible) PEs.

A routing spec (`uniform`, `zipf:1.2`) is parsed by `moetune.runtime.routing.parse_routing`, the same
parser the runtime's generators use, so the model and a measurement accept the same workloads.
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
