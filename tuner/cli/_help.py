"""Corrections to Typer's Rich help (typer/rich_utils.py), applied once by `tuner/cli/_app.py`:

* a flag takes no value, yet the Rich panel printed a type for it (`--json <bool>`, `--help <bool>`), which reads as
  if a value were required; Typer's plain help (`get_help_record`) already prints none. A flag gets no metavar.
* an option with two long names was printed `--curve-clients-dir,--clients-dir`, one word; now
  `--curve-clients-dir, --clients-dir`, as click's plain help writes it (and the column may wrap at the space).

* at 80 columns an options table cut option names and long help words with '…' (`--rediscover-interv…`,
  `--no-allow-insecur…`, `daemon.rediscover_i…`, `pipeline_d…`): Rich shrank the widest columns evenly, names
  included, and its cells cut what did not fit. Now a flag's `--x / --no-x` share one cell (as click writes them),
  every column but the help one keeps its longest word when the table can hold it (the help column gives up the
  width), and a word longer than its column folds onto the next line: every name and number is shown whole.

All patch Typer's help rendering only: parsing is untouched. Each is applied on its own: if a Typer release lacks or
renames what one patches (display_type_rich is Typer >= 0.29), that part keeps Typer's own rendering (nothing fails).
"""

from __future__ import annotations

import re
from typing import Any

_NAMES = re.compile(r"--[\w-]+(?:,--[\w-]+)+")


def apply() -> None:
    """Apply the corrections, each on its own: a Typer without display_type_rich still gets the others."""
    try:
        from typer import rich_utils
        from typer.core import TyperOption
    except ImportError:  # a Typer without these: its own help
        return
    _flags_without_metavar(TyperOption)
    _names_spaced(rich_utils)
    _nothing_cut(rich_utils)


def _flags_without_metavar(option_cls: Any) -> None:
    shown = getattr(option_cls, "display_type_rich", None)  # Typer >= 0.29
    if shown is None or getattr(option_cls, "_moetune_help", False):  # absent or renamed: Typer's own help
        return

    def display_type_rich(self: Any, *args: Any, **kwargs: Any) -> str | None:  # Typer calls it (ctx=ctx)
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None  # a flag: nothing follows it on the command line
        return shown(self, *args, **kwargs)

    option_cls.display_type_rich = display_type_rich
    option_cls._moetune_help = True


def _names_spaced(rich_utils: Any) -> None:
    try:
        from rich.highlighter import RegexHighlighter
    except ImportError:
        return
    old = getattr(rich_utils, "highlighter", None)
    if not isinstance(old, RegexHighlighter) or getattr(old, "_moetune_help", False):
        return
    base = type(old)

    class _Names(base):  # type: ignore[misc, valid-type]
        _moetune_help = True

        def __call__(self, text: Any) -> Any:
            if isinstance(text, str) and _NAMES.fullmatch(text):
                text = text.replace(",", ", ")
            return super().__call__(text)

    rich_utils.highlighter = _Names()


def _fold(renderable: Any) -> None:
    """A Text (or the Texts a Columns holds) folds a word longer than its line instead of cutting it with '…'."""
    from rich.text import Text

    if isinstance(renderable, Text):
        renderable.overflow = "fold"
    for item in getattr(renderable, "renderables", None) or ():
        if isinstance(item, Text):
            item.overflow = "fold"


def _nothing_cut(rich_utils: Any) -> None:
    """Typer's options table (rich_utils.Table, one per panel) shows every name whole; see the module's docstring."""
    try:
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return
    base = getattr(rich_utils, "Table", None)
    if base is not Table or not hasattr(Table, "_calculate_column_widths") or not hasattr(Table, "_measure_column"):
        return  # already patched, or a Rich whose table works otherwise: its own rendering

    class _HelpTable(Table):
        _moetune_help = True
        _options_rows: bool | None = None

        def add_row(self, *renderables: Any, **kwargs: Any) -> None:
            # Typer's options rows: [required,] long names, short names, --no-x names, their short names, type, help
            if self._options_rows is None:
                self._options_rows = not self.columns and len(renderables) in (6, 7)
            if self._options_rows and len(renderables) in (6, 7):
                cells = list(renderables)
                at = len(cells) - 6
                names, negative = cells[at], cells[at + 2]
                if isinstance(names, Text) and isinstance(negative, Text) and negative.plain:
                    cells[at] = Text.assemble(names, " / ", negative) if names.plain else negative
                    cells[at + 2] = Text("")
                for cell in cells:
                    _fold(cell)
                renderables = tuple(cells)
            super().add_row(*renderables, **kwargs)

        def _calculate_column_widths(self, console: Any, options: Any) -> list[int]:
            widths = list(super()._calculate_column_widths(console, options))
            try:
                return _keep_longest_words(self, console, options, widths)
            except Exception:  # a Rich that measures otherwise: its own widths (folding still cuts nothing)
                return widths

    rich_utils.Table = _HelpTable


