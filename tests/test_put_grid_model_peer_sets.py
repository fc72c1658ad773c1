"""The proxy/ibgda PUT grid asks the fabric model's own charge (`phases.queued.puts_charged_each_peer`), so a chunk
the model prices as another is not offered and one it tells apart is.

The model charges each set of peers (the queue's, and on a preset with NVLink the node's own peers) its own rounded
sum of E[ceil(X / chunk_tokens)], X ~ Binomial(S, p) rows a peer gets. The grid copied the rule with all the other
ranks as one set, peers x E rounded, and so disagreed with the model wherever the rounding of one set differs from
that of the two. Both cases on ndr-ibrc-h100x8 (2 x 8 GPUs: 8 remote peers, 7 NVLink ones), uniform routing:

* qwen3-30b at S = 64, p = 1 - C(120, 8) / C(128, 8) = 0.412 (26.4 rows a peer): chunk_tokens 32 is one PUT a peer
  unless X > 32, P = 0.0612. One set: 15 x 1.0612 = 15.92 -> 16 PUTs, one more than chunk_tokens 0's 15, so 32 was
  offered; the model's sets: 8 x 1.0612 = 8.49 -> 8 and 7 x 1.0612 = 7.43 -> 7, the PUTs of chunk_tokens 0: it prices
  32 as 0 (a trial spent on a run it cannot tell apart).
* custom:1024,512,64,4 at S = 4, p = 1 - C(60, 4) / C(64, 4) = 0.2325: chunk_tokens 0 gives E = P(X >= 1) = 0.6531,
  chunk_tokens 2 E = 0.6946. One set: 15 x 0.6531 = 9.80 and 15 x 0.6946 = 10.42 both -> 10, so 2 was dropped as the
  same run as 0; the model's remote set: 8 x 0.6531 = 5.22 -> 5 against 8 x 0.6946 = 5.56 -> 6 PUTs: it tells 2
  apart (one PUT more in dispatch and in combine)."""

from __future__ import annotations

import dataclasses
from math import comb

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.wire_rows import expected_puts
from moetune.tuner.search.backends import TuneWorkload
from moetune.tuner.search.model_backend import ModelBackend
from moetune.tuner.search.policy import KnobSpec, load_policy
from moetune.tuner.search.space import SearchSpace

PRESET = "ndr-ibrc-h100x8"
WIDE = (0, 1, 2, 4, 8, 16, 32)


def _space(model: str, tokens: int) -> SearchSpace:
    pol = load_policy("proxy:ibrc")
    pol = dataclasses.replace(pol, knobs={**pol.knobs, "chunk_tokens": KnobSpec("chunk_tokens", choices=WIDE)})
    m = get_model(model)
    # as `tune` builds it for the preset: its GPUs per node, and the backend's word on the NVLink set
    apart = ModelBackend(PRESET).nvlink_apart(pol.defaults, TuneWorkload(model=m, tokens=tokens, nodes=2,
                                                                         gpus_per_node=8))
    assert apart
    return SearchSpace(pol, experts=m.experts, ep_size=16, tokens=tokens, topk=m.topk, gpus_per_node=8,
                       nvlink_apart=apart)


def _latency(model: str, tokens: int, chunk: int) -> float:
    k = Knobs(transport="proxy", fence_mode="proxy_drain", chunk_tokens=chunk)
    return predict(PRESET, Workload(model, tokens, 2, 8), k).latency_us


def test_the_hand_computation() -> None:
    p = 1 - comb(120, 8) / comb(128, 8)
    tail = expected_puts(p, 64, 32) - 1  # P(X > 32): ceil(X / 32) is 1 for 1 <= X <= 32, 2 above
    assert tail == pytest.approx(0.0612, abs=5e-5)
    assert (round(15 * (1 + tail)), round(8 * (1 + tail)), round(7 * (1 + tail))) == (16, 8, 7)
    assert expected_puts(p, 64, 0) == pytest.approx(1.0, abs=1e-9 + (1 - p) ** 64)
    q = 1 - comb(60, 4) / comb(64, 4)
    e0, e2 = expected_puts(q, 4, 0), expected_puts(q, 4, 2)
    assert (e0, e2) == (pytest.approx(0.6531, abs=5e-5), pytest.approx(0.6946, abs=5e-5))
    assert (round(15 * e0), round(15 * e2)) == (10, 10) and (round(8 * e0), round(8 * e2)) == (5, 6)


@pytest.mark.parametrize(("model", "tokens", "offered"), [("qwen3-30b", 64, (0, 1, 2, 4, 8, 16)),
                                                          ("custom:1024,512,64,4", 4, (0, 1, 2))])
def test_the_grid_offers_what_the_model_tells_apart(model: str, tokens: int, offered: tuple[int, ...]) -> None:
    space = _space(model, tokens)
    assert space.spec["chunk_tokens"].values() == offered
    lat = {c: _latency(model, tokens, c) for c in WIDE if c <= tokens or c in offered}
    # every offered chunk is its own run in the model; every chunk left out is priced as an offered one
    assert len({round(lat[c], 6) for c in offered}) == len(offered), lat
    for c in set(lat) - set(offered):
        assert any(lat[c] == pytest.approx(lat[o], rel=1e-12) for o in offered), (c, lat)


def test_a_predictor_or_a_runtime_backend_charges_one_set() -> None:
    """Without a preset nothing is known of NVLink peers: every peer is the queue's, as the runtime's proxy sends
    them (the grid as before, the model's rounding of one set)."""
    m = get_model("qwen3-30b")
    be = ModelBackend(predictor=lambda k, w: 1.0)
    assert not be.nvlink_apart(load_policy("proxy:ibrc").defaults, TuneWorkload(model=m, tokens=64, nodes=2,
                                                                                gpus_per_node=8))
    pol = load_policy("proxy:ibrc")
    pol = dataclasses.replace(pol, knobs={**pol.knobs, "chunk_tokens": KnobSpec("chunk_tokens", choices=WIDE)})
    one = SearchSpace(pol, experts=m.experts, ep_size=16, tokens=64, topk=m.topk)
    assert 32 in one.spec["chunk_tokens"].values()  # 16 PUTs over the 15 peers as one set, not 15


def test_tune_builds_the_space_with_the_presets_peer_sets(tmp_path, monkeypatch) -> None:
    """`tune` on a preset hands the space its GPUs per node and the backend's NVLink set, so the grid it searches is
    the one above (a space built without them charges one set)."""
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search import tune as tune_mod
    from moetune.tuner.search.tune import tune_profiles_detailed
    from moetune.tuner.store.store import Store

    seen: list[SearchSpace] = []

    class Recording(SearchSpace):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            seen.append(self)

    monkeypatch.setattr(tune_mod, "SearchSpace", Recording)
    with Store(tmp_path / "moetune.db") as store:  # closed after: no SQLite connection left to the GC
        tune_profiles_detailed(store, None, models=[MODELS["qwen3-30b"]], tokens=[64], backend="model", preset=PRESET,
                               families=["proxy:ibrc"], trials=1, nodes=2,
                               storage=f"sqlite:///{tmp_path / 'studies.db'}")
    assert [(s.ep_size, s.gpus_per_node, s.nvlink_apart) for s in seen] == [(16, 8, True)]
