"""`moetune model ...` on bad input: a clear error naming the file, row, field or option, exit status 2,
no traceback; user-supplied text is never read as Rich markup."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.fabric_model.calibration import calibrate, read_rows
from moetune.tuner.fabric_model.presets import POSITIVE, PresetError, load_preset

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
IBRC = ROOT / "tuner/fabric_model/presets/ndr-ibrc-h100x8.toml"
GOOD_ROW = {"probe": "nccl_a2a", "fabric": "nvlink", "model": "qwen3-30b", "S": 4096, "world": 2, "ms": 0.29}


def _squash(text: str) -> str:
    # Rich wraps (and folds long paths) at the terminal width: compare without any whitespace
    return "".join(text.split())


def _run(*args: str):
    r = runner.invoke(app, ["model", *args])
    return r, _squash(r.output)


def _has(text: str, needle: str) -> bool:
    return _squash(needle) in text


def _assert_refused(r, text: str, *needles: str) -> None:
    assert r.exit_code == 2, r.output
    # an exit, never an exception escaping the command
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    for n in needles:
        assert _has(text, n), (n, r.output)


def _preset_variant(tmp_path: Path, name: str, line_re: str, replacement: str) -> Path:
    """The shipped ndr-ibrc-h100x8 preset with one line replaced."""
    text = IBRC.read_text()
    new, n = re.subn(line_re, replacement, text, count=1, flags=re.M)
    assert n == 1, line_re
    f = tmp_path / f"{name}.toml"
    f.write_text(new)
    return f


def _jsonl(tmp_path: Path, name: str, *rows: object, blank_first: bool = False) -> Path:
    f = tmp_path / name
    lines = ([""] if blank_first else []) + [json.dumps(r) for r in rows]
    f.write_text("\n".join(lines) + "\n")
    return f


# -- 1. calibrate: malformed rows, directories, binary files ---------------------------------------------
@pytest.mark.parametrize("row, needle", [
    ({"probe": "proxy_ce", "mode": "put_only"}, "(probe proxy_ce): missing field 'size'"),
    ({"probe": "nccl_a2a", "fabric": "nvlink", "model": "qwen3-30b", "S": 1024}, "(probe nccl_a2a): missing field 'ms'"),
    ({"kind": "transfers", "nodes": 2, "transfers": 8, "size": 4096,
      "knobs": {"transport": "proxy", "fence_mode": "proxy_drain"}}, "(probe transfers): missing field 'us'"),
    ({**GOOD_ROW, "ms": 0}, "(probe nccl_a2a): field 'ms' must be a positive number, got 0"),
    ({**GOOD_ROW, "ms": -1.5}, "(probe nccl_a2a): field 'ms' must be a positive number"),
    ({**GOOD_ROW, "ms": float("nan")}, "(probe nccl_a2a): field 'ms' must be a positive number"),
    ({**GOOD_ROW, "S": "4096"}, "(probe nccl_a2a): field 'S' must be a positive integer"),
    ({**GOOD_ROW, "S": 10.5}, "(probe nccl_a2a): field 'S' must be a positive integer"),
    ({"probe": "proxy_ce", "mode": "put_only", "size": 4096, "transfers": 0, "us": 3.0},
     "(probe proxy_ce): field 'transfers' must be a positive integer"),
])
def test_calibrate_malformed_row_names_file_row_and_field(tmp_path: Path, row: dict, needle: str) -> None:
    f = _jsonl(tmp_path, "m.jsonl", row, blank_first=True)  # a blank line first: the row is line 2
    r, text = _run("calibrate", "-p", "nvlink-h200x2", "-d", str(f))
    _assert_refused(r, text, f"{f} row 2 {needle}")


def test_calibrate_api_refuses_malformed_rows_by_index() -> None:
    with pytest.raises(ValueError, match=r"row 2 \(probe proxy_ce\): missing field 'size'"):
        calibrate("nvlink-h200x2", [GOOD_ROW, {"probe": "proxy_ce", "mode": "put_only"}])
    with pytest.raises(ValueError, match="field 'ms' must be a positive number"):
        calibrate("nvlink-h200x2", [{**GOOD_ROW, "ms": 0}])


def test_read_rows_keeps_unknown_probes_for_skipping(tmp_path: Path) -> None:
    f = _jsonl(tmp_path, "u.jsonl", {"probe": "mystery"}, {"probe": "peer_copy", "MB": 1, "ms": 2.0}, GOOD_ROW)
    assert len(read_rows([f])) == 3


def test_calibrate_out_directory_is_refused_before_the_fit(tmp_path: Path) -> None:
    f = _jsonl(tmp_path, "g.jsonl", GOOD_ROW)
    d = tmp_path / "outdir"
    d.mkdir()
    r, text = _run("calibrate", "-p", "nvlink-h200x2", "-d", str(f), "--out", str(d))
    _assert_refused(r, text, f"--out {d} is a directory")
    assert list(d.iterdir()) == []
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    r, text = _run("calibrate", "-p", "nvlink-h200x2", "-d", str(f), "--out", str(blocker / "cal.toml"))
    _assert_refused(r, text, f"{blocker} is a file, not a directory")


def test_calibrate_data_and_preset_directories_say_directory(tmp_path: Path) -> None:
    f = _jsonl(tmp_path, "g.jsonl", GOOD_ROW)
    d = tmp_path / "somedir"
    d.mkdir()
    r, text = _run("calibrate", "-p", "nvlink-h200x2", "-d", str(d))
    _assert_refused(r, text, f"measurement file '{d}' is a directory")
    assert not _has(text, "does not exist")
    r, text = _run("calibrate", "-p", str(d), "-d", str(f))
    _assert_refused(r, text, f"preset file '{d}' is a directory")
    assert not _has(text, "does not exist")


def test_binary_files_are_named(tmp_path: Path) -> None:
    blob = bytes([0x80, 0xFF, 0xFE, 0x00, 0xC3]) * 20
    data = tmp_path / "blob.jsonl"
    data.write_bytes(blob)
    r, text = _run("calibrate", "-p", "nvlink-h200x2", "-d", str(data))
    _assert_refused(r, text, f"measurement file '{data}' is not UTF-8 text")
    toml = tmp_path / "blob.toml"
    toml.write_bytes(blob)
    r, text = _run("predict", "-p", str(toml))
    _assert_refused(r, text, f"preset file '{toml}' is not UTF-8 text")
    assert not _has(text, "codec")


# -- 2. sweep --out: unsupported formats, directories, the real path --------------------------------------
def test_sweep_out_unsupported_format_is_refused_up_front(tmp_path: Path) -> None:
    out = tmp_path / "x.txt"
    r, text = _run("sweep", "-p", "slingshot11-libfabric-a100x4", "-n", "4", "-t", "256", "--out", str(out))
    _assert_refused(r, text, f"--out {out}", "'txt' is not supported", ".png", ".svg", ".pdf")
    assert not out.exists()
    assert not _has(text, "MODELLED")  # refused before the sweep ran


def test_sweep_out_directory_is_refused(tmp_path: Path) -> None:
    r, text = _run("sweep", "-p", "slingshot11-libfabric-a100x4", "-n", "4", "-t", "256", "--out", str(tmp_path))
    _assert_refused(r, text, f"--out {tmp_path} is a directory")
    assert not Path(str(tmp_path) + ".png").exists()


def test_sweep_out_without_suffix_prints_the_real_path(tmp_path: Path) -> None:
    out = tmp_path / "plot"
    r, text = _run("sweep", "-p", "slingshot11-libfabric-a100x4", "-n", "4", "-t", "256", "--out", str(out))
    assert r.exit_code == 0, r.output
    real = tmp_path / "plot.png"
    assert real.is_file()
    assert _has(text, f"written to {real}")


@pytest.mark.parametrize("name, real", [("thesis.pdf", "thesis.pdf"), ("plot", "plot.png"), ("link.svg", "link.svg")])
def test_sweep_out_replaces_an_existing_file_only_with_force(tmp_path: Path, name: str, real: str) -> None:
    """`model sweep --out thesis.pdf` must not replace an existing file with the plot without a word (as `profiles
    export` and `model calibrate` do not): refused up front, before the sweep, unless --force; the real file
    (FILE.png for a FILE without suffix; a symlink, which the write would replace) is the one checked."""
    out, path = tmp_path / name, tmp_path / real
    if name == "link.svg":
        path.symlink_to(tmp_path / "elsewhere.svg")  # dangling: still a file the write replaces
    else:
        path.write_text("thesis")
    args = ("sweep", "-p", "nvlink-h200x2", "--over", "tokens", "--out", str(out))
    r, text = _run(*args)
    where = f"--out {out}" if out == path else f"--out {out}: {path}"
    _assert_refused(r, text, f"{where} already exists: not replaced (--force replaces it)")
    assert not _has(text, "MODELLED")  # refused before the sweep ran
    if name == "link.svg":
        assert path.is_symlink() and not (tmp_path / "elsewhere.svg").exists()
    else:
        assert path.read_text() == "thesis"
    r, text = _run(*args, "--force")
    assert r.exit_code == 0 and _has(text, f"written to {path}"), r.output
    assert path.stat().st_size > 100


# -- 3. preset validation: divisors > 0, field types ------------------------------------------------------
def test_predict_with_zero_bandwidth_preset_is_refused(tmp_path: Path) -> None:
    f = _preset_variant(tmp_path, "hbm0", r"^hbm_gbps = .*$", "hbm_gbps = 0")
    r, text = _run("predict", "-p", str(f))
    _assert_refused(r, text, f"preset file '{f}'", "gpu.hbm_gbps must be > 0")


@pytest.mark.parametrize("dotted", sorted(POSITIVE))
def test_every_divided_by_parameter_must_be_positive(tmp_path: Path, dotted: str) -> None:
    section, key = dotted.split(".")
    text = IBRC.read_text()
    start = text.index(f"[{section}]")
    i = text.index(f"\n{key} = ", start) + 1
    j = text.index("\n", i)
    f = tmp_path / "zero.toml"
    f.write_text(text[:i] + f"{key} = 0" + text[j:])
    with pytest.raises(PresetError, match=rf"{re.escape(str(f))}.*{re.escape(dotted)} must be > 0"):
        load_preset(str(f))


@pytest.mark.parametrize("line_re, replacement, needle", [
    (r"^sms = .*$", 'sms = "many"', "gpu.sms must be an integer, got a string ('many')"),
    (r"^sms = .*$", "sms = 13.5", "gpu.sms must be an integer"),
    (r"^family = .*$", "family = 7", "family must be a string, got an integer (7)"),
    (r"^name = .*$", "name = 3", "name must be a string"),
    (r"^description = .*$", "description = true", "description must be a string"),
    (r"^hbm_gbps = .*$", 'hbm_gbps = "fast"', "gpu.hbm_gbps must be a number, got a string"),
    (r"^rtt_us = .*$", "rtt_us = true", "nic.rtt_us must be a number, got a boolean"),
    (r"^duplex = .*$", 'duplex = "yes"', "pcie.duplex must be a boolean, got a string"),
    (r"^serves_intra_node = .*$", "serves_intra_node = 1", "proxy.serves_intra_node must be a boolean"),
    (r"^gpus_per_node = .*$", "gpus_per_node = true", "gpus_per_node must be a positive integer"),
    (r"^transports = .*$", "transports = []", "transports must be a non-empty array"),
    (r"^transports = .*$", 'transports = "proxy"', "transports must be a non-empty array"),
    (r"^\[gpu\]$", "gpu = 5\n[gpu_unused]", "gpu must be a table"),
])
def test_preset_field_types_are_checked(tmp_path: Path, line_re: str, replacement: str, needle: str) -> None:
    f = _preset_variant(tmp_path, "typed", line_re, replacement)
    with pytest.raises(PresetError) as e:
        load_preset(str(f))
    assert f"preset file '{f}'" in str(e.value) and needle in str(e.value), str(e.value)
    r, text = _run("predict", "-p", str(f))
    _assert_refused(r, text, str(f))


def test_shipped_presets_still_load() -> None:
    from moetune.tuner.fabric_model.presets import list_presets

    for name in list_presets():
        assert load_preset(name).transports


# -- 4. sweep --values: predict's rules, exit 2 naming the option -----------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--values", "-5"], "group_size = -5"),
    (["--over", "tokens", "--values", "0"], "tokens = 0"),
    (["--over", "nodes", "--values", "0,1"], "nodes = 0"),
    (["--over", "tokens", "--values", "64,99999999"], "tokens = 99999999"),
    (["--over", "nodes", "--values", "3"], "nodes = 3"),  # 128 experts over 3 x 4 GPUs
])
def test_sweep_values_predict_refuses_are_refused(args: list[str], needle: str) -> None:
    # the swept variable's own option is refused beside --over (test_sweep_refuses_the_option_of_the_swept_variable)
    base = [x for opt, over in ((("-n", "4"), "nodes"), (("-t", "256"), "tokens")) if over not in args for x in opt]
    r, text = _run("sweep", "-p", "slingshot11-libfabric-a100x4", *base, *args)
    _assert_refused(r, text, "--values", needle)
    assert not _has(text, "n/a")


def test_sweep_keeps_na_for_settings_one_mode_cannot_run() -> None:
    # round_robin over 2 QPs is valid with proxy_drain, unsafe with nic_ordered: n/a there, not an error; group
    # size 3 runs (the runtime's proxy sends a last partial group, it need not divide the 14 PUTs per peer of
    # chunk_tokens 8; with chunk_tokens 0 there is one PUT per peer and a group size above 1 is n/a)
    r = runner.invoke(app, ["model", "sweep", "-p", "slingshot11-libfabric-a100x4", "-n", "4", "-t", "256",
                            "--knobs", "fence_mode=proxy_drain,qp_mapping=round_robin,qps_per_pe=2,chunk_tokens=8",
                            "--values", "1,3", "--json"])
    assert r.exit_code == 0, r.output
    series = json.loads(r.stdout)["series"]
    assert all("error" not in x for x in series["decoupled/proxy_drain"])
    assert all("error" in x for x in series["decoupled/nic_ordered"])


# -- 5. user-supplied text is never Rich markup -----------------------------------------------------------
def test_markup_in_a_preset_name_is_printed_as_typed(tmp_path: Path) -> None:
    f = _preset_variant(tmp_path, "markup", r"^name = .*$", 'name = "[/red][bold]odd"')
    r, text = _run("predict", "-p", str(f), "-n", "2")
    assert r.exit_code == 0, (r.output, r.exception)
    assert _has(text, "[/red][bold]odd") and _has(text, "MODELLED")
    r, text = _run("sweep", "-p", str(f), "-n", "2", "-t", "256", "--values", "1,2")
    assert r.exit_code == 0, (r.output, r.exception)
    assert _has(text, "[/red][bold]odd")


def test_markup_in_data_rows_is_printed_as_typed(tmp_path: Path) -> None:
    f = _jsonl(tmp_path, "odd[red].jsonl", {"probe": "[/red]"}, GOOD_ROW)
    # one row is refused as a fit (tuner/fabric_model/calibration.py); --force writes it, printing the problem
    r, text = _run("calibrate", "-p", "nvlink-h200x2", "-d", str(f), "--params", "collective.alpha_us",
                   "--out", str(tmp_path / "[bold]cal.toml"), "--force")
    assert r.exit_code == 0, (r.output, r.exception)
    assert _has(text, "untrusted fit: too few measured rows")
    assert _has(text, "skipped: unknown probe '[/red]'")
    assert _has(text, f"written to {tmp_path / '[bold]cal.toml'}")


def test_markup_in_a_bad_preset_argument_is_an_error_not_a_crash() -> None:
    # relies on fail() printing its message as plain text (tuner/cli/db.py)
    r, text = _run("predict", "-p", "[/red]")
    _assert_refused(r, text, "preset file '[/red]' does not exist")


def test_calibrate_refuses_one_data_file_given_twice(tmp_path: Path) -> None:
    """`-d F -d F` (or a link to F) counted every row twice: 40 points of 20."""
    f = _jsonl(tmp_path, "m.jsonl", GOOD_ROW)
    link = tmp_path / "link.jsonl"
    link.symlink_to(f)
    for other in (f, link):
        r, text = _run("calibrate", "-p", "nvlink-h200x2", "-d", str(f), "-d", str(other))
        _assert_refused(r, text, f"--data {other} is also given as --data {f}: each file once")


def test_sweep_values_given_twice_are_swept_once_with_a_note() -> None:
    """`model sweep --values 0,0,0` printed the same row three times (and plotted one point three times): one point
    each, with a note, as token counts sharing a bucket are tuned once."""
    r = runner.invoke(app, ["model", "sweep", "-p", "nvlink-h200x2", "--values", "0,2,0,0", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert all([row["x"] for row in rows] == [0, 2] for rows in d["series"].values()), d["series"]
    assert "--values: 0 given 3 times, swept once" in d["notes"], d["notes"]
    r, text = _run("sweep", "-p", "nvlink-h200x2", "--values", "0,0,0")
    assert r.exit_code == 0, r.output
    assert _has(text, "note: --values: 0 given 3 times, swept once")
    assert len(re.findall(r"^│\s*0\s*│", r.output, flags=re.M)) == 1, r.output  # one row of group_size 0


def test_sweep_force_without_out_is_refused(tmp_path: Path) -> None:
    """`model sweep --force` without --out did nothing, silently (exit 0): refused as `model calibrate --force`
    without --out is."""
    r, text = _run("sweep", "-p", "nvlink-h200x2", "--force")
    _assert_refused(r, text, "--force acts on the --out file", "give --out FILE")
    r, _ = _run("sweep", "-p", "nvlink-h200x2", "--force", "--out", str(tmp_path / "s.png"))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("over,given", [("nodes", ("--nodes", "3")), ("nodes", ("-n", "2")),
                                        ("tokens", ("-t", "5")), ("tokens", ("--tokens", "256"))])
def test_sweep_refuses_the_option_of_the_swept_variable(over: str, given: tuple[str, str]) -> None:
    """`model sweep --over tokens -t 5` ignored -t without a word, and `--over nodes -n 3` (2 GPUs a node) failed
    "128 experts do not divide evenly over an EP group of 6", a point the sweep never models: both refused, naming
    the option, before anything is predicted."""
    r, text = _run("sweep", "-p", "nvlink-h200x2", "--over", over, *given)
    _assert_refused(r, text, f"--{over}: --over {over} sweeps it")


@pytest.mark.parametrize("params", [",", "collective.alpha_us,", "collective.alpha_us,,collective.intra_gbps"])
def test_calibrate_refuses_an_empty_item_in_params(tmp_path: Path, params: str) -> None:
    """`calibrate --params ,` fitted by data kind, as if the option were left out, and an empty item beside a name was
    dropped without a word: a lost name is a typo, refused as `--values 1,,2` is (exit 2, nothing fitted)."""
    f = _jsonl(tmp_path, "rows.jsonl", GOOD_ROW)
    r, text = _run("calibrate", "-p", "nvlink-h200x2", "-d", str(f), "--params", params)
    _assert_refused(r, text, "--params: expected comma-separated dotted parameters", "(an empty item)")
