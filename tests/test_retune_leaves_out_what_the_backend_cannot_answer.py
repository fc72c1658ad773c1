"""`moetune retune` leaves out the keys the configured [tune] backend cannot answer on this node, and names them.

Since 2d91c73 the daemon's re-tune planning (handlers.retune_keys) also plans this fingerprint's current keys none of
whose rows a lookup serves: what-if rows (a proxy profile of 2 nodes, nvlink beyond the node's GPUs). With [tune]
backend = "local" the job refuses such a key (retune.local_refusal: it measures on this one node only), so every
`retune` queued a job that could only fail, where it said "nothing to re-tune" before. The planning now asks the
job's own refusal (retune.key_refusals): such keys are left out and named in the reply; the model backend still
re-tunes them where the family it tunes (its calibrated model's) can serve the key's group, and leaves them out where
it could only store another what-if row (planned again by every `retune`); a request whose every asked-for key is
refused is not queued and says why. A fabric change's
automatic re-tune is unchanged: its job names the keys that stay stale (tests/test_daemon_local_retune.py)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.daemon.handlers import run_retune
from moetune.tuner.daemon.index import ProfileIndex
from moetune.tuner.daemon.retune import tuner_retune
from moetune.tuner.daemon.server import TuneSettings

pytestmark = pytest.mark.timeout(120)

QWEN = (2048, 768, 128, 8)


def _key(fp: str, *, family: str = "nvlink", ep: int = 8, nodes: int = 1, bucket: int = 64) -> ProfileKey:
    return ProfileKey(fingerprint=fp, software="sw", transport_family=family, ep_size=ep, nodes=nodes, hidden=QWEN[0],
                      intermediate=QWEN[1], experts=QWEN[2], topk=QWEN[3], dtype="bfloat16", token_bucket=bucket)


def _rec(k: ProfileKey, backend: str = "local:nccl") -> ProfileRecord:
    prov = "measured" if backend.startswith("local:") else "node_model"
    return ProfileRecord(key=k, knobs=default_knobs(k.transport_family.split(":")[0]), latency_us=5.0,
                         spread_us=0.1, backend=backend, provenance=prov, measured_on=k.fingerprint)  # type: ignore[arg-type]


def _what_if(fp: str, **kw: Any) -> ProfileRecord:
    """A model tune's proxy profile of 2 nodes (autoload passes it over: no lookup serves it)."""
    return _rec(_key(fp, family="proxy:ibrc", **{"ep": 16, "nodes": 2, **kw}), backend=f"model:node:{fp}")


class _Jobs:
    """The job manager as run_retune sees it: the default re-tune, submit recorded."""

    def __init__(self) -> None:
        self.retune = tuner_retune
        self.submitted: list[list[ProfileKey]] = []
        self.capacity = 8

    def submit(self, *, keys: list[ProfileKey], **kw: Any) -> Any:
        self.submitted.append(list(keys))
        self.left_out = kw.get("left_out")
        info = wire.JobInfo(id=len(self.submitted), state="queued", reason="t", keys=len(keys))
        return SimpleNamespace(id=len(self.submitted), info=lambda **_kw: info)


def _daemon(records: list[ProfileRecord], stale: list[ProfileRecord], *, backend: str = "local", gpus: int = 8,
            tmp: Path | None = None) -> Any:
    facts = F.FakeFacts({"gpu_count": gpus, "name": "node"})
    facts.fingerprint = "fp"  # the records' fingerprint
    facts.software_hash = "sw"
    tune = TuneSettings(backend=backend, trials=1, node_model_dir=str(tmp) if tmp else None)
    return SimpleNamespace(index=ProfileIndex(records, version=1, facts=facts, stale=stale), facts=facts, tune=tune,
                           jobs=_Jobs(), store=SimpleNamespace(path=str((tmp or Path("/nonexistent")) / "m.db")),
                           retune_refusals=collections.deque(maxlen=wire.RETUNE_REFUSALS_KEPT))


def _ask(d: Any, **kw: Any) -> tuple[bool, Any]:
    return run_retune(d, wire.Retune(v=wire.PROTOCOL_VERSION, id=1, reason="t", **kw))


