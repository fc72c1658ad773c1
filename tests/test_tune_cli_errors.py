"""`moetune tune` / `tune show` errors a QA pass found: each is one clear line (no traceback) naming what is wrong,
and `tune show` never writes to the storage it is pointed at."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(240)
runner = CliRunner()
TUNE = ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "3", "--tokens", "128"]


def _clean_exit(r, code: int = 2) -> None:  # type: ignore[no-untyped-def]
    assert r.exit_code == code, r.output
    assert isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output


def test_a_store_error_after_the_trials_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A corrupt or locked profile database (or a full disk) raising StoreError from the profile write after the
    trials ran: one line naming the database and saying the trials are kept, not a Rich traceback."""
    from moetune.tuner.store import Store, StoreError

    db = tmp_path / "x.db"

    def malformed(self: Store, key: object) -> None:
        raise StoreError(f"{self.path}: database disk image is malformed")

    monkeypatch.setattr(Store, "get_current", malformed)
    r = runner.invoke(app, [*TUNE, "--db", str(db)])
    _clean_exit(r)
    assert f"{db}: database disk image is malformed" in r.output
    assert "trial(s) this run finished are saved in the studies file" in r.output
    assert "run the same command again" in r.output
    monkeypatch.undo()  # the studies kept them: a re-run resumes and stores the profile
    r = runner.invoke(app, [*TUNE, "--db", str(db), "--json"])
    assert r.exit_code == 0, r.output


def test_an_optuna_error_mid_run_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.search import study

    def finished(self: object, trial: optuna.Trial) -> float:
        raise optuna.exceptions.UpdateFinishedTrialError(f"Trial#{trial.number} has already finished and can not be "
                                                         "updated.")

    monkeypatch.setattr(study._Objective, "_run", finished)
    r = runner.invoke(app, [*TUNE, "--db", str(tmp_path / "x.db")])
    _clean_exit(r)
    assert "UpdateFinishedTrialError: Trial#0 has already finished" in r.output
    assert "run the same command again to resume" in r.output


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tables(path: Path) -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()


@pytest.mark.parametrize("study", [None, "x"])
def test_show_refuses_a_file_without_studies_and_leaves_it_as_it_is(tmp_path: Path, study: str | None) -> None:
    """`tune show --storage sqlite:///other.db` gave a foreign file (or the profile database) Optuna's 12 tables."""
    other = tmp_path / "other_app.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE notes (body TEXT)")
    con.commit()
    con.close()
    before = _digest(other)
    r = runner.invoke(app, ["tune", "show", "--storage", f"sqlite:///{other}", *(["--study", study] if study else [])])
    _clean_exit(r)
    assert f"{other} is not an Optuna studies storage" in r.output
    assert "move it aside" not in r.output
    assert _digest(other) == before and _tables(other) == {"notes"}


