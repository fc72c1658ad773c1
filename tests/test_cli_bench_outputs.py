"""`moetune bench` and `moetune model` outputs and messages: an output that
cannot be written is refused before the run and rows that still cannot be written are kept; the summary names the
file it read; a calibration without usable rows says why; tables fit 80 columns; messages name the option."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.measure import results as R
from moetune.tuner.measure.scenarios import checkout, definitions, records, runner, summary
from moetune.tuner.measure.scenarios.drivers import moe as moe_drivers
from moetune.tuner.measure.scenarios.drivers import registry

# procfs takes no new file, for root as for anyone: a destination that cannot be written on every Linux
UNWRITABLE = Path("/proc/moetune-unwritable")


def _run(*args: str, width: int = 80):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(width)})


def _refused(r, *needles: str, code: int = 2) -> str:
    out = r.output
    assert r.exit_code == code, (r.exit_code, out, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in out
    flat = " ".join(out.split())  # a message wraps at the console's width
    for n in needles:
        assert n in flat, (n, out)
    return flat


def _fake_driver(cases, ctx) -> list[records.CaseResult]:
    """fabric-model's first metric, as its driver names it (a prediction: MODELLED in the unit)."""
    return [records.CaseResult(c.name, {"speedup[16nodes]": records.Stat(12.1, 11.9, 12.3, 3, "x MODELLED")}, "python bench/fake.py")
            for c in cases]


def _fits(out: str, width: int = 80) -> None:
    wide = [ln for ln in out.splitlines() if len(ln) > width]
    assert not wide, "\n".join(wide)


@pytest.fixture
def fast_scenario(monkeypatch: pytest.MonkeyPatch) -> definitions.Scenario:
    """fabric-model with a driver that returns at once (the scenario's own takes seconds)."""
    from moetune.tuner.cli import bench

    monkeypatch.setitem(registry.DRIVERS, "fabric-model", _fake_driver)
    real = runner.run
    monkeypatch.setattr(runner, "run", lambda *a, **k: real(*a, **{**k, "gpus": 0}))  # no CUDA query (torch import)
    monkeypatch.setattr(bench, "_fingerprint", lambda: "fp")
    return definitions.get("fabric-model")


# -- 1. an unwritable --results / --out ---------------------------------------------------------------------------
def test_unwritable_results_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def ran(*a, **k):
        raise AssertionError("the benchmark ran although its results could not be written")

    monkeypatch.setattr(runner, "run", ran)
    dest = UNWRITABLE / "s.csv"
    _refused(_run("bench", "run", "fabric-model", "--smoke", "--results", str(dest)), f"--results {dest}",
             "cannot write there")
    monkeypatch.setattr(R, "read_rows", ran)
    _refused(_run("bench", "summarize", "--out", str(UNWRITABLE)), f"--out {UNWRITABLE}", "cannot write there")


def test_unwritable_model_out_is_refused_before_the_fit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from moetune.tuner.fabric_model import calibration

    def ran(*a, **k):
        raise AssertionError("the fit ran although --out could not be written")

    monkeypatch.setattr(calibration, "read_located", ran)  # what calibrate_cmd reads the data with
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    _refused(_run("model", "calibrate", "-p", "nvlink-h200x2", "-d", str(data), "--out", str(UNWRITABLE)),
             f"--out {UNWRITABLE}", "cannot write there")


def _read_only(monkeypatch: pytest.MonkeyPatch, fail_from: int = 1) -> list[int]:
    """append_rows fails (a read-only disk) from its `fail_from`-th call on; the calls are counted."""
    calls: list[int] = []
    real = R.append_rows

    def append(path, rows, **kw):  # kw: fresh_launch, which the runner passes
        calls.append(1)
        if len(calls) >= fail_from:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path, rows, **kw)

    monkeypatch.setattr(R, "append_rows", append)
    return calls


def test_rows_that_cannot_be_written_after_the_run_are_kept(monkeypatch, tmp_path: Path, fast_scenario) -> None:
    _read_only(monkeypatch)
    dest = tmp_path / "s.csv"
    flat = _refused(_run("bench", "run", "fabric-model", "--smoke", "--results", str(dest)), f"--results {dest}",
                    "Read-only file system", "they are kept in")
    kept = list(tmp_path.glob("s.unsaved-*.csv"))
    assert len(kept) == 1 and str(kept[0]) in flat
    rows = R.read_rows(kept[0])  # a results table of its own, header first
    assert [r["case"] for r in rows] == ["presets"] and rows[0]["median"] == "12.1"
    assert not dest.exists()


def test_rows_are_printed_where_no_file_takes_them(monkeypatch, tmp_path: Path, fast_scenario) -> None:
    _read_only(monkeypatch)
    monkeypatch.setattr(R, "keep_rows", lambda path, rows: None)
    r = _run("bench", "run", "fabric-model", "--smoke", "--results", str(tmp_path / "s.csv"))
    _refused(r, "printed on stdout as CSV")
    assert ",".join(R.COLUMNS) in r.output and "fabric-model,presets," in r.output


def test_a_later_launch_that_cannot_be_written_stops_the_run(monkeypatch, tmp_path: Path, fast_scenario) -> None:
    calls = _read_only(monkeypatch, fail_from=2)
    dest = tmp_path / "s.csv"
    with pytest.raises(R.RowsNotSaved) as e:
        runner.run(fast_scenario, smoke=True, launches=3, results=dest, gpus=0, fingerprint=lambda: "fp")
    assert len(calls) == 2  # launch 3 was not run into a table that takes no rows
    msg = str(e.value)
    assert "rows of launch 2 of 3" in msg and f"launches before it are in {dest}" in msg and "launch 3 was not run" in msg
    assert e.value.kept is not None and R.read_rows(e.value.kept)[0]["launch"].endswith("-2")
    assert R.read_rows(dest)[0]["launch"].endswith("-1")


