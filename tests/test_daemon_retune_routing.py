"""The daemon's re-tune tunes each key under the routing its profile was tuned under (`Store.routing_of`). Without a
routing every key would be re-tuned under tune_profiles' default, uniform: after a fabric change a key `moetune tune
--routing zipf:S` had tuned would come back as a uniform profile, and beside a current zipf profile (`retune --all`,
same fingerprint) the uniform result is one the store never compares with it, so the key would keep its old profile
and the job count it "kept". A row that records no routing (from before migration 0005) is uniform."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.shapes import MODELS
from moetune.tuner.daemon.jobs import Job, JobContext, JobManager
from moetune.tuner.daemon.retune import tuner_retune
from moetune.tuner.daemon.server import TuneSettings

pytestmark = pytest.mark.timeout(60)
QWEN = MODELS["qwen3-30b"]
ZIPF = "zipf:1.2"


def _key(facts: Any, ep: int = 8, bucket: int = 64, fingerprint: str | None = None) -> ProfileKey:
    return ProfileKey(fingerprint=fingerprint or facts.fingerprint, software=facts.software_hash,
                      transport_family="nvlink", ep_size=ep, nodes=1, hidden=QWEN.hidden,
                      intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype,
                      token_bucket=bucket)


def _record(key: ProfileKey, routing: str, latency_us: float = 10.0) -> ProfileRecord:
    rec = F.make_record(key, latency_us=latency_us, backend="local:nccl")
    if routing:  # "": a row from before migration 0005, which recorded none
        rec.routing = routing
    return rec


def _fake_tune(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """tune_profiles_detailed replaced: records each call, and stores one faster profile per key under the routing it
    was given (the default's, uniform, where none), by the store's rules, as `_write_profile` does."""
    import moetune.tuner.search.tune as search

    calls: list[dict] = []

    def tune_profiles(store: Any, facts: Any, **kw: Any) -> list[search.TuneResult]:
        calls.append(kw)
        out = []
        for m in kw["models"]:
            for b in kw["tokens"]:
                key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                                 ep_size=kw["ep_size"], nodes=kw["nodes"], hidden=m.hidden,
                                 intermediate=m.intermediate, experts=m.experts, topk=m.topk, dtype=m.dtype,
                                 token_bucket=b)
                had = store.get_current(key) is not None
                rec = _record(key, kw.get("routing", "uniform"), latency_us=8.0)
                written, why = store.put_profile(rec)
                study = SimpleNamespace(best_knobs=rec.knobs, study_name=f"study-{b}")
                out.append(search.TuneResult(rec if written else None, written, why, study, kept=had and not written))
        return out

    monkeypatch.setattr(search, "tune_profiles_detailed", tune_profiles)
    return calls


def _run(store: Any, facts: Any, keys: list[ProfileKey], *, old_fingerprint: str | None,
         all_current: bool = False) -> Job:
    done: list = []
    jm = JobManager(store=store, facts_fn=lambda: facts, retune=tuner_retune, on_done=lambda j, w: done.append(j),
                    tune=TuneSettings(backend="local", trials=1), gpu_probe=lambda: (False, "idle (test)"))
    return F.run_one_job(jm, done, 20, reason="test", old_fingerprint=old_fingerprint, keys=keys,
                         all_current=all_current)


def _current(store: Any, fingerprint: str) -> list[ProfileRecord]:
    return [r for _, r in store.list_profiles(status="current", fingerprint=fingerprint)]


def test_a_zipf_key_is_re_tuned_under_zipf_after_a_fabric_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_tune(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    old = F.FakeFacts({"gpu_count": 8, "name": "before"})
    new = F.FakeFacts({"gpu_count": 8, "name": "after"})
    stale = _record(_key(old), ZIPF)
    assert store.put_profile(stale)[0]
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    job = _run(store, new, [stale.key], old_fingerprint=old.fingerprint)
    assert [c.get("routing") for c in calls] == [ZIPF]  # not without routing (tune_profiles' uniform)
    assert job.state == "done" and job.written == 1, job.message
    (rec,) = _current(store, new.fingerprint)
    assert rec.tuned_routing == ZIPF
    assert f"1 key(s) re-tuned under routing {ZIPF}" in job.message
    finished = [e for e in store.list_events(limit=50) if e["kind"] == "job_finished"]
    assert ZIPF in finished[0]["reason"] and finished[0]["details"]["routings"] == {ZIPF: 1}


@pytest.mark.parametrize("how", ["retune --all", "gpu swap"])
def test_on_the_same_fingerprint_the_zipf_profile_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              how: str) -> None:
    """`retune --all`: the current zipf profile is replaced by the faster zipf result (a uniform result would be
    history beside it, the key "keeping" its old profile). A GPU swap (its rows stale, same fingerprint): the key
    gets a zipf profile again, not a uniform one."""
    calls = _fake_tune(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    old = _record(_key(facts), ZIPF, latency_us=10.0)
    assert store.put_profile(old)[0]
    if how == "gpu swap":
        store.mark_stale(fingerprint=facts.fingerprint, reason="GPUs replaced")
    job = _run(store, facts, [old.key], old_fingerprint=facts.fingerprint, all_current=how == "retune --all")
    assert [c.get("routing") for c in calls] == [ZIPF]
    assert job.state == "done" and job.written == 1 and job.kept == 0, job.message
    (rec,) = _current(store, facts.fingerprint)
    assert rec.tuned_routing == ZIPF and rec.latency_us == 8.0
    assert sorted(r.status for _, r in store.list_profiles()) == ["current", "stale" if how == "gpu swap" else "superseded"]


def test_a_uniform_key_and_a_zipf_key_are_two_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same EP group and shape: one backend for the group (its bench workers), a call per routing, each with the
    buckets of its own keys."""
    calls = _fake_tune(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    old = F.FakeFacts({"gpu_count": 8, "name": "before"})
    new = F.FakeFacts({"gpu_count": 8, "name": "after"})
    recs = [_record(_key(old, bucket=64), "uniform"), _record(_key(old, bucket=128), ZIPF),
            _record(_key(old, bucket=256), "uniform")]
    for r in recs:
        assert store.put_profile(r)[0]
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed")
    job = _run(store, new, [r.key for r in recs], old_fingerprint=old.fingerprint)
    assert sorted((c["routing"], tuple(c["tokens"])) for c in calls) == [("uniform", (64, 256)), (ZIPF, (128,))]
    assert len({id(c["backend"]) for c in calls}) == 1  # one EP group: one set of ranks
    assert {(r.key.token_bucket, r.tuned_routing) for r in _current(store, new.fingerprint)} == {
        (64, "uniform"), (128, ZIPF), (256, "uniform")}
    assert job.routings == {ZIPF: 1} and "uniform" not in job.message, job.message


def test_a_row_that_records_no_routing_is_re_tuned_under_uniform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_tune(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    pre_0005 = _record(_key(facts, bucket=64, fingerprint="old"), "")  # stored with routing "" (not recorded)
    zipf = _record(_key(facts, bucket=128, fingerprint="old"), ZIPF)
    for r in (pre_0005, zipf):
        assert store.put_profile(r)[0]
    assert [r.tuned_routing for _, r in store.list_profiles()] == ["", ZIPF]
    job = Job(1, reason="test", old_fingerprint="old", keys=[pre_0005.key, zipf.key])
    tuner_retune(JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=1)))
    assert sorted((c["routing"], tuple(c["tokens"])) for c in calls) == [("uniform", (64,)), (ZIPF, (128,))]


def test_routing_of_takes_the_profile_that_stands_over_history(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    key = _key(facts)
    assert store.routing_of(key) == "uniform"  # no row at all
    assert store.put_profile(_record(key, "", latency_us=20.0))[0]
    assert store.routing_of(key) == "uniform"  # a row from before 0005
    assert store.put_profile(_record(key, ZIPF, latency_us=10.0))[0]  # "" compares with any: replaces it
    # a `moetune tune` of the uniform default: kept as superseded history, newer than the zipf profile
    written, why = store.put_profile(_record(key, "uniform", latency_us=5.0))
    assert not written and "routing" in why
    assert store.routing_of(key) == ZIPF
    store.mark_stale(fingerprint=facts.fingerprint, reason="fabric changed")
    assert store.routing_of(key) == ZIPF  # the stale profile, not the newer history
    other = _key(facts, bucket=128)
    assert store.put_profile(_record(other, "uniform"))[0]
    assert store.routing_of(other) == "uniform"
