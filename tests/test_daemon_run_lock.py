"""The daemon and a measuring run share the database's run lock (tuner/store/lock_files.py).

`moetune profile` and `moetune tune --backend local` refuse a database a daemon serves, but a daemon started while
one of them ran served and re-tuned beside it: both measured on the node's GPUs and wrote profiles into one database.
The daemon now holds the run lock while it serves: started beside a bring-up it refuses (exit 1, naming the bring-up's
pid, the database not opened); a bring-up killed (kill -9) leaves nothing that blocks it; a run started beside a
serving daemon is refused, and a daemon that stops leaves no lock file behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon.errors import DaemonBusy
from moetune.tuner.daemon.server import Daemon
from moetune.tuner.store.lock_files import RunBusy, release_run_lock, run_lock_path, take_run_lock

pytestmark = pytest.mark.timeout(90)

HOLD = """
import sys, time
from moetune.tuner.store.lock_files import take_run_lock
fd = take_run_lock(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def _bring_up(db: Path) -> subprocess.Popen:
    """A process holding the run lock of `db`, as a running `moetune profile` does."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_serve_refuses_while_a_bring_up_runs_and_starts_once_it_is_killed(tmp_path: Path) -> None:
    F.make_capture(tmp_path / "capture")
    db = tmp_path / "moetune.db"
    holder = _bring_up(db)
    try:
        d = F.DaemonProc(tmp_path, interval=0)
        try:
            assert d.proc.wait(30) == 1  # busy, as for another daemon on the database: not a configuration error
        finally:
            d.kill()
        log = " ".join(d.read_log().split())
        assert (f"a bring-up is running on the database {db} (pid {holder.pid}: `moetune profile` or `moetune tune "
                "--backend local`); start the daemon once it has ended") in log, log
        assert "Traceback" not in log
        assert not db.exists()  # refused before the store opened: nothing created, migrated or re-tuned
        assert not (tmp_path / "run" / "daemon.sock").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the bring-up was killed (-9): its lock blocks nothing
    d = F.DaemonProc(tmp_path, interval=0)
    try:
        d.wait_ready()
        # while it serves, it holds the run lock: a bring-up that got past the daemon check is refused by it
        with pytest.raises(RunBusy) as e:
            take_run_lock(db)
        assert e.value.pid == d.proc.pid
    finally:
        d.kill(15)
    assert d.proc.returncode == 143  # SIGTERM
    assert not run_lock_path(db).exists()  # a daemon that stopped leaves no lock file beside the database
    fd = take_run_lock(db)
    assert fd is not None
    release_run_lock(db, fd)


def test_a_daemon_start_beside_a_bring_up_is_refused_and_closes_what_it_opened(tmp_path: Path) -> None:
    """Daemon.start (the --store-hook path: the store opened by the hook) takes the run lock after the database
    lock; refused, it releases the database lock and binds nothing."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    db = tmp_path / "moetune.db"
    facts = F.FakeFacts({"gpu_model": "H200"})
    fd = take_run_lock(db)  # another open file: flock locks per open file, so this process holds it as a bring-up
    assert fd is not None
    try:
        d = Daemon(store=F.open_store(db), discover=lambda: facts, rediscover_interval_s=0,
                   endpoint=f"ipc://{run}/daemon.sock")
        with pytest.raises(DaemonBusy, match=f"a bring-up is running on the database {db} \\(pid {os.getpid()}"):
            d.start()
        assert not (run / "daemon.sock").exists()
    finally:
        release_run_lock(db, fd)
    d = Daemon(store=F.open_store(db), discover=lambda: facts, rediscover_interval_s=0,
               endpoint=f"ipc://{run}/daemon.sock").start(background=True)  # the database lock was released too
    try:
        with pytest.raises(RunBusy):
            take_run_lock(db)
    finally:
        d.stop()
    assert not run_lock_path(db).exists()


def test_a_profile_that_meets_the_daemons_run_lock_says_a_daemon_serves(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that started between the bring-up's daemon check and its run lock holds the run lock: the refusal
    names the daemon (stop it, or `moetune retune`), not "another bring-up"."""
    from moetune.tuner.bringup import flow
    from moetune.tuner.cli import app
    from moetune.tuner.cli import db as cli_db

    ran: list[Any] = []
    monkeypatch.setattr(flow.Bringup, "run", lambda self: ran.append(self) or {})
    from moetune.tuner.fabric import discovery

    # the capture stands for this node (another node's capture measures nothing: no lock, no database)
    monkeypatch.setattr(discovery, "capture_not_this_node", lambda facts, capture: "")
    db = tmp_path / "m.db"
    answers = iter([None])  # the first check finds no daemon; the daemon starts right after it
    monkeypatch.setattr(cli_db, "serving_daemon", lambda path: next(answers, os.getpid()))
    fd = take_run_lock(db)  # the daemon's run lock
    try:
        r = CliRunner().invoke(app, ["profile", "--capture", str(Path(__file__).parent / "captures" / "h200x1"),
                                     "--db", str(db)], env={"COLUMNS": "400", "MOETUNE_HOME": str(tmp_path)})
    finally:
        release_run_lock(db, fd)
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and f"daemon pid {os.getpid()} is serving this database ({db}); stop it first" in said, said
    assert ran == [] and not db.exists()
