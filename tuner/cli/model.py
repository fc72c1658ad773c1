"""`moetune model`: The fabric model: predicted (modelled) dispatch/combine cost on any fabric."""

from __future__ import annotations

import typer

app = typer.Typer(help="The fabric model: predicted (modelled) dispatch/combine cost on any fabric.", no_args_is_help=True)
