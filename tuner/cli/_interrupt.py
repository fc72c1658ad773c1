"""How a long command of the CLI ends on Ctrl-C or SIGTERM: one line saying so and what it left, exit 130 / 143.

`ends_cleanly_on_interrupt` is what every measuring command (`tune`, `profile`, `bench ...`, `model calibrate`)
wraps its work in; `sigterm_interrupts`, `interrupt_behind`, `interrupted_exit` and `interrupted_by` are its parts."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

import typer
from rich.console import Console
from rich.markup import escape


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While measuring: SIGTERM (`kill`, `timeout`, a batch scheduler) raises `Terminated`, a KeyboardInterrupt, so
    the command ends as on Ctrl-C (the study saved, the bench workers and their ranks ended, a message, exit
    143). Python's default ended the process at once with no message and left the measurement worker and its
    ranks running. A second SIGTERM ends the process at once (the workers then end by themselves: they watch
    their parent). Only the main thread can have a signal handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from moetune.tuner.search.study import Terminated

    def handler(_signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that `e` is, or that its `__cause__` / `__context__` chain holds: an error raised while
    an interrupt unwound is that interrupt. A second Ctrl-C that lands in Optuna's clean-up of the first (or the
    first one landing in its `_tell_with_warning`) ends `_run_trial` with "UnboundLocalError: ... 'updated_state'"
    (its `finally` reads a name the interrupted `try` never set), and the command ended with that traceback and exit
    1. A CLI exit (`typer.Exit`, a usage error) is no such error: the command ended itself, with its own words."""
    if isinstance(e, typer.Exit | typer.Abort | typer.exceptions.TyperException):
        return None
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        cur = todo.pop()
        if isinstance(cur, KeyboardInterrupt):
            return cur
        if id(cur) not in seen:
            seen.add(id(cur))
            todo += [x for x in (cur.__context__, cur.__cause__) if x is not None]
    return None


def interrupted_exit(e: KeyboardInterrupt) -> int:
    """The exit status of a command ended by Ctrl-C (130) or SIGTERM (143: 128 + 15, as the shell reports it)."""
    from moetune.tuner.search.study import Terminated

    return 143 if isinstance(e, Terminated) else 130


def interrupted_by(e: KeyboardInterrupt) -> str:
    """What ended the command, as the interrupted line says it."""
    from moetune.tuner.search.study import Terminated

    return "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"


@contextlib.contextmanager
def ends_cleanly_on_interrupt(left: Callable[[], str], console: Console | None = None, *,
                              sigterm: bool = True) -> Iterator[None]:
    """Run the body under `sigterm_interrupts` (SIGTERM raised as KeyboardInterrupt); Ctrl-C or SIGTERM in it ends
    the command with one line on stderr (or `console`), "interrupted: LEFT" or "terminated (SIGTERM): LEFT", LEFT
    being what `left()` says then (what was and was not written or printed; plain text, escaped here), and exit 130
    (143 for SIGTERM). Without it, Ctrl-C ended the command with no word (Typer turns KeyboardInterrupt into a bare
    exit 130) and SIGTERM killed the process outright. Whatever the body's own `finally`s do (a progress bar
    closed, processes ended) is done before the line. The body's own `except` clauses must not catch the
    `typer.Exit` this raises (a RuntimeError): put them inside the `with`, as `tune` and `profile` do.
    `sigterm=False`: SIGTERM keeps its default (a process whose launcher ends it so, a torchrun worker); Ctrl-C
    still ends it with the line. An error raised while an interrupt unwound (`interrupt_behind`) ends it the same."""
    try:
        with sigterm_interrupts() if sigterm else contextlib.nullcontext():
            yield
    except (KeyboardInterrupt, Exception) as raised:
        e = interrupt_behind(raised)
        if e is None:
            raise
        out = console or Console(stderr=True, soft_wrap=True)
        out.print(f"[yellow]{interrupted_by(e)}: {escape(left())}[/yellow]")
        raise typer.Exit(interrupted_exit(e)) from None
