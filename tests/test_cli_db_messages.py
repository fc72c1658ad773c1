"""What `moetune db ...` says: an upgrade to an older revision is refused (it did nothing and said "already at");
`db check` names schema differences in words (not Alembic's tuples); an Optuna studies file without moetune's tables
is said to be one, by `db check` (as `profiles list` says it) and by `db upgrade` (not "upgraded empty"); a file
that is not a database is NOT OK to `db check` (exit 1, not 2); the downgrade help says where revision ids are
shown."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import Column, ForeignKeyConstraint, Index, Integer, MetaData, String, Table, UniqueConstraint
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.store._schema import describe_schema_diff
from moetune.tuner.store.store import Store, head_revision

runner = CliRunner()


def run(*args: str):
    r = runner.invoke(app, list(args), env={"MOETUNE_CONFIG": ""})
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r, " ".join(r.output.split())


def _revision(db: Path) -> str:
    with Store(db, readonly=True, check_schema=False) as s:
        return s.current_revision()


@pytest.mark.parametrize("target", ["0003", "base"])
def test_upgrade_to_an_older_revision_is_refused(tmp_path: Path, target: str) -> None:
    db = tmp_path / "m.db"
    run("db", "upgrade", "--db", str(db))
    run("db", "downgrade", "0005", "--yes", "--db", str(db))
    r, text = run("db", "upgrade", "--revision", target, "--db", str(db))
    assert r.exit_code == 2, r.output
    assert (f"{db} is at revision 0005, newer than {target}: an upgrade does not go down; to roll back run "
            f"`moetune db downgrade {target} --yes --db {db}`") in text
    assert "already at revision" not in text and _revision(db) == "0005"
    r, text = run("db", "upgrade", "--revision", "0005", "--db", str(db))
    assert r.exit_code == 0 and "already at revision 0005" in text  # the same revision: nothing to do, said
    r, text = run("db", "upgrade", "--revision", head_revision(), "--db", str(db))
    assert r.exit_code == 0 and f"upgraded 0005 -> {head_revision()}" in text


def test_db_check_names_schema_differences_in_words(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    run("db", "upgrade", "--db", str(db))
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE profiles DROP COLUMN routing")
    con.execute("DROP INDEX uq_profiles_current_key")
    con.execute("CREATE INDEX ix_extra ON profiles(backend)")
    con.commit()
    con.close()
    r, text = run("db", "check", "--db", str(db))
    assert r.exit_code == 1, r.output
    assert "schema differs: column profiles.routing missing in the database" in text
    assert "schema differs: index ix_extra on profiles(backend) in the database, not in moetune's schema" in text
    assert "schema differs: unique index uq_profiles_current_key on profiles(fingerprint, software," in text
    assert "Column(" not in text and "('add_column'" not in text
    r, _ = run("db", "check", "--db", str(db), "--json")
    assert "column profiles.routing missing in the database" in json.loads(r.stdout)["schema_diff"]


def test_describe_schema_diff_covers_alembics_kinds() -> None:
    md = MetaData()
    parent = Table("parent", md, Column("id", Integer, primary_key=True))
    t = Table("child", md, Column("id", Integer), Column("name", String(8)), Column("parent_id", Integer))
    fk = ForeignKeyConstraint(["parent_id"], [parent.c.id], name="fk_parent")
    t.append_constraint(fk)
    uq = UniqueConstraint(t.c.name, name="uq_name")
    t.append_constraint(uq)
    assert describe_schema_diff(("add_table", parent)) == ["table parent missing in the database"]
    assert describe_schema_diff(("remove_table", parent)) == ["table parent in the database, not in moetune's schema"]
    assert describe_schema_diff(("remove_column", None, "child", t.c.name)) == [
        "column child.name in the database, not in moetune's schema"]
    assert describe_schema_diff(("add_index", Index("ix_n", t.c.name))) == ["index ix_n on child(name) missing in the "
                                                                             "database"]
    assert describe_schema_diff(("add_constraint", uq)) == ["unique constraint uq_name on child(name) missing in the "
                                                             "database"]
    assert describe_schema_diff(("remove_fk", fk)) == [
        "foreign key fk_parent on child(parent_id) -> parent.id in the database, not in moetune's schema"]
    modify = [("modify_type", None, "child", "name", {}, String(8), String(32)),
              ("modify_nullable", None, "child", "name", {}, True, False)]
    assert describe_schema_diff(modify) == [
        "column child.name: type is VARCHAR(8) in the database, VARCHAR(32) in moetune's schema",
        "column child.name: nullable is True in the database, False in moetune's schema"]
    assert describe_schema_diff(("something_new", 1)) == ["('something_new', 1)"]


def _optuna_file(path: Path) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(storage=f"sqlite:///{path}", study_name="s")


def test_an_optuna_studies_file_is_said_to_be_one(tmp_path: Path) -> None:
    f = tmp_path / "studies.db"
    _optuna_file(f)
    r, text = run("db", "check", "--db", str(f))
    assert r.exit_code == 1, r.output
    assert (f"not a moetune database (it has only Optuna's tables): no moetune tables yet; `moetune db upgrade --db "
            f"{f}` adds them") in text and "revision none" not in text
    _, profiles = run("profiles", "list", "--db", str(f))
    assert "it has only Optuna's tables" in profiles  # the same words
    r, _ = run("db", "check", "--db", str(f), "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["ok"] is False and doc["moetune_tables"] is False
    assert "it has only Optuna's tables" in doc["problem"]
    r, text = run("db", "current", "--db", str(f))
    assert "no moetune tables (it has only Optuna's tables): needs `moetune db upgrade`" in text
    r, text = run("db", "upgrade", "--db", str(f))
    assert r.exit_code == 0, r.output
    assert (f"{f}: added moetune's tables (revision {head_revision()}) to this Optuna studies file; its studies are "
            "untouched") in text and "upgraded empty" not in text
    r, text = run("db", "check", "--db", str(f))
    assert r.exit_code == 0 and "ok" in text
    con = sqlite3.connect(f)
    assert con.execute("SELECT study_name FROM studies").fetchall() == [("s",)]
    con.close()


def test_an_empty_file_is_said_to_be_empty(tmp_path: Path) -> None:
    f = tmp_path / "empty.db"
    f.write_bytes(b"")
    r, text = run("db", "check", "--db", str(f))
    assert r.exit_code == 1 and "not a moetune database (it is empty): no moetune tables yet" in text, r.output


def test_a_file_that_is_not_a_database_is_not_ok_exit_1(tmp_path: Path) -> None:
    """`db check` of a file SQLite cannot read as a database ("file is not a database") exits 1, as its help says
    when anything is off (2 only for a newer moetune's database), as a damaged file does. Other commands given it
    still refuse it with exit 2 (the wrong file)."""
    f = tmp_path / "x.db"
    f.write_text("garbage\n")
    r, text = run("db", "check", "--db", str(f))
    assert r.exit_code == 1, r.output
    assert f"{f}: NOT OK integrity: {f}: file is not a database" in text, text
    r, _ = run("db", "check", "--db", str(f), "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["ok"] is False and doc["integrity"] == [f"{f}: file is not a database"]
    r, text = run("db", "current", "--db", str(f))
    assert r.exit_code == 2 and f"error: {f}: file is not a database" in text, r.output
    assert f.read_text() == "garbage\n"


def test_downgrade_help_says_where_revision_ids_are_shown() -> None:
    r, _ = run("db", "downgrade", "--help")
    text = " ".join(r.output.replace("│", " ").split())  # the help panel's borders out
    assert r.exit_code == 0 and "`moetune db current` shows the database's and the newest one" in text
    assert '"base" (drops every moetune table)' in text


def test_suggested_commands_name_a_database_given_by_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database named by --config (not --db) is named in the suggested command, shell-quoted: without it the
    suggestion would downgrade (or upgrade) the default database."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    db = tmp_path / "my dir" / "m.db"
    db.parent.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\ndb = "{db}"\n')
    run("db", "upgrade", "--config", str(cfg))
    run("db", "downgrade", "0005", "--yes", "--config", str(cfg))
    r, text = run("db", "upgrade", "--revision", "0003", "--config", str(cfg))
    assert r.exit_code == 2, r.output
    assert f"`moetune db downgrade 0003 --yes --db '{db}'`" in text
    optuna_file = tmp_path / "my dir" / "studies.db"
    _optuna_file(optuna_file)
    cfg.write_text(f'[store]\ndb = "{optuna_file}"\n')
    r, text = run("db", "check", "--config", str(cfg))
    assert r.exit_code == 1 and f"`moetune db upgrade --db '{optuna_file}'` adds them" in text, text
    # the default database needs no --db
    default = tmp_path / "home" / "moetune.db"
    run("db", "upgrade")
    run("db", "downgrade", "0005", "--yes")
    r, text = run("db", "upgrade", "--revision", "0003")
    assert r.exit_code == 2 and "`moetune db downgrade 0003 --yes`" in text and str(default) in text, text


@pytest.mark.parametrize("cmd", [["db", "upgrade"], ["db", "check"], ["db", "current"], ["profile"],
                                 ["tune", "--model", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "1"],
                                 ["report"], ["profiles", "list"]])
def test_a_folder_given_as_the_database_is_said_to_be_no_database_file(tmp_path: Path, cmd: list[str]) -> None:
    """`db upgrade --db <a folder>.db` and `profile --db <a folder>` said SQLite's "unable to open database file",
    while `db check` and `query` said "is not a database file": one check, one wording (db_file.not_a_file)."""
    folder = tmp_path / "d.db"
    folder.mkdir()
    r, out = run(*cmd, "--db", str(folder))
    assert r.exit_code == 2 and f"{folder} is not a database file" in out, out
    assert "unable to open" not in out and not any(folder.iterdir())


def _edited_at_head(db: Path, *sql: str) -> str:
    """`db check`'s words (it must fail) on `db` after running `sql` on it (writable_schema on)."""
    con = sqlite3.connect(db)
    con.execute("PRAGMA writable_schema = ON")
    for stmt in sql:
        con.execute(stmt)
    con.commit()
    con.close()
    r, text = run("db", "check", "--db", str(db))
    assert r.exit_code == 1, r.output
    return text


def test_db_check_compares_check_constraints(tmp_path: Path) -> None:
    """Alembic's comparison skips CHECK constraints: a database at head whose profiles CHECKs carry 0001's doubled
    names (what 0011 renames) or another condition passed `db check`. Both must be named as schema differences."""
    db = tmp_path / "m.db"
    run("db", "upgrade", "--db", str(db))
    run("db", "downgrade", "0010", "--yes", "--db", str(db))
    # at head, with 0010's CHECKs
    text = _edited_at_head(db, f"UPDATE moetune_alembic_version SET version_num = '{head_revision()}'")
    assert ("schema differs: check constraint profiles.ck_profiles_status (status IN ('current', 'stale', "
            "'superseded')) missing in the database") in text
    assert ("schema differs: check constraint profiles.ck_profiles_ck_profiles_latency (latency_us >= 0 AND "
            "spread_us >= 0) in the database, not in moetune's schema") in text

    db2 = tmp_path / "m2.db"
    run("db", "upgrade", "--db", str(db2))
    text = _edited_at_head(db2, "UPDATE sqlite_master SET sql = replace(sql, 'latency_us >= 0 AND spread_us >= 0', "
                                "'latency_us >= 0') WHERE name = 'profiles'")
    assert ("schema differs: check constraint profiles.ck_profiles_latency is (latency_us >= 0) in the database, "
            "(latency_us >= 0 AND spread_us >= 0) in moetune's schema") in text
    run("db", "upgrade", "--db", str(tmp_path / "m3.db"))
    r, text = run("db", "check", "--db", str(tmp_path / "m3.db"))
    assert r.exit_code == 0 and "schema differs" not in text, text
