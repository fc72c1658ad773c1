"""`moetune db check` on a database a newer moetune wrote (an unknown schema revision) says so, as `db current` and
`db upgrade` do: exit status 2, no "NOT OK" report (a newer schema is not drift), nothing migrated or written."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, head_revision

runner = CliRunner()


def newer_db(tmp_path: Path) -> Path:
    db = tmp_path / "m.db"
    Store(db).close()
    con = sqlite3.connect(db)
    con.execute("UPDATE moetune_alembic_version SET version_num = '0099'")
    con.commit()
    con.close()
    return db


def test_db_check_on_a_newer_database_says_it_was_written_by_a_newer_moetune(tmp_path: Path) -> None:
    db = newer_db(tmp_path)
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    for extra in ([], ["--json"]):
        r = runner.invoke(app, ["db", "check", "--db", str(db), *extra])
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
    r = runner.invoke(app, ["db", "check", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert ": ok" in r.stdout
