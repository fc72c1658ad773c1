"""The runtime directory an IPC socket lives in, and the files the daemon keeps there as its own.

The daemon never deletes or chmods what it did not create. The directory is created 0700 (0750 with a configured
group) and marked as ours (RUNTIME_MARK); an existing directory is used as it is, provided nobody else can replace
our socket in it (`prepare_runtime_dir`, `check_socket_ancestors`). An existing file at the socket path is refused
unless it is a dead socket this daemon's owner record proves was ours (`check_socket_path`). Each socket the daemon
binds, and daemon.json beside it, gets an owner record (".<name>.moetune-owner": the file's device and inode), which
is what tells our files from anyone else's (a socket is bound under a name of its own, which the record names
before the bind, and linked to its path only once its record is written: `binding_name`; a socket a daemon killed
meanwhile left there is removed by the next start, `remove_dead_binding`): daemon.json is replaced only when it carries our mark and our owner
record names it (`foreign_info_reason`) and no other daemon at another endpoint, still running, wrote it
(`other_live_daemon`); a user's file there is left alone.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any

from moetune.runtime.paths import MAX_IPC_PATH_BYTES, foreign_sticky_link_reason, ipc_socket_file
from moetune.runtime.profiles.daemon_info import probe_unix_socket
from moetune.tuner.daemon.errors import DaemonBusy, DaemonConfigError

RUNTIME_MARK = ".moetune-runtime-dir"  # in a directory the daemon created: proof that it may tighten it
OWNER_SUFFIX = ".moetune-owner"  # ".<socket name>.moetune-owner": the (dev, inode) of a socket we bound
INFO_MARK = "moetune-daemon"  # daemon.json's "written_by": with its owner record, what tells ours from a user's file
# every key of a daemon.json written before the mark and its record were (a file of ours to replace after an upgrade)
_LEGACY_INFO_KEYS = frozenset({"endpoint", "pub_endpoint", "db", "epoch", "pid", "running", "updated", "fingerprint",
                               "software", "transports"})


def group_id(group: str) -> int | None:
    """The gid of `group` (daemon.group: a name or a number); None for no group."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        try:
            return grp.getgrgid(int(group)).gr_gid
        except (ValueError, KeyError):
            raise DaemonConfigError(f"unknown unix group {group!r} (daemon.group)") from None


