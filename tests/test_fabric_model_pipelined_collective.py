"""A pipelined collective payload in the fabric model (all MODELLED): the calls the runtime posts.

runtime/buffer/facade.py `dispatch` / `combine` and runtime/pipeline.py `pipelined_moe`: with pipeline_depth d
the tokens (dense: the capacity slots) are cut into d contiguous chunks of ceil(S / d), and each chunk is its own
payload call (packed: an all_to_all_single, an empty chunk too; dense: an all-gather / reduce-scatter, empty
chunks skipped), chunk c on communicator c mod channels (at most MAX_COMM_CHANNELS). One communicator runs its
calls in order; calls on different communicators overlap but share the links: bounded by the links' capacity (an
assumption, MODELLED) on the staged path, by one call's rate on direct NVLink (as measured there, 0.94x for depth 2
/ channels 2). The model reads both knobs, rather than cost one call whatever pipeline_depth and channels, and
bounds parallel calls by one call's rate on direct NVLink only, not on every path.

nvlink-h200x2 constants: collective.alpha_us 34.5655, sync_us 1.53995, per_peer_us 5.0, intra_gbps 285.194.
pcie4-consumer-4090x4 (staged, no NVLink): collective.host_alpha_us 40, per_peer_us 3, pcie.d2h_gbps 24,
h2d_gbps 25 (duplex), host_mem_gbps 180, 4 GPUs."""

from __future__ import annotations

import math

import pytest

from moetune.runtime.buffer.layout_choice import MAX_COMM_CHANNELS
from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.phases.layouts import payload_calls
from moetune.tuner.fabric_model.predict import KNOBS_READ, predict
from moetune.tuner.fabric_model.records import Workload

QWEN = get_model("qwen3-30b")  # wire row 4192 B, combine row 4096 B
H200 = "nvlink-h200x2"
ALPHA, SYNC, PEER, INTRA = 34.5655, 1.53995, 5.0, 285.194e3


def _call(nbytes: float) -> float:
    """One NCCL call to the one other GPU over NVLink (no NIC): alpha + max(handshake, bytes / rate) + per peer."""
    return ALPHA + max(SYNC, nbytes / INTRA) + PEER


def test_payload_calls_follow_the_runtime_chunks() -> None:
    assert payload_calls(4096, 1, dense=False) == [4096]
    assert payload_calls(4096, 4, dense=True) == [1024] * 4
    assert payload_calls(10, 4, dense=False) == [3, 3, 3, 1]
    # 5 tokens over 4 chunks of 2: the packed layout still posts the empty fourth chunk, the dense one skips it
    assert payload_calls(5, 4, dense=False) == [2, 2, 1, 0]
    assert payload_calls(5, 4, dense=True) == [2, 2, 1]


def test_one_channel_runs_the_chunks_one_after_the_other() -> None:
    """Dense (the runtime's rule at EP 2), depth 4, one communicator: four calls of 1024 slots x 4192 B, each with
    its own alpha and per-peer cost; four transfers (one peer, four calls)."""
    w = Workload(QWEN, 4096, 1, 2)
    r = predict(H200, w, Knobs(transport="collective", pipeline_depth=4), phase="dispatch")
    assert r.phases["dispatch.payload"] == pytest.approx(4 * _call(1024 * 4192), rel=1e-12)
    assert r.transfers == 4
    one = predict(H200, w, Knobs(transport="collective"), phase="dispatch")
    assert one.phases["dispatch.payload"] == pytest.approx(_call(4096 * 4192), rel=1e-12)
    assert one.transfers == 1


def test_channels_overlap_the_chunks_but_share_the_link() -> None:
    """Depth 4 over 2 communicators: two calls each, side by side; over 4: one each, bounded by one call moving
    every byte (the link is shared)."""
    w = Workload(QWEN, 4096, 1, 2)
    two = predict(H200, w, Knobs(transport="collective", pipeline_depth=4, channels=2), phase="combine")
    assert two.phases["combine.payload"] == pytest.approx(2 * _call(1024 * 4096), rel=1e-12)
    four = predict(H200, w, Knobs(transport="collective", pipeline_depth=4, channels=4), phase="combine")
    assert four.phases["combine.payload"] == pytest.approx(max(_call(1024 * 4096), _call(4096 * 4096)), rel=1e-12)


