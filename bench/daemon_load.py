#!/usr/bin/env python3
"""Load test of the moetune daemon on loopback (CPU only), plus runtime start-up and fallback timings.

    python bench/daemon_load.py [--transport ipc|tcp] [--seconds 3] [--clients 1,16,64,256] [--out bench/results]

Starts `python -m moetune.tuner.daemon.server` on a tmp dir (ipc, or tcp 127.0.0.1 with allow_insecure_tcp for the
test), seeds a database with profiles (tests/daemon_fakes.py: the real Store when importable), then for each
client count N runs two phases with DEALER sockets spread over client processes (bounded: N <= 256,
each phase `--seconds` long):
  - closed loop: every client keeps one get_profile in flight (saturation throughput; latency = N / rate);
  - paced: the clients together are due to send `--rate` requests/s (open loop, Poisson-free fixed spacing); a
    socket keeps one request in flight and sends a slot that came due meanwhile when its reply comes, and every
    latency is timed from the request's scheduled send time, so queueing in the daemon (and a client that falls
    behind) shows in p99 instead of being skipped (no coordinated omission); the requests scheduled in the phase
    are waited for (up to 2 s after it, else counted unanswered).
Latency is measured by the client: send (closed loop) or scheduled send (paced) -> reply. Only ok replies are
timed and counted in req/s; error replies and unanswered requests are counted apart (`errors`, `unanswered`).
Then:
  - runtime start with the daemon up: `autoload_knobs` timed in a fresh process (imports timed apart);
  - daemon down: the fallback chain (no socket file; a stale socket file; tcp with nobody listening).
Writes bench/results/<date>_daemon_load.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

BODY = b'{"v":1,"id":%d,"op":"get_profile","ep_size":2,"tokens":3000,"model":"qwen3-30b"}'


def _client_proc(endpoint: str, n_socks: int, seconds: float, rate: float, start_at: float, q: mp.Queue,
                 cpus: set[int] | None = None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)  # before the ZeroMQ I/O thread exists: it inherits the mask
    import zmq

    ctx = zmq.Context()
    socks = []
    for _ in range(n_socks):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(endpoint)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    # warm the connections
    for s in socks:
        s.send(BODY % 0)
    for s in socks:
        s.recv()
    while time.time() < start_at:
        time.sleep(0.001)
    lat: list[float] = []  # ok replies only: an error reply is no answer, however fast
    errors = 0
    perf = time.perf_counter
    t0 = perf()
    end = t0 + seconds
    sent = 0
    if rate <= 0:  # closed loop
        sent_at = {}
        for i, s in enumerate(socks):
            sent_at[s] = perf()
            s.send(BODY % i)
            sent += 1
        while True:
            now = perf()
            if now >= end:
                break
            for s, _ in poller.poll(max(1, int((end - now) * 1000))):
                rep = s.recv()
                t = perf()
                if b'"ok":true' in rep:
                    lat.append(t - sent_at[s])
                else:
                    errors += 1
                if t < end:
                    sent_at[s] = perf()
                    s.send(BODY % sent)
                    sent += 1
        wall = perf() - t0
        unanswered = 0  # the requests in flight at the end are cut off by the end of the phase, not unanswered
        # drain in-flight replies so the daemon is idle for the next phase
        deadline = perf() + 1
        while perf() < deadline and poller.poll(50):
            for s, _ in poller.poll(0):
                s.recv()
    else:
        # paced: each socket is due to send every n_socks/rate s, staggered, whatever the replies do (the schedule is
        # the open loop). A socket keeps at most one request in flight, as the runtime's client does (and the
        # daemon drops replies past a per-peer queue): a slot that comes due while it waits is queued and sent
        # when the reply comes. Every latency is timed from the request's scheduled send time, so a daemon that
        # falls behind shows its queueing in p99 (skipping a busy socket's slot and timing from the actual send
        # hid it: coordinated omission).
        import heapq
        from collections import deque

        period = n_socks / rate
        heap = [(t0 + i * period / n_socks, i) for i in range(n_socks)]
        heapq.heapify(heap)
        index = {s: i for i, s in enumerate(socks)}
        backlog: list[deque[float]] = [deque() for _ in socks]  # scheduled times not sent yet, per socket
        in_flight: dict[int, float] = {}  # socket -> the scheduled time of its request in flight

        def send_next(i: int) -> None:
            nonlocal sent
            in_flight[i] = backlog[i].popleft()
            sent += 1
            socks[i].send(BODY % sent)

        last = t0  # the last reply: req/s is the rate served, replies after the phase's sends included
        drain_end = end + 2.0  # the requests scheduled in the phase still owed a reply: waited for, then unanswered
        while True:
            now = perf()
            if now >= end and (not in_flight or now >= drain_end):
                break
            while now < end and heap and heap[0][0] <= now:
                due, i = heapq.heappop(heap)
                backlog[i].append(due)
                if i not in in_flight:
                    send_next(i)
                heapq.heappush(heap, (due + period, i))
            # block at least 1 ms when nothing is due (a spinning client would steal the daemon's core); sends due
            # meanwhile go out together, late by < 1 ms, and that lateness counts in their latency
            wait = (heap[0][0] - perf()) if heap and now < end else 0.005
            for s, _ in poller.poll(max(1, min(int(wait * 1000) + 1, 5))):
                rep = s.recv()
                t = last = perf()
                i = index[s]
                due = in_flight.pop(i)
                if b'"ok":true' in rep:
                    lat.append(t - due)
                else:
                    errors += 1
                if backlog[i]:
                    send_next(i)
        wall = max(end, last) - t0
        unanswered = len(in_flight) + sum(len(b) for b in backlog)  # in flight, or never sent: no reply in time
        sent += sum(len(b) for b in backlog)  # `sent` of a paced phase: every request scheduled in it
    for s in socks:
        s.close(0)
    ctx.term()
    q.put({"lat": lat, "errors": errors, "unanswered": unanswered, "sent": sent, "wall": wall})


def latency_us(lat_sorted: list[float], p: float) -> float:
    """The p-quantile (0..1) of sorted latencies in seconds, in µs (one decimal), as every timing in summary.csv has
    it (tuner/measure/stats.py: linear interpolation between the sorted samples); NaN for none. It took the sample
    at rank int(p * n): another statistic than the other scenarios' beside it (of 0..9 ms, a p50 of 5 ms, not 4.5)."""
    from moetune.tuner.measure.stats import quantile

    return round(quantile(lat_sorted, p) * 1e6, 1) if lat_sorted else float("nan")


