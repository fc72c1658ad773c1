"""A tuning run killed with kill -9 (or stopped by a full disk) never finished its `tuning_runs` row: it stayed
`running` forever (the daemon's recovery closes only its own job runs). Each run records its owner (HOST:PID:START,
schema 0008); a later `tune` or `profile` marks the rows whose owner is gone `interrupted`, and never touches a row of
a live process, of another host, or one stored before the owner was recorded."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from moetune.tuner.store.store import Store

START = """
import sys, time
from moetune.tuner.store.store import Store
s = Store(sys.argv[1])
print(s.start_run(study_name="killed", storage="x", backend="model"), flush=True)
time.sleep(120)
"""


def _killed_run(db: Path) -> int:
    """A run started by a process then killed with kill -9: its row's id."""
    p = subprocess.Popen([sys.executable, "-c", START, str(db)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.stdout is not None
    run_id = int(p.stdout.readline())
    p.send_signal(signal.SIGKILL)
    p.wait()
    return run_id


def _status(db: Path) -> dict[int, tuple[str, str | None]]:
    con = sqlite3.connect(db)
    try:
        return {r[0]: (r[1], r[2]) for r in con.execute("SELECT id, status, ended FROM tuning_runs")}
    finally:
        con.close()


def test_a_killed_runs_row_is_closed_and_live_ones_are_not(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    killed = _killed_run(db)
    with Store(db) as s:
        mine = s.start_run(study_name="live", storage="x", backend="model")  # this process: alive
        other_host = s.start_run(study_name="elsewhere", storage="x", backend="model")
        legacy = s.start_run(study_name="before-0008", storage="x", backend="model")
    con = sqlite3.connect(db)
    con.execute("UPDATE tuning_runs SET owner = ? WHERE id = ?", (f"not-{socket.gethostname()}:1:1", other_host))
    con.execute("UPDATE tuning_runs SET owner = NULL WHERE id = ?", (legacy,))
    con.commit()
    con.close()
    assert _status(db)[killed] == ("running", None)
    with Store(db) as s:
        assert s.close_orphaned_runs() == [killed]
        assert s.close_orphaned_runs() == []
    st = _status(db)
    assert st[killed][0] == "interrupted" and st[killed][1] is not None
    assert {st[i][0] for i in (mine, other_host, legacy)} == {"running"}


def test_a_reused_pid_is_not_the_owner(tmp_path: Path) -> None:
    """The pid of a killed run given to another process since: the start time tells them apart."""
    db = tmp_path / "m.db"
    with Store(db) as s:
        rid = s.start_run(study_name="x", storage="x", backend="model")
        con = sqlite3.connect(db)
        con.execute("UPDATE tuning_runs SET owner = ? WHERE id = ?", (f"{socket.gethostname()}:{os.getpid()}:1", rid))
        con.commit()
        con.close()
        assert s.close_orphaned_runs() == [rid]


def test_the_next_tune_closes_a_killed_runs_row(tmp_path: Path) -> None:
    from moetune.tuner.cli import app

    db = tmp_path / "m.db"
    killed = _killed_run(db)
    r = CliRunner().invoke(app, ["tune", "--model", "qwen3-30b", "--tokens", "128", "--backend", "model", "--preset",
                                 "nvlink-h200x2", "--trials", "1", "--db", str(db), "--json"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    st = _status(db)
    assert st[killed][0] == "interrupted"
    assert all(v[0] != "running" for v in st.values()), st  # the tune's own rows ended


def test_the_owner_column_goes_down_and_up_with_the_schema(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with Store(db) as s:
        rid = s.start_run(study_name="x", storage="x", backend="model")
        s.downgrade("0007")
        con = sqlite3.connect(db)
        assert "owner" not in {r[1] for r in con.execute("PRAGMA table_info(tuning_runs)")}
        con.close()
        s.upgrade()
        assert s.check()["ok"]
        assert [r["id"] for r in s.list_runs()] == [rid]
        assert s.close_orphaned_runs() == []  # no owner recorded: left as it is


def test_an_interrupted_run_records_the_trials_that_finished(tmp_path: Path) -> None:
    """A run interrupted after trials had finished recorded `trials 0` in its row."""
    import pytest

    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.tune import tune_profiles_detailed

    db = tmp_path / "m.db"
    seen: list[int] = []

    def stop_after_three(_name: str, _study: object, _trial: object) -> None:
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with Store(db) as s:
        with pytest.raises(KeyboardInterrupt):
            tune_profiles_detailed(s, None, models=[get_model("qwen3-30b")], tokens=[128], backend="model",
                                   preset="nvlink-h200x2", trials=10, storage=f"sqlite:///{tmp_path / 'st.db'}",
                                   families=["nvlink"], on_trial=stop_after_three)
        [run] = s.list_runs()
    assert run["status"] == "interrupted" and run["trials"] >= 2, run


def test_an_interrupted_resumed_run_records_its_own_trials(tmp_path: Path) -> None:
    """A run that resumed a study holding trials and was interrupted records the trials IT finished, not the
    study's (its earlier run's row has those)."""
    import pytest

    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.tune import tune_profiles_detailed

    seen: list[int] = []

    def stop_after_two(_name: str, _study: object, _trial: object) -> None:
        seen.append(1)
        if len(seen) == 2:
            raise KeyboardInterrupt

    kw = dict(models=[get_model("qwen3-30b")], tokens=[128], backend="model", preset="nvlink-h200x2",
              storage=f"sqlite:///{tmp_path / 'st.db'}", families=["nvlink"])
    with Store(tmp_path / "m.db") as s:
        tune_profiles_detailed(s, None, trials=4, **kw)
        with pytest.raises(KeyboardInterrupt):
            tune_profiles_detailed(s, None, trials=10, on_trial=stop_after_two, **kw)
        runs = s.list_runs()
    assert [(r["status"], r["trials"]) for r in runs] == [("interrupted", 2), ("done", 4)], runs


def test_a_store_that_cannot_close_the_row_does_not_hide_what_ended_the_run(tmp_path: Path,
                                                                            caplog: Any) -> None:
    """A Ctrl-C (or an error) ended the run and then its row could not be closed (a full disk): the interrupt
    propagates and the store's error is logged; the StoreFull from `finish_run` must not replace the
    KeyboardInterrupt."""
    import pytest

    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.tune import tune_profiles_detailed
    from moetune.tuner.store import StoreError

    def stop_at_once(_name: str, _study: object, _trial: object) -> None:
        raise KeyboardInterrupt

    def full(*_a: object, **_k: object) -> None:
        raise StoreError("database or disk is full")

    with Store(tmp_path / "m.db") as s:
        s.finish_run = full  # type: ignore[method-assign]
        caplog.set_level("WARNING", logger="moetune.tuner.search.tune")
        with pytest.raises(KeyboardInterrupt):
            tune_profiles_detailed(s, None, models=[get_model("qwen3-30b")], tokens=[128], backend="model",
                                   preset="nvlink-h200x2", trials=3, storage=f"sqlite:///{tmp_path / 'st.db'}",
                                   families=["nvlink"], on_trial=stop_at_once)
        assert "its row could not be closed: database or disk is full" in caplog.text
        # a run that ended well still says that its row could not be closed
        with pytest.raises(StoreError, match="disk is full"):
            tune_profiles_detailed(s, None, models=[get_model("qwen3-30b")], tokens=[64], backend="model",
                                   preset="nvlink-h200x2", trials=1, storage=f"sqlite:///{tmp_path / 'st.db'}",
                                   families=["nvlink"])


KILLED_MID_TUNE = """
import os, signal, sys
from moetune.runtime.shapes import get_model
from moetune.tuner.search.tune import tune_profiles_detailed
from moetune.tuner.store.store import Store
seen = []
def kill_after_three(_name, _study, _trial):
    seen.append(1)
    if len(seen) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
s = Store(sys.argv[1])
tune_profiles_detailed(s, None, models=[get_model("qwen3-30b")], tokens=[128], backend="model", preset="nvlink-h200x2",
                       trials=10, storage="sqlite:///" + sys.argv[2], families=["nvlink"], on_trial=kill_after_three)
"""


def test_a_killed_runs_row_keeps_the_trials_it_had_finished(tmp_path: Path) -> None:
    """A run killed with kill -9 after trials had finished: its row, closed `interrupted` by the next run, recorded
    trials 0. The row counts the finished trials as they finish, so the count reached stands."""
    db = tmp_path / "m.db"
    p = subprocess.run([sys.executable, "-c", KILLED_MID_TUNE, str(db), str(tmp_path / "st.db")],
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    with Store(db) as s:
        [run] = s.list_runs()
        assert run["status"] == "running"
        assert s.close_orphaned_runs() == [run["id"]]
        [run] = s.list_runs()
    assert run["status"] == "interrupted" and run["trials"] == 3 and run["best_value"] is not None, run
