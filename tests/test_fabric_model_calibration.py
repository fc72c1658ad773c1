"""Calibration: the shipped nvlink-h200x2 preset against the committed 2x H200 measurements, and the
fitting machinery on data whose true parameters are known."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.calibration import calibrate, calibrated_preset, read_rows, rows_to_points
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.presets import load_preset
from moetune.tuner.fabric_model.records import Workload

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "bench/results/2026-11-30_h200x2_run11/2026-11-30_h200x2_run11_nccl_baseline_warm.jsonl"
SHARED = ROOT / "bench/results/2026-11-30_h200x2_nccl_baseline.jsonl"  # = shared/data/h200x2_baseline.jsonl
PROBE = ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl"


def test_calibrated_nvlink_h200x2_predicts_every_baseline_row() -> None:
    """The committed baseline the preset is calibrated on: run 11's warm re-measurement of the NCCL
    baseline (SHARED; 30 warm-up and 150 timed calls per row). Every row within 20%."""
    preset = load_preset("nvlink-h200x2")
    points, skipped = rows_to_points(read_rows([BASELINE]))
    assert len(points) == 48  # 3 models x 4 sizes x {bf16, fp8} x {nvlink, host_staged}
    assert not skipped
    for p in points:
        p.predicted_us = p.evaluate(preset)
        assert abs(p.rel_err) <= 0.20, (p.label, p.measured_us, p.predicted_us)


def test_calibrated_nvlink_h200x2_on_the_shared_file() -> None:
    """The shared file's latency-bound rows (S <= 1024) are not fitted: they were measured 1.2-2.6x slower than
    run 11 measured the same calls (Qwen3-30B bf16 S=128: 105.7 vs 40.4 us), beyond what any model of the call
    can bridge. Its bandwidth-bound rows (S >= 4096) agree with run 11, are fitted, and are within 20%."""
    preset = load_preset("nvlink-h200x2")
    points, _ = rows_to_points(read_rows([SHARED]))
    assert len(points) == 48
    big = [p for p in points if int(p.label.rsplit("S=", 1)[1]) >= 4096]
    assert len(big) == 24
    for p in big:
        p.predicted_us = p.evaluate(preset)
        assert abs(p.rel_err) <= 0.20, (p.label, p.measured_us, p.predicted_us)


def test_calibrated_preset_fits_the_proxy_probe() -> None:
    preset = load_preset("nvlink-h200x2")
    points, _ = rows_to_points(read_rows([PROBE]))
    assert len(points) == 20
    errs = []
    for p in points:
        p.predicted_us = p.evaluate(preset)
        errs.append(abs(p.rel_err))
    assert max(errs) <= 0.25
    assert sum(errs) / len(errs) <= 0.12


def test_baseline_rows_are_modelled_as_k_copies_collective() -> None:
    """The NCCL baseline rows sent k bare copies per token (tuner/measure/micro.py); the calibration
    describes them so (layout nccl_k_copies), while `predict` by default models the runtime's collective,
    whose packed layout sends each token once per destination rank (runtime/buffer/_packed.py)."""
    preset = load_preset("nvlink-h200x2")
    m = get_model("qwen3-30b")
    k = Knobs(transport="collective")
    r = predict(preset, Workload(m, 1024, 1, 2), k, phase="dispatch", layout="nccl_k_copies")
    assert r.bytes_on_wire == pytest.approx(1024 * 8 * 2048 * 2 / 2)  # half of the k copies are remote
    staged = predict(preset, Workload(m, 1024, 1, 2, p2p=False), k, phase="dispatch", layout="nccl_k_copies")
    assert staged.dispatch_us > 3 * r.dispatch_us
    points, _ = rows_to_points([{"probe": "nccl_a2a", "fabric": "nvlink", "model": "qwen3-30b", "S": 1024,
                                 "world": 2, "ms": 0.1}])
    assert points[0].evaluate(preset) == pytest.approx(r.dispatch_us)
    # the runtime's rows: 2048 bf16 + 8 ids x 8 B + 8 weights x 4 B = 4192 B, once to the other rank when
    # one of the token's 8 of 128 experts is there: 1 - C(64, 8) / C(128, 8)
    import math

    hit = 1 - math.comb(64, 8) / math.comb(128, 8)
    rt = predict(preset, Workload(m, 1024, 1, 2, dense=False), k, phase="dispatch")  # the packed layout
    # + the counts block to the other rank first (error word, rows, 64 rows per local expert: 66 int64)
    assert rt.bytes_on_wire == pytest.approx(1024 * hit * 4192 + 66 * 8)


def test_fit_recovers_known_parameters(tmp_path: Path) -> None:
    truth = load_preset("nvlink-h200x2").with_params(
        {"collective.alpha_us": 40.0, "collective.sync_us": 30.0, "collective.intra_gbps": 250.0})
    rows = []
    for model in ("qwen3-30b", "deepseek-v3"):
        for s in (64, 256, 1024, 4096, 16384):
            w = Workload(get_model(model), s, 1, 2)
            us = predict(truth, w, Knobs(transport="collective"), phase="dispatch",
                         layout="nccl_k_copies").dispatch_us
            rows.append({"probe": "nccl_a2a", "fabric": "nvlink", "model": model, "S": s, "world": 2, "ms": us / 1e3})
    # a fixed start (not the shipped preset's fitted values, which move with every re-calibration): the fit
    # may move each parameter within a factor 20 of where it starts
    start = load_preset("nvlink-h200x2").with_params(
        {"collective.alpha_us": 60.0, "collective.sync_us": 10.0, "collective.intra_gbps": 320.0})
    rep = calibrate(start, rows, params=["collective.alpha_us", "collective.sync_us", "collective.intra_gbps"])
    s = rep.summary()
    assert s["max_abs_rel_err"] < 0.02
    assert rep.params_after["collective.intra_gbps"] == pytest.approx(250.0, rel=0.05)
    cal = calibrated_preset(rep, ["synthetic.jsonl"], "2026-11-30")
    f = tmp_path / "cal.toml"
    f.write_text(cal.to_toml())
    again = load_preset(str(f))
    assert again.calibration["points"] == len(rows)
    assert again.sources["collective.intra_gbps"].startswith("calibrated:")


def test_bad_measurement_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_rows([tmp_path / "none.jsonl"])
    f = tmp_path / "bad.jsonl"
    f.write_text("{not json}\n")
    with pytest.raises(ValueError, match="not JSON"):
        read_rows([f])
    g = tmp_path / "unknown.jsonl"
    g.write_text('{"probe": "mystery"}\n')
    with pytest.raises(ValueError, match="no measurement rows"):
        calibrate("nvlink-h200x2", read_rows([g]))


def test_fit_transfer_microbenchmarks_recovers_proxy_cost() -> None:
    from moetune.tuner.fabric_model.predict import predict_transfers

    truth = load_preset("slingshot11-libfabric-a100x4").with_params({"proxy.put_us": 1.2, "nic.rtt_us": 6.0})
    rows = []
    for mode, sig, fm in (("coupled", "coupled", "proxy_drain"), ("fixed", "decoupled", "nic_ordered")):
        k = Knobs(transport="proxy", signalling=sig, fence_mode=fm)
        for size in (4096, 65536, 1 << 20):
            r = predict_transfers(truth, 8, 96, size, k)
            rows.append({"kind": "transfers", "nodes": 8, "transfers": 96, "size": size, "knobs": k.to_dict(),
                         "us": r.time_us, "mode": mode})
    rows.append({"kind": "transfers", "nodes": 8, "transfers": 96, "size": 4096, "put_only": True,
                 "knobs": Knobs(transport="proxy", fence_mode="proxy_drain").to_dict(),
                 "us": predict_transfers(truth, 8, 96, 4096, Knobs(transport="proxy", fence_mode="proxy_drain")).put_only_us})
    rep = calibrate("slingshot11-libfabric-a100x4", rows, params=["proxy.put_us", "nic.rtt_us"])
    assert rep.summary()["max_abs_rel_err"] < 0.02
    assert rep.params_after["proxy.put_us"] == pytest.approx(1.2, rel=0.05)


# -- fits that cannot be trusted are refused -----------------------------------------------------------------------
def _proxy_rows(truth_changes: dict[str, float]) -> list[dict]:
    """Signalled-transfer rows (two fence modes, 4 KiB..4 MiB) the slingshot preset with `truth_changes` predicts."""
    from moetune.tuner.fabric_model.predict import predict_transfers

    truth = load_preset("slingshot11-libfabric-a100x4").with_params(truth_changes)
    rows = []
    for sig, fm in (("coupled", "proxy_drain"), ("decoupled", "nic_ordered")):
        k = Knobs(transport="proxy", signalling=sig, fence_mode=fm)
        for size in (4096, 65536, 1 << 20, 1 << 22):
            rows.append({"kind": "transfers", "nodes": 8, "transfers": 96, "size": size, "knobs": k.to_dict(),
                         "us": predict_transfers(truth, 8, 96, size, k).time_us})
    return rows


def test_a_single_proxy_probe_row_is_refused() -> None:
    """One row cannot tell 7 proxy/NIC parameters apart (any one row is fitted exactly, with zero error): they keep
    the preset's values and the fit is refused, not accepted."""
    row = next(r for r in read_rows([PROBE]) if r["mode"] == "coupled_drain")
    rep = calibrate("nvlink-h200x2", [row])
    assert not rep.usable
    assert any(p.startswith("too few measured rows: 1 distinct row") for p in rep.problems), rep.problems
    assert len(rep.fitted) < 7 and rep.kept  # not 7 parameters from one number
    assert rep.to_dict()["usable"] is False and rep.to_dict()["problems"] == rep.problems
    # the same row measured again is the same experiment: no more information
    assert not calibrate("nvlink-h200x2", [row, dict(row)]).usable


