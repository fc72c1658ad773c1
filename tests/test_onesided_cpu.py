"""CPU-side checks of the one-sided transports: import, absence reporting, knob validation, nvcc build."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_transports_import_and_report_absence_without_cuda() -> None:
    import torch

    from moetune.runtime.transports.onesided import ONESIDED_TRANSPORTS

    assert set(ONESIDED_TRANSPORTS) == {"nvlink", "proxy"}
    for name, cls in ONESIDED_TRANSPORTS.items():
        assert cls.name == name
        a = cls.availability(None)
        if not torch.cuda.is_available():
            assert not a.ok
            assert "CUDA" in a.reason  # a clear reason, not an exception


def test_csrc_build_module_reports_absence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from moetune.runtime import csrc_build

    monkeypatch.setenv("MOETUNE_NVCC", str(tmp_path / "no-such-nvcc"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(csrc_build.Path, "is_file", lambda self: False)
    assert csrc_build.find_nvcc() is None
    with pytest.raises(csrc_build.BuildError, match="nvcc not found"):
        csrc_build.build()
    ok, why = csrc_build.availability()
    assert not ok and why


def test_cache_key_depends_on_arch_and_compiler() -> None:
    from moetune.runtime import csrc_build

    a = csrc_build.build_key("nvcc 13.0", "sm_90")
    assert a == csrc_build.build_key("nvcc 13.0", "sm_90")
    assert a != csrc_build.build_key("nvcc 13.0", "sm_100")
    assert a != csrc_build.build_key("nvcc 12.8", "sm_90")


def test_arch_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime import csrc_build

    monkeypatch.setenv("MOETUNE_CUDA_ARCH", "90")
    assert csrc_build.cuda_arch() == "sm_90"
    monkeypatch.setenv("MOETUNE_CUDA_ARCH", "sm_100")
    assert csrc_build.cuda_arch() == "sm_100"


def test_knobs_refuse_round_robin_nic_ordered_with_several_qps() -> None:
    from moetune.runtime.knobs import KnobError, Knobs
    from moetune.runtime.transports.proxy import validate_modes

    with pytest.raises(KnobError) as e:
        Knobs(transport="proxy", fence_mode="nic_ordered", qp_mapping="round_robin", qps_per_pe=2)
    assert "qp_mapping" in e.value.knobs
    with pytest.raises(KnobError):
        validate_modes("nic_ordered", "round_robin", 4)
    # the safe neighbours are accepted
    validate_modes("nic_ordered", "peer_hash", 4)
    validate_modes("nic_ordered", "round_robin", 1)
    validate_modes("proxy_drain", "round_robin", 4)


def test_proxy_engine_validates_before_touching_cuda() -> None:
    from moetune.runtime.knobs import KnobError
    from moetune.runtime.transports.proxy import ProxyEngine

    with pytest.raises(KnobError):
        ProxyEngine(0, [0], [0], [0], qps=4, qp_mapping="round_robin", fence_mode="nic_ordered")


def test_request_layout_matches_csrc() -> None:
    from moetune.runtime.transports.proxy import Request

    assert ctypes.sizeof(Request) == 64
    assert Request.seq.offset == 56 and Request.src.offset == 16 and Request.value.offset == 40
    header = (ROOT / "csrc" / "proxy_engine.h").read_text()
    assert "sizeof(MtRequest) == 64" in header


def test_limits_match_csrc() -> None:
    from moetune.runtime.transports import _onesided

    header = (ROOT / "csrc" / "mt_common.h").read_text()
    assert f"#define MT_MAX_WORLD {_onesided.MAX_WORLD}" in header
    assert f"#define MT_MAX_SLOTS {_onesided.MAX_SLOTS}" in header


def test_error_decoding_is_readable() -> None:
    from moetune.runtime.transports._onesided import decode_error

    msg = decode_error([2, 1, 0, 5, 7, 3, 0, 7] + [0] * 8)
    assert "timeout waiting for a data signal" in msg and "rank 1" in msg and "slot 5" in msg


def test_bench_scripts_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    for script in ("bench/proxy_micro.py", "bench/onesided_ep.py"):
        r = subprocess.run([sys.executable, script, "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "dry-run" in r.stdout
    r = subprocess.run(["bash", "-n", "bench/gpu_onesided.sh"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    not any(Path(p).is_file() for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc")) and not os.environ.get("CUDA_HOME"),
    reason="nvcc not installed here",
)
def test_csrc_compiles_with_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime import csrc_build

    if csrc_build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path))
    monkeypatch.setenv("MOETUNE_CUDA_ARCH", "sm_90")
    info = csrc_build.build()
    assert info.built and info.path.exists()
    again = csrc_build.build()
    assert not again.built and again.path == info.path  # cached
    lib = ctypes.CDLL(str(info.path))
    csrc_build._bind(lib)  # every symbol the Python side calls exists
    assert lib.mt_abi_version() == csrc_build.ABI_VERSION
