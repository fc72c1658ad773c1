"""A measuring (local) re-tune waits while other processes run on the node's GPUs: its benchmarks would disturb a
production job and measure that job's noise. The probe is faked here (no GPU, no nvidia-smi needed)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import ProfileKey
from moetune.runtime.shapes import MODELS
from moetune.tuner.daemon import gpu_procs as G
from moetune.tuner.daemon import jobs as J
from moetune.tuner.daemon import recovery as R
from moetune.tuner.daemon.server import TuneSettings

pytestmark = pytest.mark.timeout(60)
QWEN = MODELS["qwen3-30b"]


def _key(facts: Any) -> ProfileKey:
    return ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                      ep_size=2, nodes=1, hidden=QWEN.hidden, intermediate=QWEN.intermediate, experts=QWEN.experts,
                      topk=QWEN.topk, dtype=QWEN.dtype, token_bucket=64)


class Probe:
    """Answers from a script: each call takes the next answer (the last one repeats)."""

    def __init__(self, *answers: tuple[bool | None, str]) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self) -> tuple[bool | None, str]:
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _manager(tmp_path: Path, probe: Probe, *, gpus: int = 8, backend: str = "local", allow: bool = False
             ) -> tuple[J.JobManager, list, list, Any]:
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": gpus, "name": "node"})
    ran: list[float] = []
    done: list = []

    def retune(ctx: Any) -> list:
        ran.append(time.monotonic())
        return []

    jm = J.JobManager(store=store, facts_fn=lambda: facts, retune=retune, on_done=lambda j, w: done.append(j),
                      tune=TuneSettings(backend=backend, trials=1, run_on_busy_gpus=allow, busy_retry_s=0.05),
                      gpu_probe=probe)
    return jm, ran, done, facts


def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cond()


def _run_to_the_end(jm: J.JobManager, facts: Any, done: list) -> None:
    """Start the manager, submit one re-tune of the node's key, wait until it finished, stop."""
    jm.start()
    try:
        jm.submit(reason="fabric changed", old_fingerprint="old", keys=[_key(facts)])
        _until(lambda: done)
    finally:
        jm.stop()


def _events(jm: J.JobManager, kind: str) -> list:
    return [e for e in jm.store.list_events(limit=100) if e["kind"] == kind]


def test_busy_gpus_defer_the_job_until_they_are_idle(tmp_path: Path) -> None:
    probe = Probe(*[(True, "nvidia-smi: pid 4242")] * 4, (False, "nvidia-smi: no compute process"))
    jm, ran, done, facts = _manager(tmp_path, probe)
    jm.start()
    try:
        job = jm.submit(reason="fabric changed", old_fingerprint="old", keys=[_key(facts)])
        _until(lambda: _events(jm, "job_deferred"))
        assert ran == [] and job.state == "queued"
        deferred = _events(jm, "job_deferred")
        assert len(deferred) == 1  # said once, not at every retry
        assert "pid 4242" in deferred[0]["reason"] and "disturb" in deferred[0]["reason"]
        assert "run_on_busy_gpus" in deferred[0]["reason"]
        _until(lambda: done)
    finally:
        jm.stop()
    assert probe.calls == 5 and len(ran) == 1
    assert done[0].state == "done"
    finished = _events(jm, "job_finished")
    assert finished and finished[0]["details"]["state"] == "done"


def test_a_deferred_job_is_listed_queued_with_the_reason(tmp_path: Path) -> None:
    jm, ran, _done, facts = _manager(tmp_path, Probe((True, "GPU 0: pid 7")))
    jm.start()
    try:
        job = jm.submit(reason="fabric changed", old_fingerprint="old", keys=[_key(facts)])
        _until(lambda: _events(jm, "job_deferred"))
        queued, running, _ = jm.info()
        assert running is None and [q.id for q in queued] == [job.id]
        assert queued[0].state == "queued" and "deferred" in queued[0].message and "GPU 0: pid 7" in queued[0].message
        assert jm.cancel(job.id) is job
        _until(lambda: job.state == "cancelled")
    finally:
        jm.stop()
    assert ran == []


def test_unknown_gpu_state_defers_conservatively(tmp_path: Path) -> None:
    jm, ran, _done, facts = _manager(tmp_path, Probe((None, "pynvml not installed and nvidia-smi not found")))
    jm.start()
    try:
        jm.submit(reason="fabric changed", old_fingerprint="old", keys=[_key(facts)])
        _until(lambda: _events(jm, "job_deferred"))
        time.sleep(0.2)
    finally:
        jm.stop()
    assert ran == []
    reason = _events(jm, "job_deferred")[0]["reason"]
    assert "cannot tell whether this node's GPUs are idle" in reason and "nvidia-smi not found" in reason
    # stopped while waiting: not finished in the store, so the next daemon resumes it
    assert _events(jm, "job_finished") == []
    resume, _ = R.recover_jobs(jm.store)
    assert len(resume) == 1


@pytest.mark.parametrize("answer", [(True, "pid 1"), (None, "nvidia-smi not found")])
def test_run_on_busy_gpus_runs_anyway(tmp_path: Path, answer: tuple) -> None:
    jm, ran, done, facts = _manager(tmp_path, Probe(answer), allow=True)
    _run_to_the_end(jm, facts, done)
    assert len(ran) == 1 and _events(jm, "job_deferred") == []


