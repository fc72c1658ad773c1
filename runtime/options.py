"""RuntimeOptions: the data path's switches that are not knobs, typed, validated and parsed once.

A knob (runtime/knobs.py) is what the tuner searches and a profile stores: it changes speed. An option
changes *how* the runtime does the same work -- a fallback (NCCL's staging instead of the copy engines, CUDA
IPC instead of torch's symmetric memory), a timeout, or the torch ops instead of a fused kernel for a
side-by-side measurement. Options are explicit objects, as DeepEP's `Config`: `EPBuffer(..., options=...)`
hands them to its transport, which never reads the environment itself.

Where a value comes from (later wins): the defaults, the `[runtime]` section of the TOML config
(runtime/config.py keeps the table; `RuntimeOptions.from_config` checks it against these fields: there is no second
definition of the options), the option's `MOETUNE_*` variable, then what the caller passes. `RuntimeOptions.resolve`
does this once per EP buffer; nothing here is read at import time. Every rank of an EP group must run the
same options: their digest joins the knobs' digest in the buffer's cross-rank agreement. The exceptions are
`PROCESS_LOCAL_OPTIONS` (today `proxy_cpu`): they only place a thread within one process, so ranks may set them
differently (per local rank, per node's CPU layout) and the digest leaves them out.

Build and debug switches stay environment variables (as DeepEP's `EP_*` table): `ENV_VARIABLES` lists each
with type, default and meaning, and `docs/settings.md` is generated from these tables
(`python -m moetune.runtime.settings_doc > docs/settings.md`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from moetune.runtime import config as _config
from moetune.runtime.knobs import KNOB_DOCS, KNOB_VALUES, Knobs, float_of_text, int_of_text

SymmMode = Literal["torch", "ipc"]
SYMM_MODES: tuple[str, ...] = ("torch", "ipc")
MAX_PLAN_MODE = 2
# proxy_batch: what the proxy engine takes (csrc/proxy_engine.cpp mt_proxy_set_batch, 1..4096). Checked here so that
# a larger value is refused as the option, not at the buffer's construction; past 2**31 ctypes' c_int would pass
# another number (2**32 + 1 arrives as 1)
MAX_PROXY_BATCH = 4096
# chunk_weights: one weight per pipeline chunk, so at most the largest pipeline_depth. More were taken (ignored with
# one chunk or outside the dense layout), recorded with a measured profile, and refused by every client in the reply
# that served it (runtime/wire.py OptionsMap holds at most 64)
MAX_CHUNK_WEIGHTS = KNOB_VALUES["pipeline_depth"].high
# megakernel_timeout_s: the range MegakernelConfig.timeout_ms takes (runtime/megakernel/config.py, 1e-3 .. 3.6e6 ms),
# checked here so that a bad value is reported as the option the user set, not as timeout_ms
MK_TIMEOUT_MIN_S = 1e-6
MK_TIMEOUT_MAX_S = 3600.0
# onesided_timeout_s: at most a day. The C side turns it into nanoseconds in 64 bits (and 4x that for the host's
# wait): 1e11 s became 0 ns there and every wait failed at once, where the user meant "never time out"
ONESIDED_TIMEOUT_MAX_S = 86400.0
# proxy_cpu: where the proxy thread runs. "numa": the CPUs local to the GPU's NUMA node; "none": wherever the OS puts
# it; else a CPU list ("12", "8-15,40"). The largest CPU index taken is csrc/proxy_engine.h's MT_PROXY_MAX_CPU - 1.
PROXY_CPU_MODES: tuple[str, ...] = ("numa", "none")
MAX_CPU_INDEX = 65535
# Options that only place threads within one process (which CPUs a helper thread may run on): they change neither
# the wire protocol nor the buffers, so ranks may differ in them (MOETUNE_PROXY_CPU set per local rank, CPU lists
# of nodes with different layouts) and RuntimeOptions.digest(), which the ranks compare, leaves them out.
PROCESS_LOCAL_OPTIONS: frozenset[str] = frozenset({"proxy_cpu"})
# Options that change the data path: which kernels, copies, buffers and waits do the work. A tuned profile's numbers
# hold only for the values it was measured under, so every measured profile records these (`data_path`; the runtime
# compares them with the job's: runtime/profiles/tuned_options.py) and a tuner study is resumed only under the same.
DATA_PATH_OPTIONS: tuple[str, ...] = (
    "hs_native",  # host_staged: the copy engines through shared host memory, or NCCL's own staging
    "symm",  # symmetric memory from torch (multicast-capable) or plain CUDA IPC handles: other buffers and copies
    "chunk_weights",  # the dense layout's chunk sizes: another pipeline
    "proxy_batch",  # how many PUTs the proxy issues as one batch
    "proxy_peer_access",  # direct P2P copies between the local GPUs, or staged ones
    "proxy_host_wait",  # each call completes on the host, or stays asynchronous (another synchronisation)
    "plan_mode",  # the plan kernel's shape
    "nvl_gather",  # nvlink's exchange builds the wire rows from the tokens, or packs them first
    "fused_pack",  # the compiled pack kernels, or the torch ops
    "fused_fp8",  # fp8 quantisation in one launch each, or the torch ops
)
# The profile families each data-path option acts on, from where the runtime reads it. A profile of another family
# (and the tuner's study of it) is neither compared on nor keyed by it: its numbers never ran that code.
# - hs_native: host_staged only (transports/host_staged.py picks the copy engines or NCCL's staging).
# - symm, plan_mode, fused_pack: the one-sided transports (device_counts: transports/_onesided.py's SymmBuffer; the
#   device-resident layout's plan and pack kernels, buffer/_resident.py and facade.py `self.resident`).
# - chunk_weights: the dense layout, which only the dense_collectives transports (collective, host_staged) run.
# - proxy_batch, proxy_peer_access, proxy_host_wait: proxy only (transports/proxy.py).
# - nvl_gather: nvlink only (gathers_tokens, buffer/facade.py).
# - fused_fp8: every EP transport (facade.py quantises fp8 rows whatever the transport; the library is loaded apart).
# The megakernel (one GPU, no EP transport) reads none. A family missing here (a transport registered later) is
# taken to be acted on by every option: nothing is known of what it reads.
_ONESIDED: frozenset[str] = frozenset({"nvlink", "proxy"})
_TRANSPORTS: frozenset[str] = frozenset({"collective", "host_staged", "nvlink", "proxy"})
DATA_PATH_FAMILIES: dict[str, frozenset[str]] = {
    "hs_native": frozenset({"host_staged"}),
    "symm": _ONESIDED,
    "chunk_weights": frozenset({"collective", "host_staged"}),
    "proxy_batch": frozenset({"proxy"}),
    "proxy_peer_access": frozenset({"proxy"}),
    "proxy_host_wait": frozenset({"proxy"}),
    "plan_mode": _ONESIDED,
    "nvl_gather": frozenset({"nvlink"}),
    "fused_pack": _ONESIDED,
    "fused_fp8": _TRANSPORTS,
}
# The families the table above knows (the megakernel among them: acted on by none).
DATA_PATH_KNOWN_FAMILIES: frozenset[str] = _TRANSPORTS | {"megakernel"}


def options_acting_on(family: str | None) -> tuple[str, ...]:
    """The DATA_PATH_OPTIONS that act on profiles of `family` (DATA_PATH_FAMILIES): all of them for None or a family
    the table does not know. A profile family names its transport and, after a ':', the provider it runs over
    (`proxy:ibrc`, `proxy:libfabric/cxi`): the table is by transport, so such a family is looked up as its transport
    (looked up as written, every proxy profile's family was unknown and every option was compared for it)."""
    if family is not None and family not in DATA_PATH_KNOWN_FAMILIES:
        family = family.split(":", 1)[0]  # `proxy:ibrc` -> `proxy`; a family without a provider stays as it is
    if family is None or family not in DATA_PATH_KNOWN_FAMILIES:
        return DATA_PATH_OPTIONS
    return tuple(name for name in DATA_PATH_OPTIONS if family in DATA_PATH_FAMILIES[name])


# The rest, and why they are not in a profile's record: they never change what a run that completes does.
NOT_DATA_PATH_OPTIONS: dict[str, str] = {
    "onesided_timeout_s": "how long a peer's wait may last before it is an error: a run that completes is the same",
    "megakernel_timeout_s": "how long the megakernel may go without progress before it is an error",
    "proxy_cpu": "which CPUs the proxy thread may run on: process-local, set per rank and per node layout "
                 "(PROCESS_LOCAL_OPTIONS), no part of the group's data path",
}


class RuntimeOptionError(ValueError):
    """A runtime option has a bad value; the message names the option, its variable and where it came from."""


class RuntimeConfigError(_config.ConfigError, RuntimeOptionError):
    """A bad key or value in the config's `[runtime]` table: a config error (named by key and file, as any other
    section's) and a bad runtime option."""


@dataclass(frozen=True)
class OptionDoc:
    """One row of the options table: the field, its variable, and what it means."""

    name: str
    env: str
    type: str
    meaning: str


# The one place each option's variable and meaning are written down (docs/settings.md is generated from it).
OPTION_DOCS: tuple[OptionDoc, ...] = (
    OptionDoc("hs_native", "MOETUNE_HS_NATIVE", "bool",
              "host_staged: the copy engines through shared pinned host memory (csrc/host_staged.cu); false keeps "
              "the collective over NCCL's own staging (set NCCL_P2P_DISABLE=1 then)."),
    OptionDoc("symm", "MOETUNE_SYMM", "`torch` or `ipc`",
              "nvlink/proxy: symmetric memory from torch (`torch`, falling back to CUDA IPC where it fails) or "
              "plain CUDA IPC handles exchanged through the process group (`ipc`)."),
    OptionDoc("onesided_timeout_s", "MOETUNE_ONESIDED_TIMEOUT_S", "float in (0, 86400]",
              "Seconds a GPU wait (a peer's count, signal or staging slot) may last before the transport reports "
              "the peer lost instead of hanging (nvlink, proxy, host_staged); also the bound of the creations' "
              "waits for their set-up work (the proxy engine, the kernel contexts, the CUDA IPC buffers) and of "
              "the destroys'."),
    OptionDoc("megakernel_timeout_s", "MOETUNE_MK_TIMEOUT_S", f"float in [{MK_TIMEOUT_MIN_S:g}, {MK_TIMEOUT_MAX_S:g}]",
              "Seconds the MoE megakernel's scheduler or a processor may wait without progress before the kernel "
              "ends with an error record (read by `MegakernelMoE.check()`) instead of hanging. Its own option: a "
              "layer's waits are on-GPU task readiness, microseconds apart, not a peer's transfers."),
    OptionDoc("chunk_weights", "MOETUNE_EP_CHUNK_WEIGHTS", f"comma-separated floats > 0, at most {MAX_CHUNK_WEIGHTS}",
              "Dense layout: relative sizes of the pipeline_depth chunks (one weight per chunk; empty = equal). "
              "Measured in runs 33-34 without a gain; kept for side-by-side runs."),
    OptionDoc("proxy_batch", "MOETUNE_PROXY_BATCH", f"int 1..{MAX_PROXY_BATCH}",
              "proxy: consecutive unsignalled PUTs of one QP stream the proxy may issue as one batch."),
    OptionDoc("proxy_peer_access", "MOETUNE_PROXY_PEER_ACCESS", "bool",
              "proxy: enable CUDA peer access towards the other local GPUs so copies take direct P2P."),
    OptionDoc("proxy_cpu", "MOETUNE_PROXY_CPU", "`numa`, `none` or a CPU list (`12`, `8-15,40`)",
              "proxy: the set of CPUs the proxy thread pins itself to (the OS places it within the set; every "
              "proxy thread of the process gets the same set). `numa`: the CPUs local to the GPU's NUMA node "
              "(sysfs `local_cpulist`) that this process may use; no NUMA information (no sysfs PCI entry, "
              "`numa_node` -1 or absent) means no pinning (logged once at info level). `none`: no pinning. A CPU list: those of its CPUs that the process may use. A pinning the "
              "kernel refuses, or a CPU list none of whose CPUs the process may use, leaves the thread unpinned, "
              "with a warning. Case and white space do not matter; "
              "ranks may set it differently (it is not compared)."),
    OptionDoc("proxy_host_wait", "MOETUNE_PROXY_HOST_WAIT", "bool",
              "proxy: each call completes on the host (see mt_pxy_set_host_wait in csrc/proxy_gpu.cu); false "
              "leaves calls asynchronous (run 1's behaviour)."),
    OptionDoc("plan_mode", "MOETUNE_PLAN_MODE", "int 0..2",
              "Device-resident layout: the plan kernel's shape, 0 = by token count, 1 = one CTA, 2 = a grid "
              "(side-by-side measurements, run 13)."),
    OptionDoc("nvl_gather", "MOETUNE_NVL_GATHER", "bool",
              "nvlink: the exchange kernel builds the wire rows straight from the tokens; false packs first "
              "(run 10's comparison)."),
    OptionDoc("fused_pack", "MOETUNE_FUSED_PACK", "bool",
              "Device-resident layout: pack with the compiled kernels (csrc/ep_pack.cu); false uses the torch ops."),
    OptionDoc("fused_fp8", "MOETUNE_FUSED_FP8", "bool",
              "fp8 on a GPU: quantise/dequantise in one launch each (csrc/ep_fp8.cu); false uses the torch ops "
              "(the same bytes)."),
)


class RuntimeOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The data path's non-tuned switches. Defaults are what the runtime does without any setting."""

    hs_native: bool = True
    symm: SymmMode = "torch"
    onesided_timeout_s: float = 20.0
    megakernel_timeout_s: float = 2.0
    chunk_weights: tuple[float, ...] = ()
    proxy_batch: int = 1
    proxy_peer_access: bool = True
    proxy_cpu: str = "numa"
    proxy_host_wait: bool = True
    plan_mode: int = 0
    nvl_gather: bool = True
    fused_pack: bool = True
    fused_fp8: bool = True

    def __post_init__(self) -> None:
        _validate(self)
        # one spelling whatever the source (arguments, config, variable): "NUMA " is "numa"; 3 is 3.0 (the digest
        # encodes both as given, so RuntimeOptions(x=3) and from_dict({"x": 3}) would otherwise differ)
        msgspec.structs.force_setattr(self, "proxy_cpu", _normal_proxy_cpu(self.proxy_cpu))
        for name in _FLOATS:
            msgspec.structs.force_setattr(self, name, float(getattr(self, name)))
        msgspec.structs.force_setattr(self, "chunk_weights", tuple(float(w) for w in self.chunk_weights))

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> RuntimeOptions:
        """Build from a mapping of option names to values; unknown names and wrong types raise
        RuntimeOptionError naming the option (and `where` the values came from)."""
        suffix = f" (from {where})" if where else ""
        unknown = sorted(set(data) - set(cls.__struct_fields__))
        if unknown:
            raise RuntimeOptionError(f"unknown runtime option(s) {unknown}{suffix}; known: {', '.join(cls.__struct_fields__)}")
        try:
            return msgspec.convert(dict(data), cls)
        except msgspec.ValidationError as e:
            if isinstance(e.__cause__, RuntimeOptionError):  # raised by _validate: its message names the option
                raise RuntimeOptionError(f"{e.__cause__}{suffix}") from None
            raise RuntimeOptionError(f"runtime option {_field_of(str(e))}{suffix}: {e}") from None
        except RuntimeOptionError as e:
            raise RuntimeOptionError(f"{e}{suffix}") from None

    def replace(self, **changes: Any) -> RuntimeOptions:
        return RuntimeOptions.from_dict({**self.to_dict(), **changes})

    def data_path(self) -> dict[str, Any]:
        """The DATA_PATH_OPTIONS and their values, as JSON has them (what a measured profile records)."""
        d = self.to_dict()
        return {name: list(d[name]) if isinstance(d[name], tuple) else d[name] for name in DATA_PATH_OPTIONS}

    def digest(self) -> str:
        """Stable short hash (ranks compare it next to the knobs' digest) of every option but
        PROCESS_LOCAL_OPTIONS, which ranks may set differently."""
        shared = {k: v for k, v in self.to_dict().items() if k not in PROCESS_LOCAL_OPTIONS}
        return hashlib.sha256(msgspec.json.encode(shared, order="sorted")).hexdigest()[:16]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, base: RuntimeOptions | None = None) -> RuntimeOptions:
        """`base` (or the defaults) with every option whose variable is set (non-empty) in `env` replaced."""
        env = os.environ if env is None else env
        _check_retired(env)
        data = (base or cls()).to_dict()
        for doc in OPTION_DOCS:
            raw = env.get(doc.env, "")
            if raw.strip():
                data[doc.name] = _parse_env(doc, raw)
        return cls.from_dict(data)

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any] | RuntimeOptions | None = None, *,
                env: Mapping[str, str] | None = None, config: _config.Config | None = None) -> RuntimeOptions:
        """defaults ← config `[runtime]` ← `MOETUNE_*` variables ← `overrides`.

        A `RuntimeOptions` passed as `overrides` is taken as is (the caller decided everything; it was validated
        when built), but a retired variable in `env` is an error either way. `config` defaults to
        `load_config(env=env)`."""
        if overrides is not None and not isinstance(overrides, (RuntimeOptions, Mapping)):
            raise TypeError(f"options must be a RuntimeOptions, a mapping of option names or None, got "
                            f"{type(overrides).__name__} {overrides!r}")
        env = os.environ if env is None else env
        _check_retired(env)  # on both paths: a retired speed switch is never ignored silently (docs/settings.md)
        _check_misnamed(env)  # nor an option set under the name the config's variable rule gives it
        if isinstance(overrides, RuntimeOptions):
            return overrides
        if config is None:
            config, ignored = _config.load_runtime_config(env=env)
            if ignored:  # settings the data path never reads: named, not a reason to refuse the buffer (the
                # warnings module's default filter says one text once per caller; no _once here: a schema module)
                warnings.warn("moetune: the runtime ignores settings it does not read that are wrong "
                              f"({'; '.join(ignored)}); the commands that read them refuse them", RuntimeWarning,
                              stacklevel=3)
        opts = cls.from_config(config)
        opts = cls.from_env(env, base=opts)
        if overrides:
            opts = cls.from_dict({**opts.to_dict(), **dict(overrides)}, where="arguments")
        return opts

    @classmethod
    def from_config(cls, config: _config.Config) -> RuntimeOptions:
        """The defaults with the config's `[runtime]` table applied, each key checked against the options' fields
        (its TOML type: CONFIG_TYPES; its value: as the option is). RuntimeConfigError names the key, the file and
        what is wrong."""
        data = cls().to_dict()
        for name, value in config.runtime.items():
            where = config.origin_of(_config.RUNTIME, name)
            if name not in CONFIG_TYPES:
                raise RuntimeConfigError(f"unknown key runtime.{name} in {where} (known: {', '.join(CONFIG_TYPES)})")
            try:
                value = _config.check_toml_value(_config.RUNTIME, name, CONFIG_TYPES[name], value, where)
            except _config.ConfigError as e:
                raise RuntimeConfigError(str(e)) from None
            data[name] = _option_from_config(name, value, where)
        return cls.from_dict(data)


