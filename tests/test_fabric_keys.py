"""The fingerprint and software key as the daemon and the runtime use them: a discovery that could not read
everything is no fabric change; the runtime reads the driver version of every kernel-module flavour; a NIC port that
is not ACTIVE is just "down", whatever sub-state or leftover rate it reports."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles import node_identity
from moetune.tuner.fabric.discovery import discover

pytestmark = pytest.mark.timeout(60)
XML_KEY = "nvidia-smi_-q_-x"


def timed_out_smi(dest: Path, name: str = "dgx-h100") -> Path:
    """A copy of a capture in which `nvidia-smi -q -x` timed out (what a slow or busy driver gives)."""
    shutil.copytree(F.CAPTURES / name, dest)
    (dest / "commands" / XML_KEY).unlink()
    m = json.loads((dest / "manifest.json").read_text())
    m["commands"][XML_KEY] = {"argv": ["nvidia-smi", "-q", "-x"], "status": "timeout", "rc": None}
    m.get("files", {}).pop(f"commands/{XML_KEY}", None)
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest


# -- the daemon: an incomplete discovery is no fabric change -----------------------------------------------
def _daemon(tmp_path: Path, state: dict) -> tuple:
    from moetune.tuner.daemon.server import Daemon

    store = F.open_store(tmp_path / "moetune.db")
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=lambda: state["facts"],
               retune_job=F.fake_retune, rediscover_interval_s=3600).start(background=True)
    return d, store


def test_timed_out_discovery_is_incomplete(tmp_path: Path) -> None:
    f = discover(timed_out_smi(tmp_path / "cap"))
    assert not f.complete and f.gpus == []
    assert f.fingerprint != discover(F.CAPTURES / "dgx-h100").fingerprint


def _seeded_dgx(tmp_path: Path) -> tuple:
    """(the dgx-h100 capture's facts, the daemon's discovery state, the daemon, its store with 3 profiles)."""
    good = discover(F.CAPTURES / "dgx-h100")
    state = {"facts": good}
    F.seed_profiles(F.open_store(tmp_path / "moetune.db"), good)
    d, store = _daemon(tmp_path, state)
    return good, state, d, store


def test_incomplete_rediscovery_keeps_the_profiles(tmp_path: Path) -> None:
    good, state, d, store = _seeded_dgx(tmp_path)
    try:
        assert d.facts.fingerprint == good.fingerprint
        state["facts"] = discover(timed_out_smi(tmp_path / "cap"))  # nvidia-smi did not answer this round
        d.rediscover()
        assert d.facts.fingerprint == good.fingerprint
        assert store.count_profiles("stale") == 0 and store.count_profiles("current") == 3
        assert not [e for e in store.list_events(limit=50) if e["kind"] == "fabric_changed"]
        _when, ok, msg = d._last_discovery
        assert not ok and "incomplete" in msg and "timed out" in msg
        # the next complete round: nothing changed, all is well again
        state["facts"] = good
        d.rediscover()
        assert d._last_discovery[1] and store.count_profiles("stale") == 0
        # a real change is still one
        F.make_capture(tmp_path / "cap2")
        state["facts"] = F.set_port_state(tmp_path / "cap2", "1: DOWN")
        d.rediscover()
        assert d.facts.fingerprint == state["facts"].fingerprint and store.count_profiles("stale") == 3
    finally:
        d.stop()


def test_incomplete_discovery_at_start_keeps_the_profiles(tmp_path: Path) -> None:
    good, state, d, store = _seeded_dgx(tmp_path)
    d.stop()
    state["facts"] = discover(timed_out_smi(tmp_path / "cap"))
    d, store = _daemon(tmp_path, state)
    try:
        assert store.count_profiles("stale") == 0 and store.count_profiles("current") == 3
        assert not d._last_discovery[1] and "incomplete" in d._last_discovery[2]
        state["facts"] = good  # the next round reads everything: the same fabric, served
        d.rediscover()
        assert d.facts.fingerprint == good.fingerprint and store.count_profiles("stale") == 0
    finally:
        d.stop()


# -- the runtime's own reading of the node -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["dgx-h100", "perlmutter", "rtx4090x4", "aws-p5", "h200x2"])
def test_runtime_driver_is_the_discovered_one(name: str) -> None:
    """The open kernel module's /proc/driver/nvidia/version ('Open Kernel Module for x86_64  580.…') too."""
    if not (F.CAPTURES / name).is_dir():
        pytest.skip(f"no {name} capture")
    want = discover(F.CAPTURES / name).software["driver"]
    assert node_identity.local_driver(F.CAPTURES / name / "proc") == want


