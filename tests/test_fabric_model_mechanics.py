"""Mechanisms of the fabric model: fences, QP mapping, signals, routing, staging, compression, speed."""

from __future__ import annotations

import math
import time

import pytest

import moetune.tuner.fabric_model.queue as model_queue
from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.group_grids import expert_tiles_per_peer
from moetune.tuner.fabric_model.predict import predict, predict_transfers
from moetune.tuner.fabric_model.presets import PresetError, load_preset
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.routing import expert_inclusion, pe_loads, spread_quantiles

SLINGSHOT = "slingshot11-libfabric-a100x4"
QWEN = get_model("qwen3-30b")
DECOUPLED = Knobs(transport="proxy", signalling="decoupled", fence_mode="proxy_drain")
FIXED = Knobs(transport="proxy", signalling="decoupled", fence_mode="nic_ordered")


def test_perseus_count_96_transfers_12_fences() -> None:
    # Qwen3-30B on 4 nodes x 4 GPUs: each PE sends 8 experts to 12 remote PEs = 96 transfers -> 12 fences
    # (Perseus's tile-based kernels: layout expert_tiles; the runtime's proxy posts 12 PUTs, one per peer)
    w = Workload(QWEN, 256, 4, 4)
    r = predict(SLINGSHOT, w, DECOUPLED, phase="dispatch", layout="expert_tiles")
    assert r.transfers == 96
    assert r.fences == 12
    assert r.modelled is True


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [256, 4096])
def test_fence_count_is_transfers_over_group_size(group: int, tokens: int) -> None:
    w = Workload(QWEN, tokens, 4, 4)
    r = predict(SLINGSHOT, w, FIXED.replace(group_size=group), layout="expert_tiles")
    assert r.fences * group == r.transfers
    coupled = predict(SLINGSHOT, w, Knobs(transport="proxy", signalling="coupled", fence_mode="proxy_drain"),
                      layout="expert_tiles")
    assert coupled.fences == coupled.transfers


def test_tiles_multiply_transfers() -> None:
    # layout expert_tiles: 4096 tokens x top-8 / 128 experts = 256 tokens per expert = 2 tiles of 128
    w = Workload(QWEN, 4096, 4, 4)
    assert expert_tiles_per_peer(w) == 16
    assert predict(SLINGSHOT, w, FIXED, phase="dispatch", layout="expert_tiles").transfers == 12 * 16
    # the runtime's layout: one PUT per remote peer, whatever the tile
    assert predict(SLINGSHOT, w, FIXED, phase="dispatch").transfers == 12


def test_round_robin_nic_ordered_multi_qp_is_unsafe_never_predicted() -> None:
    w = Workload(QWEN, 256, 4, 4)
    with pytest.raises(KnobError, match="overtake"):
        predict(SLINGSHOT, w, Knobs(transport="proxy", fence_mode="nic_ordered", qp_mapping="round_robin",
                                    qps_per_pe=2))
    # one QP, or proxy_drain, is safe
    predict(SLINGSHOT, w, Knobs(transport="proxy", fence_mode="nic_ordered", qp_mapping="round_robin"))
    predict(SLINGSHOT, w, Knobs(transport="proxy", fence_mode="proxy_drain", qp_mapping="round_robin",
                                qps_per_pe=2))


