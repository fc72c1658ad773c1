"""Fingerprint: stable, order-independent, blind to volatile facts, and every real change is explained."""

from __future__ import annotations

import json
import pathlib
import random
import re
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Callable

import pytest

from moetune.tuner.fabric.discovery import discover
from moetune.tuner.fabric.fingerprint import diff_facts, fingerprint

CAPTURES = pathlib.Path(__file__).resolve().parent / "captures"
XML = "commands/nvidia-smi_-q_-x"
TOPO = "commands/nvidia-smi_topo_-m"
P2P = "commands/nvidia-smi_topo_-p2p_r"
NVLINK = "commands/nvidia-smi_nvlink_-s"
QUERY = "commands/nvidia-smi_--query-gpu=index,pci.bus_id,compute_cap_--format=csv,noheader"
IB = "sys/class/infiniband"


def copy(name: str, tmp: pathlib.Path) -> pathlib.Path:
    dest = tmp / name
    shutil.copytree(CAPTURES / name, dest)
    return dest


def edit(root: pathlib.Path, rel: str, fn: Callable[[str], str]) -> None:
    p = root / rel
    new = fn(p.read_text())
    assert new != p.read_text(), f"edit of {rel} changed nothing"
    p.write_text(new)


def sub(pattern: str, repl: str, count: int = 0) -> Callable[[str], str]:
    return lambda s: re.sub(pattern, repl, s, count=count, flags=re.M)


def edit_packages(root: pathlib.Path, **changes: str | None) -> None:
    p = root / "python/packages.json"
    d = json.loads(p.read_text())
    d.update({k.replace("_", "-"): v for k, v in changes.items()})
    p.write_text(json.dumps(d))


# ---- matrices (nvidia-smi topo -m / -p2p r) ---------------------------------------------------


def read_matrix(text: str) -> tuple[list[str], list[str], dict[str, list[str]], list[str]]:
    lines = text.splitlines()
    hi = next(i for i, ln in enumerate(lines) if "GPU0" in ln)
    header = [t.strip() for t in lines[hi].split("\t") if t.strip()]
    cols = [c for c in header if re.match(r"^(GPU|NIC)\d+$", c)]
    extra = header[len(cols) :]
    rows: dict[str, list[str]] = {}
    rest: list[str] = []
    for ln in lines[hi + 1 :]:
        toks = [t.strip() for t in ln.split("\t")]
        toks = [t for t in toks if t != ""] if toks and toks[0] == "" else toks
        label = toks[0].strip() if toks else ""
        if label in cols and not rest:
            rows[label] = [t for t in ln.split("\t")[1:]]
        else:
            rest.append(ln)
    return cols, extra, rows, rest


def write_matrix(cols: list[str], extra: list[str], rows: dict[str, list[str]], rest: list[str], p2p: bool) -> str:
    pre = " " if p2p else ""
    out = [pre + "\t" + "\t".join(cols + extra) + ("\t" if p2p else "")]
    for label in [c for c in cols if c in rows]:
        out.append(f"{pre}{label}\t" + "\t".join(rows[label]))
    return "\n".join(out + rest) + "\n"


