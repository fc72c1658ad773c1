"""`moetune tune` on a forced fit (`model calibrate --force`) prints the fit's warning once.

The banner before the tune gives it, the one after the results is a short reminder, and the backend the CLI builds
does not log it as well (not the same text three times, or twice when the tune is refused after the first banner);
the library (a caller that prints nothing itself) still logs it once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

REASON = "too few rows: 1 distinct row for 7 fitted parameters"


def test_the_cli_prints_the_warning_once(tmp_path: Path) -> None:
    preset = F.write_forced_preset(tmp_path / "forced.toml")
    env = {**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "", "COLUMNS": "400"}
    code = "import sys; from moetune.tuner.cli import main; sys.argv[0] = 'moetune'; main()"
    r = subprocess.run([sys.executable, "-c", code, "tune", "--backend", "model", "--preset", str(preset),
                        "--model", "qwen3-30b", "--tokens", "128", "--trials", "2", "--db", str(tmp_path / "m.db"),
                        "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(REASON) == 1, r.stderr  # the real stderr: log lines included
    assert r.stderr.count("FORCED MODEL") == 2, r.stderr  # before the tune, and the reminder after it
    assert "Traceback" not in r.stderr


def test_the_library_still_logs_it_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from moetune.tuner.search.model_backend import ModelBackend

    preset = F.write_forced_preset(tmp_path / "forced.toml")
    with caplog.at_level(logging.WARNING):
        assert REASON in ModelBackend(str(preset)).forced_fit
        quiet = ModelBackend(str(preset), warn_forced=False)
    assert REASON in quiet.forced_fit  # known either way: the CLI's rows carry it
    said = [m for m in caplog.messages if "forced fit the calibration checks refused" in m]
    assert len(said) == 1, said
