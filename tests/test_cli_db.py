"""`moetune db ...` and `moetune profiles ...` through the Typer app."""

from __future__ import annotations

import hashlib
import json
import sqlite3

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


def fill(db) -> None:
    with Store(db) as s:
        for b in (16, 128):
            key = ProfileKey(
                fingerprint="fp-cli", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=b,
            )
            s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=float(b), spread_us=0.5, backend="model:t"))


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("moetune ")


def test_db_upgrade_current_check(tmp_path):
    db = tmp_path / "m.db"  # a new file (a --db in a missing folder is refused: test_cli_db_newer_and_paths.py)
    r = run("db", "upgrade", "--db", str(db))
    assert r.exit_code == 0, r.output
    assert f"upgraded empty -> {head_revision()}" in r.stdout and db.is_file()
    assert "already at revision" in run("db", "upgrade", "--db", str(db)).stdout
    r = run("db", "current", "--db", str(db), "--json")
    assert json.loads(r.stdout) == {"path": str(db), "revision": head_revision(), "head": head_revision(), "at_head": True}
    assert "up to date" in run("db", "current", "--db", str(db)).stdout
    r = run("db", "check", "--db", str(db), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True
    assert "ok" in run("db", "check", "--db", str(db)).stdout


def test_db_check_fails_on_drift(tmp_path):
    db = tmp_path / "m.db"
    run("db", "upgrade", "--db", str(db))
    con = sqlite3.connect(db)
    con.execute("DROP INDEX uq_profiles_current_key")
    con.commit()
    con.close()
    r = run("db", "check", "--db", str(db), "--json")
    assert r.exit_code == 1
    info = json.loads(r.stdout)
    assert not info["ok"] and any("uq_profiles_current_key" in d for d in info["schema_diff"])


def test_db_downgrade_needs_yes(tmp_path):
    db = tmp_path / "m.db"
    run("db", "upgrade", "--db", str(db))
    r = run("db", "downgrade", "base", "--db", str(db))
    assert r.exit_code == 2 and "--yes" in r.stderr
    r = run("db", "downgrade", "0001", "--yes", "--db", str(db))
    assert r.exit_code == 0 and "0001" in r.stdout
    assert "needs `moetune db upgrade`" in run("db", "current", "--db", str(db)).stdout
    assert run("db", "check", "--db", str(db)).exit_code == 1
    assert run("db", "upgrade", "--db", str(db)).exit_code == 0


def test_missing_database_is_a_clean_error(tmp_path):
    for cmd in ("current", "check"):
        r = run("db", cmd, "--db", str(tmp_path / "none.db"))
        assert r.exit_code == 2 and "no database at" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "none.db").exists()


def test_default_path_from_env_and_config(tmp_path):
    r = run("db", "path", env={"MOETUNE_HOME": str(tmp_path / "h")})
    assert r.stdout.strip() == str(tmp_path / "h" / "moetune.db")
    conf = tmp_path / "c.toml"
    conf.write_text(f'[store]\ndb = "{tmp_path / "from_conf.db"}"\n')
    assert run("db", "path", "--config", str(conf)).stdout.strip() == str(tmp_path / "from_conf.db")
    conf.write_text("[store]\ndatabase = 'x'\n")
    r = run("db", "path", "--config", str(conf))
    assert r.exit_code == 2 and "unknown key store.database" in r.stderr and str(conf) in r.stderr


@pytest.mark.parametrize("cmd", [["db", "current"], ["db", "check"], ["db", "downgrade", "base", "--yes"], ["db", "path"],
                                 ["profiles", "list"]])
