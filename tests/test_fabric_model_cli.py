"""`moetune model ...`: predict, sweep, presets, calibrate; every number labelled MODELLED."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from typer.testing import CliRunner

from moetune.tuner.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def _expected_puts(tokens: int, p: float, chunk: int) -> float:
    """E[ceil(X / chunk)] for X ~ Binomial(tokens, p): the PUTs the engine sends a peer on average (by hand)."""
    return sum(math.exp(math.lgamma(tokens + 1) - math.lgamma(k + 1) - math.lgamma(tokens - k + 1) + k * math.log(p)
                        + (tokens - k) * math.log1p(-p)) * -(-k // chunk) for k in range(1, tokens + 1))


def test_predict_json_is_labelled_modelled() -> None:
    r = runner.invoke(app, ["model", "predict", "--preset", "slingshot11-libfabric-a100x4", "--model", "qwen3-30b",
                            "--nodes", "8", "--tokens", "1024", "--knobs", "signalling=decoupled,fence_mode=nic_ordered",
                            "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["label"] == "MODELLED" and d["modelled"] is True
    for key in ("latency_us", "dispatch_us", "combine_us", "fences", "proxy_stalls", "nic_stalls",
                "bytes_on_wire", "phases"):
        assert key in d
    assert d["proxy_stalls"] == 0 and d["nic_stalls"] == d["fences"]


def test_predict_table_says_modelled() -> None:
    r = runner.invoke(app, ["model", "predict", "-p", "ndr-ibrc-h100x8", "-n", "4", "-t", "256", "--routing", "zipf:1.2"])
    assert r.exit_code == 0, r.output
    assert "MODELLED" in r.output and "fences" in r.output


def test_unsafe_and_nonsense_input_are_clear_errors() -> None:
    cases = [
        (["--knobs", "fence_mode=nic_ordered,qp_mapping=round_robin,qps_per_pe=2"], "unsafe"),
        (["--tokens", "-5"], "--tokens must be >= 1"),
        (["--knobs", "bogus=1"], "unknown knob"),
    ]
    for extra, msg in cases:
        r = runner.invoke(app, ["model", "predict", "-p", "slingshot11-libfabric-a100x4", "-n", "4", *extra])
        assert r.exit_code == 2, (extra, r.output)
        assert msg in r.output.replace("\n", " "), (extra, r.output)
        assert "Traceback" not in r.output
    # the runtime's proxy sends a last partial group: a group size need not divide the PUTs per peer
    r = runner.invoke(app, ["model", "predict", "-p", "slingshot11-libfabric-a100x4", "-n", "4",
                            "--knobs", "signalling=decoupled,group_size=3"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["model", "predict", "-p", "no-such", "-n", "4"])
    assert r.exit_code == 2 and "unknown preset" in r.output


def test_sweep_table_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    r = runner.invoke(app, ["model", "sweep", "-p", "slingshot11-libfabric-a100x4", "--over", "group_size",
                            "-n", "4", "-t", "256", "--knobs", "chunk_tokens=8", "--out", str(png), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["label"] == "MODELLED"
    rows = d["series"]["decoupled/nic_ordered"]
    # 256 tokens x P(one of 8 of 128 experts on a PE of 16) = 105.5 rows per peer -> 106 / 8 = 14 PUTs of 8 rows:
    # the default grid is the divisors of 14; fences = 12 remote peers x ceil(14 / g) x (dispatch + combine)
    rows_per_peer = 256 * (1 - math.comb(120, 8) / math.comb(128, 8))
    puts = math.ceil(math.ceil(rows_per_peer) / 8)
    assert puts == 14
    assert [x["x"] for x in rows] == [1, 2, 7, 14]
    # fences: 12 remote peers + this PE's PUTs to itself (14), dispatch + combine. A remote peer gets X ~ Binomial(256,
    # p) rows, ceil(X / 8) PUTs: 13.63 on average, 164 for the 12 (13 or 14 each), so one signal a PUT (g = 1) is
    # 164 + 14 fences, and larger groups ceil(13 / g) = ceil(14 / g) each
    p = rows_per_peer / 256
    assert round(12 * _expected_puts(256, p, 8)) == 164
    assert [x["fences"] for x in rows] == [2 * (164 + 14)] + [2 * 13 * math.ceil(puts / g) for g in (2, 7, 14)]
    assert [x["fences"] for x in rows] == [356, 182, 52, 26]
    assert png.stat().st_size > 1000
    r = runner.invoke(app, ["model", "sweep", "-p", "slingshot11-libfabric-a100x4", "--over", "nodes",
                            "--values", "2,4"])
    assert r.exit_code == 0 and "MODELLED" in r.output
    r = runner.invoke(app, ["model", "sweep", "-p", "slingshot11-libfabric-a100x4", "--over", "colour"])
    assert r.exit_code == 2


def test_presets_listing() -> None:
    r = runner.invoke(app, ["model", "presets", "--json"])
    assert r.exit_code == 0
    names = {p["name"] for p in json.loads(r.stdout)}
    assert {"slingshot11-libfabric-a100x4", "ndr-ibrc-h100x8", "ndr-ibgda-h100x8", "pcie4-consumer-4090x4",
            "nvlink-h200x2"} <= names


def test_calibrate_writes_a_loadable_preset(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    lines = [ln for ln in (ROOT / "bench/results/2026-11-30_h200x2_nccl_baseline.jsonl").read_text().splitlines()
             if '"host_staged"' in ln and '"qwen3-30b"' in ln]
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "new.toml"
    r = runner.invoke(app, ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(data), "--out", str(out),
                            "--params", "collective.host_alpha_us,pcie.h2d_gbps", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["summary"]["points"] == 8 and d["summary"]["max_abs_rel_err"] < 0.2
    from moetune.tuner.fabric_model.presets import load_preset

    assert load_preset(str(out)).calibration["points"] == 8
    r = runner.invoke(app, ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_calibrate_refuses_an_untrusted_fit_unless_forced(tmp_path: Path) -> None:
    """One proxy-probe row: exit 1 naming the problem, no --out written; --force writes it with the warning."""
    row = next(ln for ln in (ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl").read_text().splitlines()
               if '"coupled_drain"' in ln)
    data = tmp_path / "one.jsonl"
    data.write_text(row + "\n")
    out = tmp_path / "node.toml"
    args = ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(data), "--out", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    flat = " ".join(r.output.split())
    assert "calibration refused: too few measured rows" in flat and "not written" in flat
    assert not out.exists()
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert d["usable"] is False and d["out"] is None and d["problems"][0].startswith("too few measured rows")
    assert not out.exists()
    r = runner.invoke(app, [*args, "--force"])
    assert r.exit_code == 0, r.output
    from moetune.tuner.fabric_model.presets import load_preset

    assert load_preset(str(out)).calibration["warning"].startswith("UNTRUSTED FIT, written with --force")


def test_calibrate_nic_line_rate_option(tmp_path: Path) -> None:
    rows = [ln for ln in (ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl").read_text().splitlines() if ln]
    data = tmp_path / "probe.jsonl"
    data.write_text("\n".join(rows) + "\n")
    base = ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(data), "--params", "nic.gbps+nic.qp_gbps,proxy.put_us"]
    assert runner.invoke(app, base).exit_code == 0
    r = runner.invoke(app, [*base, "--nic-line-rate", "100"])  # 12.5 GB/s: below the copy engines' ~300 GB/s fit
    assert r.exit_code == 1 and "line rate 12.5 GB/s" in " ".join(r.output.split()), r.output
    r = runner.invoke(app, [*base, "--nic-line-rate", "-1"])
    assert r.exit_code == 2 and "--nic-line-rate must be a positive number" in r.output


def test_predict_layout_option() -> None:
    """--layout auto|packed|dense: Workload(dense=None/False/True) for the collective transports. nvlink-h200x2,
    qwen3-30b S=4096, EP 2: the runtime's rule runs dense there, so auto and dense agree and packed differs."""
    base = ["model", "predict", "-p", "nvlink-h200x2", "-t", "4096", "-k", "transport=collective", "--json"]
    got = {}
    for layout in ("auto", "packed", "dense"):
        r = runner.invoke(app, [*base, "--layout", layout])
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        assert d["workload"]["layout"] == layout and d["label"] == "MODELLED"
        got[layout] = d["dispatch_us"]
    assert got["auto"] == got["dense"] != got["packed"]
    assert "dispatch.counts" in json.loads(runner.invoke(app, [*base, "--layout", "packed"]).stdout)["phases"]
    r = runner.invoke(app, [*base, "--layout", "sparse"])
    assert r.exit_code == 2 and "--layout must be auto, packed or dense" in r.output
    r = runner.invoke(app, ["model", "predict", "-p", "nvlink-h200x2", "-t", "4096", "--layout", "packed"])
    assert r.exit_code == 2 and "collective transports" in r.output.replace("\n", " "), r.output
    assert "--layout" in runner.invoke(app, ["model", "predict", "--help"]).output


