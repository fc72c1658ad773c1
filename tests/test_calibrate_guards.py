"""`moetune model calibrate` guards: rows whose time is not a finite number of µs or whose fabric is unknown are
refused naming the file and row; a fit error that is not a finite number is a problem (never written, the same
exit with --json, whose output stays valid JSON); --out never replaces a --data file, and another existing file
only with --replace, except the --preset file itself; a kept parameter is not labelled "calibrated:"."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.fabric_model import calibration
from moetune.tuner.fabric_model.calibration import calibrate, calibrated_preset, check_preset, read_rows
from moetune.tuner.fabric_model.presets import load_preset

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "tuner/fabric_model/presets/nvlink-h200x2.toml"
PROBE = ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl"
ROW = {"probe": "nccl_a2a", "fabric": "nvlink", "model": "qwen3-30b", "S": 4096, "world": 2, "ms": 0.29}


def _jsonl(path: Path, *rows: dict) -> Path:
    path.write_text("\n" + "\n".join(json.dumps(r) for r in rows) + "\n")  # a blank line first: rows from line 2
    return path


def _run(*args: str):
    r = runner.invoke(app, ["model", "calibrate", *args])
    return r, "".join(r.output.split())  # Rich wraps at the terminal width


def _strict_json(text: str) -> dict:
    def no(c: str) -> None:
        raise AssertionError(f"{c} in the JSON output")
    return json.loads(text, parse_constant=no)


@pytest.fixture
def no_fit(monkeypatch):
    """The CLI's fit replaced by the checks of the preset as it is (no search: the tests stay fast)."""
    monkeypatch.setattr(calibration, "calibrate", lambda preset, rows, **kw: check_preset(preset, rows, params=[]))


# -- 1. a time that is not a finite number of µs, an error that is not a finite number ------------------------------
@pytest.mark.parametrize("json_out", [False, True])
def test_ms_too_large_for_finite_us_is_refused_naming_file_and_row(tmp_path: Path, json_out: bool) -> None:
    data = _jsonl(tmp_path / "big.jsonl", {**ROW, "ms": 1e308}, ROW)
    out = tmp_path / "cal.toml"
    r, text = _run("-p", "nvlink-h200x2", "-d", str(data), "--out", str(out), *(["--json"] if json_out else []))
    assert r.exit_code == 2, r.output
    assert "".join(f"{data} row 2 (probe nccl_a2a): field 'ms' is 1e+308 ms".split()) in text, r.output
    assert not out.exists()
    with pytest.raises(ValueError, match="field 'ms' is 1e\\+308 ms, too large"):
        calibrate("nvlink-h200x2", [{**ROW, "ms": 1e308}])


@pytest.mark.parametrize("digits", [400, 5000])
def test_an_integer_too_large_for_a_float_is_refused_naming_file_and_row(tmp_path: Path, digits: int) -> None:
    data = tmp_path / "huge.jsonl"
    data.write_text(json.dumps(ROW).replace('"ms": 0.29', '"ms": 1' + "0" * digits) + "\n")
    r, text = _run("-p", "nvlink-h200x2", "-d", str(data))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "".join(f"{data}".split()) in text and ("field'ms'" in text or f"{data}:1:notJSON" in text), r.output


def test_a_non_finite_error_is_a_problem_never_written_same_exit_with_json(tmp_path: Path, no_fit) -> None:
    """A positive, finite but subnormal time: its relative error is inf. Refused, --force or not; --json gives the
    same exit and valid JSON (null for the non-finite numbers)."""
    data = _jsonl(tmp_path / "tiny.jsonl", ROW, {**ROW, "S": 8192, "ms": 5e-324})
    rep = check_preset("nvlink-h200x2", read_rows([data]), params=[])
    assert not rep.usable and any("not a finite number" in p for p in rep.problems), rep.problems
    out = tmp_path / "cal.toml"
    codes = []
    for extra in ([], ["--json"], ["--force"], ["--force", "--json"]):
        r, text = _run("-p", "nvlink-h200x2", "-d", str(data), "--out", str(out), *extra)
        codes.append(r.exit_code)
        assert not out.exists(), extra
        if "--json" in extra:
            d = _strict_json(r.stdout)
            assert d["usable"] is False and d["out"] is None and d["summary"]["max_abs_rel_err"] is None
        else:
            assert "notafinitenumber" in text and "notwritten" in text, r.output
    assert codes == [1, 1, 1, 1]


