"""Paths given on the command line, across every command: an empty path is refused naming the option (read as a Path,
"" was the current folder), and a file that is missing, unreadable, not what it should be, or cannot be written ends
the command with the same exit status in every command (the convention in `moetune --help`), one message naming the
path, and no traceback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.cli._args import path_arg, path_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_env import child_env
from cli_commands import cli_commands

pytestmark = pytest.mark.timeout(120)


def _parser(p):
    return p.type_descriptor.parameter_info.parser


def _annotation(p):
    return p.type_descriptor.annotation


# str options that name a file (kept as typed: "-" for stdout, a preset's name), and str options that are not paths
_TEXT_PATHS = {("bench", "run", "--results"), ("bench", "run", "--from-report"), ("bench", "summarize", "--results"),
               ("bench", "summarize", "--out"), ("tune", "--preset"), ("model", "predict", "--preset"),
               ("model", "sweep", "--preset"), ("model", "calibrate", "--preset")}


def _path_params():
    """(command path, the parameter's command-line words before "", its name as an error shows it) for every path."""
    out = []
    for path, cmd in cli_commands():
        args = [p for p in cmd.params if p.param_type_name == "argument"]
        for p in cmd.params:
            if _parser(p) not in (path_arg, path_text):
                continue
            if p.param_type_name == "argument":  # the arguments before it get a placeholder
                words = ["x"] * args.index(p)
                name = p.name
            else:
                words = [p.opts[0]]
                name = p.opts[0]
            out.append(pytest.param(path, words, name, id=" ".join([*path, name])))
    return out


_PATHS = _path_params()


def test_every_path_option_refuses_an_empty_path() -> None:
    """Every Path (or list[Path]) parameter of every command, and the str ones naming a file, parse with path_arg /
    path_text (`_args.path_option`): a new one typed Path without it is caught here."""
    from typing import get_args

    missing = []
    for path, cmd in cli_commands():
        for p in cmd.params:
            ann = _annotation(p)
            is_path = ann is Path or get_args(ann) == (Path,)
            text = p.param_type_name == "option" and (*path, p.opts[0]) in _TEXT_PATHS
            want = path_arg if is_path else path_text if text else None
            if want is not None and _parser(p) is not want:
                missing.append(f"moetune {' '.join(path)} {p.opts[0]}")
    assert not missing, missing
    assert len(_PATHS) >= 70, len(_PATHS)  # --db and --config of ~20 commands, --out, --capture, keys, bench, ...


@pytest.mark.parametrize(("command", "words", "name"), _PATHS)
def test_an_empty_path_is_refused_naming_the_option(command: list[str], words: list[str], name: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`profile --report-dir ""` wrote report.md into the current folder, `bench summarize --out ""` rewrote
    BENCHMARKS.md, `db path --db ""` printed ".", `tune --policy ""` was ignored, `serve --clients-dir ""` served:
    every path refuses "" before anything runs, exit 2, naming itself; nothing is created."""
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    r = CliRunner().invoke(app, [*command, *words, ""], env={"MOETUNE_HOME": str(home), "COLUMNS": "200",
                                                              "MOETUNE_CONFIG": ""})
    said = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2, said
    assert f"Invalid value for '{name}'" in said and "an empty path names no file or folder" in said, said
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))
    assert list(tmp_path.iterdir()) == []  # no database, report, key or home folder made


@pytest.mark.parametrize(("command", "words", "name"), _PATHS)
def test_a_path_too_long_for_the_file_system_is_refused_naming_the_option(command: list[str], words: list[str],
                                                                           name: str, tmp_path: Path) -> None:
    """A name over 255 bytes (a pasted value, a path glued to another): every later look at it (exists, is_dir,
    open) raised "File name too long", and `db current --db`, `--config`, `profile --plan`, `report --out`, `model
    predict --preset` ended in that traceback. Refused before anything runs, exit 2, naming the option."""
    long = str(tmp_path / ("x" * 300))
    r = _invoke([*command, *words, long], tmp_path)
    said = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2, said
    assert f"Invalid value for '{name}'" in said and "is too long for the file system" in said, said
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))


@pytest.mark.parametrize("where", ["MOETUNE_STORE_DB", "MOETUNE_HOME", "[store] db"])
def test_a_configured_database_path_too_long_is_a_config_error(where: str, tmp_path: Path) -> None:
    """The same name set by MOETUNE_STORE_DB, a config file's [store] db, or MOETUNE_HOME (the default database in
    it): `db current`, `profiles list`, `tune show`, `tune` and `profile` ended in the "File name too long"
    traceback of their first look at the file. Now the config's error naming the variable or key, exit 2."""
    long = str(tmp_path / ("x" * 300))
    home = tmp_path / "home"
    env = {"MOETUNE_HOME": str(home), "HOME": str(home), "COLUMNS": "400", "MOETUNE_CONFIG": "",
           "XDG_CONFIG_HOME": str(home / "cfg"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    named = {"MOETUNE_STORE_DB": "store.db in environment variable MOETUNE_STORE_DB",
             "MOETUNE_HOME": "(in $MOETUNE_HOME)", "[store] db": "store.db in "}[where]
    if where == "[store] db":
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'[store]\ndb = "{long}"\n')
        env["MOETUNE_CONFIG"] = str(cfg)
    else:
        env[where] = long
    for args in (["db", "current"], ["profiles", "list"], ["tune", "show"], ["profile", "--quick", "--capture", CAP],
                 ["tune", *_T]):
        r = CliRunner().invoke(app, args, env=env)
        said = " ".join(r.output.replace("│", " ").split())
        assert r.exit_code == 2, (args, said, r.exception)
        assert named in said and "longer than the file system allows (255)" in said, (args, said)
        assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))


