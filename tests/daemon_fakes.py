"""Helpers of the daemon tests.

- `DaemonProc`: `python -m moetune.tuner.daemon.server` as a subprocess on a tmp dir (real Store, real discovery of a
  `--capture` copied from tests/captures); always killed by the test's teardown.
- `make_capture` / `set_port_state`: a capture to discover, and a scripted hardware change (an IB port goes down).
- `fake_retune(ctx)` (`--retune-hook`): writes one new profile per key on the new fabric, after sleeping
  MOETUNE_FAKE_JOB_SLEEP s (checking for cancellation): a job that can be held open for the kill -9 and
  cancel tests. The fabric-change and tuner tests use the real tuner.
- `retune_past_stop(ctx)` (`--retune-hook`): a re-tune that ignores cancellation and outlives the daemon's stop.
- `retune_commits_past_stop(ctx)` (`--retune-hook`): one that holds its write transaction past the stop's wait, then
  commits and ends `done` before the stop's own finish_run reaches the store.
- `retune_holds_its_transaction(ctx)` (`--retune-hook`): one that keeps its write transaction open, ignoring cancellation.
- `FakeFacts`: facts of some other fabric (only its fingerprint and software hash matter).
- `record_fabric_seen` / `record_fabric_change` / `unqueued_fabric_change`: the events a daemon writes when it
  discovers a fabric and when it changes (H200 -> H100), and a store a daemon killed inside a change left.
- `this_node_facts` / `this_node_fabric`: facts that describe THIS machine and process as the runtime's node check
  (`node_identity.mismatch`) reads them, and a `fabric` reply reporting them: what a fake daemon must answer for
  the profiles it serves (keyed with `this_node_software()`) to be applied as tuned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, provenance_of_backend


def assert_one_current_profile_per_key(path: str | Path) -> None:
    """The store's unique index on current keys holds (e.g. after a migration copied the profiles table): making a
    superseded profile current again beside its key's current one is refused by SQLite."""
    import sqlite3

    import pytest

    with pytest.raises(sqlite3.IntegrityError):
        c = sqlite3.connect(path)
        try:
            c.execute("UPDATE profiles SET status = 'current' WHERE status = 'superseded'")
        finally:
            c.close()


def open_store(path: str | Path) -> Any:
    from moetune.tuner.store.store import Store

    return Store(path)



def in_process_daemon(tmp: Path, **kw: Any) -> Any:
    """A Daemon (not started) on `tmp`/moetune.db with fake H200 facts, no rediscovery, serving ipc://`tmp`/run/
    daemon.sock unless `endpoint` is given: the tests that drive the server object in this process."""
    from moetune.tuner.daemon.server import Daemon

    facts = FakeFacts({"gpu_model": "H200"})
    kw.setdefault("endpoint", f"ipc://{tmp}/run/daemon.sock")
    return Daemon(store=open_store(tmp / "moetune.db"), discover=lambda: facts, rediscover_interval_s=0, **kw)


def run_one_job(jm: Any, done: list, timeout: float = 60.0, **submit: Any) -> Any:
    """Start JobManager `jm` (its on_done appends to `done`), submit one job with `submit`, wait for it to end, stop
    the manager; the finished job."""
    jm.start()
    try:
        jm.submit(**submit)
        deadline = time.monotonic() + timeout
        while not done and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        jm.stop()
    assert done, "the job did not finish"
    return done[0]

def slow_job_events_store(path: str | Path) -> Any:
    """A real Store (`--store-hook`) whose job_queued / job_cancelled writes take MOETUNE_FAKE_EVENT_DELAY s: a
    reply sent before they commit is seen by a kill -9 right after it."""
    store = open_store(path)
    real, delay = store.add_event, float(os.environ.get("MOETUNE_FAKE_EVENT_DELAY", "0"))

    def add_event(**kw: Any) -> Any:
        if kw.get("kind") in ("job_queued", "job_cancelled"):
            time.sleep(delay)
        return real(**kw)

    store.add_event = add_event
    return store


class FakeTransport:
    def __init__(self, name: str):
        self.name = name
        self.reason = "fake"


