"""The queued transports (proxy, IBGDA) with chunk_tokens > 0 at decode sizes: the PUTs charged are the engine's
expected count, not ceil(rows / chunk) of the rows piled on the expected peers.

Since 2ce9b50 the model puts all the expected rows on the expected number of peers that get any (a peer that gets
none is sent count words only). Its rows per peer were then chunked and rounded up, so with chunk_tokens 1 the PUTs
exceeded the rows sent. csrc/proxy_xchg.h sends a peer that gets X rows ceil(X / chunk_tokens) PUTs (one with
chunk_tokens 0, none with X = 0), so the engine's expected PUTs to peer d are E[ceil(X_d / chunk)], X_d ~
Binomial(S, p_d): each of the S tokens needs d with probability p_d.

Hand-computed case: custom:1024,512,16,2 (16 experts, top-2) on 2 nodes x 8 GPUs, uniform routing: each rank holds
one expert, so a token needs a given rank with p = 2/16 = 1/8. Source PE 0 has 8 peers on the other node (the
queue). At S = 8, X ~ Binomial(8, 1/8):
* peers that get a row: 8 x (1 - (7/8)^8) = 5.25 -> 5 (chunk_tokens 0: 5 PUTs, as before);
* chunk_tokens 1: E[X] = 8/8 = 1 per peer -> 8 PUTs (the old model: 8 rows on 5 peers, 1.6 each, rounded up to 2
  PUTs each: 10);
* chunk_tokens 2: E[ceil(X/2)] = P1 + P2 + 2 (P3 + P4) + 3 (P5 + P6) + 4 (P7 + P8) = 0.7250 per peer -> 5.80 -> 6.
Combine is the same count (the most needed PE returns p = 1/8 of each owner's S tokens)."""

from __future__ import annotations

import math
from math import comb

import pytest

from moetune.runtime.knobs import Knobs
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.records import Workload

MODEL = "custom:1024,512,16,2"
CASES = [("ndr-ibrc-h100x8", Knobs(transport="proxy", fence_mode="proxy_drain")),
         ("ndr-ibgda-h100x8", Knobs(transport="ibgda", fence_mode="nic_ordered"))]


def _pmf(k: int, n: int = 8, p: float = 1 / 8) -> float:
    return comb(n, k) * p**k * (1 - p) ** (n - k)


