"""A damaged database file (a page of profile rows overwritten, which opening it does not read): `moetune tune`,
`moetune profile` and `moetune serve` refuse it when they open it, before anything is measured or served (one clear
line naming the file and `moetune db check`, exit 2, not a byte written), as `profiles import` does, rather than
measure and then write their rows into it, or serve from it. A daemon's re-tune job on a file
damaged after the daemon started ends failed with that reason, nothing measured or written, and the worker lives.
`moetune db upgrade` and `db downgrade` refuse it too, before a migration step writes (a damaged page the migration
does not read let it migrate the file, exit 0), while `moetune db check` still reports it; `profiles delete` and
`fabric show --record` refuse it as they did."""

from __future__ import annotations

import shutil
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
from test_store_damaged_file import PAGE, damaged_copy, databases

from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, StoreDamaged

pytestmark = pytest.mark.timeout(120)
CAPTURES = Path(__file__).resolve().parent / "captures"


@pytest.fixture
def damaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, bytes]:
    """A damaged database (and its bytes), with no config but the test's."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MOETUNE_CONFIG", raising=False)
    good, _other = databases(tmp_path)
    bad = damaged_copy(good)
    with Store(bad, upgrade=False) as s:  # the damage is not where an open looks: only the scan finds it
        assert s.current_revision() is not None
        with pytest.raises(StoreDamaged):
            s.refuse_damaged()
    return bad, bad.read_bytes()


def _refused(r: Any, bad: Path, before: bytes) -> None:
    assert r.exit_code == 2, (r.exception, r.output)
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    text = " ".join(r.output.split())
    assert f"{bad} is damaged" in text and "db check" in text and "backup" in text, text
    assert bad.read_bytes() == before  # not a byte written


def test_tune_refuses_a_damaged_database_before_any_trial(damaged: tuple[Path, bytes],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.search import tune

    bad, before = damaged
    monkeypatch.setattr(tune, "tune_profiles_detailed", lambda *a, **kw: pytest.fail("the tune ran"))
    r = CliRunner().invoke(app, ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "2",
                                 "--tokens", "128", "--db", str(bad)])
    _refused(r, bad, before)


def test_profile_refuses_a_damaged_database_before_any_stage(damaged: tuple[Path, bytes],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow

    bad, before = damaged
    from moetune.tuner.fabric import discovery

    monkeypatch.setattr(flow.Bringup, "run", lambda self: pytest.fail("the bring-up ran"))
    # the capture stands for this node (a capture of another node measures nothing and opens no database)
    monkeypatch.setattr(discovery, "capture_not_this_node", lambda facts, capture: "")
    r = CliRunner().invoke(app, ["profile", "--quick", "--capture", str(CAPTURES / "h200x1"), "--db", str(bad)])
    _refused(r, bad, before)


def test_serve_refuses_a_damaged_database_before_it_starts(damaged: tuple[Path, bytes], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.daemon import server

    bad, before = damaged
    monkeypatch.setattr(server, "Daemon", lambda **kw: pytest.fail("the daemon was made"))
    r = CliRunner().invoke(app, ["serve", "--db", str(bad), "--socket", f"ipc://{tmp_path}/run/d.sock"])
    _refused(r, bad, before)


def test_a_retune_job_on_a_file_damaged_later_fails_with_the_reason(tmp_path: Path) -> None:
    from moetune.tuner.daemon import jobs as J
    from moetune.tuner.daemon.server import TuneSettings

    good, _other = databases(tmp_path)
    store = Store(good, intact=True)  # the daemon's open: scanned, sound
    facts = F.FakeFacts({"gpu_count": 0})
    ran: list[Any] = []
    done: list[Any] = []
    jm = J.JobManager(store=store, facts_fn=lambda: facts, retune=lambda ctx: ran.append(ctx) or [],
                      on_done=lambda j, w: done.append(j), tune=TuneSettings(backend="model", trials=1))
    jm.submit(reason="fabric changed", old_fingerprint="old", keys=[])  # queued (its event written) while sound
    store.close()  # its pooled connections go (the WAL checkpointed): the job's reads see the file as it is now
    data = bytearray(good.read_bytes())
    n = len(data) // PAGE // 2  # a page of profile rows, as damaged_copy overwrites
    data[n * PAGE:(n + 1) * PAGE] = b"\xff" * PAGE
    good.write_bytes(bytes(data))  # damaged while the daemon runs
    before = good.read_bytes()
    jm.start()
    try:
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.02)
        assert done, "the job did not end"
        job = done[0]
        assert job.state == "failed" and f"{good} is damaged" in job.message and "db check" in job.message, job.message
        assert not ran  # nothing measured
        assert jm._thread.is_alive()  # the worker serves the next job
    finally:
        jm.stop()
        store.close()  # what a write left in the WAL goes into the file
    assert good.read_bytes() == before  # no run row, no job event written into it


def _damaged_table(src: Path, table: str) -> tuple[Path, bytes]:
    """A copy of `src` with `table`'s root page overwritten: the schema migrations neither read nor write that table
    (they rebuild `profiles` and add `events` rows), so only the open's scan finds the damage."""
    with sqlite3.connect(f"file:{src}?mode=ro", uri=True) as conn:
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    bad = damaged_copy(src, root - 1)  # page numbers count from 1
    with Store(bad, upgrade=False) as s, pytest.raises(StoreDamaged):
        s.refuse_damaged()
    return bad, bad.read_bytes()


