"""`--help` read as a new user: a flag shows no value placeholder (`--json <bool>` read as if a value were
required), an option with two names shows them apart (`--curve-clients-dir,--clients-dir`), and options whose
default comes from the config say what it is."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(120)


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", r.output))


def _commands(group=None, path=()):  # every command's argv prefix, subcommands included
    import typer

    group = group or typer.main.get_command(app)
    for name in group.list_commands(None):
        cmd = group.get_command(None, name)
        yield (*path, name)
        if hasattr(cmd, "list_commands"):
            yield from _commands(cmd, (*path, name))


def test_no_flag_shows_a_bool_placeholder_anywhere() -> None:
    every = [(), *_commands()]
    assert len(every) > 20
    for args in every:
        h = _help(*args)
        assert "<bool>" not in h, (args, h)
        assert "--help Show this message" in h, (args, h)


def test_a_flag_has_no_placeholder_an_option_keeps_its_own() -> None:
    assert "--version Print the version" in _help()
    h = _help("profiles", "list")
    assert "--json Print JSON." in h and "--db <path>" in h and "--status <str>" in h, h
    assert "--allow-insecure-tcp --no-allow-insecure-tcp Allow tcp://" in _help("serve")


def test_two_names_of_one_option_are_shown_apart() -> None:
    h = _help("serve")
    assert "--curve-clients-dir, --clients-dir <path>" in h, h
    assert "--curve-clients-dir,--clients-dir" not in h


def test_defaults_from_the_config_are_stated() -> None:
    q = _help("query")
    assert re.search(r"--socket <str> Daemon endpoint \(default: \[client\] socket, else the daemon's \[daemon\] "
                     r"socket: ipc:// daemon\.sock in the runtime directory\)", q), q
    assert re.search(r"--db <path> Database to read when the daemon does not answer \(default: \[store\] db, "
                     r"\$MOETUNE_HOME, XDG data dir\)", q), q
    assert "--db <path> Profile database (default: [store] db, $MOETUNE_HOME, XDG data dir)" in _help("report")
    assert "(trusted loopback tests only; default: config daemon.allow_insecure_tcp, false)" in _help("serve")
