"""The fingerprint and software key as the daemon and the runtime use them: a discovery that could not read
everything is no fabric change; the runtime reads the driver version of every kernel-module flavour."""

from __future__ import annotations

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
    monkeypatch.setattr(node_identity, "_dist_version", lambda name: sw.get(name) if sw.get(name) != "none" else None)
    why, checked = node_identity.mismatch(d, proc)
    assert why is None and "driver" in checked