def load_config_checked(config_file: Path | None = None) -> _config.Config:
    """`load_config` with its `[runtime]` table checked as `RuntimeOptions.from_config` checks it, for the commands
    that measure: a bad key stops them before their first trial (load_config keeps the table raw, since config.py
    may not import this module). Raises ConfigError (RuntimeConfigError) naming the key and the file.

    A `config_file` given here also joins this process's config chain as `$MOETUNE_CONFIG` (an absolute path), so
    that what measures under it (`runtime_options()` here, the ranks a local backend spawns with this environment)
    runs the options just checked, not the default chain's; the caller is a measuring command's entry point."""
    cfg = _config.load_config(config_file)
    RuntimeOptions.from_config(cfg)
    if config_file is not None:
        os.environ["MOETUNE_CONFIG"] = str(Path(config_file).resolve())
    return cfg


def data_path_digest(values: Mapping[str, Any]) -> str:
    """A short hash of recorded data-path options (`RuntimeOptions.data_path`, or some of them): equal values, equal
    digests."""
    return hashlib.sha256(msgspec.json.encode(dict(values), order="sorted")).hexdigest()[:16]


def data_path_problem(values: object) -> str | None:
    """Why `values` is not a record of data-path options this moetune writes (None when it is one): a mapping of
    DATA_PATH_OPTIONS names (an older moetune may have known fewer) to their canonical values, as
    `RuntimeOptions.data_path` gives them. Anything else (another option, a value that does not validate or is not
    spelt canonically) is refused, whoever recorded or sent it."""
    if not isinstance(values, Mapping):
        return f"expected a mapping of option names to values, got {type(values).__name__}"
    unknown = sorted(str(k)[:64] for k in values if k not in DATA_PATH_OPTIONS)
    if unknown:
        return f"{', '.join(map(repr, unknown[:4]))} is not a data-path option (known: {', '.join(DATA_PATH_OPTIONS)})"
    try:
        canonical = RuntimeOptions.from_dict({**RuntimeOptions().to_dict(), **dict(values)}).data_path()
    except RuntimeOptionError as e:
        return str(e)
    want = {k: canonical[k] for k in values}
    if msgspec.json.encode(want, order="sorted") != msgspec.json.encode(dict(values), order="sorted"):
        return "values not spelt as this moetune records them"
    return None


