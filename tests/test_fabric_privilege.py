"""The fingerprint does not depend on who discovers, and covers the NICs' PCIe links and NUMA locality.

`moetune profile` often runs as root at bring-up; the daemon and the runtime as an ordinary user. A fact only root
can read must not make the two compute different fingerprints (the user's daemon would then serve nothing, or mark
root's profiles stale). The two views are simulated on captures: root reads a file, the user is refused it (a
refused read is None in `LiveSource.read_bytes`, as a file missing from a capture is).

NIC PCIe link (max generation, max and current width) and the NUMA node of GPUs and NICs come from the world-readable
/sys/bus/pci/devices/<addr>/ attributes; a NIC trained at x8, or a device on another NUMA node, is a fabric change.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.fabric.discovery import discover
from moetune.tuner.fabric.fingerprint import diff_facts

pytestmark = pytest.mark.timeout(60)
IB = Path("sys/class/infiniband")
XML_KEY = "nvidia-smi_-q_-x"


def _copy(tmp_path: Path, name: str = "dgx-h100", as_: str = "cap") -> Path:
    dest = tmp_path / as_
    shutil.copytree(F.CAPTURES / name, dest)
    return dest


def _as_user(cap: Path) -> Path:
    """What an ordinary user reads of the same node: every device's VPD (mode 0600) refused."""
    for vpd in (cap / IB).glob("*/device/vpd"):
        vpd.unlink()
    return cap


def _gpu_addrs(cap: Path) -> list[str]:
    from moetune.tuner.fabric.discovery import sysfs_pci_address

    return [sysfs_pci_address(g.pci_bus_id) for g in discover(cap).gpus]


def _with_pci_sysfs(cap: Path, *, nic_width: int = 16, gpu_numa: dict[int, int] | None = None) -> Path:
    """Add /sys/bus/pci/devices/<addr>/ attributes (through each NIC's device/ link, as the kernel lays them out):
    NICs Gen5 x16 on NUMA 0 or 1 by their GPU side, GPUs 0-3 on NUMA 0 and 4-7 on NUMA 1."""
    for dev in sorted((cap / IB).iterdir()):
        d = dev / "device"
        n = int(dev.name.split("_")[1])
        (d / "max_link_speed").write_text("32.0 GT/s PCIe\n")
        (d / "current_link_speed").write_text("32.0 GT/s PCIe\n")
        (d / "max_link_width").write_text("16\n")
        (d / "current_link_width").write_text(f"{nic_width}\n")
        (d / "numa_node").write_text(f"{0 if n < 6 else 1}\n")
    for i, addr in enumerate(_gpu_addrs(cap)):
        d = cap / "sys/bus/pci/devices" / addr
        d.mkdir(parents=True, exist_ok=True)
        numa = (gpu_numa or {}).get(i, 0 if i < 4 else 1)
        (d / "numa_node").write_text(f"{numa}\n")
    return cap


# -- who discovers does not matter ------------------------------------------------------------------------------
def test_an_unreadable_vpd_leaves_the_fingerprint_as_root_computes_it(tmp_path: Path) -> None:
    """dgx-h100's mlx5_12 and mlx5_13 are NVSwitch management ports; only their VPD (root only) says so. Root set
    them aside and left them out of the fingerprint, while a user saw two more InfiniBand NICs: another
    fingerprint for the same node, so a daemon run as a user served none of root's profiles."""
    root = discover(_copy(tmp_path, as_="root"))
    user = discover(_as_user(_copy(tmp_path, as_="user")))
    assert [e.name for e in root.excluded_nics] == ["mlx5_12", "mlx5_13"]
    assert user.excluded_nics == [] and {"mlx5_12", "mlx5_13"} <= {n.name for n in user.nics}
    assert "vpd" in user.tools  # the user's view says why it cannot tell the management ports
    assert user.hardware_hash == root.hardware_hash
    assert user.fingerprint == root.fingerprint


def test_the_management_ports_still_count_in_both_views(tmp_path: Path) -> None:
    """Kept in the fingerprint, a management port is not ignored: a change to one (its link down) is a change
    for root and for the user alike, and diff_facts names it; root still keeps it out of the transports."""
    root_cap, user_cap = _copy(tmp_path, as_="root"), _as_user(_copy(tmp_path, as_="user"))
    base = discover(root_cap)
    root_down = F.set_port_state(root_cap, "1: DOWN", dev="mlx5_12")
    user_down = F.set_port_state(user_cap, "1: DOWN", dev="mlx5_12")
    assert root_down.fingerprint == user_down.fingerprint != base.fingerprint
    assert "mlx5_12 port 1 ACTIVE → DOWN" in diff_facts(base.to_dict(), root_down.to_dict())
    assert "mlx5_12" not in {n.name for n in root_down.nics}


