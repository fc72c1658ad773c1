"""`moetune profile` run again: --restart starts this flow's tuning over (new studies, nothing deleted), an interrupted
microbenchmark stage does not store its measurements twice, every compared bucket is in the report (a failed tuned
run included), and the state file and report.md are replaced atomically."""

from __future__ import annotations

import io
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import optuna
import pytest
from rich.console import Console
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs
from moetune.tuner.search.backends import TuneWorkload

# their bring-ups inject the timings of a GPU node's capture: run as ON that node (conftest), the only place a
# measurement may be stored under its key
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"


def flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    return {"graph_us": [300.0, 303.0, 297.0], "eager_us": [301.0] * 3}


def bm16_better(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    base = 300.0 * (0.7 if knobs.mk_bm == 16 else 1.0)
    return {"graph_us": [base, base + 1, base - 1], "eager_us": [base * 1.01] * 3}


def bm16_fails(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    if knobs.mk_bm == 16:
        raise RuntimeError("kernel launch failed: too many resources requested")
    return flat(knobs, wl)


def _bringup(tmp_path: Path, measure: Any, capture: str = "h200x1", **plan_kw: Any) -> Any:
    from moetune.tuner.bringup.flow import Bringup, Plan

    plan = Plan(**{"models": ["qwen3-30b"], "tokens": [16], "trials": 12, "repeats": 1, "iters": 5,
                   "compare_rounds": 2, **plan_kw})
    return Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                   console=Console(file=io.StringIO(), width=200), capture=CAPTURES / capture,
                   storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=measure)


# -- 1. --restart ---------------------------------------------------------------------------------------------------
def _trials_by_study(url: str) -> dict[str, int]:
    st = optuna.storages.RDBStorage(url)
    return {s.study_name: s.n_trials for s in optuna.get_all_study_summaries(st) if s.study_name.startswith("moetune/")}


def test_restart_tunes_again_in_new_studies_and_deletes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow
    from moetune.tuner.cli import app

    init = flow.Bringup.__init__

    def with_fake_kernel(self: Any, **kw: Any) -> None:  # the megakernel timed by a stand-in, not a GPU
        init(self, **kw, mk_measure=flat)

    monkeypatch.setattr(flow.Bringup, "__init__", with_fake_kernel)
    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])  # no subprocesses
    plan = tmp_path / "plan.toml"
    plan.write_text('[plan]\nmodels = ["qwen3-30b"]\ntokens = [16]\ntrials = 3\nrepeats = 1\niters = 5\n'
                    "compare_rounds = 1\n")
    db = tmp_path / "home" / "moetune.db"
    db.parent.mkdir()  # moetune creates no folder for an explicit --db
    args = ["profile", "--plan", str(plan), "--capture", str(CAPTURES / "h200x1"), "--db", str(db), "--json"]
    url = f"sqlite:///{db.parent / 'moetune-studies.db'}"
    runner = CliRunner()

    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    first = _trials_by_study(url)
    assert len(first) == 1 and all(n == 3 for n in first.values())
    store = F.open_store(db)
    profiles = len(store.list_profiles())
    assert profiles >= 1

    r = runner.invoke(app, [*args, "--restart"])
    assert r.exit_code == 0, r.output
    second = _trials_by_study(url)
    assert {k: second[k] for k in first} == first  # the earlier studies are kept as they were
    new = {k: n for k, n in second.items() if k not in first}
    assert len(new) == 1 and all(n == 3 for n in new.values())  # and the tuning ran again, in a new study
    assert len(store.list_profiles()) >= profiles  # no stored profile deleted

    # a rerun without --restart resumes the restarted run (its studies), it does not go back to the first
    state = json.loads(next((db.parent).glob("*bringup-*.json")).read_text())
    state["done"] = {k: v for k, v in state["done"].items() if k in ("discover", "microbench", "calibrate")}
    (next((db.parent).glob("*bringup-*.json"))).write_text(json.dumps(state))
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert _trials_by_study(url) == second


def test_a_new_plan_after_a_restart_keeps_the_restarted_studies(tmp_path: Path) -> None:
    from moetune.tuner.bringup.flow import BringupState, Plan

    state = BringupState(tmp_path / "bringup-x.json", "x", Plan())
    assert state.study_tag == ""  # no restart yet: the studies of the same settings are resumed, as before
    state.mark("discover", {})
    state.restart()
    tag = state.study_tag
    assert tag and state.done("discover") is False
    assert BringupState(state.path, "x", Plan()).study_tag == tag  # a rerun resumes the restarted run
    other = BringupState(state.path, "x", Plan(tokens=[64]))
    assert other.study_tag == tag and not other.done("discover")  # a new plan: new stages, the same generation
    assert BringupState(state.path, "y", Plan()).study_tag == ""  # another node starts over


