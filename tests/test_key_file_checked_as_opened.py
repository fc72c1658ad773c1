"""A CURVE key file was checked by its path ("a regular file?") and then opened by its path again: a FIFO put in its
place between the two had the open wait for a writer (the client's constructor, every EP buffer's autoload, hung),
and the client's mode warning judged whatever was at the path then. The file is now opened once (O_NONBLOCK) and
every check is of the descriptor opened."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from moetune.runtime.profiles import curve_keys
from moetune.runtime.profiles.curve_keys import read_curve_key_file
from moetune.tuner.cli.keys import generate_keys

pytestmark = pytest.mark.timeout(30)


@contextmanager
def _unblocker(fifo: Path) -> Iterator[threading.Event]:
    """A writer that opens `fifo` if the read has not returned within 20 s: a reader stuck in the FIFO's open (the old
    code's failure mode) is let go, and the event it sets says so. No clock is compared: a loaded machine that is slow
    to run the read does not fail it, a read that waits on the FIFO always does."""
    done, unblocked = threading.Event(), threading.Event()

    def writer() -> None:
        if not done.wait(20):
            unblocked.set()
            with open(fifo, "wb"):
                pass

    threading.Thread(target=writer, daemon=True).start()
    try:
        yield unblocked
    finally:
        done.set()


def test_a_fifo_swapped_in_after_the_checks_never_blocks_the_read(tmp_path: Path, monkeypatch) -> None:
    public, _secret = generate_keys(tmp_path / "keys")
    key = Path(public)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    swapped: list[str] = []

    def swap(when: str) -> None:
        if not swapped:
            os.replace(fifo, key)
            swapped.append(when)

    real_is_file, real_open = Path.is_file, os.open

    def swap_after_check(self: Path) -> bool:  # the race at its worst: the check by path passes, then the FIFO is put there
        ok = real_is_file(self)
        if self == key:
            swap("after the is_file check")
        return ok

    def swap_before_open(path, flags, *args, **kwargs):  # a reader that opens first: the FIFO is there when it opens
        if Path(path) == key:
            swap("before os.open")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(Path, "is_file", swap_after_check)
    monkeypatch.setattr(os, "open", swap_before_open)
    with _unblocker(key) as unblocked, pytest.raises(ValueError, match="not a regular file"):
        read_curve_key_file(key)  # the FIFO opened, and refused at once: never a wait
    assert swapped, "the FIFO was never put at the key's path: the test did not race the read"
    assert not unblocked.is_set(), f"the read waited on a FIFO swapped in {swapped[0]}"


def test_the_stat_is_the_opened_files(tmp_path: Path, monkeypatch) -> None:
    from moetune.runtime.profiles.curve_keys import read_curve_key_file_stat

    public, _secret = generate_keys(tmp_path / "keys")
    os.chmod(public, 0o666)  # loose: what the client's warning is about
    pub, sec, st = read_curve_key_file_stat(public)
    assert sec is None and len(pub) == 40
    assert st.st_ino == os.stat(public).st_ino and st.st_mode & 0o777 == 0o666
    # the warning judges the file that was read, not one put at its path since
    os.replace(public, tmp_path / "gone")
    Path(public).write_text("")
    os.chmod(public, 0o600)
    said: list[str] = []
    monkeypatch.setattr(curve_keys._once, "say_once", lambda _k, _p, msg, **_kw: said.append(msg))
    curve_keys.warn_loose_server_key(str(public), st)
    assert said and "mode 666" in said[0]


def test_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "k.key"
    os.mkfifo(fifo, 0o600)
    with _unblocker(fifo) as unblocked, pytest.raises(ValueError, match="not a regular file"):
        read_curve_key_file(fifo)
    assert not unblocked.is_set(), "the read waited on the FIFO"


def test_without_proc_the_error_says_so(tmp_path: Path) -> None:
    """The key file is read through /proc/self/fd (its checked descriptor): where this process has no /proc (a chroot
    or sandbox without it, a /proc of another PID namespace) the read fails, and the error must say that, not that a
    file named /proc/self/fd/N is an "Invalid certificate file" (what zmq says of a path that is not there)."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("umount") is None:
        pytest.skip("a mount namespace without /proc needs root and unshare")
    public, _secret = generate_keys(tmp_path / "keys")
    code = ("from moetune.runtime.profiles.curve_keys import read_curve_key_file as r\n"
            f"try:\n    r({str(public)!r})\nexcept ValueError as e:\n    print('REFUSED', e)\n")
    run = subprocess.run(["unshare", "-m", "sh", "-c", 'umount -l /proc && exec "$0" -c "$1"', sys.executable, code],
                         capture_output=True, text=True, timeout=60)
    if run.returncode != 0 and "REFUSED" not in run.stdout:
        pytest.skip(f"cannot unmount /proc in a new mount namespace here: {run.stderr.strip()[:200]}")
    assert "REFUSED" in run.stdout, (run.stdout, run.stderr)
    assert "/proc" in run.stdout and "not mounted" in run.stdout and "Invalid certificate file" not in run.stdout, \
        run.stdout


def test_a_socket_is_refused_as_not_a_regular_file(tmp_path: Path) -> None:
    """A unix socket at the key path cannot be opened (ENXIO): it is refused as what it is, as before the file was
    opened first ("is not a regular file"), not as 'cannot be read (No such device or address)'."""
    import socket

    path = tmp_path / "k.key"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(path))
        with pytest.raises(ValueError, match="is not a regular file"):
            read_curve_key_file(path)
    finally:
        s.close()
