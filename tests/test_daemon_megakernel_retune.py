"""The daemon's re-tune of a megakernel key (family `megakernel`, EP 1 on one node: the whole MoE layer in one kernel
on one GPU, which `moetune profile` tunes on Hopper nodes). It is measured as the megakernel family with the
bring-up's megakernel backend, or refused (model backend, no Hopper GPU, no library) and left stale with the reason
in the job. Grouping keys by (EP size, nodes) only and calling tune_profiles without families would "re-tune" it by
tuning every transport family of the node at EP 1 (and with the model backend, the calibrated model's family at EP
1), never the megakernel. No GPU here: the megakernel's timing is injected."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, provenance_of_backend
from moetune.runtime.shapes import MODELS
from moetune.tuner.daemon import jobs as J
from moetune.tuner.daemon import retune as RT
from moetune.tuner.daemon.server import TuneSettings
from moetune.tuner.search.backends import TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend

# a local job of a GPU node's capture measures only on that node (`_capture_elsewhere`): run as on it, timings injected
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("on_captured_node")]
QWEN = MODELS["qwen3-30b"]
CAPTURES = Path(__file__).resolve().parent / "captures"


def _facts(name: str) -> Any:
    from moetune.tuner.fabric.discovery import discover

    return discover(CAPTURES / name)


def _key(facts: Any, family: str = "megakernel", ep: int = 1, nodes: int = 1, bucket: int = 128,
         fingerprint: str | None = None) -> ProfileKey:
    return ProfileKey(fingerprint=fingerprint or facts.fingerprint, software=facts.software_hash,
                      transport_family=family, ep_size=ep, nodes=nodes, hidden=QWEN.hidden,
                      intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype,
                      token_bucket=bucket)


def _stale_mk(store: Any, facts: Any, fingerprint: str = "oldfabric0000000") -> ProfileKey:
    """A megakernel profile of the node's previous fingerprint, made stale (what the watch leaves)."""
    store.upsert_fingerprint(fingerprint, {"old": True}, origin="local")
    key = _key(facts, fingerprint=fingerprint)
    rec = ProfileRecord(key=key, knobs=Knobs(engine="megakernel"), latency_us=300.0, spread_us=1.0,
                        backend="local:megakernel", provenance=provenance_of_backend("local:megakernel"))
    ok, why = store.put_profile(rec)
    assert ok, why
    store.mark_stale(fingerprint=fingerprint, reason="fabric changed (test)")
    return key


class Measure:
    """A GPU stand-in for the megakernel's timing: 16-row tiles are 30% faster; records the workloads it ran."""

    def __init__(self) -> None:
        self.workloads: list[TuneWorkload] = []

    def __call__(self, knobs: Knobs, wl: TuneWorkload) -> dict[str, list[float]]:
        self.workloads.append(wl)
        base = 300.0 * (0.7 if knobs.mk_bm == 16 else 1.0)
        return {"graph_us": [base, base + 1, base - 1], "eager_us": [base * 1.01] * 3}


@pytest.fixture
def mk_lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 'prebuilt library' for megakernel_refusal's check (the injected measurement never loads it)."""
    lib = tmp_path / "libmoetune_moe.so"
    lib.write_bytes(b"\x7fELF")
    monkeypatch.setenv("MOETUNE_MK_LIB", str(lib))
    return lib


def _inject(monkeypatch: pytest.MonkeyPatch, measure: Measure) -> list[Any]:
    made: list[Any] = []

    def backend(tune: Any) -> LocalBackend:
        be = LocalBackend(world=1, family="megakernel", repeats=1, mk_measure=measure)
        made.append(be)
        return be

    monkeypatch.setattr(RT, "megakernel_backend", backend)
    return made


def _manager(store: Any, facts: Any, done: list, *, backend: str = "local", probe: Any = None,
             node_model_dir: str | None = None) -> J.JobManager:
    return J.JobManager(store=store, facts_fn=lambda: facts, retune=RT.tuner_retune,
                        on_done=lambda j, w: done.append((j, w)),
                        tune=TuneSettings(backend=backend, trials=4, timeout_s=60, busy_retry_s=0.05,
                                          node_model_dir=node_model_dir),
                        gpu_probe=probe or (lambda: (False, "idle (test)")))


def _wait(done: list, timeout: float = 60.0) -> tuple[J.Job, list[ProfileRecord]]:
    deadline = time.monotonic() + timeout
    while not done and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done
    return done[0]


def _run_job(store: Any, facts: Any, keys: list[ProfileKey], **kw: Any) -> tuple[J.Job, list[ProfileRecord]]:
    done: list = []
    jm = _manager(store, facts, done, **kw)
    jm.start()
    try:
        jm.submit(reason="fabric changed (test)", old_fingerprint=keys[0].fingerprint, keys=keys)
        return _wait(done)
    finally:
        jm.stop()


