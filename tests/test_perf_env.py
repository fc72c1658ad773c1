"""The performance environment (runtime/profiles/perf_env.py): which variables of a process steer the data path,
in one canonical form with a digest, and how a profile's recorded one compares with a job's.

Unrecorded, a profile measured with NCCL_P2P_DISABLE=1 (or NCCL_ALGO=Tree, FI_CXI_...) would be served to a job
without it as if it applied."""

from __future__ import annotations

import msgspec
import pytest

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles import perf_env as P
from moetune.runtime.profiles.launcher_env import ENV_RULES

JOB = {
    # the data path: kept
    "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_NET_GDR_LEVEL": "PHB",
    "NCCL_P2P_DISABLE": "1", "NCCL_BUFFSIZE": "16777216", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
    "NVSHMEM_SYMMETRIC_SIZE": "4G", "FI_PROVIDER": "cxi", "FI_CXI_RX_MATCH_MODE": "hybrid",
    "FI_EFA_USE_DEVICE_RDMA": "1", "UCX_TLS": "rc,cuda_copy", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # logging and debug only: dropped
    "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p",
    "NVSHMEM_DEBUG": "TRACE", "NVSHMEM_DEBUG_FILE": "/tmp/nv", "FI_LOG_LEVEL": "warn", "UCX_LOG_LEVEL": "info",
    "NVSHMEM_INFO": "1", "NCCL_TOPO_DUMP_FILE": "/tmp/topo.xml",
    # one job's addresses and bootstrap: dropped
    "NCCL_COMM_ID": "10.0.0.1:5555", "NVSHMEM_BOOTSTRAP": "UID", "NVSHMEM_BOOTSTRAP_UID_SESSION_ID": "x",
    # what launcher_env sets from the profile's knobs: part of the profile already, dropped
    "NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_IB_ENABLE_IBGDA": "0",
    # the runtime's own default for it (it sets 1 itself): dropped
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    # not a performance variable at all, or not as the libraries spell it, or empty (= unset for NCCL)
    "PATH": "/usr/bin", "LD_PRELOAD": "/x.so", "MOETUNE_HOME": "/h", "nccl_algo": "Tree", "NCCL_MIN_NCHANNELS": "",
}
KEPT = {"CUDA_DEVICE_MAX_CONNECTIONS", "FI_CXI_RX_MATCH_MODE", "FI_EFA_USE_DEVICE_RDMA", "FI_PROVIDER", "NCCL_ALGO",
        "NCCL_BUFFSIZE", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE", "NCCL_PROTO",
        "NVSHMEM_DISABLE_NVLS", "NVSHMEM_SYMMETRIC_SIZE", "UCX_TLS"}


def test_extraction_keeps_what_steers_the_data_path_sorted_with_a_digest() -> None:
    got = P.performance_environment(JOB)
    assert list(got.variables) == sorted(KEPT)  # sorted, canonical
    assert got.variables == {k: JOB[k] for k in sorted(KEPT)}
    assert got.digest == P.perf_env_digest(got.variables) and len(got.digest) == 16
    # the order of the mapping does not matter, and what is dropped does not move the digest
    shuffled = dict(reversed(list(JOB.items())))
    assert P.performance_environment(shuffled) == got
    quiet = {k: v for k, v in JOB.items() if k in KEPT}
    assert P.performance_environment({**quiet, "NCCL_DEBUG": "TRACE", "NCCL_COMM_ID": "h:1"}).digest == got.digest
    # a data-path change moves it
    assert P.performance_environment({**JOB, "NCCL_ALGO": "Tree"}).digest != got.digest
    assert P.performance_environment({}) == P.PerfEnv()


