"""A job whose fabric changed under it queues its keys again for the new fabric (`JobManager._requeue`). The new job's
job_queued is written before the old job's job_finished, and names the job it takes over (`resumes`): a daemon killed
between the two writes resumes the keys once at its next start. Written the other way round, a kill in between left
the old job finished and no job holding its keys: they were never re-tuned for the new fabric."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import ProfileKey
from moetune.runtime.shapes import MODELS
from moetune.tuner.daemon import jobs as J
from moetune.tuner.daemon import recovery as R
from moetune.tuner.daemon.server import TuneSettings

pytestmark = pytest.mark.timeout(60)
QWEN = MODELS["qwen3-30b"]


def test_a_kill_between_a_moved_jobs_end_and_its_requeue_loses_no_key(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    a, b = F.FakeFacts({"gpu_model": "H200"}), F.FakeFacts({"gpu_model": "H100"})
    now = [a]

    def retune(ctx: Any) -> list[Any]:
        now[0] = b  # the fabric changed under the job; the watch cancels it
        jm.cancel_fingerprint(a.fingerprint)
        return []

    jm = J.JobManager(store=store, facts_fn=lambda: now[0], retune=retune, on_done=lambda j, w: None,
                      tune=TuneSettings(backend="model", trials=1))
    key = ProfileKey(fingerprint="f" * 16, software="s" * 16, transport_family="nvlink", ep_size=2, nodes=1,
                     hidden=QWEN.hidden, intermediate=QWEN.intermediate, experts=QWEN.experts, topk=QWEN.topk,
                     dtype=QWEN.dtype, token_bucket=64)
    job = jm.submit(reason="test", old_fingerprint="f" * 16, keys=[key])
    assert job is not None
    # run it here, as the worker would (no worker thread: nothing runs the re-queued job)
    jm._queued.pop(job.id)
    jm._q.clear()
    jm.running, job.state = job, "running"

    real = store.add_event
    ends: list[str] = []  # the job's end and its keys' re-queue, in the order written

    def add_event(**kw: Any) -> Any:
        d = kw.get("details") or {}
        if len(ends) >= 1 and ends[-1] == "killed":
            raise RuntimeError("the daemon was killed (simulated)")
        if (kw["kind"] == "job_finished" and d.get("job_id") == job.id) or (kw["kind"] == "job_queued"
                                                                            and d.get("job_id") != job.id):
            ends.append(kw["kind"])
            if len(ends) == 2:  # killed before the second of the two writes
                ends.append("killed")
                raise RuntimeError("the daemon was killed (simulated)")
        return real(**kw)

    store.add_event = add_event  # type: ignore[method-assign]
    jm._run(job)
    assert "killed" in ends, ends
    store.add_event = real  # type: ignore[method-assign]

    resume, _ = R.recover_jobs(store)
    resumed = [k for r in resume for k in r.details["keys"]]
    assert [k["token_bucket"] for k in resumed] == [64], resume  # once: neither lost nor tuned twice
