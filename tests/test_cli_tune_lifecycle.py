"""`moetune tune` / `moetune profile` from start to end: signals, the GPUs a run needs, its studies file, its options:

- SIGTERM (`kill`, `timeout`) ends a local tune as Ctrl-C does (not at once, exit 143 with no message), and the
  bench worker (and its ranks) end when the tuning process is gone however it ended, never left measuring,
  re-parented to init.
- an error raised while an interrupt unwinds (a second Ctrl-C landing in Optuna's clean-up of the first) ends the
  command as that interrupt (one line, 130), not in a traceback (UnboundLocalError) and exit 1.
- `--comm nccl` on a machine without CUDA GPUs is refused up front, not ~11 s later in the ranks' init.
- two profile databases of one folder do not share one default studies file (a tune of the second would resume
  the first's finished studies and run no trial).
- errors name the one option at fault (not none for `--seed -1`, nor three for `profile --model foo`), and
  `profile --plan`'s help lists every key it takes.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

CAPTURES = Path(__file__).resolve().parent / "captures"
runner = CliRunner()

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_checks import alive, gone_within, kill  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def python_sigint_handler() -> Iterator[None]:
    """Python's own SIGINT handler, as in a terminal, for a test that sends this process a Ctrl-C. A pytest started
    with SIGINT ignored (`nohup`, `cmd &` in a non-interactive shell) keeps it ignored, and the CLI then leaves
    SIGINT alone, as it must: the Ctrl-C would never arrive and the test would fail for how it was started."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


# A stand-in for the bench worker (no torch): ready at once, one "rank" child in its process group, and a case
# that measures for a minute without reading stdin again (as a real worker mid-case). It writes both pids.
FAKE_WORKER = """
import json, subprocess, sys, time

rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{__import__('os').getpid()} {rank.pid}")
__import__('os').replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""

TUNE = """
import sys
from moetune.tuner.fabric import discovery
from moetune.tuner.search import local_backend
fake, mark, capture = sys.argv[1], sys.argv[2], sys.argv[3]
local_backend.LocalBackend.worker_argv = lambda self: [sys.executable, fake, mark]
# as on the node the capture describes (a local tune of another node's capture is refused), on any machine
discovery.live_facts = lambda timeout_s=1.5: discovery.discover(capture)
sys.argv = ["moetune", "tune", "--backend", "local", "--comm", "gloo", "--world", "2", "-m", "custom:64,32,8,2",
            "--tokens", "16", "--trials", "5", "--repeats", "1", "--from", capture]
