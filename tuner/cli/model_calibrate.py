"""`moetune model calibrate`: fit a preset's parameters to measurements, with the checks of its --data and --out."""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

import typer

from moetune.tuner.cli._args import path_option, path_text_option, write_error_code
from moetune.tuner.cli._tables import Col, print_table
from moetune.tuner.cli.db import abort
from moetune.tuner.cli.model_output import LABEL, check_out_file, console, esc

_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup


def _no_points(e: Any, data: list[Path], where: list[str], shown: int = 5) -> str:
    """Why `model calibrate` has nothing to fit: the files hold no rows, or each row's reason for being skipped
    (the first `shown`, by file and line)."""
    how = "the row formats: `moetune model calibrate --help`"
    if not e.rows:
        files = ", ".join(str(d) for d in data)
        return (f"--data {files}: no measurement rows ({'the file holds' if len(data) == 1 else 'the files hold'} "
                f"no JSON lines); each line is one JSON object ({how})")
    lines = [f"--data: no measurement rows the model can describe; all {e.rows} row(s) were skipped:"]
    lines += [f"  {where[n - 1] if n <= len(where) else f'row {n}'}: {why}" for n, why in e.skipped[:shown]]
    if len(e.skipped) > shown:
        lines.append(f"  ... and {len(e.skipped) - shown} more")
    return "\n".join([*lines, f"({how})"])


def _preset_file(preset: str) -> Path | None:
    """The file `--preset` names, as load_preset reads it (a path, or a shipped preset's file); None if none."""
    from moetune.tuner.fabric_model import presets

    if preset.endswith(".toml") or "/" in preset or Path(preset).is_file():
        return Path(preset)
    shipped = Path(presets.__file__).parent / f"{preset}.toml"
    return shipped if shipped.is_file() else None


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (through symlinks, `..` or a hard link)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def _check_calibrate_out(out: Path, data: list[Path], preset: str, replace: bool) -> None:
    """Refuse an --out whose write would destroy data, before the fit: a --data file (the measurements being read:
    never, --replace or not), or another existing file unless --replace. The --preset file itself may be rewritten:
    that is how a preset is regenerated (the shipped presets' headers say so). A SQLite database (moetune's profile
    database, say) is never replaced either, as `profiles export` and `bench summarize --out` refuse one."""
    for d in data:
        if _same_file(out, d):
            _fail(f"--out {out} is the --data file {d}: the measurements being read are never replaced; give "
                  "another file for the calibrated preset")
    from moetune.tuner.store._schema import is_sqlite_file

    if out.is_file() and is_sqlite_file(out):  # `--out moetune.db --replace` replaced the profile database, exit 0
        _fail(f"--out {out} is a SQLite database (a moetune profile database?): never replaced by a calibrated "
              "preset, --replace or not; give the TOML file to write")
    if not (out.exists() or out.is_symlink()) or replace:
        return
    pf = _preset_file(preset)
    if pf is None or not _same_file(out, pf):
        _fail(f"--out {out} already exists: not replaced (--replace replaces it; the --preset file itself may be "
              "given as --out to regenerate it)")


