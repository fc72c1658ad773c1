"""`main`: the CLI's Ctrl-C handling around the Typer app (`_app`), which it imports itself, under that handling.

Python's default Ctrl-C raises KeyboardInterrupt wherever the interpreter is, and the app's imports (Typer, Rich,
every command group, the runtime's schemas: about 0.3 s) ran before any code of the CLI could catch it, so a Ctrl-C
right after the command was started printed a traceback from inside an import. The console script reaches this
module through `_entry`, which holds Ctrl-C from its first statement until `main` takes over; this module's own
imports stay light all the same (`main` is also run by `from moetune.tuner.cli import main`)."""

from __future__ import annotations

import contextlib  # already imported by Python's start (site), as os and sys are
import os
import signal
import sys

from moetune.tuner.cli._exc_chain import interrupt_in_chain  # no Typer: light, as this module must stay
from moetune.tuner.cli._torch_import import hold_signals_while_torch_imports  # light too

TYPE_CHECKING = False  # not `typing`'s: the entry point's imports stay light
if TYPE_CHECKING:
    from typing import Any, NoReturn


def _interrupted(line: str, *, at_once: bool = False) -> NoReturn:
    """End the process on a Ctrl-C that no command's own handling took: `line` on stderr, exit 130. `at_once`: without
    the interpreter's teardown (os._exit, the output flushed first), for an interrupt that broke an import midway."""
    with contextlib.suppress(ValueError):  # not the main thread: no signal handler can be set
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut the line short with a traceback
    with contextlib.suppress(OSError, AttributeError, ValueError):
        if sys.stdout is not None:
            sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    if at_once:
        os._exit(130)
    sys.exit(130)


# the line of a Ctrl-C before the app was imported (`_entry` says the same, from its own copy: it imports nothing)
BEFORE_THE_COMMAND = "interrupted: before the command started; nothing was done"


def main(sigint_handler: Any = None) -> None:
    """The `moetune` command line (the console script's `_entry.main` calls it). A Ctrl-C before a command's own handling of it (its `ends_cleanly_on_interrupt`)
    ends the command with one line on stderr and exit 130: while the app is imported (nothing was done yet), or in a
    command's checks before its work starts, where Typer turned the KeyboardInterrupt into a bare exit 130 with no
    word (`moetune profile`'s fabric discovery, for one). A Ctrl-C while torch is imported waits for the import
    to finish (`_torch_import`): torch's initialisation loses or aborts on one.

    `sigint_handler`: the SIGINT handler to put back, first thing inside this handling (`_entry` held Ctrl-C from
    its own first statement up to here); None leaves SIGINT as it is."""
    try:
        if sigint_handler is not None:
            signal.signal(signal.SIGINT, sigint_handler)  # Python's own again: a Ctrl-C is a KeyboardInterrupt
        hold_signals_while_torch_imports()
        from moetune.tuner.cli._app import run
    except KeyboardInterrupt:
        _interrupted(BEFORE_THE_COMMAND)
    try:
        run()
    except KeyboardInterrupt:  # outside Typer's own catch: while it builds the command tree, or after the command
        _interrupted("interrupted")
    except SystemExit as e:
        # Typer's catch raises `Exit(130) from` the KeyboardInterrupt; a command that said its own line raised its
        # Exit `from None` (or from no interrupt), and says nothing more here
        if e.code == 130 and isinstance(getattr(e.__context__, "__cause__", None), KeyboardInterrupt):
            _interrupted("interrupted")
        raise
    except Exception as e:
        # a Ctrl-C inside a compiled module's initialisation (matplotlib's ft2font, in `model sweep`'s plot) comes out
        # as "ImportError: initialization failed" raised from the KeyboardInterrupt, which Typer does not catch: its
        # traceback was printed, and the half-made module then aborted the interpreter's teardown (a core dump)
        if interrupt_in_chain(e) is None:
            raise
        _interrupted("interrupted", at_once=True)
