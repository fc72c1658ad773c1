"""Policy defaults on the runtime side: the `[defaults]` knob set of a transport family's policy file.

This is the last fallback of the runtime (no daemon, no database): the untuned setting shipped in
`moetune.policies/<family>.toml`. Only `tomllib` and `importlib.resources`; the full policy (allowed
values, priors, error budget) is read and validated by `moetune.tuner.search.policy`.
"""

from __future__ import annotations

import tomllib
from importlib import resources

from moetune.runtime.knobs import KnobError, Knobs


def policy_file_candidates(family: str) -> list[str]:
    """File stems to try for a family, most specific first.

    `proxy:libfabric/cxi` → `proxy_libfabric_cxi`, `proxy_libfabric`, `proxy`; `nvlink` → `nvlink`.
    """
    fam = family.strip()
    out: list[str] = []
    for cut in (len(fam), fam.rfind("/"), fam.rfind(":")):
        if cut <= 0:
            continue
        stem = fam[:cut].replace(":", "_").replace("/", "_")
        if stem and stem not in out:
            out.append(stem)
    return out


def policy_default_knobs(family: str) -> Knobs:
    """The `[defaults]` knob set of the packaged policy for `family` (KnobError when there is none)."""
    root = resources.files("moetune.policies")
    for stem in policy_file_candidates(family):
        res = root / f"{stem}.toml"
        if not res.is_file():
            continue
        try:
            data = tomllib.loads(res.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise KnobError(f"policy file {stem}.toml is not valid TOML: {e}") from None
        defaults = data.get("defaults")
        if not isinstance(defaults, dict):
            raise KnobError(f"policy file {stem}.toml has no [defaults] table")
        try:
            return Knobs.from_dict(dict(defaults))
        except KnobError as e:
            raise KnobError(f"policy file {stem}.toml [defaults]: {e}") from None
    raise KnobError(f"no policy file for transport family {family!r} (tried {', '.join(policy_file_candidates(family))})")
