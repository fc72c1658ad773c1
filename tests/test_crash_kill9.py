"""Crash safety proven with real kills: a subprocess SIGKILLed at a point a test hook reaches (a monkeypatched
store method or sleep that signals the parent, then waits), and what it left on disk read back by the next run."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

pytestmark = pytest.mark.timeout(120)
CAPTURES = Path(__file__).resolve().parent / "captures"


def _run_until(script: str, args: list[str], mark: str, timeout: float = 60.0) -> subprocess.Popen:
    """Start `script` (python -c) and return once it printed `mark` on stdout (it then waits to be killed)."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.strip() == mark:
            return proc
    proc.kill()
    _out, err = proc.communicate()
    raise AssertionError(f"the child never reached {mark!r}: {err[-3000:]}")


def _kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


# -- the bring-up's microbenchmark rows ----------------------------------------------------------------------------
class FakeBench:
    """A microbenchmark that measures nothing: 8 rows (2 sizes x 2 directions x latency / bandwidth)."""

    transport, runner = "collective", "gloo_p2p"

    def run(self, sizes: Any, *, iters: int = 20) -> list[Any]:
        from moetune.tuner.measure.micro import MicroResult

        return [MicroResult(self.transport, kind, d, size, 10.0 + size / 1e3, 0.5, unit)
                for size in (4096, 65536) for d in ("0->1", "1->0")
                for kind, unit in (("latency", "us"), ("bandwidth", "GB/s"))]


def _bringup(tmp: Path, state_dir: Path) -> Any:
    from rich.console import Console

    from moetune.tuner.bringup.flow import Bringup, Plan

    plan = Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=5, compare_rounds=1)
    return Bringup(store=F.open_store(tmp / "b.db"), plan=plan, state_dir=state_dir,
                   console=Console(file=io.StringIO(), width=200), capture=CAPTURES / "cpu-laptop",
                   storage=f"sqlite:///{tmp / 'opt.db'}")


def _on_this_node() -> None:
    """As conftest's `on_captured_node`: live discovery answers the capture's facts (a bring-up of it measures)."""
    from moetune.tuner.fabric import discovery

    real, seen = discovery.discover, []

    def discover(capture: Any = None, **kw: Any) -> Any:
        facts = real(capture, **kw)
        if capture is not None:
            seen.append(facts)
        return facts

    discovery.discover = discover
    discovery.live_facts = lambda timeout_s=1.5: seen[-1] if seen else real(None, timeout_s=timeout_s)


MICROBENCH_KILLED = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import test_crash_kill9 as T
from moetune.tuner.measure import micro
T._on_this_node()
micro.plan = lambda *a, **kw: [(T.FakeBench(), True, "")]
b = T._bringup(Path(sys.argv[1]), Path(sys.argv[1]) / "state-second")
b.stage_discover()
real, n = b.store.add_measurement, [0]
def add_measurement(**kw):
    got = real(**kw)
    n[0] += 1
    if n[0] == 3:  # three of the benchmark's eight rows stored: killed here
        print("STORING", flush=True)
        time.sleep(120)
    return got
b.store.add_measurement = add_measurement
b.stage_microbench()
"""


def test_a_bringup_killed_while_storing_a_benchmark_leaves_the_earlier_whole_run_in_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark's rows were stored one transaction each: a bring-up killed after 3 of its 8 rows left those 3
    as the benchmark's latest run, which `moetune report` shows in place of an earlier whole run (the other 5
    points gone from the report). Its rows are one transaction now: a kill stores none of them."""
    from moetune.tuner.bringup import flow, report
    from moetune.tuner.measure import micro

    _on_this_node_fixture(monkeypatch)
    monkeypatch.setattr(micro, "plan", lambda *a, **kw: [(FakeBench(), True, "")])
    first = _bringup(tmp_path, tmp_path / "state-first")  # an earlier bring-up, whole
    first.stage_discover()
    first.stage_microbench()
    first.store.close()

    proc = _run_until(MICROBENCH_KILLED, [str(tmp_path), str(Path(__file__).resolve().parent)], "STORING")
    _kill9(proc)

    seen: list[Any] = []
    real = report.write_report
    monkeypatch.setattr(report, "write_report", lambda data, d: (seen.append(data), real(data, d))[1])
    store = F.open_store(tmp_path / "b.db")
    flow.report_from_store(store, first.facts, tmp_path / "report")
    points = sorted((r["kind"], r["direction"], r["size_bytes"]) for r in seen[0].measurements)
    assert len(points) == 8, points  # the whole earlier run, not the killed run's first rows
    assert len(store.list_measurements(fingerprint=first.facts.fingerprint)) == 8


