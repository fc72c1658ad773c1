"""`moetune serve` ends with the statuses the top-level help documents for every command: 130 after Ctrl-C
(SIGINT), 143 after SIGTERM (it exited 0 on both). The systemd unit counts both as success, so `systemctl stop`
(SIGTERM) leaves no failed unit and Restart=on-failure does not restart it."""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.tuner.cli import EXIT_STATUS_HELP

pytestmark = pytest.mark.timeout(90)
UNIT = Path(__file__).resolve().parent.parent / "tuner" / "daemon" / "deploy" / "moetune.service"


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_serve_ends_with_the_documented_status(tmp_path: Path, sig: int, status: int) -> None:
    F.make_capture(tmp_path / "capture")
    d = F.DaemonProc(tmp_path)
    try:
        d.wait_ready()
        d.proc.send_signal(sig)
        assert d.proc.wait(20) == status, d.read_log()[-2000:]
    finally:
        d.kill(9)
    assert not (d.run_dir / "daemon.sock").exists()  # a clean stop all the same
    assert "130 / 143: ended by Ctrl-C / SIGTERM" in EXIT_STATUS_HELP


def test_the_systemd_unit_takes_a_signalled_stop_for_success() -> None:
    lines = [x.strip() for x in UNIT.read_text().splitlines() if not x.lstrip().startswith("#")]
    ok = [x for x in lines if x.startswith("SuccessExitStatus=")]
    assert ok and {"130", "143"} <= set(ok[0].split("=", 1)[1].split())
    assert "Restart=on-failure" in lines


def _unit_statuses(key: str) -> set[str]:
    lines = [x.strip() for x in UNIT.read_text().splitlines() if not x.lstrip().startswith("#")]
    return {v for x in lines if x.startswith(f"{key}=") for v in x.split("=", 1)[1].split()}


def test_the_unit_does_not_restart_a_refused_configuration(tmp_path: Path) -> None:
    """With Restart=on-failure alone a configuration `serve` refuses (exit 2) was started again every RestartSec, for
    ever, failing the same way. That status stops the restarts; a crash (`moetune serve` ended by an uncaught
    exception: 1, Python's status for one) and the other failures (1) are still restarted."""
    import os
    import subprocess

    bad = tmp_path / "moetune.toml"
    bad.write_text("[daemon]\nno_such_key = 1\n")
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
    r = subprocess.run([sys.executable, "-m", "moetune.tuner.cli", "serve", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "no_such_key" in r.stderr, r.stderr[-2000:]
    prevent = _unit_statuses("RestartPreventExitStatus")
    assert str(r.returncode) in prevent
    # a crash: `moetune serve` ended by an exception none of its handling expects (here its store raising a
    # KeyError, as a bug would) exits 1, which the unit restarts
    (tmp_path / "crashing_store.py").write_text("def store(path):\n    raise KeyError('a bug in the store')\n")
    crash_env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)}
    crash = subprocess.run([sys.executable, "-m", "moetune.tuner.cli", "serve", "--db", str(tmp_path / "m.db"),
                            "--socket", f"ipc://{tmp_path / 'run' / 'd.sock'}", "--store-hook", "crashing_store:store"],
                           capture_output=True, text=True, timeout=60, env=crash_env)
    assert "a bug in the store" in crash.stderr, crash.stderr[-2000:]  # the crash, not another failure
    assert crash.returncode == 1 and "1" not in prevent, crash.stderr[-2000:]  # a crash is still restarted
    assert not prevent & _unit_statuses("SuccessExitStatus")
    # an OS error at start that no check of the configuration raised (memory, a device busy for a moment) is said
    # without a traceback and exits 1: it was 2, which the unit takes for a configuration and never restarts
    (tmp_path / "oom_store.py").write_text("import errno\n\ndef store(path):\n"
                                           "    raise OSError(errno.ENOMEM, 'Cannot allocate memory')\n")
    oom = subprocess.run([sys.executable, "-m", "moetune.tuner.cli", "serve", "--db", str(tmp_path / "m.db"),
                          "--socket", f"ipc://{tmp_path / 'run' / 'd.sock'}", "--store-hook", "oom_store:store"],
                         capture_output=True, text=True, timeout=60, env=crash_env)
    assert "Cannot allocate memory" in oom.stderr and "Traceback" not in oom.stderr, oom.stderr[-2000:]
    assert oom.returncode == 1, (oom.returncode, oom.stderr[-2000:])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_daemon_leaves_its_database_whole(tmp_path: Path, sig: int) -> None:
    """The daemon closes its store when it stops: SQLite checkpoints the WAL into the file and removes -wal and -shm.
    Left open, they stayed beside the database, and a copy of moetune.db alone (a backup, another node) lacked what
    the WAL still held."""
    F.make_capture(tmp_path / "capture")
    d = F.DaemonProc(tmp_path)
    try:
        d.wait_ready()
        assert (tmp_path / "moetune.db-wal").exists()  # written while it serves (fingerprint, discovery)
        d.proc.send_signal(sig)
        d.proc.wait(20)
    finally:
        d.kill(9)
    left = sorted(p.name for p in tmp_path.glob("moetune.db-*"))
    assert left == [], (left, d.read_log()[-2000:])


