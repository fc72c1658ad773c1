"""A symbolic link another user made in a sticky, world-writable folder (/tmp) can point a database path at a file of
this user: `/tmp/moetune.db -> ~/x.db`. The sticky bit keeps others from replacing this user's files there, not from
making their own link first, and Linux's fs.protected_symlinks refuses to follow it only where that setting is on. The
path checks passed it: the client's fallback rule (`paths.untrusted_file_reason`, also `moetune query --db`) judged
the file the link led to (this user's), and the store opened and wrote through it. Both now refuse a path with such a
link in it (the last component, a folder on the way, or one a link of this user leads to), naming it and its owner.

The layout needs a second uid (os.lchown, root only); `test_the_walk_with_a_faked_lstat` runs the same rule for any
user with the file system faked."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from moetune.runtime import paths
from moetune.runtime.paths import foreign_sticky_link_reason, untrusted_file_reason
from moetune.tuner.store.store import Store, StoreError

pytestmark = pytest.mark.timeout(60)
OTHER = 54321  # no user of this machine
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another user (os.lchown) needs root")


def _layout(tmp_path: Path) -> tuple[Path, Path]:
    """(sticky, private): a sticky world-writable folder like /tmp, and this user's folder holding a database."""
    sticky, private = tmp_path / "sticky", tmp_path / "home"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    private.mkdir(mode=0o700)
    with Store(private / "mine.db"):
        pass
    return sticky, private


def _link(at: Path, to: Path | str, uid: int) -> Path:
    at.symlink_to(to)
    os.lchown(at, uid, uid)
    return at


@needs_root
def test_another_users_link_in_a_sticky_folder_is_refused(tmp_path: Path) -> None:
    sticky, private = _layout(tmp_path)
    theirs = _link(sticky / "moetune.db", private / "mine.db", OTHER)
    for why in (untrusted_file_reason(theirs), foreign_sticky_link_reason(theirs)):
        assert why is not None and str(theirs) in why and f"uid {OTHER}" in why and "sticky" in why, why
    # a folder on the way, and this user's own link that leads through theirs
    _link(sticky / "dir", private, OTHER)
    assert f"{sticky / 'dir'} is a symbolic link owned by uid {OTHER}" in (untrusted_file_reason(sticky / "dir/mine.db") or "")
    mine = _link(private / "via.db", theirs, 0)
    assert f"{theirs} is a symbolic link owned by uid {OTHER}" in (untrusted_file_reason(mine) or "")


@needs_root
def test_the_store_refuses_to_open_or_create_through_it(tmp_path: Path) -> None:
    sticky, private = _layout(tmp_path)
    before = (private / "mine.db").read_bytes()
    for path in (_link(sticky / "moetune.db", private / "mine.db", OTHER),
                 _link(sticky / "new.db", private / "planted.db", OTHER)):  # dangling: would create the file
        for readonly in (False, True):
            with pytest.raises(StoreError, match=rf"is a symbolic link owned by uid {OTHER}") as e:
                Store(path, readonly=readonly)
            assert e.value.exit_code == 2
    assert (private / "mine.db").read_bytes() == before and not (private / "planted.db").exists()


@needs_root
def test_own_and_roots_links_and_links_outside_sticky_folders_pass(tmp_path: Path) -> None:
    sticky, private = _layout(tmp_path)
    own = _link(sticky / "own.db", private / "mine.db", 0)  # this user's (root's) link: followed
    assert foreign_sticky_link_reason(own) is None and untrusted_file_reason(own) is None
    with Store(own, readonly=True):
        pass
    plain = tmp_path / "plain"  # another user's link in a folder only root may write: not this rule's case
    plain.mkdir(mode=0o755)
    assert foreign_sticky_link_reason(_link(plain / "x.db", private / "mine.db", OTHER)) is None
    assert foreign_sticky_link_reason(sticky / "absent" / "x.db") is None  # nothing there: the open says


def test_the_walk_with_a_faked_lstat(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule without root: /s is sticky and world-writable, /s/l a link of another uid (relative, to ../h/db),
    /s/m this user's link to /s/l. Faked stat results stand in for the file system."""
    me = os.getuid()
    other = me + 1 if me else OTHER

    def st(mode: int, uid: int) -> os.stat_result:
        return os.stat_result((mode, 0, 0, 1, uid, uid, 0, 0, 0, 0))

    tree = {"/s": st(stat.S_IFDIR | 0o1777, 0), "/h": st(stat.S_IFDIR | 0o700, me), "/h/db": st(stat.S_IFREG | 0o600, me),
            "/s/l": st(stat.S_IFLNK | 0o777, other), "/s/m": st(stat.S_IFLNK | 0o777, me),
            "/p": st(stat.S_IFDIR | 0o755, 0), "/p/l": st(stat.S_IFLNK | 0o777, other)}
    links = {"/s/l": "../h/db", "/s/m": "/s/l", "/p/l": "/h/db"}

    def fake_lstat(p: str) -> os.stat_result:
        if p not in tree:
            raise FileNotFoundError(p)
        return tree[p]

    class FakeOs:
        """`os` as the rule's module sees it: the faked calls, the rest real. Patched there only: a global os.stat
        that takes no follow_symlinks broke pytest's own report of a failing assertion (an INTERNALERROR instead)."""

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        lstat = staticmethod(fake_lstat)
        stat = staticmethod(lambda p: tree[p] if p != "/" else st(stat.S_IFDIR | 0o755, 0))
        readlink = staticmethod(lambda p: links[p])

    monkeypatch.setattr(paths, "os", FakeOs())
    for path in ("/s/l", "/s/m", "/h/../s/l"):
        why = foreign_sticky_link_reason(path, me)
        assert why is not None and f"/s/l is a symbolic link owned by uid {other}" in why and "in /s," in why, why
    assert foreign_sticky_link_reason("/p/l", me) is None  # not a sticky world-writable folder
    assert foreign_sticky_link_reason("/h/db", me) is None
    tree["/s/l"] = st(stat.S_IFLNK | 0o777, me)
    assert foreign_sticky_link_reason("/s/m", me) is None


@needs_root
def test_no_lock_file_is_made_where_their_link_points(tmp_path: Path) -> None:
    """The daemon's database lock and the run lock are taken before the store opens, beside the file the links lead
    to: through another user's link, a lock file of this user's appeared in the folder they chose."""
    from moetune.tuner.daemon.errors import DaemonConfigError
    from moetune.tuner.daemon.locks import lock_database
    from moetune.tuner.store.lock_files import take_run_lock

    sticky, private = _layout(tmp_path)
    theirs = _link(sticky / "moetune.db", private / "mine.db", OTHER)
    before = sorted(p.name for p in private.iterdir())
    with pytest.raises(DaemonConfigError, match=rf"is a symbolic link owned by uid {OTHER}"):
        lock_database(theirs)
    with pytest.raises(StoreError, match=rf"is a symbolic link owned by uid {OTHER}"):
        take_run_lock(theirs)
    assert sorted(p.name for p in private.iterdir()) == before
