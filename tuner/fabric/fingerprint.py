"""Fabric fingerprint: a canonical, order-independent hash of the performance-relevant facts (issue 3).

Works on the `FabricFacts.to_dict()` form (what the store keeps), so a stored fingerprint can be
recomputed and diffed without the node. What goes in:

- hardware: per GPU (model, memory, compute capability, PCIe max generation and widths, NUMA node, MIG, its
  NVLink link speeds/states, its topology level + P2P status to every peer, its topology level to each NIC
  paired with that NIC's descriptor, so that which NIC sits next to which GPU counts, not the NICs' names),
  per NIC (kind, HCA type, firmware, board id, PCI id, PCIe max generation, max and current width, NUMA node,
  ports: an ACTIVE one with its rate and link layer, any other as just "down"), GPUDirect RDMA
  (nvidia_peermem, dma-buf), libfabric fabric providers, node count;
- software: driver, CUDA, CUDA runtime, NCCL, NVSHMEM, torch, nvshmem4py, libfabric, moetune.

Never in it: names and order of devices (GPU index, PCI bus id, UUID, serial, NIC names), temperatures, clocks,
free memory, processes, uptime, the current PCIe generation (drops at idle), how long discovery took, and what a
port not ACTIVE reports beyond being down (which of DOWN/INIT/ARMED/POLLING, a leftover rate, its link layer: a
port flapping between those carries no traffic either way, and must not make every profile stale).
Which physical parts are present (UUIDs, serials) is the companion `identity_hash`: a GPU swapped for
another of the same model keeps the fingerprint (identical nodes share profiles) but changes the
identity, and `diff_facts` says "GPU 1 replaced: serial A → B".
Each GPU and NIC becomes a descriptor; descriptors are sorted, so any reordering of devices hashes the
same.

Who discovers must not matter: `moetune profile` often runs as root, the daemon and the runtime as an ordinary
user. Every fact in here is one an ordinary user reads as root does (sysfs attributes of mode 0444, nvidia-smi
fields NVML gives every user). The one root-only read, a Mellanox device's VPD (mode 0600), decides only
whether the device is an NVSwitch management port set aside from the transports; such a port stays in the
fingerprint as an RDMA device either way (`all_nics`). A fact that is absent (no such sysfs file: a container,
a capture by an older moetune) is None, "unknown", the same for every user; a fingerprinted field the driver
withholds from a user makes discovery incomplete (`FabricFacts.warnings`), which the daemon never takes for a
fabric change.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from typing import Any

FINGERPRINT_VERSION = 1
HASH_CHARS = 16

# libfabric providers that are utilities / software fabrics, not a NIC: not fingerprinted.
_UTILITY_PROVIDERS = {"shm", "sm2", "tcp", "udp", "sockets", "off_coll", "lnx", "lpp", "net", "ucx"}

SOFTWARE_LABELS = {
    "driver": "driver",
    "cuda": "CUDA",
    "cuda_runtime": "CUDA runtime",
    "nccl": "NCCL",
    "nvshmem": "NVSHMEM",
    "torch": "torch",
    "nvshmem4py": "nvshmem4py",
    "libfabric": "libfabric",
    "moetune": "moetune",
}


def _dump(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _hash(obj: Any) -> str:
    return hashlib.sha256(_dump(obj).encode()).hexdigest()[:HASH_CHARS]


def fabric_providers(providers: list[str]) -> list[str]:
    return sorted({p for p in providers if p not in _UTILITY_PROVIDERS and not p.startswith("ofi_")})


# the one port state that carries traffic (as NICPort.active; facts imports this module, so not from there)
PORT_ACTIVE = "ACTIVE"


def _port_active(p: dict[str, Any]) -> bool:
    return p.get("state") == PORT_ACTIVE


def _canonical_port(p: dict[str, Any]) -> str:
    """An ACTIVE port with its rate and link layer (the form every port had before: ACTIVE ports hash as they
    did); any other as just "down", so its sub-state and leftover rate cannot move the fingerprint."""
    if _port_active(p):
        return _dump([p.get("port"), PORT_ACTIVE, float(p.get("rate_gbps", 0.0)), p.get("link_layer")])
    return _dump([p.get("port"), "down"])


def all_nics(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Every RDMA device discovery read: the NICs, and the NVSwitch management ports it set aside. Which devices
    are management ports only root can tell (their VPD), so the fingerprint covers both kinds alike: root and an
    ordinary user, who sees those ports as NICs, then compute the same fingerprint."""
    out = list(facts.get("nics", []) or [])
    for e in facts.get("excluded_nics", []) or []:
        if isinstance(e.get("nic"), dict):
            out.append(e["nic"])
    return out


