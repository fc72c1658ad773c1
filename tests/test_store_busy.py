"""A profile database whose write lock another process holds (`BEGIN EXCLUSIVE` in another process). A write that has
waited NOTICE_AFTER_S says once on stderr that another process is writing the database and it is waiting; past the
busy timeout a StoreBusy (exit_code 1) says another process held the database for that long: retry. Not ~31 s of
silence and then `error: …/moetune.db: database is locked` (exit 2), nor tune's "fix the database (or pass another
--db)" when nothing is wrong with the file. The commands here run in a child process with the timeouts shortened
(3 s, notice after 0.5 s)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from moetune.tuner.store import busy_timeout
from moetune.tuner.store import store as store_mod
from moetune.tuner.store.store import Store, StoreBusy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_env import child_env
from store_samples import put_one_profile

pytestmark = pytest.mark.timeout(240)
BUSY_S, NOTICE_S = 3.0, 0.5
WAITING = "another process is writing the database"
HELD = "another process held the database"
# One place holds both (tuner/store/busy_timeout.py): every store module reads them from it at each use.
CLI = ("import moetune.tuner.store.busy_timeout as busy; "
       f"busy.BUSY_TIMEOUT_S = {BUSY_S}; busy.NOTICE_AFTER_S = {NOTICE_S}; "
       "from moetune.tuner.cli import main; main()")


@contextmanager
def locked(db: Path, *, for_s: float | None = None) -> Iterator[None]:
    """Another process holds `db`'s write lock (BEGIN EXCLUSIVE) until the block ends (or for `for_s` seconds)."""
    hold = "sys.stdin.read()" if for_s is None else f"time.sleep({for_s})"
    p = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], "
                          "isolation_level=None); c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); " + hold,
                          str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "locked"
        yield
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=60)


def moetune(*args: str, home: Path, on_node_of: str | None = None) -> subprocess.CompletedProcess:
    """The CLI in a child process; `on_node_of`: a capture whose node the child runs as (its live discovery answers
    that capture's facts), so a bring-up of it measures and records on any machine that runs the suite."""
    cli = CLI
    if on_node_of is not None:
        cli = (f"from moetune.tuner.fabric import discovery; "
               f"discovery.live_facts = lambda timeout_s=1.5: discovery.discover({on_node_of!r}); {CLI}")
    return subprocess.run([sys.executable, "-c", cli, *args], capture_output=True, text=True, timeout=120,
                          env=child_env(MOETUNE_HOME=str(home), COLUMNS="200"))


@pytest.fixture
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(busy_timeout, "BUSY_TIMEOUT_S", BUSY_S)
    monkeypatch.setattr(busy_timeout, "NOTICE_AFTER_S", NOTICE_S)


