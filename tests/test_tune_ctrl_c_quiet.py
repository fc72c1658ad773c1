"""Ctrl-C during `moetune tune` / `moetune profile` prints the "interrupted" line only: Optuna logged the failed
trial as a warning with the KeyboardInterrupt's full traceback and "Trial N failed with value None.". Real
processes (Optuna's log handler writes to the process's stderr), the interrupt raised at a chosen trial."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

TUNE = """
import sys
from moetune.tuner.search import study
run, n = study._Objective._run, [0]
def interrupted_at_third(self, trial):
    n[0] += 1
    if n[0] == 3:
        raise KeyboardInterrupt  # Ctrl-C while the third trial measures
    return run(self, trial)
study._Objective._run = interrupted_at_third
sys.argv = ["moetune", "tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "50", "--tokens", "128"]
from moetune.tuner.cli import main
main()
"""

PROFILE = """
import sys, optuna
from pathlib import Path
from moetune.tuner.bringup import flow

class Facts:
    gpu_count, gpu_model, fingerprint, transport_names = 1, "test", "f" * 16, ["nvlink"]
    warnings, unavailable = [], []  # what the start of a bring-up says of the node (profile.node_limits)

class FakeBringup:  # the bring-up flow reduced to a study whose trial is interrupted
    def __init__(self, **kw):
        self.facts, self.ep_note, self.not_measured, self.measures = Facts(), "EP note", "", True
        self.mk_left_out = {}  # no planned model left out of the megakernel stage
        self.report_dir = Path(kw["state_dir"]) / "report"  # the CLI checks its report.md before the run
        self.progress = type("P", (), {"close": lambda self: None})()
    def run(self):
        def objective(trial):
            trial.suggest_int("x", 0, 3)
            raise KeyboardInterrupt
        optuna.create_study().optimize(objective, n_trials=3)

flow.Bringup = FakeBringup
sys.argv = ["moetune", "profile"]
from moetune.tuner.cli import main
main()
"""


def _run(script: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOETUNE_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=200)


@pytest.mark.parametrize(("script", "line"), [(TUNE, "interrupted: the study is saved"),
                                              (PROFILE, "interrupted: run the same command again")],
                         ids=["tune", "profile"])
def test_ctrl_c_prints_the_interrupted_line_only(tmp_path: Path, script: str, line: str) -> None:
    r = _run(script, tmp_path / "home")
    out = r.stdout + r.stderr
    assert r.returncode == 130, out[-3000:]
    assert line in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert "failed with" not in out  # Optuna's "Trial N failed with parameters/value ..."


def test_an_interrupted_rollback_in_sqlalchemys_pool_prints_no_traceback() -> None:
    """A second Ctrl-C while the first unwound interrupted a connection's rollback: SQLAlchemy's pool logs that with
    its traceback (then re-raises), and with no handler Python's last-resort handler printed it before the command's
    own "interrupted" line (a tester saw it once in 7 double Ctrl-Cs of `profile --quick`)."""
    code = """
import logging, sys
from moetune.tuner import cli
sys.argv = ["moetune", "--version"]
try:
    cli.main()
except SystemExit:
    pass
try:
    raise KeyboardInterrupt
except KeyboardInterrupt:
    logging.getLogger("sqlalchemy.pool.impl.QueuePool").error("Exception during reset or similar", exc_info=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Exception during reset" not in r.stderr and "Traceback" not in r.stderr, r.stderr
