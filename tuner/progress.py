"""Progress of long work, reported without drawing it: library code takes a sink, the CLI draws it.

typer and rich live only in `tuner/cli/` (import rule 5); `tuner/cli/_progress.py` has the Rich sink. This module
sits below every tuner layer (import rule 3: `progress` < fabric, fabric_model, store, measure < search < ...), so
the fabric model's calibration, the MoE benchmarks and the search all take the same sink; it imports nothing of
moetune. `moetune.tuner.search.progress` re-exports it (the import path the search and the bring-up use).
"""

from __future__ import annotations

from typing import Any, Protocol


class Progress(Protocol):
    """One bar per task: `add` a task (a study, the micro-benchmarks), `update` it, `close` at the end."""

    def add(self, description: str, total: int, done: int = 0) -> Any: ...

    def update(self, task: Any, done: int, best: float | None = None, description: str | None = None) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    """The silent sink (daemon jobs, tests). The CLI draws progress on stderr, with `--json` too."""

    def add(self, description: str, total: int, done: int = 0) -> Any:
        return None

    def update(self, task: Any, done: int, best: float | None = None, description: str | None = None) -> None:
        return None

    def close(self) -> None:
        return None
