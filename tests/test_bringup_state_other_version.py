"""A bring-up state whose plan has a key this moetune's plan does not (written by a newer moetune, or an older one's
key since removed) starts over saying which key differs: it said "the plan differs from the one its finished stages
ran (; a moetune upgrade ...)", naming nothing, since only this version's keys were compared."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def _state(path: Path, plan_changes: dict, drop: tuple[str, ...] = ()) -> str:
    from moetune.tuner.bringup.flow import BringupState, Plan

    plan = Plan.quick()
    was = {**{k: v for k, v in asdict(plan).items() if k not in drop}, **plan_changes}
    path.write_text(json.dumps({"fingerprint": "ab12", "plan": was, "db": "moetune.db",
                                "done": {"discover": {"fingerprint": "ab12"}}}))
    state = BringupState(path, "ab12", plan, db="moetune.db")
    assert state.data["done"] == {}  # another plan: not resumed
    return state.dropped


def test_a_key_only_the_earlier_plan_has_is_named(tmp_path: Path) -> None:
    said = _state(tmp_path / "moetune-bringup-ab12.json", {"newer_key": 3})
    assert "the plan differs" in said and "(newer_key;" in said and "starting over" in said, said


def test_a_key_only_this_plan_has_is_named(tmp_path: Path) -> None:
    said = _state(tmp_path / "moetune-bringup-ab12.json", {}, drop=("compare_rounds",))
    assert "(compare_rounds;" in said, said


def test_a_changed_value_is_named_as_before(tmp_path: Path) -> None:
    said = _state(tmp_path / "moetune-bringup-ab12.json", {"trials": 99})
    assert "(trials;" in said, said
