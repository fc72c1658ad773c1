"""`moetune_logging_kept`: the "moetune" logger as it was, after code that sets up the daemon's logging in-process
(conftest's autouse fixture wraps every test in it; tests/test_daemon_logging_isolated.py checks it)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def moetune_logging_kept() -> Iterator[None]:
    """The "moetune" logger's handlers, level and propagation put back as they were. `moetune serve` run in-process
    (CliRunner, run_daemon) sets up the daemon's logging (tuner/daemon/logs.py: a handler on the sys.stderr of that
    moment, INFO, no propagation) for the rest of the process: in a test, that stderr is CliRunner's, closed once the
    invoke returns, so every later moetune.* record (the client's INFO "tuned profile ...") printed '--- Logging
    error ---' and its traceback on whatever stderr was current, a later CliRunner's, inside its `output`. Only the
    test order pytest-xdist picks (it changes with load) put such a test before the CLI ones in a worker.
    Not handled: the "optuna" logger setup_logging also rewires (restoring it would have to redo Optuna's own
    default handler, which exists only once Optuna is imported)."""
    lg = logging.getLogger("moetune")
    saved = (list(lg.handlers), lg.level, lg.propagate)
    try:
        yield
    finally:
        lg.handlers[:], lg.propagate = saved[0], saved[2]
        lg.setLevel(saved[1])
