"""The performance environment in the store (migration 0006, profiles.perf_env), its export, its checks, and
`moetune profiles show`: a measured profile keeps the NCCL/NVSHMEM/FI environment it was measured in; a row from
before 0006 says unknown, never matching."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.runtime.profiles.db_lookup import query_db_profiles
from moetune.runtime.profiles.perf_env import perf_env_digest
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, head_revision
from moetune.tuner.store.validate import FieldError

ENV = {"NCCL_ALGO": "Ring", "NCCL_P2P_DISABLE": "1"}
SHAPE = dict(ep_size=2, nodes=1, hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16")


def key(bucket: int = 128) -> ProfileKey:
    return ProfileKey(fingerprint="fp", software="sw", transport_family="nvlink", token_bucket=bucket, **SHAPE)


def measured(latency: float = 100.0, perf_env: dict[str, str] | None = None, num_sms: int = 24,
             bucket: int = 128) -> ProfileRecord:
    return ProfileRecord(key=key(bucket), knobs=default_knobs("nvlink").replace(num_sms=num_sms), latency_us=latency,
                         spread_us=1.0, backend="local:nccl", provenance="measured",
                         perf_env=msgspec.UNSET if perf_env is None else perf_env)


def columns(path: Path) -> list[str]:
    con = sqlite3.connect(path)
    try:
        return [r[1] for r in con.execute("PRAGMA table_info(profiles)")]
    finally:
        con.close()


def database_at_0005(path: Path) -> None:
    """A database an older moetune wrote (schema 0005): profiles without a perf_env column."""
    with Store(path, upgrade=False) as s:
        s.upgrade("0005")
    con = sqlite3.connect(path)
    con.execute("INSERT INTO fingerprints(hash, facts, first_seen, last_seen) VALUES ('fp', '{}', 't', 't')")
    knobs = json.dumps(default_knobs("nvlink").to_dict())
    for bucket, status, backend, prov in ((128, "current", "local:nccl", "measured"),
                                          (128, "superseded", "local:nccl", "measured"),
                                          (256, "current", "model:nvlink-h200x2", "preset")):
        con.execute(
            "INSERT INTO profiles(fingerprint, software, transport_family, ep_size, nodes, hidden, intermediate,"
            " experts, topk, dtype, token_bucket, knobs, latency_us, spread_us, backend, status, software_versions,"
            " profile_hash, created, updated, provenance, measured_on, routing) VALUES ('fp', 'sw', 'nvlink', 2, 1,"
            " 7168, 2048, 256, 8, 'bfloat16', ?, ?, 100.0, 1.0, ?, ?, '{}', 'h', '2026-01-01T00:00:00+00:00',"
            " '2026-01-01T00:00:00+00:00', ?, 'fp', 'uniform')",
            (bucket, knobs, backend, status, prov),
        )
    con.commit()
    con.close()


def test_0006_upgrade_of_an_existing_database_says_unknown_and_downgrade_keeps_the_environments(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    database_at_0005(path)
    assert "perf_env" not in columns(path)
    # the runtime's read-only fallback reads a database an older daemon has not migrated yet
    old = query_db_profiles(path, **SHAPE)
    assert {r.key.token_bucket for r in old} == {128, 256} and all(r.tuned_perf_env is None for r in old)
    with Store(path) as s:  # upgrades on first use
        assert s.current_revision() == head_revision() == "0011"
        assert s.check()["ok"]
        assert "perf_env" in columns(path)
        assert len(s.list_profiles()) == 3 and all(r.tuned_perf_env is None for _i, r in s.list_profiles())
        F.assert_one_current_profile_per_key(path)  # the unique index on current keys survived the table copy
        # a re-tune records its environment: the same knobs measured again replace the unknown one
        assert s.put_profile(msgspec.structs.replace(measured(90.0, ENV), knobs=default_knobs("nvlink")))[0]
        assert s.get_current(key()).tuned_perf_env == ENV
        recorded = {i: r.tuned_perf_env for i, r in s.list_profiles() if r.tuned_perf_env is not None}
        n = s.count_profiles()
        s.downgrade("0005")
        assert s.current_revision() == "0005" and "perf_env" not in columns(path)
        assert s.count_profiles() == n  # every profile kept
        ev = [e for e in s.list_events() if e.kind == "perf_env_dropped"]
        assert len(ev) == 1 and {int(i): v["perf_env"] for i, v in ev[0].details["profiles"].items()} == recorded
        s.upgrade()
        assert s.check()["ok"] and s.count_profiles() == n
        # given back from the event to the rows that recorded one; the others stay unknown, never guessed
        assert {i: r.tuned_perf_env for i, r in s.list_profiles() if r.tuned_perf_env is not None} == recorded
        assert [e.kind for e in s.list_events() if e.kind.startswith("perf_env_")] == ["perf_env_restored"]
    con = sqlite3.connect(path)
    try:  # SQL NULL, not the JSON text 'null': plain sqlite3 readers see "not recorded"
        assert sum(r[0] is None for r in con.execute("SELECT perf_env FROM profiles")) == n - len(recorded)
    finally:
        con.close()


def test_round_trip_through_the_store_the_read_only_fallback_and_an_export(tmp_path: Path) -> None:
    with Store(tmp_path / "a.db") as s:
        s.put_profile(measured(100.0, ENV))
        s.put_profile(measured(50.0, {}, bucket=1024))  # recorded, with no performance variable set
        s.put_profile(measured(70.0, None, bucket=4096))  # not recorded
        got = {r.key.token_bucket: r.tuned_perf_env for _i, r in s.list_profiles()}
        assert got == {128: ENV, 1024: {}, 4096: None}
        assert s.find_profile(fingerprint="fp", software="sw", tokens=100, **SHAPE).tuned_perf_env == ENV
        data = s.dump_profiles()
    ro = {r.key.token_bucket: r.tuned_perf_env for r in query_db_profiles(tmp_path / "a.db", **SHAPE)}
    assert ro == got
    exported = json.loads(data)["profiles"]
    assert [p.get("perf_env", "absent") for p in exported] == [ENV, {}, "absent"]
    with Store(tmp_path / "b.db") as dst:
        assert dst.import_bytes(data).inserted == 3
        assert {r.key.token_bucket: r.tuned_perf_env for _i, r in dst.list_profiles()} == got


def test_the_store_refuses_an_environment_no_measurement_would_record(tmp_path: Path) -> None:
    with Store(tmp_path / "c.db") as s:
        for bad in ({"LD_PRELOAD": "/x.so"}, {"NCCL_DEBUG": "INFO"}, {"NVSHMEM_REMOTE_TRANSPORT": "ibrc"},
                    {"NCCL_ALGO": ""}):
            with pytest.raises(FieldError, match="perf_env"):
                s.put_profile(measured(perf_env=bad))
        # a prediction ran in no process's environment
        preset = ProfileRecord(key=key(), knobs=default_knobs("nvlink"), latency_us=1.0, spread_us=0.0,
                               backend="model:nvlink-h200x2", provenance="preset", perf_env={"NCCL_ALGO": "Ring"})
        with pytest.raises(FieldError, match="only a measurement"):
            s.put_profile(preset)
        assert s.list_profiles() == []
    # an import file with a forged environment is refused as a whole
    rec = msgspec.to_builtins(measured(perf_env=ENV))
    rec["perf_env"] = {"LD_PRELOAD": "/x.so"}
    doc = {"format": "moetune-profiles", "version": 1, "profiles": [rec]}
    with Store(tmp_path / "d.db") as s:
        with pytest.raises(Exception, match="perf_env"):
            s.import_bytes(json.dumps(doc).encode())
        assert s.list_profiles() == []


def test_a_re_measurement_in_another_environment_is_written_with_its_environment(tmp_path: Path) -> None:
    with Store(tmp_path / "e.db") as s:
        assert s.put_profile(measured(100.0, ENV))[0]
        # the same knobs with the very same numbers, but measured in another environment: not "unchanged"
        written, why = s.put_profile(measured(100.0, {"NCCL_ALGO": "Tree"}))
        assert written and "re-measured" in why, why
        assert s.get_current(key()).tuned_perf_env == {"NCCL_ALGO": "Tree"}
        ev = next(e for e in s.list_events() if e.kind == "remeasured")
        assert ev.details["from"]["perf_env"] == ENV and ev.details["to"]["perf_env"] == {"NCCL_ALGO": "Tree"}
        written, why = s.put_profile(measured(100.0, {"NCCL_ALGO": "Tree"}))
        assert not written and "same numbers" in why


def test_profiles_show_prints_the_environment_or_unknown(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with Store(db) as s:
        s.put_profile(measured(100.0, ENV))
        s.put_profile(measured(70.0, None, bucket=4096))
        ids = {r.key.token_bucket: i for i, r in s.list_profiles()}
    run = CliRunner().invoke
    r = run(app, ["profiles", "show", str(ids[128]), "--db", str(db)], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "perf_env.NCCL_ALGO" in r.output and "Ring" in r.output and "perf_env.NCCL_P2P_DISABLE" in r.output
    assert perf_env_digest(ENV) in r.output
    r = run(app, ["profiles", "show", str(ids[128]), "--json", "--db", str(db)])
    got = json.loads(r.stdout)
    assert got["perf_env"] == ENV and got["perf_env_digest"] == perf_env_digest(ENV)
    r = run(app, ["profiles", "show", str(ids[4096]), "--db", str(db)], terminal_width=200)
    assert r.exit_code == 0 and "unknown (not recorded" in r.output
    r = run(app, ["profiles", "show", str(ids[4096]), "--json", "--db", str(db)])
    got = json.loads(r.stdout)
    assert got["perf_env"] is None and got["perf_env_digest"] is None  # unknown: null, never {}
    r = run(app, ["profiles", "list", "--json", "--db", str(db)])
    assert [p["perf_env"] for p in json.loads(r.stdout)] == [ENV, None]
