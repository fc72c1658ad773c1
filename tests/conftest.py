"""Fixtures several test files share: the runtime's per-process state (profiles auto-loaded, availability
answers, warnings said once) emptied around a test, with auto-loading either on or off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from moetune.runtime import _once
from moetune.runtime.profiles import autoload


def _reset() -> None:
    _once.reset()
    autoload.clear_cache()


@pytest.fixture
def autoload_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fresh caches; MOETUNE_AUTOLOAD unset, so layers and buffers ask for profiles (tests fake the answers)."""
    _reset()
    monkeypatch.delenv("MOETUNE_AUTOLOAD", raising=False)
    yield
    _reset()


@pytest.fixture
def autoload_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fresh caches; MOETUNE_AUTOLOAD=0: no daemon or database is asked unless a test sets one up."""
    _reset()
    monkeypatch.setattr(autoload, "_availability", {})
    monkeypatch.setenv("MOETUNE_AUTOLOAD", "0")
    yield
    _reset()