def test_finished_stages_of_another_plan_are_said_to_be_dropped(tmp_path: Path) -> None:
    """An interrupted `--quick` bring-up resumed after an upgrade that changed the quick plan's defaults started
    again from discover without a word: the state names what changed and that it starts over."""
    from moetune.tuner.bringup.flow import BringupState, Plan

    state = BringupState(tmp_path / "bringup-x.json", "x", Plan(compare_rounds=1))
    state.mark("discover", {})
    again = BringupState(state.path, "x", Plan(compare_rounds=2))
    assert not again.done("discover") and "compare_rounds" in again.dropped and "starting over" in again.dropped
    assert BringupState(state.path, "x", Plan(compare_rounds=1)).dropped == ""  # the same plan resumes
    assert BringupState(state.path, "y", Plan(compare_rounds=2)).dropped == ""  # another node: nothing of its own


# -- 2. the report shows every compared bucket ---------------------------------------------------------------------
def test_report_shows_a_bucket_whose_tuned_run_failed(tmp_path: Path) -> None:
    from moetune.tuner.bringup.flow import report_from_store

    b = _bringup(tmp_path, bm16_better)
    b.state.mark("discover", b.stage_discover())
    b.state.mark("microbench", [])
    b.state.mark("calibrate", {"skipped": "test"})
    b.state.mark("tune", b.stage_tune())
    assert b.state.result("tune")[0]["knobs"]["mk_bm"] == 16
    b.mk_measure = bm16_fails  # the tuned setting fails when measured side by side
    b.state.mark("compare", b.stage_compare())
    row = b.state.result("compare")[0]
    assert math.isnan(row["tuned_us"]) and row["stored"] == "policy default" and row["written"]

    for text in (Path(b.stage_report()).read_text(),
                 report_from_store(b.store, b.facts, tmp_path / "from-store").read_text()):
        table = [line for line in text.splitlines() if line.startswith("| megakernel | qwen3-30b | 1 | 16 ")]
        assert len(table) == 1, text
        assert "policy default" in table[0] and "tuned run failed" in table[0] and "too many resources" in table[0]
        assert "nan" not in table[0]


# -- 3. an interrupted microbenchmark stage, run again ---------------------------------------------------------------
class FakeBench:
    def __init__(self, transport: str, runner: str, interrupt: int = 0):
        self.transport, self.runner, self.interrupt, self.calls = transport, runner, interrupt, 0

    def run(self, sizes: Any, *, iters: int = 20) -> list[Any]:
        from moetune.tuner.measure.micro import MicroResult

        self.calls += 1
        if self.calls <= self.interrupt:
            raise KeyboardInterrupt
        return [MicroResult(self.transport, kind, d, size, 10.0 + size / 1e3, 0.5, unit)
                for size in (4096, 65536) for d in ("0->1", "1->0")
                for kind, unit in (("latency", "us"), ("bandwidth", "GB/s"))]


class InterruptingStore:
    """The store, with a Ctrl-C after `after` more measurements (a stage cut short while storing a benchmark)."""

    def __init__(self, store: Any, after: int | None = None):
        self._store, self.after = store, after

    def add_measurement(self, **kw: Any) -> int:
        if self.after is not None:
            if self.after == 0:
                self.after = None
                raise KeyboardInterrupt
            self.after -= 1
        return self._store.add_measurement(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _plotted(monkeypatch: pytest.MonkeyPatch, store: Any, facts: Any, out: Path) -> list[dict]:
    from moetune.tuner.bringup import flow, report

    seen: list[Any] = []
    real = report.write_report
    monkeypatch.setattr(report, "write_report", lambda data, d: (seen.append(data), real(data, d))[1])
    flow.report_from_store(store, facts, out)
    return seen[0].measurements


def _points(rows: list[dict]) -> list[tuple]:
    return sorted((r["transport"], r["kind"], r["direction"], r["size_bytes"]) for r in rows)


@pytest.mark.parametrize("cut", ["between_benchmarks", "while_storing"])
def test_microbench_rerun_does_not_store_measurements_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             cut: str) -> None:
    from moetune.tuner.measure import micro

    a = FakeBench("collective", "gloo_p2p")
    b = FakeBench("host_staged", "nccl_p2p", interrupt=1 if cut == "between_benchmarks" else 0)
    monkeypatch.setattr(micro, "plan", lambda *args, **kw: [(a, True, ""), (b, True, "")])
    first = _bringup(tmp_path, flat, capture="cpu-laptop")
    first.stage_discover()
    if cut == "while_storing":  # Ctrl-C after the first benchmark and half of the second are stored
        first.store = InterruptingStore(first.store, after=8 + 4)
    with pytest.raises(KeyboardInterrupt):
        first.stage_microbench()

    again = _bringup(tmp_path, flat, capture="cpu-laptop")  # the rerun: a new process, the same state file
    again.state.mark("microbench", again.stage_microbench())
    want = sorted(_points([asdict(r) for bench in (FakeBench("collective", "gloo_p2p"),
                                                  FakeBench("host_staged", "nccl_p2p")) for r in bench.run(())]))
    assert _points(again.state.result("microbench")) == want
    assert _points(_plotted(monkeypatch, again.store, again.facts, tmp_path / "r")) == want
    assert a.calls == 1  # the benchmark that finished was not run again: its measurements were kept


