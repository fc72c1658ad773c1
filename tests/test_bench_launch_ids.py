"""Launch ids (`20261207T045017Z-1`: the launch's start to the second, then its number in the run) were made from
the clock alone: two `moetune bench run`s of one scenario starting in the same second gave their launches the same
ids, and the summary pooled their rows as one launch. The id is now checked against the table under its lock when the
launch's rows are appended; a taken one moves to the next free number. A lone run's ids are as before."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from moetune.tuner.measure import results as R
from moetune.tuner.measure.scenarios import definitions, runner
from moetune.tuner.measure.scenarios.records import CaseResult, Ctx, Resolved, Stat

T = "20261207T045017Z"


class _Frozen:
    """`runner.dt` with its clock stopped: every launch starts in the same second."""

    UTC = dt.UTC

    class datetime:  # the name the runner calls
        @staticmethod
        def now(tz: Any = None) -> dt.datetime:
            return dt.datetime(2026, 12, 7, 4, 50, 17, tzinfo=dt.UTC)


def _driver(seq: Sequence[Resolved], ctx: Ctx) -> list[CaseResult]:
    return [CaseResult(c.name, {"m": Stat(1.0, 0.9, 1.1, 3, "us")}, "fake") for c in seq]


def test_two_runs_starting_in_the_same_second_get_launch_ids_of_their_own(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    s = definitions.get("fabric-model")
    monkeypatch.setattr(runner, "dt", _Frozen)
    monkeypatch.setitem(runner.DRIVERS, s.driver, _driver)
    monkeypatch.setattr(runner, "machine_facts", lambda backend, fingerprint=None: {"git_sha": "a" * 40})
    out = tmp_path / "s.csv"
    first = runner.run(s, results=out, gpus=0, launches=2)
    second = runner.run(s, results=out, gpus=0, launches=2)
    a = list(dict.fromkeys(r["launch"] for r in first))
    b = list(dict.fromkeys(r["launch"] for r in second))
    assert a == [f"{T}-1", f"{T}-2"]  # a lone run: the ids it always had
    assert len(b) == 2 and not set(a) & set(b), b
    assert all(x.startswith(f"{T}-") for x in b)
    # the rows returned (what the CLI shows) carry the ids the table holds
    in_table = list(dict.fromkeys(r["launch"] for r in R.read_rows(out)))
    assert in_table == a + b


def test_a_taken_launch_id_moves_to_the_next_free_number(tmp_path: Path) -> None:
    def rows(launch: str) -> list[dict[str, Any]]:
        return [{"scenario": "x", "case": c, "launch": launch, "metric": "m", "median": 1.0} for c in ("a", "b")]

    out = tmp_path / "s.csv"
    R.append_rows(out, rows(f"{T}-1"), fresh_launch=True)
    R.append_rows(out, rows(f"{T}-2"), fresh_launch=True)
    again = rows(f"{T}-1")
    R.append_rows(out, again, fresh_launch=True)
    assert {r["launch"] for r in again} == {f"{T}-3"}
    R.append_rows(out, rows(f"{T}-1"))  # without fresh_launch (an import of recorded rows): the ids as given
    assert [r["launch"] for r in R.read_rows(out)][::2] == [f"{T}-1", f"{T}-2", f"{T}-3", f"{T}-1"]