class FakeFacts:
    def __init__(self, d: dict[str, Any]):
        self._d = d
        self.software = d.get("software", {})
        self.software_hash = hashlib.sha256(json.dumps(self.software, sort_keys=True).encode()).hexdigest()[:16]
        self.fingerprint = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
        self.hardware_hash = self.fingerprint
        self.identity_hash = ""  # unknown: a fake names no physical GPU
        self.transports = [FakeTransport(t) for t in d.get("transports", ["nvlink"])]
        self.gpu_count = d.get("gpu_count", 2)
        self.link_rates: dict[str, float] = {}
        self.gpu_model = d.get("gpu_model", "H200")
        self.nodes = 1

    def to_dict(self) -> dict[str, Any]:
        return dict(self._d)


def this_node_facts(**software: str) -> dict[str, Any]:
    """Fabric facts of this machine as `node_identity.mismatch` reads it in this process: its GPUs' UUIDs and driver
    from /proc/driver/nvidia (none on a GPU-less machine), and this process's versions of the packages discovery
    records (`PACKAGE_FACTS`); `software` overrides some (facts of other software on this node). The facts a daemon
    discovering this node from this Python environment reports, as far as the runtime checks them."""
    from moetune.runtime.profiles import node_identity as ni

    uuids = sorted(ni.local_gpu_uuids() or ())
    sw = {k: "none" for k in ni._SOFTWARE_KEYS}
    sw["driver"] = ni.local_driver() or "none"
    sw.update({name: ni.local_package_fact(name) for name in ni.PACKAGE_FACTS})
    sw.update(software)
    return {"gpus": [{"index": i, "uuid": u} for i, u in enumerate(uuids)], "software": sw}


def this_node_fake_facts(**d: Any) -> FakeFacts:
    """`FakeFacts` of THIS node: `this_node_facts()` plus `d` (e.g. port="down": a fabric change the runtime's node
    check does not read, so the re-tuned profiles are this node's too), with the software hash the runtime computes
    of them. A daemon discovering them reports facts that pass `node_identity.mismatch` here."""
    from moetune.runtime.profiles.node_identity import software_hash

    f = FakeFacts({**this_node_facts(), **d})
    f.software_hash = software_hash(f.to_dict())
    return f


def this_node_software(**software: str) -> str:
    """The software hash of `this_node_facts(**software)`: what a profile measured here, with this software, is keyed by."""
    from moetune.runtime.profiles.node_identity import software_hash

    return software_hash(this_node_facts(**software))


def this_node_fabric(fingerprint: str, facts: dict[str, Any] | None = None, transports: list[str] | None = None) -> dict[str, Any]:
    """The result of a `fabric` reply (wire.FabricResult) reporting `facts` (default `this_node_facts()`) under
    `fingerprint`, with their software hash."""
    from moetune.runtime.profiles.node_identity import software_hash

    facts = this_node_facts() if facts is None else facts
    return {"fingerprint": fingerprint, "software": software_hash(facts), "transports": transports or ["nvlink"],
            "facts": facts, "discovered_at": "2026-12-05T00:00:00Z", "ok": True, "message": ""}


CAPTURES = Path(__file__).resolve().parent / "captures"


def make_capture(dest: Path, name: str = "dgx-h100") -> Any:
    """Copy one of the fabric tests' captures to `dest` (the daemon's --capture) and discover it."""
    import shutil

    from moetune.tuner.fabric.discovery import discover

    shutil.copytree(CAPTURES / name, dest)
    return discover(dest)


def capture_this_node(dest: Path) -> Any:
    """Capture the live node (`moetune fabric capture`: its GPUs, driver and this Python environment's packages) to
    `dest` (a daemon's --capture) and discover it: a daemon serving it reports facts the runtime's node check
    (`node_identity.mismatch`) finds to be this node's, so its measured profiles are tuned here."""
    from moetune.tuner.fabric.capture import capture_node
    from moetune.tuner.fabric.discovery import discover

    capture_node(dest)
    return discover(dest)