def test_nonsense_is_a_clear_error() -> None:
    w = Workload(QWEN, 256, 4, 4)
    with pytest.raises(KnobError, match="does not divide"):
        predict(SLINGSHOT, w, FIXED.replace(group_size=3), layout="expert_tiles")
    with pytest.raises(ValueError, match="proxy or ibgda only"):
        predict("nvlink-h200x2", Workload(QWEN, 256, 1, 2), Knobs(transport="nvlink"), layout="expert_tiles")
    with pytest.raises(ValueError, match="tokens_per_gpu"):
        Workload(QWEN, -5, 4, 4)
    with pytest.raises(ValueError, match="do not divide evenly"):
        Workload(QWEN, 256, 3, 4)
    with pytest.raises(ValueError, match="routing"):
        Workload(QWEN, 256, 4, 4, routing="pareto")
    with pytest.raises(PresetError, match="unknown preset"):
        predict("no-such-fabric", w, FIXED)
    assert issubclass(PresetError, ValueError)
    with pytest.raises(KnobError, match="not available"):
        predict(SLINGSHOT, w, Knobs(transport="ibgda", fence_mode="nic_ordered"))
    # the runtime's one-sided rule (knobs.one_sided_world_problem), which names the count first: 16 ranks, one node
    with pytest.raises(KnobError, match="transport=nvlink serves at most 8 ranks on one node"):
        predict(SLINGSHOT, w, Knobs(transport="nvlink"))
    with pytest.raises(KnobError, match=r"transport=nvlink serves the ranks of one node.*spans 2 nodes"):
        predict(SLINGSHOT, Workload(QWEN, 256, 2, 4), Knobs(transport="nvlink"))
    with pytest.raises(ValueError, match="no network"):
        predict("pcie4-consumer-4090x4", Workload(QWEN, 256, 2, 4), Knobs(transport="host_staged"))
    with pytest.raises(ValueError, match="phase"):
        predict(SLINGSHOT, w, FIXED, phase="everything")  # type: ignore[arg-type]


def test_nic_ordering_never_stalls_the_proxy() -> None:
    w = Workload(QWEN, 256, 8, 4)
    drain = predict(SLINGSHOT, w, DECOUPLED)
    nic = predict(SLINGSHOT, w, FIXED)
    assert drain.proxy_stalls == drain.fences > 0 and drain.nic_stalls == 0
    assert nic.proxy_stalls == 0 and nic.nic_stalls == nic.fences > 0
    assert nic.latency_us < drain.latency_us


def test_fence_cost_grows_with_destinations() -> None:
    coupled = Knobs(transport="proxy", signalling="coupled", fence_mode="proxy_drain")
    per_transfer = [predict_transfers(SLINGSHOT, n, 96, 4096, coupled).time_us for n in (2, 4, 8, 16)]
    assert per_transfer == sorted(per_transfer)
    q = [max(spread_quantiles(n)) for n in (4, 28, 60)]
    assert q == sorted(q)  # the slowest of more destinations is slower


def test_signals_are_extra_messages() -> None:
    w = Workload(QWEN, 256, 4, 4)
    r = predict(SLINGSHOT, w, FIXED, phase="dispatch", layout="expert_tiles")
    payload = 96 * 16 * QWEN.hidden * 2 + 3 * 8 * 16 * QWEN.hidden * 2  # remote + NVLink peers
    assert r.bytes_on_wire == pytest.approx(payload + 96 * 8)
    # the runtime's layout: 15 peers x rows x (4096 B payload + 8 ids x 8 B + 8 weights x 4 B = 4192 B, a
    # multiple of 16), one signal per peer (12 through the proxy, 3 NVLink signal words), and the count words
    # to the 15 other ranks: exchange_counts' one each + the count-matrix row (16 words) each
    rows = 256 * (1 - math.comb(120, 8) / math.comb(128, 8))
    r = predict(SLINGSHOT, w, FIXED, phase="dispatch")
    assert r.bytes_on_wire == pytest.approx(15 * rows * 4192 + 15 * 8 + 15 * 17 * 8)


