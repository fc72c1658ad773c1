"""Read commands on a database the user cannot write (a shared /var/lib/moetune owned by the daemon's user, the
daemon down): they read it, and never through SQLite's immutable=1 while a -wal holds changes the file lacks.

Root's permission override is dropped with setpriv (as `setpriv --bounding-set=-dac_override,...`), and the folder
and files are given to nobody (65534), so the folder is not writable and SQLite cannot make the -shm it wants."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import TOKEN_BUCKETS, ProfileKey, ProfileRecord
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to read as a non-writer"
)
NOBODY = 65534
DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def fill(db: Path, n: int) -> None:
    with Store(db) as s:
        for i in range(n):
            key = ProfileKey(fingerprint="fp-ro", software="sw", transport_family="nvlink", ep_size=2, nodes=1,
                             hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=TOKEN_BUCKETS[i])
            s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5,
                                        backend="model:t"))


def give_away(folder: Path) -> None:
    folder.chmod(0o755)
    for p in (folder, *folder.iterdir()):
        os.chown(p, NOBODY, NOBODY)


def moetune(*args: str) -> subprocess.CompletedProcess:
    """The CLI without root's override of file permissions."""
    cmd = [*DROP, sys.executable, "-c", "from moetune.tuner.cli import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_read_commands_on_a_closed_database_in_a_folder_the_user_cannot_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    db = shared / "moetune.db"
    fill(db, 2)
    assert sorted(p.name for p in shared.iterdir()) == ["moetune.db"]  # the writer closed: no -wal/-shm
    give_away(shared)
    out = tmp_path / "export.json"
    for args in (["profiles", "list"], ["db", "current"], ["db", "check"], ["profiles", "show", "1"],
                 ["profiles", "export", str(out)]):
        r = moetune(*args, "--db", str(db))
        assert r.returncode == 0, f"{args}: {r.stdout}{r.stderr}"
        assert "Traceback" not in r.stderr
    assert "exported 2 profile(s)" in r.stdout and out.is_file()
    assert sorted(p.name for p in shared.iterdir()) == ["moetune.db"]


def test_a_live_writers_wal_is_read(tmp_path: Path) -> None:
    """A writer holds the WAL database open with a commit that is only in the -wal: the reader sees it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    db = shared / "moetune.db"
    fill(db, 1)
    con = sqlite3.connect(db, isolation_level=None)
    try:
        con.execute("PRAGMA wal_autocheckpoint = 0")
        con.execute("UPDATE profiles SET backend = 'model:in-wal'")
        give_away(shared)
        r = moetune("profiles", "show", "1", "--db", str(db))
        assert r.returncode == 0 and "model:in-wal" in r.stdout, r.stdout + r.stderr
    finally:
        con.close()


def test_a_wal_with_changes_but_no_shm_is_an_error_not_old_rows(tmp_path: Path) -> None:
    """A writer died (or a copy lost the -shm): committed rows are only in the -wal, and a reader that may not write
    the folder cannot rebuild the -shm to read them. immutable=1 would read the database file alone: a profile
    missing without a word. It must be an error that names the -wal."""
    shared = tmp_path / "shared"
    shared.mkdir()
    db = shared / "moetune.db"
    fill(db, 1)
    code = ("import sqlite3, os, sys\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('PRAGMA wal_autocheckpoint = 0')\n"
            "c.execute('DELETE FROM profiles')\n"
            "os._exit(0)\n")  # dies holding the database: the -wal stays
    subprocess.run([sys.executable, "-c", code, str(db)], check=True, timeout=60)
    wal = shared / "moetune.db-wal"
    assert wal.stat().st_size > 0
    (shared / "moetune.db-shm").unlink()
    give_away(shared)
    r = moetune("profiles", "list", "--db", str(db), "--json")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{wal} holds changes" in r.stderr and "Traceback" not in r.stderr
    # In-process too: the Store says so instead of answering from the database file alone.
    code = ("import sys\nfrom moetune.tuner.store.store import Store, StoreError\n"
            "try:\n    Store(sys.argv[1], readonly=True).list_profiles()\nexcept StoreError as e:\n"
            "    print(e); sys.exit(3)\n")
    r = subprocess.run([*DROP, sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "holds changes" in r.stdout, r.stdout + r.stderr
