"""The `moetune` console script (pyproject: `moetune = "moetune.tuner.cli._entry:main"`; also
`python -m moetune.tuner.cli._entry`). Its first statements take Ctrl-C over: one line on stderr, exit 130.

Python's default Ctrl-C raises KeyboardInterrupt wherever the interpreter is. The console script's import of the
CLI (`_main` and what it imports: signal, threading, the Ctrl-C helpers) and the script's own lines before `main`
ran with that default, so a Ctrl-C in the first few milliseconds printed a traceback from inside an import. Here a
SIGINT handler is set before anything else is imported; it stays until `_main.main` puts Python's back, inside
its own handling of KeyboardInterrupt, so no moment is left between the two. What runs before this module cannot
be covered: the interpreter's start (site and the .pth files of the environment), the script's `import re` and
`import sys`, and the package `__init__`s on the way here (`moetune.tuner`, `moetune.tuner.cli`: kept free of
imports for that reason).

Importing this module sets the handler: only the console script and `python -m` import it (tests in a child)."""

import _signal  # built into the interpreter and loaded at its start: `signal` would import enum first


def _interrupted_early(signum: int, frame: object) -> None:
    """Nothing was done yet: say so and end at once (os._exit: an import may be half done, and the interpreter's
    teardown need not run over it)."""
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # a second Ctrl-C cannot cut the line short
    import os

    try:  # the same line as `_main.BEFORE_THE_COMMAND`
        os.write(2, b"interrupted: before the command started; nothing was done\n")
    finally:
        os._exit(130)


# Python's own handler only: a Ctrl-C that the process was started ignoring (nohup, a background job of a
# non-interactive shell) stays ignored, as it was before
_SIGINT_BEFORE = _signal.getsignal(_signal.SIGINT)
if _SIGINT_BEFORE is _signal.default_int_handler:
    try:
        _signal.signal(_signal.SIGINT, _interrupted_early)
    except ValueError:  # not the main thread: no handler can be set there, nor was Python's in use
        _SIGINT_BEFORE = None
else:
    _SIGINT_BEFORE = None

from moetune.tuner.cli._main import main as _cli_main  # noqa: E402  (after the handler: that is the point)


def main() -> None:
    """Run the command; `_cli_main` puts Python's SIGINT handler back inside its own Ctrl-C handling."""
    _cli_main(sigint_handler=_SIGINT_BEFORE)


if __name__ == "__main__":
    main()
