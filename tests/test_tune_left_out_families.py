"""A transport family left out of a tune because its transport cannot serve the EP group (`BenchmarkBackend.
group_problem`: the runtime's `group_world_problem` for a local tune) is reported where the tune reports, not only
in a log line: `moetune tune`'s table and each --json row (`left_out`, a list of `{"family", "reason"}`), and
`moetune profile`'s output, summary (--json `left_out`, with the EP size) and report."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import group_world_problem

CAPTURES = Path(__file__).resolve().parent / "captures"
# the runtime's own words for nvlink at 16 ranks: what every report must say (not a copy of its text)
NVLINK_16 = group_world_problem("nvlink", 16)
assert NVLINK_16  # the bound this file is about: nvlink serves at most MAX_WORLD (8) ranks


def _fake_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's local backend replaced by a fake that launches no rank (a trial measures 10 + pipeline_depth) but
    asks the local backend's own refusal and group bound, as check_tune asks them; 16 CUDA GPUs "found" here."""
    import moetune.tuner.search.tune as search
    from moetune.tuner.search import local_backend
    from moetune.tuner.search.local_backend import LocalBackend

    def make(backend: Any, preset: Any = None, **kw: Any) -> Any:
        if not isinstance(backend, str):  # the one the daemon's re-tune built (its group's), handed to the search
            return backend
        fake = F.measuring_fake(lambda k, w: 10.0 + k.pipeline_depth, name="local:fake")
        fake.world, fake.comm_backend = kw["world"], kw.get("comm_backend", "nccl")
        fake.refusal = types.MethodType(LocalBackend.refusal, fake)
        fake.group_problem = types.MethodType(LocalBackend.group_problem, fake)
        return fake

    monkeypatch.setattr(search, "make_backend", make)
    monkeypatch.setattr(local_backend, "cuda_gpus", lambda: 16)


