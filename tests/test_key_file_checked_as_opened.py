"""A CURVE key file was checked by its path ("a regular file?") and then opened by its path again: a FIFO put in its
place between the two had the open wait for a writer (the client's constructor, every EP buffer's autoload, hung),
and the client's mode warning judged whatever was at the path then. The file is now opened once (O_NONBLOCK) and
every check is of the descriptor opened."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from moetune.runtime.profiles import curve_keys
from moetune.runtime.profiles.curve_keys import read_curve_key_file
from moetune.tuner.cli.keys import generate_keys

pytestmark = pytest.mark.timeout(30)


def test_a_fifo_swapped_in_after_the_checks_never_blocks_the_read(tmp_path: Path, monkeypatch) -> None:
    public, _secret = generate_keys(tmp_path / "keys")
    key = Path(public)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    real_is_file = Path.is_file

    def swap_after_check(self: Path) -> bool:  # the race at its worst: the check passes, then the FIFO is put there
        ok = real_is_file(self)
        if self == key and fifo.exists():
            os.replace(fifo, key)
        return ok

    monkeypatch.setattr(Path, "is_file", swap_after_check)
    # unblocks a reader stuck in the FIFO's open after a while (it then reads nothing): the old code's failure mode
    done = threading.Event()

    def writer() -> None:
        if not done.wait(3):
            with open(key, "wb"):
                pass

    threading.Thread(target=writer, daemon=True).start()
    t0 = time.monotonic()
    try:
        read_curve_key_file(key)  # the regular file opened (no swap), or refused at once: never a wait
    except ValueError as e:
        assert "not a regular file" in str(e)
    finally:
        elapsed = time.monotonic() - t0
        done.set()
    assert elapsed < 2, f"the read waited {elapsed:.1f} s on a FIFO swapped in after its check"


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
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="not a regular file"):
        read_curve_key_file(fifo)
    assert time.monotonic() - t0 < 2


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
