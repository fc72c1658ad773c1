"""Where moetune may create a new SQLite file: the ONE rule for the profile store (`--db`, `[store] db`) and a SQLite
studies storage (`--storage sqlite:///...`, the default studies file).

moetune creates no folder but its own data folder ($MOETUNE_HOME, else the XDG data dir): a path in a folder that
does not exist is most likely a typo, and the system daemon's /var/lib/moetune comes from its unit's StateDirectory."""

from __future__ import annotations

import os
from pathlib import Path


def make_parent(path: Path, error: type[Exception]) -> None:
    """Make sure the folder of new file `path` is there: create it only when it is moetune's own data folder. Any
    refusal or failure is raised as `error` (each caller's own exception type)."""
    from moetune.runtime.paths import data_dir

    parent = path.parent
    if parent.is_dir():
        return
    own = data_dir().expanduser().absolute()
    if parent.absolute() != own:
        if parent.exists():
            raise error(f"cannot create {path}: {parent} is not a folder")
        raise error(f"cannot create {path}: the folder {parent} does not exist (moetune creates only its own data "
                    f"folder, {own}; create {parent} first or give another path)")
    # a file where the data folder should be ($MOETUNE_HOME=a file) said "[Errno 17] File exists"
    if parent.exists():
        raise error(f"cannot create {path}: {_own_folder(parent)} is a file, not a folder")
    # never writable by group or others, whatever the umask (a service's UMask=0000 made it 0777: anyone could replace
    # the database, or plant a link as its -journal, and the daemon's socket check then refused $MOETUNE_HOME/run's
    # parent); readable as the umask says: other users' jobs may read the database
    old = os.umask(0)
    os.umask(old | 0o022)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except NotADirectoryError:  # a file above it ($MOETUNE_HOME=a-file/sub)
        raise error(f"cannot create {path}: {_own_folder(parent)} is under a file, not a folder") from None
    except OSError as e:
        raise error(f"cannot create the folder of {path}: {e}") from None
    finally:
        os.umask(old)


def _own_folder(parent: Path) -> str:
    """moetune's data folder `parent` as the user set it: `$MOETUNE_HOME` when that names it."""
    from moetune.runtime.paths import moetune_home

    return f"MOETUNE_HOME ({parent})" if moetune_home() is not None else f"moetune's data folder {parent}"


def _denied(p: Path) -> str:
    """Why `os.access` said no to writing `p`: a read-only mount (where a chmod would change nothing), else
    permission denied."""
    try:
        read_only = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "permission denied"


def not_writable(path: Path, *, side_files: bool = False) -> str:
    """Why this user cannot write the SQLite file `path` ('' when its permissions do not say so): the file is
    read-only for this user, or it does not exist and its folder cannot be written (SQLite cannot create it there).
    `side_files`: an existing file's folder too, where a write needs SQLite's side files: a rollback journal's
    -journal is made there at every write; a WAL file needs its -wal and -shm (made there unless both are already
    there and writable)."""
    path = Path(path)
    parent = path.parent
    if path.is_file():
        if not os.access(path, os.W_OK):
            return f"{path} is read-only for this user ({_denied(path)}): it cannot be written"
        if not side_files or not _needs_new_side_files(path):
            return ""
    elif path.exists():
        return ""
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        what = f"SQLite's journal for {path.name}" if path.exists() else f"a new database {path.name}"
        return f"cannot write {parent}: {_denied(parent)} ({what} cannot be created there)"
    return ""


def _needs_new_side_files(path: Path) -> bool:
    """Whether a write to the existing SQLite file `path` makes a file beside it: always in rollback-journal mode (its
    -journal; an empty file too); in WAL mode unless its -wal and -shm are there and writable.

    Whether it is WAL is asked of SQLite (`sqlite_open._is_wal`: a nolock=1 connection, which makes no -wal/-shm and
    takes no lock), never read off the header through a file of our own: closing any descriptor of a file drops every
    POSIX lock this process holds on it, SQLite's included, so each opening of a studies file (make_storage) took the
    locks of this process's open connections to it (the daemon's, an earlier storage's). Another process closing its
    connection then took itself for the last one and deleted the -wal/-shm under them: a commit of a third process
    went unseen here, and writes could be lost. SQLite keeps a file it has open, and its locks, across its own
    connections. Not a mode=ro connection: on a WAL file without its -wal/-shm it made both beside the user's file
    (and could not remove them), and its URI took only UTF-8 names."""
    from moetune.runtime.profiles.sqlite_open import _is_wal

    if not os.access(path, os.R_OK):
        return False  # unreadable: SQLite says what is wrong (as when the header could not be read)
    if not _is_wal(path):  # rollback journal, an empty file (its first write has one too), or not a database
        return True
    return not all(os.access(path.with_name(path.name + s), os.W_OK) for s in ("-wal", "-shm"))
