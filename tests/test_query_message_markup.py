"""`moetune query`'s table ends with why the knobs did not come from the daemon (the resolution's message). That text
names paths and quotes the daemon (the --db path, the socket, a daemon's error message) and was printed as Rich
markup: a database in a folder `a[/b]` ended the command in a MarkupError traceback (exit 1), and one in `[x]` was
named without its `[x]`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app


def query_from_a_db_in(tmp_path: Path, folder: str) -> tuple[Path, Any]:
    """(the database, the result of `moetune query` falling back to it): a database in `folder` that knows this node,
    so query's message names it; no daemon answers."""
    from moetune.tuner.store.store import Store

    where = tmp_path / folder
    where.mkdir(parents=True)
    db = where / "m.db"
    with Store(db) as s:  # this node is known there: the message names the database it read
        s.upsert_fingerprint("fp", F.this_node_facts(), origin="local")
    r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "100", "--db", str(db),
                                 "--socket", f"ipc://{tmp_path}/none.sock"],
                           env={"MOETUNE_CONFIG": "", "COLUMNS": "400"}, terminal_width=400)
    return db, r


@pytest.mark.parametrize("folder", ["a[/b]", "[x]", "[red]c"])
def test_the_fallback_message_is_printed_as_text(tmp_path: Path, folder: str) -> None:
    db, r = query_from_a_db_in(tmp_path, folder)
    assert r.exit_code == 0, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    flat = " ".join(r.output.split())
    assert f"database {db}:" in flat, r.output  # the path as it is, brackets and all