def set_port_state(capture: Path, state: str = "1: DOWN", dev: str = "mlx5_0", port: int = 1) -> Any:
    """Script a hardware change in a capture: an InfiniBand port goes down (or up). Returns the new facts."""
    from moetune.tuner.fabric.discovery import discover

    f = capture / "sys" / "class" / "infiniband" / dev / "ports" / str(port) / "state"
    tmp = f.with_suffix(".tmp")
    tmp.write_text(state + "\n")
    os.replace(tmp, f)
    return discover(capture)


def facts_after_port_change(capture: Path, state: str = "1: DOWN") -> Any:
    """The facts `set_port_state(capture, state)` will produce, computed on a copy (nothing changes yet)."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        cp = Path(t) / "capture"
        shutil.copytree(capture, cp)
        return set_port_state(cp, state)


def write_node_model(directory: Path, fingerprint: str, base: str = "nvlink-h200x2") -> Path:
    """Stand in for `moetune profile`'s calibration: node-<fingerprint>.toml beside the database (a
    shipped preset's numbers; what matters here is that the daemon reads this node's file)."""
    from dataclasses import replace

    from moetune.tuner.fabric_model.presets import load_preset

    path = directory / f"node-{fingerprint}.toml"
    # as the bring-up's calibrate stage writes it: the node it was calibrated on recorded
    preset = load_preset(base)
    path.write_text(replace(preset, calibration={**preset.calibration, "fingerprint": fingerprint}).to_toml())
    return path


def write_forced_preset(path: Path, base: str = "nvlink-h200x2", fingerprint: str | None = None) -> Path:
    """What `moetune model calibrate --force --out PATH` leaves: a fit the calibration checks refused, written with
    its [calibration] warning (calibrated_preset on a report with a problem; `base`'s numbers)."""
    from moetune.tuner.fabric_model.calibration import calibrated_preset
    from moetune.tuner.fabric_model.presets import load_preset

    class Report:  # the parts of a FitReport that calibrated_preset reads
        def __init__(self, preset: Any):
            self.preset, self.fitted, self.kept, self.points = preset, [], [], []
            self.params_after = preset.numeric()
            self.problems = ["too few rows: 1 distinct row for 7 fitted parameters"]
            self.measurement_env = None  # the rows said nothing of it

        def summary(self) -> dict[str, Any]:
            return {"points": 1, "mean_abs_rel_err": 0.0, "max_abs_rel_err": 0.0}

    path.write_text(calibrated_preset(Report(load_preset(base)), ["one-row.csv"], "2026-12-04",  # type: ignore[arg-type]
                                      fingerprint=fingerprint).to_toml())
    return path


def make_record(key: ProfileKey, *, latency_us: float = 10.0, num_sms: int = 24, backend: str = "local:fake") -> ProfileRecord:
    knobs = default_knobs("nvlink").replace(num_sms=num_sms)
    # A fake measurement on the key's own node: writers of measured profiles must say so (never derived).
    return ProfileRecord(key=key, knobs=knobs, latency_us=latency_us, spread_us=0.1, backend=backend,
                         provenance=provenance_of_backend(backend))


def fake_retune(ctx: Any) -> list[ProfileRecord]:
    deadline = time.monotonic() + float(os.environ.get("MOETUNE_FAKE_JOB_SLEEP", "0"))
    while time.monotonic() < deadline:
        ctx.check_cancel()
        time.sleep(0.02)
    out = []
    for k in ctx.keys:
        nk = ProfileKey(**{**k.to_dict(), "fingerprint": ctx.facts.fingerprint, "software": ctx.facts.software_hash,
                           "transport_family": "nvlink"})
        rec = make_record(nk, latency_us=8.0, num_sms=32)
        ok, _ = ctx.store.put_profile(rec)
        if ok:
            out.append(rec)
    return out



def _put_nvlink_profile(ctx: Any, k: ProfileKey) -> ProfileRecord:
    """Store (and return) an nvlink profile of key `k` measured on this node (a re-tune job's write)."""
    nk = ProfileKey(**{**k.to_dict(), "fingerprint": ctx.facts.fingerprint, "software": ctx.facts.software_hash,
                       "transport_family": "nvlink"})
    rec = make_record(nk, latency_us=8.0, num_sms=32)
    ctx.store.put_profile(rec)
    return rec


def retune_past_stop(ctx: Any) -> list[ProfileRecord]:
    """A re-tune that never checks for cancellation (a measurement in C that cannot be interrupted): it outlives the
    daemon's wait for its job worker at stop. It holds until the daemon closes its store (or MOETUNE_FAKE_JOB_SLEEP s),
    then writes one profile per key in one transaction, slowly. The daemon's Store.close is wrapped here (in the
    daemon's process only: the hook runs there) to print a line when it is called while this job still runs."""
    store = ctx.store
    closed = threading.Event()
    running = threading.Event()
    real_close = type(store).close

    def close(self: Any) -> None:
        if running.is_set():
            print("moetune test: the store was closed while a re-tune job still ran", flush=True)
        closed.set()
        real_close(self)

    type(store).close = close  # type: ignore[method-assign]
    running.set()
    try:
        closed.wait(float(os.environ.get("MOETUNE_FAKE_JOB_SLEEP", "20")))
        out = []
        with store.atomic():  # all or nothing: a process that ends inside it leaves none of them
            for k in ctx.keys:
                out.append(_put_nvlink_profile(ctx, k))
                time.sleep(0.2)
        print("moetune test: the re-tune job committed its profiles", flush=True)
        return out
    finally:
        running.clear()


def retune_commits_past_stop(ctx: Any) -> list[ProfileRecord]:
    """A re-tune that ignores cancellation and holds a write transaction past the daemon's wait for its job worker at
    stop (not waited for while it holds one: `JobManager._holds_transaction`), then commits its profiles and returns:
    the job ends `done`. The stop's finish_run("failed") queues on
    the store's lock meanwhile; SQLite's busy handler polls, so the worker's own writes (its finish_run, job_finished)
    may come first. That order is made certain here: a finish_run from any other thread than the job worker's waits
    (in the daemon's process only: the hook runs there) until the worker thread has ended. The transaction is held
    until that finish_run is called, which the stop does only once its wait has run out (a fixed sleep of 6 s against
    the 5 s wait left a 1 s margin)."""
    store = ctx.store
    worker = threading.current_thread()
    real_finish = type(store).finish_run
    stop_finishes = threading.Event()  # the stop's finish_run was called: its wait for the worker is over

    def finish_run(self: Any, run_id: int, **kw: Any) -> Any:
        if threading.current_thread() is not worker:
            print("moetune test: a finish_run of the stop waits for the job worker to end", flush=True)
            stop_finishes.set()
            worker.join(20)
        return real_finish(self, run_id, **kw)

    type(store).finish_run = finish_run  # type: ignore[method-assign]
    # past the stop's wait for this worker: held until the stop, its wait over, calls finish_run
    return _profiles_in_one_held_transaction(ctx, stop_finishes.wait)


def _profiles_in_one_held_transaction(ctx: Any, hold: Callable[[float], Any]) -> list[ProfileRecord]:
    """Every key's profile written in one transaction (the write lock) kept open by `hold(MOETUNE_FAKE_JOB_SLEEP s)`,
    then committed; each step printed for the test to wait on."""
    out = []
    with ctx.store.atomic():
        for k in ctx.keys:
            out.append(_put_nvlink_profile(ctx, k))
        print("moetune test: the re-tune job holds its transaction", flush=True)
        hold(float(os.environ.get("MOETUNE_FAKE_JOB_SLEEP", "20")))
    print("moetune test: the re-tune job committed its profiles", flush=True)
    return out


def retune_holds_its_transaction(ctx: Any) -> list[ProfileRecord]:
    """A re-tune that writes its profiles in one transaction and, ignoring cancellation, keeps it open for
    MOETUNE_FAKE_JOB_SLEEP s (a measurement in C inside it): the stop waited 5 s for it, then behind it."""
    return _profiles_in_one_held_transaction(ctx, time.sleep)


# -- running the daemon as a subprocess ---------------------------------------------------------------
TESTS_DIR = Path(__file__).resolve().parent


class DaemonProc:
    """`python -m moetune.tuner.daemon.server` in a tmp dir with the fakes injected; always killed by close()."""

    def __init__(self, tmp: Path, *, endpoint: str | None = None, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, interval: float = 0.2, hooks: bool = True):
        import subprocess
        import sys

        self.tmp = tmp
        self.run_dir = tmp / "run"
        self.endpoint = endpoint or f"ipc://{self.run_dir / 'daemon.sock'}"
        self.db = tmp / "moetune.db"
        self.capture = tmp / "capture"
        args = [sys.executable, "-m", "moetune.tuner.daemon.server", "--socket", self.endpoint, "--db", str(self.db),
                "--capture", str(self.capture), "--rediscover-interval", str(interval), "--log-level", "info"]
        if hooks:
            # real discovery of the --capture directory; the re-tune is faked (no Optuna in daemon tests)
            args += ["--retune-hook", "daemon_fakes:fake_retune"]
        args += extra or []
        e = dict(os.environ)
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), e.get("PYTHONPATH", "")]))
        e["MOETUNE_HOME"] = str(tmp / "home")
        e.update(env or {})
        self.log = open(tmp / "daemon.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log, env=e)

    def wait_ready(self, timeout: float = 20.0, **client_kw: Any) -> Any:
        from moetune.runtime.profiles.client import ProfileClient
        from moetune.runtime.profiles.errors import DaemonUnavailable

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.read_log()[-3000:]}")
            c = ProfileClient(self.endpoint, timeout_ms=300, **client_kw)
            try:
                return c.hello()
            except DaemonUnavailable:
                time.sleep(0.05)
            finally:
                c.close()
        raise TimeoutError(f"daemon not ready: {self.read_log()[-3000:]}")

    def read_log(self) -> str:
        self.log.flush()
        return (self.tmp / "daemon.log").read_text(errors="replace")

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def kill(self, sig: int = 9) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)

    close = kill


