"""`moetune profiles`/`db` never lose or touch data they were not asked to: exports never land on a
database, read commands never create or migrate one, nobody adds moetune tables to another program's
SQLite file, messages are plain text (not Rich markup), imports refuse half-described files."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, head_revision

runner = CliRunner()


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env, catch_exceptions=False)


def sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def fill(db, fp: str = "fp-safe") -> None:
    with Store(db) as s:
        s.upsert_fingerprint(fp, {}, origin="local")  # no facts: an import checks facts against the fingerprint (`facts_problem`)
        key = ProfileKey(
            fingerprint=fp, software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
            intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=16,
        )
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5, backend="model:t"))


def foreign_db(path) -> str:
    """Another program's SQLite file (rollback journal, one table); returns its hash."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE theirs (x INTEGER)")
    con.execute("INSERT INTO theirs VALUES (1)")
    con.commit()
    con.close()
    return sha(path)


def tables(path) -> set[str]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()


def revision(path) -> str:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute("SELECT version_num FROM moetune_alembic_version").fetchone()[0]
    finally:
        con.close()


# -- 1: an export never overwrites a database --------------------------------------------------------
def test_export_onto_the_default_database_is_refused(tmp_path):
    env = {"MOETUNE_HOME": str(tmp_path / "home")}
    assert run("db", "upgrade", env=env).exit_code == 0
    db = tmp_path / "home" / "moetune.db"
    fill(db)
    before = sha(db)
    path = run("db", "path", env=env).stdout.strip()
    assert path == str(db)
    r = run("profiles", "export", path, env=env)
    assert r.exit_code == 2 and "refusing to export onto" in r.stderr and "Traceback" not in r.output
    assert sha(db) == before
    assert run("db", "check", env=env).exit_code == 0
    assert len(json.loads(run("profiles", "list", "--json", env=env).stdout)) == 1


@pytest.mark.parametrize("how", ["symlink", "hardlink", "wal", "relative"])
def test_export_onto_the_database_by_another_name_is_refused(tmp_path, monkeypatch, how):
    db = tmp_path / "m.db"
    fill(db)
    if how == "symlink":
        target = tmp_path / "link.json"
        target.symlink_to(db)
    elif how == "hardlink":
        target = tmp_path / "hard.json"
        os.link(db, target)
    elif how == "wal":
        target = tmp_path / "m.db-wal"
    else:
        monkeypatch.chdir(tmp_path)
        target = tmp_path / "sub" / ".." / "m.db"
        (tmp_path / "sub").mkdir()
    before = sha(db)
    r = run("profiles", "export", str(target), "--db", str(db))
    assert r.exit_code == 2 and "refusing to export onto" in r.stderr, r.output
    assert sha(db) == before
    if how == "symlink":
        assert target.is_symlink()


def test_export_onto_another_sqlite_file_or_a_directory_is_refused(tmp_path):
    db = tmp_path / "m.db"
    fill(db)
    other = tmp_path / "other.sqlite"
    h = foreign_db(other)
    r = run("profiles", "export", str(other), "--db", str(db))
    assert r.exit_code == 2 and "is a SQLite database" in r.stderr
    assert sha(other) == h
    (tmp_path / "d").mkdir()
    r = run("profiles", "export", str(tmp_path / "d"), "--db", str(db))
    assert r.exit_code == 2 and "not a regular file" in r.stderr
    assert (tmp_path / "d").is_dir()


