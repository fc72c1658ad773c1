"""The performance environment: the variables of a process that steer the data path but are no knob.

A profile's numbers hold for the knobs it stores AND for the environment of the process that measured them:
NCCL_ALGO, NCCL_PROTO, NCCL_P2P_DISABLE, NCCL_IB_HCA, NCCL_BUFFSIZE, NVSHMEM_*, libfabric's FI_*, UCX_*,
CUDA_DEVICE_MAX_CONNECTIONS ... change the same knobs' latency, and the fingerprint (hardware and software) does
not see them. `performance_environment(env)` is the ONE function that extracts them from an environment mapping:
the tuner records its result with every measured profile, the runtime computes it for the job and compares
(`compare_perf_env`). Recorded variables are only ever compared, never exported: what a profile makes a job
export is `launcher_env`'s output for its knobs, nothing else (a daemon cannot inject a variable through this).

What counts (`is_performance_variable`): the names starting with one of `PREFIXES`, plus `NAMES`, spelled as
the libraries read them (upper case, digits, `_`), minus

- logging and debug output only (`QUIET_PREFIXES`, `QUIET_NAMES`: NCCL_DEBUG*, NVSHMEM_DEBUG*, FI_LOG_*, ...),
- per-job addresses and bootstrap plumbing that differ from run to run without changing the data path
  (NCCL_COMM_ID, NVSHMEM_BOOTSTRAP*, ...),
- what moetune sets from the profile itself (`launcher_env.ENV_RULES`: NVSHMEM_REMOTE_TRANSPORT, ...): those
  follow from the stored knobs, so they are part of the profile already.

The variables the project's GPU scripts export on purpose (NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1:
bench/tools/device_env.sh, runtime/testing) are recorded like any other: neither the runtime nor the tuner's profile
measurements (the local backend's ranks, the bring-up's tune) set them, so they are not part of every measurement,
and a job that leaves NVLink SHARP on runs other NCCL/NVSHMEM algorithms than a profile measured with it off. The
one place the tuner sets them is the bring-up's microbenchmarks, whose rows calibrate the node's fabric model: they
run with NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (`tuner/measure/micro.py` MEASUREMENT_ENV, NVLS
must stay off on the machines measured), a declared setting each row records with the environment it ran in (and
the calibrated model, `[calibration] measurement_env`). TORCH_SYMM_MEM_DISABLE_MULTICAST is different: the runtime's
one-sided transports set it to 1 themselves (`os.environ.setdefault`, before torch reads it), so unset and
"1" are the same run; `RUNTIME_DEFAULTS` drops it at that value (a process that already built a transport
must not differ from one that has not yet), and only another value is recorded.

An empty value counts as unset (NCCL ignores an empty variable). A value longer than `MAX_VALUE` characters, or one
with anything but printable ASCII (a newline would forge lines where a difference is printed), is kept as the
digest of its text (`sha256:...`), so that a recorded environment stays small and still compares.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from moetune.runtime.profile_record import MEGAKERNEL_FAMILY
from moetune.runtime.profiles.launcher_env import ENV_RULES

PREFIXES: tuple[str, ...] = ("NCCL_", "NVSHMEM_", "FI_", "UCX_")
NAMES: frozenset[str] = frozenset({
    "CUDA_DEVICE_MAX_CONNECTIONS",  # hardware work queues: how many streams run concurrently
    "CUDA_LAUNCH_BLOCKING",  # a debug switch, but it serialises every launch: a profile measured so is another run
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",  # torch symmetric memory's multicast objects (nvlink/proxy)
})
QUIET_PREFIXES: tuple[str, ...] = (
    "NCCL_DEBUG",  # NCCL_DEBUG, NCCL_DEBUG_SUBSYS, NCCL_DEBUG_FILE, NCCL_DEBUG_TIMESTAMP_*
    "NVSHMEM_DEBUG",  # NVSHMEM_DEBUG, NVSHMEM_DEBUG_SUBSYS, NVSHMEM_DEBUG_FILE
    "FI_LOG_",  # FI_LOG_LEVEL, FI_LOG_PROV, FI_LOG_SUBSYS
    "UCX_LOG_",  # UCX_LOG_LEVEL, UCX_LOG_FILE, ...
    "NVSHMEM_BOOTSTRAP",  # how the PEs find each other at start-up (PMI, MPI, UID plugins and their session)
    "NCCL_RAS_",  # NCCL's reliability service: a monitoring thread and its address
)
QUIET_NAMES: frozenset[str] = frozenset({
    "NCCL_WARN_ENABLE_DEBUG_INFO", "NCCL_SET_THREAD_NAME",
    "NCCL_TOPO_DUMP_FILE", "NCCL_TOPO_DUMP_FILE_RANK", "NCCL_GRAPH_DUMP_FILE", "NCCL_GRAPH_DUMP_FILE_RANK",
    "NCCL_COMM_ID", "NCCL_HOSTID",  # the rendezvous address and a host name override: one job's, not a setting
    "NVSHMEM_INFO", "NVSHMEM_VERSION",  # print the configuration / version at start-up
})
# Variables the runtime itself sets to this value when unset, before anything reads them.
RUNTIME_DEFAULTS: dict[str, str] = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

MAX_VALUE = 256  # characters of a value kept as they are; longer ones are kept as their digest
MAX_VARIABLES = 512  # a recorded environment holding more is not one this function produced
_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,127}")

EnvStatus = Literal["same", "differs", "unknown"]


def is_performance_variable(name: str) -> bool:
    """Whether `name` is a variable of the performance environment (see the module docstring)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return False
    if name in ENV_RULES or name in QUIET_NAMES or name.startswith(QUIET_PREFIXES):
        return False
    return name in NAMES or name.startswith(PREFIXES)