def run_phase(endpoint: str, clients: int, seconds: float, rate: float, procs: int, cpus: set[int] | None = None) -> dict:
    procs = max(1, min(procs, clients))
    share = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    q: mp.Queue = mp.Queue()
    start_at = time.time() + 0.5 + clients * 0.004
    ps = [mp.Process(target=_client_proc, args=(endpoint, n, seconds, rate * n / clients if rate > 0 else 0, start_at, q, cpus))
          for n in share]
    for p in ps:
        p.start()
    results = [q.get(timeout=seconds + 60) for _ in ps]
    for p in ps:
        p.join(10)
    lat = sorted(x for r in results for x in r["lat"])
    n = len(lat)
    wall = max(r["wall"] for r in results)

    def pct(p: float) -> float:
        return latency_us(lat, p)

    # requests / req_per_s / the latencies: ok replies only; errors (error replies) and unanswered apart
    return {"clients": clients, "mode": "closed" if rate <= 0 else "paced", "target_rate": rate or None,
            "client_procs": procs, "sent": sum(r["sent"] for r in results), "requests": n,
            "errors": sum(r["errors"] for r in results), "unanswered": sum(r["unanswered"] for r in results),
            "seconds": round(wall, 3), "req_per_s": round(n / wall, 1) if wall else 0.0,
            "p50_us": pct(0.50), "p90_us": pct(0.90), "p99_us": pct(0.99), "max_us": pct(1.0)}


