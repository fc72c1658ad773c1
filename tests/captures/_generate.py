"""Writes the hand-made test captures (run: python tests/captures/_generate.py).

The node descriptions follow public documentation (see README.md in this folder); the files are
written in the formats of the real tools (nvidia-smi XML / topo matrices / nvlink -s, sysfs attribute
files, /proc/modules lines, fi_info -l). This script only saves typing for repeated blocks: the
committed files are the test data, and tests never run this script.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent


def uuid_for(seed: str) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def gpu_xml(bus: str, name: str, uuid: str, minor: int, mem_mib: int, gen: int, width: int, temp: int, arch: str,
            fabric: str = "N/A") -> str:
    free = mem_mib - 328 - 1
    status = "Success" if fabric == "Completed" else "N/A"
    return f"""	<gpu id="00000000:{bus}:00.0">
		<product_name>{name}</product_name>
		<product_brand>NVIDIA</product_brand>
		<product_architecture>{arch}</product_architecture>
		<display_mode>Disabled</display_mode>
		<persistence_mode>Enabled</persistence_mode>
		<mig_mode>
			<current_mig>Disabled</current_mig>
			<pending_mig>Disabled</pending_mig>
		</mig_mode>
		<serial>{1650000000000 + minor * 7919}</serial>
		<uuid>{uuid}</uuid>
		<minor_number>{minor}</minor_number>
		<vbios_version>96.00.74.00.0D</vbios_version>
		<pci>
			<pci_bus>{bus}</pci_bus>
			<pci_device>00</pci_device>
			<pci_domain>0000</pci_domain>
			<pci_bus_id>00000000:{bus}:00.0</pci_bus_id>
			<pci_gpu_link_info>
				<pcie_gen>
					<max_link_gen>{gen}</max_link_gen>
					<current_link_gen>{gen}</current_link_gen>
					<device_current_link_gen>{gen}</device_current_link_gen>
					<max_device_link_gen>{gen}</max_device_link_gen>
					<max_host_link_gen>{gen}</max_host_link_gen>
				</pcie_gen>
				<link_widths>
					<max_link_width>{width}x</max_link_width>
					<current_link_width>{width}x</current_link_width>
				</link_widths>
			</pci_gpu_link_info>
			<replay_counter>0</replay_counter>
			<tx_util>550 KB/s</tx_util>
			<rx_util>780 KB/s</rx_util>
		</pci>
		<fabric>
			<state>{fabric}</state>
			<status>{status}</status>
		</fabric>
		<fan_speed>N/A</fan_speed>
		<performance_state>P0</performance_state>
		<fb_memory_usage>
			<total>{mem_mib} MiB</total>
			<reserved>328 MiB</reserved>
			<used>1 MiB</used>
			<free>{free} MiB</free>
		</fb_memory_usage>
		<utilization>
			<gpu_util>0 %</gpu_util>
			<memory_util>0 %</memory_util>
		</utilization>
		<temperature>
			<gpu_temp>{temp} C</gpu_temp>
			<memory_temp>{temp + 6} C</memory_temp>
		</temperature>
		<gpu_power_readings>
			<power_draw>71.42 W</power_draw>
		</gpu_power_readings>
		<clocks>
			<graphics_clock>345 MHz</graphics_clock>
			<sm_clock>345 MHz</sm_clock>
			<mem_clock>2619 MHz</mem_clock>
			<video_clock>765 MHz</video_clock>
		</clocks>
		<processes>
		</processes>
	</gpu>
"""


def smi_xml(driver: str, cuda: str, gpus: list[str]) -> str:
    return (
        '<?xml version="1.0" ?>\n<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">\n<nvidia_smi_log>\n'
        f"\t<timestamp>Mon Nov 30 05:00:00 2026</timestamp>\n\t<driver_version>{driver}</driver_version>\n"
        f"\t<cuda_version>{cuda}</cuda_version>\n\t<attached_gpus>{len(gpus)}</attached_gpus>\n"
        + "".join(gpus)
        + "</nvidia_smi_log>\n"
    )


TOPO_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

P2P_LEGEND = """
Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
  GNS  = GPU not supported
  TNS  = Topology not supported
  NS   = Not supported
  U    = Unknown
