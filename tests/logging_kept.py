"""`moetune_logging_kept`: the "moetune" and "optuna" loggers as they were, after code that sets up the daemon's logging
in-process (conftest's autouse fixture wraps every test in it; tests/test_daemon_logging_isolated.py checks it)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# the loggers tuner/daemon/logs.py's setup_logging rewires: "moetune" and, with the tuner installed, "optuna"
_KEPT = ("moetune", "optuna")


@contextlib.contextmanager
def moetune_logging_kept() -> Iterator[None]:
    """The "moetune" and "optuna" loggers' handlers, level and propagation put back as they were. `moetune serve` run
    in-process (CliRunner, run_daemon) sets up the daemon's logging (tuner/daemon/logs.py: a handler on the sys.stderr
    of that moment, INFO, no propagation) for the rest of the process: in a test, that stderr is CliRunner's, closed
    once the invoke returns, so every later moetune.* record (the client's INFO "tuned profile ...") printed '---
    Logging error ---' and its traceback on whatever stderr was current, a later CliRunner's, inside its `output`.
    The "optuna" logger got the same handler at INFO, Optuna's own handler taken off: a later test's studies logged
    their trials into that closed stream whatever verbosity the test had set. Only the test order pytest-xdist picks
    (it changes with load) put such a test before the others in a worker.
    The handler objects themselves are put back (Optuna's default handler among them, where it was there); not
    handled: Optuna's module-level note that it made its default handler, which setup_logging may set and which then
    keeps Optuna from adding that handler later where the logger had none before."""
    saved = []
    for name in _KEPT:
        lg = logging.getLogger(name)
        saved.append((lg, list(lg.handlers), lg.level, lg.propagate))
    try:
        yield
    finally:
        for lg, handlers, level, propagate in saved:
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)
