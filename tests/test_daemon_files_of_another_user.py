"""The daemon removes or replaces a file in its runtime directory only where it is its own: a socket, an owner record
or daemon.json of ANOTHER user is left alone, even where its device and inode are the ones the daemon recorded,
and the refusal says why. As root every file is this user's unless given away, so each rule is checked both ways:
a file of uid 65534 while this user is root (chown), and a file of root while this user is uid 65534 (os.getuid
patched), with the same file of this user taken as the control."""

from __future__ import annotations

import os
import socket as pysocket
import stat
from pathlib import Path

import pytest

from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.runtime_dir import check_socket_path, owner_record, record_owner, unlink_if

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user (chown) needs root")]

OTHER = 65534  # nobody: a user who is not root


def _as_uid(monkeypatch: pytest.MonkeyPatch, uid: int) -> None:
    """Make `uid` "this user" for the checks under test (they ask os.getuid; geteuid too, to be safe)."""
    monkeypatch.setattr(os, "getuid", lambda: uid)
    monkeypatch.setattr(os, "geteuid", lambda: uid)


def _dead_socket(p: Path) -> None:
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.bind(str(p))
    s.close()


def _ident(p: Path) -> tuple[int, int]:
    st = os.lstat(p)
    return st.st_dev, st.st_ino


# -- unlink_if: the daemon's exit removes its sockets and owner records only while they are this user's ---------------
@pytest.mark.parametrize("kind", [stat.S_IFREG, stat.S_IFSOCK], ids=["record", "socket"])
@pytest.mark.parametrize("way", ["theirs_while_root", "roots_while_65534"])
def test_unlink_if_leaves_another_users_file_with_our_ident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             kind: int, way: str) -> None:
    p = tmp_path / ("daemon.sock" if kind == stat.S_IFSOCK else ".daemon.sock.moetune-owner")
    if kind == stat.S_IFSOCK:
        _dead_socket(p)
    else:
        p.write_text("{}")
    ident = _ident(p)  # the very file: only its owner tells it from ours
    if way == "theirs_while_root":
        os.lchown(p, OTHER, OTHER)
    else:
        _as_uid(monkeypatch, OTHER)  # the file stays root's
    unlink_if(p, ident, kind)
    assert os.path.lexists(p) and _ident(p) == ident
    # the control: the same file, this user's, goes
    if way == "theirs_while_root":
        os.lchown(p, 0, 0)
    else:
        os.lchown(p, OTHER, OTHER)
    unlink_if(p, ident, kind)
    assert not os.path.lexists(p)


# -- check_socket_path: a dead socket at our path is removed at start only where it is ours --------------------------
@pytest.mark.parametrize("way", ["theirs_while_root", "roots_while_65534"])
def test_a_dead_socket_of_another_user_is_refused_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           way: str) -> None:
    """Even with an owner record of this user's naming it (the record is all the daemon leaves behind at kill -9):
    the socket itself must be this user's too, and the refusal says whose it is."""
    p = tmp_path / "daemon.sock"
    _dead_socket(p)
    record_owner(p, os.lstat(p))  # our record, naming this very socket
    if way == "theirs_while_root":
        os.lchown(p, OTHER, OTHER)
        owner = OTHER
    else:
        os.lchown(owner_record(p), OTHER, OTHER)  # the record is "this user's"; the socket stays root's
        _as_uid(monkeypatch, OTHER)
        owner = 0
    ident = _ident(p)
    with pytest.raises(DaemonConfigError, match=f"{p} is a dead socket of uid {owner}, not of this user"):
        check_socket_path(p)
    assert _ident(p) == ident and owner_record(p).exists()
    # the control: the same socket, this user's, is a stale one of ours and goes with its record
    os.lchown(p, *((0, 0) if way == "theirs_while_root" else (OTHER, OTHER)))
    check_socket_path(p)
    assert not os.path.lexists(p) and not owner_record(p).exists()
