"""One measuring run per database, and none under a serving daemon.

Two `profile --quick` 3 s apart both ran every stage and exited 0 (microbenchmarks stored twice, each study got the
trials of both, both measured while competing for the cores); a `tune` beside a `profile` competed the same way.
The second run now refuses at once (exit 1, naming the holder's pid), through a flock beside the database that the
kernel drops when its holder dies (kill -9 included). `profile` under a serving daemon wrote behind the single
writer's back: refused, before the database is opened.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bringup_fakes import CAPTURES, fake_bringup_run, profile_cli

HOLD = """
import sys, time
from moetune.tuner.cli._run_lock import take_run_lock
fd = take_run_lock(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def _holder(db: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    return fake_bringup_run(monkeypatch)


_profile = profile_cli


def test_a_second_profile_refuses_while_one_runs_and_runs_once_it_is_killed(tmp_path: Path,
                                                                           fake_run: list[Any]) -> None:
    db = tmp_path / "m.db"
    holder = _holder(db)
    try:
        r = _profile(db, tmp_path)
        said = " ".join(r.output.split())
        assert r.exit_code == 1, said
        assert (f"another bring-up is running on this database (pid {holder.pid}); wait for it or stop it"
                in said), said
        assert fake_run == [] and not db.exists()  # refused before any stage, before the database was made
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # kill -9 left no stale lock: the next run runs
    r = _profile(db, tmp_path)
    assert r.exit_code == 0, r.output
    assert len(fake_run) == 1
    # and released it when it ended: a third run in the same process runs too
    r = _profile(db, tmp_path)
    assert r.exit_code == 0, r.output
    assert len(fake_run) == 2


def test_a_link_to_the_database_takes_the_same_lock(tmp_path: Path, fake_run: list[Any]) -> None:
    db = tmp_path / "m.db"
    db.touch()
    link = tmp_path / "link.db"
    link.symlink_to(db)
    holder = _holder(db)
    try:
        r = _profile(link, tmp_path)
        assert r.exit_code == 1 and "another bring-up is running" in r.output, r.output
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_local_tune_refuses_while_a_bring_up_runs_and_a_model_tune_does_not(tmp_path: Path) -> None:
    """A local tune measures as a bring-up does: one at a time per database. A model tune measures nothing: workers
    of one shared study may run side by side on one database (tests/test_tune_storage_journal.py)."""
    import torch

    from moetune.tuner.cli import app

    db = tmp_path / "m.db"
    common = ["tune", "--model", "qwen3-30b", "--tokens", "128", "--trials", "1", "--db", str(db), "--json"]
    # a local tune this node accepts up to the lock: gloo ranks without a GPU, NCCL ranks with 2, the megakernel with 1
    here = ["--family", "megakernel", "--ep-size", "1"] if torch.cuda.device_count() == 1 else []
    holder = _holder(db)
    try:
        r = CliRunner().invoke(app, [*common, "--backend", "local", *here], env={"MOETUNE_HOME": str(tmp_path)})
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and f"another bring-up is running on this database (pid {holder.pid})" in said, said
        assert not db.exists()
        r = CliRunner().invoke(app, [*common, "--backend", "model", "--preset", "nvlink-h200x2"],
                               env={"MOETUNE_HOME": str(tmp_path)})
        assert r.exit_code == 0, r.output
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_profile_refuses_a_database_a_daemon_serves(tmp_path: Path, fake_run: list[Any]) -> None:
    """The daemon is the single writer of its database: a bring-up under it wrote behind its back (exit 0)."""
    from moetune.tuner.store.db_file import daemon_lock_path

    db = tmp_path / "m.db"
    fd = os.open(daemon_lock_path(db), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held as a serving daemon holds it, its pid inside
        os.write(fd, f"{os.getpid()}\n".encode())
        r = _profile(db, tmp_path)
        said = " ".join(r.output.split())
        assert r.exit_code == 1, said
        assert f"daemon pid {os.getpid()} is serving this database ({db}); stop it first" in said, said
        assert fake_run == [] and not db.exists()
    finally:
        os.close(fd)
    time.sleep(0)  # the daemon stopped: the bring-up runs
    r = _profile(db, tmp_path)
    assert r.exit_code == 0, r.output


def test_tune_refuses_a_database_a_daemon_serves(tmp_path: Path) -> None:
    """As `profile`: a tune under a serving daemon wrote its profiles behind the daemon's back (exit 0)."""
    from moetune.tuner.cli import app
    from moetune.tuner.store.db_file import daemon_lock_path

    db = tmp_path / "m.db"
    args = ["tune", "-m", "qwen3-30b", "--backend", "model", "--preset", "nvlink-h200x2", "--trials", "1",
            "--tokens", "128", "--db", str(db)]
    fd = os.open(daemon_lock_path(db), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        r = CliRunner().invoke(app, args, env={"MOETUNE_HOME": str(tmp_path)})
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and f"daemon pid {os.getpid()} is serving this database ({db}); stop it first" in said, said
        assert not db.exists()
    finally:
        os.close(fd)
    r = CliRunner().invoke(app, args, env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output


def test_a_first_profile_in_a_missing_data_folder_holds_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  fake_run: list[Any]) -> None:
    # the default database in moetune's own data folder, not made yet: the lock file could not be opened there, and
    # the run went on unlocked (the store then made the folder): a daemon or a second bring-up was not refused
    from moetune.tuner.cli import app
    from moetune.tuner.store.lock_files import run_lock_path

    home = tmp_path / "home"
    db = home / "moetune.db"
    locked: list[bool] = []

    from moetune.tuner.bringup import flow

    def run(self: Any) -> dict:
        fd = os.open(run_lock_path(db), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked.append(False)
        except OSError:
            locked.append(True)
        finally:
            os.close(fd)
        return {"calibrate": {}, "compare": [], "report": "r.md"}

    monkeypatch.setattr(flow.Bringup, "run", run)
    monkeypatch.setenv("MOETUNE_HOME", str(home))
    r = CliRunner().invoke(app, ["profile", "--capture", str(CAPTURES / "h200x1")],
                           env={"COLUMNS": "400", "MOETUNE_HOME": str(home)})
    assert r.exit_code == 0, r.output
    assert locked == [True]
    assert home.is_dir()


def test_a_profile_in_a_missing_folder_of_its_own_is_refused_not_unlocked(tmp_path: Path,
                                                                          fake_run: list[Any]) -> None:
    # not moetune's folder: nothing is created, and the store's refusal is what the user reads (no traceback)
    db = tmp_path / "typo" / "m.db"
    r = _profile(db, tmp_path)
    said = " ".join(r.output.split())
    assert r.exit_code == 2, said
    assert "the folder" in said and "does not exist" in said, said
    assert "Traceback" not in said and (r.exception is None or isinstance(r.exception, SystemExit)), said
    assert fake_run == [] and not db.parent.exists()
