"""A daemon killed during a fabric change, after fabric_changed (and mark_stale) were written but before the
re-tune job was queued: the next daemon queues that re-tune (job recovery reads job events only, so it was lost
for good and the profiles stayed stale). A change whose re-tune was queued is not queued twice."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("stopped_after", ["fabric_changed", "mark_stale", "job_queued"])
def test_the_retune_of_a_change_the_last_daemon_did_not_queue_is_queued_at_start(tmp_path: Path,
                                                                                  stopped_after: str) -> None:
    # what _fabric_changed had written when the daemon was killed
    store, old, new, seeded = F.unqueued_fabric_change(tmp_path / "moetune.db")
    if stopped_after != "fabric_changed":
        store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    if stopped_after == "job_queued":  # its job was queued (and cancelled, say): nothing more to queue
        store.add_event(kind="job_queued", reason="fabric changed",
                        details={"job_id": 1, "keys": [r.key.to_dict() for r in seeded]})
        store.add_event(kind="job_finished", reason="cancelled", details={"job_id": 1, "state": "cancelled"})

    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        if stopped_after == "job_queued":
            assert not done.wait(1.0) and not d.jobs.info()[0]
            return
        assert done.wait(10), "no re-tune queued for the change"
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
        assert all(k.fingerprint == old.fingerprint for k in ran[0])
        assert d.index.current_count == 0 and len(d.index.stale) == len(seeded)  # the old ones stale, not served
    finally:
        d.stop()


@pytest.mark.parametrize("stopped_after", ["fabric_changed", "mark_stale"])
@pytest.mark.parametrize("ids_recorded", [True, False])
def test_an_interrupted_change_of_gpus_only_is_finished_at_start(tmp_path: Path, stopped_after: str,
                                                                 ids_recorded: bool) -> None:
    """A GPU replaced by one of the same model: same fingerprint, another identity. The daemon was killed after
    writing fabric_changed (before mark_stale, or before queuing the re-tune): the next start, on the new GPUs, sees
    no change (`same_hardware`), yet the old GPUs' profiles are made stale and re-tuned; a recovery that returned at
    once for equal fingerprints would leave them current (or stale) for good with nothing re-tuned."""
    x, y = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H200"})
    x.identity_hash, y.identity_hash = "gpus-X", "gpus-Y"
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, x)
    store.add_event(kind="fabric_seen", reason="first",
                    details={"fingerprint": x.fingerprint, "identity": "gpus-X", "facts": x.to_dict()})
    ids = [i for i, _ in store.list_profiles(status="current", fingerprint=x.fingerprint)]
    store.add_event(kind="fabric_changed", reason="GPU 0 replaced",
                    details={"old_fingerprint": x.fingerprint, "fingerprint": y.fingerprint, "identity": "gpus-Y",
                             "reasons": ["GPU 0 replaced"], "facts": y.to_dict(),
                             **({"profiles": ids} if ids_recorded else {})})
    if stopped_after == "mark_stale":
        store.mark_stale(fingerprint=x.fingerprint, reason="fabric changed: GPU 0 replaced", ids=ids)
    d, ran, done = F.start_recording_daemon(store, tmp_path, y)
    try:
        assert done.wait(10), "no re-tune queued for the change of GPUs"
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
        assert store.list_profiles(status="current", fingerprint=x.fingerprint) == []
        assert d.index.current_count == 0 and len(d.index.stale) == len(seeded)  # the old GPUs' not served
    finally:
        d.stop()


def test_a_change_whose_retune_was_queued_is_not_acted_on_at_later_starts(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A change handled to its end (stale, queued, finished), then profiles of the old fingerprint came in (an
    import from a sibling node, a model tune of its capture): a start neither makes them stale nor
    re-tunes them, nor says the daemon stopped before queuing."""
    old, new = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, old)
    F.record_fabric_seen(store, old)
    F.record_fabric_change(store, old, new)
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    store.add_event(kind="job_queued", reason="fabric changed",
                    details={"job_id": 1, "old_fingerprint": old.fingerprint, "keys": [r.key.to_dict() for r in seeded]})
    store.add_event(kind="job_finished", reason="done", details={"job_id": 1, "state": "done"})
    F.seed_profiles(store, old, buckets=(8192,))
    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        assert not done.wait(1.5), f"re-tuned at start: {ran}"
        assert [r.key.token_bucket for _, r in store.list_profiles(status="current", fingerprint=old.fingerprint)] == [8192]
        assert "stopped before queuing" not in caplog.text
    finally:
        d.stop()


