"""`moetune bench`: Benchmarks on this node: EP dispatch/combine and transport microbenchmarks."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks on this node: EP dispatch/combine and transport microbenchmarks.", no_args_is_help=True)