"""


def topo(n: int, level, nics: list[str] | None = None, nic_level=None, affinity=None) -> str:
    nics = nics or []
    cols = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(len(nics))]
    lines = ["\t" + "\t".join(cols) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for i in range(n):
        vals = [" X " if i == j else level(i, j) for j in range(n)] + [nic_level(i, k) for k in range(len(nics))]
        cpu, numa = affinity(i)
        lines.append(f"GPU{i}\t" + "\t".join(vals) + f"\t{cpu}\t{numa}\t\tN/A")
    for k in range(len(nics)):
        vals = [nic_level(i, k) for i in range(n)] + [" X " if k == m else "SYS" for m in range(len(nics))]
        lines.append(f"NIC{k}\t" + "\t".join(vals))
    text = "\n".join(lines) + "\n" + TOPO_LEGEND
    if nics:
        text += "\nNIC Legend:\n\n" + "".join(f"  NIC{k}: {name}\n" for k, name in enumerate(nics))
    return text


def p2p(n: int, status) -> str:
    lines = [" \t" + "\t".join(f"GPU{i}" for i in range(n)) + "\t"]
    for i in range(n):
        lines.append(f" GPU{i}\t" + "\t".join("X" if i == j else status(i, j) for j in range(n)) + "\t")
    return "\n".join(lines) + "\n" + P2P_LEGEND


def nvlink_s(gpus: list[tuple[str, str]], links: int, speed: str) -> str:
    out = []
    for i, (name, uuid) in enumerate(gpus):
        out.append(f"GPU {i}: {name} (UUID: {uuid})")
        out.extend(f"\t Link {k}: {speed}" for k in range(links))
    return "\n".join(out) + "\n"


def modules(names: list[str]) -> str:
    sizes = {"nvidia": 56823808, "nvidia_uvm": 1519616, "nvidia_modeset": 1290240, "nvidia_drm": 77824}
    out = []
    for i, n in enumerate(names):
        size = sizes.get(n, 16384 + 4096 * (i % 9))
        out.append(f"{n} {size} {i % 3} - Live 0x0000000000000000{' (POE)' if n.startswith('nvidia') else ''}")
    return "\n".join(out) + "\n"


class Capture:
    def __init__(self, name: str, source: str) -> None:
        self.root = HERE / name
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)
        self.commands: dict[str, dict] = {}
        self.source = source

    def file(self, path: str, text: str | bytes) -> None:
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text)

    def cmd(self, argv: list[str], text: str | None, status: str = "ok") -> None:
        key = "_".join(argv)
        self.commands[key] = {"argv": argv, "status": status, "rc": 0 if status == "ok" else None}
        if text is not None:
            self.file("commands/" + key, text)

    def packages(self, versions: dict[str, str | None]) -> None:
        self.file("python/packages.json", json.dumps(versions, indent=1, sort_keys=True) + "\n")

    def ib_port(self, dev: str, port: int, state: str, rate: str, layer: str) -> None:
        base = f"/sys/class/infiniband/{dev}/ports/{port}"
        num = {"ACTIVE": 4, "DOWN": 1, "INIT": 2, "ARMED": 3}[state]
        phys = "5: LinkUp" if state == "ACTIVE" else "3: Disabled"
        self.file(f"{base}/state", f"{num}: {state}\n")
        self.file(f"{base}/phys_state", f"{phys}\n")
        self.file(f"{base}/rate", f"{rate}\n")
        self.file(f"{base}/link_layer", f"{layer}\n")

    def ib_dev(self, dev: str, driver: str, pci_id: str, slot: str, fw: str, hca: str | None, board: str | None,
               netdev: str | None, vpd: bytes | None = None) -> None:
        base = f"/sys/class/infiniband/{dev}"
        self.file(f"{base}/fw_ver", fw + "\n")
        if hca is not None:
            self.file(f"{base}/hca_type", hca + "\n")
        if board is not None:
            self.file(f"{base}/board_id", board + "\n")
        self.file(f"{base}/device/uevent", f"DRIVER={driver}\nPCI_CLASS=20000\nPCI_ID={pci_id}\nPCI_SLOT_NAME={slot}\n")
        if netdev:
            (self.root / base.lstrip("/") / "device/net" / netdev).mkdir(parents=True, exist_ok=True)
        if vpd is not None:
            self.file(f"{base}/device/vpd", vpd)

    def done(self) -> None:
        for argv in (["nvidia-smi", "-q", "-x"], ["nvidia-smi", "topo", "-m"], ["nvidia-smi", "topo", "-p2p", "r"],
                     ["nvidia-smi", "nvlink", "-s"],
                     ["nvidia-smi", "--query-gpu=index,pci.bus_id,compute_cap", "--format=csv,noheader"],
                     ["fi_info", "-l"], ["fi_info", "--version"]):
            key = "_".join(argv)
            self.commands.setdefault(key, {"argv": argv, "status": "missing", "rc": None})
        manifest = {
            "format": "moetune-capture/1",
            "created": "hand-written",
            "source": self.source,
            "commands": dict(sorted(self.commands.items())),
        }
        self.file("manifest.json", json.dumps(manifest, indent=1) + "\n")


def vpd_bytes(ident: str, fields: list[tuple[str, str]]) -> bytes:
    """A PCI VPD image: identifier string tag, then a VPD-R block of keyword/length/value fields."""
    body = b"".join(k.encode() + bytes([len(v)]) + v.encode() for k, v in fields)
    ident_b = ident.encode()
    return (bytes([0x82, len(ident_b), 0]) + ident_b + bytes([0x90, len(body) & 0xFF, len(body) >> 8]) + body
            + bytes([0x78]))


def smi_query(buses: list[str], cc: str) -> str:
    return "".join(f"{i}, 00000000:{b}:00.0, {cc}\n" for i, b in enumerate(buses))


# ---------------------------------------------------------------------------------------------


def dgx_h100() -> None:
    c = Capture("dgx-h100", "NVIDIA DGX H100 User Guide (network ports table, GPU/NIC pairing), nvidia-smi "
                "formats; NVSwitch CX7-bridge LPF ports per the Fabric Manager User Guide (VPD SMDL=SW_MNG)")
    name = "NVIDIA H100 80GB HBM3"
    buses = ["1B", "43", "52", "61", "9D", "C3", "D1", "DF"]
    uuids = [uuid_for(f"dgx-h100-{b}") for b in buses]
    xml = [gpu_xml(b, name, u, i, 81559, 5, 16, 31 + i, "Hopper", "Completed") for i, (b, u) in enumerate(zip(buses, uuids, strict=True))]
    c.cmd(["nvidia-smi", "-q", "-x"], smi_xml("535.104.05", "12.2", xml))
    c.cmd(["nvidia-smi", "--query-gpu=index,pci.bus_id,compute_cap", "--format=csv,noheader"], smi_query(buses, "9.0"))
    # compute NICs (OSFP ports) paired with GPUs 0..7, storage/in-band NICs, NVSwitch management LPFs
    compute = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]
    compute_bus = ["18", "40", "4F", "5E", "9A", "C0", "CE", "DC"]
    storage = {"mlx5_1": ("29", "0"), "mlx5_2": ("29", "1"), "mlx5_7": ("AA", "0"), "mlx5_8": ("AA", "1")}
    lpf = {"mlx5_12": "E3", "mlx5_13": "E4"}
    nic_names = [f"mlx5_{k}" for k in range(14)]

    def nic_level(i: int, k: int) -> str:
        nic = nic_names[k]
        if nic in compute:
            j = compute.index(nic)
            if j == i:
                return "PXB"
            return "NODE" if (j < 4) == (i < 4) else "SYS"
        if nic in storage:
            return "NODE" if (nic in ("mlx5_1", "mlx5_2")) == (i < 4) else "SYS"
        return "SYS" if i < 4 else "NODE"

    c.cmd(["nvidia-smi", "topo", "-m"],
          topo(8, lambda i, j: "NV18", nic_names, nic_level,
               lambda i: ("0-55,112-167", "0") if i < 4 else ("56-111,168-223", "1")))
    c.cmd(["nvidia-smi", "topo", "-p2p", "r"], p2p(8, lambda i, j: "OK"))
    c.cmd(["nvidia-smi", "nvlink", "-s"], nvlink_s([(name, u) for u in uuids], 18, "26.562 GB/s"))
    nic_vpd = vpd_bytes("NVIDIA ConnectX-7 HHHL adapter card, 400Gb/s", [("PN", "MCX75310AAS-NEAT"), ("EC", "A7"),
                                                                          ("V2", "MCX75310AAS-NEAT"), ("RV", "\x00")])
    for dev, bus in zip(compute, compute_bus, strict=True):
        c.ib_dev(dev, "mlx5_core", "15B3:1021", f"0000:{bus.lower()}:00.0", "28.39.1002", "MT4129",
                 "MT_0000000838", f"ibp{int(bus, 16)}s0", nic_vpd)
        c.ib_port(dev, 1, "ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand")
    for dev, (bus, fn) in storage.items():
        c.ib_dev(dev, "mlx5_core", "15B3:1021", f"0000:{bus.lower()}:00.{fn}", "28.39.1002", "MT4129",
                 "MT_0000000838", f"enp{int(bus, 16)}s0f{fn}np{fn}", nic_vpd)
        up = dev != "mlx5_8"
        c.ib_port(dev, 1, "ACTIVE" if up else "DOWN", "200 Gb/sec (2X NDR)" if up else "40 Gb/sec (4X QDR)", "Ethernet")
    for dev, bus in lpf.items():
        vpd = vpd_bytes("NVIDIA ConnectX-7 bridge", [("PN", "692-9X8000-0000-000"), ("V2", "SMDL=SW_MNG"), ("RV", "\x00")])
        c.ib_dev(dev, "mlx5_core", "15B3:1021", f"0000:{bus.lower()}:00.1", "28.39.1002", "MT4129", "NVD0000000033",
                 None, vpd)
        c.ib_port(dev, 1, "ACTIVE", "100 Gb/sec (2X HDR)", "InfiniBand")
    c.file("/proc/modules", modules(["nvidia_peermem", "nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia",
                                     "mlx5_ib", "ib_uverbs", "ib_core", "mlx5_core", "mlxfw", "psample", "tls",
                                     "nvme", "nvme_core", "ipmi_si"]))
    c.file("/proc/driver/nvidia/version",
           "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
           "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04) \n")
    c.file("/proc/sys/kernel/osrelease", "5.15.0-1042-nvidia\n")
    c.packages({"torch": "2.4.1", "nvidia-nccl-cu12": "2.20.5", "nvidia-nvshmem-cu12": "3.2.5",
                "nvshmem4py-cu12": "0.1.0", "nvidia-cuda-runtime-cu12": "12.4.127", "moetune": "0.1.0"})
    c.done()


def perlmutter() -> None:
    c = Capture("perlmutter", "NERSC Perlmutter GPU node documentation (4 × A100-SXM4-40GB, NVLink3 NV4 between "
                "each pair, 4 × HPE Slingshot-11 200 Gb/s Cassini NICs through libfabric cxi), nvidia-smi formats")
    name = "NVIDIA A100-SXM4-40GB"
    buses = ["03", "41", "82", "C1"]
    uuids = [uuid_for(f"perlmutter-{b}") for b in buses]
    xml = [gpu_xml(b, name, u, i, 40960, 4, 16, 28 + i, "Ampere") for i, (b, u) in enumerate(zip(buses, uuids, strict=True))]
    c.cmd(["nvidia-smi", "-q", "-x"], smi_xml("535.154.05", "12.2", xml))
    c.cmd(["nvidia-smi", "--query-gpu=index,pci.bus_id,compute_cap", "--format=csv,noheader"], smi_query(buses, "8.0"))
    aff = {0: ("48-63,112-127", "3"), 1: ("32-47,96-111", "2"), 2: ("16-31,80-95", "1"), 3: ("0-15,64-79", "0")}
    c.cmd(["nvidia-smi", "topo", "-m"], topo(4, lambda i, j: "NV4", affinity=lambda i: aff[i]))
    c.cmd(["nvidia-smi", "topo", "-p2p", "r"], p2p(4, lambda i, j: "OK"))
    c.cmd(["nvidia-smi", "nvlink", "-s"], nvlink_s([(name, u) for u in uuids], 12, "25 GB/s"))
    for k, bus in enumerate(["C2", "81", "42", "02"]):
        base = f"/sys/class/cxi/cxi{k}/device"
        c.file(f"{base}/uevent", f"DRIVER=cxi_ss1\nPCI_CLASS=20000\nPCI_ID=17DB:0501\nPCI_SLOT_NAME=0000:{bus.lower()}:00.0\n")
        c.file(f"{base}/numa_node", f"{3 - k}\n")
        c.file(f"{base}/net/hsn{k}/operstate", "up\n")
        c.file(f"{base}/net/hsn{k}/speed", "200000\n")
    c.file("/proc/modules", modules(["cxi_eth", "cxi_user", "cxi_ss1", "sl", "sbl", "nvidia_uvm", "nvidia_drm",
                                     "nvidia_modeset", "nvidia", "kdreg2", "xpmem", "lustre", "lnet"]))
    c.file("/proc/driver/nvidia/version",
           "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.154.05  Thu Dec 28 15:37:48 UTC 2023\n"
           "GCC version:  gcc version 7.5.0 (SUSE Linux) \n")
    c.file("/proc/sys/kernel/osrelease", "5.14.21-150500.55.49_13.0.56-cray_shasta_c\n")
    provs = ["cxi", "ofi_rxm", "ofi_rxd", "shm", "udp", "tcp", "sockets", "ofi_hook_perf", "ofi_hook_trace",
             "ofi_hook_debug", "ofi_hook_noop", "ofi_hook_hmem", "ofi_hook_dmabuf_peer_mem", "off_coll", "lnx"]
    c.cmd(["fi_info", "-l"], "".join(f"{p}:\n    version: {'0.1' if p == 'cxi' else '120.0'}\n" for p in provs))
    c.cmd(["fi_info", "--version"], "fi_info: 1.20.1\nlibfabric: 1.20.1\nlibfabric api: 1.20\n")
    c.packages({"torch": "2.3.1", "nvidia-nccl-cu12": "2.20.5", "nvidia-nvshmem-cu12": "3.2.5",
                "nvidia-cuda-runtime-cu12": "12.1.105", "moetune": "0.1.0"})
    c.done()


def rtx4090x4() -> None:
    c = Capture("rtx4090x4", "A 2-socket workstation with 4 × GeForce RTX 4090 (no NVLink, peer-to-peer not "
                "supported by the driver on GeForce Ada), nvidia-smi formats")
    name = "NVIDIA GeForce RTX 4090"
    buses = ["01", "21", "81", "A1"]
    uuids = [uuid_for(f"rtx-{b}") for b in buses]
    xml = [gpu_xml(b, name, u, i, 24564, 4, 16, 35 + i, "Ada Lovelace") for i, (b, u) in enumerate(zip(buses, uuids, strict=True))]
    c.cmd(["nvidia-smi", "-q", "-x"], smi_xml("550.54.14", "12.4", xml))
    c.cmd(["nvidia-smi", "--query-gpu=index,pci.bus_id,compute_cap", "--format=csv,noheader"], smi_query(buses, "8.9"))
    c.cmd(["nvidia-smi", "topo", "-m"],
          topo(4, lambda i, j: "PHB" if (i < 2) == (j < 2) else "SYS",
               affinity=lambda i: ("0-31,64-95", "0") if i < 2 else ("32-63,96-127", "1")))
    c.cmd(["nvidia-smi", "topo", "-p2p", "r"], p2p(4, lambda i, j: "CNS"))
    c.cmd(["nvidia-smi", "nvlink", "-s"], "".join(f"GPU {i}: {name} (UUID: {u})\n" for i, u in enumerate(uuids)))
    c.file("/proc/modules", modules(["nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia", "snd_hda_intel",
                                     "igb", "nvme", "nvme_core"]))
    c.file("/proc/driver/nvidia/version",
           "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n"
           "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n")
    c.file("/proc/sys/kernel/osrelease", "6.5.0-26-generic\n")
    c.packages({"torch": "2.5.1", "nvidia-nccl-cu12": "2.21.5", "nvidia-cuda-runtime-cu12": "12.4.127",
                "moetune": "0.1.0"})
    c.done()


def aws_p5() -> None:
    c = Capture("aws-p5", "AWS p5.48xlarge documentation (8 × H100 80GB HBM3 over NVSwitch, 32 EFA devices, "
                "3200 Gbps aggregate, libfabric efa provider), nvidia-smi formats")
    name = "NVIDIA H100 80GB HBM3"
    buses = ["53", "64", "75", "86", "97", "A8", "B9", "CA"]
    uuids = [uuid_for(f"p5-{b}") for b in buses]
    xml = [gpu_xml(b, name, u, i, 81559, 5, 16, 30 + i, "Hopper", "Completed") for i, (b, u) in enumerate(zip(buses, uuids, strict=True))]
    c.cmd(["nvidia-smi", "-q", "-x"], smi_xml("550.90.07", "12.4", xml))
    c.cmd(["nvidia-smi", "--query-gpu=index,pci.bus_id,compute_cap", "--format=csv,noheader"], smi_query(buses, "9.0"))
    c.cmd(["nvidia-smi", "topo", "-m"],
          topo(8, lambda i, j: "NV18", affinity=lambda i: ("0-47,96-143", "0") if i < 4 else ("48-95,144-191", "1")))
    c.cmd(["nvidia-smi", "topo", "-p2p", "r"], p2p(8, lambda i, j: "OK"))
    c.cmd(["nvidia-smi", "nvlink", "-s"], nvlink_s([(name, u) for u in uuids], 18, "26.562 GB/s"))
    for gb in buses:
        for k in range(4):
            bus = int(gb, 16) - 4 + k if k < 2 else int(gb, 16) + k - 1
            dev = f"rdmap{bus}s0"
            c.ib_dev(dev, "efa", "1D0F:EFA1", f"0000:{bus:02x}:00.0", "0.0.0.0", None, None, None)
            c.ib_port(dev, 1, "ACTIVE", "100 Gb/sec (4X EDR)", "Unknown")
    c.file("/proc/modules", modules(["efa", "ib_uverbs", "ib_core", "gdrdrv", "nvidia_uvm", "nvidia_drm",
                                     "nvidia_modeset", "nvidia", "ena", "nvme", "nvme_core"]))
    c.file("/proc/driver/nvidia/version",
           "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.90.07  Release Build  "
           "(dvs-builder@U16-I3-B03-4-3)  Fri May 31 09:34:34 UTC 2024\n"
           "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n")
    c.file("/proc/sys/kernel/osrelease", "6.8.0-1015-aws\n")
    provs = ["efa", "ofi_rxm", "shm", "udp", "tcp", "sockets", "ofi_hook_perf", "ofi_hook_trace", "ofi_hook_noop",
             "ofi_hook_hmem", "ofi_hook_dmabuf_peer_mem", "off_coll", "sm2", "ofi_mrail"]
    c.cmd(["fi_info", "-l"], "".join(f"{p}:\n    version: 122.0\n" for p in provs))
    c.cmd(["fi_info", "--version"], "fi_info: 1.22.0amzn1.0\nlibfabric: 1.22.0amzn1.0\nlibfabric api: 1.22\n")
    c.packages({"torch": "2.4.0", "nvidia-nccl-cu12": "2.21.5", "nvidia-cuda-runtime-cu12": "12.4.127",
                "moetune": "0.1.0"})
    c.done()


def cpu_laptop() -> None:
    c = Capture("cpu-laptop", "A laptop without an NVIDIA GPU or RDMA NIC (nvidia-smi and fi_info not installed)")
    c.file("/proc/modules", modules(["snd_hda_intel", "i915", "iwlmvm", "iwlwifi", "btusb", "uvcvideo",
                                     "nvme", "nvme_core", "thunderbolt"]))
    c.file("/proc/sys/kernel/osrelease", "6.5.0-14-generic\n")
    c.packages({"torch": "2.13.0+cpu", "moetune": "0.1.0"})
    c.done()


if __name__ == "__main__":
    dgx_h100()
    perlmutter()
    rtx4090x4()
    aws_p5()
    cpu_laptop()
    print("captures written under", HERE)