@pytest.mark.parametrize("ids_recorded", [True, False])
def test_only_the_rows_the_interrupted_change_concerns_are_retuned(tmp_path: Path, ids_recorded: bool) -> None:
    """Stopped in the crash window (no job_queued after the change): the rows current at the change are made stale
    and re-tuned; a row stale before the change and one that came after it are left as they are."""
    old, new = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, old, buckets=(16,))
    store.mark_stale(fingerprint=old.fingerprint, reason="stale before the change")
    seeded = F.seed_profiles(store, old)
    F.record_fabric_seen(store, old)
    at_change = [i for i, _ in store.list_profiles(status="current", fingerprint=old.fingerprint)]
    F.record_fabric_change(store, old, new, **({"profiles": at_change} if ids_recorded else {}))
    F.seed_profiles(store, old, buckets=(8192,))  # after the change (an import, say)
    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        assert done.wait(10), "no re-tune queued for the change"
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
        assert [r.key.token_bucket for _, r in store.list_profiles(status="current", fingerprint=old.fingerprint)] == [8192]
    finally:
        d.stop()


def test_a_fabric_change_records_the_profiles_it_makes_stale(tmp_path: Path) -> None:
    old, new = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, old)
    F.record_fabric_seen(store, old)
    ids = [i for i, _ in store.list_profiles(status="current", fingerprint=old.fingerprint)]
    d, _, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        assert done.wait(10)
        ev = store.list_events(limit=1, kinds=("fabric_changed",))[0]
        assert ev["details"]["profiles"] == ids
    finally:
        d.stop()


def test_a_resumed_job_of_one_key_does_not_hide_the_changes_other_keys(tmp_path: Path) -> None:
    """A job of the last daemon for one key, resumed at start, wrote a job_queued after the change: "any later
    job_queued of the old fingerprint" took the change as handled and its other keys stayed stale for good."""
    old, new = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, old)
    assert len(seeded) >= 2
    F.record_fabric_seen(store, old)
    # a `moetune retune` of ONE key queued before the change and never finished: resumed at start
    store.add_event(kind="job_queued", reason="requested", details={"job_id": 1, "keys": [seeded[0].key.to_dict()]})
    ids = [i for i, _ in store.list_profiles(status="current", fingerprint=old.fingerprint)]
    F.record_fabric_change(store, old, new, profiles=ids)
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")  # killed here: no re-tune queued
    d, ran, _done = F.start_recording_daemon(store, tmp_path, new)
    try:
        deadline = time.monotonic() + 10
        want = sorted(r.key.token_bucket for r in seeded)
        while sorted(b for keys in ran for b in (k.token_bucket for k in keys)) != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(b for keys in ran for b in (k.token_bucket for k in keys)) == want, ran
    finally:
        d.stop()


def _wait(cond: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)


def _fabrics(a_gpus: str = "gpus-X") -> tuple[Any, Any]:
    """Fabric A (H200 GPUs `a_gpus`) and fabric B (H100, GPUs gpus-B): another fingerprint each."""
    a, b = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    a.identity_hash, b.identity_hash = a_gpus, "gpus-B"
    return a, b