def _still_checked(bad: Path, before: bytes) -> None:
    """`moetune db check` reads the damaged file and reports it (exit 1), writing nothing either."""
    r = CliRunner().invoke(app, ["db", "check", "--db", str(bad)])
    assert r.exit_code == 1 and "NOT OK" in r.output and "malformed" in r.output, r.output
    assert "Traceback" not in r.output and "db upgrade/downgrade" in " ".join(r.output.split()), r.output
    assert bad.read_bytes() == before


@pytest.fixture
def sound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MOETUNE_CONFIG", raising=False)
    good, _other = databases(tmp_path)
    return good


def test_db_downgrade_refuses_a_damaged_database(sound: Path) -> None:
    bad, before = _damaged_table(sound, "tuning_runs")
    r = CliRunner().invoke(app, ["db", "downgrade", "0005", "--yes", "--db", str(bad)])
    _refused(r, bad, before)  # not "at revision 0005", exit 0, the profiles table rebuilt in the damaged file
    assert ".recover" in r.output
    _still_checked(bad, before)


@pytest.mark.parametrize("at", ["0005", "head"])  # a migration to run; none (it said "already at revision 0007")
def test_db_upgrade_refuses_a_damaged_database(sound: Path, at: str) -> None:
    src = sound
    if at != "head":
        src = sound.with_name("older.db")
        shutil.copy(sound, src)
        with Store(src, upgrade=False) as s:
            s.downgrade(at)
    bad, before = _damaged_table(src, "tuning_runs")
    r = CliRunner().invoke(app, ["db", "upgrade", "--db", str(bad)])
    _refused(r, bad, before)  # not "upgraded 0005 -> 0007" into the damaged file, exit 0
    _still_checked(bad, before)


def test_profiles_delete_and_fabric_record_refuse_a_damaged_database(damaged: tuple[Path, bytes]) -> None:
    bad, before = damaged
    run = CliRunner().invoke
    _refused(run(app, ["profiles", "delete", "1", "--yes", "--db", str(bad)]), bad, before)
    _refused(run(app, ["fabric", "show", "--record", "--capture", str(CAPTURES / "h200x1"), "--db", str(bad)]),
             bad, before)


def _damage_in_place(path: Path) -> None:
    """Overwrite a page of profile rows of `path` (its store closed first: the WAL is in the file)."""
    data = bytearray(path.read_bytes())
    n = len(data) // PAGE // 2
    data[n * PAGE:(n + 1) * PAGE] = b"\xff" * PAGE
    path.write_bytes(bytes(data))


