"""A rerun with other measurement settings (routing, metric, policy, a recalibrated model) is its own study:
never resumed into the earlier one's trials, whose numbers measured something else."""

from __future__ import annotations

from pathlib import Path

import optuna

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import MODELS
from moetune.tuner.search.backends import CallableBackend, TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend
from moetune.tuner.search.tune import _Fam, tune_profiles_detailed

optuna.logging.set_verbosity(optuna.logging.ERROR)


class Facts:
    fingerprint = "f" * 64
    software_hash = "s" * 64
    software = {"torch": "2.13.0"}  # noqa: RUF012
    gpu_count = 4
    link_rates = {"nic_gbit": 400.0}  # noqa: RUF012
    transports = [_Fam("proxy:ibrc")]  # noqa: RUF012


def value(k: Knobs) -> float:
    """A fabric-like objective where compression and grouping pay."""
    t = 500.0 * (0.7 if k.compression != "none" else 1.0)
    t *= 0.8 if k.signalling != "coupled" else 1.0
    return t * (1 + abs(k.num_sms - 32) / 64)


def _tune(url: str, backend, trials: int = 6, **kw) -> list:
    return tune_profiles_detailed(None, Facts(), models=[MODELS["qwen3-30b"]], tokens=[128], backend=backend,
                                  trials=trials, storage=url, families=["proxy:ibrc"], **kw)


