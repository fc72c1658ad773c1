"""`moetune serve`'s log at start: a database it migrates to head (e.g. after `db downgrade 0004`) gets one info line
naming both revisions (it was migrated silently); a start that is refused logs no "stopped" (nothing was served:
the error says why)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.server import Daemon
from moetune.tuner.store.store import Store, head_revision

pytestmark = pytest.mark.timeout(60)


def _lines(log: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_serve_logs_the_migration_of_a_rolled_back_database(tmp_path: Path) -> None:
    F.make_capture(tmp_path / "capture")
    with Store(tmp_path / "moetune.db") as s:
        s.downgrade("0004")
    d = F.DaemonProc(tmp_path)
    try:
        d.wait_ready()
    finally:
        d.kill(15)
    lines = _lines(d.read_log())
    migrated = [x for x in lines if x.get("msg") == "database migrated"]
    assert migrated == [{**migrated[0], "db": str(d.db), "from_revision": "0004", "to_revision": head_revision()}]
    assert migrated[0]["level"] == "info"
    assert [x["msg"] for x in lines].index("database migrated") < [x["msg"] for x in lines].index("serving")
    # at head already: no line
    d = F.DaemonProc(tmp_path)
    try:
        d.wait_ready()
    finally:
        d.kill(15)
    assert sum(x.get("msg") == "database migrated" for x in _lines(d.read_log())) == 1  # the first run's only


def test_a_new_database_is_said_to_be_created(tmp_path: Path) -> None:
    F.make_capture(tmp_path / "capture")
    d = F.DaemonProc(tmp_path)
    try:
        d.wait_ready()
    finally:
        d.kill(15)
    made = [x for x in _lines(d.read_log()) if x.get("msg") == "created moetune's tables"]
    assert len(made) == 1 and made[0]["to_revision"] == head_revision()
    assert not any(x.get("msg") == "database migrated" for x in _lines(d.read_log()))


def test_a_refused_start_logs_no_stopped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "daemon.sock").write_text("not a socket")  # the bind is refused
    facts = F.FakeFacts({"gpu_model": "H200"})
    d = Daemon(store=F.open_store(tmp_path / "moetune.db"), discover=lambda: facts, rediscover_interval_s=0,
               endpoint=f"ipc://{run}/daemon.sock")
    with caplog.at_level(logging.DEBUG, logger="moetune.daemon"), \
            pytest.raises(DaemonConfigError, match="exists and is not a socket"):
        d.start()
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "moetune.daemon"]
    assert not any(m == "stopped" for _, m in msgs), msgs
    assert (logging.DEBUG, "start refused: closed what it had opened") in msgs
    # a daemon that served still says it stopped
    (run / "daemon.sock").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moetune.daemon"):
        d2 = Daemon(store=F.open_store(tmp_path / "moetune.db"), discover=lambda: facts, rediscover_interval_s=0,
                    endpoint=f"ipc://{run}/daemon.sock").start(background=True)
        d2.stop()
    assert "stopped" in [r.getMessage() for r in caplog.records if r.name == "moetune.daemon"]


def test_a_db_given_with_a_tilde_is_the_expanded_one(tmp_path: Path) -> None:
    """--db '~/t.db' (as a config file may give it): the migration line, the lock and daemon.json name the file the
    store opened; the lock beside '~/t.db' taken literally failed ('cannot open the database lock')."""
    F.make_capture(tmp_path / "capture")
    home = tmp_path / "home-dir"
    home.mkdir()
    with Store(home / "t.db") as s:
        s.downgrade("0004")
    d = F.DaemonProc(tmp_path, extra=["--db", "~/t.db"], env={"HOME": str(home)})
    try:
        d.wait_ready()
        assert json.loads((d.run_dir / "daemon.json").read_text())["db"] == str(home / "t.db")
    finally:
        d.kill(15)
    migrated = [x for x in _lines(d.read_log()) if x.get("msg") == "database migrated"]
    assert [(x["db"], x["from_revision"]) for x in migrated] == [(str(home / "t.db"), "0004")], d.read_log()
    assert (home / "t.db.daemon-lock").exists()
