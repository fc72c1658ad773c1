"""Wrong inputs on one rank: every rank raises a clear ValueError, nobody hangs, the group stays usable."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest

from moetune.runtime.testing.launch import launch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the cases by name
runtime_cases = importlib.import_module("runtime_cases")

EXPECT = {
    "x_shape": "x must have shape",
    "x_dtype": "x must have dtype",
    "idx_range": "out of range",
    "idx_negative": "out of range",
    "idx_shape": "topk_idx must have shape",
    "weights_shape": "topk_weights must have shape",
    "too_many": "max_tokens",
    "combine_shape": "expert_out must have shape",
    "x_grad": "x requires grad",
    "combine_grad": "expert_out requires grad",
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("dense", "transport"), [(False, "collective"), (True, "collective"), (False, "nvlink"),
                                                   (False, "nvlink_words")],
                         ids=["packed", "dense", "resident", "resident-count-words"])
def test_bad_input_on_one_rank_is_an_error_on_every_rank(dense: bool, transport: str) -> None:
    """resident: the one-sided transports' device-resident layout, through a gloo stand-in (GlooResident);
    resident-count-words: the same over a stand-in whose counts exchange is the kernels' (CountWordResident: a
    count outside 0..2^39-1 is refused, received as 0, and the next exchange raises OneSidedError). The status
    the input check sends there was the negated error code: refused, so the other ranks read 0 (no error) and
    raised OneSidedError in the exchange after, the bad rank too, and none a ValueError."""
    kinds = list(runtime_cases.BAD_INPUTS)
    t0 = time.monotonic()
    # A short process-group timeout: should anything hang, the collective raises instead of blocking.
    res = launch(runtime_cases.case_errors, 2, args=(kinds, 1, dense, transport), timeout_s=10, join_timeout_s=80)
    assert time.monotonic() - t0 < 80
    for rank, msgs in enumerate(res):
        for kind in kinds:
            msg = msgs[kind]
            assert msg != "NO ERROR", (rank, kind)
            took = float(msg.split("s ", 1)[0])
            assert took < 5.0, (rank, kind, msg)  # reported at once, not after a timeout
            if rank == 1:
                assert EXPECT[kind] in msg, (kind, msg)
            else:
                assert "rank 1" in msg or "rank(s) [1]" in msg, (kind, msg)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("dense", "transport"), [(False, "collective"), (True, "collective"), (False, "nvlink")],
                         ids=["packed", "dense", "resident"])
def test_an_unchecked_bad_expert_out_says_the_other_ranks_wait_for_the_timeout(dense: bool, transport: str) -> None:
    """With check_inputs=False no layout exchanges a status on the combine's path (the packed layout's counts
    exchange is the dispatch's, done before the experts run), so an expert_out refused on one rank raises there
    only, and the other ranks wait in their combine for the group's or the transport's timeout. That stays (making
    it an error everywhere at once is what check_inputs=True's tiny all-gather is for), but the refusal says so:
    it read like the every-rank error check_inputs gives. Here every rank passes a bad one (no rank waits)."""
    res = launch(runtime_cases.case_unchecked_bad_expert_out, 2, args=(dense, transport), timeout_s=10,
                 join_timeout_s=80)
    for rank, got in enumerate(res):
        msg = got["bad"]
        assert msg.startswith(f"EPBuffer.combine on rank {rank}: expert_out must have shape"), (rank, msg)
        assert "check_inputs=False" in msg and "other ranks are not told" in msg and "timeout" in msg, (rank, msg)
        assert got["after"] == "ok", (rank, got)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dense", [False, True], ids=["packed", "dense"])
def test_a_layer_input_that_wants_a_gradient_on_one_rank_is_an_error_on_every_rank(dense: bool) -> None:
    """MoELayer refuses an x that requires grad (it has no backward); at world > 1 through the EP buffer's input
    check, so the other ranks raise too instead of waiting in dispatch."""
    res = launch(runtime_cases.case_layer_grad, 2, args=(dense,), timeout_s=10, join_timeout_s=80)
    for rank, msgs in enumerate(res):
        for kind, msg in msgs.items():
            assert msg != "NO ERROR", (rank, kind)
            assert float(msg.split("s ", 1)[0]) < 5.0, (rank, kind, msg)
            # forward: the gate's weights are computed from x, so they want its gradient too
            assert ("x requires grad" in msg or "x and topk_weights require grad" in msg) if rank == 1 else \
                "rank 1" in msg, (rank, kind, msg)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dense", [False, True], ids=["packed", "dense"])
def test_layer_parameters_that_want_a_gradient_on_one_rank_are_an_error_on_every_rank(dense: bool) -> None:
    """A layer whose parameters require grad (`layer.requires_grad_()`) in grad mode came back detached (no backward):
    refused; at world > 1 through the dispatch's input check (EPBuffer.refuse_dispatch), so the other ranks raise at
    once instead of waiting in their dispatch."""
    res = launch(runtime_cases.case_layer_param_grad, 2, args=(dense,), timeout_s=10, join_timeout_s=80)
    for rank, msgs in enumerate(res):
        for kind, msg in msgs.items():
            assert msg != "NO ERROR", (rank, kind)
            assert float(msg.split("s ", 1)[0]) < 5.0, (rank, kind, msg)
            assert ("parameters w_gate_up, w_down and gate require grad" in msg) if rank == 1 else \
                ("rank 1" in msg and "parameters require grad" in msg), (rank, kind, msg)


@pytest.mark.timeout(60)
def test_ranks_with_different_knobs_refuse_to_build() -> None:
    res = launch(runtime_cases.case_knob_mismatch, 2, timeout_s=10, join_timeout_s=50)
    for msg in res:
        assert "differ from rank 0" in msg and "knobs" in msg


@pytest.mark.timeout(60)
def test_ranks_with_different_runtime_options_refuse_to_build() -> None:
    res = launch(runtime_cases.case_options_mismatch, 2, timeout_s=10, join_timeout_s=50)
    for msg in res:
        assert "differ from rank 0 in runtime options" in msg, msg


@pytest.mark.timeout(60)
def test_ranks_with_different_proxy_cpu_agree() -> None:
    """proxy_cpu only places a thread of each process (runtime/options.py PROCESS_LOCAL_OPTIONS): not compared."""
    assert launch(runtime_cases.case_proxy_cpu_differs, 2, timeout_s=10, join_timeout_s=50) == ["NO ERROR"] * 2


@pytest.mark.timeout(60)
def test_launch_reports_a_failing_rank_without_hanging() -> None:
    from moetune.runtime.testing.launch import LaunchError

    t0 = time.monotonic()
    with pytest.raises(LaunchError) as ei:
        launch(runtime_cases.case_crash_one, 2, timeout_s=5, join_timeout_s=45)
    assert time.monotonic() - t0 < 45
    assert "boom on rank 1" in str(ei.value)
