"""`moetune profile` when a part of it fails: a bucket whose every trial failed is shown (summary, report), the
command exits 1 and a rerun tunes that bucket again; a failed microbenchmark is not taken as done."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs
from moetune.tuner.search.backends import TuneWorkload

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"
MEASURE: dict[str, Any] = {}


def flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    return {"graph_us": [300.0, 303.0, 297.0], "eager_us": [301.0] * 3}


def times_out(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    raise RuntimeError("timed out after 0.5 s")


@pytest.fixture
def profile_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from moetune.tuner.bringup import flow
    from moetune.tuner.cli import app

    init = flow.Bringup.__init__

    def with_fake_kernel(self: Any, **kw: Any) -> None:  # the megakernel timed by a stand-in, not a GPU
        init(self, **kw, mk_measure=lambda k, w: MEASURE["fn"](k, w))

    monkeypatch.setattr(flow.Bringup, "__init__", with_fake_kernel)
    plan = tmp_path / "plan.toml"
    plan.write_text('[plan]\nmodels = ["qwen3-30b"]\ntokens = [16]\ntrials = 3\nrepeats = 1\niters = 5\n'
                    "compare_rounds = 1\n")
    db = tmp_path / "home" / "moetune.db"
    db.parent.mkdir()

    def run(*extra: str) -> Any:
        return CliRunner().invoke(app, ["profile", "--plan", str(plan), "--capture", str(CAPTURES / "h200x1"),
                                        "--db", str(db), *extra], env={"COLUMNS": "300"})

    run.db = db  # type: ignore[attr-defined]
    return run


def test_a_bucket_whose_trials_all_failed_is_shown_fails_the_command_and_is_tuned_again(
        profile_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])  # no subprocesses
    MEASURE["fn"] = times_out
    r = profile_cli()
    assert r.exit_code == 1, r.output
    said = " ".join(r.output.split())
    assert "not stored: every trial failed (" in said and "timed out after 0.5 s" in said, said
    report = (profile_cli.db.parent / "report" / "report.md").read_text()
    row = [line for line in report.splitlines() if line.startswith("| megakernel | qwen3-30b | 1 | 16 ")]
    assert len(row) == 1 and "not stored: every trial failed" in row[0] and "timed out" in row[0], report
    store = F.open_store(profile_cli.db)
    assert store.list_profiles() == []

    r = profile_cli("--json")
    assert r.exit_code == 1, r.output
    assert any("every trial failed" in f for f in json.loads(r.stdout)["failed"])

    MEASURE["fn"] = flat  # the cause fixed: the rerun tunes the bucket again, with its whole budget
    r = profile_cli()
    assert r.exit_code == 0, r.output
    assert "every trial failed" not in r.output
    assert len(store.list_profiles()) == 1
    url = f"sqlite:///{profile_cli.db.parent / 'moetune-studies.db'}"
    (summary,) = [s for s in optuna.get_all_study_summaries(optuna.storages.RDBStorage(url))
                  if s.study_name.startswith("moetune/")]
    study = optuna.load_study(study_name=summary.study_name, storage=url)
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 3, states
    report = (profile_cli.db.parent / "report" / "report.md").read_text()
    assert "every trial failed" not in report


def test_the_json_summary_of_a_failed_bucket_is_standard_json(profile_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that failed has no time: null in --json, as in the stored rows (JSON has no NaN). `NaN` was printed,
    which jq and every strict reader refuse, so the summary of a failed bring-up could not be read."""
    from moetune.tuner.bringup import flow

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])
    MEASURE["fn"] = times_out
    r = profile_cli("--json")
    assert r.exit_code == 1, r.output

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    out = json.loads(r.stdout, parse_constant=refuse)
    (row,) = out["profiles"]
    assert row["default_us"] is None and row["tuned_us"] is None and not row["written"], row


