"""Search: TPE finds near-optimum settings, studies resume, kill -9 mid-study then a rerun completes
with an intact database and no half-written current profile, and the profile gate is honoured."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import ProfileKey
from moetune.runtime.shapes import MODELS
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace
from moetune.tuner.search.study import (
    enqueue_warm_start,
    make_sampler,
    open_study,
    run_study,
    study_config,
    study_name,
)
from moetune.tuner.search.trials import finished_trials
from moetune.tuner.search.tune import tune_profiles_detailed
from moetune.tuner.store.store import Store

optuna.logging.set_verbosity(optuna.logging.ERROR)


class Facts:
    fingerprint = "f" * 64
    software_hash = "s" * 64
    software = {"torch": "2.13.0", "moetune": "0.1.0"}  # noqa: RUF012
    gpu_count = 4
    nodes = 1

    @property
    def transports(self):
        from moetune.tuner.search.tune import _Fam

        return [_Fam("proxy:ibrc"), _Fam("host_staged")]

    link_rates = {"nic_gbit": 400.0}  # noqa: RUF012


def synthetic(k: Knobs, wl: TuneWorkload) -> float:
    """A fabric-like objective with interactions; its optimum is not one of the warm-start priors."""
    t = 400.0
    # PUTs per peer: one without chunking, else (a fixture's number) 8 chunks; decoupled signals per group of
    # group_size PUTs, a last partial group included (csrc/proxy_xchg.h)
    puts = 8 if k.chunk_tokens else 1
    g = 1 if k.signalling == "coupled" else (puts if k.group_size == 0 else min(k.group_size, puts))
    fences = wl.ep_size * -(-puts // g)
    fence_cost = 3.0 if k.fence_mode == "proxy_drain" else 0.6
    t += fences * fence_cost * (1.0 + 0.15 * g)  # big groups make each fence wait longer
    t /= 1 + 0.35 * (k.qps_per_pe > 1) - (0.2 if k.qp_mapping == "round_robin" and k.qps_per_pe > 1 else 0.0)
    t *= 0.72 if k.compression != "none" else 1.0
    t *= 0.97 if k.scale_granularity == "per_128" else 1.0
    # chunking pays off without pipelining too (the proxy, which has no pipeline_depth, chunks PUTs)
    t *= {1: 0.93, 2: 0.85, 3: 0.88, 4: 0.95}[k.pipeline_depth] if k.chunk_tokens else 1.0 + 0.05 * (k.pipeline_depth - 1)
    t *= 1 + abs(k.num_sms - 32) / 64
    return t


WL = TuneWorkload(model=MODELS["deepseek-v3"], tokens=1024, nodes=8, gpus_per_node=4)


def test_tpe_finds_near_optimum_with_a_quarter_of_the_grid() -> None:
    # 168 distinct points since num_sms and pipeline_depth (ignored by the proxy) are pinned and group_size
    # is asked only with chunking (PUT groups): a quarter of them is 42 trials (a tenth of the old 1152-point
    # grid, 5/6 of it duplicates, was 115)
    space = SearchSpace(load_policy("proxy:ibrc"), experts=WL.model.experts, ep_size=WL.ep_size)
    grid = list(space.enumerate())
    opt = min(synthetic(k, WL) for k in grid)
    budget = len(grid) // 4
    assert opt < min(synthetic(k, WL) for _, k in space.priors())  # the priors alone do not find it
    bests = []
    for seed in range(3):
        study = optuna.create_study(sampler=make_sampler(seed, n_startup_trials=10))
        res = run_study(study, space, CallableBackend(synthetic), WL, trials=budget)
        assert res.trials == budget
        bests.append(res.best.median_us)
    assert statistics.median(bests) <= opt * 1.03, (bests, opt)


def _key(family: str = "proxy:ibrc", bucket: int = 128) -> ProfileKey:
    m = MODELS["qwen3-30b"]
    return ProfileKey(fingerprint=Facts.fingerprint, software=Facts.software_hash, transport_family=family, ep_size=4,
                      nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts, topk=m.topk,
                      dtype=m.dtype, token_bucket=bucket)


def test_resume_runs_only_the_missing_trials_and_gate(tmp_path: Path) -> None:
    store = Store(tmp_path / "moetune.db")
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    calls = []

    def f(k: Knobs, wl: TuneWorkload) -> float:
        calls.append(k)
        return synthetic(k, wl)

    kw = dict(models=[MODELS["qwen3-30b"]], tokens=[100], backend=CallableBackend(f), storage=url,
              families=["proxy:ibrc"])
    r1 = tune_profiles_detailed(store, Facts(), trials=8, **kw)
    assert len(calls) == 8 and r1[0].written
    assert r1[0].record.key == _key()  # the full key, bucket 128 for 100 tokens
    r2 = tune_profiles_detailed(store, Facts(), trials=20, **kw)
    assert len(calls) == 20 and r2[0].study.trials == 20
    r3 = tune_profiles_detailed(store, Facts(), trials=20, **kw)
    assert len(calls) == 20  # nothing left to run
    # The same best again does not beat the noise: the current profile is kept.
    assert not r3[0].written
    cur = store.get_current(_key())
    assert cur is not None and cur.latency_us == pytest.approx(min(synthetic(k, None or _wl()) for k in calls))
    # Studies carry JSON-serialisable attrs (optuna-dashboard opens them as they are).
    study = optuna.load_study(study_name=r3[0].study.study_name, storage=url)
    json.dumps(study.user_attrs)
    assert study.user_attrs["key"] == _key().to_dict()


def _wl() -> TuneWorkload:
    return TuneWorkload(model=MODELS["qwen3-30b"], tokens=128, nodes=1, gpus_per_node=4)


def test_warm_start_runs_default_and_priors_first(tmp_path: Path) -> None:
    space = SearchSpace(load_policy("proxy:ibrc"), experts=128, ep_size=4)
    study = open_study("moetune/test", f"sqlite:///{tmp_path / 's.db'}", seed=0)
    n = enqueue_warm_start(study, space)
    assert n == len(space.priors()) >= 3
    enqueue_warm_start(study, space)  # idempotent
    seen = []
    run_study(study, space, CallableBackend(lambda k, w: seen.append(k) or 1.0), _wl(), trials=n)
    assert seen == [k for _, k in space.priors()]
    assert study.trials[0].user_attrs["warm_start"] == "policy_default"


DRIVER = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, {testdir!r})
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.search.backends import CallableBackend
    from moetune.tuner.search.tune import tune_profiles_detailed
    from moetune.tuner.store.store import Store
    ns = {{}}
    exec(open({helpers!r}).read(), ns)
    store = Store({db!r})
    facts = ns["Facts"]()
    def f(k, wl):
        time.sleep({sleep})
        return ns["synthetic"](k, wl)
    res = tune_profiles_detailed(store, facts, models=[MODELS["qwen3-30b"]], tokens=[128], backend=CallableBackend(f),
                                 trials={trials}, storage={url!r}, families=["proxy:ibrc"])
    print("DONE", res[0].written, res[0].study.trials)
''')


def _finished_in(db: Path) -> int:
    if not db.exists():
        return 0
    con = sqlite3.connect(db, timeout=5)
    try:
        return con.execute("select count(*) from trials where state in ('COMPLETE','FAIL','PRUNED')").fetchone()[0]
    except sqlite3.OperationalError:
        return 0
    finally:
        con.close()


def test_kill_9_mid_study_then_rerun_completes(tmp_path: Path) -> None:
    import inspect

    src = tmp_path / "helpers.py"
    src.write_text(textwrap.dedent('''
        class _F:
            def __init__(self, name): self.name = name
    ''') + textwrap.dedent(inspect.getsource(Facts)).replace(
        "from moetune.tuner.search.tune import _Fam\n\n        return [_Fam", "return [_F").replace("_Fam(", "_F(")
        + "\nfrom moetune.runtime.knobs import Knobs\nfrom moetune.tuner.search.backends import TuneWorkload\n"
        + textwrap.dedent(inspect.getsource(synthetic)))
    db, sdb = tmp_path / "moetune.db", tmp_path / "studies.db"
    trials = 60
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(testdir=str(tmp_path), helpers=str(src), db=str(db), sleep=0.03, trials=trials,
                                    url=f"sqlite:///{sdb}"))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while _finished_in(sdb) < 12 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    killed_at = _finished_in(sdb)
    assert 12 <= killed_at < trials
    store = Store(db)
    assert store.get_current(_key()) is None  # nothing half-written became current

    rerun = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr.decode()[-3000:]
    assert b"DONE True" in rerun.stdout
    for path in (db, sdb):
        con = sqlite3.connect(path)
        assert con.execute("pragma integrity_check").fetchone()[0] == "ok"
        con.close()
    # as tune.py builds it: the bucket's token count bounds the PUT grid (and is in the study config)
    m = MODELS["qwen3-30b"]
    space = SearchSpace(load_policy("proxy:ibrc"), experts=m.experts, ep_size=4, tokens=_wl().tokens, topk=m.topk)
    name = study_name(_key(), CallableBackend(synthetic).label, "qwen3-30b", study_config(space, CallableBackend(synthetic), _wl()))
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{sdb}")
    assert finished_trials(study) == trials
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states
    interrupted = [t for t in study.trials if "interrupted" in str(t.user_attrs.get("error", ""))]
    assert len(interrupted) <= 1
    cur = store.get_current(_key())
    assert cur is not None and cur.status == "current"
    assert cur.latency_us == pytest.approx(study.best_value)
    assert cur.knobs == Knobs.from_dict(study.best_trial.user_attrs["knobs"])


def test_neighbour_bucket_warm_starts_and_cross_bucket_pruning(tmp_path: Path) -> None:
    from moetune.tuner.search.study import BucketPrior, _Objective

    url = f"sqlite:///{tmp_path / 'n.db'}"
    res = tune_profiles_detailed(None, Facts(), models=[MODELS["qwen3-30b"]], tokens=[1024, 128],
                                 backend=CallableBackend(synthetic), trials=8, storage=url,
                                 families=["proxy:ibrc"])
    assert [r.study.workload.tokens for r in res] == [128, 1024]
    big = optuna.load_study(study_name=res[1].study.study_name, storage=url)
    assert big.user_attrs["neighbour_bucket"]["bucket"] == 128
    transfer = [t for t in big.trials if str(t.user_attrs.get("warm_start", "")).startswith("bucket_transfer:128")]
    assert transfer  # the smaller bucket's best settings were tried first

    # A setting the neighbouring bucket measured clearly bad is not benchmarked again (unless a warm start).
    space = SearchSpace(load_policy("proxy:ibrc"), experts=128, ep_size=4)
    bad, good = space.policy.defaults, space.priors()[1][1]
    runs: list[Knobs] = []
    obj = _Objective(space, CallableBackend(lambda k, w: runs.append(k) or 1.0), _wl(), prune=False,
                     cross=BucketPrior(128, "n", {bad: 300.0, good: 100.0}))
    study = optuna.create_study()
    study.enqueue_trial(space.params_of(bad))
    study.enqueue_trial(space.params_of(bad), user_attrs={"warm_start": "policy_default"})
    study.enqueue_trial(space.params_of(good))
    study.optimize(obj, n_trials=3)
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.COMPLETE]
    assert study.trials[0].user_attrs["pruned_by"]["bucket"] == 128
    assert runs == [bad, good]


CAPTURES = Path(__file__).parent / "captures"


@pytest.mark.skipif(not (CAPTURES / "dgx-h100").is_dir(), reason="discovery test captures not present")
@pytest.mark.parametrize(("capture", "families"), [
    ("dgx-h100", {"nvlink", "proxy:ibrc", "ibgda", "host_staged", "collective"}),
    ("rtx4090x4", {"host_staged", "collective"}),
    ("perlmutter", {"nvlink", "proxy:libfabric/cxi", "host_staged", "collective"}),
])
def test_only_discovered_transports_are_tuned(tmp_path: Path, capture: str, families: set[str]) -> None:
    from moetune.tuner.fabric.discovery import discover

    facts = discover(CAPTURES / capture)
    store = Store(tmp_path / "m.db")
    seen: set[str] = set()

    def f(k: Knobs, wl: TuneWorkload) -> float:
        seen.add(k.transport)
        return synthetic(k, wl)

    res = tune_profiles_detailed(store, facts, models=[MODELS["qwen3-30b"]], tokens=[256], backend=CallableBackend(f),
                                 trials=5, storage=f"sqlite:///{tmp_path / 's.db'}")
    assert {r.study.family for r in res} == families
    for r in res:
        key = r.record.key
        assert (key.fingerprint, key.software) == (facts.fingerprint, facts.software_hash)
        assert key.ep_size == max(1, facts.gpu_count) and key.token_bucket == 256
        assert store.get_current(key) is not None
        assert r.record.software_versions == {k: str(v) for k, v in facts.software.items()}
    assert seen == {load_policy(fam).transport for fam in families}


def test_preset_facts_carry_the_preset_link_rates() -> None:
    """A preset's NVLink and NIC rates reach the analytic priors (the old probe read flat keys a
    preset never has, so every preset gave none)."""
    from moetune.tuner.fabric_model.presets import load_preset
    from moetune.tuner.search.tune import PresetFacts, facts_link_rates

    preset = load_preset("ndr-ibrc-h100x8")
    facts = PresetFacts.from_preset(preset)
    assert facts.gpu_count == preset.gpus_per_node == 8
    assert facts_link_rates(facts) == {"link_gbps": preset.get("nvlink.egress_gbps"),
                                       "nic_gbit": preset.get("nic.gbps") * 8}


def test_discovered_facts_give_link_rates() -> None:
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.search.tune import facts_link_rates

    facts = discover(Path(__file__).parent / "captures" / "dgx-h100")
    rates = facts_link_rates(facts)
    assert rates["link_gbps"] == facts.nvlink_gbs_per_gpu > 0
    assert rates["nic_gbit"] == max(p.rate_gbps for n in facts.nics for p in n.active_ports)


def test_a_model_tune_stores_the_policy_default_for_knobs_the_model_cannot_tell_apart(tmp_path: Path) -> None:
    """The fabric model does not read host_staged's channels / staging_slots / wait_mode / combine_lanes: every value
    predicts the same, so the study must not offer them (it would store its first trial's values as tuned)."""
    from moetune.tuner.fabric_model.predict import KNOBS_READ

    store = Store(tmp_path / "moetune.db")
    res = tune_profiles_detailed(store, Facts(), models=[MODELS["qwen3-30b"]], tokens=[1000], backend="model",
                                 preset="pcie4-consumer-4090x4", families=["host_staged"], trials=12,
                                 storage=f"sqlite:///{tmp_path / 'studies.db'}", ep_size=4)
    rec = res[0].record
    assert rec is not None
    defaults = load_policy("host_staged").defaults.to_dict()
    ignored = set(Knobs.__struct_fields__) - KNOBS_READ["host_staged"]
    assert ignored and {n: rec.knobs.to_dict()[n] for n in ignored} == {n: defaults[n] for n in ignored}


@pytest.mark.parametrize("trials", [0, 100_001, 10**20])
def test_tune_profiles_refuses_a_trial_count_out_of_bounds_before_any_study(trials: int) -> None:
    """The library entry keeps the bound the CLI, config and plan keep (runtime.config.MAX_TRIALS): 10**20 trials
    started a study that never ended."""
    from moetune.runtime.config import MAX_TRIALS
    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.tune import tune_profiles_detailed

    with pytest.raises(ValueError, match=f"trials must be 1 to {MAX_TRIALS}, got {trials}"):
        tune_profiles_detailed(None, None, models=[get_model("qwen3-30b")], tokens=[128], trials=trials)
