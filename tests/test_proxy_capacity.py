"""Receive-capacity overflows of the one-sided exchange, in host simulation (tests/proxy_sim.py: the proxy engine and
csrc/proxy_xchg.h on CPU threads): several senders that each fit can together overflow one receiver, and the
receiver's call must fail with the capacity error -- not return with the rows that did not fit missing. The NVLink
kernel's check is the same; it runs on a GPU (tests/test_gpu_onesided.py)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_sim

ERR_CAPACITY = 3


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return proxy_sim.load(proxy_sim.build(tmp_path_factory.mktemp("mtsim_capacity") / "libmtsim.so"))


def test_a_receiver_that_several_senders_overflow_reports_the_capacity_error(lib: ctypes.CDLL) -> None:
    """reserve(4 rows) at world 2 gives 8 rows per receive area, and the host lets each rank send up to 8 rows; both
    send all 8 to rank 0. Rank 1 (its rows would end at row 16) skips its PUT and reports; rank 0 receives its own 8
    rows and none of rank 1's, and must report too: 16 rows sent to it in all, 8 held (it returned success)."""
    world, rb, cap = 2, 32, 8
    ranks = proxy_sim.SimRanks(lib, world, cap * rb, timeout_s=5.0)
    try:
        sends = [np.full((cap, rb), 10 + r, dtype=np.uint8) for r in range(world)]
        out = ranks.exchange(sends, [[cap, 0], [cap, 0]])
    finally:
        ranks.close()
    r0, r1 = out
    assert r0["rc"] == 0 and r0["recv"] == [cap, cap]
    assert (r0["rows"] == 10).all()  # its own rows landed; rank 1's were never written (no row past the area)
    assert r1["err"][:4] == [ERR_CAPACITY, 1, 0, cap], r1["err"]  # the sender's check: rank 1's 8 rows to rank 0
    # the receiver's own check: all sources (-1), 16 rows sent to it, 8 rows held
    assert r0["err"][:4] == [ERR_CAPACITY, 0, -1, -1], r0["err"]
    assert r0["err"][5] == 2 * cap and r0["err"][7] == cap, r0["err"]

    from moetune.runtime.transports._onesided import decode_error

    msg = decode_error(r0["err"])
    assert "capacity exceeded" in msg and "send rank 0 16 rows in all" in msg and "holds 8 rows per call" in msg, msg
    msg = decode_error(r1["err"])
    assert "rank 1's 8 rows to rank 0 would end at row 16" in msg and "holds 8 rows per call" in msg, msg


def test_a_sender_of_no_rows_to_an_overflowed_receiver_reports_nothing(lib: ctypes.CDLL) -> None:
    """Ranks 0 and 1 each send rank 0 a whole area (8 rows of 8): rank 0 is overflowed. Rank 2 sends it no rows (its
    one row goes to itself): nothing it writes overflows anything, so its call succeeds with its own row; only the
    receiver and the sender whose rows did not fit report the capacity error."""
    world, rb, cap = 3, 16, 8
    ranks = proxy_sim.SimRanks(lib, world, cap * rb, timeout_s=5.0)
    try:
        sends = [np.full((n, rb), 40 + r, dtype=np.uint8) for r, n in enumerate((cap, cap, 1))]
        out = ranks.exchange(sends, [[cap, 0, 0], [cap, 0, 0], [0, 0, 1]])
    finally:
        ranks.close()
    r0, r1, r2 = out
    assert r0["err"][:4] == [ERR_CAPACITY, 0, -1, -1], r0["err"]  # the receiver: all sources
    assert r1["err"][:4] == [ERR_CAPACITY, 1, 0, cap], r1["err"]  # the sender whose rows would end past the area
    assert r2["rc"] == 0 and r2["err"][0] == 0, r2["err"][:8]
    assert r2["recv"] == [0, 0, 1] and r2["rows"][:1].tolist() == [[42] * rb]


