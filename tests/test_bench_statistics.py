"""What the benchmarks' numbers are: the statistics every timing in summary.csv is summarised by (tuner/measure/stats.py),
and which device a timed region runs on."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

from moetune.tuner.measure.stats import Summary

ROOT = Path(__file__).resolve().parents[1]


def _script(monkeypatch: pytest.MonkeyPatch, rel: str) -> ModuleType:
    """bench/<rel> imported as a module (its environment defaults land in a copy of os.environ, dropped after)."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("xs", [[float(i) for i in range(20)], [3.0, 1.0, 7.5, 2.25, 9.0, 4.0, 4.5]])
def test_proxy_micro_quantiles_are_the_shared_ones(monkeypatch: pytest.MonkeyPatch, xs: list[float]) -> None:
    # bench/proxy_micro.py took the nearest sample's rank: its p10 / p90 in summary.csv (proxy-fences, proxy-ack-cost)
    # were another statistic than every other row's (of 0..19: p10 2.0 where the others say 1.9)
    pm = _script(monkeypatch, "bench/proxy_micro.py")
    s = Summary.of(xs)
    assert pm._pct(xs, 10) == pytest.approx(s.p10) and pm._pct(xs, 90) == pytest.approx(s.p90)
    assert pm._pct(xs, 50) == pytest.approx(s.median)


RATES_OUT = "read-sum 0.0421 0.0400 0.0433 TB/s\nread-gemv 0.0310 0.0302 0.0322 TB/s\n"


@pytest.mark.parametrize(("device", "smoke", "fails"), [("device cpu\n", False, True), ("", False, True),
                                                        ("device NVIDIA_H100_80GB_HBM3\n", False, False),
                                                        ("device cpu\n", True, False)])
def test_gpu_rates_on_the_cpu_is_no_gpu_rate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str,
                                             smoke: bool, fails: bool) -> None:
    # bench/gpu_rates.py times the same work on the CPU where its process sees no CUDA device: outside a smoke run
    # those CPU rates were stored as `measured` rows of gpu-rates, stamped with the GPU the parent process saw
    from moetune.tuner.measure.scenarios import records
    from moetune.tuner.measure.scenarios.drivers import registry
    from moetune.tuner.measure.scenarios.drivers import scripts as bench_scripts

    monkeypatch.setattr(bench_scripts, "run_script", lambda script, args, env, ctx: (device + RATES_OUT, "python bench/gpu_rates.py"))
    cases = [records.Resolved(n, {"iters": 20}, {}) for n in ("read-sum", "read-gemv")]
    out = registry.DRIVERS["gpu-rates"](cases, records.Ctx(world=1, backend="none", smoke=smoke, tmp=tmp_path))
    if fails:
        assert all(not r.metrics and "no CUDA device" in r.error for r in out)
    else:
        assert [r.error for r in out] == ["", ""]
        assert out[0].metrics["read_tbps"].median == pytest.approx(0.0421) and out[0].metrics["read_tbps"].n == 20


def test_compare_knobs_makes_its_cuda_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    # compare_knobs(device="cuda:N") timed and captured on the current device's stream (bench_moe already made its
    # device current): on another GPU its events bracketed nothing the layers ran
    import contextlib

    import torch

    from moetune.runtime.knobs import Knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe_compare as MC

    entered: list[torch.device] = []
    seen: list[object] = []

    @contextlib.contextmanager
    def device(d: torch.device):  # type: ignore[no-untyped-def]
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(MC, "_compare_knobs", lambda *a, **k: seen.append((list(entered), k["dev"])) or {"cases": []})
    variants = {"base": Knobs(engine="megakernel")}
    assert MC.compare_knobs(get_model("qwen3-30b"), [1], variants, device="cuda:1") == {"cases": []}
    assert seen == [([torch.device("cuda", 1)], torch.device("cuda", 1))]
    entered.clear()
    MC.compare_knobs(get_model("qwen3-30b"), [1], variants, device="cpu")
    assert entered == []