def _tune(tmp_path: Path, *extra: str) -> Any:
    from moetune.tuner.cli import app

    return CliRunner().invoke(app, ["tune", "--backend", "local", "--capture", str(CAPTURES / "dgx-h100"), "-m",
                                    "qwen3-30b", "--tokens", "16", "--trials", "2", "--ep-size", "16", "--world", "16",
                                    "--family", "nvlink", "--family", "collective", "--db", str(tmp_path / "p.db"),
                                    *extra], env={"MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "300"})


@pytest.mark.usefixtures("on_captured_node")  # as on the captured node: a local tune of it measures
def test_tune_lists_the_families_it_left_out_in_its_table_and_json(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_local(monkeypatch)
    r = _tune(tmp_path)
    assert r.exit_code == 0, r.output
    table = " ".join(r.stdout.split())  # on stdout with the table: not only the log's line on stderr
    assert "tuned profiles" in table, table
    assert f"family nvlink left out: it cannot serve EP size 16 on 1 node(s): {NVLINK_16}" in table, table

    r = _tune(tmp_path, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["family"] for row in rows] == ["collective"], rows
    assert all(row["left_out"] == [{"family": "nvlink", "reason": NVLINK_16}] for row in rows), rows


@pytest.mark.usefixtures("on_captured_node")
def test_a_tune_that_leaves_nothing_out_says_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_local(monkeypatch)
    r = _tune(tmp_path, "--ep-size", "8", "--world", "8", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert sorted(row["family"] for row in rows) == ["collective", "nvlink"], rows
    assert all(row["left_out"] == [] for row in rows), rows
    r = _tune(tmp_path, "--ep-size", "8", "--world", "8")
    assert "left out" not in r.stdout, r.stdout


# -- moetune profile (bring-up) ---------------------------------------------------------------------------------------
# a stand-in for `moetune bench ep --json` (no ranks): every setting measures the same
FAKE_BENCH = r'''
import json
t = 20.0
print(json.dumps({"dispatch_us": {"median": t, "p10": t - 0.1, "p90": t + 0.1},
                  "combine_us": {"median": t, "p10": t - 0.1, "p90": t + 0.1},
                  "roundtrip_us": {"median": 2 * t, "p10": 2 * t - 0.1, "p90": 2 * t + 0.1},
                  "layer_us": {"median": 3 * t, "p10": 3 * t - 0.1, "p90": 3 * t + 0.1}, "max_rel_err": 0.0}))
'''


@pytest.fixture
def sixteen_gpu_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as ON a node of 16 H100s (the dgx-h100 capture's GPUs twice: nvlink, proxy:ibrc, ibgda, host_staged,
    collective), whose EP 16 runs go to the fake bench; the megakernel timed by a stand-in, no microbenchmarks."""
    import msgspec

    from moetune.tuner.bringup import flow
    from moetune.tuner.fabric import discovery
    from moetune.tuner.search import local_backend
    from moetune.tuner.search.local_backend import LocalBackend

    real = discovery.discover
    base = real(CAPTURES / "dgx-h100")
    more = [msgspec.structs.replace(g, index=g.index + 8, uuid=f"{g.uuid}-b", serial=f"{g.serial}-b",
                                    pci_bus_id=f"{g.pci_bus_id}-b") for g in base.gpus]
    node = msgspec.structs.replace(base, gpus=[*base.gpus, *more])
    assert node.gpu_count == 16 and {"nvlink", "collective"} <= {t.name for t in node.transports}
    monkeypatch.setattr(discovery, "discover", lambda capture=None, **kw: node)
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: node)
    monkeypatch.setattr(local_backend, "cuda_gpus", lambda: 16)
    bench = tmp_path / "fake_bench.py"
    bench.write_text(FAKE_BENCH)

    def backend(self: Any, world: int = 0) -> LocalBackend:
        return LocalBackend(world=world, comm_backend=self.comm_backend, repeats=1, timeout_s=30, metric="comm",
                            command=[sys.executable, str(bench)], verify_compression=False)

    init = flow.Bringup.__init__

    def with_fake_kernel(self: Any, **kw: Any) -> None:
        init(self, **kw, mk_measure=lambda k, w: {"graph_us": [300.0, 303.0, 297.0], "eager_us": [301.0] * 3})

    monkeypatch.setattr(flow.Bringup, "__init__", with_fake_kernel)
    monkeypatch.setattr(flow.Bringup, "_backend", backend)
    monkeypatch.setattr(flow.Bringup, "stage_microbench", lambda self: [])


def _profile(tmp_path: Path, *extra: str) -> Any:
    from moetune.tuner.cli import app

    plan = tmp_path / "plan.toml"
    plan.write_text("[plan]\nmodels = [\"qwen3-30b\"]\ntokens = [16]\ntrials = 2\nrepeats = 1\niters = 5\n"
                    "compare_rounds = 1\nep_sizes = [16]\n")
    db = tmp_path / "home" / "moetune.db"
    db.parent.mkdir(exist_ok=True)
    return CliRunner().invoke(app, ["profile", "--plan", str(plan), "--capture", str(CAPTURES / "dgx-h100"), "--db",
                                    str(db), *extra], env={"COLUMNS": "400", "MOETUNE_HOME": str(tmp_path / "home")})


@pytest.mark.usefixtures("sixteen_gpu_node")
def test_profile_reports_the_families_it_left_out_of_an_ep_size(tmp_path: Path) -> None:
    from moetune.runtime.knobs import group_world_problem

    proxy_16 = group_world_problem("proxy", 16)
    r = _profile(tmp_path)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    nvlink = f"family nvlink left out: it cannot serve EP size 16 on 1 node(s): {NVLINK_16}"
    proxy = f"family proxy:ibrc left out: it cannot serve EP size 16 on 1 node(s): {proxy_16}"
    assert nvlink in said and proxy in said, said
    summary = said.split("tuned profiles")[-1]  # the summary after the table says it too, not only the tune stage
    assert nvlink in summary and proxy in summary, summary
    report = " ".join((tmp_path / "home" / "report" / "report.md").read_text().split())
    assert nvlink in report and proxy in report, report
    # the rest of the node's families were tuned at EP 16
    assert "collective" in summary and "host_staged" in summary, summary

    # --json of the resumed run: as the tune stage recorded it
    r = _profile(tmp_path, "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["left_out"] == [{"ep_size": 16, "family": "nvlink", "reason": NVLINK_16},
                               {"ep_size": 16, "family": "proxy:ibrc", "reason": proxy_16}], got["left_out"]
    assert {p["family"] for p in got["profiles"] if p.get("ep_size") == 16} == {"collective", "host_staged"}, got


# -- the daemon's re-tune ---------------------------------------------------------------------------------------------
def test_a_local_retune_says_the_families_it_left_out_of_a_group_in_the_job(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale key of EP 16 on a 16-GPU node, re-tuned locally over the node's families: nvlink cannot serve the
    group and is left out by the tune's plan; the job says so in the tune's words (it was in the daemon's log only),
    once however many shapes the group has, and the rest of the group is re-tuned."""
    from moetune.runtime.profile_record import ProfileKey
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.daemon.jobs import Job, JobContext
    from moetune.tuner.daemon.retune import tuner_retune
    from moetune.tuner.daemon.server import TuneSettings
    from moetune.tuner.search.tune import group_left_out_note

    _fake_local(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 16, "name": "node16", "transports": ["nvlink", "collective"]})
    keys = [ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                       ep_size=16, nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts,
                       topk=m.topk, dtype=m.dtype, token_bucket=64) for m in (MODELS["qwen3-30b"], MODELS["gpt-oss-120b"])]
    job = Job(1, reason="test", old_fingerprint="old", keys=keys)
    written = tuner_retune(JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=1)))
    assert job.refused == [group_left_out_note("nvlink", NVLINK_16, 16, 1)], job.refused
    assert {(r.key.transport_family, r.key.ep_size) for r in written} == {("collective", 16)}, written


