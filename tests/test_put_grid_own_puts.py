"""The proxy/ibgda PUT grid counts the PUTs a rank sends itself, and its study config names what decides the grid.

csrc/proxy_xchg.h produce_exchange loops over every rank, this one included: the own rows are chunking(X) PUTs whose
decoupled signals are grouped by group_size like a peer's, and the fabric model charges them (f7ddf1d: the expected
PUTs of a set of one, `phases.queued.charged_own_puts`). So `puts_charged_each_peer`, the one rule of the chunk grid
and the group bound, has them too.

Hand-computed case: 128 experts, top-8 (qwen3-30b), EP 4 on 2 x 2 GPUs of ndr-ibrc-h100x8, zipf:1.2, S = 4. PE 0
(dispatch's sender) is needed with p0 = 0.747: E[ceil(X / 2)] = 1.729 -> 2 own PUTs with chunk_tokens 2,
E[ceil(X / 3)] = 1.308 -> 1 with 3, while every peer is charged the same PUTs with 2 as with 3. Counting the peers
only, 3 was dropped as the same run as 2; the model prices 3 half a microsecond faster in dispatch (one own PUT
less)."""

from __future__ import annotations

import dataclasses
from math import comb

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.phases.queued import charged_own_puts, puts_charged_each_peer
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.routing import rank_hits
from moetune.tuner.search.backends import TuneWorkload
from moetune.tuner.search.model_backend import ModelBackend
from moetune.tuner.search.policy import KnobSpec, load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import study_config

PRESET = "ndr-ibrc-h100x8"


def _policy(chunks: tuple[int, ...]):
    pol = load_policy("proxy:ibrc")
    return dataclasses.replace(pol, knobs={**pol.knobs, "chunk_tokens": KnobSpec("chunk_tokens", choices=chunks)})


def test_the_hand_computation() -> None:
    p0 = float(rank_hits(128, 8, 1.2, 4)[0])
    assert p0 == pytest.approx(0.7472, abs=5e-5)

    def e(c: int) -> float:  # E[ceil(X / c)], X ~ Binomial(4, p0)
        return sum(comb(4, k) * p0**k * (1 - p0) ** (4 - k) * -(-k // c) for k in range(5))

    assert (e(2), e(3)) == (pytest.approx(1.7295, abs=5e-5), pytest.approx(1.3076, abs=5e-5))
    hits = rank_hits(128, 8, 1.2, 4)
    assert [charged_own_puts(hits, 0, 4, c)[1] for c in (2, 3)] == [round(e(2)), round(e(3))] == [2, 1]
    peers = [puts_charged_each_peer(hits, 4, 2, True, 4, c, own=False) for c in (2, 3)]
    assert peers[0] == peers[1]


def test_the_rule_has_the_own_puts_of_dispatch_and_combine() -> None:
    hits = rank_hits(128, 8, 1.2, 4)
    for c in (0, 2, 3):
        key = puts_charged_each_peer(hits, 4, 2, True, 4, c)
        # dispatch: the 3 peers, then PE 0 to itself; combine: the 3 peers, then the most needed PE to itself
        assert len(key) == 8
        assert (key[3], key[7]) == (charged_own_puts(hits, 0, 4, c)[1], charged_own_puts(hits, int(hits.argmax()), 4, c)[1])
        assert key[:3] + key[4:7] == puts_charged_each_peer(hits, 4, 2, True, 4, c, own=False)


def test_a_chunk_that_changes_only_the_own_puts_is_offered_and_priced_apart() -> None:
    m = get_model("qwen3-30b")
    pol = _policy((0, 2, 3))
    wl = TuneWorkload(model=m, tokens=4, nodes=2, gpus_per_node=2, routing="zipf:1.2")
    apart = ModelBackend(PRESET).nvlink_apart(pol.defaults, wl)
    space = SearchSpace(pol, experts=m.experts, ep_size=4, tokens=4, topk=m.topk, routing="zipf:1.2",
                        gpus_per_node=2, nvlink_apart=apart)
    assert space.spec["chunk_tokens"].values() == (0, 2, 3)
    # the model tells the three apart (3: one own PUT less than 2 in dispatch)
    lat = {c: predict(PRESET, Workload("qwen3-30b", 4, 2, 2, routing="zipf:1.2"),
                      Knobs(transport="proxy", fence_mode="proxy_drain", chunk_tokens=c), phase="dispatch").latency_us
           for c in (0, 2, 3)}
    assert len({round(v, 6) for v in lat.values()}) == 3, lat
    # a study of the peers-only grid (which offered 0 and 2) is not resumed with 3
    assert [c for c, _ in space._put_grid(own=False)] == [0, 2]
    assert space.grid_rule()["own_puts"] == "charged"


def test_a_grid_the_own_puts_do_not_change_keeps_its_study_config() -> None:
    m = get_model("qwen3-30b")
    space = SearchSpace(load_policy("proxy:ibrc"), experts=m.experts, ep_size=8, tokens=1024, topk=m.topk)
    assert space.grid_rule() == {"put_grid": "distinct_charged_puts"}


def test_the_peer_sets_of_a_preset_are_in_the_study_config() -> None:
    """qwen3-30b at S = 64 on 2 x 8 GPUs of ndr-ibrc-h100x8 (tests/test_put_grid_model_peer_sets.py): the preset's
    NVLink set apart offers chunk_tokens up to 16, one set of peers 32 too. The same policy, workload and backend
    (a ModelBackend given a predictor on the preset has the preset's label and settings, and one set) gave the same
    study config, so a study of either grid was resumed with the other's choices."""
    m = get_model("qwen3-30b")
    pol = _policy((0, 1, 2, 4, 8, 16, 32))
    wl = TuneWorkload(model=m, tokens=64, nodes=2, gpus_per_node=8)
    be = ModelBackend(PRESET)
    assert be.nvlink_apart(pol.defaults, wl)

    def space(apart: bool) -> SearchSpace:
        return SearchSpace(pol, experts=m.experts, ep_size=16, tokens=64, topk=m.topk, gpus_per_node=8,
                           nvlink_apart=apart)

    sets, one = space(True), space(False)
    assert sets.spec["chunk_tokens"].values() != one.spec["chunk_tokens"].values()
    assert study_config(sets, be, wl) != study_config(one, be, wl)
    assert sets.grid_rule()["peer_sets"] == "nvlink_apart_8_per_node"
    # the one-set grid's config is as before (its studies resume), and so is a one-node group's (one set anyway)
    assert one.grid_rule() == {"put_grid": "distinct_charged_puts"}
    node = SearchSpace(pol, experts=m.experts, ep_size=8, tokens=64, topk=m.topk, gpus_per_node=8, nvlink_apart=True)
    assert "peer_sets" not in node.grid_rule()
    # the peer sets are named at every bucket, so the neighbouring bucket's study is found
    assert all(SearchSpace(pol, experts=m.experts, ep_size=16, tokens=s, topk=m.topk, gpus_per_node=8,
                           nvlink_apart=True).grid_rule().get("peer_sets") == "nvlink_apart_8_per_node"
               for s in (16, 256, 4096))