def test_fp8_halves_payload_plus_scales() -> None:
    w = Workload(QWEN, 256, 1, 4)
    k = Knobs(transport="nvlink")
    bf16 = predict("nvlink-h200x2", Workload(QWEN, 256, 1, 2), k, phase="dispatch")
    fp8 = predict("nvlink-h200x2", Workload(QWEN, 256, 1, 2), k.replace(compression="fp8_e4m3"), phase="dispatch")
    p128 = predict("nvlink-h200x2", Workload(QWEN, 256, 1, 2),
                   k.replace(compression="fp8_e4m3", scale_granularity="per_128"), phase="dispatch")
    # rows for the one peer: each token once when one of its 8 of 128 experts is there (the runtime's
    # layout); a row is payload + 8 int64 ids + 8 fp32 weights (+ fp32 scales), padded to 16 bytes
    tokens = 256 * (1 - math.comb(64, 8) / math.comb(128, 8))
    signals = bf16.bytes_on_wire - tokens * (QWEN.hidden * 2 + 96)
    # one signal slot per CTA (num_sms 24 / 2 ranks) + the count-matrix row (2 words) to the other rank
    assert signals == pytest.approx(12 * 8 + 2 * 8)
    assert fp8.bytes_on_wire - signals == pytest.approx(tokens * (QWEN.hidden + 96 + 4 + 12))  # padded
    assert p128.bytes_on_wire - signals == pytest.approx(tokens * (QWEN.hidden + 96 + QWEN.hidden / 128 * 4))
    assert fp8.dispatch_us < bf16.dispatch_us
    # combine stays bf16
    both = predict("nvlink-h200x2", Workload(QWEN, 256, 1, 2), k.replace(compression="fp8_e4m3"))
    assert both.combine_us == pytest.approx(predict("nvlink-h200x2", Workload(QWEN, 256, 1, 2), k).combine_us)
    assert w.pes == 4


def test_nvlink_has_no_proxy() -> None:
    r = predict("nvlink-h200x2", Workload(QWEN, 1024, 1, 2), Knobs(transport="nvlink"))
    assert r.fences == 0 and r.proxy_stalls == 0 and r.nic_stalls == 0
    assert r.latency_us > 0


def test_intra_node_peers_use_nvlink_not_the_proxy() -> None:
    one_node = predict(SLINGSHOT, Workload(QWEN, 256, 1, 4), FIXED)
    # nothing crosses the NIC; the proxy posts only the PUT to this PE itself (a local copy) and its signal
    assert one_node.transfers == 0 and one_node.fences == 2  # one self signal each in dispatch and combine
    assert one_node.phases["dispatch.nvlink"] > 0


def test_host_staged_double_buffering_and_fp8_help() -> None:
    w = Workload(QWEN, 4096, 1, 4)
    base = Knobs(transport="host_staged", chunk_tokens=256)
    t1 = predict("pcie4-consumer-4090x4", w, base).latency_us
    t2 = predict("pcie4-consumer-4090x4", w, base.replace(pipeline_depth=2)).latency_us
    t3 = predict("pcie4-consumer-4090x4", w, base.replace(pipeline_depth=2, compression="fp8_e4m3"),
                 phase="dispatch").dispatch_us
    d2 = predict("pcie4-consumer-4090x4", w, base.replace(pipeline_depth=2), phase="dispatch").dispatch_us
    assert t2 < t1
    assert t3 < 0.75 * d2
    # many tiny chunks pay the per-copy overhead
    tiny = predict("pcie4-consumer-4090x4", w, base.replace(chunk_tokens=4, pipeline_depth=2)).latency_us
    assert tiny > t2


def test_zipf_routing_is_deterministic_and_skewed() -> None:
    p = expert_inclusion(128, 8, 1.2)
    assert p.sum() == pytest.approx(8.0)
    assert p.max() <= 1.0 + 1e-12 and p[0] >= p[-1]
    loads = pe_loads(128, 8, 1.2, 16)
    assert loads.sum() == pytest.approx(8.0)
    w_u = Workload(QWEN, 1024, 4, 4)
    w_z = Workload(QWEN, 1024, 4, 4, routing="zipf:1.2")
    a = predict(SLINGSHOT, w_z, FIXED)
    b = predict(SLINGSHOT, w_z, FIXED)
    assert a.latency_us == b.latency_us
    assert a.latency_us > predict(SLINGSHOT, w_u, FIXED).latency_us
    assert predict(SLINGSHOT, Workload(QWEN, 1024, 4, 4, routing="zipf:0"), FIXED).latency_us == pytest.approx(
        predict(SLINGSHOT, w_u, FIXED).latency_us)


