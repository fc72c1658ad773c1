"""What one PE sends: a token's wire row in bytes, signal words, rows per rank, the proxy's chunking."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from moetune.runtime.knobs import MAX_SLOTS, Knobs, num_scale_groups
from moetune.runtime.routing import parse_routing
from moetune.runtime.shapes import DTYPES, ModelShape, tokens_per_gpu_problem
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.routing import pe_loads, rank_hits

SIGNAL_BYTES = 8


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def token_bytes(model: ModelShape, knobs: Knobs, *, dispatch: bool, layout: str = "runtime") -> float:
    """Bytes of one token on the wire. Runtime layout, dispatch: EPBuffer's wire row (runtime/buffer/
    facade.py `_layout`): payload, k int64 ids, k fp32 weights, fp8 scales, padded to 16 bytes; combine:
    one activation-dtype row. `nccl_k_copies`: the bare payload (fp8: + scales), as the NCCL baseline."""
    h = model.hidden
    fp8 = dispatch and knobs.compression == "fp8_e4m3"
    scales = num_scale_groups(h, knobs.scale_granularity) if fp8 else 0
    payload = h if fp8 else h * DTYPES[model.dtype]
    if not dispatch or layout != "runtime":  # nccl_k_copies or expert_tiles: bare copies of the payload
        return float(payload + 4 * scales)
    k = model.topk
    return float(align(align(payload, 8) + 8 * k + 4 * k + 4 * scales, 16))


def route(w: Workload) -> tuple[Any, Any]:
    """(expert inclusion per PE [P, E/P], P(token needs PE r) [P]) for the workload's routing."""
    _, s = parse_routing(w.routing)
    loads = pe_loads(w.model.experts, w.model.topk, s, w.pes)
    return loads, rank_hits(w.model.experts, w.model.topk, s, w.pes)


def chunking(rows: float, chunk_tokens: int) -> tuple[int, int]:
    """(rows per PUT, PUTs) for `rows` rows to one peer, as the runtime's proxy splits a count (csrc/
    proxy_xchg.h `chunking`, which only the kernel runs: this is its one Python statement, which the search
    space's put_chunking uses too): chunk_tokens rows per PUT (0: one PUT for all), at most MAX_SLOTS PUTs
    (larger chunks then). A fractional expected count is rounded up; no rows, no PUT."""
    if rows <= 0:
        return 1, 0
    cnt = max(1, math.ceil(rows - 1e-9))
    c = chunk_tokens if chunk_tokens > 0 else cnt
    n = -(-cnt // c)
    if n > MAX_SLOTS:
        c = -(-cnt // MAX_SLOTS)
        n = -(-cnt // c)
    return c, n


def any_row_probability(p: float, tokens: int) -> float:
    """P(X >= 1) for X ~ Binomial(tokens, p): the chance a peer gets any of `tokens` rows. 1 - (1 - p)^tokens as
    -expm1(tokens log1p(-p)): the plain form cancels at large `tokens` and tiny p (0 for p < 1e-16, 2e-5 off at
    p = 1e-12 and S = 65536), where the rows, and so the chunked PUTs, are not 0."""
    p = min(1.0, max(0.0, p))
    if tokens <= 0 or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    return -math.expm1(tokens * math.log1p(-p))


@functools.lru_cache(maxsize=4096)
def expected_puts(p: float, tokens: int, chunk_tokens: int) -> float:
    """The PUTs one peer gets on average (`chunking`'s count, none for no row) when each of `tokens` tokens needs it
    with probability `p`: E[chunking(X)] over X ~ Binomial(tokens, p) rows. Not chunking(E[X]): at decode sizes most
    peers get no row and one that gets any gets whole rows (S = 2, p = 0.41, chunk_tokens 1: 0.82 PUTs, not 1).
    The fabric model charges a set of peers the sum (`phases/queued.py`), the search space keys its chunk grid on it
    (`search/space.py`), so both count the same PUTs. `tokens` beyond MAX_TOKENS_PER_GPU (what Workload and the CLI
    take) is refused (ValueError): the exact window sum grows with sqrt(tokens) (2^40 tokens: ~25M values, seconds
    and hundreds of MB a call) and no MoE layer has such a count; at 4M it is ~25k values, ~1 ms."""
    problem = tokens_per_gpu_problem(tokens) if tokens > 0 else ""
    if problem:
        raise ValueError(f"expected_puts: tokens {problem}")
    p = min(1.0, max(0.0, p))
    if tokens <= 0 or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(chunking(float(tokens), chunk_tokens)[1])
    if chunk_tokens <= 0:  # one PUT for any rows (MAX_SLOTS never binds on one)
        return any_row_probability(p, tokens)
    # the binomial's mass lies within a few standard deviations of its mean: 12 leave out less than 1e-30 where it
    # is near normal; where the standard deviation is below 1 (p near 0 or 1) it is not, and 12 of them alone left
    # out 2e-9 of it (p = 1 - 1e-9, S = 65536: X = S - 2), so 20 values more each side
    mean, sd = tokens * p, math.sqrt(tokens * p * (1.0 - p))
    lo, hi = max(0, math.floor(mean - 12 * sd) - 20), min(tokens, math.ceil(mean + 12 * sd) + 20)
    return _window_sum(p, tokens, chunk_tokens, lo, hi)


def _window_sum(p: float, tokens: int, chunk_tokens: int, lo: int, hi: int) -> float:
    """sum over k = lo..hi of P(X = k) chunking(k), X ~ Binomial(tokens, p), in arrays: ~25k values at S = 4M, where
    one lgamma-based term at a time took 25-35 ms a call (0.7-1.4 s a zipf prediction of 8-16 nodes, whose peers
    have as many distinct p). The log pmf is accumulated from one anchor near the mean by the log ratios
    log P(k+1)/P(k) = log(S - k) - log(k + 1) + log(p / (1 - p)), each small there, so the sums stay small and their
    rounding far below 1e-9; and the pmfs are normalised over the window (whose left-out mass is below 1e-20), which
    also drops the anchor's lgamma rounding (its terms ~6e7 at S = 4M: 1e-8 relative, as every term had before).
    chunking(0) is no PUT, so k = 0 counts for the mass only."""
    lp, lq = math.log(p), math.log1p(-p)
    ks = np.arange(lo, hi + 1, dtype=np.float64)  # whole numbers below 2^53: exact
    ratio = np.log((tokens - ks[:-1]) / (ks[:-1] + 1)) + (lp - lq)
    i = min(max(int(tokens * p), lo), hi) - lo  # the anchor: the mean's index (the mode to within one)
    logpmf = np.empty(len(ks), dtype=np.float64)
    logpmf[i] = 0.0  # relative to the anchor's pmf: normalised below
    logpmf[i + 1:] = np.cumsum(ratio[i:])
    logpmf[:i] = -np.cumsum(ratio[:i][::-1])[::-1]
    pmf = np.exp(logpmf)
    # chunking(k) for every k at once: ceil(k / chunk), or with more than MAX_SLOTS PUTs ceil(k / ceil(k / MAX_SLOTS));
    # k / c of whole numbers below 2^53 lands on a whole number only where c divides k, so ceil is exact
    puts = np.ceil(ks / chunk_tokens)
    if hi > chunk_tokens * MAX_SLOTS:
        puts = np.where(puts > MAX_SLOTS, np.ceil(ks / np.maximum(np.ceil(ks / MAX_SLOTS), 1.0)), puts)
    # not np.dot: a BLAS dot of this length may start threads, which on a busy machine cost more than the sum
    return float((pmf * puts).sum() / pmf.sum())
