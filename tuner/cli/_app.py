"""The `moetune` command line: the one Typer app, its command groups registered (one module each), and `run`, which
`moetune.tuner.cli.main` calls once this module is imported."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
from typing import NoReturn

import typer

from moetune.tuner import __version__
from moetune.tuner.cli import _help, bench, db, fabric, keys, model, profile, profiles, query, serve, tune
from moetune.tuner.cli._args import WRITE_FAILED_ERRNOS

_help.apply()  # a flag shows no `<bool>`, two long names read `--a, --b` (Typer's Rich help)

# The exit statuses of every command, stated once (tests/test_cli_path_errors.py holds the commands to it).
EXIT_STATUS_HELP = (
    "Exit status: 0 done. 2 the command line is wrong: a bad value or an empty path; an input file or folder that is "
    "missing, unreadable or not what it should be (not a database, a newer one, bad TOML, JSON or CSV); an output path "
    "that cannot be written (no permission, a read-only file system, no such folder, a file in the way). 1 the "
    "command line is fine but the work failed: the database is busy, served by a daemon or not writable by this user; "
    "a write ran out of space or hit an I/O error; the daemon, a measurement, a fit or a check failed. 130 / 143: "
    "ended by Ctrl-C / SIGTERM. 141: the reader of the output went away (`| head`), as for any Unix tool; nothing more "
    "is said."
)

app = typer.Typer(
    name="moetune",
    help="Profile the GPU fabric, tune MoE expert-parallel communication, keep and serve tuned profiles.",
    epilog=EXIT_STATUS_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moetune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """moetune: tuned expert-parallel communication for MoE models."""


for module in (profile, query, serve):
    module.register(app)
app.add_typer(tune.app, name="tune")
app.add_typer(fabric.app, name="fabric")
app.add_typer(model.app, name="model")
app.add_typer(bench.app, name="bench")
app.add_typer(db.app, name="db")
app.add_typer(profiles.app, name="profiles")
app.add_typer(keys.app, name="keys")


# the output itself cannot be written: a full disk (`>/dev/full`), a reader gone, an I/O error
_OUTPUT_ERRNOS = WRITE_FAILED_ERRNOS | {errno.EPIPE}


def _output_encodes_anything() -> None:
    """stdout takes any text: a path whose name is not UTF-8 (argv's bytes, decoded to surrogates) printed under a
    UTF-8 locale (errors "strict"), or the output's µ, ±, ·, × and … on an ASCII or Latin-1 terminal, raised
    UnicodeEncodeError once the work was done: a traceback, exit 1. A UTF-8 stdout writes such a name's own bytes back
    (surrogateescape, as Python does in the C locale); another encoding shows what it cannot encode as \\xNN. stderr's
    default is backslashreplace already."""
    import codecs

    stream = sys.stdout
    if getattr(stream, "errors", None) != "strict" or not hasattr(stream, "reconfigure"):
        return
    with contextlib.suppress(LookupError, ValueError, OSError):  # an odd encoding name, a stream that cannot change
        utf8 = codecs.lookup(stream.encoding).name == "utf-8"
        stream.reconfigure(errors="surrogateescape" if utf8 else "backslashreplace")


# 128 + SIGPIPE: what a shell reports for a Unix tool whose output's reader went away (`set -o pipefail`)
EXIT_READER_GONE = 141


def _piped() -> bool:
    """Whether stdout or stderr is a pipe or a socket: where a reader can go away (`_rich_met_a_broken_pipe`)."""
    import stat

    for fd in (1, 2):
        with contextlib.suppress(OSError):
            mode = os.fstat(fd).st_mode
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                return True
    return False


def _reader_gone() -> bool:
    """Whether the reader of stdout or stderr went away (`moetune ... | head -1`): poll() reports POLLERR (Linux) or
    POLLHUP for the write end of a pipe whose read end is closed; a terminal, a file or a pipe still read, neither."""
    import select

    for fd in (1, 2):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed fd, no poll on this platform
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0)):
                return True
    return False


def _stdout_id() -> tuple[int, int] | None:
    """(device, inode) of stdout (None where fd 1 is closed): what `_rich_met_a_broken_pipe` compares with."""
    with contextlib.suppress(OSError):
        st = os.fstat(1)
        return st.st_dev, st.st_ino
    return None


def _rich_met_a_broken_pipe(piped_at_start: bool, stdout_at_start: tuple[int, int] | None) -> bool:
    """Whether stdout was pointed at /dev/null while the command ran, stdout or stderr being a pipe at the start:
    Rich's catch of BrokenPipeError (`Console.on_broken_pipe`) does that and raises SystemExit(1), which leaves
    `_reader_gone` nothing to see. A stdout that was /dev/null from the start is no sign of it (`>/dev/null` beside
    a piped stderr, a script keeping only the errors): there a command's own exit 1 turned into a silent 141."""
    with contextlib.suppress(OSError):
        now, null = os.fstat(1), os.stat(os.devnull)
        return piped_at_start and (now.st_dev, now.st_ino) != stdout_at_start \
            and (now.st_rdev, now.st_ino) == (null.st_rdev, null.st_ino)
    return False


def _end_quietly() -> NoReturn:
    """End as a Unix tool does when its reader went away: no traceback, no message (there is no one to read it),
    exit 141. stdout is pointed at /dev/null first, so the exit's own flush of what is left cannot fail again."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(OSError, AttributeError, ValueError):
                os.dup2(devnull, stream.fileno())
    sys.exit(EXIT_READER_GONE)


def run() -> None:
    """The app run as the `moetune` entry point: an output that cannot be written ends the command with one line on
    stderr and exit 1, not a traceback (the commands' own files say their errors themselves); an output whose reader
    went away (`| head -1`) ends it with no word and exit 141, as a Unix tool killed by SIGPIPE."""
    # SQLAlchemy's pool logs an error (with its traceback) when a connection's rollback is interrupted, e.g. by a
    # second Ctrl-C while the first unwinds, and then re-raises it: with no handler configured Python's last-resort
    # handler printed that traceback before the command's own "interrupted" line. The exception itself still ends
    # the command the usual way.
    logging.getLogger("sqlalchemy.pool").addHandler(logging.NullHandler())
    _output_encodes_anything()
    piped, stdout_at_start = _piped(), _stdout_id()
    try:
        try:
            app()
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # here, not at the interpreter's exit where its error is only printed
            # the command has ended and its exit status is decided: a Ctrl-C during the interpreter's teardown
            # (which puts Python's handlers back to the default, for a few tenths of a second once matplotlib and
            # SQLAlchemy are loaded) killed the process, and a report written whole exited 130 with nothing undone.
            # SIGTERM keeps its default, so a teardown that hangs (a thread that never ends) can still be ended.
            with contextlib.suppress(ValueError):  # not the main thread: no signal handler can be set
                signal.signal(signal.SIGINT, signal.SIG_IGN)
    except SystemExit as e:
        # Typer's own catch of an EPIPE in a command, and Rich's in its console (the help's too), exit 1 with no
        # word: `moetune profile --help | head -1` exited 1. Where the reader is gone, 141, as a Unix tool
        # (only there: a command's own exit 1 stays 1, its reason on stderr, whatever became of its reader)
        typer_epipe = type(sys.stdout).__name__ == "PacifyFlushWrapper" and _reader_gone()
        if e.code == 1 and (typer_epipe or _rich_met_a_broken_pipe(piped, stdout_at_start)):
            _end_quietly()
        raise
    except OSError as e:
        if e.errno == errno.EPIPE and e.filename is None and _reader_gone():  # the final flush found the reader gone
            _end_quietly()
        if e.errno not in _OUTPUT_ERRNOS or e.filename is not None:  # a named file's error is not the output's
            raise
        with contextlib.suppress(OSError, AttributeError):
            sys.stderr.write(f"error: cannot write the output ({e.strerror or e})\n")
        with contextlib.suppress(OSError, AttributeError, ValueError):  # keep the exit's own flush from failing
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