def test_a_stale_megakernel_key_is_re_measured_as_the_megakernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    mk_lib: Path) -> None:
    measure = Measure()
    made = _inject(monkeypatch, measure)
    facts = _facts("h200x1")  # one H200: the node `moetune profile` tunes only the megakernel on
    store = F.open_store(tmp_path / "m.db")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    stale = _stale_mk(store, facts)
    job, written = _run_job(store, facts, [stale])
    assert job.state == "done", job.message
    assert job.refused == []
    assert made and measure.workloads and all(w.ep_size == 1 for w in measure.workloads)
    assert written and {(r.key.transport_family, r.key.ep_size, r.key.nodes) for r in written} == {("megakernel", 1, 1)}
    current = [r for _, r in store.list_profiles(status="current")]
    # only the megakernel was tuned: no transport family ('collective' on this node) at EP 1
    assert [(r.key.transport_family, r.key.fingerprint, r.key.token_bucket) for r in current] == [
        ("megakernel", facts.fingerprint, 128)]
    rec = current[0]
    assert rec.provenance == "measured" and rec.backend == "local:megakernel" and rec.knobs.engine == "megakernel"


def test_a_megakernel_key_tuned_under_zipf_is_re_measured_under_zipf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     mk_lib: Path) -> None:
    """Its profile's routing, as for an EP key, not uniform routing for every re-tune (which would bring the key back
    as a uniform profile)."""
    measure = Measure()
    _inject(monkeypatch, measure)
    facts = _facts("h200x1")
    store = F.open_store(tmp_path / "m.db")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    fp = "oldfabric0000000"
    store.upsert_fingerprint(fp, {"old": True}, origin="local")
    rec = ProfileRecord(key=_key(facts, fingerprint=fp), knobs=Knobs(engine="megakernel"), latency_us=300.0,
                        spread_us=1.0, backend="local:megakernel", routing="zipf:1.2",
                        provenance=provenance_of_backend("local:megakernel"))
    assert store.put_profile(rec)[0]
    store.mark_stale(fingerprint=fp, reason="fabric changed (test)")
    job, written = _run_job(store, facts, [rec.key])
    assert job.state == "done" and len(written) == 1, job.message
    assert measure.workloads and {w.routing for w in measure.workloads} == {"zipf:1.2"}
    assert [(r.key.transport_family, r.tuned_routing) for _, r in store.list_profiles(status="current")] == [
        ("megakernel", "zipf:1.2")]
    assert "1 key(s) re-tuned under routing zipf:1.2" in job.message


def test_a_model_re_tune_leaves_a_megakernel_key_stale_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.tuner.search.tune as search

    calls: list[dict] = []
    monkeypatch.setattr(search, "tune_profiles_detailed", lambda store, facts, **kw: calls.append(kw) or [])
    facts = _facts("h200x2")  # calibrated: a node model exists, and it must still not stand for the megakernel
    store = F.open_store(tmp_path / "m.db")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    F.write_node_model(tmp_path, facts.fingerprint)
    stale = _stale_mk(store, facts)
    job, written = _run_job(store, facts, [stale], backend="model", node_model_dir=str(tmp_path))
    assert calls == []  # nothing tuned in its place (such as the model's family at EP 1)
    assert written == []
    assert job.state == "failed" and job.impossible, job.message
    assert "megakernel" in job.message and "fabric model" in job.message and "stay stale" in job.message
    finished = [e for e in store.list_events(limit=50) if e["kind"] == "job_finished"]
    assert "megakernel" in finished[0]["reason"] and finished[0]["details"]["refused"]
    assert [r.status for _, r in store.list_profiles()] == ["stale"]


def test_a_model_re_tune_without_a_node_model_names_the_megakernel_reason(tmp_path: Path) -> None:
    """A one-GPU node is not calibrated: the refusal is the megakernel's, not 'no calibrated model'."""
    facts = _facts("h200x1")
    store = F.open_store(tmp_path / "m.db")
    stale = _stale_mk(store, facts)
    job, _ = _run_job(store, facts, [stale], backend="model", node_model_dir=str(tmp_path))
    assert job.state == "failed" and job.impossible
    assert "no prediction for family megakernel" in job.message and "calibrated model" not in job.message