def _recording_daemon(store: Any, tmp_path: Path, now: list[Any],
                      retune: Any = None) -> tuple[Daemon, list[list[Any]]]:
    """A daemon whose fabric is `now[0]` (set it, then rediscover()) and whose re-tunes are recorded (keys per job,
    second value); `retune` (ctx, ran) -> records replaces the default one, which stores nothing."""
    ran: list[list[Any]] = []

    def job(ctx: Any) -> list[Any]:
        ran.append(list(ctx.keys))
        return retune(ctx, ran) if retune is not None else []

    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/d.sock", discover=lambda: now[0], rediscover_interval_s=0,
               retune_job=job).start(background=True)
    return d, ran


def _seeded_daemon(tmp_path: Path, a: Any) -> tuple[Any, list[Any], list[Any], Daemon, list[list[Any]]]:
    """(store, A's seeded profiles, now, daemon, ran): a recording daemon on fabric `a` over a new store."""
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, a)
    now = [a]
    d, ran = _recording_daemon(store, tmp_path, now)
    return store, seeded, now, d, ran


def test_a_fabric_back_to_one_it_had_serves_that_ones_profiles_again(tmp_path: Path) -> None:
    """A → B → A (a GPU off the bus and back, a package changed then restored): A's profiles go stale at A → B, B's
    re-tune stores nothing, and B → A makes each of A's keys current again, measured as it was, with nothing
    re-tuned for them (not left stale for a re-tune of hours, or modelled rows in their place, though measured on
    this very fabric); a key tuned on A in between keeps its newer profile."""
    a, b = _fabrics()  # the same GPUs back (`test_..._on_other_gpus_...`)
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, a)
    now = [a]
    d, ran = _recording_daemon(store, tmp_path, now)  # its re-tunes store nothing (as one that cannot run)
    try:
        now[0] = b
        d.rediscover()  # A → B: A's profiles stale, their re-tune (for B) runs and stores nothing
        deadline = time.monotonic() + 10
        while len(ran) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ran) == 1 and store.list_profiles(status="current", fingerprint=a.fingerprint) == []
        now[0] = a
        d.rediscover()  # B → A: A's profiles current again
        time.sleep(0.5)
        assert len(ran) == 1, ran  # nothing re-tuned for them
        cur = store.list_profiles(status="current", fingerprint=a.fingerprint)
        assert sorted(r.key.token_bucket for _, r in cur) == sorted(r.key.token_bucket for r in seeded)
        assert {r.profile_hash for _, r in cur} == {r.profile_hash for r in seeded}
        assert any(e["kind"] == "restored" for e in store.list_events(limit=20)), store.list_events(limit=20)
    finally:
        d.stop()


@pytest.mark.parametrize("back_on", ["gpus-Y", ""])
def test_a_fabric_back_on_other_gpus_does_not_serve_the_old_gpus_profiles(tmp_path: Path, back_on: str) -> None:
    """A on GPUs X → B → A on GPUs Y (same model: same fingerprint): A's stale profiles were measured on X, and a
    replaced GPU is a change needing a re-tune (`same_hardware`), so none is made current again; A's keys are
    re-tuned on Y. The same where the GPUs now are unknown (`back_on` ""): an identity that cannot be shown equal."""
    a, b = _fabrics()
    a2, _ = _fabrics(back_on)
    assert a2.fingerprint == a.fingerprint
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, a)
    now = [a]
    d, ran = _recording_daemon(store, tmp_path, now)
    try:
        now[0] = b
        d.rediscover()  # A(X) → B
        deadline = time.monotonic() + 10
        while len(ran) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ran) == 1
        now[0] = a2
        d.rediscover()  # B → A(Y)
        deadline = time.monotonic() + 10
        while len(ran) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.list_profiles(status="current", fingerprint=a.fingerprint) == []
        assert d.index.current_count == 0
        assert not any(e["kind"] == "restored" for e in store.list_events(limit=20))
        assert len(ran) == 2, ran  # A's keys re-tuned on the GPUs now there
        assert sorted(k.token_bucket for k in ran[1]) == sorted(r.key.token_bucket for r in seeded)
    finally:
        d.stop()




