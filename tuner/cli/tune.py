"""`moetune tune`: Optuna searches over the EP knobs."""

from __future__ import annotations

import typer

app = typer.Typer(help="Optuna searches over the EP knobs.", no_args_is_help=True)
