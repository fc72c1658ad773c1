"""An import is held to the lengths the schema declares (SQLite does not enforce String(N)), to a cap on a
fingerprint's facts and on the software versions, and to a cap on the file's size: each refusal names the field
and the limit, and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

import moetune.tuner.store.io as io
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.models import Fingerprint, Profile
from moetune.tuner.store.store import ProfileImportError, Store
from moetune.tuner.store.validate import MAX_FACTS_BYTES, MAX_SOFTWARE_VERSIONS_BYTES, FieldError


def record(**kw) -> ProfileRecord:
    key = ProfileKey(fingerprint=kw.pop("fingerprint", "fp"), software=kw.pop("software", "sw"),
                     transport_family="nvlink", ep_size=2, nodes=1, hidden=7168, intermediate=2048, experts=256,
                     topk=8, dtype="bfloat16", token_bucket=128)
    return ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=3.0, spread_us=0.5,
                         backend="local:nccl", provenance="measured", measured_on=key.fingerprint, **kw)


def export_doc(tmp_path: Path) -> dict:
    with Store(tmp_path / "src.db") as s:
        s.put_profile(record())
        return json.loads(s.dump_profiles())


def length(column) -> int:
    return column.type.length


def refused(tmp_path: Path, doc: dict) -> str:
    with Store(tmp_path / "dst.db") as s, pytest.raises(ProfileImportError) as e:
        s.import_bytes(json.dumps(doc).encode())
    with Store(tmp_path / "dst.db") as s:
        assert s.count_profiles() == 0 and s.list_fingerprints() == []
    return str(e.value)


@pytest.mark.parametrize(("field", "column"), [
    ("software", Profile.__table__.c.software),
    ("backend", Profile.__table__.c.backend),
])
def test_a_text_past_its_column_is_refused_and_one_at_it_imports(tmp_path: Path, field: str, column) -> None:
    n = length(column)
    doc = export_doc(tmp_path)
    where = doc["profiles"][0]["key"] if field == "software" else doc["profiles"][0]
    value = where[field]
    where[field] = value[:6] + "x" * (n + 1 - len(value[:6]))
    msg = refused(tmp_path, doc)
    assert f"{field}: {n + 1} characters, the database column holds at most {n}" in msg
    where[field] = where[field][:n]
    with Store(tmp_path / "ok.db") as s:
        assert s.import_bytes(json.dumps(doc).encode()).inserted == 1


def test_a_fingerprint_past_its_column_is_refused(tmp_path: Path) -> None:
    n = length(Fingerprint.__table__.c.hash)
    doc = export_doc(tmp_path)
    long = "f" * (n + 1)
    doc["fingerprints"][0]["hash"] = long
    doc["profiles"][0]["key"]["fingerprint"] = long
    doc["profiles"][0]["measured_on"] = long
    assert f"fingerprints[0].hash: {n + 1} characters, the database column holds at most {n}" in refused(tmp_path, doc)


def test_measured_on_past_its_column_is_refused(tmp_path: Path) -> None:
    n = length(Profile.__table__.c.measured_on)
    doc = export_doc(tmp_path)
    doc["profiles"][0]["provenance"] = "node_model"
    doc["profiles"][0]["backend"] = "model:node:x"
    doc["profiles"][0].pop("perf_env", None)
    doc["profiles"][0]["measured_on"] = "m" * (n + 1)
    assert f"measured_on: {n + 1} characters, the database column holds at most {n}" in refused(tmp_path, doc)


def test_facts_and_software_versions_past_their_caps_are_refused(tmp_path: Path) -> None:
    doc = export_doc(tmp_path)
    doc["fingerprints"][0]["facts"] = {"blob": "x" * MAX_FACTS_BYTES}
    msg = refused(tmp_path, doc)
    assert "fingerprints[0].facts" in msg and f"at most {MAX_FACTS_BYTES}" in msg
    doc = export_doc(tmp_path)
    doc["profiles"][0]["software_versions"] = {"pkg": "1" * MAX_SOFTWARE_VERSIONS_BYTES}
    msg = refused(tmp_path, doc)
    assert "software_versions" in msg and f"at most {MAX_SOFTWARE_VERSIONS_BYTES}" in msg


def test_the_store_refuses_such_a_record_too(tmp_path: Path) -> None:
    n = length(Profile.__table__.c.software)
    with Store(tmp_path / "m.db") as s, pytest.raises(FieldError, match=f"at most {n}"):
        s.put_profile(record(software="s" * (n + 1)))


def test_a_file_past_the_size_limit_is_refused_before_it_is_read_whole(tmp_path: Path, monkeypatch) -> None:
    doc = export_doc(tmp_path)
    data = json.dumps(doc).encode()
    monkeypatch.setattr(io, "MAX_IMPORT_BYTES", len(data) - 1)
    path = tmp_path / "big.json"
    path.write_bytes(data)
    db = tmp_path / "dst.db"
    with Store(db) as s, pytest.raises(ProfileImportError, match=f"over the import limit of {len(data) - 1} bytes"):
        s.import_profiles(path)
    res = CliRunner().invoke(app, ["profiles", "import", str(path), "--db", str(db)])
    assert res.exit_code == 2, res.output
    assert "over the import limit" in res.output and "Traceback" not in res.output
    with Store(db) as s:
        assert s.count_profiles() == 0
    monkeypatch.setattr(io, "MAX_IMPORT_BYTES", len(data))  # at the limit: imported
    assert CliRunner().invoke(app, ["profiles", "import", str(path), "--db", str(db)]).exit_code == 0


def test_cli_reproducer_a_huge_fingerprint_is_refused_and_db_check_stays_ok(tmp_path: Path) -> None:
    doc = export_doc(tmp_path)
    huge = "a" * (2 << 20)
    doc["fingerprints"][0]["hash"] = huge
    doc["profiles"][0]["key"]["fingerprint"] = huge
    doc["profiles"][0]["measured_on"] = huge
    doc["profiles"][0]["key"]["software"] = "s" * (2 << 20)
    path = tmp_path / "e.json"
    path.write_bytes(msgspec.json.encode(doc))
    db = tmp_path / "dst.db"
    res = CliRunner().invoke(app, ["profiles", "import", str(path), "--db", str(db)])
    assert res.exit_code == 2, res.output
    assert "characters, the database column holds at most" in res.output and "database unchanged" in res.output


def test_an_export_over_the_import_limit_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`profiles export` wrote files `profiles import` refuses (over its 64 MiB), without a word."""
    db = tmp_path / "m.db"
    Store(db).close()
    monkeypatch.setattr(io, "MAX_IMPORT_BYTES", 10)  # any export is bigger than that
    r = CliRunner().invoke(app, ["profiles", "export", str(tmp_path / "e.json"), "--db", str(db)])
    assert r.exit_code == 0 and "over the 0 MiB that `moetune profiles import` takes" in " ".join(r.output.split())
