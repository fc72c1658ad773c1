"""The runtime's profile client: talks to the moetune daemon, falls back loudly when it cannot.

`ProfileClient` uses a ZeroMQ DEALER socket (never REQ: a REQ socket wedges after a time-out). On a
time-out the socket is closed and a fresh one is made for the retry (the "Lazy Pirate" pattern), so a
late reply can never be taken for the answer to a later request.

Change notifications: `subscribe()` connects a SUB socket FIRST, then the caller fetches a snapshot
(`get_profile`/`list_profiles` return the daemon's change `version`), then `poll_changes()` yields only
the changes whose version is above it. `TrackedProfile` (tracked_profile.py) does exactly that for one key.

Fallback chain (`resolve`): daemon -> the daemon's database (`client_db_path`: MOETUNE_STORE_DB, a configured
[store] db, daemon.json's, the default; a stopped daemon's is said) opened read-only with the stdlib sqlite3
module -> policy defaults (`policy_default_knobs(family)`, else `default_knobs`), all inside a bounded
time (`timeout_ms`, 200 ms by default). A fallback warns ONCE per resolution (warnings.warn +
logging.WARNING), naming every source tried and why it was passed over.

Trust (issue 19): a profile is applied as tuned only when it was measured on this node's fingerprint and
software (`ProfileRecord.is_tuned_for`; the node's identity: `node_identity`: the answering daemon's reported
fabric facts checked against this node and this process's packages; for the database fallback, the database's
recorded facts checked likewise; unknown: nothing is tuned). A modelled profile (the
node's calibrated model or a shipped preset) is used only with `allow_modelled=True` (or
`MOETUNE_CLIENT_ALLOW_MODELLED=1`) and then labelled MODELLED in the warning and the resolution. A reply
that does not validate (not JSON, wrong types, another protocol version, unknown fields) is `BadReply`
and falls back like a silent daemon; so is a reply that does not answer the request (another key, a bucket
the daemon would not pick, a profile that is not current, a profile_hash that is not the hash of its key and
knobs). A profile whose transport this runtime does not have falls back too. A reply or change notice over
`wire.MAX_REPLY_BYTES` drops the connection (ZMQ_MAXMSGSIZE) before it is buffered. Sockets and `daemon.json` are used
only from a runtime directory this user may trust (`paths.untrusted_dir_reason`), the fallback database only where
other users cannot write it (`paths.untrusted_file_reason`: that rule again), `daemon.json` only as a regular file
of at most MAX_INFO_BYTES (never a link or a FIFO); environment variables only as
`launcher_env` computes them here from the profile's knobs (a reply's own `env` is never exported). A tcp://
endpoint is used only with CURVE (or, explicitly, plain text on loopback); the PUB endpoint a daemon names must
be reached like its request socket.

The performance environment (NCCL_*, NVSHMEM_*, FI_*, ...: `perf_env`): a tuned profile carries the one it was
measured in (`ProfileRecord.perf_env`; not recorded by an older moetune: "unknown", never taken to match). The
client compares it with this job's (`env`) and only compares: the recorded variables are never exported, and a
reply carrying any name that is not a performance variable is `BadReply`. Where they differ the profile is still
served, the resolution says so (`env_status`, `env_diff`) and one warning per process names the variables
(`EnvMismatchWarning`); `env_mismatch = "refuse"` (config `client.env_mismatch`) passes such a profile, and one whose
environment was not recorded, over instead, so the chain ends at the policy default; "ignore" serves it silently.

The runtime options (hs_native, symm, fused_pack, ...: the data-path ones, runtime/options.py DATA_PATH_OPTIONS): a
tuned profile carries those it was measured under (`ProfileRecord.runtime_options`; not recorded: "unknown", never
taken to match). They are compared with the job's (`resolve(options=...)` and `track(options=...)`, an EP buffer's;
else what the config and `env` resolve): a profile measured under other options is never applied as tuned (passed over, the fallback warning
names each option, as an environment difference is named); an unrecorded one is judged as an unrecorded environment
is (served, or passed over with `env_mismatch = "refuse"`), and the resolution says which (`options_status`).

Where things are found: `moetune.runtime.paths` (the config's client.socket and `default_endpoint` both follow
`find_daemon_socket`; `client_db_path`; `endpoint_problem`); the daemon writes `daemon.json` next to its socket (endpoint, PUB endpoint,
database path, fingerprint, software hash and transport families of the node), and the client reads it only there.

Its parts, beside this module in runtime/profiles/: errors (the exceptions and warnings), daemon_info (reading
daemon.json, telling a stopped or killed daemon), db_lookup (the read-only database: rows, schema check, this node's
identity, `pick_profile`), replies (decoding and checking a reply), curve_keys (CURVE key files), tracked_profile
(`TrackedProfile`). Here: `ProfileClient` (sockets, requests, the fallback chain and its judgement) and `Resolution`.
"""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
import stat
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from moetune.runtime import _once, wire
from moetune.runtime.config import (
    ENV_MISMATCH_MODES,
    MAX_CLIENT_TIMEOUT_MS,
    TRUE_WORDS,
    ClientConfig,
    ConfigError,
    load_client_config,
)
from moetune.runtime.knobs import KnobError, Knobs, default_knobs, group_world_problem, int_of_text
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.paths import (
    INFO_NAME,
    client_db_path,
    default_endpoint,
    endpoint_problem,
    ipc_path,
    ipc_socket_file,
    is_loopback_host,
    tcp_host,
    tcp_port,
    untrusted_file_reason,
    untrusted_socket_reason,
)
from moetune.runtime.profile_record import (
    ENGINE_FAMILIES,
    ProfileKey,
    ProfileRecord,
    contradiction_reason,
    is_preset_fingerprint,
)
from moetune.runtime.profiles import node_identity
from moetune.runtime.profiles.curve_keys import (
    read_curve_key_file_stat,
    warn_loose_secret,
    warn_loose_server_key,
)
from moetune.runtime.profiles.daemon_info import (
    daemon_info_down,
    probe_unix_socket,
    read_daemon_info,
    stale_daemon_reason,
)
from moetune.runtime.profiles.db_lookup import (
    node_identity_from_db,
    pick_profile,
    provenance_of,
    query_db_profiles,
)
from moetune.runtime.profiles.errors import (
    BadReply,
    DaemonError,
    DaemonTimeout,
    DaemonUnavailable,
    EnvMismatchWarning,
    FallbackWarning,
)
from moetune.runtime.profiles.launcher_env import allowed_env, env_refusal, launcher_env
from moetune.runtime.profiles.perf_env import EnvComparison, compare_perf_env, performance_environment
from moetune.runtime.profiles.replies import decode_reply, decode_result, reply_problem
from moetune.runtime.profiles.tracked_profile import TrackedProfile
from moetune.runtime.profiles.tuned_options import OptionsComparison, compare_options
from moetune.runtime.shapes import ModelShape

__all__ = [
    "ProfileClient",
    "Resolution",
    "forget_env_warnings",
    "forget_reported_identities",
    "one_host_family",
    "policy_or_default",
    "warn_fallback",
]

log = logging.getLogger("moetune.client")

DEFAULT_TIMEOUT_MS = ClientConfig.timeout_ms  # [client] timeout_ms's default: one definition
MAX_NOTICES_PER_POLL = 1000  # poll_changes reads at most this many change notices a call (zmq's default receive HWM)


# client.env_mismatch (ENV_MISMATCH_MODES): what a tuned profile measured in another performance environment than
# the job's (or in one not recorded) does. "warn": served, the resolution says so, one warning names the variables
# (an unrecorded one is only logged); "refuse": passed over like a profile of another node (the chain falls back, to
# the policy default in the end); "ignore": served, no warning (the resolution still says so).


