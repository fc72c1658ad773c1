"""The daemon's endpoints: the checks that give a clear error where ZeroMQ would give a cryptic one, and the PUB
endpoint beside the request socket."""

from __future__ import annotations

import os

from moetune.runtime.config import pub_socket_beside
from moetune.runtime.paths import endpoint_problem, ipc_path, tcp_port
from moetune.tuner.daemon.errors import DaemonConfigError


def same_endpoint(a: str, b: str) -> bool:
    """The two endpoints name one socket: IPC paths compared resolved (through a linked directory the two names are
    one file, and the PUB's bind found our own socket "in use"); parts that do not exist yet compare as written."""
    pa, pb = ipc_path(a), ipc_path(b)
    if pa is not None and pb is not None:
        return os.path.realpath(pa) == os.path.realpath(pb)
    return a == b


def _tcp_port(endpoint: str, what: str) -> int:
    port = tcp_port(endpoint)
    if port is None:
        raise DaemonConfigError(f"{what} {endpoint!r}: expected tcp://HOST:PORT with a port in 1..65535")
    return port


def long_socket_hint(endpoint: str, what: str) -> str:
    """What to do about a configured or default IPC socket too long for a unix socket ('' for any other endpoint, or
    one an option named: `what` starting with "--", which the user typed and can shorten): a deep $MOETUNE_HOME made
    every daemon command, and `serve`, refuse a socket the user never set. The one hint of `serve`, `query` and
    `status`."""
    from moetune.runtime.paths import MAX_IPC_PATH_BYTES, runtime_dir_candidates

    p = ipc_path(endpoint)
    if what.startswith("--") or p is None or len(str(p).encode()) <= MAX_IPC_PATH_BYTES:
        return ""
    shorter = "name a shorter socket with daemon.socket (MOETUNE_DAEMON_SOCKET) for the daemon and its clients alike"
    # only a socket in moetune's runtime folder is helped by a shorter MOETUNE_HOME: one a file or a variable set
    # elsewhere was told "it is the default under $MOETUNE_HOME/run", which it is not
    if p.parent in runtime_dir_candidates():
        return ("; it lies in moetune's runtime folder, $MOETUNE_HOME/run (or $XDG_RUNTIME_DIR/moetune), where the "
                f"default socket goes: use a shorter MOETUNE_HOME, or {shorter}")
    return f"; it is set in a config file or a variable, not moetune's default: {shorter}"


def check_endpoint(endpoint: str, what: str) -> None:
    """A clear error for an endpoint ZeroMQ would reject with a cryptic one (or accept by surprise): the bind rule of
    `paths.endpoint_problem`, naming `what` (the option or config key), with `long_socket_hint`."""
    why = endpoint_problem(endpoint, bind=True)
    if why is not None:
        raise DaemonConfigError(f"{what} {endpoint!r}: {why}{long_socket_hint(endpoint, what)}")


def derive_pub_endpoint(endpoint: str) -> str:
    """The PUB endpoint beside `endpoint`: the config's rule (pub_socket_beside), so that a socket set in a file
    and one given with --socket get the same PUB."""
    if endpoint.startswith("tcp://"):
        port = _tcp_port(endpoint, "socket")
        if port >= 65535:
            raise DaemonConfigError(f"the PUB port would be {port + 1} (socket port + 1), over 65535: "
                                    "set --pub-socket (or daemon.pub_socket)")
    pub = pub_socket_beside(endpoint)
    if not pub:
        raise DaemonConfigError(f"cannot derive a PUB endpoint from {endpoint!r}; set --pub-socket (or daemon.pub_socket)")
    return pub
