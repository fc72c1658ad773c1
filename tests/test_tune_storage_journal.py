"""A SQLite studies file keeps its journal mode unless moetune creates it (or it is moetune's own default studies
file): `tune --storage sqlite:///D/optuna.db` on a user's Optuna file (journal_mode delete) must not switch it to
WAL for good and leave -wal/-shm beside it, a lasting change to a file moetune did not create (WAL also breaks on
network filesystems). Tunes sharing such a file in rollback-journal mode still work (BEGIN IMMEDIATE either way)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.search.storage import make_storage

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.timeout(240)
TUNE = ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--tokens", "128"]


def _journal(p: Path) -> str:
    con = sqlite3.connect(p)
    try:
        return str(con.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    finally:
        con.close()


def _users_optuna_file(p: Path) -> Path:
    """An Optuna file made by Optuna itself (rollback journal: Optuna does not switch it), with a study of its own."""
    st = optuna.storages.RDBStorage(f"sqlite:///{p}")
    study = optuna.create_study(study_name="mine", storage=st)
    study.optimize(lambda t: t.suggest_float("x", 0, 1) ** 2, n_trials=3)
    st.engine.dispose()
    assert _journal(p) == "delete"
    return p


def test_a_users_file_keeps_its_journal_mode(tmp_path: Path) -> None:
    users = _users_optuna_file(tmp_path / "optuna.db")
    r = CliRunner().invoke(app, [*TUNE, "--trials", "3", "--db", str(tmp_path / "m.db"), "--storage", f"sqlite:///{users}"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    assert _journal(users) == "delete"  # not "wal"
    assert not (tmp_path / "optuna.db-wal").exists() and not (tmp_path / "optuna.db-shm").exists()
    names = {s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{users}")}
    assert "mine" in names and any(n.startswith("moetune/") for n in names)


def test_make_storage_leaves_an_existing_file_and_switches_a_new_or_own_one(tmp_path: Path) -> None:
    users = _users_optuna_file(tmp_path / "optuna.db")
    make_storage(f"sqlite:///{users}").engine.dispose()
    assert _journal(users) == "delete"
    make_storage(f"sqlite:///{users}", own=True).engine.dispose()  # moetune's own default studies file
    assert _journal(users) == "wal"
    new = tmp_path / "new.db"
    make_storage(f"sqlite:///{new}").engine.dispose()  # moetune creates it: WAL
    assert _journal(new) == "wal"
    empty = tmp_path / "empty.db"
    empty.touch()
    make_storage(f"sqlite:///{empty}").engine.dispose()
    assert _journal(empty) == "wal"


def test_a_new_storage_file_and_the_default_one_are_wal(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, [*TUNE, "--trials", "2", "--db", str(tmp_path / "m.db"),
                                 "--storage", f"sqlite:///{tmp_path / 'new.db'}"], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    assert _journal(tmp_path / "new.db") == "wal"
    r = CliRunner().invoke(app, [*TUNE, "--trials", "2", "--db", str(tmp_path / "m.db")],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    assert _journal(tmp_path / "m-studies.db") == "wal"  # the default studies file of --db m.db


def test_two_tunes_and_a_reader_share_a_rollback_journal_file(tmp_path: Path) -> None:
    """What WAL gave (a reader beside a writer, two writers on one study) works in rollback-journal mode too: the
    readers and writers wait on the busy timeout instead."""
    users = _users_optuna_file(tmp_path / "optuna.db")
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path)}
    cmd = [sys.executable, "-c", "from moetune.tuner.cli import main; main()"]
    url = f"sqlite:///{users}"
    tunes = [subprocess.Popen([*cmd, *TUNE, "--trials", "30", "--db", str(tmp_path / "m.db"), "--storage", url,
                               "--json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    shows = []
    while any(t.poll() is None for t in tunes):
        shows.append(subprocess.run([*cmd, "tune", "show", "--storage", url, "--json"], env=env,
                                    capture_output=True, text=True, timeout=120))
    for t in tunes:
        _out, errs = t.communicate(timeout=120)
        assert t.returncode == 0, errs
    assert shows and all(s.returncode == 0 for s in shows), [s.stderr for s in shows if s.returncode]
    (summary,) = [s for s in optuna.get_all_study_summaries(url) if s.study_name.startswith("moetune/")]
    assert summary.n_trials >= 30
    assert _journal(users) == "delete"


def test_tune_show_refuses_a_study_that_is_not_moetunes(tmp_path: Path) -> None:
    """`tune show -s mine` on a user's Optuna study labelled its objective values as µs latencies."""
    users = _users_optuna_file(tmp_path / "optuna.db")
    r = CliRunner().invoke(app, ["tune", "show", "--storage", f"sqlite:///{users}", "-s", "mine"],
                           env={"MOETUNE_HOME": str(tmp_path), "COLUMNS": "300"})
    assert r.exit_code == 2, r.output
    assert "'mine' is not a moetune study" in r.stderr and "µs" not in r.output, r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, ["tune", "show", "--storage", f"sqlite:///{users}", "-s", "mine", "--json"],
                           env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 2 and r.stdout == "", r.output