def _on_this_node_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.fabric import discovery

    monkeypatch.setattr(discovery, "discover", discovery.discover)
    monkeypatch.setattr(discovery, "live_facts", discovery.live_facts)
    _on_this_node()  # undone by monkeypatch at the test's end


# -- the benchmark results table (summary.csv) ---------------------------------------------------------------------
def _result_row(launch: str, median: str, note: str = "") -> dict[str, str]:
    from moetune.tuner.measure import results as R

    return {c: "" for c in R.COLUMNS} | {"scenario": "gpu-rates", "case": "read-sum", "baseline": "1", "position": "0",
                                         "launch": launch, "metric": "read_tbps", "unit": "TB/s", "median": median,
                                         "source": "measured", "date": "2026-12-05T00:00:00Z", "git_sha": "a" * 40,
                                         "note": note}


APPEND_KILLED = """
import pathlib, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import test_crash_kill9 as T
from moetune.tuner.measure import results as R
f, cut = Path(sys.argv[1]), sys.argv[2]
real_open = pathlib.Path.open

class Torn:  # the kernel's short write of a process killed mid-write: part of the text is in the file
    def __init__(self, fh):
        self.fh = fh
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.fh.close()
    def write(self, text):
        at = len(text) // 2 if cut == "half" else text.index("line one") + len("line one") + 1
        self.fh.write(text[:at])
        self.fh.flush()
        print("TORN", flush=True)
        time.sleep(120)

def torn_open(self, mode="r", *a, **k):
    fh = real_open(self, mode, *a, **k)
    return Torn(fh) if mode == "a" and self == f else fh

pathlib.Path.open = torn_open
R.append_rows(f, [T._result_row("L2", "2.6"), T._result_row("L3", "2.7", note="FAILED: line one\\nline two")])
"""


@pytest.mark.parametrize("cut", ["half", "in_quote"])
def test_an_append_killed_mid_write_does_not_refuse_the_table_for_good(tmp_path: Path, cut: str) -> None:
    """A `bench run` killed while its rows were being appended (a short write: the kernel stops copying at a SIGKILL)
    left a row cut short at the table's end. Cut in a plain value, every later `bench run`, `bench summarize` and
    append refused the table ("does not have the 27 columns of a results row") until it was edited by hand; cut
    inside a quoted value (a FAILED note quoting a multi-line error) the cut row read as a whole one, and the next
    append's rows were read into its open quote: lost without a word. The cut row is no row (its process never
    finished the append): reads leave it out, and the next append, under the table's lock, cuts it off first."""
    from moetune.tuner.measure import results as R

    f = tmp_path / "summary.csv"
    R.append_rows(f, [_result_row("L1", "2.5")])
    proc = _run_until(APPEND_KILLED, [str(f), cut, str(Path(__file__).resolve().parent)], "TORN")
    _kill9(proc)

    R.check_table(f)  # what `bench run` checks before it measures
    R.append_rows(f, [_result_row("L4", "2.8")])
    rows = R.read_rows(f)
    assert rows[0]["launch"] == "L1" and rows[-1]["launch"] == "L4"
    assert rows[-1]["median"] == "2.8" and rows[-1]["note"] == ""  # the new row is a row of its own
    assert [r["launch"] for r in rows] in (["L1", "L4"], ["L1", "L2", "L4"])  # whole rows only: no cut L3


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name an fd's file")
def test_appended_rows_are_on_disk_when_the_append_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The append was never fsynced: a power loss after `bench run` said its rows were saved could lose them (a
    power loss cannot be simulated by a kill: the fsync is checked)."""
    from moetune.tuner.measure import results as R

    f = tmp_path / "summary.csv"
    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    R.append_rows(f, [_result_row("L1", "2.5")])
    assert str(f.resolve()) in synced
    R.append_rows(Path(os.devnull), [_result_row("L2", "2.5")])  # a device: written, not synced


# -- BENCHMARKS.md in the source checkout --------------------------------------------------------------------------
SUMMARIZE_KILLED = """
import os, sys, time
from pathlib import Path
from moetune.tuner.store.atomic_files import write_atomic
def killed_before_the_rename(src, dst):
    print("RENAMING", flush=True)
    time.sleep(120)
