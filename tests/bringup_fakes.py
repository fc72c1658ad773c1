"""Shared set-up of the tests that run `moetune profile` on a capture with the bring-up's stages faked: what the
command does before and around its stages (the run lock, the studies-file check, refusals), not the stages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

CAPTURES = Path(__file__).parent / "captures"


def fake_bringup_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Bringup.run faked (each run appended to the list returned), and the capture taken for this node: a bring-up
    of another node's capture measures nothing, so it neither takes the run lock nor opens a database or studies
    file."""
    from moetune.tuner.bringup import flow
    from moetune.tuner.fabric import discovery

    ran: list[Any] = []

    def run(self: Any) -> dict:
        ran.append(self)
        return {"calibrate": {}, "compare": [], "report": "r.md"}

    monkeypatch.setattr(flow.Bringup, "run", run)
    monkeypatch.setattr(discovery, "capture_not_this_node", lambda facts, capture: "")
    return ran


def profile_cli(db: Path, tmp_path: Path) -> Any:
    """`moetune profile --capture h200x1 --db DB` with MOETUNE_HOME in tmp_path."""
    from moetune.tuner.cli import app

    return CliRunner().invoke(app, ["profile", "--capture", str(CAPTURES / "h200x1"), "--db", str(db)],
                              env={"COLUMNS": "400", "MOETUNE_HOME": str(tmp_path)})