def test_why_a_bucket_gave_nothing_comes_from_the_tune_not_a_second_read_of_the_study(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first failure of a bucket without a result is recorded where the study is tuned (its StudyResult) and
    passed on: the bring-up loaded the study again by name from the storage it guessed, and said nothing of the
    cause where that read failed."""
    from rich.console import Console

    from moetune.tuner.bringup.flow import Bringup, Plan

    plan = Plan(models=["qwen3-30b"], tokens=[16], trials=3, repeats=1, iters=5, compare_rounds=1)
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                console=Console(file=io.StringIO()), capture=CAPTURES / "h200x1",
                storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=times_out)

    def unreadable(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("the studies file cannot be read now")

    monkeypatch.setattr(optuna, "load_study", unreadable)
    [row] = b.stage_tune()
    assert row["failed"].startswith("not stored: every trial failed (") and "timed out after 0.5 s" in row["failed"]
    assert any("timed out after 0.5 s" in why for why in b.failed), b.failed


class Bench:
    def __init__(self, transport: str, runner: str, error: str = ""):
        self.transport, self.runner, self.error, self.calls = transport, runner, error, 0

    def run(self, sizes: Any, *, iters: int = 20) -> list[Any]:
        from moetune.tuner.measure.micro import MicroResult

        self.calls += 1
        if self.error:
            raise RuntimeError(self.error)
        return [MicroResult(self.transport, "latency", "0->1", size, 10.0, 0.5, "us") for size in (4096, 65536)]


def test_failed_microbenchmarks_fail_the_command_and_a_rerun_runs_them_again(
        profile_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.measure import micro

    MEASURE["fn"] = flat
    a, b = Bench("collective", "gloo_p2p", "gloo: no interface bogus0"), Bench("host_staged", "nccl_p2p", "nccl died")
    monkeypatch.setattr(micro, "plan", lambda *args, **kw: [(a, True, ""), (b, True, "")])
    r = profile_cli()
    assert r.exit_code == 1, r.output
    said = " ".join(r.output.split())
    assert "microbenchmark collective/gloo_p2p failed: gloo: no interface bogus0" in said, said
    assert "microbenchmark host_staged/nccl_p2p failed: nccl died" in said
    report = (profile_cli.db.parent / "report" / "report.md").read_text()
    assert "microbench not finished: microbenchmark collective/gloo_p2p failed" in report, report

    a.error = ""  # one fixed: it runs again, the other still fails
    r = profile_cli()
    assert r.exit_code == 1, r.output
    assert "microbench (done earlier" not in r.output and (a.calls, b.calls) == (2, 2)
    b.error = ""
    r = profile_cli()
    assert r.exit_code == 0, r.output
    assert (a.calls, b.calls) == (2, 3)  # the benchmark that finished is not run again
    assert "microbenchmarks: resumed, 1/2 done" in r.output and "microbenchmarks: started" not in r.output, r.output
    r = profile_cli()
    assert r.exit_code == 0 and "✓ microbench (done earlier" in r.output, r.output


def test_an_interrupted_compare_stage_resumes_with_the_buckets_left(tmp_path: Path) -> None:
    """Ctrl-C while comparing S=64 (S=16 stored): the rerun compared S=16 again, superseded its profile by a new one
    and wrote a second tuned_vs_default row."""
    import io

    from rich.console import Console

    from moetune.tuner.bringup.flow import Bringup, Plan

    calls: list[int] = []
    cut = {"at": None}

    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        calls.append(wl.tokens)
        if cut["at"] == wl.tokens:
            cut["at"] = None
            raise KeyboardInterrupt
        return flat(knobs, wl)

    def bringup() -> Any:
        plan = Plan(models=["qwen3-30b"], tokens=[16, 64], trials=3, repeats=1, iters=5, compare_rounds=1)
        return Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                       console=Console(file=io.StringIO()), capture=CAPTURES / "h200x1",
                       storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=measure)

    b = bringup()
    for stage in ("discover", "microbench", "calibrate", "tune"):
        b.state.mark(stage, [] if stage == "microbench" else {"skipped": "test"} if stage == "calibrate"
                     else getattr(b, f"stage_{stage}")())
    calls.clear()
    cut["at"] = 64
    with pytest.raises(KeyboardInterrupt):
        b.stage_compare()
    assert 16 in calls
    profiles = [r.key.token_bucket for _i, r in b.store.list_profiles()]

    calls.clear()
    again = bringup()  # a new process, the same state file
    again.run()
    assert 16 not in calls and 64 in calls, calls
    assert [r.key.token_bucket for _i, r in again.store.list_profiles()].count(16) == profiles.count(16)
    rows = [m for m in again.store.list_measurements(fingerprint=again.facts.fingerprint)
            if m["kind"] == "tuned_vs_default"]
    assert sorted(m["extra"]["tokens"] for m in rows) == [16, 64]
    assert sorted(r["tokens"] for r in again.state.result("compare")) == [16, 64]


@pytest.mark.parametrize("written_by", ["this version", "an older version"])
def test_compared_buckets_are_kept_under_their_own_state_key(tmp_path: Path, written_by: str) -> None:
    """The buckets the compare stage compared and stored are kept in the state under `compared` (kept once the stage
    is done, cleared only by --restart), not as a special case of the unfinished stages' `partial` parts; a state an
    older version wrote (`partial.compare`) still resumes without measuring them again."""
    from rich.console import Console

    from moetune.tuner.bringup.flow import Bringup, Plan

    calls: list[int] = []
    cut = {"at": None}

    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        calls.append(wl.tokens)
        if cut["at"] == wl.tokens:
            cut["at"] = None
            raise KeyboardInterrupt
        return flat(knobs, wl)

    def bringup() -> Any:
        plan = Plan(models=["qwen3-30b"], tokens=[16, 64], trials=3, repeats=1, iters=5, compare_rounds=1)
        return Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                       console=Console(file=io.StringIO()), capture=CAPTURES / "h200x1",
                       storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=measure)

    b = bringup()
    for stage in ("discover", "microbench", "calibrate", "tune"):
        b.state.mark(stage, [] if stage == "microbench" else {"skipped": "test"} if stage == "calibrate"
                     else getattr(b, f"stage_{stage}")())
    cut["at"] = 64
    with pytest.raises(KeyboardInterrupt):
        b.stage_compare()
    saved = json.loads(b.state.path.read_text())
    assert [k.split("/")[2] for k in saved["compared"]] == ["S=16"] and "compare" not in saved.get("partial", {})
    if written_by == "an older version":
        saved.setdefault("partial", {})["compare"] = saved.pop("compared")
        b.state.path.write_text(json.dumps(saved))

    calls.clear()
    again = bringup()
    again.run()
    assert 16 not in calls and 64 in calls, calls
    saved = json.loads(again.state.path.read_text())
    assert sorted(k.split("/")[2] for k in saved["compared"]) == ["S=16", "S=64"]  # kept once the stage is done
    assert "compare" not in saved.get("partial", {})
    again.state.restart()
    assert "compared" not in again.state.data


def _compare_bringup(tmp_path: Path, calls: list[int]) -> Any:
    """A bring-up of S=16 and S=64 with the stages before compare done; `calls` gets each measured token count."""
    from rich.console import Console

    from moetune.tuner.bringup.flow import Bringup, Plan

    def measure(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        calls.append(wl.tokens)
        return flat(knobs, wl)

    plan = Plan(models=["qwen3-30b"], tokens=[16, 64], trials=3, repeats=1, iters=5, compare_rounds=1)
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                console=Console(file=io.StringIO()), capture=CAPTURES / "h200x1",
                storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=measure)
    for stage in ("discover", "microbench", "calibrate", "tune"):
        if not b.state.done(stage):
            b.state.mark(stage, [] if stage == "microbench" else {"skipped": "test"} if stage == "calibrate"
                         else getattr(b, f"stage_{stage}")())
    return b


def _compared_rows(b: Any) -> list[dict[str, Any]]:
    return [m["extra"] for m in b.store.list_measurements(fingerprint=b.facts.fingerprint)
            if m["kind"] == "tuned_vs_default"]


def test_a_bucket_stored_before_the_state_was_saved_is_not_compared_again(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after the S=16 bucket's profile and row were stored, before the state kept it: the rerun measured S=16
    again (a second tuned_vs_default row, the profile measured anew). It finds what was stored and keeps it."""
    from moetune.tuner.bringup.flow import BringupState

    calls: list[int] = []
    b = _compare_bringup(tmp_path, calls)
    real = BringupState.keep_compared

    def killed(self: Any, parts: dict[str, Any]) -> None:
        raise KeyboardInterrupt  # as a kill at this point: the state file is not written

    with monkeypatch.context() as mp:
        mp.setattr(BringupState, "keep_compared", killed)
        with pytest.raises(KeyboardInterrupt):
            b.stage_compare()
    assert BringupState.keep_compared is real
    [stored] = _compared_rows(b)
    assert stored["tokens"] == 16 and "compared" not in json.loads(b.state.path.read_text())
    profiles = b.store.list_profiles()

    calls.clear()
    again = _compare_bringup(tmp_path, calls)  # a new process, the same state file
    rows = again.stage_compare()
    assert 16 not in calls and 64 in calls, calls
    assert sorted(r["tokens"] for r in _compared_rows(again)) == [16, 64]  # no second row of S=16
    assert len(again.store.list_profiles()) == len(profiles) + 1
    row16 = next(r for r in rows if r["tokens"] == 16)
    assert {k: v for k, v in stored.items() if k in row16} == row16 and "compared_as" not in row16
    assert sorted(again.state.compared()) == sorted(f"megakernel/qwen3-30b/S={n}/EP1" for n in (16, 64))


def test_a_bucket_is_stored_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between the bucket's profile and its tuned_vs_default row: the profile was stored without the row that
    says it was compared. Both are one transaction: neither is stored, and the rerun compares the bucket."""
    from moetune.tuner.store.store import Store

    calls: list[int] = []
    b = _compare_bringup(tmp_path, calls)
    real = Store.add_measurement

    def killed(self: Any, **kw: Any) -> int:
        if kw.get("kind") == "tuned_vs_default":
            raise KeyboardInterrupt
        return real(self, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(Store, "add_measurement", killed)
        with pytest.raises(KeyboardInterrupt):
            b.stage_compare()
    assert b.store.list_profiles() == [] and _compared_rows(b) == []
    calls.clear()
    again = _compare_bringup(tmp_path, calls)
    again.stage_compare()
    assert 16 in calls and 64 in calls
    assert sorted(r["tokens"] for r in _compared_rows(again)) == [16, 64]
    assert sorted(r.key.token_bucket for _i, r in again.store.list_profiles()) == [16, 64]


def test_profile_json_shows_progress_on_stderr_and_a_resumed_studys_best_before_the_report(
        profile_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--json` turned the progress off (stdout is JSON; the stage lines were already on stderr). The progress lines
    go to stderr too. A resumed study's best, given after its "resumed" line, was printed only when the progress
    closed: after "→ report"."""
    from moetune.tuner.bringup import flow

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])  # no subprocesses
    MEASURE["fn"] = flat
    r = profile_cli("--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["profiles"]
    assert "megakernel qwen3-30b S=16: 3/3 done, best" in r.stderr and "tuned vs default: 1/1 done" in r.stderr
    state = next(profile_cli.db.parent.glob("*bringup-*.json"))
    saved = json.loads(state.read_text())
    saved["done"] = {k: v for k, v in saved["done"].items() if k in ("discover", "microbench", "calibrate")}
    state.write_text(json.dumps(saved))  # the tune stage runs again: its study is resumed, finished
    r = profile_cli("--json")
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    best = next(i for i, ln in enumerate(lines) if ln.startswith("megakernel qwen3-30b S=16: 3/3 done, best"))
    assert lines[best - 1].startswith("megakernel qwen3-30b S=16: resumed, 3/3 done"), lines
    assert best < lines.index("→ report"), lines


def test_a_finished_bring_up_writes_its_report_again(profile_cli: Any, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """Once the report stage was done, a rerun named the earlier report, deleted or not, and ignored --report-dir."""
    from moetune.tuner.bringup import flow

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])
    MEASURE["fn"] = flat
    assert profile_cli().exit_code == 0
    first = profile_cli.db.parent / "report" / "report.md"
    first.unlink()
    r = profile_cli()
    assert r.exit_code == 0 and first.is_file(), r.output
    other = tmp_path / "elsewhere"
    r = profile_cli("--report-dir", str(other))
    assert r.exit_code == 0, r.output
    assert (other / "report.md").is_file() and str(other / "report.md") in " ".join(r.output.split())