def _field_of(message: str) -> str:
    # msgspec says "... - at `$.name`"
    return message.rsplit("$.", 1)[-1].rstrip("`").split("[")[0] if "$." in message else "value"


def _doc(name: str) -> OptionDoc:
    return next(d for d in OPTION_DOCS if d.name == name)


def _fail(name: str, value: Any, expected: str) -> None:
    raise RuntimeOptionError(f"runtime option {name} ({_doc(name).env}) = {value!r}: expected {expected}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_types(o: RuntimeOptions) -> None:
    # msgspec checks types in convert/decode only, not when RuntimeOptions(...) is built directly: "no" for a bool
    # (truthy), 1.5 for an int or a misspelt choice would otherwise pass (as knobs._check_types guards Knobs)
    for name, tp in _FIELD_TYPES.items():
        v = getattr(o, name)
        if tp is bool and not isinstance(v, bool):
            _fail(name, v, "a bool (True or False)")
        elif tp is int and type(v) is not int:
            _fail(name, v, "an int")
        elif tp is float and not _is_number(v):
            _fail(name, v, "a number")
        elif typing.get_origin(tp) is Literal and (not isinstance(v, str) or v not in typing.get_args(tp)):
            _fail(name, v, f"one of {', '.join(typing.get_args(tp))}")
        elif name == "chunk_weights" and not (isinstance(v, (tuple, list)) and all(_is_number(w) for w in v)):
            _fail(name, v, "a tuple of numbers (one weight per pipeline chunk)")


def _positive_finite(w: float) -> bool:
    try:
        return w > 0 and math.isfinite(w)
    except OverflowError:  # an int past what a float holds (isfinite converts it): no weight either
        return False


def _validate(o: RuntimeOptions) -> None:
    _check_types(o)
    if not 0 < o.onesided_timeout_s <= ONESIDED_TIMEOUT_MAX_S:  # NaN fails too
        _fail("onesided_timeout_s", o.onesided_timeout_s, f"a number of seconds > 0 and <= {ONESIDED_TIMEOUT_MAX_S:g}")
    if not MK_TIMEOUT_MIN_S <= o.megakernel_timeout_s <= MK_TIMEOUT_MAX_S:  # NaN fails too
        _fail("megakernel_timeout_s", o.megakernel_timeout_s,
              f"a number of seconds from {MK_TIMEOUT_MIN_S:g} to {MK_TIMEOUT_MAX_S:g}")
    if len(o.chunk_weights) > MAX_CHUNK_WEIGHTS:
        _fail("chunk_weights", o.chunk_weights, f"at most {MAX_CHUNK_WEIGHTS} weights, one per pipeline chunk (got "
                                                f"{len(o.chunk_weights)}; pipeline_depth is at most {MAX_CHUNK_WEIGHTS})")
    if any(not _positive_finite(w) for w in o.chunk_weights):
        _fail("chunk_weights", o.chunk_weights, "positive numbers (one per pipeline chunk)")
    if not 1 <= o.proxy_batch <= MAX_PROXY_BATCH:
        _fail("proxy_batch", o.proxy_batch, f"an integer from 1 to {MAX_PROXY_BATCH}")
    proxy_cpu_setting(o.proxy_cpu)
    if not 0 <= o.plan_mode <= MAX_PLAN_MODE:
        _fail("plan_mode", o.plan_mode, f"an integer from 0 to {MAX_PLAN_MODE}")


# each field's type, from the struct's own annotations (_check_types); the float fields are stored as floats
_FIELD_TYPES: dict[str, Any] = {f.name: f.type for f in msgspec.structs.fields(RuntimeOptions)}
_FLOATS: tuple[str, ...] = tuple(n for n, tp in _FIELD_TYPES.items() if tp is float)


def _toml_type(name: str, tp: Any) -> type:
    if tp in (bool, int, float, str):
        return tp
    if typing.get_origin(tp) is Literal or name == "chunk_weights":  # a choice; the weights as text, "1,3"
        return str
    raise TypeError(f"RuntimeOptions.{name}: no TOML type for {tp!r}")


# The TOML type of each option's `[runtime]` key, from the options' own annotations.
CONFIG_TYPES: dict[str, type] = {n: _toml_type(n, tp) for n, tp in _FIELD_TYPES.items()}


def _option_from_config(name: str, value: Any, where: str) -> Any:
    """One `[runtime]` key's value (of its CONFIG_TYPES type) as the option takes it, checked as the option is; a
    RuntimeConfigError names the key and `where` (not the option's variable: the file set it)."""
    raw = value
    try:
        if name == "chunk_weights":
            value = _parse_floats(raw, repr(raw))
        # built directly: _validate's own words ("expected one of torch, ipc"), not msgspec's
        return getattr(RuntimeOptions(**{name: value}), name)
    except RuntimeOptionError as e:
        msg = str(e).removeprefix(f"runtime option {name} ({_doc(name).env}) = ").replace(repr(value), repr(raw), 1)
        raise RuntimeConfigError(f"runtime.{name} in {where}: {msg}") from None

_CPU_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def parse_cpulist(text: str) -> tuple[int, ...]:
    """A CPU list in the kernel's syntax (sysfs `local_cpulist`, `taskset -c`): "0-3,8-11" -> (0, 1, 2, 3, 8, 9, 10,
    11), sorted, each CPU once; "" (or white space) -> (). Raises ValueError naming the malformed part."""
    body = text.strip()
    if not body:
        return ()
    cpus: set[int] = set()
    for item in body.split(","):
        m = _CPU_ITEM.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"malformed CPU list {text!r}: {item!r} is not a CPU number or a range a-b")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"malformed CPU list {text!r}: the range {item.strip()!r} runs backwards")
        if hi > MAX_CPU_INDEX:
            raise ValueError(f"CPU list {text!r}: CPU {hi} is past the largest index taken, {MAX_CPU_INDEX}")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def _normal_proxy_cpu(value: str) -> str:
    return value.strip().lower()