def test_a_fabric_back_restores_the_row_measured_on_it_not_one_a_job_wrote_after_it_moved_on(tmp_path: Path) -> None:
    """A re-tune of A's key is running when the fabric moves to B; the job writes its A-keyed result after that, and
    `_fabric_moved_on` makes it stale (it was not measured on A throughout). At B → A only the rows A served are
    candidates: the older row A served until it left comes back, not that newest stale row."""
    import msgspec

    a, b = _fabrics()
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, a, buckets=(64,))
    now = [a]
    holder: dict[str, Any] = {}

    def retune(ctx: Any, ran: list[list[Any]]) -> list[Any]:
        if len(ran) > 1:
            return []  # B's re-tunes store nothing
        now[0] = b
        holder["d"].rediscover()  # A → B while the job measures
        rec = msgspec.structs.replace(F.make_record(seeded[0].key), latency_us=999.0)
        assert store.put_profile(rec, force_reason="side by side")[0]  # A's key had nothing current: written current
        return [rec]

    d, _ran = _recording_daemon(store, tmp_path, now, retune)
    holder["d"] = d
    try:
        d.jobs.submit(reason="manual", old_fingerprint=None, keys=[seeded[0].key], all_current=True, confirm=True)
        _wait(lambda: any(e["kind"] == "stale" and e["reason"].startswith("job ")
                          for e in store.list_events(limit=50)))
        assert store.list_profiles(status="current", fingerprint=a.fingerprint) == []  # the job's row made stale
        # the job's re-queue (for B) runs and stores nothing: waited for, as a fixed sleep could end before it ran
        # (a loaded CI box) and let it run after B → A
        _wait(lambda: len(_ran) >= 2 and d.jobs.info()[:2] == ([], None))
        assert len(_ran) == 2 and d.jobs.info()[:2] == ([], None), (_ran, d.jobs.info())
        now[0] = a
        d.rediscover()  # B → A
        cur = store.list_profiles(status="current", fingerprint=a.fingerprint)
        assert [r.latency_us for _, r in cur] == [seeded[0].latency_us], cur
        assert [r.profile_hash for _, r in cur] == [seeded[0].profile_hash]
    finally:
        d.stop()


def test_a_fabric_back_does_not_restore_rows_of_an_earlier_stay_on_other_gpus(tmp_path: Path) -> None:
    """A(X) → B → A(Y): X's rows stay stale and their re-tune stores nothing; A(Y) → B → A(Y): the GPUs are those A
    had when it last left, but A served nothing then: X's rows, each key's newest stale one, must not come back."""
    a, b = _fabrics()
    a2, _ = _fabrics("gpus-Y")
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, a)
    now = [a]
    d, ran = _recording_daemon(store, tmp_path, now)
    try:
        for n, facts in enumerate([b, a2, b, a2], start=1):
            now[0] = facts
            d.rediscover()
            _wait(lambda n=n: len(ran) >= n)
            assert store.list_profiles(status="current", fingerprint=a.fingerprint) == [], facts.identity_hash
        assert not any(e["kind"] == "restored" for e in store.list_events(limit=50))
    finally:
        d.stop()


def test_restoring_keeps_a_key_tuned_since(tmp_path: Path) -> None:
    """restore_stale: a key with a current profile keeps it (its stale one stays stale); of two stale profiles of a
    key the newest comes back; other fingerprints are untouched."""
    a, b = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, a, buckets=(64, 1024))
    F.seed_profiles(store, b, buckets=(64,))
    store.mark_stale(fingerprint=a.fingerprint, reason="fabric changed")
    store.put_profile(seeded[0])  # key 64 measured again on A: current
    assert store.restore_stale(fingerprint=a.fingerprint, reason="back") == 1  # only key 1024
    cur = store.list_profiles(status="current", fingerprint=a.fingerprint)
    assert sorted(r.key.token_bucket for _, r in cur) == [64, 1024]
    assert len(store.list_profiles(status="stale", fingerprint=a.fingerprint)) == 1  # 64's old one
    assert len(store.list_profiles(status="current", fingerprint=b.fingerprint)) == 1
    assert store.restore_stale(fingerprint=a.fingerprint, reason="again") == 0