AUTOLOAD_SNIPPET = r"""
import time, json, sys, warnings
t_pkg = time.perf_counter()
import moetune.runtime  # the runtime package itself (torch, ...) is imported by any EP program anyway
from moetune.runtime.shapes import MODELS
import gc
gc.collect()  # do not charge the client import for a full collection of torch's objects that is due anyway
t0 = time.perf_counter()
from moetune.runtime.profiles.autoload import autoload_profile  # what the daemon client adds: pyzmq, wire schemas
t1 = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    r = autoload_profile(model=MODELS["qwen3-30b"], ep_size=2, nodes=1, max_tokens=3000)
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "runtime_pkg_ms": (t0 - t_pkg) * 1e3, "autoload_ms": (t2 - t1) * 1e3,
                  "source": r.source}))
"""


def _cpu_s(pid: int) -> float:
    """user+system CPU seconds of a process (all its threads, incl. the ZeroMQ I/O thread)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def time_autoload(env: dict, runs: int = 5) -> list[dict]:
    """Fresh processes; the first (discarded) one writes the bytecode caches, as an installed package has them
    (this machine exports PYTHONDONTWRITEBYTECODE=1, which would charge every import for compiling)."""
    env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = []
    for i in range(runs + 1):
        p = subprocess.run([sys.executable, "-c", AUTOLOAD_SNIPPET], env=env, capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-2000:])
        if i:
            out.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return out


def summarize(xs: list[dict], key: str) -> dict:
    """Median (of an even count, the mean of the middle two: it took the upper one) and max of the runs' `key`."""
    import statistics

    v = sorted(x[key] for x in xs)
    return {"median_ms": round(statistics.median(v), 2), "max_ms": round(v[-1], 2), "runs": len(v)}