def proxy_cpu_setting(value: Any) -> tuple[str, tuple[int, ...]]:
    """A proxy_cpu value -> ("numa", ()), ("none", ()) or ("cpus", the CPUs listed); RuntimeOptionError naming
    the value otherwise. The one parser of the value: case and surrounding white space do not matter ("NUMA ",
    " None"), whether it came from the arguments, the config or MOETUNE_PROXY_CPU."""
    expected = "`numa`, `none` or a CPU list such as `12` or `8-15,40` (as a string)"
    if not isinstance(value, str):
        _fail("proxy_cpu", value, expected)
    text = _normal_proxy_cpu(value)
    if text in PROXY_CPU_MODES:
        return text, ()
    try:
        cpus = parse_cpulist(text)
    except ValueError as e:
        raise RuntimeOptionError(f"runtime option proxy_cpu ({_doc('proxy_cpu').env}) = {value!r}: {e}; expected "
                                 f"{expected}") from None
    if not cpus:
        _fail("proxy_cpu", value, expected)
    return "cpus", cpus


def _parse_env(doc: OptionDoc, raw: str) -> Any:
    kind = RuntimeOptions.__annotations__[doc.name]
    text = raw.strip()
    where = f"runtime option {doc.name} ({doc.env}={raw!r})"
    if kind == "bool":  # config.parse_bool: one reading of a bool variable; a RuntimeOptionError, as for the others
        try:
            return _config.parse_bool(raw, where)
        except _config.ConfigError as e:
            raise RuntimeOptionError(str(e)) from None
    if kind == "int":
        value = int_of_text(text)  # not int(): it takes "1_0" as 10
        if value is None:
            raise RuntimeOptionError(f"{where}: expected an integer (digits only)")
        return value
    if kind == "float":
        number = float_of_text(text)  # not float(): it takes "1_0" as 10.0
        if number is None:
            raise RuntimeOptionError(f"{where}: expected a number")
        return number
    if doc.name == "chunk_weights":
        return _parse_floats(text, where)
    if doc.name == "symm":
        if text.lower() not in SYMM_MODES:
            raise RuntimeOptionError(f"{where}: expected one of {', '.join(SYMM_MODES)}")
        return text.lower()
    return text  # proxy_cpu: normalised and checked with every other value (proxy_cpu_setting), naming the option


