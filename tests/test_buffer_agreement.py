"""EPBuffer's construction and pipelined_moe raise on every rank when one rank's arguments or expert_fn are wrong: the
buffer's first collective is one fixed-shape agreement (knobs given or not, a failed local check's code), and
pipelined_moe agrees per chunk on expert_fn's output (with check_inputs). A transport the knobs allow but this
runtime lacks (ibgda) is a KnobError naming the knob."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from moetune.runtime import EPBuffer, Knobs, get_model
from moetune.runtime.knobs import KnobError, default_knobs
from moetune.runtime.pipeline import pipelined_moe, weighted_rows
from moetune.runtime.testing.launch import launch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the cases by name
cases = importlib.import_module("buffer_agreement_ranks")

pytestmark = pytest.mark.usefixtures("autoload_off")

# rank 1's refused argument → (the error rank 1 gets, a part of its message)
OWN_ERRORS = {"expected_tokens": ("ValueError", "expected_tokens=64 is more than max_tokens=32"),
              "max_tokens": ("TypeError", "max_tokens must be an int"),
              "dense": ("ValueError", "dense=True needs a collective transport"),
              "transport": ("KnobError", "knob transport: 'ibgda' is not available in this runtime"),
              "device": ("ValueError", "EPBuffer: device='no-such-device': "),  # torch's RuntimeError, named
              "meta": ("ValueError", "device must be a cpu or cuda device, got meta"),  # knocked the group out of step
              # its constructor failed on that rank alone, the other waiting in the constructor's collectives
              "unavailable": ("KnobError", "transport 'nvlink' cannot run here: not on this rank (test double)")}
# rank 1's expert_fn fault → a part of the message rank 1 gets
EXPERT_FN_ERRORS = {"shape": "expert_fn's output must have shape", "dtype": "expert_fn's output must have dtype "
                    "torch.float32", "device": "expert_fn's output must be on cpu", "raises": "expert kernel failed"}
LAYOUTS = {"packed": ("collective", False), "dense": ("collective", True), "resident": ("nvlink", False)}


# One launch per group of cases: spawning two ranks is most of a case's time. A short process-group timeout: a rank
# left waiting in a collective raises after 10 s instead of hanging, and _at_once tells it from an agreed error.
@pytest.fixture(scope="module")
def construction() -> list[dict[str, Any]]:
    return launch(cases.case_construction, 2, args=(list(OWN_ERRORS),), timeout_s=10, join_timeout_s=100,
                  env={"MOETUNE_AUTOLOAD": "0"})


@pytest.fixture(scope="module")
def pipelined() -> dict[str, list[dict[str, Any]]]:
    res = launch(cases.case_pipelined, 2, args=(list(LAYOUTS.values()), list(EXPERT_FN_ERRORS)), timeout_s=10,
                 join_timeout_s=100)
    return {name: [res[0][i], res[1][i]] for i, name in enumerate(LAYOUTS)}


@pytest.fixture(scope="module")
def layer_arguments() -> list[dict[str, Any]]:
    return launch(cases.case_layer_arguments, 2, timeout_s=10, join_timeout_s=100, env={"MOETUNE_AUTOLOAD": "0"})


def _at_once(outcome: tuple[str, str, float]) -> None:
    assert outcome[2] < 5.0, outcome  # an error at once, not a collective's timeout


def _raised(outcomes: list[dict[str, Any]], case: str, *wanted: tuple[str, str]) -> None:
    """Rank r's outcome of `case` is the exception wanted[r][0], its message holding wanted[r][1], raised at once."""
    for rank, (kind, text) in enumerate(wanted):
        got = outcomes[rank][case]
        assert got[0] == kind and text in got[1], (case, rank, got)
        _at_once(got)


