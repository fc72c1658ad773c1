"""The runtime on 2 GPUs over NCCL (skipped without them)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from moetune.runtime.testing.launch import launch

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the cases by name
runtime_cases = importlib.import_module("runtime_cases")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_nccl_two_gpus_match_dense_reference() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    res = launch(runtime_cases.case_gpu, 2, backend="nccl", timeout_s=60, join_timeout_s=280)
    for rank_rows in res:
        for name, err, bound in rank_rows:
            assert err < bound, (name, err, bound)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_host_staged_copy_engines_match_the_collective() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    res = launch(runtime_cases.case_gpu_host_staged, 2, backend="nccl", timeout_s=60, join_timeout_s=280,
                 env={"MOETUNE_ONESIDED_TIMEOUT_S": "3", "NCCL_P2P_DISABLE": "1"})
    for rep in res:
        assert all(rep["native"]) and rep["native"], rep["native"]
        assert rep["mismatch"] == [], rep["mismatch"]
        assert rep["pieces_ok"] and rep["ring"] == 3, rep["ring"]
        assert rep["graph"] == [], rep["graph"]
    # rank 0 waits for data from rank 1 (or, its sends having filled the ring, for rank 1 to drain a slot);
    # with cuStreamWaitValue64 waits (the default) the watchdog times it, with spin kernels the kernel
    for key in ("timeout", "timeout_kernel"):
        assert "timeout waiting for a" in res[0][key], (key, res[0][key], res[0]["flags"], res[1]["flags"])
        assert "(peer 1)" in res[0][key]


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_a_cuda_index_past_the_devices_is_named_before_anything_is_allocated() -> None:
    """EPBuffer / MoELayer on cuda:N where this process sees N GPUs: a ValueError naming the device, not "CUDA error:
    invalid device ordinal" from the first allocation (the CPU tests stand a device count in for this)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moetune.runtime import EPBuffer, Knobs, MoELayer, get_model

    n = torch.cuda.device_count()
    model = get_model("custom:128,64,8,2,bfloat16")
    with pytest.raises(ValueError, match=rf"EPBuffer: device cuda:{n}: this process sees {n} CUDA device"):
        EPBuffer(None, Knobs(), model=model, max_tokens=8, device=f"cuda:{n}")
    with pytest.raises(ValueError, match=rf"MoELayer: device cuda:{n}: this process sees {n} CUDA device"):
        MoELayer(model, None, Knobs(), max_tokens=8, device=f"cuda:{n}", engine="unfused")
    buf = EPBuffer(None, Knobs(), model=model, max_tokens=8, device="cuda:0")
    assert buf.device == torch.device("cuda", 0)
    buf.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_grouped_mm_forced_on_a_gpu_runs_or_is_refused_at_construction() -> None:
    """MoELayer(use_grouped_mm=True) in each activation dtype on a GPU: where torch._grouped_mm runs there it matches
    the per-expert loop; where it does not (fp32 or fp16 with a grouped kernel that takes bf16 only), construction
    raises ValueError naming use_grouped_mm instead of the first forward failing inside the grouped GEMM."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moetune.runtime import Knobs, MoELayer, get_model
    from moetune.runtime.moe_layer import grouped_mm_usable, max_rel_err

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        model = get_model("custom:128,64,8,2,float32")
        args = dict(max_tokens=64, device="cuda:0", dtype=dtype, engine="unfused", seed=3)
        x = torch.randn(40, 128, device="cuda:0").to(dtype)
        loop = MoELayer(model, None, Knobs(), use_grouped_mm=False, **args)
        if grouped_mm_usable("cuda", 0, dtype, 128, 64):
            grouped = MoELayer(model, None, Knobs(), use_grouped_mm=True, **args)
            assert max_rel_err(grouped(x), loop(x)) < 3e-2, dtype
            grouped.close()
        else:
            with pytest.raises(ValueError, match=r"use_grouped_mm=True, but torch\._grouped_mm does not run"):
                MoELayer(model, None, Knobs(), use_grouped_mm=True, **args)
        loop.close()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_host_staged_dense_ranks_on_other_buffers_raise_at_once() -> None:
    """The dense layout's status (with each rank's max_tokens) went through the transport's gather: on host_staged's
    copy-engine path that moves between one buffer's staging rings only, so a rank dispatching on the decode buffer
    and one on the prefill buffer each waited for a peer that never posted (the watchdog's timeout, then the
    uninitialised status read as codes, the rings out of step). Over the EP group they meet: a ValueError naming
    them on every rank at once, and the decode buffer still runs."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    res = launch(runtime_cases.case_gpu_host_staged_other_buffers, 2, backend="nccl", timeout_s=60,
                 join_timeout_s=280, env={"MOETUNE_ONESIDED_TIMEOUT_S": "10", "NCCL_P2P_DISABLE": "1"})
    for rank, rep in enumerate(res):
        assert rep["native"], rep  # the copy-engine path (the NCCL fallback's gather is on the EP group anyway)
        kind, msg, seconds = rep["step"]
        assert kind == "ValueError" and "(max_tokens [32, 16], by rank)" in msg, (rank, rep)
        assert seconds < 5, (rank, rep)
        assert rep["after"] == [8, 64], (rank, rep)
