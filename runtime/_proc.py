"""Is process `pid` of this host still the one we knew? Read off /proc/<pid>/stat (Linux), never off a clock.

A process is known by its pid and its start time in clock ticks since boot (/proc/<pid>/stat's field 22): a pid
reused by a later process has other ticks. No wall-clock time is compared: another process's time zone, a DST
change or an NTP step cannot make a live process look dead. Where there is no /proc, only os.kill(pid, 0) tells."""

from __future__ import annotations

import os


def _stat_after_comm(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields from field 3 (state) on; None where it cannot be read. The command name (field 2)
    may hold spaces and parentheses: the fields after it start after the LAST ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    _, sep, rest = text.rpartition(b")")
    if not sep:
        return None
    return rest.decode("ascii", "replace").split()


def start_ticks(pid: int | str = "self") -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22); None where /proc cannot tell."""
    fields = _stat_after_comm(pid)
    try:
        return int(fields[19]) if fields else None  # fields 3, 4, ... 22
    except (IndexError, ValueError):
        return None


def is_zombie(pid: int) -> bool:
    """Whether `pid` is a zombie (dead, not yet reaped by its parent): False where /proc cannot tell."""
    fields = _stat_after_comm(pid)
    return bool(fields) and fields[0] == "Z"


def pid_gone(pid: int) -> bool:
    """Whether no process `pid` runs on this host (a zombie, killed and not yet reaped, is gone too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: another user's process, alive
        pass
    return is_zombie(pid)


def same_process(pid: int, ticks: int) -> bool | None:
    """Whether the process that started at `ticks` (`start_ticks` of it) still runs as `pid`: its stat exists, is not
    a zombie's and has those ticks (a reused pid has others). None where /proc cannot tell (not Linux, or /proc
    hides other processes, or no such process): the caller falls back to `pid_gone`, which tells those apart."""
    fields = _stat_after_comm(pid)
    if fields is None:
        return None
    if fields[0] == "Z":
        return False
    try:
        return int(fields[19]) == ticks
    except (IndexError, ValueError):
        return None