def canonical_hardware(facts: dict[str, Any]) -> dict[str, Any]:
    gpus = facts.get("gpus", []) or []
    peers: dict[int, list[str]] = defaultdict(list)
    for p in facts.get("pairs", []) or []:
        tag = f"{p.get('level', '?')}/{p.get('p2p', '?')}"
        peers[p["a"]].append(tag)
        peers[p["b"]].append(tag)
    ndesc: list[str] = []
    ndesc_by_name: dict[str, str] = {}
    for n in all_nics(facts):
        ports = sorted(_canonical_port(p) for p in n.get("ports", []))
        desc = _dump(
            {
                "kind": n.get("kind", ""),
                "hca_type": n.get("hca_type", ""),
                "fw_ver": n.get("fw_ver", ""),
                "board_id": n.get("board_id", ""),
                "pci_id": n.get("pci_id", ""),
                "pcie_gen_max": n.get("pcie_gen_max"),
                "pcie_width_max": n.get("pcie_width_max"),
                "pcie_width": n.get("pcie_width_current"),
                "numa": n.get("numa_node"),
                "ports": ports,
            }
        )
        ndesc.append(desc)
        ndesc_by_name[n.get("name", "")] = desc
    # Each level goes with the NIC at that distance (not its name): an InfiniBand HCA and a storage card
    # trading slots leaves every GPU's set of levels as it was, yet moves a GPU's RDMA across the CPU.
    nic_levels: dict[int, list[str]] = defaultdict(list)
    for gn in facts.get("gpu_nic", []) or []:
        nic_levels[gn["gpu"]].append(_dump([gn.get("level", "?"), ndesc_by_name.get(gn.get("nic", ""), "")]))
    gdesc = []
    for g in gpus:
        links = sorted(
            (f"{float(lk.get('speed_gbs', 0.0)):.3f}" if lk.get("active") else "down") for lk in g.get("nvlinks", [])
        )
        gdesc.append(
            _dump(
                {
                    "model": g.get("model", ""),
                    "memory_mib": g.get("memory_mib", 0),
                    "cc": g.get("compute_capability", ""),
                    "pcie_gen_max": g.get("pcie_gen_max"),
                    "pcie_width_max": g.get("pcie_width_max"),
                    "pcie_width": g.get("pcie_width_current"),
                    "mig": bool(g.get("mig", False)),
                    "numa": g.get("numa_node"),
                    "fabric": g.get("fabric_state", ""),
                    "nvlinks": links,
                    "peers": sorted(peers.get(g.get("index", -1), [])),
                    "nics": sorted(nic_levels.get(g.get("index", -1), [])),
                }
            )
        )
    gd = facts.get("gpudirect", {}) or {}
    lf = facts.get("libfabric", {}) or {}
    return {
        "v": FINGERPRINT_VERSION,
        "gpus": sorted(gdesc),
        "nics": sorted(ndesc),
        "gpudirect": {"nvidia_peermem": bool(gd.get("nvidia_peermem")), "dmabuf": bool(gd.get("dmabuf"))},
        "libfabric": fabric_providers(list(lf.get("providers", []))),
        "nodes": facts.get("nodes", 1),
    }


def canonical_software(facts: dict[str, Any]) -> dict[str, Any]:
    sw = facts.get("software", {}) or {}
    return {"v": FINGERPRINT_VERSION, **{k: str(sw.get(k, "none")) for k in SOFTWARE_LABELS}}


def identity_hash(facts: dict[str, Any]) -> str:
    """Hash of which physical GPUs the node holds (serials, else UUIDs), in any order. The fingerprint
    leaves them out so identical nodes share profiles; this companion hash changes when a part is
    swapped for another of the same model, which is a hardware change all the same."""
    ids = sorted(f"{g.get('serial') or ''}/{g.get('uuid') or ''}" for g in facts.get("gpus", []) or [])
    return _hash({"gpus": ids})


def _replacement(a: dict[str, Any], b: dict[str, Any]) -> str:
    """'serial A → B' (or 'UUID A → B') when the GPU in a slot is another part; '' when it is the same."""
    if a.get("serial") and b.get("serial") and a["serial"] != b["serial"]:
        return f"serial {a['serial']} → {b['serial']}"
    if a.get("uuid") and b.get("uuid") and a["uuid"] != b["uuid"]:
        return f"UUID {a['uuid']} → {b['uuid']}"
    return ""


def hardware_hash(facts: dict[str, Any]) -> str:
    return _hash({"hardware": canonical_hardware(facts)})


