"""Every command of the `moetune` CLI as (path of names, click command): the tests that check something of each."""

from __future__ import annotations

from typing import Any


def cli_commands() -> list[tuple[list[str], Any]]:
    from typer.main import get_command

    from moetune.tuner.cli import app

    def walk(cmd: Any, path: list[str]) -> Any:
        if getattr(cmd, "commands", None):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
        if path:
            yield path, cmd

    return list(walk(get_command(app), []))
