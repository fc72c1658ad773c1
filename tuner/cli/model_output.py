"""What the `moetune model` commands print and write through: the console, the MODELLED label, escaped user text, --out checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from moetune.tuner.cli.db import abort

console = Console()
LABEL = "MODELLED"


_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup


def esc(value: Any) -> str:
    """User-supplied text (preset names, paths, rows of a data file) printed through Rich: escaped, so a
    '[' in it is shown as typed and never read as markup."""
    return escape(str(value))


def check_out_file(out: Path, example: str) -> None:
    """Refuse an --out that cannot be a file to write: a directory, a path below a file, or one in a folder that
    does not exist (no folder is made for it, as for --db: a typo must not leave a new tree behind)."""
    if out.is_dir():
        _fail(f"--out {out} is a directory; give a file name, e.g. {out / example}")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            _fail(f"--out {out}: {parent} is a file, not a directory")
    if not out.parent.is_dir():
        _fail(f"--out {out}: the folder {out.parent} does not exist (moetune does not create it: create it first "
              "or give another path)")
    from moetune.tuner.measure.results import write_problem

    why = write_problem(out)
    if why:  # a read-only disk or folder: refused before the work, not after it
        _fail(f"--out {out}: cannot write there ({why}); give a writable file with --out")
