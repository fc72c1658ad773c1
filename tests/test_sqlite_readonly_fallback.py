"""The read-only opener shared by the store, the runtime's "daemon down" fallback (`db_lookup.db_read`) and `tune show`
(`moetune.runtime.profiles.sqlite_open`): immutable=1 only where mode=ro cannot open the file and no -wal/-journal
holds changes, chosen again for every read, and a read the file changed under is retried, then refused with "changed
while being read; retry", never answered from stale or torn pages nor called "malformed".

Real cases run the reader without root's permission override (setpriv) in a folder owned by nobody, as
tests/test_store_readonly.py does. The interleavings with a writer are forced: the reader waits on a pipe, or a hook
writes at a chosen point of the read."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import event

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import TOKEN_BUCKETS, ProfileKey, ProfileRecord
from moetune.runtime.profiles import db_lookup, sqlite_open
from moetune.tuner.store.store import Store, StoreError

NOBODY = 65534
DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
needs_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to read as a non-writer"
)


def record(fp: str, i: int) -> ProfileRecord:
    key = ProfileKey(fingerprint=fp, software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                     intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=TOKEN_BUCKETS[i % 12])
    return ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5, backend="model:t")


def add(db: Path, n: int, fp: str = "fp-a") -> None:
    with Store(db) as s:
        for i in range(n):
            s.put_profile(record(f"{fp}-{i // 12}", i))


def give_away(folder: Path) -> None:
    folder.chmod(0o755)
    for p in (folder, *folder.iterdir()):
        os.chown(p, NOBODY, NOBODY)


def run_dropped(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DROP, sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


# -- real: a reader that may not write the folder ----------------------------------------------------------------------
@needs_setpriv
def test_a_readonly_store_sees_what_a_writer_added_after_it_was_opened(tmp_path: Path) -> None:
    """The fallback was chosen once and its connection pooled: a read-only Store opened while the daemon was down
    returned 1 profile for its whole life while a writer added 20."""
    shared = tmp_path / "shared"
    shared.mkdir()
    db = shared / "moetune.db"
    add(db, 1)
    give_away(shared)
    code = ("import sys\nfrom moetune.tuner.store.store import Store\n"
            "s = Store(sys.argv[1], readonly=True)\n"
            "print(s.count_profiles(), flush=True)\n"
            "sys.stdin.readline()\n"
            "print(s.count_profiles(), flush=True)\n")
    reader = subprocess.Popen([*DROP, sys.executable, "-c", code, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "1"
        add(db, 20, fp="fp-b")  # the writer (root) adds 20 and closes: checkpointed, no -wal left
        assert not (shared / "moetune.db-wal").exists()
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "21"
    finally:
        reader.kill()
        reader.wait()


def wal_with_a_delete_and_no_shm(shared: Path) -> Path:
    """A database whose one profile is deleted by a commit that is only in the -wal (a writer died), -shm gone."""
    db = shared / "moetune.db"
    add(db, 1)
    code = ("import sqlite3, os, sys\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('PRAGMA wal_autocheckpoint = 0')\n"
            "c.execute('DELETE FROM profiles')\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code, str(db)], check=True, timeout=60)
    assert (shared / "moetune.db-wal").stat().st_size > 0
    (shared / "moetune.db-shm").unlink()
    give_away(shared)
    return db


@needs_setpriv
def test_db_read_refuses_a_wal_it_cannot_apply_instead_of_returning_deleted_rows(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    db = wal_with_a_delete_and_no_shm(shared)
    code = ("import sys, sqlite3\nfrom moetune.runtime.profiles.db_lookup import db_read\n"
            "try:\n    print('rows', db_read(sys.argv[1], 'SELECT count(*) FROM profiles'))\n"
            "except sqlite3.Error as e:\n    print('error', e)\n")
    r = run_dropped(code, str(db))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("error") and f"{db}-wal holds changes" in r.stdout, r.stdout


@needs_setpriv
def test_db_read_reads_a_closed_database_in_a_folder_it_cannot_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    db = shared / "moetune.db"
    add(db, 3)
    give_away(shared)
    code = "import sys\nfrom moetune.runtime.profiles.db_lookup import db_read\nprint(db_read(sys.argv[1], 'SELECT count(*) FROM profiles'))\n"
    r = run_dropped(code, str(db))
    assert r.returncode == 0 and r.stdout.strip() == "[(3,)]", r.stdout + r.stderr


def closed_studies_file(folder: Path) -> str:
    import optuna

    from moetune.tuner.search.storage import make_storage

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    url = f"sqlite:///{folder / 'studies.db'}"
    storage = make_storage(url)
    study = optuna.create_study(study_name="moetune/t", storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    storage.engine.dispose()
    del study, storage
    return url


@needs_setpriv
def test_tune_show_storage_opens_the_daemons_closed_studies_file(tmp_path: Path) -> None:
    """A closed WAL-mode studies file, no -shm, in a folder owned by another user: read with the shared opener
    (not "attempt to write a readonly database")."""
    shared = tmp_path / "shared"
    shared.mkdir()
    url = closed_studies_file(shared)
    assert sorted(p.name for p in shared.iterdir()) == ["studies.db", "studies.db.lock"] or \
        sorted(p.name for p in shared.iterdir()) == ["studies.db"]
    give_away(shared)
    code = ("import sys, optuna\nfrom moetune.tuner.search.storage import open_readonly_storage\n"
            "st = open_readonly_storage(sys.argv[1])\n"
            "print([(s.study_name, s.n_trials) for s in optuna.get_all_study_summaries(st)])\n")
    r = run_dropped(code, url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "[('moetune/t', 2)]", r.stdout
    assert "studies.db-shm" not in {p.name for p in shared.iterdir()}


# -- forced: the fallback in this process (mode=ro made to fail as it does without the -shm), a writer mid-read --------
@pytest.fixture
def fallback(monkeypatch: pytest.MonkeyPatch) -> list[sqlite_open.ReadOnlyConnection]:
    """mode=ro fails as it does for a WAL file without -shm in a folder the reader cannot write; the immutable=1
    connections opened are listed."""
    opened: list[sqlite_open.ReadOnlyConnection] = []

    def no_shm(uri: str, timeout_s: float) -> sqlite_open.ReadOnlyConnection:
        e = sqlite3.OperationalError("attempt to write a readonly database")
        e.sqlite_errorname = "SQLITE_READONLY_DIRECTORY"
        raise e

    real = sqlite_open.connect_readonly

    def connect(path: str | Path, *, timeout_s: float) -> sqlite_open.ReadOnlyConnection:
        con = real(path, timeout_s=timeout_s)
        assert con.immutable
        opened.append(con)
        return con

    monkeypatch.setattr(sqlite_open, "_open_ro", no_shm)
    monkeypatch.setattr(sqlite_open, "connect_readonly", connect)
    return opened


def test_a_store_read_the_file_changed_under_is_run_again(tmp_path: Path, fallback: list) -> None:
    db = tmp_path / "moetune.db"
    add(db, 1)
    with Store(db, readonly=True) as s:
        writes = [3]  # the writer adds 3 profiles while the first read runs, then stops

        @event.listens_for(s.engine, "before_cursor_execute")
        def writer(*_a: object) -> None:
            if writes:
                add(db, writes.pop(), fp="fp-mid")

        before = len(fallback)
        assert s.count_profiles() == 4  # not the 1 the file held when the read's connection was opened
        assert len(fallback) - before == 2  # the first read was thrown away, the second was clean


@pytest.mark.parametrize("malformed", [False, True], ids=["silent", "malformed"])
def test_a_store_read_the_file_keeps_changing_under_says_so(tmp_path: Path, fallback: list, malformed: bool) -> None:
    """Never "malformed" (a user told so may delete a healthy database): the file was being written."""
    db = tmp_path / "moetune.db"
    add(db, 1)
    with Store(db, readonly=True) as s:

        @event.listens_for(s.engine, "before_cursor_execute")
        def writer(*_a: object) -> None:
            add(db, 1, fp=f"fp-{len(fallback)}")
            if malformed:  # what SQLite says on a page a checkpoint rewrote under it
                raise sqlite3.DatabaseError("database disk image is malformed")

        before = len(fallback)
        with pytest.raises(StoreError, match=r"moetune\.db: the database changed while being read .*; retry") as e:
            s.list_profiles()
        assert "malformed" not in str(e.value)
        assert len(fallback) - before == sqlite_open.READ_ATTEMPTS


def test_a_store_read_of_an_unchanged_file_is_not_retried_and_a_real_error_stays(tmp_path: Path, fallback: list) -> None:
    db = tmp_path / "moetune.db"
    add(db, 2)
    with Store(db, readonly=True) as s:
        before = len(fallback)
        assert s.count_profiles() == 2 and len(fallback) - before == 1

        @event.listens_for(s.engine, "before_cursor_execute")
        def broken(*_a: object) -> None:
            raise sqlite3.DatabaseError("database disk image is malformed")

        with pytest.raises(StoreError, match=r"moetune\.db is damaged \(database disk image is malformed\)"):  # kept
            s.count_profiles()
        assert len(fallback) - before == 2  # not retried


def test_db_read_retries_a_read_the_file_changed_under(tmp_path: Path, fallback: list,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "moetune.db"
    add(db, 1)
    writes = [2]
    connect = sqlite_open.connect_readonly

    def connect_then_write(path: str | Path, *, timeout_s: float) -> sqlite_open.ReadOnlyConnection:
        con = connect(path, timeout_s=timeout_s)  # identity taken: a writer now changes the file
        if writes:
            add(db, writes.pop(), fp="fp-mid")
        return con

    monkeypatch.setattr(sqlite_open, "connect_readonly", connect_then_write)
    assert db_lookup.db_read(db, "SELECT count(*) FROM profiles") == [(3,)]
    assert len(fallback) == 2


def test_db_read_of_a_file_that_keeps_changing_is_an_error(tmp_path: Path, fallback: list,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "moetune.db"
    add(db, 1)
    connect = sqlite_open.connect_readonly

    def connect_then_write(path: str | Path, *, timeout_s: float) -> sqlite_open.ReadOnlyConnection:
        con = connect(path, timeout_s=timeout_s)
        add(db, 1, fp=f"fp-{len(fallback)}")
        return con

    monkeypatch.setattr(sqlite_open, "connect_readonly", connect_then_write)
    with pytest.raises(sqlite_open.DatabaseChanged, match=r"changed while being read .*; retry"):
        db_lookup.db_read(db, "SELECT count(*) FROM profiles")
    assert len(fallback) == sqlite_open.READ_ATTEMPTS


def test_the_fallback_is_refused_while_a_wal_holds_changes(tmp_path: Path, fallback: list) -> None:
    db = tmp_path / "moetune.db"
    add(db, 1)
    writer = sqlite3.connect(db, isolation_level=None)
    try:
        writer.execute("PRAGMA wal_autocheckpoint = 0")
        writer.execute("DELETE FROM profiles")
        with pytest.raises(sqlite3.OperationalError, match=r"moetune\.db-wal holds changes"):
            db_lookup.db_read(db, "SELECT count(*) FROM profiles")
        with pytest.raises(StoreError, match=r"moetune\.db-wal holds changes"):
            Store(db, readonly=True)
    finally:
        writer.close()


def test_tune_show_storage_says_changed_not_malformed(tmp_path: Path, fallback: list) -> None:
    import optuna

    from moetune.tuner.search.storage import open_readonly_storage

    url = closed_studies_file(tmp_path)
    st = open_readonly_storage(url)
    assert fallback and all(c.immutable for c in fallback)

    @event.listens_for(st.engine, "before_cursor_execute")
    def writer(*_a: object) -> None:  # a re-tune writes the file while tune show reads it
        con = sqlite3.connect(tmp_path / "studies.db")
        con.execute("UPDATE studies SET study_name = study_name")
        con.execute("CREATE TABLE IF NOT EXISTS t (x)")
        con.commit()
        con.close()
        raise sqlite3.DatabaseError("database disk image is malformed")

    with pytest.raises(sqlite_open.DatabaseChanged, match=r"studies\.db: the database changed while being read"):
        optuna.get_all_study_summaries(st)


def test_a_file_gone_before_the_fallback_is_sqlites_own_error_not_changed(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """mode=ro failed as without a -shm, then the file vanished (a rename, a delete): SQLite's error, not a retried
    'changed while being read'."""
    db = tmp_path / "moetune.db"
    add(db, 1)
    (tmp_path / "moetune.db-wal").write_bytes(b"")  # another connection's: mode=ro is tried, not immutable=1 first

    def no_shm_then_gone(uri: str, timeout_s: float) -> sqlite_open.ReadOnlyConnection:
        db.unlink()
        e = sqlite3.OperationalError("attempt to write a readonly database")
        e.sqlite_errorname = "SQLITE_READONLY_DIRECTORY"
        raise e

    monkeypatch.setattr(sqlite_open, "_open_ro", no_shm_then_gone)
    with pytest.raises(sqlite3.OperationalError) as e:
        sqlite_open.connect_readonly(db, timeout_s=1)
    assert not isinstance(e.value, sqlite_open.DatabaseChanged) and "readonly" in str(e.value)


def test_a_changed_read_is_a_passing_condition_exit_1() -> None:
    from moetune.tuner.store.connect import DatabaseChangedError

    assert DatabaseChangedError("x").exit_code == 1


def test_a_read_leaves_no_wal_or_shm_beside_a_file_nothing_has_open(tmp_path: Path) -> None:
    """mode=ro on a WAL file nothing had open left an empty -wal and -shm behind in a writable folder: beside
    moetune's database after every `profiles list`, and beside another program's WAL file that moetune only looked
    at to refuse. With no -wal/-shm/-journal there, the read is immutable=1 (checked for changes afterwards)."""
    db = tmp_path / "theirs.db"
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE t (x)")
    con.execute("INSERT INTO t VALUES (1)")
    con.commit()
    con.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.db"]
    assert sqlite_open.read(db, lambda c: c.execute("SELECT x FROM t").fetchall(), timeout_s=1) == [(1,)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.db"]
    # while a writer has it open (its -wal and -shm there), the read is mode=ro and sees its committed rows
    w = sqlite3.connect(db)
    w.execute("INSERT INTO t VALUES (2)")
    w.commit()
    c = sqlite_open.connect_readonly(db, timeout_s=1)
    try:
        assert not c.immutable and c.execute("SELECT count(*) FROM t").fetchone() == (2,)
    finally:
        c.close()
        w.close()


def test_a_rollback_journal_file_is_read_under_locks(tmp_path: Path) -> None:
    """immutable=1 first for every file without side files raced a rollback-journal writer between two transactions
    (no -journal then): a tune sharing a studies file read torn pages, "database disk image is malformed". Only a WAL
    file is read immutably (only there does mode=ro leave files behind)."""
    db = tmp_path / "journal.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    c = sqlite_open.connect_readonly(db, timeout_s=1)
    try:
        assert not c.immutable
    finally:
        c.close()


def test_choosing_the_opening_keeps_this_processs_locks_on_a_rollback_journal_file(tmp_path: Path) -> None:
    """Whether a file is WAL (`_is_wal`) was read off its header through a file of our own: closing it dropped every
    POSIX lock this process held on the file, SQLite's included. A rollback-journal file has no side file while its
    connections only read, so a read-only opening during another read of this process (a read-only store's nested
    read, a second reader thread) took that read's SHARED lock: another process could then write under it (here: take
    the EXCLUSIVE lock). SQLite is asked now, and keeps a file's descriptor open while this process holds locks on it."""
    db = tmp_path / "journal.db"
    held = sqlite3.connect(db, isolation_level=None)
    held.execute("CREATE TABLE t (x)")
    held.execute("BEGIN")
    assert held.execute("SELECT count(*) FROM t").fetchone() == (0,)  # a read transaction: SHARED on the file
    writer = ("import sqlite3, sys\nc = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)\n"
              "try:\n    c.execute('BEGIN EXCLUSIVE')\n    print('took')\nexcept sqlite3.OperationalError:\n"
              "    print('held')")

    def other_process() -> str:
        return subprocess.run([sys.executable, "-c", writer, str(db)], capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip()

    try:
        assert other_process() == "held"
        c = sqlite_open.connect_readonly(db, timeout_s=1)
        try:
            assert not c.immutable and c.execute("SELECT count(*) FROM t").fetchone() == (0,)
        finally:
            c.close()
        assert other_process() == "held"  # was "took"
    finally:
        held.execute("COMMIT")
        held.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.db"]


def test_a_wal_file_is_still_told_from_a_rollback_journal_one(tmp_path: Path) -> None:
    """`_is_wal` asks SQLite (a nolock=1 connection, which cannot open a WAL file's wal-index): True for a WAL file,
    False for a rollback-journal file, an empty file, a file that is no database and a missing one; nothing is left
    beside any of them."""
    wal, journal = tmp_path / "wal.db", tmp_path / "journal.db"
    for path, mode in ((wal, "WAL"), (journal, "DELETE")):
        con = sqlite3.connect(path)
        con.execute(f"PRAGMA journal_mode={mode}")
        con.execute("CREATE TABLE t (x)")
        con.commit()
        con.close()
    (tmp_path / "empty.db").write_bytes(b"")
    (tmp_path / "text").write_bytes(b"not a database\n" * 100)
    assert sqlite_open._is_wal(wal)
    for other in (journal, tmp_path / "empty.db", tmp_path / "text", tmp_path / "missing"):
        assert not sqlite_open._is_wal(other), other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db", "journal.db", "text", "wal.db"]
