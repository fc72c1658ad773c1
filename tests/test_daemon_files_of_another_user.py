"""The daemon removes or replaces a file in its runtime directory only where it is its own: a socket, an owner record
or daemon.json of ANOTHER user is left alone, even where its device and inode are the ones the daemon recorded,
and the refusal says why. As root every file is this user's unless given away, so each rule is checked both ways:
a file of uid 65534 while this user is root (chown), and a file of root while this user is uid 65534 (os.getuid
patched), with the same file of this user taken as the control."""

from __future__ import annotations

import json
import logging
import os
import socket as pysocket
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon.errors import DaemonConfigError
from moetune.tuner.daemon.runtime_dir import (
    check_socket_path,
    foreign_info_reason,
    owner_record,
    record_owner,
    unlink_if,
    write_info_record,
)

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


# -- foreign_info_reason: daemon.json is replaced only where it is this user's ----------------------------------------
def _ours_written(tmp: Path) -> tuple[Path, str]:
    """daemon.json as a daemon of ours leaves it (marked, named by our owner record), and the daemon's endpoint."""
    d = F.in_process_daemon(tmp)
    endpoint = d.endpoint
    d.start(background=True).stop()
    info = tmp / "run" / "daemon.json"
    assert foreign_info_reason(info, endpoint) is None  # ours as it stands: the cases below differ in the owner only
    return info, endpoint


def test_our_daemon_json_given_to_another_user_is_not_ours(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """This user root, daemon.json of uid 65534 (mark and record as ours): a daemon starting beside it leaves it
    as it is, and says why."""
    info, endpoint = _ours_written(tmp_path)
    os.lchown(info, OTHER, OTHER)
    assert foreign_info_reason(info, endpoint) == f"it belongs to uid {OTHER}"
    before, ident = info.read_bytes(), _ident(info)
    with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
        d = F.in_process_daemon(tmp_path).start(background=True)
        try:
            assert info.read_bytes() == before and _ident(info) == ident
        finally:
            d.stop()
    assert info.read_bytes() == before and _ident(info) == ident and os.lstat(info).st_uid == OTHER  # nor at exit
    assert any(f"not writing {info}: it belongs to uid {OTHER}" in r.getMessage() for r in caplog.records)


def test_roots_daemon_json_is_not_ours_when_this_user_is_not_root(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """This user uid 65534, daemon.json root's: the owner record is given to 65534, so that only the file's owner
    tells it from ours."""
    info, endpoint = _ours_written(tmp_path)
    os.lchown(owner_record(info), OTHER, OTHER)
    _as_uid(monkeypatch, OTHER)
    assert foreign_info_reason(info, endpoint) == "it belongs to uid 0"
    os.lchown(info, OTHER, OTHER)  # the control: the same file, this user's, is ours
    assert foreign_info_reason(info, endpoint) is None


# -- _info_is_ours: daemon.json is this run's only while it is the very file this run wrote, this user's ---------------
def _put_another_daemons_info(info: Path) -> bytes:
    """Replace daemon.json (a new inode) as another daemon of this user's, serving elsewhere, would: marked, with
    the owner record naming its file, so that foreign_info_reason calls it ours and only _info_is_ours tells."""
    body = json.dumps({"written_by": "moetune-daemon", "endpoint": "ipc:///elsewhere/daemon.sock", "pid": 1,
                       "running": True, "epoch": "the-other-daemon"}).encode()
    tmp = info.with_name(".daemon.json.other")
    tmp.write_bytes(body)
    write_info_record(info, _ident(tmp), None)
    os.replace(tmp, info)
    return body


def test_a_daemon_json_replaced_during_the_run_is_left_at_exit(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    d = F.in_process_daemon(tmp_path).start(background=True)
    info = tmp_path / "run" / "daemon.json"
    try:
        theirs = _put_another_daemons_info(info)
        record = owner_record(info).read_bytes()
        assert foreign_info_reason(info, d.endpoint) is None  # marked and recorded: only the inode says it is not ours
    finally:
        with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
            d.stop()
    assert info.read_bytes() == theirs and owner_record(info).read_bytes() == record  # not rewritten "running": false
    assert any(f"not writing {info}: it was replaced since this daemon wrote it" in r.getMessage()
               for r in caplog.records)


def test_a_never_served_daemon_leaves_a_daemon_json_replaced_since(tmp_path: Path) -> None:
    """A start-up that fails removes the daemon.json it wrote, never another daemon's put there since."""
    d = F.in_process_daemon(tmp_path)
    d._bind()
    d._write_info(running=True)
    info = tmp_path / "run" / "daemon.json"
    theirs = _put_another_daemons_info(info)
    record = owner_record(info).read_bytes()
    d._close()
    assert info.read_bytes() == theirs and owner_record(info).read_bytes() == record


def test_our_daemon_json_given_to_another_user_during_the_run_is_left_at_exit(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The very file this run wrote (same inode), given to uid 65534 since: no longer ours to rewrite."""
    d = F.in_process_daemon(tmp_path).start(background=True)
    info = tmp_path / "run" / "daemon.json"
    try:
        before, ident = info.read_bytes(), _ident(info)
        os.lchown(info, OTHER, OTHER)
    finally:
        with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
            d.stop()
    assert info.read_bytes() == before and _ident(info) == ident and os.lstat(info).st_uid == OTHER
    assert any(f"not writing {info}: it was replaced since this daemon wrote it" in r.getMessage()
               for r in caplog.records)


def test_roots_daemon_json_is_not_this_runs_when_this_user_is_not_root(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    d = F.in_process_daemon(tmp_path)
    d.start(background=True).stop()  # the daemon.json this run wrote last, root's
    info = tmp_path / "run" / "daemon.json"
    assert d._info_is_ours(info)
    _as_uid(monkeypatch, OTHER)
    assert not d._info_is_ours(info)
    os.lchown(info, OTHER, OTHER)  # the control: the same file, this user's
    assert d._info_is_ours(info)


# -- record_owner / write_info_record: an owner record in our record's place is replaced only where it is ours --------
@pytest.mark.parametrize("which", ["socket", "daemon.json"])
@pytest.mark.parametrize("way", ["theirs_while_root", "roots_while_65534"])
def test_an_owner_record_of_another_user_is_not_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         which: str, way: str) -> None:
    """A record is what makes a file ours: one of another user's at our record's name would have the daemon later
    remove what that user names. It is refused, saying so, and kept."""
    p = tmp_path / ("daemon.sock" if which == "socket" else "daemon.json")
    if which == "socket":
        _dead_socket(p)
    else:
        p.write_text("{}")
    st = os.lstat(p)

    def write() -> None:
        if which == "socket":
            record_owner(p, st)
        else:
            write_info_record(p, (st.st_dev, st.st_ino), None)

    rec = owner_record(p)
    rec.write_text("theirs")
    if way == "theirs_while_root":
        os.lchown(rec, OTHER, OTHER)
    else:
        _as_uid(monkeypatch, OTHER)  # the record stays root's
    with pytest.raises(DaemonConfigError, match=f"{rec} exists and is not ours: refusing to replace it"):
        write()
    assert rec.read_text() == "theirs"
    # the control: the same record, this user's, is replaced by ours
    os.lchown(rec, *((0, 0) if way == "theirs_while_root" else (OTHER, OTHER)))
    write()
    assert json.loads(rec.read_text())["ino"] == st.st_ino
