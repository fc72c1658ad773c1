"""The fabric model's runtime layouts include what the runtime does around the data (all MODELLED):

1. the count exchange: exchange_counts (dispatch; one word per rank) and the count-matrix row every rank's
   exchange writes to every rank first (csrc/proxy_xchg.h produce_exchange: world x world immediate 8-byte
   writes through the proxy, cuStreamWriteValue64 in csrc/proxy_engine.cpp), before any data PUT;
2. the rows a rank sends itself (a PUT to its own rank: a local copy, no NIC);
3. combine's reduce kernel (csrc/ep_pack.cu combine_reduce: every returned row read, every token written).

Every expected number below is derived by hand from the preset's constants; none of these pieces existed
before (each test fails on the model of commit 4451d1f)."""

from __future__ import annotations

import math

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.presets import load_preset
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.routing import spread_quantiles

QWEN = get_model("qwen3-30b")  # H 2048 bf16, 128 experts, top-8
DSV3 = get_model("deepseek-v3")  # H 7168 bf16, 256 experts, top-8
DSV3_ROW = 7168 * 2 + 8 * 8 + 8 * 4  # dispatch wire row: 14432 B
DSV3_ROWS_2 = 4096 * (1 - math.comb(128, 8) / math.comb(256, 8))  # rows PE 0 sends each rank at 2 ranks
SL = "slingshot11-libfabric-a100x4"
FIXED = Knobs(transport="proxy", signalling="decoupled", fence_mode="nic_ordered")


def _proxy(**kw) -> Knobs:
    return Knobs(transport="proxy", fence_mode="proxy_drain", **kw)


def test_sixteen_ranks_post_the_count_matrix_before_the_first_put() -> None:
    """Slingshot preset (proxy.signal_us 0.3, put_us 0.8), 4 nodes x 4 GPUs: the proxy posts its count-matrix row
    to every rank, 16 x 16 = 256 words (the 3 NVLink peers' and its own included: the proxy writes them all),
    then per rank one PUT and one signal (chunk_tokens 0, group 0): 12 remote peers + this PE itself (its 3
    NVLink peers go over NVLink). Proxy issue time = 256 x 0.3 + 13 x (0.8 + 0.3) = 91.1 us (was 12 x 1.1 =
    13.2 us: no words, no PUT to self)."""
    r = predict(SL, Workload(QWEN, 256, 4, 4), FIXED, phase="dispatch")
    assert r.phases["dispatch.count_matrix_issue"] == pytest.approx(256 * 0.3)
    assert r.phases["dispatch.proxy_issue"] == pytest.approx(256 * 0.3 + 13 * (0.8 + 0.3))
    # the first data PUT leaves after the pack, exchange_counts, the host's wait for it, the exchange launch, the
    # proxy's poll and the 256 words: the dispatch cannot end before
    floor = (r.phases["dispatch.pack"] + r.phases["dispatch.counts"] + r.phases["dispatch.host_wait_counts"] + 4.0
             + 0.5 + 256 * 0.3 + 0.8)
    assert r.dispatch_us > floor
    # combine's exchange posts the matrix again (it is given the counts: no exchange_counts)
    c = predict(SL, Workload(QWEN, 256, 4, 4), FIXED, phase="combine")
    assert c.phases["combine.count_matrix_issue"] == pytest.approx(256 * 0.3)
    assert "combine.counts" not in c.phases


def test_exchange_counts_is_a_round_of_words() -> None:
    """nvlink-h200x2's proxy probe (serves the other GPU through the queue): exchange_counts posts 2 words
    (signal_us 1.59931 each) and waits for the peer's word to it, its first push: posted 1.59931 us after the
    peer's poll, landed a signal overhead (4.41776) plus half the round trip (2.93426 + tail 0.5 x quantile
    ln 2 of one destination) later. Kernel = poll 1 + max(2 x 1.59931, that); its launch is hidden behind the pack
    kernels' (launched right after them on the same stream; test_fabric_model_proxy_host_wait)."""
    rtt = 2.93426 + 0.5 * spread_quantiles(1)[0]
    assert spread_quantiles(1)[0] == pytest.approx(math.log(2))
    want = 1.0 + max(2 * 1.59931, 1.59931 + 4.41776 + rtt / 2)
    r = predict("nvlink-h200x2", Workload(DSV3, 4096, 1, 2), _proxy(), phase="dispatch")
    assert r.phases["dispatch.counts"] == pytest.approx(want, rel=1e-9)


def test_sixteen_rank_count_words_on_the_wire() -> None:
    """Each rank sends each of the 15 others one exchange_counts word and a 16-word matrix row in dispatch, the
    16-word row again in combine: 15 x 17 x 8 + 15 x 16 x 8 = 3960 bytes more than the data and signals."""
    w = Workload(QWEN, 256, 4, 4)
    r = predict(SL, w, FIXED)
    rows = 256 * (1 - math.comb(120, 8) / math.comb(128, 8))
    data = 15 * rows * (4192 + 4096) + 2 * 15 * 8  # dispatch rows, combine rows, one signal per peer each
    assert r.bytes_on_wire == pytest.approx(data + 15 * 17 * 8 + 15 * 16 * 8, rel=1e-12)


