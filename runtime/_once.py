"""Say something once per process: one record of what the runtime has already warned or logged.

Every MoE layer builds its own EP buffer, transport and proxy engine, and every lookup of a model's buckets asks
the profile client, so one condition (the megakernel cannot run here, a proxy CPU list cannot be applied, an EP
sub-group cannot get extra communicators, a profile tuned under another environment) is met many times per job;
it is said once per process for each key. One lock-guarded set here, shared by those modules, instead of one set
per module (some of which were unguarded while layers are built from several threads).

`reset` forgets what was said (tests; `autoload.clear_cache` forgets one scope). Standard library only.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Hashable

__all__ = ["first_time", "reset", "say_once"]

_said: set[tuple[str, Hashable]] = set()
_lock = threading.Lock()


def _new_lock_in_child() -> None:
    # A fork while another thread held the lock (a fork-mode DataLoader worker) would leave the child's copy held
    # forever, and its first warning would hang: the child starts with a free lock (what was said stays said).
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def first_time(scope: str, key: Hashable) -> bool:
    """True the first time (`scope`, `key`) is asked about in this process, False after (atomic)."""
    with _lock:
        if (scope, key) in _said:
            return False
        _said.add((scope, key))
        return True


def say_once(scope: str, key: Hashable, message: str, *, category: type[Warning] | None = None,
             logger: logging.Logger | None = None, level: int = logging.WARNING, stacklevel: int = 2) -> bool:
    """Warn `message` as `category` and/or log it on `logger` at `level`, the first time (`scope`, `key`) comes up.

    `stacklevel` counts as `warnings.warn`'s would from the caller's own frame (this function's frame is
    added here), so a caller keeps the stacklevel it passed to `warnings.warn` before. True when it was said."""
    if not first_time(scope, key):
        return False
    if category is not None:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    if logger is not None:
        logger.log(level, "%s", message)
    return True


def reset(scope: str | None = None) -> None:
    """Forget what was said: everything (`scope` None, the hook for tests) or one scope's keys."""
    with _lock:
        if scope is None:
            _said.clear()
        else:
            _said.difference_update([s for s in _said if s[0] == scope])
