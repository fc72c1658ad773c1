"""The runtime's profile client: talks to the moetune daemon, falls back loudly when it cannot.

`ProfileClient` uses a ZeroMQ DEALER socket (never REQ: a REQ socket wedges after a time-out). On a
time-out the socket is closed and a fresh one is made for the retry (the "Lazy Pirate" pattern), so a
late reply can never be taken for the answer to a later request.

Change notifications: `subscribe()` connects a SUB socket FIRST, then the caller fetches a snapshot
(`get_profile`/`list_profiles` return the daemon's change `version`), then `poll_changes()` yields only
the changes whose version is above it. `TrackedProfile` does exactly that for one key.

Fallback chain (`resolve`): daemon -> the daemon's database opened read-only with the stdlib sqlite3
module -> policy defaults (`policy_default_knobs(family)`, else `default_knobs`), all inside a bounded
time (`timeout_ms`, 200 ms by default); every fallback warns loudly (warnings.warn + logging.WARNING).

Where things are found (the runtime does not read the TOML config; it mirrors the tuner's defaults):
- endpoint: `MOETUNE_CLIENT_SOCKET`, else `MOETUNE_DAEMON_SOCKET`, else the first runtime directory
  holding `daemon.sock` among `$MOETUNE_HOME/run`, `$XDG_RUNTIME_DIR/moetune`, `/run/moetune`,
  `/tmp/moetune-<uid>`;
- the daemon writes `daemon.json` next to its socket (endpoint, PUB endpoint, database path, last
  fingerprint and transport families); the fallback reads it for the database and the fingerprint;
- database: `MOETUNE_STORE_DB`, else `daemon.json`'s db, else `$MOETUNE_HOME/moetune.db`, else
  `$XDG_DATA_HOME/moetune/moetune.db` (or `~/.local/share/moetune/moetune.db`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import zmq

from moetune.runtime import wire
from moetune.runtime.knobs import KnobError, Knobs, default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, nearest_bucket
from moetune.runtime.shapes import ModelShape

log = logging.getLogger("moetune.client")

SOCKET_NAME = "daemon.sock"
PUB_SOCKET_NAME = "events.sock"
INFO_NAME = "daemon.json"
DB_NAME = "moetune.db"
DEFAULT_TIMEOUT_MS = 200


class DaemonUnavailable(RuntimeError):
    """No reply from the daemon within the time budget (or no daemon socket at all)."""


class DaemonError(RuntimeError):
    """The daemon answered ok=false."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class FallbackWarning(RuntimeWarning):
    """The runtime could not get a tuned profile from the daemon and fell back."""


# -- where things live ------------------------------------------------------------------------------
def runtime_dir_candidates(env: Mapping[str, str] = os.environ) -> list[Path]:
    out: list[Path] = []
    if env.get("MOETUNE_HOME"):
        out.append(Path(env["MOETUNE_HOME"]).expanduser() / "run")
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and Path(xdg).is_absolute():
        out.append(Path(xdg) / "moetune")
    out.append(Path("/run/moetune"))
    out.append(Path("/tmp") / f"moetune-{os.getuid()}")
    return out


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def default_endpoint(env: Mapping[str, str] = os.environ) -> str:
    for var in ("MOETUNE_CLIENT_SOCKET", "MOETUNE_DAEMON_SOCKET"):
        if env.get(var):
            return env[var]
    cands = runtime_dir_candidates(env)
    for d in cands:
        try:
            os.stat(d / SOCKET_NAME)
        except OSError:
            continue
        return f"ipc://{d / SOCKET_NAME}"
    return f"ipc://{cands[0] / SOCKET_NAME}"


