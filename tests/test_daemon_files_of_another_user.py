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

from moetune.tuner.daemon.runtime_dir import unlink_if

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
