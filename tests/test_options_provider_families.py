"""A profile's family is `proxy:ibrc`, `proxy:ucx` or `proxy:libfabric/PROVIDER` (tuner/fabric/families.py), never a
bare `proxy`; the table of which data-path runtime options act on which family (options.DATA_PATH_FAMILIES) is by
transport. `options_acting_on` looked the family up as it is: every proxy profile's family was "unknown", so every
option was compared for it. A proxy profile tuned under the defaults was not applied as tuned to a job that only
switched host_staged's copy engines off (`MOETUNE_HS_NATIVE=0`) or nvlink's gather (`MOETUNE_NVL_GATHER=0`), options
its data path never reads, and every such change started its study anew. A family of a transport the table does not
know (ibgda) still takes every option."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_client_perf_env import QWEN, db_client, node_db, qkey  # noqa: F401  (node_db: a fixture)

from moetune.runtime.knobs import default_knobs
from moetune.runtime.options import RuntimeOptions, options_acting_on
from moetune.runtime.profile_record import ProfileRecord
from moetune.runtime.profiles.errors import FallbackWarning
from moetune.runtime.profiles.tuned_options import compare_options, relevant_options
from moetune.tuner.search.local_backend import LocalBackend

pytestmark = pytest.mark.timeout(120)
DEFAULTS = RuntimeOptions().data_path()
NOT_PROXY = RuntimeOptions(hs_native=not DEFAULTS["hs_native"], nvl_gather=not DEFAULTS["nvl_gather"]).data_path()
PROXY_FAMILIES = ("proxy:ibrc", "proxy:ucx", "proxy:libfabric", "proxy:libfabric/cxi")


@pytest.mark.parametrize("family", PROXY_FAMILIES)
def test_a_proxy_family_is_compared_on_the_proxy_options_only(family: str) -> None:
    assert options_acting_on(family) == options_acting_on("proxy")
    assert compare_options(DEFAULTS, NOT_PROXY, family).status == "same"
    cmp = compare_options(DEFAULTS, RuntimeOptions(proxy_batch=DEFAULTS["proxy_batch"] + 1).data_path(), family)
    assert cmp.status == "differs" and cmp.differences[0].startswith("proxy_batch:")
    assert set(relevant_options(DEFAULTS, family)) == set(options_acting_on("proxy"))


def test_a_family_of_an_unknown_transport_still_takes_every_option() -> None:
    assert compare_options(DEFAULTS, NOT_PROXY, "ibgda").status == "differs"
    assert compare_options(DEFAULTS, NOT_PROXY, "custom:x").status == "differs"


def test_a_proxy_study_is_not_started_anew_for_an_option_it_never_reads() -> None:
    def digest(env: dict[str, str]) -> Any:
        be = LocalBackend(world=2, command=["x"], env={"HOME": "/nonexistent", **env}, family="proxy:ibrc")
        return be.settings()["runtime_options"]

    assert digest({"MOETUNE_HS_NATIVE": "0", "MOETUNE_NVL_GATHER": "0"}) == digest({})
    assert digest({"MOETUNE_PROXY_BATCH": "4"}) != digest({})


def test_a_proxy_ibrc_profile_is_tuned_for_a_job_that_changed_only_host_staged_options(node_db, tmp_path) -> None:  # noqa: F811
    key = msgspec.structs.replace(qkey(), transport_family="proxy:ibrc")
    rec = ProfileRecord(key=key, knobs=default_knobs("proxy"), latency_us=20.0, spread_us=0.1, backend="local:nccl",
                        provenance="measured", perf_env={}, runtime_options=DEFAULTS)
    db = node_db([rec])
    c = db_client(tmp_path, db, {"MOETUNE_HS_NATIVE": "0", "MOETUNE_NVL_GATHER": "0", "HOME": "/nonexistent"})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = c.resolve(model=QWEN, ep_size=2, tokens=100, transport_family="proxy:ibrc")
    finally:
        c.close()
    fell = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert res.source == "database" and res.tuned and res.options_status == "same", (res, fell)
