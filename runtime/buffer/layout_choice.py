"""Which wire layout `EPBuffer(dense=None)` takes on a collective transport: dense or packed (module doc of
runtime/buffer/facade.py). Plain arithmetic, no torch: the fabric model (tuner/fabric_model/predict.py) asks the
same rule, so it predicts the layout the runtime runs."""

from __future__ import annotations

import math

# Automatic dense layout (EPBuffer(dense=None)): when one dispatch's dense send to a peer is at most this many
# bytes (latency-bound: the saved host sync and kernels matter more than bytes), or when uniform routing
# sends all but this fraction of the tokens to every rank anyway (e.g. 2 ranks with top-8).
DENSE_AUTO_MAX_BYTES = 2 << 20
DENSE_AUTO_MAX_WASTE = 0.10


def hit_probability(experts: int, topk: int, world: int) -> float:
    """Probability that a token with `topk` distinct uniformly chosen experts has one on a given rank."""
    epr = experts // max(1, world)
    if world <= 1:
        return 1.0
    return 1.0 - math.comb(experts - epr, topk) / math.comb(experts, topk)


def picks_dense(experts: int, topk: int, world: int, max_tokens: int, row_bytes: float) -> bool:
    """Whether a collective transport's buffer of `max_tokens` wire rows of `row_bytes` runs the dense layout
    when not told (dense=None): one dense send per peer of at most DENSE_AUTO_MAX_BYTES, or at most
    DENSE_AUTO_MAX_WASTE of the rows sent for nothing under uniform routing. Never at world 1."""
    if world <= 1:
        return False
    waste = 1.0 - hit_probability(experts, topk, world)
    return max_tokens * row_bytes <= DENSE_AUTO_MAX_BYTES or waste <= DENSE_AUTO_MAX_WASTE
