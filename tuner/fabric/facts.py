"""The facts discovery finds on one node: GPUs, their links, NICs, GPUDirect, libfabric, software.

Plain msgspec structs. `FabricFacts.to_dict()` is the canonical JSON-able form that the store keeps and
`moetune.tuner.fabric.fingerprint` hashes and diffs. Volatile readings (temperatures, clocks, free memory,
processes, uptime) are never parsed into these structs, so they cannot leak into a fingerprint.
"""

from __future__ import annotations

from typing import Any

import msgspec

FACTS_SCHEMA = 1

# Software keys always present in FabricFacts.software (value NONE when not installed / unknown).
SOFTWARE_KEYS: tuple[str, ...] = (
    "driver",
    "cuda",
    "cuda_runtime",
    "nccl",
    "nvshmem",
    "torch",
    "nvshmem4py",
    "libfabric",
    "moetune",
)
NONE = "none"


class NVLinkLink(msgspec.Struct, kw_only=True, frozen=True):
    link: int
    active: bool
    speed_gbs: float = 0.0  # GB/s per direction as `nvidia-smi nvlink -s` prints it; 0 when inactive


class GPU(msgspec.Struct, kw_only=True):
    index: int  # nvidia-smi index (PCI bus order)
    model: str
    uuid: str = ""
    serial: str = ""  # the board serial (nvidia-smi <serial>, NVML): with the UUID, which part sits in the slot
    pci_bus_id: str = ""
    memory_mib: int = 0
    compute_capability: str = ""  # "9.0"
    pcie_gen_max: int | None = None  # max generation the link supports (min of host and device)
    pcie_gen_current: int | None = None  # volatile (drops at idle): shown, never fingerprinted
    pcie_width_max: int | None = None
    pcie_width_current: int | None = None
    mig: bool = False
    numa_node: int | None = None  # /sys/bus/pci/devices/<bus>/numa_node (-1: the kernel knows none); None: unread
    fabric_state: str = ""  # NVSwitch fabric (Fabric Manager) state: Completed, In Progress, Not Started, N/A
    nvlinks: list[NVLinkLink] = []

    @property
    def active_links(self) -> list[NVLinkLink]:
        return [lk for lk in self.nvlinks if lk.active]


class GPUPair(msgspec.Struct, kw_only=True, frozen=True):
    a: int  # GPU index, a < b
    b: int
    level: str  # nvidia-smi topo -m: NV18, PIX, PXB, PHB, NODE, SYS, ...
    p2p: str  # nvidia-smi topo -p2p r: OK, CNS, GNS, TNS, NS, U; "?" when not reported

    @property
    def nvlink(self) -> bool:
        return self.level.startswith("NV")

    @property
    def p2p_ok(self) -> bool:
        return self.p2p == "OK" or (self.p2p == "?" and self.nvlink)


class GPUNic(msgspec.Struct, kw_only=True, frozen=True):
    gpu: int
    nic: str
    level: str  # PIX, PXB, PHB, NODE, SYS


class NICPort(msgspec.Struct, kw_only=True, frozen=True):
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED, POLLING, ...
    phys_state: str = ""  # LinkUp, Disabled, Polling, ...
    rate_gbps: float = 0.0
    link_layer: str = ""  # InfiniBand, Ethernet, Unknown

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


class NIC(msgspec.Struct, kw_only=True):
    name: str  # mlx5_0, rdmap79s0, cxi0
    kind: str  # mlx5, efa, cxi, other (from the kernel driver)
    driver: str = ""
    hca_type: str = ""
    fw_ver: str = ""
    board_id: str = ""
    pci_id: str = ""
    netdev: str = ""
    # its PCIe link and locality, from the world-readable /sys/bus/pci/devices/<addr>/ (None: not there to read);
    # the current link speed drops with power saving, so it is not kept (the current width is)
    pcie_gen_max: int | None = None  # from max_link_speed (the device's fastest generation)
    pcie_width_max: int | None = None
    pcie_width_current: int | None = None
    numa_node: int | None = None  # -1: the kernel knows none
    ports: list[NICPort] = []

    @property
    def active_ports(self) -> list[NICPort]:
        return [p for p in self.ports if p.active]


