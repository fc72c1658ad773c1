"""bench/daemon_load.py's client loops against a fake daemon (a ZeroMQ ROUTER in a thread, a fixed service time, no
moetune daemon): the paced phase is an open loop timed from each request's scheduled send time, and error replies
are counted apart from the latencies; the daemon-load driver fails a phase that had errors."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from moetune.tuner.measure import results as R
from moetune.tuner.measure.scenarios import checkout, definitions, runner
from moetune.tuner.measure.scenarios.drivers import scripts as bench_scripts

zmq = pytest.importorskip("zmq")


def _daemon_load() -> Any:
    spec = importlib.util.spec_from_file_location("daemon_load", checkout.ROOT / "bench" / "daemon_load.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _serve(endpoint: str, stop: threading.Event, service_s: float, fail_every: int, sent: dict[bool, int]) -> None:
    """Answer requests one at a time, each after `service_s`; every `fail_every`-th request id gets ok:false (`sent`
    counts the ok and error replies, the warm-up's ok one included)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(endpoint)
    while not stop.is_set():
        if not sock.poll(20):
            continue
        ident, body = sock.recv_multipart()
        rid = int(re.search(rb'"id":(\d+)', body).group(1))  # type: ignore[union-attr]
        time.sleep(service_s)
        ok = not (fail_every and rid and rid % fail_every == 0)
        sent[ok] = sent.get(ok, 0) + 1
        sock.send_multipart([ident, b'{"v":1,"id":%d,"ok":%s,"epoch":"e"}' % (rid, b"true" if ok else b"false")])
    sock.close(0)
    ctx.term()


def _client(tmp: Path, *, seconds: float, rate: float, service_s: float, fail_every: int = 0
            ) -> tuple[dict[str, Any], dict[bool, int]]:
    """What one client process of the bench reports against the fake daemon, and the replies the daemon sent."""
    mod = _daemon_load()
    endpoint = f"ipc://{tmp}/fake.sock"
    stop = threading.Event()
    replies: dict[bool, int] = {}
    server = threading.Thread(target=_serve, args=(endpoint, stop, service_s, fail_every, replies), daemon=True)
    server.start()
    got: list[dict[str, Any]] = []

    class Q:
        put = got.append

    try:
        mod._client_proc(endpoint, 1, seconds, rate, time.time(), Q())
    finally:
        stop.set()
        server.join(5)
    return got[0], replies


def test_paced_phase_is_an_open_loop_timed_from_the_schedule(tmp_path: Path) -> None:
    """200 requests/s offered to a daemon that serves 100/s: requests queue, and their latency grows to ~0.3 s by
    the end of a 0.6 s phase. A socket still waiting must not skip its send slot, nor latency be timed from the
    actual send: every request would read ~10 ms (the service time alone) and the queueing never show in p99."""
    r, replies = _client(tmp_path, seconds=0.6, rate=200.0, service_s=0.01)
    lat = sorted(r["lat"])
    assert lat[int(0.99 * len(lat))] > 0.15, lat[-5:]
    assert len(lat) == replies[True] - 1 >= 100, (len(lat), replies)  # every scheduled request went out, was waited for
    assert (r["sent"], r["unanswered"], r["errors"]) == (len(lat), 0, 0), r


def test_error_replies_are_counted_apart_from_the_latencies(tmp_path: Path) -> None:
    """Every third request is answered ok:false: those replies are counted apart, not timed into p50 / p99 and
    req/s."""
    for rate, service_s in ((100.0, 0.0), (0.0, 0.001)):  # paced, closed loop
        r, replies = _client(tmp_path, seconds=0.3, rate=rate, service_s=service_s, fail_every=3)
        missed = (replies[True] - 1 - len(r["lat"]), replies[False] - r["errors"])
        # the closed loop's one request in flight at the phase's end is neither timed nor counted
        assert replies[False] >= 5 and min(missed) >= 0 and sum(missed) <= (0 if rate else 1), (rate, missed, replies)


def test_a_phase_with_errors_fails_its_latency_metrics(tmp_path: Path, monkeypatch) -> None:
    """daemon_metrics ignored `errors`: a phase whose daemon answered with errors showed its p99 as a result."""
    phase = {"clients": 64, "mode": "paced", "p99_us": 545.0, "p50_us": 190.0, "max_us": 2505.0, "requests": 990,
             "req_per_s": 9990.0, "errors": 0, "unanswered": 0, "sent": 990}
    doc = {"phases": [{**phase, "clients": 1, "mode": "closed"}, {**phase, "clients": 64, "mode": "closed"},
                      {**phase, "errors": 7, "unanswered": 3, "sent": 1000}]}

    def fake_run(script: str, args: dict[str, Any], env: dict[str, str], ctx: Any) -> tuple[str, str]:
        Path(args["out"], "2026-12-05_daemon_load.json").write_text(json.dumps(doc))
        return "", "python bench/daemon_load.py"

    monkeypatch.setattr(bench_scripts, "run_script", fake_run)
    out = tmp_path / "s.csv"
    runner.run(definitions.get("daemon-load"), results=out, gpus=0, launches=1, fingerprint=lambda: "fp")
    rows = [r for r in R.read_rows(out) if r["position"] == "0"]
    by = {r["metric"]: r for r in rows}
    why = "c64-paced: 7 error replies and 3 unanswered of 1000 requests"
    assert by["p99_us[c64-paced]"]["note"].startswith(f"FAILED: {why}") and by["p99_us[c64-paced]"]["median"] == ""
    assert by["errors[c64-paced]"]["median"] == "10" and by["errors[c64-closed]"]["median"] == "0"
    assert by["p99_us[c64-closed]"]["median"] == "545" and by["p99_us[c64-closed]"]["note"].startswith(why)
    assert not [r for r in rows if r["metric"] == "p99_us[c64-paced]" and not r["note"].startswith("FAILED")]


class _FakeDaemonProc:
    """daemon_fakes.DaemonProc's surface main() uses, with no daemon: it writes its log into the bench's folder, as
    the real one does; `fail` makes wait_ready raise (a daemon that did not start)."""

    fail = False

    def __init__(self, tmp: Path, **_kw: Any) -> None:
        import os
        import types

        (tmp / "daemon.log").write_text("serving\n")
        self.endpoint, self.db = f"ipc://{tmp}/run/daemon.sock", tmp / "moetune.db"
        self.proc = types.SimpleNamespace(pid=os.getpid())

    def wait_ready(self) -> None:
        if self.fail:
            raise RuntimeError("daemon exited with 2")

    def rss_kb(self) -> int:
        return 1

    def kill(self, _sig: int = 9) -> None:
        pass


@pytest.mark.parametrize("fail", [False, True])
def test_a_run_removes_its_temp_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    """Each run made a moetune-bench-* folder (database, capture, daemon log) under the temp dir and left it there,
    also when it failed."""
    import sys
    import tempfile

    mod = _daemon_load()  # puts tests/ on sys.path, as the script runs
    import daemon_fakes

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(_FakeDaemonProc, "fail", fail)
    monkeypatch.setattr(daemon_fakes, "DaemonProc", _FakeDaemonProc)
    monkeypatch.setattr(daemon_fakes, "make_capture", lambda dest: (dest.mkdir(), None)[1])
    monkeypatch.setattr(daemon_fakes, "open_store", lambda path: path.write_text(""))
    monkeypatch.setattr(daemon_fakes, "seed_profiles", lambda store, facts: None)
    monkeypatch.setattr(mod, "run_phase", lambda *a, **kw: {"requests": 1, "clients": 1, "mode": "closed",
                                                           "req_per_s": 1.0, "p50_us": 1.0, "p99_us": 1.0,
                                                           "errors": 0, "unanswered": 0})
    monkeypatch.setattr(sys, "argv", ["daemon_load.py", "--clients", "1", "--seconds", "0", "--no-autoload",
                                      "--out", str(tmp_path / "out")])
    if fail:
        with pytest.raises(RuntimeError, match="daemon exited"):
            mod.main()
    else:
        assert mod.main() == 0
        assert len(list((tmp_path / "out").glob("*_daemon_load.json"))) == 1
    assert list(temp.iterdir()) == []