def test_a_local_retune_of_only_what_if_keys_it_cannot_measure_says_nothing_to_re_tune_and_names_them() -> None:
    """Current keys whose only rows are what-if ones, of 2 nodes and of more ranks than the node has GPUs: no job
    (it failed as impossible, every time), "nothing to re-tune" as before 2d91c73, each group named with why."""
    d = _daemon([_what_if("fp"), _rec(_key("fp", ep=16, bucket=1024), backend="model:node:fp")], [])
    ok, res = _ask(d)
    assert ok and res.job is None and not d.jobs.submitted, res
    assert res.message.startswith("nothing to re-tune"), res.message
    assert "EP 16 over 2 node(s)" in res.message and "EP 16 over 1 node(s)" in res.message, res.message
    assert "this node has 8" in res.message and "spans 2 nodes" in res.message, res.message
    assert 'backend = "model"' in res.message, res.message  # what would answer them
    assert len(res.left_out) == 2 and any("qwen" in x or "2048" in x for x in res.left_out), res.left_out


def _node_model(directory: Path, fingerprint: str, family: str, base: str = "ndr-ibrc-h100x8") -> Path:
    """This node's calibrated model (as F.write_node_model) of family `family`: what a model re-tune tunes here."""
    from dataclasses import replace

    from moetune.tuner.fabric_model.presets import load_preset

    preset = load_preset(base)
    path = directory / f"node-{fingerprint}.toml"
    path.write_text(replace(preset, family=family,
                            calibration={**preset.calibration, "fingerprint": fingerprint}).to_toml())
    return path


def test_the_model_backend_still_re_tunes_them_where_its_family_serves_the_group(tmp_path: Path) -> None:
    """A node model of family collective (which the runtime runs across nodes at any size): its re-tune of the
    what-if key's group (EP 16 over 2 nodes) stores a profile a lookup serves, so the key is queued."""
    d = _daemon([_what_if("fp")], [], backend="model", tmp=tmp_path)
    _node_model(tmp_path, "fp", "collective")
    ok, res = _ask(d)
    assert ok and res.job is not None and d.jobs.submitted == [[_what_if("fp").key]], res
    assert res.left_out == [] and "leaves out" not in res.message, res.message


def test_the_model_backend_leaves_out_a_key_its_family_can_only_give_another_what_if_row(tmp_path: Path) -> None:
    """The model re-tunes its calibrated family only (`node_model`): with a node model of family nvlink (this node's
    NVLink box), the what-if key of EP 16 over 2 nodes could only get another nvlink row beyond the runtime (more than
    8 ranks, across nodes): never served, so every `retune` planned the key again and queued a job that repeated
    itself. It is left out by the job's own rule (`key_refusals`), with why, and nothing is queued."""
    d = _daemon([_what_if("fp")], [], backend="model", tmp=tmp_path)
    F.write_node_model(tmp_path, "fp")  # nvlink-h200x2: family nvlink
    ok, res = _ask(d)
    assert ok and res.job is None and not d.jobs.submitted, res
    assert res.message.startswith("nothing to re-tune"), res.message
    assert "EP 16 over 2 node(s)" in res.message and "tunes family nvlink" in res.message, res.message
    assert "what-if" in res.message and "at most 8 ranks" in res.message, res.message
    assert len(res.left_out) == 1, res.left_out
    # a group the family serves is still queued beside it (EP 2 on this node: nvlink's own)
    stale = _rec(_key("old", ep=2, bucket=4096))
    d = _daemon([_what_if("fp")], [stale], backend="model", tmp=tmp_path)
    ok, res = _ask(d)
    assert ok and d.jobs.submitted == [[stale.key]], res
    assert "leaves out 1 key(s)" in res.message and "tunes family nvlink" in res.message, res.message


