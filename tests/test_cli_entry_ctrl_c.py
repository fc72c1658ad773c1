"""A Ctrl-C in the first milliseconds of `moetune ...`: one line on stderr and exit 130, never a traceback.

Python's default Ctrl-C raises KeyboardInterrupt wherever the interpreter is. The console script's module was
`moetune.tuner.cli`, whose imports (signal, threading, the CLI's Ctrl-C helpers) ran before `main` could catch
anything: a Ctrl-C there printed a traceback from inside an import (about one start in three with the Ctrl-C sent
5-20 ms in, on a 2-core machine). The console script's module (pyproject's `[project.scripts]`, read here) now takes
Ctrl-C over before it imports anything, and `main` hands it back to Python inside its own handling. Every child
here is started as the console script starts: `from MODULE import FUNC; sys.exit(FUNC())`. A test cannot cover the
interpreter's own start (site, the .pth files) nor the package `__init__`s on the way to the module."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_env import child_env  # beside this file

ROOT = Path(__file__).resolve().parents[1]
LINE = "interrupted: before the command started; nothing was done"


def _entry_point() -> tuple[str, str]:
    """(module, function) of the `moetune` console script."""
    value = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["moetune"]
    module, _, func = value.partition(":")
    return module, func


def _child(code: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    module, func = _entry_point()
    return subprocess.run([sys.executable, "-c", code.format(module=module, func=func)], capture_output=True,
                          text=True, timeout=120, env=child_env(MOETUNE_HOME=str(home), COLUMNS="200", **env))


# which modules are looked up while Ctrl-C is still Python's KeyboardInterrupt, from the console script's import on
_LOOKED_UP_UNDER_PYTHONS_HANDLER = """
import signal, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            seen.append(name)
        return None
sys.meta_path.insert(0, Watch())
from {module} import {func}
print(" ".join(seen))
"""


def test_the_entry_module_imports_nothing_before_taking_ctrl_c_over(tmp_path: Path) -> None:
    """Before the handler is set, only the module itself and the packages it is in are imported: the package
    `__init__`s import nothing (`moetune.tuner`, `moetune.tuner.cli`)."""
    module, _func = _entry_point()
    r = _child(_LOOKED_UP_UNDER_PYTHONS_HANDLER, tmp_path / "home")
    assert r.returncode == 0, r.stderr[-2000:]
    parts = module.split(".")
    chain = {".".join(parts[: i + 1]) for i in range(len(parts))}
    seen = r.stdout.split()
    assert module in seen, seen  # the watch saw the import at all
    assert set(seen) <= chain, f"imported ahead of the entry point's Ctrl-C handling: {sorted(set(seen) - chain)}"


# a Ctrl-C that lands while NAME is imported, sent from inside the process (no timing): as a real one, Python runs the
# SIGINT handler at the next bytecode, inside that import
_CTRL_C_AT_IMPORT = """
import os, signal, sys
class CtrlCAt:
    def find_spec(self, name, path=None, target=None):
        if name == {name!r}:
            sys.meta_path.remove(self)
            print("ctrl-c sent", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlCAt())
sys.argv = ["moetune", "--help"]
from {{module}} import {{func}}
sys.exit({{func}}())
"""


@pytest.mark.parametrize("name", ["moetune.tuner.cli._exc_chain", "moetune.tuner.cli._torch_import",
                                  "moetune.tuner.cli._app"])
def test_ctrl_c_while_the_console_script_imports_the_cli_is_one_line_and_exit_130(tmp_path: Path, name: str) -> None:
    """The CLI's first imports (its Ctrl-C helpers; then the app, under `main`'s handling): a traceback and an end
    by the signal while they were imported by the entry module itself."""
    r = _child(_CTRL_C_AT_IMPORT.format(name=name), tmp_path / "home")
    lines = r.stderr.strip().splitlines()
    assert lines[:1] == ["ctrl-c sent"], f"{name} was not imported: {r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert lines[1:] == [LINE]


_HANDLERS = """
import signal, sys
{ignore}
from {{module}} import {{func}}
import moetune.tuner.cli._app as app_module
print("at import:", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
def run():
    print("in the command:", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
app_module.run = run
sys.exit({{func}}())
"""


@pytest.mark.parametrize("ignored", [False, True], ids=["python's", "ignored"])
def test_the_command_runs_under_the_handler_the_process_started_with(tmp_path: Path, ignored: bool) -> None:
    """`main` puts Python's own handler back before the command runs (its Ctrl-C handling is KeyboardInterrupt's);
    a process started with Ctrl-C ignored (nohup, a background job of a script) keeps it ignored throughout."""
    code = _HANDLERS.format(ignore="signal.signal(signal.SIGINT, signal.SIG_IGN)" if ignored else "")
    r = _child(code, tmp_path / "home")
    assert r.returncode == 0, r.stderr[-2000:]
    at_import, in_command = r.stdout.splitlines()
    assert in_command == f"in the command: {not ignored} {ignored}"
    assert at_import == f"at import: False {ignored}"  # taken over, unless ignored


def test_python_m_runs_the_entry_module(tmp_path: Path) -> None:
    """`python -m MODULE` (a checkout without the console script) is the same command."""
    module, _func = _entry_point()
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                       env=child_env(MOETUNE_HOME=str(tmp_path / "home"), COLUMNS="200"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"Usage: .* COMMAND", r.stdout), r.stdout[:500]


def test_python_m_runs_the_cli_package(tmp_path: Path) -> None:
    """`python -m moetune.tuner.cli` (the package a user finds the CLI in) is the same command as the console
    script, Ctrl-C taken over as by `_entry`: it failed with "'moetune.tuner.cli' is a package and cannot be
    directly executed" (exit 1) before tuner/cli/__main__.py."""
    r = subprocess.run([sys.executable, "-m", "moetune.tuner.cli", "--help"], capture_output=True, text=True,
                       timeout=120, env=child_env(MOETUNE_HOME=str(tmp_path / "home"), COLUMNS="200"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"Usage: python -m moetune\.tuner\.cli .*COMMAND", r.stdout), r.stdout[:500]
    r = subprocess.run([sys.executable, "-c", "import signal, moetune.tuner.cli.__main__ as m, sys; "
                        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"],
                       capture_output=True, text=True, timeout=120,
                       env=child_env(MOETUNE_HOME=str(tmp_path / "home")))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"  # _entry's handler, set at the import, not Python's KeyboardInterrupt
