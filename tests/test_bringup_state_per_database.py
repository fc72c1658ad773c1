"""The bring-up state is the database's: two databases of one folder shared `bringup-<fingerprint>.json`, so after
`profile --db d/a.db` a `profile --db d/b.db` of the same plan found every stage "done earlier; resuming", measured
nothing, stored nothing in b.db and exited 0 with a.db's rows in its summary."""

from __future__ import annotations

import io
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs
from moetune.tuner.search.backends import TuneWorkload

# the megakernel of a GPU node's capture, timed by a stand-in: run as ON that node (conftest)
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("on_captured_node")]
CAPTURES = Path(__file__).resolve().parent / "captures"


def flat(knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
    return {"graph_us": [300.0, 303.0, 297.0], "eager_us": [301.0] * 3}


def _plan() -> Any:
    from moetune.tuner.bringup.flow import Plan

    return Plan(models=["qwen3-30b"], tokens=[16], trials=2, repeats=1, iters=5, compare_rounds=2)


def _run(db: Path) -> tuple[Any, Any, str]:
    """A bring-up into `db` as the CLI runs it: the state and the studies beside the database."""
    from moetune.tuner.bringup.flow import Bringup

    out = io.StringIO()
    store = F.open_store(db)
    b = Bringup(store=store, plan=_plan(), state_dir=db.parent, console=Console(file=out, width=300),
                capture=CAPTURES / "h200x1", mk_measure=flat)
    b.stage_microbench = lambda: []  # type: ignore[method-assign]  # no subprocesses
    b.run()
    return b, store, out.getvalue()


def test_two_databases_of_one_folder_each_run_their_own_bring_up(tmp_path: Path) -> None:
    a, store_a, _ = _run(tmp_path / "a.db")
    assert len(store_a.list_profiles()) == 1
    b, store_b, out = _run(tmp_path / "b.db")
    assert "done earlier" not in out
    assert len(store_b.list_profiles()) == 1  # measured and stored in b.db, not "resumed" from a.db's run
    assert a.state.path != b.state.path
    assert json.loads(b.state.path.read_text())["db"] == "b.db"
    # each database still resumes its own
    _, _, again = _run(tmp_path / "a.db")
    # every measuring stage resumed; the report is written again on every run (it comes from the state)
    assert again.count("done earlier; resuming") == 5 and "→ report" in again


def test_state_file_names_follow_the_studies_file_rule() -> None:
    from moetune.tuner.bringup.flow import state_file_name

    assert state_file_name("/d/moetune.db", "ab12") == "moetune-bringup-ab12.json"
    assert state_file_name("/d/b.db", "ab12") == "b-bringup-ab12.json"
    names = {state_file_name(f"/d/{n}", "ab12") for n in ("x.db", "x.sqlite", "x")}
    assert names == {"x-bringup-ab12.json", "x.sqlite.bringup-ab12.json", "x.bringup-ab12.json"}


def test_an_older_shared_state_file_is_neither_resumed_nor_touched(tmp_path: Path) -> None:
    """`bringup-<fingerprint>.json` of an older moetune names no database (any database of the folder may have
    written it): not resumed, said, and left byte for byte as it was."""
    from moetune.tuner.bringup.flow import LEGACY_STATE
    from moetune.tuner.fabric.discovery import discover

    fp = discover(CAPTURES / "h200x1").fingerprint
    legacy = tmp_path / LEGACY_STATE.format(fp)
    done = {s: [] for s in ("discover", "microbench", "calibrate", "tune", "compare")}
    legacy.write_text(json.dumps({"fingerprint": fp, "plan": asdict(_plan()), "done": done}))
    before = legacy.read_bytes()
    _, store, out = _run(tmp_path / "b.db")
    assert "done earlier" not in out
    assert "older moetune" in out and "not resumed" in out and legacy.name in out
    assert len(store.list_profiles()) == 1
    assert legacy.read_bytes() == before
    _, _, again = _run(tmp_path / "b.db")  # its own state now: resumed, and the old file no longer mentioned
    assert "older moetune" not in again and again.count("done earlier; resuming") == 5 and "→ report" in again


def test_a_state_file_of_another_database_is_not_resumed(tmp_path: Path) -> None:
    """A state file copied or renamed to this database's name records the database its stages stored into."""
    from moetune.tuner.bringup.flow import BringupState

    plan = _plan()
    first = BringupState(tmp_path / "s.json", "x", plan, db="a.db")
    first.mark("discover", {})
    other = BringupState(first.path, "x", plan, db="b.db")
    assert not other.done("discover") and "a.db" in other.dropped and "starting over" in other.dropped
    assert BringupState(first.path, "x", plan, db="a.db").done("discover")
    restarted = BringupState(first.path, "x", plan, db="a.db")
    restarted.restart()
    assert json.loads(first.path.read_text())["db"] == "a.db"  # a restart keeps whose state it is


def test_a_database_deleted_since_is_not_resumed_into(tmp_path: Path) -> None:
    """The state file outlives its database: after `rm moetune.db`, a rerun found every stage "done earlier;
    resuming" into the new, empty database, stored nothing in it, and its summary and report said the profiles
    were stored."""
    db = tmp_path / "a.db"
    first, store, _ = _run(db)
    assert len(store.list_profiles()) == 1
    store.close()
    for p in tmp_path.glob("a.db*"):  # the database (and its -wal/-shm); the state file and studies stay
        p.unlink()
    again, store2, out = _run(db)
    assert "done earlier" not in out
    assert "starting over" in out
    assert len(store2.list_profiles()) == 1  # measured and stored into the new database
    assert again.state.path == first.state.path


@pytest.mark.parametrize("body", [b"\xff\xfe{}", b"{not json"])
def test_an_unreadable_state_file_starts_over_saying_so(tmp_path: Path, body: bytes) -> None:
    """A state file that is not UTF-8 ended `moetune profile` with "error: 'utf-8' codec can't decode byte 0xff",
    naming no file; one that is not JSON was started over without a word."""
    from moetune.tuner.bringup.flow import BringupState

    path = tmp_path / "moetune-bringup-ab12.json"
    path.write_bytes(body)
    state = BringupState(path, "ab12", _plan(), db="moetune.db")
    assert state.data["done"] == {}
    assert "cannot be read as a bring-up state" in state.dropped and "starting over" in state.dropped


def test_a_new_database_that_already_holds_this_nodes_fingerprint_is_not_resumed_into(tmp_path: Path) -> None:
    """The database deleted, the new one got this node's fingerprint row before the rerun (a restarted daemon,
    `fabric show --record`): a fingerprint row is no sign the stages' rows are there, and the rerun found every stage
    "done earlier", stored nothing and said the profiles were stored."""
    from moetune.tuner.fabric.change import record_node_facts

    db = tmp_path / "a.db"
    first, store, _ = _run(db)
    store.close()
    for p in tmp_path.glob("a.db*"):
        p.unlink()
    fresh = F.open_store(db)
    record_node_facts(fresh, first.facts, by="fabric show --record")  # the node's fingerprint row, no measurement
    fresh.close()
    _again, store2, out = _run(db)
    assert "done earlier" not in out and "starting over" in out
    assert len(store2.list_profiles()) == 1  # measured and stored into the new database