def test_the_empty_path_check_leaves_the_help_as_typer_shows_a_path() -> None:
    """path_option's parser would show `<Path>`: the help keeps `<path>` (and `<list[Path]>` for --data)."""
    r = CliRunner().invoke(app, ["profile", "--help"], env={"COLUMNS": "200"})
    h = re.sub(r"\s+", " ", r.output.replace("│", " "))
    assert "--report-dir <path>" in h and "<Path>" not in h, h
    r = CliRunner().invoke(app, ["model", "calibrate", "--help"], env={"COLUMNS": "200"})
    assert "<list[Path]>" in r.output, r.output


# -- the exit status of a file error is the same in every command ------------------------------------------------
# 2: the command line is wrong (an input missing, unreadable or not what it should be; an output path that cannot be
# written); 1: the work failed (a full disk; the database busy or not writable by this user). `moetune --help` says so.
CAP = str(Path(__file__).parent / "captures" / "dgx-h100")
_Q = ["--model", "qwen3-30b", "--ep", "8", "--tokens", "16"]
_T = ["--model", "qwen3-30b", "--preset", "ndr-ibrc-h100x8", "--tokens", "16", "--trials", "1"]
_TOML, _GARBAGE, _JSON = b"[store\nx = ", b"not a database, not JSON " * 8, b"{bad json\n"
_CANNOT_SETPRIV = os.geteuid() == 0 and shutil.which("setpriv") is None
# root's override of file permissions dropped (as tests/test_store_not_writable.py does): a 0000 file is unreadable
_AS_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []


def _invoke(args: list[str], tmp_path: Path):
    home = tmp_path / "home"
    return CliRunner().invoke(app, args, env={"MOETUNE_HOME": str(home), "HOME": str(home), "COLUMNS": "400",
                                              "MOETUNE_CONFIG": "", "XDG_CONFIG_HOME": str(home / "cfg"),
                                              "XDG_RUNTIME_DIR": str(tmp_path / "run")})


def _run_as_user(args: list[str], tmp_path: Path) -> tuple[int, str]:
    """The command in a child process that cannot pass file permissions (root's override dropped)."""
    home = tmp_path / "home"
    p = subprocess.run([*_AS_USER, sys.executable, "-c", "from moetune.tuner.cli import main; main()", *args],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=child_env(MOETUNE_HOME=str(home), HOME=str(home), COLUMNS="400", MOETUNE_CONFIG="",
                                     XDG_RUNTIME_DIR=str(tmp_path / "run")))
    return p.returncode, p.stdout + p.stderr


def _refused(code: int, output: str, want: int, *named: str) -> None:
    said = " ".join(output.replace("│", " ").split())
    assert code == want, (code, said)
    assert "Traceback" not in output, output
    for n in named:
        assert n in said, (n, said)


def _keys(tmp_path: Path) -> Path:
    from moetune.tuner.cli.keys import generate_keys

    generate_keys(tmp_path / "srv")
    return tmp_path / "srv"