def test_restoring_with_ids_takes_only_those_rows(tmp_path: Path) -> None:
    """restore_stale(ids=...): of a key's stale rows only the listed one is a candidate, even where a newer one is
    stale beside it."""
    import msgspec

    a = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, a, buckets=(64,))
    (old_id, _), = store.list_profiles(status="current", fingerprint=a.fingerprint)
    store.mark_stale(fingerprint=a.fingerprint, reason="fabric changed")
    store.put_profile(msgspec.structs.replace(F.make_record(seeded[0].key), latency_us=999.0))
    store.mark_stale(fingerprint=a.fingerprint, reason="job 1 tuned for A; the fabric is now B")
    assert store.restore_stale(fingerprint=a.fingerprint, reason="back", ids=[old_id]) == 1
    assert [(i, r.latency_us) for i, r in store.list_profiles(status="current", fingerprint=a.fingerprint)] == [
        (old_id, seeded[0].latency_us)]
    assert store.restore_stale(fingerprint=a.fingerprint, reason="none", ids=[]) == 0


def test_an_interrupted_change_behind_thousands_of_job_events_is_still_finished_at_start(tmp_path: Path) -> None:
    """The change was looked for in the newest 2000 fabric and job_queued events together: 2000 jobs queued since
    (a submit + cancel loop of other keys) hid it, and its keys stayed stale with no re-tune, for good."""
    import contextlib
    import json
    import sqlite3

    store, old, new, seeded = F.unqueued_fabric_change(tmp_path / "moetune.db")
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    other = {**seeded[0].key.to_dict(), "token_bucket": 1 << 20}  # a key of no seeded profile
    rows = [("x", kind, f"job {jid}", json.dumps({"job_id": jid, "keys": [other], "state": "cancelled"}))
            for jid in range(1, 2102) for kind in ("job_queued", "job_finished")]
    with contextlib.closing(sqlite3.connect(tmp_path / "moetune.db")) as c, c:
        c.executemany("INSERT INTO events (created, kind, reason, details) VALUES (?, ?, ?, ?)", rows)
    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        assert done.wait(10), "no re-tune queued for the change"
        assert sorted(k.token_bucket for k in ran[0]) == sorted(r.key.token_bucket for r in seeded)
    finally:
        d.stop()


def test_an_interrupted_change_whose_keys_a_later_job_holds_is_not_queued_again(tmp_path: Path) -> None:
    """The keys a job queued since the change holds are its own, also when that job_queued is thousands of events
    after the change (read a page at a time)."""
    import contextlib
    import json
    import sqlite3

    store, old, new, seeded = F.unqueued_fabric_change(tmp_path / "moetune.db")
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    other = {**seeded[0].key.to_dict(), "token_bucket": 1 << 20}
    rows = [("x", kind, f"job {jid}", json.dumps({"job_id": jid, "keys": [other], "state": "cancelled"}))
            for jid in range(1, 1001) for kind in ("job_queued", "job_finished")]
    every = [r.key.to_dict() for r in seeded]
    rows += [("x", "job_queued", "job 1001", json.dumps({"job_id": 1001, "keys": every})),
             ("x", "job_finished", "job 1001", json.dumps({"job_id": 1001, "keys": every, "state": "cancelled"}))]
    with contextlib.closing(sqlite3.connect(tmp_path / "moetune.db")) as c, c:
        c.executemany("INSERT INTO events (created, kind, reason, details) VALUES (?, ?, ?, ?)", rows)
    d, ran, done = F.start_recording_daemon(store, tmp_path, new)
    try:
        assert not done.wait(1.5), f"re-tuned at start: {ran}"
    finally:
        d.stop()