def test_fabric_model_doc_gives_the_packed_layout_command() -> None:
    """docs/fabric-model.md states the packed layout's dispatch with the command that reproduces it."""
    import re

    text = re.sub(r"\s+", " ", (ROOT / "docs" / "fabric-model.md").read_text())
    m = re.search(r"the packed layout's dispatch is ([\d.]+) µs \(`(moetune model predict [^`]*--layout packed[^`]*)`", text)
    assert m, "no command for the packed layout's dispatch"
    r = runner.invoke(app, [*m.group(2).split()[1:], "--json"])
    assert r.exit_code == 0, r.output
    assert f"{json.loads(r.stdout)['dispatch_us']:.1f}" == m.group(1)


def test_predict_and_sweep_name_the_preset_file_and_a_forced_fits_warning(tmp_path: Path) -> None:
    """A calibrated or forced copy keeps the shipped preset's name: `model predict/sweep` said "nvlink-h200x2" for
    three different predictions (shipped, calibrated, `calibrate --force`), with no word of an untrusted fit."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import daemon_fakes as F

    forced = F.write_forced_preset(tmp_path / "forced.toml")
    r = runner.invoke(app, ["model", "predict", "-p", str(forced), "-k", "transport=collective", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["preset_file"] == str(forced) and d["preset_warning"].startswith("UNTRUSTED FIT"), d
    r = runner.invoke(app, ["model", "predict", "-p", str(forced), "-k", "transport=collective"], env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "forced.toml) · UNTRUSTED FIT, written with --force" in text, r.output
    r = runner.invoke(app, ["model", "sweep", "-p", str(forced), "--over", "tokens", "--values", "128,256", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["preset_warning"].startswith("UNTRUSTED FIT"), r.output
    r = runner.invoke(app, ["model", "predict", "-p", "nvlink-h200x2", "--json"])
    assert json.loads(r.stdout)["preset_file"] is None and json.loads(r.stdout)["preset_warning"] is None


def _host_staged_rows(tmp_path: Path) -> Path:
    """The shared baseline's 8 host_staged qwen3-30b rows (world 2): a fit of seconds."""
    data = tmp_path / "rows.jsonl"
    lines = [ln for ln in (ROOT / "bench/results/2026-11-30_h200x2_nccl_baseline.jsonl").read_text().splitlines()
             if '"host_staged"' in ln and '"qwen3-30b"' in ln]
    data.write_text("\n".join(lines) + "\n")
    return data


