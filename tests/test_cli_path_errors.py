"""Paths given on the command line, across every command: an empty path is refused naming the option (read as a Path,
"" was the current folder), and a file that is missing, unreadable, not what it should be, or cannot be written ends
the command with the same exit status in every command (the convention in `moetune --help`), one message naming the
path, and no traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.cli._args import path_arg, path_text

pytestmark = pytest.mark.timeout(120)


def _commands():
    from typer.main import get_command

    def walk(cmd, path):
        if getattr(cmd, "commands", None):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
        if path:
            yield path, cmd

    return list(walk(get_command(app), []))


def _parser(p):
    return p.type_descriptor.parameter_info.parser


def _annotation(p):
    return p.type_descriptor.annotation


# str options that name a file (kept as typed: "-" for stdout, a preset's name), and str options that are not paths
_TEXT_PATHS = {("bench", "run", "--results"), ("bench", "run", "--from-report"), ("bench", "summarize", "--results"),
               ("bench", "summarize", "--out"), ("tune", "--preset"), ("model", "predict", "--preset"),
               ("model", "sweep", "--preset"), ("model", "calibrate", "--preset")}


def _path_params():
    """(command path, the parameter's command-line words before "", its name as an error shows it) for every path."""
    out = []
    for path, cmd in _commands():
        args = [p for p in cmd.params if p.param_type_name == "argument"]
        for p in cmd.params:
            if _parser(p) not in (path_arg, path_text):
                continue
            if p.param_type_name == "argument":  # the arguments before it get a placeholder
                words = ["x"] * args.index(p)
                name = p.name
            else:
                words = [p.opts[0]]
                name = p.opts[0]
            out.append(pytest.param(path, words, name, id=" ".join([*path, name])))
    return out


_PATHS = _path_params()


def test_every_path_option_refuses_an_empty_path() -> None:
    """Every Path (or list[Path]) parameter of every command, and the str ones naming a file, parse with path_arg /
    path_text (`_args.path_option`): a new one typed Path without it is caught here."""
    from typing import get_args

    missing = []
    for path, cmd in _commands():
        for p in cmd.params:
            ann = _annotation(p)
            is_path = ann is Path or get_args(ann) == (Path,)
            text = p.param_type_name == "option" and (*path, p.opts[0]) in _TEXT_PATHS
            want = path_arg if is_path else path_text if text else None
            if want is not None and _parser(p) is not want:
                missing.append(f"moetune {' '.join(path)} {p.opts[0]}")
    assert not missing, missing
    assert len(_PATHS) >= 70, len(_PATHS)  # --db and --config of ~20 commands, --out, --capture, keys, bench, ...


@pytest.mark.parametrize(("command", "words", "name"), _PATHS)
def test_an_empty_path_is_refused_naming_the_option(command: list[str], words: list[str], name: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`profile --report-dir ""` wrote report.md into the current folder, `bench summarize --out ""` rewrote
    BENCHMARKS.md, `db path --db ""` printed ".", `tune --policy ""` was ignored, `serve --clients-dir ""` served:
    every path refuses "" before anything runs, exit 2, naming itself; nothing is created."""
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    r = CliRunner().invoke(app, [*command, *words, ""], env={"MOETUNE_HOME": str(home), "COLUMNS": "200",
                                                              "MOETUNE_CONFIG": ""})
    said = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2, said
    assert f"Invalid value for '{name}'" in said and "an empty path names no file or folder" in said, said
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))
    assert list(tmp_path.iterdir()) == []  # no database, report, key or home folder made


def test_the_empty_path_check_leaves_the_help_as_typer_shows_a_path() -> None:
    """path_option's parser would show `<Path>`: the help keeps `<path>` (and `<list[Path]>` for --data)."""
    r = CliRunner().invoke(app, ["profile", "--help"], env={"COLUMNS": "200"})
    h = re.sub(r"\s+", " ", r.output.replace("│", " "))
    assert "--report-dir <path>" in h and "<Path>" not in h, h
    r = CliRunner().invoke(app, ["model", "calibrate", "--help"], env={"COLUMNS": "200"})
    assert "<list[Path]>" in r.output, r.output
