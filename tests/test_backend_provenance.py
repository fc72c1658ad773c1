"""A backend's provenance is a capability its class declares, never what its name says: the stored label,
`modelled`, and what a tune records and `tune show` reads all follow from it (a reviewer found
`CallableBackend(fn, name="local:x")` stored as measured, and the default "callable" stored as this node's model
while `modelled` said False)."""

from __future__ import annotations

import sys
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import provenance_of_backend
from moetune.runtime.shapes import ModelShape
from moetune.tuner.cli import app
from moetune.tuner.search.backends import BenchmarkBackend, CallableBackend, TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend
from moetune.tuner.search.model_backend import ModelBackend, NodeModelBackend
from moetune.tuner.search.readback import describe_study

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.timeout(120)
SMALL = ModelShape(name="custom:256,128,16,2", hidden=256, intermediate=128, experts=16, topk=2)


class _Fam:
    def __init__(self, name: str) -> None:
        self.name = name


class Facts:
    fingerprint, software_hash, gpu_count = "c" * 64, "d" * 64, 2
    software: dict = {}  # noqa: RUF012
    link_rates: dict = {}  # noqa: RUF012
    transports = (_Fam("collective"),)


def _tune(tmp_path: Path, be: BenchmarkBackend) -> tuple[object, object]:
    from moetune.tuner.search.tune import tune_profiles_detailed

    store = F.open_store(tmp_path / "m.db")
    url = f"sqlite:///{tmp_path / 'opt.db'}"
    res = tune_profiles_detailed(store, Facts(), models=[SMALL], tokens=[64], backend=be, trials=2,
                                 families=["collective"], storage=url)
    return res[0], store


@pytest.mark.parametrize("name", ["local:x", "callable", "model:node:" + "c" * 64])
def test_a_callable_is_never_stored_as_measured_whatever_its_name(tmp_path: Path, name: str) -> None:
    be = CallableBackend(lambda k, w: 10.0 + k.channels, name=name)
    assert be.provenance == "preset" and be.modelled
    # the label reads back what the class declared, never what the name claimed
    assert provenance_of_backend(be.label) == "preset"
    assert be.label == (name if name.startswith("model:") and not name.startswith("model:node:") else f"model:{name}")
    res, store = _tune(tmp_path, be)
    assert res.written and res.record.provenance == "preset" and res.record.backend == be.label
    [(_, stored)] = store.list_profiles()
    assert stored.provenance == "preset" and stored.effective_provenance == "preset"
    # `tune show` reads the study's flag: modelled, as the stored profile is
    assert describe_study(f"sqlite:///{tmp_path / 'opt.db'}", res.study.study_name)["modelled"] is True


def test_a_preset_named_like_a_nodes_model_is_labelled_as_a_preset(tmp_path: Path) -> None:
    """A modelling backend named "node:<fp>" was labelled "model:node:<fp>": the label of the calibrated model of node
    <fp>, which `provenance_of_backend` (what a record without a provenance is read by, and what `query`/`profiles
    show` say of its origin) reads as node_model, outranking every preset."""
    from moetune.runtime.profile_record import backend_label

    name = "node:" + Facts.fingerprint
    assert provenance_of_backend(backend_label("preset", name)) == "preset"
    be = CallableBackend(lambda k, w: 10.0 + k.channels, name=name)
    assert provenance_of_backend(be.label) == "preset" and be.label.endswith(name)
    _res, store = _tune(tmp_path, be)
    [(_, stored)] = store.list_profiles()
    assert stored.provenance == "preset" and provenance_of_backend(stored.backend, Facts.fingerprint) == "preset"
    # every declared provenance reads back from its label, whatever the name
    for prov in ("measured", "node_model", "preset"):
        for n in ("x", "local:x", "model:x", "node:x", "model:node:x", "local:model:node:x"):
            assert provenance_of_backend(backend_label(prov, n)) == prov, (prov, n, backend_label(prov, n))


def test_a_class_that_declares_measured_is_stored_as_measured(tmp_path: Path) -> None:
    be = F.measuring_fake(lambda k, w: 10.0 + k.channels, name="gloo")
    assert be.provenance == "measured" and not be.modelled and be.label == "local:gloo"
    res, _ = _tune(tmp_path, be)
    assert res.record.provenance == "measured" and res.record.backend == "local:gloo"
    assert res.record.measured_on == Facts.fingerprint


def test_every_backend_class_declares_its_provenance() -> None:
    assert (LocalBackend.provenance, ModelBackend.provenance, NodeModelBackend.provenance,
            CallableBackend.provenance) == ("measured", "preset", "node_model", "preset")
    assert LocalBackend.remeasures and not ModelBackend.remeasures and not CallableBackend.remeasures
    be = LocalBackend(world=2, comm_backend="gloo", command=["x"])
    assert be.label == "local:gloo" and not be.modelled
    assert LocalBackend(world=2, comm_backend="gloo", command=["x"], metric="comm").label == "local:gloo:comm"
    assert LocalBackend(world=1, family="megakernel").label == "local:megakernel"
    model = ModelBackend(predictor=lambda k, w: 1.0)
    assert model.modelled and provenance_of_backend(model.label) == "preset"
    node = model.as_node_model("f" * 64)
    assert isinstance(node, NodeModelBackend) and node.label == "model:node:" + "f" * 64 and node.modelled
    assert provenance_of_backend(node.label, "f" * 64) == "node_model"

    with pytest.raises(TypeError, match="must declare its provenance"):
        class Undeclared(BenchmarkBackend):  # no default: a forgotten declaration would pick one silently
            def evaluate(self, knobs, workload, *, report=None):  # type: ignore[no-untyped-def]
                raise AssertionError

    # the base's capabilities: every backend can be closed and set up for a family, whatever it holds
    cb = CallableBackend(lambda k, w: 1.0)
    cb.close()
    cb.for_family("collective", 0.01)
    assert cb.world is None and cb.refusal(ep_size=4, nodes=2, families=["collective"], gpu_count=8) == ""
    wl = TuneWorkload(model=SMALL, tokens=16)
    assert cb.evaluate(F.default_knobs("collective"), wl).ok


def test_the_local_backend_refuses_what_it_cannot_measure_and_sets_its_family() -> None:
    be = LocalBackend(world=2, comm_backend="gloo", command=["x"])
    assert "EP size 4" in be.refusal(ep_size=4, nodes=1, families=["collective"], gpu_count=0)
    assert "gloo measures CPU processes" in be.refusal(ep_size=2, nodes=1, families=["collective"], gpu_count=2)
    assert be.refusal(ep_size=2, nodes=1, families=["collective"], gpu_count=0) == ""
    be.for_family("collective", 0.02)
    assert (be.family, be.error_budget) == ("collective", 0.02)
    fixed = LocalBackend(world=2, comm_backend="gloo", command=["x"], error_budget=0.5)
    fixed.for_family("collective", 0.02)
    assert fixed.error_budget == 0.5  # set explicitly: the policy's does not replace it


def test_tune_show_calls_a_callables_study_modelled(tmp_path: Path) -> None:
    res, _ = _tune(tmp_path, CallableBackend(lambda k, w: 10.0 + k.channels))
    r = CliRunner().invoke(app, ["tune", "show", "--storage", f"sqlite:///{tmp_path / 'opt.db'}", "--study",
                                 res.study.study_name, "--json"])
    assert r.exit_code == 0, r.output
    assert '"modelled": true' in r.output
