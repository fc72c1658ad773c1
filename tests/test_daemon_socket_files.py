"""The daemon removes only files it wrote: its socket (also when its owner record could not be written), the
socket's owner record and daemon.json's owner record only while they are the files it created (same device and
inode), and it refuses a socket directory whose parent every user (or the group of another user's directory) may
write without the sticky bit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.daemon import server
from moetune.tuner.daemon.errors import DaemonConfigError

pytestmark = pytest.mark.timeout(60)


_daemon = F.in_process_daemon


def _replace(p: Path, text: str) -> None:
    """Put another file at `p` (a new inode), as a user (or another daemon) would."""
    tmp = p.with_name(p.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, p)


def test_owner_records_replaced_since_are_left_alone(tmp_path: Path) -> None:
    d = _daemon(tmp_path).start(background=True)
    run = tmp_path / "run"
    sock_rec = run / ".daemon.sock.moetune-owner"
    info_rec = run / ".daemon.json.moetune-owner"
    assert sock_rec.is_file() and info_rec.is_file()
    _replace(sock_rec, "someone else's")
    d.stop()
    assert sock_rec.read_text() == "someone else's"  # not the record it wrote: kept
    assert not (run / "daemon.sock").exists()  # its own socket: removed


def test_a_never_served_daemon_leaves_a_replaced_info_record_alone(tmp_path: Path) -> None:
    d = _daemon(tmp_path)
    d._bind()
    d._write_info(running=True)
    info_rec = tmp_path / "run" / ".daemon.json.moetune-owner"
    rec = json.loads(info_rec.read_text())
    _replace(info_rec, json.dumps(rec))  # same content, another file: not the one this daemon wrote
    d._close()  # never served: its daemon.json goes, a record it did not write stays
    assert not (tmp_path / "run" / "daemon.json").exists()
    assert info_rec.exists()


def test_a_socket_whose_owner_record_failed_is_still_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: Any) -> Any:
        raise DaemonConfigError("record refused (test)")

    monkeypatch.setattr(server, "record_owner", refuse)
    with pytest.raises(DaemonConfigError, match="record refused"):
        _daemon(tmp_path).start(background=True)
    assert not (tmp_path / "run" / "daemon.sock").exists()  # bound in this run: removed, not leaked


def test_a_socket_dir_under_a_parent_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone may rename run/ away and put a link there
    (shared / "run").mkdir(mode=0o700)
    with pytest.raises(DaemonConfigError, match=f"{shared}, a parent of the socket directory .*writable by every user "
                                                "without the sticky bit"):
        _daemon(tmp_path, endpoint=f"ipc://{shared}/run/daemon.sock").start(background=True)
    assert sorted(os.listdir(shared / "run")) == []  # nothing bound, nothing written
    os.chmod(shared, 0o1777)  # sticky (as /tmp): only the owner of run/ may rename it
    _daemon(tmp_path, endpoint=f"ipc://{shared}/run/daemon.sock").start(background=True).stop()


@pytest.mark.parametrize("mode", [0o775, 0o2775])
def test_a_group_writable_parent_of_this_user_is_fine(tmp_path: Path, mode: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian/Ubuntu user-private groups (umask 002: `mkdir ~/moetune` is 0775) and setgid shared project
    directories (2775): the group is this user alone, or people its owner chose."""
    proj = tmp_path / "proj"
    proj.mkdir()
    os.chmod(proj, mode)
    _daemon(tmp_path, endpoint=f"ipc://{proj}/moetune/run/daemon.sock").start(background=True).stop()
    if os.getuid() == 0:
        # as root the folder above is root's, allowed whatever the rule says of this user's: the same folder of a
        # user who is not root (uid 65534, its group one of this process's), checked by a process of that uid
        from moetune.tuner.daemon.runtime_dir import check_socket_ancestors

        os.chown(proj, 65534, -1)
        monkeypatch.setattr(os, "getuid", lambda: 65534)
        check_socket_ancestors(proj / "moetune" / "run")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_group_writable_parent_of_another_user_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    os.chmod(other, 0o775)
    os.chown(other, 65534, -1)
    with pytest.raises(DaemonConfigError, match=f"{other}, a parent .*writable by its group, and it is owned by uid "
                                                "65534"):
        _daemon(tmp_path, endpoint=f"ipc://{other}/run/daemon.sock").start(background=True)