def test_a_bad_config_is_refused_beside_db(tmp_path, cmd):
    """`db current|check|downgrade --db X --config <garbage>` ignored the file and exited 0 (downgrade went ahead):
    a --config given is read, and refused as it is without --db."""
    db = tmp_path / "m.db"
    fill(db)
    before = sha(db)
    conf = tmp_path / "bad.toml"
    conf.write_text("garbage = [\n")
    alone = run(*cmd, "--config", str(conf))
    assert alone.exit_code == 2 and "not valid TOML" in alone.stderr, alone.output
    r = run(*cmd, "--db", str(db), "--config", str(conf))
    assert r.exit_code == 2, r.output
    assert r.stderr == alone.stderr and str(conf) in r.stderr and "Traceback" not in r.output
    assert sha(db) == before and r.stdout == ""
    good = tmp_path / "good.toml"
    good.write_text(f'[store]\ndb = "{tmp_path / "other.db"}"\n')
    assert run("db", "path", "--db", str(db), "--config", str(good)).stdout.strip() == str(db)  # --db still wins


def test_profiles_list_show_delete(tmp_path):
    db = tmp_path / "m.db"
    Store(db).close()
    assert json.loads(run("profiles", "list", "--db", str(db), "--json").stdout) == []
    fill(db)
    rows = json.loads(run("profiles", "list", "--db", str(db), "--json").stdout)
    assert [r["key"]["token_bucket"] for r in rows] == [16, 128]
    assert rows[0]["status"] == "current" and rows[0]["knobs"]["transport"] == "nvlink" and rows[0]["profile_hash"]
    r = run("profiles", "list", "--db", str(db))
    assert r.exit_code == 0 and "2 profile(s)" in r.stdout
    one = json.loads(run("profiles", "show", str(rows[1]["id"]), "--db", str(db), "--json").stdout)
    assert one == rows[1]
    r = run("profiles", "show", str(rows[1]["id"]), "--db", str(db))
    assert "knobs.fence_mode" in r.stdout and "key.token_bucket" in r.stdout
    assert run("profiles", "show", "999", "--db", str(db)).exit_code == 2
    assert json.loads(run("profiles", "list", "--status", "stale", "--db", str(db), "--json").stdout) == []
    r = run("profiles", "list", "--status", "bogus", "--db", str(db))
    assert r.exit_code == 2 and "--status" in r.output
    assert run("profiles", "delete", str(rows[0]["id"]), "--yes", "--db", str(db)).exit_code == 0
    assert len(json.loads(run("profiles", "list", "--db", str(db), "--json").stdout)) == 1
    assert run("profiles", "delete", "999", "--yes", "--db", str(db)).exit_code == 2


def test_ctrl_c_at_the_delete_question_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C at `profiles delete`'s "delete profile N? [y/N]" became Click's Abort: "Aborted." and exit 1, where
    Ctrl-C ends every other command with exit 130. Nothing is deleted; the end of stdin still answers no (exit 1).
    A real process, its stdin a pipe left open: the SIGINT arrives while it waits for the answer."""
    import os
    import signal
    import subprocess
    import sys

    db = tmp_path / "m.db"
    Store(db).close()
    fill(db)
    pid = str(json.loads(run("profiles", "list", "--db", str(db), "--json").stdout)[0]["id"])
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": ""}
    p = subprocess.Popen([sys.executable, "-c", "import sys; from moetune.tuner.cli import main; sys.exit(main())",
                          "profiles", "delete", pid, "--db", str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    try:
        asked = b""
        while b"[y/N]:" not in asked:  # the question is out: the process waits on stdin
            chunk = os.read(p.stdout.fileno(), 100)
            assert chunk, asked
            asked += chunk
        p.send_signal(signal.SIGINT)
        _out, stderr = p.communicate(timeout=60)
    finally:
        p.kill()
    said = stderr.decode()
    assert p.returncode == 130, said
    assert said.strip().splitlines() == ["interrupted: nothing deleted"], said
    r = runner.invoke(app, ["profiles", "delete", pid, "--db", str(db)], input="")
    assert r.exit_code == 1, r.output
    assert len(json.loads(run("profiles", "list", "--db", str(db), "--json").stdout)) == 2


@pytest.mark.parametrize(("answer", "said"), [("n\n", []), ("", ["no answer (the input ended)"])], ids=["no", "eof"])
def test_no_at_the_delete_question_says_nothing_was_deleted(tmp_path, answer, said):
    """A no at `profiles delete`'s question ended with exit 1 and not a word, and the end of stdin (a script's empty
    input) with Click's bare "Aborted.": now both say that nothing was deleted and how to delete without asking."""
    db = tmp_path / "m.db"
    Store(db).close()
    fill(db)
    pid = str(json.loads(run("profiles", "list", "--db", str(db), "--json").stdout)[0]["id"])
    r = runner.invoke(app, ["profiles", "delete", pid, "--db", str(db)], input=answer)
    assert r.exit_code == 1, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [*said, f"nothing deleted: profile {pid} kept (--yes deletes without asking)"], r.output
    assert "Aborted" not in r.output
    assert len(json.loads(run("profiles", "list", "--db", str(db), "--json").stdout)) == 2