# This node's identity as each daemon reported it (`ProfileClient._reported_identity`), for the process: autoload
# makes a client per resolution, and a `fabric` reply is ~24 KB. (endpoint, epoch, key fingerprint, key software) ->
# (until: None for good, else a monotonic time; identity or None; why not). A daemon that did not answer, or whose
# facts were not this node's, is asked again after FABRIC_RETRY_S only.
_REPORTED: dict[tuple[str, str | None, str, str], tuple[float | None, Any, str]] = {}
_REPORTED_LOCK = threading.Lock()
FABRIC_RETRY_S = 5.0


def forget_reported_identities() -> None:
    """Ask each daemon for its fabric again (`autoload.clear_cache`)."""
    with _REPORTED_LOCK:
        _REPORTED.clear()


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
    provenance: str = ""  # measured | node_model | preset for a profile; "" for defaults
    tuned: bool = False  # measured on this node's fingerprint and software
    # A tuned profile's performance environment (NCCL_*, NVSHMEM_*, FI_*: runtime/profiles/perf_env.py) against
    # this job's: "same", "differs" (env_diff names each variable: "NCCL_ALGO: tuned with Ring, job has Tree") or
    # "unknown" (not recorded: measured by an older moetune); "" where nothing was measured (a modelled profile,
    # a default). Only compared: the recorded variables are never exported.
    env_status: str = ""
    env_diff: list[str] = []
    # A tuned profile's recorded data-path runtime options (runtime/profiles/tuned_options.py) against this job's:
    # "same" or "unknown" (not recorded: measured by an older moetune); "" where nothing was measured. A profile
    # measured under other options is never applied as tuned (the lookup passes it over and the message says why).
    options_status: str = ""
    options_diff: list[str] = []


_ids = itertools.count(1)



def _client_config(env: Mapping[str, str]) -> tuple[ClientConfig | None, str | None]:
    """The config's [client] section and its [store] db; a broken config file must not stop the runtime (warned,
    env used). A bad setting the client does not read (MOETUNE_TUNE_TRIALS=many) is only named: it dropped the
    whole section before, so env_mismatch = "refuse" became "warn" and the CURVE key files were lost."""
    try:
        cfg, ignored = load_client_config(env=env)
    except (ConfigError, OSError) as e:  # e.g. another user's unreadable ~/.config: fall back, never raise
        log.warning("moetune: ignoring the config for the profile client: %s", e)
        return None, None
    if ignored:
        log.warning("moetune: the profile client ignores settings it does not read that are wrong (%s); its own "
                    "[client] settings are used", "; ".join(ignored))
    # [store] db only where set to a path (a file or MOETUNE_STORE_DB): its default must not outrank the daemon's
    # daemon.json, nor must db = "" or an exported-but-empty MOETUNE_STORE_DB, which README documents as the default
    return cfg.client, (cfg.store.db if cfg.configured("store", "db") else None)


# where a request's time budget is set, named when a request runs out of it
_BUDGET_SETTINGS = ("the time budget: client.timeout_ms or MOETUNE_CLIENT_TIMEOUT_MS, `--timeout-ms` of `moetune query` "
                    "and `moetune status`")


