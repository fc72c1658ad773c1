"""Auto-load the tuned knobs when an EP buffer or MoE layer is made without explicit knobs.

`autoload_knobs(model=..., ep_size=..., group=..., max_tokens=..., device=..., options=...)`:
1. asks the daemon (`get_profile`, one round trip) for the current profile of this node's fabric, the
   model shape, the EP size and node count, at the token bucket nearest `max_tokens`; the daemon
   fills in the fingerprint of the fabric it discovered;
2. when the daemon is down, silent or its reply does not validate, reads the daemon's database
   read-only, trusting only profiles measured on this node (identity: `node_identity`);
3. else the policy default of the transport family (`policy_default_knobs`), else `default_knobs`.
Every fallback warns once, naming the sources and why. The whole chain is bounded
(`MOETUNE_CLIENT_TIMEOUT_MS`, 200 ms default) and never raises: whatever goes wrong ends in step 3.

`nodes` is the number of hosts the process group spans: the ranks all-gather a hash of their host name
(construction is collective already). Counting hosts is exact for any group, where LOCAL_WORLD_SIZE
describes only the launcher's whole world. A profile whose transport this runtime's registry does not
have (a served `ibgda` profile) is passed over, and so is one whose transport cannot serve the EP group's
size or its hosts (nvlink or proxy beyond MAX_WORLD ranks or across nodes, host_staged across nodes:
`transport_world_problem`).

The profile's environment-level settings (NVSHMEM_*, NCCL_*; only those `launcher_env` produces) are
exported to `os.environ` right away, before any communicator exists. The performance environment a tuned profile
was measured in (NCCL_ALGO, NCCL_P2P_DISABLE, FI_*, ...: runtime/profiles/perf_env.py) is compared with this
process's and never exported: where they differ the resolution says so (`env_status`, `env_diff`) and one warning
names the variables, or with `client.env_mismatch = "refuse"` the profile is passed over (client.py). Variables already set in the
environment are left alone (what the user set explicitly wins, as explicit knobs do: with explicit knobs
this module is not called at all); one autoload exported itself, still at that value, is its own: a later lookup of
the same key (a fallback retried) replaces it, or puts it back as it was when that lookup no longer sets it
(`apply_env`'s `owner`). Results are cached per process, key and device (what can run depends on
the device) and the settings and performance environment they were judged under (`_JUDGED_UNDER`: allow_modelled
unset since must not leave a modelled profile served), so the many layers of one model cost one lookup. A FALLBACK
(the policy or built-in default: the daemon did not answer, a hardware check failed) is cached only for
`client.fallback_retry_s` (30 s): a layer built later looks up again, so a job whose daemon or NIC port was briefly
down at its start does not run on defaults for its life. An EP group over several hosts retries on rank 0's clock:
rank 0 decides once for the group and every host's first rank follows (its own cached fallback served past its
expiry, or looked up before it), since hosts retrying apart resolve different profiles.

`transport_family="megakernel"` looks up the MoE megakernel's profile instead (a world-1 `MoELayer` does: ep_size
1, nodes 1); "can this runtime run it" is then the megakernel's own check (runtime/megakernel/engine.py).

`options` (every entry point here takes it: the caller's RuntimeOptions, an EP buffer's or MoE layer's; None: what
the config's `[runtime]` table and the MOETUNE_* variables resolve) are the runtime options the job runs: a tuned
profile measured under other data-path options is not applied as tuned (client.py), whether a profile's transport
can run here is asked under them (host_staged's answer depends on hs_native), and results are cached per options.

`dtype` is the activation dtype the caller runs at (a `ModelShape.dtype` name or a torch dtype); the lookup key
carries it instead of `model.dtype` (an fp32 buffer of a bf16 model is not served the bf16 profile). `max_tokens`
is the token count the profile is picked for (its nearest stored bucket): EPBuffer passes its `expected_tokens`.

`[client] autoload = false` (or `MOETUNE_AUTOLOAD=0`; config.client_autoload) skips the daemon and the database
(policy defaults, no warning); a value that is no bool is a ConfigError naming it.

`autoload_group_profile(group=..., ...)` is what an EP group uses (collective): rank 0 resolves and broadcasts the
resolution (knobs, profile hash, source, provenance, env) as JSON in a tensor over the group (no pickle); the
other ranks of rank 0's host do not look up at all, so one slow rank (cold daemon, CURVE handshake) cannot make
the ranks disagree. A profile belongs to one node's fingerprint: with ranks on several hosts, the first rank of
every other host resolves too (its own node's daemon / database), and rank 0's profile is used only when every
host resolved the same profile hash; otherwise the whole group runs rank 0's policy default for the transport
family (the built-in collective default where that cannot serve the group: `transport_world_problem`), with one
warning naming the hashes and the reason (never an error). Every rank exports the agreed env and logs it. A rank
whose part raises (a bad `[client] autoload` on one host only, a bad dtype, a bug in rank 0's group default) tells
the others at the next collective they all enter (msgspec JSON), and every rank raises that error with the same words
(`GroupLookupError`; a ConfigError or ValueError as such) instead of waiting out the process group's timeout.

`check_same_profile(group, profile_hash)` all-gathers the hash across ranks and raises when they differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from moetune.runtime.config import (
    ClientConfig,
    ConfigError,
    client_autoload,
    config_files,
    load_client_config,
)
from moetune.runtime.hosts import group_host_hashes, host_hash, host_identity
from moetune.runtime.knobs import KnobError, Knobs, default_knobs, group_world_problem
from moetune.runtime.options import OPTION_DOCS, RuntimeOptions
from moetune.runtime.profile_record import ENGINE_FAMILIES, MEGAKERNEL_FAMILY
from moetune.runtime.profiles.client import (
    ProfileClient,
    Resolution,
    forget_env_warnings,
    forget_reported_identities,
    one_host_family,
    policy_or_default,
    warn_fallback,
)
from moetune.runtime.profiles.launcher_env import allowed_env, apply_env, forget_exports, launcher_env
from moetune.runtime.profiles.perf_env import performance_environment
from moetune.runtime.shapes import DTYPES, ModelShape

__all__ = ["GroupLookupError", "ProfileMismatch", "apply_env", "autoload_group_profile", "autoload_knobs", "autoload_profile",
           "check_same_profile", "clear_cache", "dtype_name", "group_nodes", "last_resolution", "launcher_env"]

log = logging.getLogger("moetune.autoload")

# key -> (resolution, when it expires: None for the process's life; a monotonic time for a fallback, which a later
# construction looks up again after client.fallback_retry_s: a daemon or NIC port briefly down at job start)
_cache: dict[tuple[Any, ...], tuple[Resolution, float | None]] = {}
# rank 0's: an EP group lookup over several hosts (autoload_profile's key) -> when the group's agreed fallback is
# looked up again (None: a profile every host resolved, kept). One clock for the group: each host's own expiry falls
# at another time, and a host that retried alone resolved another profile than one still serving its fallback
_group_until: dict[tuple[Any, ...], float | None] = {}
FALLBACK_SOURCES = frozenset({"policy", "default"})  # a Resolution.source that is no looked-up profile
_lock = threading.Lock()
_last: Resolution | None = None


class ProfileMismatch(RuntimeError):
    """Ranks of one group loaded different profiles."""


def _group_device(group: Any) -> Any:
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dist_on(group: Any = None) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def group_hosts(group: Any = None) -> list[int]:
    """A hash of the node (`host_identity`) of every rank of `group`, in group rank order ([one] without
    torch.distributed). Collective."""
    if not _dist_on(group):
        return [host_hash(host_identity())]
    return group_host_hashes(group, _group_device(group), host_identity())


def group_nodes(group: Any = None) -> int:
    """How many hosts the ranks of `group` run on (1 without torch.distributed). Collective."""
    return len(set(group_hosts(group)))


# The variables that change how a lookup judges a profile (not where it looks: a resolution judged for this node
# stays valid when the daemon becomes unreachable): the client's allow_modelled and env_mismatch, autoload, the config
# file that may set them, and the runtime options' own variables (what `options=None` resolves). The config files'
# contents join them in the digest (`_config_files_state`).
_JUDGED_UNDER = frozenset({"MOETUNE_CLIENT_ALLOW_MODELLED", "MOETUNE_CLIENT_ENV_MISMATCH", "MOETUNE_AUTOLOAD",
                           "MOETUNE_CONFIG", *(d.env for d in OPTION_DOCS)})


def _lookup_env_digest() -> str:
    """A digest of the environment a lookup is judged under: the `_JUDGED_UNDER` variables and the job's performance
    environment. In the cache key: a resolution made under other settings (allow_modelled since unset) must not be
    served again. launcher_env's variables, which a resolution exports, are in neither."""
    env = os.environ
    own = sorted((k, v) for k, v in env.items() if k in _JUDGED_UNDER)
    dump = json.dumps([own, performance_environment(env).variables, _config_files_state(env)], separators=(",", ":"))
    return hashlib.sha256(dump.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _config_files_state(env: Mapping[str, str]) -> list[Any]:
    """Each config file's path and (size, mtime, inode), None where absent: the files may set allow_modelled,
    env_mismatch or autoload, so an edit to one must not be answered by a resolution judged before it (a stat each,
    once per lookup)."""
    out: list[Any] = []
    for f in config_files(env=env):
        try:
            st = os.stat(f)
            out.append([str(f), st.st_size, st.st_mtime_ns, st.st_ino])
        except OSError:
            out.append([str(f), None])
    return out


def dtype_name(dtype: Any) -> str:
    """The `ModelShape.dtype` name ("bfloat16", "float16", "float32") of a torch dtype or such a name."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"activation dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


_availability: dict[tuple[str, str, str | None], str | None] = {}


def runtime_transport_problem(name: str, device: Any = None, options: RuntimeOptions | None = None) -> str | None:
    """Why this runtime cannot run transport `name` on `device` (None when it can): not in the transport
    registry (a served `ibgda`), its module missing, or (with a `device`; EPBuffer always gives one)
    unavailable there (nvlink on a CPU device) under `options` (the caller's RuntimeOptions, as EPBuffer checks its
    knobs' transport; None: the config's and variables'). Cached per process, device and options: availability may
    load the compiled library."""
    ck = (name, str(device), None if options is None else options.digest())
    if ck in _availability:
        return _availability[ck]
    if name == MEGAKERNEL_FAMILY:  # not a transport: the one-GPU MoE kernel (its device, arch and build checks)
        from moetune.runtime.megakernel.engine import megakernel_problem

        try:
            why_mk = megakernel_problem(device)
        except Exception as e:  # a probe that fails says it cannot be used here
            why_mk = f"availability check failed: {type(e).__name__}: {e}"
        _availability[ck] = why_mk
        return why_mk
    from moetune.runtime.transports.registry import get_transport

    why: str | None = None
    try:
        cls = get_transport(name)
        if device is not None:
            import torch

            avail = cls.availability(torch.device(device), options)
            why = None if avail.ok else avail.reason
    except (KeyError, ImportError, TypeError) as e:
        why = str(e).strip("'\"")
    except Exception as e:  # an availability probe that fails says the transport cannot be used here
        why = f"availability check failed: {type(e).__name__}: {e}"
    _availability[ck] = why
    return why


def transport_world_problem(name: str, world: int, nodes: int = 1) -> str | None:
    """Why transport `name` cannot serve an EP group of `world` ranks on `nodes` hosts (its `check_world`: nvlink and
    proxy take at most MAX_WORLD; those two and host_staged one node's ranks only, `group_world_problem`), None when
    it can or `name` is no transport of this runtime (runtime_transport_problem says that). A stored profile the
    runtime would refuse so (a model tune before 668bd35b stored nvlink at EP 16; a model tune of a 4-GPU proxy
    preset on 2 nodes, or of a host_staged model on 2 nodes) is passed over here, not handed to EPBuffer, whose
    loaded-knob check raised on it or whose symmetric or staging memory cannot reach another host."""
    if name == MEGAKERNEL_FAMILY:  # not a transport (world 1): no registry import (torch) to say so
        return None
    from moetune.runtime.transports.registry import get_transport

    try:
        cls = get_transport(name)
    except (KeyError, ImportError, TypeError):
        return None
    try:
        cls.check_world(world)
    except KnobError as e:
        return str(e)
    # check_world knows no node count: the same rule given the group's (no one-sided transport reaches another host,
    # nor host_staged, whose staging memory is one host's file)
    why = group_world_problem(cls.name, world, nodes=nodes)
    return None if why is None else str(KnobError(why, ("transport",)))


def autoload_profile(
    *,
    model: ModelShape,
    ep_size: int,
    nodes: int | None = None,
    max_tokens: int,
    device: Any = None,
    group: Any = None,
    client: ProfileClient | None = None,
    use_cache: bool = True,
    transport_family: str | None = None,
    dtype: Any = None,
    export_env: bool = True,
    options: RuntimeOptions | None = None,
    retry_fallback: bool | None = None,
) -> Resolution:
    """The full resolution (knobs, hash, source, env) for this process; env exported to os.environ (unless
    `export_env=False`: the group path exports the agreed env instead).

    `options`: the caller's RuntimeOptions (an EP buffer's; None: what the config and MOETUNE_* variables say); a
    tuned profile measured under other data-path options is not applied as tuned (client.py).

    `dtype`: the activation dtype the caller runs at (None: `model.dtype`); it replaces the model's in the key.
    `nodes` defaults to `group_nodes(group)`. `retry_fallback`: whether a cached fallback is looked up again (None:
    when its own client.fallback_retry_s has passed; the group path passes rank 0's decision). Never raises for
    what the daemon, the database or the policy files hold: the last resort is the built-in default, with a
    warning. Per process, not per group: an EP group uses `autoload_group_profile`.
    """
    global _last
    if nodes is None:
        nodes = group_nodes(group)
    model, lookup, key = _lookup_key(model=model, dtype=dtype, ep_size=ep_size, nodes=nodes, max_tokens=max_tokens,
                                     transport_family=transport_family, device=device, options=options)
    with _lock:
        hit = _cache.get(key) if use_cache and client is None else None
        if hit is not None and hit[1] is not None:  # a fallback: still served, or looked up again?
            fresh = time.monotonic() < hit[1] if retry_fallback is None else not retry_fallback
            if not fresh:
                hit = None
        if hit is not None:
            _last = hit[0]
            if export_env:
                apply_env(_last.env, owner=lookup)
            return _last
        on, where = client_autoload()  # a typo (MOETUNE_AUTOLOAD=of) is an error, not "on"
        until: float | None = None  # kept for the process: a looked-up profile, or autoload off (nothing to retry)
        if not on:
            knobs, source = policy_or_default(transport_family or "collective")
            res = Resolution(knobs=knobs, source=source, profile_hash=f"{source}:{knobs.digest()}",
                             status="default", family=transport_family, message=f"client.autoload is false ({where})")
        else:
            res = _resolve(model=model, ep_size=ep_size, nodes=nodes, max_tokens=max_tokens, device=device, client=client,
                           transport_family=transport_family, options=options)
            if res.source in FALLBACK_SOURCES:
                until = time.monotonic() + _fallback_retry_s()
        if export_env:
            apply_env(res.env, owner=lookup)
        log.info("moetune: knobs from %s (profile %s, %.1f ms%s)", res.source, res.profile_hash, res.elapsed_ms,
                 f", NCCL/NVSHMEM/FI environment {res.env_status}" if res.env_status else "")
        if client is None:
            _cache[key] = (res, until)
        _last = res
        return res


def _lookup_key(
    *, model: ModelShape, dtype: Any, ep_size: int, nodes: int, max_tokens: int, transport_family: str | None,
    device: Any, options: RuntimeOptions | None,
) -> tuple[ModelShape, tuple[Any, ...], tuple[Any, ...]]:
    """(the model at `dtype`, the lookup that owns what it exports, its cache key)."""
    if dtype is not None and dtype_name(dtype) != model.dtype:
        import msgspec

        model = msgspec.structs.replace(model, dtype=dtype_name(dtype))
    # The exact token count, not its rung: two counts of one rung may have different nearest stored buckets. The
    # device too: which transports can run (transport_ok) depends on it, so a CUDA device's nvlink profile must
    # not be handed to a layer on the CPU.
    lookup = (model, ep_size, nodes, max_tokens, transport_family, None if device is None else str(device),
              None if options is None else options.digest())  # other options may be served another profile
    # and other settings (allow_modelled, env_mismatch, autoload) judge otherwise; the env this lookup exported is
    # its own whatever they were (`owner`: a retry replaces what its fallback exported)
    return model, lookup, (*lookup, _lookup_env_digest())


def _fallback_retry_s() -> float:
    """client.fallback_retry_s (the config files, then its variable); its default where the config cannot be read
    (the profile client has warned about that already)."""
    try:
        cfg, _ = load_client_config()
    except (ConfigError, OSError):
        return ClientConfig.fallback_retry_s
    return cfg.client.fallback_retry_s


def _resolve(
    *, model: ModelShape, ep_size: int, nodes: int, max_tokens: int, device: Any, client: ProfileClient | None,
    transport_family: str | None = None, options: RuntimeOptions | None = None,
) -> Resolution:
    own = client is None
    try:
        c = client or ProfileClient()
        try:
            return c.resolve(model=model, ep_size=ep_size, tokens=max_tokens, nodes=nodes,
                             transport_family=transport_family,
                             transport_ok=lambda name: (runtime_transport_problem(name, device, options)
                                                        or transport_world_problem(name, ep_size, nodes)),
                             options=options)
        finally:
            if own:
                c.close()
    except Exception as e:  # a bug or an environment we did not foresee must not stop the model from loading
        # an engine family's lookup ends in its own policy default, as one that finds no profile does (the built-in
        # collective default names the unfused engine: a megakernel layer silently ran unfused); the engine checks
        # whether it runs. A transport lookup takes the one default every device runs.
        family = transport_family if transport_family in ENGINE_FAMILIES else "collective"
        knobs, source = policy_or_default(family) if family != "collective" else (default_knobs(family), "default")
        what = "policy" if source == "policy" else "built-in"
        msg = f"profile lookup failed ({type(e).__name__}: {e}); using the {what} default for {family}"
        warn_fallback(f"moetune: NO tuned profile ({msg})")
        return Resolution(knobs=knobs, source=source, profile_hash=f"{source}:{knobs.digest()}", status="default",
                          family=family, message=msg)


def autoload_knobs(
    *, model: ModelShape, ep_size: int, nodes: int | None = None, max_tokens: int, device: Any = None, group: Any = None,
    dtype: Any = None, options: RuntimeOptions | None = None,
) -> Knobs:
    """Knobs for an EP buffer / MoE layer made without explicit knobs (see the module docstring). With a
    process group of more than one rank this is `autoload_group_profile` (collective): every rank gets rank 0's.
    `options`: the caller's RuntimeOptions, as `autoload_profile` takes them (None: the config's and variables')."""
    if _dist_on(group) and nodes is None:
        return autoload_group_profile(model=model, ep_size=ep_size, max_tokens=max_tokens, device=device, group=group,
                                      dtype=dtype, options=options).knobs
    return autoload_profile(model=model, ep_size=ep_size, nodes=nodes, max_tokens=max_tokens, device=device,
                            group=group, dtype=dtype, options=options).knobs


# -- one resolution for a whole group ----------------------------------------------------------------------
def _broadcast_bytes(data: bytes, group: Any, device: Any) -> bytes:
    """Group rank 0's `data` on every rank (two tensor broadcasts: the length, then the bytes). Collective."""
    import torch
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0) if group is not None else 0
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=src, group=group)
    size = int(n.item())
    buf = (torch.tensor(list(data), dtype=torch.uint8, device=device) if dist.get_rank(group) == 0
           else torch.empty(size, dtype=torch.uint8, device=device))
    if size:
        dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().tolist())


