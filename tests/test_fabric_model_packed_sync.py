"""The packed layout's count exchange and host sync in the fabric model (all MODELLED), as the runtime does them.

What the runtime does (runtime/buffer/_packed.py `_plan_packed`, runtime/buffer/facade.py `dispatch`,
runtime/pipeline.py `pipelined_moe`), for collective and host_staged:

* ONE counts exchange per dispatch call, whatever pipeline_depth: the counts tensor is [world, chunks, 2 + E/world]
  int64 (error word, rows, rows per local expert, for every chunk) and goes in one `_exchange_blocks` call, i.e. one
  NCCL all_to_all_single (CollectiveTransport.exchange_blocks; HostStagedTransport inherits it). Each peer gets
  pipeline_depth x (2 + E/world) words: the chunks' count words ride in that one message, none per chunk.
* ONE host sync per dispatch call: `.tolist()` of the counts right after that exchange, before any payload is
  posted (the chunks' all_to_all_single calls need the split sizes on the host).
* combine: no counts, no sync (it reuses the handle's counts). The tuner measures with check_inputs=False
  (tuner/measure/ep.py), which also leaves out combine's status all-gather and its sync.
* nvlink / proxy (device-resident layout): no `.tolist()` with check_inputs=False, and pipeline_depth does not
  apply (one chunk, runtime/buffer/_resident.py). The proxy's calls end in host waits (proxy_host_wait), phases
  `host_wait_counts` / `host_wait_exchange` (test_fabric_model_proxy_host_wait), not `host_sync` phases.
* These extras are the packed layout's: where `EPBuffer(dense=None)` picks the dense one (qwen3-30b at EP 2 and
  4: few rows wasted), the model leaves them out as the runtime does (`Workload(dense=None)`, the default, asks
  runtime/buffer/layout_choice.py `picks_dense`); these tests ask for the packed layout (`dense=False`).

Expected numbers are derived by hand from the preset constants (nvlink-h200x2: pcie.memcpy_us 5.0, collective
alpha 34.5655, sync 1.53995, per peer 5.0; pcie4-consumer-4090x4: host alpha 40.0, memcpy 6.0, per peer 3.0)."""

from __future__ import annotations

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.presets import load_preset
from moetune.tuner.fabric_model.records import Workload

QWEN = get_model("qwen3-30b")  # H 2048 bf16, 128 experts, top-8
H200 = "nvlink-h200x2"
NCCL_COUNTS_H200 = 34.5655 + 1.53995 + 5.0  # one all_to_all_single with next to no bytes, one peer


@pytest.mark.parametrize("transport", ["collective", "host_staged"])
def test_one_counts_exchange_per_call_whose_block_carries_every_chunk(transport: str) -> None:
    """2 ranks, 64 experts each: each chunk adds 2 + 64 = 66 int64 to the one block for the other rank; the
    exchange itself (its time) and the host sync after it are the same at every depth (one per call)."""
    w = Workload(QWEN, 4096, 1, 2, dense=False)
    r = {d: predict(H200, w, Knobs(transport=transport, pipeline_depth=d), phase="dispatch") for d in (1, 2, 4)}
    for d in (2, 4):
        assert r[d].bytes_on_wire - r[1].bytes_on_wire == pytest.approx((d - 1) * 66 * 8, abs=1e-6)
        assert r[d].phases["dispatch.counts"] == r[1].phases["dispatch.counts"]
        assert r[d].phases["dispatch.host_sync"] == r[1].phases["dispatch.host_sync"]


def test_sixteen_rank_count_blocks_on_the_wire() -> None:
    """Slingshot, 4 nodes x 4 GPUs, collective: 8 experts per rank, so a chunk's block is 2 + 8 = 10 int64 to each
    of the 15 other ranks; pipeline_depth 3 sends 15 x 3 x 10 x 8 = 3600 count bytes, depth 1 1200."""
    w = Workload(QWEN, 256, 4, 4, dense=False)
    one = predict("slingshot11-libfabric-a100x4", w, Knobs(transport="collective", pipeline_depth=1), phase="dispatch")
    three = predict("slingshot11-libfabric-a100x4", w, Knobs(transport="collective", pipeline_depth=3),
                    phase="dispatch")
    assert three.bytes_on_wire - one.bytes_on_wire == pytest.approx(3600 - 1200, abs=1e-6)