@pytest.mark.parametrize("field", ["pcie_gen/max_link_gen", "link_widths/current_link_width"])
def test_a_field_the_driver_withholds_is_unknown_and_no_change(tmp_path: Path, field: str) -> None:
    """A fingerprinted nvidia-smi field printed as '[Insufficient Permissions]' for this user: discovery does not
    fail on it, the field is unknown, and the facts are incomplete, which the daemon never takes for a change
    (it keeps the fabric it knows rather than mark root's profiles stale)."""
    cap = _copy(tmp_path)
    xml = cap / "commands" / XML_KEY
    tag = field.rsplit("/", 1)[1]
    text = xml.read_text()
    first = text.index(f"<{tag}>")
    end = text.index(f"</{tag}>", first)
    xml.write_text(text[: first + len(tag) + 2] + "[Insufficient Permissions]" + text[end:])
    m = json.loads((cap / "manifest.json").read_text())
    m.get("files", {}).pop(f"commands/{XML_KEY}", None)
    (cap / "manifest.json").write_text(json.dumps(m))
    f = discover(cap)
    key = "pcie_gen_max" if "gen" in field else "pcie_width_current"
    assert getattr(f.gpus[0], key) is None and getattr(f.gpus[1], key) is not None
    assert not f.complete and "insufficient permissions" in f.warnings[0]


# -- NIC PCIe link and NUMA locality ------------------------------------------------------------------------------
def test_a_nic_trained_at_x8_is_a_fabric_change(tmp_path: Path) -> None:
    base = discover(_with_pci_sysfs(_copy(tmp_path, as_="a")))
    narrow = discover(_with_pci_sysfs(_copy(tmp_path, as_="b"), nic_width=8))
    assert {(n.pcie_gen_max, n.pcie_width_max, n.pcie_width_current) for n in base.nics} == {(5, 16, 16)}
    assert narrow.fingerprint != base.fingerprint
    assert "mlx5_0 PCIe width x16 → x8" in diff_facts(base.to_dict(), narrow.to_dict())


def test_a_nic_with_a_lower_max_generation_is_a_fabric_change(tmp_path: Path) -> None:
    cap = _with_pci_sysfs(_copy(tmp_path))
    base = discover(cap)
    (cap / IB / "mlx5_3/device/max_link_speed").write_text("16.0 GT/s PCIe\n")
    gen4 = discover(cap)
    assert gen4.fingerprint != base.fingerprint
    assert diff_facts(base.to_dict(), gen4.to_dict()) == ["mlx5_3 PCIe max generation Gen5 → Gen4"]


def test_the_current_link_speed_is_not_fingerprinted(tmp_path: Path) -> None:
    """The current PCIe speed drops with link power management: no fabric change."""
    cap = _with_pci_sysfs(_copy(tmp_path))
    base = discover(cap)
    for dev in (cap / IB).iterdir():
        (dev / "device/current_link_speed").write_text("2.5 GT/s PCIe\n")
    assert discover(cap).fingerprint == base.fingerprint