def prepare_runtime_dir(d: Path, group: str = "") -> bool:
    """Make sure the directory of an IPC socket is safe to bind in. Returns True when we created it.

    A missing directory is created 0700 (0750 with `group`) and marked as ours, its missing ancestors 0700 (0711
    with `group`) whatever the process's umask; only a directory with
    our mark is ever chmod-ed or chown-ed again. An existing directory is used as it is (never chmod-ed),
    provided nobody else can replace our socket in it: it must be owned by this user or root (its owner may
    remove any file in it, sticky or not), and not writable by group or others unless sticky (like /tmp, where
    only a file's owner may remove it)."""
    gid = group_id(group)
    mode = 0o750 if gid is not None else 0o700
    created = False
    if not d.exists() and not d.is_symlink():
        # the missing ancestors too under our umask (each 0700; 0711 with `group`, whose members must pass through
        # them to the 0750 directory): with the caller's (0 in a service with UMask=0000) they were 0777, writable by
        # every user, and check_socket_ancestors, run before they existed, had not seen them (the next start refused them)
        old = os.umask(0o066 if gid is not None else 0o077)
        try:
            d.parent.mkdir(parents=True, exist_ok=True, mode=0o711 if gid is not None else 0o700)
        finally:
            os.umask(old)
        old = os.umask(0o077)
        try:
            d.mkdir(mode=mode)
            created = True
        except FileExistsError:
            pass  # raced with someone: treat it as an existing directory
        finally:
            os.umask(old)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise DaemonConfigError(f"socket directory {d} is not a directory")
    mark = d / RUNTIME_MARK
    if created:
        fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
    ours = st.st_uid == os.getuid() and _owned_file(mark)
    if ours:
        if gid is not None:
            os.chown(d, -1, gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(d, mode)
        return created
    if st.st_uid not in (os.getuid(), 0):
        raise DaemonConfigError(f"socket directory {d} is owned by uid {st.st_uid}, not by this user (uid "
                                f"{os.getuid()}) or root: its owner could replace the socket; remove it if it is "
                                "not in use, or point daemon.socket at a directory of this user's")
    others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if others_write and not st.st_mode & stat.S_ISVTX:
        raise DaemonConfigError(f"socket directory {d} (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}) is "
                                "writable by group or others without the sticky bit: they could replace the socket; "
                                f"use a directory only its owner may write (e.g. chmod go-w {d})")
    return created


def missing_dirs(d: Path) -> list[Path]:
    """`d` and those of its ancestors that do not exist yet, the outermost first: what `prepare_runtime_dir` would make."""
    out: list[Path] = []
    p = Path(os.path.realpath(d))  # as the kernel walks it: abspath took a `..` after a link lexically (another folder)
    while not os.path.lexists(p) and p != p.parent:
        out.append(p)
        p = p.parent
    return out[::-1]


def remove_made_dirs(made: list[Path], marked: bool) -> None:
    """Remove the folders a refused start made (`missing_dirs` before `prepare_runtime_dir`; `marked`: the last one got
    our mark), innermost first and only while empty (rmdir): anything put in one since keeps it and its parents. The
    mark goes only from a folder this start created (never from one that was there), and only where it is all the
    folder holds: one kept (another daemon's socket in it) keeps its mark, which lets a later start tighten it."""
    if marked and made:
        mark = made[-1] / RUNTIME_MARK
        with contextlib.suppress(OSError):
            if os.listdir(made[-1]) == [RUNTIME_MARK] and _owned_file(mark):
                mark.unlink()
    for d in reversed(made):
        try:
            if os.lstat(d).st_uid != os.getuid():  # made by someone else between our check and our mkdir
                return
            d.rmdir()
        except OSError:  # not empty (or gone): it and its parents stay
            return


def check_socket_ancestors(d: Path) -> None:
    """Refuse a socket directory `d` with an ancestor that others could use to replace it: one they may write
    without the sticky bit could have `d` renamed away and a link (or a directory of theirs) put in its place, and
    the daemon would bind, write its records and remove files there. Both the path as given and the one its links
    lead to are checked; ancestors that do not exist yet are left to `prepare_runtime_dir`, which creates them (the
    daemon checks again once they exist: another user may make one first).

    Refused: owned by another user than this one or root, whatever its mode (its owner may chmod it, and may rename
    any entry of a sticky folder of theirs), writable by others (world) without the sticky bit, or writable by a
    group while owned by some user other than this one or root, or by a group this user is not in. Allowed: a
    group-writable ancestor of this user's or root's whose group this user belongs to. The trade-off: its group's members could replace `d`, but
    they are people this user shares the group with, by the choice of the directory's owner (us, or the admin);
    with Debian/Ubuntu user-private groups (umask 002: `mkdir ~/moetune` is 0775) the group is this user alone,
    and shared setgid project directories (2775) are the usual way a team shares a node. Refusing them refused
    common setups for no protection against the users the check is about (anyone on the node). A root-owned
    directory writable by a group this user is not in (a service's spool, another team's share) is refused: its
    members are strangers to this user."""
    me = os.getuid()
    my_groups = {os.getgid(), os.getegid(), *os.getgroups()}
    # the path is followed through its links (the socket folder resolved once, `ipc_socket_file`): one another user
    # owns in a sticky folder such as /tmp is theirs to repoint (the sticky bit keeps only others' files from them)
    if (why := foreign_sticky_link_reason(d)) is not None:
        raise DaemonConfigError(f"socket directory {d}: {why}; put daemon.socket under a directory of this user's")
    for a in _walked_dirs(d):
        try:
            st = os.stat(a)
        except FileNotFoundError:
            continue  # created by prepare_runtime_dir, as ours
        except OSError as e:
            raise DaemonConfigError(f"cannot check {a}, a parent of the socket directory {d}: {e.strerror or e}") from None
        # its owner may rename what is in it whatever its mode says (they may chmod it, and a sticky folder's owner
        # may rename any entry of it)
        foreign = st.st_uid not in (me, 0)
        sticky = st.st_mode & stat.S_ISVTX
        if sticky and not foreign:
            continue  # as /tmp: only the owner of `d` (and this folder's: this user or root) may rename it
        if st.st_mode & stat.S_IWOTH and not sticky:
            who = "every user"
        elif st.st_mode & stat.S_IWGRP and not sticky and foreign:
            who = f"its group, and it is owned by uid {st.st_uid} (not this user, uid {me}, nor root)"
        elif st.st_mode & stat.S_IWGRP and not sticky and st.st_gid not in my_groups:
            who = f"its group (gid {st.st_gid}), which this user (uid {me}) is not in"
        elif foreign:
            raise DaemonConfigError(
                f"{a}, a parent of the socket directory {d}, (mode {stat.S_IMODE(st.st_mode):o}, owner uid "
                f"{st.st_uid}) is owned by another user than this one (uid {me}) or root: its owner may rename what is "
                f"in it whatever its mode says, and could replace {d} and the socket in it; put daemon.socket under "
                "a directory of this user's or root's")
        else:
            continue
        raise DaemonConfigError(
            f"{a}, a parent of the socket directory {d}, (mode {stat.S_IMODE(st.st_mode):o}, owner uid "
            f"{st.st_uid}) is writable by {who} without the sticky bit: they could replace {d} and the socket in it; "
            f"put daemon.socket under a directory others may not write (or chmod o-w,g-w {a}, or +t as /tmp has)")


def _walked_dirs(d: Path) -> list[Path]:
    """The folders a lookup of `d` goes through, as the kernel walks it, and their ancestors: the folder holding
    each component as written (resolved: a `..` after a link goes up from where the link led), and the ancestors of
    where `d` leads; `d` itself is left to `prepare_runtime_dir`. abspath's chain took `a/link/..` as `a`, leaving
    out `a`, which holds the link (whoever may write it may repoint the link)."""
    raw = os.fspath(d)
    if not os.path.isabs(raw):
        raw = os.path.join(os.getcwd(), raw)
    comps = [c for c in raw.split("/") if c not in ("", ".")]
    final = Path(os.path.realpath(raw))
    out: list[Path] = []
    for k, name in enumerate(comps):
        if name == "..":
            continue  # nobody can put another folder at `..`: its holder is judged by the folder it goes up to
        holder = Path(os.path.realpath("/" + "/".join(comps[:k])))
        out += [holder, *holder.parents]
    out += list(final.parents)
    return [a for a in dict.fromkeys(out) if a != final]


def _owned_file(p: Path) -> bool:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _socket_alive(path: Path) -> bool:
    """Something accepts connections on the unix socket at `path` (`probe_unix_socket`, the client's probe too: a
    long resolved path is reached through its folder). Absent, refused or not reachable: read as dead."""
    return probe_unix_socket(path) == "accepts"


def owner_record(p: Path) -> Path:
    return p.with_name(f".{p.name}{OWNER_SUFFIX}")


def _read_owner_record(p: Path) -> tuple[int, int] | None:
    """The (dev, inode) our record says we bound at `p`; None without a record of ours."""
    rec = owner_record(p)
    if not _owned_file(rec):
        return None
    try:
        d = json.loads(rec.read_text())
        return int(d["dev"]), int(d["ino"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deeply
        return None


def _proven_ours(p: Path) -> bool:
    """`p` is a socket owned by us that our owner record names (same device and inode)."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() and _read_owner_record(p) == (st.st_dev, st.st_ino)


def check_socket_path(p: Path, setting: str = "--socket") -> None:
    """Refuse to bind over anything but a stale socket we can prove is ours (which is removed). `setting`: the option
    that names `p` (the request socket's or the PUB's), said as the way out in every refusal."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonConfigError(f"{p} exists and is not a socket: refusing to replace it (choose another {setting})")
    if _socket_alive(p):
        # a process without our socket lock (another program, a moetune from before the lock): say what to do
        raise DaemonBusy(f"another daemon is listening on {p} (a process accepts connections there): stop it "
                         f"first, or give this one another {setting}")
    if st.st_uid != os.getuid():
        # said apart from a missing record: a record of ours may name it, and only its owner then tells it is not ours
        raise DaemonConfigError(f"{p} is a dead socket of uid {st.st_uid}, not of this user (uid {os.getuid()}): "
                                f"refusing to remove it; its owner may remove it, or choose another {setting}")
    if not _proven_ours(p):
        raise DaemonConfigError(f"{p} is a dead socket that no record shows this daemon created: "
                                f"remove it yourself if it is safe, or choose another {setting}")
    p.unlink()  # left over by a daemon of ours that was killed
    owner_record(p).unlink(missing_ok=True)


def record_owner(p: Path, st: os.stat_result, binding: Path | None = None) -> tuple[int, int]:
    """Write the owner record of the socket `st` bound (under its binding name `binding`, kept in the record) for
    `p`; returns the record's own (dev, inode) (the file this daemon may remove at exit). Written whole (synced, then
    renamed): a kill or a crash never leaves an empty record, which proves nothing and had the next start refuse the
    socket."""
    return _write_record(p, {"dev": st.st_dev, "ino": st.st_ino, "pid": os.getpid(),
                             **({"binding": binding.name} if binding is not None else {})})


def record_binding(p: Path, binding: Path) -> tuple[int, int]:
    """Write, before the socket for `p` is bound at `binding` (`binding_name`), an owner record naming that name
    alone: a daemon killed before its full record (`record_owner`) or its link left a dead socket there that nothing
    named, one more at each such kill; the next start removes it (`remove_dead_binding`). Returns the record's own
    (dev, inode)."""
    return _write_record(p, {"binding": binding.name, "pid": os.getpid()})


def _write_record(path: Path, payload: dict[str, Any]) -> tuple[int, int]:
    """Write `path`'s owner record (`payload` as JSON) whole: synced, then renamed over it (a crash must not leave
    it empty); refused where a record is there that is not ours. Returns the record's own (dev, inode)."""
    rec = owner_record(path)
    if (rec.exists() or rec.is_symlink()) and not _owned_file(rec):
        raise DaemonConfigError(f"{rec} exists and is not ours: refusing to replace it")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{rec.name}.", dir=path.parent)
    except OSError as e:  # a folder gone or not writable: said with the record it is for, not a bare errno
        raise DaemonConfigError(f"cannot write {rec} (the owner record of {path}): {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
            synced(f)
            rst = os.fstat(f.fileno())
        os.replace(tmp, rec)
        return rst.st_dev, rst.st_ino
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_dead_binding(p: Path) -> None:
    """Remove the socket a killed daemon left at the binding name its owner record for `p` names (`record_binding`),
    only while it is a dead socket of this user's (the inode the record names, where it names one). Called under the
    socket lock, so no daemon of ours is binding there."""
    rec = owner_record(p)
    if not _owned_file(rec):
        return
    try:
        d = json.loads(rec.read_text())
        name = str(d["binding"])
        ident = (int(d["dev"]), int(d["ino"])) if "ino" in d else None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return
    if not re.fullmatch(rf"\.{re.escape(p.name)}\.[0-9a-f]{{8}}", name):  # a name binding_name gives, nothing else
        return
    at = p.with_name(name)
    with contextlib.suppress(OSError):
        st = os.lstat(at)
        if (stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() and ident in (None, (st.st_dev, st.st_ino))
                and not _socket_alive(at)):
            at.unlink()


def binding_name(p: Path) -> Path | None:
    """A new name in `p`'s folder to bind the socket under before it is linked to `p` (once its owner record is
    written: a daemon killed in between leaves `p` absent, never a socket no record names, which every later start
    refused); None where that name would not fit a socket address (the socket is then bound at `p` as before, with a
    warning from the daemon: that protection is lost).
    Checked absent: libzmq removes whatever is at a path before binding it."""
    while True:
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}")
        if len(os.fsencode(tmp)) > MAX_IPC_PATH_BYTES:
            return None
        if not os.path.lexists(tmp):
            return tmp


def synced(f: Any) -> None:
    """Flush the open file `f` and fsync it: its bytes are on disk before a rename makes it daemon.json or its owner
    record (renamed unsynced, a power loss could leave the new name on a 0-byte file)."""
    f.flush()
    os.fsync(f.fileno())


def unlink_if(p: Path, ident: tuple[int, int] | None, kind: int = stat.S_IFREG) -> None:
    """Remove `p` only while it is the file of this user and kind with the (dev, inode) `ident` this daemon
    created (never one put in its place since). Check, then unlink: a file swapped in between would be the one
    removed, but only a user who may write the folder could swap it, and `prepare_runtime_dir` refuses a socket folder
    others may write without the sticky bit (in a sticky one they cannot rename our files); see
    `lock_files.release_lock_file`."""
    if ident is None:
        return
    with contextlib.suppress(OSError):
        st = os.lstat(p)
        if stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid() and (st.st_dev, st.st_ino) == ident:
            p.unlink()


def _info_record_ids(path: Path) -> set[tuple[int, int]]:
    """The (dev, inode)s that daemon.json's owner record says we wrote at `path`: the current one and the one
    it replaced (a daemon killed between writing the record and renaming the file left the old one there)."""
    rec = owner_record(path)
    if not _owned_file(rec):
        return set()
    try:
        d = json.loads(rec.read_text())
        ids = {(int(d["dev"]), int(d["ino"]))}
        if d.get("prev"):
            ids.add((int(d["prev"][0]), int(d["prev"][1])))
        return ids
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        return set()


def foreign_info_reason(path: Path, endpoint: str) -> str | None:
    """Why the file at `path` (daemon.json) is not ours to replace or remove; None when there is none, or it
    is one a moetune daemon wrote: a regular file of this user marked `written_by` INFO_MARK that our owner
    record names, or (written before the mark) one with exactly the old keys naming this endpoint."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a link or a FIFO is never followed or read
    except FileNotFoundError:
        return None
    except OSError as e:
        return "it is a symbolic link" if os.path.islink(path) else f"it cannot be read ({e.strerror or e})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "it is not a regular file"
        if st.st_uid != os.getuid():
            return f"it belongs to uid {st.st_uid}"
        if st.st_size == 0 and (st.st_dev, st.st_ino) in _info_record_ids(path):
            return None  # the very file a daemon of ours wrote, its bytes lost in a crash (written before they synced)
        try:
            data = json.loads(os.read(fd, 1 << 20))
        except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply, not a file we wrote
            data = None
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return "moetune did not write it (it is not a JSON object)"
    if data.get("written_by") == INFO_MARK:
        if (st.st_dev, st.st_ino) in _info_record_ids(path):
            return None
        return f"it says a moetune daemon wrote it, but no record of ours ({owner_record(path).name}) names it"
    if set(data) == _LEGACY_INFO_KEYS and data.get("endpoint") == endpoint and not owner_record(path).exists():
        return None
    return "moetune did not write it (no \"written_by\" mark of the daemon)"


def other_live_daemon(path: Path, endpoint: str) -> str | None:
    """Which other daemon still serves from the daemon.json at `path` (its pid and endpoint), when the file says one
    runs at another endpoint than `endpoint` and that one is alive: its IPC socket answers. Only a daemon on an
    ipc:// socket writes daemon.json (beside the socket), so a file naming another kind of endpoint is no live
    daemon's. None otherwise: a stopped or dead daemon's file is taken over as before."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        data = json.loads(os.read(fd, 1 << 20)) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError, RecursionError):
        data = None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("running") is not True:
        return None
    other, pid = data.get("endpoint"), data.get("pid")
    if not isinstance(other, str) or other == endpoint:
        return None
    p = ipc_socket_file(other)
    if p is None or p == ipc_socket_file(endpoint) or not p.is_absolute() or not _socket_alive(p):
        return None
    return f"pid {pid}, endpoint {other}"


def write_info_record(path: Path, new: tuple[int, int], prev: tuple[int, int] | None) -> tuple[int, int]:
    """Record (atomically) that the file about to be renamed to `path` (daemon.json) is ours; `prev` is the one it
    replaces. Returns the record's own (dev, inode) (the file this daemon may remove at exit)."""
    return _write_record(path, {"dev": new[0], "ino": new[1], "prev": list(prev) if prev else None,
                                "pid": os.getpid()})