def test_self_copy_is_rows_times_row_bytes_over_hbm() -> None:
    """At 2 ranks PE 0 keeps as many rows as it sends: DSV3_ROWS_2 x 14432 B read and written at HBM speed
    (4800 GB/s / 2) in dispatch; combine's bf16 rows (14336 B) likewise. The PUT to itself costs the proxy one
    put_us (2.81653) and its signal one signal_us (1.59931) beside the peer's, and a drain (a fence) each."""
    pr = load_preset("nvlink-h200x2")
    half_hbm = pr.get("gpu.hbm_gbps") * 1e3 / 2
    r = predict(pr, Workload(DSV3, 4096, 1, 2), _proxy())
    assert r.phases["dispatch.self_copy"] == pytest.approx(DSV3_ROWS_2 * DSV3_ROW / half_hbm, rel=1e-12)
    assert r.phases["combine.self_copy"] == pytest.approx(DSV3_ROWS_2 * 7168 * 2 / half_hbm, rel=1e-12)
    # proxy issue: 4 matrix words, then per rank (peer, self) one PUT and one signal
    assert r.phases["dispatch.proxy_issue"] == pytest.approx(4 * 1.59931 + 2 * (2.81653 + 1.59931), rel=1e-9)
    assert r.fences == 4 and r.transfers == 2  # 2 drains per phase; the self PUT does not cross the fabric


def test_combine_includes_the_reduce_kernel() -> None:
    """combine_reduce reads every returned row (2 ranks x DSV3_ROWS_2 rows of 14336 B: its own rows too) and
    writes 4096 output rows of 14336 B, at HBM speed (4800 GB/s), after a launch (4 us). The same kernel ends
    the nvlink transport's combine; the packed layout's index_add moves the same bytes (the dense layout, which the
    runtime would pick at 2 ranks, sums otherwise: test_fabric_model_dense_payload)."""
    want = 4.0 + (2 * DSV3_ROWS_2 * 14336 + 4096 * 14336) / 4800e3
    w = Workload(DSV3, 4096, 1, 2, dense=False)
    for k in (_proxy(), Knobs(transport="nvlink"), Knobs(transport="collective"), Knobs(transport="host_staged")):
        r = predict("nvlink-h200x2", w, k)
        assert r.phases["combine.reduce"] == pytest.approx(want, rel=1e-12), k.transport
        assert "dispatch.reduce" not in r.phases
        assert r.combine_us > want
    # the NCCL baseline (layout nccl_k_copies, what the calibration fits) has none of it
    base = predict("nvlink-h200x2", w, Knobs(transport="collective"), layout="nccl_k_copies")
    assert not any(k.endswith((".reduce", ".counts", ".self_copy")) for k in base.phases)


def test_proxy_combine_adds_exactly_the_reduce_after_the_exchange() -> None:
    """The reduce runs after the exchange returned: combine = exchange time + reduce (nothing overlaps it)."""
    r = predict("nvlink-h200x2", Workload(DSV3, 4096, 1, 2), _proxy(), phase="combine")
    exchange = max(r.phases["combine.ingress_bound"], r.combine_us - r.phases["combine.reduce"])
    assert r.combine_us == pytest.approx(exchange + r.phases["combine.reduce"], rel=1e-12)
    assert r.phases["combine.reduce"] > 4.0


def test_nvlink_counts_and_own_rows() -> None:
    """nvlink (csrc/ep_nvlink.cu): the count-matrix words ride in the same launch; a CTA waits for the lower
    ranks' words before writing: one NVLink latency (2 us). The own slot's 12 CTAs (24 SMs / 2 ranks) copy
    this PE's rows at min(12 x 25 GB/s, HBM / 2) = 300 GB/s beside the peers' CTAs."""
    r = predict("nvlink-h200x2", Workload(DSV3, 4096, 1, 2), Knobs(transport="nvlink"), phase="dispatch")
    assert r.phases["dispatch.counts"] == pytest.approx(2.0)
    assert r.phases["dispatch.self_copy"] == pytest.approx(DSV3_ROWS_2 * DSV3_ROW / 300e3, rel=1e-12)
    assert r.dispatch_us == pytest.approx(
        max(r.phases["dispatch.nvlink"] + 2.0, 4.0 + 2.0 + r.phases["dispatch.self_copy"]), rel=1e-12)


def test_packed_layout_counts_exchange_before_dispatch() -> None:
    """collective (runtime/buffer/_packed.py): the counts go first in an all-to-all of their own, a call with no
    payload: alpha + sync + one per-peer cost (nvlink-h200x2: 34.5655 + 1.53995 + 5.0 us); 66 int64 to the other
    rank (error word, rows, 64 rows per local expert)."""
    w = Workload(QWEN, 4096, 1, 2, dense=False)  # the packed layout (at EP 2 the runtime would pick dense)
    r = predict("nvlink-h200x2", w, Knobs(transport="collective"), phase="dispatch")
    assert r.phases["dispatch.counts"] == pytest.approx(34.5655 + 1.53995 + 5.0)
    base = predict("nvlink-h200x2", w, Knobs(transport="collective"), phase="dispatch", layout="nccl_k_copies")
    assert "dispatch.counts" not in base.phases