def remove_gpu(root: pathlib.Path, k: int) -> None:
    tree = ET.parse(root / XML)
    gpus = tree.getroot().findall("gpu")
    gpus.sort(key=lambda g: g.get("id"))
    uuid = gpus[k].findtext("uuid")
    tree.getroot().remove(gpus[k])
    tree.getroot().find("attached_gpus").text = str(len(gpus) - 1)
    tree.write(root / XML)
    for rel, is_p2p in ((TOPO, False), (P2P, True)):
        text = (root / rel).read_text().replace("\n GPU", "\nGPU") if is_p2p else (root / rel).read_text()
        cols, extra, rows, rest = read_matrix(text)
        ci = cols.index(f"GPU{k}")
        new_cols = [c for c in cols if c != f"GPU{k}"]
        ren = {c: (f"GPU{int(c[3:]) - 1}" if c.startswith("GPU") and int(c[3:]) > k else c) for c in new_cols}
        new_rows = {}
        for label, vals in rows.items():
            if label == f"GPU{k}":
                continue
            vals = vals[:ci] + vals[ci + 1 :]
            new_rows[ren[label]] = vals
        (root / rel).write_text(write_matrix([ren[c] for c in new_cols], extra, new_rows, rest, is_p2p))
    blocks = re.split(r"(?m)^(?=GPU \d+:)", (root / NVLINK).read_text())
    blocks = [b for b in blocks if b.strip() and uuid not in b]
    (root / NVLINK).write_text("".join(re.sub(r"^GPU \d+:", f"GPU {i}:", b) for i, b in enumerate(blocks)))
    q = [ln for ln in (root / QUERY).read_text().splitlines() if ln.strip()]
    q = q[:k] + q[k + 1 :]
    (root / QUERY).write_text("".join(re.sub(r"^\d+,", f"{i},", ln) + "\n" for i, ln in enumerate(q)))


def permute_gpus(root: pathlib.Path, perm: list[int]) -> None:
    """Relabel GPUs: new GPU k is the old GPU perm[k] (bus ids, matrices and nvlink blocks follow)."""
    tree = ET.parse(root / XML)
    gpus = sorted(tree.getroot().findall("gpu"), key=lambda g: g.get("id"))
    buses = [g.get("id") for g in gpus]
    for k, old in enumerate(perm):
        g = gpus[old]
        g.set("id", buses[k])
        g.find("pci/pci_bus_id").text = buses[k]
    for g in gpus:  # and shuffle the document order too
        tree.getroot().remove(g)
    for g in random.Random(7).sample(gpus, len(gpus)):
        tree.getroot().append(g)
    tree.write(root / XML)
    n = len(perm)
    for rel, is_p2p in ((TOPO, False), (P2P, True)):
        text = (root / rel).read_text().replace("\n GPU", "\nGPU") if is_p2p else (root / rel).read_text()
        cols, extra, rows, rest = read_matrix(text)
        new_rows = dict(rows)
        for k in range(n):
            old = rows[f"GPU{perm[k]}"]
            vals = list(old)
            for m in range(n):
                vals[m] = rows[f"GPU{perm[k]}"][perm[m]]
            new_rows[f"GPU{k}"] = vals
        for label in cols:
            if label.startswith("NIC") and label in rows:
                vals = list(rows[label])
                for m in range(n):
                    vals[m] = rows[label][perm[m]]
                new_rows[label] = vals
        (root / rel).write_text(write_matrix(cols, extra, new_rows, rest, is_p2p))
    blocks = [b for b in re.split(r"(?m)^(?=GPU \d+:)", (root / NVLINK).read_text()) if b.strip()]
    by_old = {int(re.match(r"GPU (\d+):", b).group(1)): b for b in blocks}
    (root / NVLINK).write_text("".join(re.sub(r"^GPU \d+:", f"GPU {k}:", by_old[perm[k]]) for k in range(n)))


def rename_nics(root: pathlib.Path, a: str, b: str) -> None:
    base = root / IB
    (base / a).rename(base / "_tmp")
    (base / b).rename(base / a)
    (base / "_tmp").rename(base / b)
    edit(root, TOPO, lambda s: s.replace(f": {a}\n", ": _tmp\n").replace(f": {b}\n", f": {a}\n").replace(": _tmp\n", f": {b}\n"))


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dgx-h100", "perlmutter", "rtx4090x4", "aws-p5", "cpu-laptop"])
def test_identical_across_runs(name: str) -> None:
    a, b = discover(CAPTURES / name), discover(CAPTURES / name)
    assert a.fingerprint == b.fingerprint and a.hardware_hash == b.hardware_hash and a.software_hash == b.software_hash
    assert re.fullmatch(r"[0-9a-f]{16}", a.fingerprint)
    assert diff_facts(a.to_dict(), b.to_dict()) == []


