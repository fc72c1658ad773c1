"""What `moetune retune` leaves out (keys the daemon's [tune] backend cannot answer here: b2a8966) is kept for
`status`: on the job it queued (JobInfo.left_out, its events), or, where it queued none, in the daemon's short list of
recent refusals (StatusResult.retune_refusals). Before, only the retune reply named those keys: once it was gone
nothing said why they were not re-tuned. Both fields are left off the wire at their default (a client one version
older still reads such a status reply), and the retune reply's job never carries left_out (0631499)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F
import test_retune_leaves_out_what_the_backend_cannot_answer as L

from moetune.runtime import wire
from moetune.runtime.profile_record import ProfileKey
from moetune.tuner.daemon.jobs import JobManager
from moetune.tuner.daemon.retune import tuner_retune
from moetune.tuner.daemon.server import TuneSettings

pytestmark = pytest.mark.timeout(120)


def test_a_retune_that_queues_nothing_for_keys_it_leaves_out_is_kept_bounded() -> None:
    # "nothing to re-tune": current what-if keys only (2 nodes: the local backend cannot measure them)
    d = L._daemon([L._what_if("fp")], [])
    ok, res = L._ask(d)
    assert ok and res.job is None, res
    [kept] = d.retune_refusals
    assert kept.message.startswith("nothing to re-tune") and "EP 16 over 2 node(s)" in kept.message, kept
    assert 'backend = "model"' in kept.message, kept.message  # what would answer them
    assert kept.left_out == res.left_out and kept.reason == "t" and kept.at, kept
    # "not queued": a stale key of 2 nodes; the error's text is kept, the keys named in left_out
    d = L._daemon([], [L._rec(L._key("old", family="collective", ep=16, nodes=2))])
    ok, (code, msg) = L._ask(d)
    [kept] = d.retune_refusals
    assert not ok and code == wire.E_NOT_FOUND and kept.message == msg, msg
    assert len(kept.left_out) == 1 and "EP 16 over 2 node(s)" in kept.left_out[0], kept.left_out
    for _ in range(wire.RETUNE_REFUSALS_KEPT + 3):  # a user retrying does not grow the daemon without end
        L._ask(d)
    assert len(d.retune_refusals) == wire.RETUNE_REFUSALS_KEPT


def test_a_retune_that_leaves_nothing_out_or_queues_keeps_no_refusal() -> None:
    d = L._daemon([], [L._rec(L._key("old", ep=8, bucket=4096))])
    ok, res = L._ask(d)
    assert ok and res.job is not None and not d.retune_refusals, res
    assert d.jobs.left_out == [], d.jobs.left_out


def test_the_keys_left_out_of_a_queued_job_are_kept_on_the_job_not_in_the_retune_reply(tmp_path: Path) -> None:
    stale = L._rec(L._key("old", ep=8, bucket=4096))
    d = L._daemon([L._what_if("fp")], [stale])
    store = F.open_store(tmp_path / "m.db")
    # the real job manager (not started: the job stays queued), as the daemon's
    d.jobs = JobManager(store=store, facts_fn=lambda: d.facts, retune=tuner_retune, on_done=lambda j, w: None,
                        tune=d.tune)
    ok, res = L._ask(d)
    assert ok and res.job is not None and not d.retune_refusals, res
    # the reply: as a client one version older reads it (0631499), its job included
    assert b"left_out" not in wire.encode_ok(1, "e", res), res
    [queued] = d.jobs.info()[0]
    assert len(queued.left_out) == 1 and "EP 16 over 2 node(s)" in queued.left_out[0], queued
    [ev] = [e for e in store.list_events(limit=10) if e["kind"] == "job_queued"]
    assert ev["details"]["left_out"] == queued.left_out, ev  # stored with the job, as its other details


def test_the_cancel_reply_s_job_carries_no_left_out_either(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`retune --cancel N` of a job keys were left out of: its reply's job carried left_out, which a client one version
    older refuses (BadReply: its user was told the cancel failed, though the job was cancelled)."""
    from moetune.runtime.profiles.replies import decode_reply, decode_result

    d = L._daemon([L._what_if("fp")], [L._rec(L._key("old", ep=8, bucket=4096))])
    d.jobs = JobManager(store=F.open_store(tmp_path / "m.db"), facts_fn=lambda: d.facts, retune=tuner_retune,
                        on_done=lambda j, w: None, tune=d.tune)  # not started: the job stays queued
    ok, res = L._ask(d)
    assert ok and res.job is not None and d.jobs.info()[0][0].left_out, res  # a job with keys left out
    ok, res = L._ask(d, cancel=res.job.id)
    assert ok and res.job.state == "cancelled", res
    frame = wire.encode_ok(1, "e", res)
    assert b"left_out" not in frame, frame
    old_job = _older(wire.JobInfo, "left_out")
    monkeypatch.setitem(wire.RESULT_TYPES, "retune", _older(wire.RetuneResult, "", job=old_job | None))
    assert decode_result("retune", decode_reply(frame).result).job.state == "cancelled"
    assert d.jobs.info()[2][0].left_out, "status still lists them"


