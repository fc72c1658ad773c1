"""Who runs a `tuning_runs` row while it is `running`: this process, as HOST:PID:START, and whether such an owner is
gone (a run killed with kill -9, or stopped by a full disk, never finished its row)."""

from __future__ import annotations

import os
import socket

from moetune.runtime import _proc


def run_owner() -> str:
    """This process as a run's owner: HOST:PID:START (START: `_proc.start_ticks`, '' where /proc cannot tell)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_proc.start_ticks() or ''}"


def owner_gone(owner: str | None) -> bool:
    """Whether the process `owner` (run_owner's text) no longer runs: on this host only, its pid gone (a zombie
    too) or given to a process that started at another time. False where that cannot be told (another host, no
    owner recorded, an owner in another form): such a row is never touched."""
    if not owner:
        return False
    try:
        host, pid_text, start = owner.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    same = _proc.same_process(pid, int(start)) if start.isdigit() else None
    return not same if same is not None else _proc.pid_gone(pid)