@pytest.mark.parametrize("preset,knobs", [
    (SLINGSHOT, Knobs(transport="proxy", signalling="coupled", fence_mode="proxy_drain", qps_per_pe=2)),
    (SLINGSHOT, Knobs(transport="proxy", signalling="coupled", fence_mode="proxy_drain", qp_mapping="round_robin",
                      qps_per_pe=4)),
    (SLINGSHOT, Knobs(transport="proxy", signalling="decoupled", group_size=2, fence_mode="nic_ordered",
                      qps_per_pe=2)),
    ("ndr-ibgda-h100x8", Knobs(transport="ibgda", signalling="decoupled", group_size=1, fence_mode="nic_ordered")),
    ("ndr-ibrc-h100x8", Knobs(transport="proxy", signalling="decoupled", group_size=2, fence_mode="proxy_drain",
                              qp_mapping="round_robin", qps_per_pe=4)),
    ("ndr-ibrc-h100x8", Knobs(transport="proxy", signalling="decoupled", group_size=3, fence_mode="proxy_drain",
                              qp_mapping="round_robin", qps_per_pe=2, chunk_tokens=16)),
])
@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2"])
@pytest.mark.parametrize("layout", ["expert_tiles", "runtime"])
def test_periodic_extrapolation_is_exact(preset: str, knobs: Knobs, routing: str, layout: str, monkeypatch) -> None:
    gpn = load_preset(preset).gpus_per_node
    w = Workload(QWEN, 6144, 4, gpn, routing=routing, tile=8)
    if layout == "runtime":  # ~630 rows per peer: 6-row PUTs (the smallest chunk the runtime takes at S = 6144,
        # 1024 signal slots) make long periodic runs
        knobs = knobs.replace(chunk_tokens=6)
    before = model_queue.STATS["advanced"]
    fast = predict(preset, w, knobs, layout=layout)
    assert model_queue.STATS["advanced"] > before  # the periodic shortcut was taken
    monkeypatch.setattr(model_queue, "EXTRAPOLATE", False)
    slow = predict(preset, w, knobs, layout=layout)
    assert fast.latency_us == pytest.approx(slow.latency_us, rel=1e-9)
    assert (fast.fences, fast.nic_stalls, fast.proxy_stalls, fast.transfers) == (
        slow.fences, slow.nic_stalls, slow.proxy_stalls, slow.transfers)


def test_other_models_and_custom_shapes() -> None:
    for name in ("gpt-oss-120b", "deepseek-v3", "custom:1024,512,64,4"):
        m = get_model(name)
        r = predict(SLINGSHOT, Workload(m, 512, 4, 4), FIXED)
        assert r.latency_us > 0 and r.modelled
    assert Workload("qwen3-30b", 128, 2, 4).model == QWEN