def seed_profiles(store: Any, facts: FakeFacts, *, model: str = "qwen3-30b", ep_size: int = 2,
                  buckets: tuple[int, ...] = (64, 1024, 4096)) -> list[ProfileRecord]:
    from moetune.runtime.shapes import MODELS

    m = MODELS[model]
    out = []
    for b in buckets:
        key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                         ep_size=ep_size, nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts,
                         topk=m.topk, dtype=m.dtype, token_bucket=b)
        rec = make_record(key)
        store.put_profile(rec)
        out.append(rec)
    return out


def record_fabric_seen(store: Any, facts: FakeFacts, reason: str = "first") -> None:
    """The fabric_seen event a daemon writes when it discovers `facts` (its first fabric)."""
    store.add_event(kind="fabric_seen", reason=reason,
                    details={"fingerprint": facts.fingerprint, "identity": None, "facts": facts.to_dict()})


def record_fabric_change(store: Any, old: FakeFacts, new: FakeFacts, **details: Any) -> None:
    """What a daemon's fabric change old -> new (gpu_model H200 -> H100) writes before anything else: the new
    fingerprint and the fabric_changed event (with `details` added to the event's)."""
    store.upsert_fingerprint(new.fingerprint, new.to_dict(), origin="local")
    store.add_event(kind="fabric_changed", reason="gpu_model: H200 -> H100",
                    details={"old_fingerprint": old.fingerprint, "fingerprint": new.fingerprint, "identity": None,
                             "reasons": ["gpu_model: H200 -> H100"], "facts": new.to_dict(), **details})


