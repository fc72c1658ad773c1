"""Two corrections to Typer's Rich help (typer/rich_utils.py), applied once by `tuner/cli/__init__.py`:

* a flag takes no value, yet the Rich panel printed a type for it (`--json <bool>`, `--help <bool>`), which reads as
  if a value were required; Typer's plain help (`get_help_record`) already prints none. A flag gets no metavar.
* an option with two long names was printed `--curve-clients-dir,--clients-dir`, one word; now
  `--curve-clients-dir, --clients-dir`, as click's plain help writes it (and the column may wrap at the space).

Both patch Typer's help rendering only: parsing is untouched. Each is applied on its own: if a Typer release lacks or
renames what one patches (display_type_rich is Typer >= 0.29), that part keeps Typer's own rendering (nothing fails).
"""

from __future__ import annotations

import re
from typing import Any

_NAMES = re.compile(r"--[\w-]+(?:,--[\w-]+)+")


def apply() -> None:
    """Apply both corrections, each on its own: a Typer without display_type_rich still gets the names fix."""
    try:
        from typer import rich_utils
        from typer.core import TyperOption
    except ImportError:  # a Typer without these: its own help
        return
    _flags_without_metavar(TyperOption)
    _names_spaced(rich_utils)


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
