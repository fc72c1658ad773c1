"""`moetune report` and Ctrl-C, from a tester's runs:

- interrupted before the report is written, one "interrupted: ..." line says what is left, and the folder it made
  (rep_2.2/) is removed while empty, not left behind with nothing printed;
- a report written whole (it has printed `report: rep_2.8/report.md`) does not exit 130: a Ctrl-C once report.md is
  in place (it is written last), or during the interpreter's teardown after the command ended, changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(120)
CAPTURES = Path(__file__).resolve().parent / "captures"


def _db(tmp_path: Path) -> Path:
    db = tmp_path / "p.db"
    F.open_store(db).close()
    return db


def _report(tmp_path: Path, out: Path) -> Any:
    return CliRunner().invoke(app, ["report", "--db", str(_db(tmp_path)), "--out", str(out), "--capture",
                                    str(CAPTURES / "dgx-h100")])


def _write_atomic_interrupted(monkeypatch: pytest.MonkeyPatch, *, plots: tuple[str, ...] = (),
                              after_report_md: bool = False) -> None:
    """The report's writes, Ctrl-C arriving at report.md (written last): before it is written (the `plots` written
    first, as the report writes its plots before it), or just after it is in place (`after_report_md`)."""
    from moetune.tuner.bringup import report
    from moetune.tuner.store.io import write_atomic

    def interrupted(path: Path, data: Any, **kw: Any) -> None:
        if path.name == "report.md":
            for name in plots:
                write_atomic(path.with_name(name), b"\x89PNG plot")
            if after_report_md:
                write_atomic(path, data, **kw)
            raise KeyboardInterrupt
        write_atomic(path, data, **kw)

    monkeypatch.setattr(report, "write_atomic", interrupted)


def test_an_interrupt_before_anything_is_written_removes_the_empty_folder_it_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_atomic_interrupted(monkeypatch)
    out = tmp_path / "new" / "rep"  # both folders made by the report
    r = _report(tmp_path, out)
    assert r.exit_code == 130, (r.output, r.exception)
    said = " ".join(r.output.split())
    assert said == f"interrupted: no report written; the empty folder {tmp_path / 'new'} it made is removed", said
    assert not (tmp_path / "new").exists()
    assert "Traceback" not in r.output


def test_an_interrupt_leaves_a_folder_it_did_not_make_as_it_was(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _write_atomic_interrupted(monkeypatch)
    out = tmp_path / "mine"
    out.mkdir()
    r = _report(tmp_path, out)
    assert r.exit_code == 130, (r.output, r.exception)
    assert f"interrupted: no report written; {out} is as it was" in " ".join(r.output.split()), r.output
    assert out.is_dir() and not any(out.iterdir())  # the user's empty folder is kept


def test_an_interrupt_after_some_plots_says_which_are_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_atomic_interrupted(monkeypatch, plots=("latency.png", "bandwidth.png"))
    out = tmp_path / "rep"
    r = _report(tmp_path, out)
    assert r.exit_code == 130, (r.output, r.exception)
    said = " ".join(r.output.split())
    assert ("interrupted: the report is not complete: report.md was not written; bandwidth.png, latency.png written "
            f"in {out} are left there; run the same command again for the whole report") in said, r.output
    assert sorted(p.name for p in out.iterdir()) == ["bandwidth.png", "latency.png"]


def test_an_interrupt_once_report_md_is_in_place_ends_as_a_finished_report(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _write_atomic_interrupted(monkeypatch, after_report_md=True)
    out = tmp_path / "rep"
    r = _report(tmp_path, out)
    assert r.exit_code == 0, (r.output, r.exception)
    # said once, no interrupted line (whitespace dropped: a long tmp path, as under pytest-xdist, wraps mid-name)
    assert "".join(r.output.split()) == f"report:{out / 'report.md'}", r.output
    assert (out / "report.md").read_text().startswith("# moetune bring-up report")


# the CLI's own entry point, then a Ctrl-C after the command ended: in the interpreter's teardown (here an exit
# handler, which runs before Python puts the default SIGINT action back; a Ctrl-C after that killed the process)
AFTER_THE_END = """
import atexit, os, signal, sys, time

def ctrl_c_at_exit():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    print("sigint", "ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "handled", flush=True)

atexit.register(ctrl_c_at_exit)
sys.argv = ["moetune", "report", "--db", sys.argv[1], "--out", sys.argv[2], "--capture", sys.argv[3]]
from moetune.tuner.cli import main
main()
"""


def test_a_ctrl_c_after_the_report_was_written_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    p = subprocess.run([sys.executable, "-c", AFTER_THE_END, str(_db(tmp_path)), str(out), str(CAPTURES / "dgx-h100")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines() == [f"report: {out / 'report.md'}", "sigint ignored"], p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
