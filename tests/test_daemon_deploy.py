"""The systemd unit ships with the package and says what the daemon needs."""

from __future__ import annotations

import configparser
from importlib import resources

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