def _broadcast_flag(flag: bool, group: Any, device: Any) -> bool:
    """Group rank 0's `flag` on every rank (one tensor broadcast). Collective."""
    import torch
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0) if group is not None else 0
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.broadcast(t, src=src, group=group)
    return bool(t.item())


def _all_gather_text(text: str, group: Any, device: Any) -> list[str]:
    """Every rank's `text` (UTF-8, padded to the longest), in group rank order. Collective."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    raw = text.encode()
    n = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    ns = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(ns, n, group=group)
    width = max(1, max(int(x.item()) for x in ns))
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    if raw:
        mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    bufs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    return [bytes(b.cpu().tolist()[: int(k.item())]).decode(errors="replace") for b, k in zip(bufs, ns, strict=True)]


def _group_default(res: Resolution, nodes: int, device: Any, why: str,
                   options: RuntimeOptions | None = None, *, ep_size: int) -> Resolution:
    """The policy default of `res`'s family (else the built-in collective default), as rank 0 can run it under
    `options` (the group's RuntimeOptions) for an EP group of `ep_size` ranks on `nodes` hosts."""
    family = res.family or "collective"
    # nvlink, proxy, host_staged: one host's ranks only (collective's policy default instead, the rule's words said)
    one_host = transport_world_problem(family.split(":", 1)[0], ep_size, nodes) if one_host_family(family) and \
        nodes > 1 else None
    if one_host:
        family = "collective"
    knobs, source = policy_or_default(family)
    # the world check too, as client.resolve's transport_ok asks it: a family keyed proxy:* (a collective profile on
    # an InfiniBand node) has a proxy policy default, which serves one node's ranks only
    unworldly = transport_world_problem(knobs.transport, ep_size, nodes)
    lacking = runtime_transport_problem(knobs.transport, device, options)  # ibgda: no runtime transport
    if lacking is not None or unworldly is not None:
        family, (knobs, source) = "collective", (default_knobs("collective"), "default")
    # as every other path (client.resolve): only what launcher_env may produce. The family is rank 0's resolution's,
    # which came from a daemon reply or a database row: its provider string is not checked by anything before this
    env, refused = allowed_env(launcher_env(knobs, family, nodes))
    # the warning says why rank 0's family's default was not taken, whichever rule refused it
    message = "; ".join([why, *(f"the policy default of {res.family}: {x}" for x in (one_host, lacking, unworldly) if x),
                         *(f"transport family {family}: not exporting {x}" for x in refused[:8])])
    return Resolution(knobs=knobs, source=source, profile_hash=f"{source}:{knobs.digest()}", status="default",
                      env=env, family=family, message=message)


class GroupLookupError(RuntimeError):
    """A rank of an EP group failed its part of the group's profile lookup; every rank of the group raises it, with
    the same words (a ConfigError or ValueError, bad input, is raised as such)."""


# What a rank tells the others at a gather (msgspec JSON, no pickle): its host, its host's resolved profile hash, and
# why its part of the lookup failed ("" when it did not). An error rides on the collective every rank enters next, so
# no rank is left waiting in one for the process group's timeout while the rank that raised is gone.
class _RankState(msgspec.Struct, kw_only=True):
    host: int = 0
    hash: str = ""
    error: str = ""
    kind: str = ""  # the failure's exception class name


class _GroupAnswer(msgspec.Struct, kw_only=True):
    """What rank 0 broadcasts last: the group's resolution, or why rank 0 could not make it."""

    resolution: Resolution | None = None
    error: str = ""
    kind: str = ""


_RERAISED: dict[str, type[Exception]] = {"ConfigError": ConfigError, "ValueError": ValueError}


# The most characters of a failure's own words that travel to the other ranks: a ConfigError quotes the bad value
# whole (a 100 KB MOETUNE_AUTOLOAD made a 100 KB message), and every rank's gather is padded to the longest text.
FAILURE_TEXT_MAX = 2000


def _failure(rank: int, e: BaseException) -> tuple[str, str]:
    """(kind, message) of rank `rank`'s failure, as every rank of the group raises it; its words cut to
    FAILURE_TEXT_MAX characters (the cut is said) before they travel."""
    # a lone surrogate (a non-UTF-8 byte of a path or variable, as Python decodes it) cannot be encoded as JSON: this
    # rank raised UnicodeEncodeError before the gather and left the others waiting in it. Escaped, it travels
    words = str(e).encode("utf-8", "backslashreplace").decode("utf-8")
    if len(words) > FAILURE_TEXT_MAX:
        words = f"{words[:FAILURE_TEXT_MAX]}... ({len(words) - FAILURE_TEXT_MAX} more characters cut)"
    return type(e).__name__, f"moetune: the EP group's profile lookup failed on rank {rank}: {type(e).__name__}: {words}"


def _raise_group_error(kind: str, message: str) -> None:
    raise _RERAISED.get(kind, GroupLookupError)(message)


def _gather_states(state: _RankState, group: Any, device: Any) -> list[_RankState]:
    """Every rank's `state`, in group rank order (JSON text over `_all_gather_text`). Collective."""
    texts = _all_gather_text(msgspec.json.encode(state).decode(), group, device)
    try:
        return [msgspec.json.decode(t, type=_RankState) for t in texts]
    except (msgspec.DecodeError, msgspec.ValidationError) as e:  # the same bytes on every rank: all raise so
        raise GroupLookupError(f"moetune: a rank's state in the EP group's profile lookup does not decode: {e}") from None


def _raise_any(states: list[_RankState]) -> None:
    """Raise the first failed rank's error (every rank holds the same `states`: all raise it together)."""
    for s in states:
        if s.error:
            _raise_group_error(s.kind, s.error)


def autoload_group_profile(
    *,
    model: ModelShape,
    ep_size: int,
    max_tokens: int,
    device: Any = None,
    group: Any = None,
    dtype: Any = None,
    transport_family: str | None = None,
    options: RuntimeOptions | None = None,
) -> Resolution:
    """One resolution for every rank of `group` (collective; see the module docstring): rank 0's, broadcast.

    Ranks on rank 0's host never look up; the first rank of every other host does, and a host whose profile
    hash differs from rank 0's makes the whole group use rank 0's policy default (warned once, never raised).
    With several hosts, rank 0 decides (and broadcasts) whether this lookup retries the group's fallback: once
    client.fallback_retry_s has passed since the group last looked up and ended in a default.
    The agreed env is exported on every rank; `last_resolution()` is the agreed one. Without torch.distributed
    (or with one rank) this is `autoload_profile`.

    A rank whose part raises (a bad `[client] autoload` on one host, a bad dtype, a bug in rank 0's group default)
    does not leave the others waiting in the next collective: its error rides on that collective and every rank
    raises it, with the same words (GroupLookupError; a ConfigError or ValueError as such).
    """
    global _last
    if not _dist_on(group):
        client_autoload()  # a bad value is an error, not "on"
        return autoload_profile(model=model, ep_size=ep_size, nodes=1, max_tokens=max_tokens, device=device,
                                group=group, dtype=dtype, transport_family=transport_family, options=options)
    import torch.distributed as dist

    cdev = _group_device(group)  # every collective needs it: a failure here is before any and the same on every rank
    rank = dist.get_rank(group)
    kind, err = "", ""  # this rank's failure: told to the others at the next collective, never raised before it
    host = 0
    try:
        client_autoload()  # a bad value (one host's config file may differ): every rank raises it below
        host = host_hash(host_identity())
    except Exception as e:
        kind, err = _failure(rank, e)
    states = _gather_states(_RankState(host=host, error=err, kind=kind), group, cdev)
    _raise_any(states)
    hosts = [st.host for st in states]
    nodes = len(set(hosts))
    leader = hosts.index(hosts[rank]) == rank  # the first rank of its host
    retry: bool | None = None  # one host: only rank 0 looks up, its own cache's expiry decides
    group_key: tuple[Any, ...] | None = None
    if nodes > 1:
        # rank 0 decides once whether the group's fallback is looked up again, and every host's first rank follows
        # (a cached fallback served past its own expiry, or looked up before it): the hosts' own expiries differ by
        # when each lookup ended, and a host retrying alone resolves another profile than one serving its fallback
        if rank == 0:
            try:  # a bad dtype: the error every rank raises after the hash gather
                group_key = _lookup_key(model=model, dtype=dtype, ep_size=ep_size, nodes=nodes, max_tokens=max_tokens,
                                        transport_family=transport_family, device=device, options=options)[2]
                with _lock:  # never looked up as a group (0.0): every host looks up
                    until = _group_until.get(group_key, 0.0)
                retry = until is not None and time.monotonic() >= until
            except Exception as e:
                kind, err = _failure(rank, e)
        retry = _broadcast_flag(bool(retry), group, cdev)
    mine: Resolution | None = None
    if leader and not err:
        try:  # autoload_profile raises for bad input only (a dtype): the whole group raises it, as one process would
            mine = autoload_profile(model=model, ep_size=ep_size, nodes=nodes, max_tokens=max_tokens, device=device,
                                    dtype=dtype, transport_family=transport_family, export_env=False, options=options,
                                    retry_fallback=retry)
        except Exception as e:
            kind, err = _failure(rank, e)
    hashes: list[str] = []
    if nodes > 1:  # a profile is per node fingerprint: every host must have resolved the same one
        states = _gather_states(_RankState(hash=mine.profile_hash if mine is not None else "", error=err, kind=kind),
                                group, cdev)
        _raise_any(states)
        hashes = [st.hash for st in states]
    payload = b""
    if rank == 0:
        answer = _GroupAnswer(error=err, kind=kind)
        if not err:
            try:  # anything rank 0 raises from here is the group's error, broadcast instead of the resolution
                assert mine is not None
                final = _group_decision(mine, hosts, hashes, nodes, device, options, ep_size=ep_size)
                answer = _GroupAnswer(resolution=final)
                payload = msgspec.json.encode(answer)
                if nodes > 1:  # only a resolution the group receives starts (or keeps) its retry clock
                    _keep_group_clock(final, group_key, retry)
            except Exception as e:
                k, m = _failure(rank, e)
                answer = _GroupAnswer(error=m, kind=k)
        if answer.error:
            payload = msgspec.json.encode(answer)
    try:
        got = msgspec.json.decode(_broadcast_bytes(payload, group, cdev), type=_GroupAnswer)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:  # cannot happen short of a torch bug: say so loudly
        raise RuntimeError(f"moetune: the profile rank 0 broadcast does not decode: {e}") from None
    if got.error or got.resolution is None:
        _raise_group_error(got.kind, got.error or "moetune: rank 0 broadcast no profile for the EP group")
    res = got.resolution
    # this group lookup's own: a later one (rank 0's fallback retried) replaces what this one exported. Its dtype as
    # autoload_profile keys it (None is the model's own; torch.bfloat16 is "bfloat16"): one lookup, one owner
    dt = model.dtype if dtype is None else str(dtype).removeprefix("torch.")
    apply_env(res.env, owner=("group", model, dt, ep_size, nodes, max_tokens, transport_family,
                              None if device is None else str(device), None if options is None else options.digest()))
    if rank != 0:
        log.info("moetune: rank %d uses rank 0's profile %s (%s%s)", rank, res.profile_hash, res.source,
                 f", {res.provenance}" if res.provenance else "")
    with _lock:
        _last = res
    return res


def _group_decision(mine: Resolution, hosts: list[int], hashes: list[str], nodes: int, device: Any,
                    options: RuntimeOptions | None, *, ep_size: int) -> Resolution:
    """Rank 0's resolution for the group from its own (`mine`) and every rank's host and hash (several hosts). May
    raise: the caller broadcasts the error instead."""
    if nodes > 1:
        per_host = {r: h for r, h in enumerate(hashes) if hosts.index(hosts[r]) == r}
        if len(set(per_host.values())) > 1:
            detail = ", ".join(f"rank {r}: {h}" for r, h in per_host.items())
            why = (f"the {nodes} hosts of this EP group resolved different profiles ({detail}); a profile is "
                   f"measured per node, so every host must resolve the same one")
            final = _group_default(mine, nodes, device, why, options, ep_size=ep_size)
            # say which default: a family without a runnable policy file falls back to the built-in one
            what = "the policy default" if final.source == "policy" else "the built-in default"
            warn_fallback(f"moetune: using {what} on every rank ({final.message})")
            return final
    return mine


def _keep_group_clock(final: Resolution, group_key: tuple[Any, ...] | None, retry: bool | None) -> None:
    """Rank 0's: the group's default (a host's fallback, or the hosts disagreeing) is looked up again on rank 0's
    clock, fallback_retry_s after the group last looked up (not after a construction served from the caches)."""
    if group_key is None:
        return
    fallback = final.source in FALLBACK_SOURCES
    with _lock:
        # a default after a kept profile (None: no retry was due) starts its own clock too: one host's lookup key
        # changed (its config edited) and it fell back, and with None kept no retry was ever due again, that host
        # serving its fallback past its expiry for the process's life
        if not fallback:
            _group_until[group_key] = None
        elif retry or _group_until.get(group_key) is None:
            _group_until[group_key] = time.monotonic() + _fallback_retry_s()


def last_resolution() -> Resolution | None:
    """What the last autoload settled on (its profile_hash is what check_same_profile compares)."""
    return _last


def clear_cache() -> None:
    """Forget the resolutions, the environment warnings given, the daemons' reported identities and which variables
    autoload exported (they stay set and are the user's to a later lookup, as in a new process)."""
    global _last
    with _lock:
        _cache.clear()
        _group_until.clear()
        _last = None
    forget_exports()
    forget_env_warnings()
    forget_reported_identities()


HASH_BYTES = 64


def check_same_profile(group: Any, profile_hash: str) -> None:
    """All-gather `profile_hash` over `group` (torch.distributed) and raise ProfileMismatch on any difference.

    A no-op when torch.distributed is not initialised or the group has one rank.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    if world <= 1:
        return
    raw = profile_hash.encode()[:HASH_BYTES].ljust(HASH_BYTES, b"\0")
    device = _group_device(group)
    mine = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    bufs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    hashes = [bytes(b.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for b in bufs]
    if len(set(hashes)) > 1:
        detail = ", ".join(f"rank {i}: {h}" for i, h in enumerate(hashes))
        raise ProfileMismatch(f"ranks hold different moetune profiles ({detail}); restart them together")
