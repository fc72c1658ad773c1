"""Transport policies: per fabric family, the knobs the tuner may touch, their values, the default
(untuned) setting, analytic priors and the error budget for compression.

Packaged policies live in `moetune.policies/<family>.toml`; a user policy (a file, or a directory of
files named like the packaged ones) overrides them table by table (lists are replaced, not merged).
Every error names the file and the key.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from moetune.runtime.knobs import (
    ALLOWED_FENCE_MODES,
    COMPRESSIONS,
    KNOB_VALUES,
    MK_KNOBS,
    QUEUED,
    SCALE_GRANULARITIES,
    TRANSPORTS,
    KnobError,
    Knobs,
    mk_stage_cap,
)
from moetune.runtime.profile_record import LIBFABRIC_PROVIDER
from moetune.runtime.profiles.policy_defaults import policy_file_candidates

KNOB_NAMES: tuple[str, ...] = tuple(Knobs.__struct_fields__)
# What a policy's [knobs] may offer, from the runtime's one knob table (runtime/knobs.py KNOB_VALUES): a policy
# narrows a knob's values to its search space, never widens them (`_knob_spec` checks each against the table).
# Knobs that take values from a fixed vocabulary (transport is the family's, never searched).
CATEGORICAL: dict[str, tuple[str, ...]] = {n: v.choices for n, v in KNOB_VALUES.items()
                                           if not v.is_int and n != "transport"}
# Integer knobs and their hard limits.
INTEGER: dict[str, tuple[int, int]] = {n: v.limits for n, v in KNOB_VALUES.items() if v.is_int}
# Families that are not a transport: the MoE megakernel runs the layer on one GPU (ep_size 1); its policy's
# transport is the one a world-1 layer builds its (idle) EP buffer with.
FAMILY_TRANSPORT: dict[str, str] = {"megakernel": "collective"}
KNOWN_TABLES = ("policy", "defaults", "knobs", "priors", "compression")
KNOWN_PRIORS = ("link_gbps", "link_efficiency", "sm_copy_gbps", "nic_gbit", "qp_gbps")
ENV_POLICY = "MOETUNE_POLICY"


class PolicyError(ValueError):
    """A policy file is missing, malformed or inconsistent. The message names the file and the key."""

    def __init__(self, source: str, key: str, message: str):
        self.source = source
        self.key = key
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")


@dataclass(frozen=True)
class KnobSpec:
    """The values one knob may take: an explicit list, or an integer range with a step."""

    name: str
    choices: tuple[Any, ...] = ()
    low: int | None = None
    high: int | None = None
    step: int = 1

    @property
    def is_range(self) -> bool:
        return self.low is not None

    def values(self) -> tuple[Any, ...]:
        if self.is_range:
            assert self.low is not None and self.high is not None
            return tuple(range(self.low, self.high + 1, self.step))
        return self.choices

    def contains(self, value: Any) -> bool:
        if self.is_range:
            assert self.low is not None and self.high is not None
            return isinstance(value, int) and self.low <= value <= self.high and (value - self.low) % self.step == 0
        return value in self.choices

    def nearest(self, value: Any) -> Any:
        """The allowed value closest to `value` (log distance for integers)."""
        vals = self.values()
        if value in vals:
            return value
        if isinstance(value, (int, float)) and all(isinstance(v, int) for v in vals):
            lv = math.log(max(value, 0.5))
            return min(vals, key=lambda v: (abs(math.log(max(v, 0.5)) - lv), v))
        return vals[0]


@dataclass(frozen=True)
class Policy:
    family: str
    transport: str
    description: str
    defaults: Knobs
    knobs: dict[str, KnobSpec]
    # "divisors" (nvlink: per PE plus the proper divisors of the CTAs per peer), "put_groups" (proxy/ibgda:
    # per peer plus PUT_GROUP_SIZES in tuner/search/space.py) or explicit sizes.
    group_size: str | tuple[int, ...] | None
    priors: dict[str, float]
    error_budget: float
    expected_error: dict[str, float]
    sources: tuple[str, ...] = field(default_factory=tuple)

    def allowed(self, name: str) -> tuple[Any, ...]:
        """The values of a knob the tuner may try (the default alone when the knob is not searched)."""
        if name == "group_size":
            raise KnobError("group_size values depend on the workload: use SearchSpace", ("group_size",))
        spec = self.knobs.get(name)
        return spec.values() if spec else (getattr(self.defaults, name),)

    def compression_error(self, compression: str, granularity: str) -> float:
        if compression == "none":
            return 0.0
        return self.expected_error.get(f"{compression}/{granularity}", math.inf)

    def compression_allowed(self, compression: str, granularity: str) -> bool:
        return self.compression_error(compression, granularity) <= self.error_budget

    def to_dict(self) -> dict[str, Any]:
        knobs: dict[str, Any] = {}
        for n, s in self.knobs.items():
            knobs[n] = {"min": s.low, "max": s.high, "step": s.step} if s.is_range else list(s.choices)
        if self.group_size is not None:
            knobs["group_size"] = self.group_size if isinstance(self.group_size, str) else list(self.group_size)
        out_extra: dict[str, Any] = {}
        if self.transport == "nvlink" and self.group_size is not None:
            # nvlink's group sizes count CTAs per peer (tuner/search/space.py), not transfers: a study whose
            # trials used the old meaning has another digest (study_config) and is not resumed
            out_extra["group_size_unit"] = "ctas_per_peer"
        elif self.transport in QUEUED and self.group_size is not None:
            # proxy/ibgda group sizes count PUTs per peer and are asked only with chunk_tokens > 0 (space.py);
            # studies that offered the experts-per-rank divisors have another digest and are not resumed
            out_extra["group_size_unit"] = "puts_per_peer"
        return {**out_extra,
            "family": self.family, "transport": self.transport, "description": self.description,
            "defaults": self.defaults.to_dict(), "knobs": knobs, "priors": dict(self.priors),
            "error_budget": self.error_budget, "expected_error": dict(self.expected_error),
            "sources": list(self.sources),
        }


# ---------------------------------------------------------------------------------------------------
# reading


def _read_toml_text(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(source, "", f"not valid TOML ({e})") from None


def _packaged(stem: str) -> tuple[dict[str, Any], str] | None:
    res = resources.files("moetune.policies") / f"{stem}.toml"
    if not res.is_file():
        return None
    source = f"moetune.policies/{stem}.toml"
    return _read_toml_text(res.read_text(encoding="utf-8"), source), source


def packaged_families() -> list[str]:
    """Families with a packaged policy file (the `[policy] family` of each)."""
    out = []
    for res in sorted(resources.files("moetune.policies").iterdir(), key=lambda r: r.name):
        if res.name.endswith(".toml"):
            data = _read_toml_text(res.read_text(encoding="utf-8"), f"moetune.policies/{res.name}")
            fam = data.get("policy", {}).get("family") if isinstance(data.get("policy"), dict) else None
            out.append(fam or res.name[:-5])
    return out


def _read_policy_file(path: Path) -> dict[str, Any]:
    """A user policy file's tables. One that cannot be read or is not UTF-8 is a PolicyError naming it (a
    UnicodeDecodeError was a traceback from `tune --policy`, and a message naming no file from $MOETUNE_POLICY)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError(str(path), "", f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                                         "save it as UTF-8") from None
    except OSError as e:
        raise PolicyError(str(path), "", f"cannot be read ({e.strerror or e})") from None
    return _read_toml_text(text, str(path))


