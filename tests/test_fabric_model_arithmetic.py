"""The fabric model's arithmetic at its edges: refusals where a fabric cannot do something, and
counterfactuals / link sharing that must not make a prediction cheaper than it can be. All MODELLED."""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources

import pytest

from moetune.runtime.knobs import KnobError, Knobs
from moetune.tuner.fabric_model.predict import predict, predict_transfers
from moetune.tuner.fabric_model.presets import Preset, PresetError, _parse, load_preset
from moetune.tuner.fabric_model.records import Workload


def _without(name: str, section: str) -> Preset:
    """A shipped preset with one optional section (and its sources) removed."""
    text = (resources.files("moetune.tuner.fabric_model.presets") / f"{name}.toml").read_text()
    data = tomllib.loads(text)
    del data[section]
    data["sources"] = {k: v for k, v in data["sources"].items() if not k.startswith(section + ".")}
    return _parse(data, None)


def test_nvlink_transport_is_refused_without_peer_to_peer() -> None:
    # GPU stores into a peer need P2P: with it disabled the nvlink transport cannot run (it was a number)
    w = Workload("qwen3-30b", 1024, 1, 2, p2p=False)
    with pytest.raises(KnobError, match="peer-to-peer"):
        predict("nvlink-h200x2", w, Knobs(transport="nvlink"))
    # the transports that can run without P2P still predict
    assert predict("nvlink-h200x2", w, Knobs(transport="host_staged")).latency_us > 0


def test_transfers_refuse_a_queued_transport_the_preset_cannot_post() -> None:
    # a preset file may list a transport other than its family's without that transport's section: predict
    # refused, predict_transfers failed with an AttributeError from inside the simulator
    pr = _without("nvlink-h200x2", "proxy")
    k = Knobs(transport="proxy", fence_mode="proxy_drain")
    with pytest.raises(KnobError, match="has no"):
        predict_transfers(pr, 1, 96, 4096, k, destinations=1, gpus_per_node=2)
    with pytest.raises(KnobError, match="has no"):
        predict(pr, Workload("qwen3-30b", 128, 1, 2), k)


@pytest.mark.parametrize(("preset", "section"), [("ndr-ibgda-h100x8", "ibgda"), ("ndr-ibrc-h100x8", "proxy")])
def test_a_preset_without_its_familys_section_is_refused_at_load(preset: str, section: str) -> None:
    # its own family's transport could never be modelled: refused when loaded (cb41dc4), not at the first predict
    with pytest.raises(PresetError, match=rf"needs a \[{section}\] section"):
        _without(preset, section)


@pytest.mark.parametrize("signalling", ["coupled", "decoupled"])
def test_signalled_transfers_are_never_faster_than_put_only(signalling: str) -> None:
    # put-only is the same PUTs without signals or fences; with peer_hash over 4 QPs, posting every PUT of a
    # peer on one QP while the signalled run spread them would make signalled come out faster (relative
    # throughput 1.03)
    k = Knobs(transport="proxy", signalling=signalling, group_size=1 if signalling == "decoupled" else 0,
              fence_mode="nic_ordered", qp_mapping="peer_hash", qps_per_pe=4)
    for transfers in (24, 96, 192):
        r = predict_transfers("nvlink-h200x2", 1, transfers, 4 << 20, k, destinations=12)
        assert r.time_us >= r.put_only_us
        assert r.relative_throughput <= 1.0


def test_one_staged_piece_costs_the_same_with_or_without_duplex_links() -> None:
    # one piece (one peer, no staging message size): down, then up, either way; a link that is not duplex only slows
    # the overlap of several pieces (it was counted twice: 1.86x at depth 1). Several pieces overlap at any depth
    # (tests/test_fabric_model_staged_overlap.py): sharing the link costs then, but never more than one piece after
    # the other
    pc = load_preset("pcie4-consumer-4090x4")
    params = {s: dict(t) for s, t in pc.params.items()}
    params["pcie"]["duplex"] = False
    half = dataclasses.replace(pc, params=params, name="pcie4-half-duplex")
    w = Workload("qwen3-30b", 4096, 1, 2)
    one = Knobs(transport="host_staged", pipeline_depth=1)
    assert predict(half, w, one).latency_us == pytest.approx(predict(pc, w, one).latency_us, rel=1e-9)
    w4 = Workload("qwen3-30b", 4096, 1, 4)
    pieces = one.replace(chunk_tokens=256)
    staged = [predict(x, w4, pieces, phase="dispatch").phases["dispatch.staged"] for x in (pc, half)]
    out = 3 * 4096 * 4192  # EP 4 dense: S slots of the 4192-byte wire row to each of 3 peers
    serial = out / 24e3 + out / 25e3 + 2 * 6.0 * 3 * 16  # 16 pieces of 256 rows per peer, one after the other
    assert staged[0] < staged[1] <= serial


def test_a_float32_models_expert_time_says_it_is_costed_at_the_bf16_rate() -> None:
    """The expert FFN is costed at the preset's gpu.tflops_bf16 whatever the model's dtype: for a float32 model (a
    GPU's fp32 rate is a fraction of its bf16 tensor rate) expert_us and layer_us are far too small, and nothing said
    so. The prediction's notes say it; a 16-bit model's carry no such note."""
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.fabric_model.predict import predict
    from moetune.tuner.fabric_model.records import Workload

    k = Knobs(transport="nvlink")
    f32 = predict("nvlink-h200x2", Workload(get_model("custom:2048,768,128,8,float32"), 4096, 1, 2), k)
    assert any("gpu.tflops_bf16" in n and "float32" in n for n in f32.notes), f32.notes
    for dtype in ("bfloat16", "float16"):
        r = predict("nvlink-h200x2", Workload(get_model(f"custom:2048,768,128,8,{dtype}"), 4096, 1, 2), k)
        assert not any("gpu.tflops_bf16" in n for n in r.notes), r.notes
