"""`moetune profile` tunes the EP group of the whole node by default (a plan may list EP sizes, each <= the GPUs).

Profiles keyed ep_size = min(2, GPUs) (a fixed Plan.world = 2) would leave an 8-GPU node tuned at EP 2 only, and
the first EP 8 job without a profile."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs
from moetune.tuner.search.backends import TuneWorkload

optuna.logging.set_verbosity(optuna.logging.ERROR)
# their bring-ups inject the timings of a GPU node's capture: run as ON that node (conftest), the only place a
# measurement may be stored under its key
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"

# a stand-in for `moetune bench ep --json`: times grow with the world it was launched with (so rows can be told apart)
FAKE_BENCH = r'''
import json, sys
args = sys.argv[1:]
world = int(args[args.index("--world") + 1])
knobs = dict(kv.split("=", 1) for kv in args[args.index("--knobs") + 1].split(","))
t = 10.0 * world + int(knobs.get("pipeline_depth", "1"))
print(json.dumps({"dispatch_us": {"median": t, "p10": t - 0.1, "p90": t + 0.1},
                  "combine_us": {"median": t, "p10": t - 0.1, "p90": t + 0.1},
                  "roundtrip_us": {"median": 2 * t, "p10": 2 * t - 0.1, "p90": 2 * t + 0.1},
                  "layer_us": {"median": 3 * t, "p10": 3 * t - 0.1, "p90": 3 * t + 0.1},
                  "max_rel_err": 0.0, "world": world}))
'''


def flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    return {"graph_us": [300.0, 303.0, 297.0], "eager_us": [301.0] * 3}


def _bringup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capture: str = "dgx-h100", fake: str = FAKE_BENCH,
             **plan_kw: Any) -> Any:
    """A bring-up on `capture` whose EP runs go to the fake bench (no ranks, no GPU); worlds launched are recorded."""
    from moetune.tuner.bringup import flow
    from moetune.tuner.search.local_backend import LocalBackend

    bench = tmp_path / "fake_bench.py"
    bench.write_text(fake)
    worlds: list[int] = []

    def backend(self: Any, world: int = 0) -> LocalBackend:
        worlds.append(world)
        return LocalBackend(world=world, comm_backend=self.comm_backend, repeats=1, timeout_s=30, metric="comm",
                            command=[sys.executable, str(bench)], verify_compression=False)

    monkeypatch.setattr(flow.Bringup, "_backend", backend)
    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])  # no subprocesses
    plan = flow.Plan(**{"models": ["qwen3-30b"], "tokens": [16], "trials": 2, "repeats": 1, "iters": 5,
                        "compare_rounds": 1, **plan_kw})
    b = flow.Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                     console=Console(file=io.StringIO(), width=200), capture=CAPTURES / capture,
                     storage=f"sqlite:///{tmp_path / 'opt.db'}", mk_measure=flat)
    b.worlds = worlds
    return b


def _ep_profiles(store: Any) -> set[tuple[int, int, str]]:
    return {(r.key.ep_size, r.key.nodes, r.provenance) for _, r in store.list_profiles(status="current")
            if r.key.transport_family != "megakernel"}


def test_default_plan_tunes_every_gpu_of_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = _bringup(tmp_path, monkeypatch)
    assert b.facts.gpu_count == 8
    b.run()
    assert _ep_profiles(b.store) == {(8, 1, "measured")}  # not {(2, 1, "measured")}
    assert set(b.worlds) == {8}
    rows = b.state.result("compare")
    assert {r["ep_size"] for r in rows if r["family"] != "megakernel"} == {8}
    report = Path(b.state.result("report")).read_text()
    assert "EP size tuned: 8 (every GPU of this node)" in report
    assert "| EP |" in report


def test_a_plan_lists_ep_sizes_and_a_rerun_after_an_interruption_finishes_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow

    b = _bringup(tmp_path, monkeypatch, ep_sizes=[4, 8])
    F.interrupt_before_compare(b, monkeypatch)
    tuned = []
    real_tune = flow.Bringup.stage_tune
    monkeypatch.setattr(flow.Bringup, "stage_tune", lambda self: tuned.append(1) or real_tune(self))
    again = _bringup(tmp_path, monkeypatch, ep_sizes=[4, 8])
    done = again.run()
    assert tuned == []  # the finished tune stage is not run again
    assert _ep_profiles(again.store) == {(4, 1, "measured"), (8, 1, "measured")}
    rows = [r for r in done["compare"] if r["family"] != "megakernel"]
    assert sorted(r["ep_size"] for r in rows) == sorted([4, 8] * (len(rows) // 2))
    assert set(again.worlds) == {4, 8}  # each compared with as many ranks as it was tuned with
    report = Path(done["report"]).read_text()
    assert "EP sizes tuned: 4, 8 (as the plan lists)" in report


def test_ep_sizes_of_the_plan() -> None:
    from moetune.tuner.bringup.flow import Plan, plan_ep_sizes

    assert plan_ep_sizes(Plan(), 8)[0] == [8]
    assert plan_ep_sizes(Plan.quick(), 8)[0] == [8]  # --quick: still one EP size
    assert plan_ep_sizes(Plan(), 4)[0] == [4]
    sizes, note = plan_ep_sizes(Plan(), 6)  # 128 experts do not divide over 6
    assert sizes == [4] and "not 6" in note
    assert plan_ep_sizes(Plan(), 0)[0] == [2]  # a CPU node: 2 gloo ranks, as before
    assert plan_ep_sizes(Plan(), 1)[0] == []  # a one-GPU node tunes the megakernel only, as before
    assert plan_ep_sizes(Plan(ep_sizes=[8, 2, 4]), 8)[0] == [2, 4, 8]
    assert plan_ep_sizes(Plan(world=4), 8)[0] == [4]  # an older plan's single size
    with pytest.raises(ValueError, match="EP size 16 needs 16 GPUs, this node has 8"):
        plan_ep_sizes(Plan(ep_sizes=[16]), 8)
    with pytest.raises(ValueError, match="does not divide"):
        plan_ep_sizes(Plan(ep_sizes=[3]), 8)


def test_plan_file_ep_sizes(tmp_path: Path) -> None:
    from moetune.tuner.bringup.flow import Plan

    p = tmp_path / "plan.toml"
    p.write_text("[plan]\nep_sizes = [2, 8]\n")
    assert Plan.from_file(p, Plan()).ep_sizes == [2, 8]
    for body, words in (("ep_sizes = [1]", "ep_sizes must be a list of integers >= 2"),
                        ("ep_sizes = [2]\nworld = 4", "not both"), ("world = 0", "world must be an integer >= 2"),
                        # as ep_sizes = [1]: it stored "measured" collective profiles of one rank exchanging nothing
                        ("world = 1", "world must be an integer >= 2 \\(an EP exchange needs 2 GPUs"),
                        ("tokens = [99999999999999999999]", r"above the largest token bucket \(65536")):
        p.write_text(body + "\n")
        with pytest.raises(ValueError, match=words):
            Plan.from_file(p, Plan())


def test_profile_cli_refuses_an_ep_size_over_the_gpus(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    p = tmp_path / "plan.toml"
    p.write_text("[plan]\nep_sizes = [16]\n")
    r = CliRunner().invoke(app, ["profile", "--plan", str(p), "--capture", str(CAPTURES / "dgx-h100"),
                                 "--db", str(tmp_path / "m.db"), "--json"], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 2, r.output
    assert "EP size 16 needs 16 GPUs, this node has 8" in r.output and isinstance(r.exception, SystemExit)
    assert not (tmp_path / "m.db").exists()  # refused before the database was opened


def test_the_bring_up_searches_the_knobs_the_runtime_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """host_staged reads chunk_tokens (its staging message size): the bring-up's search may ask it. The search
    space pins what a runtime ignores by itself; the bring-up adds no override of its own pinning chunk_tokens = 0
    (and num_sms) for host_staged and collective, as if both ran on the collective."""
    from moetune.tuner.search import tune as T
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace

    seen: list[Any] = []

    def spy(*args: Any, **kw: Any) -> list:
        seen.append(kw.get("policy_override"))
        return []

    monkeypatch.setattr(T, "tune_profiles_detailed", spy)
    b = _bringup(tmp_path, monkeypatch)
    b.stage_tune()
    assert seen
    for override in seen:
        space = SearchSpace(load_policy("host_staged", override), experts=128, ep_size=2)
        assert len({k.chunk_tokens for k in space.enumerate()}) > 1


def test_plan_backend_model_is_refused(tmp_path: Path) -> None:
    """`backend = "model"` was accepted and never read: the bring-up measured anyway. It measures this node; the
    key names only what it does (auto, local)."""
    from moetune.tuner.bringup.flow import Plan

    p = tmp_path / "plan.toml"
    for ok in ("auto", "local"):
        p.write_text(f'backend = "{ok}"\n')
        assert Plan.from_file(p, Plan()).backend == ok
    p.write_text('backend = "model"\n')
    with pytest.raises(ValueError, match="a bring-up measures this node; a MODELLED tune is `moetune tune --backend"):
        Plan.from_file(p, Plan())


def test_a_node_without_gpus_runs_at_most_one_gloo_rank_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """ep_sizes = [2, 4, 8] on a 2-core node without GPUs is refused past what the node can run, as the docs say
    (8 gloo ranks on 2 cores would take minutes a trial)."""
    import os

    from moetune.tuner.bringup.flow import Plan, plan_ep_sizes

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert plan_ep_sizes(Plan(ep_sizes=[2]), 0)[0] == [2]
    with pytest.raises(ValueError, match=r"EP size 4 runs 4 gloo ranks .* on 2 CPUs: at most 2 here"):
        plan_ep_sizes(Plan(ep_sizes=[2, 4]), 0)
    # `tune --backend local` took the same 4 ranks on 2 CPUs (no trial done in two minutes): refused up front too
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    r = CliRunner().invoke(app, ["tune", "--backend", "local", "--model", "qwen3-30b", "--ep-size", "4", "--tokens",
                                 "16", "--trials", "1", "--capture", str(CAPTURES / "cpu-laptop"),
                                 "--db", "/nonexistent/never-created.db"])
    assert r.exit_code == 2 and "4 gloo ranks (this node has no GPU) on 2 CPUs: at most 2 here" in r.output, r.output


def test_a_node_without_gpus_refuses_experts_that_do_not_divide_over_two_up_front() -> None:
    """`profile --quick --model custom:2048,768,129,8` on a node without GPUs ran discovery, the microbenchmarks and
    the calibration before the EP size of 2 was found not to divide 129 experts, and its "rerun to continue" resumed
    into the same error every time."""
    from moetune.tuner.bringup.flow import Plan, plan_ep_sizes

    with pytest.raises(ValueError, match=r"EP size 2 .* does not divide the experts of custom:2048,768,129,8"):
        plan_ep_sizes(Plan(models=["custom:2048,768,129,8"]), 0)
    assert plan_ep_sizes(Plan(models=["custom:2048,768,128,8"]), 0)[0] == [2]


# fp8 on the wire: half the time, and a measured error (0.2) over every policy's budget (0.05)
FAKE_FP8_OVER_BUDGET = FAKE_BENCH.replace(
    't = 10.0 * world + int(knobs.get("pipeline_depth", "1"))',
    'fp8 = knobs.get("compression", "none") != "none"\n'
    't = (10.0 * world + int(knobs.get("pipeline_depth", "1"))) / (2 if fp8 else 1)').replace(
    '"max_rel_err": 0.0', '"max_rel_err": 0.2 if fp8 else 0.0')


def test_the_compare_stage_holds_a_compressed_setting_to_the_policys_error_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert FAKE_FP8_OVER_BUDGET != FAKE_BENCH
    b = _bringup(tmp_path, monkeypatch, fake=FAKE_FP8_OVER_BUDGET, compare_rounds=2)  # 2 samples: a gain can be called
    b.state.mark("discover", b.stage_discover())
    b.state.mark("microbench", [])
    b.state.mark("calibrate", {"skipped": "test"})
    rows = [r for r in b.stage_tune() if r["family"] != "megakernel"]
    assert rows and all(r["knobs"]["compression"] == "none" for r in rows)  # the trials refused fp8 (infeasible)
    for r in rows:  # a tuned fp8 setting (its trial measured within the budget): the comparison measures it again
        r["knobs"] = {**r["knobs"], "compression": "fp8_e4m3"}
    b.state.mark("tune", rows)
    compared = b.stage_compare()
    assert compared and all(r["stored"] == "policy default" for r in compared), compared  # not "tuned"
    assert all("over the budget" in r["why_default"] for r in compared), compared
    for _, rec in b.store.list_profiles(status="current"):
        assert rec.knobs.compression == "none", rec
