"""Which node the runtime is on, as far as tuned profiles are concerned: a fingerprint and a software hash.

A profile is applied as tuned only when it was measured on this node's fingerprint and software
(`ProfileRecord.is_tuned_for`). The runtime never runs fabric discovery (tuner code), so it learns its
identity from what the tuner recorded, in this order:

1. `daemon.json` in a trusted runtime directory: the fingerprint and software hash the daemon last
   discovered on this node (the directory is node-local, so the file is this node's);
2. without it, the `fingerprints` table of the database (written by the daemon, `moetune fabric` and
   `moetune profile` with the facts they were computed from), newest first, cross-checked against what
   the runtime can read in a few milliseconds: the GPU UUIDs and driver version in /proc/driver/nvidia,
   and the installed torch and moetune versions. A database shared by several nodes, or one recorded
   before a GPU, driver or torch change, fails the check;
3. else no identity: no database profile is trusted (the caller falls back to policy defaults, loudly).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.runtime.profile_record import is_preset_fingerprint

PROC_ROOT = Path("/proc")  # tests point this at a captured /proc
# Mirrors moetune.tuner.fabric.fingerprint.software_hash (a test keeps the two equal): the runtime may not
# import the tuner, and it needs the hash of the software recorded with a fingerprint.
_FINGERPRINT_VERSION = 1
_SOFTWARE_KEYS = ("driver", "cuda", "cuda_runtime", "nccl", "nvshmem", "torch", "nvshmem4py", "libfabric", "moetune")
_NONE = ("", "none")


@dataclass(frozen=True)
class NodeIdentity:
    fingerprint: str
    software: str
    source: str  # where it came from, for the messages
    checked: tuple[str, ...] = field(default=())


def software_hash(facts: dict[str, Any]) -> str:
    sw = facts.get("software", {}) or {}
    canon = {"v": _FINGERPRINT_VERSION, **{k: str(sw.get(k, "none")) for k in _SOFTWARE_KEYS}}
    dump = json.dumps({"software": canon}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


def from_daemon_info(info: dict[str, Any] | None, where: str) -> NodeIdentity | None:
    if not info:
        return None
    fp, sw = info.get("fingerprint"), info.get("software")
    if isinstance(fp, str) and fp and isinstance(sw, str) and sw:
        return NodeIdentity(fp, sw, f"daemon.json in {where}")
    return None


# -- what the runtime can read cheaply ---------------------------------------------------------------
def local_gpu_uuids(proc: Path | None = None) -> set[str] | None:
    """UUIDs of this node's GPUs from /proc/driver/nvidia/gpus/*/information (None: no NVIDIA driver)."""
    root = (proc or PROC_ROOT) / "driver" / "nvidia" / "gpus"
    try:
        entries = list(root.iterdir())
    except OSError:
        return None
    out: set[str] = set()
    for e in entries:
        try:
            text = (e / "information").read_text(errors="replace")
        except OSError:
            return None
        m = re.search(r"GPU UUID:\s*(\S+)", text)
        if m is None:
            return None
        out.add(m.group(1))
    return out


def local_driver(proc: Path | None = None) -> str | None:
    try:
        text = ((proc or PROC_ROOT) / "driver" / "nvidia" / "version").read_text(errors="replace")
    except OSError:
        return None
    # "NVIDIA UNIX x86_64 Kernel Module  535.104.05" or "NVIDIA UNIX Open Kernel Module for x86_64  550.90.07"
    # (the open module, what Hopper and Blackwell nodes run): as discovery reads it
    m = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]*)", text)
    return m.group(1) if m else None


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def mismatch(facts: dict[str, Any], proc: Path | None = None) -> tuple[str | None, tuple[str, ...]]:
    """(why the recorded `facts` are not this node, or None; what was checked)."""
    checked: list[str] = []
    gpus = [g for g in facts.get("gpus", []) or [] if isinstance(g, dict)]
    recorded = {str(g.get("uuid")) for g in gpus if g.get("uuid")}
    here = local_gpu_uuids(proc)
    if here is None and gpus:
        return "cannot read this node's GPUs (/proc/driver/nvidia/gpus) to check the recorded ones", tuple(checked)
    if here is not None:
        if len(here) != len(gpus):
            return f"{len(here)} GPUs here, {len(gpus)} recorded", tuple(checked)
        if len(recorded) == len(gpus) and recorded != here:
            return "the GPUs here are not the recorded ones (UUIDs differ)", tuple(checked)
        checked.append("GPU UUIDs" if recorded else "GPU count")
    sw = facts.get("software", {}) or {}
    for name, have in (("driver", local_driver(proc)), ("torch", _dist_version("torch")), ("moetune", _dist_version("moetune"))):
        want = str(sw.get(name, "none"))
        if want in _NONE:
            continue
        if have is None:
            return f"cannot read this node's {name} version to check the recorded {want}", tuple(checked)
        if have != want:
            return f"{name} {have} here, {want} recorded", tuple(checked)
        checked.append(name)
    return None, tuple(checked)


def from_fingerprint_rows(rows: list[tuple]) -> tuple[NodeIdentity | None, str]:
    """The newest recorded fingerprint whose facts match this node, or (None, why not).

    `rows`: (hash, facts JSON, last_seen) from the store's `fingerprints` table, newest first.
    """
    if not rows:
        return None, "no fingerprint recorded in the database"
    reasons: list[str] = []
    for fp, raw, seen in rows:
        try:
            facts = json.loads(raw) if isinstance(raw, str | bytes) else raw
        except ValueError:
            reasons.append(f"{fp}: unreadable facts")
            continue
        if not isinstance(facts, dict) or not isinstance(fp, str):
            continue
        if is_preset_fingerprint(fp):
            continue  # a what-if preset's (`moetune tune --preset`): a modelled fabric, never a node
        if not facts.get("gpus") and not facts.get("software"):
            # nothing recorded to check against this node: it would match any node, so it proves nothing
            reasons.append(f"{fp}: no facts recorded (no GPUs, no software) to check this node against")
            continue
        why, checked = mismatch(facts)
        if why is None:
            return NodeIdentity(fp, software_hash(facts), f"database fingerprint {fp} (last seen {seen})", checked), ""
        reasons.append(f"{fp}: {why}")
    return None, "no recorded fingerprint matches this node (" + "; ".join(reasons[:3]) + ")"
