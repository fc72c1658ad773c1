"""The daemon's local (measuring) re-tune: each stale key is measured with world = its EP size on this node, and
keys this node cannot measure (several nodes, more GPUs than it has) are refused and left stale, never
"re-measured" by another group and overwritten (world = min(GPUs, 8) for every group would re-tune an EP 16, 2-node
key with 8 ranks on one node and store it as measured)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.shapes import MODELS
from moetune.tuner.daemon.jobs import Job, JobContext, JobManager
from moetune.tuner.daemon.retune import tuner_retune
from moetune.tuner.daemon.server import TuneSettings

pytestmark = pytest.mark.timeout(60)
QWEN = MODELS["qwen3-30b"]


def _key(facts: Any, ep: int, nodes: int, bucket: int = 64, family: str = "nvlink") -> ProfileKey:
    return ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family=family,
                      ep_size=ep, nodes=nodes, hidden=QWEN.hidden, intermediate=QWEN.intermediate,
                      experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype, token_bucket=bucket)


def _fake_tune(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """tune_profiles_detailed replaced: records each call, writes one current profile per key group."""
    import moetune.tuner.search.tune as search

    calls: list[dict] = []

    def tune_profiles(store: Any, facts: Any, **kw: Any) -> list[search.TuneResult]:
        calls.append(kw)
        time.sleep(0.01)  # a study takes time: the job's one time budget shrinks call by call
        out = []
        for m in kw["models"]:
            for b in kw["tokens"]:
                key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                                 ep_size=kw["ep_size"], nodes=kw["nodes"], hidden=m.hidden,
                                 intermediate=m.intermediate, experts=m.experts, topk=m.topk, dtype=m.dtype,
                                 token_bucket=b)
                rec = F.make_record(key, backend="local:nccl")
                store.put_profile(rec)
                out.append(search.TuneResult(store.get_current(key), True, "no current profile for this key", None))
        return out

    monkeypatch.setattr(search, "tune_profiles_detailed", tune_profiles)
    return calls


def test_each_group_is_measured_at_its_own_ep_size_and_unmeasurable_ones_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_tune(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    keys = [_key(facts, 16, 2), _key(facts, 8, 1), _key(facts, 4, 1), _key(facts, 16, 1)]
    job = Job(1, reason="test", old_fingerprint="old", keys=keys)
    ctx = JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=1))
    written = tuner_retune(ctx)
    ran = sorted((c["ep_size"], c["nodes"], c["backend"].world) for c in calls)
    assert ran == [(4, 1, 4), (8, 1, 8)]  # world = the key's EP size, on this one node
    assert {(r.key.ep_size, r.key.nodes) for r in written} == {(4, 1), (8, 1)}
    assert len(job.refused) == 2
    two_nodes = next(m for m in job.refused if "EP 16 over 2 node(s)" in m)
    assert "one node" in two_nodes and "stale" in two_nodes
    assert any("EP 16 over 1 node(s)" in m and "this node has 8" in m for m in job.refused)


def _manager(store: Any, facts: Any, done: list) -> JobManager:
    return JobManager(store=store, facts_fn=lambda: facts, retune=tuner_retune, on_done=lambda j, w: done.append(j),
                      tune=TuneSettings(backend="local", trials=1), gpu_probe=lambda: (False, "idle (test)"))


def _wait(done: list) -> Job:
    deadline = time.monotonic() + 20
    while not done and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done
    return done[0]


def test_a_job_of_only_unmeasurable_keys_fails_and_leaves_them_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_tune(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    old = F.FakeFacts({"gpu_count": 8, "name": "before"})
    new = F.FakeFacts({"gpu_count": 8, "name": "after"})
    # a measured EP 16 profile of two nodes is a collective one (nvlink serves one node of at most 8 ranks: the store
    # refuses a measured nvlink profile of 16)
    key = _key(old, 16, 2, family="collective")
    stale = ProfileRecord(key=key, knobs=default_knobs("collective"), latency_us=10.0, spread_us=0.1, backend="local:fake",
                          provenance="measured")
    store.put_profile(stale)
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    done: list = []
    jm = _manager(store, new, done)
    jm.start()
    try:
        jm.submit(reason="fabric changed", old_fingerprint=old.fingerprint, keys=[stale.key])
        job = _wait(done)
    finally:
        jm.stop()
    assert calls == []
    assert job.state == "failed" and job.impossible, job.message
    assert "EP 16 over 2 node(s)" in job.message and "stay stale" in job.message
    finished = [e for e in store.list_events(limit=50) if e["kind"] == "job_finished"]
    assert finished and "EP 16 over 2 node(s)" in finished[0]["reason"]
    assert finished[0]["details"]["refused"]
    assert [r.status for _, r in store.list_profiles()] == ["stale"]  # nothing written for it, old or new fingerprint


def test_a_mixed_job_tunes_what_it_can_and_says_what_it_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_tune(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    done: list = []
    jm = _manager(store, facts, done)
    jm.start()
    try:
        jm.submit(reason="fabric changed", old_fingerprint="old", keys=[_key(facts, 16, 2), _key(facts, 8, 1)])
        job = _wait(done)
    finally:
        jm.stop()
    assert [(c["ep_size"], c["backend"].world) for c in calls] == [(8, 8)]
    assert job.state == "done" and job.written == 1
    assert "EP 16 over 2 node(s) not re-measured" in job.message
    finished = [e for e in store.list_events(limit=50) if e["kind"] == "job_finished"]
    assert "EP 16 over 2 node(s)" in finished[0]["reason"] and finished[0]["details"]["refused"]


def test_a_job_says_what_each_study_left_written_kept_or_without_a_result() -> None:
    """Every study's outcome is counted: written as current, the current profile kept (a measuring backend's
    side-by-side check where the incumbent held its own returns no record: it was counted as nothing, and the job
    said only "0 profile(s) written"), or no result at all (no successful trial)."""
    from types import SimpleNamespace

    from moetune.tuner.daemon.retune import _tally
    from moetune.tuner.search.tune import TuneResult

    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    rec = F.make_record(_key(facts, 8, 1))
    study = SimpleNamespace(study_name="s-1024", best_knobs="k")
    failed = SimpleNamespace(study_name="s-64", best_knobs=None)
    job = Job(1, reason="test", old_fingerprint=None, keys=[])
    written = _tally(job, [
        TuneResult(rec, True, "no current profile for this key", study),
        TuneResult(None, False, "the current profile held its own side by side", study, kept=True),
        TuneResult(rec, False, "gain within the noise", study, kept=True),
        TuneResult(rec, False, "gain within the noise", study, kept=True),
        TuneResult(None, False, "no successful trial", failed),
        TuneResult(None, False, "no successful trial", failed, kept=True),  # a profile stands: still no result
    ])
    assert written == [rec] and job.kept == 3
    assert job.kept_why == ["the current profile held its own side by side", "gain within the noise"]
    assert job.no_result == ["s-64: no successful trial"] * 2


def test_each_shape_is_re_tuned_at_its_own_buckets_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys of one (EP, nodes) group were tuned as every shape x every bucket: a store holding qwen3-30b at 64 and
    another shape at 1024 got new profiles for qwen3-30b at 1024 and the other at 64, keys nobody asked for."""
    calls = _fake_tune(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    other = MODELS["gpt-oss-120b"]
    key2 = ProfileKey(**{**_key(facts, 8, 1).to_dict(), "hidden": other.hidden, "intermediate": other.intermediate,
                         "experts": other.experts, "topk": other.topk, "token_bucket": 1024})
    job = Job(1, reason="test", old_fingerprint="old", keys=[_key(facts, 8, 1, 64), key2])
    tuner_retune(JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=1)))
    assert sorted((c["models"][0].name, c["tokens"]) for c in calls) == [("gpt-oss-120b", [1024]), ("qwen3-30b", [64])]
    assert all(len(c["models"]) == 1 and c["stop"] is not None for c in calls)
    # one budget for the job ([tune] timeout_s, 600 s by default), not one a call, shared by bucket: the first call
    # (one bucket of two) gets half, the second what is left (the first's unused time passed on); before, the first
    # shape was given all of it and could leave the second nothing
    assert 300 >= calls[0]["timeout_s"] > 299 and 600 >= calls[1]["timeout_s"] > 590