def software_hash(facts: dict[str, Any]) -> str:
    return _hash({"software": canonical_software(facts)})


def fingerprint(facts: dict[str, Any]) -> str:
    """Hash of every performance-relevant fact, hardware and software."""
    return _hash({"hardware": canonical_hardware(facts), "software": canonical_software(facts)})


# ------------------------------------------------------------------------------------------------
# readable differences
# ------------------------------------------------------------------------------------------------


def _match_gpus(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> tuple[dict[int, int], list[int], list[int]]:
    """old index -> new index, unmatched old indices, unmatched new indices (by bus id, UUID, index)."""
    pairs: dict[int, int] = {}
    used: set[int] = set()
    for key in ("pci_bus_id", "uuid", "index"):
        by_key = {g.get(key): g["index"] for g in new if g.get(key) not in (None, "") and g["index"] not in used}
        for g in old:
            if g["index"] in pairs:
                continue
            k = g.get(key)
            if k not in (None, "") and k in by_key and by_key[k] not in used:
                pairs[g["index"]] = by_key[k]
                used.add(by_key[k])
        if len(pairs) == len(old) or len(used) == len(new):
            break
    return pairs, [g["index"] for g in old if g["index"] not in pairs], [g["index"] for g in new if g["index"] not in used]


def _fmt(v: Any) -> str:
    if v is None or v == "":
        return "unknown"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _ranges(nums: list[int]) -> str:
    """[0,1,2,3,5] -> '0–3, 5'."""
    nums = sorted(set(nums))
    out, start, prev = [], nums[0], nums[0]
    for n in [*nums[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}–{prev}" if prev - start >= 2 else ", ".join(str(x) for x in range(start, prev + 1)))
        if n is not None:
            start = prev = n
    return ", ".join(out)


# what a reason of `diff_facts` holds where the GPU in a slot is another part (`fabric diff` picks those out: the same
# fingerprint on other GPUs is a change, fabric.change.same_hardware)
REPLACED = " replaced: "


def _diff_gpu(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Reasons for one matched GPU, with '{G}' where its label goes."""
    out: list[str] = []
    label = "{G}"
    replaced = _replacement(a, b)
    if replaced:
        out.append(f"{label}{REPLACED}{replaced}")
    if a.get("model") != b.get("model"):
        out.append(f"{label} model {_fmt(a.get('model'))} → {_fmt(b.get('model'))}")
    if a.get("memory_mib") != b.get("memory_mib"):
        out.append(f"{label} memory {_fmt(a.get('memory_mib'))} → {_fmt(b.get('memory_mib'))} MiB")
    if a.get("compute_capability") != b.get("compute_capability"):
        out.append(f"{label} compute capability {_fmt(a.get('compute_capability'))} → {_fmt(b.get('compute_capability'))}")
    if a.get("pcie_gen_max") != b.get("pcie_gen_max"):
        out.append(f"{label} PCIe max generation Gen{_fmt(a.get('pcie_gen_max'))} → Gen{_fmt(b.get('pcie_gen_max'))}")
    for key, what in (("pcie_width_current", "PCIe width"), ("pcie_width_max", "PCIe max width")):
        if a.get(key) != b.get(key):
            out.append(f"{label} {what} x{_fmt(a.get(key))} → x{_fmt(b.get(key))}")
    if "numa_node" in a and "numa_node" in b and a["numa_node"] != b["numa_node"]:
        out.append(f"{label} NUMA node {_fmt(a['numa_node'])} → {_fmt(b['numa_node'])}")
    if bool(a.get("mig")) != bool(b.get("mig")):
        out.append(f"{label} MIG {'enabled' if a.get('mig') else 'disabled'} → {'enabled' if b.get('mig') else 'disabled'}")
    if a.get("fabric_state", "") != b.get("fabric_state", ""):
        out.append(f"{label} NVSwitch fabric {_fmt(a.get('fabric_state'))} → {_fmt(b.get('fabric_state'))}")
    la = {lk["link"]: lk for lk in a.get("nvlinks", [])}
    lb = {lk["link"]: lk for lk in b.get("nvlinks", [])}
    events: dict[str, list[int]] = {}
    for n in sorted(set(la) | set(lb)):
        x, y = la.get(n), lb.get(n)
        if x is None:
            ev = f"new ({'active' if y and y.get('active') else 'inactive'})"
        elif y is None:
            ev = "missing"
        elif x.get("active") and not y.get("active"):
            ev = "down"
        elif not x.get("active") and y.get("active"):
            ev = "up"
        elif x.get("active") and float(x.get("speed_gbs", 0)) != float(y.get("speed_gbs", 0)):
            ev = f"speed {_fmt(float(x['speed_gbs']))} → {_fmt(float(y['speed_gbs']))} GB/s"
        else:
            continue
        events.setdefault(ev, []).append(n)
    for ev, links in events.items():
        name = f"NVLink {links[0]}" if len(links) == 1 else f"NVLinks {_ranges(links)}"
        out.append(f"{name} of {label} {ev}")
    return out


def _diff_nic(a: dict[str, Any], b: dict[str, Any], out: list[str]) -> None:
    name = a.get("name", "?")
    for key, what in (("kind", "kind"), ("hca_type", "HCA type"), ("fw_ver", "firmware"), ("board_id", "board id"), ("pci_id", "PCI id")):
        if a.get(key, "") != b.get(key, ""):
            out.append(f"{name} {what} {_fmt(a.get(key))} → {_fmt(b.get(key))}")
    # PCIe link and NUMA node: compared where both facts hold them (an older moetune recorded none: see diff_facts)
    for key, what, pre in (("pcie_gen_max", "PCIe max generation", "Gen"), ("pcie_width_max", "PCIe max width", "x"),
                           ("pcie_width_current", "PCIe width", "x"), ("numa_node", "NUMA node", "")):
        if key in a and key in b and a[key] != b[key]:
            out.append(f"{name} {what} {pre}{_fmt(a[key])} → {pre}{_fmt(b[key])}")
    pa = {p["port"]: p for p in a.get("ports", [])}
    pb = {p["port"]: p for p in b.get("ports", [])}
    for n in sorted(set(pa) | set(pb)):
        x, y = pa.get(n), pb.get(n)
        if x is None:
            out.append(f"{name} port {n} new ({_fmt(y.get('state') if y else None)})")
            continue
        if y is None:
            out.append(f"{name} port {n} missing")
            continue
        # a port ACTIVE on neither side is "down" in the fingerprint either way: its changes are still told (fabric
        # diff shows them as not performance-relevant), marked so that they are not read as the cause of a change
        idle = "" if _port_active(x) or _port_active(y) else " (not active either way)"
        if x.get("state") != y.get("state"):
            out.append(f"{name} port {n} {_fmt(x.get('state'))} → {_fmt(y.get('state'))}{idle}")
        if float(x.get("rate_gbps", 0)) != float(y.get("rate_gbps", 0)):
            out.append(f"{name} port {n} rate {_fmt(float(x.get('rate_gbps', 0)))} → "
                       f"{_fmt(float(y.get('rate_gbps', 0)))} Gb/s{idle}")
        if x.get("link_layer") != y.get("link_layer"):
            out.append(f"{name} port {n} link layer {_fmt(x.get('link_layer'))} → {_fmt(y.get('link_layer'))}{idle}")


def _not_recorded(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Facts the fingerprint covers that `new` holds and `old` lacks because an older moetune recorded it (not
    because the node changed): the fingerprint moved once on upgrade, and this names why."""
    def lacks(key: str, items: list[dict[str, Any]]) -> bool:
        return any(isinstance(x, dict) and key not in x for x in items)

    out = []
    if lacks("numa_node", old.get("gpus", []) or []) and not lacks("numa_node", new.get("gpus", []) or []):
        out.append("GPU NUMA nodes")
    if lacks("numa_node", old.get("nics", []) or []) and not lacks("numa_node", new.get("nics", []) or []):
        out.append("NIC PCIe links and NUMA nodes")
    oe, ne = old.get("excluded_nics", []) or [], new.get("excluded_nics", []) or []
    if lacks("nic", oe) and ne and not lacks("nic", ne):
        out.append("NVSwitch management ports")
    return out


def diff_facts(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Readable reasons why `new` differs from `old` (both `FabricFacts.to_dict()` forms)."""
    out: list[str] = []
    if lacking := _not_recorded(old, new):
        out.append(f"{', '.join(lacking)} not in the facts an older moetune recorded: now fingerprinted (moetune upgraded)")
    og, ng = old.get("gpus", []) or [], new.get("gpus", []) or []
    match, gone, added = _match_gpus(og, ng)
    oby = {g["index"]: g for g in og}
    nby = {g["index"]: g for g in ng}
    for i in gone:
        g = oby[i]
        out.append(f"GPU {i} missing ({g.get('model', '?')}, {g.get('pci_bus_id') or g.get('uuid') or 'no id'})")
    for j in added:
        g = nby[j]
        out.append(f"GPU {j} new ({g.get('model', '?')}, {g.get('pci_bus_id') or g.get('uuid') or 'no id'})")
    per_reason: dict[str, list[int]] = {}  # the same change on several GPUs is one line
    for i, j in sorted(match.items()):
        for r in _diff_gpu(oby[i], nby[j]):
            per_reason.setdefault(r, []).append(i)
    for r, gpus in per_reason.items():
        out.append(r.replace("{G}", f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {_ranges(gpus)}"))

    # topology between GPUs present in both
    op = {(p["a"], p["b"]): p for p in old.get("pairs", []) or []}
    np_ = {(min(p["a"], p["b"]), max(p["a"], p["b"])): p for p in new.get("pairs", []) or []}
    pair_events: dict[str, list[str]] = {}
    for (a, b), p in sorted(op.items()):
        if a not in match or b not in match:
            continue
        q = np_.get((min(match[a], match[b]), max(match[a], match[b])))
        if q is None:
            continue
        if p.get("level") != q.get("level"):
            pair_events.setdefault(f"topology {p.get('level')} → {q.get('level')}", []).append(f"GPU {a}–GPU {b}")
        if p.get("p2p") != q.get("p2p"):
            pair_events.setdefault(f"P2P {p.get('p2p')} → {q.get('p2p')}", []).append(f"GPU {a}–GPU {b}")
    for ev, pairs in pair_events.items():
        if len(pairs) == 1:
            out.append(f"{pairs[0]} {ev}")
        else:
            more = ", …" if len(pairs) > 3 else ""
            out.append(f"{len(pairs)} GPU pairs {ev} ({', '.join(pairs[:3])}{more})")
    onl = {(x["gpu"], x["nic"]): x.get("level") for x in old.get("gpu_nic", []) or []}
    nnl = {(x["gpu"], x["nic"]): x.get("level") for x in new.get("gpu_nic", []) or []}
    for (g, nic), lvl in sorted(onl.items()):
        if g in match and (match[g], nic) in nnl and nnl[(match[g], nic)] != lvl:
            out.append(f"GPU {g}–{nic} topology {lvl} → {nnl[(match[g], nic)]}")

    # NICs (NVSwitch management ports included: they are in the fingerprint too)
    on = {n["name"]: n for n in all_nics(old)}
    nn = {n["name"]: n for n in all_nics(new)}
    for name in sorted(set(on) - set(nn)):
        out.append(f"{name} missing")
    # a management port an older moetune set aside without recording it: told by the upgrade line above
    unrecorded = {e.get("name") for e in old.get("excluded_nics", []) or [] if not isinstance(e.get("nic"), dict)}
    for name in sorted(set(nn) - set(on) - unrecorded):
        n = nn[name]
        act = sum(1 for p in n.get("ports", []) if _port_active(p))
        out.append(f"{name} new ({n.get('kind', '?')}, {act} of {len(n.get('ports', []))} port(s) ACTIVE)")
    for name in sorted(set(on) & set(nn)):
        _diff_nic(on[name], nn[name], out)

    # GPUDirect, libfabric
    ogd, ngd = old.get("gpudirect", {}) or {}, new.get("gpudirect", {}) or {}
    if bool(ogd.get("nvidia_peermem")) != bool(ngd.get("nvidia_peermem")):
        out.append("nvidia_peermem unloaded" if ogd.get("nvidia_peermem") else "nvidia_peermem loaded")
    if bool(ogd.get("dmabuf")) != bool(ngd.get("dmabuf")):
        out.append("dma-buf GPUDirect RDMA " + ("available → unavailable" if ogd.get("dmabuf") else "unavailable → available"))
    opv = set(fabric_providers((old.get("libfabric", {}) or {}).get("providers", [])))
    npv = set(fabric_providers((new.get("libfabric", {}) or {}).get("providers", [])))
    for p in sorted(opv - npv):
        out.append(f"libfabric provider {p} gone")
    for p in sorted(npv - opv):
        out.append(f"libfabric provider {p} new")
    if old.get("nodes", 1) != new.get("nodes", 1):
        out.append(f"nodes {old.get('nodes', 1)} → {new.get('nodes', 1)}")

    # software
    osw, nsw = old.get("software", {}) or {}, new.get("software", {}) or {}
    for key, label in SOFTWARE_LABELS.items():
        a, b = str(osw.get(key, "none")), str(nsw.get(key, "none"))
        if a != b:
            out.append(f"{label} {a} → {b}")

    # consequences: transport families
    ot = {t["name"] for t in old.get("transports", []) or []}
    nt = {t["name"] for t in new.get("transports", []) or []}
    for t in sorted(ot - nt):
        out.append(f"transport {t} no longer available")
    for t in sorted(nt - ot):
        out.append(f"transport {t} now available")
    return out
