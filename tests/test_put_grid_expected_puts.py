"""The proxy/ibgda chunk_tokens grid at a known token count keys its values on the PUTs the fabric model charges
(`wire_rows.expected_puts`: E[ceil(X / chunk_tokens)], X ~ Binomial(S, p) rows a peer gets), not on ceil(S x p):
that rounded the expected rows of every peer, below one at decode, so every chunk collapsed into chunk_tokens 0 while
the model (and the engine: a peer that gets 2 rows is sent 2 PUTs of 1) tells them apart.

Hand-computed cases (uniform routing):
* qwen3-30b (128 experts, top-8) at EP 16 (2 x 8), S = 2: p = 1 - C(120, 8) / C(128, 8) = 0.412. chunk_tokens 1:
  a peer gets X PUTs, 15 x 2p = 12.4 over the 15 peers, where chunk_tokens 0 sends 15 x (1 - (1 - p)^2) = 9.8: two
  runs (the grid offered chunk 0 only). chunk_tokens 2 >= S: one PUT whatever X, the same run as 0.
* deepseek-v3 (256 experts, top-8) at EP 32 (4 x 8), S = 1024, the stock policy's chunk_tokens 256: p = 1 - C(248, 8)
  / C(256, 8) = 0.227, X has mean 232.5 and standard deviation 13.4, so P(X > 256) = 0.038: 31 x 1.038 = 32.2 PUTs
  against 31 with chunk_tokens 0 (the grid dropped 256 as one PUT of ceil(232.5) = 233 rows)."""

from __future__ import annotations

import dataclasses
from math import comb, exp, lgamma, log, log1p

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.search.policy import KnobSpec, load_policy
from moetune.tuner.search.space import SearchSpace


def _space(model: str, ep: int, tokens: int, chunks: tuple[int, ...] | None = None) -> SearchSpace:
    pol = load_policy("proxy:ibrc")
    if chunks is not None:
        pol = dataclasses.replace(pol, knobs={**pol.knobs, "chunk_tokens": KnobSpec("chunk_tokens", choices=chunks)})
    m = get_model(model)
    return SearchSpace(pol, experts=m.experts, ep_size=ep, tokens=tokens, topk=m.topk)


def _knobs(chunk: int) -> Knobs:
    return Knobs(transport="proxy", fence_mode="proxy_drain", chunk_tokens=chunk)


def test_decode_chunks_the_model_tells_apart_are_offered() -> None:
    p = 1 - comb(120, 8) / comb(128, 8)
    assert round(15 * 2 * p) == 12 and round(15 * (1 - (1 - p) ** 2)) == 10
    assert _space("qwen3-30b", 16, 2, (0, 1, 2)).spec["chunk_tokens"].values() == (0, 1)
    w = Workload("qwen3-30b", 2, 2, 8)
    puts = {c: predict("ndr-ibrc-h100x8", w, _knobs(c), phase="dispatch").transfers for c in (0, 1, 2)}
    assert puts[1] != puts[0] and puts[2] == puts[0], puts


def test_a_stock_chunk_the_model_tells_apart_at_prefill_is_offered() -> None:
    p = 1 - comb(248, 8) / comb(256, 8)
    tail = sum(exp(lgamma(1025) - lgamma(k + 1) - lgamma(1025 - k) + k * log(p) + (1024 - k) * log1p(-p))
               for k in range(257, 1025))
    assert abs(tail - 0.038) < 0.001 and round(31 * (1 + tail)) == 32
    assert _space("deepseek-v3", 32, 1024).spec["chunk_tokens"].values() == (0, 256)
    w = Workload("deepseek-v3", 1024, 4, 8)
    puts = {c: predict("ndr-ibrc-h100x8", w, _knobs(c), phase="dispatch").transfers for c in (0, 256)}
    assert puts[256] > puts[0], puts


