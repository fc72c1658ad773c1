"""`moetune keys` writes its key files with the one atomic writer (tuner/store/atomic_files.py), 0600 from creation.

Every key file is a new temporary file (O_EXCL, never a link) created 0600, fsynced, then renamed into place. A fixed
temporary name (`.NAME.key.tmp`) with a plain write would write through a link left there (the file it names getting
the key) and rename the link into the allow-list; permissions from a process-wide umask would touch other threads'
files too, rather than come from the file's own creation.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moetune.tuner.cli import keys
from moetune.tuner.store.atomic_files import write_atomic


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """The mode each file was created with (os.open with O_CREAT), by name, under a umask that narrows nothing: a
    file written world-readable and chmod-ed afterwards would show here."""
    made: dict[str, int] = {}
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, *a: Any, **kw: Any) -> int:
        fd = real_open(path, flags, mode, *a, **kw)
        if flags & os.O_CREAT and stat.S_ISREG(os.fstat(fd).st_mode):
            made[Path(path).name] = mode
        return fd

    monkeypatch.setattr(os, "open", spy)
    old = os.umask(0)
    yield made
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_key_files_are_owner_only_from_their_creation(tmp_path: Path, created: dict[str, int]) -> None:
    server = tmp_path / "server"
    public, secret = keys.generate_keys(server)
    client_pub, client_sec = keys.generate_keys(tmp_path / "client", "c")
    [allowed] = keys.allow_everywhere(client_pub, server, None, None, admin=False, force=False)
    for p in (public, secret, client_pub, client_sec, allowed):
        assert _mode(p) == 0o600, p
    temps = [name for name in created if name.endswith(".tmp")]
    assert len(temps) == 5, created  # each key file was a temporary file first, renamed into place
    assert {created[name] & 0o777 for name in temps} == {0o600}, created
    assert sorted(p.name for p in server.iterdir()) == ["clients", "moetune.key", "moetune.key_secret"]
    assert [p.name for p in (server / "clients").iterdir()] == ["c.key"]  # no temporary file left


def test_allow_never_writes_through_a_link_at_a_temporary_name(tmp_path: Path) -> None:
    server = tmp_path / "server"
    keys.generate_keys(server)
    client_pub, _ = keys.generate_keys(tmp_path / "client", "c")
    clients = server / "clients"
    clients.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("mine\n")
    (clients / ".c.key.tmp").symlink_to(elsewhere)  # a link left where the old fixed temporary name was
    [allowed] = keys.allow_everywhere(client_pub, server, None, None, admin=False, force=False)
    assert elsewhere.read_text() == "mine\n"  # not written through
    assert not allowed.is_symlink() and allowed.read_bytes() == client_pub.read_bytes()
    assert _mode(allowed) == 0o600


def test_allow_with_force_replaces_a_link_it_finds_instead_of_writing_through_it(tmp_path: Path) -> None:
    server = tmp_path / "server"
    keys.generate_keys(server)
    client_pub, _ = keys.generate_keys(tmp_path / "client", "c")
    clients = server / "clients"
    clients.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.key"
    elsewhere.write_text("mine\n")
    (clients / "c.key").symlink_to(elsewhere)
    with pytest.raises(FileExistsError, match="exists \\(use --force to overwrite\\)"):
        keys.allow_everywhere(client_pub, server, None, None, admin=False, force=False)
    [allowed] = keys.allow_everywhere(client_pub, server, None, None, admin=False, force=True)
    assert elsewhere.read_text() == "mine\n"
    assert not allowed.is_symlink() and allowed.read_bytes() == client_pub.read_bytes()


def test_write_atomic_with_a_mode_creates_the_file_with_it(tmp_path: Path, created: dict[str, int]) -> None:
    p = tmp_path / "k"
    p.write_text("old\n")
    os.chmod(p, 0o644)
    write_atomic(p, "new\n", mode=0o600)  # the mode asked for, not the old file's
    assert p.read_text() == "new\n" and _mode(p) == 0o600
    assert [m & 0o777 for name, m in created.items() if name.endswith(".tmp")] == [0o600]
    q = tmp_path / "q"
    write_atomic(q, "x")  # without: as any new file (0o666 less the umask, here 0)
    assert _mode(q) == 0o666