def test_captures_all_differ() -> None:
    fps = {discover(CAPTURES / n).fingerprint for n in ("dgx-h100", "perlmutter", "rtx4090x4", "aws-p5", "cpu-laptop")}
    assert len(fps) == 5


def test_fingerprint_recomputes_from_stored_dict() -> None:
    f = discover(CAPTURES / "dgx-h100")
    d = json.loads(json.dumps(f.to_dict()))  # what a store hands back
    assert fingerprint(d) == f.fingerprint


def test_hardware_and_software_hashes_split(tmp_path: pathlib.Path) -> None:
    base = discover(CAPTURES / "dgx-h100")
    root = copy("dgx-h100", tmp_path)
    edit_packages(root, nvidia_nccl_cu12="2.21.5")
    sw = discover(root)
    assert sw.hardware_hash == base.hardware_hash and sw.software_hash != base.software_hash
    root2 = copy("dgx-h100", tmp_path / "b")
    edit(root2, f"{IB}/mlx5_3/ports/1/state", lambda s: "1: DOWN\n")
    hw = discover(root2)
    assert hw.hardware_hash != base.hardware_hash and hw.software_hash == base.software_hash


def test_reordered_gpu_elements_same_facts(tmp_path: pathlib.Path) -> None:
    root = copy("dgx-h100", tmp_path)
    permute_gpus(root, list(range(8)))  # identity relabel, shuffled XML document order
    a, b = discover(CAPTURES / "dgx-h100"), discover(root)
    assert a.fingerprint == b.fingerprint
    assert diff_facts(a.to_dict(), b.to_dict()) == []


@pytest.mark.parametrize("perm", [[7, 6, 5, 4, 3, 2, 1, 0], [2, 0, 1, 5, 3, 7, 4, 6], [1, 2, 3, 4, 5, 6, 7, 0]])
def test_gpu_permutation_invariant(tmp_path: pathlib.Path, perm: list[int]) -> None:
    """After asymmetric changes (a link down on GPU 2, a narrow PCIe link on GPU 5), relabelling GPUs keeps the hash."""
    root = copy("dgx-h100", tmp_path)
    _nvlink_down(root, gpu=2, link=3)
    _pcie_width(root, gpu=5, width=8)
    changed = discover(root).fingerprint
    assert changed != discover(CAPTURES / "dgx-h100").fingerprint
    permute_gpus(root, perm)
    f = discover(root)
    assert f.fingerprint == changed
    moved = [g for g in f.gpus if g.pcie_width_current == 8]
    assert len(moved) == 1 and moved[0].index == perm.index(5)


def test_nic_renaming_invariant(tmp_path: pathlib.Path) -> None:
    root = copy("dgx-h100", tmp_path)
    edit(root, f"{IB}/mlx5_4/ports/1/rate", lambda s: "200 Gb/sec (4X HDR)\n")
    changed = discover(root).fingerprint
    rename_nics(root, "mlx5_4", "mlx5_9")
    rename_nics(root, "mlx5_0", "mlx5_1")
    f = discover(root)
    assert f.fingerprint == changed
    assert next(n for n in f.nics if n.name == "mlx5_9").ports[0].rate_gbps == 200


