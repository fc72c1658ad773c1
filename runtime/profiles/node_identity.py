"""Which node the runtime is on, as far as tuned profiles are concerned: a fingerprint and a software hash.

A profile is applied as tuned only when it was measured on this node's fingerprint and software
(`ProfileRecord.is_tuned_for`). The runtime never runs fabric discovery (tuner code), so it learns its
identity from what the tuner recorded, in this order:

For a profile the daemon serves: the facts the answering daemon reports (`fabric` op), checked against this node
and this process like the database's below (`from_reported_facts`): a daemon on another node (a tcp:// endpoint)
reports that node's GPUs, a daemon in another Python environment than the job's (or one serving a capture) other
package versions. (The identity a running daemon writes into daemon.json is the daemon's discovery, not this
process's software: it alone never makes a profile tuned.)

For the database fallback (the daemon did not serve): the `fingerprints` table of the database (written by the
daemon, `moetune fabric` and `moetune profile` with the facts they were computed from), newest first,
cross-checked against what the runtime can read in a few milliseconds (`mismatch`). A database shared by
several nodes, or one recorded before a GPU, driver or package change, fails the check. daemon.json is not
used there: a stopped (or killed) daemon's file says nothing about the software installed since.

Else no identity: no profile is applied as tuned (the caller falls back to policy defaults, loudly). Facts not
shaped as discovery records them (`facts_shape_problem`: a hand edit, another program's row, a daemon's odd reply) are
unreadable: never this node, and never an exception out of the lookup.

What `mismatch` checks: the GPU UUIDs (the model of a GPU whose UUID discovery did not read) and driver version in
/proc/driver/nvidia, on a node without GPUs the
recorded NICs in /sys/class (infiniband, cxi), the current PCIe link width of each recorded GPU found by its UUID
(/sys/bus/pci/devices/<address>/current_link_width) and whether it has MIG GPU instances while recorded with MIG off
(/proc/driver/nvidia/capabilities/gpu<minor>/mig; where nvidia-smi's XML recorded it), on any node the HCA type, board, firmware and current PCIe link
width of each recorded RDMA NIC that is here and the state (ACTIVE and its rate, or down) of its ports (by name, or
the same devices renumbered: the fingerprint has no names), whether nvidia_peermem is loaded
(/proc/modules), and the versions of the Python
distributions discovery reads the software facts from (torch, moetune, nvidia-nccl-cu*, nvidia-nvshmem-cu*,
nvidia-cuda-runtime-cu*, nvshmem4py-cu*; read once per process: a running job's imported packages do not
change). Known limits: the software hash also covers the driver's CUDA version (nvidia-smi; it follows the driver,
which is checked) and libfabric (`fi_info`, a process to run): neither is read here. Of the fingerprint's hardware,
not re-read: NVLink link states and speeds (NVML or nvidia-smi only: no sysfs file, and NVML's start costs far more
than this check's budget), MIG switched off or on without GPU instances (no file tells it), dma-buf support, a
Slingshot (cxi) NIC's PCIe link, the PCIe generations and maximum widths (static for a device: another card is
another UUID, board or firmware), topology levels and P2P status, and the libfabric providers.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.runtime.profile_record import is_preset_fingerprint

PROC_ROOT = Path("/proc")  # tests point this at a captured /proc
SYS_ROOT = Path("/sys")  # and this at a captured /sys (the RDMA and Slingshot NICs' class folders)
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


# The facts' lists of records (discovery writes each as a list of mappings) and its one mapping of versions. Facts of
# another shape (a hand edit, another program's row, a daemon's reply) are unreadable: they never match this node.
_FACT_LISTS = ("gpus", "nics", "excluded_nics")


def facts_shape_problem(facts: Any) -> str | None:
    """Why `facts` are not shaped as discovery records them (None: they are): a mapping whose gpus, nics and
    excluded_nics are lists of mappings and whose software is a mapping (each may be absent or null)."""
    if not isinstance(facts, dict):
        return f"the facts are {type(facts).__name__}, not a mapping"
    for name in _FACT_LISTS:
        value = facts.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            return f"{name} is {type(value).__name__}, not a list"
        bad = next((x for x in value if not isinstance(x, dict)), None)
        if bad is not None:
            return f"{name} holds {type(bad).__name__} {str(bad)[:32]!r}, not a mapping"
    sw = facts.get("software")
    if sw is not None and not isinstance(sw, dict):
        return f"software is {type(sw).__name__}, not a mapping"
    return None


def software_hash(facts: dict[str, Any]) -> str:
    sw = facts.get("software", {}) or {}
    canon = {"v": _FINGERPRINT_VERSION, **{k: str(sw.get(k, "none")) for k in _SOFTWARE_KEYS}}
    dump = json.dumps({"software": canon}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


def from_reported_facts(fingerprint: str | None, software: str | None, facts: Any, where: str) -> tuple[NodeIdentity | None, str]:
    """(the identity a daemon reports, when its facts are this node's; else None and why not). The facts are
    checked like the database's (`mismatch`), and must be the ones `software` was computed from."""
    if not fingerprint or not software or not isinstance(facts, dict):
        return None, f"the daemon at {where} reports no fabric"
    bad = facts_shape_problem(facts)
    if bad is not None:  # unreadable: never this node's (software_hash and mismatch read them as discovery writes them)
        return None, f"the daemon at {where} reports unreadable fabric facts ({bad})"
    if is_preset_fingerprint(fingerprint):
        return None, f"the daemon at {where} reports a preset's fabric {fingerprint!r}, not a node's"
    if not facts.get("gpus") and not facts.get("software"):
        return None, f"the daemon at {where} reports no facts (GPUs, software) to check this node against"
    if software_hash(facts) != software:
        return None, f"the daemon at {where} reports software {software} that is not its facts' ({software_hash(facts)})"
    why, checked = mismatch(facts)
    if why is not None:
        sw = facts.get("software")
        hw = {**facts, "software": {k: v for k, v in sw.items() if k not in PACKAGE_FACTS}} if isinstance(sw, dict) else facts
        if mismatch(hw)[0] is None:  # this node, but this process's packages are not the ones the daemon measured with
            return None, (f"this process's Python packages are not those of the daemon at {where} ({why}): its "
                          "profiles were tuned for the daemon's software; run the job in the daemon's environment "
                          "(or the same versions), or re-tune with this one's")
        return None, f"the fabric the daemon at {where} reports is not this node's ({why})"
    return NodeIdentity(fingerprint, software, f"the fabric facts of the daemon at {where}", checked), ""


# -- what the runtime can read cheaply ---------------------------------------------------------------
def local_gpu_uuids(proc: Path | None = None) -> set[str] | None:
    """UUIDs of this node's GPUs from /proc/driver/nvidia/gpus/*/information (None: no NVIDIA driver)."""
    models = local_gpu_models(proc)
    return None if models is None else set(models)


def _gpu_information(proc: Path | None = None) -> dict[str, tuple[str, str]] | None:
    """UUID -> (PCI address: the folder's name, the text of its information file) of this node's GPUs from
    /proc/driver/nvidia/gpus/*/information (None: no NVIDIA driver, or a file unread or naming no UUID)."""
    root = (proc or PROC_ROOT) / "driver" / "nvidia" / "gpus"
    try:
        entries = list(root.iterdir())
    except OSError:
        return None
    out: dict[str, tuple[str, str]] = {}
    for e in entries:
        try:
            text = (e / "information").read_text(errors="replace")
        except OSError:
            return None
        uuid = re.search(r"GPU UUID:\s*(\S+)", text)
        if uuid is None:
            return None
        out[uuid.group(1)] = (e.name, text)
    return out


def local_gpu_models(proc: Path | None = None) -> dict[str, str] | None:
    """UUID -> model ("Model:" line; "" where it has none) of this node's GPUs from
    /proc/driver/nvidia/gpus/*/information (None: no NVIDIA driver, or a file unread or naming no UUID)."""
    info = _gpu_information(proc)
    if info is None:
        return None
    out: dict[str, str] = {}
    for uuid, (_, text) in info.items():
        model = re.search(r"^Model:[ \t]*(.*?)[ \t]*$", text, re.MULTILINE)
        out[uuid] = model.group(1) if model else ""
    return out


def _unrecorded_models_problem(gpus: list[dict[str, Any]], recorded: set[str], proc: Path | None) -> tuple[str | None, bool]:
    """(why the GPUs recorded without a UUID are not this node's other GPUs, by model, or None; whether the models
    were compared: not where a model is unread on either side). The count alone let another node's GPUs of another
    model match."""
    want = sorted(" ".join(str(g.get("model") or "").split()) for g in gpus if not g.get("uuid"))
    models = local_gpu_models(proc)
    if not want or models is None:
        return None, False
    have = sorted(" ".join(m.split()) for u, m in models.items() if u not in recorded)
    if "" in want or "" in have or len(have) != len(want):
        return None, False
    if have != want:
        return (f"the GPUs here are not the recorded model(s) ({', '.join(have)} here, {', '.join(want)} recorded "
                "for the GPUs whose UUID discovery did not read)"), True
    return None, True


# the widths a PCIe link trains to: anything else read from current_link_width is no width (0: link down; 63, the
# field all ones: config space read while the device sleeps in D3cold) and is not compared, never a mismatch
PCIE_WIDTHS = frozenset({1, 2, 4, 8, 12, 16, 32})


def _link_width(text: str | None) -> int | None:
    """A current_link_width attribute's width (None: absent, not a number, or no width a link trains to)."""
    try:
        width = int(text.strip()) if text is not None else None
    except ValueError:
        return None
    return width if width in PCIE_WIDTHS else None


_MIG_INSTANCE = re.compile(r"^gi\d+$")  # a GPU instance's folder (gi<N>/access): made only with MIG mode on


# the tools key of discovery's `nvidia-smi -q -x` (tuner/fabric/discovery.py SMI_XML), "ok" where it ran: the only
# reader of the MIG mode. Its fallbacks (NVML, torch) record every GPU with MIG off without reading it
SMI_XML_TOOL = "nvidia-smi -q -x"


def _mig_was_read(facts: dict[str, Any]) -> bool:
    """Whether the recorded `mig` of the GPUs was read (nvidia-smi's XML ran), not the fallbacks' unread False: a
    node partitioned into MIG instances, discovered without nvidia-smi, was refused as "MIG on, recorded off"."""
    tools = facts.get("tools")
    return isinstance(tools, dict) and tools.get(SMI_XML_TOOL) == "ok"


def _gpu_links_problem(gpus: list[dict[str, Any]], info: dict[str, tuple[str, str]], proc: Path | None,
                       mig_read: bool = True) -> tuple[str | None, bool, bool]:
    """(why a recorded GPU, found here by its UUID, has another PCIe link width or has MIG on while recorded off,
    or None; whether a PCIe link was compared; whether MIG was). Read where discovery recorded them and this node
    shows them: the width in /sys/bus/pci/devices/<address>/current_link_width (the register nvidia-smi reads;
    the current speed is no part of the fingerprint: it drops at idle), MIG by its GPU instances in
    /proc/driver/nvidia/capabilities/gpu<minor>/mig/ (the information file does not say the mode). MIG on without
    instances, and MIG recorded on, are not told apart from off here (no instance folder either way; CUDA has no
    device on such a GPU anyway)."""
    links = mig = False
    for g in gpus:
        uuid = g.get("uuid")
        if not isinstance(uuid, str) or uuid not in info:
            continue  # a GPU whose UUID discovery did not read is tied to no device here
        bdf, text = info[uuid]
        want = g.get("pcie_width_current")
        if type(want) is int and "/" not in bdf:
            try:
                have = _link_width((SYS_ROOT / "bus" / "pci" / "devices" / bdf / "current_link_width").read_text(
                    errors="replace"))
            except OSError:
                have = None
            if have is not None:
                links = True
                if have != want:
                    return f"PCIe link of GPU {bdf} is x{have}, recorded x{want}", links, mig
        minor = re.search(r"^Device Minor:\s*(\d+)", text, re.MULTILINE)
        if not mig_read or g.get("mig") is not False or minor is None:
            continue  # not read by discovery, not recorded off (older facts), or no minor to find its capabilities by
        folder = (proc or PROC_ROOT) / "driver" / "nvidia" / "capabilities" / f"gpu{minor.group(1)}" / "mig"
        try:
            names = [e.name for e in folder.iterdir()]
        except OSError:
            continue  # unread (a container, an older driver): not compared
        mig = True
        if any(_MIG_INSTANCE.match(n) for n in names):
            return f"MIG mode of GPU {bdf} is on (GPU instances here), recorded off", links, mig
    return None, links, mig


def local_driver(proc: Path | None = None) -> str | None:
    try:
        text = ((proc or PROC_ROOT) / "driver" / "nvidia" / "version").read_text(errors="replace")
    except OSError:
        return None
    # "NVIDIA UNIX x86_64 Kernel Module  535.104.05" or "NVIDIA UNIX Open Kernel Module for x86_64  550.90.07"
    # (the open module, what Hopper and Blackwell nodes run): as discovery reads it
    m = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]*)", text)
    return m.group(1) if m else None