# a libfabric provider's family (proxy:libfabric/cxi) and policy file stem (proxy_libfabric_cxi)
_PROVIDER_FAMILY = re.compile(rf"proxy:libfabric/{LIBFABRIC_PROVIDER}")
_PROVIDER_STEM = re.compile(rf"proxy_libfabric_{LIBFABRIC_PROVIDER}")


def _known_families_text() -> str:
    return f"{', '.join(packaged_families())}, or a libfabric provider's proxy:libfabric/PROVIDER"


def _check_override_family(target: Any, source: str) -> None:
    """A user file's `[policy] family` must name a family it can apply to (a packaged one, a prefix of one such as
    `proxy`, or a libfabric provider's): a typo ("ibgdaa") applied to nothing and the tune ran without it."""
    if not isinstance(target, str):
        raise PolicyError(source, "policy.family", f"must be a string, got {target!r}")
    if _PROVIDER_FAMILY.fullmatch(target) or any(_family_matches(f, target) for f in packaged_families()):
        return
    raise PolicyError(source, "policy.family", f"{target!r} is no transport family this override could apply to "
                                               f"(known: {_known_families_text()})")


def _check_override_dir(override: Path) -> None:
    """Every policy file in a user directory must be named like a packaged one (or a libfabric provider's): a
    misnamed file (ibgdaa.toml) would be ignored without a word."""
    stems = {stem for f in packaged_families() for stem in policy_file_candidates(f)}
    for p in sorted(override.glob("*.toml")):
        if p.stem not in stems and not _PROVIDER_STEM.fullmatch(p.stem):
            raise PolicyError(str(p), "", f"the file name names no transport family, so it would apply to nothing "
                                          f"(known: {', '.join(sorted(stems))}.toml, or proxy_libfabric_PROVIDER.toml)")


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _override_for(family: str, override: Path) -> list[tuple[dict[str, Any], str]]:
    """The override tables that apply to `family` from a user file or directory."""
    if not override.exists():
        raise PolicyError(str(override), "", "user policy path does not exist")
    found: list[tuple[dict[str, Any], str]] = []
    if override.is_dir():
        _check_override_dir(override)
        for stem in reversed(policy_file_candidates(family)):  # least specific first
            p = override / f"{stem}.toml"
            if p.is_file():
                found.append((_read_policy_file(p), str(p)))
        return found
    data = _read_policy_file(override)
    target = data.get("policy", {}).get("family") if isinstance(data.get("policy"), dict) else None
    if target is not None:
        _check_override_family(target, str(override))
    if target is None or _family_matches(family, target):
        data = {k: v for k, v in data.items() if k != "policy"} if target is None else data
        found.append((data, str(override)))
    return found


