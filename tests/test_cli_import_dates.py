"""`profiles import` of a date near year 1 ("0001-01-01T00:00:00+01:00": no UTC date exists for it) is the
validator's error naming the field (exit 2: an input file that cannot serve, database unchanged), not an
OverflowError traceback from putting it in UTC; --skip-invalid skips that record, and a date before 1970 (no store
wrote it) is refused the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)

YEAR_1 = "0001-01-01T00:00:00+01:00"


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def exported(tmp_path: Path) -> dict:
    src = tmp_path / "src.db"
    with Store(src) as s:
        for b in (16, 128):
            key = ProfileKey(fingerprint="fp-dates", software="sw", transport_family="nvlink", ep_size=2, nodes=1,
                             hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=b)
            s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=float(b), spread_us=0.5,
                                        backend="local:nccl", provenance="measured"))
    out = tmp_path / "e.json"
    r = run("profiles", "export", str(out), "--db", str(src))
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def refused(r, dst: Path, needle: str) -> None:
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output and "OverflowError" not in r.output
    assert needle in text and "database unchanged" in text, r.output
    assert not dst.exists()


@pytest.mark.parametrize("field", ["first_seen", "last_seen"])
@pytest.mark.parametrize("value", [YEAR_1, "1969-12-31T23:59:59+00:00"])
def test_a_fingerprint_date_out_of_range_is_refused_by_name(tmp_path: Path, field: str, value: str) -> None:
    doc = exported(tmp_path)
    doc["fingerprints"][0][field] = value
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    dst = tmp_path / "dst.db"
    for extra in ([], ["--skip-invalid"]):  # a fingerprint is no record to skip: the file cannot serve
        refused(run("profiles", "import", str(f), "--db", str(dst), *extra), dst, f"fingerprints[0].{field}: date")


@pytest.mark.parametrize("field", ["created", "updated"])
@pytest.mark.parametrize("value", [YEAR_1, "1900-01-01T00:00:00+00:00"])
def test_a_profile_date_out_of_range_is_refused_by_name_and_skipped_with_skip_invalid(tmp_path: Path, field: str,
                                                                                      value: str) -> None:
    doc = exported(tmp_path)
    doc["profiles"][0][field] = value
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    dst = tmp_path / "dst.db"
    refused(run("profiles", "import", str(f), "--db", str(dst)), dst, f"profiles[0].{field}: date")

    r = run("profiles", "import", str(f), "--db", str(dst), "--skip-invalid")
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and f"profiles[0].{field}: date" in " ".join(r.output.split())
    with Store(dst) as s:
        assert [rec.key.token_bucket for _, rec in s.list_profiles()] == [doc["profiles"][1]["key"]["token_bucket"]]
