"""The proxy transport's host waits in the fabric model (all MODELLED), as the runtime makes them.

What the runtime does (runtime/transports/proxy.py `exchange_counts` / `exchange`, csrc/proxy_gpu.cu
`mt_pxy_counts` / `mt_pxy_exchange` -> `host_wait_done`, option `proxy_host_wait`, on by default): every call is
host-completed. The resident dispatch (runtime/buffer/_resident.py) launches the pack kernels and the counts kernel
back to back, then the host spins on the counts kernel's completion word in pinned host memory, launches the
exchange kernel and spins on its completion word. Combine launches the exchange kernel, waits for it the same way,
then launches the reduce. So per dispatch two exposed launches (pack, exchange) and two host waits; per combine two
launches (exchange, reduce) and one host wait.

A host wait is a host thread noticing a word the GPU wrote into pinned memory: the mechanism the preset's
`proxy.poll_us` prices for the proxy thread's FIFO. The model charges these waits, and no launch of its own for the
counts kernel."""

from __future__ import annotations

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.presets import load_preset
from moetune.tuner.fabric_model.records import Workload

DSV3 = get_model("deepseek-v3")
H200 = "nvlink-h200x2"  # gpu.launch_us 4, proxy.poll_us 1 (its proxy serves the other GPU)
PROXY = Knobs(transport="proxy", fence_mode="proxy_drain")


def test_proxy_phases_name_the_host_waits() -> None:
    r = predict(H200, Workload(DSV3, 4096, 1, 2), PROXY)
    assert r.phases["dispatch.host_wait_counts"] == 1.0
    assert r.phases["dispatch.host_wait_exchange"] == 1.0
    assert r.phases["combine.host_wait_exchange"] == 1.0
    assert "combine.host_wait_counts" not in r.phases  # combine has no counts call


@pytest.mark.parametrize(("param", "dispatch_per_us", "combine_per_us"), [
    ("gpu.launch_us", 2.0, 2.0),  # dispatch: pack + exchange launches; combine: exchange + reduce
    # dispatch: the proxy thread's poll in the counts kernel and in the exchange, and the two host waits;
    # combine: the exchange's poll and its host wait
    ("proxy.poll_us", 4.0, 2.0),
])
def test_dispatch_and_combine_scale_as_the_runtime_launches_and_waits(param: str, dispatch_per_us: float,
                                                                      combine_per_us: float) -> None:
    """One microsecond more per launch (per poll) adds one per exposed launch (per poll and host wait) on the
    critical path, as the proxy runtime launches and waits (not 3 launches and 2 polls per dispatch, 1 poll per
    combine)."""
    pr = load_preset(H200)
    hi = pr.with_params({param: pr.get(param) + 1.0})
    w = Workload(DSV3, 4096, 1, 2)
    a, b = predict(pr, w, PROXY), predict(hi, w, PROXY)
    assert b.dispatch_us - a.dispatch_us == pytest.approx(dispatch_per_us, abs=1e-9)
    assert b.combine_us - a.combine_us == pytest.approx(combine_per_us, abs=1e-9)


def test_ibgda_and_expert_tiles_have_no_host_wait() -> None:
    """IBGDA has no runtime transport (no proxy thread to wait for); expert_tiles is not what the runtime sends."""
    w = Workload(get_model("qwen3-30b"), 256, 2, 8)
    ib = predict("ndr-ibgda-h100x8", w, Knobs(transport="ibgda", fence_mode="nic_ordered"))
    tiles = predict("ndr-ibrc-h100x8", w, PROXY, layout="expert_tiles")
    for r in (ib, tiles):
        assert not any(".host_wait" in k for k in r.phases)
