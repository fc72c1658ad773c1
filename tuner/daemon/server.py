"""The moetune daemon: serves tuned profiles over ZeroMQ and keeps them true to the hardware.

Threads:
- the serving loop (`serve_forever`, main thread under `moetune serve`): one ROUTER socket polled with
  `zmq.Poller`; each request is one JSON frame decoded with msgspec into the schemas of
  `moetune.runtime.wire`; answers come from an in-memory `ProfileIndex` (current profiles only) with a
  read-through cache of encoded results, so the hot path runs no SQL. The index is rebuilt (and the
  cache dropped) after every write the daemon makes; the swap is a single reference assignment.
- the discovery worker: rediscovers the fabric every `rediscover_interval_s`; on a fingerprint change it
  records an event (with `diff_facts` reasons), marks the old fingerprint's profiles `stale`, rebuilds
  the index, publishes `fabric_changed` and `profile_stale`, and queues a re-tune job;
- the job worker (`daemon_jobs.JobManager`): one job at a time from a bounded queue; each job's state is
  persisted as events + a tuning run so that a restart after `kill -9` marks it failed and resumes it.
The PUB socket is shared by the two workers under a lock; the serving loop never waits on them.

Security: the default endpoint is `ipc://` in a runtime directory created 0700 (0750 with a configured
group); the socket file is 0600 (0660). `tcp://` needs CURVE keys unless `allow_insecure_tcp`.
The daemon is the single writer of its database; everyone else opens it read-only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import grp
import importlib
import itertools
import json
import logging
import os
import queue
import signal
import socket as pysocket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import zmq

from moetune.runtime import wire
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles.autoload import launcher_env
from moetune.runtime.profiles.client import INFO_NAME, PUB_SOCKET_NAME, pick_profile
from moetune.runtime.shapes import get_model
from moetune.tuner import __version__
from moetune.tuner.daemon.jobs import JobManager, RetuneFn, keys_from_details, recover_jobs, tuner_retune
from moetune.tuner.daemon.metrics import DaemonMetrics, start_metrics_server

log = logging.getLogger("moetune.daemon")

_GP_KEY_FIELDS = tuple(f for f in wire.GetProfile.__struct_fields__ if f not in ("v", "id"))
CACHE_LIMIT = 4096  # encoded results kept per index version (bounded: hostile clients cannot grow it)
HARD_CAP_FACTOR = 16  # ZMQ_MAXMSGSIZE = this x max_request_bytes: bigger frames drop the connection


class DaemonConfigError(ValueError):
    """A refused configuration (TCP without CURVE, a runtime directory we do not own, ...)."""


def now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class TuneSettings:
    backend: str = "model"
    trials: int = 40
    timeout_s: float | None = 600.0
    preset: str | None = None


# -- facts helpers -------------------------------------------------------------------------------
def _facts_dict(facts: Any) -> dict[str, Any]:
    try:
        d = facts.to_dict()
    except AttributeError:
        d = dict(facts)
    return d if isinstance(d, dict) else {}


def _transport_names(facts: Any) -> list[str]:
    out = []
    for t in getattr(facts, "transports", None) or []:
        name = getattr(t, "name", t)
        if isinstance(name, str):
            out.append(name)
    return out


def default_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    try:
        from moetune.tuner.fabric.fingerprint import diff_facts
    except ImportError:
        try:
            from moetune.tuner.fabric.discovery import diff_facts  # type: ignore[no-redef]
        except ImportError:
            diff_facts = None  # type: ignore[assignment]
    if diff_facts is not None:
        return list(diff_facts(old, new)) or ["facts changed"]
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)] or ["facts changed"]


def make_discover(capture: Path | None) -> Callable[[], Any]:
    def _discover() -> Any:
        from moetune.tuner.fabric.discovery import discover

        return discover(capture)

    return _discover


# -- the index the serving loop reads --------------------------------------------------------------
ShapeKey = tuple[str, int, int, int, int, int, int, str]


class ProfileIndex:
    """Current profiles grouped by (fingerprint, ep, nodes, shape); immutable once built (except the cache)."""

    def __init__(self, records: list[ProfileRecord], *, version: int, facts: Any, stale: list[ProfileRecord]):
        self.version = version
        self.fingerprint: str | None = getattr(facts, "fingerprint", None) if facts is not None else None
        self.software: str | None = getattr(facts, "software_hash", None) if facts is not None else None
        self.groups: dict[ShapeKey, list[ProfileRecord]] = {}
        for r in records:
            if r.status != "current":
                continue  # a stale profile is never served as current
            k = r.key
            self.groups.setdefault((k.fingerprint, k.ep_size, k.nodes, k.hidden, k.intermediate, k.experts, k.topk, k.dtype), []).append(r)
        self.records = [r for r in records if r.status == "current"]
        self.stale = stale
        self.cache: dict[Any, Any] = {}
        self.list_cache: dict[Any, bytes] = {}

    @property
    def current_count(self) -> int:
        return len(self.records)

    def lookup(self, req: wire.GetProfile) -> tuple[bool, Any]:
        """(True, encoded ProfileResult as msgspec.Raw) or (False, (code, message))."""
        if req.model is not None:
            try:
                m = get_model(req.model)
            except ValueError as e:
                return False, (wire.E_INVALID_FIELD, str(e))
            h, i, e_, k, dt = m.hidden, m.intermediate, m.experts, m.topk, m.dtype
            h, i, e_, k = req.hidden or h, req.intermediate or i, req.experts or e_, req.topk or k
            dt = req.dtype or dt
        else:
            missing = [f for f in ("hidden", "intermediate", "experts", "topk") if getattr(req, f) is None]
            if missing:
                return False, (wire.E_MISSING_FIELD, f"give `model` or all of hidden/intermediate/experts/topk (missing {', '.join(missing)})")
            h, i, e_, k, dt = req.hidden, req.intermediate, req.experts, req.topk, req.dtype or "bfloat16"
        if req.ep_size % req.nodes:
            return False, (wire.E_INVALID_FIELD, f"ep_size {req.ep_size} is not divisible by nodes {req.nodes}")
        fp = req.fingerprint or self.fingerprint
        if fp is None:
            return False, (wire.E_NOT_FOUND, "the daemon has not discovered its fabric (yet); no profile is current")
        recs = self.groups.get((fp, req.ep_size, req.nodes, h, i, e_, k, dt), [])
        if req.software:
            recs = [r for r in recs if r.key.software == req.software]
        rec = pick_profile(recs, req.tokens, transport_family=req.transport_family)
        if rec is None:
            return False, (wire.E_NOT_FOUND, f"no current profile for fingerprint {fp}, ep {req.ep_size}, nodes {req.nodes}, "
                                             f"shape {h}x{i}x{e_}/top{k} {dt}")
        res = wire.ProfileResult.from_record(rec, env=launcher_env(rec.knobs, rec.key.transport_family, rec.key.nodes),
                                             version=self.version)
        return True, msgspec.Raw(wire.encoder.encode(res))


# -- filesystem security -----------------------------------------------------------------------------
def _group_id(group: str) -> int | None:
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        try:
            return grp.getgrgid(int(group)).gr_gid
        except (ValueError, KeyError):
            raise DaemonConfigError(f"unknown unix group {group!r} (daemon.group)") from None


def prepare_runtime_dir(d: Path, group: str = "") -> None:
    """Create (or tighten) the directory of the IPC sockets: ours, 0700, or 0750 with `group`."""
    gid = _group_id(group)
    mode = 0o750 if gid is not None else 0o700
    old = os.umask(0o077)
    try:
        d.mkdir(parents=True, exist_ok=True, mode=mode)
    finally:
        os.umask(old)
    st = os.lstat(d)
    import stat

    if not stat.S_ISDIR(st.st_mode):
        raise DaemonConfigError(f"runtime directory {d} is not a directory")
    if st.st_uid != os.getuid():
        raise DaemonConfigError(f"runtime directory {d} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if gid is not None:
        os.chown(d, -1, gid)
    os.chmod(d, mode)


def _socket_alive(path: Path) -> bool:
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.settimeout(0.2)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def derive_pub_endpoint(endpoint: str) -> str:
    p = _ipc_path(endpoint)
    if p is not None:
        return f"ipc://{p.parent / PUB_SOCKET_NAME}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if port.isdigit():
            return f"tcp://{host}:{int(port) + 1}"
    raise DaemonConfigError(f"cannot derive a PUB endpoint from {endpoint!r}; configure daemon.pub_socket")


def load_curve_keys(secret_file: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a `moetune keys generate` secret key file."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(str(secret_file))
    if not secret:
        raise DaemonConfigError(f"{secret_file} holds no secret key")
    return public, secret


# -- JSON logs ------------------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    _skip = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in self._skip:
                d[k] = v
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


def setup_logging(level: str = "info") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger("moetune")
    root.handlers[:] = [h]
    root.setLevel(level.upper())
    root.propagate = False


# -- the daemon ---------------------------------------------------------------------------------------
class Daemon:
    def __init__(
        self,
        *,
        store: Any,
        endpoint: str,
        pub_endpoint: str | None = None,
        discover: Callable[[], Any] | None = None,
        diff: Callable[[dict, dict], list[str]] = default_diff,
        retune_job: RetuneFn | None = None,
        tune: TuneSettings | None = None,
        rediscover_interval_s: float = 60.0,
        max_request_bytes: int = wire.DEFAULT_MAX_REQUEST_BYTES,
        curve_secret_key_file: str | None = None,
        allow_insecure_tcp: bool = False,
        group: str = "",
        metrics_port: int = 0,
        metrics_addr: str = "127.0.0.1",
        db_path: str = "",
        job_capacity: int = 4,
    ):
        self.store = store
        self.endpoint = endpoint
        self.pub_endpoint = pub_endpoint or derive_pub_endpoint(endpoint)
        self._discover = discover
        self._diff = diff
        self.tune = tune or TuneSettings()
        self.interval = rediscover_interval_s
        self.max_request_bytes = max_request_bytes
        self.curve_secret_key_file = curve_secret_key_file
        self.allow_insecure_tcp = allow_insecure_tcp
        self.group = group
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.db_path = db_path or str(getattr(store, "path", "") or "")
        self.epoch = uuid.uuid4().hex[:16]
        self.started = time.time()
        self.metrics = DaemonMetrics()
        self.facts: Any = None
        self.version = 0
        self._last_discovery = ("", False, "not run yet")
        self._index = ProfileIndex([], version=0, facts=None, stale=[])
        self._commit_lock = threading.RLock()
        self._pub_lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._ctx = zmq.Context()
        self._router: zmq.Socket | None = None
        self._pub: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []
        self._serve_thread: threading.Thread | None = None
        self._metrics_server: Any = None
        self._bound_paths: list[Path] = []
        self._lock_fd: int | None = None
        self.jobs = JobManager(store=store, facts_fn=lambda: self.facts, retune=retune_job or tuner_retune,
                               on_done=self._job_done, tune=self.tune, capacity=job_capacity, metrics=self.metrics)
        self._handlers: dict[type, Callable[[Any], Any]] = {
            wire.Hello: self._op_hello,
            wire.GetProfile: self._op_get_profile,
            wire.ListProfiles: self._op_list_profiles,
            wire.Fabric: self._op_fabric,
            wire.Status: self._op_status,
            wire.Retune: self._op_retune,
        }
        g = self.metrics.gauges
        g["profiles_current"] = lambda: self._index.current_count
        g["profiles_stale"] = lambda: len(self._index.stale)
        g["jobs_queued"] = lambda: self.jobs.queued_count()
        g["jobs_running"] = lambda: 1 if self.jobs.running else 0
        g["uptime_seconds"] = lambda: time.time() - self.started
        g["change_version"] = lambda: self.version

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, *, background: bool = False) -> Daemon:
        """Discover, recover jobs, bind, start the workers (and the serving loop when `background`)."""
        self._check_transport_security()
        self._lock_database()  # the single writer: before anything is written
        self._bind()  # refuses when another daemon listens on the socket; requests wait in ZeroMQ meanwhile
        resume = self._recover()
        self._startup_discovery()
        self._resume(resume)
        self._rebuild()
        self._write_info(running=True)
        if self.metrics_port:
            self._metrics_server = start_metrics_server(self.metrics, self.metrics_port, self.metrics_addr)
        self.jobs.start()
        if self.interval > 0 and self._discover is not None:
            t = threading.Thread(target=self._discovery_loop, name="moetune-discovery", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("serving", extra={"endpoint": self.endpoint, "pub_endpoint": self.pub_endpoint, "epoch": self.epoch,
                                   "db": self.db_path, "fingerprint": self._index.fingerprint})
        # Everything loaded so far (SQLAlchemy, Alembic, the index) lives for the whole run: move it out of
        # the cyclic GC's generations so that full collections do not rescan it (tail latency).
        gc.collect()
        gc.freeze()
        if background:
            self._serve_thread = threading.Thread(target=self.serve_forever, name="moetune-serve", daemon=True)
            self._serve_thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._serve_thread is not None:
            self._serve_thread.join(5)
            self._close()

    def _close(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.jobs.stop(timeout=5.0)
        for t in self._threads:
            t.join(2)
        with self._pub_lock:
            if self._pub is not None:
                self._pub.close(linger=0)
                self._pub = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._metrics_server is not None:
            with contextlib.suppress(Exception):
                self._metrics_server[0].shutdown()
        for p in self._bound_paths:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        self._write_info(running=False)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        self._ctx.term()
        log.info("stopped", extra={"epoch": self.epoch})

    def _lock_database(self) -> None:
        """An exclusive flock next to the database (released by the kernel when the process dies, even
        on kill -9): a second daemon on the same database refuses to start."""
        if not self.db_path:
            return
        import fcntl

        path = Path(self.db_path).with_name(Path(self.db_path).name + ".daemon-lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DaemonConfigError(f"another moetune daemon is using the database {self.db_path} ({path} is locked)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def install_signal_handlers(self) -> None:
        def _handler(signum: int, _frame: Any) -> None:
            log.info("signal %s: shutting down", signal.Signals(signum).name)
            self._stop.set()

        signal.signal(signal.SIGTERM, _handler)
        signal.signal(signal.SIGINT, _handler)

    # -- sockets -----------------------------------------------------------------------------------------
    def _check_transport_security(self) -> None:
        for ep in (self.endpoint, self.pub_endpoint):
            if ep.startswith("ipc://") or ep.startswith("inproc://"):
                continue
            if not ep.startswith("tcp://"):
                raise DaemonConfigError(f"unsupported endpoint {ep!r}: use ipc:// or tcp://")
            if not self.curve_secret_key_file and not self.allow_insecure_tcp:
                raise DaemonConfigError(
                    f"refusing to listen on {ep} without CURVE keys: run `moetune keys generate DIR` and set "
                    "daemon.curve_secret_key_file (or set daemon.allow_insecure_tcp = true for a trusted loopback test)"
                )
        if self.curve_secret_key_file:
            load_curve_keys(self.curve_secret_key_file)

    def _prepare_ipc(self, endpoint: str) -> Path | None:
        p = _ipc_path(endpoint)
        if p is None:
            return None
        prepare_runtime_dir(p.parent, self.group)
        if p.exists() or p.is_symlink():
            if _socket_alive(p):
                raise DaemonConfigError(f"another daemon is listening on {p}")
            p.unlink()  # left over by a daemon that was killed
        return p

    def _secure(self, s: zmq.Socket, endpoint: str) -> None:
        if endpoint.startswith("tcp://") and self.curve_secret_key_file:
            public, secret = load_curve_keys(self.curve_secret_key_file)
            s.curve_secretkey = secret
            s.curve_publickey = public
            s.curve_server = True
        elif endpoint.startswith("tcp://"):
            log.warning("INSECURE: listening on %s without CURVE (allow_insecure_tcp)", endpoint)

    def _bind_one(self, s: zmq.Socket, endpoint: str) -> None:
        p = self._prepare_ipc(endpoint)
        self._secure(s, endpoint)
        gid = _group_id(self.group)
        old = os.umask(0o117 if gid is not None else 0o177)  # no window where the socket is wider open
        try:
            s.bind(endpoint)
        finally:
            os.umask(old)
        if p is not None:
            if gid is not None:
                os.chown(p, -1, gid)
            os.chmod(p, 0o660 if gid is not None else 0o600)
            self._bound_paths.append(p)

    def _bind(self) -> None:
        r = self._ctx.socket(zmq.ROUTER)
        r.linger = 0
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)
        r.setsockopt(zmq.MAXMSGSIZE, self.max_request_bytes * HARD_CAP_FACTOR)
        r.sndhwm = 10000
        r.rcvhwm = 10000
        self._bind_one(r, self.endpoint)
        self._router = r
        p = self._ctx.socket(zmq.PUB)
        p.linger = 0
        self._bind_one(p, self.pub_endpoint)
        self._pub = p

    def _info_path(self) -> Path | None:
        p = _ipc_path(self.endpoint)
        return p.parent / INFO_NAME if p is not None else None

    def _write_info(self, *, running: bool) -> None:
        """daemon.json next to the socket: endpoints, db, last fingerprint (the runtime's fallback cache)."""
        path = self._info_path()
        if path is None:
            return
        data = {
            "endpoint": self.endpoint, "pub_endpoint": self.pub_endpoint, "db": self.db_path, "epoch": self.epoch,
            "pid": os.getpid() if running else None, "running": running, "updated": now(),
            "fingerprint": getattr(self.facts, "fingerprint", None),
            "software": getattr(self.facts, "software_hash", None),
            "transports": _transport_names(self.facts) if self.facts is not None else [],
        }
        tmp = path.with_name(f".{INFO_NAME}.{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640 if self.group else 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            gid = _group_id(self.group)
            if gid is not None:
                os.chown(tmp, -1, gid)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot write %s: %s", path, e)

    # -- serving loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Answer requests until stop() or a signal. Runs in the calling thread."""
        assert self._router is not None, "start() first"
        router = self._router
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        handle = self._handle
        observe = self.metrics.observe
        perf = time.perf_counter
        stop = self._stop
        try:
            while not stop.is_set():
                if not poller.poll(100):
                    continue
                for _ in range(1024):
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    t0 = perf()
                    n = len(frames)
                    if n == 2:
                        head = frames[:1]
                        body = frames[1]
                    elif n == 3 and not frames[1]:  # a REQ client: [id, b"", body]
                        head = frames[:2]
                        body = frames[2]
                    else:
                        self.metrics.dropped_frames += 1
                        continue
                    reply, op, outcome = handle(body)
                    try:
                        router.send_multipart([*head, reply], zmq.NOBLOCK)
                    except zmq.ZMQError:  # peer gone (ROUTER_MANDATORY) or its queue full: drop
                        outcome = "unsent"
                    observe(op, outcome, perf() - t0)
        finally:
            if self._serve_thread is None:
                self._close()

    def _handle(self, frame: bytes) -> tuple[bytes, str, str]:
        try:
            req = wire.decode_request(frame, self.max_request_bytes)
        except wire.WireError as e:
            return wire.encode_error(e.req_id, self.epoch, e.code, e.message), "invalid", e.code
        op = req.__struct_config__.tag
        try:
            ok, payload = self._handlers[type(req)](req)
        except Exception as e:
            log.exception("op %s failed", op)
            return wire.encode_error(req.id, self.epoch, wire.E_INTERNAL, f"{type(e).__name__}: {e}"), op, wire.E_INTERNAL
        if ok:
            return wire.encode_ok(req.id, self.epoch, payload), op, "ok"
        code, message = payload
        return wire.encode_error(req.id, self.epoch, code, message), op, code

    # -- ops -----------------------------------------------------------------------------------------
    def _op_get_profile(self, req: wire.GetProfile) -> tuple[bool, Any]:
        idx = self._index
        key = attrgetter(*_GP_KEY_FIELDS)(req)  # every field but v/id
        hit = idx.cache.get(key)
        if hit is None:
            hit = idx.lookup(req)
            if len(idx.cache) < CACHE_LIMIT:
                idx.cache[key] = hit
        if hit[0]:
            self.metrics.profiles_served += 1
        return hit

    def _op_hello(self, req: wire.Hello) -> tuple[bool, Any]:
        idx = self._index
        return True, wire.HelloResult(protocol=wire.PROTOCOL_VERSION, daemon_version=__version__, epoch=self.epoch,
                                      pub_endpoint=self.pub_endpoint, version=idx.version, fingerprint=idx.fingerprint,
                                      ops=list(wire.OPS))

    def _op_list_profiles(self, req: wire.ListProfiles) -> tuple[bool, Any]:
        idx = self._index
        key = (req.status, req.fingerprint, req.limit)
        raw = idx.list_cache.get(key)
        if raw is None:
            if req.status == "current":
                recs = idx.records
            elif req.status == "stale":
                recs = idx.stale
            else:  # history: read from the store (rare, not the hot path; WAL readers never block)
                rows = self.store.list_profiles(status=None if req.status == "all" else req.status, fingerprint=req.fingerprint)
                recs = [r for _, r in rows]
            if req.fingerprint:
                recs = [r for r in recs if r.key.fingerprint == req.fingerprint]
            res = wire.ListProfilesResult(
                version=idx.version, fingerprint=idx.fingerprint,
                profiles=[wire.ProfileResult.from_record(r, env=launcher_env(r.knobs, r.key.transport_family, r.key.nodes),
                                                         version=idx.version) for r in recs[: req.limit]],
            )
            raw = wire.encoder.encode(res)
            if len(idx.list_cache) < 64:
                idx.list_cache[key] = raw
        return True, msgspec.Raw(raw)

    def _op_fabric(self, req: wire.Fabric) -> tuple[bool, Any]:
        f = self.facts
        when, ok, msg = self._last_discovery
        return True, wire.FabricResult(fingerprint=getattr(f, "fingerprint", None), software=getattr(f, "software_hash", None),
                                       transports=_transport_names(f) if f is not None else [],
                                       facts=_facts_dict(f) if f is not None else {}, discovered_at=when, ok=ok, message=msg)

    def _jobs_info(self) -> wire.JobsInfo:
        queued, running, recent = self.jobs.info()
        return wire.JobsInfo(queued=queued, running=running, recent=recent, capacity=self.jobs.capacity)

    def _op_status(self, req: wire.Status) -> tuple[bool, Any]:
        idx = self._index
        when, ok, msg = self._last_discovery
        return True, wire.StatusResult(
            epoch=self.epoch, daemon_version=__version__, pid=os.getpid(), uptime_s=time.time() - self.started,
            db=self.db_path, endpoint=self.endpoint, pub_endpoint=self.pub_endpoint, version=idx.version,
            fingerprint=idx.fingerprint, last_discovery=when, last_discovery_ok=ok, last_discovery_message=msg,
            profiles_current=idx.current_count, profiles_stale=len(idx.stale), requests=self.metrics.total_requests(),
            jobs=self._jobs_info(),
        )

    def _op_retune(self, req: wire.Retune) -> tuple[bool, Any]:
        if req.cancel is not None:
            job = self.jobs.cancel(req.cancel)
            if job is None:
                return False, (wire.E_NOT_FOUND, f"no queued or running job {req.cancel}")
            return True, wire.RetuneResult(job=job.info(), message=f"cancelling job {job.id}")
        idx = self._index
        if idx.fingerprint is None:
            return False, (wire.E_NOT_FOUND, "the fabric is unknown (discovery failed); nothing to re-tune for")
        keys = self._retune_keys(idx, all_current=req.all)
        if not keys:
            return True, wire.RetuneResult(job=None, message="nothing to re-tune: no stale profile lacks a current one")
        try:
            job = self.jobs.submit(reason=req.reason, old_fingerprint=None, keys=keys, all_current=req.all,
                                   persist_async=True)  # the serving loop never waits on the database
        except queue.Full:
            return False, (wire.E_BUSY, f"the job queue is full ({self.jobs.capacity} jobs)")
        return True, wire.RetuneResult(job=job.info(), message=f"queued job {job.id} for {len(keys)} key(s)")

    @staticmethod
    def _retune_keys(idx: ProfileIndex, *, all_current: bool) -> list[ProfileKey]:
        def tkey(k: ProfileKey) -> tuple:
            return (k.ep_size, k.nodes, k.hidden, k.intermediate, k.experts, k.topk, k.dtype, k.token_bucket)

        have = {tkey(r.key) for r in idx.records if r.key.fingerprint == idx.fingerprint}
        out: dict[tuple, ProfileKey] = {}
        for r in idx.stale:
            if tkey(r.key) not in have:
                out.setdefault(tkey(r.key), r.key)
        if all_current:
            for r in idx.records:
                if r.key.fingerprint == idx.fingerprint:
                    out.setdefault(tkey(r.key), r.key)
        return list(out.values())

    # -- writes (worker threads) -------------------------------------------------------------------
    def _rebuild(self, changes: list[dict[str, Any]] | None = None) -> None:
        """Re-read the store into a new index; then publish `changes` with fresh versions."""
        changes = changes or []
        with self._commit_lock:
            current = [r for _, r in self.store.list_profiles(status="current")]
            stale = [r for _, r in self.store.list_profiles(status="stale")]
            version = self.version + len(changes)
            self._index = ProfileIndex(current, version=version, facts=self.facts, stale=stale)
            first = self.version + 1
            self.version = version
            for n, ch in enumerate(changes):
                self._publish(wire.Change(version=first + n, epoch=self.epoch, ts=time.time(), **ch))

    def _publish(self, change: wire.Change) -> None:
        with self._pub_lock:
            if self._pub is None:
                return
            try:
                self._pub.send_multipart(wire.encode_change(change), zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("cannot publish %s: %s", change.kind, e)
        log.info("published %s v%d", change.kind, change.version, extra={"fingerprint": change.fingerprint})

    def _last_fabric_event(self) -> dict[str, Any] | None:
        for e in self.store.list_events(limit=500):  # newest first
            kind = e["kind"] if isinstance(e, dict) else e.kind
            if kind in ("fabric_seen", "fabric_changed"):
                d = e["details"] if isinstance(e, dict) else e.details
                if isinstance(d, dict) and d.get("fingerprint"):
                    return d
        return None

    def _discover_once(self) -> Any:
        """Run discovery once and record the outcome (status op, metrics); None when it failed."""
        try:
            facts = self._discover()  # type: ignore[misc]
        except Exception as e:
            self._last_discovery = (now(), False, f"{type(e).__name__}: {e}")
            self.metrics.discovery("error")
            log.error("fabric discovery failed: %s", e)
            return None
        self.metrics.discovery("ok")
        self._last_discovery = (now(), True, "")
        return facts

    def _startup_discovery(self) -> None:
        if self._discover is None:
            self._last_discovery = (now(), False, "no discovery configured")
            return
        facts = self._discover_once()
        if facts is None:
            return
        last = self._last_fabric_event()
        if last is not None and last.get("fingerprint") != facts.fingerprint:
            self._fabric_changed(last.get("fingerprint"), last.get("facts") or {}, facts, rebuild=False)
            return
        self.facts = facts
        self.store.upsert_fingerprint(facts.fingerprint, _facts_dict(facts))
        if last is None:
            self.store.add_event(kind="fabric_seen", reason="first discovery",
                                 details={"fingerprint": facts.fingerprint, "facts": _facts_dict(facts)})

    def _fabric_changed(self, old_fp: str | None, old_facts: dict[str, Any], facts: Any, *, rebuild: bool = True) -> None:
        new_dict = _facts_dict(facts)
        try:
            reasons = self._diff(old_facts, new_dict) if old_facts else ["no previous facts recorded"]
        except Exception as e:
            reasons = [f"facts changed (diff failed: {e})"]
        reason = "; ".join(reasons)[:4000]
        log.warning("fabric changed", extra={"old_fingerprint": old_fp, "fingerprint": facts.fingerprint, "reasons": reasons})
        self.metrics.fabric_changes += 1
        self.store.upsert_fingerprint(facts.fingerprint, new_dict)
        self.store.add_event(kind="fabric_changed", reason=reason,
                             details={"old_fingerprint": old_fp, "fingerprint": facts.fingerprint, "reasons": reasons, "facts": new_dict})
        stale_recs = [r for _, r in self.store.list_profiles(status="current", fingerprint=old_fp)] if old_fp else []
        if old_fp:
            self.store.mark_stale(fingerprint=old_fp, reason=f"fabric changed: {reason}"[:4000])
        with self._commit_lock:
            self.facts = facts
            self._write_info(running=True)
            changes = [dict(kind="fabric_changed", fingerprint=facts.fingerprint, old_fingerprint=old_fp, reasons=reasons)]
            if stale_recs:
                changes.append(dict(kind="profile_stale", fingerprint=old_fp, profiles=[r.profile_hash for r in stale_recs],
                                    keys=[r.key for r in stale_recs], reasons=reasons))
            if rebuild:
                self._rebuild(changes)
        if stale_recs:
            try:
                self.jobs.submit(reason=f"fabric changed: {reason}"[:512], old_fingerprint=old_fp,
                                 keys=[r.key for r in stale_recs])
            except queue.Full:
                log.error("job queue full: the re-tune after the fabric change was not queued")

    def rediscover(self) -> None:
        """One discovery round (the worker calls this every interval)."""
        facts = self._discover_once()
        if facts is None:
            return
        old = self.facts
        if old is not None and old.fingerprint == facts.fingerprint:
            return
        if old is None:
            last = self._last_fabric_event()
            if last is None or last.get("fingerprint") == facts.fingerprint:
                with self._commit_lock:
                    self.facts = facts
                    self.store.upsert_fingerprint(facts.fingerprint, _facts_dict(facts))
                    if last is None:
                        self.store.add_event(kind="fabric_seen", reason="first discovery",
                                             details={"fingerprint": facts.fingerprint, "facts": _facts_dict(facts)})
                    self._write_info(running=True)
                    self._rebuild([dict(kind="fabric_changed", fingerprint=facts.fingerprint, reasons=["fabric discovered"])])
                return
            self._fabric_changed(last.get("fingerprint"), last.get("facts") or {}, facts)
            return
        self._fabric_changed(old.fingerprint, _facts_dict(old), facts)

    def _discovery_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.rediscover()
            except Exception:
                log.exception("discovery round failed")

    def _recover(self) -> list[dict[str, Any]]:
        resume, next_id = recover_jobs(self.store)
        self.jobs._ids = itertools.count(max(next_id, 1))
        return resume

    def _resume(self, resume: list[dict[str, Any]]) -> None:
        for d in resume:
            keys = keys_from_details(d)
            if not keys:
                continue
            try:
                self.jobs.submit(reason=f"resumed job {d.get('job_id')} after a restart", old_fingerprint=d.get("old_fingerprint"),
                                 keys=keys, all_current=bool(d.get("all_current")))
            except queue.Full:
                log.error("job queue full: job %s not resumed", d.get("job_id"))

    def _job_done(self, job: Any, written: list[ProfileRecord]) -> None:
        changes = []
        if written:
            changes.append(dict(kind="profile_updated", fingerprint=getattr(self.facts, "fingerprint", None),
                                profiles=[r.profile_hash for r in written], keys=[r.key for r in written],
                                reasons=[f"job {job.id}: {job.reason}"[:512]]))
        self._rebuild(changes)
        gc.collect()  # a job imports the tuner (Optuna...): freeze what stays, as at start
        gc.freeze()


# -- entry point (`python -m moetune.tuner.daemon.server` and `moetune serve`) ---------------------------------
def _load_hook(spec: str) -> Any:
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise DaemonConfigError(f"a hook is module:attribute, got {spec!r}")
    return getattr(importlib.import_module(mod), attr)


def _load_config(config: Path | None) -> Any:
    from moetune.runtime.config import load_config

    return load_config(config)


def run_daemon(
    *,
    socket: str | None = None,
    pub_socket: str | None = None,
    db: str | None = None,
    config: Path | None = None,
    metrics_port: int | None = None,
    rediscover_interval: float | None = None,
    capture: Path | None = None,
    allow_insecure_tcp: bool | None = None,
    store_hook: str | None = None,
    discover_hook: str | None = None,
    retune_hook: str | None = None,
    log_level: str | None = None,
) -> int:
    """Build a Daemon from config + options and serve until SIGTERM/SIGINT. Returns the exit code."""
    cfg = _load_config(config)
    d = cfg.daemon
    setup_logging(log_level or d.log_level)
    endpoint = socket or d.socket
    pub = pub_socket or (derive_pub_endpoint(endpoint) if socket else d.pub_socket)
    db_path = db or cfg.store.db
    if store_hook:
        store = _load_hook(store_hook)(db_path)
    else:
        from moetune.tuner.store.store import Store

        Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        store = Store(db_path)
    if discover_hook:
        hook = _load_hook(discover_hook)
        discover = lambda: hook(capture)  # noqa: E731
    else:
        discover = make_discover(capture)
    retune = _load_hook(retune_hook) if retune_hook else None
    daemon = Daemon(
        store=store, endpoint=endpoint, pub_endpoint=pub, discover=discover, retune_job=retune,
        tune=TuneSettings(backend=cfg.tune.backend, trials=cfg.tune.trials, timeout_s=cfg.tune.timeout_s),
        rediscover_interval_s=d.rediscover_interval_s if rediscover_interval is None else rediscover_interval,
        max_request_bytes=d.max_request_bytes, curve_secret_key_file=d.curve_secret_key_file or None,
        allow_insecure_tcp=d.allow_insecure_tcp if allow_insecure_tcp is None else allow_insecure_tcp,
        group=d.group, metrics_port=d.metrics_port if metrics_port is None else metrics_port, db_path=str(db_path),
    )
    daemon.install_signal_handlers()
    daemon.start()
    daemon.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moetune.tuner.daemon.server", description="the moetune daemon (same as `moetune serve`)")
    ap.add_argument("--socket")
    ap.add_argument("--pub-socket")
    ap.add_argument("--db")
    ap.add_argument("--config", type=Path)
    ap.add_argument("--metrics-port", type=int)
    ap.add_argument("--rediscover-interval", type=float)
    ap.add_argument("--capture", type=Path)
    ap.add_argument("--allow-insecure-tcp", action="store_true", default=None)
    ap.add_argument("--log-level")
    # test/plugin hooks: module:callable
    ap.add_argument("--store-hook", help=argparse.SUPPRESS)
    ap.add_argument("--discover-hook", help=argparse.SUPPRESS)
    ap.add_argument("--retune-hook", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        return run_daemon(socket=a.socket, pub_socket=a.pub_socket, db=a.db, config=a.config, metrics_port=a.metrics_port,
                          rediscover_interval=a.rediscover_interval, capture=a.capture, allow_insecure_tcp=a.allow_insecure_tcp,
                          store_hook=a.store_hook, discover_hook=a.discover_hook, retune_hook=a.retune_hook, log_level=a.log_level)
    except (DaemonConfigError, ValueError, OSError, zmq.ZMQError) as e:  # config, key files, bind
        print(f"moetune serve: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # StoreError: not a database, unknown revision, cannot open
        print(f"moetune serve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