def test_calibrate_shows_its_progress_on_stderr(tmp_path: Path) -> None:
    """The fit ran ~30 s with nothing shown: a task per group of rows fitted, its steps counted, on stderr; stdout
    holds only the report, and --json's one object (no progress with --json, as `tune`)."""
    import re

    args = ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(_host_staged_rows(tmp_path)),
            "--params", "collective.host_alpha_us,pcie.h2d_gbps"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "fit collective/host_staged (2 parameter(s), 8 row(s)): started, 0/40 done" in r.stderr, r.stderr
    assert re.search(r"fit collective/host_staged \(2 parameter\(s\), 8 row\(s\)\): 40/40 done", r.stderr), r.stderr
    assert "fit collective" not in r.stdout and "calibration of nvlink-h200x2" in r.stdout
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["summary"]["points"] == 8 and r.stderr == ""


def test_calibrate_interrupted_says_nothing_was_written(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C in the fit ended with no word (Typer's bare exit 130): one line saying nothing was written, exit 130
    (143 for SIGTERM), as `tune`."""
    from moetune.tuner.fabric_model import calibration
    from moetune.tuner.search.workers import Terminated

    out = tmp_path / "new.toml"
    args = ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(_host_staged_rows(tmp_path)), "--out", str(out)]
    for raised, code, said in ((KeyboardInterrupt, 130, "interrupted"), (Terminated, 143, "terminated (SIGTERM)")):
        def stop(*_a, _e=raised, **_k):
            raise _e()

        monkeypatch.setattr(calibration, "_objective", stop)  # inside the fit's search
        r = runner.invoke(app, args)
        assert r.exit_code == code, (r.output, r.exception)
        last = r.stderr.strip().splitlines()[-1]  # after the progress lines
        assert last == f"{said}: the fit was stopped; nothing written (--out {out} untouched)", r.stderr
        assert "Aborted" not in r.output and "Traceback" not in r.output
        assert not out.exists()


def test_predict_and_sweep_note_a_scale_beyond_the_calibration(tmp_path: Path) -> None:
    """nvlink-h200x2 was calibrated on 2-GPU rows ([calibration] world = 2): a prediction for 64 GPUs says it
    extrapolates (text and JSON); at its own scale, or on a preset that records no measured scale, nothing."""
    wide = {"COLUMNS": "300"}
    note = ("preset nvlink-h200x2 was calibrated on measurements of at most 2 ranks ([calibration] world = 2); at 64 GPUs this prediction "
            "extrapolates 32x beyond the measured scale")
    # collective: the nvlink transport serves at most 8 ranks (the runtime's one-sided limit), so it is refused at 64
    wide64 = ["model", "predict", "-p", "nvlink-h200x2", "-g", "64", "-k", "transport=collective"]
    r = runner.invoke(app, wide64, env=wide)
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[-2] == f"note: {note}" and lines[-1].startswith("MODELLED: predicted by the fabric model"), lines[-3:]
    r = runner.invoke(app, [*wide64, "--json"])
    assert json.loads(r.stdout)["extrapolation"] == note
    for args in (["-p", "nvlink-h200x2"], ["-p", "ndr-ibgda-h100x8", "-n", "8"]):  # 2 GPUs; 64, no scale recorded
        r = runner.invoke(app, ["model", "predict", *args], env=wide)
        assert r.exit_code == 0 and "extrapolates" not in r.output, r.output
        assert json.loads(runner.invoke(app, ["model", "predict", *args, "--json"]).stdout)["extrapolation"] is None
    sweep = ["model", "sweep", "-p", "nvlink-h200x2", "-g", "8", "--over", "tokens", "--values", "128,256"]
    r = runner.invoke(app, sweep, env=wide)
    said = ("preset nvlink-h200x2 was calibrated on measurements of at most 2 ranks ([calibration] world = 2); at 8 GPUs this sweep extrapolates "
            "4x beyond the measured scale")
    assert r.exit_code == 0 and f"note: {said}" in r.stdout.splitlines(), r.output
    assert json.loads(runner.invoke(app, [*sweep, "--json"]).stdout)["extrapolation"] == said
    r = runner.invoke(app, ["model", "sweep", "-p", "nvlink-h200x2", "--over", "tokens", "--values", "128", "--json"])
    assert json.loads(r.stdout)["extrapolation"] is None


def test_calibrate_records_the_scale_its_rows_measured(tmp_path: Path) -> None:
    """--out records the most GPUs a fitted row measured ([calibration] world) where the rows say it, and nothing
    where they do not (the proxy probe's rows name no world): no scale is guessed."""
    from moetune.tuner.fabric_model.calibration_record import calibrated_world
    from moetune.tuner.fabric_model.presets import load_preset

    out = tmp_path / "new.toml"
    r = runner.invoke(app, ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(_host_staged_rows(tmp_path)),
                            "--out", str(out), "--params", "collective.host_alpha_us,pcie.h2d_gbps", "--json"])
    assert r.exit_code == 0, r.output
    assert load_preset(str(out)).calibration["world"] == 2 == calibrated_world(load_preset(str(out)))
    row = next(ln for ln in (ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl").read_text().splitlines()
               if '"coupled_drain"' in ln)
    data = tmp_path / "one.jsonl"
    data.write_text(row + "\n")
    forced = tmp_path / "forced.toml"
    r = runner.invoke(app, ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(data), "--out", str(forced),
                            "--force"])
    assert r.exit_code == 0, r.output
    assert "world" not in load_preset(str(forced)).calibration and calibrated_world(load_preset(str(forced))) is None
    bad = tmp_path / "bad.toml"
    bad.write_text(out.read_text().replace("world = 2", "world = 0"))
    r = runner.invoke(app, ["model", "predict", "-p", str(bad)])
    assert r.exit_code == 2 and "calibration.world" in r.output and "positive integer" in r.output, r.output


def _full_disk(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A full disk: a plain write truncates the file, then fails; an atomic write fails before its rename."""
    import errno
    import os

    def enospc(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def write_text(self: Path, *_a: object, **_k: object) -> None:
        self.open("w").close()  # open(..., "w") truncated it before the first byte failed
        enospc()

    monkeypatch.setattr(Path, "write_text", write_text)
    monkeypatch.setattr(os, "fsync", enospc)


def test_calibrate_out_is_replaced_atomically(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--out` may be the --preset file itself (or an earlier calibration): a full disk or Ctrl-C mid-write leaves the
    earlier file whole (not truncated, as Path.write_text would), the error is one line, no temporary file left."""
    from moetune.tuner.fabric_model.presets import load_preset

    data = _host_staged_rows(tmp_path)
    out = tmp_path / "mine.toml"
    out.write_text(load_preset("nvlink-h200x2").to_toml())  # calibrated in place: --preset and --out one file
    before = out.read_bytes()
    _full_disk(monkeypatch)
    r = runner.invoke(app, ["model", "calibrate", "-p", str(out), "--data", str(data), "--out", str(out),
                            "--params", "collective.host_alpha_us,pcie.h2d_gbps"])
    assert r.exit_code == 1, r.output  # a full disk: the write failed, not the path given
    assert "cannot write the calibrated preset (No space left on device)" in " ".join(r.output.split())
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.toml", "rows.jsonl"]


def test_calibrate_out_through_a_symlink_replaces_the_file_it_names(tmp_path: Path) -> None:
    """An --out that is a link (to the node model the daemon reads, say): the atomic write replaced the link itself
    with a regular file, so the file it named kept the old calibration. The link stays; its file gets the new one."""
    data = tmp_path / "rows.jsonl"
    lines = [ln for ln in (ROOT / "bench/results/2026-11-30_h200x2_nccl_baseline.jsonl").read_text().splitlines()
             if '"host_staged"' in ln and '"qwen3-30b"' in ln]
    data.write_text("\n".join(lines) + "\n")
    real = tmp_path / "models" / "node.toml"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "current.toml"
    link.symlink_to(real)
    r = runner.invoke(app, ["model", "calibrate", "-p", "nvlink-h200x2", "--data", str(data), "--out", str(link),
                            "--replace", "--params", "collective.host_alpha_us,pcie.h2d_gbps"])
    assert r.exit_code == 0, r.output
    from moetune.tuner.fabric_model.presets import load_preset

    assert link.is_symlink() and link.resolve() == real.resolve()
    assert load_preset(str(real), fresh=True).calibration["points"] == 8
    assert sorted(p.name for p in real.parent.iterdir()) == ["node.toml"]  # no temporary file left


def test_sweep_plot_that_cannot_be_saved_leaves_the_earlier_plot_whole(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`model sweep --out plot.png` renders the figure in memory and replaces the file atomically: saved with
    fig.savefig(path), a full disk (or Ctrl-C) mid-save would leave the earlier plot of that name truncated."""
    import errno

    from PIL import Image

    out = tmp_path / "plot.png"
    args = ["model", "sweep", "-p", "nvlink-h200x2", "-n", "1", "--over", "tokens", "--out", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and out.stat().st_size > 1000, r.output
    before = out.read_bytes()
    save = Image.Image.save

    def enospc(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def full_disk_save(self, fp, *a, **k):  # type: ignore[no-untyped-def]
        if isinstance(fp, str | os.PathLike):  # a file: opened (truncated), then the disk is full
            with open(fp, "wb") as f:
                f.write(b"\x89PNG")
            enospc()
        return save(self, fp, *a, **k)  # memory: rendered whole

    monkeypatch.setattr(Image.Image, "save", full_disk_save)
    monkeypatch.setattr(os, "fsync", enospc)  # the atomic write fails before its rename
    r = runner.invoke(app, [*args, "--force"])
    assert r.exit_code == 1 and "cannot write the plot (No space left on device)" in " ".join(r.output.split()), r.output
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]  # no temporary file left
