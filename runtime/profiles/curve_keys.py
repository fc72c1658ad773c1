"""This client's CURVE key files: reading one (the daemon's public key, the client's own pair) and warning when
the client's secret key is open to other users (the daemon's rule for its own key), or the daemon's public key file
could be changed by them (whoever changes it can pose as the daemon)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from moetune.runtime import _once
from moetune.runtime.paths import loose_key_path, secret_key_checks

__all__ = ["NoProcError", "bad_curve_key", "is_curve_key", "read_curve_key_file", "read_curve_key_file_stat",
           "read_key_file_as_opened", "warn_loose_secret", "warn_loose_server_key"]

log = logging.getLogger("moetune.client")  # the client's logger: the CLI filters its records by it


class NoProcError(ValueError):
    """A key file read refused because /proc/self/fd is not there (no /proc, or another PID namespace's): nothing is
    known of the file's keys. Its own class so that a check that can go on without the file (the daemon's pair check)
    can tell this apart from a file that is no key file, and say it."""


def is_curve_key(key: bytes | None) -> bool:
    """Whether `key` is a CURVE key as zmq writes it in a key file: 40 Z85 characters (32 bytes). zmq checks a key only
    when it is set on a socket, and then says a bare "Invalid argument" that names no file."""
    import struct

    from zmq.utils import z85

    try:
        return key is not None and len(key) == 40 and len(z85.decode(key)) == 32
    # z85 raises KeyError for a character outside its alphabet, struct.error for a 5-character group past 32 bits
    except (ValueError, KeyError, TypeError, struct.error):
        return False


def bad_curve_key(public: bytes | None, secret: bytes | None) -> str | None:
    """"public key" or "secret key": the first of a key file's keys that is there but is no CURVE key (`is_curve_key`);
    None where both are keys or absent. zmq checks a key only when it is set on a socket ("Invalid argument", naming no
    file): the client and the daemon ask this where they read the file, to name it."""
    for what, key in (("public key", public), ("secret key", secret or None)):
        if key is not None and not is_curve_key(key):
            return what
    return None


def read_curve_key_file(path: str | Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a CURVE key file (`moetune keys generate`), else a ValueError saying what is
    wrong as a predicate to follow the file's name: "does not exist", "is a directory, not a key file", "is not a
    regular file (...)", "cannot be read (...)", "cannot be read here: ... (/proc is not mounted ...)", "holds no CURVE
    public key", "holds a ... that is not a CURVE key"
    (zmq.auth says "Invalid certificate file" of a missing one)."""
    public, secret, _st = read_curve_key_file_stat(path)
    return public, secret


def read_curve_key_file_stat(path: str | Path) -> tuple[bytes, bytes | None, os.stat_result]:
    """`read_curve_key_file`, and the stat of the file it read (for the mode warnings: they judge what was read)."""
    public, secret, st = read_key_file_as_opened(path)
    if (what := bad_curve_key(public, secret)) is not None:  # no secret: the caller says if it needs one
        raise ValueError(f"holds a {what} that is not a CURVE key (40 Z85 characters; not a `moetune keys "
                         "generate` key file, or an edited one)")
    return public, secret, st


