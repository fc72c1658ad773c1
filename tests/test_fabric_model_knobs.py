"""Which knobs the fabric model reads, and a search on it that keeps the others at the policy default.

A knob the model does not read gives every value the same MODELLED latency: a search that offered it would
store whichever value it tried first as if it had been tuned."""

from __future__ import annotations

import pytest

from moetune.runtime.knobs import KnobError, Knobs
from moetune.tuner.fabric_model.predict import KNOBS_READ, predict
from moetune.tuner.fabric_model.presets import list_presets, load_preset
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.search.model_backend import ModelBackend
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import SearchSpace

FAMILY_OF = {"proxy": ("proxy:ibrc", "ndr-ibrc-h100x8"), "ibgda": ("ibgda", "ndr-ibgda-h100x8"),
             "nvlink": ("nvlink", "nvlink-h200x2"), "collective": ("collective", "nvlink-h200x2"),
             "host_staged": ("host_staged", "pcie4-consumer-4090x4")}
# values a knob takes in some policy or the runtime, to vary the ones the model says it does not read
OTHER_VALUES = {"chunk_tokens": 256, "pipeline_depth": 4, "num_sms": 48, "channels": 4, "staging_slots": 8,
                "wait_mode": "kernel", "combine_lanes": "own", "mk_bm": 64, "mk_stages": 3, "mk_split_k": 2}


def _cases():
    for name in list_presets():
        pr = load_preset(name)
        for transport in pr.transports:
            yield name, transport


@pytest.mark.parametrize(("preset", "transport"), list(_cases()))
def test_knobs_outside_knobs_read_leave_the_prediction_unchanged(preset: str, transport: str) -> None:
    pr = load_preset(preset)
    fence = {"proxy": "proxy_drain", "ibgda": "nic_ordered"}.get(transport, "none")
    base = Knobs(transport=transport, fence_mode=fence)
    nodes = 1 if pr.max_nodes == 1 or transport == "nvlink" else 2
    for S in (64, 4096):
        w = Workload("qwen3-30b", S, nodes, pr.gpus_per_node)
        ref = predict(pr, w, base)
        for knob, value in OTHER_VALUES.items():
            if knob in KNOBS_READ[transport]:
                continue
            try:
                other = base.replace(**{knob: value})
            except KnobError:  # not a value this transport takes at all
                continue
            got = predict(pr, w, other)
            assert (got.dispatch_us, got.combine_us) == (ref.dispatch_us, ref.combine_us), (knob, S)


@pytest.mark.parametrize("transport", sorted(FAMILY_OF))
def test_a_model_search_asks_only_the_knobs_the_model_reads(transport: str) -> None:
    family, preset = FAMILY_OF[transport]
    pol = load_policy(family)
    be = ModelBackend(preset)
    pinned = be.pinned_knobs(transport)
    assert not pinned & KNOBS_READ[transport]
    space = SearchSpace(pol, experts=128, ep_size=16, pinned=pinned)
    asked = {n for n, s in space.spec.items() if len(s.values()) > 1}
    assert asked <= KNOBS_READ[transport], asked - KNOBS_READ[transport]
    # every point of the grid keeps the pinned knobs at the policy default
    defaults = pol.defaults.to_dict()
    for k in space.enumerate():
        assert all(k.to_dict()[n] == defaults[n] for n in pinned)
    # without pinning, the policies offer knobs the model cannot tell apart (the gap this closes); the proxy
    # policy does not offer pipeline_depth (the proxy runtime ignores it, tuner/search/space.py RUNTIME_READS);
    # the collective policy's pipeline_depth and channels are read by the model (its payload calls), so nothing
    # of it is pinned
    if transport in ("host_staged", "ibgda"):
        assert SearchSpace(pol, experts=128, ep_size=16).size() > space.size()
    if transport == "collective":
        assert SearchSpace(pol, experts=128, ep_size=16).size() == space.size()