def test_a_job_re_queued_because_the_fabric_changed_keeps_what_its_retune_left_out(tmp_path: Path) -> None:
    """The job queued again after the fabric changed under it takes the first one over (`resumes`), as a job resumed
    after a restart does (recover_jobs passes left_out on): its keys left out were lost from `status` and its
    job_queued event, once the first job left the recent list."""
    from moetune.tuner.daemon.jobs import Job

    store = F.open_store(tmp_path / "m.db")
    jm = JobManager(store=store, facts_fn=lambda: None, retune=tuner_retune, on_done=lambda j, w: None,
                    tune=TuneSettings(backend="local", trials=1))  # not started: the new job stays queued
    said = ["1 key(s) of EP 16 over 2 node(s) (x) not re-measured: y"]
    first = Job(7, reason="asked", old_fingerprint=None, keys=[L._key("old", ep=8, bucket=4096)], left_out=said)
    first.fingerprint = "old"
    jm._requeue(first, "new")
    [again] = jm.info()[0]
    assert "re-queued" in again.reason and again.left_out == said, again
    [ev] = [e for e in store.list_events(limit=10) if e["kind"] == "job_queued"]
    assert ev["details"]["left_out"] == said and ev["details"]["resumes"] == 7, ev


def _older(struct: type, drop: str, **types: type) -> type:
    """`struct` as a client one version older defines it: without the field `drop` (nested types replaced)."""
    fields: list[Any] = []
    for f in msgspec.structs.fields(struct):
        if f.name == drop:
            continue
        t = types.get(f.name, f.type)
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, t, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, t, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, t))
    return msgspec.defstruct(struct.__name__, fields, kw_only=True, omit_defaults=True)


