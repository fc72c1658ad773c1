"""kill -9 of the daemon during a re-tune job, then restart: the database is intact, the interrupted job is
marked failed and resumed, and the resumed job produces the current profiles."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient

pytestmark = pytest.mark.timeout(60)




def test_kill9_during_job_then_restart(tmp_path: Path) -> None:
    with F.seeded_daemon(tmp_path, interval=0.2, env={"MOETUNE_FAKE_JOB_SLEEP": "60"}) as (d, _facts):
        c = ProfileClient(d.endpoint, timeout_ms=1000)
        new_facts = F.set_port_state(tmp_path / "capture", "1: DOWN")
        # running, with its tuning run and job_started event persisted (run_id is shown only then)
        running = F.until(lambda: (j := c.status().jobs.running) is not None and j.run_id is not None and j)
        assert running.fingerprint == new_facts.fingerprint and running.keys == 3
        # while the re-tune runs the stale profile is not served as current
        from moetune.runtime.profiles.errors import DaemonError

        with pytest.raises(DaemonError) as ei:
            c.get_profile(ep_size=2, tokens=3000, model="qwen3-30b")
        assert ei.value.code == "not_found"
        assert c.status().profiles_stale == 3
        c.close()
        d.kill(9)  # no chance to clean up
    assert (d.run_dir / "daemon.sock").exists()  # left behind by kill -9

    con = sqlite3.connect(f"file:{d.db}?mode=ro", uri=True)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert con.execute("SELECT status FROM tuning_runs WHERE id = ?", (running.run_id,)).fetchone()[0] == "running"
    con.close()

    d2 = F.DaemonProc(tmp_path, interval=0.2, env={"MOETUNE_FAKE_JOB_SLEEP": "0"})
    try:
        d2.wait_ready()  # the stale socket file is replaced
        c = ProfileClient(d2.endpoint, timeout_ms=1000)

        def resumed_done():
            st = c.status()
            return [j for j in st.jobs.recent if j.state == "done"]

        done = F.until(resumed_done)
        assert "resumed job" in done[0].reason and done[0].written == 3
        prof = c.get_profile(ep_size=2, tokens=3000, model="qwen3-30b")
        assert prof.key.fingerprint == new_facts.fingerprint and prof.status == "current"
        c.close()
    finally:
        d2.kill()
    con = sqlite3.connect(f"file:{d.db}?mode=ro", uri=True)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert con.execute("SELECT status FROM tuning_runs WHERE id = ?", (running.run_id,)).fetchone()[0] == "failed"
    assert con.execute("SELECT count(*) FROM tuning_runs WHERE status = 'running'").fetchone()[0] == 0
    con.close()
    store = F.open_store(d.db)
    finished = [e for e in store.list_events(limit=200) if e["kind"] == "job_finished"]
    states = {(e["details"]["job_id"], e["details"]["state"]) for e in finished}
    assert (running.id, "failed") in states
    assert any(s == "done" for _, s in states)


def test_cancel_running_job_and_bounded_queue(tmp_path: Path) -> None:
    from moetune.runtime.profiles.errors import DaemonError

    with F.seeded_daemon(tmp_path, interval=0.2, env={"MOETUNE_FAKE_JOB_SLEEP": "60"}) as (d, _facts):
        c = ProfileClient(d.endpoint, timeout_ms=1000)
        F.set_port_state(tmp_path / "capture", "1: DOWN")
        running = F.until(lambda: c.status().jobs.running)
        # the queue is bounded (4): the 5th queued job is refused with `busy`, the daemon keeps answering
        queued = []
        with pytest.raises(DaemonError) as ei:
            for _ in range(10):
                queued.append(c.retune(all=True, reason="load").job)
        assert ei.value.code == "busy" and len(queued) == 4
        assert c.hello().protocol == 1
        # cancel a queued job and the running one
        assert c.retune(cancel=queued[0].id).job.id == queued[0].id
        c.retune(cancel=running.id)

        def cancelled():
            recent = {j.id: j.state for j in c.status().jobs.recent}
            return recent.get(running.id) == "cancelled" and recent.get(queued[0].id) == "cancelled"

        F.until(cancelled)
        for j in queued[1:]:
            c.retune(cancel=j.id)
        c.close()


def test_second_daemon_refused_same_socket_or_same_database(tmp_path: Path) -> None:
    F.make_capture(tmp_path / "capture")
    d = F.DaemonProc(tmp_path, interval=0)
    try:
        d.wait_ready()
        # same socket, another database
        other = tmp_path / "second"
        other.mkdir()
        F.make_capture(other / "capture")
        d2 = F.DaemonProc(other, endpoint=d.endpoint, interval=0)
        try:
            assert d2.proc.wait(20) == 1  # busy (as the database case), not a wrong configuration (2)
            assert "another daemon is listening" in d2.read_log()
        finally:
            d2.kill()
        # same database (the single writer), another socket
        d3 = F.DaemonProc(tmp_path, endpoint=f"ipc://{tmp_path}/run2/daemon.sock", interval=0)
        try:
            assert d3.proc.wait(20) == 1  # held by another process (as a StoreBusy), not a wrong configuration (2)
            assert "another moetune daemon is using the database" in d3.read_log()
        finally:
            d3.kill()
        # the same through `moetune serve`
        import os
        import subprocess
        import sys

        env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
        r = subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "serve",
                            "--db", str(d.db), "--socket", f"ipc://{tmp_path}/run3/daemon.sock",
                            "--capture", str(tmp_path / "capture")], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 1, r.stderr
        assert "another moetune daemon is using the database" in r.stderr and "Traceback" not in r.stderr
        assert d.wait_ready().protocol == 1  # the first one is untouched
    finally:
        d.kill()
