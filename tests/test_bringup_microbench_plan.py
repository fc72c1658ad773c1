"""The bring-up's microbenchmark stage runs the sizes and iterations the plan names.

`iters` and `microbench_sizes` (empty: the default sweep) govern, not the plan's trial count: bench/plans/h200x2.toml
(trials 8, iters 20) must not silently run the 4-size quick sweep at 5 iterations. --quick's short sweep is its own
plan's `microbench_sizes`."""

from __future__ import annotations

import io
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.measure import micro

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"
ROOT = Path(__file__).resolve().parents[1]


class _Bench:
    transport, runner = "nvlink", "nccl_p2p"

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def run(self, sizes: Any, *, iters: int) -> list:
        self.seen.append((list(sizes), iters))
        return []


def _microbench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: Any) -> tuple[list, str]:
    from moetune.tuner.bringup.flow import Bringup

    seen: list = []
    monkeypatch.setattr(micro, "plan", lambda *a, **k: [(_Bench(seen), True, "")])
    out = io.StringIO()
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                console=Console(file=out, width=300), capture=CAPTURES / "h200x2",
                storage=f"sqlite:///{tmp_path / 'opt.db'}")
    b.stage_microbench()
    return seen, out.getvalue()


def test_the_shipped_h200x2_plan_runs_its_iters_and_the_default_sweep(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup.flow import Plan

    path = ROOT / "bench/plans/h200x2.toml"
    written = tomllib.loads(path.read_text())["plan"]
    assert written["trials"] <= 8 and written["iters"] == 20  # the plan the defect was found with
    seen, out = _microbench(tmp_path, monkeypatch, Plan.from_file(path, Plan()))
    assert seen == [(list(micro.DEFAULT_SIZES), 20)]
    assert "20 timed iterations each" in out and "the default sweep" in out


def test_a_small_plan_keeps_its_own_sizes_and_iters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup.flow import Plan

    plan = Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=7, microbench_sizes=[4096, 65536])
    seen, out = _microbench(tmp_path, monkeypatch, plan)
    assert seen == [([4096, 65536], 7)]
    assert "2 message sizes (4 KiB to 64 KiB), 7 timed iterations each" in out


def test_quick_stays_quick_as_its_plan_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup.flow import Plan

    plan = Plan.quick()
    assert plan.microbench_sizes == list(micro.QUICK_SIZES)
    seen, _ = _microbench(tmp_path, monkeypatch, plan)
    assert seen == [(list(micro.QUICK_SIZES), plan.iters)]


@pytest.mark.parametrize("key", ["iters", "repeats", "compare_rounds"])
def test_a_plan_count_past_the_bench_limit_is_refused_naming_it(tmp_path: Path, key: str) -> None:
    """`iters = 9999999999999999999999` was taken: the first microbenchmark then ran until killed (`bench ep --iters`
    refuses past 1000000). A count of timed runs past that limit is refused up front, naming the file and the key."""
    from moetune.tuner.bringup.flow import Plan

    path = tmp_path / "plan.toml"
    path.write_text(f"{key} = 1000001\n")
    with pytest.raises(ValueError, match=f"{path}: {key} must be an integer from 1 to 1000000"):
        Plan.from_file(path, Plan())
    path.write_text(f"{key} = 1000000\n")
    assert getattr(Plan.from_file(path, Plan()), key) == 1000000


def test_a_plan_with_trials_past_the_limit_is_refused_naming_it(tmp_path: Path) -> None:
    """`trials = 100000000000000000000` was taken (trials had no upper bound): a study that never ends."""
    from moetune.runtime.config import MAX_TRIALS
    from moetune.tuner.bringup.flow import Plan

    path = tmp_path / "plan.toml"
    path.write_text(f"trials = {MAX_TRIALS + 1}\n")
    with pytest.raises(ValueError, match=f"{path}: trials must be an integer from 1 to {MAX_TRIALS}"):
        Plan.from_file(path, Plan())
    path.write_text(f"trials = {MAX_TRIALS}\n")
    assert Plan.from_file(path, Plan()).trials == MAX_TRIALS