@pytest.mark.parametrize("mode", [0o755, 0o700, 0o1777])
def test_a_parent_of_another_user_is_refused_whatever_its_mode(tmp_path: Path, mode: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder's owner may rename what is in it whatever its mode says (they may chmod it; a sticky folder's owner
    may rename any entry): run/ renamed away and a link put in its place after the check, and the daemon wrote its
    records and daemon.json where the link points (as root: anywhere). Its mode was all that was looked at."""
    other = tmp_path / "other"
    other.mkdir()
    os.chmod(other, mode)
    if os.getuid() == 0:
        os.chown(other, 65534, -1)
        owner = 65534
    else:  # this user's folder, checked by a process of another uid
        owner = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    with pytest.raises(DaemonConfigError, match=rf"{other}, a parent of the socket directory .*owner uid {owner}\) is "
                                                "owned by another user"):
        from moetune.tuner.daemon.runtime_dir import check_socket_ancestors

        check_socket_ancestors(other / "run")
    if os.getuid() == 0:
        with pytest.raises(DaemonConfigError, match=f"{other}, a parent .*owned by another user"):
            _daemon(tmp_path, endpoint=f"ipc://{other}/run/daemon.sock").start(background=True)
        assert not (other / "run").exists()  # refused before anything was made there


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_missing_parent_made_by_another_user_meanwhile_is_refused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The parents checked before they exist: one another user makes between the check and the daemon's mkdir (which
    takes an existing folder as it is) is theirs, and so is the socket folder made in it; checked again once made."""
    from moetune.tuner.daemon import runtime_dir

    real = runtime_dir.prepare_runtime_dir
    theirs = tmp_path / "theirs"

    def raced(d: Path, group: str = "") -> bool:
        if d.parent == theirs and not theirs.exists():  # another user is quicker than the daemon's mkdir
            theirs.mkdir()
            os.chown(theirs, 65534, -1)
        return real(d, group)

    monkeypatch.setattr(server, "prepare_runtime_dir", raced)
    with pytest.raises(DaemonConfigError, match=f"{theirs}, a parent .*owned by another user"):
        # its PUB elsewhere (the one beside it would be refused by its own check, after the socket was bound there)
        _daemon(tmp_path, endpoint=f"ipc://{theirs}/run/daemon.sock",
                pub_endpoint=f"ipc://{tmp_path}/pub/events.sock").start(background=True)
    # nothing bound or written there, and the (empty) socket folder this refused start made is removed again
    assert not (theirs / "run").exists()


def test_a_group_writable_parent_of_a_group_this_user_is_not_in_is_refused(tmp_path: Path) -> None:
    """Owned by this user, but writable by a group it is not in: that group's members are strangers to it."""
    mine = {os.getgid(), os.getegid(), *os.getgroups()}
    stranger = next((g for g in (65534, 65533, 12345) if g not in mine), None)
    if stranger is None:
        pytest.skip("no group id this user is not in")
    shared = tmp_path / "spool"
    shared.mkdir()
    os.chmod(shared, 0o775)
    try:
        os.chown(shared, -1, stranger)
    except PermissionError:
        pytest.skip("chgrp to a group this user is not in needs root")
    with pytest.raises(DaemonConfigError, match=f"{shared}, a parent .*writable by its group \\(gid {stranger}\\), "
                                                "which this user"):
        _daemon(tmp_path, endpoint=f"ipc://{shared}/run/daemon.sock").start(background=True)
    assert not (shared / "run").exists()  # refused before anything was made there


def test_missing_parents_of_the_socket_directory_are_created(tmp_path: Path) -> None:
    sock = tmp_path / "new" / "sub" / "run" / "daemon.sock"
    _daemon(tmp_path, endpoint=f"ipc://{sock}").start(background=True).stop()
    assert (tmp_path / "new" / "sub" / "run").is_dir()


