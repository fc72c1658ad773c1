"""moetune's own data folder ($MOETUNE_HOME, else the XDG data dir), where the database, its lock files and (under
$MOETUNE_HOME) the daemon's runtime directory live, is never created writable by other users, whatever the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from moetune.tuner.store._folders import make_parent
from moetune.tuner.store._schema import StoreError


@pytest.mark.parametrize("umask", [0o000, 0o002, 0o022, 0o077])
def test_data_folder_is_not_created_writable_by_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        umask: int) -> None:
    """A daemon started with UMask=0000 (a service) made $MOETUNE_HOME 0777: anyone could replace the database it
    serves and every job falls back to, or plant a link as its -journal; and its own socket check then refused the
    folder (the runtime directory is $MOETUNE_HOME/run), so it did not start either. Readable as the umask says
    (jobs of other users may read the database); never group- or world-writable."""
    home = tmp_path / "a" / "home"
    monkeypatch.setenv("MOETUNE_HOME", str(home))
    old = os.umask(umask)
    try:
        make_parent(home / "moetune.db", StoreError)
    finally:
        os.umask(old)
    for d in (tmp_path / "a", home):
        mode = stat.S_IMODE(os.stat(d).st_mode)
        assert mode == 0o777 & ~(umask | 0o022), f"{d}: {mode:o}"


def test_data_folder_lets_the_daemon_bind_under_umask_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.daemon.runtime_dir import check_socket_ancestors

    home = tmp_path / "home"
    monkeypatch.setenv("MOETUNE_HOME", str(home))
    old = os.umask(0)
    try:
        make_parent(home / "moetune.db", StoreError)
    finally:
        os.umask(old)
    check_socket_ancestors(home / "run")  # raised: "writable by every user without the sticky bit"
