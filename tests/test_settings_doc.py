"""docs/settings.md is generated from the code, and documents every MOETUNE_* name the code uses."""

from __future__ import annotations

import re
from pathlib import Path

from moetune.runtime.options import documented_variables, settings_markdown

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("tuner", "runtime", "csrc", "bench", "tests")
CODE_SUFFIXES = {".py", ".cu", ".cuh", ".cpp", ".cc", ".h", ".hpp", ".c", ".sh", ".toml"}
NAME = re.compile(r"MOETUNE_[A-Z0-9_]*[A-Z0-9]")
# deliberately undocumented: tests/test_config.py checks that an unknown variable is ignored
NOT_SETTINGS = {"MOETUNE_UNRELATED_THING",
                # not settings: the config rule's names of keys whose variable is another, refused when set (the
                # doc's configuration paragraph names them: test_refused_rule_names_are_in_the_doc)
                "MOETUNE_CLIENT_AUTOLOAD", "MOETUNE_RUNTIME", "MOETUNE_RUNTIME_HS_NATIVE"}


def test_refused_rule_names_are_in_the_doc() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert "(`MOETUNE_CLIENT_AUTOLOAD`, `MOETUNE_RUNTIME_<KEY>`) is not read: set, it is an" in doc


def test_settings_doc_is_what_the_generator_writes() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert doc == settings_markdown(), (
        "docs/settings.md is stale: run `python -m moetune.runtime.settings_doc > docs/settings.md`")


def _names_in_code() -> dict[str, str]:
    found: dict[str, str] = {}
    for d in CODE_DIRS:
        for path in (ROOT / d).rglob("*"):
            if path.is_file() and path.suffix in CODE_SUFFIXES and "results" not in path.parts:
                for name in NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_moetune_variable_in_the_code_is_documented() -> None:
    documented = documented_variables()
    doc = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert all(f"`{n}`" in doc for n in documented)
    found = _names_in_code()
    assert "MOETUNE_HS_NATIVE" in found and "MOETUNE_CACHE" in found  # the scan sees the code
    # a prefix of documented names (e.g. a `startswith("MOETUNE_HS")` filter) is not a variable of its own
    missing = {n: where for n, where in found.items()
               if n not in documented and n not in NOT_SETTINGS and not any(d.startswith(n + "_") for d in documented)}
    assert not missing, f"MOETUNE_* names used in the code but not in docs/settings.md: {missing}"


def test_the_check_sees_an_undocumented_name() -> None:
    new = "MOETUNE_" + "SOMETHING_NEW"  # split so that this file does not use the name itself
    assert new not in documented_variables()
    assert NAME.findall(f'os.environ.get("{new}")') == [new]


def test_the_generator_command_writes_the_doc_and_nothing_on_stderr() -> None:
    """`python -m moetune.runtime.options --markdown` warned on stderr (runpy: the module was already imported by
    moetune.runtime); the command the doc names runs clean."""
    import subprocess
    import sys

    from moetune.runtime.settings_doc import COMMAND

    doc = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert f"`{COMMAND}`" in doc
    module = COMMAND.split()[2]
    r = subprocess.run([sys.executable, "-W", "error", "-m", module], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == doc
    r = subprocess.run([sys.executable, "-m", module, "--markdown"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "takes no arguments" in r.stderr
