"""CLI input defects from a sweep with bad input: each is a clear error naming the option and value (exit 2), or
exit 1 where nothing could run, never a traceback, never a lost or overwritten file. Numbered as in the sweep."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.cli._args import NonEmptyText

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_commands import cli_commands

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = Path(__file__).parent / "captures"
GARBAGE = bytes(range(256)) * 8 + b"\xff\xfe\x00\x80"  # not UTF-8, NULs: no text format reads it


def _run(*args: str, home: Path | None = None):
    env = {"MOETUNE_HOME": str(home)} if home is not None else None
    return CliRunner().invoke(app, list(args), env=env)


def _refused(r, *needles: str, code: int = 2) -> None:
    """Exit `code`, every needle in the output, no traceback (no exception left the command)."""
    out = r.output
    assert r.exit_code == code, (r.exit_code, out, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in out
    for n in needles:
        assert n in out, (n, out)


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path also where a GPU is


# -- 1. bench summarize / bench run: --results and --out ---------------------------------------------------------
@pytest.fixture
def benchmarks_md(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """BENCHMARKS.md redirected to a scratch file (the real one is never written by these tests)."""
    from moetune.tuner.measure.scenarios import checkout

    md = tmp_path / "BENCHMARKS.md"
    md.write_text("KEEP ME\n")
    monkeypatch.setattr(checkout, "BENCHMARKS_MD", md)
    return md


def test_summarize_refuses_a_missing_results_file_and_keeps_benchmarks_md(tmp_path: Path, benchmarks_md: Path) -> None:
    typo = tmp_path / "typo.csv"
    _refused(_run("bench", "summarize", "--results", str(typo)), "--results", str(typo), "no such file")
    assert benchmarks_md.read_text() == "KEEP ME\n"
    assert not typo.exists()


def test_summarize_refuses_unreadable_results_and_bad_out(tmp_path: Path, benchmarks_md: Path) -> None:
    garbage = tmp_path / "garbage.csv"
    garbage.write_bytes(GARBAGE)
    folder = tmp_path / "dir"
    folder.mkdir()
    _refused(_run("bench", "summarize", "--results", str(garbage), "--out", str(tmp_path / "o.md")),
             "--results", str(garbage), "not a UTF-8")
    _refused(_run("bench", "summarize", "--results", str(folder), "--out", str(tmp_path / "o.md")),
             "--results", str(folder), "is a directory")
    _refused(_run("bench", "summarize", "--out", str(folder)), "--out", str(folder), "is a directory")
    _refused(_run("bench", "summarize", "--out", str(tmp_path / "no" / "o.md")), "--out", "does not exist")
    assert garbage.read_bytes() == GARBAGE and benchmarks_md.read_text() == "KEEP ME\n"
    assert not (tmp_path / "o.md").exists() and not (tmp_path / "no").exists()
    r = _run("bench", "summarize", "--out", str(tmp_path / "ok.md"))  # the real table still summarises
    assert r.exit_code == 0, r.output
    assert (tmp_path / "ok.md").read_text().startswith("# moetune benchmarks")


def test_bench_run_refuses_bad_results_before_running(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.csv"
    garbage.write_bytes(GARBAGE)
    folder = tmp_path / "dir"
    folder.mkdir()
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    for path, words in ((garbage, "not a UTF-8"), (folder, "is a directory"), (not_dir / "s.csv", "is not a directory")):
        _refused(_run("bench", "run", "fabric-model", "--smoke", "--results", str(path)), "--results", str(path), words)
    assert garbage.read_bytes() == GARBAGE and not_dir.read_text() == "x" and not any(folder.iterdir())


def test_results_table_checks(tmp_path: Path) -> None:
    from moetune.tuner.measure import results as R

    R.check_table(tmp_path / "new.csv")  # absent: fine (a new table)
    bad = tmp_path / "b.csv"
    bad.write_bytes(GARBAGE)
    for fn in (R.check_table, R.read_rows):
        with pytest.raises(R.ResultsError, match="not a UTF-8"):
            fn(bad)
        with pytest.raises(R.ResultsError, match="is a directory"):
            fn(tmp_path)
    with pytest.raises(R.ResultsError, match="is a directory"):
        R.append_rows(tmp_path, [])
    assert bad.read_bytes() == GARBAGE


# -- 2. comma-separated integer lists: no empty items ----------------------------------------------------------
@pytest.mark.parametrize("value", ["1,,2", "1,", ",1", ""])
def test_int_list_refuses_empty_items(value: str) -> None:
    from moetune.tuner.cli._args import int_list

    with pytest.raises(ValueError, match="--tokens: expected comma-separated integers"):
        int_list(value, "--tokens")
    assert int_list(" 1, 16 ,128", "--tokens") == [1, 16, 128]


@pytest.mark.parametrize("value", ["1_000", "16,1_0", "٣", "0x10", "1e3", "2.0"])
def test_int_list_takes_digits_only(value: str) -> None:
    """int() read "1_000" as 1000 and "٣" as 3, which a knob list refuses (`num_sms=1_0`): one rule for both."""
    from moetune.tuner.cli._args import int_list

    with pytest.raises(ValueError, match=r"--tokens: expected comma-separated integers, got .* \(digits only, as in --knobs\)"):
        int_list(value, "--tokens")
    assert int_list("+16,-1, 02", "--values") == [16, -1, 2]


@pytest.mark.parametrize("args", [
    ["bench", "moe", "--engine", "torch", "--model", "custom:128,64,8,2", "--tokens", "1_000"],
    ["model", "sweep", "-p", "nvlink-h200x2", "--over", "tokens", "--values", "1_000"],
])
def test_an_underscore_in_a_list_is_refused_naming_the_option(args: list[str], tmp_path: Path) -> None:
    _refused(_run(*args, home=tmp_path), "comma-separated integers, got '1_000' (digits only, as in --knobs)")
    assert not (tmp_path / "moetune.db").exists()


@pytest.mark.parametrize("args", [
    ["bench", "moe", "--tokens", "1,,2"],
    ["bench", "knobs", "--vs", "a=mk_bm=16", "--tokens", "16,"],
    ["tune", "--model", "qwen3-30b", "--tokens", "128,,1024"],
    ["profile", "--tokens", "16,,128"],
])
def test_empty_list_items_are_refused_naming_the_option(args: list[str], tmp_path: Path) -> None:
    _refused(_run(*args, home=tmp_path), "--tokens", "comma-separated integers")


@pytest.mark.parametrize("knobs", ["num_sms=24,,", "num_sms=24,", ",num_sms=24", "num_sms=24,,channels=2", " , "])
# small cases after the knobs: where the knobs were taken, each ends in a second instead of timing the defaults
@pytest.mark.parametrize("cmd", [["bench", "ep", "--world", "1", "--backend", "nccl", "--model", "custom:128,64,8,2"],
                                 ["bench", "moe", "--engine", "torch", "--tokens", "1", "--model", "custom:128,64,8,2"],
                                 ["model", "predict", "-p", "nvlink-h200x2"]])
def test_an_empty_knob_item_is_refused(cmd: list[str], knobs: str, tmp_path: Path) -> None:
    """`--knobs num_sms=24,,` dropped the empty items without a word: a lost name=value is a typo, as --tokens 1,,2."""
    r = _run(*cmd, "--knobs", knobs, home=tmp_path)
    _refused(r, f"expected comma-separated name=value pairs, got {knobs!r} (an empty item)")
    assert "timing" not in r.output and "started" not in r.output


def test_an_empty_knobs_value_still_sets_none() -> None:
    from moetune.runtime.knobs import Knobs

    assert Knobs.parse("") == Knobs.parse("  ") == Knobs()
    assert Knobs.parse(" num_sms=16 , channels=2").num_sms == 16


@pytest.mark.parametrize("cmd", [["profile", "--quick"], ["db", "upgrade"]])
def test_moetune_home_that_is_a_file_is_said_to_be_one(cmd: list[str], tmp_path: Path) -> None:
    """MOETUNE_HOME=<a regular file>: `profile --quick` said "cannot create the folder of .../moetune.db: [Errno 17]
    File exists", `db upgrade` also warned it could not tell whether a daemon serves the database."""
    home = tmp_path / "afile"
    home.write_text("keep")
    r = CliRunner().invoke(app, cmd, env={"MOETUNE_HOME": str(home), "MOETUNE_CONFIG": "", "COLUMNS": "400"})
    _refused(r, f"cannot create {home / 'moetune.db'}: MOETUNE_HOME ({home}) is a file, not a folder")
    assert "Errno" not in r.output and "cannot tell whether a daemon" not in r.output, r.output
    assert home.read_text() == "keep"


