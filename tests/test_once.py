"""runtime/_once.py: the one once-per-process record the runtime's repeated warnings share."""

from __future__ import annotations

import inspect
import logging
import os
import signal
import threading
import warnings

import pytest

from moetune.runtime import _once


class _Said(UserWarning):
    pass


@pytest.fixture(autouse=True)
def _fresh():
    _once.reset()
    yield
    _once.reset()


def _said(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, _Said)]


def test_once_per_scope_and_key_with_the_callers_category_and_log_level(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("moetune.test_once")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger=log.name):
        warnings.simplefilter("always")  # the once is _once's, not the warnings filter's
        said = [_once.say_once("a", 1, "a1", category=_Said, logger=log, level=logging.INFO) for _ in range(3)]
        said.append(_once.say_once("a", 2, "a2", category=_Said))  # another key of the scope
        said.append(_once.say_once("b", 1, "b1", logger=log))  # the same key in another scope: log only
    assert said == [True, False, False, True, True]
    assert _said(caught) == ["a1", "a2"]
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == log.name] == [
        (logging.INFO, "a1"), (logging.WARNING, "b1")]


def test_reset_forgets_one_scope_or_everything() -> None:
    for scope in ("a", "b"):
        assert _once.first_time(scope, "k")
    _once.reset("a")
    assert _once.first_time("a", "k") and not _once.first_time("b", "k")
    _once.reset()
    assert _once.first_time("a", "k") and _once.first_time("b", "k")


def _warn_for_my_caller() -> None:
    _once.say_once("stack", "k", "where", category=_Said, stacklevel=2)


def test_stacklevel_counts_from_the_callers_frame_as_warnings_warn_does() -> None:
    """A caller keeps the stacklevel it gave warnings.warn: 2 names the line that called the caller."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_for_my_caller()
        frame = inspect.currentframe()
        assert frame is not None
        called_at = frame.f_lineno - 3
    assert [(w.filename, w.lineno) for w in caught if issubclass(w.category, _Said)] == [(__file__, called_at)]


def test_threads_racing_on_one_key_say_it_once() -> None:
    """Layers are built from several threads: the check and the record are one step, so one thread says it."""
    start = threading.Barrier(16)
    results: list[bool] = []
    lock = threading.Lock()

    def race() -> None:
        start.wait()
        got = _once.say_once("race", "k", "raced", category=_Said)
        with lock:
            results.append(got)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=race) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(results) == [False] * 15 + [True]
    assert _said(caught) == ["raced"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_holds_the_lock_leaves_the_child_a_free_one() -> None:
    """A fork-mode DataLoader worker forked while a layer-building thread was inside `first_time`: the child's first
    warning must not wait forever on the copy of a lock nobody in the child will release."""
    _once.reset()
    assert _once.first_time("fork", "said before")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _once._lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the lock is free and what was said is still said
            signal.alarm(10)
            ok = _once.first_time("fork", "new") and not _once.first_time("fork", "said before")
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        t.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
