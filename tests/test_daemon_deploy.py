"""The systemd unit ships with the package and says what the daemon needs."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app


def test_systemd_unit() -> None:
    text = (resources.files("moetune.tuner.daemon") / "deploy" / "moetune.service").read_text()
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # keep the case of systemd keys
    cp.read_string(text)
    svc = cp["Service"]
    assert svc["ExecStart"] == "/usr/bin/env moetune serve --config /etc/moetune/moetune.toml"
    assert svc["StateDirectory"] == "moetune" and svc["RuntimeDirectory"] == "moetune"
    assert svc["RuntimeDirectoryMode"] == "0750" and svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "strict" and svc["User"] == "moetune"
    assert cp["Install"]["WantedBy"] == "multi-user.target"


def test_serve_help_lists_options() -> None:
    r = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for opt in ("--socket", "--db", "--config", "--metrics-port", "--rediscover-interval", "--capture"):
        assert opt in r.output


def test_systemd_parses_every_line_of_the_unit(tmp_path: Path) -> None:
    """systemd's own parser (systemd-analyze verify) accepts every key and value of the shipped unit: a misspelt key
    or a bad value is only a warning to systemd, which then runs the daemon without that setting (hardening lost)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    unit = tmp_path / "moetune.service"
    unit.write_text((resources.files("moetune.tuner.daemon") / "deploy" / "moetune.service").read_text())
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # A diagnostic about the unit's own text names it with a line number; others are about this machine
    # (no running systemd, missing dependencies) and say nothing of the file.
    about_unit = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(f"{unit}:")]
    assert about_unit == [], "\n".join(about_unit)