def test_a_host_staged_node_model_leaves_out_groups_across_nodes() -> None:
    """The rule is the runtime's (`family_refusal`: what `runtime_refusal` says of every row of the family): a
    host_staged model serves a group of one host at any size, never one across nodes; collective serves both; the
    local backend's refusals are its own (unchanged)."""
    from moetune.tuner.daemon.retune import key_refusals

    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    one, two = _key("fp", family="host_staged", ep=8), _key("fp", family="host_staged", ep=8, nodes=2)
    refused = key_refusals([one, two], facts, "model", "host_staged")
    assert [r.keys for r in refused] == [[two]], refused
    assert "host_staged serves the ranks of one node" in refused[0].said() and not refused[0].measuring
    assert key_refusals([one, two], facts, "model", "collective") == []
    assert key_refusals([one, two], facts, "model") == []  # the family not known (no node model): the job says so
    assert [r.keys for r in key_refusals([one, two], facts, "local", "host_staged")] == [[two]]


def _fabric_change_job(store: Any, facts: Any, key: ProfileKey, tune: TuneSettings, *, timeout: float,
                       **kw: Any) -> Any:
    """The finished job of a fabric change's re-tune of `key` (a JobManager of `tune`, run until it ends)."""
    from moetune.tuner.daemon.jobs import JobManager

    done: list = []
    jm = JobManager(store=store, facts_fn=lambda: facts, retune=tuner_retune, on_done=lambda j, w: done.append(j),
                    tune=tune, **kw)
    jm.start()
    try:
        jm.submit(reason="fabric changed", old_fingerprint="old", keys=[key])
        F.until(lambda: bool(done), timeout=timeout)
    finally:
        jm.stop()
    return done[0]


def test_a_model_job_refuses_such_keys_too_and_says_why(tmp_path: Path) -> None:
    """One rule for the reply and the job: a fabric change's model re-tune of only such keys fails as impossible
    naming them (they stay stale) instead of storing another what-if row."""
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node", "transports": ["proxy:ibrc", "collective"]})
    _node_model(tmp_path, facts.fingerprint, "proxy:ibrc")  # a NIC model: it predicts EP 16 over 2 nodes
    job = _fabric_change_job(store, facts, _key(facts.fingerprint, family="proxy:ibrc", ep=16, nodes=2),
                             TuneSettings(backend="model", trials=1, node_model_dir=str(tmp_path)), timeout=30.0)
    assert job.state == "failed" and job.impossible, job.message
    assert "EP 16 over 2 node(s) not re-tuned" in job.message and "tunes family proxy:ibrc" in job.message, job.message
    assert "spans 2 nodes" in job.message or "at most 8 ranks" in job.message, job.message
    assert store.list_profiles(status="current") == [], "no what-if row was stored"


def test_a_mixed_plan_queues_what_the_backend_can_answer_and_names_the_rest() -> None:
    stale = _rec(_key("old", ep=8, bucket=4096))
    d = _daemon([_what_if("fp")], [stale])
    ok, res = _ask(d)
    assert ok and res.job is not None and d.jobs.submitted == [[stale.key]], res
    assert "queued job 1 for 1 key(s)" in res.message and "leaves out 1 key(s)" in res.message, res.message
    # named in the message only: beside a queued job a field a client one version older does not know would make it
    # say the retune failed (and its user queue the job again)
    assert res.left_out == [] and "EP 16 over 2 node(s)" in res.message, res
    assert b"left_out" not in wire.encode_ok(1, "e", res), res


def test_a_request_whose_every_stale_key_is_refused_is_not_queued_and_says_why() -> None:
    """A stale key the local backend cannot measure: the job could only fail as impossible; refused up front, as a
    model re-tune without a node model is (test_trust_daemon)."""
    d = _daemon([], [_rec(_key("old", family="collective", ep=16, nodes=2))])
    ok, res = _ask(d)
    assert not ok and not d.jobs.submitted, res
    code, msg = res
    assert code == wire.E_NOT_FOUND and msg.startswith("not queued") and "EP 16 over 2 node(s)" in msg, msg
    assert 'backend = "model"' in msg, msg
    # --all asks for every current key by name: the same refusal
    d = _daemon([_what_if("fp")], [])
    ok, (code, msg) = _ask(d, all=True)
    assert not ok and code == wire.E_NOT_FOUND and "not queued" in msg and not d.jobs.submitted, msg