def _db(tmp_path: Path) -> Path:
    from moetune.tuner.store.store import Store

    db = tmp_path / "good.db"
    Store(db).close()
    return db


# (id, the command with {} for the path, the kinds of input tried: m missing, b not what it should be, d a directory,
# its bad bytes)
_INPUTS = [
    ("db path --config", ["db", "path", "--config", "{}"], "mbd", _TOML),
    ("profiles list --config", ["profiles", "list", "--config", "{}"], "mbd", _TOML),
    ("status --config", ["status", "--config", "{}"], "mbd", _TOML),
    ("query --config", ["query", *_Q, "--config", "{}"], "mbd", _TOML),
    ("tune --config", ["tune", *_T, "--config", "{}"], "mbd", _TOML),
    ("report --db", ["report", "--capture", CAP, "--db", "{}"], "mbd", _GARBAGE),
    ("query --db", ["query", *_Q, "--db", "{}"], "mbd", _GARBAGE),
    ("profiles list --db", ["profiles", "list", "--db", "{}"], "mbd", _GARBAGE),
    ("db current --db", ["db", "current", "--db", "{}"], "mbd", _GARBAGE),
    ("db upgrade --db", ["db", "upgrade", "--db", "{}"], "bd", _GARBAGE),
    ("profiles import --db", ["profiles", "import", "{export}", "--db", "{}"], "bd", _GARBAGE),
    ("tune --db", ["tune", *_T, "--db", "{}"], "bd", _GARBAGE),
    ("profile --plan", ["profile", "--capture", CAP, "--plan", "{}"], "mbd", _TOML),
    ("profile --capture", ["profile", "--capture", "{}"], "mbd", b"x"),
    ("tune --capture", ["tune", "--model", "qwen3-30b", "--backend", "local", "--capture", "{}"], "mbd", b"x"),
    ("fabric show --from", ["fabric", "show", "--from", "{}"], "mbd", b"x"),
    ("serve --capture", ["serve", "--capture", "{}"], "mbd", b"x"),
    ("tune --policy", ["tune", *_T, "--policy", "{}"], "mb", b"[[["),
    ("model predict --preset", ["model", "predict", "--model", "qwen3-30b", "--nodes", "2", "--tokens", "16",
                                "--preset", "{}"], "mbd", b"[[["),
    ("model calibrate --data", ["model", "calibrate", "--preset", "ndr-ibrc-h100x8", "--data", "{}"], "mbd", _JSON),
    ("bench run --from-report", ["bench", "run", "moe-megakernel-vs-unfused", "--from-report", "{}"], "mbd", _JSON),
    ("bench summarize --results", ["bench", "summarize", "--out", "-", "--results", "{}"], "mbd", b"a,b\n1,2\n"),
    ("profiles import PATH", ["profiles", "import", "{}"], "mbd", _JSON),
    ("keys allow PUBLIC_FILE", ["keys", "allow", "{}", "{srv}"], "mbd", b"not a key"),
]


def _input_cases():
    for name, argv, kinds, bad in _INPUTS:
        for k in kinds:
            yield pytest.param(argv, k, bad, id=f"{name} {dict(m='missing', b='not-what-it-should-be', d='a-dir')[k]}")


def _fill(argv: list[str], path: Path, tmp_path: Path) -> list[str]:
    extra = {"{}": str(path)}
    if any("{export}" in a for a in argv):
        extra["{export}"] = str(tmp_path / "export.json")
        (tmp_path / "export.json").write_text('{"format": "moetune-profiles", "version": 1, "profiles": []}')
    if any("{srv}" in a for a in argv):
        extra["{srv}"] = str(_keys(tmp_path))
    out = []
    for a in argv:
        for k, v in extra.items():
            a = a.replace(k, v)
        out.append(a)
    return out


@pytest.mark.parametrize(("argv", "kind", "bad"), list(_input_cases()))
def test_an_input_that_cannot_serve_exits_2_naming_it(argv: list[str], kind: str, bad: bytes, tmp_path: Path) -> None:
    """A missing input, one that is not what it should be (bad TOML or JSON, not a database, not a capture or a key)
    or a folder given for a file: exit 2 in every command, one message naming the path, no traceback."""
    path = tmp_path / "input.x"
    if kind == "b":
        path.write_bytes(bad)
    elif kind == "d":
        path.mkdir()
    r = _invoke(_fill(argv, path, tmp_path), tmp_path)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    _refused(r.exit_code, r.output, 2, str(path))