def _value(text: str) -> str:
    # a long value, or one with anything but printable ASCII (a newline would forge lines wherever a difference is
    # printed: warnings, logs, `moetune query --format env` comments), is kept as its digest: it still compares
    if len(text) <= MAX_VALUE and text.isascii() and text.isprintable():
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def perf_env_digest(variables: Mapping[str, str]) -> str:
    """A short hash of a canonical performance environment (equal environments, equal digests)."""
    dump = json.dumps(dict(variables), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PerfEnv:
    """A performance environment: the variables (sorted by name) and their digest."""

    variables: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return perf_env_digest(self.variables)


def performance_environment(env: Mapping[str, str]) -> PerfEnv:
    """The performance environment of `env` (a process's environment, e.g. `os.environ`): the variables that
    steer the data path, canonical (sorted, empty values dropped, values at the runtime's own default
    dropped, long or non-printable values digested), with their digest."""
    out: dict[str, str] = {}
    for name in sorted(k for k in env if isinstance(k, str)):
        value = env[name]
        if not isinstance(value, str) or value == "" or not is_performance_variable(name):
            continue
        if RUNTIME_DEFAULTS.get(name) == value:
            continue
        out[name] = _value(value)
    return PerfEnv(out)


def perf_env_problem(variables: object) -> str | None:
    """Why `variables` is not a recorded performance environment (None when it is one): a recorded
    environment is exactly what `performance_environment` returns, so a name outside the performance
    variables (LD_PRELOAD, NCCL_DEBUG_FILE, a variable launcher_env sets) or a value it would not keep is
    refused, whoever recorded or sent it."""
    if not isinstance(variables, Mapping):
        return f"expected a mapping of variable names to values, got {type(variables).__name__}"
    if len(variables) > MAX_VARIABLES:
        return f"{len(variables)} variables (at most {MAX_VARIABLES})"
    for name, value in variables.items():
        if not isinstance(name, str) or not isinstance(value, str):
            return "names and values must be strings"
        if not is_performance_variable(name):
            return f"{name[:64]!r} is not a performance variable"
        if value == "" or _value(value) != value or RUNTIME_DEFAULTS.get(name) == value:
            return f"{name}={value[:64]!r} is not a canonical value"
    return None


def parse_recorded(text: str | bytes | None) -> dict[str, str] | None:
    """A stored `perf_env` column (JSON text) read back: None where not recorded (SQL NULL or JSON null);
    ValueError where it is not a performance environment this moetune would record (`perf_env_problem`)."""
    if text is None:
        return None
    try:
        env = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"perf_env: not JSON ({e})") from e
    if env is None:
        return None
    why = perf_env_problem(env)
    if why is not None:
        raise ValueError(f"perf_env: {why}")
    return env


@dataclass(frozen=True)
class EnvComparison:
    """A profile's recorded performance environment against the job's.

    `status`: "same"; "differs" (`differences` names each variable, e.g. "NCCL_ALGO: tuned with Ring, job has
    Tree"); "unknown" (the profile recorded none: measured by an older moetune), never taken for "same"."""

    status: EnvStatus
    differences: tuple[str, ...] = ()

    def summary(self) -> str:
        if self.status == "same":
            return "the same NCCL/NVSHMEM/FI environment as this job"
        if self.status == "unknown":
            return "its NCCL/NVSHMEM/FI environment was not recorded (an older moetune measured it)"
        return "tuned in another environment: " + "; ".join(self.differences)


def _shown(value: str) -> str:
    """A value as a difference names it: printable (escaped, as `repr` writes it), at most 64 characters."""
    text = value if value.isascii() and value.isprintable() else repr(value)[1:-1]
    return text if len(text) <= 64 else text[:61] + "..."


# The megakernel's family is one GPU's kernel: no NCCL, NVSHMEM, libfabric or UCX call is in its data path, so only
# these variables can change its numbers (a job's NCCL settings are no reason to doubt its profile).
ONE_GPU_NAMES: frozenset[str] = frozenset({"CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING"})


def relevant_to(variables: Mapping[str, str], family: str | None) -> dict[str, str]:
    """The variables of a performance environment that can act on `family`'s data path (None: all of them)."""
    if family == MEGAKERNEL_FAMILY:
        return {k: v for k, v in variables.items() if k in ONE_GPU_NAMES}
    return dict(variables)


def compare_perf_env(recorded: Mapping[str, str] | None, job: Mapping[str, str],
                     family: str | None = None) -> EnvComparison:
    """Compare a profile's recorded performance environment (None: not recorded) with the job's (both as
    `performance_environment(...).variables`), on the variables that act on `family` (`relevant_to`)."""
    if recorded is None:
        return EnvComparison("unknown")
    recorded, job = relevant_to(recorded, family), relevant_to(job, family)
    diffs: list[str] = []
    for name in sorted(set(recorded) | set(job)):
        tuned, have = recorded.get(name), job.get(name)
        if tuned == have:
            continue
        if tuned is None:
            diffs.append(f"{name}: tuned without it, job has {_shown(have or '')}")
        elif have is None:
            diffs.append(f"{name}: tuned with {_shown(tuned)}, job has it unset")
        else:
            diffs.append(f"{name}: tuned with {_shown(tuned)}, job has {_shown(have)}")
    return EnvComparison("differs", tuple(diffs)) if diffs else EnvComparison("same")
