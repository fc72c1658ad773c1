"""A persistent `moetune bench ep` world: launch the ranks once, then run many cases through them.

`python -m moetune.tuner.measure.worker --world 2 --backend gloo` (or `moetune bench ep --serve`) spawns the
ranks (the same spawn + loopback rendezvous as `moetune bench ep`, runtime/testing/launch.py), prints one line
`{"ready": true, ...}` once every rank has joined the process group, then reads one JSON case per line on
stdin and writes one JSON line per case on stdout:

  case   : {"id": ..., "model": "custom:64,32,8,2", "tokens": 128, "knobs": {...} or "name=value,...",
            "routing": "uniform", "iters": 20, "warmup": 5, "verify": false, "layer": true, "seed": 0,
            "impl": "moetune", "transport": "", "layout": "auto"}
  result : the object `moetune bench ep --json` prints (less its "meta" stamp), plus "id"
  error  : {"id": ..., "error": "..."}  (bad input, or an exception raised on every rank alike)

EOF on stdin ends the worker cleanly (exit 0). The worker process does no measuring: it validates each case,
hands it to every rank through that rank's queue and collects the ranks' answers. When a rank dies, or the
ranks fail differently (one raised inside a collective, so the group may be broken), the worker prints the
error on stderr and exits with status 3: its caller starts a fresh world. Only this process writes to
stdout (the ranks' stdout goes to stderr), so the protocol lines cannot be garbled by library output.

`--parent-pid PID` (the tuner passes its own pid): the worker ends (status 3), its ranks with it, once that
process is gone; a tune killed outright (SIGKILL, or a signal it did not handle) left the worker and its ranks
measuring for a minute, re-parented to init, holding the GPUs. Each rank is killed when the worker ends
(PR_SET_PDEATHSIG, Linux).

Environment-level settings (NCCL_P2P_DISABLE, NVSHMEM_*) are whatever the worker was started with: they are
in place before any communicator exists, so one worker serves one environment.

Test hooks (only with MOETUNE_TEST_HOOKS=1): case field "_test_sleep_s" makes rank 0 sleep that long before
the case; "_test_exit" (an exit code) makes rank 1 (or rank 0 in a world of one) exit at once;
"_test_raise" (a message) makes every rank raise RuntimeError(message) instead of running the case.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import queue as queue_mod
import sys
import time
import traceback
from typing import Any

from moetune.runtime.testing.procs import die_with_parent

READY = "ready"


def case_config(case: dict[str, Any], world: int, backend: str) -> dict[str, Any]:
    """Validate a case and build bench_case's cfg (the checks `moetune bench ep` makes). Raises ValueError."""
    from moetune.runtime import Knobs, get_model
    from moetune.runtime.routing import parse_routing

    if not isinstance(case, dict):
        raise ValueError(f"a case is a JSON object, got {type(case).__name__}")
    model = case.get("model", "qwen3-30b")
    shape = get_model(model)
    raw = case.get("knobs") or ""
    k = Knobs.from_dict(raw) if isinstance(raw, dict) else Knobs.parse(str(raw))
    if case.get("transport"):
        k = k.replace(transport=case["transport"])
    routing = str(case.get("routing", "uniform"))
    parse_routing(routing)
    impl = case.get("impl", "moetune")
    if impl not in ("moetune", "plain"):
        raise ValueError(f"impl must be moetune or plain, got {impl!r}")
    layout = case.get("layout", "auto")
    if layout not in ("auto", "dense", "packed"):
        raise ValueError(f"layout must be auto, dense or packed, got {layout!r}")
    tokens, iters, warmup = int(case.get("tokens", 128)), int(case.get("iters", 20)), int(case.get("warmup", 5))
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if iters < 1 or warmup < 0:
        raise ValueError("iters must be >= 1 and warmup >= 0")
    shape.check_ep(world)
    if k.transport not in ("collective", "host_staged") and impl == "moetune":
        from moetune.runtime.transports.registry import available_transports

        av = available_transports("cuda" if backend == "nccl" else "cpu").get(k.transport)
        if av is None or not av.ok:
            raise ValueError(f"transport {k.transport!r} is not available here: {av.reason if av else 'not registered'}")
    verify = bool(case.get("verify", False))
    rotate = case.get("rotate")  # input sets the iterations rotate over (None: ep.DEFAULT_ROTATE)
    if rotate is not None and (not isinstance(rotate, int) or isinstance(rotate, bool) or rotate < 1):
        raise ValueError(f"rotate must be an integer >= 1, got {rotate!r}")
    cfg = {"model": model, "tokens": tokens, "knobs": k.to_dict(), "routing": routing, "iters": iters,
           "warmup": warmup, "verify": verify, "impl": impl, "seed": int(case.get("seed", 0)), "backend": backend,
           "layer": impl == "moetune" and bool(case.get("layer", True)),
           "dense": {"auto": None, "dense": True, "packed": False}[layout],
           "close_buffer": True}
    if rotate is not None:
        cfg["rotate"] = rotate
    if os.environ.get("MOETUNE_TEST_HOOKS") == "1":
        for hook in ("_test_sleep_s", "_test_exit", "_test_raise"):
            if hook in case:
                cfg[hook] = case[hook]
    return cfg


