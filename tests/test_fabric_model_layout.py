"""The fabric model counts what the runtime's layouts send: each token once per destination RANK that holds
one of its k experts (runtime/buffer/_packed.py, _resident.py; DESIGN §6 "Dispatch sends each token once per
destination rank"), not once per (token, expert). Checked against the routing law and DESIGN §6's numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import Workload, predict
from moetune.tuner.fabric_model.routing import PLACEMENT_SEED, rank_hits


@pytest.mark.parametrize(("experts", "topk", "pes"), [(256, 8, 2), (256, 8, 16), (128, 8, 4), (64, 6, 8), (8, 2, 8)])
def test_uniform_rank_hits_are_the_runtime_hit_probability(experts: int, topk: int, pes: int) -> None:
    from moetune.runtime.buffer._dense import hit_probability

    h = rank_hits(experts, topk, 0.0, pes)
    assert h == pytest.approx([hit_probability(experts, topk, pes)] * pes, rel=1e-12)
    epr = experts // pes
    assert h[0] == pytest.approx(1 - math.comb(experts - epr, topk) / math.comb(experts, topk))


@pytest.mark.parametrize(("experts", "topk", "s", "pes"), [(128, 8, 1.2, 8), (256, 8, 1.0, 32), (128, 8, 0.8, 16),
                                                          (64, 6, 1.5, 8), (128, 8, 1.2, 2)])
def test_zipf_rank_hits_match_the_runtime_generator(experts: int, topk: int, s: float, pes: int) -> None:
    """Monte Carlo of runtime/routing.py's law (Gumbel-top-k over Zipf weights, k distinct experts) with the
    model's placement: the expected ranks per token within 6% (the per-rank error follows the model's
    water-filling inclusion marginals, which are an approximation of that law)."""
    w = 1.0 / np.arange(1, experts + 1) ** s
    w = (w / w.sum())[np.random.default_rng(PLACEMENT_SEED).permutation(experts)]
    rng = np.random.default_rng(1)
    n = 20000
    g = np.log(w)[None, :] - np.log(-np.log(rng.random((n, experts))))
    idx = np.argpartition(-g, topk, axis=1)[:, :topk]
    hit = np.zeros((n, pes), dtype=bool)
    np.put_along_axis(hit, idx // (experts // pes), True, axis=1)
    mc = hit.mean(axis=0)
    h = rank_hits(experts, topk, s, pes)
    assert h.sum() == pytest.approx(mc.sum(), rel=0.06)
    assert (h <= 1.0).all() and (h > 0).all()


# DESIGN §6, DeepEP V1 normal kernels on the same 2x H200 (24 SMs), µs, and its floors: each token sent once
# per remote rank at the measured 372 GB/s peer copy rate.
PEER_COPY_GBPS = 372.0
DEEPEP = {  # model: (S, dispatch bf16 µs, combine µs, floor µs each way)
    "deepseek-v3": (4096, 343.8, 399.5, 158.0),
    "qwen3-30b": (4096, 191.7, 153.9, 45.0),
}


@pytest.mark.parametrize("model", sorted(DEEPEP))
def test_nvlink_bytes_are_once_per_rank(model: str) -> None:
    """The dispatch moves the floor's bytes (158 µs x 372 GB/s = 58.8 MB for DeepSeek-V3), not once per
    expert (4x that at 2 ranks: 235 MB before). 5%: the floors are rounded to the µs and count the payload
    only, the runtime's rows also carry k ids and k weights (96 B: +0.7% DeepSeek-V3, +2.3% Qwen3-30B)."""
    s, _, _, floor_us = DEEPEP[model]
    r = predict("nvlink-h200x2", Workload(get_model(model), s, 1, 2), Knobs(transport="nvlink"), phase="dispatch")
    assert r.bytes_on_wire == pytest.approx(floor_us * 1e-6 * PEER_COPY_GBPS * 1e9, rel=0.05)


@pytest.mark.parametrize("model", sorted(DEEPEP))
def test_nvlink_against_design6_deepep(model: str) -> None:
    """MODELLED nvlink dispatch and combine against DeepEP's measured times on the same machine.

    Tolerance: above the floor (no transport beats the measured 372 GB/s with these bytes) and at most 1.5x
    DeepEP (the per-expert overcount gave 2.9x for DeepSeek-V3 dispatch, 986 vs 343.8 µs). Not a lower bound
    at DeepEP in general: the model describes moetune's kernel (240 GB/s assumed store rate, no notify
    round), and DeepEP at Qwen3-30B S=4096 is not bandwidth-bound (16.7 MB in 191.7 µs, ~87 GB/s); where it
    is (DeepSeek-V3, the floor is 46% of its time) the model must be within 1.5x both ways."""
    s, disp, comb, floor_us = DEEPEP[model]
    r = predict("nvlink-h200x2", Workload(get_model(model), s, 1, 2), Knobs(transport="nvlink"))
    for got, measured in ((r.dispatch_us, disp), (r.combine_us, comb)):
        assert floor_us <= got <= 1.5 * measured, (got, measured, floor_us)
    if model == "deepseek-v3":
        assert disp / 1.5 <= r.dispatch_us
    assert r.modelled


def test_every_layout_transport_counts_ranks_not_experts() -> None:
    """nvlink, host_staged and the runtime's collective move the same rows (once per rank); the bare NCCL
    experiment of DESIGN §6 (k copies: layout nccl_k_copies) moves ~4x the payload at 2 ranks."""
    m = get_model("deepseek-v3")
    w = Workload(m, 4096, 1, 2)
    nbytes = {t: predict("nvlink-h200x2", w, Knobs(transport=t), phase="dispatch").bytes_on_wire
              for t in ("nvlink", "host_staged", "collective")}
    assert nbytes["host_staged"] == pytest.approx(nbytes["collective"])
    assert nbytes["nvlink"] == pytest.approx(nbytes["collective"], rel=1e-4)  # + its signal words
    k = predict("nvlink-h200x2", w, Knobs(transport="collective"), phase="dispatch", layout="nccl_k_copies")
    assert k.bytes_on_wire == pytest.approx(4096 * 8 / 2 * m.hidden * 2)
    assert 3.9 < k.bytes_on_wire / nbytes["collective"] < 4.1
    with pytest.raises(ValueError, match="collective only"):
        predict("nvlink-h200x2", w, Knobs(transport="nvlink"), layout="nccl_k_copies")
