"""Issue 19, store side: provenance stored and shown, modelled never displaces measured, import
validation, bad rows skipped, the README's Store example, the bucket distance limit."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sqlite3
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, nearest_bucket_within
from moetune.runtime.shapes import get_model
from moetune.tuner.cli import app
from moetune.tuner.store.store import ProfileImportError, Store, head_revision

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def key(fp: str = "fp", bucket: int = 128, family: str = "nvlink", software: str = "sw") -> ProfileKey:
    return ProfileKey(
        fingerprint=fp, software=software, transport_family=family, ep_size=2, nodes=1, hidden=7168,
        intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=bucket,
    )


def rec(lat: float, backend: str, spread: float = 1.0, provenance: str | None = None, **kw) -> ProfileRecord:
    extra = {} if provenance is None else {"provenance": provenance}
    return ProfileRecord(key=key(**kw), knobs=default_knobs(kw.get("family", "nvlink")), latency_us=lat,
                         spread_us=spread, backend=backend, **extra)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the record's provenance ----------------------------------------------------------------------
def test_record_without_provenance_is_never_measured():
    for backend, want in (("local:nccl", "node_model"), ("model:nvlink-h200x2", "preset"), ("model:node:fp", "node_model")):
        r = rec(10, backend)
        d = msgspec.to_builtins(r)
        del d["provenance"], d["measured_on"]  # an older peer's record
        old = msgspec.convert(d, ProfileRecord)
        assert old.provenance == want and not old.is_tuned_for("fp", "sw")
    assert rec(10, "model:nvlink-h200x2").measured_on == "preset:nvlink-h200x2"
    m = rec(10, "local:nccl", provenance="measured")
    assert m.measured_on == "fp" and m.is_tuned_for("fp", "sw")
    assert not m.is_tuned_for("fp", "other-sw") and not m.is_tuned_for("other-fp", "sw")
    with pytest.raises(msgspec.ValidationError, match="provenance"):
        msgspec.convert({**msgspec.to_builtins(m), "provenance": "guessed"}, ProfileRecord)


def test_wire_result_carries_provenance():
    from moetune.runtime import wire

    m = rec(10, "local:nccl", provenance="measured")
    res = wire.ProfileResult.from_record(m, env={})
    back = msgspec.json.decode(wire.encoder.encode(res), type=wire.ProfileResult)
    assert back.provenance == "measured" and back.measured_on == "fp"
    d = msgspec.to_builtins(res)
    del d["provenance"], d["measured_on"]  # an older daemon
    assert msgspec.convert(d, wire.ProfileResult).provenance == "node_model"


# -- the replacement gate ---------------------------------------------------------------------------
def test_measured_replaces_modelled_and_modelled_never_displaces_measured():
    with Store(":memory:") as s:
        assert s.put_profile(rec(27.0, "model:nvlink-h200x2", spread=0.1))[0]
        ok, why = s.put_profile(rec(60.0, "local:nccl", provenance="measured"))
        assert ok, why  # slower but measured: measured wins
        cur = s.get_current(key())
        assert cur.provenance == "measured" and cur.latency_us == 60.0
        ok, why = s.put_profile(rec(5.0, "model:nvlink-h200x2", spread=0.1))
        assert not ok and "never displaces" in why
        assert s.get_current(key()).latency_us == 60.0
        # The modelled one is kept as labelled history, still queryable.
        hist = s.list_profiles(status="superseded", provenance="preset")
        assert [r.latency_us for _i, r in hist] == [27.0, 5.0]
        # Forcing does not let a modelled number displace a measured one either.
        assert not s.put_profile(rec(1.0, "model:node:fp", provenance="node_model"), force_reason="x")[0]
        # Between two measured ones of different knobs the noise rule stays.
        other = default_knobs("nvlink").replace(num_sms=8)
        assert not s.put_profile(msgspec.structs.replace(rec(59.5, "local:nccl", provenance="measured"), knobs=other))[0]
        assert s.put_profile(msgspec.structs.replace(rec(50.0, "local:nccl", provenance="measured"), knobs=other))[0]
        # A calibrated node model beats a preset, not the other way round.
        s.put_profile(rec(9.0, "model:x", bucket=16))
        assert s.put_profile(rec(30.0, "model:node:fp", provenance="node_model", bucket=16))[0]
        assert not s.put_profile(rec(1.0, "model:x", bucket=16))[0]


def test_import_gate_modelled_never_displaces_measured(tmp_path):
    src, dst = Store(tmp_path / "src.db"), Store(tmp_path / "dst.db")
    src.put_profile(rec(5.0, "model:nvlink-h200x2", spread=0.1))
    dst.put_profile(rec(60.0, "local:nccl", provenance="measured"))
    res = dst.import_bytes(src.dump_profiles())
    assert res.kept_superseded == 1 and res.replaced == 0
    assert dst.get_current(key()).provenance == "measured"
    # ...and a measured import replaces a modelled current one.
    dst2 = Store(tmp_path / "dst2.db")
    dst2.put_profile(rec(5.0, "model:nvlink-h200x2", spread=0.1))
    src2 = Store(tmp_path / "src2.db")
    src2.put_profile(rec(60.0, "local:nccl", provenance="measured"))
    assert dst2.import_bytes(src2.dump_profiles()).replaced == 1
    assert dst2.get_current(key()).provenance == "measured"
    for s in (src, dst, dst2, src2):
        s.close()


def test_find_profile_prefers_measured_and_limits_bucket_distance():
    with Store(":memory:") as s:
        s.put_profile(rec(5.0, "model:x", family="collective"))
        s.put_profile(rec(60.0, "local:nccl", provenance="measured"))
        q = dict(fingerprint="fp", software="sw", ep_size=2, nodes=1, hidden=7168, intermediate=2048, experts=256,
                 topk=8, dtype="bfloat16")
        got = s.find_profile(**q, tokens=128)
        assert got.provenance == "measured" and got.key.transport_family == "nvlink"
        assert s.find_profile(**q, tokens=300).key.token_bucket == 128  # 256 is one rung away
        assert s.find_profile(**q, tokens=4096) is None  # five rungs away: the caller falls back
        s.delete_profile(2)
        assert s.find_profile(**q, tokens=128).provenance == "preset"
        assert s.find_profile(**q, tokens=128, measured_only=True) is None
        with pytest.raises(ValueError, match="bfloat16"):
            s.find_profile(**{**q, "dtype": "bf16"}, tokens=128)
    assert nearest_bucket_within(100, [128]) == 128 and nearest_bucket_within(100, [512]) is None
    assert nearest_bucket_within(5000, [4096, 16]) == 4096 and nearest_bucket_within(0, [16]) == 16


# -- migration 0003 ---------------------------------------------------------------------------------
def test_upgrade_from_0002_labels_existing_rows(tmp_path):
    path = tmp_path / "old.db"
    s = Store(path, upgrade=False)
    s.upgrade("0002")
    s.close()
    con = sqlite3.connect(path)
    con.execute("INSERT INTO fingerprints(hash, facts, first_seen, last_seen) VALUES ('fp', '{}', 'a', 'a')")
    knobs = json.dumps(default_knobs("nvlink").to_dict())
    rows = [("local:nccl", 64), ("model:nvlink-h200x2", 128), ("model:node:fp", 256), ("odd", 512), ("LOCAL:nccl", 1024)]
    for backend, bucket in rows:
        con.execute(
            "INSERT INTO profiles(fingerprint, software, transport_family, ep_size, nodes, hidden, intermediate,"
            " experts, topk, dtype, token_bucket, knobs, latency_us, spread_us, backend, status, software_versions,"
            " profile_hash, created, updated) VALUES ('fp', 'sw', 'nvlink', 2, 1, 8, 8, 4, 2, 'bfloat16', ?, ?, 1.0,"
            " 0.1, ?, 'current', '{}', 'h', '2026-01-01T00:00:00+00:00', '2026-01-01T00:00:00+00:00')",
            (bucket, knobs, backend),
        )
    con.commit()
    con.close()
    with pytest.raises(Exception, match=f"moetune db upgrade --db {re.escape(str(path))}"):
        Store(path, readonly=True)
    with Store(path) as s:
        assert s.current_revision() == head_revision() == "0011"
        assert s.check()["ok"]
        got = {r.backend: (r.provenance, r.measured_on) for _i, r in s.list_profiles()}
    assert got == {
        "local:nccl": ("measured", "fp"),
        "model:nvlink-h200x2": ("preset", "preset:nvlink-h200x2"),
        "model:node:fp": ("node_model", "fp"),
        "odd": ("node_model", ""),
        "LOCAL:nccl": ("node_model", ""),  # the prefixes are case-sensitive, as provenance_of_backend's
    }
    with Store(path) as s:  # and back down, every profile kept
        s.downgrade("0002")
        with s.engine.connect() as c:
            assert len(c.exec_driver_sql("SELECT id FROM profiles").fetchall()) == 5
        s.upgrade()


def test_downgrade_and_upgrade_never_make_a_modelled_profile_measured(tmp_path):
    """An unlabelled import of a `local:*` record is node_model; 0002 has no label and the 0003 backfill would
    call it measured, so the downgrade retires it (stale, with an event) instead of losing its label."""
    with Store(tmp_path / "r.db") as s:
        s.put_profile(rec(10.0, "local:nccl", bucket=64))  # no provenance given: node_model
        s.put_profile(rec(20.0, "local:nccl", provenance="measured", bucket=128))
        s.put_profile(rec(30.0, "model:nvlink-h200x2", bucket=256))
        s.downgrade("0002")
        s.upgrade()
        assert s.get_current(key(bucket=64)) is None
        assert [(r.key.token_bucket, r.provenance) for _i, r in s.list_profiles(status="current")] == [
            (128, "measured"), (256, "preset")]
        assert len(s.list_profiles(status="stale")) == 1
        ev = s.list_events()[0]
        assert ev.kind == "stale" and "provenance" in ev.reason and ev.details == {"profiles": 1}


# -- one bad row ------------------------------------------------------------------------------------
def test_one_corrupt_row_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "c.db"
    with Store(path) as s:
        for b in (16, 128, 1024):
            s.put_profile(rec(10.0, "local:nccl", provenance="measured", bucket=b))
    con = sqlite3.connect(path)
    con.execute("UPDATE profiles SET knobs = '{not json' WHERE id = 2")
    con.commit()
    con.close()
    with caplog.at_level(logging.WARNING, logger="moetune.store"), Store(path) as s:
        rows = s.list_profiles()
        assert [i for i, _r in rows] == [1, 3]
        assert s.get_profile(2) is None
        assert s.dump_profiles()  # export still works
    assert any("profile 2" in r.getMessage() for r in caplog.records)
    r = runner.invoke(app, ["profiles", "list", "--db", str(path)])
    assert r.exit_code == 0 and r.exception is None, r.output


# -- import validation ------------------------------------------------------------------------------
def _doc(tmp_path: Path) -> dict:
    with Store(tmp_path / "src.db") as s:
        s.upsert_fingerprint("fp", {"gpus": 2}, origin="local")
        s.put_profile(rec(10.0, "local:nccl", provenance="measured", bucket=16))
        s.put_profile(rec(12.0, "model:nvlink-h200x2", bucket=128))
        return json.loads(s.dump_profiles())


def _set(path: str, value):
    def mutate(d):
        obj = d
        parts = path.split(".")
        for p in parts[:-1]:
            obj = obj[int(p)] if p.isdigit() else obj[p]
        obj[parts[-1]] = value

    return mutate


HOSTILE = {
    "family_knob_mismatch": (_set("profiles.1.key.transport_family", "collective"), "profiles[1].knobs.transport"),
    "unknown_family": (_set("profiles.1.key.transport_family", "carrier-pigeon"), "profiles[1].key.transport_family"),
    "unknown_dtype": (_set("profiles.0.key.dtype", "bf16"), "profiles[0].key.dtype"),
    "not_a_bucket": (_set("profiles.0.key.token_bucket", 300), "profiles[0].key.token_bucket"),
    "topk_above_experts": (_set("profiles.0.key.topk", 512), "profiles[0].key.topk"),
    "latency_zero": (_set("profiles.0.latency_us", 0.0), "profiles[0].latency_us"),
    "latency_nan": (_set("profiles.0.latency_us", float("nan")), "profiles[0].latency_us"),
    "latency_inf": (_set("profiles.0.latency_us", float("inf")), "profiles[0].latency_us"),
    "spread_negative": (_set("profiles.0.spread_us", -1.0), "profiles[0].spread_us"),
    "garbage_date": (_set("profiles.1.updated", "yesterday-ish"), "profiles[1].updated"),
    "future_date": (_set("profiles.1.created", "2999-01-01T00:00:00+00:00"), "profiles[1].created"),
    "huge_int_key": (_set("profiles.0.key.hidden", 1 << 63), "profiles[0].key.hidden"),
    "huge_int_knob": (_set("profiles.0.knobs.num_sms", 1 << 70), "profiles[0].knobs"),
    "unknown_provenance": (_set("profiles.0.provenance", "trust-me"), "profiles[0].provenance"),
    "measured_elsewhere": (_set("profiles.0.measured_on", "other-fp"), "profiles[0].measured_on"),
    # A fingerprint seen "in the future" would sort first forever (the runtime's node identity takes the newest).
    "future_fingerprint_date": (_set("fingerprints.0.last_seen", "2999-01-01T00:00:00+00:00"), "fingerprints[0].last_seen"),
    # A preset's number relabelled as measured (on the key's fingerprint, so measured_on agrees).
    "preset_labelled_measured": (lambda d: (_set("profiles.1.provenance", "measured")(d),
                                            _set("profiles.1.measured_on", "fp")(d)), "profiles[1].provenance"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_import_is_rejected_and_database_byte_identical(tmp_path, name):
    mutate, where = HOSTILE[name]
    d = _doc(tmp_path)
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))  # json writes NaN/Infinity, which msgspec rejects as JSON too
    db = tmp_path / "dst.db"
    with Store(db) as s:
        s.put_profile(rec(3.0, "local:nccl", provenance="measured", fp="fp-z"))
    before = sha(db)
    with Store(db) as s, pytest.raises(ProfileImportError) as ei:
        s.import_profiles(f)
    msg = str(ei.value)
    if name not in ("latency_nan", "latency_inf"):
        assert where in msg, msg
    assert sha(db) == before
    r = runner.invoke(app, ["profiles", "import", str(f), "--db", str(db)])
    assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    assert "Traceback" not in r.output and "database unchanged" in r.output
    assert sha(db) == before


def test_out_of_range_numbers_are_clean_errors(tmp_path):
    d = _doc(tmp_path)
    doc = msgspec.json.encode(d).replace(b'"latency_us":10.0', b'"latency_us":1e999')
    with Store(":memory:") as s:
        with pytest.raises(ProfileImportError, match="not valid JSON"):
            s.import_bytes(doc)
        with pytest.raises(ValueError, match="latency_us"):
            s.put_profile(rec(float("nan"), "local:nccl"))
        with pytest.raises(ValueError, match="provenance"):  # the label alone never makes a number measured
            s.put_profile(rec(1.0, "model:nvlink-h200x2", provenance="measured"))
        with pytest.raises(ValueError, match=r"key\.hidden"):
            s.put_profile(ProfileRecord(key=ProfileKey(**{**key().to_dict(), "hidden": 1 << 64}),
                                        knobs=default_knobs("nvlink"), latency_us=1.0, spread_us=0.0, backend="x"))
        assert s.list_profiles() == []


# -- the CLI shows provenance -----------------------------------------------------------------------
def test_profiles_list_and_show_label_provenance(tmp_path):
    db = tmp_path / "p.db"
    with Store(db) as s:
        s.put_profile(rec(60.0, "local:nccl", provenance="measured"))
        s.put_profile(rec(27.0, "model:nvlink-h200x2", bucket=16))
        s.put_profile(rec(30.0, "model:node:fp", provenance="node_model", bucket=64))
    r = runner.invoke(app, ["profiles", "list", "--db", str(db)], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "PRESET" in r.output and "MODELLED" in r.output and "measured" in r.output
    r = runner.invoke(app, ["profiles", "list", "--json", "--db", str(db)])
    assert [p["provenance"] for p in json.loads(r.stdout)] == ["measured", "preset", "node_model"]
    r = runner.invoke(app, ["profiles", "list", "--json", "--provenance", "measured", "--db", str(db)])
    assert [p["id"] for p in json.loads(r.stdout)] == [1]
    r = runner.invoke(app, ["profiles", "list", "--provenance", "guess", "--db", str(db)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = runner.invoke(app, ["profiles", "show", "2", "--db", str(db)], env={"COLUMNS": "200"})
    assert "PRESET" in r.output and "preset:nvlink-h200x2" in r.output
    assert "PRESET (MODELLED)" in r.output  # a preset's numbers are predictions: said as such, not only "PRESET"
    r = runner.invoke(app, ["profiles", "show", "2", "--json", "--db", str(db)])
    assert json.loads(r.stdout)["provenance"] == "preset"


def test_query_shows_provenance_from_the_database(tmp_path):
    # a preset's profile and allow_modelled: the one case where the read-only database serves with this node's
    # identity unknown (a profile of fingerprint "fp" was passed over, the policy default shown, the label unchecked)
    db = tmp_path / "q.db"
    m = get_model("qwen3-30b")
    k = ProfileKey(fingerprint="preset:nvlink-h200x2", software="modelled", transport_family="collective", ep_size=2,
                   nodes=1, hidden=m.hidden, intermediate=m.intermediate, experts=m.experts, topk=m.topk, dtype=m.dtype,
                   token_bucket=128)
    with Store(db) as s:
        s.put_profile(ProfileRecord(key=k, knobs=default_knobs("collective"), latency_us=5.0, spread_us=0.1,
                                    backend="model:nvlink-h200x2"))
    cfg = tmp_path / "client.toml"
    cfg.write_text("[client]\nallow_modelled = true\n")
    r = runner.invoke(app, ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--db", str(db),
                            "--socket", f"ipc://{tmp_path}/none.sock", "--timeout-ms", "100", "--json",
                            "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    # stdout alone, and all of it: one JSON document (Result.output also holds stderr, where a log line is allowed)
    out = json.loads(r.stdout)
    assert out["source"] == "database", out
    assert out["provenance"] == "preset"


def test_query_env_format_labels_a_modelled_profile(tmp_path, monkeypatch):
    """`--format env` is what a launcher evals or saves: a MODELLED profile's exports carry the label (a shell
    comment), as the table and JSON formats carry it."""
    from moetune.runtime.profiles import client

    k = key(fp="preset:nvlink-h200x2", software="modelled")
    res = client.Resolution(knobs=default_knobs("nvlink"), source="database", profile_hash="h1", status="current",
                            env={"NVSHMEM_REMOTE_TRANSPORT": "none"}, key=k, family="nvlink", provenance="preset", message="using a MODELLED profile")

    monkeypatch.setattr(client.ProfileClient, "resolve", lambda self, **kw: res)
    Store(tmp_path / "n.db").close()  # a --db that does not exist is refused
    args = ["query", "--model", "qwen3-30b", "--ep", "2", "--tokens", "128", "--format", "env", "--db", str(tmp_path / "n.db"),
            "--socket", f"ipc://{tmp_path}/none.sock", "--timeout-ms", "100"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "# moetune: MODELLED profile (preset" in r.stdout and "export NVSHMEM_REMOTE_TRANSPORT=none" in r.stdout
    res = msgspec.structs.replace(res, provenance="measured", source="daemon", message="")
    monkeypatch.setattr(client.ProfileClient, "resolve", lambda self, **kw: res)
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "#" not in r.stdout, r.output


# -- the README's Store example ---------------------------------------------------------------------
def test_readme_store_example_runs_and_matches(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    m = re.search(r"From Python:\n\n((?:    .*\n)+)", text)
    assert m, "the README's Store example is gone"
    code = "\n".join(line[4:] for line in m.group(1).splitlines())
    db = tmp_path / "readme.db"
    with Store(db) as s:
        s.put_profile(ProfileRecord(
            key=ProfileKey(fingerprint="fp", software="sw", transport_family="nvlink", ep_size=8, nodes=1, hidden=7168,
                           intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=256),
            knobs=default_knobs("nvlink"), latency_us=40.0, spread_us=1.0, backend="local:nccl", provenance="measured"))
    monkeypatch.setenv("MOETUNE_STORE_DB", str(db))
    ns: dict = {"fp": "fp", "sw": "sw"}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["rec"] is not None and ns["rec"].key.token_bucket == 256
    assert ns["rec"].is_tuned_for("fp", "sw")
