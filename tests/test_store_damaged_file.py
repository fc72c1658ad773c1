"""A damaged database file (a page overwritten): `moetune db check` reports the integrity result (exit 1, the
problem named, no traceback) and nothing writes to it: an import is refused and leaves the file as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store, StoreDamaged

PAGE = 4096


def record(software: str, latency: float = 3.0) -> ProfileRecord:
    key = ProfileKey(fingerprint="fp", software=software, transport_family="nvlink", ep_size=2, nodes=1, hidden=7168,
                     intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=128)
    return ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=latency, spread_us=0.5, backend="model:x")


def databases(tmp_path: Path) -> tuple[Path, bytes]:
    """A sound database with some pages of profiles, and its export."""
    good = tmp_path / "good.db"
    with Store(good) as s:
        for i in range(60):
            s.put_profile(record(f"software-{i:03d}-" + "v" * 80))
        export = s.dump_profiles()
    with Store(tmp_path / "other.db") as s:
        s.put_profile(record("another", 2.0))
        other = s.dump_profiles()
    assert export
    return good, other


def damaged_copy(good: Path, page: int | None = None) -> Path:
    data = bytearray(good.read_bytes())
    pages = len(data) // PAGE
    n = pages // 2 if page is None else page
    data[n * PAGE:(n + 1) * PAGE] = b"\xff" * PAGE
    bad = good.with_name(f"bad{n}.db")
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("page", [None, 1])  # a page of profile rows; a page of the schema and version tables
def test_db_check_reports_a_damaged_file_and_an_import_is_refused(tmp_path: Path, page: int | None) -> None:
    good, other = databases(tmp_path)
    bad = damaged_copy(good, page)
    run = CliRunner().invoke
    res = run(app, ["db", "check", "--db", str(bad)])
    assert res.exit_code == 1, res.output
    assert "NOT OK" in res.stdout and "malformed" in res.stdout and "Traceback" not in res.output
    before = bad.read_bytes()
    src = tmp_path / "other.json"
    src.write_bytes(other)
    res = run(app, ["profiles", "import", str(src), "--db", str(bad)])
    assert res.exit_code != 0 and "damaged" in res.output and "db check" in res.output, res.output
    assert bad.read_bytes() == before  # not a byte written
    assert run(app, ["db", "check", "--db", str(good)]).exit_code == 0


def test_the_store_refuses_an_import_into_a_damaged_file(tmp_path: Path) -> None:
    good, other = databases(tmp_path)
    bad = damaged_copy(good)
    with Store(bad, upgrade=False) as s, pytest.raises(StoreDamaged, match="db check"):
        s.import_bytes(other)