def test_a_failed_export_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    db = tmp_path / "m.db"
    fill(db)
    f = tmp_path / "p.json"
    f.write_text("old export\n")

    def boom(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("moetune.tuner.store.io.os.replace", boom)
    r = run("profiles", "export", str(f), "--db", str(db), "--force")
    assert r.exit_code == 1 and "cannot write" in r.stderr and "No space left" in r.stderr  # no space: not a bad path
    assert f.read_text() == "old export\n"
    assert sorted(p.name for p in tmp_path.iterdir() if "p.json" in p.name) == ["p.json"]


def test_export_replacing_a_file_keeps_its_permissions_and_symlink(tmp_path):
    db = tmp_path / "m.db"
    fill(db)
    f = tmp_path / "p.json"
    f.write_text("old\n")
    f.chmod(0o640)
    link = tmp_path / "latest.json"
    link.symlink_to(f)
    r = run("profiles", "export", str(link), "--db", str(db), "--force")  # an existing file: --force
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and json.loads(f.read_text())["format"] == "moetune-profiles"
    assert stat.S_IMODE(f.stat().st_mode) == 0o640


def test_write_atomic_writes_through_a_symlink(tmp_path):
    """write_atomic (bench summarize, model calibrate --out, the bring-up's files) resolves a symlink, as export
    does: the link stays and its file is replaced (permissions kept), not the link replaced by a regular file with
    the file it named left stale; a dangling link gets the file it names."""
    from moetune.tuner.store.io import write_atomic

    f = tmp_path / "d" / "real.md"
    f.parent.mkdir()
    f.write_text("old\n")
    f.chmod(0o640)
    link = tmp_path / "link.md"
    link.symlink_to(f)
    write_atomic(link, "new\n")
    assert link.is_symlink() and f.read_text() == "new\n" and stat.S_IMODE(f.stat().st_mode) == 0o640
    assert sorted(p.name for p in f.parent.iterdir()) == ["real.md"]
    dangling = tmp_path / "dangling.md"
    dangling.symlink_to(tmp_path / "d" / "later.md")
    write_atomic(dangling, "x")
    assert dangling.is_symlink() and (tmp_path / "d" / "later.md").read_text() == "x"
    with pytest.raises(FileExistsError):  # replace=False: the file the link names exists
        write_atomic(link, "other", replace=False)
    assert f.read_text() == "new\n"


def test_without_hard_links_write_atomic_keeps_a_file_made_after_its_check(tmp_path, monkeypatch):
    """write_atomic(replace=False) puts its file in place with a hard link, which never goes over a file. Where hard
    links fail (EPERM) it checked the path and then renamed over it: a file made there in between was replaced without
    a word. It is renamed with renameat2(RENAME_NOREPLACE) now, which the kernel refuses where a file is there:
    FileExistsError, that file kept, no temporary file left. The file is made at the last moment either way: just
    after the old check, just before the renameat2 call. (Without renameat2 the path is checked just before a plain
    rename: the window narrowed, not closed; rename_no_replace's own test covers that path.)"""
    import errno

    from moetune.tuner.store import atomic_files

    real_renameat2 = atomic_files._renameat2()
    if real_renameat2 is None:
        pytest.skip("no renameat2 in this C library")
    target = tmp_path / "out.json"
    linked: list[bool] = []
    real_lexists = os.path.lexists

    def appear() -> None:
        if linked and not real_lexists(target):  # once, after the link failed
            target.write_text("someone else's")

    def no_links(*_a):
        linked.append(False)
        raise PermissionError(errno.EPERM, "Operation not permitted")

    def someone_comes_after_the_check(path):
        seen = real_lexists(path)
        if os.fspath(path) == os.fspath(target):
            appear()
        return seen

    def someone_comes_before_the_rename(*a):
        appear()
        return real_renameat2(*a)

    monkeypatch.setattr(atomic_files.os, "link", no_links)
    monkeypatch.setattr(os.path, "lexists", someone_comes_after_the_check)
    monkeypatch.setattr(atomic_files, "_renameat2", lambda: someone_comes_before_the_rename)
    with pytest.raises(FileExistsError):
        atomic_files.write_atomic(target, "ours", replace=False)
    assert linked and target.read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]

_OTHER_UID = 54321  # no user of this machine: a link "of another user"


def _foreign_link(link, target) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a link to another user (os.lchown) needs root")
    link.symlink_to(target)
    os.lchown(link, _OTHER_UID, _OTHER_UID)