# The software facts discovery reads from Python distributions: fact -> distributions, the first installed wins
# (mirrors moetune.tuner.fabric.discovery._software; a test keeps the two equal).
PACKAGE_FACTS: dict[str, tuple[str, ...]] = {
    "cuda_runtime": ("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime"),
    "nccl": ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"),
    "nvshmem": ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
    "torch": ("torch",),
    "nvshmem4py": ("nvshmem4py-cu13", "nvshmem4py-cu12"),
    "moetune": ("moetune",),
}
_VERSIONS: dict[str, str | None] = {}  # per process: a running job's imported packages do not change under it


def _dist_version(name: str) -> str | None:
    if name not in _VERSIONS:
        from importlib.metadata import PackageNotFoundError, version

        try:
            _VERSIONS[name] = version(name)
        except PackageNotFoundError:
            _VERSIONS[name] = None
        except Exception:  # a broken dist-info reads as not installed, as discovery reads it
            _VERSIONS[name] = None
    return _VERSIONS[name]


def local_package_fact(fact: str) -> str:
    """This process's value of a software fact discovery reads from distributions ("none": none installed)."""
    for name in PACKAGE_FACTS[fact]:
        v = _dist_version(name)
        if v:
            return v
    return "none"


def _missing_nics(facts: dict[str, Any]) -> list[str]:
    """The NICs discovery recorded (used and excluded ones) that this node's /sys does not list: RDMA devices under
    class/infiniband, Slingshot ones under class/cxi. Only recorded ones are looked for (a listing of folders):
    a node that gained a NIC has a new fingerprint anyway."""
    out: list[str] = []
    for entry in [*(facts.get("nics") or []), *(facts.get("excluded_nics") or [])]:
        nic = entry.get("nic", entry) if isinstance(entry, dict) else None
        name = nic.get("name") if isinstance(nic, dict) else None
        if not isinstance(name, str) or not name or "/" in name:
            continue
        folder = "cxi" if nic.get("kind") == "cxi" else "infiniband"
        if not (SYS_ROOT / "class" / folder / name).exists():
            out.append(name)
    return out


