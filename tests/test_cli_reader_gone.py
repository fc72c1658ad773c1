"""A command whose stdout reader went away (`moetune profile --help | head -1`) ends as a Unix tool does: no
traceback, no message, exit 141 (128 + SIGPIPE). It exited 1 with no word: Typer's and Rich's own catches of the
broken pipe both end in SystemExit(1), which reads as a failed command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def _run_into_a_closed_pipe(args: list[str], home: Path) -> subprocess.CompletedProcess:
    """`moetune ARGS` with stdout a pipe whose read end is closed before the command starts: its first write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"),
           "MOETUNE_CONFIG": "", "COLUMNS": "80"}
    try:
        return subprocess.run([sys.executable, "-m", "moetune.tuner.cli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=240)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["profile", "--help"], ["--help"], ["--version"], ["model", "presets"],
                                  ["db", "path"], ["profiles", "list", "--json"]])
def test_a_reader_gone_ends_the_command_quietly_with_141(tmp_path: Path, args: list[str]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    if args[0] == "profiles":
        from moetune.tuner.store.store import Store

        Store(home / "moetune.db").close()
    r = _run_into_a_closed_pipe(args, home)
    assert r.returncode == 141, (r.returncode, r.stderr)
    assert r.stderr == "", r.stderr


def test_a_command_failing_for_its_own_reason_keeps_its_status(tmp_path: Path) -> None:
    """Only a broken output becomes 141: a refusal (exit 2) says its reason on stderr as before."""
    r = _run_into_a_closed_pipe(["profiles", "show", "1", "--db", str(tmp_path / "none.db")], tmp_path)
    assert r.returncode == 2 and "no database" in r.stderr, (r.returncode, r.stderr)


def test_a_failure_with_stdout_on_dev_null_and_stderr_a_pipe_keeps_its_exit_1(tmp_path: Path) -> None:
    """`moetune status >/dev/null` with stderr a pipe (a script keeping only the errors, a service's journal): no
    daemon is a failure, exit 1 with its reason. stdout being /dev/null from the start read as Rich's redirect after
    a broken pipe, and the exit 1 became a silent-looking 141."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"),
           "MOETUNE_CONFIG": "", "COLUMNS": "80"}
    r = subprocess.run([sys.executable, "-m", "moetune.tuner.cli", "status", "--socket",
                        f"ipc://{tmp_path / 'none.sock'}", "--timeout-ms", "50"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, env=env, timeout=240)
    assert r.returncode == 1 and "none.sock" in r.stderr, (r.returncode, r.stderr)
