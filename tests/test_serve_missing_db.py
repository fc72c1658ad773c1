"""`moetune serve --db <typo>` created and served a new empty database, while every other reader refuses a missing one
("no database at ..."): clients got not_found for every key. serve now refuses a --db that does not exist unless
--create; the default database (no --db) is created as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    from moetune.tuner.daemon import server

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(server, "run_daemon", lambda **kw: calls.append(kw) or 0)  # never really started
    return calls


def run(tmp_path: Path, *args: str):
    return CliRunner().invoke(app, ["serve", *args], env={"MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "200",
                                                          "MOETUNE_CONFIG": ""})


def test_a_missing_db_is_refused_and_nothing_is_created(tmp_path: Path, started: list[dict[str, Any]]) -> None:
    typo = tmp_path / "typo.db"
    r = run(tmp_path, "--db", str(typo))
    assert r.exit_code == 2, r.output
    assert f"no database at {typo}" in r.stderr and "--create" in r.stderr and "Traceback" not in r.output
    assert not started and sorted(p.name for p in tmp_path.iterdir()) == []


def test_create_serves_a_new_database(tmp_path: Path, started: list[dict[str, Any]]) -> None:
    r = run(tmp_path, "--db", str(tmp_path / "new.db"), "--create")
    assert r.exit_code == 0, r.output
    assert [c["db"] for c in started] == [str(tmp_path / "new.db")]


def test_an_existing_db_and_the_default_need_no_create(tmp_path: Path, started: list[dict[str, Any]]) -> None:
    Store(tmp_path / "m.db").close()
    assert run(tmp_path, "--db", str(tmp_path / "m.db")).exit_code == 0
    assert run(tmp_path).exit_code == 0  # the default database: made by the daemon as before
    assert [c["db"] for c in started] == [str(tmp_path / "m.db"), None]


def test_help_says_it() -> None:
    r = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert "--create" in r.stdout and "It must exist unless --create" in r.stdout
