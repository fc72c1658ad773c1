"""`moetune tune` and `moetune tune show`: clear errors, a model-backend run, study summaries."""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import MODELS
from moetune.tuner.cli import app
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.model_backend import ModelBackend
from moetune.tuner.search.tune import _Fam, tune_profiles_detailed

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["tune"], "give at least one --model"),
        (["tune", "--model", "qwen3-30b", "--tokens", "12,abc"], "comma-separated integers"),
        (["tune", "--model", "qwen3-30b", "--tokens", "0"], "must be integers >= 1"),
        (["tune", "--model", "qwen3-30b", "--backend", "cloud"], "expected model or local"),
        (["tune", "--model", "nonsense-7b"], "unknown model"),
        (["tune", "--model", "qwen3-30b", "--trials", "0"], "must be 1 to 100000, got 0"),
        # every list option's parse error names the option (one parser: tuner/cli/_args.py)
        (["bench", "moe", "--tokens", "1,x"], "--tokens: expected comma-separated integers, got '1,x'"),
        (["bench", "knobs", "--vs", "a=mk_bm=16", "--tokens", "16;1"], "--tokens: expected comma-separated integers"),
        (["profile", "--tokens", "16, x"], "--tokens: expected comma-separated integers, got '16, x'"),
        (["model", "sweep", "-p", "slingshot11-libfabric-a100x4", "--values", "1,two"], "--values: expected comma-separated"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], words: str) -> None:
    r = _run(*args)
    assert r.exit_code == 2, r.output
    assert words in r.output
    assert "Traceback" not in r.output


def test_bad_policy_file_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "p.toml"
    p.write_text('[policy]\nfamily = "nvlink"\n[knobs]\nnum_sms = [0]\n')
    r = _run("tune", "--model", "qwen3-30b", "--policy", str(p), "--backend", "model", "--preset", "x")
    assert r.exit_code == 2 and "p.toml" in r.output and "knobs.num_sms" in r.output


@dataclass
class FakePreset:
    name: str = "fake-ibrc-x4"
    family: str = "proxy:ibrc"
    gpus_per_node: int = 4
    transports: tuple = ("proxy",)
    params: dict = field(default_factory=dict)
    # calibrated on the node of test_node_model_keys_profiles_to_this_node (only such a preset is a node model)
    calibration: dict = field(default_factory=lambda: {"fingerprint": "n" * 64})
    path: str = "calibrated.toml"


def _objective(k: Knobs, wl: TuneWorkload) -> float:
    return 100.0 + (80 if k.signalling == "coupled" else 0) + (40 if k.fence_mode == "proxy_drain" else 0) + k.num_sms


