"""`moetune fabric`: Discover this node's fabric, capture it, fingerprint it, diff it."""

from __future__ import annotations

import typer

app = typer.Typer(help="Discover this node's fabric, capture it, fingerprint it, diff it.", no_args_is_help=True)
