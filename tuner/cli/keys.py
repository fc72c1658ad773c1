"""`moetune keys`: CURVE keys for a daemon listening on TCP."""

from __future__ import annotations

import typer

app = typer.Typer(help="CURVE keys for a daemon listening on TCP.", no_args_is_help=True)