def test_tokens_above_the_largest_bucket_are_refused(tmp_path: Path) -> None:
    from moetune.tuner.cli import app

    r = CliRunner().invoke(app, ["profile", "--quick", "--tokens", "128,99999999999999999999", "--capture",
                                 str(CAPTURES / "h200x1"), "--db", str(tmp_path / "m.db")], env={"COLUMNS": "300"})
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert "--tokens: 99999999999999999999 is above the largest token bucket (65536" in said, said
    assert not (tmp_path / "m.db").exists()


def test_report_from_the_database_keeps_the_bring_ups_notes_and_plots(profile_cli: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`moetune report` replaced the bring-up's report with a poorer one: importances.png deleted, notes dropped."""
    from moetune.tuner.bringup import flow
    from moetune.tuner.cli import app

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])
    monkeypatch.setattr(flow.Bringup, "_importances", lambda self: {"a-study": {"mk_bm": 0.7, "mk_bn": 0.3}})
    MEASURE["fn"] = flat
    assert profile_cli().exit_code == 0
    out = profile_cli.db.parent / "report"
    before = (out / "report.md").read_text()
    notes = before[before.index("## Notes"):]
    assert "EP transports need >= 2 GPUs" in notes and (out / "importances.png").is_file()
    r = CliRunner().invoke(app, ["report", "--db", str(profile_cli.db), "--capture", str(CAPTURES / "h200x1")])
    assert r.exit_code == 0, r.output
    after = (out / "report.md").read_text()
    assert (out / "importances.png").is_file() and "](importances.png)" in after
    assert after[after.index("## Notes"):] == notes