def test_runtime_accepts_the_recorded_facts_of_an_open_module_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = discover(F.CAPTURES / "aws-p5").to_dict()
    proc = tmp_path / "proc"
    shutil.copytree(F.CAPTURES / "aws-p5" / "proc", proc)
    for g in d["gpus"]:
        info = proc / "driver" / "nvidia" / "gpus" / g["pci_bus_id"].lower()[4:]
        info.mkdir(parents=True)
        (info / "information").write_text(f"Model: \t\t {g['model']}\nGPU UUID: \t {g['uuid']}\n")
    sw = d["software"]
    monkeypatch.setattr(node_identity, "local_package_fact", lambda fact: sw.get(fact) or "none")  # the node's packages
    why, checked = node_identity.mismatch(d, proc)
    assert why is None and "driver" in checked
    # its GPUs matched: a job in a container that sees none of the host's EFA devices is still on this node
    monkeypatch.setattr(node_identity, "SYS_ROOT", tmp_path / "sys")
    why, checked = node_identity.mismatch(d, proc)
    assert why is None and "NICs" not in checked, why


# -- software facts do not depend on what the discovering process imported ----------------------------------
def test_software_is_the_same_whether_torch_was_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without an nvidia-nccl-* distribution (NGC containers, conda, source builds): the daemon
    imports torch for its first local re-tune, and its next discovery must not see another NCCL version
    (a new fingerprint: every profile just tuned would go stale)."""
    import importlib.metadata as md
    import types

    from moetune.tuner.fabric.discovery import _software
    from moetune.tuner.fabric.sources import LiveSource

    def version(name: str) -> str:
        if name == "torch":
            return "2.5.0a0+e000cf0ad9.nv24.10"
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", version)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    src = LiveSource()
    without = _software(src.packages(), {"driver": "550.90.07", "cuda": "12.6"}, "")
    nccl = types.SimpleNamespace(version=lambda: (2, 22, 3))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True, nccl=nccl)))
    with_torch = _software(src.packages(), {"driver": "550.90.07", "cuda": "12.6"}, "")
    assert with_torch == without


# -- which NIC each GPU sits next to ------------------------------------------------------------------------
def test_gpu_nic_locality_is_in_the_fingerprint(tmp_path: Path) -> None:
    """The 400 Gb/s InfiniBand HCA next to GPU 0 (PXB) and a 200 Gb/s storage Ethernet card trade PCIe slots
    (names follow the slots): the same cards, the same set of levels per GPU, but GPU 0's RDMA traffic now
    crosses the CPU's root complex (its InfiniBand NIC is at NODE). A fabric change."""
    from moetune.tuner.fabric.fingerprint import diff_facts

    root = tmp_path / "c"
    shutil.copytree(F.CAPTURES / "dgx-h100", root)
    ib = root / "sys/class/infiniband"
    (ib / "mlx5_0").rename(ib / "_tmp")
    (ib / "mlx5_1").rename(ib / "mlx5_0")
    (ib / "_tmp").rename(ib / "mlx5_1")
    base, moved = discover(F.CAPTURES / "dgx-h100"), discover(root)
    near = {gn.nic for gn in moved.gpu_nic if gn.gpu == 0 and gn.level == "PXB"}
    assert [n.ports[0].link_layer for n in moved.nics if n.name in near] == ["Ethernet"]
    assert moved.fingerprint != base.fingerprint
    assert "mlx5_0 port 1 link layer InfiniBand → Ethernet" in diff_facts(base.to_dict(), moved.to_dict())