def read_key_file_as_opened(path: str | Path) -> tuple[bytes, bytes | None, os.stat_result]:
    """(public, secret or None, stat) of a key file as zmq parses it, its keys not yet checked to be CURVE keys
    (`read_curve_key_file_stat` checks them; `moetune keys allow` names a bad one its own way). Errors as
    `read_curve_key_file`'s.

    Opened once, and every check made on that descriptor: checked by path, then opened by path, a FIFO put there in
    between had the open wait for a writer (the client's constructor hung). A link is followed (key files linked
    to a shared copy are supported; who may replace a link is what the folder warnings judge). zmq reads it as
    /proc/self/fd/N: without /proc (a chroot or sandbox, or a /proc of another PID namespace) it is refused, saying so."""
    from zmq.auth import load_certificate

    p = Path(path)
    try:
        # O_NONBLOCK: a FIFO's open returns at once (it waited for a writer); O_CLOEXEC: no child inherits it
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ValueError("does not exist" + (" (a link to nothing)" if p.is_symlink() else "")) from None
    except IsADirectoryError:
        raise ValueError("is a directory, not a key file") from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket (or a device with nothing behind it): never a regular file
            raise ValueError("is not a regular file (a socket or a device), not a key file") from None
        raise ValueError(f"cannot be read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ValueError("is a directory, not a key file")
        if not stat.S_ISREG(st.st_mode):  # a FIFO's read waits for a writer for ever: the lookup (and the EP buffer) hung
            raise ValueError("is not a regular file (a FIFO or a device), not a key file")
        # zmq reads a file by name: the name of this descriptor's file, never the path again (Linux's /proc)
        by_fd = f"/proc/self/fd/{fd}"
        if not os.path.exists(by_fd):  # zmq would say "Invalid certificate file: /proc/self/fd/N" of a good file
            raise NoProcError(f"cannot be read here: {by_fd} is not there (/proc is not mounted, or is another PID "
                             "namespace's); moetune reads a key file through the descriptor it checked, in /proc")
        try:
            public, secret = load_certificate(by_fd)
        except OSError as e:
            raise ValueError(f"cannot be read ({e.strerror or e})") from None
        except (ValueError, UnicodeDecodeError, IndexError):  # "No public key found in ..."; IndexError: a
            # `public-key`/`secret-key` line without `=` (zmq splits it at "=" unchecked: a traceback reached the user)
            raise ValueError("holds no CURVE public key (not a `moetune keys generate` key file)") from None
    finally:
        os.close(fd)
    return public, secret, st


def warn_loose_secret(path: str, st: os.stat_result | None = None) -> None:
    """Warn (once per file) when this client's CURVE secret key could be read, changed or replaced by other users
    (`secret_key_checks` and `loose_key_path`, the daemon's rule for its own key): whoever reads it connects as this
    client (an admin key: may re-tune). A warning, not a refusal: the daemon enforces its allow-list, and refusing
    here would only push the job onto its fallbacks without a word at the daemon. `st`: the key file as it was read
    (`read_curve_key_file_stat`): the file judged is the one read, not one put at its path since."""
    for where, forbid in secret_key_checks(path):
        try:
            loose = loose_key_path(where, forbid=forbid, st=st if where == Path(path) else None)
        except OSError:  # gone or unreadable meanwhile: a warning only, the key was read
            continue
        if loose is None:
            continue
        if where == Path(path):
            said = (f"this client's CURVE secret key file {path} (mode {loose.mode:o}, owner uid {loose.uid}) can be "
                    "read or changed by other users: whoever reads it can connect as this client (chmod 600 it, owned "
                    "by this user)")
        else:
            said = (f"the folder {where} (mode {loose.mode:o}, owner uid {loose.uid}) of this client's CURVE secret "
                    f"key file {path} lets other users replace the key with their own (make it writable by this user "
                    "only)")
        _once.say_once("client.secret_key_mode", path, f"moetune: {said}", logger=log)
        return


def warn_loose_server_key(path: str, st: os.stat_result | None = None) -> None:
    """Warn (once per file) when the daemon's CURVE public key file this client trusts could be changed by other users:
    writable by group or others, or in a folder (the one a link points into included) they may write without the
    sticky bit. Whoever changes it chooses the key this client takes for the daemon's, and can pose as the daemon over
    TCP (its replies are then applied as the daemon's). Readable by all is fine (a public key), and so is another
    owner (the daemon operator's file, shared with the clients). A warning, as for the client's own secret key.
    `st`: the key file as it was read (`read_curve_key_file_stat`), judged instead of what is at its path now."""
    p = Path(path)
    for where in (p, *dict.fromkeys((p.parent, p.resolve().parent))):
        try:
            loose = loose_key_path(where, forbid=0o022, sticky_ok=where != p, st=st if where == p else None)
        except OSError:  # gone or unreadable meanwhile: a warning only, the key was read
            continue
        if loose is None or not loose.loose_bits:  # its owner alone is not judged here (see above)
            continue
        if where == p:
            said = (f"the daemon's CURVE public key file {path} (mode {loose.mode:o}, owner uid {loose.uid}) can be "
                    "changed by other users: whoever changes it can pose as the daemon (make it writable by its "
                    "owner only)")
        else:
            said = (f"the folder {where} (mode {loose.mode:o}, owner uid {loose.uid}) of the daemon's CURVE public key "
                    f"file {path} lets other users replace the key with their own: whoever does can pose as the daemon "
                    "(make the folder writable by its owner only)")
        _once.say_once("client.server_key_mode", path, f"moetune: {said}", logger=log)
        return