def test_a_nic_bandwidth_above_the_line_rate_is_refused() -> None:
    rows = _proxy_rows({"nic.gbps": 60.0, "nic.qp_gbps": 60.0})
    params = ["nic.gbps+nic.qp_gbps", "proxy.put_us"]
    ok = calibrate("slingshot11-libfabric-a100x4", rows, params=params)
    assert ok.usable, ok.problems  # the data are consistent: only the bound refuses them below
    assert ok.params_after["nic.gbps"] == pytest.approx(60.0, rel=0.02)
    rep = calibrate("slingshot11-libfabric-a100x4", rows, params=params, nic_line_rate_gbs=25.0)  # a 200 Gb/s port
    assert not rep.usable
    assert any("nic.gbps fitted to 60" in p and "line rate 25 GB/s (200 Gb/s)" in p for p in rep.problems), rep.problems
    # within the line rate: accepted
    assert calibrate("slingshot11-libfabric-a100x4", rows, params=params, nic_line_rate_gbs=100.0).usable


def test_a_poor_fit_is_refused_naming_the_worst_rows() -> None:
    rows = [r for r in read_rows([BASELINE]) if r["fabric"] == "nvlink"]
    bad = next(r for r in rows if r["S"] == 1024 and r["model"] == "qwen3-30b" and r["probe"] == "nccl_a2a")
    bad["ms"] *= 3.0  # one outlier row
    rep = calibrate("nvlink-h200x2", rows, params=["collective.alpha_us", "collective.intra_gbps"])
    poor = [p for p in rep.problems if p.startswith("poor fit")]
    assert poor and "nccl_a2a nvlink qwen3-30b S=1024" in poor[0], rep.problems
    assert rep.worst(1)[0].label == "nccl_a2a nvlink qwen3-30b S=1024"


