"""A daemon's text (a job's reason quoted back by `retune`, an error message, a fallback message naming it) was printed
raw by `moetune retune`, by the error of any command asking the daemon, and by `moetune query`: a terminal escape in
it (`\\x1b[2J` clears the screen) was obeyed. `moetune status` already showed control characters as \\xNN; every
printer of a daemon's string now does, with the same helper (`tuner/cli/_tables.py` `visible`)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moetune.tuner.cli import app
from moetune.tuner.cli import query as cli_query

HOSTILE = "job 7 queued: \x1b[2J\x1b[31mall clean\x07"
SHOWN = "job 7 queued: \\x1b[2J\\x1b[31mall clean\\x07"


def test_retune_shows_the_daemons_message_control_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_query, "daemon_call", lambda *a, **kw: types.SimpleNamespace(message=HOSTILE))
    r = CliRunner().invoke(app, ["retune", "--socket", "ipc:///nonexistent/d.sock"])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output and SHOWN in r.output, repr(r.output)


class _Refusing:
    """A client whose daemon answers every request with an error carrying a terminal escape."""

    def request(self, op: str, **fields: Any) -> Any:
        from moetune.runtime.profiles.errors import DaemonError

        raise DaemonError("forbidden", HOSTILE)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("args", [["retune", "--socket", "ipc:///x/d.sock"], ["status", "--socket", "ipc:///x/d.sock"]])
def test_a_daemons_error_message_is_shown_not_obeyed(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    monkeypatch.setattr(cli_query, "make_client", lambda *a, **kw: _Refusing())
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1, r.output
    assert "\x1b[2J" not in r.output and "\x07" not in r.output and SHOWN in r.output, repr(r.output)
    assert "Traceback" not in r.output


def test_the_json_error_keeps_the_daemons_text_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON escapes control characters itself: the text is the daemon's, exactly."""
    import json

    monkeypatch.setattr(cli_query, "make_client", lambda *a, **kw: _Refusing())
    r = CliRunner().invoke(app, ["status", "--socket", "ipc:///x/d.sock", "--json"])
    assert r.exit_code == 1
    assert json.loads(r.stdout)["error"] == f"the daemon said forbidden: {HOSTILE}"


def test_querys_fallback_message_shows_control_characters(tmp_path: Path) -> None:
    """The message line of `moetune query` (it quotes the daemon, names paths) goes through the same helper."""
    from test_query_message_markup import query_from_a_db_in

    _db, r = query_from_a_db_in(tmp_path, "e\x1b[2Jf")
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "e\\x1b[2Jf" in r.output, repr(r.output)