# -- 4. atomic writes ---------------------------------------------------------------------------------------------
def _spy_fsync_and_replace(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_replace(src: Any, dst: Any) -> None:
        calls.append(("replace", f"{os.fspath(src)} -> {os.fspath(dst)}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    return calls


def _synced_then_replaced(calls: list[tuple[str, str]], target: Path) -> bool:
    for i, (what, arg) in enumerate(calls):
        if what == "replace" and arg.endswith(f" -> {target}"):
            tmp = os.path.realpath(arg.split(" -> ")[0])  # as /proc names the fsynced fd's file
            return Path(tmp).parent == target.resolve().parent and ("fsync", tmp) in calls[:i]
    return False


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name an fd's file")
def test_state_file_and_report_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup.flow import BringupState, Plan
    from moetune.tuner.bringup.report import ReportData, write_report

    calls = _spy_fsync_and_replace(monkeypatch)
    state = BringupState(tmp_path / "bringup-x.json", "x", Plan())
    state.mark("discover", {"ok": True})
    assert _synced_then_replaced(calls, state.path), calls
    out = tmp_path / "report"
    path = write_report(ReportData(node="n", fingerprint="x"), out)
    assert _synced_then_replaced(calls, path), calls

    # a write that fails leaves the previous file whole, and no temporary file behind
    before = path.read_text()

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        write_report(ReportData(node="another node", fingerprint="x"), out)
    assert path.read_text() == before
    with pytest.raises(OSError, match="No space"):
        state.mark("microbench", [])
    assert json.loads(state.path.read_text())["done"] == {"discover": {"ok": True}}
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".tmp") == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["bringup-x.json"]


@pytest.mark.parametrize("earlier", [False, True])
def test_a_refused_calibration_says_a_rerun_only_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        earlier: bool) -> None:
    """`profile` whose calibration was refused said only that no node model was written: the daemon's model re-tune
    then said to run `moetune profile`, which resumed the finished bring-up ("calibrate (done earlier; resuming)")
    and wrote none again. The summary now names what writes one (`--restart`) or re-tunes without one (the local
    backend); an earlier node model left as it was needs neither."""
    from moetune.tuner.bringup import flow
    from moetune.tuner.cli import app

    cal: dict[str, Any] = {"base": "nvlink-h200x2", "refused": ["too few measured rows: 1 distinct row"],
                           "node_model": None}
    if earlier:
        cal["earlier_node_model"] = str(tmp_path / "node-x.toml")
    monkeypatch.setattr(flow.Bringup, "run", lambda self: {"calibrate": cal, "compare": [], "report": "r.md"})
    db = tmp_path / "m.db"
    r = CliRunner().invoke(app, ["profile", "--capture", str(CAPTURES / "h200x1"), "--db", str(db)],
                           env={"COLUMNS": "400", "MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "node fabric model NOT written (calibration refused): too few measured rows" in said, said
    assert ("`moetune profile --restart`" in said and '[tune] backend = "local"' in said) is not earlier, said
    # "NOT written" alone, with an earlier node model still in place (and used by the daemon's model re-tune), read as
    # if this node had none: the summary names it, as the report does
    assert (f"the node model from an earlier bring-up ({tmp_path / 'node-x.toml'}) is left as it was" in said) is earlier, said
