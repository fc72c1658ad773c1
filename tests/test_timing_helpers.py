"""runtime/testing/timing.py: nothing to time is refused with a ValueError, not a bare ZeroDivisionError."""

from __future__ import annotations

import pytest

from moetune.runtime.testing.timing import time_calls, time_interleaved


def test_time_calls_refuses_an_empty_list_of_functions() -> None:
    """time_calls rotates over fns by j % len(fns): with none it raised ZeroDivisionError (in the warm-up, or in the
    first timed call with warmup=0)."""
    for warmup in (0, 2):
        with pytest.raises(ValueError, match="time_calls: fns is empty"):
            time_calls([], warmup=warmup, iters=3, cuda=False)
    calls: list[int] = []
    assert len(time_calls([lambda: calls.append(0), lambda: calls.append(1)], warmup=1, iters=3, cuda=False)) == 3
    assert calls == [0, 0, 1, 0]


def test_time_interleaved_refuses_an_entry_without_functions() -> None:
    with pytest.raises(ValueError, match="time_interleaved: no functions to time for 'b'"):
        time_interleaved({"a": [lambda: None], "b": []}, warmup=0, iters=2, cuda=False)
    assert time_interleaved({}, warmup=1, iters=2, cuda=False) == {}