def test_the_committed_calibration_passes_the_checks() -> None:
    """The shipped nvlink-h200x2 preset on the 92 rows it was calibrated on (its [calibration] data): every
    check accepts it as it is, and a re-run of its calibration is accepted too."""
    from moetune.tuner.fabric_model.calibration import check_preset

    files = [BASELINE, ROOT / "bench/results/2026-11-30_h200x2_nccl_baseline_s4096plus.jsonl", PROBE]
    preset = load_preset("nvlink-h200x2")
    assert [f.name for f in files] == preset.calibration["data"]
    rows = read_rows(files)
    rep = check_preset(preset, rows)
    assert rep.usable, rep.problems
    assert len(rep.points) == preset.calibration["points"] == 92
    # parameters no committed row depends on are not claimed as fitted
    assert set(rep.kept) == {"collective.sync_us", "proxy.fence_us"}
    again = calibrate(preset, rows)
    assert again.usable, again.problems
    assert again.summary()["max_abs_rel_err"] <= 0.2
    cal = calibrated_preset(again, [f.name for f in files], "2026-11-30")
    assert "warning" not in cal.calibration and cal.calibration["kept"] == ["collective.sync_us", "proxy.fence_us"]
    assert cal.sources["proxy.fence_us"] == preset.sources["proxy.fence_us"]  # kept: its source unchanged
    # the scale the shipped file records is what a regeneration writes: its NCCL rows' world
    assert cal.calibration["world"] == preset.calibration["world"] == 2


