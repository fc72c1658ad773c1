"""Truncated or garbled captures give a clear error naming the file, never a traceback."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.fabric.capture import capture_node
from moetune.tuner.fabric.discovery import discover
from moetune.tuner.fabric.errors import CaptureError, DiscoveryError
from moetune.tuner.fabric.sources import CaptureSource

CAPTURES = pathlib.Path(__file__).resolve().parent / "captures"
XML = "commands/nvidia-smi_-q_-x"
IB = "sys/class/infiniband"


def copy(name: str, tmp: pathlib.Path) -> pathlib.Path:
    dest = tmp / name
    shutil.copytree(CAPTURES / name, dest)
    return dest


def truncate_half(p: pathlib.Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


BAD: list[tuple[str, str, str, object, str]] = [
    # id, capture, file, new content (str | callable), expected words in the message
    ("xml_truncated", "dgx-h100", XML, truncate_half, "not valid XML"),
    ("xml_garbage", "dgx-h100", XML, "\x00\x01garbage<<<", "not valid XML"),
    ("xml_empty", "dgx-h100", XML, "", "empty file"),
    ("xml_wrong_root", "dgx-h100", XML, "<?xml version='1.0'?><html></html>", "expected <nvidia_smi_log>"),
    ("xml_entities", "dgx-h100", XML, '<!DOCTYPE x [<!ENTITY a "aaaa">]><nvidia_smi_log/>', "entity"),
    ("xml_bad_memory", "dgx-h100", XML, lambda s: s.replace("<total>81559 MiB</total>", "<total>lots</total>", 1),
     "memory total"),
    ("xml_bad_width", "dgx-h100", XML,
     lambda s: s.replace("<current_link_width>16x</current_link_width>", "<current_link_width>wide</current_link_width>", 1),
     "PCIe width"),
    ("rate_garbage", "dgx-h100", f"{IB}/mlx5_0/ports/1/rate", "fast as heck\n", "cannot read link rate"),
    ("rate_empty", "dgx-h100", f"{IB}/mlx5_3/ports/1/rate", "", "cannot read link rate"),
    ("state_garbage", "dgx-h100", f"{IB}/mlx5_4/ports/1/state", "maybe\n", "cannot read port state"),
    ("link_layer_empty", "dgx-h100", f"{IB}/mlx5_5/ports/1/link_layer", "", "cannot read link layer"),
    ("topo_empty", "dgx-h100", "commands/nvidia-smi_topo_-m", "", "empty file"),
    ("topo_truncated", "dgx-h100", "commands/nvidia-smi_topo_-m", lambda s: s[: s.index("\nGPU3\t")] + "\nGPU3\tNV18\n",
     "truncated"),
    ("topo_garbage_entry", "perlmutter", "commands/nvidia-smi_topo_-m", lambda s: s.replace("NV4", "N@4", 1),
     "unknown entry"),
    ("topo_header_cut", "dgx-h100", "commands/nvidia-smi_topo_-m", lambda s: s[: s.index("\tGPU4")] + "\n", "lists 4 GPUs"),
    ("topo_gpu_count", "perlmutter", "commands/nvidia-smi_topo_-m",
     lambda s: s.replace("\tGPU3", "").replace("GPU3\t", "XGPU3\t"), "unexpected line"),
    ("p2p_garbage", "rtx4090x4", "commands/nvidia-smi_topo_-p2p_r", lambda s: s.replace("CNS", "MAYBE", 1),
     "unknown entry"),
    ("nvlink_garbage", "dgx-h100", "commands/nvidia-smi_nvlink_-s", lambda s: s.replace("26.562 GB/s", "fast", 1),
     "NVLink 0 of GPU 0"),
    ("modules_empty", "dgx-h100", "proc/modules", "", "empty file"),
    ("modules_garbage", "dgx-h100", "proc/modules", "\x7fELF\x02\x01\x01 binary junk\n", "cannot read module line"),
    ("packages_garbage", "dgx-h100", "python/packages.json", "{torch: 2", "not valid JSON"),
    ("packages_shape", "dgx-h100", "python/packages.json", "[1, 2]", "JSON object"),
    ("manifest_garbage", "dgx-h100", "manifest.json", "{", "manifest is not valid JSON"),
    ("fi_info_garbage", "perlmutter", "commands/fi_info_-l", "Segmentation fault\n", "no libfabric provider"),
    ("gpu_api_garbage", "cpu-laptop", "gpu_api.json", '{"api": "nvml", "gpus": [{"name": "X", "memory_mib": "lots"}]}',
     "unexpected GPU entry"),
    ("gpu_api_not_json", "cpu-laptop", "gpu_api.json", "nvml says hi", "not valid JSON"),
    ("slingshot_speed", "perlmutter", "sys/class/cxi/cxi1/device/net/hsn1/speed", "fast\n", "cannot read link speed"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_garbled_file_named(case: tuple, tmp_path: pathlib.Path) -> None:
    _, name, rel, content, words = case
    root = copy(name, tmp_path)
    p = root / rel
    if callable(content):
        if content is truncate_half:
            truncate_half(p)
        else:
            p.write_text(content(p.read_text()))
    else:
        p.write_text(content)
    with pytest.raises(CaptureError) as ei:
        discover(root)
    assert ei.value.path == str(p), ei.value
    assert words in str(ei.value), str(ei.value)
    assert str(p) in str(ei.value)


def test_cli_reports_garbled_capture_without_traceback(tmp_path: pathlib.Path) -> None:
    root = copy("dgx-h100", tmp_path)
    (root / f"{IB}/mlx5_0/ports/1/rate").write_text("garbage\n")
    for args in (["fabric", "show", "--from", str(root)], ["fabric", "show", "--json", "--from", str(root)],
                 ["fabric", "diff", "--against", str(CAPTURES / "dgx-h100"), "--from", str(root)]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, res.output
        assert "Traceback" not in res.output
        assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
        assert "mlx5_0/ports/1/rate" in res.output and "cannot read link rate" in res.output


def test_missing_capture_dir(tmp_path: pathlib.Path) -> None:
    with pytest.raises(CaptureError, match="no such directory"):
        discover(tmp_path / "nope")
    res = CliRunner().invoke(app, ["fabric", "show", "--from", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no such directory" in res.output


def test_truncation_detected_through_manifest_sizes(tmp_path: pathlib.Path) -> None:
    """A capture written by `capture` records file sizes; a file cut short is reported as truncated."""
    out = capture_node(tmp_path / "cap", source=CaptureSource(CAPTURES / "dgx-h100"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"]["proc/modules"] > 0 and manifest["format"] == "moetune-capture/1"
    p = out / "proc/modules"
    lines = p.read_text().splitlines(keepends=True)
    p.write_text("".join(lines[:-3]))  # still parseable, but shorter than recorded
    with pytest.raises(CaptureError, match="truncated") as ei:
        discover(out)
    assert ei.value.path == str(p)


def test_capture_error_is_a_discovery_error() -> None:
    assert issubclass(CaptureError, DiscoveryError)
    e = CaptureError("/x/y", "bad")
    assert str(e) == "/x/y: bad" and e.path == "/x/y"


@pytest.mark.parametrize("which", ["all", "topo"])
def test_a_command_output_the_manifest_records_but_the_capture_lacks_is_named(tmp_path: pathlib.Path,
                                                                               which: str) -> None:
    """The manifest says `status: ok` but commands/ lost the file: a CaptureError names the missing file. Read as
    "tool missing", a copy of an 8-GPU capture with an empty commands/ would give a node of 0 GPUs (another
    fingerprint), rc 0. A command recorded as missing, failed or timed out still reads as such."""
    root = copy("dgx-h100", tmp_path)
    lost = sorted((root / "commands").iterdir()) if which == "all" else [root / "commands/nvidia-smi_topo_-m"]
    for p in lost:
        p.unlink()
    with pytest.raises(CaptureError, match="manifest records this command's output") as ei:
        discover(root)
    assert ei.value.path in {str(p) for p in lost}
    res = CliRunner().invoke(app, ["fabric", "show", "--from", str(root)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "0 GPUs" not in res.output
    assert "is not in the capture" in " ".join(res.output.split())
    assert discover(CAPTURES / "dgx-h100").gpu_count == 8  # fi_info: recorded missing, no file: still fine