def test_a_client_one_version_older_reads_a_status_that_says_nothing_of_either(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.profiles.errors import BadReply
    from moetune.runtime.profiles.replies import decode_reply, decode_result

    def status(refusals: list[wire.RetuneRefusal], left_out: list[str]) -> bytes:
        job = wire.JobInfo(id=1, state="queued", reason="r", left_out=left_out)
        return wire.encode_ok(1, "e", wire.StatusResult(
            epoch="e", daemon_version="1", pid=42, uptime_s=3.0, db="/x/m.db", endpoint="ipc:///x/d.sock",
            pub_endpoint="ipc:///x/e.sock", version=7, fingerprint="f" * 16, last_discovery="t",
            last_discovery_ok=True, last_discovery_message="", profiles_current=3, profiles_stale=0, requests=5,
            jobs=wire.JobsInfo(queued=[job], running=None, recent=[], capacity=4), retune_refusals=refusals))

    refusal = wire.RetuneRefusal(at="t", reason="r", message="not queued: x", left_out=["a"])
    # this client reads both
    st = decode_result("status", decode_reply(status([refusal], ["b"])).result)
    assert st.retune_refusals == [refusal] and st.jobs.queued[0].left_out == ["b"], st
    old_job = _older(wire.JobInfo, "left_out")
    old_jobs = _older(wire.JobsInfo, "", queued=list[old_job], running=old_job | None, recent=list[old_job])
    monkeypatch.setitem(wire.RESULT_TYPES, "status", _older(wire.StatusResult, "retune_refusals", jobs=old_jobs))
    assert decode_result("status", decode_reply(status([], [])).result).jobs.queued[0].id == 1
    # where there is something it cannot show, it says so (a newer daemon), as for every such field
    with pytest.raises(BadReply, match="unknown fields retune_refusals"):
        decode_result("status", decode_reply(status([refusal], [])).result)
    with pytest.raises(BadReply, match="left_out"):
        decode_result("status", decode_reply(status([], ["b"])).result)


def test_status_shows_a_refusal_in_its_table_and_json(tmp_path: Path) -> None:
    """End to end: a daemon with [tune] backend = "local" and only a what-if current key of 2 nodes (left out)."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app
    from moetune.tuner.daemon.server import Daemon

    facts = F.FakeFacts({"gpu_model": "H200", "gpu_count": 8})
    store = F.open_store(tmp_path / "moetune.db")
    k = ProfileKey(**{**L._what_if("x").key.to_dict(), "fingerprint": facts.fingerprint,
                      "software": facts.software_hash})
    ok, why = store.put_profile(L._rec(k, backend=f"model:node:{facts.fingerprint}"))
    assert ok, why
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=lambda: facts,
               rediscover_interval_s=0, tune=TuneSettings(backend="local", trials=1)).start(background=True)
    runner = CliRunner()
    env = {"COLUMNS": "400"}
    try:
        F.until(lambda: d.index.fingerprint == facts.fingerprint)
        r = runner.invoke(app, ["retune", "--socket", d.endpoint, "--reason", "first ask"], env=env)
        assert r.exit_code == 0 and "nothing to re-tune" in r.output, r.output
        r = runner.invoke(app, ["status", "--socket", d.endpoint], env=env)
        assert r.exit_code == 0, r.output
        text = " ".join(r.output.split())
        assert "retune at" in text and "first ask: nothing to re-tune" in text, text
        assert "EP 16 over 2 node(s)" in text, text
        r = runner.invoke(app, ["status", "--socket", d.endpoint, "--json"], env=env)
        assert r.exit_code == 0, r.output
        [kept] = json.loads(r.stdout)["retune_refusals"]
        assert kept["reason"] == "first ask" and "EP 16 over 2 node(s)" in kept["left_out"][0], kept
    finally:
        d.stop()


def test_status_shows_what_a_job_s_retune_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from moetune.tuner.cli import app, query

    job = wire.JobInfo(id=3, state="queued", reason="asked", left_out=["1 key(s) of EP 16 over 2 node(s) not x"])
    st = wire.StatusResult(
        epoch="e", daemon_version="1", pid=42, uptime_s=3.0, db="/x/m.db", endpoint="ipc:///x/d.sock",
        pub_endpoint="ipc:///x/e.sock", version=7, fingerprint="f" * 16, last_discovery="t", last_discovery_ok=True,
        last_discovery_message="", profiles_current=3, profiles_stale=0, requests=5,
        jobs=wire.JobsInfo(queued=[job], running=None, recent=[], capacity=4))
    monkeypatch.setattr(query, "daemon_call", lambda *a, **kw: st)
    r = CliRunner().invoke(app, ["status"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "job 3" in text and "left out of it: 1 key(s) of EP 16 over 2 node(s) not x" in text, text


def test_retune_help_says_status_lists_them() -> None:
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    r = CliRunner().invoke(app, ["retune", "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "`moetune status` still lists them" in text and "serves another node's capture" in text, text
