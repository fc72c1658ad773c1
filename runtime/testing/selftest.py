"""Multi-GPU self-checks of the one-sided transports (used by tests/test_gpu_onesided.py and bench/tools/onesided_ep.py).

`spawn_world(fn, world, kwargs)` starts one process per GPU (NCCL process group over 127.0.0.1),
runs `fn(rank, world, **kwargs)` in each, and returns each rank's JSON-able result; a rank that raises
returns {"error": traceback}. The whole run is bounded by a timeout (processes are terminated).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetune.runtime.knobs import Knobs, default_knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.testing.bounds import BF16_LAYER_REL_ERR_BOUND
from moetune.runtime.testing.launch import destroy_group_quietly, free_port, init_dist
from moetune.runtime.transports._onesided import all_ok

GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], kwargs: dict, outdir: str) -> None:
    for k, v in GPU_ENV.items():
        os.environ.setdefault(k, v)
    res: Any
    try:
        init_dist(rank, world, backend="nccl", port=port)
        res = fn(rank, world, **kwargs)
    except BaseException:
        res = {"error": traceback.format_exc()}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(res, default=str))
    destroy_group_quietly()


def spawn_world(fn: Callable[..., Any], world: int, kwargs: dict | None = None, *, timeout_s: float = 300) -> list[Any]:
    import torch.multiprocessing as mp

    for k, v in GPU_ENV.items():
        os.environ.setdefault(k, v)
    with tempfile.TemporaryDirectory(prefix="moetune_spawn_") as outdir:
        ctx = mp.start_processes(
            _entry, args=(world, free_port(), fn, kwargs or {}, outdir), nprocs=world, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
        except Exception as e:  # a rank died: collect what we have
            last = f"{type(e).__name__}: {e}"
        else:
            last = ""
        # never leave a rank behind (a dead peer would keep the others blocked in NCCL)
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        out = []
        for r in range(world):
            f = Path(outdir, f"rank{r}.json")
            if f.exists():
                out.append(json.loads(f.read_text()))
            else:
                why = f"timed out after {timeout_s:.0f} s" if timed_out else (last or "no result")
                out.append({"error": f"rank {r}: {why}"})
        return out


def barrier(device: torch.device) -> None:
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize(device)


def _agree(err: str | None, device: torch.device) -> bool:
    """All ranks learn whether any failed (keeps collectives in step). True = all fine."""
    return all_ok(not err, None, device)


def transport_class(name: str) -> type:
    from moetune.runtime.transports.nvlink import NvlinkTransport
    from moetune.runtime.transports.proxy import ProxyTransport

    return {"nvlink": NvlinkTransport, "proxy": ProxyTransport}[name]


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'knob=v,knob=v|hidden=1025|fused' -> ('knob=v,knob=v', {'hidden': '1025', 'fused': ''})."""
    kspec, *opts = spec.split("|")
    out = {}
    for o in opts:
        k, _, v = o.partition("=")
        out[k.strip()] = v.strip()
    return kspec, out


def knobs_for(transport: str, spec: str) -> Knobs:
    return Knobs.parse(split_spec(spec)[0], base=default_knobs(transport))