def test_a_write_says_it_waits_once_then_store_busy(tmp_path: Path, short_waits: None,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "m.db"
    put_one_profile(db)
    store = Store(db)
    with locked(db), caplog.at_level(logging.WARNING, "moetune.store"), pytest.raises(StoreBusy) as e:
        store.delete_profile(1)
    assert e.value.exit_code == 1
    assert str(e.value).startswith(f"{HELD} {db} for 3 s") and "retry" in str(e.value)
    assert [r.getMessage() for r in caplog.records if WAITING in r.getMessage()] == [
        f"{WAITING} {db}: waiting for it (up to 2.5 s more)"]
    assert store.delete_profile(1)  # the lock gone: the same store writes (the busy timeout restored)
    with store.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == 3000


def test_a_lock_released_while_waiting_lets_the_write_through(tmp_path: Path, short_waits: None,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "m.db"
    put_one_profile(db)
    store = Store(db)
    with locked(db, for_s=1.5), caplog.at_level(logging.WARNING, "moetune.store"):
        assert store.delete_profile(1)
    assert sum(WAITING in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("args", [["db", "upgrade"], ["profiles", "delete", "1", "-y"], ["profiles", "import", "EXPORT"]])
def test_commands_say_another_process_holds_it(tmp_path: Path, args: list[str]) -> None:
    db = tmp_path / "m.db"
    put_one_profile(db)
    export = tmp_path / "export.json"
    with Store(db) as s:
        s.export_profiles(export)
    args = [str(export) if a == "EXPORT" else a for a in args]
    with locked(db):
        r = moetune(*args, "--db", str(db), home=tmp_path)
    assert r.returncode == 1, r.stderr  # a failure, not bad input (db.py: StoreError.exit_code)
    assert r.stderr.count(WAITING) == 1, r.stderr
    assert HELD in r.stderr and "database is locked" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_profiles_delete_on_a_held_database_exits_1(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    put_one_profile(db)
    with locked(db):
        r = moetune("profiles", "delete", "1", "-y", "--db", str(db), home=tmp_path)
    assert r.returncode == 1, r.stderr


def test_tune_on_a_held_database_exits_1_and_does_not_say_fix_it(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    put_one_profile(db)
    with locked(db):
        r = moetune("tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "2", "--tokens", "128",
                    "--db", str(db), "--json", home=tmp_path)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count(WAITING) == 1 and HELD in r.stderr, r.stderr
    assert "fix the database" not in r.stderr and "Traceback" not in r.stderr
    r = moetune("tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "2", "--tokens", "128",
                "--db", str(db), "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr  # the lock gone, the same command works
    assert json.loads(r.stdout)[0]["stored"] == "new"


CAPTURE = str(Path(__file__).parent / "captures" / "cpu-laptop")


@pytest.mark.parametrize("args", [["fabric", "show", "--record", "--from", CAPTURE],
                                  ["profile", "--quick", "--capture", CAPTURE]])
def test_fabric_record_and_profile_on_a_held_database_exit_1(tmp_path: Path, args: list[str]) -> None:
    """fabric show --record printed the waiting line, then a traceback; profile exited 2 ("bad input"). Run as on the
    capture's node: a bring-up of another node's capture records nothing (it would not touch the held database; run
    203 on an H100 exited 0 there)."""
    db = tmp_path / "m.db"
    put_one_profile(db)
    with locked(db):
        r = moetune(*args, "--db", str(db), home=tmp_path, on_node_of=CAPTURE)
    assert r.returncode == 1, r.stderr
    assert HELD in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("error", ["busy", "not_writable", "bad"])
def test_fabric_and_profile_open_errors_keep_the_store_errors_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     error: str) -> None:
    """Opening the store: a StoreBusy / StoreNotWritable exits 1, another StoreError 2 (both always exited 2)."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app
    from moetune.tuner.store.store import StoreError, StoreNotWritable

    exc = {"busy": StoreBusy, "not_writable": StoreNotWritable, "bad": StoreError}[error]

    class Refuse:  # Store() and Store.open_existing() alike (the commands open it either way)
        def __init__(self, *_a: object, **_k: object) -> None:
            raise exc("the database says no")

        @classmethod
        def open_existing(cls, *_a: object, **_k: object) -> None:
            raise exc("the database says no")

    monkeypatch.setattr(store_mod, "Store", Refuse)
    from moetune.tuner.fabric import discovery

    # the capture stands for this node: on a GPU machine the laptop's capture is another node's, whose bring-up opens
    # no database (a throwaway in-memory store, which this Refuse would refuse too)
    monkeypatch.setattr(discovery, "capture_not_this_node", lambda facts, capture: "")
    db = tmp_path / "m.db"
    db.touch()  # there: fabric diff says of a missing database itself that there is nothing to compare with
    for args in (["fabric", "show", "--record", "--from", CAPTURE], ["fabric", "diff", "--from", CAPTURE],
                 ["profile", "--quick", "--capture", CAPTURE]):
        r = CliRunner().invoke(app, [*args, "--db", str(db)], env={"MOETUNE_CONFIG": "", "MOETUNE_HOME": str(tmp_path)})
        assert isinstance(r.exception, SystemExit), repr(r.exception)
        assert r.exit_code == exc.exit_code, (args, r.output)
        assert "the database says no" in r.output


def test_stop_waiting_gives_a_waiting_write_up_at_once(tmp_path: Path) -> None:
    """SQLite's own busy wait cannot be interrupted (sqlite3_interrupt does not end it): a stopping daemon waited behind
    another process's transaction for up to the busy timeout. The store waits in slices now, and `stop_waiting` ends
    a waiting write within one: StoreStopping (a StoreBusy), nothing written; a write whose lock is free still goes."""
    import threading
    import time

    from moetune.tuner.store import StoreStopping

    db = tmp_path / "m.db"
    put_one_profile(db)
    store = Store(db)
    timer = threading.Timer(0.5, store.stop_waiting)
    with locked(db):
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(StoreStopping) as e:
            store.delete_profile(1)  # waits on the lock (30 s busy timeout) until stop_waiting
        assert time.monotonic() - t0 < 2.0
        assert isinstance(e.value, StoreBusy) and "stopping" in str(e.value)
    assert store.delete_profile(1)  # it was not deleted; the lock free, a write goes through
    store.close()


def test_write_open_s_counts_a_held_transaction_only(tmp_path: Path) -> None:
    """What a stopping daemon asks of its job worker: how long its write transaction has held the lock (None outside
    one, and while a write still waits for the lock: that wait `stop_waiting` ends)."""
    import threading

    db = tmp_path / "m.db"
    put_one_profile(db)
    store = Store(db)
    me = threading.get_ident()
    assert store.write_open_s(me) is None
    with store.atomic():
        store.add_event(kind="job_queued", reason="r", details={})
        held = store.write_open_s(me)
        assert held is not None and held >= 0
    assert store.write_open_s(me) is None
    store.close()