def _parse_floats(text: str, where: str) -> tuple[float, ...]:
    if not text.strip():
        return ()
    weights = tuple(float_of_text(v.strip()) for v in text.split(","))  # not float(): it takes "1_0" as 10.0
    if None in weights:
        raise RuntimeOptionError(f"{where}: expected comma-separated positive numbers, got {text!r}")
    return tuple(w for w in weights if w is not None)


# -- variables that were data-path switches and are knobs now (or were removed) ---------------------------
@dataclass(frozen=True)
class RetiredVariable:
    env: str
    now: str  # what replaces it


RETIRED: tuple[RetiredVariable, ...] = (
    RetiredVariable("MOETUNE_HS_SLOTS", "the knob `staging_slots`"),
    RetiredVariable("MOETUNE_HS_WAIT", "the knob `wait_mode`"),
    RetiredVariable("MOETUNE_EP_COMBINE_LANES", "the knob `combine_lanes` (`own`/`shared`; `auto` = the transport's choice)"),
    RetiredVariable("MOETUNE_HS_RECV_SMS", "nothing: receiving on SMs was slower (run 29) and removed"),
    RetiredVariable("MOETUNE_HS_STREAMS", "nothing: two copy streams per direction were slower (run 28) and removed"),
    RetiredVariable("MOETUNE_HS_SENDER_WAIT", "nothing: one wait per ring was no faster (run 31) and removed"),
)