def unqueued_fabric_change(path: Path) -> tuple[Any, FakeFacts, FakeFacts, list[ProfileRecord]]:
    """A store at `path` as a daemon killed in a fabric change left it: profiles seeded on the old fabric (H200), seen
    at the first discovery, then the change to the new one (H100) recorded and nothing after it (no re-tune queued).
    Returns the store, the old and new facts, and the seeded records."""
    old, new = FakeFacts({"gpu_model": "H200"}), FakeFacts({"gpu_model": "H100"})
    store = open_store(path)
    seeded = seed_profiles(store, old)
    record_fabric_seen(store, old, "first discovery")
    record_fabric_change(store, old, new)
    return store, old, new, seeded


@contextlib.contextmanager
def seeded_daemon(tmp: Path, capture: str = "dgx-h100", **proc_kw: Any) -> Iterator[tuple[DaemonProc, FakeFacts]]:
    """A capture (tests/captures/`capture`; "this node": the live node, `capture_this_node`, whose measured profiles
    the runtime here takes as tuned) and a store seeded with its profiles under `tmp`, and a daemon serving them
    (ready on entry, killed on exit)."""
    facts = capture_this_node(tmp / "capture") if capture == "this node" else make_capture(tmp / "capture", capture)
    seed_profiles(open_store(tmp / "moetune.db"), facts)
    d = DaemonProc(tmp, **proc_kw)
    try:
        d.wait_ready()
        yield d, facts
    finally:
        d.kill()


