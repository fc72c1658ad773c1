"""How a long command of the CLI ends on Ctrl-C or SIGTERM: one line saying so and what it left, exit 130 / 143."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import typer
from rich.console import Console
from rich.markup import escape


@contextlib.contextmanager
def ends_cleanly_on_interrupt(left: Callable[[], str], console: Console | None = None, *,
                              sigterm: bool = True) -> Iterator[None]:
    """Run the body under `sigterm_interrupts` (SIGTERM raised as KeyboardInterrupt, as `tune` and `profile` measure);
    Ctrl-C or SIGTERM in it ends the command with one line on stderr (or `console`), "interrupted: LEFT" or
    "terminated (SIGTERM): LEFT", LEFT being what `left()` says then (what was and was not written or printed;
    plain text, escaped here), and exit 130 (143 for SIGTERM). Without it, Ctrl-C ended the command with no word
    (Typer turns KeyboardInterrupt into a bare exit 130) and SIGTERM killed the process outright. Whatever the body's own `finally`s do (a progress bar closed, processes
    ended) is done before the line. `sigterm=False`: SIGTERM keeps its default (a process whose launcher ends it so,
    a torchrun worker); Ctrl-C still ends it with the line."""
    from moetune.tuner.cli.tune import interrupted_by, interrupted_exit, sigterm_interrupts

    try:
        with sigterm_interrupts() if sigterm else contextlib.nullcontext():
            yield
    except KeyboardInterrupt as e:
        out = console or Console(stderr=True, soft_wrap=True)
        out.print(f"[yellow]{interrupted_by(e)}: {escape(left())}[/yellow]")
        raise typer.Exit(interrupted_exit(e)) from None