def test_volatile_facts_ignored(tmp_path: pathlib.Path) -> None:
    root = copy("dgx-h100", tmp_path)

    def volatile(s: str) -> str:
        s = re.sub(r"<gpu_temp>\d+ C</gpu_temp>", "<gpu_temp>71 C</gpu_temp>", s)
        s = re.sub(r"<memory_temp>\d+ C</memory_temp>", "<memory_temp>80 C</memory_temp>", s)
        s = re.sub(r"<(graphics|sm)_clock>\d+ MHz", r"<\1_clock>1980 MHz", s)
        s = s.replace("<used>1 MiB</used>", "<used>64000 MiB</used>")
        s = re.sub(r"<free>\d+ MiB</free>", "<free>17230 MiB</free>", s)
        s = s.replace("<current_link_gen>5</current_link_gen>", "<current_link_gen>1</current_link_gen>")
        s = s.replace("<power_draw>71.42 W</power_draw>", "<power_draw>690.10 W</power_draw>")
        s = s.replace("<gpu_util>0 %</gpu_util>", "<gpu_util>97 %</gpu_util>")
        s = s.replace("Mon Nov 30 05:00:00 2026", "Tue Dec  1 11:12:13 2026")
        return s.replace(
            "<processes>\n\t\t</processes>",
            "<processes>\n\t\t\t<process_info><pid>4242</pid><type>C</type><process_name>python</process_name>"
            "<used_memory>63000 MiB</used_memory></process_info>\n\t\t</processes>",
        )

    edit(root, XML, volatile)
    f = discover(root)
    assert f.gpus[0].pcie_gen_current == 1  # read, shown, but not fingerprinted
    base = discover(CAPTURES / "dgx-h100")
    assert f.fingerprint == base.fingerprint
    assert diff_facts(base.to_dict(), f.to_dict()) == []


def test_nvswitch_management_ports_count_as_rdma_devices(tmp_path: pathlib.Path) -> None:
    """They count as RDMA devices in both views alike: only root can tell them (their VPD), so leaving them out would
    make a user see two more NICs and compute another fingerprint. A management port's link going down or the port
    disappearing is a change for everyone (tests/test_fabric_privilege.py)."""
    root = copy("dgx-h100", tmp_path)
    base = discover(CAPTURES / "dgx-h100").fingerprint
    edit(root, f"{IB}/mlx5_12/ports/1/state", lambda s: "1: DOWN\n")
    down = discover(root).fingerprint
    shutil.rmtree(root / IB / "mlx5_13")
    assert len({base, down, discover(root).fingerprint}) == 3


# ---- 20+ scripted changes, each with its readable reason ----------------------------------------


def _nvlink_down(root: pathlib.Path, gpu: int, link: int) -> None:
    blocks = re.split(r"(?m)^(?=GPU \d+:)", (root / NVLINK).read_text())
    out = []
    for b in blocks:
        if b.startswith(f"GPU {gpu}:"):
            b = re.sub(rf"(?m)^(\s*Link {link}:).*$", r"\1 <inactive>", b)
        out.append(b)
    (root / NVLINK).write_text("".join(out))


def _pcie_width(root: pathlib.Path, gpu: int, width: int) -> None:
    tree = ET.parse(root / XML)
    g = sorted(tree.getroot().findall("gpu"), key=lambda e: e.get("id"))[gpu]
    g.find("pci/pci_gpu_link_info/link_widths/current_link_width").text = f"{width}x"
    tree.write(root / XML)


def _gpu_model(root: pathlib.Path) -> None:
    edit(root, XML, lambda s: s.replace("NVIDIA H100 80GB HBM3", "NVIDIA H200").replace("81559 MiB", "143771 MiB"))
    edit(root, NVLINK, lambda s: s.replace("NVIDIA H100 80GB HBM3", "NVIDIA H200"))


def _mig(root: pathlib.Path) -> None:
    tree = ET.parse(root / XML)
    g = sorted(tree.getroot().findall("gpu"), key=lambda e: e.get("id"))[0]
    g.find("mig_mode/current_mig").text = "Enabled"
    tree.write(root / XML)


