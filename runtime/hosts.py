"""Which host a rank runs on, and how many hosts a process group spans: what autoload keys a profile's node count by
(profiles/autoload.py) and what host_staged, whose staging memory is one host's file, checks its group against.
Here, below both, since the transports never import the profiles."""

from __future__ import annotations

import hashlib
import socket
from typing import Any

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_identity() -> str:
    """What tells this node from another: the kernel's boot id, which every container on one host shares (each may
    have its own host name, yet they share the node's NVLink) and no two hosts do (host names may repeat across
    nodes); the host name where it cannot be read (not Linux)."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        boot = ""
    return f"boot:{boot}" if boot else f"host:{socket.gethostname()}"


def host_hash(identity: str) -> int:
    """A host identity as one int64 a collective can carry (56 bits of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:7], "little")


def group_host_hashes(group: Any, device: Any, identity: str | None = None) -> list[int]:
    """The `host_hash` of every rank of `group` (initialised torch.distributed), in group rank order: an all-gather
    on `device` (one the group's backend takes) of this rank's `identity` (None: `host_identity()`). Collective."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([host_hash(host_identity() if identity is None else identity)], dtype=torch.int64,
                        device=device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, mine, group=group)
    return [int(t.item()) for t in got]


def group_host_count(group: Any, device: Any) -> int:
    """How many hosts the ranks of `group` run on (`group_host_hashes`). Collective."""
    return len(set(group_host_hashes(group, device)))