def _files(path: Path) -> dict[str, bytes]:
    """The database and its -wal (where a write lands first; an empty one is no write), as bytes."""
    return {p.name: p.read_bytes() for p in (path, path.with_name(path.name + "-wal"))
            if p.exists() and p.stat().st_size}


def test_once_a_scan_finds_the_file_damaged_no_write_of_the_store_is_made(tmp_path: Path) -> None:
    """A failed scan latches: the later writes of the same open store (the watch's add_event, upsert_fingerprint and
    mark_stale, the next job's job_queued, a migration) raise StoreDamaged with the scan's message, without a scan;
    reads of what is still readable go on. Skipping only the failed job's own writes would let everything else go
    on writing into the damaged file."""
    good, _other = databases(tmp_path)
    store = Store(good, intact=True)
    try:
        assert store.damaged is None
        store.close()
        _damage_in_place(good)
        with pytest.raises(StoreDamaged) as scan:
            store.refuse_damaged(again=True)
        assert store.damaged == str(scan.value) and f"{good} is damaged" in store.damaged
        before = _files(good)
        writes = [lambda: store.add_event(kind="fabric_seen", reason="x", details={}),
                  lambda: store.upsert_fingerprint("fp2", {"a": 1}, origin="local"),
                  lambda: store.mark_stale(fingerprint="fp", reason="fabric changed"),
                  lambda: store.refuse_damaged(),  # a sound pass earlier in this open no longer counts
                  lambda: store.upgrade()]
        for write in writes:
            with pytest.raises(StoreDamaged) as e:
                write()
            assert str(e.value) == store.damaged
        assert store.current_revision() is not None and store.list_events(10) is not None  # reads go on
    finally:
        store.close()
    assert _files(good) == before


def test_a_daemon_that_found_its_file_damaged_writes_nothing_more_and_says_so(tmp_path: Path) -> None:
    """After a re-tune job finds the file damaged, a user's next `retune` is refused (its job_queued is not written)
    and a fabric change records nothing (the watch's writes); `moetune status` names the damage."""
    from moetune.runtime.profiles.client import ProfileClient
    from moetune.runtime.profiles.errors import DaemonError
    from moetune.tuner.daemon.server import Daemon

    good, _other = databases(tmp_path)
    facts = [F.FakeFacts({"gpu_model": "H200"})]
    with Store(good) as s:
        F.seed_profiles(s, facts[0])  # this fabric's profiles: something to re-tune
    store = Store(good, intact=True)
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=lambda: facts[0],
               rediscover_interval_s=0.05, retune_job=lambda ctx: []).start(background=True)
    c = ProfileClient(d.endpoint, timeout_ms=5000)
    try:
        F.until(lambda: c.status().fingerprint)
        assert c.status().store_damaged == ""
        store.close()
        _damage_in_place(good)
        assert c.retune(all=True, reason="first").job is not None  # its job_queued lands before the damage is found
        job = F.until(lambda: next((j for j in c.status().jobs.recent if j.state == "failed"), None))
        assert f"{good} is damaged" in job.message
        st = c.status()
        assert st.store_damaged and f"{good} is damaged" in st.store_damaged
        store.close()  # the WAL goes into the file: what follows must change neither
        before = _files(good)
        with pytest.raises(DaemonError, match="could not be recorded"):
            c.retune(all=True, reason="second")
        facts[0] = F.FakeFacts({"gpu_model": "H200", "port": "down"})  # the watch would record a fabric change
        time.sleep(0.5)
        r = CliRunner().invoke(app, ["status", "--socket", d.endpoint], env={"COLUMNS": "400"})
        assert r.exit_code == 0 and "db DAMAGED" in r.output and "is damaged" in r.output, r.output
    finally:
        c.close()
        d.stop()
        store.close()
    assert _files(good) == before
