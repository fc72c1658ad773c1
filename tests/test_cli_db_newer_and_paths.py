"""`moetune db` on a database a newer moetune wrote (an unknown revision): every command says so and exits non-zero,
nothing is migrated. A database in a folder that does not exist is refused (the folder is named, never created),
except moetune's own data folder ($MOETUNE_HOME), which is made as before."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, head_revision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_env import child_env

CAPTURE = Path(__file__).parent / "captures" / "h200x1"
runner = CliRunner()
NEWER = "written by a newer moetune"


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env)


def newer_db(tmp_path: Path) -> Path:
    db = tmp_path / "m.db"
    Store(db).close()
    con = sqlite3.connect(db)
    con.execute("UPDATE moetune_alembic_version SET version_num = '0099'")
    con.commit()
    con.close()
    return db


def revision(db: Path) -> str:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT version_num FROM moetune_alembic_version").fetchone()[0]
    finally:
        con.close()


def test_db_current_on_a_newer_database_says_so_and_fails(tmp_path: Path) -> None:
    db = newer_db(tmp_path)
    for extra in ([], ["--json"]):
        r = run("db", "current", "--db", str(db), *extra)
        assert r.exit_code == 2, r.output
        assert "revision 0099" in r.stderr and NEWER in r.stderr and "needs `moetune db upgrade`" not in r.output
        assert r.stdout == ""


def test_db_upgrade_and_downgrade_on_a_newer_database_refuse_cleanly(tmp_path: Path) -> None:
    db = newer_db(tmp_path)
    for args in (["db", "upgrade"], ["db", "upgrade", "--revision", "0005"], ["db", "downgrade", "0005", "--yes"]):
        r = run(*args, "--db", str(db))
        assert r.exit_code == 2, r.output
        assert NEWER in r.stderr and "Can't locate revision" not in r.stderr, r.stderr
        assert revision(db) == "0099"


def test_db_upgrade_refuses_a_db_in_a_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    r = run("db", "upgrade", "--db", str(missing / "m.db"), env={"MOETUNE_HOME": str(tmp_path / "home")})
    assert r.exit_code == 2, r.output
    assert f"the folder {missing} does not exist" in r.stderr
    assert not missing.exists()


def test_db_upgrade_refuses_a_configured_db_in_a_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "deeper"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\ndb = "{missing / "moetune.db"}"\n')
    r = run("db", "upgrade", "--config", str(cfg), env={"MOETUNE_HOME": str(tmp_path / "home")})
    assert r.exit_code == 2, r.output
    assert f"the folder {missing} does not exist" in r.stderr
    assert not (tmp_path / "nonexistent").exists() and not (tmp_path / "home").exists()


def test_the_default_home_is_still_created(tmp_path: Path) -> None:
    home = tmp_path / "a" / "home"
    r = run("db", "upgrade", env={"MOETUNE_HOME": str(home)})
    assert r.exit_code == 0, r.output
    assert (home / "moetune.db").is_file()
    r = run("db", "current", "--json", env={"MOETUNE_HOME": str(home)})
    assert json.loads(r.stdout)["revision"] == head_revision()


def test_serve_refuses_a_db_in_a_missing_folder(tmp_path: Path) -> None:
    """The daemon made the folder of any --db itself; it now leaves that to the store (its own data folder only)."""
    missing = tmp_path / "nonexistent"
    cmd = [sys.executable, "-c", "from moetune.tuner.cli import main; main()", "serve", "--db", str(missing / "m.db"),
           "--socket", f"ipc://{tmp_path}/d.sock", "--capture", str(CAPTURE), "--rediscover-interval", "0"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                           env=child_env(MOETUNE_HOME=str(tmp_path / "home")))
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve started with its database in a folder it created: {missing}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"the folder {missing} does not exist" in r.stderr and "Traceback" not in r.stderr
    assert not missing.exists()


def test_db_check_on_a_newer_database_says_it_was_written_by_a_newer_moetune(tmp_path: Path) -> None:
    db = newer_db(tmp_path)
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    for extra in ([], ["--json"]):
        r = run("db", "check", "--db", str(db), *extra)
        assert r.exit_code == 2, r.output
        assert "revision 0099" in r.stderr and "written by a newer moetune" in r.stderr, r.stderr
        assert f"moetune db downgrade {head_revision()} --yes" in r.stderr
        assert "NOT OK" not in r.output and r.stdout == ""
        assert "Traceback" not in r.output
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


def test_db_check_on_a_current_database_still_reports_ok(tmp_path: Path) -> None:
    """Guard: the refusal is for an unknown revision only."""
    db = tmp_path / "m.db"
    Store(db).close()
    r = run("db", "check", "--db", str(db))
    assert r.exit_code == 0, r.output
    assert ": ok" in r.stdout


def test_the_runtimes_database_fallback_refuses_a_newer_database(tmp_path: Path) -> None:
    """`moetune query` (the runtime's read-only fallback) read and applied profiles from a database every other
    command refuses as a newer moetune's; the runtime's list of schema revisions is the migrations' own."""
    from moetune.runtime.profiles import db_lookup
    from moetune.tuner.store._schema import known_revisions

    assert known_revisions() == db_lookup.KNOWN_SCHEMA_REVISIONS
    db = tmp_path / "ok.db"
    Store(db).close()
    assert db_lookup.newer_schema_problem(db) == ""
    db = newer_db(tmp_path)
    assert "schema revision 0099, written by a newer moetune" in db_lookup.newer_schema_problem(db)
    with pytest.raises(sqlite3.OperationalError, match="written by a newer moetune"):
        db_lookup.query_db_profiles(db, ep_size=2, nodes=1, hidden=2048, intermediate=768, experts=128, topk=8,
                                 dtype="bfloat16")
    r = run("query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--db", str(db))
    assert "written by a newer moetune" in " ".join(r.output.split()), r.output


def test_query_refuses_a_newer_database_given_as_db(tmp_path: Path) -> None:
    """`query --db` on a newer moetune's database answered the policy defaults and exited 0, where a --db that is no
    moetune database (or missing) exits 2, as every other command does on a newer database: refused up front."""
    db = newer_db(tmp_path)
    r = run("query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--db", str(db),
            env={"MOETUNE_HOME": str(tmp_path)})
    said = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "schema revision 0099" in said and NEWER in said and "Traceback" not in said, said


def test_a_database_path_that_is_not_utf8_is_named_not_a_traceback(tmp_path: Path) -> None:
    """A database whose name is not UTF-8 (a Latin-1 "café.db" given on the command line: Python decodes the byte
    to a surrogate): the read-only opener's quote() and the store's SQLAlchemy URL raised UnicodeEncodeError, and
    db current/check/upgrade, profiles list, report and tune ended in that traceback. The store now says the name
    is not UTF-8 (exit 2); the read-only opener percent-encodes the name's bytes, so the runtime's read works."""
    import os

    db = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9.db"))
    Store(tmp_path / "ok.db").close()
    os.rename(tmp_path / "ok.db", db)
    env = {"MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "", "COLUMNS": "400"}
    for args in (["db", "current"], ["db", "check"], ["db", "upgrade"], ["profiles", "list"], ["report"],
                 ["tune", "-m", "qwen3-30b", "--backend", "model", "--preset", "nvlink-h200x2", "--trials", "1",
                  "--tokens", "16"]):
        r = runner.invoke(app, [*args, "--db", str(db)], env=env)
        said = " ".join(r.output.split())
        assert r.exit_code == 2, (args, said, r.exception)
        assert f"database path {str(db)!r} is not UTF-8" in said, (args, said)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception))
    from moetune.runtime.profiles.sqlite_open import read

    assert read(db, lambda con: con.execute("SELECT count(*) FROM sqlite_master").fetchone()[0], timeout_s=5) > 0
