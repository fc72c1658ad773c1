"""Profiles whose key the store now refuses (experts not divisible by ep_size, a91a064's rule), met in two places:
rows stored before the rule (an import or a hand edit) are skipped with ONE warning per process and database file,
naming the rows and what to do (`db check` lists them, `profiles delete` removes one; nothing is deleted unasked);
an old export holding such a record is refused naming every invalid record, and `--skip-invalid` imports the rest
and says what it left out. A refused import leaves the database byte-identical."""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime import _once
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import UNREADABLE_WARNING, ProfileImportError, Store

pytestmark = pytest.mark.timeout(120)


def key(bucket: int = 16, fp: str = "fp-q") -> ProfileKey:
    return ProfileKey(fingerprint=fp, software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                      intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=bucket)


def rec(bucket: int = 16, lat: float = 3.0) -> ProfileRecord:
    return ProfileRecord(key=key(bucket), knobs=default_knobs("nvlink"), latency_us=lat, spread_us=0.5,
                         backend="model:t")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(*args: str, home: Path):
    env = {"MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"), "MOETUNE_CONFIG": "",
           "COLUMNS": "200"}
    return CliRunner().invoke(app, list(args), env=env)


@pytest.fixture(autouse=True)
def _fresh_once():
    _once.reset(UNREADABLE_WARNING)
    yield
    _once.reset(UNREADABLE_WARNING)


def db_with_indivisible_rows(path: Path, bad_ids: tuple[int, ...] = (2,)) -> Path:
    """Three profiles (ids 1-3, buckets 16/64/128); the rows `bad_ids` get 127 experts, as a pre-rule import stored."""
    with Store(path) as s:
        s.upsert_fingerprint("fp-q", {}, origin="local")  # no facts: an import checks facts (`facts_problem`)
        for b in (16, 64, 128):
            s.put_profile(rec(b))
    con = sqlite3.connect(path)
    con.executemany("UPDATE profiles SET experts = 127 WHERE id = ?", [(i,) for i in bad_ids])
    con.commit()
    con.close()
    return path


def store_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moetune.store" and r.levelno == logging.WARNING]


# -- 1: stored rows -------------------------------------------------------------------------------------------------
def test_rows_with_an_indivisible_key_warn_once_per_process_and_database(tmp_path, caplog):
    db = db_with_indivisible_rows(tmp_path / "a.db", bad_ids=(1, 3))
    before = sha(db)
    with caplog.at_level(logging.WARNING, logger="moetune.store"):
        with Store(db) as s:
            assert [i for i, _r in s.list_profiles()] == [2]
            assert [i for i, _r in s.list_profiles()] == [2]
            assert s.get_profile(1) is None and s.get_profile(3) is None
            assert s.get_current(key(128)) is None
            s.find_profile(fingerprint="fp-q", software="sw", ep_size=2, nodes=1, hidden=7168, intermediate=2048,
                           experts=127, topk=8, dtype="bfloat16", tokens=16)
        with Store(db, readonly=True) as s:  # another Store on the same file: the same database
            assert len(s.list_profiles()) == 1
    said = store_warnings(caplog)
    assert len(said) == 1, said
    msg = said[0]
    assert "2 unreadable profile row(s)" in msg and "profile 1:" in msg and "profile 3:" in msg, msg
    assert "127 experts do not divide evenly over an EP group of 2" in msg, msg
    assert "moetune db check" in msg and "moetune profiles delete" in msg and str(db) in msg, msg
    assert sha(db) == before  # nothing deleted or changed by reading

    other = db_with_indivisible_rows(tmp_path / "b.db")  # another database file warns on its own
    with caplog.at_level(logging.WARNING, logger="moetune.store"), Store(other) as s:
        s.list_profiles()
        s.list_profiles()
    assert len(store_warnings(caplog)) == 2


def test_the_first_warning_names_every_unreadable_row_not_just_the_read_that_met_one(tmp_path, caplog):
    db = db_with_indivisible_rows(tmp_path / "a.db", bad_ids=(1, 3))
    with caplog.at_level(logging.WARNING, logger="moetune.store"), Store(db) as s:
        assert s.get_profile(3) is None
    (msg,) = store_warnings(caplog)
    assert "profile 1:" in msg and "profile 3:" in msg, msg


def test_db_check_lists_the_unreadable_rows_and_profiles_delete_removes_one(tmp_path):
    h = tmp_path / "h"
    db = db_with_indivisible_rows(tmp_path / "a.db")
    r = run("db", "check", "--db", str(db), home=h)
    assert r.exit_code == 1, r.output
    assert "NOT OK" in r.output and "unreadable profile rows: 1" in r.output, r.output
    assert "profile 2: profile key: 127 experts do not divide evenly over an EP group of 2" in r.output, r.output
    # the removal each suggests names this database: a plain `profiles delete 2` deleted the default database's
    # (readable) profile 2 and left this one's unreadable row
    assert f"`moetune profiles delete ID --db {db}` removes one" in " ".join(r.output.split()), r.output
    r = run("db", "check", "--json", "--db", str(db), home=h)
    info = json.loads(r.stdout)
    assert r.exit_code == 1 and not info["ok"]
    assert [row["id"] for row in info["unreadable_profiles"]] == [2]

    r = run("profiles", "show", "2", "--db", str(db), home=h)
    assert r.exit_code == 2 and "cannot read it" in r.output and "127 experts" in r.output, r.output
    assert f"`moetune profiles delete 2 --db {db}` removes it" in " ".join(r.output.split()), r.output
    r = run("profiles", "delete", "2", "--yes", "--db", str(db), home=h)
    assert r.exit_code == 0 and "deleted profile 2" in r.output, r.output
    r = run("db", "check", "--json", "--db", str(db), home=h)
    assert r.exit_code == 0 and json.loads(r.stdout)["unreadable_profiles"] == [], r.output
    with Store(db) as s:
        assert [i for i, _r in s.list_profiles()] == [1, 3]