def _keep_longest_words(table: Any, console: Any, options: Any, widths: list[int]) -> list[int]:
    """Widen each column but the last (the help / description) to its longest word, taken from the last one while it
    keeps a quarter of the table (and at least 12 columns); what still does not fit folds."""
    cols = table.columns
    if len(cols) < 2 or len(widths) != len(cols):
        return widths
    mins = [table._measure_column(console, options, c).minimum for c in cols]
    need = sum(max(0, m - w) for m, w in zip(mins[:-1], widths[:-1], strict=True))
    if need <= 0:
        return widths
    spare = widths[-1] - max(mins[-1] if mins[-1] <= widths[-1] else 0, 12, sum(widths) // 4)
    if spare < need:  # not all at once: take what the help column can give, in column order
        need = max(spare, 0)
    out = list(widths)
    for i in range(len(cols) - 1):
        add = min(max(0, mins[i] - out[i]), need)
        out[i] += add
        out[-1] -= add
        need -= add
    return out


# -- examples under a command's --help (its epilog) ---------------------------------------------------------------
# Each is (what it does, the command line as typed). tests/test_docs_commands.py parses every command line against
# the real command (and runs the cheap ones), so an example cannot name an option that is gone or a value refused.
QUERY_ENV = "moetune query --model qwen3-30b --ep 8 --tokens 128 --format env"
EXAMPLES: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {
    ("query",): (
        ("the tuned knobs, where they came from and why", "moetune query --model qwen3-30b --ep 8 --tokens 128"),
        ("export them into this shell before a launcher starts the job", f'eval "$({QUERY_ENV})"'),
    ),
    ("profile",): (
        ("a short bring-up of this node (one model, two buckets, few trials)", "moetune profile --quick"),
        ("the plan of a file (the 2 x H200 node's; a sample below)",
         "moetune profile --plan bench/plans/h200x2.toml"),
    ),
    ("tune",): (
        ("predict with the fabric model (no GPU needed; stored as MODELLED)",
         "moetune tune --model qwen3-30b --tokens 128,1024 --backend model --preset nvlink-h200x2"),
        ("measure on this node: 2 ranks launched here (nccl with GPUs, else gloo)",
         "moetune tune --model qwen3-30b --tokens 128 --backend local --world 2 --trials 20"),
        ("the studies kept (--study NAME: one of them)", "moetune tune show"),
    ),
    ("serve",): (
        ("in the foreground, on this user's default socket and database (Ctrl-C or SIGTERM stops it: exit 130 / 143)",
         "moetune serve"),
        ("on a socket of its own, which clients then name (moetune status --socket ipc:///tmp/moetune-demo/daemon.sock)",
         "moetune serve --socket ipc:///tmp/moetune-demo/daemon.sock"),
    ),
    ("model", "predict"): (
        ("one knob set's predicted latency on a preset",
         "moetune model predict --preset nvlink-h200x2 --tokens 1024 --knobs compression=fp8_e4m3,pipeline_depth=2"),
    ),
}
# a plan file, shown under `profile --help` (the test loads it as `--plan` would)
PLAN_SAMPLE = '[plan]\nmodels = ["qwen3-30b"]\ntokens = [1024, 4096]\ntrials = 8'


def example_lines(path: tuple[str, ...]) -> list[str]:
    """The `moetune ...` command lines of `path`'s examples, as run (the one inside `eval "$(...)"` too)."""
    out = []
    for _why, line in EXAMPLES[path]:
        m = re.fullmatch(r'eval "\$\((.*)\)"', line)
        out.append(m.group(1) if m else line)
    return out


def examples(path: tuple[str, ...]) -> str:
    """The epilog of `path`'s --help: "Examples:", each as what it does and its command line (Rich markup escaped:
    Typer's Rich help keeps single line breaks of an epilog)."""
    from rich.markup import escape

    lines = ["Examples:"]
    for why, line in EXAMPLES[path]:
        lines += [f"{why}:", f"  {line}"]  # Typer's Rich help dedents the epilog: the command lines stand out
    if path == ("profile",):
        lines += ["a plan file (TOML): a [plan] table, or its keys at the top:", *(f"  {t}" for t in
                                                                                   PLAN_SAMPLE.splitlines())]
    return escape("\n".join(lines))
