"""Stand-ins the daemon tests inject (`--store-hook`, `--discover-hook`, `--retune-hook`).

- `open_store(path)`: the real `moetune.tuner.store.Store` when it is importable, else `FakeStore`, a
  stdlib-sqlite3 store with the same `profiles` table columns (so the runtime's read-only fallback reads it).
- `discover_capture(dir)`: the real discovery on a capture directory when `dir/facts.json` is absent and the
  discovery module exists; else facts read from `dir/facts.json` (tests edit it to script a fabric change).
- `fake_retune(ctx)`: writes one new profile per key on the new fabric (sleeping MOETUNE_FAKE_JOB_SLEEP s first,
  checking for cancellation), instead of running Optuna.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from moetune.runtime.knobs import Knobs, default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS fingerprints (id INTEGER PRIMARY KEY, hash TEXT UNIQUE, facts TEXT, first_seen TEXT, last_seen TEXT);
CREATE TABLE IF NOT EXISTS tuning_runs (id INTEGER PRIMARY KEY, study_name TEXT, storage TEXT, backend TEXT, status TEXT,
    trials INTEGER, best_value REAL, started TEXT, ended TEXT);
CREATE TABLE IF NOT EXISTS profiles (id INTEGER PRIMARY KEY, fingerprint TEXT, software TEXT, transport_family TEXT,
    ep_size INTEGER, nodes INTEGER, hidden INTEGER, intermediate INTEGER, experts INTEGER, topk INTEGER, dtype TEXT,
    token_bucket INTEGER, knobs TEXT, latency_us REAL, spread_us REAL, backend TEXT, status TEXT, software_versions TEXT,
    profile_hash TEXT, created TEXT, updated TEXT);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, created TEXT, kind TEXT, reason TEXT, details TEXT);
"""
KEY_COLS = ("fingerprint", "software", "transport_family", "ep_size", "nodes", "hidden", "intermediate", "experts",
            "topk", "dtype", "token_bucket")


def _now() -> str:
    return datetime.now(UTC).isoformat()


