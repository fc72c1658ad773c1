"""Which transport families a node offers, each with the reason (issue 3).

Families: `nvlink` (one-sided GPU stores to peers over NVLink, or PCIe P2P where that is all there is),
`proxy:ibrc` (NVSHMEM's CPU proxy over InfiniBand/RoCE RC), `proxy:libfabric/<provider>` (the proxy over
libfabric: cxi, efa, verbs), `ibgda` (GPU rings an mlx5 NIC directly), `host_staged` (through pinned host
memory) and `collective` (NCCL/gloo all-to-all, always). `classify` also returns the families it did
not find, with why, so `fabric show` can explain a missing one.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from moetune.tuner.fabric.facts import FabricFacts, TransportFamily

# libfabric providers NVSHMEM's libfabric transport can drive, and the NIC kind that must back each.
LIBFABRIC_PROVIDERS: dict[str, tuple[str, ...]] = {
    "cxi": ("cxi",),
    "efa": ("efa",),
    "verbs": (),  # any RDMA NIC that is not EFA or Slingshot
}
_FABRIC_NOT_READY = {"Not Started", "In Progress", "Failed", "Failure"}
_LABEL = {"efa": "EFA", "cxi": "Slingshot"}
FAMILY_ORDER = ("nvlink", "proxy:ibrc", "proxy:libfabric", "ibgda", "host_staged", "collective")


def _fmt_rate(r: float) -> str:
    return f"{r:g} Gb/s"


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _ports_summary(ports: list[tuple[str, int, float, str]]) -> str:
    ports = sorted(ports, key=lambda p: (_natural(p[0]), p[1]))
    rates = Counter((rate, ll) for _, _, rate, ll in ports)
    parts = [f"{n} × {_fmt_rate(rate)} {ll}" for (rate, ll), n in sorted(rates.items(), key=lambda kv: -kv[0][0])]
    names = ", ".join(f"{nic}:{p}" for nic, p, _, _ in ports[:4]) + (", …" if len(ports) > 4 else "")
    return f"{' + '.join(parts)} ACTIVE ({names})"


def _nvlink(f: FabricFacts) -> tuple[bool, str]:
    n = len(f.gpus)
    if n < 2:
        return False, f"{n} GPU{'s' if n != 1 else ''}: no peer GPU on this node"
    total = len(f.pairs)
    untrained = sorted({g.fabric_state for g in f.gpus if g.fabric_state in _FABRIC_NOT_READY})
    if untrained:
        return False, (f"NVSwitch fabric not ready (Fabric Manager state: {', '.join(untrained)}): "
                       "peer access over NVLink fails until it completes")
    nv = [p for p in f.pairs if p.nvlink and p.p2p_ok]
    if nv:
        levels = Counter(p.level for p in nv)
        lvl = ", ".join(f"{k}" for k, _ in levels.most_common())
        speeds = Counter(lk.speed_gbs for g in f.gpus for lk in g.active_links)
        per_gpu = Counter(len(g.active_links) for g in f.gpus)
        links = ""
        if speeds:
            sp, _ = speeds.most_common(1)[0]
            k, _ = per_gpu.most_common(1)[0]
            links = f"; {k} active links × {sp:g} GB/s per GPU"
        down = sum(1 for g in f.gpus for lk in g.nvlinks if not lk.active)
        if down:
            links += f"; {down} link(s) down"
        cover = f"all {total} GPU pairs" if len(nv) == total else f"{len(nv)} of {total} GPU pairs"
        return True, f"{cover} over NVLink ({lvl}){links}"
    p2p = [p for p in f.pairs if p.p2p == "OK"]
    if p2p:
        cover = f"all {total} GPU pairs" if len(p2p) == total else f"{len(p2p)} of {total} GPU pairs"
        return True, f"no NVLink; PCIe peer-to-peer supported on {cover}"
    seen = Counter(p.level for p in f.pairs)
    why = Counter(p.p2p for p in f.pairs if p.p2p not in ("OK", "?"))
    why_s = f", P2P {'/'.join(k for k, _ in why.most_common())}" if why else ", P2P not reported"
    return False, f"no NVLink between GPUs (topology {'/'.join(k for k, _ in seen.most_common())}{why_s})"


def classify(f: FabricFacts) -> tuple[list[TransportFamily], list[TransportFamily]]:
    """(available families with reasons, unavailable families with reasons)."""
    have: list[TransportFamily] = []
    missing: list[TransportFamily] = []

    def put(ok: bool, name: str, reason: str) -> None:
        (have if ok else missing).append(TransportFamily(name=name, reason=reason))

    n = len(f.gpus)
    ok, why = _nvlink(f)
    put(ok, "nvlink", why)

    gdr = f.gpudirect
    all_rc = [
        (nic.name, p.port, p.rate_gbps, "RoCE" if p.link_layer == "Ethernet" else p.link_layer)
        for nic in f.nics
        if nic.kind not in ("efa", "cxi")
        for p in nic.active_ports
        if p.link_layer in ("InfiniBand", "Ethernet")
    ]
    # InfiniBand ports when there are any (RoCE ports beside them are usually storage / in-band management)
    ib_only = [pt for pt in all_rc if pt[3] == "InfiniBand"]
    rc_ports = ib_only or all_rc
    mlx_names = {nic.name for nic in f.nics if nic.kind == "mlx5"}
    mlx_ports = [pt for pt in rc_ports if pt[0] in mlx_names]
    excl = f" ({len(f.excluded_nics)} NVSwitch management port(s) ignored)" if f.excluded_nics else ""

    if n == 0:
        put(False, "proxy:ibrc", "no GPU")
    elif not rc_ports:
        down = sum(1 for nic in f.nics if nic.kind not in ("efa", "cxi") for _ in nic.ports)
        put(False, "proxy:ibrc", ("no ACTIVE InfiniBand/RoCE port" + (f" ({down} port(s) not active)" if down else "")) + excl)
    elif not gdr.rdma:
        put(False, "proxy:ibrc", f"{_ports_summary(rc_ports)} but no GPUDirect RDMA (nvidia_peermem not loaded, no dma-buf)")
    else:
        put(True, "proxy:ibrc", f"{_ports_summary(rc_ports)}; GPUDirect RDMA via {gdr.how}{excl}")

    # libfabric: provider listed by `fi_info -l` AND the NIC that backs it present with an ACTIVE port.
    provs = set(f.libfabric.providers)
    for prov, kinds in LIBFABRIC_PROVIDERS.items():
        name = f"proxy:libfabric/{prov}"
        ports = [
            (nic.name, p.port, p.rate_gbps, _LABEL.get(nic.kind, p.link_layer))
            for nic in f.nics
            if (nic.kind in kinds if kinds else nic.kind not in ("efa", "cxi"))
            for p in nic.active_ports
            if prov != "verbs" or p.link_layer in ("InfiniBand", "Ethernet")
        ]
        if prov not in provs:
            if ports or (prov in ("cxi", "efa") and any(nic.kind == prov for nic in f.nics)):
                tool = f.tools.get("fi_info -l", "missing")
                put(False, name, f"{prov} NIC present but libfabric lists no {prov} provider (fi_info -l: {tool})")
            continue
        if n == 0:
            put(False, name, f"libfabric {prov} provider present but no GPU")
        elif not ports:
            put(False, name, f"libfabric {prov} provider listed but no {'/'.join(kinds) or 'RDMA'} NIC port ACTIVE")
        else:
            ver = f" {f.libfabric.version}" if f.libfabric.version else ""
            put(True, name, f"libfabric{ver} provider {prov}; {_ports_summary(ports)}")

    if n == 0:
        put(False, "ibgda", "no GPU")
    elif not mlx_ports:
        put(False, "ibgda", "needs an mlx5 NIC with an ACTIVE InfiniBand/RoCE port; none found" + excl)
    elif not gdr.rdma:
        put(False, "ibgda", "mlx5 ports ACTIVE but no GPUDirect RDMA (nvidia_peermem not loaded, no dma-buf)")
    else:
        put(True, "ibgda", f"mlx5 {_ports_summary(mlx_ports)}; GPUDirect RDMA via {gdr.how}")

    if n >= 2:
        widths = Counter((g.pcie_gen_max, g.pcie_width_current) for g in f.gpus)
        (gen, width), _ = widths.most_common(1)[0]
        pcie = f" (PCIe Gen{gen} x{width})" if gen and width else ""
        put(True, "host_staged", f"{n} GPUs: stage through pinned host memory{pcie}; always possible on one node")
    else:
        put(False, "host_staged", f"{n} GPU{'s' if n != 1 else ''}: nothing to stage between")

    if n == 0:
        put(True, "collective", "always available: gloo all-to-all on CPU (no GPU found)")
    else:
        nccl = f.software.get("nccl", "none")
        put(True, "collective", f"always available: NCCL all-to-all (NCCL {nccl})")
    return have, missing


# Engine families: not a way to move rows between GPUs but a layer implementation with its own knobs, tuned
# and served like a transport family (ProfileKey.transport_family, ep_size 1, nodes 1). Kept out of
# `classify` (and so out of the fabric fingerprint): a node's fabric did not change when the runtime grew one.
MEGAKERNEL = "megakernel"


def megakernel_family(f: FabricFacts) -> tuple[bool, str]:
    """Whether this node can run the MoE megakernel (runtime/megakernel: sm_90a only), and why."""
    gpus = f.gpus
    if not gpus:
        return False, "no GPU"
    hopper = [g for g in gpus if g.compute_capability.strip() == "9.0"]
    if not hopper:
        caps = sorted({g.compute_capability or "?" for g in gpus})
        return False, f"the megakernel is built for sm_90 (Hopper); this node's GPUs are compute capability {', '.join(caps)}"
    return True, f"{len(hopper)} sm_90 GPU{'s' if len(hopper) != 1 else ''}: the MoE layer in one persistent kernel, per GPU"