def test_a_job_cancelled_while_it_stores_ends_cancelled_and_counts_a_re_measurement(tmp_path: Path) -> None:
    """`retune --cancel` of a running job was acknowledged, and the job ran on to "done" (the side-by-side check
    and a resumed study never looked at the flag); what a cancelled job stored was found by profile hash, so a
    re-measurement of the same knobs (a new row, the same hash) counted as nothing written."""
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    old = F.make_record(_key(facts, 8, 1), latency_us=10.0)
    store.put_profile(old)

    def retune(ctx: JobContext) -> list:
        store.put_profile(F.make_record(_key(facts, 8, 1), latency_us=9.0), force_reason="re-measured (test)")
        ctx.cancel.set()  # the cancel arrives while this re-tune stores: it never checks the flag
        return []

    done: list = []
    jm = JobManager(store=store, facts_fn=lambda: facts, retune=retune, on_done=lambda j, w: done.append(j),
                    tune=TuneSettings(backend="local", trials=1), gpu_probe=lambda: (False, "idle (test)"))
    jm.start()
    try:
        jm.submit(reason="test", old_fingerprint=facts.fingerprint, keys=[old.key], all_current=True)
        job = _wait(done)
    finally:
        jm.stop()
    assert job.state == "cancelled" and job.written == 1, job.message
    assert "1 profile(s) written before it stopped" in job.message
    assert store.get_current(old.key).latency_us == 9.0


