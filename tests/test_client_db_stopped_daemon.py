"""A stopped daemon's daemon.json (it stays after a clean exit, `"running": false`; a killed daemon leaves
`"running": true` with its pid gone) must not redirect every database fallback to the database it names: a database
the user configured (--db, MOETUNE_STORE_DB, a config file's [store] db) outranks daemon.json, and reading the
database of a daemon that is not running is said in the fallback warning (not read without a word while `moetune db
path` prints the default)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.profiles.client import ProfileClient
from moetune.tuner.cli import app
from moetune.tuner.cli import query as Q

pytestmark = pytest.mark.timeout(60)


def _daemon_json(run: Path, db: Path, **kw: object) -> None:
    run.mkdir(parents=True, mode=0o700, exist_ok=True)
    (run / "daemon.json").write_text(json.dumps({"written_by": "moetune-daemon", "db": str(db), "pid": None,
                                                 "running": False, "host": socket.gethostname(), **kw}))


def _gone_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_configured_db_outranks_a_stopped_daemons_daemon_json(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    daemon_db = tmp_path / "X.db"
    _daemon_json(home / "run", daemon_db)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\ndb = "{tmp_path / "Y.db"}"\n')
    env = {"MOETUNE_HOME": str(home), "MOETUNE_CONFIG": str(cfg), "HOME": str(tmp_path)}
    c = ProfileClient(env=env, timeout_ms=50)
    try:
        assert c.fallback_db() == tmp_path / "Y.db"
        assert c.fallback_db_note() is None  # nothing redirected
        res = c.resolve(model="qwen3-30b", ep_size=2, tokens=16)
        assert str(daemon_db) not in res.message
    finally:
        c.close()
    # `moetune query --config c.toml` reads the configured database too
    seen: list[Path] = []
    real = Q.provenance_of
    monkeypatch.setattr(Q, "provenance_of", lambda res, db: (seen.append(db), real(res, db))[1])
    r = CliRunner().invoke(app, ["query", "--config", str(cfg), "--model", "qwen3-30b", "--ep", "2", "--tokens", "16",
                                 "--timeout-ms", "50"], env={**env, "MOETUNE_CONFIG": ""})
    assert r.exit_code == 0, r.output
    assert seen == [tmp_path / "Y.db"]


@pytest.mark.parametrize("how", ["config", "variable"])
def test_an_empty_db_setting_is_the_default_and_does_not_outrank_daemon_json(tmp_path: Path, how: str) -> None:
    """`[store] db = ""` (README: the default) and an exported-but-empty MOETUNE_STORE_DB counted as configured (by
    where they were set, not what): the default database outranked the one the daemon named in daemon.json."""
    home = tmp_path / "home"
    daemon_db = tmp_path / "X.db"
    _daemon_json(home / "run", daemon_db)
    env = {"MOETUNE_HOME": str(home), "HOME": str(tmp_path)}
    if how == "config":
        cfg = tmp_path / "c.toml"
        cfg.write_text('[store]\ndb = ""\n')
        env["MOETUNE_CONFIG"] = str(cfg)
    else:
        env["MOETUNE_STORE_DB"] = ""
    c = ProfileClient(env=env, timeout_ms=50)
    try:
        assert c.fallback_db() == daemon_db
    finally:
        c.close()


@pytest.mark.parametrize("state", ["stopped", "killed"])
def test_reading_a_daemon_that_is_not_running_s_database_is_said(tmp_path: Path, state: str) -> None:
    home = tmp_path / "home"
    daemon_db = tmp_path / "X.db"
    if state == "stopped":
        _daemon_json(home / "run", daemon_db)
    else:
        _daemon_json(home / "run", daemon_db, running=True, pid=_gone_pid())
    env = {"MOETUNE_HOME": str(home), "MOETUNE_CONFIG": "", "HOME": str(tmp_path)}
    c = ProfileClient(env=env, timeout_ms=50)
    try:
        assert c.fallback_db() == daemon_db  # still the daemon's database: nothing else is configured
        note = c.fallback_db_note()
        assert note is not None and str(daemon_db) in note and "not running" in note
        assert ("running\": false" in note) if state == "stopped" else ("is gone" in note)
        res = c.resolve(model="qwen3-30b", ep_size=2, tokens=16)
        assert note in res.message
    finally:
        c.close()


def test_a_running_daemons_database_is_read_without_a_note(tmp_path: Path) -> None:
    home = tmp_path / "home"
    daemon_db = tmp_path / "X.db"
    _daemon_json(home / "run", daemon_db, running=True, pid=os.getpid())  # a live pid: only slow to answer
    c = ProfileClient(env={"MOETUNE_HOME": str(home), "MOETUNE_CONFIG": "", "HOME": str(tmp_path)}, timeout_ms=50)
    try:
        assert c.fallback_db() == daemon_db
        assert c.fallback_db_note() is None
    finally:
        c.close()
