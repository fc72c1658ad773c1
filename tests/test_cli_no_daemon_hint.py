"""`moetune status` / `retune` where no daemon runs said only "no daemon socket at ipc://... (absent or not
accessible)": what is wrong, not what to do. Where nothing is at that path, the message now says to start one
(`moetune serve`) or to name the endpoint of one that runs elsewhere; a socket that is there but refused (not
accessible, not trusted) gets no such hint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

HINT = "no daemon runs there: start one with `moetune serve`"


@pytest.mark.parametrize("cmd", [["status"], ["retune"], ["status", "--json"]])
def test_no_socket_says_how_to_start_a_daemon(tmp_path: Path, cmd: list[str]) -> None:
    r = CliRunner().invoke(app, [*cmd, "--socket", f"ipc://{tmp_path}/run/daemon.sock", "--timeout-ms", "100"],
                           env={"MOETUNE_CONFIG": "", "COLUMNS": "400"})
    assert r.exit_code == 1, r.output
    text = json.loads(r.stdout)["error"] if "--json" in cmd else " ".join(r.output.split())
    assert "no daemon socket at" in text and HINT in text, text


def test_a_file_in_the_way_gets_no_start_hint(tmp_path: Path) -> None:
    sock = tmp_path / "daemon.sock"
    sock.write_text("not a socket")  # something is there: starting a daemon is not the answer
    r = CliRunner().invoke(app, ["status", "--socket", f"ipc://{sock}", "--timeout-ms", "100"],
                           env={"MOETUNE_CONFIG": "", "COLUMNS": "400"})
    assert r.exit_code == 1 and HINT not in " ".join(r.output.split()), r.output


def test_the_command_list_says_which_command_is_the_daemon() -> None:
    """`moetune --help` named "the daemon" under status and retune only; the command that runs it read "serve  Serve
    tuned profiles over ZeroMQ; ...", and `moetune daemon` is no command: its line now says it runs the daemon."""
    r = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.strip("│ ").startswith("serve "))
    assert "the node daemon" in line, line