os.replace = killed_before_the_rename
write_atomic(Path(sys.argv[1]), "# Benchmarks\\n\\nnew summary\\n")
"""


def test_a_summarize_killed_mid_write_leaves_later_rows_stamped_clean(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench summarize` killed while writing BENCHMARKS.md (atomically: a temporary file beside it, then a rename)
    left its temporary file, `.BENCHMARKS.md.<random>.tmp`, in the source checkout: untracked, it stamped the rows of
    every later `bench run` git_dirty (each such launch a batch of its own, never pooled at its commit) until someone
    found and removed it. Like BENCHMARKS.md itself, it is a result the bench commands write, not code."""
    from moetune.tuner.measure.scenarios import stamp

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    git("add", "a.py", "BENCHMARKS.md")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    monkeypatch.setattr(stamp, "ROOT", tmp_path)
    monkeypatch.delenv("MOETUNE_GIT_SHA", raising=False)
    assert stamp.code_stamp()[1] is False

    _kill9(_run_until(SUMMARIZE_KILLED, [str(tmp_path / "BENCHMARKS.md")], "RENAMING"))
    assert [p.name for p in tmp_path.glob(".BENCHMARKS.md.*.tmp")]  # what the kill left
    assert stamp.code_stamp() == (git("rev-parse", "HEAD").strip(), False)
    (tmp_path / "b.py").write_text("y = 1\n")  # a change of code is still seen
    assert stamp.code_stamp()[1] is True


# -- the Optuna study: a dead process's warm-start trial ----------------------------------------------------------
ASK_AND_DIE = """
import os, sys
from moetune.tuner.search.study import open_study
t = open_study("moetune/t", sys.argv[1], seed=0).ask()
print(t._trial_id, flush=True)
os._exit(0)  # killed: no tell, no clean-up
"""

OPEN_KILLED = """
import sys, time
from moetune.tuner.search import workers
def killed_here(study, trial_id):  # the trial is failed: killed before its point is enqueued again
    print("FAILED", flush=True)
    time.sleep(120)
workers.requeue_warm_start = killed_here
from moetune.tuner.search.study import open_study
open_study("moetune/t", sys.argv[1], seed=0)
"""


