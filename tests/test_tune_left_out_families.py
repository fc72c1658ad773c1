"""A transport family left out of a tune because its transport cannot serve the EP group (`BenchmarkBackend.
group_problem`: the runtime's `group_world_problem` for a local tune) is reported where the tune reports, not only
in a log line: `moetune tune`'s table and each --json row (`left_out`, a list of `{"family", "reason"}`), and
`moetune profile`'s output, summary (--json `left_out`, with the EP size) and report."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import group_world_problem

CAPTURES = Path(__file__).resolve().parent / "captures"
# the runtime's own words for nvlink at 16 ranks: what every report must say (not a copy of its text)
NVLINK_16 = group_world_problem("nvlink", 16)
assert NVLINK_16  # the bound this file is about: nvlink serves at most MAX_WORLD (8) ranks


def _fake_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's local backend replaced by a fake that launches no rank (a trial measures 10 + pipeline_depth) but
    asks the local backend's own refusal and group bound, as check_tune asks them; 16 CUDA GPUs "found" here."""
    import moetune.tuner.search.tune as search
    from moetune.tuner.search import local_backend
    from moetune.tuner.search.local_backend import LocalBackend

    def make(backend: Any, preset: Any = None, **kw: Any) -> Any:
        fake = F.measuring_fake(lambda k, w: 10.0 + k.pipeline_depth, name="local:fake")
        fake.world, fake.comm_backend = kw["world"], kw.get("comm_backend", "nccl")
        fake.refusal = types.MethodType(LocalBackend.refusal, fake)
        fake.group_problem = types.MethodType(LocalBackend.group_problem, fake)
        return fake

    monkeypatch.setattr(search, "make_backend", make)
    monkeypatch.setattr(local_backend, "cuda_gpus", lambda: 16)


def _tune(tmp_path: Path, *extra: str) -> Any:
    from moetune.tuner.cli import app

    return CliRunner().invoke(app, ["tune", "--backend", "local", "--capture", str(CAPTURES / "dgx-h100"), "-m",
                                    "qwen3-30b", "--tokens", "16", "--trials", "2", "--ep-size", "16", "--world", "16",
                                    "--family", "nvlink", "--family", "collective", "--db", str(tmp_path / "p.db"),
                                    *extra], env={"MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "300"})


@pytest.mark.usefixtures("on_captured_node")  # as on the captured node: a local tune of it measures
def test_tune_lists_the_families_it_left_out_in_its_table_and_json(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_local(monkeypatch)
    r = _tune(tmp_path)
    assert r.exit_code == 0, r.output
    table = " ".join(r.stdout.split())  # on stdout with the table: not only the log's line on stderr
    assert "tuned profiles" in table, table
    assert f"family nvlink left out: it cannot serve EP size 16 on 1 node(s): {NVLINK_16}" in table, table

    r = _tune(tmp_path, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["family"] for row in rows] == ["collective"], rows
    assert all(row["left_out"] == [{"family": "nvlink", "reason": NVLINK_16}] for row in rows), rows


@pytest.mark.usefixtures("on_captured_node")
def test_a_tune_that_leaves_nothing_out_says_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_local(monkeypatch)
    r = _tune(tmp_path, "--ep-size", "8", "--world", "8", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert sorted(row["family"] for row in rows) == ["collective", "nvlink"], rows
    assert all(row["left_out"] == [] for row in rows), rows
    r = _tune(tmp_path, "--ep-size", "8", "--world", "8")
    assert "left out" not in r.stdout, r.stdout