def test_packed_chunks_carry_their_share_of_the_rows() -> None:
    """Packed layout, depth 2, one channel: two calls, each half the rows; the counts stay one exchange. The rows
    to the other rank: 4096 tokens x P(one of 8 experts among its 64 of 128) = 1 - C(64, 8) / C(128, 8), each a
    4192-byte wire row."""
    w = Workload(QWEN, 4096, 1, 2, dense=False)
    r = predict(H200, w, Knobs(transport="collective", pipeline_depth=2), phase="dispatch")
    payload = 4096 * (1 - math.comb(64, 8) / math.comb(128, 8)) * 4192
    assert r.phases["dispatch.payload"] == pytest.approx(2 * _call(payload / 2), rel=1e-12)
    assert r.bytes_on_wire == pytest.approx(payload + 2 * 66 * 8, rel=1e-12)  # + the count block: 2 chunks x 66 int64
    assert r.transfers == 2


def test_the_model_reads_the_knobs_and_the_runtime_limit() -> None:
    from moetune.runtime.buffer import layout_choice

    assert {"pipeline_depth", "channels"} <= KNOBS_READ["collective"]
    assert MAX_COMM_CHANNELS is layout_choice.MAX_COMM_CHANNELS  # one constant, the runtime's


PCIE = "pcie4-consumer-4090x4"


def _staged_link_floor(nbytes: float) -> float:
    """pcie4-consumer-4090x4, 4 GPUs, staged: one host alpha, then the bytes out and in over the PCIe links or
    through host memory (4 GPUs write and read each byte), whichever is slower, plus 3 peers x 3 us."""
    return 40.0 + max(nbytes / 24e3, nbytes / 25e3, 4 * nbytes * 2 / 180e3) + 3 * 3.0


def test_staged_parallel_calls_are_bounded_by_the_links_not_one_call() -> None:
    """EP 4 (dense: every slot to each of the 3 peers, 4096 x 4192 B each way), depth 4 over 4 communicators: the
    four calls' copy overheads overlap and the payload takes the links' time (host memory binds here). Bounded by
    one call's rate it could not beat one call moving every byte (depth 1), and channels would never rank above
    depth 1 on this path."""
    w = Workload(QWEN, 4096, 1, 4)
    nbytes = 3 * 4096 * 4192
    four = predict(PCIE, w, Knobs(transport="collective", pipeline_depth=4, channels=4), phase="dispatch")
    assert four.phases["dispatch.link_floor"] == pytest.approx(_staged_link_floor(nbytes), rel=1e-12)
    assert four.phases["dispatch.payload"] == pytest.approx(_staged_link_floor(nbytes), rel=1e-12)
    one = predict(PCIE, w, Knobs(transport="collective"), phase="dispatch")
    assert four.dispatch_us < one.dispatch_us
    # one call is never below the floor: depth 1 is one call
    assert one.phases["dispatch.payload"] > _staged_link_floor(nbytes)


def test_staged_when_p2p_is_off_channels_pay_on_the_h200_pair() -> None:
    """nvlink-h200x2 with p2p=False (NCCL staging, runtime/pipeline.py's case for channels): depth 2 over 2
    communicators beats depth 1 in the model now (it tied before)."""
    w = Workload(QWEN, 4096, 1, 2, p2p=False)
    one = predict(H200, w, Knobs(transport="collective"))
    two = predict(H200, w, Knobs(transport="collective", pipeline_depth=2, channels=2))
    assert two.latency_us < one.latency_us


def test_direct_nvlink_parallel_calls_stay_at_one_calls_rate() -> None:
    """Direct NVLink: measured, depth 2 / channels 2 was 0.94x of depth 1 (docs/perf-notes.md, run 2c): the model
    keeps one call moving every byte as the bound there (a tie, never ahead)."""
    w = Workload(QWEN, 4096, 1, 2)
    two = predict(H200, w, Knobs(transport="collective", pipeline_depth=2, channels=2), phase="dispatch")
    assert two.phases["dispatch.payload"] == pytest.approx(_call(4096 * 4192), rel=1e-12)