# the inputs that were read with a message of their own (the database: SQLite's "unable to open database file", exit
# 2 from the readers, "read-only for this user", exit 1, from `db upgrade`, `tune`, `profile` and `serve`)
_UNREADABLE = [
    ("db path --config", ["db", "path", "--config", "{}"], b"[store]\n"),
    ("profiles list --db", ["profiles", "list", "--db", "{}"], None),
    ("db current --db", ["db", "current", "--db", "{}"], None),
    ("db upgrade --db", ["db", "upgrade", "--db", "{}"], None),
    ("db downgrade --db", ["db", "downgrade", "base", "--yes", "--db", "{}"], None),
    ("profiles import --db", ["profiles", "import", "{export}", "--db", "{}"], None),
    ("tune --db", ["tune", *_T, "--db", "{}"], None),
    ("profile --plan", ["profile", "--capture", CAP, "--plan", "{}"], b"[plan]\n"),
    ("model predict --preset", ["model", "predict", "--model", "qwen3-30b", "--nodes", "2", "--tokens", "16",
                                "--preset", "{}"], None),
    ("model calibrate --data", ["model", "calibrate", "--preset", "ndr-ibrc-h100x8", "--data", "{}"], b"{}\n"),
    ("profiles import PATH", ["profiles", "import", "{}"], b"{}"),
    ("keys allow PUBLIC_FILE", ["keys", "allow", "{}", "{srv}"], None),
]


@pytest.mark.skipif(_CANNOT_SETPRIV, reason="root without setpriv reads every file")
@pytest.mark.parametrize(("argv", "content"), [pytest.param(a, c, id=n) for n, a, c in _UNREADABLE])
def test_an_unreadable_input_exits_2_naming_it(argv: list[str], content: bytes | None, tmp_path: Path) -> None:
    """A file given that this user may not read: exit 2 (as a missing one), naming it, in every command; a database
    too, whether the command reads or writes it."""
    path = tmp_path / "input.x"
    if content is not None:
        path.write_bytes(content)
    elif "--preset" in argv:
        from moetune.tuner.fabric_model.presets import load_preset

        path.write_text(load_preset("ndr-ibrc-h100x8").to_toml())
    elif "keys" in argv:
        path.write_bytes((_keys(tmp_path / "c") / "moetune.key").read_bytes())
    else:
        shutil.copy(_db(tmp_path), path)
    path.chmod(0)
    try:
        code, output = _run_as_user(_fill(argv, path, tmp_path), tmp_path)
    finally:
        path.chmod(0o600)
    _refused(code, output, 2, str(path))
    assert re.search(r"is not readable|cannot (be )?read", output), output  # the parser's words, or the command's


@pytest.mark.skipif(_CANNOT_SETPRIV, reason="root without setpriv reads every file")
@pytest.mark.parametrize("argv", [["profiles", "list"], ["db", "current"], ["db", "upgrade"], ["tune", *_T],
                                  ["profiles", "import", "{export}"]], ids=" ".join)
def test_a_configured_database_this_user_may_not_read_exits_2(argv: list[str], tmp_path: Path) -> None:
    """The database named by the config ([store] db), not on the command line: SQLite said "unable to open database
    file" (exit 2) to the readers, and "read-only for this user" (exit 1) to `db upgrade` and `tune`. Every command
    now says it cannot be read, exit 2."""
    db = tmp_path / "m.db"
    shutil.copy(_db(tmp_path), db)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\ndb = "{db}"\n')
    db.chmod(0)
    try:
        code, output = _run_as_user([*_fill(argv, db, tmp_path), "--config", str(cfg)], tmp_path)
    finally:
        db.chmod(0o600)
    _refused(code, output, 2, f"{db}: cannot read it (permission denied)")


@pytest.mark.skipif(_CANNOT_SETPRIV, reason="root without setpriv reads every folder")
@pytest.mark.parametrize("argv", [
    pytest.param(["profile", "--capture", "{}"], id="profile --capture"),
    pytest.param(["tune", "--model", "qwen3-30b", "--backend", "local", "--capture", "{}"], id="tune --capture"),
    pytest.param(["serve", "--capture", "{}"], id="serve --capture"),
    pytest.param(["tune", *_T, "--policy", "{}"], id="tune --policy"),
])
def test_an_unreadable_folder_exits_2_naming_it(argv: list[str], tmp_path: Path) -> None:
    """A Path option's parser replaced Typer's conversion, which refused an existing path this user may not read:
    a capture or policy folder of mode 0000 ended `tune`, `profile` and `serve` in a PermissionError traceback. The
    parser refuses it as Typer did."""
    d = tmp_path / "locked"
    d.mkdir(mode=0)
    try:
        code, output = _run_as_user([a.replace("{}", str(d)) for a in argv], tmp_path)
    finally:
        d.chmod(0o755)
    _refused(code, output, 2, f"path '{d}' is not readable")


