"""A writing store (the daemon's stays open for weeks) whose database file is deleted, moved away or replaced by
another file (a backup restored over it) while it is open: every write from then on is refused (StoreReplaced, a
StoreDamaged: one clear line naming the file and "restart"), and the daemon says it in `status` and fails its re-tune
job with it, serving on. SQLite would go on writing the file it has open: after a delete every write (a re-tune's
profiles, its job events) would "succeed" into a file no longer at the path and be lost when the daemon exits, and a
replacement would get the old file's pages added to the -wal left at the path."""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.store import StoreDamaged
from moetune.tuner.store.store import Store, StoreReplaced

pytestmark = pytest.mark.timeout(120)


def _reasons(path: Path) -> list[str]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return [r[0] for r in conn.execute("SELECT reason FROM events ORDER BY id")]


def test_a_write_after_the_file_was_deleted_is_refused_not_lost(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    store = Store(db)
    store.add_event(kind="job_queued", reason="before", details={"job_id": 1})
    os.unlink(db)
    with pytest.raises(StoreReplaced, match="deleted") as e:
        store.add_event(kind="job_queued", reason="after", details={"job_id": 2})
    assert isinstance(e.value, StoreDamaged) and e.value.exit_code == 1 and "restart" in str(e.value)
    assert store.damaged and "deleted" in store.damaged  # what the daemon's `status` shows
    Store(db).close()  # a new file at the path meanwhile: this store's writes stay refused (it has the old one open)
    with pytest.raises(StoreReplaced):
        store.start_run(study_name="s", storage="x", backend="model")
    with pytest.raises(StoreReplaced):
        store.refuse_damaged(again=True)  # what a re-tune job asks before it measures
    store.close()


def test_a_file_replaced_under_the_store_gets_no_write_of_it(tmp_path: Path) -> None:
    """(The old file's -wal, left at the path, is SQLite's to read over the replacement: a file restored over a live
    database is the user's to stop the daemon for. What the store must not do is add to it.)"""
    db, other = tmp_path / "m.db", tmp_path / "backup.db"
    with Store(other) as s:
        s.add_event(kind="job_queued", reason="the backup's", details={"job_id": 1})
    store = Store(db)
    store.add_event(kind="job_queued", reason="the old file's", details={"job_id": 1})
    os.replace(other, db)  # a backup restored over it while the store is open
    with pytest.raises(StoreReplaced, match="replaced by another file"):
        store.add_event(kind="job_queued", reason="written after", details={"job_id": 2})
    store.close()
    assert "written after" not in _reasons(db)


def test_an_ordinary_store_is_not_refused(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with Store(db) as store:  # created by this open
        for i in range(3):
            store.add_event(kind="job_queued", reason=str(i), details={"job_id": i})
        assert store.damaged is None
    with Store(tmp_path / "later.db", check_schema=False) as store:  # no file until its first write
        assert not (tmp_path / "later.db").exists()
        store.upgrade()
        store.add_event(kind="job_queued", reason="x", details={"job_id": 1})
        assert store.damaged is None


def test_a_retune_job_after_the_file_was_deleted_fails_with_the_reason(tmp_path: Path) -> None:
    from moetune.tuner.daemon import jobs as J
    from moetune.tuner.daemon.server import TuneSettings

    db = tmp_path / "m.db"
    store = Store(db, intact=True)
    facts = F.FakeFacts({"gpu_count": 0})
    ran: list[Any] = []
    done: list[Any] = []
    jm = J.JobManager(store=store, facts_fn=lambda: facts, retune=lambda ctx: ran.append(ctx) or [],
                      on_done=lambda j, w: done.append(j), tune=TuneSettings(backend="model", trials=1))
    jm.submit(reason="fabric changed", old_fingerprint="old", keys=[])  # queued (its event written) before
    os.unlink(db)
    jm.start()
    try:
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.02)
        assert done, "the job did not end"
        job = done[0]
        assert job.state == "failed" and f"{db} was deleted" in job.message, job.message
        assert not ran  # nothing measured into a file that is gone
        assert jm._thread.is_alive()  # the worker lives
        with pytest.raises(J.JobNotRecorded):  # a user's retune is refused, not answered "queued" and lost
            jm.submit(reason="again", old_fingerprint=None, keys=[], confirm=True)
    finally:
        jm.stop()
        store.close()