def _study_with_a_trial_left_running(tmp_path: Path) -> tuple[Any, Any, str, int]:
    """A SQLite study of two finished trials and a warm-start trial left RUNNING by a process that died: (space,
    workload, storage URL, that trial's id)."""
    import optuna

    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.backends import CallableBackend, TuneWorkload
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.study import open_study, run_study

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    wl = TuneWorkload(model=MODELS["qwen3-30b"], tokens=128, nodes=1, gpus_per_node=4)
    space = SearchSpace(load_policy("proxy:ibrc"), experts=wl.model.experts, ep_size=wl.ep_size)
    url = f"sqlite:///{tmp_path / 's.db'}"
    run_study(open_study("moetune/t", url, seed=0), space, CallableBackend(lambda k, w: 100.0 + k.num_sms), wl, trials=2)
    out = subprocess.run([sys.executable, "-c", ASK_AND_DIE, url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return space, wl, url, int(out.stdout.split()[-1])


def test_a_process_killed_while_failing_a_dead_trial_loses_no_warm_start_point(tmp_path: Path) -> None:
    """Opening a study fails the running trials of dead processes, then enqueues again the warm-start point each
    carried (the policy default first of all): two storage writes. Killed between them, the trial was failed (and
    tagged interrupted) with its point enqueued nowhere, and no later open enqueued it (the trial is no longer
    running): that point, the policy default among them, was never measured in the study. An open enqueues again
    the point of an interrupted warm-start trial that no later trial holds."""
    import optuna

    from moetune.tuner.search.backends import CallableBackend
    from moetune.tuner.search.study import open_study, run_study

    space, wl, url, tid = _study_with_a_trial_left_running(tmp_path)
    _kill9(_run_until(OPEN_KILLED, [url], "FAILED"))  # the next open failed it, and was killed

    study = open_study("moetune/t", url, seed=0)
    dead = study._storage.get_trial(tid)
    assert dead.state == optuna.trial.TrialState.FAIL and "warm_start" in dead.user_attrs
    dead_knobs = space.knobs_from_params(dead.system_attrs["fixed_params"])
    # enqueued again by the open, as the warm-start point it is: the sampler alone drew the same knobs by chance
    # (a small space), so `dead_knobs in seen` held without the fix too
    again_of = [t for t in study.get_trials(states=(optuna.trial.TrialState.WAITING,))
                if t.system_attrs.get("fixed_params") == dead.system_attrs["fixed_params"]
                and t.user_attrs.get("warm_start") == dead.user_attrs["warm_start"]]
    assert len(again_of) == 1, study.get_trials()
    seen: list = []
    n = len(space.priors()) + 2
    run_study(study, space, CallableBackend(lambda k, w: seen.append(k) or 100.0 + k.num_sms), wl, trials=n)
    assert dead_knobs in seen  # measured after all
    assert study._storage.get_trial(again_of[0]._trial_id).state == optuna.trial.TrialState.COMPLETE
    again = open_study("moetune/t", url, seed=0)  # and enqueued once: a later open adds nothing
    assert not again.get_trials(states=(optuna.trial.TrialState.WAITING,))


REQUEUE_KILLED = """
import sys, time
from moetune.tuner.search import study as S
def killed_here(study, trial_id):  # the lost point is claimed (requeued:<id>): killed before it is enqueued
    print("CLAIMED", flush=True)
    time.sleep(120)
S.requeue_warm_start = killed_here
S.open_study("moetune/t", sys.argv[1], seed=0)
"""


def test_a_process_killed_while_enqueuing_a_lost_point_again_loses_it_for_no_one(tmp_path: Path) -> None:
    """The next open enqueues a lost warm-start point again (`requeue_lost_points`): a claim (`requeued:<id>`), then
    the enqueue, two storage writes again. Killed between them, the claim stayed taken by the dead process and every
    later open skipped the point: lost for good, as before the fix that added the claim. A claim whose process is
    gone, with no later trial holding the point, is taken over (once)."""
    import optuna

    from moetune.tuner.search.study import open_study

    _space, _wl, url, tid = _study_with_a_trial_left_running(tmp_path)
    _kill9(_run_until(OPEN_KILLED, [url], "FAILED"))  # failed, its point enqueued nowhere
    _kill9(_run_until(REQUEUE_KILLED, [url], "CLAIMED"))  # the next open claimed it, and was killed

    study = open_study("moetune/t", url, seed=0)
    fixed = study._storage.get_trial(tid).system_attrs["fixed_params"]
    waiting = [t for t in study.get_trials(states=(optuna.trial.TrialState.WAITING,))
               if t.system_attrs.get("fixed_params") == fixed]
    assert len(waiting) == 1, [t.number for t in waiting]  # was: none, for good
    again = open_study("moetune/t", url, seed=0)  # once: a later open adds nothing
    assert len([t for t in again.get_trials(states=(optuna.trial.TrialState.WAITING,))
                if t.system_attrs.get("fixed_params") == fixed]) == 1


CLAIM_KILLED = """
import sys, time
import optuna
from moetune.runtime.shapes import MODELS
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import open_study, run_study
def killed_here(self, *a, **kw):  # the point is claimed in the study: killed before it is enqueued
    print("CLAIMED", flush=True)
    time.sleep(120)
optuna.Study.enqueue_trial = killed_here
wl = TuneWorkload(model=MODELS["qwen3-30b"], tokens=128, nodes=1, gpus_per_node=4)
space = SearchSpace(load_policy("proxy:ibrc"), experts=wl.model.experts, ep_size=wl.ep_size)
run_study(open_study("moetune/t", sys.argv[1], seed=0), space, CallableBackend(lambda k, w: 100.0), wl, trials=2)
"""


def test_a_process_killed_between_claiming_and_enqueuing_a_warm_start_point_loses_it_for_no_one(
        tmp_path: Path) -> None:
    """Each warm-start point (the policy default first) is claimed in the study, then enqueued: two storage writes,
    so that two processes opening one study enqueue it once. A process killed between them left the point claimed
    and enqueued nowhere: every later run found the claim taken and skipped it, and the policy default was never
    measured in the study. A claim whose process is gone, with no trial holding its point, is enqueued by the next
    run (once)."""
    import optuna

    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.backends import CallableBackend, TuneWorkload
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.study import open_study, run_study

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    wl = TuneWorkload(model=MODELS["qwen3-30b"], tokens=128, nodes=1, gpus_per_node=4)
    space = SearchSpace(load_policy("proxy:ibrc"), experts=wl.model.experts, ep_size=wl.ep_size)
    url = f"sqlite:///{tmp_path / 's.db'}"
    _kill9(_run_until(CLAIM_KILLED, [url], "CLAIMED"))

    seen: list = []
    res = run_study(open_study("moetune/t", url, seed=0), space,
                    CallableBackend(lambda k, w: seen.append(k) or 100.0 + k.num_sms), wl, trials=4)
    assert seen and seen[0] == space.policy.defaults  # the policy default, first, after all
    assert res.default_value is not None
    study = open_study("moetune/t", url, seed=0)
    run_study(study, space, CallableBackend(lambda k, w: seen.append(k) or 100.0 + k.num_sms), wl, trials=6)
    assert seen.count(space.policy.defaults) == 1  # enqueued once


def test_the_cut_never_takes_a_file_that_is_no_results_table(tmp_path: Path) -> None:
    """A one-line file of another kind (no newline at its end, not a row's columns) is no cut-short append: refused
    as before, never emptied; the cut-short first append of a new table (part of its header) is one."""
    from moetune.tuner.measure import results as R

    other = tmp_path / "notes.txt"
    other.write_bytes(b"remember the milk")
    with pytest.raises(R.ResultsError):
        R.append_rows(other, [_result_row("L1", "2.5")])
    assert other.read_bytes() == b"remember the milk"
    torn = tmp_path / "summary.csv"
    torn.write_bytes(b"scenario,case,base")
    assert R.read_rows(torn) == []
    R.append_rows(torn, [_result_row("L1", "2.5")])
    assert [r["launch"] for r in R.read_rows(torn)] == ["L1"]


# -- the bring-up report: report.md and its plots ------------------------------------------------------------------
def _latency_rows() -> list[dict]:
    return [{"kind": "latency", "transport": "nvlink", "size_bytes": size, "value": 2.0 + size / 1e6, "spread": 0.1,
             "unit": "us", "extra": {}} for size in (1024, 65536, 1 << 20)]


REPORT_KILLED = """
import sys, time
from pathlib import Path
from moetune.tuner.bringup import report as R
real = R.write_atomic
def write_atomic(path, data):
    if Path(path).name == "report.md":  # killed before the new report.md is in place
        print("REPORTING", flush=True)
        time.sleep(120)
    return real(path, data)
R.write_atomic = write_atomic
R.write_report(R.ReportData(node="b", fingerprint="b" * 16), Path(sys.argv[1]))
"""


def test_a_report_killed_before_its_report_md_leaves_no_link_to_a_removed_plot(tmp_path: Path) -> None:
    """A report removes the earlier report's plots it does not draw (another node's curves). It removed them before
    report.md was replaced: killed between, the earlier report.md, still in place, showed a plot that was gone. A
    stale plot goes once the new report.md (which does not name it) is in place."""
    import re

    from moetune.tuner.bringup.report import ReportData, write_report

    write_report(ReportData(node="a", fingerprint="a" * 16, measurements=_latency_rows()), tmp_path)
    assert "](latency.png)" in (tmp_path / "report.md").read_text()
    _kill9(_run_until(REPORT_KILLED, [str(tmp_path)], "REPORTING"))  # a report with no plots, killed

    named = re.findall(r"\]\(([^)]+\.png)\)", (tmp_path / "report.md").read_text())
    assert named and all((tmp_path / f).is_file() for f in named), named
    write_report(ReportData(node="b", fingerprint="b" * 16), tmp_path)  # the next report removes it
    assert not (tmp_path / "latency.png").exists()
    assert "](latency.png)" not in (tmp_path / "report.md").read_text()


# -- `moetune fabric capture DIR` ------------------------------------------------------------------------------------
CAPTURE_KILLED = """
import pathlib, sys, time
from pathlib import Path
from moetune.tuner.fabric.capture import capture_node
from moetune.tuner.fabric.sources import CaptureSource
real = pathlib.Path.write_text
def write_text(self, *a, **kw):
    if self.name == "manifest.json":  # sys/, proc/ and commands/ written: killed before the manifest
        print("CAPTURING", flush=True)
        time.sleep(120)
    return real(self, *a, **kw)
pathlib.Path.write_text = write_text
capture_node(Path(sys.argv[1]), source=CaptureSource(Path(sys.argv[2])))
"""


@pytest.mark.parametrize("existed", [False, True])
def test_a_capture_killed_mid_write_does_not_refuse_the_next_one(tmp_path: Path, existed: bool) -> None:
    """`fabric capture DIR` killed mid-write left DIR half-written (no manifest: readers refuse it), and the next
    capture into DIR refused it as "not an empty directory" until it was removed by hand. The capture is written in
    a folder beside DIR and renamed to DIR whole: a kill leaves DIR as it was, absent or empty."""
    from moetune.tuner.fabric.capture import capture_node
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.fabric.sources import CaptureSource

    dest = tmp_path / "cap"
    if existed:
        dest.mkdir(mode=0o750)
    _kill9(_run_until(CAPTURE_KILLED, [str(dest), str(CAPTURES / "dgx-h100")], "CAPTURING"))
    assert (dest.is_dir() and not any(dest.iterdir())) if existed else not dest.exists()
    out = capture_node(dest, source=CaptureSource(CAPTURES / "dgx-h100"))
    assert out == dest and discover(out).fingerprint == discover(CAPTURES / "dgx-h100").fingerprint
    if existed:  # the folder as the user made it: its mode kept
        assert dest.stat().st_mode & 0o777 == 0o750


# -- the daemon's IPC socket and its owner record --------------------------------------------------------------------
DAEMON_KILLED = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import daemon_fakes as F
from moetune.tuner.daemon import server
def killed_here(p, st, *_binding):  # the socket bound: killed before its owner record is written
    print("BOUND", flush=True)
    time.sleep(120)
server.record_owner = killed_here
F.in_process_daemon(Path(sys.argv[1])).start(background=True)
"""


def test_a_daemon_killed_before_its_socket_record_does_not_refuse_the_next_start(tmp_path: Path) -> None:
    """A daemon killed between binding its socket and writing the socket's owner record left a dead socket no
    record of ours named: every later start refused it ("remove it yourself"), under systemd's Restart= a restart
    loop until someone removed it by hand. The socket is bound under a name of its own, its record written, and only
    then linked to its path: a socket at the path always has its record."""
    _kill9(_run_until(DAEMON_KILLED, [str(tmp_path), str(Path(__file__).resolve().parent)], "BOUND"))

    d = F.in_process_daemon(tmp_path).start(background=True)
    try:
        from moetune.runtime.profiles.client import ProfileClient

        c = ProfileClient(d.endpoint, timeout_ms=5000)
        assert c.hello() is not None
        c.close()
    finally:
        d.stop()
    assert not (tmp_path / "run" / "daemon.sock").exists()


# -- `moetune keys generate --force`: the daemon's key pair --------------------------------------------------------
KEYS_KILLED = """
import os, sys, time
from pathlib import Path
from moetune.tuner.cli.keys import generate_keys
real, n = os.replace, [0]
def replace(src, dst):
    n[0] += 1
    if n[0] == 2:  # the new NAME.key_secret in place: killed before NAME.key is
        print("RENAMING", flush=True)
        time.sleep(120)
    return real(src, dst)
os.replace = replace
generate_keys(Path(sys.argv[1]), force=True)
"""


def test_a_key_pair_cut_short_by_a_kill_is_named_at_the_daemons_start(tmp_path: Path) -> None:
    """`keys generate --force` renames the new NAME.key_secret, then NAME.key, into place: killed between, the daemon
    took the new secret key while NAME.key, the file its clients are given, held the old public key, and every
    client given it was refused by the CURVE handshake with no word of why. The daemon's start refuses a NAME.key
    beside its secret key that holds another public key, naming the file and the fix."""
    from moetune.tuner.cli.keys import generate_keys
    from moetune.tuner.daemon.errors import DaemonConfigError
    from moetune.tuner.daemon.server import Daemon

    _public, secret = generate_keys(tmp_path / "keys")
    (tmp_path / "keys" / "clients").mkdir(mode=0o700)  # the allow-list (empty: only warned)
    _kill9(_run_until(KEYS_KILLED, [str(tmp_path / "keys")], "RENAMING"))

    d = Daemon(store=F.open_store(tmp_path / "moetune.db"), endpoint="tcp://127.0.0.1:45123",
               pub_endpoint="tcp://127.0.0.1:45124", curve_secret_key_file=str(secret))
    with pytest.raises(DaemonConfigError, match=r"moetune\.key holds another public key than .*moetune\.key_secret.*"
                                                 r"keys generate --force"):
        d._check_transport_security()
    generate_keys(tmp_path / "keys", force=True)  # the fix it names: a whole pair again
    d._check_transport_security()


DAEMON_KILLED_BEFORE_LINK = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import daemon_fakes as F
from moetune.tuner.daemon import server
def killed_here(src, dst):  # the socket bound and recorded: killed before it is linked to its path
    print("RECORDED", flush=True)
    time.sleep(120)
server.os.link = killed_here
F.in_process_daemon(Path(sys.argv[1])).start(background=True)
"""


@pytest.mark.parametrize("script,mark", [(DAEMON_KILLED, "BOUND"), (DAEMON_KILLED_BEFORE_LINK, "RECORDED")])
def test_a_daemon_killed_while_binding_leaves_no_socket_behind(tmp_path: Path, script: str, mark: str) -> None:
    """The socket is bound under a name of its own (`.daemon.sock.<random>`) and linked to its path once recorded: a
    daemon killed in between left that dead socket in the folder, one more at each such kill, and no later start
    removed it. Its record names it (written before the bind): the next start removes it while it is still a dead
    socket of this user's."""
    _kill9(_run_until(script, [str(tmp_path), str(Path(__file__).resolve().parent)], mark))
    run = tmp_path / "run"
    assert [p.name for p in run.iterdir() if p.name.startswith(".daemon.sock.") and "moetune" not in p.name]

    d = F.in_process_daemon(tmp_path).start(background=True)
    d.stop()
    assert not [p.name for p in run.iterdir() if p.name.startswith(".daemon.sock.") and "moetune" not in p.name]
    assert not (run / "daemon.sock").exists()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name an fd's file")
def test_a_new_results_tables_folder_is_synced_after_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new table's rows were fsynced but not its folder: a power loss could lose the file's directory entry, rows
    and all. The folder is synced after the file when this append created it, not on later appends."""
    from moetune.tuner.measure import results as R

    f = tmp_path / "new" / "summary.csv"
    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    R.append_rows(f, [_result_row("L1", "2.5")])
    assert synced == [str(f.resolve()), str(f.parent.resolve())], synced  # the file first, then its name
    synced.clear()
    R.append_rows(f, [_result_row("L2", "2.5")])
    assert synced == [str(f.resolve())], synced  # the table was there: its entry is already on disk


def test_a_lost_point_another_open_enqueued_after_this_ones_look_is_not_enqueued_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`requeue_lost_points` looks at the study's trials once, before its loop. Another open that claimed a lost
    point, enqueued it and exited normally after that look left a claim whose process is gone: this open took it
    over and enqueued the point a second time. After winning the claim (or the take-over) it reads the trials again."""
    import optuna

    from moetune.tuner.search import study as S

    _space, _wl, url, tid = _study_with_a_trial_left_running(tmp_path)
    _kill9(_run_until(OPEN_KILLED, [url], "FAILED"))  # failed, its point enqueued nowhere
    claim = S.claim_study_attr

    def other_open_first(study: Any, key: str, value: Any) -> bool:
        if key.startswith(S.REQUEUED_KEY):  # the window made certain: after this open's look at the trials
            out = subprocess.run([sys.executable, "-c", "import sys; from moetune.tuner.search.study import "
                                  "open_study; open_study('moetune/t', sys.argv[1], seed=0)", url],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]  # it claimed, enqueued the point and exited
        return claim(study, key, value)

    monkeypatch.setattr(S, "claim_study_attr", other_open_first)
    study = S.open_study("moetune/t", url, seed=0)
    monkeypatch.setattr(S, "claim_study_attr", claim)
    fixed = study._storage.get_trial(tid).system_attrs["fixed_params"]
    waiting = [t for t in study.get_trials(states=(optuna.trial.TrialState.WAITING,))
               if t.system_attrs.get("fixed_params") == fixed]
    assert len(waiting) == 1, [t.number for t in waiting]  # was: 2, the other open's and this one's