def test_what_moetune_sets_from_the_profile_and_the_runtime_defaults_are_not_recorded() -> None:
    for name in ENV_RULES:  # launcher_env's variables follow from the stored knobs
        assert not P.is_performance_variable(name), name
    # TORCH_SYMM_MEM_DISABLE_MULTICAST: the runtime sets 1 itself, so unset and 1 are one run; 0 is another
    assert P.performance_environment({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}).variables == {}
    assert P.performance_environment({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}).variables == {
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}
    # the GPU scripts' NVLS switches are not set by the tuner or the runtime: recorded like any other
    assert P.performance_environment({"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}).variables == {
        "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


def test_a_long_value_is_kept_as_its_digest_and_still_compares() -> None:
    long_a, long_b = "/opt/topo/" + "a" * 400, "/opt/topo/" + "b" * 400
    a = P.performance_environment({"NCCL_TOPO_FILE": long_a}).variables["NCCL_TOPO_FILE"]
    assert a.startswith("sha256:") and len(a) <= P.MAX_VALUE
    assert a != P.performance_environment({"NCCL_TOPO_FILE": long_b}).variables["NCCL_TOPO_FILE"]
    assert P.perf_env_problem({"NCCL_TOPO_FILE": a}) is None


def test_a_recorded_environment_is_exactly_what_the_extraction_gives() -> None:
    assert P.perf_env_problem(P.performance_environment(JOB).variables) is None
    assert P.perf_env_problem({}) is None
    for bad in ({"LD_PRELOAD": "/x.so"}, {"NCCL_DEBUG_FILE": "/etc/passwd"}, {"NVSHMEM_REMOTE_TRANSPORT": "ibrc"},
                {"NCCL_ALGO": ""}, {"NCCL_ALGO": 3}, {"NCCL_TOPO_FILE": "x" * 300}, {"nccl_algo": "Tree"},
                {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}, ["NCCL_ALGO"],
                {f"NCCL_X{i}": "1" for i in range(P.MAX_VARIABLES + 1)}):
        assert P.perf_env_problem(bad) is not None, bad


def test_compare_names_each_differing_variable_and_unknown_is_never_same() -> None:
    tuned = {"NCCL_ALGO": "Ring", "NCCL_P2P_DISABLE": "1"}
    assert P.compare_perf_env(tuned, dict(tuned)) == P.EnvComparison("same")
    cmp = P.compare_perf_env(tuned, {"NCCL_ALGO": "Tree", "FI_PROVIDER": "cxi"})
    assert cmp.status == "differs"
    assert cmp.differences == ("FI_PROVIDER: tuned without it, job has cxi", "NCCL_ALGO: tuned with Ring, job has Tree",
                               "NCCL_P2P_DISABLE: tuned with 1, job has it unset")
    assert "NCCL_ALGO: tuned with Ring, job has Tree" in cmp.summary()
    assert P.compare_perf_env(None, {}).status == "unknown"  # not recorded: unknown even against an empty job env
    assert P.compare_perf_env({}, {}).status == "same"  # recorded as empty: a real statement


def test_a_value_that_is_not_printable_ascii_is_kept_as_its_digest_and_refused_as_recorded() -> None:
    """A newline in a recorded value would forge lines where differences are printed (`moetune query --format env`
    comments that launchers source, warnings, logs): the extraction digests it, a recorded one is refused."""
    forged = "Ring\nexport LD_PRELOAD=/tmp/x.so #"
    got = P.performance_environment({"NCCL_ALGO": forged, "NCCL_PROTO": "Simple\u00e9"}).variables
    assert got["NCCL_ALGO"].startswith("sha256:") and got["NCCL_PROTO"].startswith("sha256:")
    assert P.perf_env_problem({"NCCL_ALGO": forged}) is not None
    assert P.perf_env_problem({"NCCL_ALGO": "\ud800"}) is not None  # a lone surrogate: a reason, not an exception
    assert P.perf_env_problem(got) is None
    diff = P.compare_perf_env({"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "Tree\n#"}).differences[0]
    assert "\n" not in diff and diff == "NCCL_ALGO: tuned with Ring, job has Tree\\n#"


def test_a_megakernel_profile_is_compared_on_what_acts_on_one_gpu_only() -> None:
    """The megakernel (one GPU's kernel) calls no NCCL, NVSHMEM, libfabric or UCX: a job's NCCL settings are no
    difference for its profile; CUDA_DEVICE_MAX_CONNECTIONS still is. Transport families compare everything."""
    tuned = {"NCCL_ALGO": "Ring"}
    job = {"NCCL_ALGO": "Tree", "FI_PROVIDER": "cxi"}
    assert P.compare_perf_env(tuned, job, "megakernel") == P.EnvComparison("same")
    assert P.compare_perf_env(tuned, job, "nvlink").status == "differs"
    cmp = P.compare_perf_env(tuned, {**job, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "megakernel")
    assert cmp.status == "differs" and cmp.differences == ("CUDA_DEVICE_MAX_CONNECTIONS: tuned without it, job has 1",)
    assert P.compare_perf_env(None, job, "megakernel").status == "unknown"


def test_the_wire_and_the_record_carry_it_and_the_wire_bounds_it() -> None:
    key = ProfileKey(fingerprint="f" * 16, software="s" * 16, transport_family="collective", ep_size=2, nodes=1,
                     hidden=256, intermediate=128, experts=16, topk=2, dtype="bfloat16", token_bucket=64)
    rec = ProfileRecord(key=key, knobs=default_knobs("collective"), latency_us=1.0, spread_us=0.1,
                        backend="local:gloo", provenance="measured", perf_env={"NCCL_ALGO": "Ring"})
    assert rec.tuned_perf_env == {"NCCL_ALGO": "Ring"}
    res = wire.ProfileResult.from_record(rec, env={})
    assert msgspec.json.decode(msgspec.json.encode(res), type=wire.ProfileResult).perf_env == {"NCCL_ALGO": "Ring"}
    # not recorded: left out of the record, its export and the reply (an older peer's shape)
    old = msgspec.structs.replace(rec, perf_env=msgspec.UNSET)
    assert old.tuned_perf_env is None and b"perf_env" not in msgspec.json.encode(old)
    assert b"perf_env" not in msgspec.json.encode(wire.ProfileResult.from_record(old, env={}))
    # the wire's bounds are the extraction's
    raw = msgspec.to_builtins(res)
    for bad in ({"NCCL_ALGO": "x" * (P.MAX_VALUE + 1)}, {"N" * 129: "1"},
                {f"NCCL_X{i}": "1" for i in range(P.MAX_VARIABLES + 1)}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({**raw, "perf_env": bad}, wire.ProfileResult)
    msgspec.convert({**raw, "perf_env": {"N" * 128: "x" * P.MAX_VALUE}}, wire.ProfileResult)