def _check_retired(env: Mapping[str, str]) -> None:
    """A retired speed switch that is still set would be ignored silently; say where it went instead."""
    for r in RETIRED:
        if env.get(r.env, "").strip() and r.now.startswith("the knob"):
            raise RuntimeOptionError(f"{r.env} is no longer read: it is {r.now} now (pass it in the knobs, "
                                     f"e.g. --knobs or Knobs(...)); unset {r.env}")


def _check_misnamed(env: Mapping[str, str]) -> None:
    """`MOETUNE_RUNTIME_<KEY>` (the config's MOETUNE_<SECTION>_<KEY> rule applied to `[runtime]`) is moetune's own name
    but not read: each option has its own variable. Set, it was ignored without a word; say which one to set."""
    for doc in OPTION_DOCS:
        generic = f"MOETUNE_RUNTIME_{doc.name.upper()}"
        if generic != doc.env and env.get(generic, "").strip():
            raise RuntimeOptionError(f"{generic}={env[generic]!r} is not read: the variable of the runtime option "
                                     f"{doc.name} ([runtime] {doc.name}) is {doc.env} (set that one and unset {generic})")


# -- build and debug switches: environment variables only ------------------------------------------------
@dataclass(frozen=True)
class EnvVariable:
    name: str
    type: str
    default: str
    meaning: str
    read_by: str