def pretend_node(monkeypatch: Any, facts: Any, proc: Path) -> None:
    """Make the runtime's cheap node checks (moetune.runtime.profiles.node_identity) read `facts`' node:
    a /proc with its GPUs' UUIDs and driver version under `proc`, and its package versions (torch, moetune, NCCL,
    ...)."""
    from moetune.runtime.profiles import node_identity

    d = facts.to_dict() if hasattr(facts, "to_dict") else dict(facts)
    sw = d.get("software", {}) or {}
    nv = proc / "driver" / "nvidia"
    for i, g in enumerate(d.get("gpus", []) or []):
        (nv / "gpus" / f"0000:{i:02x}:00.0").mkdir(parents=True, exist_ok=True)
        (nv / "gpus" / f"0000:{i:02x}:00.0" / "information").write_text(f"Model: \t {g.get('model')}\nGPU UUID: \t {g.get('uuid')}\n")
    if sw.get("driver") not in (None, "", "none"):
        nv.mkdir(parents=True, exist_ok=True)
        (nv / "version").write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {sw['driver']}  Sat Aug 19 2023\n")
    monkeypatch.setattr(node_identity, "PROC_ROOT", proc)
    sys_root = proc.parent / f"{proc.name}-sys"  # its NICs' class folders
    for entry in [*(d.get("nics") or []), *(d.get("excluded_nics") or [])]:
        nic = entry.get("nic", entry)
        (sys_root / "class" / ("cxi" if nic.get("kind") == "cxi" else "infiniband") / nic["name"]).mkdir(
            parents=True, exist_ok=True)
    monkeypatch.setattr(node_identity, "SYS_ROOT", sys_root)
    monkeypatch.setattr(node_identity, "_dist_version", lambda name: sw.get(name) if sw.get(name) not in (None, "none") else None)
    monkeypatch.setattr(node_identity, "local_package_fact", lambda fact: str(sw.get(fact) or "none"))


def resolve_warned(c: Any, **kw: Any) -> tuple[Any, list[str]]:
    """`c.resolve(...)` for Qwen3-30B at EP 2 and 100 tokens (plus `kw`), with the FallbackWarnings it raised;
    closes the client."""
    import warnings

    from moetune.runtime.profiles.errors import FallbackWarning
    from moetune.runtime.shapes import MODELS

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = c.resolve(model=MODELS["qwen3-30b"], ep_size=2, tokens=100, **kw)
    finally:
        c.close()
    return out, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def until(cond: Any, timeout: float = 15.0, step: float = 0.05) -> Any:
    """Poll `cond()` until it returns something truthy (returned); TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise TimeoutError("condition not met")


class ReplyRouter:
    """A ROUTER bound to `endpoint` (no CURVE) answering every request with `answer(request) -> frame` (None: no
    reply at all), on a thread; what a hostile or broken daemon would send, for the client's tests."""

    def __init__(self, endpoint: str, answer: Callable[[dict], bytes | None]):
        import zmq

        self.endpoint = endpoint
        self.requests: list[dict] = []
        self._answer = answer
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, body = self._sock.recv_multipart()
            req = json.loads(body)
            self.requests.append(req)
            out = self._answer(req)
            if out is not None:
                self._sock.send_multipart([ident, out])

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self._sock.close(linger=0)


