"""A running job whose cancel was asked showed in `moetune status` as plain "running" until its current trial
ended (minutes with a measuring re-tune), as if `retune --cancel` had been lost. The job's info carries
`cancelling` once the cancel is asked, and status shows it."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.profile_record import ProfileKey
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.shapes import MODELS
from moetune.tuner.cli import app
from moetune.tuner.daemon.jobs import JobContext, JobManager
from moetune.tuner.daemon.server import TuneSettings

pytestmark = pytest.mark.timeout(60)


def test_a_running_job_is_said_cancelling_once_its_cancel_is_asked(tmp_path: Path) -> None:
    store = F.open_store(tmp_path / "m.db")
    facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
    q = MODELS["qwen3-30b"]
    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                     ep_size=8, nodes=1, hidden=q.hidden, intermediate=q.intermediate, experts=q.experts, topk=q.topk,
                     dtype=q.dtype, token_bucket=64)
    started, release = threading.Event(), threading.Event()

    def retune(ctx: JobContext) -> list:
        started.set()
        release.wait(10)  # the current trial: it runs on after the cancel is asked
        return []

    done: list = []
    jm = JobManager(store=store, facts_fn=lambda: facts, retune=retune, on_done=lambda j, w: done.append(j),
                    tune=TuneSettings(backend="local", trials=1), gpu_probe=lambda: (False, "idle (test)"))
    jm.start()
    try:
        job = jm.submit(reason="test", old_fingerprint=None, keys=[key])
        assert started.wait(10)
        _q, running, _r = jm.info()
        assert running is not None and running.state == "running" and not running.cancelling
        assert jm.cancel(job.id) is job
        _q, running, _r = jm.info()
        assert running is not None and running.id == job.id
        assert running.state == "running" and running.cancelling
        # on the wire, and decoded by a client
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(running), type=wire.JobInfo).cancelling
    finally:
        release.set()
        jm.stop()
    _q, _running, recent = jm.info()
    assert recent and recent[-1].state == "cancelled" and not recent[-1].cancelling


def test_status_shows_a_cancelling_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    job = wire.JobInfo(id=1, state="running", reason="requested from the command line", cancelling=True)
    st = wire.StatusResult(
        epoch="e", daemon_version="1", pid=42, uptime_s=3.0, db="/x/m.db", endpoint="ipc:///x/daemon.sock",
        pub_endpoint="ipc:///x/events.sock", version=7, fingerprint="f" * 16, last_discovery="2026-12-05T09:00:00Z",
        last_discovery_ok=True, last_discovery_message="ok", profiles_current=3, profiles_stale=0, requests=5,
        jobs=wire.JobsInfo(queued=[], running=job, recent=[], capacity=4))

    def request(self: ProfileClient, op: str, **fields: Any) -> Any:
        return st

    monkeypatch.setattr(ProfileClient, "request", request)
    r = CliRunner().invoke(app, ["status"], env={"MOETUNE_CONFIG": "", "COLUMNS": "200"}, terminal_width=200)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.replace("│", " ").split())
    assert "running: 1 (cancelling)" in text, r.output
    assert "running, cancelling (ends after its current trial): requested from the command line" in text, r.output
    r = CliRunner().invoke(app, ["status", "--json"], env={"MOETUNE_CONFIG": ""})
    assert r.exit_code == 0, r.output
    assert '"cancelling":true' in r.output.replace(' ', '')
