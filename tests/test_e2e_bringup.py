"""Issue 9 end to end on CPU: `moetune profile` → `moetune serve` → a MoELayer loads its profile by
itself → a capture-based software change → the daemon marks the profile stale and refuses to measure for a node
this machine is not (its re-tune fails saying why; nothing is stored under the new key) → the change back → the
daemon re-measures here and the running client picks the new profile up as tuned."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetune.runtime.profiles.client import ProfileClient

pytestmark = pytest.mark.timeout(240)

CAPTURES = Path(__file__).resolve().parent / "captures"
MODEL = "custom:256,128,16,4"


def _layer_rank(rank: int, world: int, endpoint: str) -> dict:
    """A rank that builds a MoELayer without knobs: it must find the tuned profile by itself."""
    import torch

    from moetune.runtime import MoELayer, get_model
    from moetune.runtime.profiles.autoload import check_same_profile, last_resolution

    os.environ["MOETUNE_DAEMON_SOCKET"] = endpoint
    layer = MoELayer(get_model(MODEL), knobs=None, max_tokens=128, device=torch.device("cpu"), dtype=torch.bfloat16)  # the dtype the profile was tuned at (the key)
    res = last_resolution()
    check_same_profile(None, res.profile_hash)
    out = layer(torch.randn(128, 256, dtype=torch.bfloat16))
    return {"source": res.source, "hash": res.profile_hash, "knobs": layer.buffer.knobs.to_dict(),
            "finite": bool(torch.isfinite(out).all())}


def _moetune(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from moetune.tuner.cli import main; main()", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_profile_serve_autoload_change_retune(tmp_path: Path) -> None:
    from moetune.runtime.testing.launch import launch
    from moetune.tuner.fabric import discovery

    # the flow measures (profile, the daemon's local re-tune): only on the node the capture describes, a CPU node
    # of this image (torch 2.13.0+cpu, no GPU or RDMA NIC); elsewhere nothing would be measured (capture_not_this_node)
    other = discovery.capture_not_this_node(discovery.discover(CAPTURES / "cpu-laptop"), CAPTURES / "cpu-laptop")
    if other:
        pytest.skip(f"this end-to-end flow measures on the node the cpu-laptop capture describes: {other}")
    cap = tmp_path / "capture"
    shutil.copytree(CAPTURES / "cpu-laptop", cap)
    home = tmp_path / "home"
    env = {**os.environ, "MOETUNE_HOME": str(home), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[plan]\nmodels = ["{MODEL}"]\ntokens = [128]\ntrials = 3\nrepeats = 1\niters = 5\n'
                    'compare_rounds = 1\ntrial_timeout_s = 60.0\nmicrobench_sizes = [4096, 65536]\n')
    # 1. bring-up on the node the capture describes
    r = _moetune("profile", "--plan", str(plan), "--capture", str(cap), "--json", env=env, timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert [p["tokens"] for p in summary["profiles"]] == [128]
    db = Path(summary["db"])
    assert (Path(summary["report"])).is_file()

    # 2. the daemon serves it; its re-tune runs the real runtime (gloo) with few trials
    cfg = tmp_path / "moetune.toml"
    cfg.write_text('[tune]\nbackend = "local"\ntrials = 2\ntimeout_s = 120\n')
    endpoint = f"ipc://{tmp_path}/run/daemon.sock"
    log = open(tmp_path / "daemon.log", "wb")  # noqa: SIM115
    daemon = subprocess.Popen([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "serve",
                               "--socket", endpoint, "--db", str(db), "--capture", str(cap), "--config", str(cfg),
                               "--rediscover-interval", "0.5"], env=env, stdout=log, stderr=log)
    try:
        client = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                client = ProfileClient(endpoint, timeout_ms=1000)
                client.hello()
                break
            except Exception:
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.2)
        assert client is not None, (tmp_path / "daemon.log").read_text()[-2000:]

        # 3. two ranks build a MoELayer without knobs: the daemon's profile, the same on both
        ranks = launch(_layer_rank, 2, backend="gloo", args=(endpoint,), timeout_s=60)
        assert all(x["source"] == "daemon" for x in ranks), ranks
        assert ranks[0]["hash"] == ranks[1]["hash"] and all(x["finite"] for x in ranks)
        tracked = client.track(model=MODEL, ep_size=2, tokens=128)
        first = tracked.current
        assert first is not None and first.profile_hash == ranks[0]["hash"]

        # 4. a software change in the capture (torch bumped): the profile goes stale; the daemon's local re-tune
        # would measure THIS machine (torch unchanged) for that key, so it refuses, saying why, and stores nothing
        pk = cap / "python" / "packages.json"
        pkgs = json.loads(pk.read_text())
        pkgs["torch"] = "2.14.0+cpu"
        tmp = pk.with_suffix(".tmp")
        tmp.write_text(json.dumps(pkgs))
        os.replace(tmp, pk)
        deadline = time.monotonic() + 120
        failed = None
        while time.monotonic() < deadline and failed is None:
            st = client.status()
            failed = next((j for j in st.jobs.recent if j.state == "failed"), None)
            time.sleep(0.3)
        log_text = (tmp_path / "daemon.log").read_text()[-3000:]
        assert failed is not None, log_text
        assert "describes another node than this one" in failed.message and "torch" in failed.message, failed
        assert st.profiles_stale >= 1 and st.profiles_current == 0, st
        from moetune.tuner.store import Store

        with Store(db) as store:
            rows = [r for _i, r in store.list_profiles()]
        assert rows and all(r.key.fingerprint == first.key.fingerprint for r in rows)  # nothing under the new key
        assert all(r.status == "stale" for r in rows if r.key.fingerprint == first.key.fingerprint
                   and r.status != "superseded")

        # 5. the capture back to this node's software: the change back goes to a re-tune this machine may measure
        # (the local backend, real gloo ranks), and the running client picks the re-measured profile up as tuned
        pkgs["torch"] = json.loads((CAPTURES / "cpu-laptop" / "python" / "packages.json").read_text())["torch"]
        tmp.write_text(json.dumps(pkgs))
        os.replace(tmp, pk)
        deadline = time.monotonic() + 150
        seen = None
        while time.monotonic() < deadline and seen is None:
            tracked.refresh(200)
            cur = tracked.current
            if (cur is not None and cur.status == "current" and cur.key.fingerprint == first.key.fingerprint
                    and cur.updated != first.updated):
                seen = cur
        assert seen is not None, (tmp_path / "daemon.log").read_text()[-3000:]
        assert seen.backend.startswith("local") and tracked.tuned, seen
        client.close()
    finally:
        daemon.terminate()
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
