"""The schema the migrations build is the models' schema, to the constraint: every column (type, nullability, default),
primary and foreign key (with its ON DELETE), index (with a partial index's WHERE), unique and CHECK constraint, by
name. `moetune db check` compares with Alembic's `compare_metadata`, which does not look at CHECK constraints, nor at
their names: this test does, by reading both schemas back with SQLAlchemy's inspector."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, inspect

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.store.models import Base
from moetune.tuner.store.store import Store


def schema_of(path: Path) -> dict[str, dict[str, Any]]:
    """moetune's tables in the database at `path`, as comparable values."""
    engine = create_engine(f"sqlite:///{path}")
    try:
        ins = inspect(engine)
        out: dict[str, dict[str, Any]] = {}
        for t in sorted(Base.metadata.tables):
            pk = ins.get_pk_constraint(t)
            out[t] = {
                "columns": [(c["name"], str(c["type"]), c["nullable"], c["default"]) for c in ins.get_columns(t)],
                "primary_key": (pk["name"], tuple(pk["constrained_columns"])),
                "foreign_keys": sorted((f["name"], tuple(f["constrained_columns"]), f["referred_table"],
                                        tuple(f["referred_columns"]), tuple(sorted(f["options"].items())))
                                       for f in ins.get_foreign_keys(t)),
                # a partial index's WHERE is a TextClause: compared as its text
                "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"]),
                                   str(i.get("dialect_options", {}).get("sqlite_where", ""))) for i in ins.get_indexes(t)),
                "unique": sorted((u["name"], tuple(u["column_names"])) for u in ins.get_unique_constraints(t)),
                "checks": sorted((c["name"], c["sqltext"]) for c in ins.get_check_constraints(t)),
            }
        return out
    finally:
        engine.dispose()


def models_schema(path: Path) -> dict[str, dict[str, Any]]:
    engine = create_engine(f"sqlite:///{path}")
    try:
        Base.metadata.create_all(engine)
    finally:
        engine.dispose()
    return schema_of(path)


def check_names(path: Path) -> set[str]:
    con = sqlite3.connect(path)
    try:
        sql = con.execute("SELECT sql FROM sqlite_master WHERE name = 'profiles'").fetchone()[0]
    finally:
        con.close()
    return {part.split()[0] for part in sql.split("CONSTRAINT ")[1:] if " CHECK " in part}


def test_an_empty_database_upgraded_to_head_has_exactly_the_models_schema(tmp_path: Path) -> None:
    migrated = tmp_path / "migrated.db"
    Store(migrated).close()
    want = models_schema(tmp_path / "models.db")
    got = schema_of(migrated)
    assert got == want, {t: {k: (got[t][k], want[t][k]) for k in got[t] if got[t][k] != want[t][k]}
                         for t in got if got[t] != want[t]}


# -- migration 0011: the names 0001 gave the profiles CHECK constraints ------------------------------------------------
AT_0010 = {"ck_profiles_ck_profiles_status", "ck_profiles_ck_profiles_latency", "ck_profiles_provenance"}
AT_HEAD = {"ck_profiles_status", "ck_profiles_latency", "ck_profiles_provenance"}
OWN = ("fingerprints", "tuning_runs", "measurements", "profiles", "events")


def populate(s: Store) -> None:
    """A row or more in each of moetune's tables, written by today's store."""
    s.upsert_fingerprint("fp", {"gpus": 2}, origin="local")
    run = s.start_run(study_name="st", storage=s.url, backend="model")
    s.add_measurement(fingerprint="fp", kind="lat", transport="nvlink", size_bytes=64, value=1.5, spread=0.1,
                      unit="us", run_id=run)
    for b in (16, 128):
        key = ProfileKey(fingerprint="fp", software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=4096,
                         intermediate=1024, experts=64, topk=6, dtype="bfloat16", token_bucket=b)
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=10.0 * b, spread_us=1.0,
                                    backend="local:nccl", provenance="measured", measured_on="fp", routing="uniform"))
    s.add_event(kind="fabric_changed", reason="test")


def count(path: Path, table: str) -> int:
    con = sqlite3.connect(path)
    try:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        con.close()


def test_0011_renames_the_check_constraints_of_a_database_at_0010_keeping_every_row(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with Store(db) as s:
        populate(s)
        s.downgrade("0010")
        assert check_names(db) == AT_0010  # as every database upgraded through 0001 has them
        con = sqlite3.connect(db)
        before = {t: con.execute(f"SELECT * FROM {t} ORDER BY id").fetchall() for t in OWN}
        con.close()
        s.upgrade()
        assert check_names(db) == AT_HEAD
        assert s.check()["ok"]
        con = sqlite3.connect(db)
        try:
            assert {t: con.execute(f"SELECT * FROM {t} ORDER BY id").fetchall() for t in OWN} == before
            # the same conditions, under the new names
            for bad, name in (("status = 'gone'", "ck_profiles_status"), ("latency_us = -1", "ck_profiles_latency")):
                try:
                    con.execute(f"UPDATE profiles SET {bad}")
                    raise AssertionError(f"{bad} was accepted")
                except sqlite3.IntegrityError as e:
                    assert name in str(e) and "ck_profiles_ck_" not in str(e), str(e)
        finally:
            con.close()
        s.downgrade("0010")  # 0010's schema as 0010 made it, rows and all
        assert check_names(db) == AT_0010
        assert {t: count(db, t) for t in OWN} == {t: len(rows) for t, rows in before.items()}
        s.upgrade()
        assert schema_of(db) == models_schema(tmp_path / "models.db")
