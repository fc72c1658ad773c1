"""The queued transports (proxy, IBGDA): the rows a PE sends itself are charged the engine's expected PUTs, as a
peer's are.

csrc/proxy_xchg.h produce_exchange loops over every rank, this one included: the rows to itself are PUTs through the
same proxy (chunking(X) of them, each with its signal when coupled), landing as a local copy. Since fead36a a peer of
X ~ Binomial(S, p) rows is charged E[chunking(X)] PUTs, but the PE's own rows were still chunked the old way: their
expected count S p rounded up, then chunked.

Hand-computed case: qwen3-30b (128 experts, top-8) on 2 x 8 GPUs, uniform routing, S = 5: a token needs a rank with
p = 1 - C(120, 8) / C(128, 8) = 0.412, so S p = 2.06 rows.
* chunk_tokens 1: E[X] = 2.06 -> 2 PUTs to itself (the old charge: ceil(2.06) = 3 rows, 3 PUTs);
* chunk_tokens 2: E[ceil(X / 2)] = P1 + P2 + 2 (P3 + P4) + 3 P5 = 1.28 -> 1 (the old: ceil(3 / 2) = 2).
The 8 peers on the other node: round(8 E) PUTs, 16 with chunk 1, 10 with chunk 2. Coupled signalling signals every
PUT, the PE's own included, and each signal is a fence: 16 + 2 = 18 and 10 + 1 = 11 fences, dispatch and combine (the
most needed PE returns the same p). The self copy's bytes (its time) do not depend on the chunking."""

from __future__ import annotations

from math import comb

import pytest

from moetune.runtime.knobs import Knobs
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.records import Workload

P = 1 - comb(120, 8) / comb(128, 8)


def _pmf(k: int, n: int = 5) -> float:
    return comb(n, k) * P**k * (1 - P) ** (n - k)


def test_the_hand_computation() -> None:
    rows = 5 * P
    assert rows == pytest.approx(2.0614, abs=1e-4)
    half = sum(_pmf(k) * -(-k // 2) for k in range(6))
    assert half == pytest.approx(1.2807, abs=1e-4)
    assert (round(8 * 5 * P), round(5 * P)) == (16, 2)
    assert (round(8 * half), round(half)) == (10, 1)


@pytest.mark.parametrize(("preset", "transport", "fence"), [("ndr-ibrc-h100x8", "proxy", "proxy_drain"),
                                                            ("ndr-ibgda-h100x8", "ibgda", "nic_ordered")])
@pytest.mark.parametrize(("chunk", "remote", "own"), [(1, 16, 2), (2, 10, 1)])
def test_own_rows_are_charged_the_expected_puts(preset: str, transport: str, fence: str, chunk: int, remote: int,
                                                own: int) -> None:
    w = Workload("qwen3-30b", 5, 2, 8)
    k = Knobs(transport=transport, fence_mode=fence, signalling="coupled", chunk_tokens=chunk)
    for phase in ("dispatch", "combine"):
        pr = predict(preset, w, k, phase=phase)
        assert (pr.transfers, pr.fences) == (remote, remote + own), (phase, chunk, pr.transfers, pr.fences)
        one = predict(preset, w, k.replace(chunk_tokens=0), phase=phase)
        assert pr.phases[f"{phase}.self_copy"] == pytest.approx(one.phases[f"{phase}.self_copy"], rel=1e-12)