def _not_request_socket(endpoint: str) -> str:
    """The one wording for "`endpoint` may be the daemon's PUB socket": a plain or CURVE request sent there is never
    answered, and what the client sees cannot always tell it from a daemon gone or a wrong server key."""
    return (f"this is not the daemon's request socket (its pub_socket is {endpoint}? by default that is "
            "daemon.socket's port + 1): point client.socket at its daemon.socket")


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
        allow_modelled: bool | None = None,
        allow_insecure_tcp: bool = False,
        env_mismatch: str | None = None,
    ):
        """`allow_insecure_tcp`: talk plain-text TCP to a loopback daemon started with allow_insecure_tcp (tests
        only; an argument, never read from the config or the environment). Otherwise a tcp:// endpoint needs the
        daemon's CURVE public key (`curve_server_key`, or the file client.curve_server_key_file /
        MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE names); without one every request raises DaemonUnavailable.

        `env`: this job's environment: where the config's variables are read, and the performance environment
        (NCCL_*, NVSHMEM_*, FI_*, ...) a tuned profile's recorded one is compared with. `env_mismatch`: what a tuned
        profile measured in another (or an unrecorded) environment does, one of ENV_MISMATCH_MODES (default:
        client.env_mismatch, MOETUNE_CLIENT_ENV_MISMATCH, else "warn")."""
        # the TOML [client] section (+ MOETUNE_CLIENT_* variables; None if unreadable) and [store] db
        cfg, self._configured_db = _client_config(env)
        self.endpoint = endpoint or (cfg.socket if cfg else default_endpoint(env))
        if timeout_ms is None:
            if cfg is not None:
                timeout_ms = cfg.timeout_ms
            else:
                # read as the config reads it (int_of_text): int() took "1_000" and other scripts' digits, so a value
                # the config had just refused (the reason it is ignored here) was applied all the same
                try:
                    read = int_of_text(env.get("MOETUNE_CLIENT_TIMEOUT_MS", "").strip())
                except ValueError:  # past int()'s digit limit
                    read = None
                timeout_ms = DEFAULT_TIMEOUT_MS if read is None else read
        self.timeout_ms = min(max(1, int(timeout_ms)), MAX_CLIENT_TIMEOUT_MS)  # the variable is not range-checked
        self.retries = max(0, int(retries))
        if allow_modelled is None:
            if cfg is not None:
                allow_modelled = cfg.allow_modelled
            else:
                allow_modelled = env.get("MOETUNE_CLIENT_ALLOW_MODELLED", "").strip().lower() in TRUE_WORDS
        self.allow_modelled = bool(allow_modelled)  # use modelled profiles (labelled MODELLED) when no tuned one
        if env_mismatch is None:
            env_mismatch = cfg.env_mismatch if cfg is not None else env.get("MOETUNE_CLIENT_ENV_MISMATCH", "warn")
            if env_mismatch.strip().lower() not in ENV_MISMATCH_MODES:  # an unreadable config already warned
                log.warning("moetune: MOETUNE_CLIENT_ENV_MISMATCH=%r is not one of %s; using warn", env_mismatch[:64],
                            ", ".join(ENV_MISMATCH_MODES))
                env_mismatch = "warn"
        elif env_mismatch not in ENV_MISMATCH_MODES:
            raise ValueError(f"env_mismatch must be one of {', '.join(ENV_MISMATCH_MODES)}, got {env_mismatch!r}")
        self.env_mismatch = env_mismatch.strip().lower()
        self._env = env
        self._db_path = Path(db_path) if db_path else None
        self._curve = None
        # Why this client will not talk to its tcp:// endpoint (raised as DaemonUnavailable on use, so that the
        # fallback chain still runs): never plain text by accident.
        self._refusal: str | None = None
        self._allow_insecure_tcp = allow_insecure_tcp
        key_file = (cfg.curve_server_key_file if cfg else "") or env.get("MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE", "")
        self._server_key_file = ""  # where the daemon's public key was read (named when the handshake breaks off)
        own_file = cfg.curve_secret_key_file if cfg else ""
        self._own_key_file = own_file  # this client's key pair (named when the daemon refuses its key)
        bad_endpoint = endpoint_problem(self.endpoint, bind=False)  # zmq's bare "Invalid argument" reached the caller
        if bad_endpoint is not None:
            self._refusal = bad_endpoint
            log.warning("moetune: not connecting to %s: %s", self.endpoint, self._refusal)
        elif self.endpoint.startswith("tcp://"):
            if curve_server_key is None and key_file:
                try:
                    curve_server_key, _, st = read_curve_key_file_stat(key_file)
                    self._server_key_file = key_file
                    warn_loose_server_key(key_file, st)  # the file read, not what is at its path now
                except ValueError as e:
                    self._refusal = f"the daemon's CURVE public key file {key_file} {e}"
            if self._refusal is None and own_file and (curve_public_key is None or curve_secret_key is None):
                try:
                    curve_public_key, curve_secret_key, st = read_curve_key_file_stat(own_file)
                    if not curve_secret_key:
                        raise ValueError("holds no secret key")
                    warn_loose_secret(own_file, st)
                except ValueError as e:
                    self._refusal = f"this client's CURVE secret key file {own_file} {e}"
            if self._refusal is None and curve_server_key is None and not allow_insecure_tcp:
                self._refusal = ("no CURVE public key of the daemon is configured (client.curve_server_key_file or "
                                 "MOETUNE_DAEMON_CURVE_PUBLIC_KEY_FILE): refusing plain-text TCP")
            if self._refusal is None and curve_server_key is None and not is_loopback_host(tcp_host(self.endpoint)):
                self._refusal = "allow_insecure_tcp covers loopback addresses only: refusing plain-text TCP"
            if self._refusal is not None:
                log.warning("moetune: not connecting to %s: %s", self.endpoint, self._refusal)
        self._ephemeral_key = False  # no key of its own: a fresh pair no daemon's allow-list can hold
        if curve_server_key is not None:
            if curve_public_key is None or curve_secret_key is None:
                curve_public_key, curve_secret_key = zmq.curve_keypair()
                self._ephemeral_key = True
            self._curve = tuple(k.encode() if isinstance(k, str) else k for k in (curve_server_key, curve_public_key, curve_secret_key))
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        # CURVE only: the daemon's ZAP handler refusing this client's key shows only as a failed handshake here
        self._mon: zmq.Socket | None = None
        self._key_refused = False
        # the daemon broke off the handshake without refusing the key: what a wrong daemon public key looks like
        self._handshake_dropped = False
        # connections refused and none made: nothing listens on the tcp:// endpoint (a daemon stopped or killed)
        self._connected = self._connect_retried = False
        # a connection made, then closed from the daemon's side (a daemon killed or restarted mid-request)
        self._disconnected = False
        # a socket connected again after such a close: libzmq reconnects after a dropped connection, never after a
        # peer whose handshake did not fit (a PUB: libzmq 4.3.5 drops that session for good, often without a
        # handshake-failed event), so this and a refusal (`_connect_retried`) rule out "not its request socket"
        self._reconnected = False
        # the request socket's monitor could not be made (kept with the socket): what it would tell is unknown
        self._unmonitored = False
        self._sub: zmq.Socket | None = None
        self._sub_mon: zmq.Socket | None = None  # the SUB socket's handshake monitor, until its failure is said
        self.sub_endpoint: str | None = None  # where the SUB socket connected (`subscribe`)
        self.epoch: str | None = None
        self.version = 0  # the snapshot version changes are compared with
        self.restarted = False  # set when the daemon's epoch changed between replies
        # (epoch, fingerprint, software) -> this node's identity as the daemon's fabric facts report it, or why not

    # -- sockets ---------------------------------------------------------------------------------
    def _secure(self, s: zmq.Socket) -> None:
        if self._curve:
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = self._curve

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            try:
                s.linger = 0
                s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REPLY_BYTES)  # whoever answers cannot have us buffer any size
                self._secure(s)
                self._unmonitored = False  # of this socket: set below where its monitor cannot be made
                if self.endpoint.startswith("tcp://"):  # CURVE or the explicit plain-text allowance on loopback
                    # Its events tell a refused key, a broken-off handshake and a refused connection (nothing listens)
                    # from a daemon that is slow; plain TCP too, where a stopped daemon read as "no reply".
                    # A name of its own: pyzmq's default (inproc://monitor.s-<fd>) can still be bound by the monitor
                    # of a socket just closed on a retry when the new socket gets the same fd.
                    try:
                        self._mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                         | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                                         | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                         | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
                                                         | zmq.EVENT_DISCONNECTED,
                                                         addr=f"inproc://moetune-client-monitor-{next(_MONITOR_IDS)}")
                    except zmq.ZMQError as e:
                        log.debug("no handshake monitor for %s (%s): a refused key reads as no reply", self.endpoint, e)
                        self._mon = None  # only the refused-key wording is lost: "no reply" is said instead
                        self._unmonitored = True
                s.connect(self.endpoint)
            except BaseException:
                if self._mon is not None:
                    self._mon.close(linger=0)
                    self._mon = None
                s.close(linger=0)
                raise
            self._sock = s
        return self._sock

    def _reset(self) -> None:
        if self._mon is not None:
            # AUTH: the ZAP handler refused our key. NO_DETAIL/PROTOCOL: the daemon could not read our HELLO, which
            # is encrypted to the server key we were given: not the daemon's own (or a daemon without CURVE).
            dropped = False  # this socket's connection was closed: a CONNECTED after it is a reconnection
            while self._mon.poll(0):
                try:
                    event = recv_monitor_message(self._mon, zmq.NOBLOCK)["event"]
                except zmq.ZMQError:
                    break
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self._key_refused = True
                elif event == zmq.EVENT_CONNECTED:
                    self._connected = True
                    self._reconnected = self._reconnected or dropped
                elif event == zmq.EVENT_CONNECT_RETRIED:
                    self._connect_retried = True
                elif event == zmq.EVENT_DISCONNECTED:
                    self._disconnected = dropped = True
                else:
                    self._handshake_dropped = True
            if self._sock is not None:
                # stop the events first: a monitor closed while libzmq still queues CONNECT_RETRIED events to it
                # keeps sockets alive, and a client retrying often ran out of them ("Too many open files")
                try:
                    self._sock.disable_monitor()
                except zmq.ZMQError:
                    pass
            self._mon.close(linger=0)
            self._mon = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self._reset()
        if self._sub is not None:
            self._close_sub_monitor(self._sub)
            self._sub.close(linger=0)
            self._sub = None
            self.sub_endpoint = None

    def __enter__(self) -> ProfileClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def daemon_socket_exists(self) -> bool:
        p = ipc_path(self.endpoint)
        if p is None:
            return True
        try:
            os.stat(p)
        except OSError:  # absent, or a directory we may not enter (another user's daemon)
            return False
        return True

    def _check_endpoint(self) -> None:
        """DaemonUnavailable unless the IPC socket exists in a directory this user may trust, or the
        tcp:// endpoint is secured (or explicitly allowed in plain text on loopback)."""
        if self._refusal is not None:
            raise DaemonUnavailable(f"not connecting to {self.endpoint}: {self._refusal}")
        if not self.daemon_socket_exists():
            raise DaemonUnavailable(f"no daemon socket at {self.endpoint} (absent or not accessible)")
        p = ipc_path(self.endpoint)
        why = untrusted_socket_reason(p) if p is not None else None
        if why is not None:
            raise DaemonUnavailable(f"not connecting to {self.endpoint}: {why}")
        try:  # ZeroMQ connects to a regular file too, and waits out the time-out: say what is there
            mode = os.stat(p).st_mode if p is not None else stat.S_IFSOCK
        except OSError:
            mode = stat.S_IFSOCK  # gone meanwhile: the request's time-out says so
        if not stat.S_ISSOCK(mode):
            what = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "a special file"
            raise DaemonUnavailable(f"not connecting to {self.endpoint}: {p} is {what}, not a socket (no daemon there)")

    # -- requests --------------------------------------------------------------------------------
    def request(self, op: str, *, timeout_ms: int | None = None, **fields: Any) -> Any:
        """Send one request; return the typed result. DaemonUnavailable after the retries time out."""
        budget = min(timeout_ms if timeout_ms is not None else self.timeout_ms, MAX_CLIENT_TIMEOUT_MS) / 1000.0
        self._check_endpoint()
        # `_unmonitored` is not reset here: it describes the request socket, which a request that got a reply keeps
        self._key_refused = self._handshake_dropped = self._connected = self._connect_retried = False
        self._disconnected = self._reconnected = False
        deadline = time.monotonic() + budget
        attempts = 1 if op in wire.NOT_RETRIED else self.retries + 1
        for attempt in range(attempts):
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                break
            per_try = left / (attempts - attempt)
            rid = next(_ids)
            try:
                sock = self._socket()
            except zmq.ZMQError as e:  # connect refused the address (checked at construction: what is left of it)
                raise DaemonUnavailable(f"cannot connect to {self.endpoint}: {e.strerror}") from None
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
                rep = decode_reply(frame)
                if rep.id != rid:
                    continue  # a late reply to an earlier request
                if self.epoch is not None and rep.epoch != self.epoch:
                    self.restarted = True
                    self.version = 0
                self.epoch = rep.epoch
                if not rep.ok:
                    err = rep.error or wire.ErrorInfo(code=wire.E_INTERNAL, message="no error given")
                    raise DaemonError(err.code, err.message)
                return decode_result(op, rep.result)
            self._reset()  # Lazy Pirate: never reuse a socket that timed out
        if self._key_refused:
            if self._ephemeral_key:
                raise DaemonUnavailable(f"the daemon at {self.endpoint} refused this client: it has no CURVE key of its "
                                        "own (set client.curve_secret_key_file to a key on the daemon's allow-list: "
                                        "`moetune keys client`)")
            raise DaemonUnavailable(f"the daemon at {self.endpoint} refused this client's key (not on its allow-list?): "
                                    + self._allow_hint())
        if self._handshake_dropped and self._curve is None:
            # plain text: a daemon that speaks CURVE, or a peer that is no moetune request socket at all (another
            # ZMTP service; the handshake alone cannot tell them apart): say both, not "it uses CURVE"
            raise DaemonUnavailable(f"the peer at {self.endpoint} broke off the handshake: a daemon using CURVE (then "
                                    "set client.curve_server_key_file to the NAME.key beside the daemon's "
                                    "curve_secret_key_file) or not a moetune daemon request socket (is this its "
                                    "daemon.socket, not its pub_socket?)")
        if self._handshake_dropped:
            # a CURVE client at a CURVE PUB socket (the daemon's pub_socket), right server key or not, sees what a
            # wrong server key at the request socket sees: CONNECTED, HANDSHAKE_FAILED_NO_DETAIL, DISCONNECTED, then
            # reconnections (libzmq 4.3.5; a key off the allow-list is not refused there either): say all three
            source = self._server_key_file or "the CURVE server key it was given"
            raise DaemonUnavailable(f"the daemon at {self.endpoint} broke off the CURVE handshake: {source} is not "
                                    "that daemon's public key (give the client the NAME.key beside the daemon's "
                                    "curve_secret_key_file), or the daemon there does not use CURVE, or "
                                    + _not_request_socket(self.endpoint))
        if self._connect_retried and not self._connected:  # refused, not slow: the request never left this host
            raise DaemonUnavailable(f"nothing accepts connections at {self.endpoint}: no daemon runs there (stopped "
                                    "or killed?): start it with `moetune serve` (under systemd: `systemctl status "
                                    "moetune`), or point client.socket at the one that runs")
        stale = stale_daemon_reason(self.endpoint)  # a killed daemon's socket: say so, not "no reply" (slow)
        if stale is not None:
            raise DaemonUnavailable(stale)
        said = f"no reply from the daemon at {self.endpoint} within {budget * 1000:.0f} ms"
        if self.endpoint.startswith("tcp://"):
            said += self._tcp_no_reply_hint()
        elif self.endpoint.startswith("ipc://"):
            said += self._ipc_no_reply_hint()
        raise DaemonTimeout(said)

    def _allow_hint(self) -> str:
        """What to do when the daemon refused this client's key: which public key to allow, where, and that the daemon
        reads its allow-list only when it starts (a key allowed since counts after a restart)."""
        own = self._own_key_file
        # `moetune keys generate/client` write NAME.key beside NAME.key_secret
        public = own[: -len("_secret")] if own.endswith(".key_secret") else ""
        which = (f"its public key {public} (the one beside client.curve_secret_key_file {own})" if public else
                 f"the public key of client.curve_secret_key_file {own}" if own else "this client's public key")
        return (f"allow {which} on the daemon's host (`moetune keys allow FILE DIR`, as the daemon's user), then "
                "restart the daemon (`systemctl restart moetune`): it reads its allow-list when it starts")

    def _ipc_no_reply_hint(self) -> str:
        """What to check when an ipc:// request got no reply in its time budget (no dead daemon's socket that its
        daemon.json proves stale: `stale_daemon_reason` said that first). Probed once: a socket file nothing listens
        on (a daemon killed, its pid not known to be gone) wants a start; one that accepts, a daemon stopped (SIGSTOP),
        stuck or busy, named by its pid where its daemon.json says it runs at this endpoint."""
        budget = _BUDGET_SETTINGS
        p = ipc_path(self.endpoint)
        probed = probe_unix_socket(p) if p is not None else "unknown"
        if probed == "refused":
            return (f" ({budget}): nothing listens on its socket file {p} (a daemon killed, or a file left behind): "
                    "start the daemon with `moetune serve` (under systemd: `systemctl status moetune`)")
        if probed == "unknown":  # gone meanwhile, not ours to enter, a slow accept: say what the time-out alone tells
            return f" ({budget})"
        info = read_daemon_info(self.endpoint, self._env)
        pub = info.get("pub_endpoint") if info else None
        # a request sent to the daemon's PUB socket is never answered: its daemon.json (the same folder) names it
        if isinstance(pub, str) and ipc_socket_file(pub) == ipc_socket_file(self.endpoint):
            named = info.get("endpoint") if info else None
            to = f"its daemon.socket {named}" if isinstance(named, str) else "its daemon.socket"
            return (f" ({budget}): {self.endpoint} is the daemon's pub_socket (its daemon.json says so), not its "
                    f"request socket: point client.socket at {to}")
        pid = info.get("pid") if info and info.get("running") is True and info.get("endpoint") == self.endpoint else None
        who = f"the daemon (pid {pid})" if type(pid) is int else "the daemon"
        return (f" ({budget}): its socket is there but nothing answered: check that {who} is not stopped or stuck (its "
                "log; `systemctl status moetune`), or give it a longer budget if it is busy")

    def _tcp_no_reply_hint(self) -> str:
        """What to check when a tcp:// request got no reply in its time budget, as far as this client can tell: ZeroMQ
        does not report why a connection is not made (a host unreachable or a firewall dropping packets looks like a
        slow one), only that one was (the monitor's CONNECTED), refused (CONNECT_RETRIED, said before this) or closed
        by the peer (DISCONNECTED)."""
        budget = _BUDGET_SETTINGS
        if self._connected and self._disconnected:
            # the daemon's side closed a connection that was made (a daemon killed or restarted mid-request): its
            # keys were good enough to connect (a refused or wrong key is said before this), so none are named.
            # A plain client at a PUB socket (the daemon's pub_socket, port + 1) sees the same CONNECTED then
            # DISCONNECTED, but is never reconnected nor refused after it: where neither was seen, say that too
            other = "" if self._reconnected or self._connect_retried else "; or " + _not_request_socket(self.endpoint)
            return (f" ({budget}): the connection was made, then closed by the daemon's side before it answered "
                    "(daemon stopped or restarted?): check that it runs (`systemctl status moetune`, its log, on that "
                    f"host) and ask again{other}")
        keys = ("; with CURVE, that client.curve_server_key_file is that daemon's public key and this client's key is "
                "on its allow-list (`moetune keys allow`)" if self._curve else "")
        if self._connected:  # the port accepted: a daemon that is busy or hung, or not a moetune daemon at all
            return (f" ({budget}): the connection was made but nothing answered: check that a moetune daemon listens "
                    "there and is not stuck (`systemctl status moetune`, its log, on that host); a longer budget if it "
                    f"is busy{keys}")
        where = ("whether a connection was made is not known (no socket monitor)" if self._unmonitored
                 else "no connection was made and none was refused")
        return (f" ({budget}): {where}: check that the daemon runs there (`moetune serve`; `systemctl status moetune` "
                "on that host), that this address and port are its daemon.socket, and that no firewall drops the "
                f"packets on the way{keys}")

    def fallback_db(self, info: dict[str, Any] | None = None) -> Path:
        """The database `resolve` reads when the daemon does not answer: the one given, else `client_db_path`'s
        (`info`: daemon.json as read, else read here). `moetune query` reads provenance from the same file."""
        if self._db_path is not None:
            return self._db_path
        if info is None:
            info = read_daemon_info(self.endpoint, self._env)
        named = info.get("db") if info and isinstance(info.get("db"), str) else None
        return client_db_path(named, self._env, self._configured_db)

    def fallback_db_note(self, info: dict[str, Any] | None = None) -> str | None:
        """What to say when `fallback_db` is the database a daemon that is not running named in its daemon.json
        (None otherwise): the file outlives the daemon (`"running": false` after a clean exit, a gone pid after a
        kill), and reading its database instead of the configured or default one must not go unsaid."""
        if info is None:
            info = read_daemon_info(self.endpoint, self._env)
        named = info.get("db") if info and isinstance(info.get("db"), str) else None
        if named is None or self.fallback_db(info) != Path(named):
            return None
        down = daemon_info_down(info)
        if down is None:
            return None
        return (f"database {named}: named by {Path(info.get('_dir', '?')) / INFO_NAME} of a daemon that is not "
                f"running ({down}); set store.db or MOETUNE_STORE_DB, or pass --db, to read another")

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

    def fabric(self, *, timeout_ms: int | None = None) -> wire.FabricResult:
        return self.request("fabric", timeout_ms=timeout_ms)

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
            named = self.hello().pub_endpoint
            pub_endpoint, why = self._daemon_pub(named)
            if why is not None:
                raise DaemonUnavailable(f"not subscribing to the daemon's PUB socket {named[:256]!r}: {why}")
        why = self._pub_problem(pub_endpoint)
        if why is not None:
            raise DaemonUnavailable(f"not subscribing to {pub_endpoint[:256]!r}: {why}")
        s = self._ctx.socket(zmq.SUB)
        try:
            s.linger = 0
            s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REPLY_BYTES)  # as the request socket: bounded notices
            self._secure(s)
            for t in topics:
                s.setsockopt(zmq.SUBSCRIBE, t.encode())
            self._sub_mon = self._handshake_monitor(s, pub_endpoint)
            s.connect(pub_endpoint)
        except zmq.ZMQError as e:
            self._close_sub_monitor(s)
            s.close(linger=0)
            raise DaemonUnavailable(f"not subscribing to {pub_endpoint[:256]!r}: {e.strerror}") from None
        self._sub = s
        self.sub_endpoint = pub_endpoint

    @staticmethod
    def _handshake_monitor(s: zmq.Socket, endpoint: str) -> zmq.Socket | None:
        """A monitor of `s`'s failed handshakes on a tcp:// endpoint (None for ipc://, or where none can be made): a SUB
        socket whose CURVE handshake fails retries quietly for ever, and its subscriber would wait for notices that
        never come without a word."""
        if not endpoint.startswith("tcp://"):
            return None
        try:
            return s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                        addr=f"inproc://moetune-sub-monitor-{next(_MONITOR_IDS)}")
        except zmq.ZMQError as e:
            log.debug("no handshake monitor for the SUB socket to %s (%s)", endpoint, e)
            return None

    def _close_sub_monitor(self, s: zmq.Socket | None) -> None:
        if self._sub_mon is None:
            return
        if s is not None:
            try:  # stop the events before closing their socket (as `_reset` does for the request socket's)
                s.disable_monitor()
            except zmq.ZMQError:
                pass
        self._sub_mon.close(linger=0)
        self._sub_mon = None

    def _check_sub_handshake(self) -> None:
        """Say once, as a warning naming the endpoint, that the SUB socket's handshake failed (its monitor's first
        failure event), then stop watching: the socket retries, and a later success brings the notices."""
        if self._sub_mon is None:
            return
        event = None
        while event is None and self._sub_mon.poll(0):
            try:
                event = recv_monitor_message(self._sub_mon, zmq.NOBLOCK)["event"]
            except zmq.ZMQError:
                return
        if event is None:
            return
        why = ("the daemon refused this client's key (not on its allow-list?): " + self._allow_hint()
               if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
               else "the daemon broke off the CURVE handshake (the server key given is not its public key, or one "
                    "side does not use CURVE)")
        log.warning("moetune: no change notices from %s: %s; tuned profiles are not refreshed while it lasts",
                    self.sub_endpoint, why)
        self._close_sub_monitor(self._sub)

    def _daemon_pub(self, named: str) -> tuple[str, str | None]:
        """(where to connect, why not) for the PUB endpoint the daemon's hello `named`: reached the way the request
        socket is. Same scheme; for tcp the advertised PORT on the host the requests go to, whatever host the reply
        names: a daemon bound to `tcp://*:5555` names `tcp://*:5556`, and a client reaching it as `node1` (or
        `localhost` for 127.0.0.1) must subscribe there, while a reply must never send the client to another host."""
        scheme, ours = named.partition("://")[0], self.endpoint.partition("://")[0]
        if scheme != ours:
            return named, f"not the request endpoint's transport ({ours}://)"
        if scheme != "tcp":
            return named, None
        port = tcp_port(named)
        if port is None:
            return named, "no port in 1..65535"
        host = self.endpoint[len("tcp://"):].rpartition(":")[0]  # as written: IPv6 brackets and a zone kept
        return f"tcp://{host}:{port}", None

    def _pub_problem(self, pub: str) -> str | None:
        """Why not to connect a SUB socket to `pub`: tcp only secured like the request socket (CURVE, or the explicit
        loopback allowance), ipc only a socket this user may trust."""
        scheme = pub.partition("://")[0]
        if scheme in ("tcp", "ipc"):
            bad = endpoint_problem(pub, bind=False)  # as for the request socket: zmq's connect would raise on it
            if bad is not None:
                return bad
        if scheme == "tcp":
            if self._refusal is not None:
                return self._refusal
            if self._curve is None and not (self._allow_insecure_tcp and is_loopback_host(tcp_host(pub))):
                return "no CURVE key for it, and plain-text TCP is allowed only explicitly, on loopback"
            return None
        if scheme != "ipc":
            return "only ipc:// and tcp:// are supported"
        return untrusted_socket_reason(Path(pub.removeprefix("ipc://")))  # absolute: endpoint_problem took it

    def poll_changes(self, timeout_ms: int = 0) -> list[wire.Change]:
        """Changes newer than `self.version` (received so far, waiting up to timeout_ms for the first). At most
        MAX_NOTICES_PER_POLL notices are read per call (the rest wait for the next): a publisher that never stops
        sending cannot keep the caller (a layer's refresh) here."""
        if self._sub is None:
            raise RuntimeError("call subscribe() first")
        self._check_sub_handshake()
        out: list[wire.Change] = []
        wait = timeout_ms
        for _ in range(MAX_NOTICES_PER_POLL):
            if not self._sub.poll(wait, zmq.POLLIN):
                break
            wait = 0
            frames = self._sub.recv_multipart()
            try:
                ch = wire.decode_change(frames)
            except (wire.WireError, msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                continue
            if self.epoch is not None and ch.epoch != self.epoch:
                self.restarted = True  # a new daemon: versions restart, refetch everything
                self.epoch = ch.epoch
                self.version = 0
            if ch.version > self.version:
                out.append(ch)
        self._check_sub_handshake()  # a failure seen while this call waited is said now, not at the next
        return out

    def track(self, *, transport_ok: Callable[[str], str | None] | None = None, options: RuntimeOptions | None = None,
              **query: Any) -> TrackedProfile:
        """`query`: get_profile's fields; `transport_ok` and `options` as for `resolve` (`options`: the runtime
        options of the job that tracks, an EP buffer's; None: the config's and `env`'s): every fetch is judged under
        them. Tracking needs the daemon (its change notices): with none answering this raises DaemonUnavailable,
        where `resolve` would fall back to the database; `refresh()` raises it too when the daemon stops answering
        between a change notice and the fetch."""
        return TrackedProfile(self, query, transport_ok, options)

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
        transport_ok: Callable[[str], str | None] | None = None,
        options: RuntimeOptions | None = None,
    ) -> Resolution:
        """Daemon -> read-only database -> policy defaults, inside `budget_ms` (default timeout_ms).

        `transport_ok(name)` says why this runtime cannot run transport `name` (None when it can); a
        profile needing such a transport is passed over. `options`: the runtime options the job runs (an EP buffer's;
        None: what one built here without options resolves from the config and `env`); a tuned profile measured
        under other data-path options is passed over. Never raises for what the daemon or the database
        hold; one warning names every source passed over and why.
        """
        t0 = time.monotonic()
        budget = (budget_ms if budget_ms is not None else self.timeout_ms) / 1000.0
        problems: list[str] = []
        info = read_daemon_info(self.endpoint, self._env)
        job_env = performance_environment(self._env).variables  # compared with a tuned profile's, never exported
        job_opts = self._job_options(options)  # likewise: the data-path runtime options this job runs

        def finish(res: Resolution, headline: str, env_cmp: EnvComparison | None = None,
                   opts_cmp: OptionsComparison | None = None) -> Resolution:
            res.elapsed_ms = (time.monotonic() - t0) * 1000
            if env_cmp is not None:
                res.env_status, res.env_diff = env_cmp.status, list(env_cmp.differences)
            if opts_cmp is not None:
                res.options_status, res.options_diff = opts_cmp.status, list(opts_cmp.differences)
            if problems:
                res.message = "; ".join(problems)
                warn_fallback(f"moetune: {headline} ({res.message})")
            if env_cmp is not None:
                self._say_env(res, env_cmp)
            if opts_cmp is not None and opts_cmp.status == "unknown":
                log.info("moetune: tuned profile %s: %s", res.profile_hash, opts_cmp.summary())
            return res

        # 1. the daemon (it knows the node: it discovered the fabric)
        try:
            r = self.get_profile(ep_size=ep_size, tokens=tokens, nodes=nodes, model=model,
                                 transport_family=transport_family, timeout_ms=int(budget * 1000))
            bad = reply_problem(r, model=model, ep_size=ep_size, tokens=tokens, nodes=nodes,
                                 transport_family=transport_family)
            if bad is not None:
                raise BadReply(bad)
            verdict, why, (env_cmp, opts_cmp), prov = self._judge_reply(r, info, transport_ok, job_env, t0 + budget,
                                                                        job_opts)
            if verdict is None:
                problems.append(f"daemon served profile {r.profile_hash}: {why}")
            else:
                # The env is a function of the (validated) knobs, family and nodes: recomputed here, so the
                # reply's own `env` is never exported; where it differs, the warning says what was left out.
                env, refused = allowed_env(launcher_env(r.knobs, r.key.transport_family, r.key.nodes))
                refused += [env_refusal(k, v) or f"{k[:64]}={v[:64]!r} (not what the profile's knobs need)"
                            for k, v in r.env.items() if env.get(k) != v]
                problems += [f"daemon reply: not exporting {x}" for x in refused[:8]]
                if verdict == "modelled":
                    problems.append(f"daemon served a MODELLED profile ({why}); used because allow_modelled is set")
                res = Resolution(knobs=r.knobs, source="daemon", profile_hash=r.profile_hash, status=r.status, env=env,
                                 key=r.key, family=r.key.transport_family, epoch=self.epoch, provenance=prov,
                                 tuned=verdict == "tuned")
                return finish(res, "using a MODELLED profile, not a tuned one" if verdict == "modelled"
                              else "daemon reply partly refused", env_cmp, opts_cmp)
        except (DaemonUnavailable, DaemonError, BadReply) as e:
            problems.append(f"daemon: {e}")

        # 2. the database, read-only: only with this node's identity known, from the database's facts checked against
        # this node (never daemon.json: a stopped or killed daemon's file predates what was installed since)
        db = self.fallback_db(info)
        note = self.fallback_db_note(info)
        if note is not None:
            problems.append(note)
        try:
            # a file other users can write could feed this job profiles: passed over, as a missing one is
            untrusted = untrusted_file_reason(db)
            ident, why_no_ident = (None, "") if untrusted is not None else node_identity_from_db(db)
            if untrusted is not None:
                problems.append(f"database {db}: not used, {untrusted}")
            elif ident is None and not self.allow_modelled:
                problems.append(f"database {db}: not used, this node's identity is unknown ({why_no_ident})")
            else:
                recs = query_db_profiles(db, ep_size=ep_size, nodes=nodes, hidden=model.hidden,
                                         intermediate=model.intermediate, experts=model.experts, topk=model.topk,
                                         dtype=model.dtype, transport_family=transport_family,
                                         check_schema=False)  # node_identity_from_db did
                if ident is None:  # a what-if preset's profiles are for no node in particular: only they may serve
                    recs = [x for x in recs if is_preset_fingerprint(x.key.fingerprint) and x.provenance == "preset"]
                    problems.append(f"database {db}: this node's identity is unknown ({why_no_ident}), so only a "
                                    "preset's MODELLED profiles are considered")
                rec, verdict, (env_cmp, opts_cmp), passed = self._pick_trusted(recs, tokens, ident, transport_ok,
                                                                               transport_family, job_env, job_opts)
                if rec is None and recs and not passed:  # stored, only at buckets too far from this one
                    have = ", ".join(map(str, sorted({x.key.token_bucket for x in recs})))
                    problems.append(f"database {db}: this shape/EP size/nodes has profiles at token buckets {have}, "
                                    f"none within one step of the bucket of {tokens} tokens")
                elif rec is None:
                    what = f"; passed over: {'; '.join(passed[:4])}" if passed else ""
                    where = f" ({ident.source})" if ident is not None else ""
                    problems.append(f"database {db}: no profile measured on this node{where} for this "
                                    f"shape/EP size/nodes{what}")
                else:
                    # as the daemon's: only what launcher_env may produce (the row's family string is not checked
                    # by this read-only reader; a hand edit or another tool's write could make it anything)
                    env, refused = allowed_env(launcher_env(rec.knobs, rec.key.transport_family, nodes))
                    problems += [f"database {db}: not exporting {x}" for x in refused[:8]]
                    if verdict == "modelled":
                        problems.append(f"using a MODELLED profile ({rec.provenance}, backend {rec.backend}, fingerprint "
                                        f"{rec.key.fingerprint}) from the read-only database {db} because allow_modelled is set")
                        problems += _other_presets(recs, rec)
                    else:
                        problems.append(f"using the read-only database {db}")
                    res = Resolution(knobs=rec.knobs, source="database", profile_hash=rec.profile_hash, status=rec.status,
                                     env=env, key=rec.key, family=rec.key.transport_family, provenance=rec.provenance,
                                     tuned=verdict == "tuned")
                    return finish(res, "using a MODELLED profile, not a tuned one" if verdict == "modelled"
                                  else "tuned profile not served by the daemon", env_cmp, opts_cmp)
        except (OSError, sqlite3.Error) as e:
            problems.append(f"database {db}: {e}")

        # 3. the policy default of the node's preferred family (one this runtime has)
        if transport_family:
            family = transport_family
        else:
            family, passed_over = _cached_family(info, nodes, ep_size)
            problems += passed_over[:8]  # why the node's preferred family is not the one taken
        why = _transport_problem(family, None, transport_ok)
        if why is not None:
            problems.append(f"transport family {family}: {why}")
            family = "collective"
        knobs, source = policy_or_default(family)
        if _transport_problem(family, knobs, transport_ok) is not None:
            knobs, source = default_knobs("collective"), "default"
        what = "the policy default" if source == "policy" else "the built-in default"
        problems.append(f"using {what} for {family}")
        # the family may come from daemon.json (`transports`): only what launcher_env may produce, as above
        env, refused = allowed_env(launcher_env(knobs, family, nodes))
        problems += [f"transport family {family}: not exporting {x}" for x in refused[:8]]
        res = Resolution(knobs=knobs, source=source, profile_hash=f"{source}:{knobs.digest()}", status="default",
                         env=env, family=family)
        return finish(res, "NO tuned profile")

    def _judge_reply(
        self, r: wire.ProfileResult, info: Mapping[str, Any] | None, transport_ok: Callable[[str], str | None] | None,
        job_env: Mapping[str, str], deadline: float, job_opts: Mapping[str, Any] | None = None,
    ) -> tuple[str | None, str, tuple[EnvComparison | None, OptionsComparison | None], str]:
        """`_judge` of a get_profile reply that answers its request (`reply_problem`), plus its provenance: what
        `resolve` and `TrackedProfile` decide of it. This node's identity: the fabric the answering daemon reports,
        checked against what THIS process reads (`node_identity.from_reported_facts`). Not daemon.json's identity
        on its own word: that is the daemon's discovery, which says nothing of this process's packages (a job in
        another environment than the daemon's) nor of a daemon that serves a capture; a measured profile applied
        as tuned on it was tuned for other software. `info` only adds why an identity is missing."""
        ident: node_identity.NodeIdentity | None = None
        if info and info.get("epoch") != self.epoch:  # the file of a daemon that did not answer (killed, elsewhere)
            why_no_ident = (f"daemon.json in {info.get('_dir')} is another daemon's (epoch "
                            f"{str(info.get('epoch'))[:40]!r}, not the answering daemon's {self.epoch!r})")
        else:
            why_no_ident = "" if info else "no daemon.json beside the daemon's socket"
        if not is_preset_fingerprint(r.key.fingerprint):
            ident, why_no_ident = self._reported_identity(r.key, why_no_ident, deadline)
        recorded = None if r.perf_env is msgspec.UNSET else dict(r.perf_env)
        opts = None if r.runtime_options is msgspec.UNSET else dict(r.runtime_options)
        prov = provenance_of(r)
        verdict, why, cmps = self._judge(r.key, r.knobs, prov, ident, transport_ok, recorded, job_env, why_no_ident,
                                         opts, job_opts, measured_on=r.measured_on)
        return verdict, why, cmps, prov

    def _reported_identity(self, key: ProfileKey, why_not: str, deadline: float) -> tuple[node_identity.NodeIdentity | None, str]:
        """This node's identity as the daemon's `fabric` reply reports it, when its facts are this node's
        (`node_identity.from_reported_facts`); else (None, why not). One request within what is left of the budget,
        remembered for the process (`_REPORTED`: autoload makes a client per resolution) per daemon endpoint and start
        and profile key fingerprint/software; a daemon that did not answer, or whose facts were not this node's, is not
        asked again for FABRIC_RETRY_S."""
        memo = (self.endpoint, self.epoch, key.fingerprint, key.software)
        now_s = time.monotonic()
        with _REPORTED_LOCK:
            hit = _REPORTED.get(memo)
        if hit is not None and (hit[0] is None or hit[0] > now_s):
            return hit[1], hit[2]

        def said(why: str) -> str:
            return f"{why_not}; {why}" if why_not else why

        def keep(until: float | None, ident: node_identity.NodeIdentity | None, why: str) -> tuple[Any, str]:
            with _REPORTED_LOCK:
                if len(_REPORTED) >= 256:
                    _REPORTED.clear()
                _REPORTED[memo] = (until, ident, why)
            return ident, why

        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return None, said("no time left to ask the daemon for its fabric facts")
        try:
            fab = self.fabric(timeout_ms=left_ms)
        except (DaemonUnavailable, DaemonError, BadReply) as e:  # remembered briefly: each resolve would wait again
            return keep(time.monotonic() + FABRIC_RETRY_S, None, said(f"the daemon's fabric facts: {e}"))
        ident, why = node_identity.from_reported_facts(fab.fingerprint, fab.software, fab.facts, self.endpoint)
        if ident is None:  # briefly too: what the check read here may come back (a NIC port down, then up)
            return keep(time.monotonic() + FABRIC_RETRY_S, None, said(why))
        return keep(None, ident, "")

    def _judge(
        self, key: ProfileKey, knobs: Knobs, provenance: str, ident: node_identity.NodeIdentity | None,
        transport_ok: Callable[[str], str | None] | None, recorded_env: Mapping[str, str] | None,
        job_env: Mapping[str, str], why_no_ident: str = "", recorded_opts: Mapping[str, Any] | None = None,
        job_opts: Mapping[str, Any] | None = None, *, measured_on: str | None = None,
    ) -> tuple[str | None, str, tuple[EnvComparison | None, OptionsComparison | None]]:
        """("tuned" | "modelled" | None, why, (env comparison, options comparison)): may this profile be applied here,
        and as what? `measured_on`: the fingerprint the record says it was measured on (None: not said); a measurement
        naming another than its key's was measured elsewhere, and is never applied as tuned (`is_tuned_for`).

        A measured profile is tuned only for this node's identity (`ident`; None: unknown, `why_no_ident` says why):
        never when it is unknown. The one place a profile's recorded performance environment (`recorded_env`, None:
        not recorded) meets the job's: a tuned profile's comparison is returned (for the resolution to say) or, under
        env_mismatch = refuse, refuses it; a modelled one is not compared (its numbers were never measured in any
        environment). Its recorded data-path runtime options (`recorded_opts`, None: not recorded) meet the job's
        (`job_opts`, None: unreadable) here too: measured under other options, it is not applied as tuned (whatever
        env_mismatch says: its numbers are another data path's); unrecorded, it is judged as an unrecorded
        environment is."""
        none: tuple[None, None] = (None, None)
        why = contradiction_reason(key, knobs)  # what `db check` names: never served, whatever else it says
        if why is not None:
            return None, why, none
        why = _transport_problem(key.transport_family, knobs, transport_ok)
        if why is not None:
            return None, why, none
        if ident is None and (provenance == "measured" or not is_preset_fingerprint(key.fingerprint)):
            # nothing says this node is the one it was measured (or calibrated) on: the database path's rule too
            what = "measured" if provenance == "measured" else f"MODELLED ({provenance})"
            return None, (f"{what} on fingerprint {key.fingerprint}, software {key.software}, but this node's "
                          f"identity is unknown ({why_no_ident or 'nothing recorded'}): not applied"), none
        foreign = ident is not None and (key.fingerprint != ident.fingerprint or key.software != ident.software)
        if provenance == "measured":
            if foreign:
                assert ident is not None
                return None, (f"measured on another node or software (fingerprint {key.fingerprint}, software "
                              f"{key.software}; this node: {ident.fingerprint}, {ident.software})"), none
            if measured_on is not None and measured_on != key.fingerprint:
                # the store and an import refuse such a record; a hand edit or another tool's write may hold one
                return None, (f"labelled measured under fingerprint {key.fingerprint}, but measured on fingerprint "
                              f"{measured_on[:64]} (another node's numbers): not applied"), none
            opts_cmp = compare_options(recorded_opts, job_opts, key.transport_family)
            if opts_cmp.status == "differs":
                return None, (f"{opts_cmp.summary()}: not applied as tuned (its numbers are another data path's; "
                              "re-tune under these options, or run the ones it was tuned under)"), none
            env_cmp = compare_perf_env(recorded_env, job_env, key.transport_family)
            refusal = self._env_refusal(env_cmp) or self._options_refusal(opts_cmp)
            return (None, refusal, none) if refusal is not None else ("tuned", "", (env_cmp, opts_cmp))
        label = f"MODELLED ({provenance}, fingerprint {key.fingerprint}), not measured on this node"
        if foreign and not is_preset_fingerprint(key.fingerprint):
            return None, f"{label}, and for another node", none
        if not self.allow_modelled:
            return (None, f"{label}; not applied as tuned (allow_modelled=True or MOETUNE_CLIENT_ALLOW_MODELLED=1 "
                    "to use it)", none)
        return "modelled", label, none

    def _env_refusal(self, cmp: EnvComparison) -> str | None:
        """Why a tuned profile is not used in this job's performance environment (None: it is): only with
        env_mismatch = "refuse", for an environment that differs or was not recorded."""
        if self.env_mismatch != "refuse" or cmp.status == "same":
            return None
        return (f"{cmp.summary()}; client.env_mismatch = refuse uses only a profile measured in this job's "
                "NCCL/NVSHMEM/FI environment" + (" (re-tune to record it)" if cmp.status == "unknown" else ""))

    def _options_refusal(self, cmp: OptionsComparison) -> str | None:
        """Why a tuned profile whose runtime options are unknown is not used (None: it is): only with
        env_mismatch = "refuse", the policy of an unrecorded environment."""
        if self.env_mismatch != "refuse" or cmp.status != "unknown":
            return None
        return (f"{cmp.summary()}; client.env_mismatch = refuse uses only a profile measured under this job's "
                "runtime options (re-tune to record them)")

    def _job_options(self, options: RuntimeOptions | None) -> dict[str, Any] | None:
        """This job's data-path runtime options: `options` (an EP buffer's), else what a buffer built here without
        any resolves (the config's [runtime] table, the MOETUNE_* variables of `env`); None where they do not
        resolve (the buffer refuses them too): a tuned profile's options are then unknown here, never "the same"."""
        if options is not None and not isinstance(options, RuntimeOptions):  # a caller's mistake, not the daemon's
            raise TypeError(f"options must be a RuntimeOptions or None, got {type(options).__name__}")
        if options is None:
            try:
                options = RuntimeOptions.resolve(env=self._env)
            except (ValueError, OSError) as e:  # RuntimeOptionError, ConfigError, an unreadable config file
                log.info("moetune: this job's runtime options do not resolve (%s); a tuned profile's are compared "
                         "with nothing", e)
                return None
        return options.data_path()

    def _say_env(self, res: Resolution, cmp: EnvComparison) -> None:
        """Say how the tuned profile's environment compares with this job's: a differing one in the resolution's
        message and (env_mismatch = "warn") one warning per process naming the variables; an unrecorded one in
        the log."""
        if cmp.status == "differs":
            res.message = "; ".join(x for x in (res.message, cmp.summary()) if x)
            if self.env_mismatch == "warn":
                # once per process for a profile and its differences; stacklevel 3: _say_env <- finish <- the lookup
                _once.say_once(_ENV_WARNINGS, (res.profile_hash, cmp.differences),
                               f"moetune: tuned profile {res.profile_hash} (from the {res.source}) was {cmp.summary()}; "
                               "served anyway (client.env_mismatch = warn; \"refuse\" passes it over: the lookup "
                               "falls back instead)", category=EnvMismatchWarning, logger=log, stacklevel=3)
        elif cmp.status == "unknown":
            log.info("moetune: tuned profile %s: %s", res.profile_hash, cmp.summary())

    def _pick_trusted(
        self, recs: list[ProfileRecord], tokens: int, ident: node_identity.NodeIdentity | None,
        transport_ok: Callable[[str], str | None] | None, transport_family: str | None,
        job_env: Mapping[str, str], job_opts: Mapping[str, Any] | None = None,
    ) -> tuple[ProfileRecord | None, str | None, tuple[EnvComparison | None, OptionsComparison | None], list[str]]:
        """The nearest-bucket tuned profile, else (with allow_modelled) a modelled one, as `_judge` judged it
        (verdict and environment comparison); plus what was passed over (a tuned one whose environment
        `_judge` refuses, among others)."""
        by: dict[str, list[ProfileRecord]] = {"tuned": [], "modelled": []}
        env_of: dict[int, tuple[EnvComparison | None, OptionsComparison | None]] = {}  # id(record): its comparisons
        passed: list[str] = []
        for r in recs:
            verdict, why, env_of[id(r)] = self._judge(r.key, r.knobs, r.provenance, ident, transport_ok,
                                                      r.tuned_perf_env, job_env, "", r.tuned_runtime_options, job_opts,
                                                      measured_on=r.measured_on)
            if verdict is None:
                passed.append(f"{r.profile_hash}: {why}")
            else:
                by[verdict].append(r)
        for verdict in ("tuned", "modelled"):
            # This node's own records before a preset's: pick_profile alone takes the most recently updated
            # fingerprint, which let a preset stored after the node's calibrated model win.
            mine = ident.fingerprint if ident is not None else None
            own = [r for r in by[verdict] if r.key.fingerprint == mine]
            for group in (own, [r for r in by[verdict] if r.key.fingerprint != mine]):
                rec = pick_profile(group, tokens, transport_family=transport_family)
                if rec is not None:
                    return rec, verdict, env_of[id(rec)], passed
        return None, None, (None, None), passed


