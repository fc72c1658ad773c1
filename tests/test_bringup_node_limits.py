"""`moetune profile` says what the node cannot do and what discovery could not read: the transport families the node
lacks, each with why (PCIe-only GPUs: no NVLink; no ACTIVE InfiniBand port; no GPUDirect RDMA), in its output, its
--json and its report; and a capture with a file missing is refused naming it (a file its manifest records) or
warned of (a hand-made capture without proc/modules), never read as a node without GPUDirect RDMA in silence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.fabric.discovery import discover

pytestmark = pytest.mark.timeout(120)
CAPTURES = Path(__file__).resolve().parent / "captures"


def _profile(tmp_path: Path, capture: Path, *extra: str):  # type: ignore[no-untyped-def]
    # a capture of another node (this machine is none of them): discovery, plan and report, nothing measured
    return CliRunner().invoke(app, ["profile", "--quick", "--capture", str(capture), "--db",
                                    str(tmp_path / "home" / "moetune.db"), *extra], env={"COLUMNS": "300"})


def test_a_pcie_only_node_says_it_has_no_nvlink_and_no_nic_in_output_json_and_report(tmp_path: Path) -> None:
    r = _profile(tmp_path, CAPTURES / "rtx4090x4")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "not available here (not tuned): nvlink: no NVLink between GPUs" in said, said
    assert "proxy:ibrc: no ACTIVE InfiniBand/RoCE port" in said, said
    report = next((tmp_path / "home").glob("report-*/report.md")).read_text()
    assert "## Transports not available on this node (not tuned)" in report, report
    assert "| `nvlink` | no NVLink between GPUs (topology SYS/PHB, P2P CNS) |" in report, report

    r = _profile(tmp_path, CAPTURES / "rtx4090x4", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {u["family"] for u in out["unavailable"]} == {"nvlink", "proxy:ibrc", "ibgda"}, out["unavailable"]
    assert out["discovery_warnings"] == []


def test_a_one_gpu_node_says_why_no_exchange_runs(tmp_path: Path) -> None:
    r = _profile(tmp_path, CAPTURES / "h200x1", "--json")
    assert r.exit_code == 0, r.output
    why = {u["family"]: u["why"] for u in json.loads(r.stdout)["unavailable"]}
    assert why["nvlink"] == "1 GPU: no peer GPU on this node" and "host_staged" in why, why


def test_a_capture_without_a_file_its_manifest_records_is_refused_naming_it(tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    shutil.copytree(CAPTURES / "h200x2", cap)
    (cap / "proc" / "modules").unlink()  # not to be read as "nvidia_peermem not loaded": another fingerprint, no word
    r = _profile(tmp_path, cap)
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"{cap / 'proc' / 'modules'}: missing: the manifest records this file" in said, said
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_a_hand_made_capture_without_proc_modules_warns_naming_it(tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    shutil.copytree(CAPTURES / "dgx-h100", cap)  # hand-made: its manifest records no file sizes
    (cap / "proc" / "modules").unlink()
    facts = discover(cap)
    assert not facts.complete and any(str(cap / "proc" / "modules") in w for w in facts.warnings), facts.warnings
    r = _profile(tmp_path, cap)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert f"warning: discovery: {cap / 'proc' / 'modules'} was not read (missing)" in said, said
    assert "ibgda: mlx5 ports ACTIVE but no GPUDirect RDMA" in said, said
    report = next((tmp_path / "home").glob("report-*/report.md")).read_text()
    assert "## Discovery warnings" in report and "proc/modules was not read" in report, report


def test_a_capture_without_the_driver_version_warns_instead_of_dropping_dma_buf_in_silence(tmp_path: Path) -> None:
    cap = tmp_path / "cap"
    shutil.copytree(CAPTURES / "aws-p5", cap)  # EFA with GPUDirect RDMA through dma-buf (the open kernel module)
    (cap / "proc" / "driver" / "nvidia" / "version").unlink()
    facts = discover(cap)
    assert not facts.complete, "read as a proprietary module (no dma-buf), another fingerprint, with no word"
    (w,) = facts.warnings
    assert w.startswith(f"{cap / 'proc' / 'driver' / 'nvidia' / 'version'} was not read (missing)"), w


def test_a_capture_without_its_package_versions_is_refused_or_warned_of(tmp_path: Path) -> None:
    from moetune.tuner.fabric.errors import CaptureError

    written = tmp_path / "written"
    shutil.copytree(CAPTURES / "h200x2", written)  # written by `moetune fabric capture`: it always has the file
    (written / "python" / "packages.json").unlink()
    with pytest.raises(CaptureError, match=r"packages\.json: missing"):
        discover(written)  # not to be read as a node without torch, NCCL or moetune: another software hash, no word
    hand = tmp_path / "hand"
    shutil.copytree(CAPTURES / "rtx4090x4", hand)
    (hand / "python" / "packages.json").unlink()
    facts = discover(hand)
    assert any("packages.json was not read (missing)" in w for w in facts.warnings), facts.warnings