def test_gpu_rates_samples_start_on_a_busy_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench/gpu_rates.py says its samples hold no launch gap or ramp from idle, but each began with the GPU drained by
    # the previous sample's sync: its first event waited for the first call's launch. Faked events: each sample's
    # start is recorded behind a call queued after that sync
    gr = _script(monkeypatch, "bench/gpu_rates.py")
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self) -> None:
            log.append("record")

        def synchronize(self) -> None:
            log.append("sync")

        def elapsed_time(self, other: Event) -> float:
            return 1.0

    monkeypatch.setattr(gr.torch.cuda, "Event", Event)
    monkeypatch.setattr(gr.torch.cuda, "synchronize", lambda *a: log.append("sync"))
    out = gr.timed(lambda: log.append("call"), iters=3, batch=2, warmup=1, cuda=True)
    assert out == [pytest.approx(1e-3 / 2)] * 3
    # every sample: after a sync, a call is queued before the start event is recorded
    starts = [i for i, e in enumerate(log) if e == "record"][::2]
    assert all(log[i - 1] == "call" and "sync" in log[:i] for i in starts), log


def test_runtime_host_cost_rows_hold_a_median_and_its_quantiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # bench/runtime_host_cost.py printed the mean of its 2000 calls and the scenario stored it in the median column
    # (n 1, no p10 / p90): now the calls are timed in batches, and the row holds those batch means' median, p10, p90
    from moetune.tuner.measure.scenarios import records
    from moetune.tuner.measure.scenarios.drivers import line_per_case as line_drivers
    from moetune.tuner.measure.scenarios.drivers import registry
    from moetune.tuner.measure.scenarios.drivers import scripts as bench_scripts

    hc = _script(monkeypatch, "bench/runtime_host_cost.py")
    now = [0.0]
    monkeypatch.setattr(hc.time, "perf_counter", lambda: now[0])
    xs = hc.batch_means_us(lambda: now.__setitem__(0, now[0] + 1e-6), 10, 4)  # every call 1 µs
    assert len(xs) == 4 and xs == [pytest.approx(1.0)] * 4  # 3 + 3 + 2 + 2 calls
    samples = [70.0, 71.0, 72.0, 75.0, 200.0]  # one slow batch (a context switch): the mean would be 97.6
    out = hc.line("dense_fp8_d2", samples) + "\n" + hc.line("plain", [50.0])
    monkeypatch.setattr(bench_scripts, "run_script", lambda script, args, env, ctx: (out, "python bench/runtime_host_cost.py"))
    res = {r.case: r for r in registry.DRIVERS["runtime-host-cost"]([records.Resolved("plain", {}, {}),
                                                                records.Resolved("dense-fp8-d2", {}, {})],
                                                               records.Ctx(world=1, backend="none", smoke=False, tmp=tmp_path))}
    st, want = res["dense-fp8-d2"].metrics["host_us_per_roundtrip"], Summary.of(samples)
    assert (st.median, st.p10, st.p90, st.n) == (pytest.approx(want.median, abs=0.05), pytest.approx(want.p10, abs=0.05),
                                                 pytest.approx(want.p90, abs=0.05), 5)
    # a line of the old script (a mean) is no median: the case fails rather than store it as one
    assert line_drivers._host_cost_line("plain             76.8 us/roundtrip", {}) is None


@pytest.mark.parametrize("xs", [[float(i) for i in range(10)], [0.003, 0.001, 0.0075, 0.00225, 0.009, 0.004]])
def test_daemon_load_quantiles_are_the_shared_ones(monkeypatch: pytest.MonkeyPatch, xs: list[float]) -> None:
    # bench/daemon_load.py took the sample at rank int(p * n) for its p50 / p90 / p99 and v[n // 2] for a median: of an
    # even count the upper middle sample, another statistic than every other row's (tuner/measure/stats.py)
    dl = _script(monkeypatch, "bench/daemon_load.py")
    s = Summary.of(xs)
    lat = sorted(xs)
    assert dl.latency_us(lat, 0.5) == pytest.approx(round(s.median * 1e6, 1))
    assert dl.latency_us(lat, 0.9) == pytest.approx(round(s.p90 * 1e6, 1))
    assert dl.latency_us(lat, 1.0) == pytest.approx(round(max(xs) * 1e6, 1))
    ms = dl.summarize([{"t": x * 1e3} for x in xs], "t")
    assert ms["median_ms"] == pytest.approx(round(s.median * 1e3, 2)) and ms["runs"] == len(xs)
