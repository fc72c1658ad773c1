"""Another process holds the database's write lock (an import, a tune) while the daemon runs: a `retune`, answered
only once its job_queued is committed, waits for it; list requests do not wait behind that retune; `moetune
retune` waits longer than the store's busy timeout and, when it does time out, says the job may still have been
queued; stop() neither waits out the other process's transaction nor leaves a worker dying with a traceback."""

from __future__ import annotations

import logging
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(90)


def _daemon(tmp_path: Path, retune: Any) -> Daemon:
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts)
    store.mark_stale(fingerprint=facts.fingerprint, reason="x")
    return Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=lambda: facts,
                  rediscover_interval_s=0, retune_job=retune).start(background=True)


def _lock(db: Path, seconds: float) -> threading.Thread:
    """Hold the database's write lock for `seconds` from another connection (returns once it is held)."""
    held = threading.Event()

    def hold() -> None:
        c = sqlite3.connect(db, timeout=30)
        c.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(seconds)
        c.rollback()
        c.close()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert held.wait(10)
    return t


def test_list_requests_do_not_wait_behind_a_retune_waiting_on_the_store(tmp_path: Path) -> None:
    """The retune is answered once the lock is gone (its job committed); a list_profiles sent while it waits is
    answered at once, not queued behind it."""
    hold = threading.Event()
    d = _daemon(tmp_path, lambda ctx: hold.wait(30) and [])
    try:
        locker = _lock(tmp_path / "moetune.db", 4)
        got: dict[str, Any] = {}

        def retune() -> None:
            c = ProfileClient(d.endpoint, timeout_ms=20000)
            got["retune"] = c.request("retune", reason="r")
            c.close()

        rt = threading.Thread(target=retune)
        rt.start()
        time.sleep(0.3)  # the retune is with its worker, waiting for the lock
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        t0 = time.monotonic()
        page = c.list_profiles(status="all")
        assert time.monotonic() - t0 < 1.5 and len(page.profiles) == 3
        rt.join(20)
        locker.join()
        assert got["retune"].job is not None  # answered ok once committed: the job is the daemon's
        st = c.status().jobs
        assert [j.id for j in ([st.running] if st.running else []) + st.queued] == [got["retune"].job.id]
        c.close()
    finally:
        hold.set()
        d.stop()


def test_moetune_retune_waits_longer_than_the_store_and_says_a_timed_out_job_may_be_queued(tmp_path: Path) -> None:
    from moetune.tuner.cli import app
    from moetune.tuner.cli.serve import RETUNE_TIMEOUT_MS
    from moetune.tuner.store.busy_timeout import BUSY_TIMEOUT_S

    assert RETUNE_TIMEOUT_MS > BUSY_TIMEOUT_S * 1000
    r = CliRunner().invoke(app, ["retune", "--help"])
    assert str(RETUNE_TIMEOUT_MS) in r.output.replace(",", "").replace("_", "")

    hold = threading.Event()
    d = _daemon(tmp_path, lambda ctx: hold.wait(30) and [])
    try:
        locker = _lock(tmp_path / "moetune.db", 3)
        r = CliRunner().invoke(app, ["retune", "--socket", d.endpoint, "--timeout-ms", "500"])
        assert r.exit_code == 1
        assert "may still have been queued" in r.output and "moetune status" in r.output, r.output
        locker.join()
        c = ProfileClient(d.endpoint, timeout_ms=3000)
        assert F.until(lambda: (lambda j: j.running or j.queued)(c.status().jobs))  # it was queued indeed
        c.close()
    finally:
        hold.set()
        d.stop()


def test_stop_while_retunes_wait_on_the_store_is_prompt_and_clean(tmp_path: Path) -> None:
    """Ten retunes queued behind a locked database: stop() returns promptly, and the worker that waited on the
    store ends without a traceback once the lock goes."""
    died: list[Any] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: died.append(a)
    try:
        d = _daemon(tmp_path, lambda ctx: [])
        locker = _lock(tmp_path / "moetune.db", 5)
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(d.endpoint)
        for i in range(10):
            s.send(b'{"v":1,"id":%d,"op":"retune","all":true,"reason":"r"}' % (i + 1))
        time.sleep(0.5)
        t0 = time.monotonic()
        d.stop()
        assert time.monotonic() - t0 < 4, f"stop took {time.monotonic() - t0:.1f} s"
        locker.join()
        for t in d._workers:
            t.join(10)
        time.sleep(0.3)
        assert not died, [f"{a.thread.name}: {a.exc_type.__name__}: {a.exc_value}" for a in died]
        s.close()
        ctx.term()
    finally:
        threading.excepthook = old_hook


