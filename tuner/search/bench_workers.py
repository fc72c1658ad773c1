"""The local backend's processes: a run in its own process group (`run_in_group`) and the persistent bench worker.

A hung run is killed with its whole group; `BenchWorker` drives one `python -m moetune.tuner.measure.worker`
process (the ranks stay up across runs) with a bounded wait on every answer.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def run_in_group(argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float,
                 cwd: str | None = None) -> tuple[int | None, str, str, float]:
    """Run argv in its own process group; on timeout kill the whole group. Returns (rc|None, out, err, s)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        return None, out or "", err or "", time.monotonic() - t0
    except BaseException:  # kill the run's process group, then re-raise
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


class WorkerDied(RuntimeError):
    pass


class WorkerTimeout(RuntimeError):
    pass


class BenchWorker:
    """One persistent bench worker process (`python -m moetune.tuner.measure.worker`) in its own process
    group, with a bounded wait on every answer. Its stdout lines and stderr tail are read by threads."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]):
        self.argv = list(argv)
        self.proc = subprocess.Popen(self.argv, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.ready = False
        self.next_id = 0
        self.started = time.monotonic()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_tail.append, False),
                         daemon=True).start()

    @staticmethod
    def _pump(stream: Any, sink: Callable[[Any], None], eof_marker: bool) -> None:
        try:
            for line in stream:
                sink(line.rstrip("\n"))
        except (ValueError, OSError):
            pass
        finally:
            if eof_marker:
                sink(None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _next(self, deadline: float) -> dict[str, Any]:
        """The next protocol line; WorkerTimeout at the deadline, WorkerDied at EOF or garbled output."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeout()
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise WorkerDied()
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                raise WorkerDied(f"garbled worker output (no JSON object): {line[:200]!r}")
            return obj

    def start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self._next(deadline).get("ready"):
                self.ready = True

    def request(self, case: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.next_id += 1
        cid = self.next_id
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({**case, "id": cid}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise WorkerDied() from None
        deadline = time.monotonic() + timeout_s
        while True:
            obj = self._next(deadline)
            if obj.get("id") == cid:
                return obj

    def exit_status(self, wait_s: float = 10.0) -> int | None:
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def error_tail(self) -> str:
        time.sleep(0.05)  # let the stderr reader catch up
        return " | ".join([ln for ln in self.stderr_tail if ln.strip()][-3:])

    def kill(self) -> None:
        _kill_group(self.proc)
        self.exit_status(10)
        self._close_pipes()

    def close(self, wait_s: float = 10.0) -> None:
        """EOF on stdin ends the worker cleanly; the group is killed if it does not end within wait_s."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
        if self.exit_status(wait_s) is None:
            _kill_group(self.proc)
            self.exit_status(10)
        else:
            try:  # stragglers of the group (the ranks' helpers), if any
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._close_pipes()

    def _close_pipes(self) -> None:
        for s in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if s is not None:
                    s.close()
            except (OSError, ValueError):
                pass


def close_workers(workers: dict[Any, BenchWorker]) -> None:
    for w in list(workers.values()):
        try:
            w.close(wait_s=5)
        except Exception:  # broad: best effort at shutdown; one worker must not leave the others running
            pass
    workers.clear()