def test_senders_that_fit_together_raise_no_capacity_error(lib: ctypes.CDLL) -> None:
    """The same buffers, 3 ranks, the receiver's area exactly full (4 + 3 + 1 rows of 8): every rank's call succeeds
    and rank 0 holds every source's rows in rank order."""
    world, rb, cap = 3, 16, 8
    ranks = proxy_sim.SimRanks(lib, world, cap * rb)
    try:
        sends = [np.full((n, rb), 20 + r, dtype=np.uint8) for r, n in enumerate((4, 3, 1))]
        out = ranks.exchange(sends, [[4, 0, 0], [3, 0, 0], [1, 0, 0]])
    finally:
        ranks.close()
    assert all(o["rc"] == 0 and o["err"][0] == 0 for o in out), [o["err"][:8] for o in out]
    assert out[0]["recv"] == [4, 3, 1]
    assert out[0]["rows"][:, 0].tolist() == [20] * 4 + [21] * 3 + [22]


def test_an_overflowed_receiver_returns_only_after_its_own_puts_landed(lib: ctypes.CDLL) -> None:
    """A capacity error raises the abort flag; the call must still wait for the ACK of its rank's OWN PUTs to healthy
    peers before it returns (thread 31 waits for the ACK up to its own timeout, abort or not): a caller that catches
    the error reuses the send rows at once. Rank 1 sends 9 rows to rank 2 (8 held: no copy; ranks 1 and 2 report),
    rank 2 sends 4 rows to rank 0. Streams are asynchronous and every copy is delayed by 200 ms, so a call that
    returned on the abort flag would let rank 2 overwrite its rows before the copy to rank 0 read them: rank 0 would
    get the overwritten rows under a valid signal."""
    world, rb, cap = 3, 16, 8
    lib.mtsim_set_async(1, 200_000)
    ranks = proxy_sim.SimRanks(lib, world, cap * rb, timeout_s=5.0)
    try:
        sends = [np.full((n, rb), 30 + r, dtype=np.uint8) for r, n in enumerate((1, 9, 4))]
        out = ranks.exchange(sends, [[0, 0, 0], [0, 0, 9], [4, 0, 0]], reuse_send=0xEE)
    finally:
        ranks.close()
        lib.mtsim_set_async(0, 0)
    r0, r1, r2 = out
    assert r1["err"][:4] == [ERR_CAPACITY, 1, 2, 9], r1["err"]  # rank 1's 9 rows to rank 2 would end at row 9
    assert r2["err"][0] == ERR_CAPACITY and r2["err"][1] == 2, r2["err"]
    assert r0["rc"] == 0 and r0["err"][0] == 0 and r0["recv"] == [0, 0, 4], r0["err"]
    assert r0["rows"][:4].tolist() == [[32] * rb] * 4  # rank 2's rows as they were when its call began


def test_capacity_check_sits_on_a_lane_of_its_own() -> None:
    """The receiver's check runs on lane 30 of the proxy kernel's warp (past every source lane: world <= 8 < 30);
    the NVLink kernel's CTA 0 makes the same check and report (run on GPUs: tests/test_gpu_onesided.py) -- both
    skip it on a rank that refused its send counts (nothing is sent to it)."""
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    xchg = (csrc / "proxy_xchg.h").read_text()
    assert "constexpr int kCapacityLane = 30;" in xchg and "check_receive_capacity(p);" in xchg
    nvl = (csrc / "ep_nvlink.cu").read_text()
    assert "if (ok && b == 0 && !refused)\n      mt::check_receive_capacity(" in nvl
    assert "mt::check_receive_capacity(" in xchg and "t == kCapacityLane && !refused" in xchg
    common = (csrc / "mt_common.h").read_text()  # the one check both kernels run
    assert "report(w, MT_ERR_CAPACITY, -1, -1, epoch, total, cap_rows);" in common