def calibrate_cmd(
    preset: str = path_text_option(..., "--preset", "-p", help="Preset to start from."),
    data: list[Path] = path_option(..., "--data", "-d", metavar=None, help="Measurement JSON lines (repeat for several files): one "
                                    "JSON object a line, naming what it measured: \"probe\" nccl_a2a, "
                                    "nccl_a2a_fp8payload or collective_a2a with fabric, model, S, ms (optional world, 2 where "
                                    "left out); "
                                    "\"probe\" proxy_ce with mode, size, transfers, us (optional pes, and qps, the streams it ran on, "
                                    "with abi, the library ABI it was measured at: up to 18 streams shared by every "
                                    "peer, the preset's nic.shared_qps; since 19 streams per peer); \"kind\" "
                                    "transfers with knobs, nodes, transfers, size, us (optional put_only). "
                                    "docs/fabric-model.md (Calibration) describes them."),
    out: Path | None = path_option(None, "--out", "-o", help="Write the calibrated preset TOML here."),
    params: str = typer.Option("", "--params", help="Comma-separated dotted parameters to fit (by data kind when left out or \"\")."),
    as_json: bool = typer.Option(False, "--json", help="Print the fit report as JSON."),
    nic_line_rate: float | None = typer.Option(
        None, "--nic-line-rate", help="The NIC port's line rate in Gb/s (as discovery reports it): a fitted nic.gbps "
        "or nic.qp_gbps above it is refused."),
    force: bool = typer.Option(False, "--force", help="Write --out even when the fit is refused (too few rows, a value "
                               "outside its physical bounds, a poor fit); the file carries the warning."),
    # its own option: replacing an old file must not also mean "write a fit the checks refused"
    replace: bool = typer.Option(False, "--replace", help="Replace an existing --out file (never a --data file nor a "
                                 "SQLite database; the --preset file itself may be rewritten without it)."),
    this_node: bool = typer.Option(False, "--this-node", help="The --data were measured on THIS node: --out records its "
                                   "fingerprint (live discovery), so `moetune tune --node-model` accepts the file as "
                                   "this node's model here, and nowhere else. Without it no node is recorded and "
                                   "--node-model refuses the file."),
) -> None:
    # help paragraphs on one line each: Rich prints a docstring's own line breaks as they are
    """Fit preset parameters to measurements and report the fit error per point and overall.

    A fit that cannot be trusted is refused: exit 1 naming the problem, and no --out written (unless --force)."""
    from moetune.tuner.fabric_model.calibration import NoPoints, calibrate, calibrated_preset, read_located

    # the same measurements given twice would count twice in the fit (40 points of 20)
    for i, d in enumerate(data):
        twice = next((e for e in data[:i] if _same_file(d, e)), None)
        if twice is not None:
            _fail(f"--data {d} is also given as --data {twice}: each file once (its rows would count twice)")
    # --force and --replace act on the --out file only: without one, --force turned a refused fit's exit 1 into 0
    # ("untrusted fit", nothing written), so a script read a fit the checks refused as a success
    inert = [(opt, what) for opt, on, what in (("--force", force, "--force writes it even when the fit is refused"),
                                                ("--replace", replace, "--replace replaces an existing one")) if on]
    if inert and out is None:
        _fail(f"{' and '.join(o for o, _ in inert)} {'act' if len(inert) > 1 else 'acts'} on the --out file "
              f"({'; '.join(w for _, w in inert)}): give --out FILE, or leave {'them' if len(inert) > 1 else 'it'} "
              "out")
    # a bad --out is refused before the fit, not after it
    if out is not None:
        check_out_file(out, "calibrated.toml")
        _check_calibrate_out(out, data, preset, replace)
    if nic_line_rate is not None and not (math.isfinite(nic_line_rate) and nic_line_rate > 0):
        _fail(f"--nic-line-rate must be a positive number of Gb/s, got {nic_line_rate!r}")
    fit = [p.strip() for p in params.split(",")] if params.strip() else []
    if any(not p for p in fit):  # a lost name, not one to skip: "," silently fitted by data kind instead
        _fail(f"--params: expected comma-separated dotted parameters, got {params!r} (an empty item); leave the "
              "option out (or give \"\") to fit by data kind")
    node_fp, node_family = None, None
    if this_node:
        if out is None:
            _fail("--this-node records the node in the --out file: give --out FILE")
        from moetune.tuner.fabric.discovery import live_facts
        from moetune.tuner.fabric.errors import DiscoveryError

        try:  # the node the file will be this node's model of (only it: another fingerprint is refused there)
            node = live_facts()
        except (DiscoveryError, OSError) as e:
            _fail(f"--this-node: live discovery failed, so the node cannot be recorded: {e}")
        node_fp = node.fingerprint
        from moetune.tuner.fabric_model.presets import load_preset, node_model_family

        try:
            node_family, no_family = node_model_family(load_preset(preset), node.transport_names)
        except (OSError, ValueError) as e:  # PresetError names the preset and what is wrong with it
            _fail(str(e))
        if node_family is None:  # before the fit: `tune --node-model` would refuse the file ("... not found")
            _fail(f"--this-node: {no_family}; `moetune tune --node-model` tunes only a family this node runs, so it "
                  "would refuse the file. Start from a preset of a family this node runs (--preset)")
    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt
    from moetune.tuner.cli._progress import RichProgress

    located: list[tuple[str, dict]] = []
    # the fit takes tens of seconds (the proxy probe's rows most): a task per group of rows on stderr, as `tune`
    # shows its studies; none with --json (as tune)
    bar = None if as_json else RichProgress(transient=True)
    # Ctrl-C, or SIGTERM: nothing is written before the fit ends
    kept = f"the fit was stopped; nothing written ({'--out ' + str(out) + ' untouched' if out is not None else 'no --out given'})"
    try:
        with ends_cleanly_on_interrupt(lambda: kept):
            try:
                located = read_located(data)
                rep = calibrate(preset, [row for _, row in located],
                                params=fit or None,
                                nic_line_rate_gbs=nic_line_rate / 8.0 if nic_line_rate is not None else None,
                                progress=bar)
            finally:
                if bar is not None:
                    bar.close()  # before any message below
    except NoPoints as e:
        _fail(_no_points(e, data, [where for where, _ in located]))
    except ValueError as e:
        _fail(str(e))
    s = rep.summary()
    # an error that is not a finite number checks nothing (the fit's problems say so): never written, --force or not
    unmeasured = not (math.isfinite(s["mean_abs_rel_err"]) and math.isfinite(s["max_abs_rel_err"]))
    refused = (not rep.usable and not force) or unmeasured
    written = out is not None and not refused
    relabelled = ""  # the family written, where it is not the preset's (`node_model_family`)
    if written:
        assert out is not None
        today = _dt.date.today().isoformat()
        cal = calibrated_preset(rep, [d.name for d in data], today, fingerprint=node_fp)
        if node_fp is not None and node_family != cal.family:
            # the family this node runs (gloo's collective on a node without GPUs), as the bring-up writes it:
            # `tune --node-model` tunes the file's family, and refused the base preset's (host_staged) here
            import dataclasses

            relabelled = f"family {node_family} (this node runs it; preset {cal.name} models {cal.family})"
            cal = dataclasses.replace(cal, family=node_family)
        from moetune.tuner.store.atomic_files import write_atomic

        try:  # atomic: --out may be the --preset file itself; Ctrl-C or a full disk must not leave it truncated
            write_atomic(out, cal.to_toml())
        except OSError as e:
            _fail(f"--out {out}: cannot write the calibrated preset ({e.strerror or e})", write_error_code(e))
    if as_json:
        # to_dict gives null for a non-finite number: JSON has no NaN, and a reader must not fail on it
        typer.echo(json.dumps({"label": LABEL, **rep.to_dict(), "out": str(out) if written else None,
                               "fingerprint": node_fp if written else None,
                               "family": node_family if written and node_fp else None}, allow_nan=False))
        if refused:
            raise typer.Exit(1)
        return
    def err_cell(e: float) -> str:
        c = "green" if abs(e) <= 0.2 else "red"
        return f"[{c}]{e:+.1%}[/{c}]"

    print_table(console, [Col("point", "text"), Col("measured µs", "num"), Col("modelled µs", "num"), Col("error", "num")],
                [(esc(p.label), f"{p.measured_us:,.1f}", f"{p.predicted_us:,.1f}", err_cell(p.rel_err))
                 for p in rep.points],
                title=f"calibration of {esc(rep.preset.name)}: measured vs {LABEL}")
    print_table(console, [Col("parameter", "word"), Col("before", "num"), Col("after", "num")],
                [(esc(k), f"{rep.params_before[k]:.4g}", f"{rep.params_after[k]:.4g}") for k in rep.fitted],
                title="fitted parameters")
    for g, v in s["by_group"].items():
        console.print(f"{esc(g)}: {v['points']} points, mean |error| {v['mean_abs_rel_err']:.1%}, "
                       f"max |error| {v['max_abs_rel_err']:.1%}")
    console.print(f"overall: {s['points']} points, mean |error| {s['mean_abs_rel_err']:.1%}, "
                   f"max |error| {s['max_abs_rel_err']:.1%}; skipped {s['skipped']}")
    for _row, why in rep.skipped[:5]:
        console.print(f"  skipped: {esc(why)}")
    for k, why in rep.kept.items():
        console.print(f"  kept at the preset's value: {esc(k)} ({esc(why)})")
    for why in rep.problems:
        console.print(f"[red]{'untrusted fit' if force and not unmeasured else 'calibration refused'}:[/red] {esc(why)}",
                       soft_wrap=True)
    if written:
        if rep.problems:
            console.print(f"[yellow]--force: written although the fit was refused; the file's {esc('[calibration]')} "
                           "warning says why[/yellow]")
        console.print(f"calibrated preset written to {esc(out)}", soft_wrap=True)  # a path stays whole
        node_said = (f"calibrated on node {node_fp}: `moetune tune --node-model` takes it as that node's model"
                     + (f", {esc(relabelled)}" if relabelled else ""))
        console.print(node_said if node_fp else "no node recorded (--this-node not given): `moetune tune --node-model` "
                       "refuses it; it is usable as a preset", soft_wrap=True)
    elif refused and out is not None:
        why = ("its error is not a finite number; --force does not write it" if unmeasured
               else "the fit is refused; --force writes it with the warning")
        console.print(f"not written: {esc(out)} ({why})", soft_wrap=True)
    if refused or not math.isfinite(s["max_abs_rel_err"]):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `calibrate` to the `moetune model` app."""
    app.command("calibrate")(calibrate_cmd)