def _other_presets(recs: list[ProfileRecord], rec: ProfileRecord) -> list[str]:
    """What to say when `rec`, a preset's profile, was picked (`pick_profile`: the most recently tuned fingerprint)
    among current profiles of other presets for this shape: each names its fabric model by `preset:NAME:DIGEST`, and
    an edited copy of a shipped preset keeps its NAME, so only the digest tells two of one name apart."""
    if not is_preset_fingerprint(rec.key.fingerprint):
        return []
    other = sorted({r.key.fingerprint for r in recs if r.status == "current" and is_preset_fingerprint(r.key.fingerprint)
                    and r.key.fingerprint != rec.key.fingerprint})
    if not other:
        return []
    more = f", and {len(other) - 4} more" if len(other) > 4 else ""
    return [f"the database also holds current MODELLED profiles of {len(other)} other preset(s) for this shape/EP "
            f"size/nodes ({', '.join(other[:4])}{more}); the most recently tuned one, {rec.key.fingerprint}, is used "
            "(`moetune profiles list --provenance preset` shows them; `moetune query` says whether a digest is the "
            "shipped preset's)"]


def _transport_problem(family: str, knobs: Knobs | None, transport_ok: Callable[[str], str | None] | None) -> str | None:
    """Why this runtime cannot run a profile of `family` with `knobs` (None when it can, or nobody asks)."""
    if transport_ok is None:
        return None
    names = [family.split(":", 1)[0]] + ([knobs.transport] if knobs is not None else [])
    if family in ENGINE_FAMILIES:  # the engine's own check covers it (its world-1 buffer carries no traffic)
        names = [family]
    for name in dict.fromkeys(names):
        why = transport_ok(name)
        if why is not None:
            return f"transport {name!r} is not available in this runtime ({why})"
    return None


