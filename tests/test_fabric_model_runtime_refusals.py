"""Knob settings the runtime refuses for a workload are refused by the fabric model too (a KnobError naming the knob),
never predicted: a MODELLED number for a setting no run can take would be stored by `tune --backend model` and
served to a runtime that refuses it.

* fp8 scales per 128 channels need hidden % 128 == 0 (runtime/fp8.py `num_scale_groups`, EPBuffer's check_knobs
  refuses the knobs otherwise); the model rounded the groups up and predicted.
"""

from __future__ import annotations

import sys

import pytest

from moetune.runtime.knobs import KnobError, Knobs, num_scale_groups
from moetune.tuner.fabric_model.predict import Workload, predict

ODD = "custom:200,768,128,8"  # hidden 200: not a multiple of 128


@pytest.mark.parametrize(("preset", "transport", "nodes", "gpn"), [
    ("nvlink-h200x2", "collective", 1, 2), ("nvlink-h200x2", "nvlink", 1, 2),
    ("pcie4-consumer-4090x4", "host_staged", 1, 4), ("ndr-ibrc-h100x8", "proxy", 2, 8),
    ("ndr-ibgda-h100x8", "ibgda", 2, 8)])
def test_per_128_scales_on_a_hidden_not_divisible_by_128_are_refused(preset: str, transport: str, nodes: int,
                                                                      gpn: int) -> None:
    fence = {"proxy": "proxy_drain", "ibgda": "nic_ordered"}.get(transport, "none")
    k = Knobs(transport=transport, fence_mode=fence, compression="fp8_e4m3", scale_granularity="per_128")
    w = Workload(ODD, 256, nodes, gpn)
    with pytest.raises(KnobError, match="divisible by 128") as e:
        predict(preset, w, k)
    assert e.value.knobs == ("scale_granularity",)
    # per token is fine on that model, and per 128 on a hidden that is a multiple of 128
    assert predict(preset, w, k.replace(scale_granularity="per_token")).latency_us > 0
    assert predict(preset, Workload("qwen3-30b", 256, nodes, gpn), k).latency_us > 0


def test_the_scale_group_rule_is_the_runtimes_and_torch_free() -> None:
    assert num_scale_groups(2048, "per_128") == 16 and num_scale_groups(200, "per_token") == 1
    with pytest.raises(ValueError, match="divisible by 128"):
        num_scale_groups(200, "per_128")
    if "torch" not in sys.modules:  # the model's import of the rule pulls no torch in
        import moetune.tuner.fabric_model.predict  # noqa: F401

        assert "torch" not in sys.modules
