"""Import hardening: a file imported again stores nothing new (records without `created`, dates spelled another way);
a file nested too deeply is refused with a message, not a traceback; no control character of a file (a terminal
escape sequence) is stored or printed; a transport family is one moetune knows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.io import import_bytes
from moetune.tuner.store.store import ProfileImportError, Store

pytestmark = pytest.mark.timeout(120)


def run(*args: str, input: str | bytes | None = None):
    return CliRunner().invoke(app, list(args), input=input, env={"COLUMNS": "200"})


def key(bucket: int, family: str = "nvlink") -> ProfileKey:
    return ProfileKey(fingerprint="fp-x", software="sw", transport_family=family, ep_size=2, nodes=1, hidden=7168,
                      intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=bucket)


@pytest.fixture
def export(tmp_path: Path) -> dict:
    """An export of three profiles (measured, preset, node model), as a dict."""
    with Store(tmp_path / "src.db") as s:
        s.upsert_fingerprint("fp-x", {"gpu": "H100", "n": 8}, origin="local")
        for b, prov, be, on in ((16, "measured", "local:nccl", "fp-x"), (128, "preset", "model:ndr-ibrc-h100x8", ""),
                                (256, "node_model", "model:node:fp-x", "fp-x")):
            s.put_profile(ProfileRecord(key=key(b), knobs=default_knobs("nvlink"), latency_us=float(b), spread_us=0.5,
                                        backend=be, provenance=prov, measured_on=on))
        return json.loads(s.dump_profiles())


def data(doc: dict) -> bytes:
    return json.dumps(doc).encode()


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the same file again ------------------------------------------------------------------------------------------
def test_records_without_created_are_already_present_the_second_time(tmp_path, export):
    for r in export["profiles"]:
        del r["created"], r["updated"]  # the format allows leaving them out
    with Store(tmp_path / "dst.db") as s:
        first = s.import_bytes(data(export))
        assert (first.inserted, first.current, first.skipped) == (3, 3, 0)
        for _ in range(2):
            again = s.import_bytes(data(export))
            assert (again.inserted, again.kept_superseded, again.skipped) == (0, 0, 3)
        assert len(s.list_profiles()) == 3
        # matched on what the record says: other numbers are another record
        export["profiles"][0]["latency_us"] = 99.0
        other = s.import_bytes(data(export))
        assert (other.inserted, other.skipped) == (1, 2)


def test_the_same_instant_spelled_with_z_is_already_present(tmp_path, export):
    with Store(tmp_path / "dst.db") as s:
        assert s.import_bytes(data(export)).inserted == 3
        for r in export["profiles"]:
            assert r["created"].endswith("+00:00")
            r["created"] = r["created"].replace("+00:00", "Z")
        again = s.import_bytes(data(export))
        assert (again.inserted, again.kept_superseded, again.skipped) == (0, 0, 3)
        assert len(s.list_profiles()) == 3


def test_imported_dates_are_stored_in_utc_so_the_newest_sorts_last(tmp_path, export):
    """Dates are compared as text (the newest fingerprint, `ORDER BY last_seen`): an imported `+14:00` date (or one in
    ISO's basic format) sorted as the newest whatever its instant. They are stored in UTC as the store writes its own."""
    fp = export["fingerprints"][0]
    fp["last_seen"] = "2026-01-01T20:00:00+14:00"  # 06:00 UTC: older than a 10:00 UTC date
    export["profiles"][0]["created"] = export["profiles"][0]["updated"] = "2026-01-01T09:30:00.250000-02:00"
    with Store(tmp_path / "dst.db") as s:
        assert s.import_bytes(data(export)).inserted == 3
        row = next(r for r in s.list_fingerprints() if r.hash == "fp-x")
        assert row.last_seen == "2026-01-01T06:00:00.000000+00:00"
        rec = next(r for _i, r in s.list_profiles() if r.key.token_bucket == 16)
        assert rec.created == rec.updated == "2026-01-01T11:30:00.250000+00:00"
        assert row.last_seen < "2026-01-01T10:00:00.000000+00:00"  # a later instant now sorts later
    fp["last_seen"] = "20260101T070000+00:00"  # the basic format, in UTC: still written as the store writes
    with Store(tmp_path / "dst2.db") as s:
        s.import_bytes(data(export))
        assert next(r for r in s.list_fingerprints() if r.hash == "fp-x").last_seen == "2026-01-01T07:00:00.000000+00:00"


def test_cli_says_already_present(tmp_path, export):
    for r in export["profiles"]:
        del r["created"], r["updated"]
    f = tmp_path / "nocreated.json"
    f.write_bytes(data(export))
    db = tmp_path / "dst.db"
    assert run("profiles", "import", str(f), "--db", str(db)).exit_code == 0
    r = run("profiles", "import", str(f), "--db", str(db))
    assert r.exit_code == 0, r.output
    assert "imported 0 profile(s)" in r.output and "3 already present" in r.output


# -- nested too deeply ---------------------------------------------------------------------------------------------
def test_a_file_nested_too_deeply_is_refused_with_exit_2(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text("[" * 1000 + "]" * 1000)
    db = tmp_path / "d.db"
    r = run("profiles", "import", str(f), "--db", str(db))
    assert r.exit_code == 2, r.output
    assert "not valid JSON" in r.output and "nested too deeply" in r.output
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output  # no RecursionError
    assert not db.exists()


def test_facts_nested_deep_are_refused_before_anything_is_stored(tmp_path, export):
    deep: list = []
    for _ in range(200):  # decodes, but no export nests so: stored, it could fail every later read
        deep = [deep]
    export["fingerprints"][0]["facts"]["deep"] = deep
    with Store(tmp_path / "dst.db") as s:
        with pytest.raises(ProfileImportError, match="nested too deeply"):
            s.import_bytes(data(export))
        assert s.list_profiles() == []


# -- control characters, families ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("where", "value", "field"), [
    ("backend", "local:\x1b[2J\x1b[31mclean", "profiles[0].backend"),
    ("family", "nvlink:\x1b[5mX", "profiles[0].key.transport_family"),
    ("measured_on", "fp-x\x9b31m", "profiles[0].measured_on"),  # C1: a CSI on its own
    ("software_versions", {"nccl\x1b": "2"}, "profiles[0].software_versions['nccl\\x1b']"),
    ("software_versions", {"nccl": "2\x7f"}, "profiles[0].software_versions.nccl"),
])
def test_a_control_character_in_a_record_is_refused_naming_the_field(tmp_path, export, where, value, field):
    r0 = export["profiles"][0]
    if where == "family":
        r0["key"]["transport_family"] = value
    else:
        r0[where] = value
    db = tmp_path / "dst.db"
    with Store(db) as s:
        before = sha(db)
        with pytest.raises(ProfileImportError) as e:
            s.import_bytes(data(export), source="x.json")
        assert sha(db) == before
    msg = str(e.value)
    assert f"{field}: control character in " in msg
    assert not any(c in msg for c in "\x1b\x9b\x7f"), msg  # the value is named by its repr