@pytest.mark.parametrize("where", ["option", "plan"])
def test_token_counts_sharing_a_bucket_are_tuned_once(profile_cli: Any, monkeypatch: pytest.MonkeyPatch,
                                                      where: str) -> None:
    """`tokens = [16, 16, 15]` (a plan's or --tokens) went to the tuner as given, which tuned bucket 16 once without
    a word; like tune, profile now passes one count a bucket and says on stderr which counts shared it."""
    from moetune.tuner.bringup import flow
    from moetune.tuner.search import tune

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])
    studies: list[list[int]] = []
    real = tune.tune_profiles_detailed

    def counting(*a: Any, **kw: Any) -> Any:
        studies.append(list(kw["tokens"]))
        return real(*a, **kw)

    monkeypatch.setattr(tune, "tune_profiles_detailed", counting)
    MEASURE["fn"] = flat
    if where == "plan":
        plan = profile_cli.db.parent.parent / "plan.toml"
        plan.write_text(plan.read_text().replace("tokens = [16]", "tokens = [16, 16, 15]"))
        r = profile_cli()
    else:
        r = profile_cli("--tokens", "16,16,15")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert said.count("share a token bucket, tuned once") == 1 and "16, 16, 15 (bucket 16)" in said, said
    assert studies == [[16]], studies


