"""`moetune db upgrade` / `db downgrade` on a database a daemon serves: refused (exit 1, naming the daemon's pid and
the database) and the schema left as it was. They migrated it under the daemon, which then logged "no such column:
profiles.perf_env" on every rebuild and never rebuilt its index. A migration holds the daemon's lock while it runs."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, head_revision

pytestmark = pytest.mark.timeout(90)

runner = CliRunner()


def run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args), env={"MOETUNE_CONFIG": ""})
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r.exit_code, " ".join(r.output.split())


def _revision(db: Path) -> str | None:
    with Store(db, readonly=True, check_schema=False) as s:
        return s.current_revision()


def _hold(lock: Path, content: str) -> int:
    """Flock `lock` as a serving daemon does (an fd of this process: flock locks per open file)."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, content.encode())
    return fd


def test_migrations_are_refused_while_a_daemon_serves(tmp_path: Path) -> None:
    with F.seeded_daemon(tmp_path) as (d, _facts):
        for args in (("downgrade", "0004", "--yes"), ("upgrade", "--revision", "base"), ("upgrade",)):
            code, text = run("db", *args, "--db", str(d.db))
            assert code == 1, (args, text)
            assert f"daemon pid {d.proc.pid} is serving this database ({d.db}); stop it first" in text, text
        assert _revision(d.db) == head_revision()
        assert "no such column" not in d.read_log()
    code, text = run("db", "downgrade", "0004", "--yes", "--db", str(d.db))  # stopped: its lock is free
    assert code == 0 and _revision(d.db) == "0004", text


def test_upgrade_is_refused_while_the_lock_is_held(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with Store(db) as s:
        s.downgrade("0004")
    for content, said in ((f"{os.getpid()}\n", f"daemon pid {os.getpid()} is serving this database ({db})"),
                          ("", f"another moetune process holds {db}.daemon-lock")):  # no pid yet: one starting
        fd = _hold(tmp_path / "m.db.daemon-lock", content)
        try:
            code, text = run("db", "upgrade", "--db", str(db))
            assert code == 1 and said in text, text
            assert _revision(db) == "0004"
        finally:
            os.close(fd)
    assert run("db", "upgrade", "--db", str(db))[0] == 0 and _revision(db) == head_revision()


def test_a_link_to_the_database_takes_the_same_lock(tmp_path: Path) -> None:
    """A second path to one database (a link to the file, or to a folder above it) found no daemon holding its own
    `<link>.daemon-lock` while one served the file: two daemons, or a migration under a serving daemon."""
    real = tmp_path / "data"
    real.mkdir()
    db = real / "m.db"
    with Store(db) as s:
        s.downgrade("0004")
    (tmp_path / "m-link.db").symlink_to(db)
    (tmp_path / "data-link").symlink_to(real)
    fd = _hold(real / "m.db.daemon-lock", f"{os.getpid()}\n")
    try:
        for given in (tmp_path / "m-link.db", tmp_path / "data-link" / "m.db"):
            code, text = run("db", "upgrade", "--db", str(given))
            assert code == 1 and f"daemon pid {os.getpid()} is serving this database" in text, (given, text)
        assert _revision(db) == "0004"
    finally:
        os.close(fd)
    assert not (tmp_path / "m-link.db.daemon-lock").exists()


def test_a_migration_holds_the_lock_and_creates_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "m.db"
    assert run("db", "upgrade", "--db", str(db))[0] == 0
    assert not (tmp_path / "m.db.daemon-lock").exists()  # another user's daemon could not take one of ours
    (tmp_path / "m.db.daemon-lock").write_text("")  # a daemon served it once
    held: list[bool] = []
    real = Store.downgrade

    def downgrade(self: Store, revision: str) -> None:
        fd = os.open(tmp_path / "m.db.daemon-lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:  # a daemon starting now is refused
            held.append(True)
        finally:
            os.close(fd)
        real(self, revision)

    monkeypatch.setattr(Store, "downgrade", downgrade)
    assert run("db", "downgrade", "0004", "--yes", "--db", str(db))[0] == 0
    assert held == [True] and _revision(db) == "0004"


def test_a_daemon_starting_during_a_migration_leaves_the_database_alone(tmp_path: Path) -> None:
    """The other order: `db downgrade` holds the lock (no pid in it) when `moetune serve` starts on the database. The
    daemon takes the lock before opening the store (whose open would upgrade the database back under the
    migration): exit 1 naming the lock, the downgraded schema untouched."""
    import subprocess

    db = tmp_path / "m.db"
    with Store(db) as s:
        s.downgrade("0004")
    fd = _hold(tmp_path / "m.db.daemon-lock", "")  # as `no_daemon_serving` holds it during a migration
    try:
        env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
        r = subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "serve", "--db",
                            str(db), "--socket", f"ipc://{tmp_path}/run/daemon.sock"],
                           capture_output=True, text=True, timeout=60, env=env)
    finally:
        os.close(fd)
    assert r.returncode == 1, r.stderr
    assert "is using the database" in r.stderr and "db upgrade/downgrade" in r.stderr and "Traceback" not in r.stderr
    assert _revision(db) == "0004"


def test_profiles_import_and_delete_are_refused_while_a_daemon_serves(tmp_path: Path) -> None:
    """The daemon is its database's single writer and serves what it loaded: `profiles delete` and `import` under it
    only printed a note (the daemon kept serving the deleted profile). Refused now, nothing written, no traceback;
    --force writes anyway."""
    with F.seeded_daemon(tmp_path) as (d, _facts):
        with Store(d.db, readonly=True) as s:
            ids = [pid for pid, _rec in s.list_profiles()]
        exported = tmp_path / "e.json"
        assert run("profiles", "export", str(exported), "--db", str(d.db))[0] == 0
        code, text = run("profiles", "delete", str(ids[0]), "--yes", "--db", str(d.db))
        assert code == 1 and f"daemon pid {d.proc.pid} is serving this database ({d.db}); stop it first" in text, text
        assert "Traceback" not in text
        code, text = run("profiles", "import", str(exported), "--db", str(d.db))
        assert code == 1 and f"daemon pid {d.proc.pid} is serving this database" in text, text
        with Store(d.db, readonly=True) as s:
            assert [pid for pid, _rec in s.list_profiles()] == ids  # nothing deleted, nothing imported
        assert d.wait_ready().protocol == 1  # the daemon serves on
        code, text = run("profiles", "delete", str(ids[0]), "--yes", "--force", "--db", str(d.db))
        assert code == 0 and f"note: daemon pid {d.proc.pid} serves {d.db}" in text, text
    code, text = run("profiles", "delete", str(ids[1]), "--yes", "--db", str(d.db))  # stopped: allowed
    assert code == 0, text
