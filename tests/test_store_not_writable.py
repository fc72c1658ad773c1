"""A database (or studies file) this user may not write, or a folder where one cannot be made: the file or folder is
named ("cannot write /ro-dir: permission denied" / "<file> is read-only for this user"): StoreNotWritable /
StorageNotWritable, exit_code 1 (tune exits 1 on them), not SQLite's own words with exit 2 ("unable to open database
file" from `db upgrade --db /ro-dir/p.db` and `tune --storage sqlite:////ro-dir/new.db`, "attempt to write a
readonly database" from `profiles delete 1 -y` and `serve` on a 0444 file).

As in tests/test_store_readonly.py, root's permission override is dropped with setpriv and the folder is given to
nobody (65534)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_env import child_env
from store_samples import put_one_profile

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="needs root and setpriv to be a user that cannot write"),
    pytest.mark.timeout(240),
]
NOBODY = 65534
DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
TUNE = ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "2", "--tokens", "128"]


def moetune(*args: str, home: Path) -> subprocess.CompletedProcess:
    """The CLI without root's override of file permissions."""
    return subprocess.run([*DROP, sys.executable, "-c", "from moetune.tuner.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=120,
                          env=child_env(MOETUNE_HOME=str(home), COLUMNS="300"))


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    return " ".join(r.stderr.split())


@pytest.fixture
def ro_dir(tmp_path: Path) -> Path:
    """A folder of nobody's this user (root without its override) cannot write."""
    tmp_path.chmod(0o755)
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chown(ro, NOBODY, NOBODY)
    ro.chmod(0o555)
    return ro


def test_db_upgrade_in_a_folder_that_cannot_be_written(tmp_path: Path, ro_dir: Path) -> None:
    r = moetune("db", "upgrade", "--db", str(ro_dir / "p.db"), home=tmp_path / "home")
    assert r.returncode == 1, r.stderr
    assert f"cannot write {ro_dir}: permission denied" in _one_line(r), r.stderr  # not "unable to open database file"
    assert "unable to open" not in r.stderr


def test_tune_storage_in_a_folder_that_cannot_be_written_exits_1(tmp_path: Path, ro_dir: Path) -> None:
    db = tmp_path / "m.db"
    r = moetune(*TUNE, "--db", str(db), "--storage", f"sqlite:///{ro_dir / 'new.db'}", home=tmp_path / "home")
    assert r.returncode == 1, r.stderr
    assert f"cannot write {ro_dir}: permission denied" in _one_line(r), r.stderr
    assert not db.exists()  # refused before the profile database was made


def test_tune_storage_file_whose_journal_cannot_be_made_exits_1(tmp_path: Path, ro_dir: Path) -> None:
    """A file this user may write, in a folder where SQLite cannot make its rollback journal."""
    ro_dir.chmod(0o755)
    users = ro_dir / "users.db"
    st = optuna.storages.RDBStorage(f"sqlite:///{users}")
    optuna.create_study(study_name="mine", storage=st)
    st.engine.dispose()
    users.chmod(0o666)
    ro_dir.chmod(0o555)
    r = moetune(*TUNE, "--db", str(tmp_path / "m.db"), "--storage", f"sqlite:///{users}", home=tmp_path / "home")
    assert r.returncode == 1, r.stderr
    assert f"cannot write {ro_dir}: permission denied" in _one_line(r), r.stderr  # not an Optuna commit error


def test_a_read_only_database_file_is_named(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    db = tmp_path / "p.db"
    put_one_profile(db)
    db.chmod(0o444)
    r = moetune("profiles", "delete", "1", "-y", "--db", str(db), home=tmp_path / "home")
    assert r.returncode == 1, r.stderr
    assert f"{db} is read-only for this user" in _one_line(r), r.stderr  # not "attempt to write a readonly database"
    r = moetune(*TUNE, "--db", str(db), home=tmp_path / "home")
    assert r.returncode == 1, r.stderr
    line = _one_line(r)
    assert f"{db} is read-only for this user" in line and "fix the database" not in line, r.stderr
    r = moetune("serve", "--db", str(db), "--socket", f"ipc://{tmp_path}/run/d.sock", home=tmp_path / "home")
    assert r.returncode == 1 and f"{db} is read-only for this user" in _one_line(r), r.stderr
    db.chmod(0o644)
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM profiles").fetchone()[0] == 1  # nothing was changed
    con.close()


def test_a_read_only_studies_file_exits_1(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    studies = tmp_path / "s.db"
    st = optuna.storages.RDBStorage(f"sqlite:///{studies}")
    st.engine.dispose()
    studies.chmod(0o444)
    r = moetune(*TUNE, "--db", str(tmp_path / "m.db"), "--storage", f"sqlite:///{studies}", home=tmp_path / "home")
    assert r.returncode == 1, r.stderr
    assert f"{studies} is read-only for this user" in _one_line(r), r.stderr


def test_db_upgrade_in_a_folder_that_cannot_be_written_exits_1(tmp_path: Path, ro_dir: Path) -> None:
    r = moetune("db", "upgrade", "--db", str(ro_dir / "p.db"), home=tmp_path / "home")
    assert r.returncode == 1, r.stderr
