"""`moetune profiles`: Tuned profiles in the database: list, show, delete, export, import."""

from __future__ import annotations

import typer

app = typer.Typer(help="Tuned profiles in the database: list, show, delete, export, import.", no_args_is_help=True)