def test_predict_is_fast() -> None:
    # 16 nodes x 4 GPUs x 128 experts: <= 50 ms per prediction on a 2-core CI box (aim: a few ms)
    w = Workload(QWEN, 1024, 16, 4)
    knobs = [Knobs(transport="proxy", signalling="coupled", fence_mode="proxy_drain"), FIXED,
             Knobs(transport="collective")]
    for k in knobs:
        predict(SLINGSHOT, w, k)
    times = []
    for _ in range(5):
        for k in knobs:
            t = time.perf_counter()
            predict(SLINGSHOT, w, k)
            times.append(time.perf_counter() - t)
    times.sort()
    assert times[len(times) // 2] < 0.010
    assert times[-1] < 0.050


def test_single_box_presets_refuse_more_nodes() -> None:
    for name, gpn in (("nvlink-h200x2", 2), ("pcie4-consumer-4090x4", 4)):
        with pytest.raises(ValueError, match="no network"):
            predict(name, Workload(QWEN, 128, 2, gpn), Knobs(transport="collective"))


def test_periodic_jump_matches_full_replay_on_random_cases(monkeypatch) -> None:
    import random

    rng = random.Random(7)
    checked = 0
    while checked < 30:
        name = rng.choice([SLINGSHOT, "ndr-ibrc-h100x8", "ndr-ibgda-h100x8"])
        transport = "ibgda" if "ibgda" in name else "proxy"
        signalling = rng.choice(["coupled", "decoupled"])
        try:
            k = Knobs(transport=transport, signalling=signalling,
                      group_size=0 if signalling == "coupled" else rng.choice([0, 1, 2]),
                      fence_mode="nic_ordered" if transport == "ibgda" else rng.choice(["proxy_drain", "nic_ordered"]),
                      qp_mapping=rng.choice(["round_robin", "peer_hash"]), qps_per_pe=rng.choice([1, 2]),
                      chunk_tokens=rng.choice([0, 4, 16]), num_sms=rng.choice([1, 24]))
            w = Workload(get_model(rng.choice(["qwen3-30b", "deepseek-v3"])), rng.choice([512, 2048]),
                         rng.choice([2, 4]), load_preset(name).gpus_per_node,
                         routing=rng.choice(["uniform", "zipf:1.2"]), tile=rng.choice([8, 32]))
        except (KnobError, ValueError):
            continue
        layout = rng.choice(["runtime", "expert_tiles"])
        try:
            monkeypatch.setattr(model_queue, "EXTRAPOLATE", True)
            a = predict(name, w, k, layout=layout)
        except KnobError:  # a group size that does not divide the tile grid
            continue
        monkeypatch.setattr(model_queue, "EXTRAPOLATE", False)
        b = predict(name, w, k, layout=layout)
        assert a.latency_us == pytest.approx(b.latency_us, rel=1e-9), (name, k, w)
        assert (a.fences, a.nic_stalls, a.proxy_stalls, a.transfers) == (
            b.fences, b.nic_stalls, b.proxy_stalls, b.transfers)
        checked += 1


def test_transfer_microbenchmark_refuses_zero_gpus_per_node_and_destinations() -> None:
    """An explicit 0 is a value to refuse, not "not given": gpus_per_node=0 was silently replaced by the preset's
    GPUs per node (a number for 4 GPUs a node), and destinations=0 was blamed on nodes ("nodes >= 2")."""
    with pytest.raises(ValueError, match="gpus_per_node"):
        predict_transfers(SLINGSHOT, 2, 96, 4096, FIXED, gpus_per_node=0)
    with pytest.raises(ValueError, match="destinations must be >= 1, got 0"):
        predict_transfers(SLINGSHOT, 2, 96, 4096, FIXED, destinations=0)
    # not given: the preset's GPUs per node (4)
    assert predict_transfers(SLINGSHOT, 2, 96, 4096, FIXED).time_us == \
        predict_transfers(SLINGSHOT, 2, 96, 4096, FIXED, gpus_per_node=4).time_us


@pytest.mark.parametrize("kw", [{"transfers": 96.5}, {"transfers": True}, {"nodes": 2.5}, {"size_bytes": "4096"},
                                {"gpus_per_node": 4.0}, {"destinations": 3.5}])
def test_transfer_microbenchmark_refuses_counts_that_are_no_integers(kw: dict) -> None:
    """transfers=96.5 was spread over the destinations as 96.5 transfers (a number for no run), transfers=True as 1;
    nodes=2.5 or size_bytes="4096" failed with a TypeError from inside the model. A ValueError names the argument."""
    args = {"nodes": 2, "transfers": 96, "size_bytes": 4096, **kw}
    extra = {k: v for k, v in kw.items() if k in ("gpus_per_node", "destinations")}
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be an integer"):
        predict_transfers(SLINGSHOT, args["nodes"], args["transfers"], args["size_bytes"], FIXED, **extra)