def test_an_interrupted_run_says_what_its_finished_launches_left(monkeypatch, tmp_path: Path, fast_scenario) -> None:
    """Ctrl-C in `bench run` ended with no word (Typer's bare exit 130): one line saying how many rows of the
    finished launches are in the table (the launch in progress is not), exit 130 (143 for SIGTERM), as `tune`."""
    from moetune.tuner.search.workers import Terminated

    calls: list[int] = []
    stop_at = [2]

    def driver(cases, ctx) -> list[records.CaseResult]:
        calls.append(1)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        return _fake_driver(cases, ctx)

    monkeypatch.setitem(registry.DRIVERS, "fabric-model", driver)
    dest = tmp_path / "s.csv"
    r = _run("bench", "run", "fabric-model", "--smoke", "--launches", "3", "--results", str(dest))
    assert r.exit_code == 130, (r.output, r.exception)
    flat = " ".join(r.output.split())
    assert (f"interrupted: the 1 row(s) of 1 finished launch(es) are in {dest}; the launch in progress was not "
            "saved") in flat, r.output
    assert "Aborted" not in r.output and "Traceback" not in r.output
    assert [row["launch"][-2:] for row in R.read_rows(dest)] == ["-1"]
    calls.clear()
    stop_at[0] = 1  # in the first launch: nothing appended
    fresh = tmp_path / "t.csv"
    r = _run("bench", "run", "fabric-model", "--smoke", "--results", str(fresh))
    assert r.exit_code == 130 and f"interrupted: no launch finished: nothing appended to {fresh}" in r.output, r.output
    assert not fresh.exists()

    def terminated(cases, ctx) -> list[records.CaseResult]:
        raise Terminated()

    monkeypatch.setitem(registry.DRIVERS, "fabric-model", terminated)
    r = _run("bench", "run", "fabric-model", "--smoke", "--results", str(fresh))
    assert r.exit_code == 143 and "terminated (SIGTERM): no launch finished" in r.output, r.output


# -- 2. the summary names the file it read ------------------------------------------------------------------------
def test_summary_names_the_results_file_it_read(tmp_path: Path) -> None:
    src = tmp_path / "s2.csv"
    src.write_text(",".join(R.COLUMNS) + "\n")
    r = _run("bench", "summarize", "--results", str(src), "--out", "-")
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert f"from `{src}`" in flat and f"0 rows in `{src}`" in flat
    assert "bench/results/summary.csv" not in flat and "summary.csv (" not in flat
    # the committed table's summary reads as before (BENCHMARKS.md is generated from it)
    assert "from `bench/results/summary.csv`" in summary.summarize({}, [], source=checkout.SUMMARY_CSV)


# -- 3. model calibrate without a usable row says why -------------------------------------------------------------
def test_calibrate_names_why_each_row_was_skipped(tmp_path: Path) -> None:
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    _refused(_run("model", "calibrate", "-p", "nvlink-h200x2", "--data", str(empty)), f"--data {empty}",
             "no JSON lines", "model calibrate --help")
    data = tmp_path / "a.jsonl"
    data.write_text('{"a": 1}\n\n{"probe": "zz"}\n' + '{"probe": "peer_copy"}\n' * 5)
    flat = _refused(_run("model", "calibrate", "-p", "nvlink-h200x2", "--data", str(data)), "all 7 row(s) were skipped",
                    f"{data}:1: no 'probe' field", f"{data}:3: unknown probe 'zz'", f"{data}:4: peer_copy rows",
                    "... and 2 more")
    assert f"{data}:8" not in flat  # the first five reasons, then a count


def test_calibrate_help_describes_the_row_format() -> None:
    from moetune.tuner.fabric_model.calibration import ROW_FIELDS, ROW_OPTIONAL

    r = _run("model", "calibrate", "--help", width=200)
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.replace("│", " ").split())
    for probe, fields in ROW_FIELDS.items():
        assert probe in flat, probe
        for name in (*fields, *ROW_OPTIONAL.get(probe, {})):
            assert f" {name}," in flat or f" {name} " in flat or f"{name})" in flat, (probe, name)
    assert "docs/fabric-model.md" in flat


# -- 4. tables fit 80 columns, names whole ------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["ndr-ibrc-h100x8", "slingshot11-libfabric-a100x4"])
def test_model_sweep_fits_80_columns(preset: str) -> None:
    r = _run("model", "sweep", "-p", preset, "--over", "tokens")
    assert r.exit_code == 0, r.output
    _fits(r.stdout)
    assert "16384" in r.stdout and "…" not in r.stdout
    flat = " ".join(r.stdout.split())
    assert "not shown at 80 columns: d/drain fences, d/nic fences (--json shows them)" in flat, r.stdout


def test_bench_run_table_fits_80_columns(tmp_path: Path, fast_scenario) -> None:
    r = _run("bench", "run", "fabric-model", "--smoke", "--results", str(tmp_path / "s.csv"))
    assert r.exit_code == 0, r.output
    _fits(r.stdout)
    assert "speedup[16nodes]" in r.stdout and "12.1" in r.stdout and "…" not in r.stdout


def test_a_run_stores_its_predictions_as_modelled(tmp_path: Path, fast_scenario) -> None:
    """A prediction a run makes (unit ... MODELLED) is stored with source `modelled`, never `measured`; the table's
    title does not call it measured either."""
    dest = tmp_path / "s.csv"
    r = _run("bench", "run", "fabric-model", "--launches", "1", "--results", str(dest), width=200)
    assert r.exit_code == 0, r.output
    rows = R.read_rows(dest)
    assert rows and {x["source"] for x in rows} == {"modelled"}, rows
    flat = " ".join(r.output.split())  # the title wraps at the console's width
    assert "rows appended (run here; the MODELLED ones are predictions" in flat and "(measured" not in flat, flat


def test_bench_list_keeps_every_name_whole_at_80_columns() -> None:
    import re

    r = _run("bench", "list")
    assert r.exit_code == 0, r.output
    _fits(r.stdout)
    for s in definitions.load_all().values():
        for name in (s.name, *(c.name for c in s.cases)):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", r.stdout), (name, r.stdout)
    cells = [c.strip() for ln in r.stdout.splitlines() for c in ln.split("│")[1:-1]]
    assert "," not in cells, r.stdout  # no line holding only a comma
    assert "not shown at 80 columns: driver" in " ".join(r.stdout.split())


# -- 5. messages name the option, not an internal field -------------------------------------------------------------
def test_model_workload_errors_name_the_option() -> None:
    flat = _refused(_run("model", "predict", "-p", "nvlink-h200x2", "--tokens", "0"), "--tokens must be >= 1, got 0")
    assert "tokens_per_gpu" not in flat
    _refused(_run("model", "predict", "-p", "nvlink-h200x2", "--tile", "0"), "--tile must be >= 1, got 0")
    flat = _refused(_run("model", "sweep", "-p", "nvlink-h200x2", "--over", "tokens", "--values", "0"),
                    "--values: tokens = 0", "tokens per GPU must be >= 1")
    assert "tokens_per_gpu" not in flat


def test_bench_knobs_names_the_option() -> None:
    flat = _refused(_run("bench", "knobs", "--vs", "a=mk_bn=128", "--chain", "0"), "--chain must be >= 1, got 0")
    assert "chained" not in flat
    _refused(_run("bench", "knobs", "--vs", "a=mk_bn=128", "--tokens", "0"), "--tokens must be token counts >= 1")


