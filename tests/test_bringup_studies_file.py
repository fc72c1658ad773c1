"""`moetune profile` checks its studies file before any stage runs, as `moetune tune` does.

The bring-up opened the studies file (`NAME-studies.db` beside the database) only when the tune stage began: a file
there that is not a database, a folder, or a file of a newer Optuna's schema failed after discovery, the
microbenchmarks and the calibration (minutes on a GPU node), with a traceback or Optuna's own message followed by
"finished stages are kept; run the same command again to continue", which only failed the same way again. The message offers no --storage: that is `tune`'s option, not `profile`'s.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bringup_fakes import fake_bringup_run, profile_cli


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    return fake_bringup_run(monkeypatch)


_profile = profile_cli


def _newer_optuna_file(path: Path) -> None:
    """A studies file whose Optuna schema revision this Optuna does not know (written by a newer one)."""
    import optuna

    optuna.storages.RDBStorage(f"sqlite:///{path}").engine.dispose()
    con = sqlite3.connect(path)
    con.execute("UPDATE alembic_version SET version_num = 'v99.0.0.a'")
    con.commit()
    con.close()


@pytest.mark.parametrize("kind", ["not a database", "folder", "newer optuna"])
def test_a_bad_studies_file_is_refused_before_any_stage(tmp_path: Path, fake_run: list[Any], kind: str) -> None:
    db = tmp_path / "m.db"
    studies = tmp_path / "m-studies.db"
    if kind == "not a database":
        studies.write_text("not sqlite\n")
    elif kind == "folder":
        studies.mkdir()
    else:
        _newer_optuna_file(studies)
    r = _profile(db, tmp_path)
    said = " ".join(r.output.split())
    assert r.exit_code in (1, 2), said
    assert "studies file" in said and str(studies) in said, said
    assert "--storage" not in said, said  # `tune`'s option: `profile` has none
    assert "Traceback" not in said and (r.exception is None or isinstance(r.exception, SystemExit)), said
    assert fake_run == []  # refused up front: no stage ran
    if kind == "not a database":  # found without opening it for Optuna: before the profile database is made
        assert not db.exists()


def test_a_good_studies_file_runs(tmp_path: Path, fake_run: list[Any]) -> None:
    r = _profile(tmp_path / "m.db", tmp_path)
    assert r.exit_code == 0, r.output
    assert len(fake_run) == 1


def _disk_full() -> sqlite3.OperationalError:
    return sqlite3.OperationalError("database or disk is full")


def _storage_internal() -> None:
    """Optuna's wrapping of a commit that failed on a full disk."""
    import optuna

    try:
        raise _disk_full()
    except sqlite3.OperationalError as e:
        raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from e


def _should_not_reach() -> None:
    """What Optuna's `_run_trial` raises when the trial's end could not be stored: the full disk only in its context."""
    try:
        _storage_internal()
    except Exception:
        raise AssertionError("Should not reach.")  # as Optuna raises it: the failure only in its context


@pytest.mark.parametrize("fail", [_storage_internal, _should_not_reach])
def test_a_full_disk_under_the_studies_file_while_tuning_says_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         fake_run: list[Any], fail: Any) -> None:
    """The studies file's disk filled up during the tune stage: a traceback (StorageInternalError, or Optuna's
    AssertionError "Should not reach."), exit 1. Now exit 1 naming the folder, free space and run it again, as `tune`
    says it; the finished stages are kept."""
    from moetune.tuner.bringup import flow

    def run(self: Any) -> dict:
        fail()
        return {}

    monkeypatch.setattr(flow.Bringup, "run", run)
    r = _profile(tmp_path / "m.db", tmp_path)
    said = " ".join(r.output.split())
    assert r.exit_code == 1, said
    assert "Traceback" not in said and (r.exception is None or isinstance(r.exception, SystemExit)), said
    assert f"the studies file {tmp_path / 'm-studies.db'}: the disk holding {tmp_path} is full" in said, said
    assert "free space there" in said and "--storage" not in said, said


def test_another_optuna_error_while_tuning_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       fake_run: list[Any]) -> None:
    import optuna

    from moetune.tuner.bringup import flow

    def run(self: Any) -> dict:
        raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.")

    monkeypatch.setattr(flow.Bringup, "run", run)
    r = _profile(tmp_path / "m.db", tmp_path)
    said = " ".join(r.output.split())
    assert r.exit_code in (1, 2), said
    assert "Traceback" not in said and (r.exception is None or isinstance(r.exception, SystemExit)), said
    assert "StorageInternalError" in said and "finished stages and trials are kept" in said, said


def test_a_profile_database_at_the_studies_file_name_says_what_profile_can_do(tmp_path: Path,
                                                                              fake_run: list[Any]) -> None:
    """A profile database named m-studies.db beside m.db: refused (exit 2), but its message told `profile` users to
    "pass --storage", an option `profile` does not have. It names what they can do: another --db, or move it."""
    from moetune.tuner.store.store import Store

    studies = tmp_path / "m-studies.db"
    Store(studies).close()
    r = _profile(tmp_path / "m.db", tmp_path)
    said = " ".join(r.output.split())
    assert r.exit_code == 2, said
    assert "is a moetune profile database, not a studies file" in said, said
    assert "--storage" not in said and "--db" in said, said
    assert fake_run == []


def test_a_full_disk_found_by_the_up_front_check_does_not_promise_a_resumed_study(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_run: list[Any]) -> None:
    """The up-front check of the studies file found the disk full: the message said "the study resumes", though
    no study exists yet (the wording is shared with the failures while tuning)."""
    from moetune.tuner.search import storage

    def full(*_a: Any, **_k: Any) -> None:
        raise _disk_full()

    monkeypatch.setattr(storage, "make_storage", full)
    r = _profile(tmp_path / "m.db", tmp_path)
    said = " ".join(r.output.split())
    assert r.exit_code == 1, said
    assert f"the disk holding {tmp_path} is full" in said and "free space there" in said, said
    assert "the study resumes" not in said, said
    assert fake_run == []
