"""`serve --create` looked at which of the database's files were absent before it took the database's locks: a database
another process created in between (a bring-up, or a daemon that served and stopped, each under those locks) was then
taken as this start's own, and a start refused afterwards (its metrics port taken) deleted it with what it held. The
files are now looked at under the locks, just before the store opens the database: one that is there then is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

# run in a process of its own (run_daemon sets up logging and signal handlers): the database's lock is wrapped so that
# another process's database appears between the start's first look and its lock, as a race would have it
_SCRIPT = textwrap.dedent("""
    import sys
    from moetune.tuner.daemon import server
    from moetune.tuner.store.store import Store

    db, sock, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real = server.lock_database
    made = []

    def lock_database(path):
        if not made:  # once: what another process did just before this start's lock
            made.append(True)
            Store(db).close()
        return real(path)

    server.lock_database = lock_database
    try:
        server.run_daemon(db=db, socket=sock, metrics_port=port, rediscover_interval=0, create_db=True)
    except server.DaemonConfigError as e:
        print("refused:", e)
""")


def test_a_database_made_before_the_lock_is_not_removed(tmp_path: Path, taken_port: int) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "new.db"
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(db), f"ipc://{tmp_path / 'run' / 'd.sock'}",
                        str(taken_port)], capture_output=True, text=True, timeout=100, env=env)
    assert "refused:" in r.stdout and "--metrics-port" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert db.is_file(), sorted(p.name for p in folder.iterdir())  # the other process's database stays


# the database's locks are released when the refused start closes (start()'s clean-up), and taken again by the
# removal: a process that stores profiles in that gap (a `moetune tune` started then) has them in the new file
_GAP_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[4])
    import daemon_fakes as F
    from moetune.tuner.daemon import server

    db, sock, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real = server.lock_database
    calls = []

    def lock_database(path):
        calls.append(path)
        if len(calls) == 2:  # the removal's: another process stored profiles just before it
            store = F.open_store(db)
            F.seed_profiles(store, F.FakeFacts({"gpu_model": "H200"}))
            store.close()
        return real(path)

    server.lock_database = lock_database
    try:
        server.run_daemon(db=db, socket=sock, metrics_port=port, rediscover_interval=0, create_db=True)
    except server.DaemonConfigError as e:
        print("refused:", e)
""")


def test_profiles_stored_in_the_new_database_since_keep_it(tmp_path: Path, taken_port: int) -> None:
    import sqlite3

    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "new.db"
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
    r = subprocess.run([sys.executable, "-c", _GAP_SCRIPT, str(db), f"ipc://{tmp_path / 'run' / 'd.sock'}",
                        str(taken_port), str(Path(__file__).resolve().parent)],
                       capture_output=True, text=True, timeout=100, env=env)
    assert "refused:" in r.stdout and "--metrics-port" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert db.is_file(), (r.stdout + r.stderr)[-3000:]
    con = sqlite3.connect(db)
    try:
        assert con.execute("SELECT count(*) FROM profiles").fetchone()[0] == 3
    finally:
        con.close()
    assert "not removing the new database" in r.stderr and "holds 3 profile(s)" in r.stderr, r.stderr[-3000:]


# the removal finds the database's lock held (here by another open file of this process, its pid written in it: a
# process that opened the new file since): the file is kept, and the warning says so, not the start's advice
_HELD_SCRIPT = textwrap.dedent("""
    import os, sys
    from moetune.tuner.daemon import server

    db, sock, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real = server.lock_database
    calls = []

    def lock_database(path):
        calls.append(path)
        if len(calls) == 2:  # the removal's: another holder takes the lock just before it (kept open to the end)
            calls.append(real(path))
        return real(path)

    server.lock_database = lock_database
    print("pid:", os.getpid())
    try:
        server.run_daemon(db=db, socket=sock, metrics_port=port, rediscover_interval=0, create_db=True)
    except server.DaemonConfigError as e:
        print("refused:", e)
""")


def test_a_new_database_another_process_has_open_is_kept_without_the_starts_advice(tmp_path: Path,
                                                                                  taken_port: int) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "new.db"
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
    r = subprocess.run([sys.executable, "-c", _HELD_SCRIPT, str(db), f"ipc://{tmp_path / 'run' / 'd.sock'}",
                        str(taken_port)], capture_output=True, text=True, timeout=100, env=env)
    assert "refused:" in r.stdout and "--metrics-port" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert db.is_file(), (r.stdout + r.stderr)[-3000:]
    pid = r.stdout.split("pid:")[1].split()[0]
    err = " ".join(r.stderr.split())
    assert f"keeping the new database {db}" in err, err[-3000:]
    assert f"another process has it open (pid {pid}); nothing to do" in err, err[-3000:]
    assert "stop it first" not in err and "serve another database" not in err, err[-3000:]


# the removal cannot unlink the new database (EACCES from a folder made read-only since, EBUSY, EROFS): a non-root check
# with a real read-only folder is impossible where tests run as root, so unlink is patched to refuse the database
_UNLINK_SCRIPT = textwrap.dedent("""
    import errno, pathlib, sys
    from moetune.tuner.daemon import server

    db, sock, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real_unlink = pathlib.Path.unlink

    def unlink(self, missing_ok=False):
        if self.name == pathlib.Path(db).name:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_unlink(self, missing_ok)

    pathlib.Path.unlink = unlink
    try:
        server.run_daemon(db=db, socket=sock, metrics_port=port, rediscover_interval=0, create_db=True)
    except server.DaemonConfigError as e:
        print("refused:", e)
""")


def test_a_new_database_that_cannot_be_removed_is_warned_and_the_refusal_still_said(tmp_path: Path,
                                                                                   taken_port: int) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "new.db"
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
    r = subprocess.run([sys.executable, "-c", _UNLINK_SCRIPT, str(db), f"ipc://{tmp_path / 'run' / 'd.sock'}",
                        str(taken_port)], capture_output=True, text=True, timeout=100, env=env)
    # the real refusal (the metrics port), not the clean-up's PermissionError
    assert "refused:" in r.stdout and "--metrics-port" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    err = " ".join(r.stderr.split())
    assert f"could not remove {db}" in err and "Permission denied" in err, err[-3000:]
    assert "removed the new database" not in err, err[-3000:]
    assert db.is_file()