def test_a_model_re_tune_of_ep_and_megakernel_keys_tunes_the_ep_ones_only(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.tuner.search.tune as search

    calls: list[dict] = []
    monkeypatch.setattr(search, "tune_profiles_detailed", lambda store, facts, **kw: calls.append(kw) or [])
    facts = _facts("h200x2")
    store = F.open_store(tmp_path / "m.db")
    F.write_node_model(tmp_path, facts.fingerprint)
    job = J.Job(1, reason="t", old_fingerprint="old", keys=[_key(facts, "nvlink", ep=2), _key(facts)])
    ctx = J.JobContext(store=store, facts=facts, job=job,
                       tune=TuneSettings(backend="model", trials=1, node_model_dir=str(tmp_path)))
    RT.tuner_retune(ctx)
    assert [(c["ep_size"], c["nodes"], c.get("families")) for c in calls] == [(2, 1, None)]
    assert len(job.refused) == 1 and "1 megakernel key(s) not re-tuned" in job.refused[0]


def test_a_local_job_of_ep_and_megakernel_keys_tunes_each_as_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     mk_lib: Path) -> None:
    import moetune.tuner.search.tune as search

    calls: list[dict] = []
    monkeypatch.setattr(search, "tune_profiles_detailed", lambda store, facts, **kw: calls.append(kw) or [])
    made = _inject(monkeypatch, Measure())
    facts = _facts("dgx-h100")
    store = F.open_store(tmp_path / "m.db")
    job = J.Job(1, reason="t", old_fingerprint="old", keys=[_key(facts, "nvlink", ep=8), _key(facts)])
    RT.tuner_retune(J.JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=1)))
    ran = [(c["ep_size"], c["nodes"], c.get("families"), None if c.get("families") else c["backend"].world)
           for c in calls]
    assert ran == [(8, 1, None, 8), (1, 1, ["megakernel"], None)]  # EP as before; the megakernel as itself
    assert calls[1]["backend"] is made[0] and job.refused == []


@pytest.mark.parametrize("capture, env, nvcc, expect", [
    ("rtx4090x4", None, "/usr/bin/nvcc", "sm_90"),  # no Hopper GPU
    ("cpu-laptop", None, "/usr/bin/nvcc", "no GPU"),
    ("h200x1", None, None, "no nvcc"),  # the library cannot be built
    ("h200x1", "/nonexistent/libmoetune_moe.so", "/usr/bin/nvcc", "does not exist"),
])
def test_a_node_that_cannot_measure_the_megakernel_refuses_its_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capture: str, env: str | None, nvcc: str | None,
        expect: str) -> None:
    import moetune.tuner.search.tune as search
    from moetune.runtime import csrc_build

    calls: list[dict] = []
    monkeypatch.setattr(search, "tune_profiles_detailed", lambda store, facts, **kw: calls.append(kw) or [])
    if env is None:
        monkeypatch.delenv("MOETUNE_MK_LIB", raising=False)
    else:
        monkeypatch.setenv("MOETUNE_MK_LIB", env)
    monkeypatch.setattr(csrc_build, "find_nvcc", lambda: nvcc)
    facts = _facts(capture)
    store = F.open_store(tmp_path / "m.db")
    stale = _stale_mk(store, facts)
    job, written = _run_job(store, facts, [stale])
    assert calls == [] and written == []  # nothing tuned in the megakernel's place
    assert job.state == "failed" and job.impossible, job.message
    assert "megakernel key(s) not re-tuned" in job.message and expect in job.message and "stay stale" in job.message
    assert [r.status for _, r in store.list_profiles()] == ["stale"]


