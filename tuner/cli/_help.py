"""Two corrections to Typer's Rich help (typer/rich_utils.py), applied once by `tuner/cli/__init__.py`:

* a flag takes no value, yet the Rich panel printed a type for it (`--json <bool>`, `--help <bool>`), which reads as
  if a value were required; Typer's plain help (`get_help_record`) already prints none. A flag gets no metavar.
* an option with two long names was printed `--curve-clients-dir,--clients-dir`, one word; now
  `--curve-clients-dir, --clients-dir`, as click's plain help writes it (and the column may wrap at the space).

Both patch Typer's help rendering only: parsing is untouched. If a Typer release renames what is patched, the help
keeps Typer's own rendering (nothing fails).
"""

from __future__ import annotations

import re
from typing import Any

_NAMES = re.compile(r"--[\w-]+(?:,--[\w-]+)+")


def apply() -> None:
    try:
        from rich.highlighter import RegexHighlighter
        from typer import rich_utils
        from typer.core import TyperOption
    except ImportError:  # a Typer without these: its own help
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(TyperOption, "_moetune_help", False):  # renamed in a later Typer: its own help
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None  # a flag: nothing follows it on the command line
        return shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]
    TyperOption._moetune_help = True  # type: ignore[attr-defined]
    old = getattr(rich_utils, "highlighter", None)
    if not isinstance(old, RegexHighlighter):
        return
    base = type(old)

    class _Names(base):  # type: ignore[misc, valid-type]
        def __call__(self, text: Any) -> Any:
            if isinstance(text, str) and _NAMES.fullmatch(text):
                text = text.replace(",", ", ")
            return super().__call__(text)

    rich_utils.highlighter = _Names()
