"""Nobody adds moetune's tables to another program's SQLite file: the Store itself refuses to open one (tables, none
of them moetune's version table), so tune, fabric show --record, db upgrade and serve all say so cleanly (rc 2, no
traceback) and leave the file byte-identical. An empty file, a new path and an Optuna study file still become stores."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.store._tables import OPTUNA_COLUMNS, OPTUNA_TABLES
from moetune.tuner.store.store import Store, StoreError, head_revision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_env import child_env

CAPTURE = Path(__file__).parent / "captures" / "h200x1"
runner = CliRunner()


def foreign(path: Path, *, wal: bool = False) -> str:
    """Another program's SQLite file (one table, a row); returns its hash."""
    con = sqlite3.connect(path)
    if wal:
        con.execute("PRAGMA journal_mode = WAL")
    con.execute("CREATE TABLE mydata (x INTEGER)")
    con.execute("INSERT INTO mydata VALUES (1)")
    con.commit()
    con.close()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def untouched(path: Path, digest: str) -> bool:
    side = [path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal")]
    return hashlib.sha256(path.read_bytes()).hexdigest() == digest and not any(p.exists() for p in side)


@pytest.mark.parametrize("wal", [False, True], ids=["rollback-journal", "wal"])
@pytest.mark.parametrize("readonly", [False, True], ids=["write", "read"])
def test_store_refuses_another_programs_file(tmp_path: Path, wal: bool, readonly: bool) -> None:
    db = tmp_path / "theirs.db"
    digest = foreign(db, wal=wal)
    with pytest.raises(StoreError, match=r"theirs\.db is not a moetune database \(it has tables mydata"):
        Store(db, readonly=readonly)
    if not readonly:  # a read-only probe of a WAL file may leave SQLite's empty -wal/-shm; never a byte of the file
        assert untouched(db, digest)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


def test_empty_file_new_path_and_optuna_file_still_become_stores(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    no_tables = tmp_path / "no_tables.db"
    sqlite3.connect(no_tables).close()
    optuna = tmp_path / "studies.db"  # an Optuna study file: the store shares its file with Optuna
    con = sqlite3.connect(optuna)
    con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
    for table in OPTUNA_TABLES:  # Optuna's core tables, with Optuna's columns (tuner/store/_tables.py)
        con.execute(f"CREATE TABLE {table} ({', '.join(OPTUNA_COLUMNS[table])})")
    con.commit()
    con.close()
    for path in (empty, no_tables, optuna, tmp_path / "new.db"):
        with Store(path) as s:
            assert s.current_revision() == head_revision()


def refused_by_cli(tmp_path: Path, *args: str, unsaid: str = "Traceback", env: dict[str, str] | None = None) -> None:
    """`moetune ARGS --db theirs.db` on another program's file: exit 2 saying so, nothing of `unsaid`, the file
    untouched."""
    db = tmp_path / "theirs.db"
    digest = foreign(db)
    r = runner.invoke(app, [*args, "--db", str(db)], env=env)
    assert r.exit_code == 2, r.output
    assert "is not a moetune database (it has tables mydata" in r.output and unsaid not in r.output
    assert untouched(db, digest)


def test_tune_refuses_another_programs_file(tmp_path: Path) -> None:
    refused_by_cli(tmp_path, "tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "1", "--tokens", "128",
                   env={"MOETUNE_HOME": str(tmp_path / "home")})


def test_fabric_show_record_refuses_another_programs_file(tmp_path: Path) -> None:
    refused_by_cli(tmp_path, "fabric", "show", "--record", "--capture", str(CAPTURE))


def test_db_upgrade_refuses_another_programs_file(tmp_path: Path) -> None:
    refused_by_cli(tmp_path, "db", "upgrade", unsaid="upgraded")


def test_serve_refuses_another_programs_file(tmp_path: Path) -> None:
    """The daemon's start-up error path: a message and exit status 2, not a daemon serving from their file."""
    db = tmp_path / "theirs.db"
    digest = foreign(db)
    cmd = [sys.executable, "-c", "from moetune.tuner.cli import main; main()", "serve", "--db", str(db),
           "--socket", f"ipc://{tmp_path}/d.sock", "--capture", str(CAPTURE), "--rediscover-interval", "0"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=child_env(MOETUNE_HOME=str(tmp_path / "h")))
    except subprocess.TimeoutExpired:
        pytest.fail("serve started on another program's database instead of refusing it")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is not a moetune database (it has tables mydata" in r.stderr and "Traceback" not in r.stderr
    assert untouched(db, digest)