def interrupt_before_compare(bringup: Any, monkeypatch: Any) -> None:
    """Run `bringup` through its tune stage and stop it at the compare stage (a KeyboardInterrupt, as Ctrl-C
    there); the compare stage is put back for the rerun the test makes next."""
    import pytest

    from moetune.tuner.bringup import flow

    compare = flow.Bringup.stage_compare

    def interrupted(self: Any) -> list[dict]:
        raise KeyboardInterrupt

    monkeypatch.setattr(flow.Bringup, "stage_compare", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bringup.run()
    assert bringup.state.done("tune") and not bringup.state.done("compare")
    monkeypatch.setattr(flow.Bringup, "stage_compare", compare)


def measuring_fake(fn: Callable[..., Any], name: str = "local:fake") -> Any:
    """A stand-in for the local backend: `fn(knobs, workload)` is its measurement, and its class declares what the
    local backend's does (measured), which is what the tuner records (a name alone never makes a number measured)."""
    from moetune.tuner.search.backends import CallableBackend

    class MeasuringFake(CallableBackend):
        provenance = "measured"

    return MeasuringFake(fn, name=name)


def fake_local_backend(monkeypatch: Any, name: str = "local:fake") -> list[dict]:
    """The tuner's backends replaced by a fake local one named `name` (no ranks launched; a trial measures
    10 + pipeline_depth; measured, as the local backend's numbers are): returns the options each was built with
    (the CLI's local backend options)."""
    import moetune.tuner.search.tune as search

    seen: list[dict] = []

    def make(backend: Any, preset: Any = None, **kw: Any) -> Any:
        seen.append(kw)
        fake = measuring_fake(lambda k, w: 10.0 + k.pipeline_depth, name=name)
        if "world" in kw:  # refuses what the local backend refuses (an unmeasured group, gloo on GPUs): check_tune asks it
            from moetune.tuner.search.local_backend import LocalBackend

            fake.world, fake.comm_backend = kw["world"], kw.get("comm_backend", "gloo")
            fake.refusal = types.MethodType(LocalBackend.refusal, fake)
        return fake

    monkeypatch.setattr(search, "make_backend", make)
    return seen


def fabric_daemon(tmp: Path, facts: Any) -> tuple[Any, list[ProfileRecord], list[Any], list[list[Any]], Any]:
    """A daemon started in the background on a fresh store seeded with `facts`' profiles, discovering `now[0]` (set it
    to other facts for a fabric change) and re-tuning with a job that records the keys it gets: (store, seeded, now,
    ran, daemon). The caller stops the daemon."""
    from moetune.tuner.daemon.server import Daemon

    store = open_store(tmp / "moetune.db")
    seeded = seed_profiles(store, facts)
    now = [facts]
    ran: list[list[Any]] = []

    def job(ctx: Any) -> list[Any]:
        ran.append(list(ctx.keys))
        return []

    d = Daemon(store=store, endpoint=f"ipc://{tmp}/run/d.sock", discover=lambda: now[0], rediscover_interval_s=0,
               retune_job=job).start(background=True)
    return store, seeded, now, ran, d


def start_recording_daemon(store: Any, tmp: Path, facts: Any, **kw: Any) -> tuple[Any, list[list[Any]], threading.Event]:
    """A Daemon started in the background on ipc://`tmp`/run/d.sock with `facts`, no rediscovery, whose re-tune job
    only records the keys it was given (`ran`, one list a job) and sets `done`; returns (daemon, ran, done)."""
    from moetune.tuner.daemon.server import Daemon

    ran: list[list[Any]] = []
    done = threading.Event()

    def retune(ctx: Any) -> list[Any]:
        ran.append(list(ctx.keys))
        done.set()
        return []

    d = Daemon(store=store, endpoint=f"ipc://{tmp}/run/d.sock", discover=lambda: facts, rediscover_interval_s=0,
               retune_job=retune, **kw).start(background=True)
    return d, ran, done
