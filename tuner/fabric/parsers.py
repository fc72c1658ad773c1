"""The parsers of the tool outputs and /sys, /proc texts discovery reads, the same for every source."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from moetune.tuner.fabric.facts import NVLinkLink
from moetune.tuner.fabric.sources import Source

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LEVEL_RE = re.compile(r"^(X|NV\d+|SYS|NODE|PHB|PXB|PIX|SOC|PSB|C2C|N/A)$")
P2P_RE = re.compile(r"^(X|OK|CNS|GNS|TNS|NS|U|IOCNS|N/A)$")


def normalize_bus_id(bus: str) -> str:
    """'0000:18:00.0' / '00000000:18:00.0' -> '00000000:18:00.0' (upper-case hex)."""
    bus = bus.strip().upper()
    m = re.match(r"^([0-9A-F]+):([0-9A-F]{2}):([0-9A-F]{2})\.([0-9A-F])$", bus)
    if not m:
        return bus
    return f"{int(m.group(1), 16):08X}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


# What nvidia-smi prints for a field NVML refused this user (NVML_ERROR_NO_PERMISSION), in its spellings.
_DENIED = ("[insufficient permissions]", "insufficient permissions", "[no permission]", "no permission")


def denied(text: str | None) -> bool:
    """True when nvidia-smi says the field was withheld from this user (not that the GPU has no such value)."""
    return text is not None and text.strip().lower() in _DENIED


def _int_or_none(text: str | None, where: str, what: str, src: Source, suffix: str = "") -> int | None:
    if text is None:
        return None
    t = text.strip()
    if t in ("", "N/A", "[N/A]", "Unknown", "[Unknown Error]", "Not Available") or denied(t):
        return None
    if suffix and t.lower().endswith(suffix):
        t = t[: -len(suffix)].strip()
    try:
        return int(t)
    except ValueError:
        raise src.error(where, f"{what}: cannot read {text.strip()!r} as a number")


def parse_smi_xml(text: str, where: str, src: Source) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """`nvidia-smi -q -x` -> (GPU dicts sorted by PCI bus id, {"driver", "cuda"})."""
    if not text.strip():
        raise src.error(where, "empty file (expected the XML of `nvidia-smi -q -x`)")
    if "<!ENTITY" in text:
        raise src.error(where, "XML entity declarations are not accepted")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise src.error(where, f"not valid XML ({e}); truncated or garbled?")
    if root.tag != "nvidia_smi_log":
        raise src.error(where, f"root element is <{root.tag}>, expected <nvidia_smi_log>")
    gpus = []
    for g in root.findall("gpu"):
        bus = normalize_bus_id(g.get("id") or g.findtext("pci/pci_bus_id") or "")
        name = (g.findtext("product_name") or "").strip()
        if not name:
            raise src.error(where, f"GPU {bus or '?'} has no <product_name>")
        mem_text = g.findtext("fb_memory_usage/total")
        mem = _int_or_none(mem_text, where, f"GPU {bus} memory total", src, suffix="mib")
        link = "pci/pci_gpu_link_info/"
        # fingerprinted fields nvidia-smi withheld from this user: unknown here, and the facts incomplete (a
        # view that misses them is no evidence of a change; see `_discover_gpus`)
        fingerprinted = {
            "memory": "fb_memory_usage/total",
            "compute capability": "compute_cap",
            "PCIe max generation": link + "pcie_gen/max_link_gen",
            "PCIe max width": link + "link_widths/max_link_width",
            "PCIe width": link + "link_widths/current_link_width",
            "MIG mode": "mig_mode/current_mig",
            "NVSwitch fabric state": "fabric/state",
        }
        withheld = [what for what, path in fingerprinted.items() if denied(g.findtext(path))]
        fabric_state = (g.findtext("fabric/state") or "").strip()
        d: dict[str, Any] = {
            "pci_bus_id": bus,
            "name": name,
            "uuid": (g.findtext("uuid") or "").strip(),
            "serial": serial(g.findtext("serial")),
            "memory_mib": mem or 0,
            "compute_capability": (g.findtext("compute_cap") or "").strip(),
            "pcie_gen_max": _int_or_none(g.findtext(link + "pcie_gen/max_link_gen"), where, f"GPU {bus} PCIe max gen", src),
            "pcie_gen_current": _int_or_none(
                g.findtext(link + "pcie_gen/current_link_gen"), where, f"GPU {bus} PCIe gen", src
            ),
            "pcie_width_max": _int_or_none(
                g.findtext(link + "link_widths/max_link_width"), where, f"GPU {bus} PCIe max width", src, suffix="x"
            ),
            "pcie_width_current": _int_or_none(
                g.findtext(link + "link_widths/current_link_width"), where, f"GPU {bus} PCIe width", src, suffix="x"
            ),
            "mig": (g.findtext("mig_mode/current_mig") or "").strip().lower() == "enabled",
            "fabric_state": "" if denied(fabric_state) else fabric_state,
            "withheld": withheld,
        }
        if not re.match(r"^(\d+\.\d+)?$", d["compute_capability"]):
            d["compute_capability"] = ""
        gpus.append(d)
    seen = set()
    for d in gpus:
        if d["pci_bus_id"] in seen:
            raise src.error(where, f"GPU PCI bus id {d['pci_bus_id']} listed twice")
        seen.add(d["pci_bus_id"])
    gpus.sort(key=lambda d: d["pci_bus_id"])
    versions = {
        "driver": (root.findtext("driver_version") or "").strip(),
        "cuda": (root.findtext("cuda_version") or "").strip(),
    }
    return gpus, versions


def _split_row(line: str) -> list[str]:
    if "\t" in line:
        return [t.strip() for t in line.split("\t") if t.strip()]
    return line.split()


def parse_matrix(text: str, where: str, src: Source, what: str, value_re: re.Pattern[str]) -> dict[str, Any]:
    """A `nvidia-smi topo` matrix -> {"cols": [...], "rows": {label: [values]}, "legend": {NIC0: name}}."""
    if not text.strip():
        raise src.error(where, f"empty file (expected the matrix of {what})")
    lines = _ANSI.sub("", text).splitlines()  # some nvidia-smi versions underline the header
    header_i = None
    for i, line in enumerate(lines):
        toks = _split_row(line)
        if toks and toks[0] == "GPU0":
            header_i = i
            break
        if "GPU0" in toks and not line.lstrip().startswith("GPU0"):
            header_i = i
            break
    if header_i is None:
        raise src.error(where, f"no header row with GPU0 found (expected the matrix of {what})")
    cols: list[str] = []
    for tok in _split_row(lines[header_i]):
        if tok.startswith(("CPU", "NUMA", "GPU NUMA", "Affinity")):
            break
        cols.append(tok)
    rows: dict[str, list[str]] = {}
    legend: dict[str, str] = {}
    in_legend = False
    for line in lines[header_i + 1 :]:
        s = line.strip()
        if not s:
            continue
        if s.startswith("Legend") or s.startswith("NIC Legend"):
            in_legend = True
            continue
        if in_legend:
            m = re.match(r"^(NIC\d+)\s*:\s*(\S+)$", s)
            if m:
                legend[m.group(1)] = m.group(2)
            continue
        toks = _split_row(line)
        if not toks or toks[0] not in cols:
            raise src.error(where, f"unexpected line in {what}: {s[:60]!r}")
        vals = toks[1 : 1 + len(cols)]
        if len(vals) < len(cols):
            raise src.error(where, f"row {toks[0]} has {len(vals)} entries, expected {len(cols)} (truncated?)")
        for v in vals:
            if not value_re.match(v):
                raise src.error(where, f"row {toks[0]}: unknown entry {v!r}")
        rows[toks[0]] = vals
    return {"cols": cols, "rows": rows, "legend": legend}


def serial(text: Any) -> str:
    """A board serial, or "" where the tool says it has none."""
    v = str(text or "").strip()
    return "" if v.upper() in ("N/A", "NOT SUPPORTED", "[N/A]", "0") else v


_GPU_HDR = re.compile(r"^GPU\s+(\d+)\s*:\s*(.*?)\s*(?:\(UUID:\s*([^)\s]+)\s*\))?\s*$")
_LINK = re.compile(r"^Link\s+(\d+)\s*:\s*(.*?)\s*$", re.I)


def parse_nvlink(text: str, where: str, src: Source) -> list[dict[str, Any]]:
    """`nvidia-smi nvlink -s` -> [{"index", "uuid", "links": [NVLinkLink]}]."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        m = _GPU_HDR.match(s)
        if m:
            cur = {"index": int(m.group(1)), "uuid": m.group(3) or "", "links": []}
            out.append(cur)
            continue
        m = _LINK.match(s)
        if m:
            if cur is None:
                raise src.error(where, f"link line before any GPU line: {s[:60]!r}")
            val = m.group(2)
            low = val.lower()
            if re.search(r"\b(inactive|down|disabled|not active)\b", low):
                cur["links"].append(NVLinkLink(link=int(m.group(1)), active=False))
                continue
            sm = re.search(r"(\d+(?:\.\d+)?)\s*GB/s", val)
            if sm:
                speed = round(float(sm.group(1)), 3)
            elif re.search(r"\b(active|up)\b", low):
                speed = 0.0
            else:
                raise src.error(where, f"NVLink {m.group(1)} of GPU {cur['index']}: cannot read {val!r}")
            cur["links"].append(NVLinkLink(link=int(m.group(1)), active=True, speed_gbs=speed))
        # anything else (NVML notices such as "all links are inactive") is informational
    return out


