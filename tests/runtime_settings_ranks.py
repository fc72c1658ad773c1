"""Rank functions for tests/test_runtime_settings_checks.py (imported by name in the spawned ranks; no tests here)."""

from __future__ import annotations

from moetune.runtime import EPBuffer, Knobs, get_model


def case_check_inputs_mismatch(rank: int, world: int) -> str:
    """Rank 0 checks inputs, the others do not: combine would run an all_gather on rank 0 only (a hang on valid
    input), so the buffer must refuse to build on every rank."""
    model = get_model("custom:64,32,8,2,float32")
    try:
        EPBuffer(knobs=Knobs(), model=model, max_tokens=32, check_inputs=rank == 0)
    except ValueError as e:
        return str(e)
    return "NO ERROR"