def test_a_predictor_backend_pins_nothing() -> None:
    assert ModelBackend(predictor=lambda k, w: 1.0).pinned_knobs("collective") == frozenset()


@pytest.mark.parametrize("preset", [n for n in list_presets() if "nvlink" in load_preset(n).transports])
def test_nvlink_signalling_and_group_size_leave_the_prediction_unchanged(preset: str) -> None:
    """The nvlink model charges one round of device-write signals whatever the signalling and group size (at most
    (world - 1) x CTAs per peer < num_sms groups over num_sms CTAs), so neither is a knob the model reads."""
    pr = load_preset(preset)
    assert not {"signalling", "group_size"} & KNOBS_READ["nvlink"]
    for gpn in (2, pr.gpus_per_node, 8):
        for S in (1, 64, 4096):
            w = Workload("qwen3-30b", S, 1, gpn)
            for sms in (16, 24, 48, 132):
                base = Knobs(transport="nvlink", num_sms=sms)
                ref = predict(pr, w, base)
                for g in (0, 1, 2, 3, 4, 6):
                    got = predict(pr, w, base.replace(signalling="decoupled", group_size=g))
                    assert (got.dispatch_us, got.combine_us) == (ref.dispatch_us, ref.combine_us), (gpn, S, sms, g)


def test_a_model_tune_of_nvlink_stores_the_default_signalling(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Found with `moetune tune --backend model --preset nvlink-h200x2 -n 30`: the search asked signalling and
    group_size, every value tied, and the MODELLED profile stored `signalling=decoupled, group_size=2` as tuned."""
    from moetune.runtime.shapes import get_model
    from moetune.tuner.search.tune import tune_profiles_detailed
    from moetune.tuner.store.store import Store

    store = Store(tmp_path / "p.db")
    (res,) = tune_profiles_detailed(store, None, models=[get_model("qwen3-30b")], tokens=[1024], backend="model",
                                    preset="nvlink-h200x2", trials=30, storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert res.record is not None
    assert (res.record.knobs.signalling, res.record.knobs.group_size) == ("coupled", 0)
    pol = load_policy("nvlink")
    space = SearchSpace(pol, experts=128, ep_size=2, pinned=ModelBackend("nvlink-h200x2").pinned_knobs("nvlink"))
    assert space.spec["signalling"].values() == ("coupled",) and "pinned" in space.grid_rule()
    # a measuring backend still searches them (the kernel's fences are real on the GPU)
    assert SearchSpace(pol, experts=128, ep_size=2).spec["signalling"].values() == ("coupled", "decoupled")


def test_model_predict_and_sweep_say_which_given_knobs_the_model_does_not_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`model predict -k transport=nvlink,pipeline_depth=4` printed the same MODELLED number as without it, with no
    word that the model reads no pipeline_depth for nvlink: the knob the user set looked modelled. A note names the
    given knobs the model does not read (KNOBS_READ); knobs it reads, or knobs not given, get none."""
    import json

    from typer.testing import CliRunner

    from moetune.tuner.cli import app

    def notes(*args: str) -> list[str]:
        r = CliRunner().invoke(app, ["model", *args, "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["notes"]

    said = [n for n in notes("predict", "-p", "nvlink-h200x2", "-k", "transport=nvlink,pipeline_depth=4,num_sms=48")
            if "not read" in n]
    assert len(said) == 1 and "pipeline_depth" in said[0] and "num_sms" not in said[0], said
    assert not [n for n in notes("predict", "-p", "nvlink-h200x2", "-k", "transport=nvlink,num_sms=48") if "not read" in n]
    assert not [n for n in notes("predict", "-p", "nvlink-h200x2") if "not read" in n]
    said = [n for n in notes("sweep", "-p", "nvlink-h200x2", "--over", "tokens", "--values", "256",
                             "-k", "transport=collective,chunk_tokens=64") if "not read" in n]
    assert len(said) == 1 and "chunk_tokens" in said[0], said