def test_model_backend_run_and_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.tuner.cli.tune as tune_cli
    import moetune.tuner.search.tune as search

    monkeypatch.setattr(search, "make_backend", lambda *a, **k: ModelBackend(FakePreset(), predictor=_objective))
    monkeypatch.setattr(tune_cli, "model_preset_warning", lambda preset: "")  # FakePreset is no shipped preset
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    db = tmp_path / "moetune.db"  # the real profile store: its write rules decide `written`
    r = _run("tune", "--model", "qwen3-30b", "--tokens", "128,1024", "--backend", "model", "--preset", "fake-ibrc-x4",
             "--nodes", "2", "--trials", "12", "--storage", url, "--db", str(db), "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)  # the progress lines are on stderr
    assert [row["tokens"] for row in rows] == [128, 1024]
    for row in rows:
        assert row["written"] and row["family"] == "proxy:ibrc" and row["trials"] == 12
        assert row["best_us"] < row["default_us"]  # the naive default is beaten
        assert row["knobs"]["signalling"] == "decoupled"
    from moetune.tuner.store.store import Store

    with Store(db, readonly=True) as store:  # what was written is current, and stored as a preset's prediction
        current = [rec for _, rec in store.list_profiles(status="current")]
    assert sorted(p.key.token_bucket for p in current) == [128, 1024]
    for p, row in zip(sorted(current, key=lambda p: p.key.token_bucket), rows, strict=True):
        assert p.knobs.to_dict() == row["knobs"] and p.latency_us == row["best_us"]
        assert p.provenance == "preset" and p.key.fingerprint.startswith("preset:fake-ibrc-x4:")
    # a rerun resumes the finished studies: no new trial, the stored profiles kept as they are
    r = _run("tune", "--model", "qwen3-30b", "--tokens", "128,1024", "--backend", "model", "--preset", "fake-ibrc-x4",
             "--nodes", "2", "--trials", "12", "--storage", url, "--db", str(db), "--json")
    assert r.exit_code == 0, r.output
    assert [row["stored"] for row in json.loads(r.stdout)] == ["kept", "kept"]
    r = _run("tune", "show", "--storage", url, "--json")
    assert r.exit_code == 0, r.output
    studies = json.loads(r.stdout)
    assert len(studies) == 2 and all(s["modelled"] for s in studies)
    r = _run("tune", "show", "--storage", url, "--study", studies[0]["study"], "--json")
    d = json.loads(r.stdout)
    assert d["states"]["complete"] == 12 and d["best_us"] < d["default_us"]
    # model predictions: said to be MODELLED, not "measured alone ... noise between runs"
    assert "speedup_vs_default" not in d and "MODELLED prediction" in d["trials_note"]
    assert "measured alone" not in d["trials_note"]
    assert (d["importances"] and "signalling" in d["importances"]) or d["importance_note"]
    r = _run("tune", "show", "--storage", url, "--study", studies[0]["study"])
    assert r.exit_code == 0 and "policy default" in r.output
    r = _run("tune", "show", "--storage", url, "--study", "moetune/nope")
    assert r.exit_code == 2 and "no study named" in r.output
    r = _run("tune", "show", "--storage", f"sqlite:///{tmp_path / 'missing.db'}")
    assert r.exit_code == 2 and "no studies yet" in r.output


def test_show_lists_studies_written_by_tune_profiles(tmp_path: Path) -> None:
    class Facts:
        fingerprint, software_hash, gpu_count = "a" * 64, "b" * 64, 2
        software: dict = {}  # noqa: RUF012
        link_rates: dict = {}  # noqa: RUF012
        transports = (_Fam("host_staged"),)

    url = f"sqlite:///{tmp_path / 's.db'}"
    tune_profiles_detailed(None, Facts(), models=[MODELS["gpt-oss-120b"]], tokens=[4096],
                           backend=CallableBackend(lambda k, w: 10.0 / k.pipeline_depth), trials=6, storage=url)
    r = _run("tune", "show", "--storage", url)
    assert r.exit_code == 0 and "host_staged" in r.output


def test_show_reads_no_speed_up_from_search_trials(tmp_path: Path) -> None:
    """Every setting is the same run (100 µs ± 15 of noise): `tune show` must not print the default trial over the
    best of 20 trials as a "speed-up 1.26×", measured side by side nowhere. It shows the trials as what they are and
    the profile stored for the key instead."""
    import random

    from moetune.tuner.store.store import Store

    class Noisy(CallableBackend):  # measurements: the noise of runs on a node (a prediction has none)
        provenance = "measured"

    class Facts:
        fingerprint, software_hash, gpu_count = "a" * 64, "b" * 64, 2
        software: dict = {}  # noqa: RUF012
        link_rates: dict = {}  # noqa: RUF012
        transports = (_Fam("host_staged"),)

    rng = random.Random(1)
    url, db = f"sqlite:///{tmp_path / 's.db'}", tmp_path / "p.db"
    with Store(db) as store:
        res = tune_profiles_detailed(store, Facts(), models=[MODELS["qwen3-30b"]], tokens=[128], trials=8, storage=url,
                                     backend=Noisy(lambda k, w: 100.0 + rng.uniform(-15, 15), name="local:noise"))
        stored = store.get_current(res[0].record.key)
    name = res[0].study.study_name
    r = _run("tune", "show", "--storage", url, "--db", str(db), "--study", name, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["default_us"] is not None and "speedup_vs_default" not in d
    assert d["stored"]["latency_us"] == stored.latency_us and d["stored"]["backend"] == "local:noise"
    r = _run("tune", "show", "--storage", url, "--db", str(db), "--study", name)
    assert r.exit_code == 0, r.output
    assert "×" not in r.output and "not side by side" in r.output and "stored for this key" in r.output
    # without a profile database the summary says the stored profile was not looked up
    r = _run("tune", "show", "--storage", url, "--study", name)
    assert r.exit_code == 0 and "not looked up" in r.output and "×" not in r.output


def test_show_counts_the_finished_trials_and_calls_predictions_modelled(tmp_path: Path) -> None:
    """`tune --trials 1` reported 1 trial; `tune show` listed 3 (Optuna's n_trials counts the warm-start points still
    WAITING) and called the model's predictions "each measured alone ... noise between runs"."""
    url = f"sqlite:///{tmp_path / 'st.db'}"
    r = _run("tune", "--model", "qwen3-30b", "--tokens", "128", "--backend", "model", "--preset", "nvlink-h200x2",
             "--trials", "1", "--db", str(tmp_path / "m.db"), "--storage", url, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)[0]["trials"] == 1
    r = _run("tune", "show", "--storage", url, "--json")
    [listed] = json.loads(r.stdout)
    assert listed["trials"] == 1 and listed["modelled"]
    r = _run("tune", "show", "--storage", url, "--study", listed["study"], "--json")
    d = json.loads(r.stdout)
    assert d["states"]["complete"] == 1 and d["states"]["waiting"] >= 1  # the case: warm starts left waiting
    assert d["trials"] == 1
    assert "MODELLED prediction" in d["trials_note"] and "measured alone" not in d["trials_note"]
    r = _run("tune", "show", "--storage", url, "--study", listed["study"])
    text = " ".join(r.output.split())
    assert "each a MODELLED prediction of the fabric model (not measured)" in text and "measured alone" not in text


def test_real_model_backend_end_to_end(tmp_path: Path) -> None:
    presets = importlib.import_module("moetune.tuner.fabric_model.presets")

    preset = "ndr-ibrc-h100x8" if "ndr-ibrc-h100x8" in presets.list_presets() else presets.list_presets()[0]
    r = _run("tune", "--model", "qwen3-30b", "--tokens", "128", "--backend", "model", "--preset", preset,
             "--nodes", "2", "--trials", "8", "--db", str(tmp_path / "m.db"),
             "--storage", f"sqlite:///{tmp_path / 'st.db'}", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert rows and rows[0]["best_us"] is not None and rows[0]["backend"] == f"model:{preset}"


def test_node_model_keys_profiles_to_this_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--node-model: a calibrated preset of this node tunes its family under the node's own key."""
    import moetune.tuner.search.tune as search

    class Facts:
        fingerprint, software_hash, gpu_count = "n" * 64, "m" * 64, 4
        software: dict = {}  # noqa: RUF012
        link_rates: dict = {}  # noqa: RUF012
        transports = (_Fam("proxy:ibrc"), _Fam("host_staged"), _Fam("collective"))

    monkeypatch.setattr(search, "make_backend", lambda *a, **k: ModelBackend(FakePreset(), predictor=_objective))
    res = search.tune_profiles_detailed(None, Facts(), models=[MODELS["qwen3-30b"]], tokens=[128], backend="model",
                                        preset="calibrated.toml", node_model=True, trials=4,
                                        storage=f"sqlite:///{tmp_path / 's.db'}")
    assert [r.study.family for r in res] == ["proxy:ibrc"]
    assert res[0].record.key.fingerprint == "n" * 64 and res[0].record.key.ep_size == 4


def test_workload_the_model_cannot_run_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.tuner.cli.tune as tune_cli
    import moetune.tuner.search.tune as search

    def nope(k: Knobs, wl: TuneWorkload) -> float:
        raise ValueError("preset 'fake-ibrc-x4' has no network between nodes; use nodes=1")

    monkeypatch.setattr(search, "make_backend", lambda *a, **k: ModelBackend(FakePreset(), predictor=nope))
    monkeypatch.setattr(tune_cli, "model_preset_warning", lambda preset: "")  # FakePreset is no shipped preset
    db = tmp_path / "moetune.db"
    r = _run("tune", "--model", "qwen3-30b", "--tokens", "128", "--backend", "model", "--preset", "fake-ibrc-x4",
             "--nodes", "2", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--db", str(db))
    assert r.exit_code == 2 and "no network between nodes" in r.output and "Traceback" not in r.output
    r = _run("tune", "--model", "custom:64,64,6,2", "--tokens", "128", "--backend", "model", "--preset", "fake-ibrc-x4",
             "--storage", f"sqlite:///{tmp_path / 's.db'}", "--db", str(db))
    assert r.exit_code == 2 and "do not divide evenly" in r.output
    from moetune.tuner.store.store import Store

    with Store(db, readonly=True) as store:  # nothing stored from a tune the model could not run
        assert store.list_profiles() == []


def test_first_failure_prefers_a_real_error_to_an_interrupted_trial(tmp_path: Path) -> None:
    """When no study succeeds, `moetune tune` names the first failure (`StudyResult.first_error`, recorded as the
    study is summed up): an earlier trial whose process died says nothing of what to fix, so the first real
    failure's error is shown."""
    import os
    import socket

    import optuna

    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.backends import TuneWorkload
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.study import open_study, summarize_study

    wl = TuneWorkload(model=MODELS["qwen3-30b"], tokens=1024, nodes=1, gpus_per_node=2)
    space = SearchSpace(load_policy("host_staged"), experts=128, ep_size=2)

    def _first_failure(url: str, name: str) -> str:
        return summarize_study(optuna.load_study(study_name=name, storage=url), space, wl).first_error

    # host:pid without a run id: an earlier process whose pid this one reuses, i.e. a process that is gone
    gone = f"{socket.gethostname()}:{os.getpid()}"
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study("moetune/x", url)
    study.ask().set_user_attr("worker", gone)  # RUNNING, of no live process: the next opening fails it as interrupted
    study = open_study("moetune/x", url)
    t = study.ask()
    t.set_user_attr("error", "bench ep failed: NCCL error: unhandled system error")
    study.tell(t, state=optuna.trial.TrialState.FAIL)
    assert _first_failure(url, "moetune/x") == "bench ep failed: NCCL error: unhandled system error"

    only_cut = open_study("moetune/y", url)
    only_cut.ask().set_user_attr("worker", gone)
    open_study("moetune/y", url)
    assert "interrupted" in _first_failure(url, "moetune/y")  # nothing better to say


@pytest.mark.parametrize("node_model", [False, True])
def test_tune_on_a_forced_model_says_so_loudly(tmp_path: Path, node_model: bool,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A model the calibration checks refused (written with --force) may still be tuned on when the user points at
    it, but `moetune tune` says, before and after, that it is a forced model (in silence its profiles would be
    stored as this node's like any calibrated model's), and the JSON rows carry its warning. Shipped presets and
    accepted calibrations print nothing of the kind."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dataclasses import replace

    import daemon_fakes as F

    from moetune.tuner.fabric.discovery import discover

    def discover_fp(capture: Path) -> str:
        return discover(capture).fingerprint

    # a forced fit calibrated on the node --node-model names (dgx-h100's capture): taken as its model, loudly
    preset = F.write_forced_preset(tmp_path / "forced.toml",
                                   fingerprint=discover(Path(__file__).parent / "captures" / "dgx-h100").fingerprint)
    args = ["tune", "--model", "qwen3-30b", "--tokens", "128", "--backend", "model", "--trials", "3",
            "--db", str(tmp_path / "m.db"), "--storage", f"sqlite:///{tmp_path / 'st.db'}", "--json"]
    if node_model:
        args += ["--node-model", "--capture", str(tmp_path / "capture")]
        import shutil

        shutil.copytree(Path(__file__).parent / "captures" / "dgx-h100", tmp_path / "capture")
    r = _run(*args, "--preset", str(preset))
    assert r.exit_code == 0, r.output
    assert r.stderr.count("FORCED MODEL") == 2 and "REFUSED" in r.stderr, r.stderr
    assert "without --force" in r.stderr and ("THIS NODE" in r.stderr) == node_model
    # the warning itself (its reasons) is printed once, in the banner before the tune: the banner after it is a
    # reminder, and the backend's log line is not given as well (the reasons were printed two and three times)
    assert r.stderr.count("too few rows") == 1, r.stderr
    said = [x for x in caplog.messages if "is a forced fit the calibration checks refused" in x]
    assert said == [], said
    rows = json.loads(r.stdout)
    assert rows and all("too few rows" in row["forced_model"] for row in rows)

    accepted = tmp_path / "accepted.toml"  # the same model, its fit accepted: tuned on as before, quietly
    from moetune.tuner.fabric_model.presets import load_preset

    shipped = load_preset("nvlink-h200x2")  # as calibrated on the node --node-model names (else refused there)
    accepted.write_text(shipped.to_toml() if not node_model else replace(
        shipped, calibration={**shipped.calibration, "fingerprint": discover_fp(tmp_path / "capture")}).to_toml())
    r = _run(*args, "--preset", str(accepted))
    assert r.exit_code == 0, r.output
    assert "FORCED" not in r.stderr and all(row["forced_model"] is None for row in json.loads(r.stdout))


def test_a_model_tune_beyond_the_calibrated_scale_says_so(tmp_path: Path) -> None:
    """`tune --backend model -p nvlink-h200x2 --ep-size 8` stored profiles predicted at 8 GPUs from a fit of 2-rank
    all-to-alls with no word of it: the note `model predict` prints (from the preset's `[calibration] world`) after
    the table and in each JSON row's "extrapolation"; none within the measured scale, none where the preset records
    none. What is stored is unchanged (predictions, backend model:PRESET)."""
    def tune(preset: str, *extra: str, json_out: bool = True):
        r = runner.invoke(app, ["tune", "--model", "qwen3-30b", "--tokens", "128", "--backend", "model", "--preset",
                                preset, "--trials", "2", "--db", str(tmp_path / f"{preset}.db"),
                                "--storage", f"sqlite:///{tmp_path / f'{preset}-st.db'}", *extra,
                                *(("--json",) if json_out else ())], env={"COLUMNS": "80"})
        assert r.exit_code == 0, r.output
        return r

    rows = json.loads(tune("nvlink-h200x2", "--ep-size", "8").stdout)
    said = ("preset nvlink-h200x2 was calibrated on measurements of at most 2 ranks ([calibration] world = 2); at 8 "
            "GPUs this tune extrapolates 4x beyond the measured scale")
    assert rows and all(row["extrapolation"] == said for row in rows), rows
    assert all(row["backend"] == "model:nvlink-h200x2" for row in rows)
    flat = " ".join(tune("nvlink-h200x2", "--ep-size", "8", json_out=False).stdout.split())
    assert f"note: {said}" in flat, flat
    # within the measured scale (its 2 GPUs per node), and a datasheet preset that records no measured scale
    assert all(row["extrapolation"] is None for row in json.loads(tune("nvlink-h200x2").stdout))
    assert all(row["extrapolation"] is None for row in json.loads(tune("ndr-ibrc-h100x8", "--nodes", "2").stdout))
    assert "extrapolates" not in tune("nvlink-h200x2", json_out=False).stdout