def test_a_forced_write_carries_the_warning() -> None:
    row = next(r for r in read_rows([PROBE]) if r["mode"] == "coupled_drain")
    rep = calibrate("nvlink-h200x2", [row])
    cal = calibrated_preset(rep, ["one.jsonl"], "2026-11-30")
    assert cal.calibration["warning"].startswith("UNTRUSTED FIT") and "too few measured rows" in cal.calibration["warning"]
    assert all("untrusted fit" in cal.sources[k] for k in rep.fitted)


def test_a_one_rank_all_to_all_row_is_skipped_not_fitted() -> None:
    """An all-to-all of one rank (`world` 1) exchanges nothing: the model has no call to describe (it predicted
    gpu.launch_us whatever was measured), so the row is skipped with its reason, as every EP-1 request is refused
    elsewhere; it was fitted as a point (its S widening the [calibration] tokens range a prediction is checked
    against)."""
    row = {"probe": "nccl_a2a", "fabric": "nvlink", "model": "qwen3-30b", "S": 65536, "world": 1, "ms": 0.004}
    points, skipped = rows_to_points([row])
    assert points == []
    assert len(skipped) == 1 and "one rank" in skipped[0][1]


def test_a_proxy_probe_row_is_modelled_with_the_streams_it_measured() -> None:
    """A proxy_ce row says how many copy-engine streams (the probe's QPs, shared by every emulated peer) it ran on:
    `qps`. It was ignored, so a row measured on 1 stream was modelled on the preset's nic.shared_qps (4) and the fit
    bent the proxy's costs to make up the difference."""
    preset = load_preset("nvlink-h200x2")
    assert preset.get("nic.shared_qps") == 4
    row = {"probe": "proxy_ce", "size": 65536, "mode": "decoupled_ordered", "transfers": 96, "us": 500.0}
    # abi 18: qps streams shared by every peer (tests/test_proxy_probe_abi.py: the meaning since 19)
    (four,), _ = rows_to_points([{**row, "qps": 4, "abi": 18}])
    (one,), _ = rows_to_points([{**row, "qps": 1, "abi": 18}])
    (unsaid,), _ = rows_to_points([row])  # a row that names none: the preset's
    assert four.evaluate(preset) == unsaid.evaluate(preset)
    assert one.evaluate(preset) == pytest.approx(unsaid.evaluate(preset.with_params({"nic.shared_qps": 1})))
    assert one.evaluate(preset) != four.evaluate(preset)
    with pytest.raises(ValueError, match="qps"):
        rows_to_points([{**row, "qps": 0, "abi": 18}])


def test_a_collective_row_without_world_says_the_two_ranks_it_is_modelled_at() -> None:
    """`world` is optional in an NCCL/collective row; one that names none is modelled as an all-to-all of 2 ranks (and
    records no [calibration] world). Nothing said so: a row of an 8-GPU node without the field was fitted as 2 ranks
    with no word in the fit's table. Its label says it; a row that names its world is labelled as before."""
    row = {"probe": "nccl_a2a", "fabric": "nvlink", "model": "qwen3-30b", "S": 4096, "ms": 0.2}
    (p,), _ = rows_to_points([row])
    assert p.label == "nccl_a2a nvlink qwen3-30b S=4096 (world 2 assumed: the row names none)"
    assert p.world is None
    (q,), _ = rows_to_points([{**row, "world": 2}])
    assert q.label == "nccl_a2a nvlink qwen3-30b S=4096" and q.world == 2
    assert p.evaluate(load_preset("nvlink-h200x2")) == q.evaluate(load_preset("nvlink-h200x2"))
