"""`serve --create` looked at which of the database's files were absent before it took the database's locks: a database
another process created in between (a bring-up, or a daemon that served and stopped, each under those locks) was then
taken as this start's own, and a start refused afterwards (its metrics port taken) deleted it with what it held. The
files are now looked at under the locks, just before the store opens the database: one that is there then is kept."""

from __future__ import annotations

import os
import socket
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


@pytest.fixture
def taken_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_a_database_made_before_the_lock_is_not_removed(tmp_path: Path, taken_port: int) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "new.db"
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(db), f"ipc://{tmp_path / 'run' / 'd.sock'}",
                        str(taken_port)], capture_output=True, text=True, timeout=100, env=env)
    assert "refused:" in r.stdout and "--metrics-port" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert db.is_file(), sorted(p.name for p in folder.iterdir())  # the other process's database stays
