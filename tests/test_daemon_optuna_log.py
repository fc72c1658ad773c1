"""The daemon's log is JSON lines only: a re-tune's Optuna studies log through Optuna's own plain-text stderr
handler ("[I 2026-...] A new study created in RDB ...", "Trial 0 finished ..."), and those lines were mixed into
`moetune serve`'s JSON log. setup_logging routes Optuna's logger through the daemon's JSON handler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))
from child_env import child_env  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# a daemon's local re-tune of one key, trials=1, with the real Optuna study and a fake measuring backend
CHILD = r'''
import sys
import daemon_fakes as F
import moetune.tuner.search.tune as search
from moetune.runtime.profile_record import ProfileKey
from moetune.runtime.shapes import MODELS
from moetune.tuner.daemon.jobs import Job, JobContext
from moetune.tuner.daemon.retune import tuner_retune
from moetune.tuner.daemon.logs import setup_logging
from moetune.tuner.daemon.server import TuneSettings
from moetune.tuner.search.backends import CallableBackend

class Fake(CallableBackend):
    def close(self) -> None:
        pass

search.make_backend = lambda backend, preset=None, **kw: Fake(lambda k, w: 10.0 + k.pipeline_depth, name="local:fake")
setup_logging("info")
q = MODELS["qwen3-30b"]
store = F.open_store(sys.argv[1])
facts = F.FakeFacts({"gpu_count": 8, "name": "node"})
key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink", ep_size=2,
                 nodes=1, hidden=q.hidden, intermediate=q.intermediate, experts=q.experts, topk=q.topk,
                 dtype=q.dtype, token_bucket=64)
ctx = JobContext(store=store, facts=facts, job=Job(1, reason="test", old_fingerprint="old", keys=[key]),
                 tune=TuneSettings(backend="local", trials=1))
print(len(tuner_retune(ctx)))
'''


def test_every_stderr_line_of_a_daemon_re_tune_is_json(tmp_path: Path) -> None:
    env = child_env(MOETUNE_HOME=str(tmp_path / "home"), HOME=str(tmp_path / "home"))
    env["PYTHONPATH"] = ":".join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "m.db")], capture_output=True, text=True,
                       env=env, timeout=100)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"  # the study ran and stored its profile
    lines = r.stderr.splitlines()
    bad = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            bad.append(line)
    assert not bad, bad
    logs = [json.loads(x) for x in lines]
    # Optuna's lines are still there, as JSON records of its logger
    assert any(x["logger"].startswith("optuna") and "Trial 0 finished" in x["msg"] for x in logs), logs
