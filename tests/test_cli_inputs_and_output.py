"""The CLI's inputs and output (fabric, report, serve, query, help, config, messages): a capture folder is one, help
and tables fit the console uncut, and errors name the option or path and what to do."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_env import child_env  # beside this file

CAPTURES = Path(__file__).parent / "captures"


def _run(*args: str, home: Path | None = None, columns: int = 80):
    env = {"MOETUNE_CONFIG": "", "COLUMNS": str(columns)}
    if home is not None:
        env["MOETUNE_HOME"] = str(home)
    r = CliRunner().invoke(app, list(args), env=env, terminal_width=columns)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    return r, " ".join(r.output.split())


def _refused(r, out: str, *needles: str, code: int = 2) -> None:
    assert r.exit_code == code, (r.exit_code, out)
    for n in needles:
        assert n in out, (n, out)


# -- 1. a capture must be one: exist, be a directory, hold the manifest `fabric capture` writes ---------------------
def test_report_refuses_an_empty_capture_folder(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    assert _run("db", "upgrade", "--db", str(db), home=tmp_path)[0].exit_code == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    r, out = _run("report", "--db", str(db), "--capture", str(empty), "--out", str(tmp_path / "rep"), home=tmp_path)
    _refused(r, out, str(empty), "not a fabric capture", "is empty", "manifest.json", "moetune fabric capture")
    assert not (tmp_path / "rep" / "report.md").exists()


def test_fabric_show_refuses_a_folder_without_a_manifest(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    (junk / "proc").mkdir(parents=True)
    r, out = _run("fabric", "show", "--capture", str(junk))
    _refused(r, out, str(junk), "holds no manifest.json")
    (junk / "manifest.json").write_text('{"format": "other"}')
    r, out = _run("fabric", "show", "--capture", str(junk))
    _refused(r, out, "manifest.json", "not a fabric capture manifest")
    r, out = _run("fabric", "show", "--capture", str(CAPTURES / "cpu-laptop"), "--json")  # a real one still reads
    assert r.exit_code == 0, out


def test_fabric_diff_against_empty_is_not_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r, out = _run("fabric", "diff", "--against", "", "--from", str(CAPTURES / "cpu-laptop"), home=tmp_path)
    _refused(r, out, "--against is empty", "fingerprint hash", "capture directory")


def test_serve_applies_the_same_rule_with_a_discover_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.daemon import server

    monkeypatch.setattr(server, "run_daemon", lambda **kw: 0)  # never started: the capture is refused first
    empty = tmp_path / "empty"
    empty.mkdir()
    r, out = _run("serve", "--db", str(tmp_path / "m.db"), "--capture", str(empty), "--discover-hook", "x:y",
                  home=tmp_path)
    _refused(r, out, f"--capture {empty}", "not a fabric capture")


@pytest.mark.parametrize(("option", "hook", "said"), [
    ("--store-hook", "nosuch_module_x:f", "cannot import 'nosuch_module_x'"),
    ("--discover-hook", "os:nosuch", "module 'os' has no attribute 'nosuch'"),
    ("--retune-hook", "os:sep", "is not callable"),
    ("--store-hook", ".x:y", "relative import"),
])
def test_serve_names_a_hook_that_cannot_be_loaded(option: str, hook: str, said: str, tmp_path: Path) -> None:
    """A hook (`serve`'s test seams) naming a module or attribute that is not there ended `serve` in the import's
    ModuleNotFoundError / AttributeError traceback, and one that is not callable in a TypeError once called (a
    --retune-hook only at the first re-tune). A child process: the daemon's log handler stays out of this one."""
    from moetune.tuner.store.store import Store

    Store(tmp_path / "m.db").close()
    r = subprocess.run([sys.executable, "-c", "import sys; from moetune.tuner.cli import main; sys.exit(main())",
                        "serve", "--db", str(tmp_path / "m.db"), "--capture", str(CAPTURES / "dgx-h100"), "--socket",
                        f"ipc://{tmp_path}/d.sock", option, hook], capture_output=True, text=True, timeout=60,
                       env=child_env(MOETUNE_HOME=str(tmp_path / "home"), MOETUNE_CONFIG="", COLUMNS="400"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"hook {hook!r}" in r.stderr and said in r.stderr, r.stderr


# -- 2. --help shows every option name whole at 80 columns ---------------------------------------------------------
def _names_whole(args: tuple[str, ...], columns: int) -> None:
    import typer

    cmd = typer.main.get_command(app)
    for a in args:
        cmd = cmd.get_command(None, a)
    r, _ = _run(*args, "--help", columns=columns)
    assert r.exit_code == 0 and "…" not in r.output, r.output
    assert max(map(len, r.output.splitlines())) <= columns, r.output
    for p in cmd.params:
        for name in (*p.opts, *p.secondary_opts):
            if name.startswith("--") and not p.hidden:
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", r.output), (args, name, r.output)


@pytest.mark.parametrize("args,columns", [(("serve",), 80), (("serve",), 60), (("bench", "ep"), 80)])
def test_help_never_cuts_an_option_name(args: tuple[str, ...], columns: int) -> None:
    _names_whole(args, columns)
    r, _ = _run(*args, "--help", columns=columns)
    if args == ("serve",):
        assert "daemon.rediscover_interval_s" in r.output.replace("│", "").replace("\n", "").replace(" ", "")
    else:
        assert "compression=fp8_e4m3,pipeline_depth=2" in r.output.replace("│", "").replace("\n", "").replace(" ", "")


# -- 3. fabric show fits the console (it was laid out at 160 columns in a pipe) -------------------------------------
@pytest.mark.parametrize("columns", [80, 60])
def test_fabric_show_fits_the_console_without_cutting(columns: int) -> None:
    r, _ = _run("fabric", "show", "--capture", str(CAPTURES / "dgx-h100"), columns=columns)
    assert r.exit_code == 0, r.output
    assert max(map(len, r.output.splitlines())) <= columns, r.output
    flat = r.output.replace("│", " ")
    assert "81559 MiB" in flat and "mlx5_11" in flat and "proxy:ibrc" in flat, r.output
    assert "not shown at" in " ".join(r.output.split()) and "UUID" in r.output  # the caption names what is left out
    if columns == 80:
        assert "NVIDIA H100 80GB HBM3" in r.output and "18/18 × 26.562 GB/s" in r.output, r.output


# -- 4. --config DIR: a folder, not a missing file ------------------------------------------------------------------
@pytest.mark.parametrize("args", [("db", "path"), ("serve",), ("tune", "--model", "qwen3-30b")])
def test_config_folder_is_said_to_be_a_folder(args: tuple[str, ...], tmp_path: Path) -> None:
    (tmp_path / "moetune.toml").write_text("")
    r, out = _run(*args, "--config", str(tmp_path), home=tmp_path)
    _refused(r, out, f"config file {tmp_path} (from --config) is a directory", f"--config {tmp_path / 'moetune.toml'}")
    assert "does not exist" not in out


# -- 5. messages that named internals ------------------------------------------------------------------------------
def test_serve_log_level_names_the_option_and_the_levels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.daemon import server

    monkeypatch.setattr(server, "run_daemon", lambda **kw: 0)  # a level Python's logging refuses never reaches it
    r, out = _run("serve", "--db", str(tmp_path / "m.db"), "--log-level", "bogus", home=tmp_path)
    _refused(r, out, "--log-level must be one of debug, info, warning, error, critical", "'bogus'")
    assert "Unknown level" not in out


def test_query_names_an_empty_database_file(tmp_path: Path) -> None:
    db = tmp_path / "zero.db"
    db.write_bytes(b"")
    r, out = _run("query", "--model", "qwen3-30b", "--ep", "8", "--tokens", "4", "--db", str(db),
                  "--socket", f"ipc://{tmp_path}/none.sock", home=tmp_path)
    _refused(r, out, f"--db {db} is not a moetune database (it is empty)", f"moetune db upgrade --db {db}")
    assert "no such table" not in out


@pytest.mark.parametrize("where", ["x.db", "bad/missing/x.db"])
def test_query_refuses_a_db_that_does_not_exist(tmp_path: Path, where: str) -> None:
    """An explicit --db that does not exist printed the NO-tuned-profile line and the policy default's exports,
    exit 0 (a directory or a non-database --db was already refused); without --db the fallback stays."""
    db = tmp_path / where
    r, out = _run("query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16", "--db", str(db), "--format", "env",
                  "--socket", f"ipc://{tmp_path}/none.sock", home=tmp_path)
    _refused(r, out, f"--db {db} does not exist")
    assert "export" not in r.stdout and not db.exists()
    r, out = _run("query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16", "--format", "env",
                  "--socket", f"ipc://{tmp_path}/none.sock", "--timeout-ms", "100", home=tmp_path)
    assert r.exit_code == 0 and "export MOETUNE_PROFILE_HASH=policy:" in r.stdout, out


def test_profiles_import_of_a_json_object_without_format(tmp_path: Path) -> None:
    f = tmp_path / "e.json"
    f.write_text("{}")
    r, out = _run("profiles", "import", str(f), "--db", str(tmp_path / "m.db"), home=tmp_path)
    _refused(r, out, f"{f} is not a moetune export file (an empty JSON object", "moetune profiles export")
    assert "'None'" not in out and not (tmp_path / "m.db").exists()


def test_keys_messages_name_the_path_and_what_to_do(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    r, out = _run("keys", "generate", str(f))
    _refused(r, out, f"key directory {f} is a file, not a directory")
    assert "Errno" not in out
    srv = tmp_path / "srv"
    assert _run("keys", "generate", str(srv))[0].exit_code == 0
    r, out = _run("keys", "allow", str(tmp_path / "nope.key"), str(srv))
    _refused(r, out, f"{tmp_path / 'nope.key'}: no such file")
    assert "Invalid certificate" not in out
    # a key file whose public key is no CURVE key was copied in and reported allowed (it lets nobody in)
    bad = tmp_path / "bob.key"
    bad.write_text('metadata\ncurve\n    public-key = "not-a-key"\n')
    r, out = _run("keys", "allow", str(bad), str(srv), "--admin")
    _refused(r, out, f"{bad}: its public key b'not-a-key' is not a CURVE key (40 Z85 characters)")
    assert not (srv / "clients" / "bob.key").exists() and not (srv / "admins" / "bob.key").exists()


def test_db_downgrade_above_the_database_and_unknown_revisions(tmp_path: Path) -> None:
    db = tmp_path / "d.db"
    assert _run("db", "upgrade", "--db", str(db), "--revision", "0004")[0].exit_code == 0
    r, out = _run("db", "downgrade", "0006", "--yes", "--db", str(db))
    _refused(r, out, "is at revision 0004; 0006 is above it", "moetune db upgrade --revision 0006")
    assert "not a valid downgrade target" not in out
    r, out = _run("db", "downgrade", "nope", "--db", str(db))
    _refused(r, out, "revision 'nope' is not a schema revision", "0001, 0002, 0003, 0004, 0005", "or base")
    r, out = _run("db", "current", "--db", str(db))
    assert "revision 0004" in out, out  # neither touched it


def test_fabric_capture_prints_a_bracketed_path_whole(tmp_path: Path) -> None:
    """'captured N files to PATH' read PATH as Rich markup: cap[bogus] was printed as cap."""
    dest = tmp_path / "cap[bogus]"
    r, out = _run("fabric", "capture", str(dest), "--timeout", "0.5", home=tmp_path, columns=400)
    assert r.exit_code == 0, out
    assert f"to {dest} " in out, out


def test_fabric_diff_without_a_database_says_to_record_one(tmp_path: Path) -> None:
    """It said 'run `moetune db upgrade`', after which it said to record a fingerprint: one step, named at once."""
    r, out = _run("fabric", "diff", home=tmp_path, columns=400)
    _refused(r, out, f"no database at {tmp_path / 'moetune.db'}", "`moetune fabric show --record`", "--against DIR")
    assert not (tmp_path / "moetune.db").exists()


def test_query_says_its_fallback_once(tmp_path: Path) -> None:
    """The table's footer and JSON's message say why no tuned profile was used; the client's log said it again on
    stderr as one line of hundreds of columns. The env lines do not say it: there stderr keeps it. (A child process:
    the log's handler writes to the process's own stderr, which CliRunner does not capture.)"""
    args = ("query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128")
    for fmt, on_stderr in (("table", False), ("json", False), ("env", True)):
        r = subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", *args, "--format",
                            fmt], capture_output=True, text=True, timeout=120,
                           env=child_env(MOETUNE_HOME=str(tmp_path), MOETUNE_CONFIG="", COLUMNS="80"))
        assert r.returncode == 0, r.stderr
        assert ("NO tuned profile" in r.stderr) is on_stderr, (fmt, r.stderr)
        assert fmt == "env" or "using the policy default" in " ".join(r.stdout.split()), (fmt, r.stdout)


def test_fabric_capture_into_a_file_says_it_is_a_file(tmp_path: Path) -> None:
    """`fabric capture keep.png` (a file) said it 'already exists and is not an empty directory'."""
    dest = tmp_path / "keep.png"
    dest.write_bytes(b"png")
    r, out = _run("fabric", "capture", str(dest), "--timeout", "0.5", home=tmp_path, columns=400)
    _refused(r, out, "is a file, not a directory", code=r.exit_code)
    assert r.exit_code != 0 and dest.read_bytes() == b"png"


_HOSTILE_FAMILY = "proxy:libfabric/x;touch${IFS}PWNED;#"


def _eval_env_lines(stdout: str, cwd: Path) -> None:
    """What `eval "$(moetune query --format env ...)"` does: nothing but exports, every value one moetune sets."""
    from moetune.runtime.profiles.launcher_env import env_refusal

    subprocess.run(["bash", "-c", stdout], cwd=cwd, check=True, env=child_env())
    assert not (cwd / "PWNED").exists(), stdout
    for line in stdout.splitlines():
        if line.startswith("#"):
            continue
        assert line.startswith("export "), stdout
        name, _, value = line.removeprefix("export ").partition("=")
        import shlex

        (value,) = shlex.split(value)
        assert name == "MOETUNE_PROFILE_HASH" or env_refusal(name, value) is None, line


def test_query_env_from_a_hand_edited_database_row_exports_only_quoted_allowed_values(tmp_path: Path) -> None:
    """The database fallback's env was printed unfiltered and unquoted: a family string a hand edit (or another tool)
    left in a row ran as a command in the shell that eval'd the lines."""
    import sqlite3

    import daemon_fakes as F

    from moetune.runtime.knobs import default_knobs
    from moetune.runtime.profile_record import ProfileKey, ProfileRecord

    db = tmp_path / "moetune.db"
    store = F.open_store(db)
    key = ProfileKey(fingerprint="preset:h100x8:abc", software="none", transport_family="proxy:libfabric/cxi",
                     ep_size=2, nodes=1, hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16",
                     token_bucket=64)
    store.put_profile(ProfileRecord(key=key, knobs=default_knobs("proxy"), latency_us=10.0, spread_us=1.0,
                                    backend="model:h100x8", provenance="preset"))
    store.close()
    c = sqlite3.connect(db)
    c.execute("UPDATE profiles SET transport_family = ?", (_HOSTILE_FAMILY,))
    c.commit()
    c.close()
    r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "64", "--db", str(db),
                                 "--format", "env", "--socket", f"ipc://{tmp_path}/none.sock"],
                           env={"MOETUNE_CONFIG": "", "MOETUNE_HOME": str(tmp_path),
                                "MOETUNE_CLIENT_ALLOW_MODELLED": "1"})
    assert r.exit_code == 0, r.output
    assert "export NVSHMEM_REMOTE_TRANSPORT=libfabric" in r.stdout, r.stdout  # the row was the one used
    assert "NVSHMEM_LIBFABRIC_PROVIDER" not in r.stdout.replace("# ", "#").split("#")[0], r.stdout
    _eval_env_lines(r.stdout, tmp_path)