def test_summarize_an_empty_or_headless_csv(tmp_path: Path) -> None:
    empty = tmp_path / "e.csv"
    empty.write_text("")
    flat = _refused(_run("bench", "summarize", "--results", str(empty), "--out", "-"), f"--results {empty}",
                    "the file is empty")
    assert "None" not in flat
    blank = tmp_path / "b.csv"
    blank.write_text("\n\n")
    flat = _refused(_run("bench", "summarize", "--results", str(blank), "--out", "-"), "no header row")
    assert "header []" not in flat
    assert R.read_rows(empty) == []  # an empty table is a new one, as check_table (bench run) takes it


def test_from_report_that_is_not_json_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "report.txt"
    f.write_text("hello\n")
    flat = _refused(_run("bench", "run", "moe-megakernel-vs-unfused", "--from-report", str(f), "--results",
                         str(tmp_path / "s.csv")), f"--from-report {f}: not a JSON report", "bench moe --json")
    assert "char 0" not in flat


def test_bench_moe_checks_engine_before_timing() -> None:
    flat = _refused(_run("bench", "moe", "--engine", "nope", "--tokens", "1"), "--engine: 'nope' is not an engine",
                    "megakernel, unfused, torch")
    assert "timing" not in flat
    assert "timing" not in _refused(_run("bench", "moe", "--engine", "torch", "--tokens", "0"), "--tokens")


@pytest.mark.parametrize("engine", ["unfused,,torch", "unfused,"])
def test_bench_moe_refuses_an_empty_engine_item(engine: str) -> None:
    """`--engine unfused,,torch` dropped the empty item without a word: a lost name is a typo, as --tokens 1,,2."""
    flat = _refused(_run("bench", "moe", "--engine", engine, "--tokens", "1"), "--engine:", "(an empty item)")
    assert "timing" not in flat