def test_show_reads_a_studies_file_without_writing_it(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    r = runner.invoke(app, [*TUNE, "--db", str(db), "--json"])
    assert r.exit_code == 0, r.output
    studies = tmp_path / "x-studies.db"  # the default studies file of --db x.db
    con = sqlite3.connect(studies)  # all in the main file, so its bytes say whether anything was written
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    before = _digest(studies)
    r = runner.invoke(app, ["tune", "show", "--db", str(db)])
    assert r.exit_code == 0 and "moetune/" in r.output, r.output
    r = runner.invoke(app, ["tune", "show", "--db", str(db), "--study", "S128", "--json"])
    assert r.exit_code == 0 and '"best_us"' in r.output, r.output
    assert _digest(studies) == before


def test_show_with_a_plain_path_says_what_to_type_and_prints_no_python_warning(tmp_path: Path) -> None:
    """A plain path for --storage printed Optuna's ExperimentalWarning before SQLAlchemy's parse error."""
    script = ("import sys\nsys.argv = ['moetune', 'tune', 'show', '--storage', sys.argv[1]]\n"
              "from moetune.tuner.cli import main\nmain()\n")
    plain = tmp_path / "plain.db"
    r = subprocess.run([sys.executable, "-W", "default", "-c", script, str(plain)], capture_output=True, text=True,
                       env={**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "300"}, timeout=200)
    assert r.returncode == 2, r.stderr
    assert "Warning" not in r.stderr and "Traceback" not in r.stderr
    assert f"--storage {plain}: not a storage URL (a SQLite file is sqlite:///{plain})" in r.stderr
    assert not plain.exists()


def test_tune_options_before_a_subcommand_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`moetune tune --policy /nonexistent show` exited 0: the options of `tune` itself never reach `show`."""
    r = runner.invoke(app, [*TUNE, "--db", str(tmp_path / "moetune.db"), "--json"])  # a studies file to show
    assert r.exit_code == 0, r.output
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path))
    missing = tmp_path / "nonexistent"
    r = runner.invoke(app, ["tune", "--policy", str(missing), "show"])
    _clean_exit(r)
    assert f"--policy {missing}: no such file or directory" in r.output
    r = runner.invoke(app, ["tune", "--db", str(tmp_path / "x.db"), "show"])
    _clean_exit(r)
    assert "--db: an option of `moetune tune`, given before `show`" in r.output
    assert runner.invoke(app, ["tune", "show"]).exit_code == 0


def test_a_busy_studies_file_is_not_called_broken() -> None:
    """Two first runs at once: the loser was told to move a good studies file aside."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    from moetune.tuner.cli.tune_storage import _storage_error

    for e in (IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed: alembic_version.version_num")),
              OperationalError("CREATE", {}, Exception("table trials already exists")),
              OperationalError("BEGIN", {}, Exception("database is locked"))):
        msg = _storage_error("sqlite:////h/moetune-studies.db", False, e)
        assert "move it aside" not in msg and "busy" in msg and "run the command again" in msg


@pytest.mark.parametrize(("preset", "says"), [
    (None, "the model backend needs --preset"),
    ("nosuch", "unknown preset 'nosuch'; known:"),
    ("missing.toml", "preset file 'missing.toml' does not exist"),
])
def test_a_model_tune_without_a_usable_preset_creates_no_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    preset: str | None, says: str) -> None:
    """The preset was loaded only when the tune began, after the profile database and the studies file (and its
    lock) were made: a missing or unknown --preset left three new files behind its exit 2."""
    monkeypatch.chdir(tmp_path)
    args = ["tune", "-m", "qwen3-30b", "--backend", "model", "--trials", "3", "--tokens", "128", "--ep-size", "8"]
    r = runner.invoke(app, args + ([] if preset is None else ["--preset", preset]),
                      env={"MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "", "COLUMNS": "300"})
    _clean_exit(r)
    assert says in " ".join(r.output.split()), r.output
    assert not (tmp_path / "home").exists() or list((tmp_path / "home").iterdir()) == []


def test_a_bad_policy_override_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tune --policy` on a non-UTF-8 file was a traceback (UnicodeDecodeError), and a family typo tuned with the
    override ignored (exit 0). Both are one line naming the file, from --policy and from $MOETUNE_POLICY alike,
    before any database is created."""
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[policy]\nfamily = "ibgda"\n# caf\xe9\n')
    typo = tmp_path / "typo.toml"
    typo.write_text('[policy]\nfamily = "ibgdaa"\n[knobs]\nnum_sms = [1]\n')
    db = tmp_path / "m.db"
    for f, words in ((latin1, "not UTF-8 text"), (typo, "policy.family: 'ibgdaa' is no transport family")):
        r = runner.invoke(app, [*TUNE, "--db", str(db), "--policy", str(f)])
        _clean_exit(r)
        assert f"{f}: {words}" in " ".join(r.output.split()), r.output
        with monkeypatch.context() as m:
            m.setenv("MOETUNE_POLICY", str(f))
            r = runner.invoke(app, [*TUNE, "--db", str(db)])
        _clean_exit(r)
        assert f"MOETUNE_POLICY: {f}: {words}" in " ".join(r.output.split()), r.output
    assert not db.exists()



_SMALL_TUNE = ["tune", "--model", "qwen3-30b", "--preset", "ndr-ibrc-h100x8", "--tokens", "16", "--trials", "5"]


def _tune_child(args: list[str], tmp_path: Path) -> tuple[int, str]:
    """The command in a child process: an in-process run leaves its Optuna storage's connections open, and a file
    deleted while open keeps its room on the small disk."""
    p = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'moetune'; from moetune.tuner.cli import main; "
                        "main()", *args], capture_output=True, text=True, timeout=200,
                       env={**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "",
                            "COLUMNS": "1000"})
    said = p.stdout + p.stderr
    assert "Traceback" not in said, said
    return p.returncode, " ".join(said.split())


def test_a_full_disk_under_the_studies_file_exits_1_and_the_study_resumes(tmp_path: Path) -> None:
    """A studies file on a full disk (a real 1 MiB tmpfs, filled to a few KiB): exit 1, naming the folder, free
    space and run the same command again; it resumes the trials the file holds. SQLite's "disk I/O error" or
    "database or disk is full" must not reach the generic branches: "cannot open the study storage" (exit 2) when it
    is opened, "the tune stopped on an Optuna error (StorageInternalError ...)" (exit 2) or Optuna's own
    AssertionError ("Should not reach.", a traceback) mid-run."""
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from small_disk import empty, fill, small_disk

    said = []
    with small_disk(tmp_path / "small") as small:
        storage = f"sqlite:///{small}/s.db"
        for left in (8, 64, 256, 704):  # opened: "disk I/O error", "database or disk is full"; 704: mid-run
            empty(small)
            fill(small, left)
            db = tmp_path / f"p{left}.db"  # the profile database elsewhere: only the studies file is short of room
            code, out = _tune_child([*_SMALL_TUNE, "--db", str(db), "--storage", storage], tmp_path)
            assert code == 1, (left, out)
            said.append(out)
            assert f"--storage {storage}: the disk holding {small} is full" in out, out
            assert "free space there" in out and "run the same command again (the file is kept: a study it holds resumes" in out, out
        assert any("disk I/O error" in o for o in said) and any("database or disk is full" in o for o in said), said
        (small / "fill").unlink()  # room again: the last run's finished trials resume
        code, out = _tune_child([*_SMALL_TUNE, "--db", str(db), "--storage", storage], tmp_path)
        assert code == 0 and re.search(r"resumed, [1-9]/5 done", out), out
        # the default studies file, beside a profile database that still fits
        empty(small)
        fill(small, 128)
        code, out = _tune_child([*_SMALL_TUNE, "--db", str(small / "m.db")], tmp_path)
        assert code == 1 and f"the disk holding {small} is full" in out and "Optuna error" not in out, out


def test_a_full_disk_under_the_profile_database_after_the_trials_says_free_space(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A StoreFull from the profile write after the trials: exit 1, free space and run the same command again, not
    the damaged file's advice ("fix the database (or pass another --db)"): nothing is wrong with the file. The
    trials are kept and a re-run with room stores the profile."""
    from moetune.tuner.store import Store, StoreFull

    db = tmp_path / "x.db"

    def full(self: Store, key: object) -> None:
        raise StoreFull(f"{self.path}: database or disk is full: the disk holding {tmp_path} is full; free space "
                        "there, then run the command again")

    monkeypatch.setattr(Store, "get_current", full)
    r = runner.invoke(app, [*TUNE, "--db", str(db)])
    _clean_exit(r, 1)
    said = " ".join(r.output.split())
    assert "fix the database" not in said and "pass another --db" not in said, said
    assert "trial(s) this run finished are saved in the studies file" in said, said
    assert "free space, then run the same command again: the studies resume" in said, said
    monkeypatch.undo()
    r = runner.invoke(app, [*TUNE, "--db", str(db), "--json"])
    assert r.exit_code == 0, r.output


def test_tokens_above_the_largest_bucket_are_refused(tmp_path: Path) -> None:
    """`--tokens 99999999999` is refused with the same rule and words as `profile` (tuner/cli/_args.tokens_over_bucket),
    exit 2, no database made, not tuned and stored at S=65536."""
    db = tmp_path / "x.db"
    r = runner.invoke(app, ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--tokens", "128,99999999999",
                            "--db", str(db)])
    _clean_exit(r)
    assert "99999999999 is above the largest token bucket (65536 tokens per rank)" in " ".join(r.output.split())
    assert not db.exists()
    r = runner.invoke(app, [*TUNE[:-1], "65536", "--db", str(db), "--json"])  # the largest itself is fine
    assert r.exit_code == 0, r.output


def test_counts_sharing_a_bucket_are_tuned_once_and_said_once(tmp_path: Path) -> None:
    """`--tokens 128,128,100`: one S=128 study, and one line naming the counts that share the bucket."""
    import json

    r = runner.invoke(app, [*TUNE[:-1], "128,128,100", "--db", str(tmp_path / "x.db"), "--json"])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert flat.count("share a token bucket") == 1
    assert "128, 128, 100 (bucket 128)" in flat
    assert [row["tokens"] for row in json.loads(r.stdout)] == [128]


@pytest.mark.parametrize(("args", "named"), [
    (["--backend", "model", "--world", "4"], "--world"),
    (["--backend", "model", "--comm", "gloo"], "--comm"),
    (["--backend", "model", "--repeats", "5"], "--repeats"),
    (["--backend", "model", "--trial-timeout", "9"], "--trial-timeout"),
    (["--backend", "local", "--node-model"], "--node-model"),
])
def test_an_option_the_backend_does_not_read_is_refused(tmp_path: Path, args: list[str], named: str) -> None:
    """Each is refused, exit 2 naming it and why, before any database: accepted, it would do nothing (`--backend
    model --world 4` tuning as without it)."""
    db = tmp_path / "x.db"
    r = runner.invoke(app, ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--tokens", "128", *args,
                            "--db", str(db)] if "--node-model" not in args else
                      ["tune", "-m", "qwen3-30b", "--tokens", "128", *args, "--db", str(db)])
    _clean_exit(r)
    flat = " ".join(r.output.split())
    assert f"{named}: it applies to the" in flat, flat
    assert not db.exists()


def test_a_preset_with_the_local_backend_is_refused(tmp_path: Path) -> None:
    r = runner.invoke(app, ["tune", "-m", "qwen3-30b", "--backend", "local", "--preset", "nvlink-h200x2",
                            "--db", str(tmp_path / "x.db")])
    _clean_exit(r)
    assert "--preset: it applies to the fabric model; --backend local measures" in " ".join(r.output.split())


def test_tune_show_says_interrupted_never_none(tmp_path: Path) -> None:
    """A trial ended by SIGTERM/Ctrl-C has no `error`: `tune show --study` says "interrupted"
    (trials.is_interrupted), not "trial N failed: None", and a failed measurement keeps its own reason."""
    import json

    db = tmp_path / "x.db"
    r = runner.invoke(app, [*TUNE, "--db", str(db), "--json"])
    assert r.exit_code == 0, r.output
    name = json.loads(r.stdout)[0]["study"]
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'x-studies.db'}")
    cut = study.ask()
    study.tell(cut, state=optuna.trial.TrialState.FAIL)  # as Optuna fails a trial its interrupt left untagged
    bad = study.ask()
    bad.set_user_attr("error", "rank 1 [exit 9]")
    study.tell(bad, state=optuna.trial.TrialState.FAIL)
    r = runner.invoke(app, ["tune", "show", "--study", name, "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert "None" not in r.output, r.output
    assert f"trial {cut.number} interrupted (not counted)" in r.output, r.output
    assert f"trial {bad.number} failed: rank 1 [exit 9]" in r.output, r.output
    r = runner.invoke(app, ["tune", "show", "--study", name, "--db", str(db), "--json"])
    failed = {f["trial"]: f for f in json.loads(r.stdout)["failed"]}
    assert failed[cut.number] == {"trial": cut.number, "interrupted": True, "error": "interrupted"}
    assert failed[bad.number]["interrupted"] is False
