"""A copy the proxy engine could not issue (cudaMemcpyAsync failed) must never be signalled as landed: in host
simulation (tests/proxy_sim.py) with an injected copy failure, the sender's call reports the engine's failure and
the receiver's call ends in a reported error (a timeout waiting for the signal) instead of success with the rows
missing."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_sim

ERR_TIMEOUT_SIGNAL = 2
RC_ENGINE_FAILED = 321  # mt_pxy_exchange: the proxy engine failed (host wait)


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = proxy_sim.load(proxy_sim.build(tmp_path_factory.mktemp("mtsim_copy_failure") / "libmtsim.so"))
    yield lib
    lib.mtsim_set_copy_fault(0, 0, 0)


@pytest.mark.parametrize("batch", [1, 8], ids=["one-call-per-put", "batched-puts"])
@pytest.mark.parametrize("coupled", [1, 0], ids=["coupled", "decoupled"])
def test_a_failed_copy_is_not_signalled(lib: ctypes.CDLL, coupled: int, batch: int) -> None:
    """Rank 1's copies (from its send rows) fail. Rank 1's engine records the failure and its call returns the
    engine's error; the engine must then write no signal for those rows, so rank 0 does not take the call as done:
    its wait for rank 1's signal times out and is reported. (A signal sent after the failed copy would make rank 0
    return success with rank 1's rows never written.)"""
    world, rb, rows = 2, 32, 4
    ranks = proxy_sim.SimRanks(lib, world, world * rows * rb, timeout_s=0.5)
    sends = [np.full((rows, rb), 10 + r, dtype=np.uint8) for r in range(world)]
    try:
        for h in ranks.engines:
            assert lib.mt_proxy_set_batch(h, batch) == 0
        bad = sends[1].ctypes.data
        lib.mtsim_set_copy_fault(7, bad, bad + sends[1].nbytes)
        out = ranks.exchange(sends, [[2, 2], [2, 2]], coupled=coupled)
    finally:
        lib.mtsim_set_copy_fault(0, 0, 0)
        ranks.close()
    r0, r1 = out
    assert r1["rc"] == RC_ENGINE_FAILED, r1
    assert r0["recv"] == [2, 2] and (r0["rows"][:2] == 10).all()  # rank 0's own rows landed
    assert not (r0["rows"] == 11).any()  # rank 1's never did
    assert r0["err"][:3] == [ERR_TIMEOUT_SIGNAL, 0, 1], r0["err"]  # rank 0's call failed: no signal from rank 1
