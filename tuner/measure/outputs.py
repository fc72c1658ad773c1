"""Whether a measured run's output was right: a run whose output was wrong is no measurement.

A transport that moves stale rows, or nothing, or a kernel setting that leaves rows unwritten returns as fast as a
correct run (often faster): timed and stored, it wins a tuning run. So every path that times a run also checks that
run's output against a reference, outside the timed region, and these functions give the verdict from the relative
error (`max |out - ref| / max |ref|`, `runtime.moe_layer.max_rel_err`) and its bound: over the bound, or not a number
(NaN: a poisoned row left behind, a non-finite value), the output is wrong and the run gives no timing.

No torch here: the tuner's search process reads the verdict of a report a bench worker wrote.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class WrongOutput(RuntimeError):
    """A measured run's output was not its reference's within the bound (the message says by how much)."""


def rel_err_problem(err: float, bound: float, what: str) -> str | None:
    """Why a relative error `err` of `what` is wrong (over `bound`, or NaN), None when it is within the bound."""
    if isinstance(err, float) and math.isnan(err):
        return (f"wrong output: {what}: relative error is NaN (non-finite values, or rows the run never wrote), "
                f"bound {bound:.3g}")
    if not err <= bound:
        return f"wrong output: {what}: relative error {err:.3g} exceeds its bound {bound:.3g}"
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# (error key, bound key, short label, what it is) of a `moetune bench ep` report (tuner/measure/ep.py bench_case): the
# one list ep_report_problem judges and `moetune bench ep`'s table shows (tuner/cli/bench.py), so the two cannot drift
EP_CHECKS = (
    ("roundtrip_rel_err", "roundtrip_bound", "round trip", "the round trip (dispatch, identity experts, combine)"),
    ("graph_roundtrip_rel_err", "roundtrip_bound", "round trip (CUDA graph)",
     "the round trip replayed from a CUDA graph"),
    ("graph_pair_rel_err", "roundtrip_bound", "dispatch + combine (CUDA graph)",
     "dispatch + combine replayed from a CUDA graph"),
    ("max_rel_err", "verify_bound", "verify", "the layer against the dense reference (--verify)"),
)


def ep_report_problem(rep: Mapping[str, Any]) -> str | None:
    """The first wrong output a `moetune bench ep` report records, None when every output it checked is within its
    bound: the round trip with identity experts (`roundtrip_rel_err` against `roundtrip_bound`, which already allows
    for the dtype and any fp8 compression), its CUDA-graph replays (against the same bound) and, with verify, the
    layer against the fp32 dense reference (`max_rel_err` against `verify_bound`). An error or bound the report does
    not hold (a phase not run: null; a report of another tool) is not checked; one that is not a number is wrong."""
    for err_key, bound_key, _label, what in EP_CHECKS:
        err, bound = rep.get(err_key), rep.get(bound_key)
        if err is None or bound is None:
            continue
        if not _number(err) or not _number(bound):
            return f"wrong output: {what}: relative error {err!r} with bound {bound!r} is not a checked number"
        why = rel_err_problem(float(err), float(bound), what)
        if why is not None:
            return why
    return None
