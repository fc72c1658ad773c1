"""`moetune db`: The profile database: migrations."""

from __future__ import annotations

import typer

app = typer.Typer(help="The profile database: migrations.", no_args_is_help=True)
