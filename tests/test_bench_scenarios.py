"""The benchmark scenarios stay runnable: every file parses and names a registered driver, every scenario runs
in smoke mode on gloo/CPU through `moetune bench run --smoke` (the real CLI and drivers, tiny sizes, 1 launch)
and appends fully stamped rows, and `moetune bench summarize` turns the rows into a short BENCHMARKS.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.tuner.measure import results as R
from moetune.tuner.measure.scenarios import checkout, definitions, moe_report, records, runner, stamp, summary
from moetune.tuner.measure.scenarios.drivers import ep as ep_driver
from moetune.tuner.measure.scenarios.drivers import moe as moe_drivers
from moetune.tuner.measure.scenarios.drivers import registry
from moetune.tuner.measure.scenarios.errors import ScenarioError

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = definitions.load_all()
STAMP = ("git_sha", "date", "moetune", "torch", "gpu", "fabric_fingerprint", "hardware", "command", "launch", "source")
# BENCHMARKS.md stays a page a reader takes in: at most 200 lines (ARCHITECTURE's target), ~10 lines a scenario (16
# scenarios) and the header; the committed one and a smoke run's alike
MD_LINES = 200


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "bench", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_every_scenario_parses_and_names_a_driver() -> None:
    assert len(SCENARIOS) >= 8
    for s in SCENARIOS.values():
        assert s.driver in registry.DRIVERS, s.name
        assert s.question and s.metrics and s.cases[0].smoke
        assert s.smoke_skip or s.smoke_needs.gpus == 0, f"{s.name}: a smoke variant must run without GPUs"


def test_every_shipped_scenario_passes_the_load_checks() -> None:
    """Every file in bench/scenarios/ read one by one through `load`'s checks (no retired or runtime-option
    `MOETUNE_*` variable in any env, options valid as RuntimeOptions, ep knobs that parse with their transport):
    a scenario whose case can only fail is refused when read, not found failing on a GPU machine."""
    from moetune.runtime.options import OPTION_DOCS, RETIRED, RuntimeOptions

    paths = sorted(checkout.SCENARIO_DIR.glob("*.toml"))
    assert len(paths) == len(SCENARIOS)
    banned = {d.env for d in OPTION_DOCS} | {r.env for r in RETIRED}
    for path in paths:
        s = definitions.load(path)
        for smoke in (False, True):
            for c in runner.plan(s, None, smoke):
                assert not set(c.env) & banned, (s.name, c.name, c.env)
                RuntimeOptions.from_dict(c.options)
    kernel_wait = next(c for c in SCENARIOS["host-staged-fp8-pipelined"].cases if c.name == "fp8-depth4-kernel-wait")
    assert "wait_mode=kernel" in kernel_wait.args["knobs"] and not kernel_wait.env


def test_a_scenario_setting_a_variable_that_cannot_work_is_refused_when_read(tmp_path: Path) -> None:
    """A retired variable (the case always failed: the runtime refuses an EP buffer under MOETUNE_HS_WAIT), a runtime
    option's variable (options = {...} instead), an unknown MOETUNE_* name, a bad option and a knob its transport has
    not: each a ScenarioError naming the file, the case and the variable, option or knob."""
    head = ('name = "x"\ndriver = "ep"\nquestion = "q"\nmetrics = ["roundtrip_us"]\n'
            '[args]\ntransport = "host_staged"\n[[cases]]\nname = "base"\n')
    path = tmp_path / "x.toml"

    def refused(case: str, *words: str) -> str:
        path.write_text(head + case)
        with pytest.raises(ScenarioError) as e:
            definitions.load(path)
        msg = str(e.value)
        assert str(path) in msg and all(w in msg for w in words), msg
        return msg

    refused('[[cases]]\nname = "kw"\nenv = { MOETUNE_HS_WAIT = "kernel" }\n', "cases[1] (kw)", "MOETUNE_HS_WAIT",
            "retired", "the knob `wait_mode`")
    refused('[[cases]]\nname = "nat"\nenv = { MOETUNE_HS_NATIVE = "0" }\n', "cases[1] (nat)", "MOETUNE_HS_NATIVE",
            "options = { hs_native = ... }")
    refused('[env]\nMOETUNE_ONESIDED_TIMEOUT_S = "5"\n', "MOETUNE_ONESIDED_TIMEOUT_S", "onesided_timeout_s")
    typo = "MOETUNE_" + "HS_NATIV"  # split so that tests/test_settings_doc.py does not see an undocumented name
    refused(f'[[cases]]\nname = "typo"\nenv = {{ {typo} = "0" }}\n', "cases[1] (typo)", typo, "no moetune code reads")
    refused('[[cases]]\nname = "bad"\noptions = { hs_native = "maybe" }\n', "cases[1] (bad)", "hs_native")
    refused('[[cases]]\nname = "unk"\noptions = { hs_natve = false }\n', "cases[1] (unk)", "hs_natve")
    refused('[options]\nonesided_timeout_s = -1.0\n', "cases[0] (base)", "onesided_timeout_s")
    path.write_text(head.replace('transport = "host_staged"', "") + '[[cases]]\nname = "kw"\n'
                    'args = { knobs = "wait_mode=kernel" }\n')
    with pytest.raises(ScenarioError, match=r"cases\[1\] \(kw\): knobs 'wait_mode=kernel'.*host_staged"):
        definitions.load(path)
    # NCCL's variables and moetune's build/debug variables pass; options reach the resolved case and its command
    path.write_text(head + '[[cases]]\nname = "ok"\nenv = { NCCL_P2P_DISABLE = "1", MOETUNE_CSRC_LIB = "/x.so" }\n'
                    'options = { hs_native = false }\n')
    s = definitions.load(path)
    ok = runner.plan(s, "ok", smoke=False)[1]
    assert ok.options == {"hs_native": False} and runner.plan(s, "ok", smoke=False)[0].options == {}
    assert ep_driver.ep_command(ok.args, ok.env, 2, "nccl", ok.options).startswith(
        "NCCL_P2P_DISABLE=1 MOETUNE_CSRC_LIB=/x.so MOETUNE_HS_NATIVE=0 moetune bench ep")
    # a driver that hands no runtime options anywhere refuses them
    (tmp_path / "y.toml").write_text('name = "y"\ndriver = "gpu-rates"\nquestion = "q"\nmetrics = ["read_tbps"]\n'
                                     '[options]\nsymm = "ipc"\n[[cases]]\nname = "read-sum"\n')
    with pytest.raises(ScenarioError, match="driver gpu-rates takes no runtime options"):
        definitions.load(tmp_path / "y.toml")


@pytest.mark.timeout(180)
def test_the_ep_driver_hands_a_cases_options_to_its_buffer(tmp_path: Path) -> None:
    """A case's runtime options reach the EP buffer of that case only (one spawned world for both cases): three chunk
    weights for two pipeline chunks are refused there, naming the option; the case without options runs."""
    args = {"model": "custom:64,32,8,2", "tokens": 8, "iters": 2, "warmup": 1, "layer": False, "layout": "dense",
            "knobs": "pipeline_depth=2"}
    cases = [records.Resolved("plain", dict(args), {}), records.Resolved("weights", dict(args), {}, {"chunk_weights": [1.0, 2.0, 3.0]})]
    out = registry.DRIVERS["ep"](cases, records.Ctx(world=2, backend="gloo", smoke=True, tmp=tmp_path))
    assert not out[0].error and out[0].metrics, out[0]
    assert "chunk_weights" in out[1].error and not out[1].metrics, out[1]
    assert out[1].command.startswith("MOETUNE_EP_CHUNK_WEIGHTS=1.0,2.0,3.0 moetune bench ep"), out[1].command


def test_plan_puts_the_baseline_first_and_last() -> None:
    s = SCENARIOS["host-staged-fp8-pipelined"]
    seq = [c.name for c in runner.plan(s, None, smoke=False)]
    assert seq[0] == seq[-1] == "bf16-nccl-staging" and len(seq) == len(s.cases) + 1
    assert [c.name for c in runner.plan(s, "fp8-depth4", smoke=False)] == ["bf16-nccl-staging", "fp8-depth4", "bf16-nccl-staging"]
    assert "fp8-depth4-kernel-wait" not in [c.name for c in runner.plan(s, None, smoke=True)]
    smoke = runner.plan(s, None, smoke=True)[1]
    assert smoke.args["tokens"] == 16 and smoke.env["NCCL_P2P_DISABLE"] == "1"


def test_a_gpu_scenario_offers_a_smoke_run_only_where_it_has_one() -> None:
    """proxy-fences, refused on a CPU machine, said `--smoke` checks its plumbing; `--smoke` then said it has none."""
    with_smoke = next(s for s in SCENARIOS.values() if not s.smoke_skip and s.needs.gpus > 0)
    without = next(s for s in SCENARIOS.values() if s.smoke_skip and s.needs.gpus > 0)
    with pytest.raises(ScenarioError, match=f"`moetune bench run {with_smoke.name} --smoke` checks its plumbing"):
        runner.check_machine(with_smoke, False, 0)
    with pytest.raises(ScenarioError) as e:
        runner.check_machine(without, False, 0)
    assert "--smoke" not in str(e.value) and f"it has no CPU smoke variant: {without.smoke_skip}" in str(e.value)


def test_bad_scenario_files_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "x.toml").write_text('name = "x"\ndriver = "nope"\nquestion = "q"\nmetrics = ["m"]\n[[cases]]\nname = "a"\n')
    with pytest.raises(ScenarioError, match="unknown driver 'nope'"):
        definitions.load(tmp_path / "x.toml")
    (tmp_path / "y.toml").write_text('name = "z"\n')
    with pytest.raises(ScenarioError, match="must equal the file's stem"):
        definitions.load(tmp_path / "y.toml")
    with pytest.raises(ScenarioError, match="no case 'nope'"):
        runner.plan(SCENARIOS["daemon-load"], "nope", smoke=False)


def test_run_refuses_a_gpu_scenario_on_this_machine_without_a_traceback(tmp_path: Path) -> None:
    out = tmp_path / "s.csv"
    with pytest.raises(ScenarioError, match="needs 2 GPUs"):
        runner.run(SCENARIOS["ep-roundtrip-qwen3-s128"], results=out, gpus=0)
    r = _cli("run", "ep-roundtrip-qwen3-s128", "--results", str(out))
    if r.returncode == 0:
        pytest.skip("this machine has the GPUs")
    assert r.returncode == 2 and "needs 2 GPUs" in r.stderr and "Traceback" not in r.stderr
    r = _cli("run", "no-such-scenario", "--results", str(out))
    assert r.returncode == 2 and "no scenario 'no-such-scenario'" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.timeout(180)
def test_every_scenario_runs_in_smoke_mode_and_summarizes(tmp_path: Path) -> None:
    out = tmp_path / "summary.csv"
    ran = []
    for s in SCENARIOS.values():
        if s.smoke_skip:  # the scenario says why no CPU variant can exist
            with pytest.raises(ScenarioError, match="no CPU smoke variant"):
                runner.run(s, smoke=True, results=out)
            continue
        rows = runner.run(s, smoke=True, results=out, gpus=0)
        failed = [r for r in rows if str(r.get("note", "")).startswith("FAILED")]
        # the notes say why (a GPU machine's run 242 showed only the rows' truncated first keys)
        assert not failed, [(r["case"], r.get("metric"), r["note"]) for r in failed]
        assert {r["case"] for r in rows} == {c.name for c in s.cases if c.smoke}, s.name
        ran.append(s.name)
    assert {"host-staged-fp8-pipelined", "ep-roundtrip-qwen3-s128", "daemon-load", "fabric-discovery"} <= set(ran)
    rows = R.read_rows(out)  # what was appended reads back with every column, stamped
    assert {r["scenario"] for r in rows} == set(ran)
    for r in rows:
        assert set(r) == set(R.COLUMNS)
        assert r["source"] == "smoke" and all(r[c] for c in STAMP), r
        assert len(r["git_sha"]) == 40 and r["git_dirty"] in ("0", "1")
    md_path = tmp_path / "BENCHMARKS.md"
    r = _cli("summarize", "--results", str(out), "--out", str(md_path))
    assert r.returncode == 0, r.stderr
    md = md_path.read_text()
    assert md.count("\n") <= MD_LINES
    for name in SCENARIOS:
        assert f"### {name}" in md
    assert "SMOKE" in md and "(baseline)" in md


def test_list_shows_needs() -> None:
    r = _cli("list", "--json")
    assert r.returncode == 0, r.stderr
    assert '"name": "host-staged-fp8-pipelined"' in r.stdout and '"gpus": 2' in r.stdout


def test_committed_summary_and_benchmarks_md_agree() -> None:
    rows = R.read_rows(checkout.SUMMARY_CSV)
    assert rows and all(r["git_sha"] for r in rows)
    md = checkout.BENCHMARKS_MD.read_text()
    assert md == summary.summarize(SCENARIOS, rows), "BENCHMARKS.md is stale: run `moetune bench summarize`"
    assert md.count("\n") <= MD_LINES


def test_rows_of_a_copied_tree_take_the_given_sha(monkeypatch) -> None:
    """A tree copied to a GPU machine without a .git of its own (bench/tools/sync_megakernel_device.sh: an exported folder):
    MOETUNE_GIT_SHA (hex only) stamps it, clean unless it ends in -dirty; without it, 'unknown'. A repository around
    the tree (an export unpacked inside another checkout) is not its git."""
    calls = {"rev-parse": "/somewhere/else", "status": ""}
    monkeypatch.setattr(stamp, "_git", lambda *a: calls[a[0]])  # git's top level is another folder
    monkeypatch.setenv("MOETUNE_GIT_SHA", "0D90E94abc")
    f = stamp.machine_facts("none", lambda: "fp")
    assert (f["git_sha"], f["git_dirty"]) == ("0d90e94abc", False)
    monkeypatch.setenv("MOETUNE_GIT_SHA", "0D90E94abc-dirty")  # a copy with changes on top (the sync script says so)
    f = stamp.machine_facts("none", lambda: "fp")
    assert (f["git_sha"], f["git_dirty"]) == ("0d90e94abc", True)
    monkeypatch.setenv("MOETUNE_GIT_SHA", "not a sha; rm -rf")
    assert stamp.machine_facts("none", lambda: "fp")["git_sha"] == "unknown"
    monkeypatch.setattr(stamp, "_git", lambda *a: "")  # no git at all
    assert stamp.machine_facts("none", lambda: "fp")["git_sha"] == "unknown"
    monkeypatch.setenv("MOETUNE_GIT_SHA", "0d90e94abc")
    assert stamp.machine_facts("none", lambda: "fp")["git_sha"] == "0d90e94abc"


def test_a_git_checkout_is_stamped_by_git_whatever_moetune_git_sha_says(tmp_path: Path, monkeypatch) -> None:
    """MOETUNE_GIT_SHA won over a real checkout: with a dirty tree and MOETUNE_GIT_SHA=0123456789abcdef the rows were
    stamped clean with a commit that does not exist. In a checkout of its own git decides (HEAD and its changes),
    the variable is for a tree without .git (or whose stale .git never saw its commit: stamped, never clean), and a
    disagreement is warned about."""
    import subprocess
    import warnings

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    head = git("rev-parse", "HEAD").strip()
    (tmp_path / "a.py").write_text("x = 2\n")  # dirty
    monkeypatch.setattr(stamp, "ROOT", tmp_path)
    other = git("-c", "user.name=t", "-c", "user.email=t@t", "commit-tree", "-m", "b", "HEAD^{tree}").strip()
    monkeypatch.setenv("MOETUNE_GIT_SHA", other)  # a known commit that is not HEAD: a leftover variable, git wins
    with pytest.warns(UserWarning, match=f"MOETUNE_GIT_SHA={other} is not this checkout"):
        f = stamp.machine_facts("none", lambda: "fp")
    assert (f["git_sha"], f["git_dirty"]) == (head, True)
    # a commit this .git has never seen (a stale .git copied with a newer tree, or a variable naming nothing): the
    # variable's commit, never clean
    monkeypatch.setenv("MOETUNE_GIT_SHA", "0123456789abcdef")
    with pytest.warns(UserWarning, match="MOETUNE_GIT_SHA=0123456789abcdef is unknown to this tree's .git"):
        f = stamp.machine_facts("none", lambda: "fp")
    assert (f["git_sha"], f["git_dirty"]) == ("0123456789abcdef", True)
    monkeypatch.setenv("MOETUNE_GIT_SHA", head[:12])  # the right commit, but the tree has changes: never clean
    with pytest.warns(UserWarning):
        f = stamp.machine_facts("none", lambda: "fp")
    assert (f["git_sha"], f["git_dirty"]) == (head, True)
    (tmp_path / "a.py").write_text("x = 1\n")  # clean again, and the variable agrees: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = stamp.machine_facts("none", lambda: "fp")
    assert (f["git_sha"], f["git_dirty"]) == (head, False)


def _moe_report(tokens: list[int], order: tuple[str, ...] = ("unfused", "megakernel", "torch"), **over: object) -> dict:
    """A `moetune bench moe --json` report of the moe-megakernel-vs-unfused measurement (its three engines, timed in
    `order`: the scenario's is unfused, megakernel, torch)."""
    meta = {"git_sha": "bd3e980e906d", "git_dirty": False, "moetune": "0+unknown", "torch": "2.11.0+cu130",
            "nccl": "2.28.9", "cuda": "13.0", "gpu": "NVIDIA H200", "gpu_count": 1, "fabric_fingerprint": "2bb9",
            "hardware": "1x NVIDIA H200, 16 CPU cores", "date": "2026-12-04T09:38:10Z",
            "command": f"moetune bench moe --engine {','.join(order)} --model qwen3-30b --cuda-graph"}
    q = {"median": 10.0, "p10": 9.0, "p90": 11.0}
    speed = {"megakernel": 8.0, "unfused": 9.0, "torch": 10.0}
    cases = [{"engine": e, "S": s, "eager_us": q,
              "graph_us": {"median": speed[e], "p10": speed[e] - 0.5, "p90": speed[e] + 0.5}} for s in tokens for e in order]
    return {"model": "qwen3-30b", "graph": True, "iters": 50, "warmup": 10, "rotate": 4, "rest_s": 0.0, "seed": 0,
            "cases": cases, "meta": meta, **over}


def test_a_bench_moe_report_imports_as_one_launch_only_where_it_is_the_scenarios_measurement(tmp_path: Path) -> None:
    """`bench run --from-report`: a report measured on a GPU machine becomes one launch of the moe scenario, stamped
    with the report's own code, hardware, date and command and marked imported; anything else is refused."""
    s, out = SCENARIOS["moe-megakernel-vs-unfused"], tmp_path / "s.csv"
    rows = moe_report.import_moe_report(s, _moe_report([1, 16, 128, 1024, 4096]), origin="out163/bench_moe.json", results=out)
    assert len(rows) == 3 * 5 * 2 and R.read_rows(out) and all(r["source"] == "imported" for r in rows)
    assert {(r["git_sha"], r["date"], r["gpu"], r["launch"]) for r in rows} == {
        ("bd3e980e906d", "2026-12-04T09:38:10Z", "NVIDIA H200", "20261204T093810Z-imported")}
    g = {r["case"]: r["median"] for r in rows if r["metric"] == "graph_us[S=128]"}
    assert g == {"megakernel": 8.0, "unfused": 9.0, "torch": 10.0}
    assert [r["case"] for r in rows if r["metric"] == "graph_us[S=1]"] == ["unfused", "megakernel", "torch"]
    assert all(r["note"] == "imported from out163/bench_moe.json" for r in rows)
    for rep, words in ((_moe_report([1, 16, 128, 1024, 4096]), "in " + str(out) + " already"),
                       (_moe_report([1]), "tokens [1] (scenario: [1, 16, 128, 1024, 4096])"),
                       (_moe_report([1, 16, 128, 1024, 4096], iters=20), "iters 20 (scenario: 50)"),
                       # timed megakernel first: under a power cap the second engine pays for the first one's heat
                       # measured where the scenario cannot run (a CPU's plumbing check)
                       (_moe_report([1, 16, 128, 1024, 4096], meta={**_moe_report([1])["meta"], "gpu": "none",
                                                                    "gpu_count": 0}), "machine '0 x none'"),
                       # other weights and inputs (the scenario's seed is 0), or none it can tell
                       (_moe_report([1, 16, 128, 1024, 4096], seed=3), "seed 3 (scenario: 0)"),
                       ({k: v for k, v in _moe_report([1, 16, 128, 1024, 4096]).items() if k != "seed"},
                        "seed None (scenario: 0)"),
                       (_moe_report([1, 16, 128, 1024, 4096], order=("megakernel", "unfused", "torch")),
                        "engine order ['megakernel', 'unfused', 'torch'] (scenario: ['unfused', 'megakernel', 'torch'])"),
                       ({"cases": []}, "not a `moetune bench moe --json` report"),
                       # a stamp emptied by hand: rows that trace to no code or machine
                       (_moe_report([1, 16, 128, 1024, 4096], meta={**_moe_report([1])["meta"], "git_sha": "",
                                                                    "hardware": None}),
                        "the report's meta has no git_sha, hardware (empty or not text)")):
        with pytest.raises(ScenarioError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            moe_report.import_moe_report(s, rep, origin="x.json", results=out)
    # a report written before it held its seed: its command's --seed says it
    old = {k: v for k, v in _moe_report([1, 16, 128, 1024, 4096]).items() if k != "seed"}
    old["meta"] = {**old["meta"], "date": "2026-12-04T10:00:00Z", "command": old["meta"]["command"] + " --seed 0"}
    assert moe_report.import_moe_report(s, old, origin="old.json", results=out)
    assert len(R.read_rows(out)) == 2 * len(rows)
    bad = _moe_report([1, 16, 128, 1024, 4096])  # a forged or broken timing: no number to keep
    bad["cases"][0]["eager_us"] = {"median": float("nan"), "p10": -5.0, "p90": float("inf")}
    with pytest.raises(ScenarioError, match=r"is no timing \(finite, > 0, p10 <= median <= p90\)"):
        moe_report.import_moe_report(s, bad, origin="x.json", results=out)
    with pytest.raises(ScenarioError, match="only scenarios of driver moe"):
        moe_report.import_moe_report(SCENARIOS["daemon-load"], _moe_report([1]), origin="x.json", results=out)
    assert len(R.read_rows(out)) == 2 * len(rows)  # nothing appended by a refused import
    r = _cli("run", "moe-megakernel-vs-unfused", "--from-report", str(tmp_path / "none.json"), "--results", str(out))
    assert r.returncode == 2 and "none.json" in r.stderr and "Traceback" not in r.stderr


def test_summarize_never_writes_over_the_results_it_reads(tmp_path: Path) -> None:
    """`bench summarize --results same.csv --out same.csv` replaced every measured row with the Markdown summary
    (exit 0), and a link named as --out to the results file likewise."""
    src = tmp_path / "same.csv"
    src.write_bytes(checkout.SUMMARY_CSV.read_bytes())
    before = src.read_bytes()
    link = tmp_path / "link.md"
    link.symlink_to(src)
    for out in (src, link):
        r = _cli("summarize", "--results", str(src), "--out", str(out))
        assert r.returncode == 2 and "is the results file being read" in r.stderr, r.stderr
        assert src.read_bytes() == before and link.is_symlink()


def test_summarize_says_which_rows_it_left_out(tmp_path: Path) -> None:
    """A median that was no number (a hand edit) or a row of no scenario was dropped without a word, and the table
    switched to another metric."""
    src = tmp_path / "h.csv"
    lines = checkout.SUMMARY_CSV.read_text().splitlines(keepends=True)
    rows = R.read_rows(checkout.SUMMARY_CSV)
    i = next(k for k, r in enumerate(rows) if not r["note"].startswith("FAILED") and r["median"])
    r = dict(rows[i], median="abc")
    import csv
    import io

    buf = io.StringIO()
    csv.DictWriter(buf, fieldnames=list(R.COLUMNS), lineterminator="\n").writerow(r)
    lines[i + 1] = buf.getvalue()
    src.write_text("".join(lines))
    res = _cli("summarize", "--results", str(src), "--out", str(tmp_path / "out.md"))
    flat = " ".join(res.stderr.split())
    assert res.returncode == 0 and f"1 row(s) left out of the summary: line {i + 2}: median 'abc'" in flat, res.stderr
    assert R.row_problems(R.read_rows(checkout.SUMMARY_CSV), SCENARIOS) == (0, [])  # the committed table: none


def test_a_bench_moe_report_with_a_skipped_engine_imports_it_as_failed(tmp_path: Path) -> None:
    """A report where one engine could not run (bench moe's {"engine", "skipped": why} row, which has no S) was refused
    whole ("not of the expected shape: KeyError 'S'"): it imports, the skipped engine's cases FAILED with the reason."""
    s, out = SCENARIOS["moe-megakernel-vs-unfused"], tmp_path / "s.csv"
    rep = _moe_report([1, 16, 128, 1024, 4096], order=("unfused", "megakernel"))
    why = "the plain torch path needs torch._grouped_mm on a CUDA device"
    rep["cases"].insert(0, {"engine": "torch", "skipped": why})
    rows = moe_report.import_moe_report(s, rep, origin="out/bench_moe.json", results=out)
    torch_rows = [r for r in rows if r["case"] == "torch"]
    assert [r["metric"] for r in torch_rows] == list(s.metrics)
    assert all(r["note"] == f"FAILED: SKIPPED: {why}; imported from out/bench_moe.json" and r.get("median") is None
               for r in torch_rows), torch_rows
    assert {r["case"] for r in rows if r.get("median") is not None} == {"unfused", "megakernel"}


def test_a_case_argument_a_single_shot_driver_would_ignore_is_refused(tmp_path: Path) -> None:
    """run_moe and run_moe_knobs read tokens, iters, knobs (moe) ... of the first case only, for every case: a
    scenario giving a second case its own `knobs` (or tokens) is refused at load, not loaded and silently not
    measured."""
    head = 'question = "q"\nmetrics = ["graph_us[S=16]"]\n[args]\ntokens = [16]\n'
    (tmp_path / "m.toml").write_text(f'name = "m"\ndriver = "moe"\n{head}[[cases]]\nname = "unfused"\n'
                                     'args = { engine = "unfused" }\n[[cases]]\nname = "mk"\n'
                                     'args = { engine = "megakernel", knobs = "mk_bn=128" }\n')
    with pytest.raises(ScenarioError, match=r"cases\[1\] \(mk\) sets knobs: driver moe runs every case in one process"):
        definitions.load(tmp_path / "m.toml")
    (tmp_path / "k.toml").write_text(f'name = "k"\ndriver = "moe-knobs"\n{head}[[cases]]\nname = "base"\n'
                                     'args = { knobs = "" }\n[[cases]]\nname = "b"\nargs = { knobs = "mk_bn=128" }\n'
                                     'smoke_args = { tokens = [4] }\n')
    with pytest.raises(ScenarioError, match=r"cases\[1\] \(b\) sets tokens: .*; a case sets only knobs"):
        definitions.load(tmp_path / "k.toml")
    (tmp_path / "s.toml").write_text(f'name = "s"\ndriver = "search-efficiency"\n{head}[[cases]]\nname = "random"\n'
                                     'args = { seeds = 3 }\n')
    with pytest.raises(ScenarioError, match="its cases take no arguments"):
        definitions.load(tmp_path / "s.toml")


def test_the_moe_command_of_a_row_names_its_seed() -> None:
    """run_moe builds the weights and inputs from `seed`, but the command stored with its rows left it out: a case of
    seed 7 named a command that reruns seed 0."""
    cmd = moe_drivers.moe_command({"model": "qwen3-30b", "tokens": [1, 16], "iters": 50, "seed": 7}, ["unfused", "megakernel"])
    assert cmd.endswith("--iters 50 --seed 7 --json"), cmd
    assert "--seed" not in moe_drivers.moe_command({"tokens": [1]}, ["unfused"])  # the default (0) where the scenario sets none


def test_the_moe_driver_stores_the_plain_read_it_timed_beside_the_engines(monkeypatch, tmp_path: Path) -> None:
    """bench_moe times a plain read of the weights the layer touches at every S, in the same process (the floor `bench
    moe` prints beside the engines), and run_moe dropped it: README.md quoted run 194's plain reads (273.6 / 410.8 µs)
    as if from summary.csv, where no row held them. Each engine's rows now carry it; a failed engine fails only its
    own timings, not the plain read."""
    from moetune.tuner.measure import moe as M

    q = {"median": 10.0, "p10": 9.0, "p90": 11.0}
    read = {"median": 5.0, "p10": 4.5, "p90": 5.5}
    rep = {"iters": 50, "graph": True, "cases": [
        {"engine": "unfused", "S": 16, "eager_us": q, "graph_us": q, "plain_read_us": read},
        {"engine": "megakernel", "S": 16, "failed": "wrong output"}]}
    monkeypatch.setattr(M, "bench_moe", lambda *a, **k: rep)
    args = {"model": "qwen3-30b", "tokens": [16], "cuda_graph": True}
    out = {r.case: r for r in moe_drivers.run_moe([records.Resolved("unfused", dict(args, engine="unfused"), {}),
                                                   records.Resolved("megakernel", dict(args, engine="megakernel"), {})],
                                                  records.Ctx(world=1, backend="none", smoke=False, tmp=tmp_path))}
    st = out["unfused"].metrics["plain_read_us[S=16]"]
    assert (st.median, st.p10, st.p90, st.n, st.unit) == (5.0, 4.5, 5.5, 50, "us")
    assert set(out["megakernel"].failed) == {"layer_us[S=16]", "graph_us[S=16]"}


def test_a_mistyped_key_of_a_scenario_file_is_refused_naming_it(tmp_path: Path) -> None:
    """A key the loader does not read was dropped without a word: `[needs] gpu = 2` (for gpus) made a GPU scenario
    a CPU one that `bench run` ran (and stamped) on any machine, `launchs = 5` ran the default 3 launches, a case's
    `smoke_arg` ran the smoke variant at full size. Each is refused, naming the file, where it is and the key."""
    head = 'name = "x"\ndriver = "gpu-rates"\nquestion = "q"\nmetrics = ["read_tbps"]\n'
    case = '[[cases]]\nname = "a"\n'
    for extra, where, key in (("launchs = 5\n", "", "launchs"), ("", "needs", "gpu"), ("", "smoke", "skp"),
                              ("", "case", "smoke_arg"), ("", "smoke.needs", "worlds")):
        body = head + extra
        if where == "needs":
            text = body + "[needs]\ngpu = 2\n" + case
        elif where == "smoke":
            text = body + '[smoke]\nskp = "GPU only"\n' + case
        elif where == "smoke.needs":
            text = body + "[smoke.needs]\nworlds = 2\n" + case
        elif where == "case":
            text = body + case + "smoke_arg = { size = 1 }\n"
        else:
            text = body + case
        (tmp_path / "x.toml").write_text(text)
        with pytest.raises(ScenarioError, match=f"unknown key.*'{key}'") as e:
            definitions.load(tmp_path / "x.toml")
        assert str(tmp_path / "x.toml") in str(e.value)


def test_the_moe_driver_takes_one_token_count_as_it_runs_it(monkeypatch, tmp_path: Path) -> None:
    """run_moe times `tokens = 16` (one count, not a list) as [16], but the command stored with its rows was built
    first from the list it is not: TypeError 'int' object is not iterable, a traceback out of `bench run`, nothing
    timed. The command names the count it times."""
    from moetune.tuner.measure import moe as M

    q = {"median": 10.0, "p10": 9.0, "p90": 11.0}
    seen: list[object] = []

    def bench(shape: object, toks: list[int], *a: object, **k: object) -> dict:
        seen.append(toks)
        return {"iters": 50, "graph": False, "cases": [{"engine": "unfused", "S": 16, "eager_us": q}]}

    monkeypatch.setattr(M, "bench_moe", bench)
    (r,) = moe_drivers.run_moe([records.Resolved("unfused", {"model": "qwen3-30b", "tokens": 16, "engine": "unfused"},
                                                 {})], records.Ctx(world=1, backend="none", smoke=False, tmp=tmp_path))
    assert seen == [[16]] and "--tokens 16 " in r.command and r.metrics["layer_us[S=16]"].median == 10.0


def test_the_moe_knobs_driver_fails_a_bad_token_count_without_a_traceback(tmp_path: Path) -> None:
    """run_moe_knobs turned one token count into an int before its try: `tokens = "x"` raised ValueError out of
    `bench run` (a traceback). The cases fail with the reason, as any other bad argument does."""
    out = moe_drivers.run_moe_knobs([records.Resolved("base", {"tokens": "x"}, {}), records.Resolved("v", {}, {})],
                                    records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path))
    assert [r.case for r in out] == ["base", "v"] and all("x" in r.error and not r.metrics for r in out)


def _bench_ep_knobs(command: str) -> dict:
    """The knobs `moetune bench ep` runs for a stamped command (its --transport and --knobs, as its CLI takes them)."""
    import shlex

    from moetune.runtime.knobs import Knobs, default_knobs

    argv = shlex.split(command)
    opts = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--transport", "--knobs")}
    if "--transport" in opts:
        t = opts["--transport"]
        return Knobs.parse(opts.get("--knobs", ""), base=default_knobs(t)).replace(transport=t).to_dict()
    return Knobs.parse(opts.get("--knobs", "")).to_dict()


@pytest.mark.parametrize("args", [{"transport": "nvlink"}, {"transport": "nvlink", "knobs": "num_sms=8"},
                                  {"transport": "collective", "layout": "dense"},
                                  {"knobs": "transport=host_staged,compression=fp8_e4m3,pipeline_depth=4,wait_mode=kernel"},
                                  {"transport": "host_staged", "knobs": "compression=fp8_e4m3"}])
def test_an_ep_rows_command_runs_the_knobs_the_case_ran(args: dict, monkeypatch) -> None:
    """The ep driver builds a case's knobs as the bench worker does (`case_config`: `knobs` on the defaults, then
    `transport` put in), but stamped its rows with `moetune bench ep --transport T`, which starts from T's safe
    defaults (`default_knobs`): the nvlink case of ep-roundtrip-qwen3-s128 ran signalling=decoupled, and its command
    runs signalling=coupled. The command now runs exactly the knobs that ran (unchanged where they agree)."""
    from types import SimpleNamespace

    from moetune.runtime.transports import registry as transports
    from moetune.tuner.measure.worker import case_config

    # nvlink needs GPUs to run; its knobs are built alike without them
    monkeypatch.setattr(transports, "available_transports", lambda _dev: {args.get("transport"): SimpleNamespace(ok=True)})
    ran = case_config(dict(args), 2, "nccl")["knobs"]
    cmd = ep_driver.ep_command(args, {}, 2, "nccl")
    assert _bench_ep_knobs(cmd) == ran, cmd
    if args.get("transport") != "nvlink":  # where `--transport` already ran them: the command as it was
        assert ("--knobs" in cmd) == ("knobs" in args), cmd


@pytest.mark.parametrize("exit_code", [1, 0])
@pytest.mark.parametrize("scenario", ["daemon-load", "runtime-host-cost", "fabric-discovery", "fabric-model",
                                      "search-efficiency", "proxy-fences", "proxy-ack-cost"])
def test_a_failed_script_case_is_stamped_with_the_command_that_ran(scenario: str, exit_code: int, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """A bench/*.py driver whose script exited non-zero, or whose output could not be read, stamped its FAILED rows
    with `python bench/SCRIPT` alone: not the command that ran (its flags, its environment). They carry it now."""
    import shlex

    from moetune.tuner.measure.scenarios.drivers import scripts

    ran: list[list[str]] = []

    def fake_run(argv: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        ran.append(argv)
        return subprocess.CompletedProcess(argv, exit_code, stdout="not the script's output\n", stderr="boom\n")

    monkeypatch.setattr(scripts.subprocess, "run", fake_run)
    s = SCENARIOS[scenario]
    seq = runner.plan(s, None, smoke=True)
    out = registry.DRIVERS[s.driver](seq, records.Ctx(world=1, backend="none", smoke=True, tmp=tmp_path))
    failed = [r for r in out if not r.metrics]
    assert ran and failed, out
    flags = {" ".join(map(shlex.quote, argv[2:])) for argv in ran}
    for r in failed:
        assert r.command.split("python bench/", 1)[-1].partition(" ")[2] in flags, (r.command, flags)


def test_a_left_out_row_is_named_by_its_line_after_a_value_of_several_lines(tmp_path: Path) -> None:
    """`bench summarize` names a row it leaves out by its line in the CSV; a value holding a newline (a FAILED note
    quoting a script's error) spans lines, and every row after it was named a line too early: the editor opened at
    `line 3` showed the middle of the note, not the bad row (line 5)."""
    src = tmp_path / "r.csv"
    base = {c: "" for c in R.COLUMNS} | {"scenario": "runtime-host-cost", "case": "plain", "metric":
                                         "host_us_per_roundtrip", "source": "measured"}
    R.append_rows(src, [base | {"note": "FAILED: exited 1:\nTraceback ...\nRuntimeError: boom"},
                        base | {"median": "abc"}])
    n, bad = R.row_problems(R.read_rows(src), SCENARIOS)
    lines = src.read_text().splitlines()
    assert lines[4].startswith("runtime-host-cost,plain,") and ",abc," in lines[4]  # line 5 of the file
    assert (n, bad) == (1, ["line 5: median 'abc' of host_us_per_roundtrip is not a finite number"]), bad


def test_an_ep_rows_command_quotes_its_environment() -> None:
    """A case's `env` went into its rows' command unquoted: NCCL_DEBUG_SUBSYS="INIT,GRAPH ENV" gave
    `NCCL_DEBUG_SUBSYS=INIT,GRAPH ENV moetune bench ep ...`, which a shell runs as the command `ENV`. Each value is
    quoted as the bench/*.py drivers' commands quote theirs."""
    import shlex

    cmd = ep_driver.ep_command({"tokens": 8}, {"NCCL_DEBUG_SUBSYS": "INIT,GRAPH ENV", "NCCL_P2P_DISABLE": "1"}, 2, "gloo")
    words = shlex.split(cmd)
    assert words[:3] == ["NCCL_DEBUG_SUBSYS=INIT,GRAPH ENV", "NCCL_P2P_DISABLE=1", "moetune"], cmd


def test_an_ep_case_whose_pair_graph_failed_gets_a_failed_row_for_it(tmp_path: Path, monkeypatch) -> None:
    """bench_case reports why dispatch + combine could not be replayed from a CUDA graph in `graph_pair_error` (the
    round trip's graph captured fine); the ep driver read only `graph_error`, so graph_pair_us -- the first metric of
    ep-roundtrip-qwen3-s128, its headline -- was missing without a word, as if the case did not give it, and the
    summary silently headed the scenario with graph_roundtrip_us. It is a FAILED row with the reason now; the other
    metrics' rows stand."""
    from moetune.runtime.testing import launch as launch_mod

    q = {"median": 30.0, "p10": 29.0, "p90": 31.0}
    rep = {"iters": 5, "roundtrip_us": q, "graph_roundtrip_us": q, "graph_pair_us": None, "graph_error": None,
           "graph_pair_error": "RuntimeError: operation not permitted when stream is capturing"}
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: [[dict(rep)]])
    s = SCENARIOS["ep-roundtrip-qwen3-s128"]
    case = records.Resolved("collective", {"model": "custom:64,32,8,2", "tokens": 8, "cuda_graph": True}, {})
    out = registry.DRIVERS["ep"]([case], records.Ctx(world=2, backend="gloo", smoke=False, tmp=tmp_path))
    rows = runner.launch_rows(s, out, "L1", {"source": "measured"})
    by = {r["metric"]: r for r in rows}
    assert s.metrics[0] == "graph_pair_us"
    assert by["graph_pair_us"]["note"].startswith("FAILED") and "stream is capturing" in by["graph_pair_us"]["note"]
    assert by["graph_roundtrip_us"]["median"] == 30.0 and not by["graph_roundtrip_us"]["note"].startswith("FAILED")


@pytest.mark.parametrize("driver, args", [
    ("ep", {"model": "custom:64,32,8,2", "tokens": [16, 128], "iters": 1, "warmup": 0, "layer": False}),
    ("moe", {"model": "custom:128,64,8,2", "tokens": [4], "iters": [3], "engine": "unfused"}),
    ("moe", {"model": "custom:128,64,8,2", "tokens": ["4"], "iters": 1, "warmup": 0, "rotate": 1, "engine": "unfused"}),
    ("moe-knobs", {"model": "custom:128,64,8,2", "tokens": [4], "iters": 1, "warmup": 0, "rotate": 1, "chain": [2]}),
])
def test_a_scenario_argument_of_the_wrong_type_fails_its_cases_not_bench_run(driver: str, args: dict,
                                                                                 tmp_path: Path) -> None:
    """A scenario argument of the wrong type (`tokens = [16, 128]` in an ep scenario, where moe scenarios take a list;
    `iters = [3]`; a token count written as a string) raised TypeError out of the driver: `bench run` ended in a
    traceback, the launches before it saved but this one's other cases lost. The driver fails the cases with Python's
    reason and the case's arguments beside it, as it fails a value of the right type that is out of range."""
    cases = [records.Resolved("unfused" if driver == "moe" else "base", dict(args), {})]
    out = registry.DRIVERS[driver](cases, records.Ctx(world=2 if driver == "ep" else 1,
                                                       backend="gloo" if driver == "ep" else "none", smoke=True,
                                                       tmp=tmp_path))
    assert len(out) == 1 and not out[0].metrics and "an argument of the wrong type among" in out[0].error, out


def test_a_case_smoke_or_launches_of_another_type_is_refused(tmp_path: Path) -> None:
    """`smoke = "false"` (a string) was taken for true by bool(): the GPU-only case ran in every smoke run and failed
    there; `launches = true` passed as 1 (a bool is an int). Each is refused when the file is read, naming it."""
    head = 'name = "x"\ndriver = "gpu-rates"\nquestion = "q"\nmetrics = ["read_tbps"]\n[[cases]]\nname = "read-sum"\n'
    path = tmp_path / "x.toml"
    for extra, words in (('[[cases]]\nname = "read-gemv"\nsmoke = "false"\n', "cases[1] (read-gemv): 'smoke'"),
                         ('launches = true\n', "'launches'")):
        path.write_text(extra + head if extra.startswith("launches") else head + extra)
        with pytest.raises(ScenarioError, match=re.escape(words)):
            definitions.load(path)
    path.write_text(head + '[[cases]]\nname = "read-gemv"\nsmoke = false\n')
    assert [c.smoke for c in definitions.load(path).cases] == [True, False]


def test_an_env_a_driver_would_ignore_is_refused(tmp_path: Path) -> None:
    """The moe and moe-knobs drivers time the layer in `bench run`'s own process: a scenario's or a case's `env`
    (CUDA_DEVICE_MAX_CONNECTIONS = "1", ...) was never set anywhere, and its rows claimed a measurement under it. A
    single-shot script driver runs its script once with the first case's environment: another case's own `env` was
    dropped. Both are refused when the file is read, as a case argument such a driver would ignore is."""
    moe = ('name = "m"\ndriver = "moe"\nquestion = "q"\nmetrics = ["layer_us[S=16]"]\n[args]\ntokens = [16]\n'
           '[[cases]]\nname = "unfused"\nargs = { engine = "unfused" }\n')
    for extra in ('[env]\nCUDA_DEVICE_MAX_CONNECTIONS = "1"\n',
                  '[[cases]]\nname = "torch"\nargs = { engine = "torch" }\nenv = { CUDA_DEVICE_MAX_CONNECTIONS = "1" }\n'):
        (tmp_path / "m.toml").write_text(moe + extra)
        with pytest.raises(ScenarioError, match=r"m\.toml.*CUDA_DEVICE_MAX_CONNECTIONS.*driver moe"):
            definitions.load(tmp_path / "m.toml")
    rates = ('name = "r"\ndriver = "gpu-rates"\nquestion = "q"\nmetrics = ["read_tbps"]\n[[cases]]\nname = "read-sum"\n'
             '[[cases]]\nname = "read-gemv"\nenv = { CUDA_VISIBLE_DEVICES = "1" }\n')
    (tmp_path / "r.toml").write_text(rates)
    with pytest.raises(ScenarioError, match=r"cases\[1\] \(read-gemv\).*CUDA_VISIBLE_DEVICES.*first case"):
        definitions.load(tmp_path / "r.toml")
    # a scenario-wide env of a script driver reaches its script: kept
    (tmp_path / "r.toml").write_text(rates.replace('env = { CUDA_VISIBLE_DEVICES = "1" }\n', "")
                                     + '[env]\nCUDA_VISIBLE_DEVICES = "1"\n')
    assert definitions.load(tmp_path / "r.toml").env == {"CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize("needs", ['gpus = 1.5', 'gpus = true', 'world = "2"', 'world = 2.9'])
def test_needs_of_another_type_are_refused(needs: str, tmp_path: Path) -> None:
    """[needs] gpus / world went through int(): `gpus = 1.5` needed 1 GPU, `world = 2.9` spawned 2 ranks, `gpus = true`
    needed 1: a typo became another machine's requirement, without a word. They must be integers."""
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\ndriver = "gpu-rates"\nquestion = "q"\nmetrics = ["read_tbps"]\n'
                    f'[needs]\n{needs}\n[[cases]]\nname = "read-sum"\n')
    with pytest.raises(ScenarioError, match=rf"needs.*{needs.split()[0]}"):
        definitions.load(path)


def test_two_imports_of_one_report_at_once_append_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `bench run --from-report` of the same report at the same moment: both pass the early look at the table
    (a barrier holds each after it until the other has looked too), yet only one appends the launch; the duplicate
    check that counts is made under the table's append lock."""
    import threading

    s, out = SCENARIOS["moe-megakernel-vs-unfused"], tmp_path / "s.csv"
    looked = threading.Barrier(2, timeout=10)
    read, first = R.read_rows, threading.local()

    def read_then_wait(path: Path) -> list[dict[str, str]]:
        rows = read(path)
        if not getattr(first, "done", False):  # the import's early look (later reads: the append's own checks)
            first.done = True
            looked.wait()  # the window made certain: neither appends before both have looked at the table
        return rows

    monkeypatch.setattr(R, "read_rows", read_then_wait)
    errors: list[BaseException] = []

    def one() -> None:
        try:
            moe_report.import_moe_report(s, _moe_report([1, 16, 128, 1024, 4096]), origin="x.json", results=out)
        except ScenarioError as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    monkeypatch.setattr(R, "read_rows", read)
    assert len(errors) == 1 and "already" in str(errors[0])
    assert len(R.read_rows(out)) == 3 * 5 * 2  # one launch's rows, not two
