"""`moetune profile` says which planned models the megakernel stage left out everywhere it reports: before the stages,
in the --json summary (`megakernel_left_out`), in a resumed run's summary (from what the tune stage recorded), and on a
one-GPU node whose every planned model is left out it says nothing was tuned (the report said the megakernel "is what
was tuned") and exits 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import Knobs
from moetune.tuner.search.backends import TuneWorkload

# the megakernel's timings injected on a one-GPU node's capture, run as ON that node (conftest)
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"
BAD = "custom:100,64,8,2"  # hidden 100: not a multiple of 128, the megakernel can run no setting of it
WHY = "the megakernel cannot run it: it needs hidden % 128 == 0"  # how its reason starts


def _why() -> str:
    """The whole reason, by the rule the tune stage leaves a model out by."""
    from moetune.tuner.bringup.flow import megakernel_left_out

    return megakernel_left_out([BAD])[BAD]


def flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    return {"graph_us": [300.0, 303.0, 297.0], "eager_us": [301.0] * 3}


@pytest.fixture(autouse=True)
def _fake_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The megakernel timed by a stand-in, not a GPU; no microbenchmark subprocesses."""
    from moetune.tuner.bringup import flow

    init = flow.Bringup.__init__

    def with_fake_kernel(self: Any, **kw: Any) -> None:
        init(self, **kw, mk_measure=flat)

    monkeypatch.setattr(flow.Bringup, "__init__", with_fake_kernel)
    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])


def _profile(tmp_path: Path, models: list[str], *extra: str) -> Any:
    """`moetune profile` of the one-GPU h200x1 capture with `models`."""
    from moetune.tuner.cli import app

    plan = tmp_path / "plan.toml"
    plan.write_text(f"[plan]\nmodels = {json.dumps(models)}\ntokens = [16]\ntrials = 2\nrepeats = 1\niters = 5\n"
                    "compare_rounds = 1\n")
    db = tmp_path / "home" / "moetune.db"
    db.parent.mkdir(exist_ok=True)
    return CliRunner().invoke(app, ["profile", "--plan", str(plan), "--capture", str(CAPTURES / "h200x1"), "--db",
                                    str(db), *extra], env={"COLUMNS": "400"})


def _state(tmp_path: Path) -> Path:
    return next((tmp_path / "home").glob("*bringup-*.json"))


def test_left_out_models_are_said_before_the_stages(tmp_path: Path) -> None:
    r = _profile(tmp_path, [BAD, "qwen3-30b"])
    assert r.exit_code == 0, r.output
    # among the plan's lines, before the stages: it was said only as the tune stage ran
    assert f"megakernel: {BAD} left out: {WHY}" in r.output.split("→ discover")[0], r.output


def test_the_json_summary_lists_left_out_models_with_model_and_reason(tmp_path: Path) -> None:
    r = _profile(tmp_path, [BAD, "qwen3-30b"], "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["megakernel_left_out"] == [{"model": BAD, "reason": _why()}], got
    assert {"fingerprint", "db", "ep_sizes", "ep_note", "profiles", "failed"} <= set(got)  # kept as they were
    assert [(p["model"], p["family"]) for p in got["profiles"]] == [("qwen3-30b", "megakernel")]


def test_a_resumed_run_says_the_left_out_models_in_its_summary_as_recorded(tmp_path: Path) -> None:
    r = _profile(tmp_path, [BAD, "qwen3-30b"])
    assert r.exit_code == 0, r.output
    # the tune stage recorded what it left out; a reason changed there is said as recorded (not decided again)
    state = json.loads(_state(tmp_path).read_text())
    assert state["mk_left_out"] == {BAD: _why()} and _why().startswith(WHY)
    state["mk_left_out"] = {BAD: "as recorded"}
    _state(tmp_path).write_text(json.dumps(state))
    r = _profile(tmp_path, [BAD, "qwen3-30b"])
    assert r.exit_code == 0, r.output
    assert "✓ tune (done earlier; resuming)" in r.output, r.output
    summary = r.output.split("tuned profiles")[-1]
    assert f"megakernel: {BAD} left out: as recorded" in summary, r.output
    report = (tmp_path / "home" / "report" / "report.md").read_text()
    assert f"megakernel: {BAD} left out: as recorded" in report
    assert "is what was tuned" in report  # qwen3-30b was
    r = _profile(tmp_path, [BAD, "qwen3-30b"], "--json")
    assert json.loads(r.stdout)["megakernel_left_out"] == [{"model": BAD, "reason": "as recorded"}]


def test_a_one_gpu_node_whose_every_model_is_left_out_says_nothing_was_tuned_and_exits_1(
        tmp_path: Path) -> None:
    r = _profile(tmp_path, [BAD])
    assert r.exit_code == 1, r.output
    said = " ".join(r.output.split())
    assert f"error: nothing tuned: every planned model was left out ({BAD}:" in said, said
    assert "Traceback" not in said
    report = " ".join((tmp_path / "home" / "report" / "report.md").read_text().split())
    assert "is what was tuned" not in report, report
    assert f"so no exchange was tuned; nothing tuned: every planned model was left out ({BAD}:" in report, report
    assert f"megakernel: {BAD} left out: {WHY}" in report

    # --json: the summary is printed, the error on stderr, exit 1 all the same (a resumed run: nothing re-decided)
    r = _profile(tmp_path, [BAD], "--json")
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["megakernel_left_out"] == [{"model": BAD, "reason": _why()}]
    assert "nothing tuned: every planned model was left out" in r.stderr


def test_a_one_gpu_node_the_megakernel_cannot_run_on_says_nothing_was_tuned_and_exits_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-GPU node that is no sm_90 GPU (or has no megakernel library) tunes nothing: it exited 0, and its report
    said the megakernel "is what was tuned" right above "MoE megakernel not tuned: ..."."""
    from moetune.tuner.fabric import families

    why = "it needs an sm_90 GPU (this one is sm_80)"
    monkeypatch.setattr(families, "megakernel_family", lambda facts: (False, why))  # (the bring-up imports it late)
    r = _profile(tmp_path, ["qwen3-30b"])
    assert r.exit_code == 1, r.output
    said = " ".join(r.output.split())
    assert f"error: nothing tuned: the MoE megakernel, the only thing a one-GPU node tunes, cannot run here: {why}" \
        in said, said
    assert "plan a model it can run" not in said and "Traceback" not in said
    report = " ".join((tmp_path / "home" / "report" / "report.md").read_text().split())
    assert "is what was tuned" not in report, report
    assert f"MoE megakernel not tuned: {why}" in report, report
