"""The runtime options a tuned profile was measured under, against a job's.

A profile's numbers hold for its knobs, its performance environment (perf_env.py) AND the runtime options that change
the data path (`runtime/options.py` DATA_PATH_OPTIONS: hs_native, symm, fused_pack, proxy_host_wait, ...; set through
MOETUNE_* variables, the config's `[runtime]` table or `EPBuffer(options=...)`). A measured profile records them
(`ProfileRecord.runtime_options`, a readable copy, and its digest in the store); the runtime compares them with the
job's here, on the options that act on the profile's family (`options.DATA_PATH_FAMILIES`: symm never on a collective
profile, hs_native only on host_staged's), as it compares the performance environment: a profile measured under other options is not applied as
tuned (its numbers are another data path's), one that recorded none (an older moetune measured it) is "unknown",
never taken to match (served, or passed over with `client.env_mismatch = "refuse"`, as an unrecorded environment is).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from moetune.runtime.options import data_path_digest, data_path_problem, options_acting_on
from moetune.runtime.profile_record import ENGINE_FAMILIES

OptionsStatus = Literal["same", "differs", "unknown"]


def relevant_options(values: Mapping[str, Any], family: str | None) -> dict[str, Any]:
    """The data-path options of `values` that act on `family` (`options.DATA_PATH_FAMILIES`; None: all of them). The
    engine families (the megakernel: one GPU's kernel, no EP transport) read none of them: only its own timeout,
    which is no data-path option."""
    if family in ENGINE_FAMILIES:
        return {}
    acting = options_acting_on(family)
    return {k: v for k, v in values.items() if k in acting}


def parse_recorded_options(text: str | bytes | None, digest: str | None = None) -> dict[str, Any] | None:
    """A stored `runtime_options` column (JSON text) read back: None where not recorded (SQL NULL or JSON null);
    ValueError where it is not a record this moetune writes (`data_path_problem`), or where the row's `digest` column
    (given, not NULL) is not the digest of that copy."""
    if text is None:
        return None
    values, why, own = _checked(text if isinstance(text, str) else bytes(text).decode("utf-8", "replace"))
    if why is not None:
        raise ValueError(f"runtime_options: {why}")
    if values is None:
        return None
    if digest is not None and digest != own:
        raise ValueError(f"runtime_options: digest {str(digest)[:32]!r} is not the digest of the recorded options")
    return json.loads(values)  # a fresh copy for each caller


@functools.lru_cache(maxsize=256)
def _checked(text: str) -> tuple[str | None, str | None, str | None]:
    """(the values as JSON text, None where recorded as null; why they are not a record; their digest) of a stored
    column: the rows of one database mostly hold a few distinct records, and the check builds a RuntimeOptions."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e})", None
    if values is None:
        return None, None, None
    why = data_path_problem(values)
    if why is not None:
        return None, why, None
    return json.dumps(values), None, data_path_digest(values)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 64 else text[:61] + "..."


@dataclass(frozen=True)
class OptionsComparison:
    """A profile's recorded runtime options against the job's.

    `status`: "same"; "differs" (`differences` names each option: "fused_pack: tuned with true, job has false");
    "unknown" (the profile recorded none, or not every option that acts here: `differences` names what is missing;
    or the job's own options could not be read), never taken for "same"."""

    status: OptionsStatus
    differences: tuple[str, ...] = ()
    why_unknown: str = ""

    def summary(self) -> str:
        if self.status == "same":
            return "the same runtime options as this job"
        if self.status == "unknown":
            return f"its runtime options are unknown ({self.why_unknown})"
        return "tuned under other runtime options: " + "; ".join(self.differences)


def compare_options(recorded: Mapping[str, Any] | None, job: Mapping[str, Any] | None,
                    family: str | None = None) -> OptionsComparison:
    """Compare a profile's recorded data-path options (None: not recorded) with the job's (`RuntimeOptions.data_path()`;
    None: they could not be read), on the options that act on `family` (`relevant_options`): where none acts (the
    megakernel), there is nothing to doubt, recorded or not."""
    if family in ENGINE_FAMILIES:
        return OptionsComparison("same")
    if recorded is None:
        return OptionsComparison("unknown", why_unknown="not recorded: an older moetune measured it")
    if job is None:
        return OptionsComparison("unknown", why_unknown="this job's runtime options could not be read")
    recorded, job = relevant_options(recorded, family), relevant_options(job, family)
    diffs = [f"{name}: tuned with {_shown(recorded[name])}, job has {_shown(job[name])}"
             for name in sorted(set(recorded) & set(job)) if recorded[name] != job[name]]
    if diffs:
        return OptionsComparison("differs", tuple(diffs))
    missing = sorted(set(job) - set(recorded))
    if missing:  # recorded by a moetune that did not know these options yet
        return OptionsComparison("unknown", why_unknown=f"{', '.join(missing)} not recorded")
    return OptionsComparison("same")