class ExcludedNIC(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    reason: str
    # what the device is, read like any NIC: it stays in the fingerprint, because only root can read the VPD
    # that excludes it, and the fingerprint must not depend on who discovered (None: recorded by an older moetune)
    nic: NIC | None = None


class GPUDirect(msgspec.Struct, kw_only=True):
    nvidia_peermem: bool = False  # nvidia_peermem (or the older nv_peer_mem) in /proc/modules
    dmabuf: bool = False  # open kernel module + kernel >= 5.12 (dma-buf GPUDirect RDMA)
    open_kernel_module: bool = False
    kernel: str = ""

    @property
    def rdma(self) -> bool:
        return self.nvidia_peermem or self.dmabuf

    @property
    def how(self) -> str:
        ways = []
        if self.nvidia_peermem:
            ways.append("nvidia_peermem")
        if self.dmabuf:
            ways.append("dma-buf")
        return " + ".join(ways) if ways else "none"


class Libfabric(msgspec.Struct, kw_only=True):
    providers: list[str] = []
    version: str = ""


class TransportFamily(msgspec.Struct, kw_only=True, frozen=True):
    name: str  # nvlink, proxy:ibrc, proxy:libfabric/cxi, ibgda, host_staged, collective
    reason: str


class FabricFacts(msgspec.Struct, kw_only=True):
    gpus: list[GPU] = []
    pairs: list[GPUPair] = []
    gpu_nic: list[GPUNic] = []
    nics: list[NIC] = []
    excluded_nics: list[ExcludedNIC] = []
    gpudirect: GPUDirect = msgspec.field(default_factory=GPUDirect)
    libfabric: Libfabric = msgspec.field(default_factory=Libfabric)
    software: dict[str, str] = {}
    tools: dict[str, str] = {}  # command key -> ok | missing | timeout | failed (rc) — not fingerprinted
    transports: list[TransportFamily] = []
    unavailable: list[TransportFamily] = []  # families not found here, with the reason
    warnings: list[str] = []  # e.g. a command timed out: facts incomplete (not fingerprinted)
    nodes: int = 1
    source: str = "live"  # live | capture:<dir>
    seconds: float = 0.0  # how long discovery took (not fingerprinted)

    # ---- summaries ----------------------------------------------------------------------------
    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def gpu_model(self) -> str:
        models = sorted({g.model for g in self.gpus})
        return " + ".join(models) if models else "none"

    @property
    def complete(self) -> bool:
        """False when discovery could not read everything it expected (see `warnings`)."""
        return not self.warnings

    @property
    def nvlink_gbs_per_gpu(self) -> float:
        """Per-direction NVLink bandwidth of the weakest GPU (sum of its active link speeds, GB/s); 0 without NVLink."""
        if not self.gpus:
            return 0.0
        return round(min(sum(lk.speed_gbs for lk in g.active_links) for g in self.gpus), 3)

    @property
    def link_rates(self) -> dict[str, float]:
        """Rates for the tuner's analytic priors: link_gbps (NVLink GB/s per GPU), nic_gbit (fastest
        ACTIVE port, Gbit/s); a key is absent where this node has no such link."""
        out: dict[str, float] = {}
        if self.nvlink_gbs_per_gpu > 0:
            out["link_gbps"] = float(self.nvlink_gbs_per_gpu)
        rates = [float(p.rate_gbps) for n in self.nics for p in n.active_ports if p.rate_gbps > 0]
        if rates:
            out["nic_gbit"] = max(rates)
        return out

    @property
    def network_gbs(self) -> float:
        """Scale-out bandwidth of the node in GB/s (ACTIVE ports' rate / 8): InfiniBand, EFA and Slingshot
        ports; RoCE ports only when there are none of those (RoCE beside IB is usually storage)."""
        fast = [p.rate_gbps for n in self.nics for p in n.active_ports
                if n.kind in ("efa", "cxi") or p.link_layer == "InfiniBand"]
        if not fast:
            fast = [p.rate_gbps for n in self.nics for p in n.active_ports if p.link_layer == "Ethernet"]
        return round(sum(fast) / 8.0, 3)

    @property
    def transport_names(self) -> list[str]:
        return [t.name for t in self.transports]

    def transport(self, name: str) -> TransportFamily | None:
        for t in self.transports:
            if t.name == name:
                return t
        return None

    # ---- canonical form and hashes ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = msgspec.to_builtins(self)
        d["schema"] = FACTS_SCHEMA
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FabricFacts:
        d = {k: v for k, v in d.items() if k != "schema"}
        return msgspec.convert(d, cls)

    @property
    def fingerprint(self) -> str:
        from moetune.tuner.fabric.fingerprint import fingerprint

        return fingerprint(self.to_dict())

    @property
    def identity_hash(self) -> str:
        """Which physical GPUs these are (UUIDs and serials): a part replaced by another of the same model
        changes this, not the fingerprint (which stays shared by identical nodes)."""
        from moetune.tuner.fabric.fingerprint import identity_hash

        return identity_hash(self.to_dict())

    @property
    def hardware_hash(self) -> str:
        from moetune.tuner.fabric.fingerprint import hardware_hash

        return hardware_hash(self.to_dict())

    @property
    def software_hash(self) -> str:
        from moetune.tuner.fabric.fingerprint import software_hash

        return software_hash(self.to_dict())


class FactsError(ValueError):
    """Facts from a file or a database row that do not decode as `FabricFacts`, or that do not hash to the fingerprint
    recorded with them."""


def read_facts(d: Any) -> FabricFacts:
    """Facts kept as `to_dict()` (a store row, an export file) decoded as FabricFacts: every reader of the dict form
    (`fingerprint`, `diff_facts`) indexes it as this struct lays it out, so a dict that does not decode would fail
    there with a KeyError; FactsError says what is wrong instead."""
    if not isinstance(d, dict):
        raise FactsError(f"expected an object, got {type(d).__name__}")
    try:
        return FabricFacts.from_dict(d)
    except (msgspec.ValidationError, TypeError, ValueError) as e:
        raise FactsError(str(e)) from None


def facts_problem(fp_hash: str, d: Any) -> str:
    """Why facts recorded under `fp_hash` cannot be taken as that fingerprint's ('' when they can): they do not decode
    as FabricFacts (what `fabric diff` and the daemon read them as). Their hash is not compared with `fp_hash`: the
    fingerprint's rule changed on 2026-12-04 without a new FINGERPRINT_VERSION, so facts an earlier moetune recorded
    hash otherwise today, and refusing them refused every export of a database profiled before then."""
    try:
        read_facts(d)
    except FactsError as e:
        return f"its facts are not fabric facts moetune can read ({e})"
    return ""