def test_the_hand_computation() -> None:
    assert round(8 * (1 - (7 / 8) ** 8)) == 5
    half = sum(_pmf(k) * -(-k // 2) for k in range(9))
    assert half == pytest.approx(0.7250, abs=5e-5) and round(8 * half) == 6


@pytest.mark.parametrize(("preset", "knobs"), CASES)
@pytest.mark.parametrize(("chunk", "puts"), [(0, 5), (1, 8), (2, 6)])
def test_puts_are_the_engines_expected_count(preset: str, knobs: Knobs, chunk: int, puts: int) -> None:
    w = Workload(MODEL, 8, 2, 8)
    for phase in ("dispatch", "combine"):
        pr = predict(preset, w, knobs.replace(chunk_tokens=chunk), phase=phase)
        assert pr.transfers == puts, (phase, chunk, pr.transfers)


@pytest.mark.parametrize(("preset", "knobs"), CASES)
def test_the_bytes_do_not_depend_on_the_chunking(preset: str, knobs: Knobs) -> None:
    """The rows on the wire are the expected rows whatever the chunk (signals aside: decoupled, one per peer)."""
    w = Workload(MODEL, 8, 2, 8)
    k = knobs.replace(signalling="decoupled", group_size=0)
    got = {c: predict(preset, w, k.replace(chunk_tokens=c), phase="dispatch").bytes_on_wire for c in (0, 1, 2)}
    assert got[1] == pytest.approx(got[0]) and got[2] == pytest.approx(got[0]), got


def test_the_qwen3_decode_case() -> None:
    """qwen3-30b (128 experts, top-8) on 2 x 8 GPUs at S = 2, chunk_tokens 1: p = 1 - C(120, 8) / C(128, 8) = 0.412;
    8 remote peers x E[X] = 8 x 2p = 6.6 PUTs on average -> 7 (the model said 10: 6.6 rows on 5 peers, 1.32 each,
    rounded up to 2 PUTs each)."""
    p = 1 - comb(120, 8) / comb(128, 8)
    assert round(8 * 2 * p) == 7
    pr = predict("ndr-ibrc-h100x8", Workload("qwen3-30b", 2, 2, 8),
                 Knobs(transport="proxy", fence_mode="proxy_drain", chunk_tokens=1), phase="dispatch")
    assert pr.transfers == 7


@pytest.mark.parametrize("p", [1e-17, 1e-12, 1e-8, 1e-3, 0.3, 1 - 1e-9])
def test_one_put_for_any_rows_at_large_token_counts(p: float) -> None:
    """A chunk of at least the token count sends one PUT for any rows, as chunk_tokens 0 does: both are P(X >= 1)
    = 1 - (1 - p)^S. At S = 65536 that was lost to cancellation with chunk 0 (1 - (1 - p)^S: 0 for p = 1e-17, 2e-5
    off at 1e-12) and, where the standard deviation is below 1, to the +-12 sd window of the sum (p = 1e-8: 7e-8
    relative, X >= 3 left out; p = 1 - 1e-9: P(X = S - 2) = 2e-9)."""
    from moetune.tuner.fabric_model.wire_rows import expected_puts

    tokens = 65536
    want = -math.expm1(tokens * math.log1p(-p))  # 1 - (1 - p)^S without the cancellation
    # (no absolute tolerance: pytest's default of 1e-12 took 0 for 6.6e-13; the binomial sum's lgamma terms, some
    # 7e5 each at this S, hold its relative error near 1e-11)
    assert expected_puts(p, tokens, 0) == pytest.approx(want, rel=1e-9, abs=0)
    assert expected_puts(p, tokens, tokens) == pytest.approx(want, rel=1e-9, abs=0)


def test_the_slot_cap_near_p_one() -> None:
    """p = 1 - 1e-9 at S = 65536, chunk_tokens 1: every plausible X (65534 .. 65536) is cut into MAX_SLOTS = 1024
    PUTs, so the expectation is 1024 to within P(X < 65473) (nothing): the window left out 2e-9 of the mass."""
    from moetune.tuner.fabric_model.wire_rows import expected_puts

    assert expected_puts(1 - 1e-9, 65536, 1) == pytest.approx(1024.0, rel=1e-12, abs=0)


def _exact_puts(p: float, tokens: int, chunk: int, lo: int = 1, hi: int | None = None) -> float:
    """E[chunking(X)], X ~ Binomial(tokens, p), summed term by term (each pmf from lgamma) over lo..hi (all by
    default): the reference the fast sum must match."""
    from moetune.tuner.fabric_model.wire_rows import chunking

    lp, lq, lt = math.log(p), math.log1p(-p), math.lgamma(tokens + 1)
    return math.fsum(math.exp(lt - math.lgamma(k + 1) - math.lgamma(tokens - k + 1) + k * lp + (tokens - k) * lq)
                     * chunking(float(k), chunk)[1] for k in range(lo, (tokens if hi is None else hi) + 1))


@pytest.mark.parametrize(("p", "tokens", "chunk"), [
    (0.41, 2, 1), (1 / 8, 8, 2), (0.122, 4096, 256), (0.23, 1024, 7), (0.5, 3000, 1), (0.9, 5000, 1),
    (0.9, 5000, 3), (0.02, 5000, 16), (1e-4, 5000, 1), (0.999, 4000, 2), (0.3, 4096, 4096)])
def test_the_sum_matches_the_exact_one(p: float, tokens: int, chunk: int) -> None:
    """The expected PUTs match the term-by-term binomial sum over every X (MAX_SLOTS binding at 4500 rows, chunk 1 or
    3, and near p = 1 included) to 1e-9 relative."""
    from moetune.tuner.fabric_model.wire_rows import expected_puts

    assert expected_puts.__wrapped__(p, tokens, chunk) == pytest.approx(_exact_puts(p, tokens, chunk), rel=1e-9)


def test_large_token_counts_are_fast_and_unchanged() -> None:
    """At S = 4M (zipf routing on 8-16 nodes gives many distinct p) each uncached call summed ~25k lgamma terms:
    0.7-1.4 s a prediction. Every call now takes under 5 ms, and matches the term-by-term sum over the same
    +-(12 sd + 20) window to 1e-7 relative: that sum's own lgamma terms (~6e7 each here) hold it only to ~1e-8 (it
    gives 1024.000008 PUTs at p = 0.3, chunk 256, more than the MAX_SLOTS = 1024 there can be; the sum now, 1024)."""
    import time

    from moetune.tuner.fabric_model.wire_rows import expected_puts

    tokens = 4 * 1024 * 1024
    for p, chunk in ((0.3, 256), (0.05, 64), (0.5, 1024), (0.003, 16), (0.01, 8192)):
        # this process's CPU time, the best of 20 uncached calls: the machine's other work (and its CPU quota's
        # throttling, which stalls a whole run of short calls) stays out of it
        best = min(_timed(expected_puts.__wrapped__, (p, tokens, chunk), time.process_time) for _ in range(20))
        assert best < 0.005, (p, chunk, best)
    for p, chunk in ((0.3, 256), (0.003, 16)):
        mean, sd = tokens * p, math.sqrt(tokens * p * (1 - p))
        lo, hi = math.floor(mean - 12 * sd) - 20, math.ceil(mean + 12 * sd) + 20
        want = _exact_puts(p, tokens, chunk, lo, hi)
        assert expected_puts.__wrapped__(p, tokens, chunk) == pytest.approx(want, rel=1e-7), (p, chunk)
    assert expected_puts.__wrapped__(0.3, tokens, 256) <= 1024


def _timed(f, args: tuple, clock) -> float:
    t = clock()
    f(*args)
    return clock() - t


def test_absurd_token_counts_are_refused_at_once_and_small() -> None:
    """2^40 tokens summed a window of ~25M binomial values: seconds and hundreds of MB a call. No MoE layer has more
    than MAX_TOKENS_PER_GPU (4M, what Workload and the CLI take) tokens per rank, so beyond it expected_puts refuses
    with an error naming the count and the limit, at once and without allocating; at the limit itself the worst p
    (0.5: the widest window) stays within a few ms and a few MB."""
    import time
    import tracemalloc

    from moetune.runtime.shapes import MAX_TOKENS_PER_GPU
    from moetune.tuner.fabric_model.wire_rows import expected_puts

    for tokens in (2**40, MAX_TOKENS_PER_GPU + 1):
        tracemalloc.start()
        t = time.process_time()
        with pytest.raises(ValueError, match=rf"tokens {tokens} is beyond .*at most {MAX_TOKENS_PER_GPU}"):
            expected_puts.__wrapped__(0.5, tokens, 1)
        spent = time.process_time() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert spent < 0.05 and peak < 1 << 20, (tokens, spent, peak)
    tracemalloc.start()
    best = min(_timed(expected_puts.__wrapped__, (0.5, MAX_TOKENS_PER_GPU, 1), time.process_time) for _ in range(5))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert best < 0.02 and peak < 8 << 20, (best, peak)