def test_a_control_character_in_fingerprint_facts_is_refused(tmp_path, export):
    export["fingerprints"][0]["facts"]["gpu"] = "H100\x1b]0;pwned\x07"
    with Store(tmp_path / "dst.db") as s, pytest.raises(ProfileImportError) as e:
        s.import_bytes(data(export), source="x.json")
    assert "fingerprints[0].facts.gpu: control character in" in str(e.value)
    assert "\x1b" not in str(e.value) and "\x07" not in str(e.value)


def test_a_record_that_does_not_decode_names_its_hostile_key_escaped(tmp_path, export):
    r0 = export["profiles"][0]
    r0["key"]["transport_family"] = "nvlink\x1b[2J"
    r0["key"]["ep_size"] = "two"  # fails to decode: the key is shown from the raw text
    with Store(tmp_path / "dst.db") as s, pytest.raises(ProfileImportError) as e:
        s.import_bytes(data(export), source="x.json")
    assert "nvlink\\x1b[2J" in str(e.value) and "\x1b" not in str(e.value)


@pytest.mark.parametrize("family", ["nvlink:X", "proxy", "proxy:libfabric/CXI", "collective/nvlink"])
def test_an_unknown_family_is_refused(tmp_path, export, family):
    export["profiles"][0]["key"]["transport_family"] = family
    with Store(tmp_path / "dst.db") as s, pytest.raises(ProfileImportError, match="unknown transport family"):
        s.import_bytes(data(export))


@pytest.mark.parametrize(("family", "transport"), [
    ("proxy:ibrc", "proxy"), ("proxy:ucx", "proxy"), ("proxy:libfabric", "proxy"), ("proxy:libfabric/cxi", "proxy"),
    ("proxy:libfabric/efa", "proxy"), ("ibgda", "ibgda"), ("host_staged", "host_staged"), ("collective", "collective"),
    ("megakernel", "collective"),
])
def test_known_families_import(tmp_path, export, family, transport):
    r0 = export["profiles"][0]
    r0["key"]["transport_family"] = family
    r0["knobs"] = default_knobs(transport).to_dict()
    if family == "megakernel":  # the one-GPU engine's key and knobs (any other contradicts the family: refused)
        r0["key"]["ep_size"] = 1
        r0["knobs"]["engine"] = "megakernel"
    r0["provenance"], r0["measured_on"] = "node_model", ""  # the profile hash changed: not the measured one
    with Store(tmp_path / "dst.db") as s:
        assert s.import_bytes(data(export)).inserted == 3