def test_query_env_of_the_policy_default_for_daemon_json_transports_exports_only_quoted_allowed_values(
        tmp_path: Path) -> None:
    """The policy default's family comes from daemon.json (`transports`): its env was printed unfiltered and unquoted."""
    import json

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "daemon.json").write_text(json.dumps({"transports": [_HOSTILE_FAMILY]}))
    r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "64", "--format", "env",
                                 "--socket", f"ipc://{run}/daemon.sock"],
                           env={"MOETUNE_CONFIG": "", "MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    assert "export NVSHMEM_IB_ENABLE_IBGDA=0" in r.stdout, r.stdout  # the proxy default was the one used
    _eval_env_lines(r.stdout, tmp_path)


def test_query_env_lines_are_quoted_and_filtered_whatever_resolve_returns(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The env output itself is safe to eval, not only what resolve now hands it: values shell-quoted, variables
    moetune does not set left out, and a comment with a newline kept to one line."""
    from moetune.runtime.knobs import default_knobs
    from moetune.runtime.profiles.client import ProfileClient, Resolution

    def resolve(self, **kw):
        return Resolution(knobs=default_knobs("proxy"), source="default", profile_hash="default:$(touch PWNED)",
                          status="default", env={"NVSHMEM_LIBFABRIC_PROVIDER": "x;touch PWNED",
                                                 "LD_PRELOAD": "/tmp/evil.so", "NVSHMEM_IB_ENABLE_IBGDA": "0"},
                          env_status="differs", env_diff=["NCCL_X\ntouch PWNED\n: tuned with 1, job has 2"])

    monkeypatch.setattr(ProfileClient, "resolve", resolve)
    r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "64", "--format", "env",
                                 "--socket", f"ipc://{tmp_path}/none.sock"],
                           env={"MOETUNE_CONFIG": "", "MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    assert "LD_PRELOAD=" not in r.stdout and "export NVSHMEM_LIBFABRIC_PROVIDER" not in r.stdout, r.stdout
    assert "export MOETUNE_PROFILE_HASH='default:$(touch PWNED)'" in r.stdout, r.stdout
    assert all(line.startswith(("# ", "export ")) for line in r.stdout.splitlines()), r.stdout
    _eval_env_lines(r.stdout, tmp_path)


def test_output_the_terminal_cannot_encode_is_no_traceback(tmp_path: Path) -> None:
    """Under a UTF-8 locale (stdout's errors "strict") a path whose name is not UTF-8 (argv's byte 0xE9, decoded to
    a surrogate) printed by `db path` raised UnicodeEncodeError; on an ASCII terminal the output's µ, ±, ·, × did:
    a traceback and exit 1 once the work was done. Now the name's own bytes, and \\xNN for what ASCII lacks."""
    import os

    name = os.fsdecode(bytes(tmp_path) + b"/caf\xe9.db")
    code = "import sys; from moetune.tuner.cli import main; sys.exit(main())"
    env = child_env(MOETUNE_HOME=str(tmp_path / "home"), MOETUNE_CONFIG="", COLUMNS="200")
    r = subprocess.run([sys.executable, "-c", code, "db", "path", "--db", name], capture_output=True, timeout=120,
                       env={**env, "PYTHONIOENCODING": "utf-8:strict"})
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode(errors="replace")
    assert r.stdout == os.fsencode(name) + b"\n"
    r = subprocess.run([sys.executable, "-c", code, "model", "predict", "--preset", "nvlink-h200x2", "--model",
                        "qwen3-30b"], capture_output=True, timeout=120, env={**env, "PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode(errors="replace")
    assert b"MODELLED" in r.stdout