def test_db_check_of_a_clean_database_reports_no_unreadable_rows(tmp_path):
    with Store(tmp_path / "ok.db") as s:
        s.upsert_fingerprint("fp-q", {}, origin="local")
        s.put_profile(rec())
        info = s.check()
    assert info["ok"] and info["unreadable_profiles"] == []


# -- 2: import of an old export -------------------------------------------------------------------------------------
def export_with_bad_records(tmp_path: Path, bad: tuple[int, ...] = (0,)) -> Path:
    """An export of three profiles (buckets 16/64/128) whose records `bad` say 127 experts."""
    with Store(tmp_path / "src.db") as s:
        s.upsert_fingerprint("fp-q", {}, origin="local")  # no facts: an import checks facts (`facts_problem`)
        for b in (16, 64, 128):
            s.put_profile(rec(b))
        doc = json.loads(s.dump_profiles())
    for i in bad:
        doc["profiles"][i]["key"]["experts"] = 127
    f = tmp_path / "old.json"
    f.write_text(json.dumps(doc))
    return f


def target_db(tmp_path: Path) -> Path:
    db = tmp_path / "dst.db"
    with Store(db) as s:
        s.upsert_fingerprint("fp-z", {}, origin="local")
        s.put_profile(ProfileRecord(key=key(fp="fp-z"), knobs=default_knobs("nvlink"), latency_us=9.0,
                                    spread_us=0.5, backend="model:t"))
    return db


def test_an_import_with_invalid_records_is_refused_naming_each_and_changes_nothing(tmp_path):
    f = export_with_bad_records(tmp_path, bad=(0, 2))
    db = target_db(tmp_path)
    before = sha(db)
    with Store(db) as s, pytest.raises(ProfileImportError) as ei:
        s.import_profiles(f)
    msg = str(ei.value)
    assert "2 of 3 profile record(s) invalid, nothing imported" in msg, msg
    assert "profiles[0] (fp-q nvlink ep2x1 h7168/i2048/e127/k8 bfloat16 t16)" in msg, msg
    assert "profiles[2] (fp-q nvlink ep2x1 h7168/i2048/e127/k8 bfloat16 t128)" in msg, msg
    assert "profiles[1]" not in msg
    assert "127 experts do not divide evenly over an EP group of 2 - at `$.profiles[0].key`" in msg, msg
    assert "--skip-invalid" in msg and "import the other 1" in msg, msg
    assert sha(db) == before

    r = run("profiles", "import", str(f), "--db", str(db), home=tmp_path / "h")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "profiles[0] (" in r.output and "profiles[2] (" in r.output and "--skip-invalid" in r.output, r.output
    assert "database unchanged" in r.output
    assert sha(db) == before


def test_skip_invalid_imports_the_rest_and_reports_what_it_left_out(tmp_path):
    f = export_with_bad_records(tmp_path, bad=(0,))
    db = target_db(tmp_path)
    with Store(db) as s:
        res = s.import_profiles(f, skip_invalid=True)
        assert res.inserted == 2 and len(res.invalid) == 1, res
        assert res.invalid[0].startswith("profiles[0] (fp-q nvlink ep2x1 h7168/i2048/e127/k8"), res.invalid
        got = sorted(r.key.token_bucket for _i, r in s.list_profiles(fingerprint="fp-q"))
        assert got == [64, 128]
        assert len(s.list_profiles(fingerprint="fp-z")) == 1  # what was stored stays

    (tmp_path / "cli").mkdir()
    db2 = target_db(tmp_path / "cli")
    r = run("profiles", "import", str(f), "--skip-invalid", "--db", str(db2), home=tmp_path / "h")
    assert r.exit_code == 0, r.output
    assert "left out (invalid): profiles[0] (" in r.stderr and "127 experts" in r.stderr, r.stderr
    assert "imported 2 profile(s)" in r.stdout and "1 invalid left out" in r.stdout, r.stdout
    r = run("profiles", "import", str(f), "--skip-invalid", "--json", "--db", str(db2), home=tmp_path / "h")
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["skipped"] == 2 and len(out["invalid"]) == 1, r.output


def test_skip_invalid_still_refuses_a_problem_of_the_file_itself(tmp_path):
    f = export_with_bad_records(tmp_path, bad=(0,))
    doc = json.loads(f.read_text())
    twin = json.loads(json.dumps(doc["profiles"][1]))
    twin["latency_us"] = 1.0
    doc["profiles"].append(twin)  # two current records for one key: neither is invalid alone
    f.write_text(json.dumps(doc))
    db = target_db(tmp_path)
    before = sha(db)
    with Store(db) as s, pytest.raises(ProfileImportError, match="both current for the same key"):
        s.import_profiles(f, skip_invalid=True)
    assert sha(db) == before


def test_import_help_documents_skip_invalid(tmp_path):
    r = run("profiles", "import", "--help", home=tmp_path)
    assert r.exit_code == 0 and "--skip-invalid" in r.output, r.output