def test_other_routing_is_another_study(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    routings: list[str] = []
    be = CallableBackend(lambda k, w: routings.append(w.routing) or value(k))
    r1 = _tune(url, be, routing="uniform")
    r2 = _tune(url, be, routing="zipf:1.2")
    assert routings.count("zipf:1.2") == 6  # measured under the routing asked for, not resumed from uniform
    assert r1[0].study.study_name != r2[0].study.study_name
    # the same routing again resumes its own study: nothing left to run
    _tune(url, be, routing="uniform")
    assert len(routings) == 12


class MetricBackend(LocalBackend):
    """A local backend whose runs are faked in-process: the comm figure is a tenth of the layer's."""

    def __init__(self, metric: str):
        # nccl: the facts' node has 4 GPUs (gloo, CPU processes, is refused there); the runs are fakes
        super().__init__(world=4, comm_backend="nccl", repeats=1, metric=metric)
        self.runs: list[str] = []

    def run_once(self, knobs: Knobs, workload: TuneWorkload) -> tuple[float | None, dict, str | None]:
        self.runs.append(self.metric)
        return value(knobs) / (10 if self.metric == "comm" else 1), {}, None


def test_other_metric_is_another_study(tmp_path: Path) -> None:
    """`moetune tune --backend local` times the whole layer, `moetune profile` the round trip only (labelled
    local:nccl and local:nccl:comm): one study of both would rank layer times against comm times."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    _tune(url, MetricBackend("layer"))
    comm = MetricBackend("comm")
    res = _tune(url, comm)
    assert comm.runs.count("comm") >= 6
    study = optuna.load_study(study_name=res[0].study.study_name, storage=url)
    assert all(t.value < 100 for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE)


def test_policy_override_is_another_study(tmp_path: Path) -> None:
    """A policy that forbids a knob value must not get a stored best that uses it from an earlier study."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    r1 = _tune(url, CallableBackend(lambda k, w: value(k)), trials=12)
    assert r1[0].study.best_knobs.compression != "none"  # the unrestricted search found compression pays
    pol = tmp_path / "pol.toml"
    pol.write_text('[policy]\nfamily = "proxy:ibrc"\n\n[knobs]\ncompression = ["none"]\n')
    r2 = _tune(url, CallableBackend(lambda k, w: value(k)), trials=12, policy_override=pol)
    assert r2[0].study.best_knobs.compression == "none"
    assert r2[0].record.knobs.compression == "none"


def test_recalibrated_model_is_another_study(tmp_path: Path) -> None:
    """A node model recalibrated under the same name predicts other numbers: its study is not resumed into the
    old model's predictions (which would all be counted as done and rewritten as the profile)."""
    from moetune.tuner.fabric_model.presets import load_preset
    from moetune.tuner.search.model_backend import ModelBackend

    url = f"sqlite:///{tmp_path / 's.db'}"
    old = load_preset("ndr-ibrc-h100x8")
    new = old.with_params({"nic.gbps": old.get("nic.gbps") / 2}, name=old.name)
    r1 = _tune(url, ModelBackend(old), nodes=2)  # across the NIC
    r2 = _tune(url, ModelBackend(new), nodes=2)
    assert r1[0].study.study_name != r2[0].study.study_name
    assert r2[0].record.latency_us != r1[0].record.latency_us


def test_an_edited_preset_of_the_same_name_has_its_own_profile_key(tmp_path: Path) -> None:
    """A calibrated or edited copy of a preset keeps the shipped preset's name: its profile key must still differ
    (it keyed by name alone, so a fabric ~10x slower was "kept" under the shipped preset's profile, and the other way
    round replaced it). Same content → same key, so a rerun of one preset still finds its own profile."""
    from moetune.tuner.fabric_model.presets import load_preset
    from moetune.tuner.store import Store

    shipped = load_preset("ndr-ibgda-h100x8")
    slow = tmp_path / "slow.toml"  # the NIC ten times slower, the name unchanged
    slow.write_text(shipped.with_params({"nic.gbps": shipped.get("nic.gbps") / 10}, name=shipped.name).to_toml())
    same = tmp_path / "same.toml"  # the shipped content in a file of its own: the shipped preset's key
    same.write_text(shipped.to_toml())
    url = f"sqlite:///{tmp_path / 's.db'}"

    def tune(store: Store, preset: str) -> list:
        return tune_profiles_detailed(store, None, models=[MODELS["qwen3-30b"]], tokens=[1024], backend="model",
                                      preset=preset, trials=4, nodes=2, storage=url)

    with Store(tmp_path / "p.db") as store:
        [a] = tune(store, "ndr-ibgda-h100x8")
        [b] = tune(store, str(slow))
        assert a.stored == "new" and b.stored == "new", (a.reason, b.reason)
        assert a.record.key.fingerprint != b.record.key.fingerprint
        assert a.record.key.fingerprint.startswith("preset:ndr-ibgda-h100x8:")
        assert b.record.latency_us > a.record.latency_us
        # the shipped preset's profile is still current under its key, its number its own
        assert store.get_current(a.record.key).latency_us == a.record.latency_us
        [c] = tune(store, str(same))
        assert c.record.key == a.record.key


def test_one_shape_spelt_two_ways_is_one_study(tmp_path: Path) -> None:
    # `custom:2048,768,128,8` is qwen3-30b's shape, and `custom:H,I,E,K` is `custom:H,I,E,K,bfloat16` (the daemon's
    # re-tune spells the dtype out): each spelling was a study of its own for one key, so a rerun started over
    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.study import study_model_name

    url = f"sqlite:///{tmp_path / 's.db'}"
    calls: list[Knobs] = []
    be = CallableBackend(lambda k, w: calls.append(k) or value(k))

    def tune(spec: str) -> list:
        return tune_profiles_detailed(None, Facts(), models=[get_model(spec)], tokens=[128], backend=be, trials=6,
                                      storage=url, families=["proxy:ibrc"])

    first = tune("qwen3-30b")
    assert len(calls) == 6
    again = tune("custom:2048,768,128,8")
    assert len(calls) == 6 and again[0].study.study_name == first[0].study.study_name  # resumed: nothing left to run
    assert study_model_name(get_model("custom:4096,1024,64,4")) == study_model_name(
        get_model("custom:4096,1024,64,4,bfloat16")) == "custom:4096,1024,64,4"
    assert study_model_name(get_model("custom:4096,1024,64,4,float16")) == "custom:4096,1024,64,4,float16"
    assert study_model_name(get_model("deepseek-v3")) == "deepseek-v3"


def test_a_programs_own_shapes_of_one_name_are_studies_of_their_shapes() -> None:
    """A program's own ModelShape kept its name in the study name: two shapes named alike with other dimensions (other
    profile keys) shared one study, one resuming the other's trials; one named like a known model but of other
    dimensions took that model's name. The study is the shape's, whatever it is named."""
    from moetune.runtime.shapes import ModelShape
    from moetune.tuner.search.study import study_model_name

    a = ModelShape(name="mine", hidden=1024, intermediate=512, experts=32, topk=4)
    b = ModelShape(name="mine", hidden=2048, intermediate=512, experts=32, topk=4)
    assert study_model_name(a) == "custom:1024,512,32,4" and study_model_name(b) == "custom:2048,512,32,4"
    fake = ModelShape(name="qwen3-30b", hidden=1024, intermediate=512, experts=32, topk=4)
    assert study_model_name(fake) == "custom:1024,512,32,4"
    assert study_model_name(ModelShape(name="q", hidden=2048, intermediate=768, experts=128, topk=8)) == "qwen3-30b"