@contextlib.contextmanager
def _retuning_daemon(tmp_path: Path, hook: str, reason: str,
                     env: dict[str, str] | None = None) -> Iterator[tuple[F.DaemonProc, ProfileClient]]:
    """A daemon over a database seeded with three current profiles whose `--retune-hook daemon_fakes:<hook>` runs a
    re-tune of them all, asked for here; killed (9) on the way out, whatever happened."""
    facts = F.make_capture(tmp_path / "capture")
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts)
    store.close()  # the daemon's close is the last one: nothing of this test holds the file
    d = F.DaemonProc(tmp_path, extra=["--retune-hook", f"daemon_fakes:{hook}"], env=env)
    try:
        d.wait_ready()
        c = ProfileClient(d.endpoint, timeout_ms=3000)
        c.retune(all=True, reason=reason)
        yield d, c
    finally:
        d.kill(9)


def test_a_stop_that_outlasts_a_job_leaves_its_store_open(tmp_path: Path) -> None:
    """A re-tune that ignores cancellation outlives stop()'s wait for the job worker (5 s). The store was closed under
    it all the same: the job then wrote through a fresh connection (SQLAlchemy reopens a disposed engine) that the
    exiting process never closed, so the close checkpointed nothing and said nothing. A worker still running keeps the
    store open now, and the log says so; the stop is still clean (143, no traceback) and the job's transaction is
    all or nothing, left `started` for the next daemon to resume."""
    with _retuning_daemon(tmp_path, "retune_past_stop", "outlives the stop", {"MOETUNE_FAKE_JOB_SLEEP": "20"}) as (d, c):
        F.until(lambda: (j := c.status().jobs.running) is not None and j.run_id is not None)
        c.close()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 143, d.read_log()[-3000:]
    log = d.read_log()
    assert "Traceback" not in log, log[-3000:]
    assert "the store was closed while a re-tune job still ran" not in log, log[-3000:]
    assert "leaving the store open" in log and "moetune-jobs" in log, log[-3000:]
    con = sqlite3.connect(f"file:{d.db}?mode=ro", uri=True)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # the seeded profiles alone: none of the job's (its transaction never committed), none half
        assert con.execute("SELECT status, count(*) FROM profiles GROUP BY status").fetchall() == [("current", 3)]
        assert con.execute("SELECT status FROM tuning_runs").fetchall() == [("failed",)]
        kinds = [k for (k,) in con.execute("SELECT kind FROM events WHERE kind LIKE 'job_%' ORDER BY id")]
        assert kinds == ["job_queued", "job_started"]  # no job_finished: the next daemon resumes it
    finally:
        con.close()


def test_a_job_that_commits_past_the_stop_stays_done(tmp_path: Path) -> None:
    """A re-tune holds its write transaction past stop()'s wait for it, then commits and ends `done` (its run row `done`,
    its job_finished written). The stop's finish_run("failed"), queued on the store's lock meanwhile, ran after those
    and overwrote the row: `failed` beside a job_finished that says its profiles were written. The stop's finish_run
    now changes a run only while it is still `running`."""
    with _retuning_daemon(tmp_path, "retune_commits_past_stop", "commits past the stop") as (d, c):
        F.until(lambda: "the re-tune job holds its transaction" in d.read_log())
        c.close()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(40) == 143, d.read_log()[-3000:]
    log = d.read_log()
    assert "Traceback" not in log, log[-3000:]
    assert "the re-tune job committed its profiles" in log, log[-3000:]
    assert "a finish_run of the stop waits for the job worker to end" in log, log[-3000:]  # the order the test makes
    con = sqlite3.connect(f"file:{d.db}?mode=ro", uri=True)
    try:
        kinds = [k for (k,) in con.execute("SELECT kind FROM events WHERE kind LIKE 'job_%' ORDER BY id")]
        assert kinds == ["job_queued", "job_started", "job_finished"]
        assert con.execute("SELECT status FROM tuning_runs").fetchall() == [("done",)]
    finally:
        con.close()


def test_a_stop_does_not_wait_behind_a_jobs_open_transaction(tmp_path: Path) -> None:
    """A re-tune that ignores its cancel keeps its write transaction open (20 s here). SIGTERM waited 5 s for the job
    worker, then the stop's finish_run waited behind that transaction until it ended (~20 s). The stop does not wait
    for a worker holding a transaction now: the exit rolls it back, nothing of the job is stored, the job is left
    `started` (its run `running`) as a kill -9 leaves it, and the next start resumes it."""
    from moetune.tuner.daemon.recovery import recover_jobs

    with _retuning_daemon(tmp_path, "retune_holds_its_transaction", "holds its transaction",
                          {"MOETUNE_FAKE_JOB_SLEEP": "20"}) as (d, c):
        F.until(lambda: "the re-tune job holds its transaction" in d.read_log())
        c.close()
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(40) == 143, d.read_log()[-3000:]
        took = time.monotonic() - t0
    log = d.read_log()
    assert took < 3.0, f"the stop took {took:.1f} s: {log[-3000:]}"
    assert "Traceback" not in log and "committed its profiles" not in log, log[-3000:]
    con = sqlite3.connect(f"file:{d.db}?mode=ro", uri=True)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT status, count(*) FROM profiles GROUP BY status").fetchall() == [("current", 3)]
        kinds = [k for (k,) in con.execute("SELECT kind FROM events WHERE kind LIKE 'job_%' ORDER BY id")]
        assert kinds == ["job_queued", "job_started"]
        assert con.execute("SELECT status FROM tuning_runs").fetchall() == [("running",)]
    finally:
        con.close()
    store = F.open_store(d.db)
    try:
        resume, _ = recover_jobs(store)
        assert [r.job_id for r in resume] == [1] and resume[0].details["keys"]
        assert [r["status"] for r in store.list_runs(limit=5)] == ["failed"]
    finally:
        store.close()