def test_write_atomic_refuses_another_users_link(tmp_path):
    """write_atomic resolved a link by hand (os.path.realpath), which fs.protected_symlinks does not see: another
    user's /tmp/p.json -> ~/.bashrc had `--out /tmp/p.json` overwrite .bashrc, and a dangling one with replace=False
    created a file wherever it pointed. Another user's link (anywhere in the chain) is refused, naming it and its
    owner; this user's or root's is still followed."""
    from moetune.tuner.store.io import write_atomic

    victim = tmp_path / "bashrc"
    victim.write_text("mine\n")
    link = tmp_path / "p.json"
    _foreign_link(link, victim)
    with pytest.raises(PermissionError) as e:
        write_atomic(link, "export")
    assert str(link) in e.value.strerror and f"uid {_OTHER_UID}" in e.value.strerror
    assert victim.read_text() == "mine\n" and link.is_symlink()
    dangling = tmp_path / "d.json"
    _foreign_link(dangling, tmp_path / "planted")
    with pytest.raises(PermissionError):
        write_atomic(dangling, "x", replace=False)
    assert not (tmp_path / "planted").exists()
    mine = tmp_path / "mine.json"  # this user's link to another user's link: refused at the second
    mine.symlink_to(link)
    with pytest.raises(PermissionError, match=r"p\.json is a symbolic link owned by uid"):
        write_atomic(mine, "x")
    assert victim.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "bashrc", "d.json", "mine.json", "p.json"]
    own = tmp_path / "own.json"  # this user's (root's) link: written through
    own.symlink_to("bashrc")
    write_atomic(own, "new\n")
    assert victim.read_text() == "new\n" and own.is_symlink()


def test_export_refuses_another_users_link(tmp_path):
    """`profiles export` resolved the path itself (Path.resolve) before write_atomic: the same hole, closed the same
    way; said plainly, exit 2 (the path given cannot be written), nothing written."""
    db = tmp_path / "m.db"
    fill(db)
    victim = tmp_path / "bashrc"
    victim.write_text("mine\n")
    link = tmp_path / "p.json"
    _foreign_link(link, victim)
    for extra in ([], ["--force"]):
        r = run("profiles", "export", str(link), "--db", str(db), *extra)
        assert r.exit_code == 2 and "refusing to write through" in r.stderr and f"uid {_OTHER_UID}" in r.stderr, (
            r.output)
        assert victim.read_text() == "mine\n"
    _foreign_link(tmp_path / "new.json", tmp_path / "planted.json")
    r = run("profiles", "export", str(tmp_path / "new.json"), "--db", str(db))
    assert r.exit_code == 2 and not (tmp_path / "planted.json").exists(), r.output


# -- 2: read commands never create or migrate; nobody adds tables to a foreign file -----------------
@pytest.mark.parametrize(
    "args",
    [["profiles", "list"], ["profiles", "show", "1"], ["profiles", "export", "-"], ["profiles", "delete", "1", "--yes"]],
)
def test_a_missing_database_is_an_error_and_is_not_created(tmp_path, args):
    db = tmp_path / "typo.db"
    r = run(*args, "--db", str(db))
    assert r.exit_code == 2 and f"no database at {db}" in r.stderr and "moetune db upgrade" in r.stderr
    assert "Traceback" not in r.output
    assert not db.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args",
    [
        ["profiles", "list"],
        ["profiles", "show", "1"],
        ["profiles", "export", "-"],
        ["profiles", "delete", "1", "--yes"],
        ["profiles", "import", "IMPORT"],
        ["db", "downgrade", "base", "--yes"],
        ["db", "current"],
        ["db", "check"],
    ],
)
def test_a_foreign_sqlite_file_is_left_alone(tmp_path, args):
    src = tmp_path / "src.db"
    fill(src)
    export = tmp_path / "x.json"
    assert run("profiles", "export", str(export), "--db", str(src)).exit_code == 0
    theirs = tmp_path / "theirs.db"
    h = foreign_db(theirs)
    args = [str(export) if a == "IMPORT" else a for a in args]
    r = run(*args, "--db", str(theirs))
    assert "Traceback" not in r.output
    if args[:2] not in (["db", "current"], ["db", "check"]):
        assert r.exit_code == 2 and f"{theirs} is not a moetune database" in r.stderr, r.output
    assert sha(theirs) == h and tables(theirs) == {"theirs"}
    # nothing beside either file: the export's read of src.db left an empty -wal and -shm before ae735c0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.db", "theirs.db", "x.json"]


