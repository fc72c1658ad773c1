"""The default re-tune job with the real tuner (model backend, few trials): a fabric change on a capture
makes the profiles stale and the daemon's job writes new current profiles for the new fingerprint, from
this node's calibrated fabric model (never from a shipped preset of other hardware, issue 19)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profiles.client import ProfileClient
from moetune.tuner.daemon.server import Daemon, TuneSettings

pytestmark = pytest.mark.timeout(90)


def test_real_tuner_retune_after_fabric_change(tmp_path: Path) -> None:
    cap = tmp_path / "capture"
    facts = F.make_capture(cap, "dgx-h100")
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts, ep_size=8, buckets=(64, 1024))
    from moetune.tuner.fabric.discovery import discover

    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=lambda: discover(cap),
               tune=TuneSettings(backend="model", trials=3, timeout_s=60), rediscover_interval_s=0.1).start(background=True)
    try:
        c = ProfileClient(d.endpoint, timeout_ms=2000)
        F.write_node_model(tmp_path, F.facts_after_port_change(cap).fingerprint)  # `moetune profile` ran here
        new = F.set_port_state(cap, "1: DOWN")
        deadline = time.monotonic() + 60
        done = None
        while time.monotonic() < deadline and done is None:
            st = c.status()
            done = next((j for j in st.jobs.recent if j.state in ("done", "failed")), None)
            time.sleep(0.1)
        assert done is not None and done.state == "done", done
        assert done.written >= 2
        prof = c.get_profile(ep_size=8, tokens=1000, model="qwen3-30b")
        assert prof.key.fingerprint == new.fingerprint and prof.status == "current"
        assert prof.backend == f"model:node:{new.fingerprint}" and prof.provenance == "node_model"
        c.close()
    finally:
        d.stop()


def test_a_retune_whose_predictions_do_not_displace_measurements_says_so(tmp_path: Path) -> None:
    """`retune --all` with the model backend on a node whose current profiles are measured: the predictions go in as
    history and the measured profiles stay current. The job said only "0 profile(s) written", which read as a
    re-tune that did nothing; its message now counts the keys that kept their current profile."""
    from moetune.tuner.daemon.jobs import JobManager
    from moetune.tuner.daemon.retune import tuner_retune
    from moetune.tuner.fabric.discovery import discover

    cap = tmp_path / "capture"
    facts = F.make_capture(cap, "dgx-h100")
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, facts, ep_size=8, buckets=(64, 1024))
    assert {r.provenance for r in seeded} == {"measured"}
    F.write_node_model(tmp_path, facts.fingerprint)
    done: list = []
    jm = JobManager(store=store, facts_fn=lambda: discover(cap), retune=tuner_retune,
                    on_done=lambda j, w: done.append(j), tune=TuneSettings(backend="model", trials=3, timeout_s=60),
                    gpu_probe=lambda: (False, "idle (test)"))
    job = _retune_all(jm, facts, seeded, done)
    assert job.state == "done" and job.written == 0 and job.kept == 2, job.message
    assert "0 profile(s) written" in job.message and "2 profile key(s) kept their current profile" in job.message
    assert job.message.count("a node_model profile never displaces it") == 2 and len(job.kept_why) == 2
    rows = [r for _, r in store.list_profiles()]
    assert sorted(r.provenance for r in rows if r.status == "current") == ["measured", "measured"]
    assert {r.provenance for r in rows if r.status == "superseded"} == {"node_model"}
    finished = [e for e in store.list_events(limit=50) if e["kind"] == "job_finished"]
    assert finished and finished[0]["details"]["kept"] == 2 and finished[0]["details"]["no_result"] == []


def test_a_job_that_wrote_predictions_says_they_are_modelled(tmp_path: Path) -> None:
    """A re-tune job with the model backend said "3 profile(s) written" in its message (`moetune status`, the
    job_finished event), as a measuring job says it: nothing said the profiles it wrote were predictions."""
    from moetune.runtime.profile_record import ProfileKey
    from moetune.tuner.daemon.jobs import JobManager
    from moetune.tuner.fabric.discovery import discover

    cap = tmp_path / "capture"
    facts = F.make_capture(cap, "dgx-h100")
    store = F.open_store(tmp_path / "moetune.db")
    seeded = F.seed_profiles(store, facts, ep_size=8, buckets=(64, 1024))

    def retune(ctx) -> list:
        out = []
        # keys of their own (other buckets): a prediction never displaces the measured profiles seeded
        for k, backend, bucket in zip(ctx.keys, (f"model:node:{ctx.facts.fingerprint}", "local:fake"), (128, 4096),
                                      strict=True):
            nk = ProfileKey(**{**k.to_dict(), "fingerprint": ctx.facts.fingerprint,
                               "software": ctx.facts.software_hash, "token_bucket": bucket})
            rec = F.make_record(nk, latency_us=1.0, num_sms=32, backend=backend)
            assert ctx.store.put_profile(rec)[0]
            out.append(rec)
        return out

    done: list = []
    jm = JobManager(store=store, facts_fn=lambda: discover(cap), retune=retune, on_done=lambda j, w: done.append(j),
                    tune=TuneSettings(backend="model", trials=3, timeout_s=60), gpu_probe=lambda: (False, "idle"))
    job = _retune_all(jm, facts, seeded, done)
    assert job.state == "done" and job.written == 2, job.message
    assert "2 profile(s) written" in job.message and "1 of them MODELLED (node_model)" in job.message, job.message


def _retune_all(jm: Any, facts: Any, seeded: list, done: list) -> Any:
    """Run one `retune --all` job of the seeded keys on `jm` to its end; the finished job."""
    return F.run_one_job(jm, done, 60, reason="retune --all", old_fingerprint=facts.fingerprint,
                         keys=[r.key for r in seeded], all_current=True)
