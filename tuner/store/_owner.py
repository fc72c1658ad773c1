"""Who runs a `tuning_runs` row while it is `running`: this process, as HOST:PID:START, and whether such an owner is
gone (a run killed with kill -9, or stopped by a full disk, never finished its row). And which node recorded a
fingerprint's facts as its own (`node_id`, the `fingerprints.node` of a row of origin 'local')."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

from moetune.runtime import _proc

# systemd's machine id, and D-Bus's older copy of it: set once when the OS is installed, kept across reboots and
# hardware changes (a GPU swap, a new NIC), unlike anything discovery reads
MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


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


def node_id() -> str:
    """This node, as the fingerprints it records as its own name it: a hash of the machine id (`MACHINE_ID_FILES`;
    hashed, as systemd asks of what leaves the machine: an export or a shared database), or of the host name where
    there is none (a container without one). Hardware-independent: a node whose GPUs changed is the same node, so
    the daemon compares its fabric with what this node's bring-up recorded (`Store.local_fingerprints`). Limits: a
    machine id copied into every node's image names them all alike; a renamed host without one is a new node."""
    for f in MACHINE_ID_FILES:
        try:
            mid = f.read_text(encoding="ascii", errors="replace").strip()
        except OSError:
            continue
        if mid and mid != "uninitialized":  # systemd's word for one not set up yet (first boot)
            return "m-" + hashlib.sha256(f"moetune-node:{mid}".encode()).hexdigest()[:16]
    return "h-" + hashlib.sha256(f"moetune-node:{socket.gethostname()}".encode()).hexdigest()[:16]
