"""Where the proxy thread runs: a set of CPUs local to its GPU's NUMA node (the runtime option `proxy_cpu`).

The proxy thread busy-polls the request FIFO in pinned host memory and issues the copies; left to the OS it
may run on the far socket from its GPU (the CUDA calls it makes then reach the GPU across the inter-socket link)
or share a core with the job's own busy threads. With `proxy_cpu="numa"` (the default) it pins itself to the CPUs the
kernel lists as local to the GPU (`/sys/bus/pci/devices/<address>/local_cpulist`, when its `numa_node` names a
node) that this process may use (`os.sched_getaffinity(0)`: a cgroup, taskset or launcher limit is respected);
with a CPU list, to those of the listed CPUs the process may use.

The thread is pinned to the whole SET, never to one CPU of it: the OS places it within the set. Every MoE layer
builds its own EP buffer and so its own proxy engine; all of a process's engines get the same set, and the OS
spreads their threads over it (one CPU for all of them would stack a 48-layer model's busy-polling threads on
one core). Missing information (no sysfs PCI tree, no address for the GPU, `numa_node` -1 or absent, an empty
list) means no pinning, with the reason, never an error: under the default `numa` it is logged once at info level
(logger `moetune.proxy`); a warning (ProxyCpuWarning) is for what the user asked for explicitly and did not get
(a CPU list none of whose CPUs the process may use, a pinning the kernel refused).

What the set places: the proxy THREAD (its polling loop, its CUDA calls), and through the engine the request FIFO
and the control page: mt_proxy_create binds them (mbind) to the NUMA node of the set before registering them with
CUDA. Where that cannot be done (sysfs names no node, the kernel refuses mbind) they fall back to cudaHostAlloc on
the creating thread's NUMA node, logged once at info level; `ProxyEngine.fifo_placement()` says where they are.

Standard library only: the transport (runtime/transports/proxy.py) finds the GPU's PCI address and applies the
choice through the engine's create call, where the thread pins itself (csrc/proxy_engine.cpp).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moetune.runtime import _once
from moetune.runtime.options import parse_cpulist, proxy_cpu_setting

SYSFS_PCI = "/sys/bus/pci/devices"
log = logging.getLogger("moetune.proxy")


class ProxyCpuWarning(RuntimeWarning):
    """The proxy thread runs unpinned although the user asked for pinning: an explicit `proxy_cpu` CPU list that
    cannot be applied, or a pinning the kernel refused (the message says why). Missing NUMA information under the
    default `numa` is no user error: it is logged at info level (`note_once`), not warned."""


@dataclass(frozen=True)
class CpuChoice:
    """The set of CPUs the proxy thread should pin itself to (empty: no pinning) and why."""

    cpus: tuple[int, ...]
    reason: str
    # the candidates were known (the GPU's NUMA-local CPUs, or a list) but the process may use none of them: a
    # misplacement (e.g. a rank bound to the far socket), said as a warning even under the default `numa`
    excluded: bool = False


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
    """(the CPUs local to the PCI device `address`, "") or ((), why they are unknown). `root`: default SYSFS_PCI.

    The device's `numa_node` must name a node: -1 (VMs, firmware without proximity information) comes with a
    `local_cpulist` of every CPU, which says nothing of locality; that, or no `numa_node` file, is no NUMA
    information."""
    device = Path(SYSFS_PCI if root is None else root) / address
    node_path = device / "numa_node"
    try:
        node_text = node_path.read_text().strip()
    except OSError as e:
        return (), f"no NUMA information for the GPU ({node_path}: {e.strerror or e})"
    try:
        node = int(node_text)
    except ValueError:
        return (), f"no usable NUMA information for the GPU ({node_path}: {node_text!r} is not a node number)"
    if node < 0:
        return (), f"no NUMA information for the GPU ({node_path}: numa_node {node}, no proximity information)"
    path = device / "local_cpulist"
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


def usable_cpus(candidates: Iterable[int], allowed: Iterable[int], what: str = "the candidate CPUs") -> CpuChoice:
    """The CPUs of `candidates` that are also `allowed`, as one set (the thread is pinned to all of them and the OS
    places it within); none, with the reason, when no candidate is allowed. `what` names the candidates."""
    cands = sorted(set(candidates))
    allowed_set = set(allowed)
    usable = tuple(c for c in cands if c in allowed_set)
    if not usable:
        return CpuChoice((), f"none of {what} ({format_cpulist(cands) or 'none'}) is allowed for this process "
                             f"(allowed: {format_cpulist(allowed_set) or 'none'})", excluded=bool(cands))
    return CpuChoice(usable, f"CPUs {format_cpulist(usable)} ({what} this process may use)")


def resolve(setting: str, *, address: str, allowed: Iterable[int] | None = None,
            root: str | Path | None = None) -> CpuChoice:
    """The CPU set for a proxy thread whose GPU is at PCI `address` ('' if unknown) under the option value `setting`.

    `allowed`: the process's CPUs (default `os.sched_getaffinity(0)`). `root`: the sysfs PCI device directory
    (default SYSFS_PCI). Never raises for missing information: the choice is then empty with the reason."""
    kind, listed = proxy_cpu_setting(setting)
    if kind == "none":
        return CpuChoice((), "proxy_cpu=none: not pinned")
    if kind == "cpus":
        candidates, what = listed, f"the CPUs of proxy_cpu={format_cpulist(listed)!r}"
    elif not address:
        return CpuChoice((), "no NUMA information for the GPU (no PCI address for it)")
    else:
        candidates, why = gpu_local_cpus(address, root)
        if not candidates:
            return CpuChoice((), why)
        what = f"the NUMA-local CPUs of GPU {address}"
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    return usable_cpus(candidates, allowed, what)


def note_once(message: str) -> None:
    """An info-level log record (logger `moetune.proxy`), once per process for each distinct message: what the
    default setting could not do on this machine is worth a line in the log, not a warning."""
    _once.say_once("proxy.cpu.note", message, message, logger=log, level=logging.INFO)


def warn_once(message: str) -> None:
    """A ProxyCpuWarning, once per process for each distinct message (every EP buffer builds an engine)."""
    _once.say_once("proxy.cpu.warn", message, message, category=ProxyCpuWarning, stacklevel=3)