def test_bench_moe_times_a_repeated_engine_or_token_count_once() -> None:
    """`--engine unfused,unfused --tokens 4,4` timed every case again: the table had each row four times."""
    r = _run("bench", "moe", "--engine", "unfused,unfused", "--model", "custom:128,64,8,2", "--tokens", "4,4",
             "--iters", "1", "--warmup", "0", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert [(c["engine"], c["S"]) for c in rep["cases"]] == [("unfused", 4)], rep["cases"]
    flat = " ".join(r.stderr.split())
    assert "--engine: unfused given 2 times, timed once" in flat and "--tokens: 4 given 2 times, timed once" in flat


def test_bench_ep_refuses_a_negative_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.testing import launch

    def ran(*a, **k):
        raise AssertionError("bench ep ran with --seed -1")

    monkeypatch.setattr(launch, "launch", ran)
    _refused(_run("bench", "ep", "--seed", "-1"), "--seed must be an integer from 0 to 4294967295")
    _refused(_run("bench", "moe", "--seed", "-1"), "--seed must be")


def test_bench_ep_refuses_more_ranks_than_it_may_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """--world 1000 on gloo must not start a thousand torch processes: at most 8 a CPU (the scenarios' rule)."""
    import os

    from moetune.runtime.testing import launch

    def ran(*a, **k):
        raise AssertionError("bench ep spawned its ranks")

    monkeypatch.setattr(launch, "launch", ran)
    too_many = str((os.cpu_count() or 1) * 8 + 1)
    for serve in ([], ["--serve"]):
        _refused(_run("bench", "ep", "--world", too_many, "--backend", "gloo", *serve),
                 f"--world {too_many}: too many ranks to spawn here")


def test_bench_moe_without_a_runnable_engine_builds_no_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA, `bench moe --engine megakernel,torch` builds nothing and refuses at once, rather than build the
    layers' weights (and time a plain read of them) for 20-75 s before saying both engines were skipped."""
    import torch

    from moetune.runtime import moe_layer
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_layer(*a: object, **k: object) -> None:
        raise AssertionError("a layer was built for engines that cannot run here")

    monkeypatch.setattr(moe_layer, "MoELayer", no_layer)
    rep = M.bench_moe(get_model("qwen3-30b"), [1], ["megakernel", "torch"], iters=1, warmup=0, rotate=1)
    assert [c["engine"] for c in rep["cases"]] == ["megakernel", "torch"]
    assert "no CUDA device" in rep["cases"][0]["skipped"] and "CUDA" in rep["cases"][1]["skipped"]
    r = _run("bench", "moe", "--engine", "megakernel,torch", "--tokens", "1", "--iters", "1", "--warmup", "0")
    assert r.exit_code == 1 and "every requested case was skipped: nothing was measured" in r.output, r.output


def test_bench_moe_makes_its_cuda_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_moe(device="cuda:N") times, captures and syncs on the current device's stream: it must make cuda:N the
    current device for the whole run (on another GPU it timed the host's launches and captured empty graphs)."""
    import contextlib

    import torch

    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    entered: list[torch.device] = []
    seen: list[object] = []

    @contextlib.contextmanager
    def device(d: torch.device):  # type: ignore[no-untyped-def]
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(M, "_bench_moe", lambda *a, **k: seen.append((list(entered), k["dev"])) or {"cases": []})
    assert M.bench_moe(get_model("qwen3-30b"), [1], ["unfused"], device="cuda:1") == {"cases": []}
    assert seen == [([torch.device("cuda", 1)], torch.device("cuda", 1))]
    entered.clear()
    M.bench_moe(get_model("qwen3-30b"), [1], ["unfused"], device="cpu")
    assert entered == []


def test_bench_moe_floors_say_whose_rates_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floors are the rates measured on the GPU model in use, and on a device with none the H200's, named as
    such: an H200's (4.2 TB/s, 790 TFLOP/s) on every device without a word would put an H100's floors out of reach
    (its HBM3 reads ~25 % slower)."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    m = get_model("qwen3-30b")
    assert M.rates_for("NVIDIA H200") == (M.H200_RATES, True)
    h100, own = M.rates_for("NVIDIA H100 80GB HBM3")
    assert own and h100.read_tbps < M.H200_RATES.read_tbps
    assert M.rates_for("cpu") == (M.H200_RATES, False)
    fake = M.GpuRates("Fake GPU 40GB", M.H200_RATES.read_tbps / 2, M.H200_RATES.tensor_tflops / 2, "test")
    # no GPU model here has rates (on a GPU machine too): the CLI below takes the H200's and says so
    monkeypatch.setattr(M, "GPU_RATES", (fake,))
    assert M.rates_for("Fake GPU 40GB") == (fake, True)
    assert M.rates_for("NVIDIA H200") == (M.H200_RATES, False)
    half, full = M.floors(m, 128, fake), M.floors(m, 128)
    assert half["weight_floor_us"] == pytest.approx(2 * full["weight_floor_us"])
    assert half["tensor_floor_us"] == pytest.approx(2 * full["tensor_floor_us"])
    assert 280 < full["weight_floor_us"] < 300  # issue 17: all 1.21 GB of weights at ~4.2 TB/s, 287-290 µs
    r = _run("bench", "moe", "--engine", "unfused", "--model", "custom:128,64,8,2", "--tokens", "4", "--iters", "1",
             "--warmup", "0", "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0 and rep["floor_rates"]["this_gpu_model"] is False, r.output
    assert rep["floor_rates"]["gpu"] == "NVIDIA H200" and rep["floor_rates"]["read_tbps"] == M.H200_RATES.read_tbps
    r = _run("bench", "moe", "--engine", "unfused", "--model", "custom:128,64,8,2", "--tokens", "4", "--iters", "1",
             "--warmup", "0")
    flat = " ".join(r.output.split())
    assert r.exit_code == 0 and "NVIDIA H200's rates (this moetune has none for this device" in flat, r.output


def test_bench_moe_plain_read_covers_the_experts_s_tokens_touch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain read beside the floors sums as many experts' weights as S tokens are expected to touch: at S=1 that is
    top-k exactly. E (1 - (1 - K/E)^S) is a float (8.000000000000004 for 72 experts, top-8; 8.000000000000014 for
    384, top-8), and its ceiling read one expert more than a token touches (9 of 8: 12 % more bytes in the floor)."""
    import math

    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    seen: list[int] = []
    orig = M.time_plain_read

    def spy(w1: Any, w2: Any, experts: int, **kw: Any) -> list[float]:
        seen.append(experts)
        return orig(w1, w2, experts, **kw)

    monkeypatch.setattr(M, "time_plain_read", spy)
    rep = M.bench_moe(get_model("custom:64,32,72,8,float32"), [1], ["unfused"], iters=1, warmup=0, rotate=1,
                      device="cpu")
    assert seen == [8] and "failed" not in rep["cases"][0]
    for spec in ("custom:64,32,72,8", "custom:64,32,384,8", "custom:64,32,96,8", "qwen3-30b", "custom:64,32,60,4"):
        m = get_model(spec)
        assert M.plain_read_experts(m, 1) == m.topk, spec
        for s in (2, 3, 16, 4096):  # never more than S tokens route to, nor than the model has
            n = M.plain_read_experts(m, s)
            assert n == min(m.experts, s * m.topk, math.ceil(M.experts_touched(m, s) - 1e-9)), (spec, s)


def test_results_rows_are_never_glued_or_swallowed(tmp_path: Path) -> None:
    """A results CSV whose last row has no newline (a hand edit) gets the newline before appending, or that row's
    note would take the next row in and the summary lose it; a row of the wrong width (an unclosed quote swallows
    every row after it) is refused, naming its line, not read as if whole."""
    row = {c: "" for c in R.COLUMNS} | {"scenario": "gpu-rates", "case": "read-sum", "baseline": "1", "position": "0",
                                        "launch": "L1", "metric": "read_tbps", "unit": "TB/s", "median": "2.5",
                                        "source": "measured", "date": "2026-12-05T00:00:00Z", "git_sha": "a" * 40}
    f = tmp_path / "r.csv"
    R.append_rows(f, [row])
    f.write_bytes(f.read_bytes().rstrip(b"\n"))
    R.append_rows(f, [row | {"launch": "L2", "median": "2.6"}])
    assert [(r["launch"], r["median"], r["note"]) for r in R.read_rows(f)] == [("L1", "2.5", ""), ("L2", "2.6", "")]
    # a whole row after it: at the very end, with nothing after it, such a row reads as the cut tail of an append a
    # kill stopped (test_crash_kill9.py), left out and cut by the next append
    f.write_text(f.read_text() + 'gpu-rates,read-sum,1,0,L3,read_tbps,TB/s,"2.7\n'
                 + R._csv_text([row | {"launch": "L4"}], header=False))
    with pytest.raises(R.ResultsError, match="line 5 does not have the 27 columns"):
        R.read_rows(f)
    with pytest.raises(R.ResultsError, match="does not have the 27 columns"):
        R.append_rows(f, [row])  # refused before anything is appended after it
    r = _run("bench", "summarize", "--results", str(f), "--out", "-")
    assert r.exit_code == 2 and "does not have the 27 columns" in r.output and "Traceback" not in r.output


def test_summarize_leaves_the_old_file_whole_when_the_write_fails(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench summarize --out` renames a temporary file into place: a failed write (a full disk) leaves the old
    file as it was, not a truncated BENCHMARKS.md."""
    import os

    out = tmp_path / "B.md"
    out.write_text("# moetune benchmarks\n\nold summary\n")  # one it wrote: replaced (a file not its own is refused)

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    r = _run("bench", "summarize", "--out", str(out))
    assert r.exit_code != 0 and "No space left on device" in r.output, r.output
    assert out.read_text() == "# moetune benchmarks\n\nold summary\n" and [p.name for p in tmp_path.iterdir()] == ["B.md"]


def test_summarize_never_replaces_a_file_it_did_not_write(tmp_path: Path) -> None:
    """`bench summarize --out README.md` replaced the user's file with the summary, exit 0: an existing file is
    replaced only where its first line is the summary's title (BENCHMARKS.md regenerated), or it is empty."""
    results = tmp_path / "s.csv"
    results.write_text(",".join(R.COLUMNS) + "\n")
    notes = tmp_path / "README.md"
    notes.write_text("# my notes\n\nnothing to lose\n")
    _refused(_run("bench", "summarize", "--results", str(results), "--out", str(notes)), f"--out {notes}",
             "not written by `moetune bench summarize`", "not replaced")
    assert notes.read_text() == "# my notes\n\nnothing to lose\n"
    ours, empty = tmp_path / "B.md", tmp_path / "E.md"
    ours.write_text("# moetune benchmarks\n\nold\n")
    empty.write_text("")
    for path in (ours, empty):
        r = _run("bench", "summarize", "--results", str(results), "--out", str(path))
        assert r.exit_code == 0, r.output
        assert path.read_text().startswith("# moetune benchmarks\n\nGenerated by")


def test_bench_names_and_reports_of_the_wrong_shape_are_refused_clearly(tmp_path: Path) -> None:
    """A scenario name is a name (`../scenarios/x` must not load a TOML from anywhere), and a hand-made report whose
    cases lack keys, or that holds no number, is refused by name (not a KeyError / AttributeError traceback, nor an
    all-null report taken in as rows of "-")."""
    r = _run("bench", "run", "../scenarios/gpu-rates", "--smoke", "--results", str(tmp_path / "r.csv"))
    assert r.exit_code == 2 and "no scenario '../scenarios/gpu-rates'" in r.output
    meta = {"date": "2026-12-05T00:00:00Z", "git_sha": "a" * 40, "git_dirty": False, "moetune": "0", "torch": "2",
            "nccl": "", "cuda": "", "gpu": "g", "gpu_count": 1, "fabric_fingerprint": "f", "hardware": "h",
            "command": "moetune bench moe"}
    base = {"model": "qwen3-30b", "iters": 50, "warmup": 10, "rotate": 4, "graph": True, "rest_s": 0.0, "seed": 0,
            "meta": meta}
    q = {"median": None, "p10": None, "p90": None}
    for cases, said in ((["a"], "expected shape"), ([{"S": 1}], "expected shape"),
                        ([{"engine": e, "S": s, "eager_us": q, "graph_us": q} for e in ("unfused", "megakernel", "torch")
                          for s in (1, 16, 128, 1024, 4096)], "holds no measured number")):
        f = tmp_path / "rep.json"
        f.write_text(json.dumps({**base, "cases": cases}))
        r = _run("bench", "run", "moe-megakernel-vs-unfused", "--from-report", str(f), "--results",
                 str(tmp_path / "r.csv"))
        assert r.exit_code == 2 and said in " ".join(r.output.split()) and "Traceback" not in r.output, r.output
    assert not (tmp_path / "r.csv").exists()


class _TimedOutMegakernel:
    """Stands in for MegakernelMoE on the CPU: forwards return at once (as launches that abort do) and `check` raises
    the device-side error record of a wait that timed out."""

    def __init__(self, model: object, **kw: object) -> None:
        self.kw = kw

    def forward(self, x: Any) -> Any:
        return x.new_zeros(x.shape)

    def rebind(self, *args: object) -> None:
        pass

    def check(self) -> None:
        from moetune.runtime.megakernel.layer import MegakernelError

        raise MegakernelError("megakernel error 1: scheduler timed out waiting for a task's inputs (where=3)")


def _timed_out_megakernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from moetune.runtime.megakernel import engine as E

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(E, "megakernel_problem", lambda device, dtype=None, model=None: None)
    monkeypatch.setattr(E, "build_megakernel", _TimedOutMegakernel)


TINY_MODEL = "custom:128,64,4,2"


def test_bench_moe_reports_a_megakernel_error_as_a_failed_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench moe reads the megakernel's error record: a case whose launches timed out (and returned at once) fails
    rather than make a timing row, is not run again at later S, and the command exits 1 naming it."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M

    _timed_out_megakernel(monkeypatch)
    rep = M.bench_moe(get_model(TINY_MODEL), [1, 2], ["unfused", "megakernel"], iters=1, warmup=0, rotate=1)
    rows = {(c["engine"], c["S"]): c for c in rep["cases"]}
    assert "eager_us" in rows[("unfused", 1)] and "eager_us" in rows[("unfused", 2)]
    assert "scheduler timed out" in rows[("megakernel", 1)]["failed"] and "eager_us" not in rows[("megakernel", 1)]
    assert rows[("megakernel", 2)] == {"engine": "megakernel", "S": 2,
                                       "failed": "not run: its launches failed at S=1"}
    for extra in ((), ("--json",)):
        r = _run("bench", "moe", "--engine", "unfused,megakernel", "--model", TINY_MODEL, "--tokens", "1", "--iters",
                 "1", "--warmup", "0", *extra)
        flat = _refused(r, "megakernel S=1 failed:", "scheduler timed out", "a case failed", code=1)
        assert "unfused" in flat


def test_bench_knobs_reports_a_megakernel_error_as_a_failed_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for `bench knobs` (compare_knobs): a variant whose launches reported an error is a failed case, not a
    timing row beside the base."""
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe_compare as MC

    _timed_out_megakernel(monkeypatch)
    variants = {"base": Knobs(engine="unfused"), "mk": Knobs(engine="megakernel")}
    rep = MC.compare_knobs(get_model(TINY_MODEL), [1, 2], variants, iters=1, warmup=0, rotate=1, chained=1)
    rows = {(c["variant"], c["S"]): c for c in rep["cases"]}
    assert "single_us" in rows[("base", 1)] and "single_us" in rows[("base", 2)]
    assert "scheduler timed out" in rows[("mk", 1)]["failed"] and "single_us" not in rows[("mk", 1)]
    assert rows[("mk", 2)]["failed"] == "not run: its launches failed at an earlier S"
    rep = MC.compare_knobs(get_model(TINY_MODEL), [1, 2], {"mk": variants["mk"], "un": variants["base"]}, iters=1,
                           warmup=0, rotate=1, chained=1)
    rows = {(c["variant"], c["S"]): c for c in rep["cases"]}
    assert "failed" in rows[("mk", 1)] and "minus_base_us" not in rows[("un", 1)]  # no difference to a failed base
    assert rows[("un", 2)]["failed"] == "not run: the base's launches failed at an earlier S"
    r = _run("bench", "knobs", "--knobs", "engine=unfused", "--vs", "mk=engine=megakernel", "--model", TINY_MODEL,
             "--tokens", "1", "--iters", "1", "--warmup", "0", "--rotate", "1", "--chain", "1")
    _refused(r, "mk S=1 failed:", "scheduler timed out", "a case failed", code=1)


def test_bench_knobs_never_rebases_onto_another_variant_when_the_base_is_skipped(tmp_path: Path) -> None:
    """The megakernel base cannot run here (a CPU; on a GPU, this shape): the variants are timed with no difference
    to the skipped base, each row says why, the command exits 1 saying so, and the scenario stores those differences
    as FAILED. Taking the next variant as the base would make u2's "minus base" u2 - u1 while stderr says the base
    is engine=megakernel."""
    from moetune.runtime.knobs import Knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe_compare as MC

    model = "custom:64,32,8,2"
    variants = {"base": Knobs(engine="megakernel"), "u1": Knobs(engine="unfused"), "u2": Knobs(engine="unfused")}
    rep = MC.compare_knobs(get_model(model), [4], variants, iters=2, warmup=0, rotate=1, chained=1)
    assert rep["base"] == "base"
    rows = {c["variant"]: c for c in rep["cases"]}
    # skipped everywhere: on a CPU for want of a CUDA device, on a GPU for the shape (hidden 64: not a multiple of 128)
    assert "megakernel" in rows["base"]["skipped"] or "no CUDA device" in rows["base"]["skipped"], rows["base"]
    for n in ("u1", "u2"):
        assert "single_us" in rows[n] and "minus_base_us" not in rows[n] and "chain_minus_base_us" not in rows[n]
        assert rows[n]["no_difference"].startswith("no difference to the base at S=4: the base variant 'base' was "
                                                   "skipped (")
    r = _run("bench", "knobs", "--model", model, "--tokens", "4", "--vs", "u1=engine=unfused;u2=engine=unfused",
             "--iters", "2", "--warmup", "0", "--rotate", "1", "--chain", "1", width=200)
    _refused(r, "base skipped:", "error: no difference to the base at S=4: the base variant 'base' was skipped", code=1)
    out = moe_drivers.run_moe_knobs([records.Resolved("base", {"model": model, "tokens": [4], "iters": 2, "warmup": 0, "rotate": 1,
                                                "chain": 1}, {}),
                                     records.Resolved("u1", {"knobs": "engine=unfused"}, {}),
                                     records.Resolved("u2", {"knobs": "engine=unfused"}, {})],
                                    records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path))
    by = {c.case: c for c in out}
    assert by["base"].error.startswith("SKIPPED:")
    import torch

    single = "graph_us[S=4]" if torch.cuda.is_available() else "layer_us[S=4]"  # single calls: replays on a GPU
    for n in ("u1", "u2"):
        assert single in by[n].metrics and "minus_base_us[S=4]" not in by[n].metrics
        assert "the base variant 'base' was skipped" in by[n].failed["minus_base_us[S=4]"]
        assert "the base variant 'base' was skipped" in by[n].failed["chain_minus_base_us[S=4]"]


def test_moe_scenario_cases_with_a_failed_row_fail() -> None:
    rep = {"iters": 1, "cases": [{"engine": "unfused", "S": 1, "eager_us": {"median": 1.0, "p10": 1.0, "p90": 1.0}},
                                 {"engine": "megakernel", "S": 1, "failed": "megakernel error 1: timed out"},
                                 {"engine": "torch", "skipped": "no CUDA"}]}
    per, why = moe_drivers.per_case(rep, "engine", (("eager_us", "layer_us"),))
    assert set(per) == {"unfused"}
    assert why == {"megakernel": "S=1 failed: megakernel error 1: timed out", "torch": "SKIPPED: no CUDA"}


def test_bench_ep_says_it_runs_while_its_ranks_work() -> None:
    """`bench ep` printed nothing until its ranks reported (98 s at the README's example on 2 CPUs): a progress line
    on stderr when it starts and ends (a "still running" line meanwhile), stdout's --json untouched."""
    r = _run("bench", "ep", "--world", "2", "--backend", "gloo", "--model", "custom:64,32,8,2", "--tokens", "4",
             "--iters", "1", "--warmup", "0", "--json")
    assert r.exit_code == 0, r.output
    assert "dispatch_us" in json.loads(r.stdout)
    assert "bench ep: 2 gloo rank(s), 1 round trip(s) per phase: started" in r.stderr, r.stderr
    assert "1/1 done" in r.stderr


@pytest.mark.parametrize("command", ["ep", "moe", "knobs"])
def test_an_interrupted_benchmark_says_nothing_was_printed(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """Ctrl-C in `bench ep`, `bench moe` or `bench knobs` ended with no word (Typer's bare exit 130), and SIGTERM
    killed them: one line saying the report (printed only at the end) was not printed, exit 130 (143 for SIGTERM),
    as `bench run` and `tune`."""
    from moetune.runtime.testing import launch
    from moetune.tuner.measure import moe as M
    from moetune.tuner.measure import moe_compare as MC
    from moetune.tuner.search.workers import Terminated

    raised: list[type[BaseException]] = [KeyboardInterrupt]

    def stop(*_a: object, **_k: object) -> None:
        raise raised[0]()

    where = {"ep": (launch, "launch"), "moe": (M, "bench_moe"), "knobs": (MC, "compare_knobs")}[command]
    monkeypatch.setattr(*where, stop)
    args = {"ep": ["--world", "2", "--backend", "gloo", "--model", TINY_MODEL, "--tokens", "4", "--iters", "1"],
            "moe": ["--engine", "unfused", "--model", TINY_MODEL, "--tokens", "1", "--iters", "1"],
            "knobs": ["--vs", "ct8=mk_combine_tokens=8", "--model", TINY_MODEL, "--tokens", "1", "--iters", "1"]}[command]
    said = {"ep": "the benchmark was stopped and its 2 rank process(es) ended; no report printed",
            "moe": "the timing was stopped; no table printed (it comes once every case is timed)",
            "knobs": "the comparison was stopped; no table printed (it comes once every case is timed)"}[command]
    for raised[0], code, who in ((KeyboardInterrupt, 130, "interrupted"), (Terminated, 143, "terminated (SIGTERM)")):
        r = _run("bench", command, *args, width=200)
        assert r.exit_code == code, (r.output, r.exception)
        assert f"{who}: {said}" in r.stderr, r.output
        assert "Aborted" not in r.output and "Traceback" not in r.output and r.stdout == ""
    if command != "ep":  # --json: the report is the one not printed
        r = _run("bench", command, *args, "--json", width=200)
        assert r.exit_code == 143 and "no JSON report printed" in r.stderr and r.stdout == "", r.output


def _ep_report(roundtrip_rel_err: float) -> dict[str, Any]:
    """What `bench ep`'s rank 0 reports (tuner/measure/ep.py bench_case), its round trip's error as given."""
    q = {"median": 50.0, "p10": 49.0, "p90": 52.0}
    return {"dispatch_us": q, "combine_us": q, "roundtrip_us": q, "layer_us": None, "dispatch_host_us": q,
            "combine_host_us": q, "roundtrip_host_us": q, "graph_roundtrip_us": None, "graph_error": None,
            "graph_roundtrip_rel_err": None, "graph_pair_us": None, "graph_pair_error": None,
            "graph_pair_rel_err": None, "max_rel_err": None, "roundtrip_rel_err": roundtrip_rel_err,
            "roundtrip_bound": 0.03, "verify_bound": None, "impl": "moetune", "world": 2, "backend": "gloo",
            "model": "custom", "tokens": 4, "routing": "uniform", "layout": "dense",
            "knobs": {"transport": "collective", "compression": "none", "pipeline_depth": 1}}


def test_bench_ep_fails_a_wrong_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench ep` checks the round trip's error, not only --verify's layer error: a round trip that moved nothing
    (relative error 1 against a bound of 0.03) exits 1 saying why, as the tuner's trials and the ep scenario fail it
    (outputs.ep_report_problem); the table shows the round trip's error and bound."""
    from moetune.runtime.testing import launch

    got = [_ep_report(1.0)]
    monkeypatch.setattr(launch, "launch", lambda *a, **k: [got[0]])
    args = ["bench", "ep", "--world", "2", "--backend", "gloo", "--model", TINY_MODEL, "--tokens", "4", "--iters", "1"]
    r = _run(*args, width=200)
    assert r.exit_code == 1, r.output
    assert "FAILED: wrong output: the round trip (dispatch, identity experts, combine): relative error 1 exceeds its " \
           "bound 0.03; its timings are no measurement" in " ".join(r.stderr.split()), r.stderr
    assert "round trip: max relative error 1 (bound 0.03)" in r.stdout, r.stdout
    r = _run(*args, "--json", width=200)
    assert r.exit_code == 1 and json.loads(r.stdout)["roundtrip_rel_err"] == 1.0 and "wrong output" in r.stderr
    got[0] = _ep_report(0.001)
    r = _run(*args, width=200)
    assert r.exit_code == 0 and "round trip: max relative error 0.001 (bound 0.03)" in r.stdout, r.output
    assert "FAILED" not in r.output


def test_bench_ep_table_shows_every_output_the_verdict_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table and outputs.ep_report_problem iterate over one list (outputs.EP_CHECKS): every check has a label
    shown beside its error and bound, and an error the verdict fails for not being a number is shown too."""
    from moetune.runtime.testing import launch
    from moetune.tuner.measure.outputs import EP_CHECKS, ep_report_problem

    rep = _ep_report(0.001) | {"graph_roundtrip_rel_err": 0.002, "graph_pair_rel_err": 0.5, "max_rel_err": 0.004,
                               "verify_bound": 0.05}
    got = [rep]
    monkeypatch.setattr(launch, "launch", lambda *a, **k: [got[0]])
    args = ["bench", "ep", "--world", "2", "--backend", "gloo", "--model", TINY_MODEL, "--tokens", "4", "--iters", "1"]
    r = _run(*args, width=200)
    assert r.exit_code == 1, r.output
    for err_key, bound_key, label, _what in EP_CHECKS:
        assert f"{label}: max relative error {rep[err_key]:.3g} (bound {rep[bound_key]:.3g})" in r.stdout, r.stdout
    why = ep_report_problem(rep)
    assert why is not None and "dispatch + combine replayed from a CUDA graph" in why
    got[0] = _ep_report(0.001) | {"graph_pair_rel_err": "nan?"}
    r = _run(*args, width=200)
    assert r.exit_code == 1 and "not a checked number" in r.stderr.replace("\n", " "), r.output
    assert "dispatch + combine (CUDA graph): max relative error 'nan?' (bound 0.03): not a checked number" in r.stdout


def test_bench_moe_raises_a_warmup_below_rotate_so_no_input_has_its_first_call_timed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench moe --warmup 0` (or any warm-up below --rotate) timed the first eager call of every rotated input the
    warm-up did not reach. The warm-up is now raised to --rotate with a note, and the report and its stamped command
    say the warm-up that ran."""
    import torch

    from moetune.tuner.measure import moe as M

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real, seen = M.time_calls, []

    def spy(fns: Any, *, warmup: int, iters: int, cuda: bool) -> list[float]:
        seen.append((warmup, len(fns)))
        return real(fns, warmup=warmup, iters=iters, cuda=cuda)

    monkeypatch.setattr(M, "time_calls", spy)
    r = CliRunner().invoke(app, ["bench", "moe", "--engine", "unfused", "--model", TINY_MODEL, "--tokens", "4",
                                 "--iters", "1", "--warmup", "1", "--rotate", "3", "--json"])
    assert r.exit_code == 0, r.output
    assert "--warmup 1 is below --rotate 3: raised to 3" in r.stderr.replace("\n", " ")
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["warmup"] == 3 and "--warmup 3 --rotate 3" in rep["meta"]["command"]
    assert seen and all(w >= n for w, n in seen), seen  # every timed input had an untimed call first


def test_every_caller_of_the_moe_timings_raises_a_warmup_below_rotate(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """The rule of `bench moe` (a warm-up below the rotation is raised to it, with a note) is bench_moe's and
    compare_knobs' own (moe.warmup_for), not the CLI's only: the `moe` scenario driver calls bench_moe directly, and
    `bench knobs` and the `moe-knobs` driver (compare_knobs) rotate their inputs the same way. Their reports say the
    raised warm-up and the note, the drivers' rows carry the note and `bench knobs` prints it."""
    import torch

    from moetune.runtime.knobs import Knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.measure import moe as M
    from moetune.tuner.measure import moe_compare as MC

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen: list[tuple[int, int]] = []
    calls, rounds = M.time_calls, MC.time_interleaved

    def spy_calls(fns: Any, *, warmup: int, iters: int, cuda: bool) -> list[float]:
        seen.append((warmup, len(fns)))
        return calls(fns, warmup=warmup, iters=iters, cuda=cuda)

    def spy_rounds(fns: Any, *, warmup: int, iters: int, cuda: bool) -> dict[str, list[float]]:
        seen.append((warmup, max(map(len, fns.values()))))
        return rounds(fns, warmup=warmup, iters=iters, cuda=cuda)

    monkeypatch.setattr(M, "time_calls", spy_calls)
    monkeypatch.setattr(MC, "time_interleaved", spy_rounds)
    note = "--warmup 1 is below --rotate 3: raised to 3, one untimed call per rotated input"
    rep = M.bench_moe(get_model(TINY_MODEL), [4], ["unfused"], iters=1, warmup=1, rotate=3)
    assert rep["warmup"] == 3 and rep["warmup_note"] == note, rep
    variants = {"base": Knobs(engine="unfused"), "same": Knobs(engine="unfused")}
    rep = MC.compare_knobs(get_model(TINY_MODEL), [4], variants, iters=1, warmup=1, rotate=3, chained=1)
    assert rep["warmup"] == 3 and rep["warmup_note"] == note, rep
    assert "warmup_note" not in M.bench_moe(get_model(TINY_MODEL), [4], ["unfused"], iters=1, warmup=3, rotate=3)
    # the drivers (as a scenario's smoke settings run them: warmup 1, rotate 2)
    ctx = records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path)
    args = {"model": TINY_MODEL, "tokens": [4], "iters": 1, "warmup": 1, "rotate": 2}
    (r,) = moe_drivers.run_moe([records.Resolved("unfused", {**args, "engine": "unfused"}, {})], ctx)
    assert not r.error and r.metrics and r.note.startswith("--warmup 1 is below --rotate 2: raised to 2"), r
    out = moe_drivers.run_moe_knobs([records.Resolved("base", {**args, "knobs": "engine=unfused", "chain": 1}, {}),
                                     records.Resolved("v", {"knobs": "engine=unfused"}, {})], ctx)
    assert all(not c.error and c.metrics and c.note.startswith("--warmup 1 is below --rotate 2") for c in out), out
    assert seen and all(w >= n for w, n in seen), seen  # every timed input had an untimed call first
    r = _run("bench", "knobs", "--knobs", "engine=unfused", "--vs", "v=engine=unfused", "--model", TINY_MODEL, "--tokens",
             "4", "--iters", "1", "--warmup", "0", "--rotate", "2", "--chain", "1", "--json", width=200)
    assert r.exit_code == 0, r.output
    assert "--warmup 0 is below --rotate 2: raised to 2" in r.stderr.replace("\n", " ")
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["warmup"] == 2 and "--warmup 2 --rotate 2" in rep["meta"]["command"]


def test_summarize_never_replaces_a_database_with_its_markdown(tmp_path: Path) -> None:
    """`bench summarize --out moetune.db` replaced the profile database with Markdown, exit 0 (it takes no --force:
    BENCHMARKS.md is regenerated); `profiles export` refuses a SQLite target for the same reason."""
    import sqlite3

    db = tmp_path / "moetune.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    before = db.read_bytes()
    results = tmp_path / "s.csv"
    results.write_text(",".join(R.COLUMNS) + "\n")
    _refused(_run("bench", "summarize", "--results", str(results), "--out", str(db)), f"--out {db} is a SQLite database")
    assert db.read_bytes() == before


# -- counts of calls, rounds and launches: bounded above, the bound in --help ------------------------------------
HUGE = "100000000000000000000"
SMALL_SHAPE = ["--model", "custom:128,64,8,2", "--tokens", "1"]


@pytest.mark.parametrize(("args", "option", "limit"), [
    (["bench", "moe", "--engine", "torch", *SMALL_SHAPE, "--iters", HUGE], "--iters", "1000000"),
    (["bench", "moe", "--engine", "torch", *SMALL_SHAPE, "--warmup", HUGE], "--warmup", "1000000"),
    (["bench", "moe", "--engine", "torch", *SMALL_SHAPE, "--rotate", "1000001"], "--rotate", "1000000"),
    (["bench", "knobs", "--vs", "a=mk_bn=128", *SMALL_SHAPE, "--iters", HUGE], "--iters", "1000000"),
    (["bench", "knobs", "--vs", "a=mk_bn=128", *SMALL_SHAPE, "--chain", HUGE], "--chain", "1000000"),
    (["bench", "ep", "--world", "1", "--backend", "nccl", *SMALL_SHAPE, "--iters", HUGE], "--iters", "1000000"),
    (["bench", "ep", "--world", "1", "--backend", "nccl", *SMALL_SHAPE, "--warmup", "1000001"], "--warmup", "1000000"),
    (["bench", "run", "no-such-scenario", "--launches", HUGE], "--launches", "1000"),
])
def test_bench_counts_are_bounded_above(args: list[str], option: str, limit: str) -> None:
    """`bench moe --iters 100000000000000000000` was taken and ran practically forever: refused up front, exit 2,
    naming the option and its bound, which --help states."""
    value = args[args.index(option) + 1]
    flat = _refused(_run(*args), f"{option} must be at most {limit}, got {value}")
    assert "timing" not in flat
    cmd = args[:2]
    helped = " ".join(_run(*cmd, "--help", width=400).output.split())
    assert f"to {limit}" in helped, helped


def test_bench_ep_says_why_dispatch_and_combine_were_not_replayed_from_a_graph(capsys: pytest.CaptureFixture[str]) -> None:
    """With --cuda-graph, bench_case reports why the round trip could not be captured (`graph_error`) and, apart,
    why dispatch + combine alone could not (`graph_pair_error`); the table printed the first only, so a pair that
    failed to capture just had no row, as if it had not been asked for."""
    from moetune.tuner.cli import bench as bench_cli

    q = {"median": 30.0, "p10": 29.0, "p90": 31.0}
    bench_cli._print_table(_ep_report(0.001) | {"graph_roundtrip_us": q, "graph_pair_error": "RuntimeError: no capture"})
    out = " ".join(capsys.readouterr().out.split())
    assert "dispatch + combine (CUDA graph)" in out and "RuntimeError: no capture" in out, out


def test_bench_ep_prints_a_graph_error_with_brackets_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    """The CUDA-graph error went into Rich markup unescaped: a bracketed part of torch's message
    ("[cudaErrorStreamCaptureUnsupported]") vanished as a style tag, and a "[/...]" in it raised MarkupError, a
    traceback instead of the table."""
    from moetune.tuner.cli import bench as bench_cli

    bench_cli._print_table(_ep_report(0.001) | {"graph_error": "RuntimeError: [cudaErrorStreamCaptureUnsupported] [/x]"})
    out = capsys.readouterr().out
    assert "RuntimeError: [cudaErrorStreamCaptureUnsupported] [/x]" in out, out


@pytest.mark.parametrize("command", ["moe", "knobs"])
def test_the_stamped_command_of_bench_moe_and_knobs_runs_as_given(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's `command` (the row's command when imported with `bench run --from-report`) wrote --knobs and
    --model unquoted: `--knobs "mk_bn=128, mk_stages=3"` (a space after the comma, which --knobs takes) was stamped
    as `--knobs mk_bn=128, mk_stages=3`, which a shell splits into a --knobs of one knob and a stray argument. Each
    value is quoted for the shell, so the command reads back as what ran."""
    import shlex

    from moetune.tuner.cli import bench
    from moetune.tuner.measure import moe as M
    from moetune.tuner.measure import moe_compare as MC

    monkeypatch.setattr(bench, "_fingerprint", lambda: "fp")
    monkeypatch.setattr(M, "bench_moe", lambda *a, **k: {"graph": False, "cases": [{"engine": "unfused", "S": 1}]})
    monkeypatch.setattr(MC, "compare_knobs", lambda *a, **k: {"graph": False, "cases": [{"variant": "base", "S": 1}]})
    knobs = "mk_bn=128, mk_stages=3"
    args = {"moe": ["--engine", "megakernel"], "knobs": ["--vs", "a=mk_combine_tokens=8"]}[command]
    r = _run("bench", command, *args, "--model", TINY_MODEL, "--tokens", "1", "--iters", "1", "--knobs", knobs,
             "--json", width=200)
    assert r.exit_code == 0, r.output
    words = shlex.split(json.loads(r.stdout)["meta"]["command"])
    assert words[words.index("--knobs") + 1] == knobs and words[words.index("--model") + 1] == TINY_MODEL, words
