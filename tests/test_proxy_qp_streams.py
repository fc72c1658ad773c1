"""qps_per_pe is per PE: the proxy engine gives each peer its own qps CUDA streams (the queue pairs), as the knob's
name, its documentation and the tuner's fabric model (tuner/fabric_model/queue.py: destination d's QPs are
d*qps .. d*qps+qps-1) say. Checked in host simulation (tests/proxy_sim.py), which records the stream of every copy
and word write: the engine alone (host producer) and the exchange's producer (csrc/proxy_xchg.h)."""

from __future__ import annotations

import ctypes
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_sim
from proxy_sim import COPY, WRITE

from moetune.runtime.transports.proxy import OP_PUT, OP_SIGNAL, Request

PEER_HASH, ROUND_ROBIN = 1, 0
DRAIN, NIC_ORDERED = 1, 2


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = proxy_sim.load(proxy_sim.build(tmp_path_factory.mktemp("mtsim_qp_streams") / "libmtsim.so"))
    yield lib
    lib.mtsim_set_log(0)
    lib.mtsim_set_async(0, 0)


def _host_batch(lib: ctypes.CDLL, qps: int, mapping: int, fence: int, npeers: int = 3, groups: int = 6,
                per_group: int = 2) -> dict:
    """One engine; per peer `groups` groups of `per_group` PUTs (signal_idx: the group's slot) each followed by its
    SIGNAL. Returns per peer the streams of its copies, of each group's copies and of each group's SIGNAL."""
    size = 64
    nput = groups * per_group
    src = (ctypes.c_uint8 * (npeers * nput * size))(*[i % 251 for i in range(npeers * nput * size)])
    data = [(ctypes.c_uint8 * (nput * size))() for _ in range(npeers)]
    ctrl = [(ctypes.c_uint64 * 8)() for _ in range(npeers)]
    sig = [(ctypes.c_uint64 * 64)() for _ in range(npeers)]
    addr = ctypes.addressof
    h = ctypes.c_void_p()
    assert lib.mt_proxy_create(0, npeers, proxy_sim.u64([addr(d) for d in data]), proxy_sim.u64([addr(c) for c in ctrl]),
                               proxy_sim.u64([addr(s) for s in sig]), qps, mapping, fence, 64, None, 0,
                               20.0, ctypes.byref(h)) == 0, lib.mt_last_error()
    try:
        reqs = []
        for p in range(npeers):
            for g in range(groups):
                for t in range(g * per_group, (g + 1) * per_group):
                    reqs.append(Request(OP_PUT, p, 0, g, addr(src) + (p * nput + t) * size, t * size, size, 0, 0, 0))
                reqs.append(Request(OP_SIGNAL, p, 0, g, 0, 0, 0, 9, 0, 0))
        arr = (Request * len(reqs))(*reqs)
        lib.mtsim_set_log(1)
        assert lib.mt_proxy_enqueue(h, arr, len(arr), 10.0) == 0, lib.mt_last_error()
        assert lib.mt_proxy_quiesce(h, 10.0) == 0, lib.mt_last_error()
        ops = proxy_sim.stream_log(lib)
        lib.mtsim_set_log(0)
        nstreams = proxy_sim.nstreams(lib, h)
    finally:
        lib.mtsim_set_log(0)
        lib.mt_proxy_destroy(h)
    for p in range(npeers):  # everything landed
        assert bytes(data[p]) == bytes(src)[p * nput * size : (p + 1) * nput * size]
        assert all(sig[p][g] == 9 for g in range(groups))
    out: dict = {"nstreams": nstreams, "copies": defaultdict(set), "group": defaultdict(set), "signal": {}}
    for stream, dst, kind in ops:
        for p in range(npeers):
            if kind == COPY and addr(data[p]) <= dst < addr(data[p]) + nput * size:
                out["copies"][p].add(stream)
                out["group"][(p, (dst - addr(data[p])) // size // per_group)].add(stream)
            elif kind == WRITE and addr(sig[p]) <= dst < addr(sig[p]) + 8 * groups:
                out["signal"][(p, (dst - addr(sig[p])) // 8)] = stream
    return out


@pytest.mark.parametrize("fence", [DRAIN, NIC_ORDERED], ids=["proxy_drain", "nic_ordered"])
@pytest.mark.parametrize("qps", [1, 2, 4, 6])
def test_peer_hash_gives_each_peer_qps_streams_and_keeps_a_group_on_one(lib: ctypes.CDLL, qps: int, fence: int) -> None:
    """peer_hash: a peer's 6 signal groups rotate over ITS qps streams (qps distinct streams per peer, no stream
    shared between peers: 3 x qps in all), and a group's PUTs and its SIGNAL share one stream (nic_ordered relies on
    it), not qps streams in all with exactly one (peer mod qps) for each peer, whatever qps."""
    r = _host_batch(lib, qps, PEER_HASH, fence)
    assert r["nstreams"] == 3 * qps
    assert [len(r["copies"][p]) for p in range(3)] == [qps] * 3
    assert len(set().union(*r["copies"].values())) == 3 * qps  # disjoint: every peer has streams of its own
    for (p, g), streams in r["group"].items():
        assert streams == {r["signal"][(p, g)]}, (p, g)  # one stream per group, its signal behind its data


@pytest.mark.parametrize("qps", [1, 2, 4])
def test_round_robin_rotates_over_the_peers_own_streams(lib: ctypes.CDLL, qps: int) -> None:
    """round_robin (with proxy_drain, the fence that allows it with several QPs): a peer's PUTs and SIGNALs rotate
    over its own qps streams; no peer shares another's."""
    r = _host_batch(lib, qps, ROUND_ROBIN, DRAIN)
    assert r["nstreams"] == 3 * qps
    assert [len(r["copies"][p]) for p in range(3)] == [qps] * 3
    assert len(set().union(*r["copies"].values())) == 3 * qps
    streams_of = {p: r["copies"][p] | {r["signal"][(p, g)] for g in range(6)} for p in range(3)}
    assert all(len(s) == qps for s in streams_of.values())


def test_an_engine_refuses_more_streams_than_it_can_acknowledge(lib: ctypes.CDLL) -> None:
    """npeers x qps streams, at most MT_MAX_STREAMS (8 x 64: every qps_per_pe at every transport world size)."""
    addrs = proxy_sim.u64([0] * 9)
    h = ctypes.c_void_p()
    assert lib.mt_proxy_create(0, 9, addrs, addrs, addrs, 64, PEER_HASH, DRAIN, 64, None, 0, 20.0, ctypes.byref(h)) == 201
    assert b"9 peers x 64 QPs per peer = 576 streams, more than 512" in lib.mt_last_error()
    assert lib.mt_proxy_create(0, 8, addrs, addrs, addrs, 64, PEER_HASH, DRAIN, 64, None, 0, 20.0, ctypes.byref(h)) == 0
    lib.mt_proxy_destroy(h)


def test_the_diagnosis_names_a_stream_as_a_stream(lib: ctypes.CDLL) -> None:
    """mt_proxy_diag says which peer or which stream the thread is stuck on: a drain (and an ACK's write, a batch's
    copy) is on a global stream index (peer * qps + k), not a peer or a QP of one. 2 peers x 2 QPs, asynchronous
    streams with every copy 2 s late: a PUT to peer 1 covered by slot 1 (peer_hash: stream 3), then its SIGNAL,
    whose drain waits on stream 3."""
    lib.mt_proxy_diag.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    # 2 s per copy, looked at for up to 1.5 s: on a loaded CI box (2 pytest-xdist workers on 2 cores) 200 looks 1 ms
    # apart could end before the thread reached the drain, or miss a window of 300 ms
    lib.mtsim_set_async(1, 2_000_000)
    src = (ctypes.c_uint8 * 64)()
    data = [(ctypes.c_uint8 * 64)() for _ in range(2)]
    ctrl = [(ctypes.c_uint64 * 8)() for _ in range(2)]
    sig = [(ctypes.c_uint64 * 64)() for _ in range(2)]
    addr = ctypes.addressof
    h = ctypes.c_void_p()
    assert lib.mt_proxy_create(0, 2, proxy_sim.u64([addr(d) for d in data]), proxy_sim.u64([addr(c) for c in ctrl]),
                               proxy_sim.u64([addr(s) for s in sig]), 2, PEER_HASH, DRAIN, 64, None, 0,
                               20.0, ctypes.byref(h)) == 0, lib.mt_last_error()
    try:
        arr = (Request * 2)(Request(OP_PUT, 1, 0, 1, addr(src), 0, 64, 0, 0, 0), Request(OP_SIGNAL, 1, 0, 1, 0, 0, 0, 9, 0, 0))
        assert lib.mt_proxy_enqueue(h, arr, 2, 10.0) == 0, lib.mt_last_error()
        buf = ctypes.create_string_buffer(512)
        seen = []
        deadline = time.monotonic() + 1.5
        while True:
            lib.mt_proxy_diag(h, buf, 512)
            seen.append(buf.value)
            if b"inside a drain" in buf.value or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        assert b"inside a drain (stream 3)" in buf.value, seen[-3:]
        assert lib.mt_proxy_quiesce(h, 10.0) == 0, lib.mt_last_error()
    finally:
        lib.mt_proxy_destroy(h)
        lib.mtsim_set_async(0, 0)


def test_qps_per_peer_is_a_new_library_abi() -> None:
    """mt_proxy_create's qps changed meaning (a total -> per peer, npeers*qps streams, the 201 refusal) and
    MtGpuView.qps became nstreams: an ABI-18 library (MOETUNE_CSRC_LIB) would pass the load check and take qps as
    the total, so the library and its Python check both say 19 or later, and agree."""
    import re

    from moetune.runtime import csrc_build

    src = (Path(__file__).resolve().parents[1] / "csrc" / "mt_common.cu").read_text()
    abi = int(re.search(r"mt_abi_version\(\) \{ return (\d+);", src).group(1))
    assert abi == csrc_build.ABI_VERSION >= 19


@pytest.mark.parametrize("qps", [1, 2, 4, 8])
def test_the_exchange_spreads_a_peers_signal_groups_over_its_qps_streams(lib: ctypes.CDLL, qps: int) -> None:
    """The exchange kernel's producer (decoupled, 1 row per PUT, groups of 2: 4 groups per peer) with nic_ordered +
    peer_hash on asynchronous simulated streams (every copy 100 µs late, so a signal on another stream than its
    data would be seen first): rank 0's PUTs to each peer use min(qps, 4) of that peer's streams, each group's
    SIGNAL follows its PUTs on their stream, and every row arrives."""
    world, rb, rows = 2, 32, 8
    lib.mtsim_set_async(1, 100)  # streams created from here on are asynchronous (until reset, after close)
    try:
        ranks = proxy_sim.SimRanks(lib, world, world * rows * rb, qps=qps, mapping=PEER_HASH, fence=NIC_ORDERED)
        try:
            assert proxy_sim.nstreams(lib, ranks.engines[0]) == world * qps
            sends = [np.arange(2 * rows * rb, dtype=np.uint8).reshape(2 * rows, rb), np.zeros((0, rb), dtype=np.uint8)]
            lib.mtsim_set_log(1)
            out = ranks.exchange(sends, [[rows, rows], [0, 0]], coupled=0, group=2, chunk_rows=1)
            ops = proxy_sim.stream_log(lib)
        finally:
            lib.mtsim_set_log(0)
            ranks.close()
    finally:
        lib.mtsim_set_async(0, 0)
    assert all(o["rc"] == 0 and o["err"][0] == 0 for o in out), [o["err"][:8] for o in out]
    for d in range(world):
        assert np.array_equal(out[d]["rows"][:rows], sends[0][d * rows : (d + 1) * rows]), d
    copies: dict = defaultdict(set)  # (peer, group) -> streams of rank 0's copies (only rank 0 sends rows)
    signals: dict = {}
    for stream, dst, kind in ops:
        for d in range(world):
            data, ctrl = ranks.data[d], ranks.ctrl[d]
            off = dst - data.ctypes.data
            if kind == COPY and 0 <= off < data.nbytes:
                copies[(d, off % ranks.per_parity // rb // 2)].add(stream)
            sig = dst - ctrl.ctypes.data  # rank 0's signal slots at d: the first MAX_SLOTS words
            if kind == WRITE and 0 <= sig < 8 * proxy_sim.MAX_SLOTS:
                signals[(d, sig // 8)] = stream
    per_peer = {d: set().union(*(copies[(d, g)] for g in range(4))) for d in range(world)}
    assert [len(per_peer[d]) for d in range(world)] == [min(qps, 4)] * world
    assert not per_peer[0] & per_peer[1]
    for (d, g), streams in copies.items():
        assert streams == {signals[(d, g)]}, (d, g)


@pytest.mark.parametrize("qps", [1, 2, 4])
@pytest.mark.parametrize("mapping", ["peer_hash", "round_robin"])
def test_the_fabric_model_gives_each_destination_the_same_qps_queue_pairs(qps: int, mapping: str) -> None:
    """The tuner's model of the queued transports (a NIC preset: QPs per peer, nic.shared_qps = 0) uses for
    destination d the QPs d*qps .. d*qps+qps-1, as the engine now uses its streams: 3 destinations, 4 signal groups
    of 2 tiles each (decoupled, proxy_drain), count words first."""
    from moetune.tuner.fabric_model.params import params
    from moetune.tuner.fabric_model.presets import load_preset
    from moetune.tuner.fabric_model.queue import run_queue

    p = params(load_preset("ndr-ibrc-h100x8"))
    assert p.shared_qps == 0
    dests = [(p.rtt, [(16384.0, 8, 1, 0.0, 0.0)]) for _ in range(3)]
    sim = run_queue(p, "proxy", dests, npes=4, signalling="decoupled", group=2, fence="drain", qp_mapping=mapping,
                    qps=qps, num_sms=1, group_signal=True, words=4)
    assert set(sim.qp_free) == {d * qps + k for d in range(3) for k in range(qps)}


@pytest.mark.parametrize(("mapping", "coupled", "group", "chunk_rows", "want"), [
    (PEER_HASH, 1, 0, 0, {0, 4}),  # one PUT a peer, its signal on slot 0: each peer's first stream only
    (ROUND_ROBIN, 1, 0, 0, {0, 1, 4, 5}),  # the PUT and its signal take a peer's next two streams
    (ROUND_ROBIN, 0, 2, 1, set(range(8))),  # 4 PUTs + 2 SIGNALs a peer rotate over all 4
])
def test_the_ack_is_written_on_the_streams_the_call_picked(lib: ctypes.CDLL, mapping: int, coupled: int, group: int,
                                                             chunk_rows: int, want: set[int]) -> None:
    """Every ACK stream write costs the proxy thread ~1-2 us (run 204: +20-36 us a batch on 8 peers x 4 QPs), so an
    exchange ACKs only the streams its requests picked (count words: each peer's first; PUTs and signals: the QP
    mapping), and the kernel's last lane waits on exactly those. World 2, 4 QPs per peer, asynchronous streams
    (every copy 100 us late), five calls in a row: rank 0's ACK writes land on `want` only, every call returns
    without error (a wait on a stream the engine did not ACK would end in the timeout) and every row arrives."""
    world, qps, rb, rows = 2, 4, 32, 4
    lib.mtsim_set_async(1, 100)
    try:
        ranks = proxy_sim.SimRanks(lib, world, world * rows * rb, qps=qps, mapping=mapping, fence=DRAIN,
                                   timeout_s=5.0)
        try:
            view = proxy_sim.GpuView()
            assert lib.mt_proxy_gpu_view(ranks.engines[0], ctypes.byref(view)) == 0
            assert (view.qps, view.qp_mapping, view.nstreams) == (qps, mapping, world * qps)
            for epoch in range(1, 6):
                sends = [np.full((2 * rows, rb), 10 * epoch + r, dtype=np.uint8) for r in range(world)]
                lib.mtsim_set_log(1)
                out = ranks.exchange(sends, [[rows, rows], [rows, rows]], epoch, coupled=coupled, group=group,
                                     chunk_rows=chunk_rows)
                ops = proxy_sim.stream_log(lib)
                lib.mtsim_set_log(0)
                assert all(o["rc"] == 0 and o["err"][0] == 0 for o in out), [o["err"][:8] for o in out]
                for d in range(world):
                    assert (out[d]["rows"][:rows] == 10 * epoch).all() and (out[d]["rows"][rows:] == 10 * epoch + 1).all()
                acked = {(dst - view.ack_dev) // 8 for _stream, dst, kind in ops
                         if kind == WRITE and view.ack_dev <= dst < view.ack_dev + 8 * view.nstreams}
                assert acked == want, (epoch, sorted(acked))
        finally:
            lib.mtsim_set_log(0)
            ranks.close()
    finally:
        lib.mtsim_set_async(0, 0)


def test_the_readme_says_an_ack_is_written_on_the_picked_streams() -> None:
    """csrc/README.md describes the engine: an ACK goes on the streams picked since the previous ACK (every stream only
    once the engine failed), as the test above sees; it said every stream, which the engine stopped doing."""
    readme = " ".join((Path(__file__).resolve().parents[1] / "csrc" / "README.md").read_text().split())
    assert "an `ACK` is written on every stream" not in readme
    assert "completion word on every QP stream" not in readme
    assert "An `ACK` is written on the streams picked since the previous ACK only" in readme
    header = " ".join(w for w in (Path(__file__).resolve().parents[1] / "csrc" / "proxy_engine.h").read_text().split()
                       if w != "//")  # the comment's text, across its lines
    assert "on each stream picked since the previous ACK" in header


def case_world_1_acks(rank: int, world: int, mapping: str, fence: str) -> tuple[int, int, list[str]]:
    """The body of the GPU test below, on its one spawned rank (the proxy transport needs a process group): 30
    exchanges with idle gaps; returns the acks and ack_writes the calls added, and any call that went wrong."""
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.transports.proxy import ProxyTransport

    dev = torch.device("cuda", 0)
    knobs = Knobs(transport="proxy", signalling="coupled", fence_mode=fence, qp_mapping=mapping, qps_per_pe=4)
    t = ProxyTransport(None, knobs, dev, max_send_rows=64, row_bytes=256)
    wrong: list[str] = []
    try:
        t.proxy_stats()  # the engine runs
        before = t.proxy_stats()
        for i in range(30):
            rows = 1 + i % 48
            send = torch.full((rows, 128), float(i), dtype=torch.bfloat16, device=dev)
            sc = torch.tensor([rows], dtype=torch.int64, device=dev)
            rc = t.exchange_counts(sc)
            got = t.exchange(send, sc, rc)
            torch.cuda.synchronize(dev)
            t.check()
            if int(rc[0]) != rows or not torch.equal(got[:rows], send):
                wrong.append(f"call {i}: {int(rc[0])} rows back for {rows}, or other bytes")
            time.sleep((i % 3) * 1e-3)
        after = t.proxy_stats()
    finally:
        t.close()
    return after["acks"] - before["acks"], after["ack_writes"] - before["ack_writes"], wrong


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the proxy exchange kernel and engine)")
@pytest.mark.parametrize(("mapping", "fence", "want"), [("peer_hash", "nic_ordered", 1), ("round_robin", "proxy_drain", 2)])
def test_a_world_1_proxy_exchange_acks_only_its_picked_streams_on_a_gpu(mapping: str, fence: str, want: int) -> None:
    """The exchange kernel and the proxy engine on one GPU (world 1: rank 0 sends to itself, one spawned nccl rank),
    4 QPs: each call's ACK is written on the streams its requests picked (peer_hash: the count word, the PUT and its
    signal all on stream 0; round_robin: the PUT and its signal on streams 0 and 1), 30 calls with 0-2 ms idle gaps
    between them (the engine's thread sleeps after 200 us idle and every launch must wake it): every call returns
    the rows sent."""
    from moetune.runtime.testing.launch import launch

    [(acks, writes, wrong)] = launch(case_world_1_acks, 1, backend="nccl", args=(mapping, fence), timeout_s=60,
                                     join_timeout_s=120)
    assert not wrong, wrong
    assert acks == 30
    assert writes == 30 * want, (acks, writes)
