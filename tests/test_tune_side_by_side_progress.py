"""`moetune tune --backend local` measures its winner again beside the policy default and the current profile after
the search (`_write_profile`): on a CPU node that took 46 s of two gloo ranks after the study's last "2/2 done" line,
with no line at all (a terminal's bar sat finished, a piped log said nothing). It is a step of its own in the
progress now ("...: side-by-side check"), started before the re-measurement and done after it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import Knobs
from moetune.tuner.cli import app
from moetune.tuner.search.backends import Measurement
from moetune.tuner.search.local_backend import LocalBackend

# a local tune of the cpu-laptop capture (timings injected), run as on that node whatever machine runs the suite
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).parent / "captures"
COMPARED: list[int] = []  # how many settings each side-by-side re-measurement ran


class Timed(LocalBackend):
    """Trials and the side-by-side re-measurement with set numbers (no ranks launched)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(command=["true"], comm_backend="gloo", repeats=1, world=kw.get("world", 2))

    def evaluate(self, knobs: Knobs, workload: Any, *, report: Any = None) -> Measurement:
        return Measurement(100.0 + knobs.pipeline_depth, 1.0, [100.0], True)

    def compare(self, candidates: Any, workload: Any, *, rounds: int = 3) -> list[Measurement]:
        COMPARED.append(len(candidates))
        return [Measurement(100.0, 1.0, [100.0] * rounds, True) for _ in candidates]


def test_the_side_by_side_check_is_a_step_in_the_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.tuner.search.tune as search

    monkeypatch.setattr(search, "make_backend", lambda backend, preset=None, **kw: Timed(**kw))
    COMPARED.clear()
    r = CliRunner().invoke(app, ["tune", "-m", "qwen3-30b", "--backend", "local", "--world", "2", "--family",
                                 "collective", "--from", str(CAPTURES / "cpu-laptop"), "--trials", "2", "--tokens",
                                 "128", "--repeats", "1", "--db", str(tmp_path / "m.db")],
                           env={"MOETUNE_HOME": str(tmp_path), "COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert COMPARED, "no side-by-side re-measurement ran"
    lines = r.stderr.splitlines()
    study = max(i for i, ln in enumerate(lines) if ln.startswith("collective qwen3-30b S=128: 2/2 done"))
    check = "collective qwen3-30b S=128: side-by-side check"
    started = [i for i, ln in enumerate(lines) if ln.startswith(f"{check}: started, 0/1 done")]
    done = [i for i, ln in enumerate(lines) if ln.startswith(f"{check}: 1/1 done")]
    assert started and done and study < started[0] < done[0], lines
