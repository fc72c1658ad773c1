"""Where the proxy thread runs: one CPU local to its GPU's NUMA node (the runtime option `proxy_cpu`).

The proxy thread busy-polls the request FIFO in pinned host memory and issues the copies; left to the OS it
may run on the far socket from its GPU (every poll of the FIFO and every CUDA call then crosses the
inter-socket link) or share a core with the job's own busy threads. With `proxy_cpu="numa"` (the default) it
pins itself to one CPU the kernel lists as local to the GPU (`/sys/bus/pci/devices/<address>/local_cpulist`)
and this process may use (`os.sched_getaffinity(0)`: a cgroup, taskset or launcher limit is respected).

The choice is deterministic: the candidates in order, the GPU's index among the node's GPUs (its "local rank")
modulo their number, so the proxies of the ranks sharing a NUMA node spread over different CPUs; when that CPU
is the one the constructing thread runs on and there is another candidate, the next one. Missing information
(no sysfs PCI tree, no address for the GPU, an empty list) means no pinning, noted once, never an error.

Standard library only: the transport (runtime/transports/proxy.py) finds the GPU's PCI address and applies the
choice through the engine's create call, where the thread pins itself (csrc/proxy_engine.cpp).
"""

from __future__ import annotations

import ctypes
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moetune.runtime.options import parse_cpulist, proxy_cpu_setting

SYSFS_PCI = "/sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"
DISPLAY_CLASS = "0x03"  # PCI base class 03: display controllers (VGA 0300, 3D 0302: every NVIDIA datacentre GPU)


class ProxyCpuWarning(RuntimeWarning):
    """The proxy thread runs unpinned although `proxy_cpu` asked for pinning (the message says why)."""


@dataclass(frozen=True)
class CpuChoice:
    """The CPU the proxy thread should pin itself to (None: no pinning) and why."""

    cpu: int | None
    reason: str


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8" (the kernel's syntax; "" for none)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


_BUS_ID = re.compile(r"([0-9A-Fa-f]+):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])")


def sysfs_pci_address(bus_id: str) -> str:
    """'00000000:19:00.0' (nvidia-smi, CUDA) or '0000:19:00.0' -> '0000:19:00.0', the name under
    /sys/bus/pci/devices (lower case, domain of at least 4 digits); '' if `bus_id` is not a PCI address."""
    m = _BUS_ID.fullmatch(bus_id.strip())
    if m is None:
        return ""
    return f"{int(m.group(1), 16):04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def gpu_local_cpus(address: str, root: str | Path | None = None) -> tuple[tuple[int, ...], str]:
    """(the CPUs local to the PCI device `address`, "") or ((), why they are unknown). `root`: default SYSFS_PCI."""
    path = Path(SYSFS_PCI if root is None else root) / address / "local_cpulist"
    try:
        text = path.read_text()
    except OSError as e:
        return (), f"no NUMA information for the GPU ({path}: {e.strerror or e})"
    try:
        cpus = parse_cpulist(text)
    except ValueError as e:
        return (), f"no usable NUMA information for the GPU ({path}: {e})"
    if not cpus:
        return (), f"no NUMA information for the GPU ({path} lists no CPU)"
    return cpus, ""


def gpu_index_on_node(address: str, root: str | Path | None = None) -> int | None:
    """The GPU's position among the node's NVIDIA GPUs in PCI address order (the same on every process,
    whatever CUDA_VISIBLE_DEVICES it has): the local rank of the process driving it when each rank drives one
    GPU. None when sysfs does not list it. `root`: default SYSFS_PCI."""
    base = Path(SYSFS_PCI if root is None else root)
    try:
        entries = sorted(p.name for p in base.iterdir())
    except OSError:
        return None
    gpus = []
    for name in entries:
        try:
            vendor = (base / name / "vendor").read_text().strip().lower()
            klass = (base / name / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and klass.startswith(DISPLAY_CLASS):
            gpus.append(name)
    return gpus.index(address) if address in gpus else None


def choose_cpu(candidates: Iterable[int], allowed: Iterable[int], local_rank: int, current_cpu: int | None,
               what: str = "the candidate CPUs") -> CpuChoice:
    """One CPU of `candidates` that is also `allowed`: the (`local_rank` mod their number)-th in order, or the next
    one when that is `current_cpu` (the constructing thread's) and there is another. None, with the reason, when no
    candidate is allowed. `what` names the candidates in the reason."""
    cands = sorted(set(candidates))
    allowed_set = set(allowed)
    usable = [c for c in cands if c in allowed_set]
    if not usable:
        return CpuChoice(None, f"none of {what} ({format_cpulist(cands) or 'none'}) is allowed for this process "
                               f"(allowed: {format_cpulist(allowed_set) or 'none'})")
    i = local_rank % len(usable)
    cpu = usable[i]
    why = f"{what} this process may use: {format_cpulist(usable)}; local rank {local_rank}"
    if cpu == current_cpu and len(usable) > 1:
        cpu = usable[(i + 1) % len(usable)]
        why += f"; CPU {current_cpu} skipped: the constructing thread runs there"
    return CpuChoice(cpu, f"CPU {cpu} ({why})")


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (glibc's sched_getcpu), None where unknown."""
    try:
        cpu = int(ctypes.CDLL(None).sched_getcpu())
    except (OSError, AttributeError):
        return None
    return cpu if cpu >= 0 else None


def resolve(setting: str, *, address: str, local_rank: int | None = None, allowed: Iterable[int] | None = None,
            current: int | None = None, root: str | Path | None = None) -> CpuChoice:
    """The CPU for a proxy thread whose GPU is at PCI `address` ('' if unknown) under the option value `setting`.

    `local_rank`: the spreading index (None: the GPU's index on the node from sysfs, else 0). `allowed`: the
    process's CPUs (default `os.sched_getaffinity(0)`). `current`: the constructing thread's CPU (default: asked).
    `root`: the sysfs PCI device directory (default SYSFS_PCI).
    Never raises for missing information: the choice is then None with the reason."""
    kind, listed = proxy_cpu_setting(setting)
    if kind == "none":
        return CpuChoice(None, "proxy_cpu=none: not pinned")
    if kind == "cpus":
        candidates, what = listed, f"the CPUs of proxy_cpu={format_cpulist(listed)!r}"
    elif not address:
        return CpuChoice(None, "no NUMA information for the GPU (no PCI address for it)")
    else:
        candidates, why = gpu_local_cpus(address, root)
        if not candidates:
            return CpuChoice(None, why)
        what = f"the NUMA-local CPUs of GPU {address}"
    if local_rank is None:
        local_rank = (gpu_index_on_node(address, root) if address else None) or 0
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    current = current_cpu() if current is None else current
    return choose_cpu(candidates, allowed, local_rank, current, what)


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A ProxyCpuWarning, once per process for each distinct message (every EP buffer builds an engine)."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    warnings.warn(message, ProxyCpuWarning, stacklevel=3)