def test_cli_import_of_escape_sequences_exits_2_and_prints_none(tmp_path, export):
    r0 = export["profiles"][0]
    r0["backend"] = "local:\x1b[2J\x1b[31mclean"
    r0["key"]["transport_family"] = "nvlink:\x1b[5mX"
    f = tmp_path / "ansi.json"
    f.write_bytes(data(export))
    db = tmp_path / "an.db"
    r = run("profiles", "import", str(f), "--db", str(db))
    assert r.exit_code == 2, r.output
    assert "profiles[0].key.transport_family: control character in 'nvlink:\\x1b[5mX'" in r.output
    assert "\x1b" not in r.output
    assert not db.exists()


def test_an_import_reads_the_stored_rows_once_not_per_record(tmp_path: Path) -> None:
    """The import's fingerprints' rows are read once: a file imported again (nothing to write) runs a handful of
    SELECTs whatever its size, and a first import one re-read per inserted row. Two queries with twelve-column
    filters a record (already stored? the current one?) take ~50 s for 4,000 records, holding the write lock."""
    from sqlalchemy import event

    buckets = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    with Store(tmp_path / "src.db") as s:
        s.upsert_fingerprint("fp-x", {"gpu": "H100"}, origin="local")
        for i in range(120):
            k = ProfileKey(**{**key(buckets[i % 10]).to_dict(), "hidden": 1024 + 64 * (i // 10)})
            s.put_profile(ProfileRecord(key=k, knobs=default_knobs("nvlink"), latency_us=10.0 + i, spread_us=0.1,
                                        backend="local:nccl", provenance="measured", measured_on="fp-x"))
        data = s.dump_profiles()
    with Store(tmp_path / "dst.db") as d:
        selects: list[str] = []
        event.listen(d.engine, "before_cursor_execute",
                     lambda conn, cur, stmt, *a: selects.append(stmt) if stmt.lstrip().upper().startswith("SELECT") else None)
        first = d.import_bytes(data)
        assert first.inserted == 120 and first.current == 120, first
        assert len(selects) <= 120 + 10, len(selects)
        selects.clear()
        again = d.import_bytes(data)
        assert again.skipped == 120 and again.inserted == 0, again
        assert len(selects) <= 10, selects[:20]
        assert d.count_profiles("current") == 120


def test_many_invalid_records_are_named_by_ranges(tmp_path: Path, export: dict) -> None:
    """A file whose records were all invalid listed every index past the twentieth one by one (a 2,000-record file:
    a line of ~30,000 characters); runs of neighbours are now one range each."""
    bad = []
    for i in range(200):
        p = json.loads(json.dumps(export["profiles"][0]))
        p["key"]["token_bucket"] = 22 if i != 150 else 16  # one valid record in the middle
        p["key"]["hidden"] = 1024 + i
        bad.append(p)
    data = json.dumps({**export, "profiles": bad}).encode()
    with Store(tmp_path / "dst.db") as d, pytest.raises(ProfileImportError) as e:
        d.import_bytes(data)
    msg = str(e.value)
    assert "199 of 200 profile record(s) invalid" in msg, msg[:300]
    assert "and 179 more: profiles[20-149], profiles[151-199]\n" in msg, msg[-400:]
    assert len(msg) < 5000


def test_an_imports_work_per_record_does_not_grow_with_the_keys_history(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The import hashes each record's key and knobs once a record, not once per stored row of its key: hashing per
    row makes an import of 3,000 records of one key take 33 s (60 s for the same file again)."""
    with Store(tmp_path / "src.db") as s:
        s.upsert_fingerprint("fp-x", {"gpu": "H100"}, origin="local")
        for i in range(60):
            s.put_profile(ProfileRecord(key=key(16), knobs=default_knobs("nvlink").replace(num_sms=1 + i),
                                        latency_us=100.0 - i, spread_us=0.01, backend="local:nccl",
                                        provenance="measured", measured_on="fp-x"))
        data = s.dump_profiles()
    calls: list[int] = []
    real = ProfileRecord.profile_hash
    monkeypatch.setattr(ProfileRecord, "profile_hash", property(lambda self: (calls.append(1), real.fget(self))[1]))
    with Store(tmp_path / "dst.db") as d:
        first = d.import_bytes(data)
        calls.clear()
        again = d.import_bytes(data)
    assert first.inserted == 60 and again.skipped == 60, (first, again)
    assert len(calls) <= 3 * 60, len(calls)  # per-row hashing would be ~60 x 60


def test_the_store_refuses_a_key_that_is_no_token_bucket(tmp_path: Path) -> None:
    """put_profile refuses token_bucket=22 (a lookup rounds S to a bucket, so it would never be found), as an import
    of its export would: what the store keeps is what an import takes back."""
    from moetune.tuner.store.validate import FieldError

    with Store(tmp_path / "m.db") as s:
        s.upsert_fingerprint("fp-x", {"gpu": "H100"}, origin="local")
        with pytest.raises(FieldError, match=r"key\.token_bucket.*22 is not a token bucket"):
            s.put_profile(ProfileRecord(key=key(22), knobs=default_knobs("nvlink"), latency_us=1.0, spread_us=0.1,
                                        backend="local:nccl", provenance="measured", measured_on="fp-x"))
        assert s.count_profiles() == 0


def test_the_import_summary_counts_history_and_a_negative_latency_is_refused_as_zero_is(tmp_path: Path,
                                                                                         export: dict) -> None:
    """Superseded records of a file are imported and must be in a count of the summary; a negative latency is
    refused in the same words as 0, not with "must be a finite number >= 0", which 0 would satisfy."""
    hist = json.loads(json.dumps(export["profiles"][0]))
    hist["status"], hist["knobs"]["num_sms"], hist["created"] = "superseded", 40, "2026-01-01T00:00:00+00:00"
    src = tmp_path / "f.json"
    src.write_text(json.dumps({**export, "profiles": [*export["profiles"], hist]}))
    r = run("profiles", "import", str(src), "--db", str(tmp_path / "d.db"))
    assert r.exit_code == 0 and "imported 4 profile(s)" in r.output and "3 current, 1 as history," in r.output, r.output
    for bad in (-1.0, 0.0):
        p = json.loads(json.dumps(export["profiles"][0]))
        p["latency_us"] = bad
        f = tmp_path / f"bad{bad}.json"
        f.write_text(json.dumps({**export, "profiles": [p]}))
        r = run("profiles", "import", str(f), "--db", str(tmp_path / "e.db"))
        assert r.exit_code != 0 and f"latency_us: must be a finite number > 0, got {bad}" in r.output, r.output


def test_a_re_measurement_stored_in_the_same_second_survives_export_and_import(tmp_path: Path) -> None:
    """A tune stamped its records to the second: a re-measurement of the same knobs that replaced the current profile
    in the same second had the same key, knobs and `created` as the row it superseded, and an import of the export
    took the current one for that row, "already present": the new database had no current profile for the key."""
    same = "2026-12-05T16:12:29Z"
    with Store(tmp_path / "src.db") as s:
        s.upsert_fingerprint("fp-x", {"gpu": "H100"}, origin="local")
        for lat in (12.0, 11.0):
            s.put_profile(ProfileRecord(key=key(16), knobs=default_knobs("nvlink"), latency_us=lat, spread_us=0.5,
                                        backend="local:nccl", provenance="measured", measured_on="fp-x",
                                        created=same, updated=same), force_reason="re-measured")
        data = s.dump_profiles()
    with Store(tmp_path / "dst.db") as d:
        res = import_bytes(d, data)
        assert (res.inserted, res.skipped) == (2, 0), res
        cur = d.get_current(key(16))
        assert cur is not None and cur.latency_us == 11.0
        again = import_bytes(d, data)
        assert (again.inserted, again.skipped) == (0, 2)  # a second import still finds both


def test_token_counts_of_one_bucket_are_one_study(tmp_path: Path) -> None:
    """`tune -t 16,17,18` ran three studies of the one key (bucket 16), each replacing the last's profile."""
    import optuna

    from moetune.runtime.shapes import ModelShape
    from moetune.tuner.search.tune import tune_profiles_detailed

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    small = ModelShape(name="custom:256,128,16,2", hidden=256, intermediate=128, experts=16, topk=2)
    with Store(tmp_path / "t.db") as s:
        res = tune_profiles_detailed(s, None, models=[small], tokens=[16, 17, 18, 130], backend="model",
                                     preset="nvlink-h200x2", trials=2, ep_size=2,
                                     storage=f"sqlite:///{tmp_path / 'opt.db'}")
    assert sorted(r.record.key.token_bucket for r in res if r.record) == [16, 128]