CHANGES: list[tuple[str, str, Callable[[pathlib.Path], None], str]] = [
    ("gpu_removed", "dgx-h100", lambda r: remove_gpu(r, 6), "GPU 6 missing (NVIDIA H100 80GB HBM3, 00000000:D1:00.0)"),
    ("nic_port_down", "dgx-h100", lambda r: edit(r, f"{IB}/mlx5_3/ports/1/state", lambda s: "1: DOWN\n"),
     "mlx5_3 port 1 ACTIVE → DOWN"),
    ("rate_change", "dgx-h100", lambda r: edit(r, f"{IB}/mlx5_0/ports/1/rate", lambda s: "200 Gb/sec (4X HDR)\n"),
     "mlx5_0 port 1 rate 400 → 200 Gb/s"),
    ("driver_bump", "dgx-h100", lambda r: edit(r, XML, sub(r"535\.104\.05", "550.54.15")), "driver 535.104.05 → 550.54.15"),
    ("nvlink_down", "dgx-h100", lambda r: _nvlink_down(r, 2, 3), "NVLink 3 of GPU 2 down"),
    ("nvlink_slower", "dgx-h100", lambda r: edit(r, NVLINK, sub(r"(GPU 1:.*\n\s*Link 0:) 26.562", r"\1 25.000")),
     "NVLink 0 of GPU 1 speed 26.562 → 25 GB/s"),
    ("nvshmem_version", "dgx-h100", lambda r: edit_packages(r, nvidia_nvshmem_cu12="3.3.9"), "NVSHMEM 3.2.5 → 3.3.9"),
    ("nccl_version", "dgx-h100", lambda r: edit_packages(r, nvidia_nccl_cu12="2.21.5"), "NCCL 2.20.5 → 2.21.5"),
    ("peermem_unloaded", "dgx-h100", lambda r: edit(r, "proc/modules", sub(r"^nvidia_peermem .*\n", "")),
     "nvidia_peermem unloaded"),
    ("provider_gone", "perlmutter", lambda r: edit(r, "commands/fi_info_-l", sub(r"^cxi:\n.*\n", "")),
     "libfabric provider cxi gone"),
    ("firmware", "dgx-h100", lambda r: edit(r, f"{IB}/mlx5_4/fw_ver", lambda s: "28.40.1000\n"),
     "mlx5_4 firmware 28.39.1002 → 28.40.1000"),
    ("cuda_bump", "dgx-h100", lambda r: edit(r, XML, sub(r"<cuda_version>12.2<", "<cuda_version>12.4<")), "CUDA 12.2 → 12.4"),
    ("pcie_width_drop", "dgx-h100", lambda r: _pcie_width(r, 5, 8), "GPU 5 PCIe width x16 → x8"),
    ("gpu_model", "dgx-h100", _gpu_model, "GPUs 0–7 model NVIDIA H100 80GB HBM3 → NVIDIA H200"),
    ("torch_version", "dgx-h100", lambda r: edit_packages(r, torch="2.5.1"), "torch 2.4.1 → 2.5.1"),
    ("nvshmem4py_version", "dgx-h100", lambda r: edit_packages(r, nvshmem4py_cu12="0.2.0"), "nvshmem4py 0.1.0 → 0.2.0"),
    ("link_layer", "dgx-h100", lambda r: edit(r, f"{IB}/mlx5_1/ports/1/link_layer", lambda s: "InfiniBand\n"),
     "mlx5_1 port 1 link layer Ethernet → InfiniBand"),
    ("nic_removed", "dgx-h100", lambda r: shutil.rmtree(r / IB / "mlx5_9"), "mlx5_9 missing"),
    ("p2p_enabled", "rtx4090x4", lambda r: edit(r, P2P, sub(r"^( GPU0\tX\t)CNS", r"\1OK")), "GPU 0–GPU 1 P2P CNS → OK"),
    ("topology_level", "rtx4090x4", lambda r: edit(r, TOPO, sub(r"^(GPU0\t X \t)PHB", r"\1PIX")),
     "GPU 0–GPU 1 topology PHB → PIX"),
    ("mig_enabled", "dgx-h100", _mig, "GPU 0 MIG disabled → enabled"),
    ("fabric_manager_stopped", "aws-p5", lambda r: edit(r, XML, lambda s: s.replace("<state>Completed</state>",
     "<state>In Progress</state>").replace("<status>Success</status>", "<status>N/A</status>")),
     "GPUs 0–7 NVSwitch fabric Completed → In Progress"),
    ("moetune_version", "cpu-laptop", lambda r: edit_packages(r, moetune="0.2.0"), "moetune 0.1.0 → 0.2.0"),
    ("libfabric_version", "perlmutter", lambda r: edit(r, "commands/fi_info_--version", sub("1.20.1", "1.22.0")),
     "libfabric 1.20.1 → 1.22.0"),
    ("dmabuf_lost", "aws-p5", lambda r: edit(r, "proc/sys/kernel/osrelease", lambda s: "5.10.220-209.869.amzn2.x86_64\n"),
     "dma-buf GPUDirect RDMA available → unavailable"),
    ("efa_port_down", "aws-p5", lambda r: edit(r, f"{IB}/rdmap79s0/ports/1/state", lambda s: "1: DOWN\n"),
     "rdmap79s0 port 1 ACTIVE → DOWN"),
    ("slingshot_down", "perlmutter", lambda r: edit(r, "sys/class/cxi/cxi2/device/net/hsn2/operstate", lambda s: "down\n"),
     "cxi2 port 1 ACTIVE → DOWN"),
    ("nccl_installed", "cpu-laptop", lambda r: edit_packages(r, nvidia_nccl_cu12="2.21.5"), "NCCL none → 2.21.5"),
]


