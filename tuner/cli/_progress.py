"""The Rich drawing of `moetune.tuner.search.progress.Progress`: a bar per task, on stderr so `--json` stays clean."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RichProgress:
    def __init__(self, console: Console | None = None, *, transient: bool = False, label: str = ""):
        self._label = f" {label}" if label else ""  # e.g. MODELLED: a model backend's "best" is a prediction
        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[best]}"), TimeElapsedColumn(), transient=transient,
                           console=console or Console(stderr=True))
        self._p.start()

    def add(self, description: str, total: int, done: int = 0) -> Any:
        return self._p.add_task(description, total=total, completed=min(done, total), best="")

    def update(self, task: Any, done: int, best: float | None = None, description: str | None = None) -> None:
        fields: dict[str, Any] = {"completed": done}
        if best is not None:
            fields["best"] = f"best {best:,.1f} µs{self._label}"
        if description is not None:
            fields["description"] = description
        self._p.update(task, **fields)

    def close(self) -> None:  # the caller that made the bar closes it (idempotent)
        if self._p.live.is_started:
            self._p.stop()
