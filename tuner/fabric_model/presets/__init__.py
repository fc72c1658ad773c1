"""Fabric presets for the fabric model: data files (tuner/fabric_model/presets/*.toml) with a source per parameter.

A preset describes one fabric (GPUs per node, NVLink, PCIe, NIC, CPU proxy, collective library) as
physical parameters. Every numeric parameter must name its source in the file's `[sources]` table
(key = dotted parameter path): a datasheet, a paper, a measurement file, or "assumed: ..." where the
value is an engineering estimate. `load_preset` refuses a file where a parameter has no source.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from moetune.runtime.knobs import TRANSPORTS
from moetune.runtime.profile_record import TRANSPORT_FAMILIES, is_transport_family

# Parameter sections the model reads, and the keys each must (or may) hold.
REQUIRED: dict[str, tuple[str, ...]] = {
    "gpu": ("sms", "tflops_bf16", "gemm_efficiency", "hbm_gbps", "sm_copy_gbps", "launch_us"),
    "pcie": ("d2h_gbps", "h2d_gbps", "memcpy_us", "host_mem_gbps"),
    "collective": ("alpha_us", "sync_us", "per_peer_us", "intra_gbps", "nic_efficiency", "host_alpha_us",
                   "host_chunk_kb"),
}
OPTIONAL: dict[str, tuple[str, ...]] = {
    "nvlink": ("egress_gbps", "peer_gbps", "latency_us", "signal_us"),
    "nic": ("gbps", "qp_gbps", "msg_overhead_us", "signal_overhead_us", "rtt_us", "tail_us", "shared_qps"),
    "proxy": ("put_us", "signal_us", "fence_flag_us", "fence_us", "fence_per_pe_us", "poll_us"),
    "ibgda": ("post_sm_us", "wqe_fetch_us"),
}
FENCE_QUIET = ("always", "multi_qp", "never")
# Parameters the model divides by (bandwidths, rates, efficiencies, counts): 0 would divide by zero.
POSITIVE: frozenset[str] = frozenset({
    "gpu.sms", "gpu.tflops_bf16", "gpu.gemm_efficiency", "gpu.hbm_gbps", "gpu.sm_copy_gbps",
    "nvlink.egress_gbps", "nvlink.peer_gbps",
    "pcie.d2h_gbps", "pcie.h2d_gbps", "pcie.host_mem_gbps",
    "collective.intra_gbps", "collective.nic_efficiency", "collective.host_chunk_kb",
    "nic.gbps", "nic.qp_gbps",
})
# Fractions of a rate (the model multiplies a peak by them): 45 for 45 % made the GEMMs 100x the GPU's peak.
FRACTIONS: frozenset[str] = frozenset({"gpu.gemm_efficiency", "collective.nic_efficiency"})
# Parameters the model uses as counts: a fraction makes no sense.
INTEGER: frozenset[str] = frozenset({"gpu.sms", "nic.shared_qps"})
# The top-level keys a preset may hold besides its parameter sections.
TOP_LEVEL = ("name", "family", "transports", "gpus_per_node", "description", "max_nodes", "calibration", "sources")
# Non-numeric switches: (section, key) -> the Python type the value must have.
SWITCHES: dict[tuple[str, str], type] = {
    ("proxy", "fence_quiet"): str,
    ("proxy", "serves_intra_node"): bool,
    ("pcie", "duplex"): bool,
}


class PresetError(ValueError):
    """A preset cannot be found or is malformed."""


@dataclass(frozen=True)
class Preset:
    """One fabric described by physical parameters (all numbers carry a source)."""

    name: str
    family: str
    transports: tuple[str, ...]
    gpus_per_node: int
    description: str
    params: Mapping[str, Mapping[str, Any]]
    sources: Mapping[str, str]
    path: str | None = None
    calibration: Mapping[str, Any] = field(default_factory=dict)
    # 0 = no limit; 1 = a single box (no network between nodes)
    max_nodes: int = 0

    # -- access -------------------------------------------------------------------------------
    def has(self, section: str) -> bool:
        return section in self.params

    def get(self, dotted: str) -> Any:
        section, key = dotted.split(".", 1)
        try:
            return self.params[section][key]
        except KeyError:
            raise PresetError(f"preset {self.name!r} has no parameter {dotted!r}") from None

    def numeric(self) -> dict[str, float]:
        """All numeric parameters as {dotted: value} (what calibration can fit)."""
        out: dict[str, float] = {}
        for section, table in self.params.items():
            for key, value in table.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[f"{section}.{key}"] = float(value)
        return out

    def with_params(self, changes: Mapping[str, float], *, source: str | None = None,
                    name: str | None = None, calibration: Mapping[str, Any] | None = None) -> Preset:
        """A copy with some numeric parameters replaced (their source becomes `source` if given)."""
        params = {s: dict(t) for s, t in self.params.items()}
        sources = dict(self.sources)
        for dotted, value in changes.items():
            section, key = dotted.split(".", 1)
            if section not in params or key not in params[section]:
                raise PresetError(f"preset {self.name!r} has no parameter {dotted!r}")
            old = params[section][key]
            params[section][key] = round(value) if isinstance(old, int) and not isinstance(old, bool) else float(value)
            if source:
                sources[dotted] = source
        return Preset(
            name=name or self.name, family=self.family, transports=self.transports,
            gpus_per_node=self.gpus_per_node, description=self.description, params=params,
            sources=sources, path=None, calibration=dict(calibration if calibration is not None else self.calibration),
            max_nodes=self.max_nodes,
        )

    def to_toml(self) -> str:
        """Serialise back to the preset file format (round-trips through `load_preset`)."""
        lines = [
            f"name = {_tq(self.name)}",
            f"family = {_tq(self.family)}",
            f"transports = [{', '.join(_tq(t) for t in self.transports)}]",
            f"gpus_per_node = {self.gpus_per_node}",
            f"description = {_tq(self.description)}",
        ]
        if self.max_nodes:
            lines.append(f"max_nodes = {self.max_nodes}")
        for section, table in self.params.items():
            lines += ["", f"[{section}]"]
            lines += [f"{k} = {_tv(v)}" for k, v in table.items()]
        if self.calibration:
            lines += ["", "[calibration]"]
            lines += [f"{k} = {_tv(v)}" for k, v in self.calibration.items()]
        lines += ["", "[sources]"]
        lines += [f"{_tq(k)} = {_tq(v)}" for k, v in sorted(self.sources.items())]
        return "\n".join(lines) + "\n"


# What a preset's predictions depend on: not its name, description, sources or calibration notes.
PREDICTION_FIELDS = ("family", "transports", "gpus_per_node", "max_nodes", "params")


def preset_content(preset: Any) -> dict[str, Any]:
    """The fields of `preset` its predictions depend on (`PREDICTION_FIELDS`)."""
    return {k: getattr(preset, k, None) for k in PREDICTION_FIELDS}


def _canon(v: Any) -> Any:
    # 46 and 46.0 in a TOML file are one bandwidth: the digest must not tell them apart
    if isinstance(v, Mapping):
        return {str(k): _canon(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_canon(x) for x in v]
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    return v


def preset_digest(preset: Any) -> str:
    """A 16-hex digest of `preset_content`: two presets of one name (a calibrated or edited copy keeps the shipped
    preset's name) but other numbers get other digests, hence other profile keys."""
    blob = json.dumps(_canon(preset_content(preset)), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _shipped_digest(name: str) -> str | None:
    """`preset_digest` of the shipped preset `name` (None: no preset of that name is shipped). Read from the package
    itself, never from a file of that name in the working directory (which `load_preset(name)` would take)."""
    if name not in list_presets():
        return None
    if name not in _SHIPPED_DIGESTS:
        _SHIPPED_DIGESTS[name] = preset_digest(_parse(tomllib.loads((_preset_dir() / f"{name}.toml").read_text()), None))
    return _SHIPPED_DIGESTS[name]


_SHIPPED_DIGESTS: dict[str, str] = {}


def preset_origin(measured_on: str) -> tuple[bool | None, str]:
    """Whether a preset profile's `measured_on` (`preset:NAME:DIGEST`, DIGEST its preset's `preset_digest`) is the
    shipped preset NAME's content, and a note saying so: (True, ...) the shipped preset's numbers; (False, ...) another
    content under a shipped preset's name (an edited or calibrated copy keeps the name), or a preset file of a name
    nothing ships; (None, ...) not recorded: a profile an older moetune stored says only `preset:NAME`."""
    from moetune.runtime.profile_record import PRESET_PREFIX

    rest = measured_on.removeprefix(PRESET_PREFIX)
    name, _, digest = rest.rpartition(":")
    if not (len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)):
        name, digest = rest, ""
    shipped = _shipped_digest(name)
    if not digest:
        return None, f"which {name} predicted it is not recorded (stored by an older moetune)"
    if shipped is None:
        return False, f"a preset file named {name} (no preset of that name is shipped), content digest {digest}"
    if digest == shipped:
        return True, f"the shipped preset {name}"
    return False, (f"NOT the shipped preset {name}: a file of that name with other numbers (an edited or calibrated "
                   f"copy), content digest {digest}; the shipped one's is {shipped}")


def _tq(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _tv(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(float(f"{v:.6g}"))
    if isinstance(v, str):
        return _tq(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_tv(x) for x in v) + "]"
    raise PresetError(f"cannot write {v!r} to TOML")


def _preset_dir():
    return resources.files("moetune.tuner.fabric_model.presets")


def list_presets() -> list[str]:
    """Names of the presets shipped with the package."""
    return sorted(p.name[: -len(".toml")] for p in _preset_dir().iterdir() if p.name.endswith(".toml"))


_CACHE: dict[str, Preset] = {}


def load_preset(name_or_path: str | Path, *, fresh: bool = False) -> Preset:
    """A shipped preset by name, or a preset file by path (cached for the process; `fresh` reads it again: a
    node model re-calibrated on disk). Raises PresetError (a ValueError)."""
    key = str(name_or_path)
    if key in _CACHE and not fresh:
        return _CACHE[key]
    path: Path | None = None
    # a directory of that name is a wrong path, not a shipped preset's name (unless it is one)
    if (key.endswith(".toml") or "/" in key or Path(key).is_file()
            or (Path(key).is_dir() and key not in list_presets())):
        path = Path(key)
        text = _read_file(path)
    else:
        res = _preset_dir() / f"{key}.toml"
        if not res.is_file():
            raise PresetError(f"unknown preset {key!r}; known: {', '.join(list_presets())}")
        text = res.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"preset {key!r}: not valid TOML ({e})") from None
    preset = _parse(data, str(path) if path else None)
    _CACHE[key] = preset
    return preset


def read_text_file(path: Path, what: str, expected: str, error: type[Exception]) -> str:
    """The UTF-8 text of a user-named file (`what`: "preset file"); `error` naming the file where it is a folder,
    missing, not a regular file, not UTF-8 or unreadable (`expected`: what it should be, e.g. "a TOML file")."""
    name = f"{what} {str(path)!r}"
    if path.is_dir():
        raise error(f"{name} is a directory, not {expected}")
    if not path.exists():
        raise error(f"{name} does not exist")
    if not path.is_file():
        raise error(f"{name} is not a regular file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{name} is not UTF-8 text (bad byte at offset {e.start}); expected {expected}") from None
    except OSError as e:
        raise error(f"{name} cannot be read: {e.strerror or e}") from None


def _read_file(path: Path) -> str:
    return read_text_file(path, "preset file", "a TOML file", PresetError)


def _is_number(value: Any) -> bool:
    # TOML booleans are Python ints; they are never a parameter value
    return isinstance(value, int | float) and not isinstance(value, bool)


_TYPE_NAMES: dict[type, str] = {bool: "a boolean", str: "a string", int: "an integer", float: "a number",
                                list: "an array", dict: "a table"}


def _type_name(value: Any) -> str:
    """How a TOML value's type reads in an error ("a string")."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


# The section a family's transport needs beyond the required ones: the model's costs of that transport.
FAMILY_SECTIONS = {"nvlink": "nvlink", "proxy": "proxy", "ibgda": "ibgda"}


def _check_family(family: str, transports: tuple[str, ...], params: Mapping[str, Any], where: str) -> None:
    """A preset's `family` (what `tune --preset` tunes, a node model's family) is a transport family moetune names,
    whose transport the preset lists and models: a typo loaded without a word and was named only where the family
    was read later, without the file; a family of a transport it does not list had every prediction refused."""
    if not is_transport_family(family):
        raise PresetError(f"{where}: family {family[:64]!r} is no transport family (allowed: "
                          f"{', '.join(sorted(TRANSPORT_FAMILIES))}, or proxy:libfabric/PROVIDER)")
    transport = family.split(":", 1)[0]  # proxy:libfabric/cxi runs the proxy transport
    if transport not in transports:
        raise PresetError(f"{where}: family {family!r} runs transport {transport!r}, which transports does not list "
                          f"(it lists {', '.join(transports)}): add it, or name a family of one of those")
    section = FAMILY_SECTIONS.get(transport)
    if section is not None and section not in params:
        raise PresetError(f"{where}: family {family!r} needs a [{section}] section (the {transport} transport's "
                          f"parameters: {', '.join(OPTIONAL[section])})")


def _parse(data: dict[str, Any], path: str | None) -> Preset:
    name = data.get("name")
    # name the file where there is one (that is what the user edits), else the preset
    where = f"preset file {path!r}" if path else f"preset {name!r}"
    for k in ("name", "family", "transports", "gpus_per_node"):
        if k not in data:
            raise PresetError(f"{where}: missing top-level key {k!r}")
    for k in ("name", "family", "description"):
        if k in data and not isinstance(data[k], str):
            raise PresetError(f"{where}: {k} must be a string, got {_type_name(data[k])} ({data[k]!r})")
    if not data["name"].strip():
        raise PresetError(f"{where}: name must not be empty")
    raw_transports = data["transports"]
    if not isinstance(raw_transports, list) or not raw_transports:
        raise PresetError(f"{where}: transports must be a non-empty array of transport names "
                          f"(known: {', '.join(TRANSPORTS)}), got {raw_transports!r}")
    transports = tuple(raw_transports)
    for t in transports:
        if t not in TRANSPORTS:
            raise PresetError(f"{where}: unknown transport {t!r} (known: {', '.join(TRANSPORTS)})")
    gpn = data["gpus_per_node"]
    if not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1:
        raise PresetError(f"{where}: gpus_per_node must be a positive integer, got {gpn!r}")
    sources = data.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise PresetError(f"{where}: [sources] must be a table of parameter = \"source text\"")
    if not isinstance(data.get("calibration", {}), dict):
        raise PresetError(f"{where}: calibration must be a table")
    fp = data.get("calibration", {}).get("fingerprint")
    if fp is not None and not (isinstance(fp, str) and fp.strip()):
        raise PresetError(f"{where}: calibration.fingerprint (the node it was calibrated on) must be a fingerprint "
                          f"string, got {fp!r}")
    world = data.get("calibration", {}).get("world")
    if world is not None and not (isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        raise PresetError(f"{where}: calibration.world (the most ranks a fitted row measured together) must be a "
                          f"positive integer, got {world!r}")
    tokens = data.get("calibration", {}).get("tokens")
    if tokens is not None and not (isinstance(tokens, list) and len(tokens) == 2
                                   and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tokens)
                                   and tokens[0] <= tokens[1]):
        raise PresetError(f"{where}: calibration.tokens (the least and most tokens per GPU a fitted row measured) must "
                          f"be [least, most], two positive integers, least <= most, got {tokens!r}")
    params: dict[str, dict[str, Any]] = {}
    for section in (*REQUIRED, *OPTIONAL):
        if section not in data:
            if section in REQUIRED:
                raise PresetError(f"{where}: missing section [{section}]")
            continue
        if not isinstance(data[section], dict):
            raise PresetError(f"{where}: {section} must be a table [{section}], got {_type_name(data[section])}")
        table = dict(data[section])
        want = REQUIRED.get(section) or OPTIONAL[section]
        missing = [k for k in want if k not in table]
        if missing:
            raise PresetError(f"{where}: [{section}] lacks {', '.join(missing)}")
        switches = [k for (s, k) in SWITCHES if s == section]
        extra = [k for k in table if k not in want and k not in switches]
        if extra:  # the model reads none of them (a misspelled parameter, even with a source)
            raise PresetError(f"{where}: unknown parameter {', '.join(f'{section}.{k}' for k in extra)} (the model "
                              f"reads {', '.join(f'{section}.{k}' for k in (*want, *switches))})")
        params[section] = table
    # a key or section nothing reads is a typo: `[nvlnk]` dropped the preset's NVLink, `max_node = 1` its node limit
    # (checked after the sections' own checks, so that `gpu = 5` is still said to be no table)
    unknown = sorted(set(data) - set(TOP_LEVEL) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        said = ", ".join(f"[{k}]" if isinstance(data[k], dict) else k for k in unknown)  # as the file spells it
        sections = ", ".join(f"[{s}]" for s in (*REQUIRED, *OPTIONAL))
        raise PresetError(f"{where}: unknown top-level key or section {said} (known: {', '.join(TOP_LEVEL)} and the "
                          f"sections {sections})")
    # Non-numeric switches.
    if "proxy" in params:
        fq = params["proxy"].get("fence_quiet")
        if fq not in FENCE_QUIET:
            raise PresetError(f"{where}: proxy.fence_quiet must be one of {FENCE_QUIET}, got {fq!r}")
        params["proxy"].setdefault("serves_intra_node", False)
    # the queue model reads [nic] for every request, also where the proxy serves this node's peers (nvlink-h200x2's
    # copy-engine streams are its QPs): exempting that case let `predict` fail with an AttributeError instead
    if "nic" not in params and any(t in ("proxy", "ibgda") for t in transports):
        raise PresetError(f"{where}: proxy/ibgda transports need a [nic] section (the queue model reads its QPs, "
                          "overheads and round trip, also where the proxy serves this node's peers)")
    _check_family(data["family"], transports, params, where)
    if "pcie" in params:
        params["pcie"].setdefault("duplex", True)
    for section, table in params.items():
        for key, value in table.items():
            dotted = f"{section}.{key}"
            want = SWITCHES.get((section, key))
            if want is not None:
                if not isinstance(value, want):
                    raise PresetError(f"{where}: {dotted} must be {_TYPE_NAMES[want]}, "
                                      f"got {_type_name(value)} ({value!r})")
                continue
            if dotted in INTEGER and not (isinstance(value, int) and not isinstance(value, bool)):
                raise PresetError(f"{where}: {dotted} must be an integer, got {_type_name(value)} ({value!r})")
            if not _is_number(value):
                raise PresetError(f"{where}: {dotted} must be a number, got {_type_name(value)} ({value!r})")
            if not math.isfinite(value) or value < 0:
                raise PresetError(f"{where}: {dotted} must be a finite number >= 0, got {value!r}")
            if dotted in POSITIVE and value <= 0:
                # the model divides by it: 0 has no physical meaning and would divide by zero
                raise PresetError(f"{where}: {dotted} must be > 0, got {value!r}")
            if dotted in FRACTIONS and value > 1:
                raise PresetError(f"{where}: {dotted} must be a fraction of the peak rate, at most 1 (0.45 for 45 %), "
                                  f"got {value!r}")
            if dotted not in sources:
                raise PresetError(f"{where}: parameter {dotted} has no entry in [sources]")
    max_nodes = data.get("max_nodes", 0)
    if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 0:
        raise PresetError(f"{where}: max_nodes must be an integer >= 0, got {max_nodes!r}")
    return Preset(
        name=str(name), family=str(data["family"]), transports=transports, gpus_per_node=gpn,
        description=str(data.get("description", "")), params=params, sources=dict(sources), path=path,
        calibration=dict(data.get("calibration", {})), max_nodes=max_nodes,
    )


RECALIBRATE = ("recalibrate on that node: `moetune profile --restart` (its calibrate stage writes node-<fingerprint>.toml "
               "beside the database), or `moetune model calibrate --this-node --data ... --out FILE` there with "
               "measurements taken there")


def node_model_family(preset: Any, families: Iterable[str]) -> tuple[str | None, str]:
    """(the transport family a model calibrated from `preset` describes on a node whose discovery found `families`,
    '') or (None, why no family there). The preset's own family where the node runs it; else `collective` where the
    node runs it and the preset models it (a node without GPUs measures gloo between host processes: the pcie4
    preset's host_staged is not on it). `tune --node-model` tunes only this family, so a node model of a family the
    node lacks was refused there ("host_staged not found"): the bring-up and `model calibrate --this-node` ask
    this one rule."""
    found = sorted(set(families))
    if preset.family in found:
        return preset.family, ""
    if "collective" in found and "collective" in preset.transports:
        return "collective", ""
    return None, (f"this node runs no family preset {preset.name} models (its family {preset.family}, or collective "
                  f"of its transports {', '.join(preset.transports)}; the node has: {', '.join(found) or 'none'})")


def node_model_refusal(preset: Any, fingerprint: str) -> str:
    """'' when `preset` is a calibrated model of the node `fingerprint` (its [calibration] records that fingerprint),
    else why it may not stand as that node's model. Profiles from a node model are labelled node_model, which
    outranks a preset's in every pick: the user's word (--node-model, a file's name) is not enough."""
    calib = getattr(preset, "calibration", None)
    recorded = calib.get("fingerprint") if isinstance(calib, Mapping) else None
    if recorded == fingerprint:
        return ""
    path = getattr(preset, "path", None)
    what = f"preset file {path!r}" if path else f"preset {getattr(preset, 'name', '?')!r}"
    if not path:
        return (f"{what} is a shipped preset (a model of the machine it describes), not a model calibrated on this "
                f"node {fingerprint}; use it without --node-model (its profiles are stored as preset), or "
                + RECALIBRATE)
    if not calib:
        return f"{what} is not a calibrated model (no [calibration] table), so not this node's ({fingerprint}); " + RECALIBRATE
    if not recorded:
        return (f"{what} records no fingerprint of the node it was calibrated on (written by an older moetune, or by "
                f"`moetune model calibrate` without --this-node), so it cannot be taken as this node's ({fingerprint}) "
                "model; " + RECALIBRATE)
    return (f"{what} was calibrated on node {recorded}, not on this node {fingerprint} (hardware or software "
            "differ); " + RECALIBRATE)
