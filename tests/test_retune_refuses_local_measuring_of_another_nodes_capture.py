"""A daemon serving a capture of another node (`serve --capture`) with [tune] backend = "local": its re-tune would
measure on this machine and store the numbers under the captured node's identity, so the job refuses every key. That
refusal was tuner_retune's own check, not `key_refusals` (the one rule `retune` asks before it queues: e54dc4a,
b2a8966): `moetune retune` queued the job, which then failed as a whole. It is now in key_refusals: the retune is not
queued and says why at once, and the job still refuses."""

from __future__ import annotations

import collections
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_retune_leaves_out_what_the_backend_cannot_answer as L

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.daemon.index import ProfileIndex
from moetune.tuner.daemon.retune import key_refusals
from moetune.tuner.daemon.server import TuneSettings
from moetune.tuner.fabric import discovery

pytestmark = pytest.mark.timeout(120)
CAPTURES = Path(__file__).resolve().parent / "captures"


@pytest.fixture
def other_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """This machine is the cpu-laptop capture's node; the daemon serves a capture of the same hardware with another
    torch (another node's key). Live discovery is simulated so that this reads the same on any machine."""
    here = discovery.discover(CAPTURES / "cpu-laptop")
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: here, raising=False)
    cap = tmp_path / "cap2"
    shutil.copytree(CAPTURES / "cpu-laptop", cap)
    pk = cap / "python" / "packages.json"
    pkgs = json.loads(pk.read_text())
    pkgs["torch"] = "2.12.0+cpu"
    pk.write_text(json.dumps(pkgs))
    return discovery.discover(cap)


def _key(*, family: str = "collective", ep: int = 2) -> ProfileKey:
    return ProfileKey(fingerprint="old", software="sw", transport_family=family, ep_size=ep, nodes=1, hidden=2048,
                      intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=16)


def _daemon(facts: Any, stale_keys: list[ProfileKey], backend: str = "local") -> Any:
    stale = [L._rec(k) if k.transport_family != "megakernel" else ProfileRecord(
        key=k, knobs=default_knobs("collective").replace(engine="megakernel"), latency_us=5.0, spread_us=0.1,
        backend="local:megakernel", provenance="measured", measured_on=k.fingerprint) for k in stale_keys]
    return SimpleNamespace(index=ProfileIndex([], version=1, facts=facts, stale=stale), facts=facts,
                           tune=TuneSettings(backend=backend, trials=1), jobs=L._Jobs(),
                           store=SimpleNamespace(path="/nonexistent/m.db"),
                           retune_refusals=collections.deque(maxlen=wire.RETUNE_REFUSALS_KEPT))


@pytest.mark.parametrize("family", ["collective", "megakernel"])
def test_a_local_retune_of_another_node_s_capture_is_not_queued_and_says_why(other_node: Any, family: str) -> None:
    ep = 1 if family == "megakernel" else 2  # a group this (CPU) node measures otherwise: gloo ranks
    d = _daemon(other_node, [_key(family=family, ep=ep)])
    ok, res = L._ask(d)
    assert not ok and not d.jobs.submitted, res
    code, msg = res
    assert code == wire.E_NOT_FOUND and msg.startswith("not queued"), msg
    assert "describes another node than this one" in msg and "torch" in msg, msg
    assert "measures on this machine only" in msg, msg
    [kept] = d.retune_refusals  # and `status` keeps it
    assert "describes another node" in kept.left_out[0], kept


def test_this_node_s_own_capture_still_queues(other_node: Any) -> None:
    here = discovery.live_facts()
    assert key_refusals([_key()], here, "local") == []
    d = _daemon(here, [_key()])
    ok, res = L._ask(d)
    assert ok and res.job is not None and len(d.jobs.submitted) == 1, res


def test_the_model_backend_is_not_refused_for_it(other_node: Any) -> None:
    """It predicts with the captured node's model; it measures nothing here (its own refusals are unchanged)."""
    assert key_refusals([_key()], other_node, "model") == []
