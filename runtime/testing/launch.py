"""Launch a function on N local ranks (torch.multiprocessing spawn, loopback rendezvous), and `init_dist`,
the one way any process of this project joins a process group.

Used by `moetune bench ep`, the tuner's measurement workers, the bench scripts and the tests; never by the
data path (an import rule keeps it so). Every wait is bounded: the process group gets `timeout_s`
(collectives that cannot complete raise instead of hanging) and the parent gives up after
`join_timeout_s`, terminating the ranks it started. A parent interrupted while it waits (Ctrl-C, or SIGTERM
raised as KeyboardInterrupt) ends its ranks at once; one that ends without a word (SIGKILL) takes them with
it (`die_with_parent`).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetune.runtime.testing.procs import die_with_parent


class LaunchError(RuntimeError):
    """One or more ranks failed; `errors` maps rank → message."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        lines = [f"rank {r}: {m}" for r, m in sorted(errors.items())]
        super().__init__("distributed run failed:\n" + "\n".join(lines))


_handed_out: set[int] = set()  # ports free_port returned in this process (their owners bind them later)


def free_port() -> int:
    """A loopback TCP port free now and not handed out by an earlier call of this process: the kernel may give the
    same ephemeral port to two binds in a row while neither caller has bound it yet (a daemon's socket and its
    publisher got one port and refused to start)."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    return port  # every try an earlier one: the range is nearly spent, let the bind say so


def init_dist(rank: int, world: int, *, backend: str, port: int | None = None,
              timeout_s: float | None = None) -> torch.device:
    """Join the default process group as `rank` of `world`; return this rank's device.

    The one place that calls `torch.distributed.init_process_group` (DeepEP's `init_dist` is the model):
    spawned ranks, torchrun workers, measurement subprocesses and the bench scripts all join through it.

    Args:
        backend: "nccl" (one GPU per rank) or "gloo" (CPU).
        port: a loopback TCP rendezvous on 127.0.0.1:`port` (ranks spawned on this machine); None joins
            through the environment torchrun sets (env://: MASTER_ADDR, MASTER_PORT).
        timeout_s: bound on every collective (they raise instead of hanging); None keeps torch's default.

    Returns:
        With nccl, `cuda:rank` for spawned ranks, `cuda:LOCAL_RANK` under torchrun (env://), modulo the
        visible GPUs, made the current device and bound to the group; with gloo, the CPU.
    """
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    if backend == "nccl":
        # spawned ranks are this machine's ranks; a torchrun worker's GPU is its rank on its node
        local = rank if port is not None else int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    init_method = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world, **kwargs)
    return device


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, backend: str, timeout_s: float,
           args: tuple, env: dict[str, str], q: Any, parent: int) -> None:
    # a launcher killed outright (SIGKILL, or a second Ctrl-C while it ends the ranks) left them running,
    # re-parented to init, holding the GPUs until their benchmark ended
    die_with_parent(parent)
    os.environ.update(env)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # share the cores between the ranks
    try:
        try:
            init_dist(rank, world, backend=backend, port=port, timeout_s=timeout_s)
        except Exception as e:  # the group did not form: `launch` may start the ranks again on another port
            q.put((rank, False, f"{RENDEZVOUS}{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
            return
        result = fn(rank, world, *args)
        # plain pickle (bytes): tensors are copied, not shared through file descriptors that vanish when
        # this process exits before the parent reads them
        q.put((rank, True, pickle.dumps(result)))
    except BaseException as e:
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
    finally:
        destroy_group_quietly()


def destroy_group_quietly() -> None:
    """Tear down this process's default group, if any; a rank on its way out has nothing to do with a
    failure here (the peer may already be gone)."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


# Prefixes the error of a rank whose process group did not form (before `fn` ran): where every rank failed so, the
# group's rendezvous lost a race for its ports (another process took the master port picked by free_port, or
# connected to a Gloo pair's listening port: "Connection closed by peer"), and nothing of `fn` has run.
RENDEZVOUS = "process group not formed: "


def launch(
    fn: Callable[..., Any],
    world: int,
    *,
    backend: str = "gloo",
    args: tuple = (),
    timeout_s: float = 60.0,
    join_timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run fn(rank, world, *args) on `world` spawned ranks; return their results in rank order.

    fn must be importable by name (a module-level function). Raises LaunchError naming every failed rank.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    for attempt in range(2):
        results, errors = _launch_once(fn, world, backend, args, timeout_s, join_timeout_s, env)
        # once more on fresh ports where every failed rank failed forming the group: a port race between concurrent
        # launches, not a failure of fn. A rank that formed it may have run fn meanwhile (one H100 run with 13
        # pytest processes: rank 0 "Connection closed by peer", rank 1's fn, which needs no peer, returned), and
        # runs it again: its fn ran alone, since any exchange with the rank that failed would have failed too.
        if attempt == 0 and errors and all(str(e).startswith(RENDEZVOUS) for e in errors.values()):
            continue
        break
    if errors:
        raise LaunchError(errors)
    return [pickle.loads(results[r]) for r in range(world)]


def _launch_once(fn: Callable[..., Any], world: int, backend: str, args: tuple, timeout_s: float,
                 join_timeout_s: float | None, env: dict[str, str] | None) -> tuple[dict[int, Any], dict[int, str]]:
    """One start of the ranks on a port of their own: (results, errors) by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, fn, world, port, backend, timeout_s, args, dict(env or {}), q, os.getpid()),
                    daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + (join_timeout_s if join_timeout_s is not None else 3 * timeout_s + 30)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    waited = False  # the loop ended by itself (every rank reported, or the time limit), not by an interrupt
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                for r in range(world):
                    if r not in results and r not in errors:
                        errors[r] = f"no result within the time limit ({join_timeout_s or 3 * timeout_s + 30:.0f} s)"
                break
            try:
                rank, ok, payload = q.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if not p.is_alive() and r not in results and r not in errors and p.exitcode not in (0, None):
                        # give its queued message a moment to arrive
                        try:
                            rank, ok, payload = q.get(timeout=1.0)
                        except queue_mod.Empty:
                            errors[r] = f"process exited with code {p.exitcode}"
                            continue
                        (results if ok else errors)[rank] = payload
                continue
            (results if ok else errors)[rank] = payload
        waited = True
    finally:
        # interrupted (Ctrl-C, SIGTERM raised as KeyboardInterrupt) or failed here: no result is wanted, end the
        # ranks now (waiting 5 s for each to finish its run kept a SIGTERM'd `bench ep` alive world x 5 s)
        _end_ranks(procs, grace_s=5.0 if waited else 0.0)
    return results, errors


def _end_ranks(procs: list[Any], grace_s: float) -> None:
    """Join each rank, giving it `grace_s` to exit by itself; then SIGTERM those still running, and SIGKILL any that
    outlive that by 5 s."""
    if grace_s > 0:
        for p in procs:
            p.join(timeout=grace_s)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