def test_packed_dispatch_waits_for_the_host_between_counts_and_payload() -> None:
    """collective, nvlink-h200x2: dispatch = the stage write + the send rows' build + the counts exchange + the host
    sync (`.tolist()` of the counts: a small device-to-host copy, pcie.memcpy_us = 5 us; the payload call's own
    launch is in its alpha) + the payload all-to-all (or the own rows' copy, the longer). Combine has neither counts
    nor sync."""
    pr = load_preset(H200)
    assert pr.get("pcie.memcpy_us") == 5.0
    r = predict(pr, Workload(QWEN, 4096, 1, 2, dense=False), Knobs(transport="collective"))
    ph = r.phases
    assert ph["dispatch.host_sync"] == 5.0
    assert ph["dispatch.counts"] == pytest.approx(NCCL_COUNTS_H200)
    before = ph["dispatch.stage"] + ph["dispatch.send_rows"]
    payload = max(ph["dispatch.collective_intra"], ph["dispatch.collective_inter"]) + ph["dispatch.per_peer"]
    assert r.dispatch_us == pytest.approx(max(payload, ph["dispatch.self_copy"]) + before + NCCL_COUNTS_H200 + 5.0,
                                          rel=1e-12)
    assert "combine.host_sync" not in ph and "combine.counts" not in ph
    payload_c = max(ph["combine.collective_intra"], ph["combine.collective_inter"]) + ph["combine.per_peer"]
    assert r.combine_us == pytest.approx(max(payload_c, ph["combine.self_copy"]) + ph["combine.reduce"], rel=1e-12)


def test_host_staged_counts_go_through_nccls_all_to_all() -> None:
    """host_staged's counts exchange is CollectiveTransport.exchange_blocks (an NCCL all_to_all_single), not its
    copy-engine staging: over NVLink the same call as the collective transport's; on a box without NVLink or
    peer-to-peer NCCL stages it through host memory: host alpha + a copy down and one up + per peer
    (pcie4-consumer-4090x4, 4 GPUs: 40 + 2 x 6 + 3 x 3 = 61 us). The host sync follows it in both."""
    w = Workload(QWEN, 4096, 1, 2, dense=False)
    hs = predict(H200, w, Knobs(transport="host_staged"), phase="dispatch")
    coll = predict(H200, w, Knobs(transport="collective"), phase="dispatch")
    assert hs.phases["dispatch.counts"] == pytest.approx(NCCL_COUNTS_H200)
    assert hs.phases["dispatch.counts"] == coll.phases["dispatch.counts"]
    pc = predict("pcie4-consumer-4090x4", Workload(QWEN, 1024, 1, 4, dense=False), Knobs(transport="host_staged"),
                 phase="dispatch")
    assert pc.phases["dispatch.counts"] == pytest.approx(40.0 + 2 * 6.0 + 3 * 3.0)
    assert pc.phases["dispatch.host_sync"] == 6.0
    # NCCL staging the collective's own counts without peer-to-peer: the same staged call
    staged = predict(H200, Workload(QWEN, 4096, 1, 2, p2p=False, dense=False), Knobs(transport="collective"),
                     phase="dispatch")
    assert staged.phases["dispatch.counts"] == pytest.approx(17.3533 + 2 * 5.0 + 5.0)