def test_a_queued_job_cancelled_frees_its_slot_at_once_and_is_recorded_once(tmp_path: Path) -> None:
    """A queued job's cancel frees its queue slot at once and records it once: a cancel that only set its flag would
    hold the slot (and list the job as queued) until the worker reached it, and `retune` be refused "the job queue is
    full" meanwhile."""
    import queue

    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    key = _key(facts, 8, 1)
    release, started = threading.Event(), threading.Event()

    def retune(ctx: JobContext) -> list:
        started.set()
        release.wait(10)
        return []

    done: list = []
    jm = JobManager(store=store, facts_fn=lambda: facts, retune=retune, on_done=lambda j, w: done.append(j),
                    tune=TuneSettings(backend="local", trials=1), gpu_probe=lambda: (False, "idle (test)"), capacity=2)
    jm.start()
    try:
        jm.submit(reason="runs", old_fingerprint=None, keys=[key])
        assert started.wait(10)
        a = jm.submit(reason="queued a", old_fingerprint=None, keys=[key])
        jm.submit(reason="queued b", old_fingerprint=None, keys=[key])
        with pytest.raises(queue.Full):
            jm.submit(reason="no room", old_fingerprint=None, keys=[key])
        assert jm.cancel(a.id) is a and a.state == "cancelled"
        queued, _running, recent = jm.info()
        assert [j.reason for j in queued] == ["queued b"] and [j.id for j in recent] == [a.id]
        assert jm.submit(reason="room again", old_fingerprint=None, keys=[key]) is not None
        release.set()
        deadline = time.monotonic() + 10
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        release.set()
        jm.stop()
    finished = [e for e in store.list_events(limit=50) if e["kind"] == "job_finished" and e["details"]["job_id"] == a.id]
    assert len(finished) == 1 and finished[0]["details"]["state"] == "cancelled"


def test_a_running_job_cancelled_then_a_daemon_stop_is_not_resumed(tmp_path: Path) -> None:
    """A cancel of a running job was recorded only when the job ended: a daemon stopped before that (its trial still
    running) left the job started in the store and the next daemon resumed it, the user's cancel lost."""
    from moetune.tuner.daemon.recovery import recover_jobs

    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    started, release = threading.Event(), threading.Event()

    def retune(ctx: JobContext) -> list:
        started.set()
        release.wait(10)  # a trial that goes on past the daemon's stop
        return []

    jm = JobManager(store=store, facts_fn=lambda: facts, retune=retune, on_done=lambda j, w: None,
                    tune=TuneSettings(backend="local", trials=1), gpu_probe=lambda: (False, "idle (test)"))
    jm.start()
    try:
        job = jm.submit(reason="retune --all", old_fingerprint=facts.fingerprint, keys=[_key(facts, 8, 1)])
        assert started.wait(10)
        assert jm.cancel(job.id) is job
        jm.stop(timeout=0.5)  # the re-tune has not returned: no job_finished from it
        assert [e for e in store.list_events(limit=50) if e["kind"] == "job_finished"] == []
        resume, _ = recover_jobs(store)  # the next daemon, while this process's worker is still stuck
        assert resume == []
        closed = [e for e in store.list_events(limit=50) if e["kind"] == "job_finished"]
        assert len(closed) == 1 and closed[0]["details"]["state"] == "cancelled", closed
        assert recover_jobs(store)[0] == []  # and stays closed
    finally:
        release.set()
        jm._thread.join(10)


def test_a_stale_ep1_transport_key_is_refused_and_the_other_groups_are_still_re_tuned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An nvlink key at EP 1 (stored before today's EP-1 refusal of the tune backends) in a re-tune job: the search
    refuses EP 1 for a transport family with a ValueError, and its group sorts first: it is refused among the job's
    refusals and stays stale, and the EP 2 key is still re-tuned (the whole job must not fail with it)."""
    import moetune.tuner.search.tune as search

    real = search.tune_profiles_detailed
    calls = _fake_tune(monkeypatch)
    fake = search.tune_profiles_detailed

    def tune(store: Any, facts: Any, **kw: Any) -> list:
        # EP 1: the real search (it refuses before launching anything); the others: the fake measurement
        return real(store, facts, **kw) if kw["ep_size"] == 1 else fake(store, facts, **kw)

    monkeypatch.setattr(search, "tune_profiles_detailed", tune)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    job = Job(1, reason="test", old_fingerprint="old", keys=[_key(facts, 1, 1), _key(facts, 2, 1)])
    ctx = JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=1))
    written = tuner_retune(ctx)
    assert [(c["ep_size"], c["nodes"]) for c in calls] == [(2, 1)]
    assert {(r.key.ep_size, r.key.nodes) for r in written} == {(2, 1)}
    assert len(job.refused) == 1 and "EP 1 over 1 node(s)" in job.refused[0] and "stay stale" in job.refused[0]
