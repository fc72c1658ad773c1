"""bench/gpu_runtime.py is known to run: its CPU dry run (gloo, tiny shapes) writes valid JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_gpu_script_cpu_dry_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_runtime.py"), "--cpu", "--out", str(tmp_path), "--models", "qwen3-30b",
         "--tokens", "16", "--fabrics", "nvlink", "--iters", "2", "--warmup", "0", "--collective-timeout", "30",
         "--profile", "nvlink:qwen3-30b:16:fp8_d2"],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "runtime_results.jsonl").read_text().splitlines()]
    timed = {r["variant"]: r for r in rows if r["kind"] == "time"}
    assert set(timed) == {"plain", "packed", "packed_a2a", "fp8_d1", "fp8_d2", "fp8_d4"}
    assert timed["packed_a2a"]["layout"] == "packed" and timed["packed"]["layout"] == "dense"
    prof = (tmp_path / timed["fp8_d2"]["profile_file"]).read_text()
    assert "moetune_roundtrip" in prof and "cpu_time_total" in prof
    for r in timed.values():
        assert "error" not in r, r
        for f in ("date", "hardware", "torch", "command", "fabric", "model", "S", "dispatch_us", "combine_us",
                  "total_us", "total_p10", "total_p90"):
            assert f in r, f
        assert r["total_p10"] <= r["total_us"] <= r["total_p90"]
        assert r["roundtrip_ok"], r
    verify = [r for r in rows if r["kind"] == "verify"]
    assert len(verify) == 2 and all(r["verify_ok"] for r in verify)
    assert "issue checks" in proc.stdout
