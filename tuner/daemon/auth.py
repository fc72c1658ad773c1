"""Who may talk to the daemon: its CURVE keys, the client allow-list and admin list, and the peers' credentials.

`tcp://` needs CURVE keys (unless `allow_insecure_tcp`, loopback addresses only); clients are then authenticated by
pyzmq's ZAP authenticator against the allow-list of client public keys as read and checked at start
(`CurveAllowList`). Key files and lists other local users could read (the secret key) or change are refused
(`check_key_path`), never chmod-ed. The administrative op (`retune`) is for admins: on IPC the daemon's own user or
root (the kernel's peer credentials, `peer_credentials`) and, with `group_may_retune`, members of `group`
(`user_in_group`); on TCP a CURVE client whose public key is also in the admin list (`load_admin_keys`).
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import shlex
import stat
from collections.abc import Callable
from pathlib import Path

import zmq

from moetune.runtime.paths import loose_key_path, secret_key_checks
from moetune.runtime.profiles.curve_keys import NoProcError, bad_curve_key, read_curve_key_file
from moetune.tuner.daemon.errors import DaemonConfigError

log = logging.getLogger("moetune.daemon")  # the server's logger: its warnings go to the daemon's log


def _mode_words(bits: int) -> tuple[str, str]:
    """("readable and writable", "rw") for the group/other bits in `bits`: the message and the chmod go-... fix."""
    r, w = bool(bits & 0o044), bool(bits & 0o022)
    return " and ".join(x for x, on in (("readable", r), ("writable", w)) if on), "r" * r + "w" * w


def check_key_path(p: Path, what: str, *, forbid: int, risk: str, sticky_ok: bool = False,
                   st: os.stat_result | None = None) -> None:
    """Refuse key material `p` (a key file or a directory of keys) that `moetune.runtime.paths.loose_key_path` finds
    loose: owned by a user other than this daemon's or root (its owner could change it), or with a mode bit of
    `forbid` (group/other read or write); a sticky directory (like /tmp) passes with `sticky_ok`. Never chmod-ed:
    the user fixes it (the daemon never changes what it did not create). `st`: the fstat of the file as opened to be
    read (`_certificate`), judged instead of what is at `p` now."""
    try:
        loose = loose_key_path(p, forbid=forbid, sticky_ok=sticky_ok, st=st)
    except OSError as e:
        raise DaemonConfigError(f"cannot check the {what} {p}: {e.strerror or e}") from None
    if loose is None:
        return
    if loose.foreign_owner:
        raise DaemonConfigError(f"the {what} {p} (mode {loose.mode:o}) is owned by uid {loose.uid}, not by this "
                                f"daemon's user (uid {os.geteuid()}) or root: that user could change it ({risk}); "
                                # what to do, as the mode refusal names its chmod: its content is the other user's
                                f"refusing to use it (e.g. chown {os.geteuid()} {p} as root, once its content is "
                                "checked)")
    words, fix = _mode_words(loose.loose_bits)
    raise DaemonConfigError(f"the {what} {p} (mode {loose.mode:o}, owner uid {loose.uid}) is {words} by group or "
                            f"others: {risk}; refusing to use it (e.g. chmod go-{fix} {p})")


def check_secret_key_file(secret_file: str | Path, st: os.stat_result | None = None) -> None:
    """The daemon's CURVE secret key (`moetune.runtime.paths.secret_key_checks`): nobody but its user (or root) may
    read or change it, nor replace it in its directory (the directory a link points into included). `st`: the key
    file as opened to be read (`load_curve_keys(check=True)`); its folders are judged by path."""
    for path, forbid in secret_key_checks(secret_file):
        if path == Path(secret_file):
            check_key_path(path, "CURVE secret key file", forbid=forbid, st=st,
                           risk="whoever can read it can impersonate the daemon, whoever can write it can replace its key")
        else:
            check_key_path(path, "directory of the CURVE secret key", forbid=forbid,
                           risk="others could replace the daemon's key (and its clients/ and admins/ lists)")


def _keys_in(data: bytes) -> tuple[bytes | None, bytes | None]:
    """(public, secret) of a CURVE certificate's text, read line for line as zmq.auth.load_certificate reads a file
    (`moetune keys` and the client read key files through it: `curve_keys.read_key_file_as_opened`): lines split at
    newlines, `#` lines skipped, a line starting `public-key` or `secret-key` sets that value (after its first `=`,
    blanks and quotes dropped), a later one replacing it until both are non-empty; None for one never set, and
    (None, None) where such a line has no `=` (zmq fails on it). One reading: a file of two `public-key` lines
    (hand-edited) must name the same key to the daemon as to `moetune keys allow` and the clients. Parsed here from
    the bytes read through the checked descriptor: zmq.auth reads only by name (/proc/self/fd/N, absent where /proc
    is not mounted, where the daemon still serves)."""
    public: bytes | None = None
    secret: bytes | None = None
    for raw in data.split(b"\n"):
        line = raw.strip()
        if line.startswith(b"#"):
            continue
        for name in (b"public-key", b"secret-key"):
            if line.startswith(name):
                if b"=" not in line:
                    return None, None
                value = line.split(b"=", 1)[1].strip(b" \t'\"")
                if name == b"public-key":
                    public = value
                else:
                    secret = value
        if public and secret:
            break
    return public, secret


def _certificate(path: Path, not_regular: str, what: str, *, missing_ok: bool,
                 judge: Callable[[os.stat_result | None], None] | None = None) -> tuple[bytes, bytes | None]:
    """zmq's (public, secret) of a key file, opened once and read from that descriptor: `judge` (the owner and mode
    checks, DaemonConfigError) gets its fstat, so the file judged is the file read (a path checked, then read again,
    could be another file by then). DaemonConfigError `not_regular` where it is not a regular file (O_NONBLOCK: a
    FIFO's open returns at once, where it waited for a writer and the start hung; `missing_ok`: a missing one is
    said as missing), "cannot read WHAT" where it cannot be read. A link is followed, as the key rules want (the
    folder a link leads into is judged by its callers); where the open fails, `judge` gets None and judges the path,
    so its "cannot check" refusals come first, as before."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        if judge is not None:
            judge(None)
        if isinstance(e, FileNotFoundError) and missing_ok:
            raise DaemonConfigError(f"cannot read {what}: it does not exist") from None
        if isinstance(e, FileNotFoundError) or e.errno == errno.ENXIO:  # a dangling link; a socket
            raise DaemonConfigError(not_regular) from None
        raise DaemonConfigError(f"cannot read {what}: {e}") from None
    try:
        st = os.fstat(fd)
        if judge is not None:
            judge(st)
        if not stat.S_ISREG(st.st_mode):
            raise DaemonConfigError(not_regular)
        chunks: list[bytes] = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError as e:
        raise DaemonConfigError(f"cannot read {what}: {e}") from None
    finally:
        os.close(fd)
    public, secret = _keys_in(b"".join(chunks))
    if public is None:  # zmq.auth's words for it
        raise DaemonConfigError(f"cannot read {what}: No public key found in {path}")
    # an allow-list entry that is no key lets nobody in without a word: said here, naming the file
    if (kind := bad_curve_key(public, secret)) is not None:
        raise DaemonConfigError(f"{what} holds a {kind} that is not a CURVE key (40 Z85 characters, as `moetune "
                                "keys` writes them): replace the file with one `moetune keys` wrote")
    return public, secret


