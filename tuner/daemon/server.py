"""The moetune daemon: lifecycle, sockets and security; it serves tuned profiles over ZeroMQ.

Threads:
- the serving loop (`serve_forever`, main thread under `moetune serve`): one ROUTER socket polled with
  `zmq.Poller`; each request is one JSON frame decoded with msgspec into the schemas of
  `moetune.runtime.wire` and answered by `handlers` from the in-memory `index.ProfileIndex`, so the
  hot path runs no SQL. The index is rebuilt after every write; the swap is one reference assignment.
- the list worker: uncached `list_profiles` requests (which may read the store's history and encode a
  thousand profiles) are answered here and the replies handed back over an inproc socket, so that list
  requests never hold up `get_profile`; its queue is bounded (a full queue answers `busy`).
- the retune worker: `retune` (queue or cancel), answered once its event is committed, so it may wait out the
  store's busy timeout behind another writer; in a thread of its own so that list requests never wait on it.
- the discovery worker (`watch.FabricWatch`): rediscovery and hardware-change handling;
- the job worker (`jobs.JobManager`): one re-tune job at a time from a bounded queue.
The PUB socket is shared by the workers under a lock; the serving loop never waits on them.

Security (the checks live beside it: `runtime_dir` for the socket directory, the socket path, the owner records and
daemon.json's ownership; `auth` for CURVE keys, the client and admin lists and peer credentials; `locks` for the
database, run and socket locks): the daemon never deletes or chmods what it did not create. The IPC directory is
created 0700 (0750 with a configured group) and marked as ours; an existing directory is used as it is. An existing
file at the socket path is refused unless it is a dead socket this daemon's owner record proves was ours.
daemon.json beside it is replaced only when it carries our mark and our owner record names it and no other daemon at
another endpoint, still running, wrote it (a user's file there is left alone; a start-up that fails removes the one
it wrote). `tcp://` needs CURVE keys unless `allow_insecure_tcp` (loopback addresses only), and then clients are
authenticated by pyzmq's ZAP authenticator against the allow-list of client public keys as read and checked at start
(the ZAP domain enforced: without a handler libzmq would let every CURVE client in); key files and lists other local
users could read (the secret key) or change are refused (`auth.check_key_path`). One bad frame never ends the
serving loop: it is answered with an error (or its connection dropped). Every frame a peer sends is capped
(ZMQ_MAXMSGSIZE: the ROUTER near the request cap, the PUB, whose peers send only subscriptions, at 1 KiB), and
what one connection can have queued at the ROUTER in one-frame messages is bounded in bytes (ZMQ_RCVHWM:
REQUEST_QUEUE_BYTES); a multipart message is not (libzmq caps frames, not frames per message: see MAXMSG_SLACK).
Reading is open to every peer the socket lets in; the administrative op (`retune`: queue or cancel a
re-tune, which runs benchmarks on the node's GPUs) is answered `forbidden` unless the peer is an admin: on
IPC the daemon's own user or root (read from the kernel's peer credentials, SO_PEERCRED) and, with
`group_may_retune`, members of `group`; on TCP a CURVE client whose public key is also in the admin list
(`admins/` beside the secret key); plain-text TCP carries no identity, so never.
The daemon is the single writer of its database; everyone else opens it read-only. It holds the database's run
lock (`lock_files.take_run_lock`) while it serves, as a measuring run (`moetune profile`, `tune --backend local`) does:
its re-tune jobs measure and write as one does, so it refuses to start beside one, and one refuses to start beside it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import gc
import importlib
import itertools
import json
import logging
import math
import os
import queue
import signal
import socket as pysocket
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import msgspec
import zmq

from moetune.runtime import wire
from moetune.runtime.paths import (
    INFO_NAME,
    MAX_IPC_PATH_BYTES,
    ipc_path,
    ipc_socket_file,
    is_loopback_host,
    sync_folder,
    tcp_host,
)
from moetune.runtime.profile_record import ProfileRecord
from moetune.tuner.daemon import handlers
from moetune.tuner.daemon.auth import (
    CurveAllowList,
    check_public_beside,
    default_admins_dir,
    default_clients_dir,
    load_admin_keys,
    load_client_keys,
    load_curve_keys,
    peer_credentials,
    user_in_group,
)
from moetune.tuner.daemon.endpoints import check_endpoint, derive_pub_endpoint, same_endpoint
from moetune.tuner.daemon.errors import DaemonBusy, DaemonConfigError
from moetune.tuner.daemon.index import ProfileIndex, read_profiles
from moetune.tuner.daemon.jobs import Job, JobManager, RetuneFn
from moetune.tuner.daemon.locks import (
    holder_words,
    lock_database,
    lock_runs,
    lock_socket_path,
    release_socket_lock,
)
from moetune.tuner.daemon.logs import setup_logging
from moetune.tuner.daemon.metrics import DaemonMetrics, start_metrics_server
from moetune.tuner.daemon.recovery import (
    Resumable,
    close_job,
    keys_from_details,
    recover_jobs,
    tune_notice_of,
)
from moetune.tuner.daemon.retune import TUNE_BACKENDS, tuner_retune
from moetune.tuner.daemon.runtime_dir import (
    INFO_MARK,
    binding_name,
    check_socket_ancestors,
    check_socket_path,
    foreign_info_reason,
    group_id,
    missing_dirs,
    other_live_daemon,
    owner_record,
    prepare_runtime_dir,
    record_binding,
    record_owner,
    remove_dead_binding,
    remove_made_dirs,
    synced,
    unlink_if,
    write_info_record,
)
from moetune.tuner.daemon.watch import FabricWatch, make_discover, transport_names
from moetune.tuner.fabric.change import default_diff
from moetune.tuner.store import StoreStopping
from moetune.tuner.store.atomic_files import rename_no_replace
from moetune.tuner.store.lock_files import release_run_lock

log = logging.getLogger("moetune.daemon")

__all__ = ["Daemon", "TuneSettings", "check_rediscover_interval", "main", "run_daemon"]

# ZMQ_MAXMSGSIZE = max_request_bytes + this: a frame a little over the cap is answered `too_large`, a bigger
# one drops the connection. libzmq bounds each frame, not the frames per message: a multipart message is
# buffered whole before the serving loop sees (and drops) it, so peers allowed to connect are trusted not
# to flood (IPC: the owner and its group; TCP: the CURVE allow-list).
MAXMSG_SLACK = 1024
# ZMQ_MAXMSGSIZE of the PUB socket: what its peers send it are subscriptions (one frame: 1 byte + a topic prefix, a
# change kind), never more than this; a bigger frame drops that connection (libzmq buffers a frame whole first)
SUBSCRIPTION_MAX_BYTES = 1024
MAX_REQUEST_BYTES_LIMIT = 16 << 20  # a request cap above this is a configuration mistake
# ZMQ_RCVHWM of the ROUTER: libzmq queues up to this many messages per connection, each frame up to its
# ZMQ_MAXMSGSIZE; 10000 let one peer have the daemon hold ~650 MB at the default cap. The bound holds for one-frame
# messages, what clients send: a message of many frames counts once (see MAXMSG_SLACK). A legitimate client has one
# request in flight (ProfileClient: one DEALER, one request, a new socket after a time-out), and a full queue only
# has libzmq stop reading that connection until the loop drains it (nothing is dropped): bounded at
# REQUEST_QUEUE_BYTES per connection (~127 requests at the default cap), never below REQUEST_HWM_MIN (a cap the
# operator raised to MiBs).
REQUEST_QUEUE_BYTES = 8 << 20
REQUEST_HWM_MIN = 4
LIST_QUEUE = 8  # uncached list requests waiting for the list worker; more are answered `busy`
RETUNE_QUEUE = 8  # retune requests waiting for the retune worker; more are answered `busy`
STOP_WORKERS_S = 1.0  # how long stop() waits for the list and retune workers (one may be waiting on the store)
# the largest reply (a list_profiles page of LIST_PAGE_MAX profiles) is about 1 MB: at most ~64 MB queued per peer
LARGEST_REPLY_BYTES = 1 << 20
REPLY_HWM = max(16, (64 << 20) // LARGEST_REPLY_BYTES)
ZAP_DOMAIN = "moetune"  # the domain our sockets ask the ZAP authenticator about


def now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class TuneSettings:
    backend: str = "model"
    trials: int = 40
    timeout_s: float | None = 600.0
    preset: str | None = None  # only for tests/explicit use: a preset never stands for this node by default
    node_model_dir: str | None = None  # where `moetune profile` left node-<fingerprint>.toml (default: beside the db)
    # a measuring (local) re-tune waits while other processes run on the GPUs (or that cannot be told), unless this
    run_on_busy_gpus: bool = False
    busy_retry_s: float = 300.0  # how often a waiting re-tune checks the GPUs again

    def __post_init__(self) -> None:
        if self.backend not in TUNE_BACKENDS:
            raise DaemonConfigError(f"tune.backend must be one of {', '.join(TUNE_BACKENDS)}, got {self.backend!r}")


# -- the daemon ---------------------------------------------------------------------------------------
class Daemon(FabricWatch):
    def __init__(
        self,
        *,
        store: Any,
        endpoint: str,
        pub_endpoint: str | None = None,
        discover: Callable[[], Any] | None = None,
        fabric_origin: Literal["local", "capture"] = "local",  # 'capture': `discover` reads a capture, not this node
        diff: Callable[[dict, dict], list[str]] = default_diff,
        retune_job: RetuneFn | None = None,
        tune: TuneSettings | None = None,
        rediscover_interval_s: float = 60.0,
        max_request_bytes: int = wire.DEFAULT_MAX_REQUEST_BYTES,
        curve_secret_key_file: str | None = None,
        curve_clients_dir: str | Path | None = None,
        curve_admins_dir: str | Path | None = None,
        allow_insecure_tcp: bool = False,
        group: str = "",
        group_may_retune: bool = False,
        metrics_port: int = 0,
        metrics_addr: str = "127.0.0.1",
        metrics_option: str = "daemon.metrics_port",  # where metrics_port came from, for the error when it is taken
        db_path: str = "",
        job_capacity: int = 4,
        db_lock_fd: int | None = None,  # the database's lock, taken before the store opened (run_daemon); closed here
        run_lock_fd: int | None = None,  # its run lock (lock_runs), taken with it there; released here
    ):
        check_endpoint(endpoint, "socket")
        if not 64 <= max_request_bytes <= MAX_REQUEST_BYTES_LIMIT:
            raise DaemonConfigError(f"daemon.max_request_bytes must be in 64..{MAX_REQUEST_BYTES_LIMIT}, got {max_request_bytes}")
        self.store = store
        self.endpoint = endpoint
        self.pub_endpoint = pub_endpoint or derive_pub_endpoint(endpoint)
        check_endpoint(self.pub_endpoint, "pub_socket")
        if same_endpoint(endpoint, self.pub_endpoint):  # else the PUB's bind found our own socket "in use" (exit 1)
            raise DaemonConfigError(f"socket and pub_socket are the same endpoint ({endpoint}, {self.pub_endpoint}): "
                                    "the two endpoints must differ (set daemon.pub_socket / --pub-socket to another one, "
                                    "or leave it unset for the one beside the socket)")
        self._discover = discover
        if fabric_origin not in ("local", "capture"):
            raise DaemonConfigError(f"fabric_origin must be 'local' or 'capture', not {fabric_origin!r}")
        self.fabric_origin = fabric_origin
        self._diff = diff
        self.tune = tune or TuneSettings()
        check_rediscover_interval(rediscover_interval_s, "rediscover_interval_s")
        self.interval = rediscover_interval_s
        self.max_request_bytes = max_request_bytes
        self.curve_secret_key_file = curve_secret_key_file
        self.curve_clients_dir = Path(curve_clients_dir) if curve_clients_dir else (
            default_clients_dir(curve_secret_key_file) if curve_secret_key_file else None)
        self.curve_admins_dir = Path(curve_admins_dir) if curve_admins_dir else (
            default_admins_dir(curve_secret_key_file) if curve_secret_key_file else None)
        self._admin_keys: frozenset[bytes] = frozenset()  # read at start (see _check_transport_security)
        self._client_keys: frozenset[bytes] = frozenset()  # the allow-list as read and checked at start: ZAP's only source
        self._curve_keys: tuple[bytes, bytes] | None = None  # (public, secret) as read and checked at start
        self._auth: Any = None  # the ZAP authenticator thread (tcp + CURVE)
        self.allow_insecure_tcp = allow_insecure_tcp
        self.group = group
        self.group_may_retune = group_may_retune
        self._admin_gid = group_id(group) if group_may_retune else None
        if group_may_retune and self._admin_gid is None:
            raise DaemonConfigError("daemon.group_may_retune needs daemon.group (the group whose members may re-tune)")
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.metrics_option = metrics_option
        self.db_path = db_path or str(getattr(store, "path", "") or "")
        self.epoch = uuid.uuid4().hex[:16]
        self.started = time.time()
        self.metrics = DaemonMetrics()
        self.facts: Any = None
        self.version = 0
        self._last_discovery = ("", False, "not run yet")
        self.index = ProfileIndex([], version=0, facts=None, stale=[])
        self.tune_notice = ""  # why the automatic re-tune cannot run here (shown by `status`), else ""
        # the last `retune` requests that queued nothing for keys they left out (handlers._note_refusal; `status`)
        self.retune_refusals: collections.deque[wire.RetuneRefusal] = collections.deque(maxlen=wire.RETUNE_REFUSALS_KEPT)
        self._lists: queue.Queue[tuple[list[bytes], wire.ListProfiles] | None] = queue.Queue(maxsize=LIST_QUEUE)
        self._retunes: queue.Queue[tuple[list[bytes], wire.Retune] | None] = queue.Queue(maxsize=RETUNE_QUEUE)
        self._workers: list[threading.Thread] = []  # the list and retune workers (they hold a PUSH socket each)
        self._list_endpoint = f"inproc://moetune-lists-{self.epoch}"
        self._list_pull: zmq.Socket | None = None
        self._commit_lock = threading.RLock()
        self._pub_lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self.stopped_by: int | None = None  # the signal that stopped serve_forever, if one did (its exit status)
        self._ctx = zmq.Context()
        self._router: zmq.Socket | None = None
        self._pub: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []
        self._serve_thread: threading.Thread | None = None
        self._metrics_server: Any = None
        # socket path -> (dev, inode) of the socket bound there and of its owner record (None: not written)
        self._bound_paths: dict[Path, tuple[tuple[int, int] | None, tuple[int, int] | None]] = {}
        self._lock_fd: int | None = db_lock_fd
        self._run_lock_fd: int | None = run_lock_fd
        self._socket_locks: dict[Path, int] = {}  # socket path -> the fd of its lock (lock_socket_path)
        # socket folders this start made (missing ancestors first, then the folder; whether it holds our mark): a start
        # refused before it serves removes them again, as it does the new database (`_close`)
        self._made_dirs: list[tuple[list[Path], bool]] = []
        # ipc endpoint -> its socket file, resolved once when bound (`ipc_socket_file`): the files beside it stay
        # in that folder for the whole run, even if a link on the way is repointed meanwhile
        self._socket_files: dict[str, Path] = {}
        self._jobs_started = False
        self._info_id: tuple[int, int] | None = None  # (dev, inode) of the daemon.json this run wrote last
        self._info_rec_id: tuple[int, int] | None = None  # (dev, inode) of daemon.json's owner record it wrote last
        self._info_yielded = False  # daemon.json is another live daemon's: not written this run
        self._served = False  # start() went through: at exit daemon.json stays, as the runtime's fallback cache
        self.jobs = JobManager(store=store, facts_fn=lambda: self.facts, retune=retune_job or tuner_retune,
                               on_done=self._job_done, on_start=self._job_started, tune=self.tune,
                               capacity=job_capacity, metrics=self.metrics)
        g = self.metrics.gauges
        # the profiles held, by provenance (a modelled profile served is not a measured one: the label tells them apart)
        pg = self.metrics.provenance_gauges
        pg["profiles_current"] = lambda: self.index.held_by_provenance("current")
        pg["profiles_stale"] = lambda: self.index.held_by_provenance("stale")
        pg["profiles_not_served"] = lambda: self.index.held_by_provenance("not_served")  # of profiles_current
        g["jobs_queued"] = lambda: self.jobs.queued_count()
        g["jobs_running"] = lambda: 1 if self.jobs.running else 0
        g["uptime_seconds"] = lambda: time.time() - self.started
        g["change_version"] = lambda: self.version

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, *, background: bool = False) -> Daemon:
        """Discover, recover jobs, bind, start the workers (and the serving loop when `background`)."""
        self._check_transport_security()
        self._lock_database()  # the single writer: before anything is written
        try:
            self._bind()  # refuses when another daemon listens on the socket; requests wait in ZeroMQ meanwhile
            self._start_metrics()  # a port in use is refused before the start-up's slow work (discovery)
            # the interrupted jobs first: a fabric change found now queues its re-tune with skip_queued (as every
            # automatic one), leaving out the keys a resumed job holds, so no key is tuned twice
            self._resume(self._recover())
            self._startup_discovery()
            self._retune_after_interrupted_change()  # a change the last daemon recorded but did not queue
            self._rebuild()
            self.jobs.start()
            self._jobs_started = True
            for name, q in (("moetune-lists", self._lists), ("moetune-retunes", self._retunes)):
                wt = threading.Thread(target=self._worker_loop, args=(q,), name=name, daemon=True)
                wt.start()
                self._workers.append(wt)
            if self.interval > 0 and self._discover is not None:
                t = threading.Thread(target=self._discovery_loop, name="moetune-discovery", daemon=True)
                t.start()
                self._threads.append(t)
            # last: a start-up that fails before this point leaves the previous run's daemon.json (the runtime's
            # fallback cache: database and fingerprint) and its owner record as they were
            self._write_info(running=True)
        except BaseException:  # close what was opened (a daemon.json we wrote included), then re-raise
            self._close()
            raise
        self._served = True
        log.info("serving", extra={"endpoint": self.endpoint, "pub_endpoint": self.pub_endpoint, "epoch": self.epoch,
                                   "db": self.db_path, "fingerprint": self.index.fingerprint})
        # Everything loaded so far (SQLAlchemy, Alembic, the index) lives for the whole run: move it out of
        # the cyclic GC's generations so that full collections do not rescan it (tail latency).
        gc.collect()
        gc.freeze()
        if background:
            self._serve_thread = threading.Thread(target=self.serve_forever, name="moetune-serve", daemon=True)
            self._serve_thread.start()
        return self

    def _start_metrics(self) -> None:
        if not self.metrics_port:
            return
        try:
            self._metrics_server = start_metrics_server(self.metrics, self.metrics_port, self.metrics_addr)
        except OSError as e:  # "[Errno 98] Address already in use" named neither the address nor the option
            raise DaemonConfigError(f"{self.metrics_option} {self.metrics_port}: cannot serve /metrics on "
                                    f"{self.metrics_addr}:{self.metrics_port}: {e.strerror or e} (choose another port, "
                                    "or 0 for none)") from None

    def stop(self) -> None:
        self._stop.set()
        if self._serve_thread is not None:
            self._serve_thread.join(5)
            self._close()

    def store_users(self) -> list[str]:
        """The threads that use the store and still run after stop() (each waited for a bounded time): the job worker,
        the discovery loop, the list and retune workers. [] before start() and once every one has ended."""
        alive = ["moetune-jobs"] if self._jobs_started and self.jobs.alive() else []
        return alive + [t.name for t in (*self._threads, *self._workers) if t.is_alive()]

    def _close(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._jobs_started:
            self.jobs.stop(timeout=5.0)
        for q in (self._lists, self._retunes):
            # the requests still waiting are dropped (their clients time out): the queue is emptied so that the
            # end marker always fits (a full queue used to hold stop() for 2 s)
            with contextlib.suppress(queue.Empty):
                while True:
                    q.get_nowait()
            with contextlib.suppress(queue.Full):
                q.put_nowait(None)
        for t in self._threads:
            t.join(2)
        deadline = time.monotonic() + STOP_WORKERS_S
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self._workers if t.is_alive()]
        with self._pub_lock:
            if self._pub is not None:
                self._pub.close(linger=0)
                self._pub = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._list_pull is not None:
            self._list_pull.close(linger=0)
            self._list_pull = None
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        if self._metrics_server is not None:
            with contextlib.suppress(Exception):
                self._metrics_server[0].shutdown()
        self._unlink_bound()
        if self._info_id is not None:  # only a daemon.json this run wrote is touched
            if self._served:
                self._write_info(running=False)  # kept: the last fingerprint and database, for the runtime
            else:
                self._remove_info()  # a daemon that never served leaves none behind
        for p, fd in self._socket_locks.items():  # last: the next daemon on this socket may start now
            release_socket_lock(p, fd)
        self._socket_locks = {}
        if not self._served:  # a refused start leaves no socket folder it made (an operator's rerun finds none)
            for made, marked in self._made_dirs:
                remove_made_dirs(made, marked)
        self._made_dirs = []
        if self._run_lock_fd is not None:  # before the database lock: a bring-up refused by either may start now
            release_run_lock(self.db_path, self._run_lock_fd)
            self._run_lock_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        if busy:
            # a worker still waits on the store (another process holds its write lock, up to the busy timeout):
            # term() blocks until its socket is closed, which it does when the wait ends, so the context ends in
            # the background and stop() does not wait out another process's transaction
            log.info("stopping while %s wait on the database; their requests get no reply", ", ".join(busy))
            threading.Thread(target=self._ctx.term, name="moetune-ctx-term", daemon=True).start()
        else:
            self._ctx.term()
        if self._served:
            log.info("stopped", extra={"epoch": self.epoch})
        else:  # start() failed: nothing was served; the caller reports why
            log.debug("start refused: closed what it had opened", extra={"epoch": self.epoch})

    def _lock_database(self) -> None:
        """An exclusive flock next to the database (released by the kernel when the process dies, even
        on kill -9): a second daemon on the same database refuses to start. Then its run lock (`lock_runs`): none
        starts beside a bring-up running on it. Held already where `run_daemon` took them before opening the store
        (`db_lock_fd`, `run_lock_fd`)."""
        if self.db_path and self._lock_fd is None:
            self._lock_fd = lock_database(self.db_path)
        if self.db_path and self._run_lock_fd is None:
            try:
                self._run_lock_fd = lock_runs(self.db_path)
            except BaseException:  # refused (start() closes nothing yet): the database lock is not kept either
                if self._lock_fd is not None:
                    os.close(self._lock_fd)
                    self._lock_fd = None
                raise

    def install_signal_handlers(self) -> None:
        def _handler(signum: int, _frame: Any) -> None:
            log.info("signal %s: shutting down", signal.Signals(signum).name)
            if self.stopped_by is None:  # the first signal decides the exit status (a second one only repeats it)
                self.stopped_by = signum
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
            if not self.curve_secret_key_file and not is_loopback_host(tcp_host(ep)):
                raise DaemonConfigError(
                    f"refusing to listen on {ep} without CURVE keys: allow_insecure_tcp is for loopback addresses only "
                    "(127.0.0.0/8, ::1, localhost); use CURVE keys (`moetune keys generate DIR`) for any other address"
                )
        if self.curve_secret_key_file:
            tcp = any(ep.startswith("tcp://") for ep in (self.endpoint, self.pub_endpoint))
            # the key is used only on TCP; an IPC daemon with a configured key is not refused for its mode. Read
            # once, judged on the descriptor it was read from; the binds use these keys, never the path again
            public, secret = load_curve_keys(self.curve_secret_key_file, check=tcp)
            self._curve_keys = (public, secret)
            if tcp:
                check_public_beside(self.curve_secret_key_file, public)
            if tcp:
                assert self.curve_clients_dir is not None
                allowed = load_client_keys(self.curve_clients_dir)
                self._client_keys = frozenset(allowed)  # read once: `moetune keys allow` says to restart to apply
                if not allowed:
                    log.warning("the CURVE client allow-list %s is empty: every client will be refused "
                                "(add one with `moetune keys client`)", self.curve_clients_dir)
                self._admin_keys = load_admin_keys(self.curve_admins_dir)
                if self._admin_keys - set(allowed):  # an admin must get in before it can be an admin
                    log.warning("some keys in the admin list %s are not in the allow-list %s: those clients are "
                                "refused (`moetune keys allow --admin` puts a key in both)",
                                self.curve_admins_dir, self.curve_clients_dir)

    def _start_authenticator(self) -> None:
        """pyzmq's ZAP authenticator: a CURVE client is let in only when its public key is in the allow-list, as
        `_check_transport_security` read and checked it (the keys themselves, never the folder's path: pyzmq would
        glob that path again, unescaped)."""
        if self._auth is not None:
            return
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("moetune.daemon.zap"))
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=CurveAllowList(self._client_keys))
        self._auth = auth

    def _prepare_ipc(self, endpoint: str, setting: str = "--socket (daemon.socket)") -> Path | None:
        raw = ipc_path(endpoint)
        if raw is None:
            return None
        check_socket_ancestors(raw.parent)  # the folders the path as written goes through (the links' holders too)
        # one resolved path for the socket and every file beside it (lock, owner records, daemon.json): what the
        # kernel finds, so the client (given the same string) finds the same files
        p = self._socket_files.setdefault(endpoint, ipc_socket_file(endpoint) or raw)
        missing = missing_dirs(p.parent)  # before prepare makes them: what a refused start removes again
        created = prepare_runtime_dir(p.parent, self.group)
        if missing:
            self._made_dirs.append((missing, created))
        # again, now that none is missing: one another user made between the check and prepare's mkdir (which takes an
        # existing folder as it is) is theirs, and so is the socket folder made in it; the resolved folder too (a link
        # on the way repointed since would take the path as written elsewhere)
        for d in dict.fromkeys((raw.parent, p.parent)):
            check_socket_ancestors(d)
        if p not in self._socket_locks:
            self._socket_locks[p] = lock_socket_path(p, setting)  # before the check: nobody else binds p until we exit
        remove_dead_binding(p)  # a socket a daemon killed while binding left under its binding name
        check_socket_path(p, setting)
        return p

    def _secure(self, s: zmq.Socket, endpoint: str) -> None:
        if endpoint.startswith("tcp://") and self.curve_secret_key_file:
            if self._curve_keys is None:  # a bind without the start's checks (`start` reads them first)
                self._curve_keys = load_curve_keys(self.curve_secret_key_file, check=True)
            public, secret = self._curve_keys
            self._start_authenticator()
            s.zap_domain = ZAP_DOMAIN.encode()
            # with no ZAP handler bound libzmq lets every CURVE client in ("Stonehouse", its legacy default): the
            # allow-list would hold only while the authenticator's thread is there. Enforced, a missing handler
            # refuses every client instead
            s.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            s.curve_secretkey = secret
            s.curve_publickey = public
            s.curve_server = True
        elif endpoint.startswith("tcp://"):
            log.warning("INSECURE: listening on %s without CURVE (allow_insecure_tcp)", endpoint)

    def _bind_one(self, s: zmq.Socket, endpoint: str, setting: str) -> None:
        """Bind `s` at `endpoint`; `setting`: the option that names it, for a TCP address this host refuses."""
        p = self._prepare_ipc(endpoint, setting)
        self._secure(s, endpoint)
        gid = group_id(self.group)
        # an IPC socket is bound under a name of its own, recorded, then linked to its path (binding_name)
        at = binding_name(p) if p is not None else None
        if p is not None and at is None:  # bound at p itself: the protection above is lost, so say so
            log.warning("%s is too long for a binding name beside it (%d bytes of %d): the socket is bound at its path "
                        "directly, and a daemon killed before it records its owner leaves a socket the next start "
                        "refuses (remove it by hand then); a path %d bytes or shorter avoids this", p,
                        len(os.fsencode(p)), MAX_IPC_PATH_BYTES, MAX_IPC_PATH_BYTES - 10)  # `.NAME.<8 hex>`
        intent = record_binding(p, at) if p is not None and at is not None else None  # names `at` before it exists
        # 0600 whatever the group: bound 0660 it was open to the process's own group (its primary group, or a setgid
        # folder's) until the chown below, and a peer connected in that window stayed connected
        old = os.umask(0o177)
        try:
            s.bind(f"ipc://{at}" if at is not None else endpoint)
        except BaseException as e:
            if p is not None:
                unlink_if(owner_record(p), intent)  # nothing was bound: the record of the intent goes
            # zmq's "Address already in use (addr=...)" named neither the setting nor what to do (the IPC paths have
            # their socket locks, which say who holds them)
            if p is None and isinstance(e, zmq.ZMQError) and e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                why = ("the address is in use: another moetune daemon, or another program, listens there; stop it or "
                       "choose another port" if e.errno == errno.EADDRINUSE else
                       f"{os.strerror(e.errno)} (no interface of this host has that address): choose one of this host's")
                raise DaemonConfigError(f"{setting} {endpoint}: cannot listen: {why}") from None
            raise
        finally:
            os.umask(old)
        if p is not None:
            if intent is not None:  # removed at exit where the full record below does not replace it
                self._bound_paths[p] = (None, intent)
            bound = at or p
            # the socket as bound, never a link put in its place: nothing but our own socket is claimed or chmod-ed
            st = os.lstat(bound)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
                raise DaemonConfigError(f"{bound} is no longer the socket this daemon bound (replaced meanwhile?)")
            # we created it: ours to chmod and, at exit, to remove, by the id seen here (also when the record
            # below cannot be written)
            self._bound_paths[bound] = ((st.st_dev, st.st_ino), None)
            self._bound_paths[p] = ((st.st_dev, st.st_ino), record_owner(p, st, at))
            # its group and mode before its path names it (bound under its own name: `at`)
            if gid is not None:
                os.chown(bound, -1, gid, follow_symlinks=False)
            os.chmod(bound, 0o660 if gid is not None else 0o600)
            if at is not None:
                appeared = DaemonConfigError(f"{p} appeared while this daemon was binding it: refusing to replace it")
                try:
                    os.link(at, p)  # never over a file that appeared at p meanwhile (EEXIST)
                except FileExistsError:
                    raise appeared from None
                except OSError as e:
                    if os.path.lexists(p):
                        raise appeared from None
                    if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    # a file system without hard links: a rename that never goes over a file made at p since the
                    # check above (the socket lock keeps other daemons away, not the user's own processes)
                    try:
                        rename_no_replace(at, p)
                    except FileExistsError:
                        raise appeared from None
                unlink_if(at, (st.st_dev, st.st_ino), stat.S_IFSOCK)
                del self._bound_paths[at]

    def _bind(self) -> None:
        r = self._ctx.socket(zmq.ROUTER)
        r.linger = 0
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)
        r.setsockopt(zmq.MAXMSGSIZE, self.max_request_bytes + MAXMSG_SLACK)
        # replies queued per peer: a peer that sends list_profiles and never reads its replies (up to ~1 MB each)
        # would have the daemon hold sndhwm of them; past this many, its replies are dropped (ROUTER_MANDATORY +
        # NOBLOCK: counted `unsent`), never another peer's
        r.sndhwm = REPLY_HWM
        r.rcvhwm = max(REQUEST_HWM_MIN, REQUEST_QUEUE_BYTES // (self.max_request_bytes + MAXMSG_SLACK))
        self._router = r
        self._bind_one(r, self.endpoint, "daemon.socket (--socket)")
        p = self._ctx.socket(zmq.PUB)
        p.linger = 0
        p.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_BYTES)  # a peer's oversized "subscription" drops its connection
        self._pub = p
        # its default as the scheme has it (endpoints.derive_pub_endpoint): an IPC refusal names this setting too
        beside = "the socket's port + 1" if self.pub_endpoint.startswith("tcp://") else "events.sock beside the socket"
        self._bind_one(p, self.pub_endpoint, f"daemon.pub_socket (--pub-socket; default: {beside})")
        pull = self._ctx.socket(zmq.PULL)
        pull.linger = 0
        pull.bind(self._list_endpoint)
        self._list_pull = pull

    def _unlink_bound(self) -> None:
        """Remove the sockets we bound and their owner records, only while they are still the files we created."""
        for p, (sock, rec) in self._bound_paths.items():
            unlink_if(p, sock, stat.S_IFSOCK)
            unlink_if(owner_record(p), rec)
        self._bound_paths = {}

    def _info_path(self) -> Path | None:
        p = self._socket_files.get(self.endpoint) or ipc_socket_file(self.endpoint)
        return p.parent / INFO_NAME if p is not None else None

    def _info_is_ours(self, path: Path) -> bool:
        """`path` is still the daemon.json this run wrote last (not replaced since, by anyone)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and (st.st_dev, st.st_ino) == self._info_id

    def _remove_info(self) -> None:
        path = self._info_path()
        if path is None or self._info_id is None:
            return
        with contextlib.suppress(OSError):
            if self._info_is_ours(path):
                path.unlink()
                unlink_if(owner_record(path), self._info_rec_id)  # only the record this run wrote
        self._info_id = self._info_rec_id = None

    def _write_info(self, *, running: bool) -> None:
        """daemon.json next to the socket: endpoints, db, last fingerprint (the runtime's fallback cache). Written
        only over nothing or over a daemon.json of ours (marked and recorded, see foreign_info_reason): a file of
        anyone else's, the user's own included, is left alone and the daemon serves without one."""
        path = self._info_path()
        if path is None:
            return
        if self._info_yielded:
            return  # another live daemon's file (warned at start): left to it for this whole run
        if self._info_id is None:
            why = foreign_info_reason(path, self.endpoint)
            # two daemons in one runtime folder: the other's clients would take this daemon's fingerprint as theirs
            if why is None and (other := other_live_daemon(path, self.endpoint)) is not None:
                self._info_yielded = True
                log.warning("not writing %s: it is another moetune daemon's, still running (%s); this daemon (%s) "
                            "serves without one and leaves it alone", path, other, self.endpoint)
                return
        else:
            why = None if self._info_is_ours(path) else "it was replaced since this daemon wrote it"
        if why is not None:
            log.warning("not writing %s: %s; the daemon serves without it (move the file away to have one)", path, why)
            return
        try:
            prev_st = os.lstat(path)
            prev: tuple[int, int] | None = (prev_st.st_dev, prev_st.st_ino)
        except FileNotFoundError:
            prev = None
        data = {
            "written_by": INFO_MARK,
            "endpoint": self.endpoint, "pub_endpoint": self.pub_endpoint, "db": self.db_path, "epoch": self.epoch,
            # host: a client tells a pid of this host's from another's (a runtime directory on a shared folder)
            "pid": os.getpid() if running else None, "host": pysocket.gethostname(), "running": running, "updated": now(),
            "fingerprint": self.facts.fingerprint if self.facts is not None else None,
            "software": self.facts.software_hash if self.facts is not None else None,
            "transports": transport_names(self.facts) if self.facts is not None else [],
        }
        gid = group_id(self.group)
        tmp: str | None = None
        try:
            # mkstemp: a fresh, unguessable name opened O_CREAT|O_EXCL|O_NOFOLLOW, 0600: nothing planted is followed
            fd, tmp = tempfile.mkstemp(prefix=f".{INFO_NAME}.", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                if gid is not None:
                    os.fchown(f.fileno(), -1, gid)
                    os.fchmod(f.fileno(), 0o640)
                json.dump(data, f)
                synced(f)  # on disk before the rename: a power loss left a 0-byte daemon.json otherwise
                st = os.fstat(f.fileno())
            rec_id = write_info_record(path, (st.st_dev, st.st_ino), prev)
            os.replace(tmp, path)
            tmp = None
            sync_folder(path.parent)
            # the replaced file's inode is free now and the next file made in this folder may get it (a user's
            # copy put over daemon.json would then pass for ours): the record names the new file alone from here
            if prev is not None:
                rec_id = write_info_record(path, (st.st_dev, st.st_ino), None)
            self._info_id, self._info_rec_id = (st.st_dev, st.st_ino), rec_id
        except (OSError, DaemonConfigError) as e:
            log.warning("cannot write %s: %s", path, e)
        finally:
            if tmp is not None:  # ours (just created), left behind by a failed write
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    # -- serving loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Answer requests until stop() or a signal. Runs in the calling thread."""
        assert self._router is not None and self._list_pull is not None, "start() first"
        router, pull = self._router, self._list_pull
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        handle = self._handle
        observe = self.metrics.observe
        perf = time.perf_counter
        stop = self._stop
        try:
            while not stop.is_set():
                if not poller.poll(100):
                    continue
                while True:  # replies of the list worker
                    try:
                        out = pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    with contextlib.suppress(zmq.ZMQError):
                        router.send_multipart(out, zmq.NOBLOCK)
                for _ in range(1024):
                    try:
                        # The identity frame as a zmq.Frame: it carries the connection's metadata (who the
                        # peer is) for the admin check; the rest of the message (delivered whole) as bytes.
                        first = router.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    frames = [first.bytes, *router.recv_multipart()] if first.more else [first.bytes]
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
                        if n < 3:
                            continue  # no frame after the routing id: nothing to answer
                        # a request split into several frames: answered (a client waiting for a reply would wait out
                        # its time-out), through the envelope it came with (a REQ's empty delimiter kept)
                        head = frames[:2] if not frames[1] else frames[:1]
                        parts = n - len(head)
                        reply = wire.encode_error(None, self.epoch, wire.E_BAD_REQUEST,
                                                  f"a request is one ZeroMQ frame holding one JSON object; got {parts} frames")
                        with contextlib.suppress(zmq.ZMQError):
                            router.send_multipart([*head, reply], zmq.NOBLOCK)
                        observe("invalid", wire.E_BAD_REQUEST, perf() - t0)
                        continue
                    try:
                        reply, op, outcome = handle(body, head, first)
                    except Exception as e:  # broad: one frame must never end the serving loop
                        log.exception("request frame failed")
                        op, outcome = "invalid", wire.E_INTERNAL
                        reply = wire.encode_error(None, self.epoch, wire.E_INTERNAL, f"request failed: {type(e).__name__}")
                    if reply is None:
                        continue  # handed to the list worker, which answers
                    try:
                        router.send_multipart([*head, reply], zmq.NOBLOCK)
                    except zmq.ZMQError:  # peer gone (ROUTER_MANDATORY) or its queue full: drop
                        outcome = "unsent"
                    observe(op, outcome, perf() - t0)
        finally:
            if self._serve_thread is None:
                self._close()

    def _handle(self, frame: bytes, head: list[bytes] | None = None,
                peer: zmq.Frame | None = None) -> tuple[bytes | None, str, str]:
        """Decode one request and answer it; None when the reply will come from the list worker. `peer` is a
        frame of the request's message (its connection's metadata); None for a call in this process."""
        try:
            req = wire.decode_request(frame, self.max_request_bytes)
        except wire.WireError as e:
            return wire.encode_error(e.req_id, self.epoch, e.code, e.message), "invalid", e.code
        op = req.__struct_config__.tag
        if peer is not None and type(req) in handlers.ADMIN_OPS:
            refusal = self._admin_refusal(peer)
            if refusal:
                log.warning("refused %s: %s", op, refusal)
                return wire.encode_error(req.id, self.epoch, wire.E_FORBIDDEN, refusal), op, wire.E_FORBIDDEN
        try:
            res = handlers.HANDLERS[type(req)](self, req)
            if res is handlers.DEFERRED:
                if head is None:  # a direct call (tests): answer inline
                    res = self._deferred(req)
                else:
                    retune = isinstance(req, wire.Retune)
                    try:
                        (self._retunes if retune else self._lists).put_nowait((head, req))
                        return None, op, "deferred"
                    except queue.Full:
                        what = f"{RETUNE_QUEUE} retune requests" if retune else f"{LIST_QUEUE} list_profiles requests"
                        res = False, (wire.E_BUSY, f"{what} are waiting: retry later")
            ok, payload = res
        except StoreStopping as e:  # the daemon stops: a write given up behind another writer's lock (no traceback)
            log.info("op %s not answered: %s", op, e)
            return wire.encode_error(req.id, self.epoch, wire.E_BUSY, f"the daemon is stopping: {e}"), op, wire.E_BUSY
        except Exception as e:  # broad: the request handler's boundary; the client gets E_INTERNAL
            log.exception("op %s failed", op)
            return wire.encode_error(req.id, self.epoch, wire.E_INTERNAL, f"{type(e).__name__}: {e}"), op, wire.E_INTERNAL
        if ok:
            return wire.encode_ok(req.id, self.epoch, payload), op, "ok"
        code, message = payload
        return wire.encode_error(req.id, self.epoch, code, message), op, code

    def _admin_refusal(self, peer: zmq.Frame) -> str:
        """Why the peer that sent `peer` may not run an administrative op ("" when it may)."""
        if self.endpoint.startswith("inproc://"):
            return ""  # only this process can reach an inproc socket
        if self.endpoint.startswith("ipc://"):
            cred = peer_credentials(peer)
            if cred is None:
                return "re-tuning needs the daemon's own user, and the kernel reported no credentials for this peer"
            uid, gid = cred
            me = os.geteuid()
            if uid in (me, 0) or (self._admin_gid is not None and user_in_group(uid, gid, self._admin_gid)):
                return ""
            who = f"the daemon's user (uid {me})" + (f" or members of group {self.group!r}" if self._admin_gid is not None
                                                      else " (daemon.group_may_retune lets its group do it too)")
            return f"re-tuning is for {who}; this peer runs as uid {uid}"
        try:
            user = peer.get("User-Id")  # the ZAP authenticator's name for a CURVE client: its z85 public key
        except zmq.ZMQError:
            user = None
        if not self.curve_secret_key_file or not user:
            return "re-tuning over TCP needs a CURVE client key in the daemon's admin list; this connection has none"
        if str(user).encode() not in self._admin_keys:
            return (f"this client's key is not in the daemon's admin list {self.curve_admins_dir} "
                    "(`moetune keys allow --admin` adds one)")
        return ""

    def _list_page(self, req: wire.ListProfiles) -> bytes:
        idx = self.index
        history = None
        if req.status in ("superseded", "all"):  # the history lives in the store only
            history = read_profiles(self.store, status=None if req.status == "all" else req.status,
                                    fingerprint=req.fingerprint)
        raw = idx.list_page(req.status, req.fingerprint, req.limit, history)
        idx.list_cache.put(idx.list_key(req.status, req.fingerprint, req.limit), raw)  # bounded: LRU
        return raw

    def _deferred(self, req: Any) -> handlers.Result:
        """The answer to a request the serving loop handed over (`handlers.DEFERRED`), on the list worker."""
        if isinstance(req, wire.Retune):
            return handlers.run_retune(self, req)
        return True, msgspec.Raw(self._list_page(req))

    def _worker_loop(self, q: queue.Queue) -> None:
        """The list or the retune worker: answers the requests the serving loop handed to `q` (uncached
        list_profiles; retune, which waits for the store) off the serving thread, until stop()."""
        push = self._ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(self._list_endpoint)
        try:
            while not self._stop.is_set():
                item = q.get()
                if item is None or self._stop.is_set():
                    return  # stopping: the serving loop forwards no more replies
                head, req = item
                op = req.__struct_config__.tag
                t0 = time.perf_counter()
                try:
                    ok, payload = self._deferred(req)
                    if ok:
                        reply, outcome = wire.encode_ok(req.id, self.epoch, payload), "ok"
                    else:
                        reply, outcome = wire.encode_error(req.id, self.epoch, *payload), payload[0]
                except StoreStopping as e:  # the daemon stops (a write given up at the stop): said, no traceback
                    log.info("%s not answered: %s", op, e)
                    reply = wire.encode_error(req.id, self.epoch, wire.E_BUSY, f"the daemon is stopping: {e}")
                    outcome = wire.E_BUSY
                except Exception as e:  # broad: the worker's boundary; the client gets E_INTERNAL
                    log.exception("%s failed", op)
                    reply = wire.encode_error(req.id, self.epoch, wire.E_INTERNAL, f"{type(e).__name__}: {e}")
                    outcome = wire.E_INTERNAL
                if self._stop.is_set():
                    return  # a retune that waited on the store through stop(): nobody forwards its reply
                try:
                    push.send_multipart([*head, reply])
                except zmq.ContextTerminated:  # stop() ended the context while this reply waited to be handed back
                    return
                self.metrics.observe(op, outcome, time.perf_counter() - t0)
        finally:
            push.close(linger=0)

    # -- writes (worker threads) -------------------------------------------------------------------
    def _rebuild(self, changes: list[dict[str, Any]] | None = None) -> None:
        """Re-read the store into a new index; then publish `changes` with fresh versions."""
        changes = changes or []
        with self._commit_lock:
            current = read_profiles(self.store, status="current")
            stale = read_profiles(self.store, status="stale")
            version = self.version + len(changes)
            self.index = ProfileIndex(current, version=version, facts=self.facts, stale=stale)
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

    def _recover(self) -> list[Resumable]:
        self.tune_notice = tune_notice_of(self.store, backend=self.tune.backend)  # as the last daemon left it
        resume, next_id = recover_jobs(self.store)
        self.jobs._ids = itertools.count(max(next_id, 1))
        return resume

    def _resume(self, resume: list[Resumable]) -> None:
        """Queue each job again (past the queue's capacity), then close the old one: its job_finished only once
        the resumption's job_queued is written (a crash between the two resumes it once, not never)."""
        for r in resume:
            d = r.details
            keys = keys_from_details(d)
            if not keys:  # keys an older moetune wrote that this one cannot read: nothing is queued
                close_job(self.store, r.job_id, details=r.finish_details,
                          reason=f"{r.why}; nothing to resume (its keys cannot be read)")
                continue
            try:
                job = self.jobs.submit(reason=f"resumed job {r.job_id} after a restart",
                                       old_fingerprint=d.get("old_fingerprint"), keys=keys,
                                       all_current=bool(d.get("all_current")), resumes=r.job_id,
                                       # what its `retune` left out stays said (an older moetune wrote none)
                                       left_out=[x for x in d.get("left_out") if isinstance(x, str)]
                                       if isinstance(d.get("left_out"), list) else None)
            except queue.Full:  # only while stopping: left open in the store, the next start resumes it
                log.error("daemon stopping: job %s not resumed", r.job_id)
                continue
            if job is None or not job.queued_recorded:
                # the store refused the resumption's job_queued: the old job stays open (a restart before the new one
                # records any event resumes it; once one is recorded, it names the old job, which is closed then)
                log.error("job %s: its resumption's event was not recorded; left open in the store", r.job_id)
                continue
            # not written (a full disk): the old job stays open, and the next start closes it (its resumption names it)
            close_job(self.store, r.job_id, reason=f"{r.why}; resuming", details=r.finish_details)

    def _job_started(self, job: Job) -> None:
        # the notice was about the last job's settings: this one runs under those now in force, and its end sets a
        # notice again if it still cannot (`status` showed the old advice above the job that followed it)
        self.tune_notice = ""

    def _job_done(self, job: Job, written: list[ProfileRecord]) -> None:
        if job.impossible:
            self.tune_notice = job.message
        elif job.state == "done":
            self.tune_notice = ""
        changes = []
        if written:
            changes.append(dict(kind="profile_updated", fingerprint=self.facts.fingerprint if self.facts is not None else None,
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
    # a module or attribute that is not there (a typo) ended `serve` in the import's traceback
    try:
        hook = getattr(importlib.import_module(mod), attr)
    except ImportError as e:
        raise DaemonConfigError(f"hook {spec!r}: cannot import {mod!r} ({e})") from None
    except AttributeError:
        raise DaemonConfigError(f"hook {spec!r}: module {mod!r} has no attribute {attr!r}") from None
    except (TypeError, ValueError) as e:  # ".x": a relative module name, which needs a package
        raise DaemonConfigError(f"hook {spec!r}: {e}") from None
    if not callable(hook):
        raise DaemonConfigError(f"hook {spec!r}: {type(hook).__name__} {hook!r} is not callable")
    return hook


def _load_config(config: Path | None, *, measuring: bool = False) -> Any:
    """The clients (query, status, retune) read it plainly; the daemon (`measuring`) checks [runtime] too and makes
    --config the chain its re-tunes measure under (`load_config_checked`)."""
    from moetune.runtime.config import load_config
    from moetune.runtime.options import load_config_checked

    return load_config_checked(config) if measuring else load_config(config)


MAX_REDISCOVER_INTERVAL_S = 365 * 24 * 3600.0  # a year; more is a mistake (past threading.TIMEOUT_MAX the wait overflows)


def check_rediscover_interval(value: float, what: str) -> None:
    """Refuse an interval the discovery loop cannot wait: inf made its thread die of OverflowError (the daemon served
    on with discovery dead), nan waited for ever without saying so. 0 is "never" (documented)."""
    if not math.isfinite(value) or not 0 <= value <= MAX_REDISCOVER_INTERVAL_S:
        raise DaemonConfigError(f"{what} must be a number of seconds in 0..{MAX_REDISCOVER_INTERVAL_S:.0f} "
                                f"(0 = never), got {value}")


# SQLite's files of a database: the file itself, its WAL and shared memory (WAL mode), a rollback journal
_SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")


class _NewDatabase:
    """What a start that creates its database makes there: whether the folder and the daemon's lock file existed
    (recorded before this start takes the lock), and the files absent just before the store opens the database (the
    database, SQLite's files beside it: `looked`, under the database's locks where its folder exists). A start refused
    before it serves (`serve --create` whose bind fails) removes those files and nothing else, so a corrected rerun
    finds no empty database it did not ask for (and `--db` without --create would then be served it)."""

    def __init__(self, db_path: str) -> None:
        from moetune.tuner.store.db_file import daemon_lock_path, database_path

        self.db = Path(os.path.realpath(database_path(db_path)))  # where SQLite and the locks put the files
        self.db_path = db_path
        self.lock = daemon_lock_path(db_path)
        self.folder_existed = self.db.parent.is_dir()
        self.absent = [self.lock] if not os.path.lexists(self.lock) else []
        self.ident: tuple[int, int] | None = None

    def looked(self) -> None:
        """Record which of the database's files are absent now, just before the store opens it. Not earlier: a
        database another process made before this start held the locks (a bring-up, a daemon that served and
        stopped) would be taken as this start's and deleted with what it holds."""
        self.absent += [p for p in (self.db.with_name(self.db.name + s) for s in _SQLITE_SUFFIXES)
                        if not os.path.lexists(p)]

    @property
    def creates(self) -> bool:
        return self.db in self.absent

    def opened(self) -> None:
        """Record the (dev, inode) of the database the store just created: only that file is removed later."""
        with contextlib.suppress(OSError):
            st = os.stat(self.db)
            self.ident = (st.st_dev, st.st_ino)

    def _stored_since(self) -> str | None:
        """Why the new file is kept although this start created it: profiles in it (a start refused before it
        serves stores none: another process did), or a file that cannot be read to tell. None: nothing to keep."""
        import sqlite3

        try:
            con = sqlite3.connect(self.db)  # read-write, as the store's own: a WAL file whose -shm is gone is read too
            try:
                n = con.execute("SELECT count(*) FROM profiles").fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error as e:
            return f"it cannot be read to tell whether it holds profiles ({e})"
        return f"it holds {n} profile(s) stored since" if n else None

    def _kept_in_use(self, busy: DaemonBusy) -> None:
        """Say the new database is kept because another process holds its lock. Not the lock's own refusal: its
        advice ("stop it first, or serve another database") is for a start, not for a clean-up that keeps a file."""
        log.warning("keeping the new database %s this refused start created: another process has it open (%s); "
                    "nothing to do", self.db, busy.holder or holder_words(None))

    def _remove_files(self) -> list[Path] | None:
        """Under the database's and run locks: remove the files this start created while the database is still the
        file it created and holds no profiles. None: kept (said why); else the files it could not remove (warned)."""
        try:
            st = os.lstat(self.db)
        except OSError as e:  # gone or unreadable since: nothing of ours to remove; the refusal goes on
            log.warning("not removing %s: it cannot be looked at (%s)", self.db, e.strerror or e)
            return None
        if (st.st_dev, st.st_ino) != self.ident:
            log.warning("not removing %s: replaced since this start created it", self.db)
            return None
        # the locks were free between start()'s release and here: what another process stored is kept
        if (why := self._stored_since()) is not None:
            log.warning("not removing the new database %s this refused start created: %s", self.db, why)
            return None
        left = []
        for p in self.absent:
            if p == self.lock:
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:  # EACCES, EBUSY, EROFS: said here; raised, it replaced the start's refusal
                left.append(p)
                log.warning("could not remove %s (made by this refused start): %s", p, e.strerror or e)
        return left

    def remove(self) -> None:
        """Remove what this start created, its store closed and its locks released. The database's locks are taken
        again first: a daemon, migration or bring-up that opened the new file since keeps it (never waited for), and
        so does one that stored profiles in it while no lock was held (`_stored_since`)."""
        from moetune.tuner.store.lock_files import release_lock_file

        if not self.creates or self.ident is None:
            return
        left: list[Path] | None = None  # `_remove_files`' answer
        try:
            fd = lock_database(self.db_path)
        except DaemonBusy as e:  # someone else has it now: theirs to use, nothing for the operator to do
            self._kept_in_use(e)
            return
        except DaemonConfigError as e:  # unusable: leave it as it is
            log.warning("not removing the new database %s this refused start created: %s", self.db, e)
            return
        try:
            try:
                run_fd = lock_runs(self.db_path)
            except DaemonBusy as e:  # a bring-up holds the run lock: it has the file open
                self._kept_in_use(e)
                return
            except (DaemonConfigError, RuntimeError) as e:  # a StoreError
                log.warning("not removing the new database %s this refused start created: %s", self.db, e)
                return
            try:
                left = self._remove_files()
            finally:
                if run_fd is not None:
                    release_run_lock(self.db_path, run_fd)  # removes the run lock file, as every run's release does
        finally:
            if self.lock in self.absent:
                release_lock_file(self.lock, fd)  # made by this start: removed while it is still the one fd holds
            else:
                os.close(fd)
        if left is None or left:  # kept, or a file it could not remove: the folder stays, no "removed" is said
            return
        if not self.folder_existed:  # the store made moetune's own data folder: removed only where nothing is in it
            with contextlib.suppress(OSError):
                self.db.parent.rmdir()
        log.info("removed the new database this refused start created", extra={"db": str(self.db)})


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
    curve_clients_dir: Path | None = None,
    create_db: bool = True,
) -> int:
    """Build a Daemon from config + options and serve until SIGTERM/SIGINT. Returns the exit code: 143 after
    SIGTERM, 130 after SIGINT (Ctrl-C), 0 after stop(). `create_db=False` (`serve --db` without --create): a
    database file that does not exist is refused (DaemonConfigError), after the configuration was checked."""
    cfg = _load_config(config, measuring=True)  # ConfigError (a ValueError) names the key and the file
    d = cfg.daemon
    if rediscover_interval is not None:
        check_rediscover_interval(rediscover_interval, "--rediscover-interval")
    else:
        check_rediscover_interval(d.rediscover_interval_s,
                                  f"daemon.rediscover_interval_s in {cfg.origin_of('daemon', 'rediscover_interval_s')}")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise DaemonConfigError(f"--metrics-port must be in 0..65535, got {metrics_port}")
    metrics_option = ("--metrics-port" if metrics_port is not None else
                      f"daemon.metrics_port (in {cfg.origin_of('daemon', 'metrics_port')})")
    setup_logging(log_level or d.log_level)
    endpoint = socket or d.socket
    # --socket alone: its PUB beside it (the rule load_config applies to a socket set without pub_socket)
    pub = pub_socket or (derive_pub_endpoint(endpoint) if socket or not d.pub_socket else d.pub_socket)
    # here, before the database is opened (and created): the Daemon's own check came after `created moetune's tables`.
    # Named as the user set them; a socket left to its default (too long under a deep $MOETUNE_HOME) gets the hint
    check_endpoint(endpoint, "--socket" if socket else f"daemon.socket ({cfg.origin_of('daemon', 'socket')})")
    check_endpoint(pub, "--pub-socket" if pub_socket else
                   "--pub-socket (default: events.sock beside --socket)" if socket else f"daemon.pub_socket ({cfg.origin_of('daemon', 'pub_socket')})")
    db_path = db or cfg.store.db
    db_lock: int | None = None
    run_lock: int | None = None
    where = Path(db_path).expanduser()
    store: Any = None
    # what a start refused before it serves removes again (a new database only: never a file that was there); its
    # lock file is looked at here, before this start makes it, the database's files under the lock (`looked`)
    new_db = _NewDatabase(db_path) if not store_hook and create_db else None
    if not store_hook and not create_db and not where.exists() and where.parent.is_dir():
        # every other reader refuses a missing database; a daemon on a mistyped path served a new empty one, answering
        # not_found to every client (a --db in a missing folder: the store names the folder). Checked after the
        # configuration and the endpoints, before any lock file is made beside it
        raise DaemonConfigError(f"no database at {where}: `serve --db` serves an existing database; check the path, "
                                "or pass --create to start serving a new empty one there")
    if not store_hook:
        # the database's lock before the store opens (and may migrate) it: a `db upgrade/downgrade` running now holds
        # it, and an open that migrated under it would undo the downgrade. Where the folder does not exist yet (the
        # store makes moetune's own), the daemon takes the lock at start as before: nothing to migrate there
        db_lock = lock_database(where) if where.parent.is_dir() else None
    try:  # the locks taken here are not left open behind a store or a configuration refused here
        if db_lock is not None:  # and the run lock: a bring-up running on it is refused before the store opens
            run_lock = lock_runs(where)
        if store_hook:
            store = _load_hook(store_hook)(db_path)
        else:
            from moetune.tuner.store.store import Store

            if new_db is not None:  # under the locks taken above: a file there now is not this start's
                new_db.looked()
            # makes moetune's own data folder only: a configured one must exist; intact: a damaged file is refused (a
            # StoreDamaged: `moetune serve` says it, exit 2) before the daemon serves or re-tunes into it
            store = Store(db_path, intact=True)
            if new_db is not None:
                new_db.opened()
            up = store.upgraded  # what the open migrated (a `db downgrade` is undone here: say so)
            if up is not None and up.from_revision is not None:
                log.info("database migrated", extra={"db": str(store.path), "from_revision": up.from_revision,
                                                     "to_revision": up.to_revision})
            elif up is not None:
                log.info("created moetune's tables", extra={"db": str(store.path), "to_revision": up.to_revision})
        if discover_hook:
            hook = _load_hook(discover_hook)
            discover = lambda: hook(capture)  # noqa: E731
        else:
            discover = make_discover(capture)
        retune = _load_hook(retune_hook) if retune_hook else None
        daemon = Daemon(
            store=store, endpoint=endpoint, pub_endpoint=pub, discover=discover, retune_job=retune,
            fabric_origin="local" if capture is None else "capture",
            tune=TuneSettings(backend=cfg.tune.backend, trials=cfg.tune.trials, timeout_s=cfg.tune.timeout_s,
                              run_on_busy_gpus=cfg.tune.run_on_busy_gpus),
            rediscover_interval_s=d.rediscover_interval_s if rediscover_interval is None else rediscover_interval,
            max_request_bytes=d.max_request_bytes, curve_secret_key_file=d.curve_secret_key_file or None,
            curve_clients_dir=curve_clients_dir, curve_admins_dir=d.curve_admins_dir or None,
            allow_insecure_tcp=d.allow_insecure_tcp if allow_insecure_tcp is None else allow_insecure_tcp,
            group=d.group, group_may_retune=d.group_may_retune, metrics_port=d.metrics_port if metrics_port is None else metrics_port,
            metrics_option=metrics_option,
            db_path=str(getattr(store, "path", db_path)),  # as the store opened it (~ expanded): its lock goes beside it
            db_lock_fd=db_lock,
            run_lock_fd=run_lock,
        )
    except BaseException:
        if store is not None and not store_hook:
            store.close()
        if run_lock is not None:
            release_run_lock(where, run_lock)
        if db_lock is not None:
            os.close(db_lock)
        if new_db is not None and store is not None:
            new_db.remove()
        raise
    daemon.install_signal_handlers()
    served = False
    try:
        daemon.start()
        served = True
        daemon.serve_forever()
    finally:
        if not served:  # a refusal before start()'s own clean-up (transport security, its locks): close it here
            daemon._close()  # (a no-op where start() closed it)
        # the last connection closed checkpoints the WAL into the file and removes -wal and -shm: left open, they
        # stayed beside the database, and a copy of the file alone lacked what the WAL held
        if not store_hook:  # a hook's store is the hook's to close
            if busy := daemon.store_users():
                # closed under them, a worker's next write opened a fresh connection that the exiting process never
                # closed (the close checkpointed nothing); left open, their transactions end with the process
                log.warning("leaving the store open: %s still running past the stop's wait; %s-wal and -shm stay "
                            "beside it until the next open", ", ".join(busy), store.path)
            else:
                store.close()
                # refused before it served (a bind, a key file): start() released its locks; the new database goes
                if not served and new_db is not None:
                    new_db.remove()
    # the CLI's documented statuses: 130 for Ctrl-C, 143 for SIGTERM (128 + the signal, as the shell reports a
    # killed process); the systemd unit lists both in SuccessExitStatus, so a stop is no failure there
    return 128 + daemon.stopped_by if daemon.stopped_by is not None else 0


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
    ap.add_argument("--curve-clients-dir", type=Path)
    # test/plugin hooks: module:callable
    ap.add_argument("--store-hook", help=argparse.SUPPRESS)
    ap.add_argument("--discover-hook", help=argparse.SUPPRESS)
    ap.add_argument("--retune-hook", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        return run_daemon(socket=a.socket, pub_socket=a.pub_socket, db=a.db, config=a.config, metrics_port=a.metrics_port,
                          rediscover_interval=a.rediscover_interval, capture=a.capture, allow_insecure_tcp=a.allow_insecure_tcp,
                          store_hook=a.store_hook, discover_hook=a.discover_hook, retune_hook=a.retune_hook, log_level=a.log_level,
                          curve_clients_dir=a.curve_clients_dir)
    # config, key files, bind; RuntimeError: a StoreError (not a database, unknown revision, cannot open)
    except (DaemonConfigError, ValueError, OverflowError, OSError, zmq.ZMQError, RuntimeError) as e:
        print(f"moetune serve: {e}", file=sys.stderr)
        # as `moetune serve`: 1 for DaemonBusy (another daemon has the database) and a store held or not writable
        return getattr(e, "exit_code", 2)


if __name__ == "__main__":
    sys.exit(main())
