"""The search space never yields an infeasible setting, and its conditional structure holds."""

from __future__ import annotations

import warnings
from pathlib import Path

import optuna
import pytest

from moetune.runtime.knobs import PER_PE, QUEUED, KnobError, Knobs
from moetune.tuner.search.policy import load_policy
from moetune.tuner.search.space import (
    PUT_GROUP_SIZES,
    SearchSpace,
    nvlink_ctas_per_peer,
    sample_infeasible_free,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)

FAMILIES = ["nvlink", "host_staged", "collective", "proxy:ibrc", "proxy:libfabric/cxi", "ibgda"]
# (experts, ep_size): 64, 8, 4 and 1 transfers per remote PE.
LAYOUTS = [(128, 2), (256, 32), (128, 32), (128, 128)]


def _assert_feasible(space: SearchSpace, k: Knobs) -> None:
    pol = space.policy
    assert k.transport == pol.transport
    if k.transport == "nvlink":  # group size divides the CTAs per peer (the kernel's groups)
        cpp = nvlink_ctas_per_peer(k.num_sms, space.ep_size)
        assert k.group_size == PER_PE or (k.group_size < cpp and cpp % k.group_size == 0)
    elif k.transport in QUEUED:  # PUT groups: only with chunking (more than one PUT per peer)
        assert k.group_size == PER_PE or (k.chunk_tokens > 0 and k.group_size in PUT_GROUP_SIZES)
    else:
        k.check_workload(space.tpp)  # group size divides the transfers per PE
    assert not (k.fence_mode == "nic_ordered" and k.qp_mapping == "round_robin" and k.qps_per_pe > 1)
    if k.compression != "none":
        assert pol.compression_error(k.compression, k.scale_granularity) <= pol.error_budget
    else:
        assert k.scale_granularity == "per_token"
    if k.signalling == "coupled":
        assert k.group_size == PER_PE
    if k.transport not in QUEUED:
        assert k.qps_per_pe == 1
    space.check(k)


def _sample(space: SearchSpace, sampler: optuna.samplers.BaseSampler, n: int) -> list[tuple[dict, Knobs]]:
    study = optuna.create_study(sampler=sampler)
    out = []

    def obj(trial: optuna.Trial) -> float:
        k = space.suggest(trial)
        out.append((dict(trial.params), k))
        return float(hash(k) % 1000)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study.optimize(obj, n_trials=n)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_settings_are_always_feasible(family: str) -> None:
    pol = load_policy(family)
    for experts, ep in LAYOUTS:
        space = SearchSpace(pol, experts=experts, ep_size=ep)
        grid = set(space.enumerate())
        for k in sample_infeasible_free(space, 400, seed=experts + ep):
            _assert_feasible(space, k)
            assert k in grid
    space = SearchSpace(pol, experts=128, ep_size=32)
    grid = set(space.enumerate())
    for sampler in (optuna.samplers.RandomSampler(seed=1),
                    optuna.samplers.TPESampler(seed=1, multivariate=True, group=True, n_startup_trials=10)):
        for params, k in _sample(space, sampler, 60):
            _assert_feasible(space, k)
            assert k in grid
            # Conditional parameters appear only where they apply.
            assert ("group_size" in params) <= (k.signalling == "decoupled")
            assert ("fence_mode" in params) <= (k.transport == "proxy")
            assert ("qps_per_pe" in params) <= (k.transport in QUEUED)
            assert ("qp_mapping" in params) <= (k.qps_per_pe > 1 and k.fence_mode != "nic_ordered")
            assert ("scale_granularity" in params) <= (k.compression != "none")


@pytest.mark.parametrize("family", FAMILIES)
def test_grid_points_are_unique_feasible_and_round_trip(family: str) -> None:
    space = SearchSpace(load_policy(family), experts=128, ep_size=32)
    pts = list(space.enumerate())
    assert len(pts) == len(set(pts)) > 10
    for k in pts:
        _assert_feasible(space, k)
        params = space.params_of(k)
        assert space.knobs_from_params(params) == k


def test_grid_size_of_the_benchmark_spaces() -> None:
    # proxy: 1152 points before num_sms (3 values) and pipeline_depth (2), which the proxy ignores, were
    # pinned: 192; then group sizes only with chunking (with chunk_tokens 0 each peer gets one PUT, one
    # signal whatever the group size): 168, the same at every EP size (PUT groups, not experts per rank)
    sizes = {f: SearchSpace(load_policy(f), experts=128, ep_size=32).size() for f in ("proxy:ibrc", "proxy:libfabric/cxi")}
    assert all(s == 168 for s in sizes.values()), sizes
    assert 500 <= SearchSpace(load_policy("host_staged"), experts=128, ep_size=4).size() <= 1500