from moetune.tuner.cli import main
main()
"""


def test_sigterm_ends_a_local_tune_as_ctrl_c_and_its_worker_with_it(tmp_path: Path) -> None:
    fake, mark = tmp_path / "fake_worker.py", tmp_path / "measuring"
    fake.write_text(FAKE_WORKER)
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "80"}
    proc = subprocess.Popen([sys.executable, "-c", TUNE, str(fake), str(mark), str(CAPTURES / "cpu-laptop")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), proc.communicate(timeout=30)
        pids = [int(x) for x in mark.read_text().split()]  # the worker and its "rank", mid-case
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 143, out + err
        assert "terminated (SIGTERM): the study is saved; run the same command again to resume" in err, err
        assert "Traceback" not in out + err
        assert gone_within(pids, 3.0) == [], "the bench worker or its rank outlived the tune"
    finally:
        kill(pids, proc)


def _interrupted(*_a: object, **_k: object) -> None:
    raise KeyboardInterrupt


def _storage_failed(*_a: object, **_k: object) -> None:
    from sqlalchemy.exc import OperationalError

    raise OperationalError("UPDATE trials", {}, Exception("interrupted"))


# where the second interrupt lands: Optuna's tell of the interrupted trial, or the objective's own clean-up (the
# warm-start point put back) whose study storage then fails: an SQLAlchemyError whose context is the interrupt
@pytest.mark.parametrize("tell, requeue", [(_interrupted, None), (None, _storage_failed)])
def test_a_second_ctrl_c_in_optunas_clean_up_ends_the_tune_as_an_interrupt(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          tell: Any, requeue: Any) -> None:
    """Ctrl-C twice (~0.3 s apart) during `tune --backend model` ends as an interrupt, not in a traceback and exit 1:
    the second interrupt may land in Optuna's clean-up of the first, whose `finally` then raises "UnboundLocalError:
    ... 'updated_state'". Here the trial is interrupted and so is the clean-up after it (an error of the study
    storage raised while the interrupt unwound is no storage failure: the interrupt ends the command)."""
    import optuna.study._optimize as optimize

    from moetune.tuner.search import study

    monkeypatch.setattr(study._Objective, "_run", _interrupted)
    if tell is not None:
        monkeypatch.setattr(optimize, "_tell_with_warning", tell)
    if requeue is not None:
        monkeypatch.setattr(study, "requeue_warm_start", requeue)
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    r = runner.invoke(app, [*TUNE_MODEL, "--db", str(tmp_path / "m.db")])
    assert r.exit_code == 130, (r.output, r.exception)
    assert "interrupted: the study is saved; run the same command again to resume" in r.output, r.output
    assert "UnboundLocalError" not in r.output and "Traceback" not in r.output, r.output


def test_an_error_raised_while_an_interrupt_unwound_is_that_interrupt() -> None:
    """`ends_cleanly_on_interrupt` ends on an error whose __context__ / __cause__ chain holds a KeyboardInterrupt
    (or SIGTERM's Terminated) as on the interrupt; other errors and the CLI's own exits pass through."""
    import typer

    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt, interrupt_behind
    from moetune.tuner.search.workers import Terminated

    def unwound(interrupt: KeyboardInterrupt) -> Exception:
        try:
            try:
                raise interrupt
            finally:
                raise UnboundLocalError("cannot access local variable 'updated_state'")
        except UnboundLocalError as e:
            return e

    def caused(interrupt: KeyboardInterrupt) -> Exception:
        try:
            raise RuntimeError("wrapped") from unwound(interrupt)
        except RuntimeError as e:
            return e

    def ends(e: BaseException) -> tuple[int, str]:
        from io import StringIO

        from rich.console import Console

        buf = StringIO()
        with pytest.raises(typer.Exit) as x, ends_cleanly_on_interrupt(lambda: "left", Console(file=buf),
                                                                       sigterm=False):
            raise e
        return x.value.exit_code, buf.getvalue().strip()

    assert ends(unwound(KeyboardInterrupt())) == (130, "interrupted: left")
    assert ends(caused(KeyboardInterrupt())) == (130, "interrupted: left")
    assert ends(unwound(Terminated())) == (143, "terminated (SIGTERM): left")
    assert interrupt_behind(ValueError("no interrupt")) is None
    with pytest.raises(ValueError), ends_cleanly_on_interrupt(lambda: "left", sigterm=False):
        raise ValueError("no interrupt")
    try:  # a CLI exit the body raised while it handled an interrupt: its own words were printed, its code stands
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise typer.Exit(1) from None
    except typer.Exit as e:
        assert interrupt_behind(e) is None


# A parent that starts a child which asks to die with it (die_with_parent, as each rank of the worker does), then
# waits to be killed.
DIES_WITH_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, sys, time; "
                          "from moetune.tuner.measure.worker import die_with_parent; "
                          "die_with_parent(int(sys.argv[1])); print(os.getpid(), flush=True); time.sleep(120)",
                          str(__import__('os').getpid())], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""


def test_a_rank_dies_with_its_worker(tmp_path: Path) -> None:
    """A worker killed outright (SIGKILL) left its ranks running; each rank now has PR_SET_PDEATHSIG."""
    parent = subprocess.Popen([sys.executable, "-c", DIES_WITH_PARENT], stdout=subprocess.PIPE, text=True)
    child: list[int] = []
    try:
        assert parent.stdout is not None
        child = [int(parent.stdout.readline())]
        assert alive(child[0])
        parent.kill()
        parent.wait()
        assert gone_within(child, 3.0) == []
    finally:
        kill(child, parent)


# A rank of `serve` (spawned: a function of an importable module): joins at once, then measures a case for a minute.
FAKE_RANK = """
import time

def fake_rank(rank, world, port, backend, timeout_s, env, inq, outq, parent=None):
    outq.put((rank, "ready", True, None))
    inq.get()
    time.sleep(60)
"""


def test_the_worker_ends_when_the_process_that_started_it_is_gone(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A tune killed outright (SIGKILL, a signal it does not handle) left the worker measuring its case to the
    end, for nobody: with --parent-pid it notices its parent is gone (re-parented) and ends, killing its ranks."""
    import importlib
    import io
    import multiprocessing

    from moetune.tuner.measure import worker

    (tmp_path / "fake_bench_rank.py").write_text(FAKE_RANK)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned ranks get this sys.path
    monkeypatch.setattr(worker, "_rank_main", importlib.import_module("fake_bench_rank").fake_rank)
    real_ppid, parent = os.getppid, os.getppid()
    gone = [False]
    monkeypatch.setattr(worker.os, "getppid", lambda: 1 if gone[0] else real_ppid())

    def cases():  # read once the ranks are up: one case, and meanwhile this process is re-parented (to init)
        gone[0] = True
        yield json.dumps({"model": "custom:64,32,8,2", "tokens": 16}) + "\n"

    out = io.StringIO()
    t0 = time.monotonic()
    assert worker.serve(2, "gloo", 10.0, stdin=cases(), stdout=out, parent_pid=parent) == 3
    assert time.monotonic() - t0 < 30
    assert '"ready": true' in out.getvalue()
    assert not [p for p in multiprocessing.active_children() if p.isalive()]  # the ranks were killed
    # a parent gone before the worker started: it ends at once (getppid real again: the pid given is not the parent)
    gone[0] = False
    assert worker.serve(1, "gloo", 1.0, stdin=iter(()), stdout=out, parent_pid=parent + 1) == 3


@pytest.mark.usefixtures("on_captured_node")  # as on the captured node: else its capture refusal comes first
def test_local_tune_refuses_nccl_without_cuda_gpus_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.search import local_backend

    monkeypatch.setattr(local_backend, "cuda_gpus", lambda: 0)
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    base = ["tune", "--backend", "local", "-m", "custom:64,32,8,2", "--tokens", "16", "--trials", "1",
            "--db", str(tmp_path / "m.db")]
    t0 = time.monotonic()
    r = runner.invoke(app, [*base, "--comm", "nccl", "--from", str(CAPTURES / "cpu-laptop")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "--comm nccl needs 2 CUDA GPUs on this machine (one per rank, --world 2), found 0" in text, text
    assert "pass --comm gloo" in text and "Traceback" not in text
    # the default nccl (discovery found GPUs) is named as the default
    r = runner.invoke(app, [*base, "--from", str(CAPTURES / "h200x2")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "--comm nccl (the default: --from/--capture" in text and "found 2 GPU(s)) needs 2 CUDA GPUs" in text, text
    assert time.monotonic() - t0 < 20  # no rank was started
    assert not (tmp_path / "m.db").exists()  # refused before the database was made


@pytest.mark.usefixtures("on_captured_node")  # as on the captured node: another node's capture measures nothing
def test_profile_refuses_nccl_without_cuda_gpus_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow
    from moetune.tuner.search import local_backend

    monkeypatch.setattr(local_backend, "cuda_gpus", lambda: 0)
    monkeypatch.setattr(flow.Bringup, "run", lambda self: pytest.fail("the bring-up ran"))
    r = runner.invoke(app, ["profile", "--quick", "--capture", str(CAPTURES / "h200x2"), "--db",
                            str(tmp_path / "m.db")], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "describes a node with 2 GPUs, so the bring-up measures EP size 2 with NCCL" in text, text
    assert "torch finds 0 CUDA GPU(s) here" in text
    assert not (tmp_path / "m.db").exists()  # refused before the database was opened (it was left behind, empty)


TUNE_MODEL = ["tune", "-m", "qwen3-30b", "--tokens", "128", "--backend", "model", "--preset", "nvlink-h200x2",
              "--trials", "2", "--json"]


def test_each_profile_database_has_its_own_default_studies_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.search.readback import list_studies
    from moetune.tuner.search.storage import default_storage_url

    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    for name in ("p", "empty"):  # one folder, two databases: each runs its trials in its own studies file
        r = runner.invoke(app, [*TUNE_MODEL, "--db", str(tmp_path / f"{name}.db")])
        assert r.exit_code == 0, r.output
        assert [row["complete"] for row in json.loads(r.stdout)] == [2]
        studies = tmp_path / f"{name}-studies.db"
        assert studies.is_file()
        assert len(list_studies(f"sqlite:///{studies}")) == 1  # this database's study only
    assert not (tmp_path / "moetune-studies.db").exists()
    # the default database keeps its file, so studies of earlier versions resume
    assert default_storage_url(tmp_path / "moetune.db") == f"sqlite:///{tmp_path / 'moetune-studies.db'}"
    r = runner.invoke(app, ["tune", "show", "--db", str(tmp_path / "empty.db"), "--json"])
    assert r.exit_code == 0 and len(json.loads(r.stdout)) == 1, r.output


def test_a_database_tuned_in_the_shared_studies_file_keeps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database whose runs were recorded in moetune-studies.db beside it (before the file was per database)
    resumes its studies there, while it has no file of its own."""
    from moetune.tuner.search.readback import list_studies
    from moetune.tuner.search.storage import default_storage_url

    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    shared = tmp_path / "moetune-studies.db"
    r = runner.invoke(app, [*TUNE_MODEL, "--db", str(tmp_path / "old.db"), "--storage", f"sqlite:///{shared}"])
    assert r.exit_code == 0, r.output
    assert default_storage_url(tmp_path / "old.db") == f"sqlite:///{shared}"
    before = list_studies(f"sqlite:///{shared}")[0]["trials"]
    r = runner.invoke(app, [*TUNE_MODEL, "--db", str(tmp_path / "old.db"), "--trials", str(before + 2)])
    assert r.exit_code == 0, r.output
    after = [s["trials"] for s in list_studies(f"sqlite:///{shared}")]
    assert len(after) == 1 and after[0] >= before + 2  # the same study, resumed and run further
    assert not (tmp_path / "old-studies.db").exists()
    assert default_storage_url(tmp_path / "new.db") == f"sqlite:///{tmp_path / 'new-studies.db'}"
    # the data folder moved (a new MOETUNE_HOME, a restored backup): the runs name the old path, still resumed
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in tmp_path.glob("*"):  # with their -wal/-shm, as a move of the folder takes them
        if f.name.startswith(("old.db", "moetune-studies.db")):
            f.rename(moved / f.name)
    assert default_storage_url(moved / "old.db") == f"sqlite:///{moved / 'moetune-studies.db'}"


def test_default_studies_file_names_are_one_per_database(tmp_path: Path) -> None:
    """x.db, x.sqlite and x of one folder shared x-studies.db (the name came from the stem)."""
    from moetune.tuner.search.storage import studies_file_name

    names = [studies_file_name(tmp_path / n) for n in ("moetune.db", "x.db", "x.sqlite", "x")]
    assert names == ["moetune-studies.db", "x-studies.db", "x.sqlite.studies.db", "x.studies.db"]


def test_the_default_studies_file_is_never_a_profile_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile database named x-studies.db beside x.db got Optuna's tables added to it by `tune --db x.db`."""
    from moetune.tuner.store.store import Store

    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    Store(tmp_path / "x-studies.db").close()
    r = runner.invoke(app, [*TUNE_MODEL, "--db", str(tmp_path / "x.db")])
    assert r.exit_code == 2 and "is a moetune profile database, not a studies file" in r.output, r.output
    assert not (tmp_path / "x.db").exists()  # refused before the profile database is made


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_tune_names_seed_out_of_range(tmp_path: Path, seed: str) -> None:
    r = runner.invoke(app, [*TUNE_MODEL, "--seed", seed, "--db", str(tmp_path / "m.db")],
                      env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 2, r.output
    assert f"--seed must be an integer from 0 to 4294967295 (2**32 - 1), got {seed}" in r.output, r.output
    assert not (tmp_path / "m.db").exists()


@pytest.mark.parametrize(("args", "words"), [
    (["--model", "foo"], "error: --model: unknown model 'foo'; known: qwen3-30b, gpt-oss-120b, deepseek-v3"),
    (["--trials", "0"], "error: --trials must be an integer from 1 to 100000, got 0"),
    (["--tokens", "0,16"], "error: --tokens: token counts must be integers >= 1, got '0,16'"),
])
def test_profile_names_the_one_bad_option(tmp_path: Path, args: list[str], words: str) -> None:
    r = runner.invoke(app, ["profile", *args, "--db", str(tmp_path / "m.db")], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 2, r.output
    assert words in " ".join(r.output.split()), r.output
    assert "/" not in r.output.split("error:")[1].split(":")[0]  # one option, not "--model/--tokens/--trials"


def test_profile_plan_help_lists_every_key_the_plan_takes() -> None:
    from moetune.tuner.bringup.flow import Plan
    from moetune.tuner.cli.profile import profile

    text = inspect.signature(profile).parameters["plan_file"].default.help
    keys = text.split(":", 1)[1].split("(")[0].replace(" ", "").split(",")
    assert sorted(keys) == sorted(f.name for f in dataclasses.fields(Plan)), text


def test_an_interrupted_profile_says_so_after_its_last_progress_lines(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After Ctrl-C, `moetune profile` prints no progress line after its "interrupted: ..." message (the bar is
    closed before the message)."""
    from moetune.tuner.bringup import flow
    from moetune.tuner.cli import profile as P

    def run(self: Any) -> Any:
        task = self.progress.add("collective qwen3-30b S=128", 4)
        self.progress.update(task, 2, best=5484.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(P, "_no_cuda_for_nccl", lambda flow, capture: None)
    monkeypatch.setattr(flow.Bringup, "run", run)
    r = runner.invoke(app, ["profile", "--quick", "--capture", str(CAPTURES / "h200x2"), "--db",
                            str(tmp_path / "m.db")], env={"MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 130, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert "collective qwen3-30b S=128: 2/4 done" in r.output, r.output
    assert lines[-1].startswith("interrupted: run the same command again"), lines[-3:]


def _after_begin_line() -> int:
    """The line of SQLAlchemy's SessionTransaction._connection_for_bind right after the connection began its
    transaction (BEGIN IMMEDIATE ran) and before the session recorded it: an interrupt there left the connection
    checked out holding SQLite's write lock, with nothing to close it."""
    import inspect as _inspect

    from sqlalchemy.orm.session import SessionTransaction

    fn = _inspect.unwrap(SessionTransaction._connection_for_bind)
    lines, first = _inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if "bind_is_connection = isinstance(" in line:
            return first + i
    pytest.skip("this SQLAlchemy's _connection_for_bind has no such line")
    raise AssertionError("unreachable")


@pytest.mark.usefixtures("python_sigint_handler")
def test_ctrl_c_inside_a_study_storage_transaction_ends_the_tune_as_an_interrupt(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt may land inside SQLAlchemy's bookkeeping of a study-storage transaction, after BEGIN IMMEDIATE
    (2 of ~37 Ctrl-Cs of `tune --backend model`); left there, the connection keeps SQLite's write lock, the
    interrupted trial's FAIL waits the busy timeout and fails "database is locked", and Optuna ends in
    "AssertionError: Should not reach." (no KeyboardInterrupt in the chain): a ~480-line traceback, exit 1, the
    trial left RUNNING. Here a real SIGINT arrives at that very line, inside the objective's storage write: the
    interrupt is held back until the storage call returns, the trial is failed as interrupted and saved, one line,
    exit 130, at once (not after the 30 s busy timeout)."""
    import optuna

    from moetune.tuner.search.trials import INTERRUPTED

    target = _after_begin_line()
    session_file = sys.modules["sqlalchemy.orm.session"].__file__
    fired: list[bool] = []

    def in_objective(frame: Any) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "_run" and frame.f_code.co_filename.endswith(os.path.join("search", "study.py")):
                return True
            frame = frame.f_back
        return False

    def local(frame: Any, event: str, _arg: object) -> Any:
        if event == "line" and frame.f_lineno == target and not fired and in_objective(frame):
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: inside the transaction bookkeeping
        return local

    def tracer(frame: Any, event: str, _arg: object) -> Any:
        if event == "call" and frame.f_code.co_name == "_connection_for_bind" and frame.f_code.co_filename == session_file:
            return local
        return None

    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    start = time.monotonic()
    sys.settrace(tracer)
    try:
        r = runner.invoke(app, [*TUNE_MODEL, "--trials", "3", "--db", str(tmp_path / "m.db")])
    finally:
        sys.settrace(None)
    took = time.monotonic() - start
    assert fired, "the SIGINT was never sent"
    assert r.exit_code == 130, (r.output, r.exception)
    assert "interrupted: the study is saved; run the same command again to resume" in r.output, r.output
    assert "Traceback" not in r.output and "locked" not in r.output, r.output
    assert took < 25, f"{took:.1f} s: a storage write waited on a lock the interrupt left held"
    studies = optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'm-studies.db'}")
    assert len(studies) == 1
    trials = optuna.load_study(study_name=studies[0].study_name, storage=f"sqlite:///{tmp_path / 'm-studies.db'}").trials
    states = [(t.state.name, t.user_attrs.get(INTERRUPTED)) for t in trials]
    assert ("FAIL", "interrupted (Ctrl-C)") in states, states  # the interrupted trial, failed and marked so
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in trials), states


@pytest.mark.usefixtures("python_sigint_handler")
def test_an_error_after_a_received_interrupt_is_that_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same find's other half: Optuna caught the interrupt (to fail the trial), and its own clean-up then raised
    an error whose chain does not hold it (StorageInternalError, then "AssertionError: Should not reach."). An error
    that ends the body after the handler received a Ctrl-C (or SIGTERM) ends it as that interrupt; without one it is
    the error it is."""
    import io

    import optuna
    import typer
    from rich.console import Console

    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt

    def optunas_clean_up() -> None:
        try:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.")
        except optuna.exceptions.StorageInternalError:
            pass
        raise AssertionError("Should not reach.")

    buf = io.StringIO()
    with pytest.raises(typer.Exit) as x, ends_cleanly_on_interrupt(lambda: "left", Console(file=buf)):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler raises here
            raise AssertionError("the SIGINT was not raised")
        except KeyboardInterrupt:
            pass  # Optuna's `except (Exception, KeyboardInterrupt)`: the trial failed, then its clean-up fails
        optunas_clean_up()
    assert x.value.exit_code == 130 and buf.getvalue().strip() == "interrupted: left"
    with pytest.raises(AssertionError), ends_cleanly_on_interrupt(lambda: "left", Console(file=io.StringIO())):
        optunas_clean_up()  # no interrupt received (the previous one is forgotten with its command): an error


def test_an_interrupt_inside_a_storage_call_is_raised_when_it_returns() -> None:
    """`interrupt_guard`: delivered inside a storage call, the interrupt is raised when the outermost call returns
    (or over its error); outside one, or a second one while the first is held back, at once."""
    from moetune.tuner.search.interrupt_guard import deliver, guarded, pending

    done: list[str] = []

    @guarded
    def inner() -> None:
        deliver(KeyboardInterrupt("first"))
        assert pending() is not None
        done.append("inner")

    @guarded
    def outer(fail: bool) -> None:
        inner()
        done.append("outer")
        if fail:
            raise ValueError("storage error")

    with pytest.raises(KeyboardInterrupt, match="first"):
        outer(False)
    assert done == ["inner", "outer"] and pending() is None
    with pytest.raises(KeyboardInterrupt) as x:
        outer(True)
    assert isinstance(x.value.__context__, ValueError)
    with pytest.raises(KeyboardInterrupt, match="now"):
        deliver(KeyboardInterrupt("now"))

    @guarded
    def insists() -> None:
        deliver(KeyboardInterrupt("first"))
        deliver(KeyboardInterrupt("second"))
        done.append("not reached")

    with pytest.raises(KeyboardInterrupt, match="second"):
        insists()
    assert "not reached" not in done and pending() is None
