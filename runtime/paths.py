"""Where moetune keeps its files: the database, the config files, the daemon's sockets.

Every function takes the environment as a mapping (default `os.environ`) so tests can pass their own.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SYSTEM_CONFIG = Path("/etc/moetune/moetune.toml")  # the node's file where $MOETUNE_SYSTEM_CONFIG is unset
DB_NAME = "moetune.db"
# The folder of the last fallback runtime dir, moetune-<uid> (a test moves it: a real one may hold a daemon's
# leftover daemon.json, which the client's search takes)
TMP_DIR = Path("/tmp")


def _home(env: Mapping[str, str]) -> Path:
    home = env.get("HOME")
    return Path(home) if home else Path.home()


NAME_MAX_BYTES = 255  # one name of a path (Linux file systems)
PATH_MAX_BYTES = 4095  # a whole path, less its NUL


def too_long_problem(path: str | Path) -> str | None:
    """Why the file system cannot name `path` (a name over 255 bytes, or the whole over 4095), else None: every look
    at such a path (exists, is_dir, open) raises "File name too long". Read from the text alone."""
    raw = os.fsencode(path)
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest > NAME_MAX_BYTES:
        return f"a name in it is {longest} bytes, longer than the file system allows ({NAME_MAX_BYTES})"
    if len(raw) > PATH_MAX_BYTES:
        return f"it is {len(raw)} bytes, longer than the file system allows ({PATH_MAX_BYTES})"
    return None


def moetune_home(env: Mapping[str, str] = os.environ) -> Path | None:
    """`$MOETUNE_HOME` (expanded, made absolute against the current directory) when set and non-empty, else None.
    Absolute: a relative one made the socket `ipc://relhome/run/daemon.sock`, which every daemon command refused
    as no ipc:///absolute/path (after `serve` had made relhome/moetune.db)."""
    value = env.get("MOETUNE_HOME", "")
    return Path(value).expanduser().absolute() if value else None


def data_dir(env: Mapping[str, str] = os.environ) -> Path:
    """`$MOETUNE_HOME`, else `$XDG_DATA_HOME/moetune`, else `~/.local/share/moetune`."""
    home = moetune_home(env)
    if home is not None:
        return home
    xdg = env.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else _home(env) / ".local" / "share"
    return base / "moetune"


def default_db_path(env: Mapping[str, str] = os.environ) -> Path:
    """The database when neither `--db` nor the config's `[store] db` names one."""
    return data_dir(env) / DB_NAME


def system_config_path(env: Mapping[str, str] = os.environ) -> Path:
    """`$MOETUNE_SYSTEM_CONFIG` (expanded) when set and non-empty, else `/etc/moetune/moetune.toml`. A path where no
    file is means no system file: the one way a process and the processes it starts skip the node's file (a test
    suite's CLI children, which no monkeypatch of `SYSTEM_CONFIG` reaches). Empty is unset, as for MOETUNE_CONFIG."""
    value = env.get("MOETUNE_SYSTEM_CONFIG", "")
    return Path(value).expanduser() if value else SYSTEM_CONFIG


def user_config_path(env: Mapping[str, str] = os.environ) -> Path:
    """`$XDG_CONFIG_HOME/moetune/moetune.toml`, else `~/.config/moetune/moetune.toml`."""
    xdg = env.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else _home(env) / ".config"
    return base / "moetune" / "moetune.toml"


