"""Spawned-rank cases for tests/test_autoload_group.py and test_trust_client.py (module-level functions, imported by
name; a light module, as every spawned rank imports it)."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

from moetune.runtime.knobs import Knobs
from moetune.runtime.profiles.client import Resolution

TUNED_A = Knobs(pipeline_depth=2)
TUNED_B = Knobs(pipeline_depth=4)


def _tuned(knobs: Knobs, tag: str) -> Resolution:
    return Resolution(knobs=knobs, source="daemon", profile_hash=f"tuned-{tag}", status="current", family="collective",
                      provenance="measured", tuned=True, env={"NVSHMEM_IBGDA_NUM_RC_PER_PE": {"A": "2", "B": "4"}[tag]})


def _daemon_down() -> Resolution:
    """The collective policy default a lookup ends in while the daemon does not answer."""
    knobs = Knobs()
    return Resolution(knobs=knobs, source="policy", profile_hash=f"policy:{knobs.digest()}", status="default",
                      family="collective", message="daemon: no reply")


def _patch(rank: int, answers: dict[int, Any], hosts: list[str] | None) -> list[dict]:
    """Every rank's lookup answers `answers[rank]` (a Resolution, or "slow": the daemon times out on this rank
    and the chain ends in the policy default); with `hosts`, rank r runs on host hosts[r]."""
    from moetune.runtime.profiles import autoload

    os.environ.pop("MOETUNE_AUTOLOAD", None)
    os.environ.pop("NVSHMEM_IBGDA_NUM_RC_PER_PE", None)
    autoload.clear_cache()
    calls: list[dict] = []

    def fake_resolve(**kw: Any) -> Resolution:
        calls.append({"nodes": kw["nodes"], "tokens": kw["max_tokens"], "dtype": kw["model"].dtype})
        ans = answers[rank]
        if ans == "slow":  # a cold daemon: the budget runs out, the policy default is what this rank gets
            time.sleep(0.3)
            knobs = Knobs()
            return Resolution(knobs=knobs, source="policy", profile_hash=f"policy:{knobs.digest()}", status="default",
                              family="collective")
        return ans

    autoload._resolve = fake_resolve  # type: ignore[assignment]
    if hosts is not None:
        autoload.host_identity = lambda: hosts[rank]  # type: ignore[assignment]
    return calls


def case_group_profile(rank: int, world: int, answers: dict[int, Any], hosts: list[str] | None) -> dict:
    """Build an EPBuffer without knobs; report the knobs, profile and env every rank ended with."""
    import torch

    from moetune.runtime.buffer.facade import EPBuffer
    from moetune.runtime.shapes import ModelShape

    calls = _patch(rank, {int(k): (_tuned(*v) if isinstance(v, tuple) else v) for k, v in answers.items()}, hosts)
    model = ModelShape(name="t", hidden=64, intermediate=32, experts=8, topk=2, dtype="float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = EPBuffer(None, None, model=model, max_tokens=16, dtype=torch.float32)
    x = torch.randn(5, 64)
    idx = torch.randint(0, 8, (5, 2))
    w = torch.rand(5, 2)
    recv, _meta, handle = buf.dispatch(x, idx, w)
    buf.combine(torch.zeros(recv.shape[0], 64), handle)
    return {"knobs": buf.knobs.to_dict(), "hash": buf.resolution.profile_hash, "source": buf.resolution.source,
            "calls": calls, "env": os.environ.get("NVSHMEM_IBGDA_NUM_RC_PER_PE"),
            "warnings": [str(c.message) for c in caught]}


def case_group_default_named(rank: int, world: int, hosts: list[str]) -> dict:
    """Two hosts disagree and rank 0's family has no policy default this runtime can run (ibgda: no runtime
    transport): the group falls back to the built-in default; report what every rank ended with and was warned.
    (Not a proxy:* family: across hosts that is one host's transport, replaced by collective's policy default as
    nvlink's is, `client.one_host_family`.)"""
    from moetune.runtime.knobs import default_knobs

    mine = Resolution(knobs=default_knobs("collective"), source="daemon", profile_hash="tuned-ibgda",
                      status="current", family="ibgda", provenance="measured", tuned=True)
    answers = {0: mine, 1: _tuned(TUNED_B, "B")}
    return case_group_profile(rank, world, answers, hosts)


def case_group_fallback_retry(rank: int, world: int, hosts: list[str], lagging: int, at: list[float]) -> dict:
    """Two hosts' first ranks both fall back (the daemon did not answer), then find the tuned profile on any later
    lookup. Rank `lagging`'s first lookup takes 0.2 s longer (it waited out the client timeout), so the fallback it
    caches expires 0.2 s after the other host's. The group looks up at each clock time in `at` (autoload's clock,
    moved by hand; client.fallback_retry_s is 10); report what every rank ended with each time."""
    from types import SimpleNamespace

    from moetune.runtime.profiles import autoload
    from moetune.runtime.shapes import ModelShape

    _patch(rank, {}, hosts)
    now = [1000.0]
    autoload.time = SimpleNamespace(monotonic=lambda: now[0])  # type: ignore[assignment]
    calls: list[str] = []

    def fake_resolve(**kw: Any) -> Resolution:
        if not calls:
            calls.append("down")
            if rank == lagging:
                now[0] += 0.2
            return _daemon_down()
        calls.append("tuned")
        return _tuned(TUNED_A, "A")

    autoload._resolve = fake_resolve  # type: ignore[assignment]
    model = ModelShape(name="t", hidden=64, intermediate=32, experts=8, topk=2, dtype="float32")
    out: list[dict] = []
    for t in at:
        now[0] = t
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = autoload.autoload_group_profile(model=model, ep_size=world, max_tokens=16)
        out.append({"hash": res.profile_hash, "source": res.source, "calls": list(calls),
                    "warnings": [str(c.message) for c in caught]})
    return {"steps": out}


def case_group_default_after_a_kept_profile(rank: int, world: int, hosts: list[str], at: list[float]) -> dict:
    """Both hosts find the tuned profile (the group keeps it); before the second construction rank 1's cached
    lookups are gone (its lookup key changed: a config file edited) and its lookup then falls back once (the daemon
    briefly down), so the group runs its default; later lookups find the profile again. The group looks up at each
    clock time in `at` (client.fallback_retry_s is 10); report what every rank ended with each time."""
    from types import SimpleNamespace

    from moetune.runtime.profiles import autoload
    from moetune.runtime.shapes import ModelShape

    _patch(rank, {}, hosts)
    now = [1000.0]
    autoload.time = SimpleNamespace(monotonic=lambda: now[0])  # type: ignore[assignment]
    calls: list[str] = []

    def fake_resolve(**kw: Any) -> Resolution:
        if rank == 1 and len(calls) == 1:
            calls.append("down")
            return _daemon_down()
        calls.append("tuned")
        return _tuned(TUNED_A, "A")

    autoload._resolve = fake_resolve  # type: ignore[assignment]
    model = ModelShape(name="t", hidden=64, intermediate=32, experts=8, topk=2, dtype="float32")
    out: list[dict] = []
    for i, t in enumerate(at):
        now[0] = t
        if i == 1 and rank == 1:
            autoload._cache.clear()  # this host's lookup key changed: nothing cached under the new one
        res = autoload.autoload_group_profile(model=model, ep_size=world, max_tokens=16)
        out.append({"hash": res.profile_hash, "source": res.source, "calls": list(calls)})
    return {"steps": out}


def case_group_lookup_raises(rank: int, world: int, where: str) -> dict:
    """One rank's part of the group lookup raises at `where` (monkeypatched); report what every rank raised and how
    long its call took (the process group's timeout is short: a rank left waiting in a collective shows in both)."""
    import torch.distributed as dist

    from moetune.runtime.profiles import autoload
    from moetune.runtime.shapes import ModelShape

    two_hosts = where != "config_on_rank_1"
    # the hosts disagree: rank 0 builds the group default ("group_default")
    _patch(rank, {0: _tuned(TUNED_A, "A"), 1: _tuned(TUNED_B, "B")}, ["node-a", "node-b"] if two_hosts else None)

    def boom(*a: Any, **kw: Any) -> Any:
        raise RuntimeError(f"{where} broke")

    if where == "group_default" and rank == 0:  # after the hash gather, before the final broadcast
        autoload._group_default = boom  # type: ignore[assignment]
    elif where == "leader_lookup" and rank == 1:  # the other host's first rank, in its own lookup
        autoload.autoload_profile = boom  # type: ignore[assignment]
    elif where == "retry_clock" and rank == 0:  # rank 0 deciding whether the group retries, before that broadcast
        from types import SimpleNamespace

        autoload.time = SimpleNamespace(monotonic=boom)  # type: ignore[assignment]
    elif where == "config_on_rank_1" and rank == 1:  # one rank's environment only (one host)
        os.environ["MOETUNE_AUTOLOAD"] = "maybe"
    model = ModelShape(name="t", hidden=64, intermediate=32, experts=8, topk=2, dtype="float32")
    dist.barrier()  # both ranks enter the lookup together: the time measured is the lookup's
    t0 = time.monotonic()
    try:
        res = autoload.autoload_group_profile(model=model, ep_size=world, max_tokens=16)
        out: dict = {"kind": None, "message": res.profile_hash}
    except Exception as e:
        out = {"kind": type(e).__name__, "message": str(e)}
    out["elapsed"] = time.monotonic() - t0
    return out


def case_group_nodes(rank: int, world: int, hosts: list[str]) -> int:
    """The group's node count autoload finds, rank r on host hosts[r]."""
    from moetune.runtime.profiles import autoload

    # the node's identity itself, not the host name: that is only its fallback where the kernel's boot id cannot be
    # read, and every rank spawned here shares this machine's boot id
    autoload.host_identity = lambda: hosts[rank]  # type: ignore[assignment]
    return autoload.group_nodes(None)