def main() -> int:
    from moetune.runtime.testing.launch import free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clients", default="1,16,64,256")
    ap.add_argument("--rate", type=float, default=10000.0, help="aggregate request rate of the paced phase")
    ap.add_argument("--procs", type=int, default=1, help="client processes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="wait up to this many seconds for the 1-min load average to drop below --quiet-load")
    ap.add_argument("--quiet-load", type=float, default=1.0)
    ap.add_argument("--pin", action="store_true",
                    help="pin the daemon (all its threads) to CPU 0 and the client processes to the other CPUs")
    ap.add_argument("--nice", type=int, default=0, help="os.nice() increment for the bench and the daemon it starts")
    ap.add_argument("--no-autoload", action="store_true",
                    help="skip the runtime start-up / fallback timings (a smoke run of the load phases only)")
    a = ap.parse_args()
    if a.nice:
        os.nice(a.nice)
    deadline = time.time() + a.wait_quiet
    while time.time() < deadline and os.getloadavg()[0] >= a.quiet_load:
        time.sleep(5)
    load_before = os.getloadavg()

    import daemon_fakes as F

    # the database, the capture, the daemon's log and sockets: removed when the run ends, failed or not
    with tempfile.TemporaryDirectory(prefix="moetune-bench-", ignore_cleanup_errors=True) as tmp_dir:
        tmp = Path(tmp_dir)
        facts = F.make_capture(tmp / "capture")
        store = F.open_store(tmp / "moetune.db")
        F.seed_profiles(store, facts)
        del store
        if a.transport == "tcp":
            port = free_port()
            endpoint, extra = f"tcp://127.0.0.1:{port}", ["--allow-insecure-tcp", "--pub-socket", f"ipc://{tmp}/run/events.sock"]
        else:
            endpoint, extra = None, []
        d = F.DaemonProc(tmp, endpoint=endpoint, extra=extra, interval=0)
        phases = []
        client_cpus: set[int] | None = None
        try:
            d.wait_ready()
            if a.pin and (os.cpu_count() or 1) > 1:
                for tid in os.listdir(f"/proc/{d.proc.pid}/task"):
                    os.sched_setaffinity(int(tid), {0})
                client_cpus = set(range(1, os.cpu_count() or 2))
            for n in (int(x) for x in a.clients.split(",")):
                n = max(1, min(n, 256))
                for rate in (0.0, a.rate):
                    cpu0 = _cpu_s(d.proc.pid)
                    r = run_phase(d.endpoint, n, a.seconds, rate, a.procs, client_cpus)
                    cpu = _cpu_s(d.proc.pid) - cpu0
                    r["daemon_cpu_s"] = round(cpu, 3)
                    r["daemon_cpu_us_per_req"] = round(cpu / max(1, r["requests"]) * 1e6, 2)
                    r["daemon_rss_kb"] = d.rss_kb()
                    phases.append(r)
                    print(json.dumps(r), flush=True)
            env = dict(os.environ, MOETUNE_CLIENT_SOCKET=d.endpoint, MOETUNE_STORE_DB=str(d.db))
            # the runtime's client speaks TCP only with CURVE (plain text is a test-only argument autoload never
            # passes), so its start-up is timed on the ipc run only
            timed_autoload = not a.no_autoload and a.transport == "ipc"
            up = time_autoload(env) if timed_autoload else []
        finally:
            d.kill(15)
        auto = _time_fallbacks(tmp, d) if timed_autoload else None

    result = {
        "date": datetime.now(UTC).isoformat(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "platform": platform.platform()},
        "transport": a.transport,
        "nice": a.nice,
        "pinned": bool(client_cpus),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "note": "2-core shared CI box; other jobs may run at the same time (see loadavg); client processes run on the same cores as the daemon",
        "store": "moetune.tuner.store.store.Store",
        "phases": phases,
    }
    if auto is not None:
        result["autoload_daemon_up"] = {"call": summarize(up, "autoload_ms"), "import": summarize(up, "import_ms"),
                                        "runtime_package_import": summarize(up, "runtime_pkg_ms"),
                                        "sources": sorted({x["source"] for x in up})}
        result["autoload_daemon_down"] = auto
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{datetime.now(UTC):%Y-%m-%d}_daemon_load{'' if a.transport == 'ipc' else '_tcp'}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}")
    print("\n| clients | mode | req/s | p50 µs | p99 µs | daemon CPU µs/req |\n|---|---|---|---|---|---|")
    for r in phases:
        print(f"| {r['clients']} | {r['mode']} | {r['req_per_s']:.0f} | {r['p50_us']:.0f} | {r['p99_us']:.0f} "
              f"| {r['daemon_cpu_us_per_req']:.1f} |")
    print()
    print(f"load average before {result['loadavg_before']}, after {result['loadavg_after']}")
    print(f"{'clients':>7} {'mode':>6} {'req/s':>9} {'p50 us':>8} {'p99 us':>8} {'errors':>6} {'unanswered':>10} "
          f"{'cpu us/req':>10}")
    for r in phases:
        print(f"{r['clients']:>7} {r['mode']:>6} {r['req_per_s']:>9.0f} {r['p50_us']:>8.0f} {r['p99_us']:>8.0f} {r['errors']:>6}"
              f" {r['unanswered']:>10} {r['daemon_cpu_us_per_req']:>10.1f}")
    if auto is None:
        return 0
    au = result["autoload_daemon_up"]
    print(f"autoload, daemon up: call {au['call']['median_ms']} ms median; importing the client adds "
          f"{au['import']['median_ms']} ms (the runtime package itself: {au['runtime_package_import']['median_ms']} ms)")
    for k, v in result["autoload_daemon_down"].items():
        print(f"autoload, daemon down ({k}): {v['call']['median_ms']} ms median, {v['call']['max_ms']} ms max -> {v['sources']}")
    return 0


def _time_fallbacks(tmp: Path, d) -> dict:
    """The runtime's start-up with the daemon down: no socket file, a stale socket file (a daemon killed -9
    leaves one: connect is refused, the client waits its budget) and tcp with nobody listening (since the client
    refuses plain-text TCP, without a CURVE key configured that is a refusal before any connect)."""
    from moetune.runtime.testing.launch import free_port

    env = dict(os.environ, MOETUNE_CLIENT_SOCKET=d.endpoint, MOETUNE_STORE_DB=str(d.db))
    stale = tmp / "stale"
    stale.mkdir()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale / "daemon.sock"))
    s.close()
    runs = {"no_socket": time_autoload(env),
            "stale_socket": time_autoload(dict(env, MOETUNE_CLIENT_SOCKET=f"ipc://{stale / 'daemon.sock'}")),
            "tcp_nobody": time_autoload(dict(env, MOETUNE_CLIENT_SOCKET=f"tcp://127.0.0.1:{free_port()}"))}
    return {k: {"call": summarize(v, "autoload_ms"), "sources": sorted({x["source"] for x in v})} for k, v in runs.items()}


if __name__ == "__main__":
    sys.exit(main())