def one_host_family(family: str) -> bool:
    """Whether `family`'s transport serves the ranks of one host only (nvlink, proxy, host_staged): asked of the one
    rule, `knobs.group_world_problem`, for a group over two hosts. A list of its own here left proxy out."""
    return group_world_problem(family.split(":", 1)[0], 2, nodes=2) is not None


def _cached_family(info: Mapping[str, Any] | None, nodes: int = 1, ep_size: int = 1) -> tuple[str, list[str]]:
    """The node's preferred transport family as the daemon last discovered it, of those whose transport can serve an
    EP group of `ep_size` ranks on `nodes` hosts (`knobs.group_world_problem`: nvlink, proxy and host_staged within
    one node only), and why each family before it was passed over."""
    fams = info.get("transports") if info else None
    skipped: list[str] = []
    if isinstance(fams, list):
        for f in fams:
            if not isinstance(f, str):
                continue
            why = group_world_problem(f.split(":", 1)[0], ep_size, nodes=nodes)
            if why is None:
                return f, skipped
            skipped.append(f"transport family {f[:64]}: {why}")
    return "collective", skipped


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


def warn_fallback(message: str) -> None:
    warnings.warn(message, FallbackWarning, stacklevel=3)
    log.warning(message)


_MONITOR_IDS = itertools.count()  # one inproc name per monitor socket in this process

_ENV_WARNINGS = "client.env_mismatch"  # the _once scope of the env-mismatch warnings


def forget_env_warnings() -> None:
    """Warn again about environments already warned about (autoload.clear_cache calls it)."""
    _once.reset(_ENV_WARNINGS)