def _rank_main(rank: int, world: int, port: int, backend: str, timeout_s: float, env: dict[str, str],
               inq: Any, outq: Any, parent: int | None = None) -> None:
    """One rank: join the group, then run every case the parent hands it until it gets None. `parent`: the
    worker's pid; the rank is killed when the worker ends (`die_with_parent`)."""
    die_with_parent(parent)  # a worker killed outright (SIGKILL) left its ranks running, re-parented to init
    os.dup2(2, 1)  # only the parent writes protocol lines on stdout
    os.environ.update(env)
    import torch

    from moetune.runtime.testing.launch import destroy_group_quietly, init_dist
    from moetune.tuner.measure.ep import bench_case

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        init_dist(rank, world, backend=backend, port=port, timeout_s=timeout_s)
    except BaseException as e:  # broad: a rank process reports to its parent, never dies silently
        outq.put((rank, READY, False, f"{type(e).__name__}: {e}"))
        return
    outq.put((rank, READY, True, None))
    try:
        while True:
            item = inq.get()
            if item is None:
                break
            cid, cfg = item
            try:
                if cfg.get("_test_exit") is not None and rank == min(1, world - 1):
                    os._exit(int(cfg["_test_exit"]))
                if cfg.get("_test_raise"):
                    raise RuntimeError(str(cfg["_test_raise"]))
                if cfg.get("_test_sleep_s") and rank == 0:
                    time.sleep(float(cfg["_test_sleep_s"]))
                rep = bench_case(rank, world, cfg)
                outq.put((rank, cid, True, pickle.dumps(rep)))
            except Exception as e:  # broad: a worker process; the case fails, the worker serves on
                outq.put((rank, cid, False, f"{type(e).__name__}: {e}"))
                if os.environ.get("MOETUNE_WORKER_TRACEBACK") == "1":
                    traceback.print_exc()
    finally:
        destroy_group_quietly()


class _Died(RuntimeError):
    pass


def parent_gone(parent_pid: int | None) -> bool:
    """Whether the process that started this worker (`--parent-pid`) has ended: this process was re-parented."""
    return parent_pid is not None and os.getppid() != parent_pid