def test_a_model_retune_refuses_such_a_group_with_the_tune_s_bound() -> None:
    """With [tune] backend = "model" of an nvlink node model the group is refused before the job tunes it
    (`key_refusals`): the bound it names is the one `moetune tune --backend model` leaves the family out with."""
    from moetune.runtime.profile_record import ProfileKey
    from moetune.tuner.daemon.retune import key_refusals
    from moetune.tuner.search.model_backend import ModelBackend

    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                     ep_size=16, nodes=1, hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16",
                     token_bucket=64)
    tune_says = ModelBackend("nvlink-h200x2").group_problem("nvlink", ep_size=16, nodes=1)
    assert tune_says == NVLINK_16
    (refusal,) = key_refusals([key], facts, "model", "nvlink")
    assert refusal.why.endswith(f"never served: {tune_says}"), refusal.why


def test_the_left_out_family_s_stale_key_is_answered_by_its_group_and_not_planned_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stale key of the family left out (nvlink at EP 16, a what-if row of the old fabric) never gets a profile of
    its own family, but is no job that can only repeat itself: a key is planned by `tuning_key` (its group, shape and
    bucket, no transport family), which the group's new collective profile serves. After the job neither a user's
    `retune` (`handlers.retune_keys`) nor the next fabric change (`watch.retune_keys`) plans it again; its row stays
    listed as stale history, as every re-tuned key's old row does, and the job's message says why nvlink got none."""
    from moetune.runtime.profile_record import ProfileKey
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.daemon.handlers import retune_keys as user_retune_keys
    from moetune.tuner.daemon.index import ProfileIndex, read_profiles
    from moetune.tuner.daemon.jobs import Job, JobContext
    from moetune.tuner.daemon.retune import served_tuning_keys, tuner_retune
    from moetune.tuner.daemon.server import TuneSettings
    from moetune.tuner.daemon.watch import retune_keys as change_retune_keys
    from moetune.tuner.search.tune import group_left_out_note

    _fake_local(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    old = F.FakeFacts({"gpu_count": 16, "name": "node16", "transports": ["nvlink", "collective"], "gpu_model": "H200"})
    facts = F.FakeFacts({"gpu_count": 16, "name": "node16", "transports": ["nvlink", "collective"]})
    m = MODELS["qwen3-30b"]
    stale_key = ProfileKey(fingerprint=old.fingerprint, software=old.software_hash, transport_family="nvlink",
                           ep_size=16, nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts,
                           topk=m.topk, dtype=m.dtype, token_bucket=64)
    # nvlink at EP 16 is no run's: only a model's what-if row of it can be stored
    assert store.put_profile(F.make_record(stale_key, backend=f"model:node:{old.fingerprint}"))[0]
    store.mark_stale(fingerprint=old.fingerprint, reason="fabric changed: test")

    def index() -> ProfileIndex:
        return ProfileIndex(read_profiles(store, status="current"), version=0, facts=facts,
                            stale=read_profiles(store, status="stale"))

    assert user_retune_keys(index(), all_current=False) == [stale_key]  # planned once: no current profile of it
    job = Job(1, reason="test", old_fingerprint=old.fingerprint, keys=[stale_key])
    job_ctx = JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=1))
    written = tuner_retune(job_ctx)
    assert {(r.key.transport_family, r.key.ep_size, r.key.token_bucket) for r in written} == {("collective", 16, 64)}
    assert job.refused == [group_left_out_note("nvlink", NVLINK_16, 16, 1)], job.refused

    # not planned again: by a user's retune, nor by the next fabric change (its rows made stale, or the fingerprint's)
    assert user_retune_keys(index(), all_current=False) == []
    have = served_tuning_keys(r for _, r in store.list_profiles(status="current", fingerprint=facts.fingerprint))
    stale_rows = store.list_profiles(status="stale")
    assert change_retune_keys([r for _, r in stale_rows], stale_rows, have) == {}
    # its row is history, listed as stale as the old fabric's rows are; nothing of it was lost
    assert [(r.key.transport_family, r.status) for _, r in stale_rows] == [("nvlink", "stale")]


def test_a_job_stopped_after_the_group_with_a_left_out_family_is_not_resumed_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon stopped (kill -9) after its re-tune wrote the EP 16 group whose nvlink key the tune left out: the
    group's collective profile answers the key (the planner's rule, `tuning_key`), so the next start does not resume
    the job to re-tune the group once more. Recovery asked for an nvlink profile of its own, which never comes."""
    from moetune.runtime.profile_record import ProfileKey
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.daemon import recovery as R
    from moetune.tuner.daemon.jobs import Job, JobContext
    from moetune.tuner.daemon.retune import tuner_retune
    from moetune.tuner.daemon.server import TuneSettings

    _fake_local(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 16, "name": "node16", "transports": ["nvlink", "collective"]})
    m = MODELS["qwen3-30b"]
    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                     ep_size=16, nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts,
                     topk=m.topk, dtype=m.dtype, token_bucket=64)
    # the job's started event as the daemon writes it, then the job ran to its last profile and the daemon died
    store.add_event(kind="job_started", reason="job 1", details={
        "job_id": 1, "keys": [key.to_dict()], "fingerprint": facts.fingerprint, "software": facts.software_hash})
    job = Job(1, reason="test", old_fingerprint="old", keys=[key])
    written = tuner_retune(JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=1)))
    assert {r.key.transport_family for r in written} == {"collective"}, written

    resume, _ = R.recover_jobs(store)
    assert resume == [], resume  # nothing left to re-tune: not the group once more
    (closed,) = store.list_events(10, kinds=("job_finished",))
    assert "nothing left to resume" in closed["reason"], closed


