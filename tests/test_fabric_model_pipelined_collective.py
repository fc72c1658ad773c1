"""A pipelined collective payload in the fabric model (all MODELLED): the calls the runtime posts.

runtime/buffer/facade.py `dispatch` / `combine` and runtime/pipeline.py `pipelined_moe`: with pipeline_depth d
the tokens (dense: the capacity slots) are cut into d contiguous chunks of ceil(S / d), and each chunk is its own
payload call (packed: an all_to_all_single, an empty chunk too; dense: an all-gather / reduce-scatter, empty
chunks skipped), chunk c on communicator c mod channels (at most MAX_COMM_CHANNELS). One communicator runs its
calls in order; calls on different communicators overlap but share the links. Before, the model costed one call
whatever pipeline_depth and channels (and did not read either knob).

nvlink-h200x2 constants: collective.alpha_us 34.5655, sync_us 1.53995, per_peer_us 5.0, intra_gbps 285.194."""

from __future__ import annotations

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import KNOBS_READ, MAX_COMM_CHANNELS, Workload, payload_calls, predict

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
    """Packed layout, depth 2, one channel: two calls, each half the rows; the counts stay one exchange."""
    w = Workload(QWEN, 4096, 1, 2, dense=False)
    r = predict(H200, w, Knobs(transport="collective", pipeline_depth=2), phase="dispatch")
    rows = r.bytes_on_wire - 2 * 66 * 8  # the count block: 2 chunks x 66 int64
    assert r.phases["dispatch.payload"] == pytest.approx(2 * _call(rows / 2), rel=1e-12)
    assert r.transfers == 2


def test_the_model_reads_the_knobs_and_the_runtime_limit() -> None:
    from moetune.runtime.buffer.facade import MAX_COMM_CHANNELS as RUNTIME_MAX

    assert {"pipeline_depth", "channels"} <= KNOBS_READ["collective"]
    assert MAX_COMM_CHANNELS == RUNTIME_MAX
