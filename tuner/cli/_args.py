"""Parsing of the CLI's list options, paths, text options and seeds, with errors that name the option."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any


def int_list(text: str, option: str) -> list[int]:
    """The integers of a comma-separated option value ("1,16, 128"); a ValueError naming the option where an item
    is empty ("1,,2", "1,") or not an integer. An item is ASCII digits with an optional sign (`int_of_text`, as the
    knob lists read theirs): int() took "1_000" and Arabic-Indic digits, which `--knobs` refuses."""
    from moetune.runtime.knobs import int_of_text

    items = [t.strip() for t in text.split(",")]
    # an empty item is a typo (a lost number), not something to skip silently
    if "" in items:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r} (an empty item)")
    out = [int_of_text(t) for t in items]
    if None in out:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r} (digits only, as in --knobs)")
    return [v for v in out if v is not None]


def tokens_over_bucket(counts: list[int], option: str = "--tokens") -> str:
    """Why `counts` are no token counts to tune or profile ('' when each is at most the largest token bucket): a
    larger count was tuned at the largest bucket without a word (`tune --tokens 99999999999` stored S=65536). One
    rule and message for `profile` and `tune`."""
    from moetune.runtime.profile_record import TOKEN_BUCKETS

    top = TOKEN_BUCKETS[-1]
    over = [t for t in counts if t > top]
    if not over:
        return ""
    return (f"{option}: {', '.join(map(str, over))} is above the largest token bucket ({top} tokens per rank), at "
            f"which it would be tuned; give counts up to {top}")


def distinct_buckets(counts: list[int], option: str = "--tokens") -> tuple[list[int], str]:
    """`counts` with one count per token bucket (the first given, order kept), and a note naming the counts that
    share a bucket ('' when none do): each bucket is one study, so `--tokens 128,128,100` tunes S=128 once."""
    from moetune.runtime.profile_record import nearest_bucket

    by_bucket: dict[int, list[int]] = {}
    for t in counts:
        by_bucket.setdefault(nearest_bucket(t), []).append(t)
    shared = [f"{', '.join(map(str, ts))} (bucket {b})" for b, ts in by_bucket.items() if len(ts) > 1]
    note = f"{option}: {'; '.join(shared)} share a token bucket, tuned once" if shared else ""
    return [ts[0] for ts in by_bucket.values()], note


def distinct_values(items: list[Any], option: str, done: str) -> tuple[list[Any], str]:
    """`items` with each one once (the first kept, order kept), and a note naming those given more than once ('' when
    none were): "OPTION: X given N times, DONE once" (`bench moe --engine unfused,unfused` timed every case again,
    `model sweep --values 2,2` printed the same point twice)."""
    repeated = {x: items.count(x) for x in items if items.count(x) > 1}
    if not repeated:
        return items, ""
    return list(dict.fromkeys(items)), (f"{option}: " + ", ".join(f"{x} given {n} times" for x, n in repeated.items())
                                        + (f", {done} once" if len(repeated) == 1 else f", each {done} once"))


def distinct_shapes(names: list[str], option: str = "--model") -> tuple[list[str], str]:
    """`names` with one name per model shape (the first given, order kept), and a note naming those that are one shape
    ('' when none are): a shape (hidden, intermediate, experts, top-k, dtype) is one key and one study per bucket, so
    `--model qwen3-30b --model qwen3-30b` (or qwen3-30b beside its custom:2048,768,128,8) tuned it twice: the second
    resumed the finished studies and measured the side-by-side check again, and printed every row twice. Each name
    must parse (`get_model`)."""
    from moetune.runtime.shapes import get_model

    by_shape: dict[tuple, list[str]] = {}
    for n in names:
        m = get_model(n)
        by_shape.setdefault((m.hidden, m.intermediate, m.experts, m.topk, m.dtype), []).append(n)
    shared = [", ".join(ns) for ns in by_shape.values() if len(ns) > 1]
    note = f"{option}: {'; '.join(shared)} {'is one model shape' if len(shared) == 1 else 'are one shape each'}, " \
           "tuned once" if shared else ""
    return [ns[0] for ns in by_shape.values()], note


EMPTY_PATH = "an empty path names no file or folder (give one; \".\" is the current folder)"


def path_text(text: str) -> str:
    """A path argument's parser (`typer.Argument(..., parser=path_text)`), the argument kept as typed (a str: "-" for
    stdout, say): "" is refused, naming the argument (Click says "Invalid value for 'PATH': ..."); so is a path below
    a folder this user may not search (mode 0000): every later look at it (exists, is_dir) raised PermissionError,
    and `report --out`, `model sweep --out`, `bench summarize --out`, `fabric capture`, `db upgrade --db` ended in
    its traceback. So is a path the file system cannot name (a name over 255 bytes): exists() and is_dir() raise
    its OSError, and `db current --db`, `--config`, `profile --plan`, `report --out`, `model predict --preset` (a
    name too long) ended in that traceback."""
    import os

    import typer

    if text == "":
        raise typer.BadParameter(EMPTY_PATH)
    try:
        os.stat(text)
    except PermissionError as e:
        raise typer.BadParameter(f"path {text!r} cannot be reached: a folder on the way may not be searched "
                                 f"({e.strerror or e})") from None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise typer.BadParameter(f"path {text!r} is too long for the file system ({e.strerror or e})") from None
        # missing, a dangling link: the command's own checks say what is wrong
    except ValueError:  # a NUL byte: as a missing path, the command's own checks say so
        pass
    return text


def path_arg(text: str) -> Path:
    """`path_text` for a Path argument. Converted as a Path, "" was ".": `profiles import ""` said "cannot read .: Is
    a directory" and `fabric capture ""` reported on the current folder. An existing path this user may not read is
    refused as Typer refuses it for a Path it converts ("path 'X' is not readable."): a capture folder of mode 0000
    ended `tune --capture` in a PermissionError traceback once the parser replaced Typer's conversion."""
    import os

    text = path_text(text)
    if os.path.exists(text) and not os.access(text, os.R_OK):
        import typer

        raise typer.BadParameter(f"path {text!r} is not readable.")
    return Path(text)


