"""host_staged's pieces overlap at any pipeline_depth (tests/test_fabric_model_staged_sum.py has the sums).

runtime/transports/host_staged.py `_move` posts every piece of an exchange in one library call, the sends on one
copy stream and the receives on another (send j, receive j, send j+1, ...): piece j+1 goes down to host memory while
piece j comes up, whether the pieces are staging messages (`chunk_tokens`, "double buffering inside one exchange", the
module docstring) or the blocks of different peers. The model charged the pieces one after the other unless
pipeline_depth > 1, so at the default depth 1 a staging message size only ever added copy overheads (chunk_tokens=256
predicted 4782.8 us of staging against 4242.8 with one piece per peer, pcie4-consumer-4090x4, qwen3-30b S=4096 EP 4)
and docs/fabric-model.md's "in chunks (chunk_tokens), double-buffered" did not hold."""

from __future__ import annotations

import pytest

from moetune.runtime.knobs import Knobs
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.records import Workload

PCIE = "pcie4-consumer-4090x4"
HS = Knobs(transport="host_staged")


def test_pieces_of_three_peers_overlap_at_depth_one() -> None:
    """EP 4 dense, one piece per peer: the first piece down and up, then each further piece one stage later (its
    down copy, the slower direction at 24 GB/s, plus a copy overhead), not 3 x (down + up + 2 overheads)."""
    piece = 4096 * 4192  # S slots x the 4192-byte wire row to each of 3 peers
    a, b, ov = piece / 24e3, piece / 25e3, 6.0
    r = predict(PCIE, Workload("qwen3-30b", 4096, 1, 4), HS, phase="dispatch")
    assert r.phases["dispatch.staged"] == pytest.approx((a + b + 2 * ov) + 2 * (max(a, b) + ov), rel=1e-12)


def test_a_staging_message_size_double_buffers_without_pipeline_depth() -> None:
    w = Workload("qwen3-30b", 4096, 1, 4)
    whole = predict(PCIE, w, HS).latency_us
    pieces = predict(PCIE, w, HS.replace(chunk_tokens=256)).latency_us
    assert pieces < 0.95 * whole
    # tiny pieces still pay a copy overhead each
    assert predict(PCIE, w, HS.replace(chunk_tokens=4)).latency_us > pieces
