"""The bring-up report never overwrites a file moetune did not write: `moetune report --out DIR` and `profile
--report-dir DIR` replaced a DIR/report.md of the user's ("MY OWN NOTES") and exited 0. A report.md that is not
moetune's, or a plot file of a name the report draws that is not its own, is refused with one line naming the file
and the option, and nothing in the folder changes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.tuner.cli import app
from moetune.tuner.fabric import discovery

pytestmark = pytest.mark.timeout(120)
CAPTURES = Path(__file__).resolve().parent / "captures"
NOTES = "MY OWN NOTES\n"


def _latency_rows() -> list[dict]:
    return [{"kind": "latency", "transport": "nvlink", "size_bytes": size, "value": 2.0 + size / 1e6, "spread": 0.1,
             "unit": "us", "extra": {}} for size in (1024, 65536, 1 << 20)]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_report_md_not_ours_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    from moetune.tuner.bringup.report import NotOurReport, ReportData, write_report

    (tmp_path / "report.md").write_text(NOTES)
    with pytest.raises(NotOurReport, match=r"report\.md was not written by moetune.*not replaced"):
        write_report(ReportData(node="a", fingerprint="a" * 16, measurements=_latency_rows()), tmp_path)
    assert _files(tmp_path) == {"report.md": NOTES.encode()}  # no plot drawn beside it either


def test_a_plot_file_not_ours_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from moetune.tuner.bringup.report import NotOurReport, ReportData, write_report

    (tmp_path / "latency.png").write_bytes(b"the user's")
    with pytest.raises(NotOurReport, match=r"latency\.png was not written by moetune"):
        write_report(ReportData(node="a", fingerprint="a" * 16, measurements=_latency_rows()), tmp_path)
    assert _files(tmp_path) == {"latency.png": b"the user's"}  # no report.md, the user's file as it was


def test_the_reports_own_plots_are_replaced(tmp_path: Path) -> None:
    """A plot of ours is replaced: marked as the report's, or (written before the mark) shown by our report.md."""
    from moetune.tuner.bringup.report import ReportData, write_report

    data = ReportData(node="a", fingerprint="a" * 16, measurements=_latency_rows())
    write_report(data, tmp_path)
    (tmp_path / "report.md").unlink()  # the mark alone says the plot is ours
    assert "](latency.png)" in write_report(data, tmp_path).read_text()
    (tmp_path / "latency.png").write_bytes(b"\x89PNG plot of an older moetune, unmarked")  # shown by report.md
    write_report(data, tmp_path)
    assert b"moetune bring-up report" in (tmp_path / "latency.png").read_bytes()[:4096]


def _db(tmp_path: Path) -> Path:
    db = tmp_path / "p.db"
    F.open_store(db).close()
    return db


def test_report_out_refuses_a_report_md_not_ours(tmp_path: Path) -> None:
    db = _db(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text(NOTES)
    r = CliRunner().invoke(app, ["report", "--db", str(db), "--out", str(out), "--capture", str(CAPTURES / "dgx-h100")])
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"{out / 'report.md'} was not written by moetune" in said and "pass another --out" in said, said
    assert "Traceback" not in r.output and _files(out) == {"report.md": NOTES.encode()}


def test_report_out_refuses_a_plot_not_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.bringup import flow

    monkeypatch.setattr(flow, "report_from_store", lambda store, facts, out_dir: _write_latency(out_dir))
    out = tmp_path / "out"
    out.mkdir()
    (out / "latency.png").write_bytes(b"the user's")
    r = CliRunner().invoke(app, ["report", "--db", str(_db(tmp_path)), "--out", str(out), "--capture",
                                 str(CAPTURES / "dgx-h100")])
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"{out / 'latency.png'} was not written by moetune" in said and "pass another --out" in said, said
    assert _files(out) == {"latency.png": b"the user's"}


def _write_latency(out_dir: Path) -> Path:
    from moetune.tuner.bringup.report import ReportData, write_report

    return write_report(ReportData(node="a", fingerprint="a" * 16, measurements=_latency_rows()), out_dir)


def test_report_default_folder_holding_a_report_md_not_ours_writes_beside_the_current_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # run as on the node the capture describes: its report's default folder is report/ (another node's would be
    # report-<fingerprint>/)
    facts = discovery.discover(CAPTURES / "dgx-h100")
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: facts)
    db = _db(tmp_path)
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.md").write_text(NOTES)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["report", "--db", str(db), "--capture", str(CAPTURES / "dgx-h100")])
    assert r.exit_code == 0, r.output
    assert "was not written by moetune" in " ".join(r.output.split())
    assert (tmp_path / "report" / "report.md").read_text() == NOTES
    assert (tmp_path / "moetune-report" / "report.md").read_text().startswith("# moetune bring-up report")


def _profile(tmp_path: Path, *extra: str) -> Any:
    return CliRunner().invoke(app, ["profile", "--quick", "--capture", str(CAPTURES / "dgx-h100"), "--db",
                                    str(tmp_path / "p.db"), *extra], env={"MOETUNE_HOME": str(tmp_path)})


def test_profile_report_dir_holding_a_report_md_not_ours_is_refused_before_the_bring_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "live_facts", lambda timeout_s=1.5: discovery.discover(CAPTURES / "cpu-laptop"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text(NOTES)
    r = _profile(tmp_path, "--report-dir", str(out))
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"--report-dir {out}: {out / 'report.md'} was not written by moetune" in said, said
    assert "pass another --report-dir" in said
    assert _files(out) == {"report.md": NOTES.encode()} and not (tmp_path / "p.db").exists()  # nothing ran