def path_option(default: Any, *names: str, **kwargs: Any) -> Any:
    """`typer.Option` for a Path option naming a file or folder (`--db`, `--config`, `--out`, ...): "" is refused up
    front, naming the option (exit 2, as Click's other bad values). Converted as a Path, "" was ".": `profile
    --report-dir ""` wrote its report into the current folder, `db path --db ""` printed ".", `tune --policy ""` was
    ignored. Shown `<path>` in the help, as Typer shows a Path option (a parser would show `<Path>`); an option of
    several paths (`list[Path]`) passes `metavar=None` to keep Typer's own."""
    import typer

    kwargs.setdefault("metavar", "<path>")
    return typer.Option(default, *names, parser=path_arg, **kwargs)


def path_text_option(default: Any, *names: str, **kwargs: Any) -> Any:
    """`path_option` for a str option naming a file (kept as typed: "-" for stdout, or a preset's name)."""
    import typer

    return typer.Option(default, *names, parser=path_text, **kwargs)


class NonEmptyText:
    """A text option's parser (`text_option`): the value as typed; "" (or blanks only) is refused up front, naming the
    option (exit 2, as `path_text` refuses an empty path), with `empty` saying what to give instead. An option whose
    default is None took "" for "left out" where it was tested as `if x:` or `x or default` (`tune --storage ""` used
    the default studies file, `query --socket ""` the configured endpoint), and as the start of a name it matched
    every one (`tune show --study ""` showed the only study)."""

    def __init__(self, empty: str) -> None:
        self.empty = empty

    def __call__(self, text: str) -> str:
        if not text.strip():
            import typer

            raise typer.BadParameter(self.empty)
        return text


def text_option(default: Any, *names: str, empty: str, **kwargs: Any) -> Any:
    """`typer.Option` for a str option that an empty value cannot mean (`NonEmptyText`); `empty`: the error's words,
    e.g. "an empty URL names no storage (leave the option out for ...)"."""
    import typer

    return typer.Option(default, *names, parser=NonEmptyText(empty), **kwargs)


# A write that failed as it was made, for want of room or by the device (no space, over quota, a file too large, an I/O
# error): nothing is wrong with the path given, the operation failed: exit 1. Any other error writing an output (no
# permission, a read-only file system, no such folder, a file in the way, a folder where a file goes) says the path
# given cannot take it: exit 2, as for a bad argument (the convention `moetune --help` states).
WRITE_FAILED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def write_error_code(e: BaseException) -> int:
    """The exit status for an error writing an output (its `errno`, see WRITE_FAILED_ERRNOS): 1 or 2."""
    return 1 if getattr(e, "errno", None) in WRITE_FAILED_ERRNOS else 2


def routing_problem(routing: str) -> str:
    """Why `routing` is no --routing value, naming the option ('' when it is one): the runtime's words
    (parse_routing's "unknown routing ''") named none."""
    from moetune.runtime.routing import parse_routing

    try:
        parse_routing(routing)
    except ValueError as e:
        return f"--routing: {e}"
    return ""


def nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists: where the folders of a new output file would be made."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


SEED_MAX = 2**32 - 1  # the sampler's seed (numpy's RandomState) is 0 .. 2**32 - 1: one range across the CLI


def seed_problem(seed: int) -> str:
    """Why `seed` is no --seed ('' when it is one): Optuna's sampler said "Seed must be between 0 and 2**32 - 1",
    naming no option."""
    return "" if 0 <= seed <= SEED_MAX else f"--seed must be an integer from 0 to {SEED_MAX} (2**32 - 1), got {seed}"


def _negative_numbers_last(args: list[str], valued: set[str]) -> list[str]:
    """`args` with each negative integer ("-1") that is no option's value moved behind a "--", so that the parser
    reads it as the positional argument it was meant as (Click reads "-1" as an option: `profiles show -1` said
    "No such option: -1"); the argument's own range check then refuses it, naming the argument. Unchanged where a
    "--" is given already (the user said where options end)."""
    import re

    if "--" in args:
        return args
    moved = {i for i, a in enumerate(args) if re.fullmatch(r"-\d+", a) and (i == 0 or args[i - 1] not in valued)}
    if not moved:
        return args
    return [a for i, a in enumerate(args) if i not in moved] + ["--"] + [args[i] for i in sorted(moved)]


def id_command_class() -> type:
    """The command class (`@app.command(cls=...)`) of a command whose one positional argument is a number (a profile
    id): a negative one reaches the argument's check instead of being read as an unknown option."""
    from typer.core import TyperCommand, TyperOption

    class IdCommand(TyperCommand):
        def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
            valued = {o for p in self.params if isinstance(p, TyperOption) and not p.is_flag for o in p.opts}
            return super().parse_args(ctx, _negative_numbers_last(list(args), valued))

    return IdCommand