def test_profiles_delete_and_import_refuse_a_database_a_daemon_serves_unless_forced(tmp_path):
    """`profiles delete` and `profiles import` under a daemon serving the database refuse (exit 1, naming the daemon,
    the database unchanged, no traceback), as `profile` and `tune` do: the daemon would keep serving its copy (it
    reads the profiles at start and after a re-tune job; no request reloads them), behind the single writer's back.
    --force writes anyway and says what the daemon still serves. The lock is held as a serving daemon holds it, its
    pid inside; none held, nothing said."""
    import fcntl
    import os

    from moetune.tuner.store.db_file import daemon_lock_path

    db = tmp_path / "m.db"
    fill(db)
    ids = [r["id"] for r in json.loads(run("profiles", "list", "--db", str(db), "--json").stdout)]
    exported = tmp_path / "e.json"
    assert run("profiles", "export", str(exported), "--db", str(db)).exit_code == 0
    assert run("profiles", "delete", str(ids[0]), "--yes", "--db", str(db)).exit_code == 0  # to import it again
    before = sha(db)
    fd = os.open(daemon_lock_path(db), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        refused = f"daemon pid {os.getpid()} is serving this database ({db}); stop it first"
        r = run("profiles", "delete", str(ids[1]), "--yes", "--db", str(db))
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and refused in said and "--force" in said and "(nothing deleted)" in said, said
        assert "Traceback" not in said and "deleted profile" not in said
        r = run("profiles", "import", str(exported), "--db", str(db))
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and refused in said and "(database unchanged)" in said, said
        assert sha(db) == before  # nothing written
        r = run("profiles", "import", str(exported), "--db", str(db), "--force")
        said = " ".join(r.output.split())
        assert r.exit_code == 0 and "imported 1 profile(s)" in said, said
        assert f"note: daemon pid {os.getpid()} serves {db}" in said, said
        r = run("profiles", "delete", str(ids[1]), "--yes", "--force", "--db", str(db))
        said = " ".join(r.output.split())
        assert r.exit_code == 0 and f"deleted profile {ids[1]}" in said, said
        assert (f"note: daemon pid {os.getpid()} serves {db} and keeps serving the profiles it loaded, profile "
                f"{ids[1]} included, until it is restarted") in said, said
    finally:
        os.close(fd)  # the daemon stopped: its lock is free
    rows = json.loads(run("profiles", "list", "--db", str(db), "--json").stdout)
    assert [r["key"]["token_bucket"] for r in rows] == [16]  # the forced import and delete, nothing else
    r = run("profiles", "delete", str(rows[0]["id"]), "--yes", "--db", str(db))
    assert r.exit_code == 0 and "daemon" not in r.output, r.output


def test_profiles_export_import(tmp_path):
    src, dst = tmp_path / "s.db", tmp_path / "d.db"
    fill(src)
    f = tmp_path / "p.json"
    r = run("profiles", "export", str(f), "--db", str(src))
    assert r.exit_code == 0 and "exported 2" in r.stdout
    stdout_copy = run("profiles", "export", "-", "--db", str(src)).stdout
    assert stdout_copy == f.read_text()
    r = run("profiles", "import", str(f), "--db", str(dst), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["inserted"] == 2
    run("profiles", "export", str(tmp_path / "q.json"), "--db", str(dst))
    assert (tmp_path / "q.json").read_bytes() == f.read_bytes()

    bad = tmp_path / "bad.json"
    doc = json.loads(f.read_text())
    doc["profiles"][1]["knobs"]["warp_speed"] = 9
    bad.write_text(json.dumps(doc))
    before = sha(dst)
    r = run("profiles", "import", str(bad), "--db", str(dst))
    assert r.exit_code == 2
    assert "unknown field `warp_speed`" in r.stderr and "profiles[1].knobs" in r.stderr and "Traceback" not in r.output
    assert sha(dst) == before


@pytest.mark.parametrize("group", ["db", "profiles"])
def test_group_help(group):
    r = run(group, "--help")
    assert r.exit_code == 0


# -- issue 19 point 10: every command that touches the database takes --db and --config ------------
def _commands():
    import typer.main

    try:  # typer >= 0.25 vendors click as typer._click; older ones depend on click
        import click
    except ImportError:
        from typer import _click as click

    from moetune.tuner.cli import app as root

    cmd = typer.main.get_command(root)
    ctx = click.Context(cmd)
    found = {}

    def walk(c, path):
        if hasattr(c, "list_commands"):
            if path and getattr(c, "callback", None) is not None and c.params:
                found[" ".join(path)] = c  # a group that is itself a command (`moetune tune`)
            for n in c.list_commands(ctx):
                walk(c.get_command(ctx, n), [*path, n])
        else:
            found[" ".join(path)] = c

    walk(cmd, [])
    return found


DB_COMMANDS = ["profile", "report", "query", "serve", "db path", "db upgrade", "db downgrade", "db current",
               "db check", "profiles list", "profiles show", "profiles delete", "profiles export", "profiles import",
               "tune", "tune show", "fabric show", "fabric diff"]


@pytest.mark.parametrize("name", DB_COMMANDS)
def test_database_commands_take_db_and_config(name):
    cmds = _commands()
    assert name in cmds, sorted(cmds)
    opts = {o for p in cmds[name].params for o in getattr(p, "opts", [])}
    assert {"--db", "--config"} <= opts, f"`moetune {name}` lacks {sorted({'--db', '--config'} - opts)}"


@pytest.mark.parametrize(
    "args",
    [
        ["db", "upgrade", "--revision", "nonsense"],
        ["db", "downgrade", "nonsense", "--yes"],
        ["profiles", "show", "not-a-number"],
        ["profiles", "show", str(1 << 70)],
        ["profiles", "delete", "99", "--yes"],
        ["profiles", "list", "--status", "best"],
        ["profiles", "export", "/nonexistent-dir/x.json"],
        ["profiles", "import", "/"],
        ["profiles", "import", "/nonexistent.json"],
    ],
)
def test_bad_input_gives_no_traceback(tmp_path, args):
    db = tmp_path / "t.db"
    Store(db).close()
    before = db.read_bytes()
    r = runner.invoke(app, [*args, "--db", str(db)])
    assert r.exit_code != 0
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    if args[0] == "profiles":
        assert db.read_bytes() == before


def test_report_of_a_missing_database_is_an_error_and_creates_nothing(tmp_path):
    where = tmp_path / "not-there"
    r = run("report", "--db", str(where / "m.db"))
    assert r.exit_code == 2 and "no database at" in r.output and "Traceback" not in r.output
    assert not where.exists()


def test_a_write_command_that_upgrades_an_older_database_says_so(tmp_path):
    """`profiles import`, `profiles delete` and `tune` upgraded an older schema without a word: an older moetune
    sharing the file could not open it any more, and nothing had said why."""
    db = tmp_path / "m.db"
    run("db", "upgrade", "--db", str(db))
    assert run("db", "downgrade", "0001", "--yes", "--db", str(db)).exit_code == 0
    empty = tmp_path / "e.json"
    empty.write_text('{"format": "moetune-profiles", "version": 1, "moetune_version": "0", "fingerprints": [], '
                     '"profiles": []}')
    r = run("profiles", "import", str(empty), "--db", str(db))
    assert r.exit_code == 0 and "from schema revision 0001 to" in " ".join(r.stderr.split()), r.output
    assert "an older moetune sharing this file cannot open it" in " ".join(r.stderr.split())
    r = run("profiles", "import", str(empty), "--db", str(tmp_path / "new.db"))
    assert r.exit_code == 0 and "schema revision" not in r.stderr  # a new database: nothing was upgraded
    assert run("db", "downgrade", "0001", "--yes", "--db", str(db)).exit_code == 0
    r = run("tune", "--backend", "model", "--preset", "nvlink-h200x2", "-m", "qwen3-30b", "-t", "16", "--trials", "1",
            "--db", str(db))
    assert r.exit_code == 0 and "from schema revision 0001 to" in " ".join(r.stderr.split()), r.output


def test_profiles_list_draws_the_newest_rows_by_default(tmp_path):
    """A table of 11,000 profiles took 16 s before its first line: the newest 500 by default, said in the title;
    --limit 0 draws all, --json lists all."""
    from moetune.runtime.knobs import default_knobs
    from moetune.runtime.profile_record import ProfileKey, ProfileRecord
    from moetune.tuner.store.store import Store

    db = tmp_path / "m.db"
    with Store(db) as s:
        for b in (1, 16, 64, 128):
            key = ProfileKey(fingerprint="fp-l", software="sw", transport_family="nvlink", ep_size=2, nodes=1,
                             hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=b)
            s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=float(b), spread_us=0.5,
                                        backend="local:nccl", provenance="measured"))
    r = run("profiles", "list", "--limit", "2", "--db", str(db))
    text = " ".join(r.stdout.split())
    assert r.exit_code == 0 and "4 profile(s), the newest 2 shown (--limit 0 shows all" in text, r.output
    ids = [ln.split("│")[1].strip() for ln in r.stdout.splitlines() if ln.startswith("│") and ln.split("│")[1].strip()]
    assert ids == ["3", "4"], ids
    assert "the newest" not in run("profiles", "list", "--limit", "0", "--db", str(db)).stdout
    assert len(json.loads(run("profiles", "list", "--limit", "2", "--json", "--db", str(db)).stdout)) == 4
    assert run("profiles", "list", "--limit", "-1", "--db", str(db)).exit_code == 2


