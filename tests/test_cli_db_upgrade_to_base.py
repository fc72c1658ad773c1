"""`db upgrade --revision base` on a missing file created it (with moetune's version table) and said "already at
revision None": base is "no moetune tables", where a missing or empty file already is; nothing is created."""

from __future__ import annotations

from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.store.store import Store


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_base_on_a_missing_file_creates_nothing(tmp_path):
    db = tmp_path / "missing.db"
    r = run("db", "upgrade", "--revision", "base", "--db", str(db))
    assert r.exit_code == 0, r.output
    assert "base" in r.output and "None" not in r.output and "nothing created" in r.output
    assert not db.exists() and list(tmp_path.iterdir()) == []


def test_base_on_an_empty_file_leaves_it_empty(tmp_path):
    db = tmp_path / "empty.db"
    db.touch()
    r = run("db", "upgrade", "--revision", "base", "--db", str(db))
    assert r.exit_code == 0, r.output
    assert "already at revision base" in r.output and "None" not in r.output
    assert db.stat().st_size == 0


def test_base_after_a_downgrade_to_base_says_base(tmp_path):
    db = tmp_path / "m.db"
    with Store(db) as s:
        s.downgrade("base")
    r = run("db", "upgrade", "--revision", "base", "--db", str(db))
    assert r.exit_code == 0, r.output
    assert "already at revision base" in r.output and "None" not in r.output
