"""Reading the `daemon.json` a daemon keeps beside its IPC socket, and telling from it that the daemon is down.

The client reads it for the database fallback (`db`, and whether the daemon that named it still runs), the node's
preferred transport family and the daemon's epoch (whose file it is), and says "not running" rather than "no reply"
of a killed daemon's socket (`stale_daemon_reason`).
The file is read only from a runtime directory this user may trust (`paths.untrusted_dir_reason`) and only as a
regular file of at most MAX_INFO_BYTES (never a link or a FIFO).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetune.runtime._proc import pid_gone  # a zombie (killed, not reaped) is gone too
from moetune.runtime.paths import (
    INFO_NAME,
    MAX_IPC_PATH_BYTES,
    default_endpoint,
    ipc_path,
    ipc_socket_file,
    untrusted_dir_reason,
)

__all__ = ["MAX_INFO_BYTES", "daemon_info_down", "read_daemon_info", "stale_daemon_reason"]

log = logging.getLogger("moetune.client")  # the client's logger: the CLI filters its records by it


def read_daemon_info(endpoint: str | None = None, env: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The `daemon.json` the daemon at `endpoint` (default: `default_endpoint(env)`) keeps next to its IPC socket
    (None when absent, unreadable, in a directory this user may not trust, or for a tcp:// endpoint: only a daemon
    on an ipc:// socket writes one). Only that directory: another runtime directory's file is another daemon's
    (its database, its transports), although the client talks to this one. The path it was read from is under the
    key `_dir`."""
    p = ipc_path(endpoint if endpoint else default_endpoint(env))
    for d in [p.parent] if p is not None else []:
        f = d / INFO_NAME
        if not f.exists():
            continue
        why = untrusted_dir_reason(d)
        if why is not None:
            log.warning("moetune: ignoring %s: %s", f, why)
            continue
        data = _read_info_file(f)
        if isinstance(data, dict):
            data["_dir"] = str(d)
            return data
    return None


MAX_INFO_BYTES = 1 << 20  # a daemon's daemon.json is a few hundred bytes: a bigger file is not one it wrote


def _read_info_file(f: Path) -> Any:
    """The JSON in the daemon.json at `f`, as the daemon wrote it (a regular file, never a link, at most MAX_INFO_BYTES):
    else None. Opened O_NONBLOCK and read only when regular: a FIFO there blocked the open for ever (the resolution is
    bounded in time), and a file of any size was read whole."""
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, MAX_INFO_BYTES + 1)
        return json.loads(raw) if len(raw) <= MAX_INFO_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def daemon_info_down(info: dict[str, Any]) -> str | None:
    """Why the daemon a daemon.json describes is not running (None when it may be): `"running": false` (a clean
    exit leaves the file so), or this host's pid it names is gone (a kill). Another host's pid cannot be told."""
    if info.get("running") is not True:
        return "stopped: its daemon.json says \"running\": false"
    pid = _gone_pid(info)
    return None if pid is None else f"its pid {pid} is gone"


def _gone_pid(info: dict[str, Any]) -> int | None:
    """The pid a daemon.json names when it is this host's and gone, else None (another host's pid, or a daemon.json
    without a host (older moetune), cannot be told): the one check of `daemon_info_down` and `stale_daemon_reason`."""
    pid = info.get("pid")
    if type(pid) is int and pid > 0 and info.get("host") == socket.gethostname() and pid_gone(pid):
        return pid
    return None


def stale_daemon_reason(endpoint: str) -> str | None:
    """Why an IPC endpoint has no daemon behind it although its socket is there (None when nothing says so): the
    daemon.json next to the socket, in a directory this user may trust (`untrusted_dir_reason`), says a daemon of
    this host runs at this endpoint, its pid is gone, and the socket refuses connections (a daemon killed with -9
    leaves both behind). Anything less certain (another host's daemon.json, a pid alive or reused, a socket that
    accepts) is None: the caller says what it saw instead."""
    p = ipc_path(endpoint)
    if p is None or untrusted_dir_reason(p.parent) is not None:
        return None
    data = _read_info_file(p.parent / INFO_NAME)
    if not isinstance(data, dict) or data.get("running") is not True:
        return None
    named = data.get("endpoint")
    # compared resolved, the daemon's rule (`ipc_socket_file`): a/link/../d.sock and the path it leads to are one socket
    if not isinstance(named, str) or ipc_socket_file(named) != ipc_socket_file(endpoint):
        return None
    pid = _gone_pid(data)  # None: another host's, no host recorded, or alive (or reused)
    if pid is None:
        return None
    if probe_unix_socket(p) != "refused":  # something accepts there (a daemon started since), or not certain
        return None
    return f"the daemon is not running (pid {pid} is gone; stale socket at {p}): start it with `moetune serve`"


def probe_unix_socket(path: Path) -> str:
    """One connection attempt to the unix socket at `path`: "accepts" (something listens), "refused" (a socket file
    nothing listens on: what a killed daemon leaves) or "unknown" (absent, not ours to enter, a slow accept). A path
    longer than a socket address (MAX_IPC_PATH_BYTES) is reached through its folder opened O_PATH
    (/proc/self/fd/N/NAME, a short name of the same file): a daemon bound at a short ipc:// path through a linked
    folder whose resolved path is longer (`ipc_socket_file`) was read as dead. Without /proc, or with a NAME too long
    itself: "unknown"."""
    dir_fd: int | None = None
    target = os.fspath(path)
    if len(os.fsencode(target)) > MAX_IPC_PATH_BYTES:
        try:
            dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return "unknown"
        target = f"/proc/self/fd/{dir_fd}/{path.name}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.2)
    try:
        s.connect(target)
        return "accepts"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unknown"
    finally:
        s.close()
        if dir_fd is not None:
            os.close(dir_fd)
