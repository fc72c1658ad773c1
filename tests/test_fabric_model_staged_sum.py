"""host_staged in the fabric model (all MODELLED), as runtime/transports/host_staged.py runs it.

* The dense combine's reduce-scatter sums the `world` blocks after each chunk's copies (reduce_scatter_async
  `finish`, once per reduce_scatter_async call, i.e. per non-empty chunk; a chunk's sum runs while later chunks'
  copies are still moving, phase `reduce_exposed` what is left past the copies): at world 2 one torch.add (2 blocks read,
  out written: 6 B per bf16 element, 1 launch); beyond, blocks[0].float() (2 read, 4 written), per further block
  b.float() (2 read, 4 written) and acc += it (8 read, 4 written), then out.copy_(acc) (4 read, 2 written):
  6 + 18 (W - 1) + 6 B per element and 2W launches. With fp32 activations .float() is the block itself (no pass):
  12 (W - 1) + 8 B and W launches. The model charged "every block read, the tokens written", once (10 B per
  element at W = 4).
* No pack kernel: the copy engines read the dense stage rows / the expert rows directly; no kernel of host_staged
  reads num_sms. The model charged a pack at num_sms x sm_copy and a launch.

Constants, pcie4-consumer-4090x4: gpu.hbm_gbps 1008, gpu.launch_us 5, pcie.d2h_gbps 24, pcie.h2d_gbps 25,
pcie.memcpy_us 6, pcie.host_mem_gbps 180 (duplex). nvlink-h200x2: gpu.hbm_gbps 4800, gpu.launch_us 4.
qwen3-30b: hidden 2048, bf16, 128 experts, top-8; dispatch wire row 4192 B. EP 2 and EP 4 run dense (the runtime's
rule)."""

from __future__ import annotations

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import ModelShape, get_model
from moetune.tuner.fabric_model.predict import KNOBS_READ, predict
from moetune.tuner.fabric_model.records import Workload

QWEN = get_model("qwen3-30b")
PCIE = "pcie4-consumer-4090x4"
HS = Knobs(transport="host_staged")
H = 2048


def test_dense_combine_sum_at_world_4_is_the_runtime_passes() -> None:
    """S=4096, EP 4, one chunk: 66 B per element over 4096 x 2048 elements at 1008 GB/s, plus 8 launches of 5 us
    (about 589 us; the model said 88)."""
    r = predict(PCIE, Workload(QWEN, 4096, 1, 4), HS, phase="combine")
    want = 8 * 5.0 + 4096 * H * 66 / 1008e3
    assert r.phases["combine.reduce"] == pytest.approx(want, rel=1e-12)
    assert 585 < want < 595
    # one call: its sum waits for all of the copies, nothing of it hidden
    assert r.phases["combine.reduce_exposed"] == pytest.approx(want, rel=1e-12)
    assert r.combine_us == pytest.approx(r.phases["combine.staged"] + want, rel=1e-12)


def test_dense_combine_sum_runs_once_per_chunk() -> None:
    """pipeline_depth 4: four reduce_scatter_async calls of 1024 slots, each its 8 launches."""
    r = predict(PCIE, Workload(QWEN, 4096, 1, 4), HS.replace(pipeline_depth=4), phase="combine")
    one = 8 * 5.0 + 1024 * H * 66 / 1008e3
    assert r.phases["combine.reduce"] == pytest.approx(4 * one, rel=1e-12)


