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
    assert run(tmp_path, "--db", str(typo)).exit_code == 0  # the stub: the CLI asks the daemon not to create it
    assert [c["create_db"] for c in started] == [False]


def test_the_daemon_refuses_it_and_makes_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys

    typo = tmp_path / "typo.db"
    # a process of its own: run_daemon sets up the daemon's logging first, which must not leak into other tests
    r = subprocess.run([sys.executable, "-c", "import sys; from moetune.tuner.daemon.server import run_daemon; "
                        f"run_daemon(db={str(typo)!r}, create_db=False, socket='ipc://{tmp_path}/d.sock')"],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode != 0 and f"no database at {typo}" in r.stderr and "--create" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no database, no lock file beside it


def test_a_bad_config_is_named_before_the_missing_db(tmp_path: Path) -> None:
    """The configuration is checked first: a user told to pass --create would only then learn the config was bad."""
    from moetune.tuner.daemon.server import run_daemon

    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon]\nrediscover_interval_s = -1\n")
    with pytest.raises(ValueError, match="rediscover_interval"):  # raised before the daemon's logging is set up
        run_daemon(db=str(tmp_path / "typo.db"), create_db=False, config=cfg, socket=f"ipc://{tmp_path}/d.sock")


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