def test_the_socket_is_linked_to_its_path_once_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bound under a name of its own and linked to its path after its owner record: nothing else is left there."""
    real, at_record = server.record_owner, []

    def record_owner(p: Path, st: os.stat_result, binding: Path | None = None) -> tuple[int, int]:
        at_record.append(os.path.lexists(p))  # the path is still free while the record is written
        return real(p, st, binding)

    monkeypatch.setattr(server, "record_owner", record_owner)
    d = _daemon(tmp_path).start(background=True)
    run = tmp_path / "run"
    try:
        # (without this the test passed with the socket bound at its path before its record, as before 7f572d9)
        assert at_record and not any(at_record), at_record
        st = os.lstat(run / "daemon.sock")
        assert json.loads((run / ".daemon.sock.moetune-owner").read_text())["ino"] == st.st_ino
        assert not [p.name for p in run.iterdir() if p.name.startswith(".daemon.sock.") and "moetune" not in p.name]
    finally:
        d.stop()
    assert not (run / "daemon.sock").exists()


def test_a_file_system_without_hard_links_gets_the_socket_renamed(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def no_links(*_a: Any) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(server.os, "link", no_links)
    d = _daemon(tmp_path).start(background=True)
    run = tmp_path / "run"
    try:
        assert (run / "daemon.sock").is_socket()
        assert not [p.name for p in run.iterdir() if p.name.startswith(".daemon.sock.") and "moetune" not in p.name]
    finally:
        d.stop()
    assert not (run / "daemon.sock").exists()


def test_a_file_that_appears_at_the_socket_path_while_binding_is_kept(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.link

    def someone_was_first(src: Any, dst: Any) -> None:
        Path(dst).write_text("someone else's")
        real(src, dst)

    monkeypatch.setattr(server.os, "link", someone_was_first)
    with pytest.raises(DaemonConfigError, match="appeared while this daemon was binding it"):
        _daemon(tmp_path).start(background=True)
    run = tmp_path / "run"
    assert (run / "daemon.sock").read_text() == "someone else's"
    assert not [p.name for p in run.iterdir() if p.name.startswith(".daemon.sock.") and "moetune" not in p.name]



@pytest.mark.parametrize("noreplace", [True, False], ids=["renameat2", "checked-rename"])
def test_without_hard_links_a_file_made_after_the_check_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                noreplace: bool) -> None:
    """No hard links: the socket was renamed onto its path after a check that the path was free, and a file made there
    in between was replaced without a word. The rename refuses to go over one (renameat2 with RENAME_NOREPLACE); where
    that is not to be had, the path is checked again just before the rename. With renameat2 the file is made after
    every check, just before the kernel's call: only RENAME_NOREPLACE can keep it (with the checked rename alone the
    test passed too, the second check seeing a file made at the first)."""
    import errno

    from moetune.tuner.store import atomic_files

    real_renameat2 = atomic_files._renameat2()
    if noreplace and real_renameat2 is None:
        pytest.skip("no renameat2 in this C library")
    sock = tmp_path / "run" / "daemon.sock"
    linked: list[bool] = []
    real_lexists = os.path.lexists

    def no_links(*_a: Any) -> None:
        linked.append(False)
        raise PermissionError(errno.EPERM, "Operation not permitted")

    def someone_comes_after_the_check(path: Any) -> bool:
        seen = real_lexists(path)
        if linked and Path(path) == sock and not real_lexists(sock):  # after the daemon's first look, once
            sock.write_text("someone else's")
        return seen

    def someone_comes_before_the_rename(*a: Any) -> int:
        sock.write_text("someone else's")
        return real_renameat2(*a)  # type: ignore[misc]

    monkeypatch.setattr(server.os, "link", no_links)
    if noreplace:
        monkeypatch.setattr(atomic_files, "_renameat2", lambda: someone_comes_before_the_rename)
    else:
        monkeypatch.setattr(atomic_files, "_renameat2", lambda: None)
        monkeypatch.setattr(os.path, "lexists", someone_comes_after_the_check)
    with pytest.raises(DaemonConfigError, match="appeared while this daemon was binding it"):
        _daemon(tmp_path).start(background=True)
    assert sock.read_text() == "someone else's"
    assert not [p.name for p in sock.parent.iterdir() if p.name.startswith(".daemon.sock.") and "moetune" not in p.name]


def test_with_a_group_the_socket_is_the_groups_before_it_is_reachable(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With a configured group the socket was bound 0660 of the process's own group (its primary group, or a setgid
    folder's) and given to the configured group only after its owner record (synced) and its link to the path: a
    member of that other group who connected meanwhile stayed connected. Bound 0600, it is given its group and mode
    under its binding name, so the path never names it with another group's access."""
    import grp
    import stat

    gid = os.getgid()
    if os.geteuid() == 0:
        gid = next((g.gr_gid for g in grp.getgrall() if g.gr_name == "nogroup"), 65534)
    seen: dict[str, tuple[int, int]] = {}
    real_record, real_link = server.record_owner, os.link

    def record(p: Path, st: os.stat_result, *binding: Any) -> tuple[int, int]:
        seen["bound"] = (stat.S_IMODE(st.st_mode), st.st_gid)  # the socket as bind made it
        return real_record(p, st, *binding)

    def link(src: Any, dst: Any) -> None:
        st = os.lstat(src)
        seen["linked"] = (stat.S_IMODE(st.st_mode), st.st_gid)
        real_link(src, dst)

    monkeypatch.setattr(server, "record_owner", record)
    monkeypatch.setattr(server.os, "link", link)
    d = _daemon(tmp_path, group=grp.getgrgid(gid).gr_name).start(background=True)
    try:
        assert seen["bound"][0] & 0o077 == 0, seen  # was 0o660, of the process's group
        assert seen["linked"] == (0o660, gid), seen
        st = os.lstat(tmp_path / "run" / "daemon.sock")
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, gid)
    finally:
        d.stop()


