"""Ctrl-C / SIGTERM held back while a study-storage call runs, raised as soon as it returns.

The CLI's interrupt raised KeyboardInterrupt wherever the main thread was. Landing inside SQLAlchemy's
bookkeeping of a storage call (between the connection's `BEGIN IMMEDIATE` and the session recording it, in a
commit or a rollback) it left a connection holding SQLite's write lock that nothing ever closed. Optuna's own
clean-up (the interrupted trial told FAIL) then waited the busy timeout and failed "database is locked"; Optuna
raised its StorageInternalError and then "AssertionError: Should not reach.", an error chain without the
interrupt in it, and the command ended in a traceback with exit 1 and a trial left RUNNING.

`uninterrupted` marks a storage call; `deliver`, called by a signal handler, raises the interrupt at once outside
such a call, or keeps it until the outermost one returns (or fails) and raises it there, where no transaction is
open. A second signal while one is kept is raised at once: a storage call that waits (the busy timeout on a
database another process holds) never makes Ctrl-C do nothing. Only the main thread, where Python runs signal
handlers, is held back; another thread's storage calls are not marked."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_depth = 0  # storage calls of the main thread in progress (nested: a storage method calling another)
_pending: BaseException | None = None  # an interrupt kept until the outermost call returns

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A study-storage call: an interrupt `deliver`ed while it runs is raised when it ends (the outermost one), on
    its return or over its own error (which becomes the interrupt's `__context__`)."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1  # an interrupt before this line is raised before the call began: nothing of it is open
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _pending is not None:
            e, _pending = _pending, None
            raise e


def deliver(e: BaseException) -> None:
    """From a signal handler: raise `e` now, or, inside a storage call of the main thread, when that call ends.
    A second interrupt while one is kept is raised now (the user insists; a call waiting on a busy database)."""
    global _pending
    if _depth > 0 and _pending is None and threading.current_thread() is threading.main_thread():
        _pending = e
        return
    _pending = None
    raise e


def pending() -> BaseException | None:
    """The interrupt kept for the end of the storage call in progress, if any."""
    return _pending


def guarded(fn: F) -> F:
    """`fn` run `uninterrupted`."""
    import functools

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with uninterrupted():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def guard_methods(cls: type, base: type) -> type:
    """Every method `base` defines (its private ones too, not its dunders but `__init__`, which creates the schema)
    wrapped `guarded` on the subclass `cls`: each storage call of an Optuna RDBStorage made as `cls`. A method `cls`
    defines itself is left as it is: it runs `uninterrupted` on its own (to do something of its own before a
    kept interrupt is raised)."""
    for name, value in vars(base).items():
        if (name.startswith("__") and name != "__init__") or name in vars(cls):
            continue
        if isinstance(value, staticmethod | classmethod | property) or not callable(value):
            continue
        setattr(cls, name, guarded(value))
    return cls