def read_daemon_info(endpoint: str | None = None, env: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The `daemon.json` the daemon keeps next to its IPC socket (None when absent or unreadable)."""
    dirs: list[Path] = []
    p = _ipc_path(endpoint) if endpoint else None
    if p is not None:
        dirs.append(p.parent)
    dirs += runtime_dir_candidates(env)
    for d in dirs:
        try:
            data = json.loads((d / INFO_NAME).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return None


def default_db_path(info: Mapping[str, Any] | None = None, env: Mapping[str, str] = os.environ) -> Path:
    if env.get("MOETUNE_STORE_DB"):
        return Path(env["MOETUNE_STORE_DB"]).expanduser()
    if info and isinstance(info.get("db"), str) and info["db"]:
        return Path(info["db"])
    if env.get("MOETUNE_HOME"):
        return Path(env["MOETUNE_HOME"]).expanduser() / DB_NAME
    xdg = env.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path(env.get("HOME") or Path.home()) / ".local" / "share"
    return base / "moetune" / DB_NAME


# -- the read-only database fallback ----------------------------------------------------------------
_PROFILE_COLUMNS = (
    "fingerprint, software, transport_family, ep_size, nodes, hidden, intermediate, experts, topk, dtype, "
    "token_bucket, knobs, latency_us, spread_us, backend, status, software_versions, created, updated"
)


def query_db_profiles(
    db_path: str | Path,
    *,
    ep_size: int,
    nodes: int,
    hidden: int,
    intermediate: int,
    experts: int,
    topk: int,
    dtype: str,
    fingerprint: str | None = None,
    timeout_s: float = 0.05,
) -> list[ProfileRecord]:
    """Current profiles of one shape/EP size from the store's `profiles` table, opened read-only.

    The ONE place the runtime reads the database (stdlib sqlite3, `file:...?mode=ro`, no SQLAlchemy).
    Columns as defined by moetune's store (tuner/store_models.py, table `profiles`). Rows that do not
    parse are skipped. Raises sqlite3.Error / OSError when the file cannot be read.
    """
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"no database at {path}")
    uri = f"{path.resolve().as_uri()}?mode=ro"
    sql = (
        f"SELECT {_PROFILE_COLUMNS} FROM profiles WHERE status = 'current' AND ep_size = ? AND nodes = ? "
        "AND hidden = ? AND intermediate = ? AND experts = ? AND topk = ? AND dtype = ?"
    )
    args: list[Any] = [ep_size, nodes, hidden, intermediate, experts, topk, dtype]
    if fingerprint:
        sql += " AND fingerprint = ?"
        args.append(fingerprint)
    try:
        rows = _ro_query(uri, sql, args, timeout_s)
    except sqlite3.OperationalError as e:
        # A WAL database whose -shm/-wal files are gone (the daemon closed it) in a directory we may not
        # write (/var/lib/moetune) cannot be opened mode=ro; immutable=1 can, and is safe exactly when
        # nobody writes, which is when this fallback runs (the daemon is down).
        if "unable to open" not in str(e) and "readonly database" not in str(e):
            raise
        rows = _ro_query(uri + "&immutable=1", sql, args, timeout_s)
    out: list[ProfileRecord] = []
    for r in rows:
        try:
            key = ProfileKey(
                fingerprint=r[0], software=r[1], transport_family=r[2], ep_size=r[3], nodes=r[4], hidden=r[5],
                intermediate=r[6], experts=r[7], topk=r[8], dtype=r[9], token_bucket=r[10],
            )
            knobs = Knobs.from_dict(json.loads(r[11]) if isinstance(r[11], str) else r[11])
            sv = json.loads(r[16]) if isinstance(r[16], str) and r[16] else {}
            out.append(
                ProfileRecord(
                    key=key, knobs=knobs, latency_us=float(r[12]), spread_us=float(r[13]), backend=str(r[14]),
                    status=r[15], software_versions=sv if isinstance(sv, dict) else {}, created=r[17] or "",
                    updated=r[18] or "",
                )
            )
        except (ValueError, TypeError, KnobError, msgspec.ValidationError) as e:
            log.debug("skipping an unreadable profile row: %s", e)
    return out


def _ro_query(uri: str, sql: str, args: list[Any], timeout_s: float) -> list[tuple]:
    conn = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def pick_profile(
    records: list[ProfileRecord], tokens: int, *, fingerprint: str | None = None, transport_family: str | None = None
) -> ProfileRecord | None:
    """The profile at the nearest token bucket among `records` (one shape/EP size).

    With several fingerprints (fingerprint unknown) the most recently updated fingerprint wins; with
    several transport families at the chosen bucket, the lowest latency wins (unless one is asked for).
    """
    recs = [r for r in records if r.status == "current"]
    if fingerprint:
        recs = [r for r in recs if r.key.fingerprint == fingerprint]
    if transport_family:
        recs = [r for r in recs if r.key.transport_family == transport_family]
    if not recs:
        return None
    if len({r.key.fingerprint for r in recs}) > 1:
        newest = max(recs, key=lambda r: r.updated or r.created)
        recs = [r for r in recs if r.key.fingerprint == newest.key.fingerprint]
    bucket = nearest_bucket(tokens, sorted({r.key.token_bucket for r in recs}))
    at = [r for r in recs if r.key.token_bucket == bucket]
    return min(at, key=lambda r: r.latency_us)


# -- the client -------------------------------------------------------------------------------------
class Resolution(msgspec.Struct, kw_only=True):
    """What the fallback chain settled on."""

    knobs: Knobs
    source: str  # "daemon" | "database" | "policy" | "default"
    profile_hash: str
    status: str
    env: dict[str, str] = {}
    key: ProfileKey | None = None
    family: str | None = None
    message: str = ""
    elapsed_ms: float = 0.0
    epoch: str | None = None


_ids = itertools.count(1)


class ProfileClient:
    """A DEALER client for the moetune daemon (one per process; not thread-safe)."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_ms: int | None = None,
        retries: int = 1,
        curve_server_key: bytes | str | None = None,
        curve_public_key: bytes | str | None = None,
        curve_secret_key: bytes | str | None = None,
        db_path: str | Path | None = None,
        context: zmq.Context | None = None,
        env: Mapping[str, str] = os.environ,
    ):
        self.endpoint = endpoint or default_endpoint(env)
        if timeout_ms is None:
            try:
                timeout_ms = int(env.get("MOETUNE_CLIENT_TIMEOUT_MS", DEFAULT_TIMEOUT_MS))
            except ValueError:
                timeout_ms = DEFAULT_TIMEOUT_MS
        self.timeout_ms = max(1, int(timeout_ms))
        self.retries = max(0, int(retries))
        self._env = env
        self._db_path = Path(db_path) if db_path else None
        self._curve = None
        key_file = env.get("MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE", "")
        if curve_server_key is None and key_file and self.endpoint.startswith("tcp://"):
            from zmq.auth import load_certificate

            curve_server_key, _ = load_certificate(key_file)
        if curve_server_key is not None:
            if curve_public_key is None or curve_secret_key is None:
                curve_public_key, curve_secret_key = zmq.curve_keypair()
            self._curve = tuple(k.encode() if isinstance(k, str) else k for k in (curve_server_key, curve_public_key, curve_secret_key))
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._sub: zmq.Socket | None = None
        self.epoch: str | None = None
        self.version = 0  # the snapshot version changes are compared with
        self.restarted = False  # set when the daemon's epoch changed between replies

    # -- sockets ---------------------------------------------------------------------------------
    def _secure(self, s: zmq.Socket) -> None:
        if self._curve:
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = self._curve

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.linger = 0
            self._secure(s)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self._reset()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def __enter__(self) -> ProfileClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def daemon_socket_exists(self) -> bool:
        p = _ipc_path(self.endpoint)
        if p is None:
            return True
        try:
            os.stat(p)
        except OSError:  # absent, or a directory we may not enter (another user's daemon)
            return False
        return True

    # -- requests --------------------------------------------------------------------------------
    def request(self, op: str, *, timeout_ms: int | None = None, **fields: Any) -> Any:
        """Send one request; return the typed result. DaemonUnavailable after the retries time out."""
        budget = (timeout_ms if timeout_ms is not None else self.timeout_ms) / 1000.0
        if not self.daemon_socket_exists():
            raise DaemonUnavailable(f"no daemon socket at {self.endpoint} (absent or not accessible)")
        deadline = time.monotonic() + budget
        attempts = self.retries + 1
        for attempt in range(attempts):
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                break
            per_try = left / (attempts - attempt)
            rid = next(_ids)
            sock = self._socket()
            try:
                sock.send(wire.encode_request(op, rid, **fields), zmq.NOBLOCK)
            except zmq.Again:  # send queue full: treat as a time-out of this attempt
                self._reset()
                continue
            end = now + per_try
            while True:
                wait = end - time.monotonic()
                if wait <= 0 or not sock.poll(max(1, int(wait * 1000)), zmq.POLLIN):
                    break
                frame = sock.recv()
                try:
                    rep = wire.reply_decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if rep.id != rid:
                    continue  # a late reply to an earlier request
                if self.epoch is not None and rep.epoch != self.epoch:
                    self.restarted = True
                    self.version = 0
                self.epoch = rep.epoch
                if not rep.ok:
                    err = rep.error or wire.ErrorInfo(code=wire.E_INTERNAL, message="no error given")
                    raise DaemonError(err.code, err.message)
                return wire.decode_result(op, rep.result)
            self._reset()  # Lazy Pirate: never reuse a socket that timed out
        raise DaemonUnavailable(f"no reply from the daemon at {self.endpoint} within {budget * 1000:.0f} ms")

    def hello(self, **kw: Any) -> wire.HelloResult:
        return self.request("hello", client=f"pid:{os.getpid()}", **kw)

    def get_profile(
        self,
        *,
        ep_size: int,
        tokens: int,
        nodes: int = 1,
        model: ModelShape | str | None = None,
        fingerprint: str | None = None,
        software: str | None = None,
        transport_family: str | None = None,
        timeout_ms: int | None = None,
    ) -> wire.ProfileResult:
        fields: dict[str, Any] = dict(ep_size=ep_size, tokens=tokens, nodes=nodes, fingerprint=fingerprint,
                                      software=software, transport_family=transport_family)
        if isinstance(model, ModelShape):
            fields.update(hidden=model.hidden, intermediate=model.intermediate, experts=model.experts,
                          topk=model.topk, dtype=model.dtype)
        elif model is not None:
            fields["model"] = model
        return self.request("get_profile", timeout_ms=timeout_ms, **fields)

    def list_profiles(self, *, status: str = "current", fingerprint: str | None = None, limit: int = 1000) -> wire.ListProfilesResult:
        return self.request("list_profiles", status=status, fingerprint=fingerprint, limit=limit)

    def fabric(self) -> wire.FabricResult:
        return self.request("fabric")

    def status(self) -> wire.StatusResult:
        return self.request("status")

    def retune(self, *, all: bool = False, cancel: int | None = None, reason: str = "requested") -> wire.RetuneResult:
        return self.request("retune", all=all or None, cancel=cancel, reason=reason)

    # -- change notifications --------------------------------------------------------------------
    def subscribe(self, pub_endpoint: str | None = None, topics: tuple[str, ...] = ("",)) -> None:
        """Connect the SUB socket (do this BEFORE fetching the snapshot)."""
        if self._sub is not None:
            return
        if pub_endpoint is None:
            pub_endpoint = self.hello().pub_endpoint
        s = self._ctx.socket(zmq.SUB)
        s.linger = 0
        self._secure(s)
        for t in topics:
            s.setsockopt(zmq.SUBSCRIBE, t.encode())
        s.connect(pub_endpoint)
        self._sub = s

    def poll_changes(self, timeout_ms: int = 0) -> list[wire.Change]:
        """Changes newer than `self.version` (received so far, waiting up to timeout_ms for the first)."""
        if self._sub is None:
            raise RuntimeError("call subscribe() first")
        out: list[wire.Change] = []
        wait = timeout_ms
        while self._sub.poll(wait, zmq.POLLIN):
            wait = 0
            frames = self._sub.recv_multipart()
            try:
                ch = wire.decode_change(frames)
            except (wire.WireError, msgspec.DecodeError, msgspec.ValidationError):
                continue
            if self.epoch is not None and ch.epoch != self.epoch:
                self.restarted = True  # a new daemon: versions restart, refetch everything
                self.epoch = ch.epoch
                self.version = 0
            if ch.version > self.version:
                out.append(ch)
        return out

    def track(self, **query: Any) -> TrackedProfile:
        return TrackedProfile(self, query)

    # -- the fallback chain ----------------------------------------------------------------------
    def resolve(
        self,
        *,
        model: ModelShape,
        ep_size: int,
        tokens: int,
        nodes: int = 1,
        transport_family: str | None = None,
        budget_ms: int | None = None,
    ) -> Resolution:
        """Daemon -> read-only database -> policy defaults, inside `budget_ms` (default timeout_ms)."""
        from moetune.runtime.profiles.autoload import launcher_env  # local: autoload imports this module

        t0 = time.monotonic()
        budget = (budget_ms if budget_ms is not None else self.timeout_ms) / 1000.0
        problems: list[str] = []
        try:
            res = self.get_profile(ep_size=ep_size, tokens=tokens, nodes=nodes, model=model,
                                   transport_family=transport_family, timeout_ms=int(budget * 1000))
            return Resolution(knobs=res.knobs, source="daemon", profile_hash=res.profile_hash, status=res.status,
                              env=res.env, key=res.key, family=res.key.transport_family, epoch=self.epoch,
                              elapsed_ms=(time.monotonic() - t0) * 1000)
        except DaemonUnavailable as e:
            problems.append(f"daemon: {e}")
        except DaemonError as e:
            problems.append(f"daemon: {e}")
        info = read_daemon_info(self.endpoint, self._env)
        fingerprint = info.get("fingerprint") if info else None
        try:
            db = self._db_path or default_db_path(info, self._env)
            recs = query_db_profiles(db, ep_size=ep_size, nodes=nodes, hidden=model.hidden, intermediate=model.intermediate,
                                     experts=model.experts, topk=model.topk, dtype=model.dtype)
            # The daemon caches the last fingerprint in daemon.json; without it, any current profile
            # of this shape and EP size is taken (the most recently updated fingerprint).
            rec = pick_profile(recs, tokens, fingerprint=fingerprint, transport_family=transport_family)
            if rec is None and fingerprint:
                problems.append(f"database {db}: no current profile for fingerprint {fingerprint}")
            elif rec is None:
                problems.append(f"database {db}: no current profile for this shape/EP size")
            if rec is not None:
                msg = "; ".join(problems) + f"; using the read-only database {db}"
                _warn(f"moetune: tuned profile not served by the daemon ({msg})")
                return Resolution(knobs=rec.knobs, source="database", profile_hash=rec.profile_hash, status=rec.status,
                                  env=launcher_env(rec.knobs, rec.key.transport_family, nodes), key=rec.key,
                                  family=rec.key.transport_family, message=msg, elapsed_ms=(time.monotonic() - t0) * 1000)
        except (OSError, sqlite3.Error) as e:
            problems.append(f"database: {e}")
        family = transport_family or _cached_family(info, nodes)
        knobs, source = policy_or_default(family)
        what = "the policy default" if source == "policy" else "the built-in default"
        msg = "; ".join(problems) + f"; using {what} for {family}"
        _warn(f"moetune: NO tuned profile ({msg})")
        return Resolution(knobs=knobs, source=source, profile_hash=f"{source}:{knobs.digest()}", status="default",
                          env=launcher_env(knobs, family, nodes), family=family, message=msg,
                          elapsed_ms=(time.monotonic() - t0) * 1000)


