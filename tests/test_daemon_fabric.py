"""A capture-based fabric change: profiles go stale, changes are published, a re-tune makes a new current
profile that a running client picks up; plus the retune op, metrics, and a clean SIGTERM shutdown."""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.profiles.client import ProfileClient
from moetune.runtime.profiles.errors import DaemonError
from moetune.runtime.testing.launch import free_port

pytestmark = pytest.mark.timeout(60)




def test_fabric_change_stale_publish_retune_pickup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    # the real re-tune: the tuner on the model backend, 3 trials per study. Since issue 19 the model is
    # this node's calibrated one (what `moetune profile` writes for the new fingerprint), never a preset
    # of other hardware: the test puts that file where the daemon looks (beside the database).
    with F.seeded_daemon(tmp_path, interval=0.2, extra=["--metrics-port", str(port)], hooks=False,
                         env={"MOETUNE_TUNE_TRIALS": "3", "MOETUNE_TUNE_BACKEND": "model"}) as (d, facts):
        F.write_node_model(tmp_path, F.facts_after_port_change(tmp_path / "capture").fingerprint)
        # allow_modelled: the re-tune is on the node's calibrated model, and a tracked profile is only what resolve uses
        c = ProfileClient(d.endpoint, timeout_ms=1000, allow_modelled=True)
        # the client runs on the captured node (the daemon's fabric facts are checked against the node this
        # process reads: its GPUs, driver and packages, as in test_daemon_client's database fallback); an IB port
        # going down leaves them the same, so both the old and the re-tuned profile are this node's
        F.pretend_node(monkeypatch, facts, tmp_path / "proc")
        tracked = c.track(ep_size=2, tokens=3000, model="qwen3-30b")
        old = tracked.current
        assert old is not None and old.key.fingerprint == facts.fingerprint and old.status == "current"
        assert old.key.token_bucket == 4096  # nearest stored bucket
        # a watcher that only listens
        w = ProfileClient(d.endpoint, timeout_ms=1000)
        w.subscribe()
        time.sleep(0.2)  # let the SUB connect (correctness never depends on it: snapshots carry versions)

        new_facts = F.set_port_state(tmp_path / "capture", "1: DOWN")  # script the hardware change
        kinds: list[str] = []

        def saw_stale():
            kinds.extend(ch.kind for ch in w.poll_changes(100))
            return "profile_stale" in kinds

        F.until(saw_stale)
        assert "fabric_changed" in kinds
        # from now on the old profile is never served: not_found until the re-tune lands, then the new one
        # (test_daemon_restart holds a job open to see the not_found window for sure)
        try:
            assert c.get_profile(ep_size=2, tokens=3000, model="qwen3-30b").key.fingerprint == new_facts.fingerprint
        except DaemonError as e:
            assert e.code == wire.E_NOT_FOUND
        st = c.status()
        assert st.fingerprint == new_facts.fingerprint and st.profiles_stale == 3

        # the running client picks the re-tuned profile up through PUB
        def picked_up():
            tracked.refresh(200)
            return tracked.current is not None and tracked.current.key.fingerprint == new_facts.fingerprint

        F.until(picked_up)
        assert tracked.current.profile_hash != old.profile_hash and tracked.current.status == "current"
        # tuned on this node's calibrated model: labelled as such, never as a preset or a measurement
        assert tracked.current.backend == f"model:node:{new_facts.fingerprint}"
        assert tracked.current.provenance == "node_model" and tracked.current.measured_on == new_facts.fingerprint
        assert tracked.current.version > old.version
        F.until(lambda: "profile_updated" in [ch.kind for ch in w.poll_changes(100)] or None)
        fab = c.fabric()
        assert fab.fingerprint == new_facts.fingerprint and fab.ok and "proxy:ibrc" in fab.transports
        mlx5_0 = next(n for n in fab.facts["nics"] if n["name"] == "mlx5_0")
        assert mlx5_0["ports"][0]["state"] == "DOWN"
        lst = c.list_profiles()
        assert {p.key.fingerprint for p in lst.profiles} == {new_facts.fingerprint}
        assert len(c.list_profiles(status="stale").profiles) == 3
        # the retune op: nothing left to re-tune; --all queues one; cancel of an unknown job is not_found
        assert c.retune().job is None
        job = c.retune(all=True).job
        assert job is not None and job.state in ("queued", "running") and job.keys == 3
        with pytest.raises(DaemonError):
            c.retune(cancel=999)
        # metrics on 127.0.0.1
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'moetune_requests_total{op="get_profile",outcome="ok"}' in text
        assert "moetune_request_seconds_bucket" in text
        # by provenance (b12eea59): the three measured profiles went stale, their re-tune on the calibrated model is
        # current and labelled node_model, a modelled figure never counted as measured
        assert 'moetune_profiles_stale{provenance="measured"} 3.0' in text
        assert 'moetune_profiles_stale{provenance="node_model"} 0.0' in text
        assert 'moetune_profiles_current{provenance="node_model"} 3.0' in text
        assert 'moetune_profiles_current{provenance="measured"} 0.0' in text
        assert "moetune_fabric_changes_total 1.0" in text
        c.close()
        w.close()
        # events were recorded with the diff reasons
        store = F.open_store(d.db)
        evs = [e for e in store.list_events(limit=100) if e["kind"] == "fabric_changed"]
        assert evs and "mlx5_0 port 1 ACTIVE → DOWN" in evs[0]["reason"]
        # structured logs: JSON lines
        lines = [json.loads(x) for x in d.read_log().splitlines() if x.startswith("{")]
        assert any(x["msg"] == "fabric changed" for x in lines)
        # clean shutdown on SIGTERM: exit 143, socket files removed, daemon.json says not running
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(15) == 143  # SIGTERM: the CLI's documented status
        assert not (d.run_dir / "daemon.sock").exists() and not (d.run_dir / "events.sock").exists()
        info = json.loads((d.run_dir / "daemon.json").read_text())
        assert info["running"] is False and info["fingerprint"] == new_facts.fingerprint


def test_discovery_failure_then_recovery(tmp_path: Path) -> None:
    """No facts at start: nothing is served as current (not_found), status says why; once discovery
    works the profiles of that fabric are served and a fabric_changed is published."""
    from moetune.tuner.daemon.server import Daemon

    store = F.open_store(tmp_path / "moetune.db")
    facts = F.FakeFacts({"gpu_model": "H200", "gpu_count": 2})
    F.seed_profiles(store, facts)
    state = {"facts": None}

    def discover():
        if state["facts"] is None:
            raise RuntimeError("nvidia-smi timed out")
        return state["facts"]

    d = Daemon(store=store, endpoint=f"ipc://{tmp_path}/run/daemon.sock", discover=discover,
               rediscover_interval_s=0.1).start(background=True)
    try:
        c = ProfileClient(d.endpoint, timeout_ms=1000)
        c.subscribe()
        with pytest.raises(DaemonError) as ei:
            c.get_profile(ep_size=2, tokens=64, model="qwen3-30b")
        assert ei.value.code == wire.E_NOT_FOUND
        st = c.status()
        assert not st.last_discovery_ok and "timed out" in st.last_discovery_message and st.fingerprint is None
        time.sleep(0.2)
        state["facts"] = facts
        changes = F.until(lambda: c.poll_changes(100))
        assert changes[0].kind == "fabric_changed" and changes[0].fingerprint == facts.fingerprint
        assert c.get_profile(ep_size=2, tokens=64, model="qwen3-30b").key.fingerprint == facts.fingerprint
        c.close()
    finally:
        d.stop()