@pytest.mark.skipif(_CANNOT_SETPRIV, reason="root without setpriv searches every folder")
@pytest.mark.parametrize("argv", [
    pytest.param(["report", "--capture", CAP, "--out", "{}"], id="report --out"),
    pytest.param(["model", "sweep", "--preset", "ndr-ibrc-h100x8", "--model", "qwen3-30b", "--over", "nodes", "--out",
                  "{}.png"], id="model sweep --out"),
    pytest.param(["bench", "summarize", "--out", "{}"], id="bench summarize --out"),
    pytest.param(["fabric", "capture", "{}"], id="fabric capture DEST"),
    pytest.param(["db", "upgrade", "--db", "{}"], id="db upgrade --db"),
    pytest.param(["profiles", "list", "--db", "{}"], id="profiles list --db"),
    pytest.param(["profiles", "import", "{}"], id="profiles import PATH"),
    pytest.param(["db", "path", "--config", "{}"], id="db path --config"),
])
def test_a_path_below_a_folder_this_user_may_not_search_exits_2_naming_it(argv: list[str], tmp_path: Path) -> None:
    """Below a folder of mode 0000 every look at the path (exists, is_dir) raised PermissionError: these commands
    ended in its traceback. Refused when parsed: exit 2, naming the option and the path."""
    d = tmp_path / "locked"
    d.mkdir(mode=0)
    try:
        code, output = _run_as_user([a.replace("{}", str(d / "x")) for a in argv], tmp_path)
    finally:
        d.chmod(0o755)
    _refused(code, output, 2, str(d / "x"), "cannot be reached: a folder on the way may not be searched")


# (id, the command with {} for the output path)
_OUTPUTS = [
    ("report --out", ["report", "--capture", CAP, "--db", "{db}", "--out", "{}"]),
    ("profile --report-dir", ["profile", "--capture", CAP, "--report-dir", "{}"]),
    ("model sweep --out", ["model", "sweep", "--preset", "ndr-ibrc-h100x8", "--model", "qwen3-30b", "--over", "nodes",
                           "--out", "{}.png"]),
    ("bench summarize --out", ["bench", "summarize", "--out", "{}"]),
    ("bench run --results", ["bench", "run", "fabric-model", "--smoke", "--results", "{}"]),
    ("profiles export PATH", ["profiles", "export", "{}", "--db", "{db}"]),
    ("keys generate DIRECTORY", ["keys", "generate", "{}"]),
    ("keys client --out", ["keys", "client", "{srv}", "--name", "bob", "--out", "{}"]),
    ("fabric capture DEST", ["fabric", "capture", "{}"]),
]


def _fill_out(argv: list[str], path: Path, tmp_path: Path) -> list[str]:
    out = []
    for a in argv:
        if "{db}" in a:
            a = a.replace("{db}", str(_db(tmp_path)))
        if "{srv}" in a:
            a = a.replace("{srv}", str(_keys(tmp_path)))
        out.append(a.replace("{}", str(path)))
    return out


@pytest.mark.parametrize("argv", [pytest.param(a, id=n) for n, a in _OUTPUTS])
def test_an_output_under_a_file_exits_2_naming_it(argv: list[str], tmp_path: Path) -> None:
    """An output path that cannot be made (a file where its folder should be): exit 2, naming the path, nothing
    written."""
    (tmp_path / "afile").write_text("x")
    path = tmp_path / "afile" / "out"
    r = _invoke(_fill_out(argv, path, tmp_path), tmp_path)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    _refused(r.exit_code, r.output, 2, str(tmp_path / "afile"))
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.skipif(_CANNOT_SETPRIV, reason="root without setpriv writes everywhere")
@pytest.mark.parametrize("argv", [pytest.param(a, id=n) for n, a in _OUTPUTS])
def test_an_output_in_a_folder_this_user_may_not_write_exits_2_naming_it(argv: list[str], tmp_path: Path) -> None:
    """No permission to write the output's folder: exit 2 in every command (`profiles export` said 1), naming it."""
    filled = _fill_out(argv, tmp_path / "ro" / "out", tmp_path)
    (tmp_path / "ro").mkdir(mode=0o555)
    try:
        code, output = _run_as_user(filled, tmp_path)
    finally:
        (tmp_path / "ro").chmod(0o755)
    _refused(code, output, 2, str(tmp_path / "ro"))
    assert list((tmp_path / "ro").iterdir()) == []