@pytest.mark.parametrize("cmd", [["profile"], ["profile", "--quick"], ["tune", "--model", "qwen3-30b"]])
def test_an_empty_tokens_value_is_refused_not_read_as_the_default(cmd: list[str], tmp_path: Path) -> None:
    """`profile --tokens ""` ran the default buckets (the option's own default was "", so "" read as not given);
    `tune --tokens ""` and `profile --tokens " , "` were refused: the same refusal for both, nothing made."""
    r = _run(*cmd, "--tokens", "", home=tmp_path)
    _refused(r, "--tokens")
    said = " ".join(r.output.replace("│", " ").split())  # Typer's box wraps a usage error
    assert "expected comma-separated integers, got '' (an empty item)" in said, r.output
    assert not (tmp_path / "moetune.db").exists()


def test_model_sweep_values_refuse_empty_items(tmp_path: Path) -> None:
    _refused(_run("model", "sweep", "-p", "slingshot11-libfabric-a100x4", "--values", "1,,2", home=tmp_path),
             "--values", "comma-separated integers")


# -- 3. timeouts: positive, checked up front -------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_bench_ep_timeout_must_be_positive(value: str) -> None:
    _refused(_run("bench", "ep", "--timeout", value), "--timeout must be a number of seconds > 0")
    _refused(_run("bench", "ep", "--serve", "--timeout", value), "--timeout must be")


@pytest.mark.parametrize("value", ["0", "-1", "5000000000"])  # the last overflowed zmq's poll: a traceback
def test_timeout_ms_must_be_positive_and_at_most_a_day(value: str, tmp_path: Path) -> None:
    why = "--timeout-ms must be 1 to 86400000 (milliseconds: up to a day)"
    _refused(_run("status", "--timeout-ms", value, home=tmp_path), why, value)
    _refused(_run("retune", "--timeout-ms", value, home=tmp_path), why)
    _refused(_run("query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16", "--timeout-ms", value, home=tmp_path),
             why)