def serve(world: int, backend: str, timeout_s: float, stdin: Any = None, stdout: Any = None,
          parent_pid: int | None = None) -> int:
    """Run the worker loop; returns the exit status. `parent_pid`: end (status 3, the ranks killed) once that
    process, this worker's parent, is gone, checked every half second while the ranks start or measure (a case
    can run for minutes) and at EOF on stdin when idle."""
    if parent_gone(parent_pid):
        print(f"bench worker: the process that started it (pid {parent_pid}) has ended", file=sys.stderr, flush=True)
        return 3
    import torch.multiprocessing as mp

    from moetune.runtime.testing.launch import free_port
    from moetune.tuner.measure.ep import finish_report

    stdin = stdin or sys.stdin
    if stdout is None:
        # keep the real stdout for protocol lines; everything else printed to fd 1 goes to stderr
        stdout = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def emit(obj: dict[str, Any]) -> None:
        stdout.write(json.dumps(obj) + "\n")
        stdout.flush()

    ctx = mp.get_context("spawn")
    outq = ctx.Queue()
    inqs = [ctx.Queue() for _ in range(world)]
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, backend, timeout_s, {}, inqs[r], outq, os.getpid()))
             for r in range(world)]
    for p in procs:
        p.start()

    def collect(tag: Any, limit_s: float | None) -> dict[int, tuple[bool, Any]]:
        got: dict[int, tuple[bool, Any]] = {}
        deadline = None if limit_s is None else time.monotonic() + limit_s
        while len(got) < world:
            try:
                rank, t, ok, payload = outq.get(timeout=0.5)
            except queue_mod.Empty:
                if parent_gone(parent_pid):  # the tuner was killed: stop measuring for nobody
                    raise _Died(f"the process that started it (pid {parent_pid}) has ended") from None
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                if dead:
                    try:  # its last message may still be in flight
                        rank, t, ok, payload = outq.get(timeout=1.0)
                    except queue_mod.Empty:
                        raise _Died(f"rank {dead[0][0]} exited with code {dead[0][1]}") from None
                elif deadline is not None and time.monotonic() > deadline:
                    raise _Died(f"ranks did not start within {limit_s:g} s")
                else:
                    continue
            if t == tag:
                got[rank] = (ok, payload)
        return got

    status = 0
    try:
        ready = collect(READY, timeout_s + 60)
        bad = {r: m for r, (ok, m) in ready.items() if not ok}
        if bad:
            raise _Died("process group init failed: " + "; ".join(f"rank {r}: {m}" for r, m in sorted(bad.items())))
        emit({"ready": True, "world": world, "backend": backend, "pid": os.getpid()})
        n = 0
        for line in stdin:
            line = line.strip()
            if not line:
                continue
            n += 1
            try:
                case = json.loads(line)
            except json.JSONDecodeError as e:
                emit({"id": None, "error": f"not a JSON case: {e}"})
                continue
            cid = case.get("id") if isinstance(case, dict) else None
            try:
                cfg = case_config(case, world, backend)
            except Exception as e:  # broad: a worker process; a bad case is answered, not fatal
                emit({"id": cid, "error": f"{type(e).__name__}: {e}"})
                continue
            tag = ("case", n)
            for q in inqs:
                q.put((tag, cfg))
            got = collect(tag, None)
            errs = {r: m for r, (ok, m) in got.items() if not ok}
            if errs:
                msgs = set(errs.values())
                if len(errs) == world and len(msgs) == 1:  # every rank raised the same: the group is intact
                    emit({"id": cid, "error": msgs.pop()})
                    continue
                raise _Died("ranks failed differently (the group may be broken): "
                            + "; ".join(f"rank {r}: {m}" for r, m in sorted(errs.items())))
            rep = pickle.loads(got[0][1])
            rep = finish_report(rep, cfg["verify"])
            rep["id"] = cid
            emit(rep)
    except _Died as e:
        print(f"bench worker: {e}", file=sys.stderr, flush=True)
        status = 3
    except BrokenPipeError:  # the reader of the protocol lines is gone (the tuner ended): nothing to report to
        status = 3
    except KeyboardInterrupt:
        status = 130
    finally:
        for q in inqs:
            try:
                q.put(None)
            except Exception:  # broad: best effort while shutting the ranks down
                pass
        for p in procs:
            p.join(timeout=5 if status == 0 else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moetune.tuner.measure.worker", description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds any collective may wait before failing")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="end (the ranks with it) once this process, the worker's parent, is gone")
    a = ap.parse_args(argv)
    if a.world < 1:
        ap.error("--world must be >= 1")
    return serve(a.world, a.backend, a.timeout, parent_pid=a.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
