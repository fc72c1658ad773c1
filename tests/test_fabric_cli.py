"""`moetune fabric show | capture | diff` and live discovery on this (CPU-only) machine."""

from __future__ import annotations

import json
import pathlib
import shutil
import time

import pytest
from typer.testing import CliRunner

from moetune.tuner.fabric.discovery import discover
from moetune.tuner.fabric.sources import LiveSource

CAPTURES = pathlib.Path(__file__).resolve().parent / "captures"
runner = CliRunner()


def invoke(*args: str):
    from moetune.tuner.cli import app

    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    ("name", "families"),
    [
        ("dgx-h100", {"nvlink", "proxy:ibrc", "ibgda", "host_staged", "collective"}),
        ("perlmutter", {"nvlink", "proxy:libfabric/cxi", "host_staged", "collective"}),
        ("rtx4090x4", {"host_staged", "collective"}),
        ("aws-p5", {"nvlink", "proxy:libfabric/efa", "host_staged", "collective"}),
        ("cpu-laptop", {"collective"}),
    ],
)
def test_show_json_from_capture(name: str, families: set[str]) -> None:
    res = invoke("fabric", "show", "--from", str(CAPTURES / name), "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert {t["name"] for t in d["transports"]} == families
    assert all(t["reason"] for t in d["transports"])
    assert d["fingerprint"] == discover(CAPTURES / name).fingerprint
    assert {"hardware_hash", "software_hash", "gpu_count", "gpu_model", "gpus", "nics", "software"} <= set(d)


def test_show_table_from_capture() -> None:
    res = invoke("fabric", "show", "--from", str(CAPTURES / "dgx-h100"))
    assert res.exit_code == 0, res.output
    for words in ("NVIDIA H100 80GB HBM3", "mlx5_11", "ignored mlx5_12", "ibgda", "proxy:ibrc", "nvidia_peermem"):
        assert words in res.output


def test_diff_between_captures(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(CAPTURES / "dgx-h100", root)
    (root / "sys/class/infiniband/mlx5_3/ports/1/state").write_text("1: DOWN\n")
    res = invoke("fabric", "diff", "--against", str(CAPTURES / "dgx-h100"), "--from", str(root))
    assert res.exit_code == 1, res.output
    assert "mlx5_3 port 1 ACTIVE → DOWN" in res.output
    res = invoke("fabric", "diff", "--against", str(CAPTURES / "dgx-h100"), "--from", str(root), "--json")
    d = json.loads(res.stdout)
    assert d["changed"] is True and "mlx5_3 port 1 ACTIVE → DOWN" in d["reasons"]
    same = invoke("fabric", "diff", "--against", str(CAPTURES / "dgx-h100"), "--from", str(CAPTURES / "dgx-h100"))
    assert same.exit_code == 0 and "unchanged" in same.output


def test_diff_against_bad_value(tmp_path: pathlib.Path) -> None:
    res = invoke("fabric", "diff", "--against", "not/a/dir/or/hash", "--from", str(CAPTURES / "cpu-laptop"))
    assert res.exit_code == 2 and "neither a capture directory nor a fingerprint hash" in res.output


def test_diff_against_hash_is_clear_without_traceback(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With or without the store, an unknown hash is a clean error (exit 2), never a traceback."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    res = invoke("fabric", "diff", "--against", "0123456789abcdef", "--from", str(CAPTURES / "cpu-laptop"))
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and "Traceback" not in res.output


def test_diff_against_stored_fingerprint(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    res = invoke("fabric", "show", "--from", str(CAPTURES / "dgx-h100"), "--record", "--json")
    assert res.exit_code == 0, res.output
    fp = json.loads(res.stdout)["fingerprint"]
    root = tmp_path / "c"
    shutil.copytree(CAPTURES / "dgx-h100", root)
    (root / "proc/modules").write_text((root / "proc/modules").read_text().replace("nvidia_peermem", "nvidia_peerxxx"))
    res = invoke("fabric", "diff", "--against", fp[:8], "--from", str(root))
    assert res.exit_code == 1, res.output
    assert "nvidia_peermem unloaded" in res.output
    res = invoke("fabric", "diff", "--from", str(CAPTURES / "dgx-h100"))  # default: last stored
    assert res.exit_code == 0, res.output


def test_capture_cli_and_read_back(tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "node"
    res = invoke("fabric", "capture", str(dest), "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["fingerprint"] == discover(dest).fingerprint == discover().fingerprint
    assert (dest / "manifest.json").exists() and (dest / "proc").is_dir()
    again = invoke("fabric", "capture", str(dest))
    assert again.exit_code == 2 and "not an empty directory" in again.output


@pytest.mark.parametrize("cmd", [("fabric", "capture", ""), ("keys", "generate", ""), ("keys", "allow", "", "srv")])
def test_an_empty_path_argument_is_refused_by_name(cmd: tuple[str, ...], tmp_path: pathlib.Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`fabric capture ""` said ".: already exists and is not an empty directory" (read as a Path, "" is the
    current folder); every path argument refuses "" naming itself (tuner/cli/_args.py path_arg)."""
    monkeypatch.chdir(tmp_path)
    from moetune.tuner.cli import app

    res = runner.invoke(app, list(cmd), env={"COLUMNS": "200"})
    said = " ".join(res.output.replace("│", " ").split())
    name = {"capture": "dest", "generate": "directory", "allow": "public_file"}[cmd[1]]
    assert res.exit_code == 2 and f"Invalid value for '{name}': an empty path names no file or folder" in said, said
    assert list(tmp_path.iterdir()) == []


def test_live_discovery_is_fast() -> None:
    t0 = time.perf_counter()
    f = discover()
    dt = time.perf_counter() - t0
    print(f"live discovery: {dt:.3f} s ({f.gpu_count} GPUs, {len(f.nics)} NICs)")
    assert dt < 5.0  # measured ~0.03 s on the CPU-only dev box; the issue asks < 2 s
    assert "collective" in f.transport_names
    assert discover().fingerprint == f.fingerprint


def test_live_command_timeout_and_missing_tool() -> None:
    src = LiveSource(timeout_s=0.3)
    t0 = time.perf_counter()
    res = src.run(("sleep", "5"))
    assert res.status == "timeout" and time.perf_counter() - t0 < 2.0
    assert src.run(("moetune-no-such-tool-xyz", "-l")).status == "missing"
    ok = src.run(("echo", "hi"))
    assert ok.status == "ok" and ok.stdout.strip() == "hi"
    bad = src.run(("false",))
    assert bad.status == "failed" and bad.rc == 1 and bad.describe == "failed (rc 1)"
    src.close()


def test_live_prefetch_runs_in_parallel() -> None:
    src = LiveSource(timeout_s=5.0)
    # ~1 s each: one after another they take 4 s, together ~1 s; the bound of 2.5 s tells the two apart with room
    # for a loaded CI box (2 pytest-xdist workers on 2 cores) of 1.5 s rather than 0.8 s
    cmds = [("sleep", "1.0"), ("sleep", "1.01"), ("sleep", "1.02"), ("sleep", "1.03")]
    t0 = time.perf_counter()
    src.prefetch(cmds)
    assert all(src.run(c).ok for c in cmds)
    assert time.perf_counter() - t0 < 2.5
    src.close()


def test_nvml_hang_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.tuner.fabric.sources as s  # LiveSource.gpu_api looks _nvml_facts up there

    monkeypatch.setattr(s, "_nvml_facts", lambda: time.sleep(3) or None)
    monkeypatch.setattr(s.shutil, "which", lambda name: None)
    t0 = time.perf_counter()
    api = s.LiveSource(timeout_s=0.3).gpu_api()
    assert time.perf_counter() - t0 < 1.5
    assert api == {"api": "nvml", "gpus": [], "status": "timeout"}


@pytest.mark.parametrize("opt", ["--db", "--config"])
def test_show_refuses_a_database_option_without_record(tmp_path: pathlib.Path, opt: str) -> None:
    """`fabric show --db X` without --record was accepted and opened nothing: exit 2, naming the option."""
    path = tmp_path / "x.db"
    r = invoke("fabric", "show", "--capture", str(CAPTURES / "h200x1"), opt, str(path))
    assert r.exit_code == 2, r.output
    flat = " ".join(r.output.split())
    assert f"{opt}: names the database --record writes to" in flat and "Traceback" not in flat
    assert not path.exists()


def test_diff_of_a_gpu_swapped_for_the_same_model_is_a_change(tmp_path: pathlib.Path) -> None:
    """Same fingerprint, another physical GPU: the daemon marks the profiles measured on the old part stale and
    re-tunes (fabric.change.same_hardware); diff said "(not performance-relevant) GPU 0 replaced" and exit 0."""
    root = tmp_path / "c"
    shutil.copytree(CAPTURES / "h200x1", root)
    smi = root / "commands" / "nvidia-smi_-q_-x"
    smi.write_text(smi.read_text().replace("<serial>1652826069623</serial>", "<serial>1652826069999</serial>"))
    res = invoke("fabric", "diff", "--against", str(CAPTURES / "h200x1"), "--from", str(root))
    assert res.exit_code == 1, res.output
    said = " ".join(res.output.split())
    assert "fingerprint unchanged" in said and "but on other GPUs: a change" in said, said
    assert "- GPU 0 replaced: serial 1652826069623 → 1652826069999" in said and "not performance-relevant" not in said
    d = json.loads(invoke("fabric", "diff", "--against", str(CAPTURES / "h200x1"), "--from", str(root), "--json").stdout)
    assert d["changed"] is True and d["fingerprint_changed"] is False and d["old"] == d["new"]
    assert d["gpus_replaced"] == ["GPU 0 replaced: serial 1652826069623 → 1652826069999"]
    same = invoke("fabric", "diff", "--against", str(CAPTURES / "h200x1"), "--from", str(CAPTURES / "h200x1"), "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["gpus_replaced"] == []


def test_diff_of_the_live_node_compares_with_its_own_facts_not_a_newer_capture(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default base was the store's newest fingerprint with facts, whoever's: after `fabric show --from CAPTURE
    --record` (another node's facts) a diff of this unchanged node said "changed" (exit 1)."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    other = invoke("fabric", "show", "--from", str(CAPTURES / "dgx-h100"), "--record")
    assert other.exit_code == 0, other.output
    alone = invoke("fabric", "diff")
    assert alone.exit_code == 2, alone.output
    said = " ".join(alone.output.split())
    assert "no discovered fingerprint of this node yet (only 1 of other nodes or captures" in said, said
    assert invoke("fabric", "show", "--record").exit_code == 0  # this node's own facts
    time.sleep(0.01)
    assert invoke("fabric", "show", "--from", str(CAPTURES / "dgx-h100"), "--record").exit_code == 0  # newer again
    res = invoke("fabric", "diff", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["changed"] is False
    # a capture is still compared with the newest facts of any origin
    assert invoke("fabric", "diff", "--from", str(CAPTURES / "dgx-h100")).exit_code == 0


@pytest.mark.parametrize("opt", ["--db", "--config"])
def test_diff_against_capture_refuses_db_and_config(tmp_path: pathlib.Path, opt: str) -> None:
    """--against DIR reads no database: --db/--config were taken and ignored (as `fabric show` without --record
    refuses them), so a user comparing with a database's fingerprint got the capture's diff, exit 0 or 1."""
    given = tmp_path / ("other.db" if opt == "--db" else "other.toml")
    res = invoke("fabric", "diff", "--against", str(CAPTURES / "cpu-laptop"), "--from", str(CAPTURES / "cpu-laptop"),
                 opt, str(given))
    assert res.exit_code == 2, res.output
    assert opt in res.output and "--against" in res.output and "Traceback" not in res.output
