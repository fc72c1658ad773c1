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


def test_a_failed_engine_call_returns_only_after_its_copies(lib: ctypes.CDLL) -> None:
    """mt_pxy_exchange's error return on a failed engine (321) must not leave copies of that call still to run: the
    failed engine keeps issuing the call's later PUTs (it only stops signalling), and a caller that catches the error
    reuses its send rows at once (the Python side drops the call's tensors). Rank 1's first row cannot be copied, its
    other rows can; streams are asynchronous with every copy 100 ms late. A call that returned when it saw the engine
    fail would let rank 1 overwrite its rows (0xEE) before those copies read them: 0xEE would land at rank 0 and in
    rank 1's own area."""
    world, rb, rows = 2, 32, 4
    lib.mtsim_set_async(1, 100_000)
    ranks = proxy_sim.SimRanks(lib, world, world * rows * rb, timeout_s=0.5)
    sends = [np.full((rows, rb), 10 + r, dtype=np.uint8) for r in range(world)]
    try:
        bad = sends[1].ctypes.data
        lib.mtsim_set_copy_fault(7, bad, bad + rb)  # rank 1's first row only: its later PUTs are still issued
        out = ranks.exchange(sends, [[2, 2], [2, 2]], chunk_rows=1, reuse_send=0xEE)
    finally:
        lib.mtsim_set_copy_fault(0, 0, 0)
        ranks.close()  # waits for every stream: whatever a late copy wrote is in the areas now
        lib.mtsim_set_async(0, 0)
    assert out[1]["rc"] == RC_ENGINE_FAILED, out[1]
    for r in range(world):
        assert not (ranks.data[r] == 0xEE).any(), f"rank {r} got rows rank 1 wrote after its call returned"
    area = ranks.data[0][ranks.per_parity :]  # call 1's parity
    assert (area[3 * rb : 4 * rb] == 11).all()  # rank 1's second row (after rank 0's two) as it was during the call