def test_a_bind_that_fails_leaves_no_record_of_its_binding_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner record naming the binding name is written before the bind (a kill after it leaves a socket the next
    start removes): a bind that fails leaves no such record behind."""
    import zmq

    def refused(self: Any, addr: str) -> None:
        raise zmq.ZMQError(zmq.EADDRINUSE, "Address already in use (test)")

    monkeypatch.setattr(zmq.Socket, "bind", refused)
    (tmp_path / "run").mkdir(mode=0o700)  # there before: kept (a folder the refused start made would be removed)
    with pytest.raises(zmq.ZMQError):
        _daemon(tmp_path).start(background=True)
    assert not [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".daemon.sock.")
                and not p.name.endswith(".moetune-lock")]


def test_a_socket_path_too_long_for_a_binding_name_is_warned_of(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A socket path that fits a socket address but not with its binding name's `.NAME.<8 hex>` around it is bound at
    its path directly, where a kill between bind and record leaves a socket no record names: that was silent."""
    import logging

    from moetune.runtime.paths import MAX_IPC_PATH_BYTES

    run = tmp_path / "run"
    name = "d" * (MAX_IPC_PATH_BYTES - 3 - len(os.fsencode(run)))  # the path fits with 2 bytes to spare
    if len(name) < 2:
        pytest.skip("tmp_path is too long for the test's socket path")
    d = _daemon(tmp_path, endpoint=f"ipc://{run}/{name}", pub_endpoint=f"ipc://{run}/p.sock")
    with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
        d.start(background=True)
    try:
        assert (run / name).is_socket()
        said = [r.getMessage() for r in caplog.records if str(run / name) in r.getMessage()]
        assert said and "binding name" in said[0], caplog.text
        assert not [r for r in caplog.records if "p.sock" in r.getMessage()]  # a short path: bound as usual
    finally:
        d.stop()


@pytest.mark.parametrize("how", ["renameat2", "einval", "eperm", "none"])
def test_rename_no_replace_never_goes_over_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """renameat2(RENAME_NOREPLACE) where the C library has it; a file system that refuses the flag (EINVAL), a seccomp
    filter that refuses the call (EPERM) or a C library without it: the checked rename. Either way a file at the target is kept and named."""
    import ctypes
    import errno

    from moetune.tuner.store import atomic_files

    if how == "renameat2":
        if atomic_files._renameat2() is None:
            pytest.skip("no renameat2 in this C library")
        # every check finds the path free (the file made after it): only the kernel's refusal keeps the file
        monkeypatch.setattr(os.path, "lexists", lambda _p: False)
    elif how in ("einval", "eperm"):  # a file system without the flag; a seccomp filter that knows no renameat2
        def refused(*_a: Any) -> int:
            ctypes.set_errno(errno.EINVAL if how == "einval" else errno.EPERM)
            return -1

        monkeypatch.setattr(atomic_files, "_renameat2", lambda: refused)
    elif how == "none":
        monkeypatch.setattr(atomic_files, "_renameat2", lambda: None)
    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_text("ours")
    dst.write_text("theirs")
    with pytest.raises(FileExistsError):
        atomic_files.rename_no_replace(src, dst)
    assert (src.read_text(), dst.read_text()) == ("ours", "theirs")
    dst.unlink()
    atomic_files.rename_no_replace(src, dst)
    assert dst.read_text() == "ours" and not src.exists()
