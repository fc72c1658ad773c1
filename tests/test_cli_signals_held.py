"""`signals_held` (tuner/cli/_torch_import.py): Ctrl-C / SIGTERM recorded in its body, handed to their handlers after
it, in arrival order; a second of the same signal at once; dispositions that are not Python functions untouched."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator

import pytest

from moetune.tuner.cli._torch_import import _TorchImportHold, hold_signals_while_torch_imports, signals_held


@pytest.fixture
def recorded() -> Iterator[list[int]]:
    """SIGINT and SIGTERM handled by a Python function that records the signal (the old handlers put back after)."""
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_signal_in_the_body_reaches_its_handler_after_the_body(recorded: list[int]) -> None:
    with signals_held():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert recorded == []
    assert recorded == [signal.SIGTERM, signal.SIGINT]


def test_the_same_signal_twice_is_handed_over_at_once(recorded: list[int]) -> None:
    with signals_held():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        assert recorded == [signal.SIGINT]
    assert recorded == [signal.SIGINT, signal.SIGINT]


def test_the_handlers_are_put_back_and_a_body_error_still_gets_the_interrupt() -> None:
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as caught, signals_held():
            signal.raise_signal(signal.SIGINT)
            raise ValueError("the body's own error")
        assert isinstance(caught.value.__context__, ValueError)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, old)


def test_an_ignored_signal_stays_ignored(recorded: list[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with signals_held():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)
    assert recorded == [] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_another_thread_changes_nothing(recorded: list[int]) -> None:
    seen: list[object] = []

    def body() -> None:
        with signals_held():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [signal.getsignal(signal.SIGINT)]


def test_the_hold_is_installed_once_and_not_once_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    hold_signals_while_torch_imports()
    hold_signals_while_torch_imports()
    assert sum(isinstance(f, _TorchImportHold) for f in sys.meta_path) == 1
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, _TorchImportHold)])
    monkeypatch.setitem(sys.modules, "torch", object())
    hold_signals_while_torch_imports()
    assert not any(isinstance(f, _TorchImportHold) for f in sys.meta_path)
