"""`moetune profile` shows progress through its long stages: the side-by-side comparison of every tuned bucket
against the policy default (rounds x 2 settings x repeats per bucket) had no bar, only its heading."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

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


class Recorder:
    def __init__(self) -> None:
        self.tasks: list[dict[str, Any]] = []

    def add(self, description: str, total: int, done: int = 0) -> int:
        self.tasks.append({"description": description, "total": total, "done": done})
        return len(self.tasks) - 1

    def update(self, task: int, done: int, best: float | None = None, description: str | None = None) -> None:
        self.tasks[task]["done"] = done

    def close(self) -> None:
        pass


def test_compare_stage_has_a_progress_bar(tmp_path: Path) -> None:
    from moetune.tuner.bringup.flow import Bringup, Plan

    bar = Recorder()
    plan = Plan(models=["qwen3-30b"], tokens=[16, 64], trials=3, repeats=1, iters=5, compare_rounds=1)
    b = Bringup(store=F.open_store(tmp_path / "b.db"), plan=plan, state_dir=tmp_path / "state",
                console=Console(file=io.StringIO()), capture=CAPTURES / "h200x1",
                storage=f"sqlite:///{tmp_path / 'opt.db'}", progress=bar, mk_measure=flat)
    b.state.mark("tune", b.stage_tune())
    before = len(bar.tasks)
    b.stage_compare()
    new = bar.tasks[before:]
    assert len(new) == 1 and new[0]["total"] == 2 and new[0]["done"] == 2
