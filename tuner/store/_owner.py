"""Who runs a `tuning_runs` row while it is `running`: this process, as HOST:PID:START, and whether such an owner is
gone (a run killed with kill -9, or stopped by a full disk, never finished its row)."""

from __future__ import annotations

import os
import socket


def _start_time(pid: int) -> str:
    """The start time of process `pid` in clock ticks since boot (/proc/PID/stat, field 22); '' where it cannot be
    read (no /proc, no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces and ')'
    return fields[19] if len(fields) > 19 else ""


def run_owner() -> str:
    """This process as a run's owner: HOST:PID:START."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def owner_gone(owner: str | None) -> bool:
    """Whether the process `owner` (run_owner's text) no longer runs: on this host only, its pid gone or given to a
    process that started at another time. False where that cannot be told (another host, no owner recorded, an
    owner in another form): such a row is never touched."""
    if not owner:
        return False
    try:
        host, pid_text, start = owner.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # PermissionError: another user's live process
    now = _start_time(pid)
    return bool(start and now and now != start)  # the pid now names another process
