"""Files written whole or not at all: `write_atomic` (the one atomic file writer: the export, `bench summarize`, `model
calibrate --out`, the bring-up's state file, report and node model, `moetune keys`' allow-list) and `write_temp`, its
first half (`moetune keys generate` renames the two files of a key pair once both are written); `rename_no_replace`
(a rename that never goes over a file, where hard links fail: the daemon's socket, `write_atomic(replace=False)`).
Standard library only: a command that writes a file (`moetune keys`) does not load the store (SQLAlchemy) for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetune.runtime.paths import foreign_link_reason, sync_folder


def _put_new(tmp: Path, path: Path) -> None:
    """Make `tmp` the file `path` only if there is none: a hard link fails with EEXIST when one appeared since the
    caller looked. A filesystem without hard links: `rename_no_replace` (a check then os.replace went over a file made
    between the two)."""
    try:
        os.link(tmp, path)
    except OSError as e:  # EEXIST (a file appeared) is not in the list below: raised
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        try:
            rename_no_replace(tmp, path)  # FileExistsError where a file is there; `tmp` is the caller's to remove
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "file exists", str(path)) from None
        return
    os.unlink(tmp)



_AT_FDCWD = -100  # <fcntl.h>: paths relative to the working directory
_RENAME_NOREPLACE = 1  # <linux/fs.h>: fail with EEXIST where the target exists


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's renameat2 (2.28 and later, Linux), or None where this C library has none (musl before 1.2.2, macOS)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def rename_no_replace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` only if nothing is at `dst` (FileExistsError otherwise), for a file system where a hard
    link (which fails with EEXIST the same way) is refused. renameat2 with RENAME_NOREPLACE decides it in the kernel;
    without it (no such call in the C library, ENOSYS from an old kernel, EINVAL from a file system without the flag,
    EPERM from a seccomp filter of an older container runtime that knows no renameat2: a real permission problem
    fails the plain rename the same way) `dst` is checked just before a plain rename, and a file made between the two
    is replaced: the window narrowed, not closed."""
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.EPERM):
            raise OSError(err, os.strerror(err), str(src), None, str(dst))  # EEXIST: a FileExistsError
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


_MAX_LINKS = 40  # as the kernel's ELOOP


def follow_own_links(path: Path) -> Path:
    """`path`, or the file its chain of symbolic links names when each link is this user's or root's (a dangling
    link: the path it names). Another user's link raises PermissionError naming the link and its owner: in a shared
    folder such as /tmp, `--out /tmp/p.json` must not follow another user's link to this user's ~/.bashrc (the
    kernel's fs.protected_symlinks refuses that when it follows the link; a link resolved by hand is not). Only the
    last component is followed here: the folders on the way are the kernel's to follow, with its checks."""
    for _ in range(_MAX_LINKS):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return path
        if not stat.S_ISLNK(st.st_mode):
            return path
        why = foreign_link_reason(path, st, os.getuid())
        if why is not None:
            raise PermissionError(errno.EACCES, f"refusing to write through {why}", str(path))
        path = path.parent / os.readlink(path)  # an absolute target replaces the folder
    raise OSError(errno.ELOOP, "too many levels of symbolic links", str(path))


def write_temp(path: Path, raw: bytes, *, mode: int | None = None) -> Path:
    """A new file beside `path`, under a hidden temporary name (".NAME.<random>.tmp": no `*.key` or `*.json` glob takes
    it), holding `raw` and on disk (fsync) before it returns: the file `write_atomic` renames into place (`moetune keys`
    renames the two of a key pair once both are written). O_EXCL: never a file (nor a link) we did not create. `mode`:
    its permissions from creation (the umask narrows them; fchmod before a byte is written sets them exactly, as a
    folder's default ACL can widen them); None: 0o666 less the umask, as any new file. Removed again if the write
    fails (Ctrl-C included)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666 if mode is None else mode & 0o777)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before a rename makes them the file
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def write_atomic(path: Path, data: str | bytes, *, replace: bool = True, mode: int | None = None,
                 follow_links: bool = True) -> None:
    """Replace `path` with `data` (str: UTF-8) atomically: a crash or a full disk mid-write leaves the previous file
    whole (`write_temp`: a new temporary file in the same directory, fsynced, then os.replace); an existing file keeps
    its permissions, unless `mode` is given: the new file's from creation (a key file: 0o600, never readable by others
    for a moment). `replace=False`: FileExistsError when `path` exists by the time the file is put in place (a hard
    link, which never replaces, instead of os.replace: no window between the check and the write). A symlink is
    written through, as a plain write would: the link stays and the file it names is replaced (os.replace on the
    link itself would turn it into a regular file, leaving the file it named stale), if it is this user's or root's
    (`follow_own_links`: another user's link is refused, PermissionError); `follow_links=False` replaces the link
    itself instead (key files: a link in a key folder must not carry a key elsewhere). Used by the export, `bench
    summarize`, `model calibrate --out`, the bring-up's state file, report and node model, and `moetune keys`."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if follow_links:
        path = follow_own_links(path)  # its target (a dangling link: the file it names is created)
    if mode is None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            st = os.stat(path) if follow_links else os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                mode = stat.S_IMODE(st.st_mode)
    tmp = write_temp(path, raw, mode=mode)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            _put_new(tmp, path)
    except BaseException:  # Ctrl-C included: remove our temporary file, the old file stays as it was
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    sync_folder(path.parent)


def write_figure(fig: Any, path: Path, **savefig_kw: Any) -> None:
    """Save a matplotlib figure to `path` atomically (`write_atomic`): rendered in memory first, so Ctrl-C or a full
    disk mid-save leaves an earlier plot of that name whole (fig.savefig(path) truncated it first). The format
    is the file's suffix, as savefig reads it (none: matplotlib's savefig.format); a ValueError for one it cannot
    write, before anything is written."""
    import io as _io

    buf = _io.BytesIO()
    fig.savefig(buf, format=path.suffix[1:].lower() or None, **savefig_kw)
    write_atomic(path, buf.getvalue())