def load_curve_keys(secret_file: str | Path, *, check: bool = False) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a `moetune keys generate` secret key file; with `check`, the file as opened
    and read is judged by `check_secret_key_file` (its owner and mode by fstat, its folders by path) first."""
    def judge(st: os.stat_result | None) -> None:
        check_secret_key_file(secret_file, st)

    public, secret = _certificate(
        Path(secret_file), f"the CURVE key file {secret_file} is not a regular file (a FIFO, a device or a directory): "
        "give the NAME.key_secret `moetune keys generate` wrote", f"the CURVE key file {secret_file}", missing_ok=True,
        judge=judge if check else None)
    if not secret:
        raise DaemonConfigError(f"{secret_file} holds no secret key")
    return public, secret


def check_public_beside(secret_file: str | Path, public: bytes) -> None:
    """Refuse a NAME.key beside the daemon's NAME.key_secret that holds another public key than the secret file:
    `moetune keys generate --force` renames the secret file, then the public one, into place, and a kill between left
    the old public key in NAME.key, the file its clients are given (each then refused by the CURVE handshake, with no
    word of why). No NAME.key there, or one that is no key file, is left alone (not a pair of `keys generate`'s); one
    that cannot be read here for want of /proc is warned of (not checked), never passed over silently."""
    sf = Path(secret_file)
    if sf.suffix != ".key_secret":
        return
    pf = sf.with_suffix(".key")
    # shell-quoted (as store._schema.db_option): a folder with a space must paste as one argument
    fix = f"moetune keys generate --force {shlex.quote(str(sf.parent))} --name {shlex.quote(sf.stem)}"
    try:
        theirs, _ = read_curve_key_file(pf)
    except NoProcError as e:
        # the daemon serves without /proc (it parses its own keys from the descriptor it checked), so a refusal here
        # would stop a daemon that works for want of a consistency check; it starts, but never silently
        log.warning("the public key file %s beside the daemon's secret key %s was not checked to hold the same "
                    "public key: it %s. Should it hold another key, clients given %s are refused by the CURVE "
                    "handshake; if in doubt, write a whole pair again with `%s` and give the clients the new %s",
                    pf, sf, e, pf.name, fix, pf.name)
        return
    except ValueError:
        return
    if theirs != public:
        raise DaemonConfigError(
            f"{pf} holds another public key than {sf} (a `moetune keys generate --force` cut short between writing "
            f"the two?): clients given {pf.name} would be refused; write a whole pair again with `{fix}` and give "
            f"the clients the new {pf.name}")


def default_clients_dir(secret_file: str | Path) -> Path:
    """Where the allow-list of client public keys lives by default: `clients/` beside the server key."""
    return Path(secret_file).parent / "clients"


def default_admins_dir(secret_file: str | Path) -> Path:
    """Where the CURVE clients allowed to re-tune are listed by default: `admins/` beside the server key."""
    return Path(secret_file).parent / "admins"


def load_admin_keys(directory: Path | None) -> frozenset[bytes]:
    """The admin public keys (z85) in `directory`; none when it does not exist (nobody re-tunes over TCP)."""
    if directory is None or not directory.exists():
        return frozenset()
    return frozenset(load_client_keys(directory, role="admin list"))


def peer_credentials(frame: zmq.Frame) -> tuple[int, int] | None:
    """(uid, gid) of the process at the other end of an IPC connection, as the kernel reported it when the
    connection was accepted (libzmq appends ":uid:gid:pid" from SO_PEERCRED to the Peer-Address); None when
    the frame carries no such credentials."""
    try:
        addr = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    parts = str(addr).rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None


def user_in_group(uid: int, gid: int, group_gid: int) -> bool:
    """Whether user `uid` (whose process runs with primary group `gid`) belongs to group `group_gid`."""
    import pwd

    if gid == group_gid:
        return True
    try:
        user = pwd.getpwuid(uid)
        members = grp.getgrgid(group_gid).gr_mem
    except KeyError:
        return False
    return user.pw_gid == group_gid or user.pw_name in members


class CurveAllowList:
    """The ZAP authenticator's credentials provider: a CURVE client gets in when its z85 public key is one of `keys`,
    the keys the daemon read and checked itself (load_client_keys). pyzmq's own `configure_curve(location=...)`
    re-read the folder through glob.glob, unescaped: a `[`, `*` or `?` in the path had it load the keys of another
    folder (`keys[1]/clients` read `keys1/clients`), which no check had seen."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def load_client_keys(directory: Path, role: str = "allow-list") -> list[bytes]:
    """The client public keys in `directory` (`*.key` files written by `moetune keys`)."""

    if not directory.is_dir():
        raise DaemonConfigError(f"the CURVE client {role} {directory} is not a directory: "
                                "run `moetune keys client KEYDIR NAME` to create it with a client key")
    # whoever may add a key here gets in (the admin list: may re-tune); group-readable is fine (public keys)
    risk = f"others could add their own key {'as an admin (who may re-tune)' if role == 'admin list' else 'and connect'}"
    for parent in dict.fromkeys((directory.parent, directory.resolve().parent)):  # the folder a link points into too
        check_key_path(parent, f"directory holding the CURVE client {role}", forbid=0o022, risk=risk, sticky_ok=True)
    check_key_path(directory, f"CURVE client {role} directory", forbid=0o022, risk=risk)
    keys = []
    for f in sorted(directory.glob("*.key")):
        def judge(st: os.stat_result | None, f: Path = f) -> None:  # the file as opened (`_certificate`)
            check_key_path(f, f"key file in the CURVE client {role}", forbid=0o022, risk=risk, st=st)
            # a key file linked into another folder: whoever may write there could replace the file the link names
            if (target := f.resolve().parent) != directory.resolve():
                check_key_path(target, f"directory a key file of the CURVE client {role} ({f.name}) links into",
                               forbid=0o022, risk=risk, sticky_ok=True)

        public, _ = _certificate(f, f"{f} in the CURVE client {role} is not a regular file (a FIFO, a device or a "
                                 "directory): remove it, or put a client's public key file there", f"the client key {f}",
                                 missing_ok=False, judge=judge)
        keys.append(public)
    return keys
