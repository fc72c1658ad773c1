"""What one PE sends: a token's wire row in bytes, signal words, rows per rank, the proxy's chunking."""

from __future__ import annotations

import functools
import math
from typing import Any

from moetune.runtime.knobs import MAX_SLOTS, Knobs, num_scale_groups
from moetune.runtime.routing import parse_routing
from moetune.runtime.shapes import DTYPES, ModelShape
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
    (`search/space.py`), so both count the same PUTs."""
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
    lo, hi = max(1, math.floor(mean - 12 * sd) - 20), min(tokens, math.ceil(mean + 12 * sd) + 20)
    lp, lq, lt = math.log(p), math.log1p(-p), math.lgamma(tokens + 1)
    total = 0.0
    for k in range(lo, hi + 1):
        pmf = math.exp(lt - math.lgamma(k + 1) - math.lgamma(tokens - k + 1) + k * lp + (tokens - k) * lq)
        total += pmf * chunking(float(k), chunk_tokens)[1]
    return total