ENV_VARIABLES: tuple[EnvVariable, ...] = (
    EnvVariable("MOETUNE_HOME", "path", "unset",
                "Moves the default database (`$MOETUNE_HOME/moetune.db`) and the daemon's socket directory "
                "(`$MOETUNE_HOME/run`); a relative path is taken against the current directory.", "runtime/paths.py"),
    EnvVariable("MOETUNE_SYSTEM_CONFIG", "path", "/etc/moetune/moetune.toml",
                "The system config file, read first (before the user's file); a path where no file is skips it "
                "(the test suite sets one for the CLI processes it starts). Empty is unset.", "runtime/paths.py"),
    EnvVariable("MOETUNE_CONFIG", "path", "unset",
                "A TOML config file read after /etc/moetune/moetune.toml and the user's file (as `--config`).",
                "runtime/config.py"),
    EnvVariable("MOETUNE_MK_LIB", "path", "unset",
                "A prebuilt megakernel library (`libmoetune_moe.so`) to load instead of building csrc/megakernel/.",
                "runtime/megakernel/_lib.py"),
    EnvVariable("MOETUNE_CACHE", "path", "~/.cache/moetune",
                "Cache root of the compiled library (`$MOETUNE_CACHE/build/<key>/`).", "runtime/csrc_build.py"),
    EnvVariable("MOETUNE_NVCC", "path", "$CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc",
                "The nvcc that builds csrc/.", "runtime/csrc_build.py"),
    EnvVariable("MOETUNE_CUDA_ARCH", "e.g. `90` or `sm_90`", "the current GPU's compute capability, else 90",
                "Target architecture of the csrc/ build.", "runtime/csrc_build.py"),
    EnvVariable("MOETUNE_CSRC_LIB", "path", "unset",
                "A prebuilt csrc/ library to load instead of building one.", "runtime/csrc_build.py"),
    EnvVariable("MOETUNE_POLICY", "path (file or directory)", "unset",
                "A user policy merged over the shipped policies (as `--policy`).", "tuner/search/policy.py"),
    EnvVariable("MOETUNE_PROFILE_HASH", "string", "unset",
                "Printed by `moetune query --format env` for launchers to record which profile a job ran; the "
                "runtime does not read it.", "tuner/cli/query.py (written)"),
    EnvVariable("MOETUNE_PROFILE_TRACE", "path prefix", "unset",
                "`moetune bench ep --profile`: also export the torch profiler timeline there (debug).",
                "tuner/measure/ep.py"),
    EnvVariable("MOETUNE_TEST_HOOKS", "`1`", "unset",
                "Honour the benchmark worker's test hooks (case fields such as `_test_sleep_s`); tests only.",
                "tuner/measure/worker.py"),
    EnvVariable("MOETUNE_WORKER_TRACEBACK", "`1`", "unset",
                "The benchmark worker prints a failing case's full traceback (debug).", "tuner/measure/worker.py"),
    EnvVariable("MOETUNE_GIT_SHA", "40-hex commit, optionally `-dirty`", "unset",
                "`moetune bench run` / `bench moe` / `bench knobs`: the commit to stamp on results where the tree "
                "is no git checkout of its own (an exported tree on a GPU machine: bench/tools/sync_megakernel_device.sh "
                "writes it to SHA_FULL); git_dirty is true when it ends in `-dirty` (the copy had changes on top of that commit), else "
                "whoever sets it vouches that the tree is exactly that commit. In a git checkout git decides (HEAD "
                "and its changes); where the two disagree git's is stamped, with a warning, unless the checkout's "
                ".git does not know the named commit (a stale .git copied with a newer tree): then the variable's "
                "commit, marked dirty (unverified).",
                "tuner/measure/scenarios/stamp.py"),
    EnvVariable("MOETUNE_FAKE_JOB_SLEEP", "float seconds", "0",
                "The test daemon's fake tuning job holds this long (restart tests); tests only.",
                "tests/daemon_fakes.py"),
    EnvVariable("MOETUNE_FAKE_EVENT_DELAY", "float seconds", "0",
                "The test daemon's store (`--store-hook`) takes this long for each job_queued / job_cancelled write "
                "(a retune answered only once committed); tests only.", "tests/daemon_fakes.py"),
)


# -- docs/settings.md ------------------------------------------------------------------------------------
def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    if isinstance(v, tuple):
        return "`" + ",".join(f"{x:g}" for x in v) + "`" if v else "(empty)"
    if v == "":
        return "(empty)"
    return f"`{v}`"


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def _knob_rows() -> list[str]:
    d = Knobs()
    rows = ["| knob | type / values | default | meaning |", "| --- | --- | --- | --- |"]
    for name in Knobs.__struct_fields__:
        kind, meaning = KNOB_DOCS[name]
        rows.append(f"| `{name}` | {_esc(kind)} | {_cell(getattr(d, name))} | {_esc(meaning)} |")
    return rows


def _config_rows() -> list[str]:
    rows = ["| key | type | default | variable |", "| --- | --- | --- | --- |"]
    for section, cls in _config.SECTIONS.items():
        defaults = cls()
        for f in dataclasses.fields(cls):
            var = _config.env_name(section, f.name)
            default = _cell(getattr(defaults, f.name))
            if (section, f.name) in _config.EMPTY_MEANS:  # said in full: `db = ""` is this default, not "no database"
                default = f"(empty: {_esc(_config.EMPTY_MEANS[(section, f.name)])})"
            rows.append(f"| `{section}.{f.name}` | {_config.type_name(section, f.name)} | "
                        f"{default} | `{var}` |")
    d = RuntimeOptions()
    for name, tp in CONFIG_TYPES.items():  # the [runtime] table: the options themselves
        rows.append(f"| `{_config.RUNTIME}.{name}` | {_config.TYPE_NAMES[tp]} | {_cell(getattr(d, name))} | "
                    "(the option variable below) |")
    return rows


