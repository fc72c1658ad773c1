"""A rank that refuses its send counts, in host simulation (tests/proxy_sim.py: the proxy engine and
csrc/proxy_xchg.h on CPU threads). The refusing rank (MT_ERR_SEND_COUNTS) still publishes its count-matrix row,
marked MT_COUNT_REFUSED, so its peers' waits end at once with MT_ERR_PEER_REFUSED naming it -- not at their count-word
timeout -- no rows go to or from it, nothing lands outside any receive area, and after mt_pxy_clear_error on every
rank the next calls run as if the refused one had been a good one (the parity protocol of the count matrix and the
receive areas, the monotonic signal slots). The NVLink kernel's twin runs on a GPU (tests/test_gpu_onesided.py)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_sim

ERR_CAPACITY, ERR_SEND_COUNTS, ERR_PEER_REFUSED = 3, 8, 9
TIMEOUT_S = 30.0  # the waits' timeout: a refusal must reach the peers far sooner
POISON, OUTSIDE = 0xFF, 0xEE  # receive areas before the calls; the memory after a refusing rank's send rows


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return proxy_sim.load(proxy_sim.build(tmp_path_factory.mktemp("mtsim_refusal") / "libmtsim.so"))


def _sends(world: int, rows: int, rb: int, epoch: int) -> list[np.ndarray]:
    """Rank r's send rows for call `epoch`: row i holds the byte 16 * epoch + 4 * r + (i % 4) (distinct per rank and
    call, never POISON or OUTSIDE)."""
    return [np.array([[16 * epoch + 4 * r + i % 4] * rb for i in range(rows)], dtype=np.uint8) for r in range(world)]


def _expected_area(sends: list[np.ndarray], counts: list[list[int]], dst: int, cap_rows: int,
                   refused: set[int]) -> np.ndarray:
    """Rank dst's receive area after a call: the rows of every source that did not refuse, in rank order (a refusing
    source counts 0 rows), the rest untouched (POISON); all POISON when dst refused."""
    rb = sends[0].shape[1]
    area = np.full((cap_rows, rb), POISON, dtype=np.uint8)
    if dst in refused:
        return area
    at = 0
    for s, send in enumerate(sends):
        if s in refused:
            continue
        first = sum(counts[s][:dst])
        area[at : at + counts[s][dst]] = send[first : first + counts[s][dst]]
        at += counts[s][dst]
    return area


def _run(lib: ctypes.CDLL, world: int, refusing: set[int], *, coupled: int, chunk_rows: int) -> None:
    """Call 1: the ranks in `refusing` send counts that run past their send rows (the rows after them: OUTSIDE);
    calls 2..4: every rank sends good counts, after mt_pxy_clear_error on every rank. Checks each call's verdicts,
    receive areas (poisoned before each call) and timing."""
    rb, rows, cap_rows = 16, 6, 24
    ranks = proxy_sim.SimRanks(lib, world, cap_rows * rb, timeout_s=TIMEOUT_S)
    try:
        for epoch in (1, 2, 3, 4):
            bad = refusing if epoch == 1 else set()
            counts = [[(r + d) % 3 for d in range(world)] for r in range(world)]  # each sums to at most 6 rows
            held = _sends(world, rows, rb, epoch)
            sends = []
            for r in range(world):
                if r in bad:  # counts through the last peer add up to rows + 2: past the send rows
                    big = np.full((rows + 8, rb), OUTSIDE, dtype=np.uint8)
                    big[:rows] = held[r]
                    sends.append(big[:rows])
                    counts[r] = [0] * (world - 1) + [rows + 2]
                else:
                    sends.append(held[r])
            par = epoch & 1
            for d in ranks.data:
                d[par * ranks.per_parity : (par + 1) * ranks.per_parity] = POISON
            t0 = time.monotonic()
            out = ranks.exchange(sends, counts, epoch, coupled=coupled, group=2, chunk_rows=chunk_rows)
            seconds = time.monotonic() - t0
            assert seconds < TIMEOUT_S / 3, (epoch, seconds)  # no wait ran into its timeout
            assert not any((d == OUTSIDE).any() for d in ranks.data), f"call {epoch}: rows from outside a send buffer"
            for r, o in enumerate(out):
                assert o["rc"] == 0, (epoch, r, o["rc"])
                if r in bad:  # its own refusal: the last destination, past the rows (slot 1), rows + 2 of `rows`
                    assert o["err"][:4] == [ERR_SEND_COUNTS, r, world - 1, 1], (epoch, r, o["err"][:8])
                    assert o["err"][5] == rows + 2 and o["err"][7] == rows, (epoch, r, o["err"][:8])
                elif bad:  # a peer's refusal, named (the lowest-numbered lane to see one writes the record first)
                    assert o["err"][0] == ERR_PEER_REFUSED and o["err"][1] == r and o["err"][2] in bad, \
                        (epoch, r, o["err"][:8])
                    assert o["err"][3] == -1, (epoch, r, o["err"][:8])
                else:
                    assert o["err"][0] == 0, (epoch, r, o["err"][:8])
                want = _expected_area(sends, counts, r, cap_rows, bad)
                assert np.array_equal(o["rows"][:cap_rows], want), (epoch, r, o["rows"][:, 0].tolist(),
                                                                   want[:, 0].tolist())
            if bad:
                assert ranks.clear_errors() == [0] * world, lib.mt_last_error()
                assert all(e == 0 for e in _errors(lib, ranks)), "the record is still set after clearing"
    finally:
        ranks.close()


def _errors(lib: ctypes.CDLL, ranks: proxy_sim.SimRanks) -> list[int]:
    words = []
    for x in ranks.ctxs:
        err = (ctypes.c_int * 16)()
        lib.mt_pxy_error(x, err)
        words.append(err[0])
    return words


@pytest.mark.parametrize("refusing", [0, 1, 2], ids=["lowest", "middle", "highest"])
def test_a_refusing_rank_reaches_its_peers_at_once_and_the_next_calls_run(lib: ctypes.CDLL, refusing: int) -> None:
    """World 3, one rank's counts run past its send rows: it reports MT_ERR_SEND_COUNTS, both peers report
    MT_ERR_PEER_REFUSED naming it well before the 30 s timeout, its receive area stays untouched and theirs hold only
    each other's rows (placed as if it had sent 0); after clearing, three good calls (both parities again) are exact.
    The lowest, middle and highest rank: the producer learns of a lower and of a higher destination's refusal from
    different words of its row."""
    _run(lib, 3, {refusing}, coupled=1, chunk_rows=0)


def test_a_refusal_with_decoupled_chunked_puts_on_asynchronous_streams(lib: ctypes.CDLL) -> None:
    """As above with decoupled signals (groups of 2 PUTs of 1 row) on asynchronous simulated streams (every copy
    200 µs late): the skipped signals of the refused call must not satisfy, or go backwards under, the later calls'
    waits."""
    lib.mtsim_set_async(1, 200)
    try:
        _run(lib, 3, {1}, coupled=0, chunk_rows=1)
    finally:
        lib.mtsim_set_async(0, 0)


def test_two_ranks_refusing_in_one_call(lib: ctypes.CDLL) -> None:
    """World 4, ranks 0 and 2 refuse in the same call: each reports its own counts; ranks 1 and 3 report a refusing
    peer and exchange their rows with each other only; the next calls run."""
    _run(lib, 4, {0, 2}, coupled=1, chunk_rows=2)


def test_a_negative_count_is_refused_the_same_way(lib: ctypes.CDLL) -> None:
    """A negative count (slot 0, seen = the count) is a refusal like counts past the rows: the peer learns at once,
    and the next call runs after clearing."""
    world, rb = 2, 32
    ranks = proxy_sim.SimRanks(lib, world, 16 * rb, timeout_s=TIMEOUT_S)
    try:
        sends = _sends(world, 4, rb, 1)
        out = []
        def one(r: int, counts: list[int]) -> None:  # the exchange alone (no exchange_counts before it)
            sc = np.array(counts, dtype=np.int64)
            recv = np.array([2, 2], dtype=np.int64)
            rc = lib.mt_pxy_exchange(ranks.ctxs[r], sends[r].ctypes.data, 4, rb, sc.ctypes.data, recv.ctypes.data,
                                     1, 0, 0, 1, 0)
            err = (ctypes.c_int * 16)()
            lib.mt_pxy_error(ranks.ctxs[r], err)
            out.append((r, rc, list(err)))

        t0 = time.monotonic()
        ts = [threading.Thread(target=one, args=(r, c)) for r, c in ((0, [-1, 2]), (1, [2, 2]))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert time.monotonic() - t0 < TIMEOUT_S / 3
        errs = dict((r, e) for r, _, e in out)
        assert errs[0][:4] == [ERR_SEND_COUNTS, 0, 0, 0] and errs[0][5:7] == [-1, -1], errs[0][:8]
        assert errs[1][:4] == [ERR_PEER_REFUSED, 1, 0, -1], errs[1][:8]
        area = ranks.data[1][ranks.per_parity : ranks.per_parity + 2 * rb]  # call 1: parity 1
        assert (area.reshape(2, rb) == sends[1][2:4]).all()  # its own 2 rows, at row 0
        assert ranks.clear_errors() == [0, 0]
        sends = _sends(world, 4, rb, 2)
        res = ranks.exchange(sends, [[2, 2], [2, 2]], 2)
        for r, o in enumerate(res):
            assert o["err"][0] == 0 and o["recv"] == [2, 2], (r, o["err"][:8])
            assert np.array_equal(o["rows"][:4], np.concatenate([sends[0][2 * r : 2 * r + 2], sends[1][2 * r : 2 * r + 2]]))
    finally:
        ranks.close()


def test_exchange_counts_refuses_a_count_no_word_carries(lib: ctypes.CDLL) -> None:
    """exchange_counts with a negative count (masked into 39 bits it arrived as 2^39 - 1) or one past 2^39 - 1 (it
    wrapped): refused (slot 3, seen = the count), that word sent marked, so its peer receives 0 and reports the refusal
    at once;
    cleared while it is the last call, the next calls run. Followed by an exchange before anyone checks (as
    SimRanks.exchange does), the refusal is no longer the last call and clearing is refused."""
    world = 2
    for bad in (-3, 1 << 39):
        ranks = proxy_sim.SimRanks(lib, world, 16 * 32, timeout_s=TIMEOUT_S)
        try:
            t0 = time.monotonic()
            out = ranks.counts([[2, bad], [2, 2]], 1)  # the bad count is rank 1's
            assert time.monotonic() - t0 < TIMEOUT_S / 3
            assert out[0]["err"][:4] == [ERR_SEND_COUNTS, 0, 1, 3], out[0]["err"][:8]
            seen = (out[0]["err"][5] & 0xFFFFFFFF) | (out[0]["err"][6] & 0xFFFFFFFF) << 32
            assert seen == bad % (1 << 64), (seen, bad)
            assert out[1]["err"][:4] == [ERR_PEER_REFUSED, 1, 0, -2] and out[1]["recv"] == [0, 2], out[1]
            assert ranks.clear_errors() == [0, 0], lib.mt_last_error()
            sends = _sends(world, 4, 32, 2)
            res = ranks.exchange(sends, [[2, 2], [2, 2]], 2)
            assert all(o["err"][0] == 0 and o["recv"] == [2, 2] for o in res), [o["err"][:8] for o in res]
            res = ranks.exchange(_sends(world, 4, 32, 3), [[2, bad], [2, 2]], 3)  # counts, then the exchange
            assert res[0]["err"][:4] == [ERR_SEND_COUNTS, 0, 1, 3], res[0]["err"][:8]
            assert ranks.clear_errors() == [323, 323]
            assert "(exchange_counts, epoch 3) is not this rank's last (an exchange, epoch 3" in lib.mt_last_error().decode()
        finally:
            ranks.close()


def test_clear_error_clears_only_a_refusal(lib: ctypes.CDLL) -> None:
    """mt_pxy_clear_error with nothing recorded is a no-op; after a capacity overflow (an error whose waits may have
    ended early: the abort flag is set) it refuses (323) and keeps the record, naming the code."""
    world, rb, cap = 2, 32, 8
    ranks = proxy_sim.SimRanks(lib, world, cap * rb, timeout_s=5.0)
    try:
        assert ranks.clear_errors() == [0, 0]
        ranks.exchange([np.full((cap, rb), 10 + r, dtype=np.uint8) for r in range(world)], [[cap, 0], [cap, 0]])
        assert _errors(lib, ranks) == [ERR_CAPACITY, ERR_CAPACITY]
        assert ranks.clear_errors() == [323, 323]
        msg = lib.mt_last_error().decode()
        assert "holds code 3 and a wait of that call failed (abort flag set)" in msg and "build a new transport" in msg
        assert _errors(lib, ranks) == [ERR_CAPACITY, ERR_CAPACITY]
    finally:
        ranks.close()


def test_the_refusal_marker_is_outside_every_count() -> None:
    """The marker is bit 39 of a count-matrix word, below the tag (bits 40..63); counts are the 39 bits under it, and
    mt::tagged masks them, so no count sets the marker. Read from the header, as the kernels compile it."""
    import re

    src = (Path(__file__).resolve().parents[1] / "csrc" / "mt_common.h").read_text()
    assert re.search(r"#define MT_TAG_SHIFT 40\b", src)
    assert "#define MT_COUNT_REFUSED (1ull << (MT_TAG_SHIFT - 1))" in src
    assert "#define MT_COUNT_MASK (MT_COUNT_REFUSED - 1)" in src
    assert "(tag << MT_TAG_SHIFT) | (count & MT_COUNT_MASK)" in src
    assert "MT_ERR_PEER_REFUSED = 9," in src


def test_clear_error_refuses_once_a_later_call_ran_after_the_refusal(lib: ctypes.CDLL) -> None:
    """The record keeps the first error only: rank 0 refuses in call 1, and call 2 (launched before anyone checked, as
    asynchronous callers do) is refused by rank 1, whose refusal cannot be recorded. Clearing then would hide call 2's
    refusal, and ranks that noticed call 1's at different calls may be out of step: mt_pxy_clear_error refuses (323)
    on every rank, naming both epochs, and keeps the record."""
    world, rb = 3, 16
    ranks = proxy_sim.SimRanks(lib, world, 24 * rb, timeout_s=TIMEOUT_S)
    try:
        good = [[1] * world for _ in range(world)]
        for epoch, refusing in ((1, 0), (2, 1)):
            counts = [row[:] for row in good]
            counts[refusing] = [0] * (world - 1) + [9]  # past its 4 send rows
            ranks.exchange(_sends(world, 4, rb, epoch), counts, epoch)
        assert _errors(lib, ranks) == [ERR_SEND_COUNTS, ERR_PEER_REFUSED, ERR_PEER_REFUSED]
        assert ranks.clear_errors() == [323] * world
        msg = lib.mt_last_error().decode()
        assert "the refused call (exchange, epoch 1) is not this rank's last (an exchange, epoch 2, was launched" in msg, msg
        assert "build a new transport" in msg
        assert _errors(lib, ranks) == [ERR_SEND_COUNTS, ERR_PEER_REFUSED, ERR_PEER_REFUSED]
    finally:
        ranks.close()


CAPTURED = 0x5000  # a stream handle the simulation takes as being captured into a CUDA graph (mtsim_set_capturing)


def _counts_call(lib: ctypes.CDLL, ctx: ctypes.c_void_p, count: int, epoch: int, stream: int = 0) -> int:
    """mt_pxy_counts of one rank sending `count` rows to itself; on the CAPTURED stream the launch is captured, not run
    (the call returns at once and its kernel never writes its completion word: a graph that is never replayed)."""
    sc, recv = np.array([count], dtype=np.int64), np.zeros(1, dtype=np.int64)
    if stream == CAPTURED:
        lib.mtsim_set_capturing(CAPTURED)
    try:
        return lib.mt_pxy_counts(ctx, sc.ctypes.data, recv.ctypes.data, epoch, stream)
    finally:
        lib.mtsim_set_capturing(0)


@pytest.mark.parametrize("refused", [None, "before", "after"])
def test_clear_error_does_not_wait_for_a_launch_only_captured(lib: ctypes.CDLL, refused: str | None) -> None:
    """A launch captured into a CUDA graph writes its completion word only when the graph is replayed: clearing must
    not wait for it (it did, until its host wait's bound of 4 x the timeout + 10 s, then failed with 322). It waits for
    the last launch run where it was issued and for the device's work (a replay in flight), within the timeout, then
    applies its rule: nothing recorded, or a refusal in a call run before the captured launch (the captured launch is
    the rank's last: 323, promptly, naming it), or in a call run after it (cleared)."""
    ranks = proxy_sim.SimRanks(lib, 1, 64, timeout_s=0.5)
    ctx = ranks.ctxs[0]
    try:
        assert _counts_call(lib, ctx, -1 if refused == "before" else 1, 1) == 0
        assert _counts_call(lib, ctx, 1, 2, CAPTURED) == 0
        if refused == "after":
            assert _counts_call(lib, ctx, -1, 3) == 0  # runs although the launch before it never did
        t0 = time.monotonic()
        rc = lib.mt_pxy_clear_error(ctx)
        took = time.monotonic() - t0
        msg = lib.mt_last_error().decode()
        assert took < 2.0, (took, rc, msg)
        if refused == "before":
            assert rc == 323 and "(exchange_counts, epoch 1) is not this rank's last (exchange_counts, epoch 2" in msg, msg
        else:
            assert rc == 0, msg
    finally:
        ranks.close()