def test_a_what_if_key_of_a_family_the_local_backend_does_not_take_is_still_planned_where_its_group_fits() -> None:
    """An ibgda key (no runtime transport; the local backend does not take the family: 5753dab) at EP 8 on this
    8-GPU node: the job re-tunes a key's EP group over the node's families (never the key's family alone), so a
    measurement answers it with a served profile of another family; it is not left out."""
    ibgda = _rec(_key("fp", family="ibgda", ep=8), backend="model:node:fp")
    d = _daemon([ibgda], [])
    ok, res = _ask(d)
    assert ok and d.jobs.submitted == [[ibgda.key]] and res.left_out == [], res


def test_a_retune_reply_without_left_out_keys_is_what_an_older_client_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A field at its default is left off the wire (wire.py): a client one version older refuses unknown fields."""
    from moetune.runtime.profiles.errors import BadReply
    from moetune.runtime.profiles.replies import decode_reply, decode_result

    res = wire.RetuneResult(job=None, message="nothing to re-tune: x")
    assert set(msgspec.json.decode(msgspec.json.encode(res))) == {"job", "message"}
    said = wire.encode_ok(1, "e", wire.RetuneResult(job=None, message="m", left_out=["a"]))
    assert decode_result("retune", decode_reply(said).result).left_out == ["a"]
    older = msgspec.defstruct("RetuneResult", [("job", wire.JobInfo | None), ("message", str)], kw_only=True)
    monkeypatch.setitem(wire.RESULT_TYPES, "retune", older)
    assert decode_result("retune", decode_reply(wire.encode_ok(1, "e", res)).result).message == res.message
    with pytest.raises(BadReply, match="unknown fields left_out"):  # says something it cannot show: said so
        decode_result("retune", decode_reply(said).result)


def test_retune_help_says_what_is_left_out() -> None:
    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    r = CliRunner().invoke(app, ["retune", "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "left out" in text and "cannot answer" in text, text


def test_the_cli_prints_the_left_out_keys(tmp_path: Path) -> None:
    """End to end: a daemon with [tune] backend = "local" and only a what-if current key of 2 nodes."""
    from typer.testing import CliRunner

    from moetune.tuner.cli import app
    from moetune.tuner.daemon.server import Daemon

    facts = F.FakeFacts({"gpu_model": "H200", "gpu_count": 8})
    store = F.open_store(tmp_path / "moetune.db")
    k = ProfileKey(**{**_what_if("x").key.to_dict(), "fingerprint": facts.fingerprint,
                      "software": facts.software_hash})
    ok, why = store.put_profile(_rec(k, backend=f"model:node:{facts.fingerprint}"))
    assert ok, why
    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=lambda: facts,
               rediscover_interval_s=0, tune=TuneSettings(backend="local", trials=1)).start(background=True)
    try:
        F.until(lambda: d.index.fingerprint == facts.fingerprint)
        r = CliRunner().invoke(app, ["retune", "--socket", d.endpoint], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert "nothing to re-tune" in r.output and "EP 16 over 2 node(s)" in r.output, r.output
        assert not d.jobs.info()[0] and d.jobs.info()[1] is None
    finally:
        d.stop()


def test_a_fabric_change_s_job_of_only_keys_it_refuses_says_so_without_waiting_for_idle_gpus(tmp_path: Path) -> None:
    """A fabric change's automatic re-tune still queues its keys and names those that stay stale. A job every key of
    which the local re-tune refuses measures nothing: it waited for the GPUs to be idle first (where no probe can
    tell, for good: `status` showed it "deferred", checked again every 300 s) and never said why its keys stay
    stale. It ends at once, failed as impossible, naming them."""
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    job = _fabric_change_job(store, facts, _key(facts.fingerprint, family="collective", ep=16, nodes=2),
                             TuneSettings(backend="local", trials=1, busy_retry_s=300), timeout=10.0,
                             gpu_probe=lambda: (None, "no NVML, no nvidia-smi (test)"))
    assert job.state == "failed" and job.impossible, job.message
    assert "EP 16 over 2 node(s) not re-measured" in job.message and "stay stale" in job.message, job.message
    assert not [e for e in store.list_events(limit=50) if e["kind"] == "job_deferred"]


def test_a_retune_reply_this_client_cannot_read_says_the_job_may_be_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer daemon's retune reply with a field this client does not know (left_out, to a client one version older)
    is BadReply, yet the daemon answered: it queued the job (or cancelled it) first. Said as a timeout says it (check
    `moetune status` before retrying), not as a plain failure whose retry queues a second job."""
    from typer.testing import CliRunner

    from moetune.runtime.profiles.errors import BadReply
    from moetune.tuner.cli import app, query

    class _Client:
        endpoint = "ipc:///nonexistent/daemon.sock"

        def request(self, op: str, **_kw: Any) -> Any:
            raise BadReply(f"{op} result has unknown fields left_out (a newer daemon?)")

        def close(self) -> None:
            pass

    monkeypatch.setattr(query, "make_client", lambda *a, **kw: _Client())
    r = CliRunner().invoke(app, ["retune", "--socket", _Client.endpoint], env={"COLUMNS": "400"})
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    assert "unknown fields left_out" in text and "may still have been queued" in text, text
    assert "`moetune status` lists the queued and running jobs" in text, text


