"""Tables at 80 columns (the width Rich takes in a pipe or a CI log): a number or a status is never cut (Rich's
default cut turns 6987.4 µs into `698…`, current into `curre…`, bfloat16 into `bflo…` in `moetune profiles list`):
text wraps, low-value columns are left out (the caption names them), and only a table that cannot fit is printed
wider."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord
from moetune.tuner.cli import app
from moetune.tuner.cli._tables import Col, print_table
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)

ROWS = [("nvlink", 2, 1, 16, 6987.4, 12.3, "local:nccl", "measured"),
        # a shipped preset's prediction is a preset; node_model only from this node's own model (the store refuses
        # the label on another backend)
        ("proxy:libfabric", 16, 2, 4096, 123456.7, 1234.5, "model:slingshot11-libfabric-a100x4", "preset"),
        ("host_staged", 4, 1, 128, 56.4, 0.0, "model:node:fp-cli-0123456789abcdef", "node_model")]


def _fill(db: Path) -> None:
    with Store(db) as s:
        for fam, ep, nodes, b, us, sp, be, prov in ROWS:
            key = ProfileKey(fingerprint="fp-cli-0123456789abcdef", software="sw", transport_family=fam, ep_size=ep,
                             nodes=nodes, hidden=7168, intermediate=18432, experts=256, topk=8, dtype="bfloat16",
                             token_bucket=b)
            s.put_profile(ProfileRecord(key=key, knobs=default_knobs(fam.split(":")[0]), latency_us=us, spread_us=sp,
                                        backend=be, provenance=prov))


def _run(*args: str, columns: int) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    return r.exit_code, r.stdout


def _lines_fit(out: str, width: int) -> None:
    too_wide = [ln for ln in out.splitlines() if len(ln) > width]
    assert not too_wide, too_wide


def _unwrapped(out: str) -> str:
    """The table's cell text, one space between pieces (a wrapped cell's pieces are on consecutive lines)."""
    return re.sub(r"\s+", " ", re.sub(r"[│┃┏┓┗┛┡┩└┘┌┐├┤━─╇╈┳┻┼┬┴╋]", " ", out))


@pytest.mark.parametrize("columns", [80, 100, 60])
def test_profiles_list_never_cuts_a_number_or_a_status(tmp_path: Path, columns: int) -> None:
    db = tmp_path / "m.db"
    _fill(db)
    code, out = _run("profiles", "list", "--db", str(db), columns=columns)
    assert code == 0, out
    assert "…" not in out, out
    for number in ("6987.4", "±12.3", "123456.7", "±1234.5", "56.4", "4096", "16/2n", "h7168", "i18432", "e256"):
        assert number in out, (number, out)  # the shape's numbers too (18432 was split over two lines)
    assert out.count("current") == 3 and "measured" in out and "PRESET" in out, out
    if columns >= 80:  # at 60 even the fewest columns do not fit: printed wider, nothing cut
        _lines_fit(out, columns)
    if columns < 160:
        assert re.search(r"not shown at \d+ columns: .*updated", _unwrapped(out)), out


def test_profiles_list_shows_every_column_when_wide(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    _fill(db)
    code, out = _run("profiles", "list", "--db", str(db), columns=200)
    assert code == 0 and "…" not in out and "not shown" not in out, out
    for cell in ("6987.4 ±12.3", "bfloat16", "model:slingshot11-libfabric-a100x4", "fp-cli-012", "h7168 i18432 e256 k8"):
        assert cell in out, (cell, out)


def test_profiles_show_folds_a_long_value_at_60_columns(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    _fill(db)
    code, out = _run("profiles", "show", "2", "--db", str(db), columns=60)
    assert code == 0 and "…" not in out, out
    _lines_fit(out, 60)
    assert "123456.700 ± 1234.500" in out, out
    folded = [ln.split("│")[2].strip() for ln in out.splitlines() if ln.count("│") == 3]
    assert "model:slingshot11-libfabric-a100x4" in "".join(folded), out


def test_bench_list_at_80_columns_names_every_scenario_whole() -> None:
    code, out = _run("bench", "list", columns=80)
    assert code == 0 and "…" not in out, out
    _lines_fit(out, 80)
    for name in ("moe-megakernel-vs-unfused", "host-staged-fp8-pipelined", "ep-roundtrip-qwen3-s128"):
        assert name in out, (name, out)


def _render(width: int, cols, rows, **kw) -> str:
    buf = io.StringIO()
    print_table(Console(file=buf, width=width), cols, rows, **kw)
    return buf.getvalue()


def test_numbers_stay_whole_and_the_lowest_value_column_goes_first() -> None:
    cols = (Col("id", "num"), Col("status", "word"), Col("note"), Col("median µs", "num"), Col("p90 µs", "num"),
            Col("backend", drop=2), Col("updated", "num", drop=5))
    rows = [("1", "superseded", "a long note that can wrap anywhere at all", "1,234,567.8", "2,345,678.9",
             "model:slingshot11-libfabric-a100x4", "2026-12-05")]
    out = _render(70, cols, rows, title="t")
    _lines_fit(out, 70)
    assert "1,234,567.8" in out and "2,345,678.9" in out and "superseded" in out and "…" not in out, out
    assert "2026-12-05" not in out and "backend" in out, out
    assert "not shown at 70 columns: updated" in _unwrapped(out), out  # dropped first (5 > 2)
    out = _render(60, cols, rows, title="t")
    _lines_fit(out, 60)
    assert "1,234,567.8" in out and "2,345,678.9" in out and "superseded" in out and "…" not in out, out
    assert "not shown at 60 columns: backend, updated" in _unwrapped(out), out
    wide = _render(200, cols, rows, title="t")
    assert "2026-12-05" in wide and "not shown" not in wide and "a long note that can wrap anywhere at all" in wide


def test_a_table_that_cannot_fit_is_printed_wider_not_cut() -> None:
    cols = [Col(f"n{i}", "num") for i in range(6)]
    rows = [tuple(f"{i}12345678.9" for i in range(6))]
    out = _render(40, cols, rows)
    assert all(f"{i}12345678.9" in out for i in range(6)) and "…" not in out, out


def test_collapsed_padding_leaves_headers_whole_where_the_table_fits() -> None:
    """The tune table collapses its padding (one column between cells, not two): the helper counted two, so at 80
    columns it thought nine columns of 58 characters did not fit, narrowed them to their longest words and wrapped
    'default µs' onto two lines with room to spare."""
    from rich import box

    cols = (Col("family", "word"), Col("model", "word"), Col("S", "num"), Col("trials", "num"),
            Col("default µs", "num"), Col("best µs", "num"), Col("±", "num"), Col("×", "num"), Col("stored", "word"))
    rows = [("proxy:ibrc", "deepseek-v3", "4096", "2/0/0", "8,882.8", "8,880.5", "0.0", "1.00", "kept")]
    out = _render(80, cols, rows, title="t", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    _lines_fit(out, 80)
    assert "default µs" in out and "8,882.8" in out and "…" not in out, out


def test_tune_table_fits_80_columns_with_long_names(tmp_path: Path) -> None:
    """A long family and model (proxy:libfabric/cxi, custom:7168,2048,256,8) made the table 98 wide and its notes one
    135-wide line: the spread, the trial counts and the ratio give way (named), the notes wrap."""
    r = CliRunner().invoke(app, ["tune", "--backend", "model", "--preset", "slingshot11-libfabric-a100x4", "--model",
                                 "custom:7168,2048,256,8", "--tokens", "128", "--nodes", "2", "--trials", "2",
                                 "--db", str(tmp_path / "m.db")],
                           env={"COLUMNS": "80", "MOETUNE_HOME": str(tmp_path)})
    assert r.exit_code == 0, r.output
    _lines_fit(r.stdout, 80)
    assert "custom:7168,2048,256,8" in r.stdout and "not shown at 80 columns" in r.stdout, r.stdout


def test_a_stored_control_character_is_shown_not_obeyed(tmp_path: Path) -> None:
    """A profile written with a terminal escape in its backend (an import before imports refused them, or a direct
    write) cleared the screen and recoloured `profiles list` and `show`: tables write control characters as \\xNN."""
    db = tmp_path / "m.db"
    with Store(db) as s:
        key = ProfileKey(fingerprint="fp-esc", software="sw", transport_family="nvlink", ep_size=2, nodes=1,
                         hidden=7168, intermediate=2048, experts=256, topk=8, dtype="bfloat16", token_bucket=16)
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=5.0, spread_us=0.1,
                                    backend="local:\x1b[2J\x1b[31mclean", provenance="measured"))
    for args in (("profiles", "list"), ("profiles", "show", "1")):
        code, out = _run(*args, "--db", str(db), columns=200)
        assert code == 0, out
        assert "\x1b" not in out and "local:\\x1b[2J\\x1b[31mclean" in out, out


def test_the_tune_tables_note_says_a_written_row_was_stored() -> None:
    """Run 191 (H200): a row stored as new got the note "study best 198.2 µs; no current profile for this key", which
    reads as nothing stored; the note now says what was stored and why."""
    from moetune.tuner.cli.tune_notes import row_note

    row = {"family": "megakernel", "model": "qwen3-30b", "tokens": 16, "best_us": 199.1, "study_best_us": 198.2,
           "written": True, "reason": "no current profile for this key"}
    assert row_note(row) == ("megakernel qwen3-30b S=16: study best 198.2 µs in its search trial; stored 199.1 µs as "
                             "measured side by side (no current profile for this key)")
    assert row_note({**row, "study_best_us": 199.1}) is None
    kept = row_note({**row, "written": False, "reason": "the stored profile is faster"})
    assert kept is not None and kept.endswith("µs in its search trial; the stored profile is faster"), kept