def settings_markdown() -> str:
    """docs/settings.md: every knob, runtime option, config key and environment variable, from the code."""
    d = RuntimeOptions()
    out = [
        "# Settings",
        "",
        "<!-- GENERATED by `python -m moetune.runtime.settings_doc > docs/settings.md`; do not edit by hand.",
        "     tests/test_settings_doc.py fails when this file and the code disagree. -->",
        "",
        "moetune has three kinds of settings. **Knobs** change speed: the tuner searches them and a profile",
        "stores them (`runtime/knobs.py`). **Runtime options** change how the data path does the same work",
        "(fallbacks, timeouts, side-by-side switches): `EPBuffer(..., options=RuntimeOptions(...))` (`from moetune.runtime import RuntimeOptions`), else the",
        "`[runtime]` section of the config, overridden by each option's variable (`runtime/options.py`). Every rank",
        "of an EP group must use the same knobs and options: the buffer compares their digests when it is built",
        "(except the options that only place a thread within each process, which ranks may set differently: "
        f"{', '.join(f'`{n}`' for n in sorted(PROCESS_LOCAL_OPTIONS))}).",
        "**Build and debug variables** stay environment variables.",
        "",
        "## Knobs",
        "",
        "Pass them as `Knobs(...)`, `--knobs name=value,...`, or in a policy (`policies/*.toml`).",
        "",
        *_knob_rows(),
        "",
        "## Runtime options",
        "",
        "Order (later wins): default, config `[runtime]` key, variable, `EPBuffer(options=...)`.",
        "Booleans in variables: `1`/`0` (or `true`/`false`, `yes`/`no`, `on`/`off`); an empty variable is unset.",
        "The options that change the data path "
        f"({', '.join(f'`{n}`' for n in DATA_PATH_OPTIONS)}) are recorded with every measured profile;",
        "a profile that recorded them is applied as tuned only to a job running the same values of the options that",
        "act on its transport family (" + "; ".join(f"`{n}` on {', '.join(sorted(DATA_PATH_FAMILIES[n]))}"
                                                    for n in DATA_PATH_OPTIONS) + ").",
        "A profile that recorded none (an older moetune measured it) has unknown options: it is applied as tuned by",
        "default, and passed over only with `client.env_mismatch = \"refuse\"`. Megakernel profiles are never",
        "compared (the kernel reads none of these options). The others change no data path: "
        f"{', '.join(f'`{n}`' for n in NOT_DATA_PATH_OPTIONS)}.",
        "",
        "| option (`[runtime]` key) | variable | type | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for doc in OPTION_DOCS:
        out.append(f"| `{doc.name}` | `{doc.env}` | {_esc(doc.type)} | {_cell(getattr(d, doc.name))} | {_esc(doc.meaning)} |")
    out += [
        "",
        "## Configuration file",
        "",
        "TOML, read in order (later wins): `/etc/moetune/moetune.toml` (or `$MOETUNE_SYSTEM_CONFIG`),",
        "`~/.config/moetune/moetune.toml` (`$XDG_CONFIG_HOME` respected), `--config FILE` or `$MOETUNE_CONFIG`, then",
        "`MOETUNE_<SECTION>_<KEY>` variables (or the variable the table names; the `[runtime]` section's variables",
        "are the option variables above). Unknown keys are errors (an EP buffer or MoE layer only warns of a wrong",
        "setting it does not read, such as `[tune]` or the daemon's, and runs: the commands that read it refuse it).",
        "Booleans in variables: `1`/`0` (or `true`/`false`, `yes`/`no`, `on`/`off`);",
        "an empty one is the key's default; anything else is an error naming the variable. The rule's name of a key",
        "whose variable is another (`MOETUNE_CLIENT_AUTOLOAD`, `MOETUNE_RUNTIME_<KEY>`) is not read: set, it is an",
        "error naming the variable to set. Any other `MOETUNE_*` variable these tables do not list is not read and not",
        "checked (other tools may own it): a misspelt name is ignored.",
        "",
        *_config_rows(),
        "",
        *(f"- `{section}.{key}`: {_esc(note)}" for (section, key), note in _config.KEY_NOTES.items()),
        "",
        "## Build and debug variables",
        "",
        "| variable | type | default | meaning | read by |",
        "| --- | --- | --- | --- | --- |",
    ]
    for v in ENV_VARIABLES:
        out.append(f"| `{v.name}` | {_esc(v.type)} | {_esc(v.default)} | {_esc(v.meaning)} | {v.read_by} |")
    out += [
        "",
        "## Retired variables",
        "",
        "Older benchmark scripts set these; the code no longer reads them. Setting one that became a knob is an",
        "error when an EP buffer is built (it would otherwise be ignored silently).",
        "",
        "| variable | now |",
        "| --- | --- |",
    ]
    for r in RETIRED:
        out.append(f"| `{r.env}` | {_esc(r.now)} |")
    return "\n".join(out) + "\n"


def documented_variables() -> set[str]:
    """Every `MOETUNE_*` name docs/settings.md documents."""
    names = {d.env for d in OPTION_DOCS} | {v.name for v in ENV_VARIABLES} | {r.env for r in RETIRED}
    for section, cls in _config.SECTIONS.items():
        for f in dataclasses.fields(cls):
            var = _config.env_name(section, f.name)
            if var:
                names.add(var)
    return names

