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


def test_a_folder_at_the_state_files_name_is_refused_up_front(tmp_path: Path) -> None:
    """A folder where the state file goes was 'read' as an unreadable state ("starting over"), and the first save,
    after the discover stage, failed "Is a directory ... (finished stages are kept; run the same command again to
    continue)": every rerun failed the same way. Now a ValueError naming it before any stage (the CLI: exit 2)."""
    import pytest

    from moetune.tuner.bringup.flow import BringupState, Plan

    path = tmp_path / "moetune-bringup-ab12.json"
    path.mkdir()
    with pytest.raises(ValueError, match="not a file"):
        BringupState(path, "ab12", Plan.quick(), db="moetune.db")
    # a capture of another node neither reads nor saves a state: nothing to refuse
    assert BringupState(path, "ab12", Plan.quick(), persist=False, db="moetune.db").data["done"] == {}