def test_a_refusal_of_many_keys_still_says_every_group_and_what_answers_them_within_an_error_s_length() -> None:
    """An error's message is cut at wire.ERROR_MESSAGE_MAX characters (encode_error): "not queued" naming every
    shape and bucket of several refused groups ran past it, and the cut took the later groups and the advice (what
    would answer them) with it. Each group is said, and the advice, within the limit."""
    groups = [(16, 2), (32, 4), (64, 8), (16, 1)]  # (16, 1): more ranks than the node's 8 GPUs
    stale = [_rec(_key("old", family="collective", ep=ep, nodes=n, bucket=1 << b)) for ep, n in groups
             for b in range(15)]
    ok, res = _ask(_daemon([], stale))
    assert not ok, res
    code, msg = res
    said = msg[:wire.ERROR_MESSAGE_MAX]  # what the client gets
    assert code == wire.E_NOT_FOUND and said.startswith("not queued"), said
    for ep, n in groups:
        assert f"EP {ep} over {n} node(s)" in said, (ep, n, said)
    assert 'backend = "model"' in said, said


def test_a_stale_megakernel_key_of_another_dtype_is_refused_as_the_store_refuses_its_profiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A megakernel key of dtype float16 (an older moetune's import): no profile of it can be stored (the store's
    `megakernel_key_problem`), yet key_refusals checked only the group (EP 1, 1 node), so `retune` queued a job that
    waited for idle GPUs and had every trial refused ("the megakernel runs bfloat16 activations"). Now refused by the
    one rule, and named."""
    from moetune.tuner.daemon import retune

    monkeypatch.setattr(retune, "megakernel_refusal", lambda facts, backend: "")  # a node that can measure it
    fp16 = ProfileKey(fingerprint="old", software="sw", transport_family="megakernel", ep_size=1, nodes=1,
                      hidden=QWEN[0], intermediate=QWEN[1], experts=QWEN[2], topk=QWEN[3], dtype="float16",
                      token_bucket=64)
    bf16 = ProfileKey(**{**fp16.to_dict(), "dtype": "bfloat16"})
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    refused = retune.key_refusals([fp16, bf16], facts, "local")
    assert [r.keys for r in refused] == [[fp16]], refused
    assert "dtype float16" in refused[0].said() and "bfloat16 only" in refused[0].said(), refused[0].said()
    stale = ProfileRecord(key=fp16, knobs=default_knobs("collective").replace(engine="megakernel"), latency_us=5.0,
                          spread_us=0.1, backend="local:megakernel", provenance="measured", measured_on="old")
    d = _daemon([], [stale])
    ok, res = _ask(d)
    assert not ok and not d.jobs.submitted, res
    assert "dtype float16" in res[1], res
