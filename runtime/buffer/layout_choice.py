"""Which wire layout `EPBuffer(dense=None)` takes on a collective transport: dense or packed (module doc of
runtime/buffer/facade.py), and how a collective transport's EP buffer cuts a dispatch into pipeline chunks over its
communicators. Plain arithmetic, no torch: the fabric model (tuner/fabric_model/phases/) asks the same rules, so
it predicts the layout and the calls the runtime runs."""

from __future__ import annotations

import math

from moetune.runtime.knobs import MAX_COMM_CHANNELS as MAX_COMM_CHANNELS

# Automatic dense layout (EPBuffer(dense=None)): when one dispatch's dense send to a peer is at most this many
# bytes (latency-bound: the saved host sync and kernels matter more than bytes), or when uniform routing
# sends all but this fraction of the tokens to every rank anyway (e.g. 2 ranks with top-8).
DENSE_AUTO_MAX_BYTES = 2 << 20
DENSE_AUTO_MAX_WASTE = 0.10

# MAX_COMM_CHANNELS (runtime/knobs.py, beside the `channels` knob it caps): communicators per direction a
# collective transport's EP buffer spreads its pipeline chunks over (facade.py `comm_channels` =
# min(knobs.channels, MAX_COMM_CHANNELS); chunk c goes on communicator c mod comm_channels).


def equal_chunk_size(tokens: int, chunks: int) -> int:
    """Tokens (dense: capacity slots) per pipeline chunk when `tokens` are cut into `chunks` equal contiguous
    chunks: ceil(tokens / chunks), at least 1 (the packed layout's `_plan_packed`, the dense layout's
    `_dense_bounds` without chunk_weights)."""
    return max(1, math.ceil(tokens / chunks))


def equal_chunk_bounds(tokens: int, chunks: int) -> list[int]:
    """The chunks + 1 token boundaries of `equal_chunk_size` chunks over `tokens`, from 0 to `tokens`: chunk c is
    [bounds[c], bounds[c + 1]), the last ones short or empty (e.g. 5 tokens in 4 chunks: 0, 2, 4, 5, 5)."""
    cs = equal_chunk_size(tokens, chunks)
    return [min(c * cs, tokens) for c in range(chunks + 1)]


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
