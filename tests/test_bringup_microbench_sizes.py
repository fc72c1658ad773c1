"""A --plan whose microbench_sizes no memory of the node can hold (1 TiB) is refused before any stage, naming the size
and the bound: the microbenchmark allocated it (a GPU out of memory, or a host driven into swap and the OOM killer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

CAPTURES = Path(__file__).parent / "captures"


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    from moetune.tuner.bringup import flow
    from moetune.tuner.fabric import discovery

    ran: list[Any] = []
    monkeypatch.setattr(flow.Bringup, "run", lambda self: ran.append(self) or {"calibrate": {}, "compare": [],
                                                                              "report": "r.md"})
    monkeypatch.setattr(discovery, "capture_not_this_node", lambda facts, capture: "")  # measured as this node
    from moetune.tuner.search import local_backend

    monkeypatch.setattr(local_backend, "cuda_gpus", lambda: 8)  # the capture's GPUs are this machine's
    return ran


def _profile(tmp_path: Path, capture: str, sizes: list[int]):
    from moetune.tuner.cli import app

    plan = tmp_path / "plan.toml"
    plan.write_text(f"microbench_sizes = {sizes}\n")
    return CliRunner().invoke(app, ["profile", "--capture", str(CAPTURES / capture), "--db", str(tmp_path / "m.db"),
                                    "--plan", str(plan)], env={"COLUMNS": "400", "MOETUNE_HOME": str(tmp_path)})


@pytest.mark.parametrize("capture", ["h200x2", "cpu-laptop"])
def test_a_size_no_memory_holds_is_refused_before_any_stage(tmp_path: Path, fake_run: list[Any], capture: str) -> None:
    r = _profile(tmp_path, capture, [1024, 1 << 40])
    said = " ".join(r.output.split())
    assert r.exit_code == 2, said
    assert "microbench_sizes" in said and "1 TiB" in said and "at most" in said, said
    assert fake_run == [] and not (tmp_path / "m.db").exists()


def test_the_gpu_bound_is_half_the_smallest_gpu(tmp_path: Path, fake_run: list[Any]) -> None:
    """h200x2: 2 GPUs of about 141 GiB; 100 GiB fits no GPU twice over (the warm-up buffer and the message)."""
    r = _profile(tmp_path, "h200x2", [100 << 30])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "100 GiB" in said and "GPU" in said, said


def test_sizes_that_fit_run(tmp_path: Path, fake_run: list[Any]) -> None:
    r = _profile(tmp_path, "h200x2", [1024, 16 << 20])
    assert r.exit_code == 0, r.output
    assert len(fake_run) == 1
