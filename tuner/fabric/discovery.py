"""Fabric discovery: what decides EP communication performance on this node (issue 3).

Discovery reads everything through a `Source` (`moetune.tuner.fabric.sources`: the live node, a capture
directory, a recording of either) and parses it with `moetune.tuner.fabric.parsers`, the same for all of them,
so `fabric show --from DIR` analyses a capture exactly as it would the live node. Garbled input raises
`CaptureError` (a `DiscoveryError`; both in `moetune.tuner.fabric.errors`) naming the file.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from moetune.runtime.transports._affinity import sysfs_pci_address  # nvidia-smi bus id -> sysfs name
from moetune.tuner.fabric.errors import DiscoveryError
from moetune.tuner.fabric.facts import (
    GPU,
    NIC,
    NONE,
    SOFTWARE_KEYS,
    ExcludedNIC,
    FabricFacts,
    GPUDirect,
    GPUNic,
    GPUPair,
    Libfabric,
    NICPort,
    NVLinkLink,
)
from moetune.tuner.fabric.parsers import (
    LEVEL_RE,
    P2P_RE,
    STATE_RE,
    normalize_bus_id,
    parse_fi_list,
    parse_fi_version,
    parse_link_layer,
    parse_matrix,
    parse_modules,
    parse_nvlink,
    parse_port_state,
    parse_query_cc,
    parse_rate,
    parse_smi_xml,
    parse_uevent,
    serial,
)
from moetune.tuner.fabric.sources import GPU_API_FILE, CaptureSource, LiveSource, Source

# ------------------------------------------------------------------------------------------------
# commands discovery runs (their stdout is what a capture stores)
# ------------------------------------------------------------------------------------------------

SMI_XML = ("nvidia-smi", "-q", "-x")
SMI_TOPO = ("nvidia-smi", "topo", "-m")
SMI_P2P = ("nvidia-smi", "topo", "-p2p", "r")
SMI_NVLINK = ("nvidia-smi", "nvlink", "-s")
SMI_QUERY = ("nvidia-smi", "--query-gpu=index,pci.bus_id,compute_cap", "--format=csv,noheader")
FI_LIST = ("fi_info", "-l")
FI_VERSION = ("fi_info", "--version")
COMMANDS: tuple[tuple[str, ...], ...] = (SMI_XML, SMI_TOPO, SMI_P2P, SMI_NVLINK, SMI_QUERY, FI_LIST, FI_VERSION)

IB_ROOT = "/sys/class/infiniband"
PCI_DEVICES = "/sys/bus/pci/devices"
CXI_ROOT = "/sys/class/cxi"
PROC_MODULES = "/proc/modules"
PROC_NV_VERSION = "/proc/driver/nvidia/version"
PROC_OSRELEASE = "/proc/sys/kernel/osrelease"

# ------------------------------------------------------------------------------------------------
# sysfs attributes read through the source, and what a model name tells
# ------------------------------------------------------------------------------------------------

_GT_S = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*GT/s")
_GEN_BY_GT = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}


def _sysfs_int(src: Source, path: str, what: str) -> int | None:
    text = src.read_text(path)
    if text is None or not text.strip():
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise src.error(src.where(path), f"cannot read {what} {text.strip()[:40]!r} as a number")


def pci_link(src: Source, dev: str) -> dict[str, int | None]:
    """PCIe link and NUMA node of the PCI device directory `dev` (…/device of a NIC, /sys/bus/pci/devices/<addr>):
    pcie_gen_max (from max_link_speed), pcie_width_max, pcie_width_current, numa_node. These sysfs attributes are
    world-readable (0444; numa_node 0644), so every user reads the same; one that is not there (a container
    without the PCI tree, a capture by an older moetune, a virtual device) is None, unknown. The current link
    speed is left out: it drops with link power management."""
    speed = src.read_text(f"{dev}/max_link_speed")
    gen = None
    if speed is not None and speed.strip() and speed.strip().lower() != "unknown":
        m = _GT_S.match(speed)
        if not m:
            raise src.error(src.where(f"{dev}/max_link_speed"), f"cannot read PCIe speed {speed.strip()[:40]!r} (expected e.g. '32.0 GT/s PCIe')")
        gen = _GEN_BY_GT.get(float(m.group(1)))
    return {
        "pcie_gen_max": gen,
        "pcie_width_max": _sysfs_int(src, f"{dev}/max_link_width", "PCIe max width"),
        "pcie_width_current": _sysfs_int(src, f"{dev}/current_link_width", "PCIe width"),
        "numa_node": _sysfs_int(src, f"{dev}/numa_node", "NUMA node"),
    }


def _kernel_at_least(release: str, major: int, minor: int) -> bool:
    m = re.match(r"^(\d+)\.(\d+)", release.strip())
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (major, minor)


# Compute capability when neither nvidia-smi nor NVML reports it (longest match first).
_CC_BY_MODEL = (
    ("GB200", "10.0"), ("B200", "10.0"), ("B100", "10.0"), ("GH200", "9.0"), ("H200", "9.0"),
    ("H100", "9.0"), ("H800", "9.0"), ("H20", "9.0"), ("A100", "8.0"), ("A800", "8.0"), ("A30", "8.0"),
    ("RTX 5090", "12.0"), ("RTX 4090", "8.9"), ("L40", "8.9"), ("L4", "8.9"), ("RTX 3090", "8.6"),
    ("A40", "8.6"), ("A10", "8.6"), ("V100", "7.0"),
)  # fmt: skip


def cc_from_model(model: str) -> str:
    for key, cc in _CC_BY_MODEL:
        if key in model:
            return cc
    return ""


# ------------------------------------------------------------------------------------------------
# discovery
# ------------------------------------------------------------------------------------------------


def _gpu_api_rows(api: dict[str, Any]) -> list[dict[str, Any]]:
    raw = []
    for g in api.get("gpus", []):
        if not isinstance(g, dict) or not g.get("name"):
            continue
        raw.append(
            {
                "pci_bus_id": normalize_bus_id(str(g.get("pci_bus_id", ""))),
                "name": str(g["name"]),
                "uuid": str(g.get("uuid", "")),
                "serial": serial(g.get("serial")),
                "memory_mib": int(g.get("memory_mib") or 0),
                "compute_capability": str(g.get("compute_capability", "")),
                "pcie_gen_max": None if g.get("pcie_gen_max") is None else int(g["pcie_gen_max"]),
                "pcie_gen_current": None,
                "pcie_width_max": None if g.get("pcie_width_max") is None else int(g["pcie_width_max"]),
                "pcie_width_current": None if g.get("pcie_width_current") is None else int(g["pcie_width_current"]),
                "mig": False,
                "fabric_state": "",
                "nvlinks": [NVLinkLink(link=int(x["link"]), active=bool(x["active"])) for x in g.get("nvlinks", [])],
                "withheld": [str(w) for w in g.get("withheld", [])],
            }
        )
    raw.sort(key=lambda d: d["pci_bus_id"])
    return raw


def _discover_gpus(src: Source, facts: FabricFacts, tools: dict[str, str]) -> dict[str, str]:
    """Fills facts.gpus from `nvidia-smi -q -x` (+ nvlink -s, compute_cap query) or the NVML fallback;
    returns the driver/CUDA versions it read."""
    versions: dict[str, str] = {}
    xml = src.run(SMI_XML)
    tools[" ".join(SMI_XML)] = xml.describe
    raw: list[dict[str, Any]] = []
    if xml.ok:
        raw, versions = parse_smi_xml(xml.stdout, src.where_command(SMI_XML), src)
    api = src.gpu_api() if not raw else None
    if api:
        try:
            raw = _gpu_api_rows(api)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            where = src.where("/" + GPU_API_FILE) if isinstance(src, CaptureSource) else "NVML"
            raise src.error(where, f"unexpected GPU entry ({type(e).__name__}: {e})")
        versions = {"driver": str(api.get("driver", "")), "cuda": str(api.get("cuda", ""))}
        tools["gpu api"] = str(api.get("api", "?")) + (f" ({api['status']})" if api.get("status") else "")
    if not raw:
        return versions

    cc_by_bus: dict[str, str] = {}
    if any(not d["compute_capability"] for d in raw) and xml.ok:
        q = src.run(SMI_QUERY)
        tools[" ".join(SMI_QUERY)] = q.describe
        if q.ok:
            cc_by_bus = parse_query_cc(q.stdout)

    links_by_uuid: dict[str, list[NVLinkLink]] = {}
    links_by_index: dict[int, list[NVLinkLink]] = {}
    if xml.ok:
        nv = src.run(SMI_NVLINK)
        tools[" ".join(SMI_NVLINK)] = nv.describe
        if nv.ok:
            for entry in parse_nvlink(nv.stdout, src.where_command(SMI_NVLINK), src):
                if entry["uuid"]:
                    links_by_uuid[entry["uuid"]] = entry["links"]
                links_by_index[entry["index"]] = entry["links"]

    withheld = [f"GPU {d['pci_bus_id'] or i} {', '.join(d['withheld'])}" for i, d in enumerate(raw) if d.get("withheld")]
    if withheld:
        # Unknown is not "different": such facts are incomplete, so the daemon keeps the fabric it knows
        # instead of taking one user's narrower view for a hardware change (and the profiles for stale).
        facts.warnings.append(
            f"the GPU driver withheld {'; '.join(withheld)} from this user (insufficient permissions); facts are incomplete"
        )
    for i, d in enumerate(raw):
        cc = d["compute_capability"] or cc_by_bus.get(d["pci_bus_id"], "") or cc_from_model(d["name"])
        addr = sysfs_pci_address(d["pci_bus_id"])
        if "nvlinks" in d:
            links = d["nvlinks"]
        elif d["uuid"] and links_by_uuid:
            links = links_by_uuid.get(d["uuid"], [])
        else:
            links = links_by_index.get(i, [])
        facts.gpus.append(
            GPU(
                index=i,
                model=d["name"],
                uuid=d["uuid"],
                serial=d.get("serial", ""),
                pci_bus_id=d["pci_bus_id"],
                memory_mib=d["memory_mib"],
                compute_capability=cc,
                pcie_gen_max=d["pcie_gen_max"],
                pcie_gen_current=d["pcie_gen_current"],
                pcie_width_max=d["pcie_width_max"],
                pcie_width_current=d["pcie_width_current"],
                mig=d["mig"],
                numa_node=_sysfs_int(src, f"{PCI_DEVICES}/{addr}/numa_node", "NUMA node") if addr else None,
                fabric_state=d["fabric_state"],
                nvlinks=sorted(links, key=lambda lk: lk.link),
            )
        )
    return versions


def _matrix_cells(mat: dict[str, Any], n: int, where: str, src: Source):
    """(gpu row i, column label, peer GPU index or None for a non-GPU column, value) of GPU rows 0..n-1."""
    for i in range(n):
        row = mat["rows"].get(f"GPU{i}")
        if row is None:
            raise src.error(where, f"no row for GPU{i}")
        for j, col in enumerate(mat["cols"]):
            m = re.match(r"^GPU(\d+)$", col)
            yield i, col, (int(m.group(1)) if m else None), row[j]


def _discover_topology(src: Source, facts: FabricFacts, tools: dict[str, str]) -> list[tuple[int, str, str]]:
    """Pairs from `topo -m` + `topo -p2p r`; returns (gpu, nic name, level) for NIC columns."""
    n = len(facts.gpus)
    levels: dict[tuple[int, int], str] = {}
    p2p: dict[tuple[int, int], str] = {}
    gpu_nic: list[tuple[int, str, str]] = []
    if n == 0 or tools.get(" ".join(SMI_XML)) != "ok":
        return gpu_nic
    topo = src.run(SMI_TOPO)
    tools[" ".join(SMI_TOPO)] = topo.describe
    if topo.ok:
        where = src.where_command(SMI_TOPO)
        mat = parse_matrix(topo.stdout, where, src, "`nvidia-smi topo -m`", LEVEL_RE)
        gpu_rows = [c for c in mat["cols"] if re.match(r"^GPU\d+$", c)]
        if len(gpu_rows) != n:
            raise src.error(where, f"lists {len(gpu_rows)} GPUs, `nvidia-smi -q -x` lists {n} (truncated, or from another node?)")
        for i, col, peer, value in _matrix_cells(mat, n, where, src):
            if peer is None:
                gpu_nic.append((i, mat["legend"].get(col, col), value))
            elif peer != i:
                levels[(i, peer)] = value
    if n > 1:
        pr = src.run(SMI_P2P)
        tools[" ".join(SMI_P2P)] = pr.describe
        if pr.ok:
            where = src.where_command(SMI_P2P)
            mat = parse_matrix(pr.stdout, where, src, "`nvidia-smi topo -p2p r`", P2P_RE)
            for i, _col, peer, value in _matrix_cells(mat, n, where, src):
                if peer is not None and peer != i:
                    p2p[(i, peer)] = value
    for i in range(n):
        for j in range(i + 1, n):
            facts.pairs.append(
                GPUPair(a=i, b=j, level=levels.get((i, j), levels.get((j, i), "?")), p2p=p2p.get((i, j), "?"))
            )
    return gpu_nic


def _discover_ib(src: Source, facts: FabricFacts) -> None:
    names = src.listdir(IB_ROOT) or []
    no_vpd = 0
    for name in names:
        base = f"{IB_ROOT}/{name}"
        uevent = parse_uevent(src.read_text(f"{base}/device/uevent"))
        driver = uevent.get("DRIVER", "")
        if driver.startswith("mlx5") or name.startswith("mlx5"):
            kind = "mlx5"
        elif driver == "efa" or name.startswith(("efa", "rdmap")):
            kind = "efa"
        else:
            kind = driver or "other"
        ports = []
        for pn in src.listdir(f"{base}/ports") or []:
            if not pn.isdigit():
                continue
            pb = f"{base}/ports/{pn}"
            state = parse_port_state(src.read_text(f"{pb}/state"), src.where(f"{pb}/state"), src)
            phys = src.read_text(f"{pb}/phys_state")
            pm = STATE_RE.match(phys or "")
            rate = parse_rate(src.read_text(f"{pb}/rate"), src.where(f"{pb}/rate"), src)
            ll = parse_link_layer(src.read_text(f"{pb}/link_layer"), src.where(f"{pb}/link_layer"), src)
            ports.append(
                NICPort(port=int(pn), state=state, phys_state=pm.group(2) if pm else "", rate_gbps=rate, link_layer=ll)
            )
        netdevs = src.listdir(f"{base}/device/net") or []
        nic = NIC(
            name=name,
            kind=kind,
            driver=driver,
            hca_type=(src.read_text(f"{base}/hca_type") or "").strip(),
            fw_ver=(src.read_text(f"{base}/fw_ver") or "").strip(),
            board_id=(src.read_text(f"{base}/board_id") or "").strip(),
            pci_id=uevent.get("PCI_ID", ""),
            netdev=netdevs[0] if netdevs else "",
            ports=sorted(ports, key=lambda p: p.port),
            **pci_link(src, f"{base}/device"),
        )
        # The VPD (mode 0400/0600: root only) is what tells an NVSwitch management LPF from a NIC (Fabric
        # Manager guide). Only the transports depend on it: the device stays in the fingerprint either way
        # (ExcludedNIC.nic), so root and an ordinary user compute the same one.
        vpd = src.read_bytes(f"{base}/device/vpd")
        if vpd is not None and b"SW_MNG" in vpd:
            facts.excluded_nics.append(
                ExcludedNIC(name=name, reason="NVSwitch management port (CX7 bridge LPF, VPD SMDL=SW_MNG)", nic=nic)
            )
            continue
        no_vpd += kind == "mlx5" and vpd is None
        facts.nics.append(nic)
    if no_vpd:
        facts.tools["vpd"] = f"unreadable on {no_vpd} mlx5 device(s): NVSwitch management ports not identifiable"


def _discover_cxi(src: Source, facts: FabricFacts) -> None:
    """HPE Slingshot (Cassini) NICs: /sys/class/cxi/cxiN, link state/speed from their hsn netdev."""
    for name in src.listdir(CXI_ROOT) or []:
        base = f"{CXI_ROOT}/{name}"
        uevent = parse_uevent(src.read_text(f"{base}/device/uevent"))
        netdevs = src.listdir(f"{base}/device/net") or []
        ports = []
        if netdevs:
            nb = f"{base}/device/net/{netdevs[0]}"
            oper = (src.read_text(f"{nb}/operstate") or "").strip().lower()
            speed_text = src.read_text(f"{nb}/speed")
            rate = 0.0
            if speed_text is not None and speed_text.strip() not in ("", "-1"):
                try:
                    rate = int(speed_text.strip()) / 1000.0
                except ValueError:
                    raise src.error(src.where(f"{nb}/speed"), f"cannot read link speed {speed_text.strip()[:40]!r} (Mb/s)")
            ports.append(
                NICPort(port=1, state="ACTIVE" if oper == "up" else "DOWN", phys_state=oper, rate_gbps=rate, link_layer="Ethernet")
            )
        facts.nics.append(
            NIC(
                name=name,
                kind="cxi",
                driver=uevent.get("DRIVER", ""),
                pci_id=uevent.get("PCI_ID", ""),
                netdev=netdevs[0] if netdevs else "",
                ports=ports,
                **pci_link(src, f"{base}/device"),
            )
        )


def _software(pk: dict[str, str | None], versions: dict[str, str], libfabric: str) -> dict[str, str]:
    def first(*names: str) -> str:
        for n in names:
            v = pk.get(n)
            if v:
                return v
        return ""

    sw = {
        "driver": versions.get("driver", ""),
        "cuda": versions.get("cuda", ""),
        "cuda_runtime": first("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime"),
        "nccl": first("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"),
        "nvshmem": first("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
        "torch": first("torch"),
        "nvshmem4py": first("nvshmem4py-cu13", "nvshmem4py-cu12"),
        "libfabric": libfabric,
        "moetune": first("moetune"),
    }
    return {k: (sw.get(k) or NONE) for k in SOFTWARE_KEYS}


def discover_from(src: Source) -> FabricFacts:
    """Discover through any source. Raises DiscoveryError/CaptureError on garbled input."""
    from moetune.tuner.fabric.families import classify

    t0 = time.perf_counter()
    src.prefetch(COMMANDS)
    facts = FabricFacts(source=src.name if not isinstance(src, CaptureSource) else f"capture:{src.root}")
    tools: dict[str, str] = {}

    versions = _discover_gpus(src, facts, tools)
    gpu_nic_raw = _discover_topology(src, facts, tools)
    _discover_ib(src, facts)
    _discover_cxi(src, facts)
    # GPU-NIC levels only for devices discovery read (not absent ones). NVSwitch management ports keep theirs:
    # whether one is recognised as such depends on reading its VPD (root only), and the fingerprint may not.
    known = {n.name for n in facts.nics} | {e.name for e in facts.excluded_nics}
    facts.gpu_nic = sorted(
        (GPUNic(gpu=g, nic=nic, level=lvl) for g, nic, lvl in gpu_nic_raw if nic in known),
        key=lambda x: (x.gpu, x.nic),
    )

    # GPUDirect RDMA
    mods_text = src.read_text(PROC_MODULES)
    mods = parse_modules(mods_text, src.where(PROC_MODULES), src)
    nvver_text, kernel_text = src.read_text(PROC_NV_VERSION), src.read_text(PROC_OSRELEASE)
    if facts.gpus:
        # unread is not "no module loaded", "no open kernel module" or "an old kernel": GPUDirect RDMA is unknown, and
        # the NIC transports that need it were classified unavailable (another fingerprint) without a word (a capture
        # copied without its proc/ folder)
        for path, text, what in ((PROC_MODULES, mods_text, "whether nvidia_peermem is loaded"),
                                 (PROC_NV_VERSION, nvver_text, "the kernel module's flavour (open or proprietary)"),
                                 (PROC_OSRELEASE, kernel_text, "the kernel release")):
            if text is None:
                facts.warnings.append(f"{src.where(path)} was not read (missing): {what} is unknown, so GPUDirect "
                                      "RDMA that depends on it is taken as absent; facts are incomplete")
    nvver = nvver_text or ""
    kernel = (kernel_text or "").strip()
    open_km = "Open Kernel Module" in nvver
    if not versions.get("driver"):
        m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", nvver)
        if m:
            versions["driver"] = m.group(1)
    drv_major = int(m.group(1)) if (m := re.match(r"^(\d+)", versions.get("driver", ""))) else 0
    facts.gpudirect = GPUDirect(
        nvidia_peermem=bool({"nvidia_peermem", "nv_peer_mem"} & mods),
        dmabuf=bool(facts.gpus) and open_km and drv_major >= 515 and _kernel_at_least(kernel, 5, 12),
        open_kernel_module=open_km,
        kernel=kernel,
    )

    # libfabric
    fl = src.run(FI_LIST)
    tools[" ".join(FI_LIST)] = fl.describe
    providers = parse_fi_list(fl.stdout, src.where_command(FI_LIST), src) if fl.ok else []
    fv = src.run(FI_VERSION)
    tools[" ".join(FI_VERSION)] = fv.describe
    facts.libfabric = Libfabric(providers=providers, version=parse_fi_version(fv.stdout) if fv.ok else "")

    facts.software = _software(src.packages(), versions, facts.libfabric.version)
    facts.warnings += getattr(src, "unread", [])
    facts.tools = {**tools, **facts.tools}
    if nvver and not facts.gpus:
        xml_state = tools.get(" ".join(SMI_XML), "missing")
        facts.warnings.append(
            f"the NVIDIA driver is loaded but no GPU was read (`nvidia-smi -q -x`: {xml_state}); facts are incomplete"
        )
    for key, state in tools.items():
        if state.endswith("timeout") or state.endswith("(timeout)"):
            facts.warnings.append(f"`{key}` timed out; facts it provides are missing")
    facts.transports, facts.unavailable = classify(facts)
    facts.seconds = round(time.perf_counter() - t0, 4)
    return facts


def discover(capture: Path | str | None = None, *, timeout_s: float = 1.5) -> FabricFacts:
    """The facts of the live node (capture None) or of a capture directory."""
    if capture is not None:
        return discover_from(CaptureSource(capture))
    src = LiveSource(timeout_s=timeout_s)
    try:
        return discover_from(src)
    finally:
        src.close()


def live_facts(timeout_s: float = 1.5) -> FabricFacts:
    """The live node's facts: what `capture_not_this_node` compares a capture with. Its own name so that a test
    can simulate being on a captured node (monkeypatch this) without touching how the capture itself is read."""
    return discover(None, timeout_s=timeout_s)


def capture_not_this_node(facts: FabricFacts, capture: Path | str) -> str:
    """'' when `facts` (read from `capture`) describe THIS node, else why not, naming both identities.

    A number measured here may only be stored under this node's key: a measurement run with --capture is allowed
    only when the capture's fingerprint and software hash are those of live discovery. A failed live discovery
    cannot confirm it, so it counts as another node."""
    try:
        live = live_facts()
    except (DiscoveryError, OSError) as e:
        return f"the capture {capture} cannot be checked against this node: live discovery failed ({e})"
    if live.fingerprint == facts.fingerprint and live.software_hash == facts.software_hash:
        return ""
    from moetune.tuner.fabric.fingerprint import diff_facts

    what = diff_facts(live.to_dict(), facts.to_dict())
    shown = "; ".join(what[:4]) + (f"; and {len(what) - 4} more" if len(what) > 4 else "")
    return (f"the capture {capture} describes another node than this one (the capture: fingerprint "
            f"{facts.fingerprint}, software {facts.software_hash}; this node: fingerprint {live.fingerprint}, "
            f"software {live.software_hash}" + (f"; from this node to the capture: {shown}" if shown else "") + ")")
