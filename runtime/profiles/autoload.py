"""Auto-load the tuned knobs when an EP buffer or MoE layer is made without explicit knobs.

`autoload_knobs(model=..., ep_size=..., nodes=..., max_tokens=..., device=...)`:
1. asks the daemon (`get_profile`, one round trip) for the current profile of this node's fabric, the
   model shape, the EP size and node count, at the token bucket nearest `max_tokens`; the daemon
   fills in the fingerprint of the fabric it discovered;
2. when the daemon is down or silent, reads the daemon's database read-only. The runtime never runs
   fabric discovery itself (that is tuner code): it uses the fingerprint the daemon cached in
   `daemon.json` in its runtime directory, and without one, any current profile of the same shape and
   EP size (the most recently updated fingerprint);
3. else the policy default of the transport family (`policy_default_knobs`), else `default_knobs`.
Steps 2 and 3 warn loudly. The whole chain is bounded (`MOETUNE_CLIENT_TIMEOUT_MS`, 200 ms default).

The profile's environment-level settings (NVSHMEM_*, NCCL_*) are exported to `os.environ` right away,
before any communicator exists. Variables already set in the environment are left alone (what the user
set explicitly wins, as explicit knobs do: with explicit knobs this module is not called at all).
Results are cached per process and key, so the many layers of one model cost one lookup.

`MOETUNE_AUTOLOAD=0` skips the daemon and the database (policy defaults, no warning).

`check_same_profile(group, profile_hash)` all-gathers the hash across ranks and raises when they differ.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import nearest_bucket
from moetune.runtime.profiles.client import ProfileClient, Resolution, policy_or_default
from moetune.runtime.shapes import ModelShape

log = logging.getLogger("moetune.autoload")

_cache: dict[tuple[Any, ...], Resolution] = {}
_lock = threading.Lock()
_last: Resolution | None = None


class ProfileMismatch(RuntimeError):
    """Ranks of one group loaded different profiles."""


def launcher_env(knobs: Knobs, transport_family: str | None, nodes: int = 1) -> dict[str, str]:
    """The environment a launcher must export for a knob set (read by NVSHMEM/NCCL at init).

    - proxy:<provider>: NVSHMEM_IB_ENABLE_IBGDA=0 and NVSHMEM_REMOTE_TRANSPORT=<ibrc|ucx|libfabric>
      (+ NVSHMEM_LIBFABRIC_PROVIDER for libfabric/<provider>);
    - ibgda: NVSHMEM_IB_ENABLE_IBGDA=1, NVSHMEM_IBGDA_NUM_RC_PER_PE=<qps_per_pe>;
    - nvlink on one node: NVSHMEM_REMOTE_TRANSPORT=none (no network transport needed);
    - collective/host_staged: NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS=<channels> when channels > 1.
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
    elif knobs.transport in ("collective", "host_staged") and knobs.channels > 1:
        env["NCCL_MIN_NCHANNELS"] = str(knobs.channels)
        env["NCCL_MAX_NCHANNELS"] = str(knobs.channels)
    return env


def apply_env(env: dict[str, str], *, override: bool = False) -> dict[str, str]:
    """Export NVSHMEM_*/NCCL_* settings; variables already set win unless `override`. Returns what was set."""
    applied: dict[str, str] = {}
    for k, v in env.items():
        if not (k.startswith("NVSHMEM_") or k.startswith("NCCL_")):
            log.warning("moetune: ignoring a non NVSHMEM/NCCL variable from a profile: %s", k)
            continue
        if k in os.environ and not override:
            if os.environ[k] != v:
                log.info("moetune: keeping %s=%s from the environment (profile wants %s)", k, os.environ[k], v)
            continue
        os.environ[k] = v
        applied[k] = v
    return applied


def autoload_profile(
    *,
    model: ModelShape,
    ep_size: int,
    nodes: int = 1,
    max_tokens: int,
    device: Any = None,
    client: ProfileClient | None = None,
    use_cache: bool = True,
) -> Resolution:
    """The full resolution (knobs, hash, source, env) for this process; env exported to os.environ."""
    global _last
    key = (model, ep_size, nodes, nearest_bucket(max_tokens))
    with _lock:
        if use_cache and client is None and key in _cache:
            _last = _cache[key]
            return _last
        if os.environ.get("MOETUNE_AUTOLOAD", "1").lower() in ("0", "off", "false", "no"):
            knobs, source = policy_or_default("collective")
            res = Resolution(knobs=knobs, source=source, profile_hash=f"{source}:{knobs.digest()}",
                             status="default", message="MOETUNE_AUTOLOAD=0")
        else:
            own = client is None
            c = client or ProfileClient()
            try:
                res = c.resolve(model=model, ep_size=ep_size, tokens=max_tokens, nodes=nodes)
            finally:
                if own:
                    c.close()
        apply_env(res.env)
        log.info("moetune: knobs from %s (profile %s, %.1f ms)", res.source, res.profile_hash, res.elapsed_ms)
        if client is None:
            _cache[key] = res
        _last = res
        return res


def autoload_knobs(*, model: ModelShape, ep_size: int, nodes: int = 1, max_tokens: int, device: Any = None) -> Knobs:
    """Knobs for an EP buffer / MoE layer made without explicit knobs (see the module docstring)."""
    return autoload_profile(model=model, ep_size=ep_size, nodes=nodes, max_tokens=max_tokens, device=device).knobs


def last_resolution() -> Resolution | None:
    """What the last autoload settled on (its profile_hash is what check_same_profile compares)."""
    return _last


def clear_cache() -> None:
    global _last
    with _lock:
        _cache.clear()
        _last = None


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
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    bufs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    hashes = [bytes(b.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for b in bufs]
    if len(set(hashes)) > 1:
        detail = ", ".join(f"rank {i}: {h}" for i, h in enumerate(hashes))
        raise ProfileMismatch(f"ranks hold different moetune profiles ({detail}); restart them together")