@pytest.mark.skipif(_CANNOT_SETPRIV, reason="root without setpriv writes everywhere")
def test_a_database_this_user_may_not_write_exits_1(tmp_path: Path) -> None:
    """The database is the exception the README states: one this user may not write (or create) is the store's
    failure, exit 1, from every command that writes it."""
    (tmp_path / "ro").mkdir(mode=0o555)
    db = tmp_path / "ro" / "new.db"
    try:
        for argv in (["db", "upgrade", "--db", str(db)], ["tune", *_T, "--db", str(db)]):
            code, output = _run_as_user(argv, tmp_path)
            _refused(code, output, 1, str(tmp_path / "ro"))
    finally:
        (tmp_path / "ro").chmod(0o755)


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write of an output fails for want of room: the fsync of the atomic writes and of a key pair's files, and
    a capture's write."""
    import errno

    def enospc(*_a: object, **_k: object):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    from moetune.tuner.fabric import capture

    monkeypatch.setattr(os, "fsync", enospc)
    monkeypatch.setattr(capture, "write_capture", enospc)


@pytest.mark.parametrize("argv", [pytest.param(a, id=n) for n, a in _OUTPUTS
                                  if n not in ("profile --report-dir", "bench run --results")])
def test_a_full_disk_exits_1_naming_the_output(argv: list[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails as it is made (no space left): the work failed, not the path given: exit 1 in every
    command (it was 2 in all but `profiles export`), naming the output and the reason."""
    filled = _fill_out(argv, tmp_path / "out", tmp_path)  # the database and keys made before the disk is full
    _full_disk(monkeypatch)
    r = _invoke(filled, tmp_path)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    _refused(r.exit_code, r.output, 1, str(tmp_path / "out"), "No space left on device")


def test_a_full_disk_under_the_database_exits_1() -> None:
    """SQLite's "database or disk is full" is a StoreFull (exit 1), as a full disk under any other output; so is its
    "disk I/O error" (SQLITE_IOERR, an extended code such as SQLITE_IOERR_SHMSIZE 4874: what a full disk usually gives
    first), told by the code, also inside SQLAlchemy's error. The message names the folder."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from moetune.tuner.store.sqlite_errors import sqlite_failure
    from moetune.tuner.store.store import StoreFull

    e = sqlite_failure(Path("/x/m.db"), sqlite3.OperationalError("database or disk is full"), write=True)
    assert isinstance(e, StoreFull) and e.exit_code == 1, repr(e)
    assert str(e).startswith("/x/m.db: database or disk is full: the disk holding /x is full"), str(e)
    for code, full in ((4874, "is full or failed"), (10, "is full or failed"), (13, "is full;")):
        orig = sqlite3.OperationalError("some words")
        orig.sqlite_errorcode = code
        for given in (orig, OperationalError("INSERT", {}, orig)):
            e = sqlite_failure(Path("/x/m.db"), given, write=True)
            assert isinstance(e, StoreFull) and e.exit_code == 1 and f"the disk holding /x {full}" in str(e), str(e)
    other = sqlite3.OperationalError("some words")
    other.sqlite_errorcode = sqlite3.SQLITE_CONSTRAINT
    assert type(sqlite_failure(Path("/x/m.db"), other, write=True)).__name__ == "StoreError"


# KiB left on a 1 MiB tmpfs: SQLite answered "disk I/O error" at 8-32 (its -shm could not grow), "database or disk is
# full" at 4 and 64; both exit 1
_LEFT_KIB = (4, 8, 16, 32, 64)


@pytest.mark.parametrize("argv", [
    pytest.param(["profiles", "import", "{export}", "--db", "{}"], id="profiles import"),
    pytest.param(["fabric", "show", "--record", "--from", CAP, "--db", "{}"], id="fabric show --record"),
    pytest.param(["tune", *_T, "--db", "{}"], id="tune"),
])
def test_a_real_full_disk_under_the_database_exits_1(argv: list[str], tmp_path: Path) -> None:
    """On a filled small filesystem SQLite usually fails first with "disk I/O error" (the -wal/-shm cannot grow), not
    "database or disk is full": that was a plain StoreError, exit 2, as if the command line were wrong. Every amount
    left ends the command with exit 1, naming the folder, no traceback."""
    from small_disk import empty, fill, small_disk
    from store_samples import put_one_profile

    src = tmp_path / "src.db"
    put_one_profile(src)
    export = tmp_path / "export.json"
    assert _invoke(["profiles", "export", str(export), "--db", str(src)], tmp_path).exit_code == 0
    said = []
    with small_disk(tmp_path / "small") as small:
        db = small / "m.db"
        for left in _LEFT_KIB:
            empty(small)
            fill(small, left)
            r = _invoke([a.replace("{export}", str(export)).replace("{}", str(db)) for a in argv], tmp_path)
            assert r.exception is None or isinstance(r.exception, SystemExit), (left, repr(r.exception))
            _refused(r.exit_code, r.output, 1, f"the disk holding {small} is full")
            said.append(r.output)
    assert any("disk I/O error" in o for o in said), said  # the case the words alone missed


def test_a_real_full_disk_leaves_no_partial_key_file_and_keeps_the_old_pair(tmp_path: Path) -> None:
    """`keys generate` wrote NAME.key, then NAME.key_secret, in place: on a full disk the second was left empty beside
    the first (a pair that matches nothing), and --force unlinked the old pair before writing the new one. Both are
    now written to temporary names and renamed into place once whole: with no room for them (none left: the first
    file fails; 4 KiB: the secret file is written, the public one fails), exit 1 naming the directory, the old pair
    byte for byte, no new or temporary file left."""
    from small_disk import fill, small_disk

    with small_disk(tmp_path / "small") as small:
        keys = small / "keys"
        assert _invoke(["keys", "generate", str(keys)], tmp_path).exit_code == 0
        old = {p.name: p.read_bytes() for p in keys.iterdir()}
        assert sorted(old) == ["moetune.key", "moetune.key_secret"]
        for left in (0, 4):
            fill(small, left)
            for argv in (["keys", "generate", str(keys), "--force"], ["keys", "generate", str(keys), "--name", "new"]):
                r = _invoke(argv, tmp_path)
                assert r.exception is None or isinstance(r.exception, SystemExit), (left, repr(r.exception))
                _refused(r.exit_code, r.output, 1, f"in {keys}: No space left on device")
                assert {p.name: p.read_bytes() for p in keys.iterdir()} == old, (left, argv)
        fill(small, 64)  # room again: the same command works
        assert _invoke(["keys", "generate", str(keys), "--force"], tmp_path).exit_code == 0
        assert sorted(p.name for p in keys.iterdir()) == ["moetune.key", "moetune.key_secret"]
        assert (keys / "moetune.key_secret").read_bytes() != old["moetune.key_secret"]


def test_the_help_states_the_exit_statuses() -> None:
    r = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "400"})
    said = " ".join(r.output.replace("│", " ").split())
    assert "Exit status: 0 done. 2 the command line is wrong" in said and "1 the command line is fine" in said, said


@pytest.mark.parametrize("argv", [pytest.param(["report", "--capture", CAP, "--db", "{db}", "--out", "-"], id="report"),
                                  pytest.param(["profile", "--capture", CAP, "--report-dir", "-"], id="profile")])
def test_a_report_folder_of_dash_is_refused_not_made(argv: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench summarize --out -` prints to stdout, but `report --out -` (and `profile --report-dir -`) made a folder
    literally named "-" in the current folder and wrote the report there. The report is a folder (report.md and its
    PNG plots), not one file that stdout could take: "-" is refused, exit 2, naming the option, nothing made."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, _fill_out(argv, tmp_path, tmp_path))
    _refused(r.exit_code, r.output, 2, argv[-2] + " -", "not stdout")
    assert not (tmp_path / "-").exists()
    assert "stdout" in _help(argv[0], argv[-2])


def _help(command: str, option: str) -> str:
    """The help text of `command`'s `option`, its lines joined."""
    r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    said = " ".join(r.output.replace("│", " ").split())
    return said[said.index(option):]