# A recorded NIC's attributes the fingerprint hashes that /sys reads in a few microseconds: (fact, what to call it)
_NIC_ATTRIBUTES = (("hca_type", "HCA type"), ("board_id", "board"), ("fw_ver", "firmware"))


def _recorded_rdma_nics(facts: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, facts) of each RDMA device discovery recorded (used and excluded NICs; Slingshot's are not RDMA devices)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for entry in [*(facts.get("nics") or []), *(facts.get("excluded_nics") or [])]:
        nic = entry.get("nic", entry) if isinstance(entry, dict) else None
        name = nic.get("name") if isinstance(nic, dict) else None
        if not isinstance(name, str) or not name or "/" in name or nic.get("kind") == "cxi":
            continue
        out.append((name, nic))
    return out


_Read = Callable[[Path], "str | None"]


def _nic_problem(name: str, nic: dict[str, Any], folder: Path, read: _Read) -> tuple[str | None, bool, bool]:
    """(why the recorded NIC `name` is not the device whose sysfs folder is `folder`, or None; whether any attribute
    was compared; whether any port was). Attributes and ports unread here are not compared."""
    compared = ports = False
    for attr, what in _NIC_ATTRIBUTES:
        want = str(nic.get(attr) or "").strip()
        if not want:  # discovery read none: nothing to compare
            continue
        text = read(folder / attr)
        if text is None:
            continue
        have = text.strip()
        compared = True
        if have != want:
            return f"NIC {name}: {what} {have[:64]} here, {want[:64]} recorded", compared, ports
    want_width = nic.get("pcie_width_current")  # discovery reads it from the same sysfs file (None: it read none)
    if type(want_width) is int:
        have_width = _link_width(read(folder / "device" / "current_link_width"))
        if have_width is not None:
            compared = True
            if have_width != want_width:
                return f"PCIe link of NIC {name} is x{have_width}, recorded x{want_width}", compared, ports
    for p in nic.get("ports") or []:
        why = _changed_port(name, folder, p, read)
        if why is None:
            continue
        ports = True
        if why:
            return why, compared, ports
    return None, compared, ports


def _changed_nics(facts: dict[str, Any]) -> tuple[str | None, bool, bool]:
    """(why a recorded RDMA NIC that is on this node is another card or firmware, or one of its ports another link,
    or None; whether any attribute was compared; whether any port was). Only NICs, attributes and ports read here:
    one absent (a container sees the NICs given to it) or unread says nothing; one read and different is another
    fingerprint (a firmware upgrade, another card under its name, a port down or at another rate), unless the
    recorded NICs are here under each other's names (`_renamed`: names are no part of the fingerprint)."""
    nics = _recorded_rdma_nics(facts)
    root = SYS_ROOT / "class" / "infiniband"
    seen: dict[Path, str | None] = {}

    def read(path: Path) -> str | None:  # each file once per check, however many pairings `_renamed` tries
        if path not in seen:
            try:
                seen[path] = path.read_text(errors="replace")
            except OSError:
                seen[path] = None
        return seen[path]

    compared = ports = False
    first: str | None = None
    for name, nic in nics:
        why, c, p = _nic_problem(name, nic, root / name, read)
        compared, ports = compared or c, ports or p
        first = first or why
    if first is not None and (paired := _renamed(nics, root, read)) is not None:
        return None, *paired
    return first, compared, ports


def _renamed(nics: list[tuple[str, dict[str, Any]]], root: Path, read: _Read) -> tuple[bool, bool] | None:
    """When the recorded NICs whose names are here are the devices under those names in another order (each paired
    with a device of its own among them that it is, `_nic_problem`): whether an attribute and a port were compared
    so; else None. The kernel numbers RDMA devices (mlx5_N) in the
    order they come up, which a reboot may change (VFs hot-added in another order, a device reloaded), and the
    fingerprint has no names: the same devices renumbered are the same node. Only these names: a device new here is
    a change of its own, not one to pair a recorded NIC with."""
    present = [(n, nic) for n, nic in nics if (root / n).is_dir()]
    names = [n for n, _ in present]
    fits = [[h for h in names if _nic_problem(n, nic, root / h, read)[0] is None] for n, nic in present]
    held: dict[str, int] = {}  # a device here -> the recorded NIC paired with it

    def pair(i: int, tried: set[str]) -> bool:  # an augmenting path: NICs of one type fit several devices
        for h in fits[i]:
            if h not in tried:
                tried.add(h)
                if h not in held or pair(held[h], tried):
                    held[h] = i
                    return True
        return False

    if not all(pair(i, set()) for i in range(len(present))):
        return None
    flags = [_nic_problem(*present[i], root / h, read)[1:] for h, i in held.items()]
    return any(c for c, _ in flags), any(p for _, p in flags)


_PORT_STATE = re.compile(r"^\s*(\d+)\s*:\s*([A-Za-z_]+)\s*$")  # as discovery reads it ("4: ACTIVE")
_PORT_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")  # "400 Gb/sec (4X NDR)"


def _changed_port(name: str, folder: Path, port: Any, read: _Read) -> str | None:
    """Why a recorded port of NIC `name` is another link here ('' when it is the same; None when not compared: unread
    here). As the fingerprint has a port: ACTIVE with its rate, or down (whichever other state)."""
    if not isinstance(port, dict) or type(port.get("port")) is not int:
        return None
    base = folder / "ports" / str(port["port"])
    text = read(base / "state")
    state = _PORT_STATE.match(text) if text is not None else None
    if state is None:
        return None
    active, was = state.group(2).upper() == "ACTIVE", str(port.get("state", "")).upper() == "ACTIVE"
    where = f"NIC {name} port {port['port']}"
    if active != was:
        return f"{where}: {'ACTIVE' if active else 'down'} here, {'ACTIVE' if was else 'down'} recorded"
    if not active:
        return ""
    text = read(base / "rate")  # None: the kernel refuses the read without a valid width/speed; discovery reads 0
    rate = _PORT_RATE.match(text) if text is not None else None
    have = float(rate.group(1)) if rate else 0.0
    try:
        want = float(port.get("rate_gbps") or 0.0)
    except (TypeError, ValueError):
        return None
    return "" if have == want else f"{where}: ACTIVE at {have:g} Gb/s here, {want:g} Gb/s recorded"


_PEERMEM = frozenset({"nvidia_peermem", "nv_peer_mem"})  # either makes GPUDirect RDMA (discovery's rule)


def _peermem_problem(facts: dict[str, Any], proc: Path | None) -> tuple[str | None, bool]:
    """(why nvidia_peermem is loaded here and was not when the facts were recorded, or the other way, or None;
    whether it was compared). In the fingerprint (GPUDirect RDMA of the NIC transports); /proc/modules unread here,
    or facts that do not record it, compare nothing."""
    gd = facts.get("gpudirect")
    want = gd.get("nvidia_peermem") if isinstance(gd, dict) else None
    if not isinstance(want, bool):
        return None, False
    try:
        text = ((proc or PROC_ROOT) / "modules").read_text(errors="replace")
    except OSError:
        return None, False
    loaded = any(line.split()[0] in _PEERMEM for line in text.splitlines() if line.split())
    if loaded == want:
        return None, True
    said = {True: "loaded", False: "not loaded"}
    return f"nvidia_peermem {said[loaded]} here, {said[want]} recorded", True


def mismatch(facts: dict[str, Any], proc: Path | None = None) -> tuple[str | None, tuple[str, ...]]:
    """(why the recorded `facts` are not this node, or None; what was checked)."""
    checked: list[str] = []
    gpus = [g for g in facts.get("gpus", []) or [] if isinstance(g, dict)]
    recorded = {str(g.get("uuid")) for g in gpus if g.get("uuid")}
    info = _gpu_information(proc)  # read once: the UUIDs here, then each GPU's PCI address and minor
    here = None if info is None else set(info)
    if here is None and gpus:
        return "cannot read this node's GPUs (/proc/driver/nvidia/gpus) to check the recorded ones", tuple(checked)
    if here is not None:
        if len(here) != len(gpus):
            return f"{len(here)} GPUs here, {len(gpus)} recorded", tuple(checked)
        # every UUID recorded must be here, also where discovery could not read some (""): those went unchecked
        if recorded - here or (len(recorded) == len(gpus) and recorded != here):
            return "the GPUs here are not the recorded ones (UUIDs differ)", tuple(checked)
        checked.append("GPU UUIDs" if recorded else "GPU count")
        if len(recorded) < len(gpus):  # some UUIDs unread: the rest told apart by model, not by count alone
            why_model, compared = _unrecorded_models_problem(gpus, recorded, proc)
            if why_model is not None:
                return why_model, tuple(checked)
            if compared:
                checked.append("GPU models")
        why_gpu, links, mig = _gpu_links_problem(gpus, info, proc, _mig_was_read(facts))
        if why_gpu is not None:
            return why_gpu, tuple(checked)
        if links:
            checked.append("GPU PCIe links")
        if mig:
            checked.append("GPU MIG mode")
    if not gpus and not here:
        # no GPU compared: the NICs are the hardware a node without GPUs is told apart by (a shared database's
        # other node passed on package versions alone). Not where GPUs matched: a containerised job sees only the
        # RDMA devices given to it, and the host's other ones are no sign of another node.
        missing = _missing_nics(facts)
        if missing:
            return f"NIC(s) {', '.join(missing[:4])} recorded, not on this node", tuple(checked)
        if facts.get("nics") or facts.get("excluded_nics"):
            checked.append("NICs")
    why_nic, compared, ports = _changed_nics(facts)  # GPUs or not: a NIC present here is read whole
    if why_nic is not None:
        return why_nic, tuple(checked)
    if compared:
        checked.append("NIC firmware")
    if ports:
        checked.append("NIC ports")
    sw = facts.get("software", {}) or {}
    if not isinstance(sw, dict):
        return "the recorded software facts are not a mapping", tuple(checked)
    want = str(sw.get("driver", "none"))
    if want not in _NONE:  # "none": discovery could not read it either
        have = local_driver(proc)
        if have is None:
            return f"cannot read this node's driver version to check the recorded {want}", tuple(checked)
        if have != want:
            return f"driver {have} here, {want} recorded", tuple(checked)
        checked.append("driver")
    why_peermem, compared = _peermem_problem(facts, proc)
    if why_peermem is not None:
        return why_peermem, tuple(checked)
    if compared:
        checked.append("nvidia_peermem")
    for name in PACKAGE_FACTS:
        if name not in sw:
            continue  # not recorded (older facts): nothing to compare
        want = str(sw[name]).strip() or "none"
        have = local_package_fact(name)
        if have != want:  # "none" too: a package installed (or removed) since changes the software hash
            return f"{name} {have} here, {want} recorded", tuple(checked)
        checked.append(name)
    return None, tuple(checked)


def from_fingerprint_rows(rows: Iterable[tuple]) -> tuple[NodeIdentity | None, str]:
    """The newest recorded fingerprint whose facts match this node, or (None, why not).

    `rows`: (hash, facts JSON, last_seen) from the store's `fingerprints` table, newest first; taken one at a time, none
    after the first that matches (a cursor: the older rows are never read).
    """
    reasons: list[str] = []
    any_row = False
    for fp, raw, seen in rows:
        any_row = True
        try:
            facts = json.loads(raw) if isinstance(raw, str | bytes) else raw
        except (ValueError, RecursionError):  # RecursionError: nested past json's depth limit
            reasons.append(f"{fp}: unreadable facts")
            continue
        if not isinstance(facts, dict) or not isinstance(fp, str):
            continue
        if is_preset_fingerprint(fp):
            continue  # a what-if preset's (`moetune tune --preset`): a modelled fabric, never a node
        bad = facts_shape_problem(facts)
        if bad is not None:  # never a match: mismatch and software_hash read them as discovery writes them
            reasons.append(f"{fp}: unreadable facts ({bad})")
            continue
        if not facts.get("gpus") and not facts.get("software"):
            # nothing recorded to check against this node: it would match any node, so it proves nothing
            reasons.append(f"{fp}: no facts recorded (no GPUs, no software) to check this node against")
            continue
        why, checked = mismatch(facts)
        if why is None:
            return NodeIdentity(fp, software_hash(facts), f"database fingerprint {fp} (last seen {seen})", checked), ""
        reasons.append(f"{fp}: {why}")
    if not any_row:
        return None, "no fingerprint recorded in the database"
    return None, "no recorded fingerprint matches this node (" + "; ".join(reasons[:3]) + ")"