def test_group_sizes_the_model_tells_apart_are_offered() -> None:
    """The group-size bound is the most PUTs the model charges a peer, not the rounded mean: qwen3-30b at EP 64
    (8 x 8), S = 4096, the stock chunk_tokens 256: p = 1 - C(126, 8) / C(128, 8) = 0.122, X has mean 497.9 and
    standard deviation 20.9, so ceil(X / 256) is 2, or 3 where X > 512 (P = 0.241): E = 2.241 per peer. The model
    charges the 56 remote peers round(56 x 2.241) = 126 PUTs, 14 of them 3 (largest remainder), so group_size 2 sends
    those 2 signals, not 1 (dispatch fences 71 against 57 per peer); the bound round(2.241) = 2 offered no group
    size. Over the 63 other ranks: round(63 x 2.241) = 141 PUTs on the 63 peers that get rows, ceil(141 / 63) = 3."""
    p = 1 - comb(126, 8) / comb(128, 8)
    tail = sum(exp(lgamma(4097) - lgamma(k + 1) - lgamma(4097 - k) + k * log(p) + (4096 - k) * log1p(-p))
               for k in range(513, 4097))
    assert abs(tail - 0.241) < 0.001 and round(56 * (2 + tail)) == 126 and round(63 * (2 + tail)) == 141
    space = _space("qwen3-30b", 64, 4096)
    assert space.spec["chunk_tokens"].values() == (0, 256)
    assert space.puts_per_peer(256) == 3 and space.group_values(chunk_tokens=256) == (0, 2)
    w = Workload("qwen3-30b", 4096, 8, 8)
    k = _knobs(256).replace(signalling="decoupled")
    fences = {g: predict("ndr-ibrc-h100x8", w, k.replace(group_size=g), phase="dispatch").fences for g in (0, 2, 4)}
    assert fences[2] != fences[0] and fences[4] == fences[0], fences  # 4 >= the most PUTs: one signal a peer


def test_the_group_grid_over_several_nodes_is_the_model_s_over_each_set_of_peers() -> None:
    """The model shares a rank's PUTs over the queue's peers and the node's NVLink peers apart (`charged_puts` per
    set). qwen3-30b at EP 16 (2 x 8), S = 64, chunk_tokens 16: E = 2.05 PUTs a peer, 16 over the 8 remote peers and
    14 over the 7 NVLink ones, 2 each; a space that took the 15 as one set (31 PUTs, one peer 3) offered group size 2,
    the same run as per peer in the model (equal fences and latency). With the model's sets (`ModelBackend.nvlink_apart`
    and the node's GPUs, as `tune` builds the space) the two agree."""
    from moetune.tuner.fabric_model.group_grids import group_grid
    from moetune.tuner.search.backends import TuneWorkload
    from moetune.tuner.search.model_backend import ModelBackend

    m = get_model("qwen3-30b")
    pol = load_policy("proxy:ibrc")
    pol = dataclasses.replace(pol, knobs={**pol.knobs, "chunk_tokens": KnobSpec("chunk_tokens", choices=(0, 16))})
    apart = ModelBackend("ndr-ibrc-h100x8").nvlink_apart(pol.defaults, TuneWorkload(m, 64, nodes=2, gpus_per_node=8))
    assert apart
    space = SearchSpace(pol, experts=m.experts, ep_size=16, tokens=64, topk=m.topk, gpus_per_node=8, nvlink_apart=apart)
    w = Workload("qwen3-30b", 64, 2, 8)
    k = _knobs(16).replace(signalling="decoupled")
    assert space.puts_per_peer(16) == group_grid("ndr-ibrc-h100x8", w, k) == 2
    assert space.group_values(chunk_tokens=16) == (0,)
    runs = {g: [(x.fences, x.latency_us) for x in (predict("ndr-ibrc-h100x8", w, k.replace(group_size=g), phase=ph)
                                                 for ph in ("dispatch", "combine"))] for g in (0, 2)}
    assert runs[2] == runs[0], runs  # group size 2 is per peer here: not offered
    # the one-set space (every peer the queue's, as the runtime's proxy sends them) offers it: the sets decide
    assert 2 in SearchSpace(pol, experts=m.experts, ep_size=16, tokens=64, topk=m.topk).group_values(chunk_tokens=16)