def parse_query_cc(text: str) -> dict[str, str]:
    """`nvidia-smi --query-gpu=index,pci.bus_id,compute_cap` -> {bus id: "9.0"} (tolerant)."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and re.match(r"^\d+\.\d+$", parts[2]):
            out[normalize_bus_id(parts[1])] = parts[2]
    return out


STATE_RE = re.compile(r"^\s*(\d+)\s*:\s*([A-Za-z_]+)\s*$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")


def parse_port_state(text: str | None, where: str, src: Source) -> str:
    if text is None:
        raise src.error(where, "missing")
    m = STATE_RE.match(text)
    if not m:
        raise src.error(where, f"cannot read port state {text.strip()[:40]!r} (expected e.g. '4: ACTIVE')")
    return m.group(2).upper()


def parse_rate(text: str | None, where: str, src: Source) -> float:
    if text is None:  # the kernel refuses the read (EINVAL) when the port has no valid width/speed
        return 0.0
    m = _RATE_RE.match(text)
    if not m:
        raise src.error(where, f"cannot read link rate {text.strip()[:40]!r} (expected e.g. '400 Gb/sec (4X NDR)')")
    return float(m.group(1))


def parse_link_layer(text: str | None, where: str, src: Source) -> str:
    if text is None:
        raise src.error(where, "missing")
    s = text.strip()
    if not re.match(r"^[A-Za-z][A-Za-z0-9 ]{0,31}$", s):
        raise src.error(where, f"cannot read link layer {s[:40]!r} (expected InfiniBand or Ethernet)")
    return s


def parse_uevent(text: str | None) -> dict[str, str]:
    out = {}
    for line in (text or "").splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def parse_fi_list(text: str, where: str, src: Source) -> list[str]:
    names = []
    other = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^([A-Za-z0-9_;.\-]+):\s*$", line)
        if m:
            names.append(m.group(1))
        elif re.match(r"^\s+version:\s*\S+", line):
            continue
        else:
            other += 1
    if other and not names:
        raise src.error(where, "no libfabric provider recognised in `fi_info -l` output")
    return sorted(set(names))


def parse_fi_version(text: str) -> str:
    m = re.search(r"^libfabric:\s*(\S+)", text, re.M)
    return m.group(1) if m else ""


def parse_modules(text: str | None, where: str, src: Source) -> set[str]:
    if text is None:
        return set()
    if not text.strip():
        raise src.error(where, "empty file (expected the lines of /proc/modules)")
    mods = set()
    for line in text.splitlines():
        toks = line.split()
        if not toks:
            continue
        if not re.match(r"^[A-Za-z0-9_]+$", toks[0]):
            raise src.error(where, f"cannot read module line {line[:60]!r}")
        mods.add(toks[0])
    return mods