def _family_matches(family: str, target: str) -> bool:
    """`proxy:libfabric` applies to `proxy:libfabric/cxi`; an exact name to itself."""
    return family == target or family.startswith(target + "/") or family.startswith(target + ":")


def load_policy(family: str, override: str | Path | None = None) -> Policy:
    """The validated policy of `family`, with a user override merged on top.

    `override`: a policy file (its `[policy] family` says which family it refines; without one it
    applies to every family) or a directory of files named like the packaged ones. When None,
    `$MOETUNE_POLICY` is used if set.
    """
    if override is None and os.environ.get(ENV_POLICY):
        override = os.environ[ENV_POLICY]
    data: dict[str, Any] | None = None
    sources: list[str] = []
    for stem in policy_file_candidates(family):
        got = _packaged(stem)
        if got is not None:
            data, src = got
            sources.append(src)
            break
    if override is not None:
        for over, src in _override_for(family, Path(override)):
            data = _merge(data or {}, over)
            sources.append(src)
    if data is None:
        raise PolicyError(
            f"moetune.policies/{policy_file_candidates(family)[0] if policy_file_candidates(family) else family}.toml",
            "", f"no policy for transport family {family!r}")
    pol = validate_policy(data, source=" + ".join(sources), family=family, sources=tuple(sources))
    # The policy applies to the family asked for (`proxy:libfabric/cxi` from proxy_libfabric.toml).
    return replace(pol, family=family)


def _check_mk_stage_caps(specs: Mapping[str, Any], defaults: Knobs, source: str) -> None:
    """PolicyError where the listed mk_bm, mk_stages, mk_core and mk_overlap values combine into a pipeline deeper than
    the m-tile's shared memory holds (`mk_stage_cap`): the knob check refuses such a set, so a study that sampled it
    would stop with that error instead of trying the next trial."""
    def values(name: str) -> tuple[Any, ...]:
        return specs[name].values() if name in specs else (getattr(defaults, name),)

    for bm in values("mk_bm"):
        for core in values("mk_core"):
            for overlap in values("mk_overlap"):
                cap = mk_stage_cap(bm, core, overlap)
                deep = [v for v in values("mk_stages") if v > cap]
                if deep:
                    raise PolicyError(source, "knobs.mk_stages",
                                      f"{deep} with mk_bm {bm}, mk_core {core}, mk_overlap {overlap}: that tile holds "
                                      f"at most {cap} stages in shared memory")


def load_policy_file(path: str | Path) -> Policy:
    """Validate a single, complete policy file (what `moetune tune --policy` checks first)."""
    p = Path(path)
    data = _read_policy_file(p)
    fam = data.get("policy", {}).get("family") if isinstance(data.get("policy"), dict) else None
    return validate_policy(data, source=str(p), family=fam or p.stem, sources=(str(p),))


# ---------------------------------------------------------------------------------------------------
# validation


def _table(data: dict[str, Any], name: str, source: str, required: bool = True) -> dict[str, Any]:
    t = data.get(name)
    if t is None:
        if required:
            raise PolicyError(source, f"[{name}]", "missing table")
        return {}
    if not isinstance(t, dict):
        raise PolicyError(source, f"[{name}]", f"must be a table, got {type(t).__name__}")
    return t


