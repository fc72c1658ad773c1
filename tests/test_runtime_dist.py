"""EPBuffer/MoELayer over 2 and 4 gloo ranks (spawned, loopback, bounded timeouts) vs the dense reference."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from moetune.runtime.fp8 import FP8_LAYER_REL_ERR_BOUND
from moetune.runtime.testing.launch import launch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the cases by name
runtime_cases = importlib.import_module("runtime_cases")

FP32_BOUND = 1e-5
SMALL = "custom:64,32,8,2,float32"


def _check(results: list[list[dict]], bound: float = FP32_BOUND) -> None:
    for rank, rows in enumerate(results):
        for r in rows:
            assert r["shape_ok"], (rank, r["cfg"])
            assert r["err"] < bound, (rank, r["cfg"], r["err"])
            assert r["rows"] == r["expected_rows"], (rank, r["cfg"], r["rows"], r["expected_rows"])
            assert r["pairs"] == r["expected_pairs"], (rank, r["cfg"], r["pairs"], r["expected_pairs"])
            if "dense" in r["cfg"] and r["cfg"]["dense"] is not None:
                assert r["dense"] == r["cfg"]["dense"]
            if r["cfg"].get("compression", "none") == "none":
                assert r["roundtrip_err"] < FP32_BOUND, (rank, r["cfg"], r["roundtrip_err"])


def _same_outputs(results: list[list[dict]]) -> None:
    """On each rank every config gave the first one's output: configs that change only the schedule."""
    for rank_rows in results:
        outs = [r["out"] for r in rank_rows]
        for o in outs[1:]:
            assert torch.allclose(o, outs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_two_ranks_matches_dense_reference_all_cases() -> None:
    configs = [
        {"model": SMALL, "tokens": 48},
        {"model": SMALL, "tokens": 48, "routing": "zipf:1.5", "seed": 1},
        # every token's experts live on rank 0: rank 1 and experts 4..7 receive nothing
        {"model": SMALL, "tokens": 20, "routing": "rank0:2", "seed": 2},
        {"model": SMALL, "tokens": 0},
        {"model": SMALL, "tokens": [0, 9]},  # S = 0 on one rank only
        {"model": SMALL, "tokens": 1},
        {"model": "custom:64,32,8,1,float32", "tokens": 33, "seed": 3},  # top-1
        {"model": "custom:64,32,16,8,float32", "tokens": 33, "seed": 4},  # top-8
        {"model": "custom:64,32,16,8,float32", "tokens": 1, "seed": 5, "depth": 4},  # fewer tokens than chunks
        {"model": SMALL, "tokens": [17, 40], "routing": "zipf:1.5", "seed": 6, "depth": 2},
    ]
    # both layouts: packed (counts first, only routed rows travel) and dense (all-gather / reduce-scatter)
    configs = [dict(c, dense=d) for d in (False, True) for c in configs]
    res = launch(runtime_cases.case_equivalence, 2, args=(configs,), timeout_s=20, join_timeout_s=55)
    _check(res)
    # rank 1 and half of the experts got nothing in the rank0 case
    assert res[1][2]["rows"] == 0 and res[1][2]["pairs"] == 0
    assert res[0][2]["rows"] > 0
    n = len(configs) // 2
    assert res[1][n + 2]["pairs"] == 0 and res[1][n + 2]["rows"] == 2 * 64  # dense: empty slots arrive
    # the layouts agree with each other, not only with the reference
    for rank_rows in res:
        for a, b in zip(rank_rows[:n], rank_rows[n:], strict=True):
            assert torch.allclose(a["out"], b["out"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_device_resident_layout_matches_dense_reference() -> None:
    """The one-sided transports' layout (counts kept on the device, capacity-padded receive view whose
    rows past the live ones are random bytes), through GlooResident on 2 and 4 gloo ranks."""
    configs = [
        {"model": SMALL, "tokens": 48},
        {"model": SMALL, "tokens": 48, "routing": "zipf:1.5", "seed": 1},
        {"model": SMALL, "tokens": 20, "routing": "rank0:2", "seed": 2},
        {"model": SMALL, "tokens": 0},
        {"model": SMALL, "tokens": [0, 9]},
        {"model": SMALL, "tokens": 1},
        {"model": "custom:64,32,8,1,float32", "tokens": 33, "seed": 3},
        {"model": "custom:64,32,16,8,float32", "tokens": 64, "seed": 4},  # top-8, S = max_tokens
    ]
    configs = [dict(c, transport="nvlink") for c in configs]
    res = launch(runtime_cases.case_equivalence, 2, args=(configs,), timeout_s=20, join_timeout_s=55)
    _check(res)
    for rank_rows in res:
        for r in rank_rows:
            assert r["resident"] and r["recv_view_rows"] == 2 * 64  # world x max_tokens (all S <= 64 here)
    assert res[1][2]["rows"] == 0 and res[1][2]["pairs"] == 0  # rank 1 receives nothing in the rank0 case
    res4 = launch(runtime_cases.case_equivalence, 4, args=([dict(configs[1], tokens=[5, 0, 30, 17])],),
                  timeout_s=20, join_timeout_s=55)
    _check(res4)


@pytest.mark.timeout(60)
def test_pipeline_depths_give_equal_results() -> None:
    base = {"model": "custom:64,32,16,4,float32", "tokens": [37, 29], "routing": "zipf:1.5", "seed": 7}
    configs = [dict(base, depth=d, dense=dense) for dense in (False, True) for d in (1, 2, 4)]
    configs += [dict(base, depth=4, channels=2, dense=True), dict(base, depth=3, channels=2, dense=False)]
    res = launch(runtime_cases.case_equivalence, 2, args=(configs,), timeout_s=20, join_timeout_s=55)
    _check(res)
    _same_outputs(res)


@pytest.mark.timeout(80)
def test_four_ranks_matches_dense_reference() -> None:
    configs = [
        {"model": "custom:64,32,16,4,float32", "tokens": 30, "routing": "zipf:1.5", "seed": 8, "depth": 2},
        {"model": "custom:64,32,16,8,float32", "tokens": [5, 0, 1, 12], "seed": 9},
        {"model": "custom:64,32,16,1,float32", "tokens": 16, "routing": "rank0:4", "seed": 10, "dense": False},
        {"model": "custom:64,32,16,8,float32", "tokens": [5, 0, 1, 12], "seed": 9, "dense": True, "depth": 2},
        {"model": "custom:64,32,16,4,float32", "tokens": 30, "routing": "zipf:1.5", "seed": 8, "dense": False},
    ]
    res = launch(runtime_cases.case_equivalence, 4, args=(configs,), timeout_s=30, join_timeout_s=75)
    _check(res)
    assert all(res[r][2]["rows"] == 0 for r in (1, 2, 3))


@pytest.mark.timeout(60)
def test_fp8_dispatch_within_documented_bound() -> None:
    configs = [
        {"model": "custom:128,64,8,4,float32", "tokens": 64, "compression": "fp8_e4m3", "seed": 11},
        {"model": "custom:128,64,8,4,float32", "tokens": 64, "compression": "fp8_e4m3", "seed": 12,
         "routing": "zipf:1.5", "depth": 2},
        {"model": "custom:128,64,8,4,float32", "tokens": [64, 40], "compression": "fp8_e4m3", "seed": 13,
         "routing": "zipf:1.5", "depth": 2, "dense": True},
        {"model": "custom:128,64,8,4,float32", "tokens": 64, "compression": "fp8_e4m3", "seed": 14,
         "dense": False},
    ]
    res = launch(runtime_cases.case_equivalence, 2, args=(configs,), timeout_s=20, join_timeout_s=55)
    _check(res, FP8_LAYER_REL_ERR_BOUND)
    # fp8 really is lossy (the comparison is not vacuous)
    assert max(r["err"] for rows in res for r in rows) > 1e-4


@pytest.mark.timeout(60)
def test_uneven_chunks_and_shared_lanes_give_equal_results() -> None:
    """The option chunk_weights (MOETUNE_EP_CHUNK_WEIGHTS: uneven dense chunks) and the knob combine_lanes=shared
    (combine on the dispatch communicators) change only the schedule: the same results as one chunk."""
    base = {"model": "custom:64,32,16,4,float32", "tokens": [37, 29], "routing": "zipf:1.5", "seed": 7}
    configs = [dict(base, depth=1, dense=True)]
    configs += [dict(base, depth=4, dense=dense, channels=ch, combine_lanes="shared")
                for dense in (True, False) for ch in (1, 2)]
    res = launch(runtime_cases.case_equivalence, 2, args=(configs,), timeout_s=20, join_timeout_s=55,
                 env={"MOETUNE_EP_CHUNK_WEIGHTS": "1,3,2,1"})
    _check(res)
    _same_outputs(res)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dense", [True, False])
def test_rows_without_a_local_slot_add_nothing_in_either_layout(dense: bool) -> None:
    """The dense layout's reduce-scatter added every received row's expert output, also the rows of tokens with no
    expert on that rank (documented as ignored): an engine's expert code that left anything there (a bias, a shared
    term, uninitialised memory) corrupted the output, in the dense layout only. Both layouts now give 1."""
    res = launch(runtime_cases.case_rows_without_a_local_slot, 2, args=(dense,))
    assert res == [[1.0, 1.0], [1.0, 1.0]], res


def test_unchecked_bad_expert_ids_behave_as_the_docs_say() -> None:
    """docs/runtime.md said that with check_inputs=False only the rank with the wrong input knows and the others fail
    at the timeout; for an expert id out of range that holds in no layout: the packed layout refuses it on every rank
    (its counts exchange checks every dispatch), the dense one drops that share of the token silently. The docs (and
    EPBuffer's check_inputs doc) now say both."""
    assert launch(runtime_cases.case_unchecked_bad_ids, 2, args=(False,)) == [("err", 0.0), ("err", 0.0)]
    (s0, e0), (s1, e1) = launch(runtime_cases.case_unchecked_bad_ids, 2, args=(True,))
    assert (s0, s1) == ("ok", "ok") and e0 < 1e-5 and e1 > 1e-3  # rank 1's token 0 lost a share, no error anywhere
    text = " ".join((Path(__file__).parents[1] / "docs" / "runtime.md").read_text().split())
    assert "With `check_inputs=False` the packed layout still raises on every rank" in text
    assert "an expert id out of range is not seen at all there" in text and "silently missing" in text
    from moetune.runtime import EPBuffer

    doc = " ".join((EPBuffer.__doc__ or "").split())
    assert "never see an expert id out of range" in doc
