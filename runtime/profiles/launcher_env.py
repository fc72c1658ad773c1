"""The environment a knob set needs before any communicator exists (read by NVSHMEM/NCCL at init).

`launcher_env` is the ONE function that turns knobs into variables; the daemon calls it to fill a reply's
`env`, the runtime calls it for database and default profiles, and the tuner calls it for the environment
its measurements run in (tuner/search/local_backend.py `knob_environment`), so a knob set is served in the
environment it was measured in.

It sets only variables that the EP transport alone reads (NVSHMEM_*). It sets no NCCL_* variable: a
launcher exports these for the whole job, so they would also reach every other communicator (the
data-parallel all-reduce, ...). The `channels` knob is implemented by the runtime itself (extra
communicators over the EP group, runtime/transports/collective.py; lanes in host_staged), not by NCCL's
channel count, and `host_staged` needs no NCCL_P2P_DISABLE (its bytes travel by the copy engines; on a node
without peer-to-peer NCCL stages through the host by itself). `ENV_RULES` lists every variable it can
produce with the values it can produce, and `apply_env` exports nothing else: a reply asking for
`NCCL_NET_PLUGIN` (a library NCCL loads) or `NVSHMEM_REMOTE_TRANSPORT=../evil` is refused, whoever sent it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Hashable

from moetune.runtime import _once
from moetune.runtime.knobs import KNOB_VALUES, Knobs
from moetune.runtime.profile_record import LIBFABRIC_PROVIDER

log = logging.getLogger("moetune.autoload")


def _int_in(lo: int, hi: int) -> re.Pattern[str]:
    """Exactly the decimal integers lo..hi (no sign, no leading zero)."""
    return re.compile("|".join(str(i) for i in range(hi, lo - 1, -1)))


# The knob's range (KNOB_VALUES): a value outside it is not one a valid knob set could have produced, so it is
# refused even though it would parse.
_QPS_PER_PE = _int_in(KNOB_VALUES["qps_per_pe"].low, KNOB_VALUES["qps_per_pe"].high)

# Every variable launcher_env can set, with the values it can set (a test enumerates launcher_env's
# outputs over every transport and family and checks both directions).
ENV_RULES: dict[str, re.Pattern[str]] = {
    "NVSHMEM_IB_ENABLE_IBGDA": re.compile(r"[01]"),
    "NVSHMEM_REMOTE_TRANSPORT": re.compile(r"ibrc|ucx|libfabric|none"),
    "NVSHMEM_LIBFABRIC_PROVIDER": re.compile(LIBFABRIC_PROVIDER),  # cxi, efa, verbs, ...
    "NVSHMEM_IBGDA_NUM_RC_PER_PE": _QPS_PER_PE,
}


def launcher_env(knobs: Knobs, transport_family: str | None, nodes: int = 1) -> dict[str, str]:
    """The environment a knob set needs: what a launcher must export, and what the tuner measured it in.

    - proxy:<provider>: NVSHMEM_IB_ENABLE_IBGDA=0 and NVSHMEM_REMOTE_TRANSPORT=<ibrc|ucx|libfabric>
      (+ NVSHMEM_LIBFABRIC_PROVIDER for libfabric/<provider>);
    - ibgda: NVSHMEM_IB_ENABLE_IBGDA=1, NVSHMEM_IBGDA_NUM_RC_PER_PE=<qps_per_pe>;
    - nvlink on one node: NVSHMEM_REMOTE_TRANSPORT=none (no network transport needed);
    - collective/host_staged: nothing (no job-wide NCCL variable; `channels` is the runtime's own).
    """
    env: dict[str, str] = {}
    fam = transport_family or knobs.transport
    if knobs.transport == "proxy":
        env["NVSHMEM_IB_ENABLE_IBGDA"] = "0"
        provider = fam.split(":", 1)[1] if ":" in fam else ""
        if provider.startswith("libfabric"):
            env["NVSHMEM_REMOTE_TRANSPORT"] = "libfabric"
            if "/" in provider:
                env["NVSHMEM_LIBFABRIC_PROVIDER"] = provider.split("/", 1)[1]
        elif provider in ("ibrc", "ucx"):
            env["NVSHMEM_REMOTE_TRANSPORT"] = provider
    elif knobs.transport == "ibgda":
        env["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
        env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] = str(knobs.qps_per_pe)
    elif knobs.transport == "nvlink" and nodes == 1:
        env["NVSHMEM_REMOTE_TRANSPORT"] = "none"
    return env


def env_refusal(name: object, value: object) -> str | None:
    """Why `name=value` may not be exported (None when launcher_env could have produced it)."""
    if not isinstance(name, str) or not isinstance(value, str):
        return "not a string"
    rule = ENV_RULES.get(name)
    if rule is None:
        return f"{name[:64]} is not a variable moetune sets"
    if not rule.fullmatch(value):
        return f"{name}={value[:64]!r} is not a value moetune sets"
    return None


def allowed_env(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Split `env` into the variables launcher_env can produce and the reasons the others were refused."""
    kept: dict[str, str] = {}
    refused: list[str] = []
    for k, v in env.items():
        why = env_refusal(k, v)
        if why is None:
            kept[k] = v
        else:
            refused.append(why)
    return kept, refused


KEPT_SCOPE = "launcher_env.kept"  # the _once scope of the warnings about a profile's variable the user set otherwise


# What autoload itself exported, so that a later lookup replaces it instead of deferring to it as if the user had set
# it (a fallback is cached for client.fallback_retry_s only; its retry may find a tuned profile with other values).
# _wanted: each lookup (`owner`) -> the allowed env it wants now, in the order they first applied (the first wins a
# conflict, as "already set" did). _exported: variable -> (its value before autoload set it, the value autoload set).
_wanted: dict[Hashable, dict[str, str]] = {}
_exported: dict[str, tuple[str | None, str]] = {}
_env_lock = threading.Lock()


def apply_env(env: dict[str, str], *, override: bool = False, owner: Hashable | None = None) -> dict[str, str]:
    """Export the allowed variables of `env`; variables already set win unless `override`. Returns what was set.

    `owner` (autoload's lookup key) makes autoload's exports its own: a variable it exported that still holds that
    value is set to what the lookups want now (`owner`'s new `env` replaces its previous one; the first lookup wins a
    conflict) and, where none wants it any more, put back as it was before (unset if it was unset). A variable set
    outside autoload, before or since (a user who set it to autoload's very value is taken as autoload's), still
    wins. Without `owner` nothing is recorded: what it sets is as the user's to later calls. `override` sets every
    variable of `env`, autoload's own exports included."""
    kept, refused = allowed_env(env)
    for why in refused:
        log.warning("moetune: not exporting a variable from a profile: %s", why)
    applied: dict[str, str] = {}
    with _env_lock:
        if owner is not None:
            _wanted[owner] = kept
        for k, (before, mine) in list(_exported.items()):
            if os.environ.get(k) != mine:  # changed outside autoload since: the user's now
                del _exported[k]
                continue
            want = next((w[k] for w in _wanted.values() if k in w), None)
            if want is None:  # no lookup wants it any more (a fallback's, its retry found a profile without it)
                del _exported[k]
                if before is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = before
            elif want != mine:
                os.environ[k] = want
                _exported[k] = (before, want)
                if kept.get(k) == want:
                    applied[k] = want
        for k, v in kept.items():
            if not override and (k in _exported or k in os.environ):
                continue  # autoload's (settled above), or set outside it: it wins
            # `override` sets it even over autoload's own export (it skipped those, and said nothing)
            before = _exported[k][0] if k in _exported else os.environ.get(k)
            os.environ[k] = v
            applied[k] = v
            if owner is not None:
                _exported[k] = (before, v)
            else:  # set by a caller outside autoload: the user's from now on, never put back
                _exported.pop(k, None)
        for k, v in kept.items():
            have = os.environ.get(k)
            if have is not None and have != v:
                # a warning, once: these variables are left out of the performance environment compared with the
                # profile's (they follow from its knobs), so nothing else says the profile runs outside what it
                # was measured in
                _once.say_once(KEPT_SCOPE, (k, have, v),
                               f"moetune: keeping {k}={have} from the environment; the profile was measured "
                               f"with {k}={v}, so its numbers are not this run's", logger=log)
    return applied


def forget_exports() -> None:
    """Forget what autoload exported (autoload.clear_cache): the variables stay, as a new process inherits them."""
    with _env_lock:
        _wanted.clear()
        _exported.clear()