def _ref_exchange(send: torch.Tensor, sc: list[int], rc: list[int]) -> torch.Tensor:
    out = torch.empty((sum(rc), *send.shape[1:]), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(out, send, output_split_sizes=rc, input_split_sizes=sc)
    return out


def check_exchange_worker(
    rank: int, world: int, *, transport: str, variants: list[str], iters: int = 40, max_rows: int = 512,
    hidden: int = 2048, seed: int = 0,
) -> list[dict]:
    """Random counts and data, poisoned receive buffers, equality to NCCL's all_to_all_single."""
    device = torch.device("cuda", rank)
    cls = transport_class(transport)
    results = []
    for spec in variants:
        rec: dict[str, Any] = {"transport": transport, "knobs": spec, "iters": 0, "mismatch_iters": 0,
                               "count_mismatch_iters": 0, "poison_overwritten_iters": 0, "error": None}
        t = None
        try:
            cerr = None
            try:
                # "knobs|hidden=N|fused": another row size (odd: byte-copy path) / nvlink's fused dispatch
                _, opts = split_spec(spec)
                h = int(opts.get("hidden", hidden))
                fused = "fused" in opts
                knobs = knobs_for(transport, spec)
                # "|symm=ipc": the CUDA IPC fallback instead of torch symmetric memory
                options = RuntimeOptions.resolve({"symm": opts["symm"]} if "symm" in opts else None)
                t = cls(None, knobs, device, max_send_rows=max_rows, row_bytes=h * 2, options=options)
                rec["symm_backend"] = t.symm_backend
                rec["symm_torch_error"] = t.ctrl.torch_error or None
                if opts.get("hostwait") == "0" and transport == "proxy":  # run 1's asynchronous proxy calls
                    t.host_wait = False
                    t.lib.mt_pxy_set_host_wait(t._h, 0)
            except Exception:
                cerr = traceback.format_exc()[-3000:]
            if not _agree(cerr, device):
                raise RuntimeError(cerr or "construction failed on another rank")
            g = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
            for it in range(iters):
                # counts: sometimes zero for a peer, total <= max_rows
                cnt = torch.randint(0, max_rows // world + 1, (world,), generator=g)
                if it % 5 == 0:
                    cnt[torch.randint(0, world, (1,), generator=g)] = 0
                sc = cnt.tolist()
                send = torch.randn(sum(sc), h, generator=g).to(torch.bfloat16).to(device)
                sc_dev = cnt.to(device)
                assert t.data is not None
                t.data.local.fill_(0xFF)  # poison both parity areas (bf16 0xFFFF = NaN)
                barrier(device)
                # dense reference first (NCCL), so every rank runs the same collectives even if the
                # transport fails on one of them
                rc_ref = torch.empty(world, dtype=torch.int64, device=device)
                dist.all_to_all_single(rc_ref, sc_dev.clone())
                rc_list = rc_ref.tolist()
                total = sum(rc_list)
                ref = _ref_exchange(send, sc, rc_list).view(torch.int16)
                err = None
                try:
                    if fused:
                        out, rc_dev = t.exchange_fused(send, sc_dev)
                    else:
                        rc_dev = t.exchange_counts(sc_dev)
                        out = t.exchange(send, sc_dev, rc_dev)
                    # consumer reads right after the exchange, stream-ordered (no host sync in between)
                    got = out[:total].view(torch.int16).clone()
                    tail = out[total : total + 8].view(torch.int16).clone()
                    torch.cuda.synchronize(device)
                    t.check()
                    if rc_dev.tolist() != rc_list:
                        rec["count_mismatch_iters"] += 1
                    if not torch.equal(got, ref):
                        rec["mismatch_iters"] += 1
                        if "first_mismatch" not in rec:
                            bad = (got != ref).any(dim=1).nonzero().flatten()
                            rec["first_mismatch"] = {"iter": it, "rows_bad": int(bad.numel()),
                                                     "first_rows": bad[:8].tolist(), "total": total,
                                                     "send_counts": sc, "recv_counts": rc_list}
                    if tail.numel() and not bool((tail == -1).all()):
                        rec["poison_overwritten_iters"] += 1
                    rec["iters"] += 1
                except Exception:
                    err = traceback.format_exc()[-3000:]
                # all ranks agree whether to go on (keeps the collectives in step after a failure)
                flag = torch.tensor([1.0 if err else 0.0], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if err:
                    rec["error"] = err
                if flag.item() > 0:
                    rec["error"] = rec["error"] or f"stopped at iteration {it}: another rank failed"
                    break
            if transport == "proxy":
                rec["proxy_stats"] = t.proxy_stats()
        except Exception:
            rec["error"] = traceback.format_exc()[-3000:]
        finally:
            _close_quietly(t)
        results.append(rec)
    return results


def _close_quietly(t: Any) -> None:
    """Close transport `t` (None: nothing built) after a worker's case; a failing close never hides the case's own
    result or error."""
    if t is not None:
        try:
            t.close()
        except Exception:
            pass


def _one_exchange(t: Any, send: torch.Tensor, sc: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """One counts + exchange call of transport `t` to its verdict: {"raised": False}, or the OneSidedError's message."""
    from moetune.runtime.transports._onesided import OneSidedError

    try:
        rc = t.exchange_counts(sc)
        t.exchange(send, sc, rc)
        torch.cuda.synchronize(device)
        t.check()
    except OneSidedError as e:
        return {"raised": True, "message": str(e)}
    return {"raised": False}


def _per_transport(transports: tuple[str, ...], device: torch.device, timeout_s: float, max_send_rows: int,
                   call: Callable[[Any, dict[str, Any]], None]) -> dict:
    """{transport: its result}: each transport built with its default knobs on `device`, then `call(t, res)`
    fills `res` ({"raised": False} to start; a traceback under "error" when anything raised) and closes `t`."""
    options = RuntimeOptions.resolve({"onesided_timeout_s": timeout_s})
    out: dict[str, Any] = {}
    for name in transports:
        res: dict[str, Any] = {"raised": False}
        try:
            call(transport_class(name)(None, default_knobs(name), device, max_send_rows=max_send_rows, row_bytes=256,
                                       options=options), res)
        except Exception:
            res["error"] = traceback.format_exc()[-2000:]
        out[name] = res
    return out


def timeout_worker(rank: int, world: int, *, transports: tuple[str, ...] = ("nvlink", "proxy")) -> dict:
    """Rank 0 exchanges alone: it must raise OneSidedError within the timeout instead of hanging."""
    device = torch.device("cuda", rank)

    def call(t: Any, res: dict[str, Any]) -> None:
        barrier(device)
        if rank == 0:
            t0 = time.monotonic()
            send = torch.zeros(world, 128, dtype=torch.bfloat16, device=device)
            sc = torch.ones(world, dtype=torch.int64, device=device)
            res.update(_one_exchange(t, send, sc, device))
            res["seconds"] = time.monotonic() - t0
        barrier(device)
        t.close()  # the aborted kernels have returned: this must not hang either

    return _per_transport(transports, device, 2.0, 64, call)


def capacity_worker(rank: int, world: int, *, transports: tuple[str, ...] = ("nvlink", "proxy")) -> dict:
    """Every rank sends a whole receive area's rows to rank 0: each passes the host's per-sender check, together they
    overflow rank 0. Every rank must raise OneSidedError with the capacity error: rank 0 from its own check of what
    all ranks send it (it received only some of the rows), the others from the sender's check of their own rows."""
    device = torch.device("cuda", rank)

    def call(t: Any, res: dict[str, Any]) -> None:
        cap = t.data_bytes // 256  # rows of one receive area (world x 16, rounded up to the allocation's pages)
        res["capacity_rows"] = cap
        barrier(device)
        send = torch.full((cap, 128), float(rank), dtype=torch.bfloat16, device=device)
        sc = torch.zeros(world, dtype=torch.int64, device=device)
        sc[0] = cap
        res.update(_one_exchange(t, send, sc, device))
        barrier(device)
        t.close()

    return _per_transport(transports, device, 5.0, 16, call)


_REFUSAL_H = 128  # bf16 columns of the refusal worker's rows (256 bytes)
_GATHER_ROW, _GATHER_IDS, _GATHER_W = 288, 256, 264  # its gathered wire rows: payload, one int64 id, one fp32 weight


def _refusal_call(t: Any, case: str, rank: int, world: int, call: int, bad: bool,
                  device: torch.device) -> tuple[Callable[[], Any], int, Callable[[int], torch.Tensor]]:
    """Call `call` of the refusal worker's `case` on this rank: (the transport call, its row bytes, the rows source s
    sends this rank as uint8 [2, row bytes]). Every rank sends 2 rows to each rank, all holding 16 * call + s; `bad`:
    this rank's counts run past its send rows (span, strided), or its first row gathers a token outside x (gather)."""
    v = float(16 * call + rank)
    sc = torch.full((world,), 2, dtype=torch.int64, device=device)
    rc = sc.clone()
    if bad and case != "gather":
        sc[world - 1] += 3

    def rows_of(s: int) -> torch.Tensor:
        payload = torch.full((2, _REFUSAL_H), float(16 * call + s), dtype=torch.bfloat16).view(torch.uint8)
        if case != "gather":
            return payload.to(device)
        row = torch.zeros(2, _GATHER_ROW, dtype=torch.uint8)
        row[:, : _REFUSAL_H * 2] = payload
        row[:, _GATHER_IDS : _GATHER_IDS + 8] = torch.tensor([s], dtype=torch.int64).view(torch.uint8)
        row[:, _GATHER_W : _GATHER_W + 4] = torch.tensor([float(s)], dtype=torch.float32).view(torch.uint8)
        return row.to(device)

    if case == "span":
        send = torch.full((2 * world, _REFUSAL_H), v, dtype=torch.bfloat16, device=device)
        return (lambda: t.exchange(send, sc, rc)), 2 * _REFUSAL_H, rows_of
    if case == "strided":  # the payload columns of wider rows, read in place (combine's path)
        wide = torch.full((2 * world, 2 * _REFUSAL_H), v, dtype=torch.bfloat16, device=device)
        return (lambda: t.exchange_strided(wide[:, :_REFUSAL_H], sc, rc)), 2 * _REFUSAL_H, rows_of
    tokens = 2 * world
    x = torch.full((tokens, _REFUSAL_H), v, dtype=torch.bfloat16, device=device)
    tok = torch.arange(tokens * world, dtype=torch.int64, device=device) % tokens
    if bad:
        tok[0] = tokens  # one past x's rows
    idx = torch.full((tokens, 1), rank, dtype=torch.int64, device=device)
    w = torch.full((tokens, 1), float(rank), dtype=torch.float32, device=device)
    return (lambda: t.dispatch_gather(x, tok, idx, w, sc, row_bytes=_GATHER_ROW, id_off=_GATHER_IDS,
                                      weight_off=_GATHER_W)), _GATHER_ROW, rows_of


def refusal_worker(rank: int, world: int, *, transports: tuple[str, ...] = ("nvlink", "proxy"),
                   timeout_s: float = 20.0) -> dict:
    """Calls 1..4 of each case (nvlink: a packed send, a strided one, the gather from tokens; proxy: a packed send),
    every receive area poisoned (0xFF) before each: call 2 is refused by rank 0 (its counts run past its send rows; the
    gather: a token outside x). Per call and rank: whether it raised, the message, the seconds to its verdict, whether
    the receive area holds exactly the rows of the ranks that did not refuse (none when this rank refused) and 0xFF
    after them, and the received counts (the gather). Between calls 2 and 3 every rank runs clear_error()."""
    from moetune.runtime.transports._onesided import OneSidedError

    device = torch.device("cuda", rank)
    options = RuntimeOptions.resolve({"onesided_timeout_s": timeout_s})
    out: dict[str, Any] = {}
    for name in transports:
        for case in ("span", "strided", "gather") if name == "nvlink" else ("span",):
            recs: list[dict[str, Any]] = []
            t = None
            try:
                t = transport_class(name)(None, default_knobs(name), device, max_send_rows=4 * world,
                                          row_bytes=_GATHER_ROW, options=options)
                for call in (1, 2, 3, 4):
                    refusing = {0} if call == 2 else set()
                    fn, rb, rows_of = _refusal_call(t, case, rank, world, call, rank in refusing, device)
                    t.data.local.fill_(0xFF)
                    barrier(device)
                    rec: dict[str, Any] = {"call": call, "raised": False}
                    t0 = time.monotonic()
                    result = None
                    try:
                        result = fn()
                        torch.cuda.synchronize(device)
                        t.check()
                    except OneSidedError as e:
                        rec.update(raised=True, message=str(e))
                    torch.cuda.synchronize(device)
                    rec["seconds"] = time.monotonic() - t0
                    if case == "gather" and result is not None:
                        rec["recv_counts"] = result[1].tolist()
                    par = t._epoch & 1
                    area = t.data.local[par * t.data_bytes : (par + 1) * t.data_bytes]
                    area = area[: t.data_bytes // rb * rb].view(-1, rb)
                    want = [rows_of(s) for s in range(world) if s not in refusing] if rank not in refusing else []
                    n = 2 * len(want)
                    rec["area_ok"] = bool((not want or torch.equal(area[:n], torch.cat(want)))
                                          and bool((area[n:] == 0xFF).all()))
                    barrier(device)
                    if call == 2:
                        try:
                            t.clear_error()
                            rec["cleared"] = True
                        except OneSidedError as e:
                            rec["cleared"] = f"clear_error raised: {e}"
                        barrier(device)
                    recs.append(rec)
                out[f"{name}_{case}"] = recs
            except Exception:
                out[f"{name}_{case}"] = {"error": traceback.format_exc()[-2000:], "calls": recs}
            finally:
                _close_quietly(t)
    return out


def refusal_rules_worker(rank: int, world: int, *, transports: tuple[str, ...] = ("nvlink", "proxy"),
                         timeout_s: float = 20.0) -> dict:
    """exchange_counts with a negative count, per transport (world 1: the refusing rank's own side): refused in its
    own words (slot 3), clear_error succeeds (it is the last call), and the next exchange moves its rows exactly. (A
    refusal followed by another call launched before clearing is refused by clear_error: host simulation,
    tests/test_proxy_refusal.py; through this API each call checks the record first, so such a call is not
    launched once the refusal is seen.)"""
    from moetune.runtime.transports._onesided import OneSidedError

    device = torch.device("cuda", rank)
    options = RuntimeOptions.resolve({"onesided_timeout_s": timeout_s})
    out: dict[str, Any] = {}
    for name in transports:
        rec2: dict[str, Any] = {}
        t = None
        try:
            t = transport_class(name)(None, default_knobs(name), device, max_send_rows=4 * world, row_bytes=64,
                                      options=options)
            neg = torch.full((world,), 2, dtype=torch.int64, device=device)
            neg[0] = -1
            try:
                t.exchange_counts(neg)
                torch.cuda.synchronize(device)
                t.check()
                rec2["b_refused"] = False
            except OneSidedError as e:
                rec2["b_refused"] = str(e)[:300]
            try:
                t.clear_error()
                rec2["b_clear"] = "cleared"
            except OneSidedError as e:
                rec2["b_clear"] = str(e)[:400]
            send = torch.arange(2 * world * 32, device=device).to(torch.bfloat16).view(2 * world, 32)
            good = torch.full((world,), 2, dtype=torch.int64, device=device)
            res = t.exchange(send, good, good)
            torch.cuda.synchronize(device)
            t.check()
            got = res if isinstance(res, torch.Tensor) else res[0]
            rec2["b_next_exact"] = bool(torch.equal(got[: 2 * world].reshape(-1).view(torch.uint8)[: send.numel() * 2],
                                                    send.reshape(-1).view(torch.uint8)))
        except Exception:
            rec2["error"] = traceback.format_exc()[-2000:]
        finally:
            _close_quietly(t)
        out[name + "_counts"] = rec2
    return out


def proxy_capture_worker(rank: int, world: int, *, timeout_s: float = 20.0) -> dict:
    """The proxy transport inside a CUDA-graph capture (world 1 on the real kernels): exchange and exchange_counts
    are refused before anything is launched (a replay would reuse the captured call's epoch and read rows before
    they land), the capture ends without a launch in it, and the eager exchanges before and after are exact."""
    from moetune.runtime.transports._onesided import OneSidedError

    device = torch.device("cuda", rank)
    options = RuntimeOptions.resolve({"onesided_timeout_s": timeout_s})
    out: dict[str, Any] = {}
    t = None
    try:
        t = transport_class("proxy")(None, default_knobs("proxy"), device, max_send_rows=4 * world, row_bytes=64,
                                     options=options)
        send = torch.arange(2 * world * 32, device=device).to(torch.bfloat16).view(2 * world, 32)
        good = torch.full((world,), 2, dtype=torch.int64, device=device)

        def exact() -> bool:
            res = t.exchange(send, good, good)
            torch.cuda.synchronize(device)
            t.check()
            got = res if isinstance(res, torch.Tensor) else res[0]
            return bool(torch.equal(got[: 2 * world].reshape(-1).view(torch.uint8)[: send.numel() * 2],
                                    send.reshape(-1).view(torch.uint8)))

        out["before_exact"] = exact()
        for what, call in (("exchange", lambda: t.exchange(send, good, good)),
                           ("exchange_counts", lambda: t.exchange_counts(good))):
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(device)
            try:
                with torch.cuda.graph(g, stream=side):
                    call()
                out[what] = "captured"
            except OneSidedError as e:
                out[what] = str(e)[:300]
            except Exception as e:  # the capture itself failed: a launch reached it
                out[what] = f"other: {type(e).__name__}: {str(e)[:300]}"
        out["after_exact"] = exact()
    except Exception:
        out["error"] = traceback.format_exc()[-2000:]
    finally:
        _close_quietly(t)
    return out


def _graph_replay_equal(buf: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, want: torch.Tensor,
                        device: torch.device) -> bool:
    """dispatch + combine captured in one CUDA graph; replayed 3 times, each after poisoning the receive
    buffer (0xFF bytes: NaN), must give the eager result bit for bit (a replay that moved nothing cannot).
    Captured unchecked: the cross-rank input checks sync with the host, which a graph cannot."""
    checked, buf.check_inputs = buf.check_inputs, False
    try:
        return _graph_replay_equal_unchecked(buf, x, idx, w, want, device)
    finally:
        buf.check_inputs = checked


def _graph_replay_equal_unchecked(buf: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, want: torch.Tensor,
                                  device: torch.device) -> bool:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            recv_x, _meta, h = buf.dispatch(x, idx, w)
            buf.combine(recv_x, h)
    torch.cuda.current_stream(device).wait_stream(side)
    barrier(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        recv_x, _meta, h = buf.dispatch(x, idx, w)
        out = buf.combine(recv_x, h)
    ok = True
    for _ in range(3):
        barrier(device)
        buf.transport.data.local.fill_(255)
        barrier(device)
        g.replay()
        torch.cuda.synchronize(device)
        ok = ok and bool(torch.equal(out, want))
    barrier(device)
    return ok


def epbuffer_worker(rank: int, world: int, *, transports: tuple[str, ...] = ("nvlink", "proxy"), iters: int = 5,
                    model: str = "qwen3-30b", tokens: int = 256,
                    layer_bound: float = BF16_LAYER_REL_ERR_BOUND) -> dict:
    """Through the runtime's EPBuffer: dispatch + identity experts + combine with a one-sided transport
    must equal the same with the `collective` transport bit for bit, and the whole MoE layer on the
    one-sided transport must match the single-process dense reference (max rel. error <= layer_bound,
    the runtime issue's bf16 bound: `bounds.BF16_LAYER_REL_ERR_BOUND`)."""
    from moetune.runtime import shapes
    from moetune.runtime.buffer.facade import EPBuffer
    from moetune.runtime.moe_layer import MoELayer, dense_reference, max_rel_err

    device = torch.device("cuda", rank)
    m = shapes.get_model(model)
    out: dict[str, Any] = {}
    g = torch.Generator(device="cpu").manual_seed(100 + rank)
    ref_buf = EPBuffer(None, default_knobs("collective"), model=m, max_tokens=tokens, device=device,
                      dense=False)  # the same packed layout the one-sided transports use
    try:
        for name in transports:
            rec: dict[str, Any] = {"iters": 0, "max_abs_diff": 0.0, "layer_rel_err": None, "layer_bound": layer_bound}
            buf = layer = None
            try:
                buf = EPBuffer(None, default_knobs(name), model=m, max_tokens=tokens, device=device)
                for it in range(iters):
                    s = tokens - 3 * it  # varying S (<= max_tokens)
                    x = torch.randn(s, m.hidden, generator=g).to(torch.bfloat16).to(device)
                    idx = torch.rand(s, m.experts, generator=g).topk(m.topk, dim=1).indices.to(device)
                    w = torch.rand(s, m.topk, generator=g).to(device)
                    results = []
                    for b in (ref_buf, buf):
                        recv_x, _meta, handle = b.dispatch(x, idx, w)
                        results.append(b.combine(recv_x, handle))
                        barrier(device)
                    diff = (results[0].float() - results[1].float()).abs().max().item()
                    rec["max_abs_diff"] = max(rec["max_abs_diff"], diff)
                    rec["iters"] += 1
                if type(buf.transport).graph_capturable:
                    rec["graph_equal"] = _graph_replay_equal(buf, x, idx, w, results[1], device)
                buf.close()
                buf = None
                # the MoE layer (SwiGLU experts) on this transport vs the dense single-process reference
                layer = MoELayer(m, knobs=default_knobs(name), max_tokens=tokens, device=device, seed=1)
                x = torch.randn(tokens, m.hidden, generator=g).to(torch.bfloat16).to(device)
                idx = torch.rand(tokens, m.experts, generator=g).topk(m.topk, dim=1).indices.to(device)
                w = torch.rand(tokens, m.topk, generator=g).softmax(1).to(device)
                got = layer.forward_routed(x, idx, w)
                ref = dense_reference(x, m, seed=1, topk_idx=idx, topk_weights=w)
                rec["layer_rel_err"] = max_rel_err(got, ref)
                rec["equal"] = (rec["max_abs_diff"] == 0.0 and rec["layer_rel_err"] <= layer_bound
                                and rec.get("graph_equal", True))
            except Exception:
                rec["error"] = traceback.format_exc()[-2000:]
            finally:
                for obj in (buf, getattr(layer, "buffer", None)):
                    if obj is not None:
                        try:
                            obj.close()
                        except Exception:
                            pass
            out[name] = rec
            barrier(device)
    finally:
        ref_buf.close()
    return out
