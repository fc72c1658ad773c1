"""How a long command of the CLI ends on Ctrl-C or SIGTERM: one line saying so and what it left, exit 130 / 143.

`ends_cleanly_on_interrupt` is what every measuring command (`tune`, `profile`, `bench ...`, `model calibrate`)
wraps its work in; `signals_interrupt`, `interrupt_behind`, `interrupted_exit` and `interrupted_by` are its
parts; `say_sigterm_early` covers a command's seconds before it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import typer
from rich.console import Console
from rich.markup import escape

from moetune.tuner.cli._exc_chain import interrupt_in_chain

# the interrupts the handlers of `signals_interrupt` raised or held back, in the body now running: an error that
# ends the body after one is that interrupt, whatever its own chain holds (`interrupt_behind`)
_received: list[KeyboardInterrupt] = []


@contextlib.contextmanager
def signals_interrupt(*, sigterm: bool = True) -> Iterator[None]:
    """While measuring: Ctrl-C raises KeyboardInterrupt and (`sigterm`) SIGTERM (`kill`, `timeout`, a batch
    scheduler) raises `Terminated`, a KeyboardInterrupt, so the command ends as on Ctrl-C (the study saved, the
    bench workers and their ranks ended, a message, exit 143). Python's default SIGTERM ended the process at once
    with no message and left the measurement worker and its ranks running. A second SIGTERM ends the process at
    once (the workers then end by themselves: they watch their parent).

    Either is raised through `interrupt_guard.deliver`: inside a call of the study storage it is held back until
    that call returns. Raised inside SQLAlchemy's transaction bookkeeping, it left a connection holding SQLite's
    write lock, and Optuna's FAIL of the interrupted trial then failed "database is locked" (a traceback, exit 1).
    A second Ctrl-C while one is held back is raised at once. Each is recorded (`_received`) for the body's end.
    A SIGINT handler other than Python's own is left as it is. Only the main thread can have a signal handler:
    elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from moetune.tuner.search.interrupt_guard import deliver
    from moetune.tuner.search.workers import Terminated

    def on_int(_signum: int, _frame: object) -> None:
        e = KeyboardInterrupt()
        _received.append(e)
        deliver(e)

    def on_term(_signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        e = Terminated()
        _received.append(e)
        deliver(e)

    old_int = signal.getsignal(signal.SIGINT)
    ours = old_int is signal.default_int_handler
    old_term = signal.signal(signal.SIGTERM, on_term) if sigterm else None
    if ours:
        signal.signal(signal.SIGINT, on_int)
    try:
        yield
    finally:
        if ours:
            signal.signal(signal.SIGINT, old_int)
        if sigterm:
            signal.signal(signal.SIGTERM, old_term)


def say_sigterm_early(what: str) -> Callable[[], None]:
    """Until the returned function is called: SIGTERM writes "terminated (SIGTERM): WHAT" on stderr and ends the
    process at once with 143, for a command's first seconds, before its `ends_cleanly_on_interrupt` (`profile`'s
    imports and discovery). Python's default ended it there with -15 and no word. Ending at once (os._exit, as
    `_entry` does for an early Ctrl-C) is what the default did, less the silence: an import may be half done, and
    nothing needs undoing yet. Needs no import (Optuna's, for `Terminated`, is among what it covers). Set only
    where SIGTERM has Python's default, in the main thread: one a parent set to be ignored stays ignored."""
    def on_term(_signum: int, _frame: object) -> None:
        with contextlib.suppress(Exception):
            if sys.stdout is not None:
                sys.stdout.flush()
            os.write(2, f"terminated (SIGTERM): {what}\n".encode())
        os._exit(143)

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None
    signal.signal(signal.SIGTERM, on_term)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_term:  # once only; a handler set since is left as it is
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return restore


@contextlib.contextmanager
def interrupts_ignored() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored in the body (the main thread only; elsewhere nothing changes), their handlers put
    back after it: for what follows work that is complete (its last line printed), where an interrupt would turn a
    finished command into exit 130 with nothing left undone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that `e` is, or that its `__cause__` / `__context__` chain holds: an error raised while
    an interrupt unwound is that interrupt. A second Ctrl-C that lands in Optuna's clean-up of the first (or the
    first one landing in its `_tell_with_warning`) ends `_run_trial` with "UnboundLocalError: ... 'updated_state'"
    (its `finally` reads a name the interrupted `try` never set), and the command ended with that traceback and exit
    1. A CLI exit (`typer.Exit`, a usage error) is no such error: the command ended itself, with its own words."""
    if isinstance(e, typer.Exit | typer.Abort | typer.exceptions.TyperException):
        return None
    if (ki := interrupt_in_chain(e)) is not None:
        return ki
    # an error after a Ctrl-C / SIGTERM the handlers received is that interrupt too: one Optuna caught and handled
    # (the trial's FAIL) before its clean-up raised an error of its own, without the interrupt in its chain
    return _received[0] if _received else None


def interrupted_exit(e: KeyboardInterrupt) -> int:
    """The exit status of a command ended by Ctrl-C (130) or SIGTERM (143: 128 + 15, as the shell reports it)."""
    from moetune.tuner.search.workers import Terminated

    return 143 if isinstance(e, Terminated) else 130


def interrupted_by(e: KeyboardInterrupt) -> str:
    """What ended the command, as the interrupted line says it."""
    from moetune.tuner.search.workers import Terminated

    return "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"


@contextlib.contextmanager
def ends_cleanly_on_interrupt(left: Callable[[], str], console: Console | None = None, *,
                              sigterm: bool = True) -> Iterator[None]:
    """Run the body under `signals_interrupt` (SIGTERM raised as KeyboardInterrupt); Ctrl-C or SIGTERM in it ends
    the command with one line on stderr (or `console`), "interrupted: LEFT" or "terminated (SIGTERM): LEFT", LEFT
    being what `left()` says then (what was and was not written or printed; plain text, escaped here), and exit 130
    (143 for SIGTERM). Without it, Ctrl-C ended the command with no word (Typer turns KeyboardInterrupt into a bare
    exit 130) and SIGTERM killed the process outright. Whatever the body's own `finally`s do (a progress bar
    closed, processes ended) is done before the line. The body's own `except` clauses must not catch the
    `typer.Exit` this raises (a RuntimeError): put them inside the `with`, as `tune` and `profile` do.
    `sigterm=False`: SIGTERM keeps its default (a process whose launcher ends it so, a torchrun worker); Ctrl-C
    still ends it with the line. An error raised while an interrupt unwound, or after the handlers received one
    (`interrupt_behind`), ends it the same."""
    mark = len(_received)
    try:
        with signals_interrupt(sigterm=sigterm):
            yield
    except (KeyboardInterrupt, Exception) as raised:
        e = interrupt_behind(raised)
        if e is None:
            raise
        out = console or Console(stderr=True, soft_wrap=True)
        out.print(f"[yellow]{interrupted_by(e)}: {escape(left())}[/yellow]")
        raise typer.Exit(interrupted_exit(e)) from None
    finally:
        del _received[mark:]  # forgotten with the body: a later command's error is its own