def test_read_commands_do_not_undo_a_downgrade(tmp_path):
    db = tmp_path / "m.db"
    fill(db)
    assert run("db", "downgrade", "0002", "--yes", "--db", str(db)).exit_code == 0
    for args in (["profiles", "list"], ["profiles", "show", "1"], ["profiles", "export", "-"]):
        r = run(*args, "--db", str(db))
        assert r.exit_code == 2, r.output
        assert f"database {db} is at schema 0002, this moetune needs {head_revision()}: run `moetune db upgrade" in r.stderr
        assert revision(db) == "0002"
    assert run("db", "upgrade", "--db", str(db)).exit_code == 0
    assert run("profiles", "list", "--db", str(db)).exit_code == 0


def test_an_empty_file_is_not_a_database_to_read_but_import_may_create_one(tmp_path):
    src = tmp_path / "src.db"
    fill(src)
    export = tmp_path / "x.json"
    run("profiles", "export", str(export), "--db", str(src))
    empty = tmp_path / "empty.db"
    empty.touch()
    r = run("profiles", "list", "--db", str(empty))
    assert r.exit_code == 2 and "is not a moetune database" in r.stderr and empty.stat().st_size == 0
    new = tmp_path / "d.db"  # a new file; a folder that does not exist is refused (test_cli_db_newer_and_paths.py)
    for target in (empty, new):
        r = run("profiles", "import", str(export), "--db", str(target), "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["inserted"] == 1, r.output
        assert revision(target) == head_revision()


def test_a_bad_import_file_creates_no_database(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    db = tmp_path / "new.db"
    r = run("profiles", "import", str(bad), "--db", str(db))
    assert r.exit_code == 2 and not db.exists()
    r = run("profiles", "import", str(tmp_path / "none.json"), "--db", str(db))
    assert r.exit_code == 2 and "cannot read" in r.stderr and not db.exists()


def test_import_still_upgrades_an_older_moetune_database(tmp_path):
    src, db = tmp_path / "src.db", tmp_path / "m.db"
    fill(src)
    export = tmp_path / "x.json"
    run("profiles", "export", str(export), "--db", str(src))
    Store(db).close()
    run("db", "downgrade", "0002", "--yes", "--db", str(db))
    r = run("profiles", "import", str(export), "--db", str(db))
    assert r.exit_code == 0, r.output
    assert revision(db) == head_revision()


# -- 3: messages and help are plain text, not Rich markup -------------------------------------------
@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["profiles", "import", "[/bold]x.json"], "[/bold]x.json"),
        (["db", "path", "--config", "[/red]c.toml"], "[/red]c.toml"),
        (["profiles", "list", "--db", "[/x]/[gpu].db"], "[/x]/[gpu].db"),
    ],
)
def test_error_messages_show_brackets_verbatim(tmp_path, monkeypatch, args, shown):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), repr(r.exception)
    assert "error:" in r.stderr and shown in r.stderr
    assert "Traceback" not in r.output and "MarkupError" not in r.output


def test_an_unknown_config_section_is_named(tmp_path):
    conf = tmp_path / "sec.toml"
    conf.write_text("[bogus]\n")
    r = run("db", "path", "--config", str(conf))
    assert r.exit_code == 2 and "unknown section [bogus] in" in r.stderr