def test_a_device_on_another_numa_node_is_a_fabric_change(tmp_path: Path) -> None:
    cap = _with_pci_sysfs(_copy(tmp_path))
    base = discover(cap)
    assert [g.numa_node for g in base.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    (cap / IB / "mlx5_0/device/numa_node").write_text("1\n")
    nic_moved = discover(cap)
    assert nic_moved.fingerprint != base.fingerprint
    assert diff_facts(base.to_dict(), nic_moved.to_dict()) == ["mlx5_0 NUMA node 0 → 1"]
    gpu_moved = discover(_with_pci_sysfs(_copy(tmp_path, as_="g"), gpu_numa={2: 1}))
    assert gpu_moved.fingerprint != base.fingerprint
    assert diff_facts(base.to_dict(), gpu_moved.to_dict()) == ["GPU 2 NUMA node 0 → 1"]


def test_absent_pci_attributes_are_unknown_the_same_way(tmp_path: Path) -> None:
    """No /sys/bus/pci (a container without it, a capture from before): every such fact is None, for every device,
    the same on each discovery; and unknown is not taken for a known value."""
    f = discover(F.CAPTURES / "dgx-h100")
    assert {g.numa_node for g in f.gpus} == {None}
    assert {(n.pcie_gen_max, n.pcie_width_max, n.pcie_width_current, n.numa_node) for n in f.nics} == {(None,) * 4}
    assert discover(F.CAPTURES / "dgx-h100").fingerprint == f.fingerprint
    assert discover(_with_pci_sysfs(_copy(tmp_path))).fingerprint != f.fingerprint


def test_numa_node_minus_one_is_kept_apart_from_unknown(tmp_path: Path) -> None:
    """-1 is the kernel saying the device has no NUMA affinity: a fact, not 'could not read'."""
    cap = _with_pci_sysfs(_copy(tmp_path))
    for d in (cap / "sys/bus/pci/devices").iterdir():
        (d / "numa_node").write_text("-1\n")
    f = discover(cap)
    assert {g.numa_node for g in f.gpus} == {-1}
    for d in (cap / "sys/bus/pci/devices").iterdir():
        (d / "numa_node").unlink()
    assert discover(cap).fingerprint != f.fingerprint


def test_a_garbled_pci_attribute_names_its_file(tmp_path: Path) -> None:
    from moetune.tuner.fabric.errors import CaptureError

    cap = _with_pci_sysfs(_copy(tmp_path))
    (cap / IB / "mlx5_0/device/current_link_width").write_text("sixteen\n")
    with pytest.raises(CaptureError, match="mlx5_0/device/current_link_width"):
        discover(cap)


# -- the upgrade that adds these facts --------------------------------------------------------------------------
def _as_older_moetune_recorded(d: dict) -> dict:
    old = json.loads(json.dumps(d))
    for g in old["gpus"]:
        g.pop("numa_node", None)
    for n in old["nics"]:
        for k in ("pcie_gen_max", "pcie_width_max", "pcie_width_current", "numa_node"):
            n.pop(k, None)
    for e in old["excluded_nics"]:
        e.pop("nic", None)
    return old


def test_the_upgrade_says_why_the_fingerprint_moved(tmp_path: Path) -> None:
    """Facts an older moetune stored lack the new ones: the daemon's reason for the fabric change (and the stale
    mark of the profiles) says that they are now fingerprinted, not that the NUMA node went from unknown to 0."""
    from moetune.tuner.fabric.change import default_diff

    new = discover(_with_pci_sysfs(_copy(tmp_path))).to_dict()
    reasons = default_diff(_as_older_moetune_recorded(new), new)
    assert reasons == ["GPU NUMA nodes, NIC PCIe links and NUMA nodes, NVSwitch management ports not in the facts an "
                       "older moetune recorded: now fingerprinted (moetune upgraded)"]


# -- the daemon: a user's discovery after root's bring-up; the upgrade -------------------------------------------
def _daemon(tmp_path: Path, facts) -> tuple:
    from moetune.tuner.daemon.server import Daemon

    store = F.open_store(tmp_path / "moetune.db")
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=lambda: facts,
               retune_job=F.fake_retune, rediscover_interval_s=3600).start(background=True)
    return d, store


def test_a_daemon_run_as_a_user_serves_what_root_profiled(tmp_path: Path) -> None:
    """Bring-up as root recorded the fabric and its profiles; the daemon, restarted as a user who cannot read the
    VPD, finds the same fabric: no change, nothing stale, the profiles served."""
    root = discover(_copy(tmp_path, as_="root"))
    F.seed_profiles(F.open_store(tmp_path / "moetune.db"), root)
    d, store = _daemon(tmp_path, root)
    d.stop()
    user = discover(_as_user(_copy(tmp_path, as_="user")))
    d, store = _daemon(tmp_path, user)
    try:
        assert d.facts.fingerprint == root.fingerprint
        assert store.count_profiles("stale") == 0 and store.count_profiles("current") == 3
        assert not [e for e in store.list_events(limit=50) if e["kind"] == "fabric_changed"]
    finally:
        d.stop()


def test_the_upgrade_marks_the_profiles_stale_with_its_reason(tmp_path: Path) -> None:
    """The fabric an older moetune recorded (its fingerprint, its facts without the new ones) and its profiles: the
    upgraded daemon's first discovery is a fabric change that says it comes from the upgrade, marks those profiles
    stale with that reason and queues their re-tune; none is orphaned silently."""
    import types

    new = discover(_with_pci_sysfs(_copy(tmp_path)))
    old_fp = "0123456789abcdef"
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, types.SimpleNamespace(fingerprint=old_fp, software_hash=new.software_hash))
    old = _as_older_moetune_recorded(new.to_dict())
    store.upsert_fingerprint(old_fp, old, origin="local")
    store.add_event(kind="fabric_seen", reason="first discovery",
                    details={"fingerprint": old_fp, "identity": new.identity_hash, "facts": old})
    d, store = _daemon(tmp_path, new)
    try:
        changed = [e for e in store.list_events(limit=50) if e["kind"] == "fabric_changed"]
        assert len(changed) == 1 and "now fingerprinted (moetune upgraded)" in changed[0]["reason"]
        assert changed[0]["details"]["old_fingerprint"] == old_fp
        assert store.count_profiles("stale") == 3  # the older fabric's three; a re-tune may already have written new ones
        assert all(rec.key.fingerprint != old_fp for _id, rec in store.list_profiles(status="current"))
        stale = [e for e in store.list_events(limit=50) if e["kind"] == "stale"]
        assert len(stale) == 1 and "now fingerprinted (moetune upgraded)" in stale[0]["reason"]
    finally:
        d.stop()