@pytest.mark.parametrize(("gpus", "backend"), [(0, "local"), (8, "model")])
def test_no_probe_where_nothing_runs_on_gpus(tmp_path: Path, gpus: int, backend: str) -> None:
    """A node without GPUs measures gloo ranks on its CPUs; a model re-tune predicts: neither waits for the GPUs."""
    probe = Probe((True, "pid 1"))
    jm, ran, done, facts = _manager(tmp_path, probe, gpus=gpus, backend=backend)
    _run_to_the_end(jm, facts, done)
    assert probe.calls == 0 and len(ran) == 1


def test_gpu_processes_reads_nvidia_smi_when_nvml_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_nvml() -> list[str]:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(G, "_nvml_pids", no_nvml)
    outputs: dict[str, Any] = {}

    def run(argv: list[str], **kw: Any) -> Any:
        assert argv == ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
        out = outputs["next"]
        if isinstance(out, BaseException):
            raise out
        return subprocess.CompletedProcess(argv, out[0], out[1], out[2])

    monkeypatch.setattr(G.subprocess, "run", run)
    outputs["next"] = (0, "4242\n[Not Found]\n", "")
    busy, seen = G.gpu_processes()
    assert busy is True and "4242" in seen and "[Not Found]" in seen
    outputs["next"] = (0, "\n", "")
    assert G.gpu_processes()[0] is False
    outputs["next"] = FileNotFoundError("nvidia-smi")
    busy, seen = G.gpu_processes()
    assert busy is None and "pynvml not installed" in seen and "nvidia-smi not found" in seen
    outputs["next"] = (9, "", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")
    busy, seen = G.gpu_processes()
    assert busy is None and "exited 9" in seen
    outputs["next"] = subprocess.TimeoutExpired("nvidia-smi", 15)
    assert G.gpu_processes()[0] is None


def test_gpu_processes_prefers_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(G, "_nvml_pids", lambda: ["GPU 3: pid 99"])
    monkeypatch.setattr(G.subprocess, "run", lambda *a, **k: pytest.fail("nvidia-smi run although NVML answered"))
    assert G.gpu_processes() == (True, "GPU 3: pid 99")
    monkeypatch.setattr(G, "_nvml_pids", lambda: [])
    assert G.gpu_processes()[0] is False


def test_config_run_on_busy_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.config import load_config

    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[tune]\nbackend = \"local\"\nrun_on_busy_gpus = true\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "none"))
    assert load_config(cfg).tune.run_on_busy_gpus is True
    cfg.write_text("[tune]\nbackend = \"local\"\n")
    assert load_config(cfg).tune.run_on_busy_gpus is False  # the default: wait for idle GPUs


def test_a_deferred_job_that_runs_no_longer_says_deferred(tmp_path: Path) -> None:
    """Its "deferred: ..." message stayed on the job while it ran (status then listed it running and deferred)."""
    jm, _ran, done, facts = _manager(tmp_path, Probe((True, "GPU 0: pid 7"), (False, "idle")))
    seen: list[str] = []
    jm.retune = lambda ctx: seen.append(ctx.job.message) or []  # what status shows while it runs
    jm.start()
    try:
        job = jm.submit(reason="fabric changed", old_fingerprint="old", keys=[_key(facts)])
        _until(lambda: bool(done))
    finally:
        jm.stop()
    assert seen == [""] and job.state == "done", (seen, job.message)


def test_a_queued_job_cancelled_before_its_queued_event_is_written_stays_cancelled_after_a_restart(
        tmp_path: Path) -> None:
    """An automatic job's job_queued is written by the thread that queues it: a cancel that came while that write
    was still going on must write job_finished after it (finished-then-queued would make a restarted daemon's
    recover_jobs take the job as queued and run it), and returns only once that job_finished is committed."""
    import threading

    jm, ran, _done, facts = _manager(tmp_path, Probe((True, "busy: keeps the worker waiting")))
    hold, writing, real = threading.Event(), threading.Event(), jm.store.add_event

    def slow_add_event(**kw: Any) -> Any:  # a slow database, for the queuing thread's job_queued
        if threading.current_thread().name == "queuer" and kw.get("kind") == "job_queued":
            writing.set()
            hold.wait(5)
        return real(**kw)

    jm.store.add_event = slow_add_event
    jm.start()
    got: list[Any] = []
    try:
        queuer = threading.Thread(target=lambda: got.append(jm.submit(reason="fabric changed", old_fingerprint="old",
                                                                      keys=[_key(facts)])), name="queuer")
        queuer.start()
        assert writing.wait(5)
        job = next(iter(jm._queued.values()))
        cancelled: list[Any] = []
        canceller = threading.Thread(target=lambda: cancelled.append(jm.cancel(job.id)))
        canceller.start()
        canceller.join(0.3)
        assert canceller.is_alive() and job.state == "cancelled"  # its end is not committed yet: no answer yet
        hold.set()
        canceller.join(5)
        queuer.join(5)
        assert cancelled == [job] and got == [job]
        assert len(_events(jm, "job_finished")) == 1  # committed when cancel returned
    finally:
        hold.set()
        jm.stop()
    kinds = [e["kind"] for e in sorted(jm.store.list_events(limit=50), key=lambda e: e["id"])
             if e["details"] and e["details"].get("job_id") == job.id]
    assert kinds == ["job_queued", "job_finished"], kinds
    resume, _ = R.recover_jobs(jm.store)
    assert resume == [] and ran == []
