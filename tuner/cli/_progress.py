"""The drawing of `moetune.tuner.progress.Progress`, on stderr so `--json` stays clean.

On a terminal: a Rich bar per task. Anywhere else (a CI log, the systemd journal, `2>log`) Rich Live draws nothing
until it stops, so a long tune looked hung for minutes: there it prints plain lines instead, one as each step
starts or completes (at most one every `every_s` seconds while steps complete faster, the last always) and, while
nothing completes, a "still running" line every `heartbeat_s` seconds, each with done/total and the elapsed time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RichProgress:
    """A bar per task on a terminal, plain progress lines on any other stream (`_Lines`)."""

    def __init__(self, console: Console | None = None, *, transient: bool = False, label: str = "",
                 every_s: float = 2.0, heartbeat_s: float = 30.0):
        console = console or Console(stderr=True)
        self._impl: _Bars | _Lines = (_Bars(console, transient=transient, label=label) if console.is_terminal
                                      else _Lines(console, label=label, every_s=every_s, heartbeat_s=heartbeat_s))

    def add(self, description: str, total: int, done: int = 0) -> Any:
        return self._impl.add(description, total, done)

    def update(self, task: Any, done: int, best: float | None = None, description: str | None = None) -> None:
        self._impl.update(task, done, best, description)

    def close(self) -> None:  # the caller that made the bar closes it (idempotent)
        self._impl.close()


def _best(best: float, label: str) -> str:
    return f"best {best:,.1f} µs{label}"  # label e.g. MODELLED: a model backend's "best" is a prediction


class _Bars:
    def __init__(self, console: Console, *, transient: bool, label: str):
        self._label = f" {label}" if label else ""
        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[best]}"), TimeElapsedColumn(), transient=transient,
                           console=console)
        self._p.start()

    def add(self, description: str, total: int, done: int = 0) -> Any:
        return self._p.add_task(description, total=total, completed=min(done, total), best="")

    def update(self, task: Any, done: int, best: float | None, description: str | None) -> None:
        fields: dict[str, Any] = {"completed": done}
        if best is not None:
            fields["best"] = _best(best, self._label)
        if description is not None:
            fields["description"] = description
        self._p.update(task, **fields)

    def close(self) -> None:
        if self._p.live.is_started:
            self._p.stop()


@dataclass
class _Task:
    description: str
    total: int
    done: int
    started: float
    best: float | None = None
    shown: tuple[int, float | None] = field(default=(-1, None))  # (done, best) of the last line printed


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Lines:
    """Plain lines for a stream that is no terminal; a daemon thread prints the "still running" lines."""

    def __init__(self, console: Console, *, label: str, every_s: float, heartbeat_s: float):
        self._c, self._label, self._every, self._beat = console, f" {label}" if label else "", every_s, heartbeat_s
        self._tasks: list[_Task] = []
        self._lock = threading.RLock()
        self._last_line = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _print(self, t: _Task, what: str, sep: str = ": ") -> None:  # under the lock
        now = time.monotonic()
        best = f", {_best(t.best, self._label)}" if t.best is not None else ""
        self._c.print(f"{t.description}{sep}{what}{best}, elapsed {_clock(now - t.started)}", markup=False,
                      highlight=False, soft_wrap=True)
        t.shown, self._last_line = (t.done, t.best), now

    def add(self, description: str, total: int, done: int = 0) -> Any:
        with self._lock:
            t = _Task(description, total, min(done, total), time.monotonic())
            self._tasks.append(t)
            self._print(t, f"{'started' if t.done == 0 else 'resumed'}, {t.done}/{t.total} done")
            if self._thread is None and self._beat > 0:
                self._thread = threading.Thread(target=self._heartbeat, name="moetune-progress", daemon=True)
                self._thread.start()
            return len(self._tasks) - 1

    def update(self, task: Any, done: int, best: float | None, description: str | None) -> None:
        with self._lock:
            if self._closed or not isinstance(task, int) or not 0 <= task < len(self._tasks):
                return
            t = self._tasks[task]
            moved, t.done = done != t.done, min(done, t.total)
            if best is not None:
                t.best = best
            if description is not None and description != t.description:
                t.description = description
                if t.done < t.total:  # a step named as it starts (`bench moe`'s cases, `profile`'s stages)
                    self._print(t, f"({t.done + 1}/{t.total}) ...", sep=" ")
                    return
                moved = True
            if not moved:
                if t.done >= t.total and (t.done, t.best) != t.shown:
                    # a finished task's best given after its last line (a resumed study's, whose "resumed, N/N done"
                    # came before it was read): said now, in its place, not when the progress closes after the lines
                    # printed since (`profile`'s "→ report")
                    self._print(t, f"{t.done}/{t.total} done")
                return
            if t.done >= t.total or time.monotonic() - self._last_line >= self._every:
                self._print(t, f"{t.done}/{t.total} done")

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(self._beat, 1.0)):
            with self._lock:
                if self._closed or time.monotonic() - self._last_line < self._beat:
                    continue
                running = [t for t in self._tasks if t.done < t.total]
                if running:
                    t = running[-1]
                    self._print(t, f"{t.done}/{t.total} done, still running")
                else:
                    self._last_line = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for t in self._tasks:  # the state a throttled update did not print (an interrupted run's last count)
                if t.shown != (t.done, t.best):
                    self._print(t, f"{t.done}/{t.total} done")
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
