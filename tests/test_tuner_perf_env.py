"""Every measured profile records the performance environment (NCCL_*, NVSHMEM_*, FI_*, ...) of the process that
measured it: `moetune tune --backend local` and the bring-up (the ranks' environment), the daemon's local re-tune
(the daemon's own). Modelled profiles record none (a prediction ran in no process's environment)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import optuna
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey
from moetune.runtime.shapes import ModelShape
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.timeout(120)
SMALL = ModelShape(name="custom:256,128,16,2", hidden=256, intermediate=128, experts=16, topk=2)

# a stand-in for `moetune bench ep --json` that reports the NCCL_ALGO its ranks ran with
FAKE_BENCH = r'''
import json, os, sys
print(json.dumps({"dispatch_us": {"median": 10.0, "p10": 9.9, "p90": 10.1},
                  "combine_us": {"median": 10.0, "p10": 9.9, "p90": 10.1},
                  "layer_us": {"median": 30.0, "p10": 29.9, "p90": 30.1},
                  "world": int(sys.argv[sys.argv.index("--world") + 1]), "backend": os.environ.get("NCCL_ALGO", "")}))
'''


class _Fam:
    def __init__(self, name: str) -> None:
        self.name = name


class Facts:
    fingerprint, software_hash, gpu_count = "c" * 64, "d" * 64, 2
    software: dict = {}  # noqa: RUF012
    link_rates: dict = {}  # noqa: RUF012
    transports = (_Fam("collective"),)


def _bench(tmp_path: Path) -> list[str]:
    p = tmp_path / "fake_bench.py"
    p.write_text(FAKE_BENCH)
    return [sys.executable, str(p)]


def test_a_local_tune_records_the_environment_its_ranks_measured_in(tmp_path: Path) -> None:
    from moetune.tuner.search.tune import tune_profiles_detailed

    env = {"PATH": "/usr/bin:/bin", "NCCL_ALGO": "Ring", "NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "INFO",
           "NVSHMEM_REMOTE_TRANSPORT": "ibrc", "FI_PROVIDER": "cxi"}
    # nccl: the facts' node has GPUs (gloo, CPU processes, is refused there); the bench is a fake
    be = LocalBackend(world=2, command=_bench(tmp_path), comm_backend="nccl", repeats=1, timeout_s=20, env=env)
    # the ranks run in it (plus what the knobs set)
    _, details, err = be.run_once(default_knobs("collective"), TuneWorkload(model=SMALL, tokens=64))
    assert err is None and details["backend"] == "Ring"
    store = F.open_store(tmp_path / "p.db")
    res = tune_profiles_detailed(store, Facts(), models=[SMALL], tokens=[64], backend=be, trials=2,
                                 families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert res[0].written, res[0].reason
    want = {"FI_PROVIDER": "cxi", "NCCL_ALGO": "Ring", "NCCL_P2P_DISABLE": "1"}  # no debug, no knob variable
    assert res[0].record.tuned_perf_env == want
    [(_, stored)] = store.list_profiles()
    assert stored.provenance == "measured" and stored.tuned_perf_env == want


def test_another_environment_is_another_study_and_none_keeps_the_old_study_names(tmp_path: Path) -> None:
    from moetune.tuner.search.policy import load_policy
    from moetune.tuner.search.space import SearchSpace
    from moetune.tuner.search.study import study_config

    space = SearchSpace(load_policy("collective"), experts=16, ep_size=2, tokens=64, topk=2)
    wl = TuneWorkload(model=SMALL, tokens=64)

    def config(env: dict[str, str]) -> str:
        return study_config(space, LocalBackend(world=2, command=["x"], env=env), wl)

    assert "perf_env" not in LocalBackend(world=2, command=["x"], env={"NCCL_DEBUG": "INFO"}).settings()
    assert config({"NCCL_DEBUG": "INFO"}) == config({})  # debug output is not another measurement
    assert config({"NCCL_ALGO": "Ring"}) != config({}) != config({"NCCL_ALGO": "Tree"})
    # the megakernel (one GPU, no NCCL call): only what acts on it names another study
    mk = {"world": 1, "family": "megakernel"}
    assert "perf_env" not in LocalBackend(**mk, env={"NCCL_ALGO": "Ring"}).settings()
    assert "perf_env" in LocalBackend(**mk, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}).settings()


def test_a_modelled_tune_records_no_environment(tmp_path: Path) -> None:
    from moetune.tuner.search.tune import tune_profiles_detailed

    class Preset(CallableBackend):  # a prediction: `model:*`, never measured
        pass

    be = Preset(lambda k, w: 10.0 + k.channels, name="model:fake")
    store = F.open_store(tmp_path / "m.db")
    res = tune_profiles_detailed(store, Facts(), models=[SMALL], tokens=[64], backend=be, trials=2,
                                 families=["collective"], storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert res[0].written and res[0].record.provenance == "preset" and res[0].record.tuned_perf_env is None
    assert [r.tuned_perf_env for _i, r in store.list_profiles()] == [None]


def test_the_daemons_local_re_tune_records_the_daemons_environment(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """tuner_retune with [tune] backend = "local": the ranks are launched from the daemon, in its environment."""
    import moetune.tuner.search.tune as search
    from moetune.tuner.daemon.jobs import Job, JobContext
    from moetune.tuner.daemon.retune import tuner_retune
    from moetune.tuner.daemon.server import TuneSettings

    bench = _bench(tmp_path)
    made: list[LocalBackend] = []
    real = search.make_backend

    def make_backend(backend: Any, preset: Any = None, **kw: Any) -> Any:
        if backend != "local":
            return real(backend, preset, **kw)
        # nccl, as a daemon on this 2-GPU node launches its ranks (gloo is refused there); the bench is a fake
        be = LocalBackend(world=kw["world"], command=bench, comm_backend="nccl", repeats=1, timeout_s=20)
        made.append(be)
        return be

    monkeypatch.setattr(search, "make_backend", make_backend)
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    facts = F.FakeFacts({"gpu_count": 2, "transports": ["collective"], "name": "node"})
    store = F.open_store(tmp_path / "d.db")
    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="collective",
                     ep_size=2, nodes=1, hidden=SMALL.hidden, intermediate=SMALL.intermediate, experts=SMALL.experts,
                     topk=SMALL.topk, dtype=SMALL.dtype, token_bucket=64)
    job = Job(1, reason="test", old_fingerprint="old", keys=[key])
    written = tuner_retune(JobContext(store=store, facts=facts, job=job, tune=TuneSettings(backend="local", trials=2)))
    assert made and made[0].env is None  # the daemon's own environment, nothing put in its place
    assert written and written[0].provenance == "measured"
    stored = store.get_current(key)
    assert stored is not None and stored.tuned_perf_env["NCCL_ALGO"] == "Tree"
    assert stored.tuned_perf_env["NCCL_IB_HCA"] == "mlx5_0" and "NCCL_DEBUG" not in stored.tuned_perf_env


@pytest.mark.usefixtures("on_captured_node")  # the bring-up measures only as on its capture's node
def test_the_bring_up_records_its_environment_with_every_profile_it_stores(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`moetune profile`: the search's records and the side-by-side re-measurement that replaces them (compare)."""
    import test_bringup_ep_sizes as BE  # its bring-up on a capture, EP runs through a fake bench

    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    b = BE._bringup(tmp_path, monkeypatch, capture="h200x2")
    b.run()
    assert b.state.done("compare")
    current = [r for _i, r in b.store.list_profiles(status="current")]
    assert current and all(r.provenance == "measured" for r in current)
    assert {r.key.transport_family for r in current} >= {"megakernel"}  # in-process, and through the ranks
    for r in current:
        assert r.tuned_perf_env is not None and r.tuned_perf_env.get("NCCL_ALGO") == "Ring", r.key
        assert "NCCL_DEBUG" not in r.tuned_perf_env