def _nvlink_key(facts: Any, ep: int) -> Any:
    from moetune.runtime.profile_record import ProfileKey
    from moetune.runtime.shapes import MODELS

    m = MODELS["qwen3-30b"]
    return ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                      ep_size=ep, nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts,
                      topk=m.topk, dtype=m.dtype, token_bucket=64)


def test_a_group_no_family_can_serve_is_that_group_s_refusal_the_others_re_tuned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose only family is nvlink (fake facts: real discovery always lists collective) and stale keys of
    EP 8 and EP 16: the tune refuses EP 16 up front (no family considered can serve it), which failed the whole job
    (ValueError), the EP 8 group untuned with it. Now that one group is the job's refusal, in the tune's words, and
    EP 8 is re-tuned; a job of that group alone is impossible here, said as the job's reason."""
    from moetune.tuner.daemon.jobs import Job, JobContext
    from moetune.tuner.daemon.retune import RetuneImpossible, tuner_retune
    from moetune.tuner.daemon.server import TuneSettings
    from moetune.tuner.search.tune import NoFamilyServesGroup

    assert issubclass(NoFamilyServesGroup, ValueError)  # the CLI's `except ValueError` still says it
    _fake_local(monkeypatch)
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 16, "name": "node16", "transports": ["nvlink"]})
    job = Job(1, reason="test", old_fingerprint="old", keys=[_nvlink_key(facts, 16), _nvlink_key(facts, 8)])
    tune = TuneSettings(backend="local", trials=1)
    written = tuner_retune(JobContext(store=store, facts=facts, job=job, tune=tune))
    assert {(r.key.transport_family, r.key.ep_size) for r in written} == {("nvlink", 8)}, written
    (said,) = job.refused
    assert said.startswith("1 key(s) of EP 16 over 1 node(s) not re-tuned: no transport family considered (nvlink) "
                           f"can serve it: nvlink: {NVLINK_16}"), said
    assert "Nothing was tuned" not in said, said  # EP 8 was

    alone = Job(2, reason="test", old_fingerprint="old", keys=[_nvlink_key(facts, 16)])
    with pytest.raises(RetuneImpossible, match="not re-tuned: no transport family considered"):
        tuner_retune(JobContext(store=store, facts=facts, job=alone, tune=tune))


def test_recovery_resumes_a_family_the_group_can_serve_and_not_one_it_cannot() -> None:
    """After a kill, a key whose own family got no profile is still to do where that family can serve the group (EP 8:
    the job died between collective and nvlink, the nvlink tuning would be lost for good), and done where it cannot
    (EP 16: the group's collective profile answers it, nvlink's never comes)."""
    import msgspec

    from moetune.tuner.daemon import recovery as R
    from moetune.tuner.daemon.retune import tuning_key

    facts = F.FakeFacts({"gpu_count": 16, "name": "node16", "transports": ["nvlink", "collective"]})
    nv8, nv16 = _nvlink_key(facts, 8), _nvlink_key(facts, 16)
    coll8, coll16 = (msgspec.structs.replace(k, transport_family="collective") for k in (nv8, nv16))
    written = ({(*tuning_key(k), "collective") for k in (coll8, coll16)}, {tuning_key(coll8), tuning_key(coll16)})
    assert R._done(coll8.to_dict(), written) and R._done(coll16.to_dict(), written)
    assert not R._done(nv8.to_dict(), written)  # nvlink serves 8 ranks: its own profile is still to come
    assert R._done(nv16.to_dict(), written)  # past nvlink's ranks: answered by its group
    assert not R._done(nv16.to_dict(), (set(), set()))  # nothing written: to do
    assert not R._done({"ep_size": "x"}, written)  # unreadable: not done
