"""`moetune report` on a database the user may read but not write (a shared /var/lib/moetune owned by the daemon's
user): its default folder, report/ beside the database, cannot be made there, so the report goes to
./moetune-report/ with a note saying why; when that cannot be written either, an error names both and --out.

Root's permission override is dropped with setpriv, and the database's folder is given to nobody (65534), as in
tests/test_store_readonly.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to read as a non-writer"
)
NOBODY = 65534
DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
CAPTURE = Path(__file__).parent / "captures" / "h200x1"


def shared_db(tmp_path: Path, *, give_away: bool = True) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    db = shared / "moetune.db"
    with Store(db) as s:
        key = ProfileKey(fingerprint="fp-ro", software="sw", transport_family="nvlink", ep_size=2, nodes=1,
                         hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=16)
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5,
                                    backend="model:t"))
    if give_away:
        shared.chmod(0o755)
        for p in (shared, *shared.iterdir()):
            os.chown(p, NOBODY, NOBODY)
    return db


def report(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`moetune report` run from `cwd`, without root's override of file permissions, as on the node the capture
    describes (live discovery answers its facts): its default folder is report/, not another node's
    report-<fingerprint>/."""
    on_node = ("from pathlib import Path; from moetune.tuner.fabric import discovery as d; "
               f"f = d.discover(Path({str(CAPTURE)!r})); d.live_facts = lambda timeout_s=1.5: f; ")
    cmd = [*DROP, sys.executable, "-c", on_node + "from moetune.tuner.cli import main; main()", "report",
           "--capture", str(CAPTURE), *args]
    env = {**os.environ, "MOETUNE_HOME": str(cwd / "home"), "MOETUNE_CONFIG": "", "COLUMNS": "200"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def test_report_on_a_read_only_database_goes_to_the_current_directory(tmp_path: Path) -> None:
    db = shared_db(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    r = report(work, "--db", str(db))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert (work / "moetune-report" / "report.md").is_file()
    assert f"report: {work / 'moetune-report' / 'report.md'}" in r.stdout
    assert f"{db.parent / 'report'}: cannot create it, {db.parent} is not writable" in r.stderr
    assert f"writing the report to {work / 'moetune-report'} instead" in r.stderr
    assert sorted(p.name for p in db.parent.iterdir()) == ["moetune.db"]


def test_report_says_to_pass_out_when_no_default_folder_can_be_written(tmp_path: Path) -> None:
    db = shared_db(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o555)
    try:
        r = report(work, "--db", str(db))
    finally:
        work.chmod(0o755)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert f"cannot write the report beside the database ({db.parent / 'report'}: " in r.stderr
    assert f"nor to {work / 'moetune-report'} (cannot create it, {work} is not writable): pass --out DIR" in r.stderr
    assert not (work / "moetune-report").exists()


def test_report_still_goes_beside_a_writable_database(tmp_path: Path) -> None:
    """Guard: the documented default is unchanged when the database's folder can be written."""
    db = shared_db(tmp_path, give_away=False)
    work = tmp_path / "work"
    work.mkdir()
    r = report(work, "--db", str(db))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (db.parent / "report" / "report.md").is_file() and not (work / "moetune-report").exists()
    assert "note:" not in r.stderr


def test_out_to_a_folder_the_user_cannot_write_is_refused_naming_out(tmp_path: Path) -> None:
    db = shared_db(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    r = report(work, "--db", str(db), "--out", str(db.parent))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--out {db.parent}: not writable" in r.stderr and "Traceback" not in r.stderr
    assert not (work / "moetune-report").exists()