class FakeStore:
    """The subset of the Store contract the daemon uses, on stdlib sqlite3 (WAL)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.url = f"sqlite:///{self.path}"
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=5)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)

    def _x(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def upsert_fingerprint(self, fp_hash: str, facts: dict) -> None:
        ts = _now()
        with self._lock:
            if self._x("SELECT 1 FROM fingerprints WHERE hash=?", (fp_hash,)).fetchone():
                self._x("UPDATE fingerprints SET last_seen=?, facts=? WHERE hash=?", (ts, json.dumps(facts), fp_hash))
            else:
                self._x("INSERT INTO fingerprints (hash, facts, first_seen, last_seen) VALUES (?,?,?,?)", (fp_hash, json.dumps(facts), ts, ts))

    def start_run(self, *, study_name: str, storage: str, backend: str) -> int:
        c = self._x("INSERT INTO tuning_runs (study_name, storage, backend, status, trials, started) VALUES (?,?,?,?,0,?)",
                    (study_name, storage, backend, "running", _now()))
        return int(c.lastrowid)

    def finish_run(self, run_id: int, *, status: str, trials: int, best_value: float | None) -> None:
        self._x("UPDATE tuning_runs SET status=?, trials=?, best_value=?, ended=? WHERE id=?", (status, trials, best_value, _now(), run_id))

    def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        cur = self._x("SELECT id, study_name, status FROM tuning_runs ORDER BY id DESC LIMIT ?", (limit,))
        return [dict(id=r[0], study_name=r[1], status=r[2]) for r in cur.fetchall()]

    def _rec(self, r: tuple) -> ProfileRecord:
        key = ProfileKey(**dict(zip(KEY_COLS, r[1:12], strict=True)))
        return ProfileRecord(key=key, knobs=Knobs.from_dict(json.loads(r[12])), latency_us=r[13], spread_us=r[14], backend=r[15],
                             status=r[16], software_versions=json.loads(r[17] or "{}"), created=r[19], updated=r[20])

    _SEL = "SELECT id, " + ", ".join(KEY_COLS) + ", knobs, latency_us, spread_us, backend, status, software_versions, profile_hash, created, updated FROM profiles"

    def put_profile(self, rec: ProfileRecord) -> tuple[bool, str]:
        ts = _now()
        with self._lock:
            self._x("BEGIN IMMEDIATE")
            try:
                where = " AND ".join(f"{c}=?" for c in KEY_COLS)
                vals = tuple(getattr(rec.key, c) for c in KEY_COLS)
                old = self._x(f"SELECT id, latency_us, spread_us FROM profiles WHERE status='current' AND {where}", vals).fetchone()
                if old is not None:
                    if not old[1] - rec.latency_us > max(old[2], rec.spread_us):
                        self._x("COMMIT")
                        return False, "kept the current profile"
                    self._x("UPDATE profiles SET status='superseded', updated=? WHERE id=?", (ts, old[0]))
                self._x("INSERT INTO profiles (" + ", ".join(KEY_COLS) + ", knobs, latency_us, spread_us, backend, status, "
                        "software_versions, profile_hash, created, updated) VALUES (" + ",".join("?" * 20) + ")",
                        (*vals, json.dumps(rec.knobs.to_dict()), rec.latency_us, rec.spread_us, rec.backend, rec.status,
                         json.dumps(rec.software_versions), rec.profile_hash, rec.created or ts, ts))
                self._x("COMMIT")
            except BaseException:
                self._x("ROLLBACK")
                raise
        return True, "written"

    def list_profiles(self, *, status: str | None = None, fingerprint: str | None = None) -> list[tuple[int, ProfileRecord]]:
        sql, args = self._SEL + " WHERE 1=1", []
        if status:
            sql += " AND status=?"
            args.append(status)
        if fingerprint:
            sql += " AND fingerprint=?"
            args.append(fingerprint)
        return [(r[0], self._rec(r)) for r in self._x(sql + " ORDER BY id", tuple(args)).fetchall()]

    def mark_stale(self, *, fingerprint: str, reason: str) -> int:
        n = self._x("UPDATE profiles SET status='stale', updated=? WHERE fingerprint=? AND status='current'", (_now(), fingerprint)).rowcount
        if n:
            self.add_event(kind="stale", reason=reason, details={"fingerprint": fingerprint, "profiles": n})
        return n

    def add_event(self, *, kind: str, reason: str, details: dict | None = None) -> int:
        c = self._x("INSERT INTO events (created, kind, reason, details) VALUES (?,?,?,?)", (_now(), kind, reason, json.dumps(details or {})))
        return int(c.lastrowid)

    def list_events(self, limit: int = 100) -> list[dict[str, Any]]:
        cur = self._x("SELECT id, created, kind, reason, details FROM events ORDER BY id DESC LIMIT ?", (limit,))
        return [dict(id=r[0], created=r[1], kind=r[2], reason=r[3], details=json.loads(r[4])) for r in cur.fetchall()]


def open_store(path: str | Path) -> Any:
    try:
        from moetune.tuner.store import Store
    except ImportError:
        return FakeStore(path)
    return Store(path)


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
        self.transports = [FakeTransport(t) for t in d.get("transports", ["nvlink"])]
        self.gpu_count = d.get("gpu_count", 2)
        self.gpu_model = d.get("gpu_model", "H200")
        self.nodes = 1

    def to_dict(self) -> dict[str, Any]:
        return dict(self._d)


def write_facts(capture: Path, **facts: Any) -> FakeFacts:
    capture.mkdir(parents=True, exist_ok=True)
    d = {"gpu_model": "H200", "gpu_count": 2, "transports": ["nvlink"], "software": {"nccl": "2.28.9"}, **facts}
    tmp = capture / "facts.json.tmp"
    tmp.write_text(json.dumps(d))
    os.replace(tmp, capture / "facts.json")
    return FakeFacts(d)


def discover_capture(capture: Path | None) -> Any:
    """Fake facts from `capture/facts.json` when present, else the real discovery of the capture."""
    if capture is None:
        raise RuntimeError("the fake discovery needs --capture")
    if (Path(capture) / "facts.json").exists():
        return FakeFacts(json.loads((Path(capture) / "facts.json").read_text()))
    from moetune.tuner.discovery import discover

    return discover(capture)


CAPTURES = Path(__file__).resolve().parent / "captures"


def make_capture(dest: Path, name: str = "dgx-h100") -> Any:
    """Copy one of the fabric tests' captures to `dest` (the daemon's --capture) and discover it."""
    import shutil

    from moetune.tuner.discovery import discover

    shutil.copytree(CAPTURES / name, dest)
    return discover(dest)


def set_port_state(capture: Path, state: str = "1: DOWN", dev: str = "mlx5_0", port: int = 1) -> Any:
    """Script a hardware change in a capture: an InfiniBand port goes down (or up). Returns the new facts."""
    from moetune.tuner.discovery import discover

    f = capture / "sys" / "class" / "infiniband" / dev / "ports" / str(port) / "state"
    tmp = f.with_suffix(".tmp")
    tmp.write_text(state + "\n")
    os.replace(tmp, f)
    return discover(capture)


def make_record(key: ProfileKey, *, latency_us: float = 10.0, num_sms: int = 24, backend: str = "model:fake") -> ProfileRecord:
    knobs = default_knobs("nvlink").replace(num_sms=num_sms)
    return ProfileRecord(key=key, knobs=knobs, latency_us=latency_us, spread_us=0.1, backend=backend)


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


# -- running the daemon as a subprocess ---------------------------------------------------------------
TESTS_DIR = Path(__file__).resolve().parent


class DaemonProc:
    """`python -m moetune.tuner.daemon` in a tmp dir with the fakes injected; always killed by close()."""

    def __init__(self, tmp: Path, *, endpoint: str | None = None, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, interval: float = 0.2, hooks: bool = True):
        import subprocess
        import sys

        self.tmp = tmp
        self.run_dir = tmp / "run"
        self.endpoint = endpoint or f"ipc://{self.run_dir / 'daemon.sock'}"
        self.db = tmp / "moetune.db"
        self.capture = tmp / "capture"
        args = [sys.executable, "-m", "moetune.tuner.daemon", "--socket", self.endpoint, "--db", str(self.db),
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
        from moetune.runtime.client import DaemonUnavailable, ProfileClient

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