@pytest.mark.parametrize("args", [["profiles", "show", "-1"], ["profiles", "show", "-1", "--json"],
                                  ["profiles", "delete", "-3", "--yes"], ["profiles", "show", "abc"]])
def test_a_bad_profile_id_is_refused_naming_the_argument_as_the_help_shows_it(tmp_path, args):
    """`profiles show -1` said "No such option: -1" (Click reads -1 as an option), and a bad id was named
    'profile_id', the Python parameter's name (the help too). Now the argument is ID in the help and the errors,
    and a negative id reaches its range check."""
    db = tmp_path / "t.db"
    Store(db).close()
    before = db.read_bytes()
    r = runner.invoke(app, [*args, "--db", str(db)], env={"COLUMNS": "200"})
    assert r.exit_code == 2, r.output
    assert "Invalid value for 'ID'" in r.output and "No such option" not in r.output, r.output
    assert "profile_id" not in r.output
    assert db.read_bytes() == before
    assert "ID" in runner.invoke(app, [*args[:2], "--help"], env={"COLUMNS": "200"}).output


def test_an_option_value_that_looks_negative_stays_the_options():
    """Only a negative number that is no option's value is moved behind "--" (`--db -5` keeps its value)."""
    from moetune.tuner.cli._args import _negative_numbers_last

    assert _negative_numbers_last(["--db", "-5", "-1"], {"--db"}) == ["--db", "-5", "--", "-1"]
    assert _negative_numbers_last(["-1", "--json"], {"--db"}) == ["--json", "--", "-1"]
    assert _negative_numbers_last(["--", "-1"], set()) == ["--", "-1"]
    assert _negative_numbers_last(["3", "--json"], set()) == ["3", "--json"]