# -- 2. an unknown fabric ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fabric", ["host-staged", "NVLINK", ""])
def test_unknown_fabric_is_refused_naming_file_row_and_the_known_ones(tmp_path: Path, fabric: str) -> None:
    data = _jsonl(tmp_path / "typo.jsonl", {**ROW, "fabric": fabric})
    r, text = _run("-p", "nvlink-h200x2", "-d", str(data))
    assert r.exit_code == 2, r.output
    assert "".join(f"{data} row 2 (probe nccl_a2a): field 'fabric' must be one of nvlink, host_staged, collective, got "
                   f"{fabric!r}".split()) in text, r.output
    with pytest.raises(ValueError, match="must be one of nvlink, host_staged, collective"):
        calibrate("nvlink-h200x2", [{**ROW, "probe": "collective_a2a", "fabric": fabric}])


# -- 3. --out: never a --data file; another existing file only with --replace; the --preset file itself may be rewritten
def test_out_is_never_a_data_file(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "rows.jsonl", ROW)
    before = data.read_bytes()
    link = tmp_path / "link.toml"
    link.symlink_to(data)
    other = _jsonl(tmp_path / "other.jsonl", ROW)
    for out in (data, link, tmp_path / "sub" / ".." / "rows.jsonl"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        for extra in ([], ["--force"], ["--replace"], ["--json"]):
            r, text = _run("-p", "nvlink-h200x2", "-d", str(other), "-d", str(data), "--out", str(out), *extra)
            assert r.exit_code == 2, (out, extra, r.output)
            assert "isthe--datafile" in text, r.output
            assert data.read_bytes() == before


def test_an_existing_out_is_replaced_only_with_replace(tmp_path: Path, no_fit) -> None:
    """--replace, not --force: replacing an old file must not also mean writing a fit the checks refused."""
    data = _jsonl(tmp_path / "rows.jsonl", ROW)
    out = tmp_path / "cal.toml"
    out.write_text("mine\n")
    for extra in ([], ["--json"], ["--force"]):
        r, text = _run("-p", "nvlink-h200x2", "-d", str(data), "--out", str(out), *extra)
        assert r.exit_code == 2 and "alreadyexists:notreplaced(--replacereplacesit" in text, r.output
        assert out.read_text() == "mine\n"
    r, _ = _run("-p", "nvlink-h200x2", "-d", str(data), "--out", str(out), "--replace")
    assert r.exit_code == 0, r.output
    assert load_preset(str(out), fresh=True).calibration["points"] == 1


def test_out_is_never_a_sqlite_database(tmp_path: Path, no_fit) -> None:
    """A SQLite --out is refused before the fit (exit 2, naming it), --replace or --force or not, and the file is left
    as it was, as `profiles export` and `bench summarize --out` refuse a SQLite target: otherwise `--out moetune.db
    --replace` replaces moetune's profile database (any SQLite file) with a calibrated preset TOML, exit 0."""
    from moetune.tuner.store.store import Store

    data = _jsonl(tmp_path / "rows.jsonl", ROW)
    db = tmp_path / "moetune.db"
    Store(db).close()
    before = db.read_bytes()
    for extra in (["--replace"], ["--force", "--replace"], ["--replace", "--json"], []):
        r, text = _run("-p", "nvlink-h200x2", "-d", str(data), "--out", str(db), *extra)
        assert r.exit_code == 2, (extra, r.output)
        assert "".join(f"--out {db} is a SQLite database".split()) in text and "Traceback" not in r.output, r.output
        assert db.read_bytes() == before


def test_the_preset_file_itself_may_be_regenerated(tmp_path: Path, no_fit) -> None:
    data = _jsonl(tmp_path / "rows.jsonl", ROW)
    own = tmp_path / "mine.toml"
    own.write_text(SHIPPED.read_text())
    r, _ = _run("-p", str(own), "-d", str(data), "--out", str(own))
    assert r.exit_code == 0, r.output
    assert load_preset(str(own), fresh=True).calibration["points"] == 1
    # a shipped preset by name, --out its file (as its header says): allowed without --replace (checked only here:
    # no test writes the shipped file)
    from moetune.tuner.cli.model_calibrate import _check_calibrate_out

    _check_calibrate_out(SHIPPED, [data], "nvlink-h200x2", False)
    _check_calibrate_out(SHIPPED, [data], str(SHIPPED), False)


# -- 4. a kept parameter is not labelled "calibrated:" ---------------------------------------------------------------
def test_a_kept_parameter_loses_its_calibrated_label() -> None:
    rows = read_rows([PROBE])
    base = load_preset("nvlink-h200x2")
    old = "calibrated: fitted by `moetune model calibrate` on earlier.jsonl (2026-01-01)"
    preset = dataclasses.replace(base, sources={**base.sources, "proxy.fence_us": old,
                                                "proxy.poll_us": "assumed: 1 us"})
    rep = check_preset(preset, rows, params=["proxy.put_us", "proxy.fence_us", "proxy.poll_us"])
    assert {"proxy.fence_us", "proxy.poll_us"} <= set(rep.kept), rep.kept  # no probe row depends on them
    cal = calibrated_preset(rep, ["probe.jsonl"], "2026-12-05")
    src = cal.sources["proxy.fence_us"]
    assert src.startswith("kept: not constrained by probe.jsonl (2026-12-05)") and src.endswith(old), src
    assert cal.sources["proxy.poll_us"] == "assumed: 1 us"  # a kept non-calibrated source says where it is from
    # calibrated again and still kept: its "kept:" source stays, not nested
    rep2 = check_preset(cal, rows, params=["proxy.put_us", "proxy.fence_us"])
    assert calibrated_preset(rep2, ["later.jsonl"], "2026-12-06").sources["proxy.fence_us"] == src


def test_the_shipped_preset_labels_no_kept_parameter_calibrated() -> None:
    """On the rows its [calibration] names, every parameter the checks keep has a source other than
    "calibrated:", and its header's regenerate command names files that exist, --out being the preset itself."""
    header = "\n".join(ln for ln in SHIPPED.read_text().splitlines() if ln.startswith("#"))
    files = [ROOT / f for f in re.findall(r"--data (\S+)", header)]
    assert [f.name for f in files] == load_preset("nvlink-h200x2").calibration["data"]
    assert all(f.is_file() for f in files), files
    assert re.findall(r"--out (\S+)", header) == [str(SHIPPED.relative_to(ROOT))]
    preset = load_preset("nvlink-h200x2")
    rep = check_preset(preset, read_rows(files))
    assert set(rep.kept) == {"collective.sync_us", "proxy.fence_us"}
    for k in rep.kept:
        assert preset.sources[k].startswith("kept: not constrained by " + ", ".join(f.name for f in files)), k


_A2A = [{"probe": "nccl_a2a", "fabric": "nvlink", "model": "qwen3-30b", "S": s, "ms": ms}
        for s, ms in [(64, 0.05), (256, 0.09), (1024, 0.2), (4096, 0.7)]]


@pytest.mark.parametrize("params", [["collective.alpha_us", "collective.alpha_us"],
                                    ["nic.gbps+nic.qp_gbps", "nic.gbps"]])
def test_a_parameter_named_twice_is_refused(params: list[str]) -> None:
    """`--params collective.alpha_us,collective.alpha_us` gave the fit two identical columns: it took them for two
    parameters the rows cannot tell apart and kept the preset's value ("fitted to 63.89, where the rows cannot tell it
    apart from collective.alpha_us: the preset's value kept"), so the calibration was refused as a poor fit where
    `--params collective.alpha_us` fits it."""
    with pytest.raises(ValueError, match="named more than once"):
        calibrate("nvlink-h200x2", _A2A, params=params)


def test_cli_refuses_a_parameter_named_twice_before_any_fit(tmp_path: Path) -> None:
    data = tmp_path / "a2a.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _A2A))
    once = calibrate("nvlink-h200x2", _A2A, params=["collective.alpha_us"])
    assert once.fitted == ["collective.alpha_us"]  # fitted, not kept at the preset's value
    r = CliRunner().invoke(app, ["model", "calibrate", "-p", "nvlink-h200x2", "-d", str(data),
                                 "--params", "collective.alpha_us,collective.alpha_us"])
    assert r.exit_code == 2, r.output
    assert "'collective.alpha_us' is named more than once" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("extra", [["--force"], ["--replace"], ["--force", "--replace"], ["--force", "--json"]])
def test_force_or_replace_without_out_is_refused_before_the_fit(tmp_path: Path, extra: list[str]) -> None:
    """--force writes --out even when the fit is refused; --replace replaces an existing --out. Without --out, --force
    only turned a refused fit's exit 1 into 0 ("untrusted fit", nothing written): a script took a fit the checks
    refused for a success. Refused up front (exit 2), as --this-node without --out is."""
    bad = _jsonl(tmp_path / "a2a.jsonl", *_A2A)  # a poor fit of nvlink-h200x2's collective (refused without --force)
    r0 = CliRunner().invoke(app, ["model", "calibrate", "-p", "nvlink-h200x2", "-d", str(bad),
                                  "--params", "collective.alpha_us"])
    assert r0.exit_code == 1, r0.output
    r = CliRunner().invoke(app, ["model", "calibrate", "-p", "nvlink-h200x2", "-d", str(bad),
                                 "--params", "collective.alpha_us", *extra])
    assert r.exit_code == 2, r.output
    assert "on the --out file" in r.output and "give --out FILE" in r.output and "Traceback" not in r.output