@pytest.mark.parametrize("package", ["torch", "moetune"])
def test_a_daemon_whose_imported_software_is_not_the_installed_one_does_not_measure_the_megakernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mk_lib: Path, package: str) -> None:
    """The megakernel is timed in the daemon's own process, with the torch and moetune it imported when it started.
    After an upgrade the node's facts name the installed versions (the watch rediscovers them, a fabric change), and
    the re-tune stored numbers of the old software, measured, under the new software's key: served as tuned to jobs
    running the new one. Refused instead (restart the daemon), the key left stale."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(RT, "_IMPORTED", dict(RT._IMPORTED))  # moetune's, as read when the daemon started
    # the check before the daemon's first megakernel re-tune, which imports torch then
    monkeypatch.delitem(sys.modules, "torch")
    assert RT.process_software_problem() == ""
    monkeypatch.setitem(sys.modules, "torch", torch)
    real = RT._installed_version
    monkeypatch.setattr(RT, "_installed_version", lambda dist: "99.0.0" if dist == package else real(dist))
    measure = Measure()
    _inject(monkeypatch, measure)
    facts = _facts("h200x1")
    store = F.open_store(tmp_path / "m.db")
    stale = _stale_mk(store, facts)
    job, written = _run_job(store, facts, [stale])
    assert written == [] and measure.workloads == []
    assert job.state == "failed" and job.impossible, job.message
    assert f"{package} 99.0.0 is installed now" in job.message and "restart the daemon" in job.message, job.message
    assert [r.status for _, r in store.list_profiles()] == ["stale"]


def test_a_torch_whose_version_string_is_not_its_metadatas_is_the_installed_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch build's own __version__ can differ from its installed metadata for the same install (2.11.0+cu130
    against 2.11.0 on the GPU machine of run 233): compared, every megakernel re-tune there was refused as if the
    daemon ran old software. What the process imported is what was installed when it imported it, as discovery
    reads it."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(RT, "_IMPORTED", dict(RT._IMPORTED))
    monkeypatch.delitem(sys.modules, "torch")
    assert RT.process_software_problem() == ""
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(torch, "__version__", f"{RT._installed_version('torch')}+cu999")
    assert RT.process_software_problem() == ""


def test_a_megakernel_re_tune_waits_while_the_gpus_are_busy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            mk_lib: Path) -> None:
    measure = Measure()
    _inject(monkeypatch, measure)
    answers = [(True, "nvidia-smi: pid 4242")] * 3 + [(False, "nvidia-smi: no compute process")]
    seen: list[int] = []

    def probe() -> tuple[bool | None, str]:
        seen.append(len(measure.workloads))  # nothing measured while it is asked
        return answers.pop(0) if len(answers) > 1 else answers[0]

    facts = _facts("h200x1")
    store = F.open_store(tmp_path / "m.db")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    stale = _stale_mk(store, facts)
    job, written = _run_job(store, facts, [stale], probe=probe)
    assert len(seen) >= 4 and set(seen) == {0}
    assert [e for e in store.list_events(limit=100) if e["kind"] == "job_deferred"]
    assert job.state == "done" and written and written[0].key.transport_family == "megakernel"


def test_a_current_ep_1_transport_profile_does_not_stand_for_a_stale_megakernel_key(tmp_path: Path) -> None:
    """retune_keys and the queue's de-duplication tell the megakernel from a transport at EP 1 of the same shape."""
    from moetune.tuner.daemon.handlers import retune_keys
    from moetune.tuner.daemon.index import ProfileIndex

    facts = _facts("h200x1")
    ep1 = F.make_record(_key(facts, "collective"))
    mk_stale = ProfileRecord(key=_key(facts, fingerprint="oldfabric0000000"), knobs=Knobs(engine="megakernel"),
                             latency_us=300.0, spread_us=1.0, backend="local:megakernel",
                             provenance=provenance_of_backend("local:megakernel"))
    idx = ProfileIndex([ep1], version=1, facts=facts, stale=[mk_stale])
    assert retune_keys(idx, all_current=False) == [mk_stale.key]
    assert RT.tuning_key(ep1.key) != RT.tuning_key(mk_stale.key)
    assert RT.tuning_key(_key(facts, "nvlink", ep=2)) == RT.tuning_key(_key(facts, "host_staged", ep=2))


def _hopper_with_library() -> str:
    """'' where the real megakernel can be measured here, else why not (the skip reason)."""
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm_90 GPU (the megakernel is built for sm_90a)"
    from moetune.tuner.fabric.discovery import discover

    return RT.megakernel_refusal(discover(), "local")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_a_stale_megakernel_key_is_re_measured_on_the_gpu(tmp_path: Path) -> None:
    """The daemon's re-tune of a stale megakernel key with the real backend (megakernel_backend: the kernel timed on
    this GPU, nothing injected): the job ends done with a measured megakernel profile of this node's fingerprint."""
    why = _hopper_with_library()
    if why:
        pytest.skip(why)
    from moetune.tuner.fabric.discovery import discover

    facts = discover()
    store = F.open_store(tmp_path / "m.db")
    store.upsert_fingerprint(facts.fingerprint, facts.to_dict(), origin="local")
    stale = _stale_mk(store, facts)
    done: list = []
    jm = J.JobManager(store=store, facts_fn=lambda: facts, retune=RT.tuner_retune,
                      on_done=lambda j, w: done.append((j, w)),
                      tune=TuneSettings(backend="local", trials=3, timeout_s=240, busy_retry_s=0.05),
                      gpu_probe=lambda: (False, "idle (test)"))
    jm.start()
    try:
        jm.submit(reason="fabric changed (test)", old_fingerprint=stale.fingerprint, keys=[stale])
        job, written = _wait(done, timeout=280.0)
    finally:
        jm.stop()
    assert job.state == "done", job.message
    assert job.refused == []
    # run 244 (an H100 shared with 15 other pytest processes) wrote nothing here, job done: say why when it recurs
    assert [(r.key.transport_family, r.key.fingerprint, r.key.token_bucket) for r in written] == [
        ("megakernel", facts.fingerprint, 128)], (job.message, job.kept, job.kept_why, job.no_result)
    rec = written[0]
    assert rec.provenance == "measured" and rec.backend == "local:megakernel" and rec.knobs.engine == "megakernel"
    assert 50.0 < rec.latency_us < 5000.0, rec.latency_us  # the whole layer at S=128 (~290 us on an H200)