@pytest.mark.parametrize("transport", ["nvlink", "proxy"])
def test_device_resident_layout_has_no_host_sync_and_no_chunks(transport: str) -> None:
    """The one-sided transports keep every count on the GPU (no `.tolist()` with check_inputs=False; the proxy's
    host waits are phases of their own) and send one chunk whatever pipeline_depth (runtime/buffer/_resident.py):
    the prediction is the same at every depth."""
    fence = "proxy_drain" if transport == "proxy" else "none"
    w = Workload(QWEN, 4096, 1, 2)
    one = predict(H200, w, Knobs(transport=transport, fence_mode=fence))
    four = predict(H200, w, Knobs(transport=transport, fence_mode=fence, pipeline_depth=4))
    assert not any(k.endswith(".host_sync") for k in one.phases)
    assert (four.dispatch_us, four.combine_us, four.bytes_on_wire) == (one.dispatch_us, one.combine_us,
                                                                      one.bytes_on_wire)


@pytest.mark.parametrize("transport", ["collective", "host_staged"])
def test_where_the_runtime_runs_dense_there_are_no_counts_and_no_host_sync(transport: str) -> None:
    """EPBuffer(dense=None), as the tuner measures, runs the dense layout for qwen3-30b at EP 2 (0.3 % of rows
    wasted): no counts exchange, no `.tolist()`. The model asks the same rule (Workload(dense=None), the default);
    at EP 8 (a third of the rows wasted, 4096 tokens: more than 2 MB per peer) the runtime and the model go packed."""
    from moetune.runtime.buffer.layout_choice import picks_dense

    k = Knobs(transport=transport)
    auto = predict(H200, Workload(QWEN, 4096, 1, 2), k, phase="dispatch")
    packed = predict(H200, Workload(QWEN, 4096, 1, 2, dense=False), k, phase="dispatch")
    assert picks_dense(QWEN.experts, QWEN.topk, 2, 4096, 4192)
    assert not any(n.endswith((".counts", ".host_sync")) for n in auto.phases)
    assert "dispatch.counts" in packed.phases and "dispatch.host_sync" in packed.phases
    # the dense payload (every slot, test_fabric_model_dense_payload) is a little larger than the packed one here,
    # far less than the counts exchange and the sync it saves
    assert auto.dispatch_us < packed.dispatch_us - packed.phases["dispatch.counts"] / 2
    assert not picks_dense(QWEN.experts, QWEN.topk, 8, 4096, 4192)
    wide = predict("ndr-ibrc-h100x8", Workload(QWEN, 4096, 1, 8), Knobs(transport="collective"), phase="dispatch")
    assert "dispatch.counts" in wide.phases and "dispatch.host_sync" in wide.phases


def test_the_send_rows_gather_is_padded_to_every_rank() -> None:
    """The packed layout's send rows (runtime/buffer/_packed.py): twelve planning ops (4 us launches on both
    presets) and one gather whose order list is padded to S x world rows (nonzero_static: no host sync before the
    counts), read and written at HBM speed (4.8 TB/s H200, 3.35 H100), whatever share of them the routing needs:
    the phase grows with the world, not with the rows really sent. Three more ops with pipeline chunks; the stage
    write (x read, the 4192-byte wire rows written, three copies) comes before it."""
    tb = 4192
    for preset, hbm, nodes, gpus in ((H200, 4800e3, 1, 2), ("ndr-ibrc-h100x8", 3350e3, 2, 8)):
        pes = nodes * gpus
        w = Workload(QWEN, 4096, nodes, gpus, dense=False)
        r = predict(preset, w, Knobs(transport="collective"), phase="dispatch")
        want = 12 * 4.0 + 2 * 4096 * pes * tb / hbm
        assert r.phases["dispatch.send_rows"] == pytest.approx(want, rel=1e-12)
        assert r.phases["dispatch.stage"] == pytest.approx(3 * 4.0 + 4096 * (2048 * 2 + tb) / hbm, rel=1e-12)
        chunked = predict(preset, w, Knobs(transport="collective", pipeline_depth=2), phase="dispatch")
        assert chunked.phases["dispatch.send_rows"] == pytest.approx(want + 3 * 4.0, rel=1e-12)
