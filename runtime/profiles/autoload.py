"""Auto-load the tuned knobs when an EP buffer or MoE layer is made without explicit knobs.

`autoload_knobs(model=..., ep_size=..., group=..., max_tokens=..., device=...)`:
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
have (a served `ibgda` profile) is passed over.

The profile's environment-level settings (NVSHMEM_*, NCCL_*; only those `launcher_env` produces) are
exported to `os.environ` right away, before any communicator exists. Variables already set in the
environment are left alone (what the user set explicitly wins, as explicit knobs do: with explicit knobs
this module is not called at all). Results are cached per process, key and device (what can run depends on
the device), so the many layers of one model cost one lookup.

`transport_family="megakernel"` looks up the MoE megakernel's profile instead (a world-1 `MoELayer` does: ep_size
1, nodes 1); "can this runtime run it" is then the megakernel's own check (runtime/megakernel/engine.py).

`MOETUNE_AUTOLOAD=0` skips the daemon and the database (policy defaults, no warning).

`check_same_profile(group, profile_hash)` all-gathers the hash across ranks and raises when they differ.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
from typing import Any

from moetune.runtime.knobs import Knobs, default_knobs
from moetune.runtime.profile_record import MEGAKERNEL_FAMILY
from moetune.runtime.profiles.client import ProfileClient, Resolution, policy_or_default, warn_fallback
from moetune.runtime.profiles.launcher_env import apply_env, launcher_env
from moetune.runtime.shapes import ModelShape

__all__ = ["ProfileMismatch", "apply_env", "autoload_knobs", "autoload_profile", "check_same_profile", "clear_cache",
           "group_nodes", "last_resolution", "launcher_env"]

log = logging.getLogger("moetune.autoload")

_cache: dict[tuple[Any, ...], Resolution] = {}
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


def group_nodes(group: Any = None) -> int:
    """How many hosts the ranks of `group` run on (1 without torch.distributed). Collective."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return 1
    host = int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:7], "little")
    mine = torch.tensor([host], dtype=torch.int64, device=_group_device(group))
    bufs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(bufs, mine, group=group)
    return len({int(b.item()) for b in bufs})


_availability: dict[tuple[str, str], str | None] = {}


def runtime_transport_problem(name: str, device: Any = None) -> str | None:
    """Why this runtime cannot run transport `name` on `device` (None when it can): not in the transport
    registry (a served `ibgda`), its module missing, or (with a `device`; EPBuffer always gives one)
    unavailable there (nvlink on a CPU device). Cached per process: availability may load the compiled library."""
    ck = (name, str(device))
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

            avail = cls.availability(torch.device(device))
            why = None if avail.ok else avail.reason
    except (KeyError, ImportError, TypeError) as e:
        why = str(e).strip("'\"")
    except Exception as e:  # an availability probe that fails says the transport cannot be used here
        why = f"availability check failed: {type(e).__name__}: {e}"
    _availability[ck] = why
    return why


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
) -> Resolution:
    """The full resolution (knobs, hash, source, env) for this process; env exported to os.environ.

    `nodes` defaults to `group_nodes(group)`. Never raises for what the daemon, the database or the
    policy files hold: the last resort is the built-in default, with a warning.
    """
    global _last
    if nodes is None:
        nodes = group_nodes(group)
    # The exact token count, not its rung: two counts of one rung may have different nearest stored buckets. The
    # device too: which transports can run (transport_ok) depends on it, so a CUDA device's nvlink profile must
    # not be handed to a layer on the CPU.
    key = (model, ep_size, nodes, max_tokens, transport_family, None if device is None else str(device))
    with _lock:
        if use_cache and client is None and key in _cache:
            _last = _cache[key]
            return _last
        if os.environ.get("MOETUNE_AUTOLOAD", "1").lower() in ("0", "off", "false", "no"):
            knobs, source = policy_or_default(transport_family or "collective")
            res = Resolution(knobs=knobs, source=source, profile_hash=f"{source}:{knobs.digest()}",
                             status="default", family=transport_family, message="MOETUNE_AUTOLOAD=0")
        else:
            res = _resolve(model=model, ep_size=ep_size, nodes=nodes, max_tokens=max_tokens, device=device, client=client,
                           transport_family=transport_family)
        apply_env(res.env)
        log.info("moetune: knobs from %s (profile %s, %.1f ms)", res.source, res.profile_hash, res.elapsed_ms)
        if client is None:
            _cache[key] = res
        _last = res
        return res


def _resolve(
    *, model: ModelShape, ep_size: int, nodes: int, max_tokens: int, device: Any, client: ProfileClient | None,
    transport_family: str | None = None,
) -> Resolution:
    own = client is None
    try:
        c = client or ProfileClient()
        try:
            return c.resolve(model=model, ep_size=ep_size, tokens=max_tokens, nodes=nodes,
                             transport_family=transport_family,
                             transport_ok=lambda name: runtime_transport_problem(name, device))
        finally:
            if own:
                c.close()
    except Exception as e:  # a bug or an environment we did not foresee must not stop the model from loading
        knobs = default_knobs("collective")
        msg = f"profile lookup failed ({type(e).__name__}: {e}); using the built-in default for collective"
        warn_fallback(f"moetune: NO tuned profile ({msg})")
        return Resolution(knobs=knobs, source="default", profile_hash=f"default:{knobs.digest()}", status="default",
                          family="collective", message=msg)


def autoload_knobs(
    *, model: ModelShape, ep_size: int, nodes: int | None = None, max_tokens: int, device: Any = None, group: Any = None
) -> Knobs:
    """Knobs for an EP buffer / MoE layer made without explicit knobs (see the module docstring)."""
    return autoload_profile(model=model, ep_size=ep_size, nodes=nodes, max_tokens=max_tokens, device=device,
                            group=group).knobs


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
    device = _group_device(group)
    mine = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    bufs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    hashes = [bytes(b.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for b in bufs]
    if len(set(hashes)) > 1:
        detail = ", ".join(f"rank {i}: {h}" for i, h in enumerate(hashes))
        raise ProfileMismatch(f"ranks hold different moetune profiles ({detail}); restart them together")