def test_output_with_brackets_in_paths_and_stored_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "[/x]m.db"
    db.parent.mkdir()  # the folder "[": moetune creates no folder for an explicit path
    fill(db)
    with Store(db) as s:
        key = ProfileKey(
            fingerprint="fp-safe", software="sw", transport_family="nvlink", ep_size=4, nodes=1, hidden=7168,
            intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=16,
        )
        rec = ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5,
                            backend="model:[/bold][gpu]", software_versions={"[/x]": "[/y]"})
        s.put_profile(rec)
    for args in (["db", "upgrade"], ["db", "current"], ["db", "check"], ["profiles", "list"]):
        r = run(*args, "--db", str(db))
        assert r.exit_code == 0, r.output
        assert "[/x]m.db" in r.stdout if args[0] == "db" else "2 profile(s)" in r.stdout
    r = run("profiles", "show", "2", "--db", str(db))
    assert r.exit_code == 0 and "model:[/bold][gpu]" in r.stdout and "[/y]" in r.stdout
    r = run("profiles", "export", "[/x].json", "--db", str(db))
    assert r.exit_code == 0 and "to [/x].json" in r.stdout
    r = run("profiles", "import", "[/x].json", "--db", str(tmp_path / "d.db"))
    assert r.exit_code == 0 and "from [/x].json" in r.stdout


@pytest.mark.parametrize(("args", "text"), [(["profiles", "list"], "[store] db"), (["db", "check"], "[store] db")])
def test_help_keeps_bracketed_config_names(args, text):
    r = run(*args, "--help", env={"COLUMNS": "300"})
    assert r.exit_code == 0 and text in " ".join(r.stdout.split())


# -- 4, 5: imports refuse half-described files ------------------------------------------------------
def _export(tmp_path) -> dict:
    src = tmp_path / "src.db"
    fill(src)
    return json.loads(run("profiles", "export", "-", "--db", str(src)).stdout)


def _import(tmp_path, doc) -> tuple:
    f = tmp_path / "in.json"
    f.write_text(json.dumps(doc))
    db = tmp_path / "dst.db"
    fill(db, fp="fp-other")
    before = sha(db)
    r = run("profiles", "import", str(f), "--db", str(db))
    assert sha(db) == before
    return r, f


def test_import_refuses_a_profile_whose_fingerprint_is_not_in_the_file(tmp_path):
    doc = _export(tmp_path)
    doc["fingerprints"] = []
    r, _f = _import(tmp_path, doc)
    assert r.exit_code == 2
    assert "profiles[0].key.fingerprint fp-safe is not in the file's fingerprints" in r.stderr


@pytest.mark.parametrize("version", ["1", 1.0, True, None])
def test_import_says_the_version_must_be_an_integer(tmp_path, version):
    doc = _export(tmp_path)
    doc["version"] = version
    r, _f = _import(tmp_path, doc)
    assert r.exit_code == 2 and "format version must be an integer" in r.stderr, r.stderr


def test_import_of_a_newer_version_names_it(tmp_path):
    doc = _export(tmp_path)
    doc["version"] = 2
    r, _f = _import(tmp_path, doc)
    assert r.exit_code == 2 and "unsupported format version 2" in r.stderr


@pytest.mark.parametrize("profiles", ["missing", None, {}])
def test_import_without_a_profiles_list_is_refused(tmp_path, profiles):
    doc = {"format": "moetune-profiles", "version": 1}
    if profiles != "missing":
        doc["profiles"] = profiles
    r, f = _import(tmp_path, doc)
    assert r.exit_code == 2 and f"no `profiles` list in {f}" in r.stderr


def test_import_of_an_empty_export_still_works(tmp_path):
    db = tmp_path / "empty.db"
    Store(db).close()
    f = tmp_path / "e.json"
    assert run("profiles", "export", str(f), "--db", str(db)).exit_code == 0
    r = run("profiles", "import", str(f), "--db", str(db))
    assert r.exit_code == 0 and "imported 0" in r.stdout