@pytest.mark.timeout(120)
def test_knobs_none_on_one_rank_is_an_error_on_every_rank(construction: list[dict[str, Any]]) -> None:
    for res in construction:
        kind, msg, _ = res["none"]
        assert kind == "ValueError", res["none"]
        assert "differ from rank 0 in knobs (given on rank(s) [1], None on the others)" in msg, msg
        _at_once(res["none"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arg", list(OWN_ERRORS))
def test_a_local_check_failing_on_one_rank_is_an_error_on_every_rank(construction: list[dict[str, Any]],
                                                                     arg: str) -> None:
    exc, text = OWN_ERRORS[arg]
    kind0, msg0, _ = construction[0]["local"][arg]
    named = {"meta": "device", "unavailable": "transport"}.get(arg, arg)  # the argument rank 1 got wrong
    assert kind0 == "ValueError" and f"refused on another rank (rank 1: {named})" in msg0, msg0
    kind1, msg1, _ = construction[1]["local"][arg]
    assert kind1 == exc and text in msg1, (kind1, msg1)
    _at_once(construction[0]["local"][arg])
    _at_once(construction[1]["local"][arg])


@pytest.mark.timeout(120)
def test_loaded_knobs_failing_on_one_rank_is_an_error_on_every_rank(construction: list[dict[str, Any]]) -> None:
    _raised(construction, "loaded", ("ValueError", "(rank 1: transport)"), ("ImportError", "no_such_module_here"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_bad_expert_fn_on_one_rank_is_an_error_on_every_rank(pipelined: dict[str, list[dict[str, Any]]],
                                                                layout: str) -> None:
    r0, r1 = pipelined[layout]
    for fault, text in EXPERT_FN_ERRORS.items():
        assert r0[fault][0] == "ValueError", (fault, r0[fault])
        assert "pipelined_moe on rank 0: expert_fn failed or returned wrong rows on rank(s) [1]" in r0[fault][1]
        assert text in r1[fault][1], (fault, r1[fault])
        _at_once(r0[fault])
        _at_once(r1[fault])
    assert r0["after"] and r1["after"]  # the group still works and gives what dispatch/combine give


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["packed", "dense"])
def test_moe_layers_own_experts_cost_no_per_chunk_sync(pipelined: dict[str, list[dict[str, Any]]],
                                                        layout: str) -> None:
    """The per-chunk agreement is one all-gather and host sync per chunk (2 chunks here), which undoes the overlap
    the pipeline is for; MoELayer calls pipelined_moe with agree=False (its own experts return the right rows), so
    its pipelined path syncs no more than before the agreement existed."""
    agreed, layer = pipelined[layout][0]["gathers"]
    assert agreed == 2 and layer == 0, (agreed, layer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_explicit_agree_holds_without_check_inputs(pipelined: dict[str, list[dict[str, Any]]],
                                                      layout: str) -> None:
    r0, r1 = (r["agree_unchecked"] for r in pipelined[layout])
    assert r0[0] == "ValueError" and "on rank(s) [1]" in r0[1], r0
    assert r1[0] != "NO ERROR", r1
    _at_once(r0)


def test_unimplemented_transport_is_a_knob_error() -> None:
    with pytest.raises(KnobError, match=r"^knob transport: 'ibgda' is not available in this runtime \(registered: "
                                        r"collective, ") as e:
        EPBuffer(knobs=default_knobs("ibgda"), model=get_model("custom:256,128,8,2"), max_tokens=16, device="cpu")
    assert e.value.knobs == ("transport",)


@pytest.mark.parametrize("check_inputs", [True, False])
def test_expert_fn_output_on_another_device_is_refused(check_inputs: bool) -> None:
    buf = EPBuffer(knobs=Knobs(pipeline_depth=2), model=get_model("custom:64,32,8,2,float32"), max_tokens=16,
                   device="cpu", check_inputs=check_inputs)
    x, idx, w = torch.randn(8, 64), torch.randint(0, 8, (8, 2)), torch.rand(8, 2)

    def on_meta(recv_x: torch.Tensor, meta: object) -> torch.Tensor:
        return torch.empty(recv_x.shape, dtype=recv_x.dtype, device="meta")

    with pytest.raises(ValueError, match=r"^pipelined_moe on rank 0: expert_fn's output must be on cpu, got meta"):
        pipelined_moe(buf, x, idx, w, on_meta)
    assert pipelined_moe(buf, x, idx, w, weighted_rows).shape == (8, 64)


@pytest.mark.timeout(120)
def test_a_handle_of_another_buffer_is_refused_on_every_rank() -> None:
    res = launch(cases.case_foreign_handle, 2, timeout_s=10, join_timeout_s=60, env={"MOETUNE_AUTOLOAD": "0"})
    assert res[1][0] == "ValueError" and "handle was returned by another EPBuffer's dispatch" in res[1][1], res[1]
    assert res[0][0] == "ValueError" and "invalid expert_out on rank(s) [1]" in res[0][1], res[0]
    _at_once(res[0])
    _at_once(res[1])


@pytest.mark.timeout(120)
def test_extra_communicators_keep_the_groups_timeout() -> None:
    """channels > 1 (and pipeline chunks on them) waited on torch's default timeout (30 min for gloo), not the
    group's: a peer that stopped mid-exchange held the other rank that long."""
    res = launch(cases.case_channel_timeouts, 2, timeout_s=7, join_timeout_s=60, env={"MOETUNE_AUTOLOAD": "0"})
    for timeouts in res:
        assert len(timeouts) == 3 and all(t == 7.0 for t in timeouts if t is not None), timeouts
        assert timeouts[0] is not None, timeouts  # this torch says (else the check above proves nothing)


@pytest.mark.timeout(120)
def test_moe_layers_with_other_seeds_on_one_rank_are_an_error_on_every_rank(
        layer_arguments: list[dict[str, Any]]) -> None:
    """Ranks given other seeds would build different gates and experts, and the layer would run with wrong outputs:
    every rank raises instead."""
    for res in layer_arguments:
        kind, msg, _ = res["seed"]
        assert kind == "ValueError" and "different seeds ([0, 7], by rank)" in msg, res["seed"]
        _at_once(res["seed"])


@pytest.mark.timeout(120)
def test_an_engine_refused_on_one_rank_is_an_error_on_every_rank(layer_arguments: list[dict[str, Any]]) -> None:
    """Rank 0 must raise too when rank 1 raises MegakernelUnavailable: otherwise it waits in its first dispatch."""
    _raised(layer_arguments, "engine", ("ValueError", "the layer was refused on rank(s) [1]"),
            ("MegakernelUnavailable", "world 1"))


@pytest.mark.timeout(120)
def test_a_layer_argument_refused_on_one_rank_is_an_error_on_every_rank(layer_arguments: list[dict[str, Any]]) -> None:
    """Rank 0 must raise too when rank 1 raises before the buffer's agreement: otherwise it waits in that agreement
    until the group's timeout."""
    _raised(layer_arguments, "argument", ("ValueError", "refused on another rank (rank 1: layer arguments)"),
            ("TypeError", "max_tokens must be an int"))
    # with a given buffer the first collective is the layer's own agreement
    _raised(layer_arguments, "buffer", ("ValueError", "the layer was refused on rank(s) [1]"),
            ("ValueError", "max_tokens 8 vs the buffer's 16"))


@pytest.mark.timeout(120)
def test_a_buffer_given_on_one_rank_only_is_an_error_on_every_rank(layer_arguments: list[dict[str, Any]]) -> None:
    """The layer's agreement has the buffer agreement's shape, marked, so the rank given a buffer and the other run
    the same all-gather: a 2-wide one against a 12-wide one makes gloo abort a process while the other reads the row
    as "knobs=None". A `buffer` that is no EPBuffer is an error on every rank, not on its rank alone."""
    _raised(layer_arguments, "buffer_on_one", ("ValueError", "rank 1: buffer (that rank's layer was given one"),
            ("ValueError", "rank(s) [0] built their own EPBuffer where this rank's layer was given one"))
    not_one = ("TypeError", "buffer must be an EPBuffer or None")
    _raised(layer_arguments, "not_a_buffer", ("ValueError", "rank 1: layer arguments"), not_one)
    _raised(layer_arguments, "not_a_buffer_given", ("ValueError", "the layer's arguments were refused on rank(s) [1]"),
            not_one)


@pytest.mark.timeout(120)
def test_a_layer_failing_to_build_its_weights_on_one_rank_is_an_error_on_every_rank(
        layer_arguments: list[dict[str, Any]]) -> None:
    """Rank 0 must raise too when rank 1 raises while building its experts: otherwise it waits in the layer's
    agreement until the timeout."""
    _raised(layer_arguments, "weights_fail", ("ValueError", "the layer was refused on rank(s) [1]"),
            ("RuntimeError", "out of memory (simulated)"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2])
def test_a_rank_out_of_step_is_an_error_on_every_rank(world: int) -> None:
    """A rank that raised between its dispatch and its combine, caught it and dispatched again, while the others
    combine: both sides ran their input checks' collectives (of other kinds), every rank waited the group's timeout
    and got gloo's 'Timed out waiting', or without a check gloo aborted. The combine's check now runs the dispatch
    check's collective, marked, so every rank raises at once, naming the ranks out of step; the group still works."""
    layouts = [LAYOUTS["packed"], LAYOUTS["dense"]]
    res = launch(cases.case_out_of_step, world, args=(layouts,), timeout_s=10, join_timeout_s=100,
                 env={"MOETUNE_AUTOLOAD": "0"})
    for i, layout in enumerate(("packed", "dense")):
        one = res[1][i]["step"]
        assert one[0] == "ValueError" and "out of step" in one[1] and "called combine" in one[1], (layout, one)
        _at_once(one)
        for r in (0, *range(2, world)):
            got = res[r][i]["step"]
            assert got[0] == "ValueError" and "out of step with rank(s) [1]" in got[1], (layout, r, got)
            assert "called dispatch" in got[1], (layout, r, got)
            _at_once(got)
        assert all(res[r][i]["after"] == (8, 64) for r in range(world)), (layout, res)
    # ranks calling different buffers (dense: prefill on some, decode on the others): gloo aborted the process whose
    # all-gather of the rows got more bytes than its buffer holds; now every rank raises naming them
    for r in range(world):
        got = res[r][2]["step"]
        assert got[0] == "ValueError" and "called another EPBuffer" in got[1], (r, got)
        assert f"(max_tokens {[32, 16, *[32] * (world - 2)]}, by rank)" in got[1], (r, got)
        _at_once(got)
        assert res[r][2]["after"] == (8, 64), res[r]


@pytest.mark.timeout(120)
def test_a_layer_whose_weights_changed_on_one_rank_is_an_error_on_every_rank(
        layer_arguments: list[dict[str, Any]]) -> None:
    """Rank 1's layer was made .double() after it was built: its forward refused the weights before the dispatch, on
    that rank alone, and rank 0 waited in the dispatch until the group's timeout. Rank 1 now takes part in the
    dispatch's input check with its refusal; afterwards the layer (made .float() again) runs on every rank."""
    _raised(layer_arguments, "weights_changed", ("ValueError", "reported by rank 1: the layer's weights are not"),
            ("ValueError", "MoELayer: the layer runs torch.float32 w_gate_up"))
    assert [r["weights_changed_after"] for r in layer_arguments] == [(8, 64), (8, 64)]


@pytest.mark.timeout(120)
def test_a_layers_experts_failing_on_one_rank_is_an_error_on_every_rank(layer_arguments: list[dict[str, Any]]) -> None:
    """Rank 1's experts raise between its dispatch and its combine (out of memory where the routing sent it the most
    rows): rank 0 waited in its combine until the group's timeout. With check_inputs rank 1 now takes part in the
    combine's input check with a refusal, so rank 0 raises at once; afterwards the layer runs on every rank."""
    _raised(layer_arguments, "experts_fail", ("ValueError", "EPBuffer.combine on rank 0: invalid expert_out on rank(s) [1]"),
            ("RuntimeError", "out of memory (simulated)"))
    assert [r["experts_fail_after"] for r in layer_arguments] == [(8, 64), (8, 64)]


@pytest.mark.timeout(120)
def test_ranks_calling_other_buffers_meet_where_the_rows_move_on_each_buffers_own_communicator() -> None:
    """The dense status (with max_tokens) must pair across two buffers: host_staged's copy-engine gather, which it
    went through, moves between one buffer's staging rings only, so a rank on the decode buffer and one on the
    prefill buffer waited for each other until the timeout (on a GPU the wait's watchdog, then the uninitialised
    status read as codes). Modelled on CPU by a transport whose dense collectives run on a gloo group of each
    buffer's own: the status now goes over the EP group, and every rank raises at once, naming them."""
    res = launch(cases.case_other_buffers_own_lanes, 2, timeout_s=10, join_timeout_s=100,
                 env={"MOETUNE_AUTOLOAD": "0"})
    for r in range(2):
        got = res[r]["step"]
        assert got[0] == "ValueError" and "called another EPBuffer" in got[1], (r, got)
        assert "(max_tokens [32, 16], by rank)" in got[1], (r, got)
        _at_once(got)
        assert res[r]["after"] == (8, 64), res[r]