# -- 4. daemon endpoints --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("socket", "words"), [
    ("bogus", "expected ipc:///absolute/path or tcp://HOST:PORT"),
    ("ipc://", "expected ipc:///absolute/path"),
    ("ipc://relative/sock", "expected ipc:///absolute/path"),
    ("tcp://127.0.0.1:99999", "port in 1..65535"),
    ("inproc://x", "expected ipc:///absolute/path or tcp://HOST:PORT"),
    # a folder name that is not UTF-8 (argv's byte 0xE9 as Python decodes it): the length check's encode() raised
    # UnicodeEncodeError, a traceback
    ("ipc:///tmp/caf\udce9/d.sock", "not UTF-8"),
])
def test_client_commands_refuse_a_bad_socket(socket: str, words: str, tmp_path: Path) -> None:
    for args in (["status"], ["retune"], ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16"]):
        _refused(_run(*args, "--socket", socket, "--timeout-ms", "100", home=tmp_path),
                 f"invalid --socket {socket!r}", words)


def _serve(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`moetune serve` in a subprocess (a daemon that does start is killed by the timeout, not left running)."""
    env = dict(os.environ, MOETUNE_HOME=str(tmp_path / "home"))
    return subprocess.run([sys.executable, "-c", "import sys; from moetune.tuner.cli import main; sys.exit(main())",
                           "serve", "--db", str(tmp_path / "m.db"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_serve_names_a_bad_socket_option(tmp_path: Path) -> None:
    r = _serve(tmp_path, "--socket", "bogus")
    assert r.returncode == 2 and "invalid --socket 'bogus'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "daemon.pub_socket" not in r.stderr
    r = _serve(tmp_path, "--socket", f"ipc://{tmp_path}/d.sock", "--pub-socket", "ipc://x")
    assert r.returncode == 2 and "invalid --pub-socket 'ipc://x'" in r.stderr, r.stderr


# -- 5. tune: storage, --comm, --timeout, --from; 6. a tune without one successful trial --------------------------
MODEL_TUNE = ("tune", "-m", "qwen3-30b", "--backend", "model", "--preset", "nvlink-h200x2", "--trials", "1",
              "--tokens", "128")


def test_tune_names_a_bad_storage(tmp_path: Path) -> None:
    folder = tmp_path / "dir"
    folder.mkdir()
    db = ["--db", str(tmp_path / "m.db")]
    _refused(_run(*MODEL_TUNE, *db, "--storage", "bogus://x", home=tmp_path), "--storage bogus://x", "cannot open")
    _refused(_run(*MODEL_TUNE, *db, "--storage", f"sqlite:///{folder}", home=tmp_path), "--storage", "is a directory")
    _refused(_run("tune", "show", "--storage", "bogus://x", home=tmp_path), "--storage bogus://x", "cannot open")
    _refused(_run("tune", "show", "--storage", f"sqlite:///{folder}", home=tmp_path), "is a directory")
    # a password in the URL stays off the terminal
    r = _run(*MODEL_TUNE, *db, "--storage", "nosuchdialect://user:s3cret@host/db", home=tmp_path)
    _refused(r, "--storage")
    assert "s3cret" not in r.output
    assert not any(folder.iterdir())


def test_tune_and_show_name_a_storage_file_name_too_long(tmp_path: Path) -> None:
    """A SQLite --storage whose file name is over 255 bytes: the error path's own is_dir() (tune) and `tune show`'s
    exists() raised "File name too long" again, a traceback. One line naming --storage, exit 2, nothing created."""
    url = f"sqlite:///{tmp_path / ('x' * 300)}.db"
    db = ["--db", str(tmp_path / "m.db")]
    for argv in ([*MODEL_TUNE, *db, "--storage", url], ["tune", "show", "--storage", url]):
        _refused(_run(*argv, home=tmp_path / "home"), f"--storage {url}", "File name too long")
    assert not (tmp_path / "m.db").exists()


@pytest.mark.parametrize("url", ["", "  "])
def test_tune_and_show_refuse_an_empty_storage(url: str, tmp_path: Path) -> None:
    """`--storage ""` was taken for the default studies file (`if storage:`): the tune ran and stored its studies in
    m-studies.db, `tune show` read that file. Refused up front, exit 2, naming the option; nothing is created."""
    db = ["--db", str(tmp_path / "m.db")]
    for argv in ([*MODEL_TUNE, *db, "--storage", url], ["tune", "show", *db, "--storage", url],
                 ["tune", "--storage", url, "show", *db]):  # given before `show`: refused as empty, not as misplaced
        r = _run(*argv, home=tmp_path / "home")
        _refused(r)
        said = " ".join(r.output.replace("│", " ").split())
        assert "Invalid value for '--storage': an empty URL names no storage (leave the option out for the default " \
               "studies file NAME-studies.db" in said, said
    assert list(tmp_path.iterdir()) == []


def test_tune_and_show_name_a_garbage_studies_file_and_keep_it(tmp_path: Path) -> None:
    studies = tmp_path / "m-studies.db"  # the default studies file of --db m.db
    studies.write_bytes(GARBAGE)
    db = ["--db", str(tmp_path / "m.db")]
    _refused(_run(*MODEL_TUNE, *db, home=tmp_path), str(studies), "file is not a database")
    _refused(_run("tune", "show", *db, home=tmp_path), str(studies), "file is not a database")
    assert studies.read_bytes() == GARBAGE  # nothing stored is lost


@pytest.mark.parametrize(("args", "words"), [
    (["--comm", "bogus"], "--comm must be nccl or gloo, got 'bogus'"),
    (["--timeout", "0"], "--timeout must be a number of seconds > 0"),
    (["--timeout", "-1"], "--timeout must be a number of seconds > 0"),
    (["--trial-timeout", "0"], "--trial-timeout must be"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--from", "/nonexistent/capture"], "--from/--capture /nonexistent/capture: no such directory"),
    (["--capture", "/nonexistent/capture"], "--from/--capture /nonexistent/capture: no such directory"),
])
def test_tune_option_values(args: list[str], words: str, tmp_path: Path) -> None:
    _refused(_run(*MODEL_TUNE, "--db", str(tmp_path / "m.db"), *args, home=tmp_path), words)


def test_tune_names_an_empty_capture_folder_once(tmp_path: Path) -> None:
    """The capture's own error names the path: tune said '--from/--capture X: X: not a fabric capture ...'."""
    empty = tmp_path / "cap"
    empty.mkdir()
    r = _run(*MODEL_TUNE, "--db", str(tmp_path / "m.db"), "--from", str(empty), home=tmp_path)
    _refused(r, f"--from/--capture {empty}: not a fabric capture: the directory is empty")
    assert r.output.count(str(empty)) == 1, r.output


@pytest.mark.parametrize("opt", ["--from", "--capture"])
def test_model_tune_with_a_preset_refuses_a_capture_it_would_not_read(tmp_path: Path, opt: str) -> None:
    """`tune --backend model --preset P --capture DIR` (no --node-model) predicted P's fabric (its GPUs per node, under
    P's key) and never read the capture: exit 0 with the preset's profiles, as if the captured node had been predicted
    (the local backend's refusal of a capture even suggested `--backend model` for that node). Refused before any
    file is made, as the other options a backend does not read are."""
    r = _run(*MODEL_TUNE, "--db", str(tmp_path / "m.db"), opt, str(CAPTURES / "h200x2"), home=tmp_path)
    _refused(r, "--from/--capture", "predicts the preset's fabric", "--node-model")
    assert not (tmp_path / "m.db").exists() and not list(tmp_path.glob("*studies*"))


def test_tune_tunes_a_model_shape_once(tmp_path: Path) -> None:
    """`--model qwen3-30b --model custom:2048,768,128,8` (the same shape: one key, one study per bucket) tuned it twice:
    the second resumed the finished studies, ran the side-by-side check again (minutes on a GPU node with the local
    backend) and printed each row twice. Tuned once, said once, as --tokens sharing a bucket are."""
    r = _run(*MODEL_TUNE, "-m", "custom:2048,768,128,8", "-m", "qwen3-30b", "--db", str(tmp_path / "m.db"), "--json",
             home=tmp_path)
    assert r.exit_code == 0, r.output
    assert "qwen3-30b, custom:2048,768,128,8, qwen3-30b is one model shape, tuned once" in r.stderr, r.stderr
    rows = json.loads(r.stdout)
    assert [(row["model"], row["tokens"]) for row in rows] == [("qwen3-30b", 128)], rows


def test_a_family_given_twice_is_named_once(tmp_path: Path) -> None:
    """`--family ibgda --family ibgda` on a fabric without it: the error named it twice ("transport families ibgda,
    ibgda were not found"). One family is one set of studies: taken once, with a note, as a shape given twice."""
    r = _run(*MODEL_TUNE, "-f", "ibgda", "-f", "ibgda", "--db", str(tmp_path / "m.db"), home=tmp_path)
    _refused(r, "transport family ibgda was not found")
    assert "ibgda, ibgda" not in r.output and "--family: ibgda given more than once, taken once" in r.stderr
    assert not (tmp_path / "m.db").exists()
    r = _run(*MODEL_TUNE, "-f", "nvlink", "-f", "nvlink", "--db", str(tmp_path / "n.db"), "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    assert [row["family"] for row in json.loads(r.stdout)] == ["nvlink"]


def test_bench_knobs_refuses_a_variant_of_no_knob(tmp_path: Path) -> None:
    """`bench knobs --vs 'a='` measured the base variant a second time under the name a, silently."""
    r = _run("bench", "knobs", "--vs", "a=", "--tokens", "16", "--iters", "1", home=tmp_path)
    _refused(r, "--vs: variant 'a' sets no knob", "base variant again")


def test_profile_plans_a_model_shape_once(tmp_path: Path) -> None:
    r = _run("profile", "-m", "qwen3-30b", "-m", "qwen3-30b", "--capture", str(CAPTURES / "h200x2"),
             "--db", str(tmp_path / "p.db"), "--json", home=tmp_path)
    assert r.exit_code == 0, r.output
    assert "--model: qwen3-30b, qwen3-30b is one model shape, tuned once" in r.stderr, r.stderr


def test_distinct_shapes_keeps_the_first_name_of_each_shape() -> None:
    from moetune.tuner.cli._args import distinct_shapes

    assert distinct_shapes(["qwen3-30b", "deepseek-v3"]) == (["qwen3-30b", "deepseek-v3"], "")
    names, note = distinct_shapes(["custom:2048,768,128,8", "deepseek-v3", "qwen3-30b",
                                   "custom:2048,768,128,8,float16"])
    assert names == ["custom:2048,768,128,8", "deepseek-v3", "custom:2048,768,128,8,float16"]  # a dtype is a shape
    assert note == "--model: custom:2048,768,128,8, qwen3-30b is one model shape, tuned once"


def _fake_local(monkeypatch: pytest.MonkeyPatch, fail_from: int) -> None:
    """The local backend replaced by one whose every run fails from `fail_from` tokens on (as nccl does on a node
    without GPUs), so the tune's outcome is known without launching ranks."""
    import daemon_fakes as F

    import moetune.tuner.search.tune as search

    def run(k, w):
        if w.tokens >= fail_from:
            raise RuntimeError("process group init failed: no CUDA device")
        return 10.0 + k.pipeline_depth

    monkeypatch.setattr(search, "make_backend", lambda *a, **k: F.measuring_fake(run, name="local:fake"))


def _local_tune(tmp_path: Path, tokens: str, *extra: str):
    return CliRunner().invoke(app, ["tune", "-m", "qwen3-30b", "--backend", "local", "--from", str(CAPTURES / "cpu-laptop"),
                                    "--trials", "2", "--tokens", tokens, "--db", str(tmp_path / "m.db"), *extra],
                              env={"MOETUNE_HOME": str(tmp_path)})


@pytest.mark.usefixtures("on_captured_node")  # a local tune of a capture measures only on its node
def test_tune_without_a_successful_trial_exits_1_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_local(monkeypatch, fail_from=1)
    r = _local_tune(tmp_path, "128", "--json")
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)[0]["reason"] == "no successful trial"  # the report is still printed
    assert "no study had a successful trial" in r.stderr and "no CUDA device" in r.stderr
    # (no "Traceback" check here: Optuna's log handler from an earlier in-process run may write to a closed stream)
    assert isinstance(r.exception, SystemExit)
    r = _local_tune(tmp_path / "t", "128")
    assert r.exit_code == 1 and "no study had a successful trial" in r.stderr, r.output


def test_model_tune_without_a_successful_trial_says_nothing_was_predicted_not_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model tune whose every trial is refused exits 1 saying nothing was predicted (MODELLED) or stored: it never
    measures, so "nothing was measured" mislabelled what it does. (An EP group past the family's bound no longer
    gets this far: it is refused before any trial, 37b34768; here the model refuses each trial's knobs.)"""
    import moetune.tuner.fabric_model.predict as predict_mod
    from moetune.runtime.knobs import KnobError

    def refuse(*_a: object, **_k: object) -> None:
        raise KnobError("refused by this test")

    monkeypatch.setattr(predict_mod, "predict", refuse)
    r = _run(*MODEL_TUNE, "--db", str(tmp_path / "m.db"), home=tmp_path)
    _refused(r, "no study had a successful trial", code=1)
    said = " ".join(r.output.split("no study had a successful trial")[1].split())  # the console wraps lines
    assert said.startswith(": nothing was predicted (MODELLED) or stored"), said
    assert "measured" not in said


@pytest.mark.usefixtures("on_captured_node")  # a local tune of a capture measures only on its node
def test_tune_partly_successful_exits_0_and_names_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_local(monkeypatch, fail_from=1024)
    r = _local_tune(tmp_path, "128,1024", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [row["best_us"] is not None for row in rows] == [True, False]
    # (stderr also has the progress lines of both studies)
    assert "S=1024: no successful trial" in r.stderr and "S=128: no successful trial" not in r.stderr


@pytest.mark.usefixtures("on_captured_node")  # a local tune of a capture measures only on its node
def test_a_local_tune_on_the_live_node_records_its_facts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile measured here was never served by the read-only fallback: the tune left only a placeholder
    fingerprint (no facts), so `query` said this node's identity was unknown. A capture's facts are not recorded
    (it describes another node)."""
    import torch

    from moetune.tuner.store.store import Store

    if torch.cuda.is_available():  # run 190 on the H200: a live node with GPUs refuses a gloo tune (by design)
        pytest.skip("the live node has GPUs: a local gloo tune is refused there (test_tuner_measured_scope)")
    _fake_local(monkeypatch, fail_from=1 << 30)
    args = ["tune", "-m", "qwen3-30b", "--backend", "local", "--world", "2", "--comm", "gloo", "--trials", "2",
            "--tokens", "128", "--json"]
    r = CliRunner().invoke(app, [*args, "--db", str(tmp_path / "live.db")], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    with Store(tmp_path / "live.db", readonly=True) as st:
        assert [bool(row["facts"]) for row in st.list_fingerprints()] == [True]
    r = _local_tune(tmp_path / "cap", "128", "--json")
    assert r.exit_code == 0, r.output
    with Store(tmp_path / "cap" / "m.db", readonly=True) as st:
        assert [bool(row["facts"]) for row in st.list_fingerprints()] == [False]


# -- 6. bench moe / knobs: exit 1 when every case was skipped ----------------------------------------------------
SMALL = ["--model", "custom:128,64,8,2", "--tokens", "4", "--iters", "2", "--warmup", "0"]


@pytest.mark.parametrize("engine", ["megakernel", "torch", "megakernel,torch"])
def test_bench_moe_with_every_engine_skipped_exits_1(engine: str, cpu_only: None) -> None:
    r = CliRunner().invoke(app, ["bench", "moe", "--engine", engine, *SMALL, "--json"])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])  # the report still says why
    assert rep["cases"] and all("skipped" in c for c in rep["cases"])
    assert "every requested case was skipped" in r.stderr and " skipped:" in r.stderr
    r = CliRunner().invoke(app, ["bench", "moe", "--engine", engine, *SMALL])
    assert r.exit_code == 1 and "every requested case was skipped" in r.stderr, r.output


def test_bench_moe_partly_skipped_exits_0_and_says_what(cpu_only: None) -> None:
    r = CliRunner().invoke(app, ["bench", "moe", "--engine", "megakernel,unfused", *SMALL, "--json"])
    assert r.exit_code == 0, r.output
    assert "megakernel skipped:" in r.stderr and "no CUDA device" in r.stderr
    r = CliRunner().invoke(app, ["bench", "moe", "--engine", "unfused", "--cuda-graph", *SMALL, "--json"])
    assert r.exit_code == 0 and "--cuda-graph ignored" in r.stderr, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["graph"] is False


def test_bench_knobs_with_every_variant_skipped_exits_1(cpu_only: None) -> None:
    r = CliRunner().invoke(app, ["bench", "knobs", "--vs", "a=mk_bm=16", *SMALL, "--chain", "2"])
    assert r.exit_code == 1, r.output
    assert "base skipped:" in r.stderr and "a skipped:" in r.stderr and "every requested case was skipped" in r.stderr


# -- 7. profile --plan and the plan's fields; report --out -----------------------------------------------------
@pytest.mark.parametrize(("body", "words"), [
    ("world = 0", "world must be an integer >= 2 (an EP exchange needs 2 GPUs; a one-GPU node tunes the megakernel), got 0"),
    ("world = 1", "world must be an integer >= 2"),
    ("repeats = -1", "repeats must be an integer >= 1, got -1"),
    ("iters = 0", "iters must be an integer >= 1"),
    ("compare_rounds = 0", "compare_rounds must be an integer >= 1"),
    ("trials = 0", "trials must be an integer >= 1"),
    ("trial_timeout_s = -1", "trial_timeout_s must be a number of seconds > 0"),
    ("trial_timeout_s = nan", "trial_timeout_s must be a number of seconds > 0"),
    ("microbench_sizes = [0]", "microbench_sizes must be a list of positive integers"),
    ("tokens = [1.5]", "tokens must be a non-empty list of positive integers"),
    ("tokens = [true]", "tokens must be a non-empty list of positive integers"),
    ("world = true", "key 'world' must be int, got bool"),
    ("models = [1]", "models must be model names"),
    ("plan = 3", "[plan] must be a table"),
    # keys beside a [plan] table were ignored without a word (the bring-up ran 16 trials, not the 2 written)
    ('trials = 2\n[plan]\nmodels = ["qwen3-30b"]', "['trials'] beside the [plan] table"),
    ('[plan]\ntrials = 2\n[tune]\nbackend = "local"', "['tune'] beside the [plan] table"),
])
def test_plan_fields_are_validated_naming_field_and_file(body: str, words: str, tmp_path: Path) -> None:
    from moetune.tuner.bringup.flow import Plan

    p = tmp_path / "plan.toml"
    p.write_text(body + "\n")
    with pytest.raises(ValueError) as e:
        Plan.from_file(p, Plan())
    assert words in str(e.value) and str(p) in str(e.value)


def test_profile_refuses_a_bad_plan_file(tmp_path: Path) -> None:
    _refused(_run("profile", "--plan", str(tmp_path), home=tmp_path), f"plan file {tmp_path}", "is a directory")
    p = tmp_path / "plan.toml"
    p.write_text("world = 0\n")
    _refused(_run("profile", "--plan", str(p), home=tmp_path), f"plan file {p}", "world must be an integer >= 2")
    p.write_bytes(GARBAGE)
    _refused(_run("profile", "--plan", str(p), home=tmp_path), "not a UTF-8")
    assert not (tmp_path / "moetune.db").exists()  # refused before the database is opened


def test_report_out_must_be_a_folder_it_can_make(tmp_path: Path) -> None:
    from moetune.tuner.store.store import Store

    db = tmp_path / "m.db"
    Store(db).close()
    f = tmp_path / "file"
    f.write_text("keep")
    cap = ["--db", str(db), "--capture", str(CAPTURES / "cpu-laptop")]
    _refused(_run("report", *cap, "--out", str(f), home=tmp_path), f"--out {f}", "not a directory")
    _refused(_run("report", *cap, "--out", str(f / "sub"), home=tmp_path), f"--out {f / 'sub'}", "cannot create it")
    assert f.read_text() == "keep"
    r = _run("report", *cap, "--out", str(tmp_path / "new" / "rep"), home=tmp_path)
    assert r.exit_code == 0 and (tmp_path / "new" / "rep" / "report.md").is_file(), r.output
    _refused(_run("profile", "--report-dir", str(f), home=tmp_path), f"--report-dir {f}", "not a directory")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_profile_refuses_a_report_dir_it_cannot_make_before_any_stage(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`profile --report-dir /proc/x` passes a permission check (as root every permission bit passes, and /proc
    looks writable), so the up-front check makes the folder and a file in it (and removes them): the error names the
    option, the path and the OS's words before the database is opened or a stage runs, not after the whole bring-up
    as "--report-dir [Errno 2] ..."."""
    from moetune.tuner.bringup import flow

    def run(_self: object) -> None:
        raise AssertionError("the bring-up ran")

    monkeypatch.setattr(flow.Bringup, "run", run)
    db = tmp_path / "m.db"
    for d, words in ((Path("/proc/x"), "--report-dir /proc/x: cannot create it"),
                     (Path("/proc/x/y"), "--report-dir /proc/x/y: cannot create ")):
        r = _run("profile", "--quick", "--capture", str(CAPTURES / "h200x2"), "--db", str(db), "--report-dir",
                 str(d), home=tmp_path)
        _refused(r, words)
        assert "[Errno" not in r.output and not db.exists(), r.output


def test_the_report_folder_check_leaves_no_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check tries what the report will do (make the folders, write a file) and undoes it, whether it passed or
    not: a refused command leaves no folder the user did not get."""
    import tempfile

    from moetune.tuner.cli.profile import _out_dir_problem

    assert _out_dir_problem(tmp_path / "a" / "b") is None
    assert _out_dir_problem(tmp_path) is None
    assert sorted(tmp_path.iterdir()) == []

    def refused(*_a: object, **_k: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)  # a folder it can make but not write in (as root can't be set up)
    assert _out_dir_problem(tmp_path / "a" / "b") == "cannot write in it (Permission denied)"
    assert _out_dir_problem(tmp_path) == "cannot write in it (Permission denied)"
    assert sorted(tmp_path.iterdir()) == []


# -- 8. serve --capture ----------------------------------------------------------------------------------------
def test_serve_refuses_a_missing_capture(tmp_path: Path) -> None:
    args = ("--socket", f"ipc://{tmp_path}/d.sock")
    r = _serve(tmp_path, *args, "--capture", str(tmp_path / "nope"))
    assert r.returncode == 2 and f"--capture {tmp_path / 'nope'}: no such directory" in r.stderr, r.stderr
    f = tmp_path / "f"
    f.write_text("x")
    r = _serve(tmp_path, *args, "--capture", str(f))
    assert r.returncode == 2 and "not a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- 9. keys: safe names, a real server key directory ------------------------------------------------------------
@pytest.mark.parametrize("name", ["../evil", "", ".hidden", "a/b", "x" * 101])
def test_keys_generate_refuses_unsafe_names(name: str, tmp_path: Path) -> None:
    d = tmp_path / "k"
    _refused(_run("keys", "generate", str(d), "--name", name), "--name", "key name")
    assert not any(tmp_path.iterdir())  # nothing written, in the directory or outside it


def test_keys_client_and_allow_need_the_servers_key_dir(tmp_path: Path) -> None:
    nosuch = tmp_path / "nosuch"
    _refused(_run("keys", "client", str(nosuch), "--name", "c1"), "SERVER_KEYS", str(nosuch), "no such directory")
    assert not nosuch.exists()
    assert _run("keys", "generate", str(tmp_path / "cl"), "--name", "c2").exit_code == 0
    c2 = tmp_path / "cl" / "c2.key"
    _refused(_run("keys", "allow", str(c2), str(nosuch)), "SERVER_KEYS", "no such directory")
    assert not nosuch.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(_run("keys", "allow", str(c2), str(empty)), "holds no daemon key pair")
    _refused(_run("keys", "client", str(empty), "--name", "c1"), "holds no daemon key pair")
    assert not any(empty.iterdir())
    _refused(_run("keys", "client", str(empty), "--name", "../x"), "--name '../x'")
    # a real server directory: both work
    srv = tmp_path / "srv"
    assert _run("keys", "generate", str(srv)).exit_code == 0
    r = _run("keys", "allow", str(c2), str(srv))
    assert r.exit_code == 0 and (srv / "clients" / "c2.key").is_file(), r.output
    r = _run("keys", "client", str(srv), "--name", "c1")
    assert r.exit_code == 0 and (srv / "clients" / "c1.key").is_file(), r.output


@pytest.mark.parametrize("taken", ["moetune.key", "moetune.key_secret"])
def test_keys_generate_touches_no_file_it_did_not_create(taken: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The key pair is written to temporary names beside it (O_EXCL): a file already at one of them (the names' random
    part forced here) is left as it is, mode and bytes, never written through, removed or chmod-ed; the temporary
    file this run did make is removed, and the old pair kept (--force unlinked it before writing the new one)."""
    import secrets

    d = tmp_path / "k"
    assert _run("keys", "generate", str(d)).exit_code == 0
    old = {p.name: p.read_bytes() for p in d.iterdir()}
    monkeypatch.setattr(secrets, "token_hex", lambda n: "0" * 2 * n)
    decoy = d / f".{taken}.000000000000.tmp"
    decoy.write_text("not ours")
    decoy.chmod(0o644)
    _refused(_run("keys", "generate", str(d), "--force"), "cannot write the key pair", "File exists")
    assert decoy.read_text() == "not ours" and decoy.stat().st_mode & 0o777 == 0o644
    assert {p.name: p.read_bytes() for p in d.iterdir() if p != decoy} == old


# -- 10. help text: config sections such as [tune] are shown, not eaten as Rich markup ------------------------------
def test_help_shows_config_sections() -> None:
    env = {"COLUMNS": "250"}
    r = CliRunner().invoke(app, ["tune", "--help"], env=env)
    assert "config [tune] trials" in r.output and "its [tune] section" in r.output, r.output
    r = CliRunner().invoke(app, ["serve", "--help"], env=env)
    assert "default: [store] db" in r.output, r.output


def test_no_help_text_holds_unescaped_markup_tags() -> None:
    import typer.main

    try:  # typer >= 0.25 vendors click as typer._click
        import click
    except ImportError:
        from typer import _click as click

    tag = re.compile(r"(?<!\\)\[[a-zA-Z#/@][^\[\]]*\]")  # what Rich reads as a style tag (and drops)
    root = typer.main.get_command(app)
    ctx = click.Context(root)
    bad = []

    def walk(c, path: list[str]) -> None:
        for who, text in [("help", c.help or ""), *((p.name, getattr(p, "help", "") or "") for p in c.params)]:
            bad.extend(f"moetune {' '.join(path)} {who}: {m}" for m in tag.findall(text))
        if hasattr(c, "list_commands"):
            for n in c.list_commands(ctx):
                walk(c.get_command(ctx, n), [*path, n])

    walk(root, [])
    assert not bad, bad


# -- 11. an empty text option: refused naming the option, never read as "left out" --------------------------------
# `tune --storage ""` took the default studies file and `tune --backend ""` the configured backend (`if x:`, `x or
# default`); `query/status/retune --socket ""` the configured endpoint; `tune show --study ""` and `profiles
# list/export --fingerprint ""` matched the only study or fingerprint ("" starts every name); `bench ep --transport ""`
# ran the knobs' transport. These options parse with _args.text_option. The others below refuse "" in their own check
# of the value: (the command line up to the option where the command's words are not enough, words of the refusal)
_Q = ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "16"]
_EMPTY_REFUSED_BY_VALUE = {
    ("profile", "--tokens"): ([], "--tokens: expected comma-separated integers, got ''"),
    ("profile", "--model"): ([], "--model: unknown model ''"),
    ("query", "--family"): (_Q, "unknown family ''"),
    ("query", "--format"): (_Q, "expected table, json or env"),
    ("serve", "--socket"): (["serve", "--db", "{tmp}/m.db"], "invalid --socket ''"),
    ("serve", "--pub-socket"): (["serve", "--db", "{tmp}/m.db"], "invalid --pub-socket ''"),
    ("serve", "--log-level"): (["serve", "--db", "{tmp}/m.db"], "--log-level must be one of"),
    ("tune", "--model"): ([], "unknown model ''"),
    ("tune", "--comm"): ([*MODEL_TUNE, "--db", "{tmp}/m.db"], "--comm must be nccl or gloo, got ''"),
    ("fabric", "diff", "--against"): (["fabric", "diff"], "--against is empty"),
    ("model", "sweep", "--values"): (["model", "sweep", "-p", "nvlink-h200x2"], "--values: expected comma-separated "
                                     "integers, got ''"),
    ("profiles", "list", "--status"): (["profiles", "list"], "must be one of current, stale, superseded, got ''"),
    ("profiles", "list", "--provenance"): (["profiles", "list"], "must be one of measured, node_model, preset, got ''"),
    ("profiles", "export", "--status"): (["profiles", "export", "-"], "must be one of current, stale, superseded"),
    ("profiles", "export", "--provenance"): (["profiles", "export", "-"], "must be one of measured, node_model, preset"),
}
# "" is an empty list here, as the help says: no knob overrides, the parameters a fit picks by its data
_EMPTY_IS_NONE = {("bench", "ep", "--knobs"), ("bench", "moe", "--knobs"), ("bench", "knobs", "--knobs"),
                  ("model", "predict", "--knobs"), ("model", "sweep", "--knobs"), ("model", "calibrate", "--params")}


def _text_params():
    """(command words, option, parameter) for every str or list[str] option of every command that a user may leave
    out (not required, not hidden) and whose default is None or "" (an empty value may be mistaken for it); not the
    paths (tests/test_cli_path_errors.py)."""
    from moetune.tuner.cli._args import path_arg, path_text

    out = []
    for path, cmd in cli_commands():
        for p in cmd.params:
            ann = p.type_descriptor.annotation
            if p.param_type_name != "option" or p.required or p.hidden or p.default not in (None, "", []):
                continue
            if ann in (str, list[str]) and p.type_descriptor.parameter_info.parser not in (path_arg, path_text):
                out.append((tuple(path), p.opts[0], p))
    return out


def test_every_text_option_refuses_an_empty_value_or_says_what_it_is() -> None:
    """A new str option whose default is None parses with text_option, or is listed above with its own refusal; one
    whose default is "" says in its help what "" means."""
    found, unsorted = set(), []
    for path, opt, p in _text_params():
        found.add((*path, opt))
        if isinstance(p.type_descriptor.parameter_info.parser, NonEmptyText) or (*path, opt) in _EMPTY_REFUSED_BY_VALUE:
            continue
        if (*path, opt) not in _EMPTY_IS_NONE or '""' not in (p.help or ""):
            unsorted.append(f"moetune {' '.join(path)} {opt}")
    assert not unsorted, unsorted
    assert not (set(_EMPTY_REFUSED_BY_VALUE) | _EMPTY_IS_NONE) - found  # no stale entry


_TEXT_OPTIONS = [pytest.param(path, opt, id=" ".join([*path, opt])) for path, opt, p in _text_params()
                 if isinstance(p.type_descriptor.parameter_info.parser, NonEmptyText)]


@pytest.mark.parametrize("value", ["", "  "])
@pytest.mark.parametrize(("path", "opt"), _TEXT_OPTIONS)
def test_an_empty_text_option_is_refused_naming_it(path: tuple[str, ...], opt: str, value: str, tmp_path: Path) -> None:
    """Refused as it is parsed (before anything runs, so the command's other arguments are not needed): exit 2, the
    option named, what to do instead; nothing is made."""
    r = CliRunner().invoke(app, [*path, opt, value], env={"MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "200",
                                                           "MOETUNE_CONFIG": ""})
    _refused(r)
    said = " ".join(r.output.replace("│", " ").split())
    assert re.search(rf"Invalid value for '{opt}'( / '-\w')?: an empty \w+ (names|matches|is)", said), said
    assert "leave the option out" in said, said
    assert list(tmp_path.iterdir()) == []


def test_text_options_refused_are_the_ones_found() -> None:
    """The options the sweep fixed are among those refused by their parser (a rename would drop one silently)."""
    ids = {" ".join([*p.values[0], p.values[1]]) for p in _TEXT_OPTIONS}
    assert {"tune --storage", "tune show --storage", "tune --backend", "tune --family", "tune show --study",
            "profiles list --fingerprint", "profiles export --fingerprint", "query --socket", "status --socket",
            "retune --socket", "bench ep --transport", "bench run --case"} <= ids, ids


@pytest.mark.parametrize(("key", "before", "words"),
                         [pytest.param(k, a, w, id=" ".join(k)) for k, (a, w) in _EMPTY_REFUSED_BY_VALUE.items()])
def test_an_empty_value_checked_option_is_refused_naming_it(key: tuple[str, ...], before: list[str], words: str,
                                                             tmp_path: Path) -> None:
    """The options that refuse "" in their check of the value keep doing so: exit 2, naming the option."""
    *path, opt = key
    argv = [a.replace("{tmp}", str(tmp_path)) for a in (before or path)] + [opt, ""]
    r = CliRunner().invoke(app, argv, env={"MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "200",
                                           "MOETUNE_CONFIG": ""})
    _refused(r)
    said = " ".join(r.output.replace("│", " ").split())
    assert opt in said and words in said, said


def test_an_empty_fingerprint_or_study_no_longer_picks_the_only_one(tmp_path: Path) -> None:
    """With one fingerprint stored, `profiles list --fingerprint ""` listed its profiles and `export` wrote them;
    with one study, `tune show --study ""` described it: exit 0 for a value that names nothing."""
    from store_samples import put_one_profile

    db = tmp_path / "m.db"
    put_one_profile(db)
    for argv in (["profiles", "list", "--db", str(db)], ["profiles", "export", "-", "--db", str(db)]):
        assert _run(*argv, "--fingerprint", "fp").exit_code == 0
        _refused(_run(*argv, "--fingerprint", ""), "--fingerprint")
    studies = ["--db", str(tmp_path / "t.db")]
    assert _run(*MODEL_TUNE, *studies, home=tmp_path).exit_code == 0
    assert _run("tune", "show", *studies, "--study", "nvlink").exit_code == 0  # a unique part of the name
    _refused(_run("tune", "show", *studies, "--study", ""), "--study")


def test_tune_refuses_a_bad_routing_before_any_database_is_made(tmp_path: Path) -> None:
    """`tune --routing ""` (or "bogus") was refused by the first study ("model:... cannot evaluate ...: model error:
    ValueError: unknown routing"), naming no option, after the profile database and studies file were made."""
    for routing in ("", "bogus", "zipf:x"):
        r = _run(*MODEL_TUNE, "--routing", routing, home=tmp_path)
        _refused(r, "--routing: ", repr(routing))
        assert "model error" not in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_tune_refuses_an_unknown_family_before_any_database_is_made(tmp_path: Path) -> None:
    """`tune --family bogus` was refused by the search ("transport families ['bogus'] were not found on this fabric")
    after the profile database and studies file were made; a family of another fabric still is (it needs the fabric)."""
    r = _run(*MODEL_TUNE, "--family", "nvlink", "--family", "bogus", home=tmp_path)
    _refused(r, "--family bogus: not a transport family", "proxy:ibrc")
    assert list(tmp_path.iterdir()) == []


def test_bench_ep_serve_refuses_the_options_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench ep --serve` takes its cases (model, tokens, knobs, ...) from stdin and its environment from its start:
    --no-p2p (NCCL_P2P_DISABLE=1) was dropped without a word, so a "no peer-to-peer" world measured with P2P on, and
    --model, --tokens, --knobs, ... were ignored. Each is refused naming it, before any rank is spawned."""
    from moetune.tuner.measure import worker as bench_worker

    def served(*a: object, **k: object) -> int:
        raise AssertionError("the worker was started")

    monkeypatch.setattr(bench_worker, "serve", served)
    _refused(_run("bench", "ep", "--serve", "--backend", "nccl", "--no-p2p"), "--no-p2p", "--serve")
    _refused(_run("bench", "ep", "--serve", "--model", "deepseek-v3", "--tokens", "4096"), "--model", "--tokens")
    _refused(_run("bench", "ep", "--serve", "--knobs", "compression=fp8_e4m3"), "--knobs")


@pytest.mark.parametrize("tokens", ["0", "-3", "99999999"])
def test_bench_knobs_says_a_bad_tokens_value_once(tokens: str, tmp_path: Path) -> None:
    """`bench knobs --tokens 0` added "error: the benchmark failed: Exit: 2": the refusal's typer.Exit (a RuntimeError)
    was caught as an error torch raised while timing."""
    r = _run("bench", "knobs", "--vs", "a=mk_bm=16", "--tokens", tokens, home=tmp_path)
    _refused(r, "--tokens")
    assert "the benchmark failed" not in r.output and r.output.count("error:") == 1, r.output


@pytest.mark.parametrize(("opt", "value", "words"), [
    ("--iters", "0", "--iters must be >= 1, got 0"), ("--rotate", "0", "--rotate must be >= 1, got 0"),
    ("--warmup", "-1", "--warmup must be >= 0, got -1"), ("--rest", "61", "--rest must be in 0..60 seconds, got 61"),
    ("--rest", "nan", "--rest must be in 0..60 seconds, got nan")])
def test_bench_moe_names_the_count_that_is_out_of_range(opt: str, value: str, words: str, tmp_path: Path) -> None:
    """`bench moe --rotate 0` said "--iters and --rotate must be >= 1, --warmup >= 0, --rest in 0..60 seconds": which
    of the four, and its value, was left to guess."""
    _refused(_run("bench", "moe", "--engine", "torch", "--tokens", "1", opt, value, home=tmp_path), words)


@pytest.mark.parametrize(("args", "words"), [
    (["--knobs", "num_sms=8"], "num_sms is not the megakernel's"),
    (["--knobs", "engine=unfused"], "engine=unfused does not choose what is timed (--engine does)"),
    (["--knobs", "mk_bm=16", "--engine", "unfused,torch"], "--engine unfused,torch times no megakernel")])
def test_bench_moe_refuses_knobs_that_no_timed_engine_reads(args: list[str], words: str, tmp_path: Path) -> None:
    """`bench moe --knobs num_sms=8`, `--knobs engine=unfused` or `--knobs mk_bm=16 --engine unfused` timed the layers
    exactly as without them, and the report's command said the knobs were set."""
    r = _run("bench", "moe", "--engine", "torch", "--tokens", "1", "--model", "custom:128,64,8,2", *args, home=tmp_path)
    _refused(r, words)
    assert "timing" not in r.output


@pytest.mark.parametrize(("args", "words"), [
    (["--vs", "n=num_sms=8"], "variant 'n': num_sms is not read by the MoE layer on one device"),
    (["--knobs", "compression=fp8_e4m3", "--vs", "a=mk_bm=16"], "variant 'base': compression is not read")])
def test_bench_knobs_refuses_a_variant_of_knobs_the_layer_does_not_read(args: list[str], words: str,
                                                                          tmp_path: Path) -> None:
    """`bench knobs --vs n=num_sms=8` timed the base again under the name n (the layer runs on one device: no EP
    exchange reads num_sms) and reported the per-round noise as the knob's difference."""
    r = _run("bench", "knobs", "--tokens", "1", "--model", "custom:128,64,8,2", *args, home=tmp_path)
    _refused(r, words)