def test_a_fingerprint_recomputed_by_an_upgrade_is_explained() -> None:
    """Facts stored with a fingerprint an older moetune computed: the daemon's reason says so, not 'facts changed'."""
    from moetune.tuner.fabric.change import default_diff

    d = discover(F.CAPTURES / "dgx-h100").to_dict()
    assert default_diff(d, json.loads(json.dumps(d))) == ["same facts, fingerprint computed differently (moetune upgraded)"]


# -- a port that is not ACTIVE is just "down" in the fingerprint ------------------------------------------------
def _port_rate(capture: Path, rate: str, dev: str, port: int = 1) -> None:
    (capture / "sys" / "class" / "infiniband" / dev / "ports" / str(port) / "rate").write_text(rate + "\n")


def test_a_port_not_active_is_just_down_in_the_fingerprint(tmp_path: Path) -> None:
    """dgx-h100's mlx5_8 is DOWN and still reports 40 Gb/s. Its sub-state (DOWN, INIT, ARMED, POLLING) and that
    leftover rate went into the fingerprint: a port flapping between them, or its stale rate changing, made every
    profile stale and queued a re-tune with no effect on performance. They are still told by diff_facts, marked."""
    from moetune.tuner.fabric.fingerprint import diff_facts

    cap = tmp_path / "cap"
    base = F.make_capture(cap)
    assert [(p.state, p.rate_gbps) for n in base.nics if n.name == "mlx5_8" for p in n.ports] == [("DOWN", 40.0)]
    for state in ("2: INIT", "3: ARMED", "1: POLLING", "1: DOWN"):
        f = F.set_port_state(cap, state, dev="mlx5_8")
        assert f.fingerprint == base.fingerprint and f.hardware_hash == base.hardware_hash, state
    polling = F.set_port_state(cap, "1: POLLING", dev="mlx5_8")
    assert "mlx5_8 port 1 DOWN → POLLING (not active either way)" in diff_facts(base.to_dict(), polling.to_dict())
    _port_rate(cap, "100 Gb/sec (4X EDR)", "mlx5_8")
    stale = discover(cap)
    assert stale.fingerprint == base.fingerprint
    assert "mlx5_8 port 1 rate 40 → 100 Gb/s (not active either way)" in diff_facts(base.to_dict(), stale.to_dict())

    # an ACTIVE port keeps its rate and state in it: up, and a rate change while up, are fabric changes
    up = F.set_port_state(cap, "4: ACTIVE", dev="mlx5_8")
    assert up.fingerprint != base.fingerprint
    assert "mlx5_8 port 1 POLLING → ACTIVE" in diff_facts(polling.to_dict(), up.to_dict())
    _port_rate(cap, "200 Gb/sec (4X HDR)", "mlx5_8")
    assert discover(cap).fingerprint not in (up.fingerprint, base.fingerprint)


def test_an_active_port_going_down_is_one_change_whatever_state_it_reports(tmp_path: Path) -> None:
    """mlx5_0 (400 Gb/s InfiniBand, ACTIVE) leaves ACTIVE: a fabric change, the same one whether the port then says
    DOWN, INIT or POLLING, and with or without a rate left behind."""
    cap = tmp_path / "cap"
    base = F.make_capture(cap)
    down = F.set_port_state(cap, "1: DOWN", dev="mlx5_0")
    assert down.fingerprint != base.fingerprint
    for state in ("2: INIT", "3: ARMED", "1: POLLING"):
        assert F.set_port_state(cap, state, dev="mlx5_0").fingerprint == down.fingerprint, state
    _port_rate(cap, "10 Gb/sec (4X SDR)", "mlx5_0")
    assert discover(cap).fingerprint == down.fingerprint
    assert F.set_port_state(cap, "4: ACTIVE", dev="mlx5_0").fingerprint not in (base.fingerprint, down.fingerprint)
