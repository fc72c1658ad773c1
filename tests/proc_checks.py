"""Process checks the tests that stop commands share: whether a pid still runs, waiting for pids to go, clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids of `pids` still running after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill(pids: list[int], proc: subprocess.Popen | None = None) -> None:
    """SIGKILL to `pids` and to `proc` (reaped) if it still runs: a test's clean-up whatever it stopped at."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