def test_proxy_group_sizes_are_put_groups_asked_only_with_chunking() -> None:
    # proxy/ibgda group PUTs per peer, not the experts per rank: the same choices at every layout, and only
    # where chunk_tokens > 0 gives more than one PUT per peer
    for fam in ("proxy:ibrc", "ibgda"):
        for experts, ep in ((256, 32), (32, 32), (128, 8)):
            space = SearchSpace(load_policy(fam), experts=experts, ep_size=ep)
            assert space.spec["group_size"].values() == (PER_PE, *PUT_GROUP_SIZES)
            assert space.group_values(chunk_tokens=0) == (PER_PE,)
            for k in space.enumerate():
                if k.chunk_tokens == 0:
                    assert k.group_size == PER_PE, k
            assert {k.group_size for k in space.enumerate() if k.chunk_tokens > 0 and k.signalling == "decoupled"} \
                == {PER_PE, *PUT_GROUP_SIZES}
    space = SearchSpace(load_policy("proxy:ibrc"), experts=128, ep_size=8)
    base = space.policy.defaults.replace(signalling="decoupled")
    with pytest.raises(KnobError, match="chunk_tokens 0"):
        space.check(base.replace(group_size=4, chunk_tokens=0))
    space.check(base.replace(group_size=4, chunk_tokens=256))
    # a size that does not divide the experts per rank (16) is fine: it counts PUTs
    with pytest.raises(KnobError, match="not offered for PUT groups"):
        space.check(base.replace(group_size=3, chunk_tokens=256))
    # warm start / stored knob sets: projection drops a group size chunking cannot use, and check agrees
    proj = space.project(base.replace(group_size=4, chunk_tokens=0))
    assert proj.group_size == PER_PE and proj.chunk_tokens == 0 and space.feasible(proj)[0]
    assert space.project(base.replace(group_size=4, chunk_tokens=256)).group_size == 4
    assert space.knobs_from_params(space.params_of(base.replace(group_size=8, chunk_tokens=256))).group_size == 8


def test_compression_beyond_budget_is_never_offered(tmp_path: Path) -> None:
    over = tmp_path / "strict.toml"
    over.write_text("[compression]\nerror_budget = 0.01\n")
    for family in FAMILIES:
        space = SearchSpace(load_policy(family, over), experts=128, ep_size=8)
        assert all(k.compression == "none" for k in space.enumerate())
        with pytest.raises(KnobError, match="over the policy's budget"):
            space.check(space.policy.defaults.replace(compression="fp8_e4m3"))
    # One granularity within budget, the other not: only that one is offered.
    mixed = tmp_path / "mixed.toml"
    mixed.write_text('[policy]\nfamily = "nvlink"\n[compression.expected_error]\n"fp8_e4m3/per_token" = 0.08\n')
    space = SearchSpace(load_policy("nvlink", mixed), experts=128, ep_size=8)
    grans = {k.scale_granularity for k in space.enumerate() if k.compression != "none"}
    assert grans == {"per_128"}


def test_check_refuses_what_the_policy_does_not_allow() -> None:
    space = SearchSpace(load_policy("proxy:ibrc"), experts=128, ep_size=32)
    base = space.policy.defaults
    with pytest.raises(KnobError):
        space.check(base.replace(num_sms=100))
    with pytest.raises(KnobError):
        space.check(base.replace(signalling="decoupled", group_size=3))
    with pytest.raises(KnobError):
        space.check(Knobs(transport="nvlink", fence_mode="none"))


def test_priors_start_with_the_policy_default_and_are_feasible() -> None:
    for family in FAMILIES:
        space = SearchSpace(load_policy(family), experts=128, ep_size=16)
        pri = space.priors()
        assert pri[0] == ("policy_default", space.policy.defaults)
        for _, k in pri:
            _assert_feasible(space, k)
    # SM count from link bandwidth (478 GB/s x 0.9 / 20 GB/s per SM = 22 -> nearest allowed 24) and
    # QPs from the NIC rate (400 Gb/s / 8 x 0.9 / 12.5 GB/s per QP = 4).
    nv = dict(SearchSpace(load_policy("nvlink"), experts=128, ep_size=2).priors())["prior:per_pe"]
    assert nv.num_sms == 24 and nv.signalling == "decoupled" and nv.group_size == PER_PE
    px = dict(SearchSpace(load_policy("proxy:ibrc"), experts=128, ep_size=16).priors())["prior:per_pe"]
    assert px.qps_per_pe == 4 and px.fence_mode == "nic_ordered" and px.qp_mapping == "peer_hash"
    slow = dict(SearchSpace(load_policy("proxy:ibrc"), experts=128, ep_size=16,
                            link_rates={"nic_gbit": 100.0}).priors())["prior:per_pe"]
    assert slow.qps_per_pe == 1