def test_stop_while_the_running_jobs_write_waits_on_the_store_is_prompt_and_the_job_resumed(tmp_path: Path) -> None:
    """The running job's profile write waits for another process's write lock (a tune, an import) when the daemon
    stops. The stop waited 5 s for the job worker, then its own finish_run waited behind the same lock (up to the
    busy timeout, 30 s): ~25 s here. The stop now gives the job's wait up: the job ends interrupted with nothing of
    it written, left `started` (its run `running`) as a crash leaves it, and the next start resumes it whole."""
    from moetune.tuner.daemon.recovery import recover_jobs

    db = tmp_path / "moetune.db"
    go, started, release = threading.Event(), threading.Event(), threading.Event()

    def retune(ctx: Any) -> list:
        started.set()
        go.wait(30)  # its trial ends: then it writes its profiles
        return [F._put_nvlink_profile(ctx, k) for k in ctx.keys]

    d = _daemon(tmp_path, retune)
    held = threading.Event()

    def hold() -> None:  # another writer, holding the lock until released (at most 20 s)
        c = sqlite3.connect(db, timeout=30)
        c.execute("BEGIN IMMEDIATE")
        held.set()
        release.wait(20)
        c.rollback()
        c.close()

    locker = threading.Thread(target=hold, daemon=True)
    try:
        c = ProfileClient(d.endpoint, timeout_ms=5000)
        c.retune(all=True, reason="r")
        c.close()
        assert started.wait(10)
        locker.start()
        assert held.wait(10)
        go.set()
        time.sleep(0.5)  # its first write waits on the lock
        t0 = time.monotonic()
        d.stop()
        took = time.monotonic() - t0
        assert took < 2.0, f"stop took {took:.1f} s"
    finally:
        go.set()
        release.set()
        d.stop()
    locker.join(10)
    assert d.store_users() == []  # the job worker ended (interrupted), not left behind on the lock
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT status, count(*) FROM profiles GROUP BY status").fetchall() == [("stale", 3)]
        kinds = [k for (k,) in con.execute("SELECT kind FROM events WHERE kind LIKE 'job_%' ORDER BY id")]
        assert kinds == ["job_queued", "job_started"]  # no job_finished: the next start resumes it
        assert con.execute("SELECT status FROM tuning_runs").fetchall() == [("running",)]
    finally:
        con.close()
    store = F.open_store(db)
    try:
        resume, _ = recover_jobs(store)
        assert [(r.job_id, len(r.details["keys"])) for r in resume] == [(1, 3)]
        assert [r["status"] for r in store.list_runs(limit=5)] == ["failed"]
    finally:
        store.close()


def test_a_discovery_round_given_up_by_the_stop_logs_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """The daemon's stop makes a write waiting for another process's lock raise StoreStopping (Store.stop_waiting). A
    discovery round writing then (its facts, a fabric change) went to the loop's broad handler: "discovery round
    failed" with a traceback on `moetune serve`'s stderr at every such stop. It is said plainly, and the loop ends."""
    from types import SimpleNamespace

    from moetune.tuner.daemon.watch import FabricWatch
    from moetune.tuner.store import StoreStopping

    rounds: list[int] = []

    def rediscover() -> None:
        rounds.append(1)
        raise StoreStopping("the database x is locked by another writer and this process is stopping")

    stop = threading.Event()  # never set: the loop ends on its own
    fake = SimpleNamespace(_stop=stop, interval=0.01, rediscover=rediscover, _last_discovery=None)
    with caplog.at_level(logging.INFO, logger="moetune.daemon"):
        t = threading.Thread(target=FabricWatch._discovery_loop, args=(fake,), daemon=True)
        t.start()
        t.join(5)
    assert not t.is_alive() and rounds == [1]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
    assert "discovery round not recorded" in caplog.text