def runtime_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Directory for the daemon's IPC sockets: `$MOETUNE_HOME/run`, `$XDG_RUNTIME_DIR/moetune`,
    else `/tmp/moetune-<uid>`."""
    home = moetune_home(env)
    if home is not None:
        return home / "run"
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "moetune"
    return TMP_DIR / f"moetune-{os.getuid()}"


# -- the daemon's runtime directory, as the runtime client finds it ---------------------------------
SOCKET_NAME = "daemon.sock"
PUB_SOCKET_NAME = "events.sock"
INFO_NAME = "daemon.json"
SYSTEM_RUNTIME_DIR = Path("/run/moetune")


def runtime_dir_candidates(env: Mapping[str, str] = os.environ) -> list[Path]:
    """Where a client looks for a daemon: `runtime_dir(env)` first (the daemon's own default), then the
    system service's `/run/moetune`, then `/tmp/moetune-<uid>`, without duplicates."""
    out: list[Path] = []
    xdg = env.get("XDG_RUNTIME_DIR", "")
    for d in (
        runtime_dir(env),
        Path(xdg) / "moetune" if xdg and Path(xdg).is_absolute() else None,
        SYSTEM_RUNTIME_DIR,
        TMP_DIR / f"moetune-{os.getuid()}",
    ):
        if d is not None and d not in out:
            out.append(d)
    return out


def ipc_path(endpoint: str) -> Path | None:
    """The filesystem path of an `ipc://` endpoint as written (None for tcp:// and others)."""
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def ipc_socket_file(endpoint: str) -> Path | None:
    """The file an `ipc://` endpoint names, its folder resolved as the kernel resolves it (os.path.realpath: a `..`
    after a linked folder goes up from where the link led; os.path.abspath and tempfile went up lexically, so the
    daemon wrote its records in another folder, or failed with a raw errno). The one rule of the daemon (its socket,
    lock, owner records and daemon.json beside it) and of the client's comparisons. None for other endpoints; a
    relative path is returned as written (endpoint_problem refuses it)."""
    p = ipc_path(endpoint)
    if p is None or not p.is_absolute():
        return p
    return Path(os.path.realpath(p.parent)) / p.name


def tcp_host(endpoint: str) -> str:
    """The host of a `tcp://HOST:PORT` endpoint, lower-cased and without IPv6 brackets."""
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.lower()


def tcp_port(endpoint: str) -> int | None:
    """The port of a `tcp://HOST:PORT` endpoint, or None where there is no host or no port in 1..65535."""
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    # ASCII digits only: isdigit alone takes "²", which int() refuses; at most 5 past leading zeros: int() raises
    # ValueError past 4300 digits (a hello reply's PUB port, a configured socket), and no port has more than 5
    value = int(port) if port.isascii() and port.isdigit() and len(port.lstrip("0")) <= 5 else None
    return value if host and value is not None and 1 <= value <= 65535 else None


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 (also IPv4-mapped) or localhost: the only hosts plain-text TCP is allowed on (the daemon's
    binds, the client's connects)."""
    if host == "localhost":
        return True
    import ipaddress

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name or an interface (eth0, *): may reach beyond this host
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")
MAX_IPC_PATH_BYTES = 107  # sockaddr_un's sun_path, less its NUL


def tcp_host_problem(endpoint: str) -> str | None:
    """What is wrong with the HOST:PORT shape of a tcp:// endpoint (None: nothing; the port's range is `tcp_port`'s).
    ZeroMQ takes almost any text at connect time and fails later, or never ("tcp://[::1" waited out the time-out): a
    host is a name, an IPv4 address or an interface (letters, digits, '.', '-', '_'), '*' (every interface, to
    bind), or an IPv6 address in brackets, with an optional %zone."""
    addr = endpoint[len("tcp://"):]
    if addr.startswith("["):
        close = addr.find("]")
        if close < 0:
            return "no ']' closing the IPv6 address (an IPv6 host is written [ADDRESS])"
        host, rest = addr[: close + 1], addr[close + 1:]
        if not rest.startswith(":"):
            return f"expected ':PORT' right after {host!r}"
        import ipaddress

        try:
            ipaddress.IPv6Address(host[1:-1].partition("%")[0])
        except ValueError:
            return f"{host[1:-1]!r} in brackets is not an IPv6 address"
        return None
    host, colon, _port = addr.rpartition(":")
    if not colon:
        return "no ':PORT'"
    if not host:
        return "no host before the port"
    if ":" in host or "[" in host or "]" in host:
        return f"the host {host!r} is not valid: an IPv6 address goes in brackets, tcp://[::1]:PORT"
    if host != "*" and not set(host) <= _HOST_CHARS:
        return f"the host {host!r} is not a host name, an IPv4 address or an interface"
    return None


def endpoint_problem(endpoint: str, *, bind: bool) -> str | None:
    """Why `endpoint` cannot be used (None: it can): the one rule of the daemon's binds (`bind`: the socket and the PUB,
    `moetune serve`, the CLI's --socket) and of a client's connects (the runtime's client, its SUB, the config's
    client.socket). ZeroMQ answers the rest with a bare "Invalid argument" (tcp://node1, tcp://node1:notaport) or "File
    name too long", or takes it and waits out every time-out (tcp://:5555). A daemon may bind tcp://*:PORT (every
    interface) and inproc:// (tests); a client connects to neither."""
    try:
        endpoint.encode()
    except UnicodeEncodeError:  # undecodable bytes of argv or the environment (a Latin-1 folder name): pyzmq
        return "not UTF-8 (ZeroMQ takes an endpoint as UTF-8 text)"  # encodes it as UTF-8, and so did the length check
    if endpoint.startswith("ipc://"):
        p = ipc_path(endpoint)
        if p is None or not str(p) or not p.is_absolute():
            return "expected ipc:///absolute/path"
        if p.name in ("", ".."):  # "/" or ".../..": a folder, never a socket file (ipc_socket_file takes the name as is)
            return f"expected ipc:///absolute/path naming a socket file, not the folder {p}"
        if len(str(p).encode()) > MAX_IPC_PATH_BYTES:
            return f"a unix socket path is at most {MAX_IPC_PATH_BYTES} bytes, this one is {len(str(p).encode())}"
        return None
    if endpoint.startswith("tcp://"):
        why = tcp_host_problem(endpoint)
        if why is not None:
            return f"{why} (expected tcp://HOST:PORT)"
        if tcp_port(endpoint) is None:
            return "expected tcp://HOST:PORT with a port in 1..65535"
        if not bind and tcp_host(endpoint) == "*":
            return "'*' (every interface) is where a daemon binds; a client connects to the daemon's host"
        return None
    if bind and endpoint.startswith("inproc://"):
        return None
    return "not an ipc:///absolute/path or tcp://HOST:PORT endpoint"


def foreign_link_reason(d: Path, link: os.stat_result, uid: int) -> str | None:
    """Why `d` (lstat-ed as `link`) is refused as a symbolic link of another user (None: not a link, or this user's or
    root's): os.stat follows it, so its target's owner and mode said nothing of who can repoint it. The one rule of
    the runtime directory's trust and of `write_atomic`'s writes through a link (fs.protected_symlinks' point: in a
    shared folder such as /tmp, another user's link must not aim this user's write at their files)."""
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        return (f"{d} is a symbolic link owned by uid {link.st_uid}, not by this user (uid {uid}) or root: its owner "
                "can point it anywhere")
    return None


MAX_LINK_HOPS = 40  # Linux's limit of links followed in one path lookup (ELOOP past it)


def foreign_sticky_link_reason(p: str | Path, uid: int | None = None) -> str | None:
    """Why the path `p` is refused for a symbolic link in it (any component, the last included, and any in what the
    links lead to) that sits in a sticky, world-writable folder (such as /tmp) and is owned by neither this user
    (`uid`, default os.getuid()) nor root; None where there is none. The sticky bit keeps others from replacing this
    user's files there, not from making their own link first: `/tmp/moetune.db -> ~/x.db`, made by another user,
    points this user's database wherever its owner likes, and Linux's fs.protected_symlinks refuses to follow it only
    where that setting is on (and never for a path resolved by hand, as realpath does). Walked as the kernel resolves
    a path (a `..` after a link goes up from where the link led); a component that is not there ends the walk (the
    caller's open says what is missing)."""
    uid = os.getuid() if uid is None else uid
    raw = os.fspath(p)
    if not os.path.isabs(raw):
        raw = os.path.join(os.getcwd(), raw)
    todo = [x for x in reversed(raw.split("/")) if x not in ("", ".")]  # popped from the end: the next component
    cur, hops = "/", 0
    while todo:
        name = todo.pop()
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except OSError:  # absent, or a folder this user may not search: nothing further to judge here
            return None
        if not stat.S_ISLNK(st.st_mode):
            cur = nxt
            continue
        hops += 1
        try:
            folder, target = os.stat(cur), os.readlink(nxt)
        except OSError:
            return None
        if folder.st_mode & stat.S_ISVTX and folder.st_mode & 0o002 and st.st_uid not in (uid, 0):
            return (f"{nxt} is a symbolic link owned by uid {st.st_uid}, not by this user (uid {uid}) or root, in "
                    f"{cur}, a sticky folder anyone can write: its owner can point it anywhere")
        if hops > MAX_LINK_HOPS:  # a loop: the open fails with ELOOP and says so
            return None
        if target.startswith("/"):
            cur = "/"
        todo.extend(x for x in reversed(target.split("/")) if x not in ("", "."))
    return None


def untrusted_dir_reason(d: Path) -> str | None:
    """Why the runtime must not trust sockets or `daemon.json` in directory `d` (None when it may).

    Trusted: not group- or world-writable, and owned by the current user or root, or created where only
    root can create (a parent owned by root and writable by nobody else: systemd's `RuntimeDirectory=`
    under /run hands `/run/moetune` to the service user). A `/tmp/moetune-<uid>` made by another user
    (/tmp is world-writable) is refused, and so is a symbolic link there that is not this user's or root's: its
    owner can point it at another directory at any time (the checks below are of the directory it leads to, and
    where that directory is).
    """
    try:
        link = os.lstat(d)
        st = os.stat(d)
        parent = os.stat(Path(os.path.realpath(d)).parent)  # where the directory is, not where a link to it is
    except OSError as e:
        return f"cannot stat {d}: {e.strerror or e}"
    uid = os.getuid()
    why = foreign_link_reason(d, link, uid)
    if why is not None:
        return why
    if not stat.S_ISDIR(st.st_mode):
        return f"{d} is not a directory"
    if st.st_mode & 0o022:
        return f"{d} is group- or world-writable (mode {st.st_mode & 0o777:o})"
    if st.st_uid in (uid, 0):
        return None
    if parent.st_uid == 0 and not parent.st_mode & 0o022:
        return None
    return f"{d} is owned by uid {st.st_uid}, not by this user (uid {uid}) or root, in a directory others can write"


def untrusted_file_reason(f: Path) -> str | None:
    """Why the runtime must not believe what the file `f` says (None when it may, or when there is no file there: its
    reader says that). For the client's fallback database: a file other users can write could feed it profiles.

    The socket folder's rule (`untrusted_dir_reason`), reused: the folder `f` is in (as given, and the one its links
    lead into) must be one the runtime trusts a socket in, or (as `untrusted_socket_reason` allows a socket) a sticky
    folder of this user or root, such as /tmp, with `f` this user's or root's. The file itself: not writable by group
    or others, and owned by this user, root or its trusted folder's owner (a service's database, 0640 in its state
    directory, read by its group's members). SQLite's side files beside it (-wal, -shm, -journal: read as part of the
    database) are judged as the file is: in a sticky folder another user may make them while the file is safe. A
    path through another user's link in a sticky, world-writable folder is refused (`foreign_sticky_link_reason`):
    the file it leads to says nothing of who chose it."""
    if (why := foreign_sticky_link_reason(f)) is not None:
        return why
    real = Path(os.path.realpath(f))
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot stat {f}: {e.strerror or e}"
    files: list[tuple[Path, os.stat_result]] = [(f, st)]
    for suffix in ("-wal", "-shm", "-journal"):
        side = real.with_name(real.name + suffix)
        try:
            files.append((side, os.stat(side)))
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"cannot stat {side}: {e.strerror or e}"
    uid = os.getuid()
    for name, fst in files:
        if fst.st_mode & 0o022:
            return (f"{name} is group- or world-writable (mode {stat.S_IMODE(fst.st_mode):o}): other users could "
                    "change it")
    for d in dict.fromkeys((Path(os.path.abspath(f)).parent, real.parent)):
        why = untrusted_dir_reason(d)
        if why is None:
            owner = os.stat(d).st_uid
            for name, fst in files:
                if fst.st_uid not in (uid, 0, owner):
                    return (f"{name} is owned by uid {fst.st_uid}, not by this user (uid {uid}), root or its folder's "
                            f"owner (uid {owner}): its owner could change it")
            continue
        try:
            link, dst = os.lstat(d), os.stat(d)
        except OSError as e:
            return f"cannot stat {d}: {e.strerror or e}"
        if (foreign_link_reason(d, link, uid) is None and dst.st_mode & stat.S_ISVTX and dst.st_uid in (uid, 0)
                and st.st_uid in (uid, 0)):
            for name, fst in files[1:]:  # a sticky folder: only this user's or root's files are theirs alone
                if fst.st_uid not in (uid, 0):
                    return (f"{name} is owned by uid {fst.st_uid}, not by this user (uid {uid}) or root, in {d}, "
                            "a folder others can write: its owner could change it")
            continue
        return f"{why}: other users could replace {f}"
    return None


@dataclass(frozen=True)
class LooseKeyPath:
    """Why key material (a CURVE key file or a folder of keys) is not safe: its mode and owner, whether the owner is
    another user (neither this process's effective user nor root: that user could change it) and which of the
    forbidden group/other bits it has (0: none)."""

    mode: int
    uid: int
    foreign_owner: bool
    loose_bits: int


def loose_key_path(p: Path | str, *, forbid: int, sticky_ok: bool = False,
                   st: os.stat_result | None = None) -> LooseKeyPath | None:
    """The one rule for key material, the daemon's refusal and the client's warning alike: None when `p` is owned by
    this process's effective user or root and has none of the mode bits `forbid` (a sticky folder such as /tmp passes
    with `sticky_ok`: only a file's owner may replace the file there). Follows a link: the target's mode and owner
    are what matter. `st`: the stat of the file as it was opened and read (judged instead of what is at `p` now).
    Raises OSError when `p` cannot be stat-ed."""
    if st is None:
        st = os.stat(p)
    mode = stat.S_IMODE(st.st_mode)
    foreign = st.st_uid not in (os.geteuid(), 0)
    bad = 0 if sticky_ok and st.st_mode & stat.S_ISVTX else mode & forbid
    return LooseKeyPath(mode, st.st_uid, foreign, bad) if foreign or bad else None


def secret_key_checks(secret_file: Path | str) -> list[tuple[Path, int]]:
    """What a CURVE secret key's safety rests on, as (path, forbidden mode bits) for `loose_key_path`: the file
    (nobody else may read or change it) and its folder, the one a link points into included (nobody else may
    replace the file there). The daemon refuses its own key on any of them; a client warns about its own."""
    p = Path(secret_file)
    return [(p, 0o066), *((d, 0o022) for d in dict.fromkeys((p.parent, p.resolve().parent)))]


def untrusted_socket_reason(sock: Path) -> str | None:
    """Why the runtime must not connect to the IPC socket `sock` (None when it may).

    A socket in a trusted directory (`untrusted_dir_reason`) is trusted. In a sticky world-writable
    directory owned by this user or root, such as /tmp, a socket that is a real socket (not a link) owned by this
    user or root is trusted too: the sticky bit keeps anyone else from removing or replacing it, except the
    directory's owner (a `/tmp/moetune-<uid>` made sticky by another user is theirs to empty).
    """
    why = untrusted_dir_reason(sock.parent)
    if why is None:
        return None
    try:
        link, d, s = os.lstat(sock.parent), os.stat(sock.parent), os.lstat(sock)
    except OSError as e:
        return f"cannot stat {sock}: {e.strerror or e}"
    mine = (os.getuid(), 0)
    if foreign_link_reason(sock.parent, link, os.getuid()) is not None:
        return why  # another user's link to a sticky folder: the sticky bit is no protection of the link
    if d.st_mode & stat.S_ISVTX and d.st_uid in mine and stat.S_ISSOCK(s.st_mode) and s.st_uid in mine:
        return None
    return why


def find_daemon_socket(env: Mapping[str, str] = os.environ) -> str:
    """Where a client finds the daemon when no socket is configured (the config's client.socket default and
    `default_endpoint`'s: one rule). `moetune serve` with no socket configured binds in `runtime_dir` of its own
    environment, which may not be the client's (started without MOETUNE_HOME, with XDG_RUNTIME_DIR, ...): the first
    candidate runtime directory holding `daemon.sock`, else the first holding `daemon.json` (a stopped daemon's,
    which names its database), else `runtime_dir(env)` (where this environment's daemon binds). The client reads
    `daemon.json` only beside the socket it uses, so the two never name different daemons."""
    cands = runtime_dir_candidates(env)
    for name in (SOCKET_NAME, INFO_NAME):
        for d in cands:
            try:
                os.stat(d / name)
            except OSError:  # absent, or a directory this user may not enter
                continue
            return f"ipc://{d / SOCKET_NAME}"
    return f"ipc://{cands[0] / SOCKET_NAME}"


def default_endpoint(env: Mapping[str, str] = os.environ) -> str:
    """The daemon endpoint a client uses when the config cannot be read: `MOETUNE_CLIENT_SOCKET`, else
    `MOETUNE_DAEMON_SOCKET`, else `find_daemon_socket` (what the config's client.socket defaults to)."""
    for var in ("MOETUNE_CLIENT_SOCKET", "MOETUNE_DAEMON_SOCKET"):
        if env.get(var):
            return env[var]
    return find_daemon_socket(env)


def client_db_path(info_db: str | None = None, env: Mapping[str, str] = os.environ,
                   configured: str | Path | None = None) -> Path:
    """The database the runtime reads when the daemon is down: `MOETUNE_STORE_DB`, else the config's `[store] db`
    where a config file sets it (`configured`: None or "" when it is the default: left unset, or set empty), else the one the daemon named in
    `daemon.json`, else `default_db_path(env)`. What the user configured outranks the file a daemon left behind:
    a stopped daemon's `daemon.json` redirected a job whose config names another database."""
    if env.get("MOETUNE_STORE_DB"):  # exported but empty: unset (the default), as the config reads it
        return Path(env["MOETUNE_STORE_DB"]).expanduser()
    if configured:
        return Path(configured).expanduser()
    if info_db:
        return Path(info_db)
    return default_db_path(env)


def sync_folder(folder: Path) -> None:
    """fsync `folder`: a file created or renamed in it keeps its name after a power loss once the folder is synced.
    Best effort: a folder the file system cannot open or fsync is left as it is (the callers' data is written)."""
    with contextlib.suppress(OSError):
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
