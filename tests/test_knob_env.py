"""A knob set is measured in the environment it is served in (launcher_env is the one source), that
environment caps no NCCL communicator of the job, and `channels` on an EP sub-group says it is not honoured."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from moetune.runtime.knobs import TRANSPORTS, default_knobs
from moetune.runtime.profiles.launcher_env import ENV_RULES, launcher_env
from moetune.runtime.testing.launch import launch
from moetune.tuner.search.local_backend import LocalBackend, knob_environment

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import this module by name

FAMILIES = ["nvlink", "proxy:ibrc", "proxy:ucx", "proxy:libfabric/cxi", "ibgda", "host_staged", "collective"]


def _knob_sets():
    for t in TRANSPORTS:
        k = default_knobs(t)
        for ch in (1, 2, 4, 8):
            yield k.replace(channels=ch)


def test_tuner_measures_in_the_served_environment() -> None:
    for k in _knob_sets():
        for fam in [*FAMILIES, k.transport]:
            assert knob_environment(k, fam) == launcher_env(k, fam, 1), (k.transport, fam)
    be = LocalBackend(world=2, comm_backend="gloo", env={"KEEP": "1"})
    k = default_knobs("host_staged").replace(channels=4)
    assert be.environment(k) == {"KEEP": "1", **launcher_env(k, "host_staged", 1)}


def test_no_job_wide_nccl_variable() -> None:
    # NCCL_* reach every communicator of the job (the data-parallel all-reduce too): none is produced
    for k in _knob_sets():
        for fam in FAMILIES:
            for nodes in (1, 2):
                env = launcher_env(k, fam, nodes)
                assert not [v for v in env if v.startswith("NCCL_")], (k.transport, fam, env)
                assert not [v for v in knob_environment(k, fam) if v.startswith("NCCL_")]
    assert not [v for v in ENV_RULES if v.startswith("NCCL_")]


def case_subgroup_channels(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from moetune.runtime.transports.collective import CollectiveTransport

    sub = dist.new_group(ranks=[0, 1])
    whole = dist.new_group(ranks=list(range(world)))
    got: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank in (0, 1):
            a = CollectiveTransport(sub, default_knobs("collective"), "cpu", channels=3)
            b = CollectiveTransport(sub, default_knobs("collective"), "cpu", channels=3)
            got["sub_channels"] = (a.channels, b.channels)
        w = CollectiveTransport(whole, default_knobs("collective"), "cpu", channels=2)
        got["whole_channels"] = w.channels
    got["warnings"] = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    return got


@pytest.mark.timeout(60)
def test_channels_on_a_subgroup_warn_once() -> None:
    res = launch(case_subgroup_channels, 3, timeout_s=20, join_timeout_s=55)
    for rank in (0, 1):
        assert res[rank]["sub_channels"] == (1, 1)  # one communicator: not honoured ...
        assert len(res[rank]["warnings"]) == 1, res[rank]  # ... and said once, not silently
        assert "not the whole world" in res[rank]["warnings"][0]
    assert res[2]["warnings"] == []
    assert all(r["whole_channels"] == 2 for r in res)  # the whole world gets its extra communicator


@pytest.mark.parametrize("provider", ["cxi", "efa", "verbs", "psm3", "a" * 32, "9x", "1", "a" * 33, "Efa", "cxi-1"])
def test_a_libfabric_family_is_taken_exactly_where_its_provider_can_be_exported(provider: str) -> None:
    """The store's import, a policy lookup and launcher_env decide on a libfabric provider's name by one rule: a family
    the store took (proxy:libfabric/9x, or a 40-letter name) had a provider NVSHMEM_LIBFABRIC_PROVIDER's rule refuses,
    so its profile could be stored and served but never applied (a warning at the launcher only)."""
    from moetune.tuner.search.policy import _PROVIDER_FAMILY
    from moetune.tuner.store.validate import is_known_family

    family = f"proxy:libfabric/{provider}"
    exportable = ENV_RULES["NVSHMEM_LIBFABRIC_PROVIDER"].fullmatch(provider) is not None
    assert is_known_family(family) is exportable
    assert (_PROVIDER_FAMILY.fullmatch(family) is not None) is exportable
    if exportable:
        env = launcher_env(default_knobs("proxy"), family)
        assert env["NVSHMEM_LIBFABRIC_PROVIDER"] == provider
    assert exportable is (provider[0].isalpha() and provider.islower() and len(provider) <= 32 and "-" not in provider)