def test_a_bucket_whose_side_by_side_runs_all_failed_fails_the_command_and_is_compared_again(
        profile_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuned, then every run of the comparison failed (the default's and the tuned setting's): nothing was measured
    and nothing stored, yet the compare stage was done, the command exited 0, and a rerun kept the bucket as compared
    (never measured again)."""
    from moetune.tuner.bringup import flow

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])  # no subprocesses
    compare = flow.Bringup.stage_compare

    def failing_compare(self: Any) -> list[dict]:
        MEASURE["fn"] = times_out  # the tune measured; the side-by-side runs all fail
        return compare(self)

    MEASURE["fn"] = flat
    with monkeypatch.context() as mp:
        mp.setattr(flow.Bringup, "stage_compare", failing_compare)
        r = profile_cli()
    assert r.exit_code == 1, r.output
    said = " ".join(r.output.split())
    assert "timed out after 0.5 s" in said and "compare:" in said, said
    store = F.open_store(profile_cli.db)
    assert store.list_profiles() == []

    MEASURE["fn"] = flat  # the cause fixed: the rerun compares the bucket again and stores it
    r = profile_cli()
    assert r.exit_code == 0, r.output
    assert len(store.list_profiles()) == 1


def test_after_restart_the_way_to_continue_is_without_restart(profile_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`profile --restart` interrupted (or with failed parts) said "run the same command again to continue where it
    stopped": the same command, --restart and all, starts over again."""
    from moetune.tuner.bringup import flow

    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])  # no subprocesses
    MEASURE["fn"] = flat

    def interrupted(self: Any) -> list[dict]:
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(flow.Bringup, "stage_tune", interrupted)
        r = profile_cli("--restart")
    assert r.exit_code == 130, r.output
    said = " ".join(r.output.split())
    assert "without --restart" in said and "the same command again" not in said, said
    MEASURE["fn"] = times_out  # every trial fails: the failed parts say how to try them again
    r = profile_cli("--restart")
    assert r.exit_code == 1, r.output
    said = " ".join(r.output.split())
    assert "without --restart" in said and "the same command again" not in said, said
    r = profile_cli()  # without --restart: the same words as before
    assert r.exit_code == 1, r.output
    assert "run the same command again" in " ".join(r.output.split())

    def broken(self: Any) -> list[dict]:
        raise RuntimeError("bench worker died")

    with monkeypatch.context() as mp:
        mp.setattr(flow.Bringup, "stage_tune", broken)
        r = profile_cli("--restart")
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert "bench worker died (finished stages are kept; run it again without --restart to continue)" in said, said


def test_the_megakernel_backends_are_closed_after_their_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The megakernel's LocalBackend of the tune stage, and one per bucket of the compare stage, were never closed:
    the layer's weights and reference its trials put on the GPU stayed there while the EP comparisons after it ran
    (`LocalBackend.close` releases them)."""
    from moetune.tuner.search.local_backend import LocalBackend

    made: list[Any] = []
    closed: list[Any] = []
    init, close = LocalBackend.__init__, LocalBackend.close

    def tracked_init(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        made.append(self)

    def tracked_close(self: Any) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(LocalBackend, "__init__", tracked_init)
    monkeypatch.setattr(LocalBackend, "close", tracked_close)
    b = _compare_bringup(tmp_path, [])  # its tune stage ran
    assert made and all(be in closed for be in made), (made, closed)
    made.clear()
    b.stage_compare()
    assert made and all(be in closed for be in made), (made, closed)