@pytest.mark.parametrize("depth", [2, 4])
def test_a_chunks_sum_runs_while_later_chunks_copy(depth: int) -> None:
    """finish_combine waits for the calls in order, each sum queued on the compute stream while the later calls'
    copies still run on the copy engines. Call c's copies end at (c + 1) / depth of the copies' time (MODELLED,
    assumed: in proportion to the rows), its sum starts then or after the previous sum. Over PCIe each call's copies
    (about 1 ms a call at depth 4 here) outlast a sum (~151 us): only the last call's sum is past the copies."""
    r = predict(PCIE, Workload(QWEN, 4096, 1, 4), HS.replace(pipeline_depth=depth), phase="combine")
    one = 8 * 5.0 + (4096 // depth) * H * 66 / 1008e3
    copies = r.phases["combine.staged"]
    assert copies / depth > one
    assert r.phases["combine.reduce"] == pytest.approx(depth * one, rel=1e-12)
    assert r.phases["combine.reduce_exposed"] == pytest.approx(one, rel=1e-12)
    assert r.combine_us == pytest.approx(copies + one, rel=1e-12)


def test_sums_longer_than_the_copies_queue_behind_each_other() -> None:
    """With sums longer than a call's copies they run back to back from the first call's end: the exposed part is
    the first call's copies plus every sum, less the copies' time (unit numbers, the helper alone)."""
    from moetune.tuner.fabric_model.phases.layouts import _sums_past_copies

    assert _sums_past_copies(100.0, [10, 10], [80.0, 80.0]) == pytest.approx(50 + 160 - 100)
    assert _sums_past_copies(100.0, [10, 10], [5.0, 5.0]) == pytest.approx(5.0)
    assert _sums_past_copies(100.0, [30, 10], [5.0, 5.0]) == pytest.approx(5.0)
    assert _sums_past_copies(100.0, [], []) == 0.0


def test_dense_combine_sum_at_world_2_is_one_add() -> None:
    """nvlink-h200x2, EP 2: torch.add over 4096 x 2048 elements, 6 B each, one 4 us launch."""
    r = predict("nvlink-h200x2", Workload(QWEN, 4096, 1, 2), HS, phase="combine")
    assert r.phases["combine.reduce"] == pytest.approx(4.0 + 4096 * H * 6 / 4800e3, rel=1e-12)


def test_dense_combine_sum_in_fp32_has_no_conversions() -> None:
    """fp32 activations at world 4: acc is block 0 itself, 3 adds of 12 B and the copy of 8 B, 4 launches."""
    m = ModelShape(name="qwen-fp32", hidden=H, intermediate=768, experts=128, topk=8, dtype="float32")
    r = predict(PCIE, Workload(m, 4096, 1, 4, dense=True), HS, phase="combine")
    want = 4 * 5.0 + 4096 * H * (12 * 3 + 8) / 1008e3
    assert r.phases["combine.reduce"] == pytest.approx(want, rel=1e-12)


def test_dense_dispatch_is_the_stage_write_then_the_staging() -> None:
    """No pack kernel: EP 4 dense, depth 1, one piece per peer (chunk_tokens 0): 3 pieces, the first down (4096 x
    4192 B at 24 GB/s) and up (at 25 GB/s) after two 6 us copy overheads, each further one a stage later (down, the
    slower direction, and one overhead: the pieces overlap, tests/test_fabric_model_staged_overlap.py); host memory
    (4 GPUs x 2 x the bytes at 180 GB/s) binds less. Before it only the stage write (facade.py `_write_stage`: three
    copies, 5 us launches; x's 2048 bf16 read and the 4192-byte wire row written per token at 1008 GB/s); no counts,
    no send-row gather."""
    out = 3 * 4096 * 4192
    r = predict(PCIE, Workload(QWEN, 4096, 1, 4), HS, phase="dispatch")
    a, b = out / 3 / 24e3, out / 3 / 25e3
    want = (a + b + 2 * 6.0) + 2 * (a + 6.0)
    assert 4 * out * 2 / 180e3 < want
    assert r.phases["dispatch.staged"] == pytest.approx(want, rel=1e-12)
    stage = 3 * 5.0 + 4096 * (2048 * 2 + 4192) / 1008e3
    assert r.phases["dispatch.stage"] == pytest.approx(stage, rel=1e-12)
    assert "dispatch.send_rows" not in r.phases
    assert r.dispatch_us == pytest.approx(want + stage, rel=1e-12)


def test_host_staged_does_not_read_num_sms() -> None:
    assert "num_sms" not in KNOBS_READ["host_staged"]
    for dense in (True, False):
        w = Workload(QWEN, 4096, 1, 4, dense=dense)
        a = predict(PCIE, w, HS.replace(num_sms=8))
        b = predict(PCIE, w, HS.replace(num_sms=96))
        assert a.latency_us == b.latency_us