def _knob_spec(name: str, raw: Any, source: str) -> KnobSpec:
    key = f"knobs.{name}"
    if isinstance(raw, dict):
        if name not in INTEGER:
            raise PolicyError(source, key, "a {min, max, step} range only applies to integer knobs")
        unknown = set(raw) - {"min", "max", "step"}
        if unknown:
            raise PolicyError(source, key, f"unknown range field(s) {sorted(unknown)}; expected min, max, step")
        try:
            low, high, step = raw["min"], raw["max"], raw.get("step", 1)
        except KeyError as e:
            raise PolicyError(source, key, f"range needs {e.args[0]!r}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, step)):
            raise PolicyError(source, key, "min, max and step must be integers")
        lo, hi = INTEGER[name]
        if step < 1 or low > high or low < lo or high > hi:
            raise PolicyError(source, key, f"need {lo} <= min <= max <= {hi} and step >= 1, got {raw}")
        refused = KNOB_VALUES[name].refused_in(low, high, step)  # inside the limits, a gap (mk_stages 1)
        if refused:
            raise PolicyError(source, key, f"the range takes {refused[0]}, which the knob refuses: it must be "
                                           f"{KNOB_VALUES[name].requirement()}")
        return KnobSpec(name, low=low, high=high, step=step)
    if not isinstance(raw, list) or not raw:
        raise PolicyError(source, key, f"must be a non-empty list of values or a {{min, max, step}} range, got {raw!r}")
    if len(set(raw)) != len(raw):
        raise PolicyError(source, key, f"duplicate values in {raw}")
    if name in CATEGORICAL:
        bad = [v for v in raw if v not in CATEGORICAL[name]]
        if bad:
            raise PolicyError(source, key, f"unknown value(s) {bad}; allowed: {', '.join(CATEGORICAL[name])}")
    else:
        bad = [v for v in raw if not isinstance(v, int) or isinstance(v, bool) or not KNOB_VALUES[name].allows(v)]
        if bad:
            raise PolicyError(source, key, f"value(s) {bad} are not integers the knob takes: it must be "
                                           f"{KNOB_VALUES[name].requirement()}")
    return KnobSpec(name, choices=tuple(raw))


def validate_policy(data: dict[str, Any], *, source: str, family: str, sources: tuple[str, ...] = ()) -> Policy:
    unknown = set(data) - set(KNOWN_TABLES)
    if unknown:
        raise PolicyError(source, f"[{sorted(unknown)[0]}]", f"unknown table; known: {', '.join(KNOWN_TABLES)}")
    pol = _table(data, "policy", source)
    fam = pol.get("family", family)
    if not isinstance(fam, str) or not fam:
        raise PolicyError(source, "policy.family", f"must be a non-empty string, got {fam!r}")
    transport = pol.get("transport")
    if transport not in TRANSPORTS:
        raise PolicyError(source, "policy.transport", f"must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    description = pol.get("description", "")
    if not isinstance(description, str):
        raise PolicyError(source, "policy.description", "must be a string")

    raw_defaults = _table(data, "defaults", source)
    try:
        defaults = Knobs.from_dict(dict(raw_defaults))
    except KnobError as e:
        raise PolicyError(source, "defaults", str(e)) from None
    if defaults.transport != transport:
        raise PolicyError(source, "defaults.transport",
                          f"{defaults.transport!r} differs from policy.transport {transport!r}")

    raw_knobs = _table(data, "knobs", source, required=False)
    specs: dict[str, KnobSpec] = {}
    group: str | tuple[int, ...] | None = None
    for name, raw in raw_knobs.items():
        if name == "transport":
            raise PolicyError(source, "knobs.transport", "the transport is fixed by the family (policy.transport)")
        if name not in KNOB_NAMES:
            raise PolicyError(source, f"knobs.{name}", f"unknown knob; known: {', '.join(KNOB_NAMES)}")
        if name == "group_size":
            if raw in ("divisors", "put_groups"):
                # proxy/ibgda group PUTs, whose count per peer has no divisibility rule (a last partial group
                # is sent as is, csrc/proxy_xchg.h): "divisors" there is the older spelling of "put_groups"
                group = "put_groups" if transport in QUEUED else raw
                if group == "put_groups" and transport not in QUEUED:
                    raise PolicyError(source, "knobs.group_size", f"'put_groups' applies to proxy/ibgda (PUT groups), "
                                      f"not {transport!r}; use 'divisors' or a list")
                continue
            spec = _knob_spec(name, raw, source)
            group = tuple(spec.values())
            continue
        specs[name] = _knob_spec(name, raw, source)

    # Knob-level consistency with the transport.
    if "fence_mode" in specs:
        bad = [v for v in specs["fence_mode"].values() if v not in ALLOWED_FENCE_MODES[transport]]
        if bad:
            raise PolicyError(source, "knobs.fence_mode", f"{bad} not possible on transport {transport!r} "
                              f"(allowed: {', '.join(ALLOWED_FENCE_MODES[transport])})")
    if transport not in QUEUED:
        for name in ("qps_per_pe", "qp_mapping"):
            if name in specs and specs[name].values() != (getattr(defaults, name),):
                raise PolicyError(source, f"knobs.{name}", f"queue pairs only exist on proxy/ibgda, not {transport!r}")
    for name, spec in specs.items():
        if name in MK_KNOBS:  # values the knob check refuses (mk_bm=32, mk_stages=1) or without engine=megakernel
            for v in spec.values():
                try:
                    defaults.replace(**{name: v})
                except KnobError as e:
                    raise PolicyError(source, f"knobs.{name}", f"value {v!r}: {e}") from None
        dv = getattr(defaults, name)
        if not spec.contains(dv):
            raise PolicyError(source, f"defaults.{name}", f"default {dv!r} is not among the allowed values {list(spec.values())}")
    _check_mk_stage_caps(specs, defaults, source)
    if isinstance(group, tuple) and defaults.group_size not in group and defaults.signalling == "decoupled":
        raise PolicyError(source, "defaults.group_size", f"default {defaults.group_size} not among {list(group)}")

    raw_priors = _table(data, "priors", source, required=False)
    priors: dict[str, float] = {}
    for k, v in raw_priors.items():
        if k not in KNOWN_PRIORS:
            raise PolicyError(source, f"priors.{k}", f"unknown prior; known: {', '.join(KNOWN_PRIORS)}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise PolicyError(source, f"priors.{k}", f"must be a positive number, got {v!r}")
        priors[k] = float(v)
    if "link_efficiency" in priors and priors["link_efficiency"] > 1:
        raise PolicyError(source, "priors.link_efficiency", f"must be in (0, 1], got {priors['link_efficiency']}")

    comp = _table(data, "compression", source, required=False)
    unknown_c = set(comp) - {"error_budget", "expected_error"}
    if unknown_c:
        raise PolicyError(source, f"compression.{sorted(unknown_c)[0]}", "unknown key; known: error_budget, expected_error")
    budget = comp.get("error_budget", 0.0)
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 <= budget < 1:
        raise PolicyError(source, "compression.error_budget", f"must be a number in [0, 1), got {budget!r}")
    expected_raw = comp.get("expected_error", {})
    if not isinstance(expected_raw, dict):
        raise PolicyError(source, "compression.expected_error", "must be a table of \"compression/granularity\" = bound")
    expected: dict[str, float] = {}
    for k, v in expected_raw.items():
        parts = k.split("/")
        if len(parts) != 2 or parts[0] not in COMPRESSIONS or parts[0] == "none" or parts[1] not in SCALE_GRANULARITIES:
            raise PolicyError(source, f"compression.expected_error.{k}",
                              "keys are \"<compression>/<granularity>\", e.g. \"fp8_e4m3/per_token\"")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise PolicyError(source, f"compression.expected_error.{k}", f"must be a number >= 0, got {v!r}")
        expected[k] = float(v)
    if "compression" in specs:
        for c in specs["compression"].values():
            if c == "none":
                continue
            grans = specs["scale_granularity"].values() if "scale_granularity" in specs else (defaults.scale_granularity,)
            missing = [g for g in grans if f"{c}/{g}" not in expected]
            if missing:
                raise PolicyError(source, f"compression.expected_error.\"{c}/{missing[0]}\"",
                                  f"knobs.compression allows {c!r} but no error bound is given for it")
    if defaults.compression != "none" and expected.get(f"{defaults.compression}/{defaults.scale_granularity}", math.inf) > budget:
        raise PolicyError(source, "defaults.compression", "the default compression exceeds the error budget")
    return Policy(family=fam, transport=transport, description=description, defaults=defaults, knobs=specs,
                  group_size=group, priors=priors, error_budget=float(budget), expected_error=expected,
                  sources=sources or (source,))


def transport_of_family(family: str) -> str:
    """Knobs.transport for a discovery family name (`proxy:libfabric/cxi` → `proxy`)."""
    head = family.split(":", 1)[0].split("/", 1)[0]
    if head in FAMILY_TRANSPORT:
        return FAMILY_TRANSPORT[head]
    if head not in TRANSPORTS:
        raise KnobError(f"unknown transport family {family!r}", ("transport",))
    return head


def load_policies(families: Iterable[str], override: str | Path | None = None) -> dict[str, Policy]:
    return {f: load_policy(f, override) for f in families}