def _cached_family(info: Mapping[str, Any] | None, nodes: int = 1) -> str:
    """The node's preferred transport family as the daemon last discovered it (NVLink only within a node)."""
    fams = info.get("transports") if info else None
    if isinstance(fams, list):
        for f in fams:
            if isinstance(f, str) and (nodes == 1 or not f.startswith("nvlink")):
                return f
    return "collective"


def policy_or_default(family: str) -> tuple[Knobs, str]:
    """The policy default for a transport family, else the built-in default of its transport."""
    try:
        from moetune.runtime.profiles.policy_defaults import (
            policy_default_knobs,  # shipped by the tuner branch
        )

        return policy_default_knobs(family), "policy"
    except Exception as e:  # missing module, missing file or bad policy: built-in default
        log.debug("no policy default for %s: %s", family, e)
    transport = family.split(":", 1)[0]
    try:
        return default_knobs(transport), "default"
    except KnobError:
        return default_knobs("collective"), "default"


def _warn(message: str) -> None:
    warnings.warn(message, FallbackWarning, stacklevel=3)
    log.warning(message)


class TrackedProfile:
    """One key's profile kept current: subscribe, snapshot, then apply newer changes (Clone pattern)."""

    def __init__(self, client: ProfileClient, query: dict[str, Any]):
        self.client = client
        self.query = query
        self.current: wire.ProfileResult | None = None
        self.error: DaemonError | None = None
        self._lock = threading.Lock()
        client.subscribe()
        self._fetch()

    def _fetch(self) -> None:
        try:
            res = self.client.get_profile(**self.query)
            self.current, self.error = res, None
            self.client.version = res.version  # the snapshot's version
            self.client.restarted = False
        except DaemonError as e:
            # not found / stale: never keep serving a profile the daemon no longer calls current
            self.current, self.error = None, e

    def refresh(self, timeout_ms: int = 0) -> bool:
        """Apply pending changes; True when the profile (hash or presence) changed."""
        with self._lock:
            changes = self.client.poll_changes(timeout_ms)
            if not changes and not self.client.restarted:
                return False
            before = self.current.profile_hash if self.current else None
            newest = max((c.version for c in changes), default=self.client.version)
            self._fetch()
            self.client.version = max(self.client.version, newest)
            after = self.current.profile_hash if self.current else None
            return before != after