@pytest.mark.parametrize("case", CHANGES, ids=[c[0] for c in CHANGES])
def test_scripted_change(case: tuple, tmp_path: pathlib.Path) -> None:
    _, name, change, expected = case
    base = discover(CAPTURES / name)
    root = copy(name, tmp_path)
    change(root)
    new = discover(root)
    assert new.fingerprint != base.fingerprint, "the change did not change the fingerprint"
    reasons = diff_facts(base.to_dict(), new.to_dict())
    assert expected in reasons, reasons
    back = diff_facts(new.to_dict(), base.to_dict())
    assert back, "the reverse change must be explained too"


def test_grouped_reasons(tmp_path: pathlib.Path) -> None:
    root = copy("dgx-h100", tmp_path)
    for k in (0, 1, 2, 5):
        _nvlink_down(root, gpu=3, link=k)
    _nvlink_down(root, gpu=6, link=0)
    for k in (0, 1, 2, 5):
        _nvlink_down(root, gpu=6, link=k)
    reasons = diff_facts(discover(CAPTURES / "dgx-h100").to_dict(), discover(root).to_dict())
    assert "NVLinks 0–2, 5 of GPUs 3, 6 down" in reasons, reasons
    assert len([r for r in reasons if "NVLink" in r]) == 1


def test_at_least_twenty_changes() -> None:
    assert len(CHANGES) >= 20


def test_consequences_reported(tmp_path: pathlib.Path) -> None:
    root = copy("dgx-h100", tmp_path)
    edit(root, "proc/modules", sub(r"^nvidia_peermem .*\n", ""))
    f = discover(root)
    assert "ibgda" not in f.transport_names and "proxy:ibrc" not in f.transport_names
    reasons = diff_facts(discover(CAPTURES / "dgx-h100").to_dict(), f.to_dict())
    assert "transport ibgda no longer available" in reasons
    assert "no GPUDirect RDMA" in next(t.reason for t in f.unavailable if t.name == "ibgda")


def test_fabric_not_ready_disables_nvlink(tmp_path: pathlib.Path) -> None:
    root = copy("dgx-h100", tmp_path)
    edit(root, XML, lambda s: s.replace("<state>Completed</state>", "<state>Not Started</state>"))
    f = discover(root)
    assert "nvlink" not in f.transport_names and "host_staged" in f.transport_names
    assert "Fabric Manager state: Not Started" in next(t.reason for t in f.unavailable if t.name == "nvlink")


def test_all_nvlinks_down_falls_back(tmp_path: pathlib.Path) -> None:
    root = copy("perlmutter", tmp_path)
    edit(root, TOPO, lambda s: s.replace("NV4", "SYS"))
    edit(root, P2P, lambda s: s.replace("\tOK", "\tNS"))
    f = discover(root)
    assert "nvlink" not in f.transport_names and "host_staged" in f.transport_names
