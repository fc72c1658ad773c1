"""`moetune fabric`: Discover this node's fabric, capture it, fingerprint it, diff it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from moetune.tuner.cli._args import path_arg, path_option, write_error_code
from moetune.tuner.cli._tables import Col, fit_table, print_table
from moetune.tuner.cli.db import db_flag, db_path, err, fail, open_store

app = typer.Typer(help="Discover this node's fabric, capture it, fingerprint it, diff it.", no_args_is_help=True)



def _out() -> Console:
    """stdout at the terminal's width (COLUMNS, else 80 in a pipe), read when printing: it was 160 columns in a
    pipe, so the tables were laid out wider than the 80 of a CI log."""
    return Console(highlight=False)


_fail = fail  # the CLI's one error message (escaped: a capture path in brackets is text)


_TIMEOUT_HELP = "Seconds each external command (nvidia-smi, fi_info, ...) may take: 0.1 to 60, fractions allowed."


def _check_timeout(value: float) -> float:
    """Click's range check refused NaN with a message about the upper bound only, and no message said the unit."""
    if not (math.isfinite(value) and 0.1 <= value <= 60.0):
        raise typer.BadParameter(f"must be a number of seconds from 0.1 to 60, got {value}")
    return value


def _discover(from_dir: Path | None, timeout_s: float) -> Any:
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.fabric.errors import DiscoveryError

    try:
        return discover(from_dir, timeout_s=timeout_s)
    except DiscoveryError as e:
        raise _fail(str(e))
    except Exception as e:  # a parser bug must still not end in a traceback; say where it came from
        where = f"capture {from_dir}" if from_dir else "this node"
        raise _fail(f"discovery of {where} failed unexpectedly ({type(e).__name__}: {e}); please report it "
                    "with the capture (`moetune fabric capture DIR`)")


def _summary(f: Any) -> dict[str, Any]:
    d = f.to_dict()
    d.update(
        fingerprint=f.fingerprint,
        hardware_hash=f.hardware_hash,
        software_hash=f.software_hash,
        gpu_count=f.gpu_count,
        gpu_model=f.gpu_model,
        nvlink_gbs_per_gpu=f.nvlink_gbs_per_gpu,
        network_gbs=f.network_gbs,
    )
    return d


def _print_gpus(out: Console, f: Any, rows: list[tuple[str, ...]]) -> None:
    """The GPU table within the console's width (it was laid out at 160 columns in a pipe: 85 and more at 80). Ids
    are never folded: the UUID is left out first, then the bus id (the caption names them). The model is kept on one
    line where the table then fits (80 columns: the bus id gives way); on a narrower console it wraps between words."""
    kw: dict[str, Any] = {"title": f"{f.gpu_count} GPU(s)", "title_justify": "left",
                          "left_out_hint": "fabric show --json shows them"}
    for model in ("num", "word"):
        cols = (Col("#", "num"), Col("model", model, "left"), Col("memory", "num"), Col("cc", "num"),
                Col("PCIe", "word"), Col("NVLink", "word"), Col("bus id", "num", "left", drop=1),
                Col("UUID", "num", "left", drop=2))
        table = fit_table(out, cols, rows, **dict(kw))
        if table.width is None or table.width <= out.width:  # fit_table sets a width only when printed wider
            break
    out.print(table, crop=False, soft_wrap=False)


def _print_facts(f: Any) -> None:
    out = _out()
    out.print(f"[bold]fabric[/bold] {escape(f.source)}  fingerprint [cyan]{f.fingerprint}[/cyan]  "
               f"hardware {f.hardware_hash}  software {f.software_hash}  ({f.seconds:.3f} s)")
    if f.gpus:
        rows = []
        for g in f.gpus:
            act = g.active_links
            nvl = f"{len(act)}/{len(g.nvlinks)} × {act[0].speed_gbs:g} GB/s" if act else (f"0/{len(g.nvlinks)}" if g.nvlinks else "-")
            pcie = f"Gen{g.pcie_gen_max or '?'} x{g.pcie_width_current or '?'}"
            rows.append((str(g.index), escape(g.model + (" (MIG)" if g.mig else "")), f"{g.memory_mib} MiB",
                         escape(g.compute_capability or "?"), pcie, nvl, escape(g.pci_bus_id), escape(g.uuid)))
        _print_gpus(out, f, rows)
        if f.pairs:
            levels: dict[str, int] = {}
            for p in f.pairs:
                k = f"{p.level} (P2P {p.p2p})"
                levels[k] = levels.get(k, 0) + 1
            out.print("GPU pairs: " + ", ".join(f"{n} × {k}" for k, n in sorted(levels.items())))
    else:
        out.print("no GPU found")
    if f.nics:
        rows = []
        for n in f.nics:
            if not n.ports:
                rows.append((escape(n.name), escape(n.kind), escape(n.fw_ver), "-", "-", "-", "-"))
            for i, p in enumerate(n.ports):
                rows.append((escape(n.name) if i == 0 else "", escape(n.kind) if i == 0 else "",
                             escape(n.fw_ver) if i == 0 else "", str(p.port), escape(p.state), f"{p.rate_gbps:g} Gb/s",
                             escape(p.link_layer)))
        cols = (Col("name"), Col("kind", "word"), Col("firmware", drop=1), Col("port", "num", "left"),
                Col("state", "word"), Col("rate", "num", "left"), Col("link layer", "word"))
        print_table(out, cols, rows, title=f"{len(f.nics)} NIC(s)", title_justify="left",
                    left_out_hint="fabric show --json shows them")
    for e in f.excluded_nics:
        out.print(f"ignored {e.name}: {e.reason}")
    gd = f.gpudirect
    out.print(f"GPUDirect RDMA: {gd.how}  (open kernel module: {'yes' if gd.open_kernel_module else 'no'}, kernel {gd.kernel or '?'})")
    if f.libfabric.providers:
        out.print(f"libfabric {f.libfabric.version or '?'}: providers {', '.join(f.libfabric.providers)}")
    out.print("software: " + ", ".join(f"{k} {v}" for k, v in f.software.items()))
    missing = [k for k, v in f.tools.items() if v != "ok"]
    if missing:
        out.print("tools: " + ", ".join(f"{k}: {f.tools[k]}" for k in missing))
    for w in f.warnings:
        out.print(f"[yellow]warning:[/yellow] {w}")
    rows = [(f"[green]{escape(tr.name)}[/green]", "yes", escape(tr.reason)) for tr in f.transports]
    rows += [(f"[dim]{escape(tr.name)}[/dim]", "no", escape(tr.reason)) for tr in f.unavailable]
    print_table(out, (Col("family", "word"), Col("available", "word"), Col("reason")), rows,
                title="transport families", title_justify="left")


@app.command("show")
def show(
    from_dir: Path | None = path_option(None, "--from", "--capture", help="Analyse a capture directory instead of this node (--capture, as for `moetune profile` and `tune`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the facts, hashes and transports as JSON."),
    record: bool = typer.Option(False, "--record", help="Also record the fingerprint and its facts in the store (refused, exit 1, where discovery could not read everything: give it more --timeout)."),
    db: Path | None = path_option(None, "--db", help="Profile database --record writes to (default: configured)."),
    config: Path | None = path_option(None, "--config", help="TOML config file (for --record's database)."),
    timeout_s: float = typer.Option(1.5, "--timeout", callback=_check_timeout, help=_TIMEOUT_HELP),
) -> None:
    """Discover the fabric (or read a capture) and show facts, fingerprint and transport families."""
    if not record and (db is not None or config is not None):  # accepted, and nothing was read or written
        raise _fail(f"{'--db' if db is not None else '--config'}: names the database --record writes to; without "
                    "--record, `fabric show` opens no database: add --record, or leave it out")
    f = _discover(from_dir, timeout_s)
    if record and from_dir is None and not f.complete:
        # refused, not recorded flagged: every reader of this node's recorded facts (the daemon's first start, `fabric
        # diff`, the runtime's database fallback) would have to pass over such a row; recorded as the node's newest,
        # they made the daemon's first start record a fabric change that was none
        raise _fail(f"discovery could not read everything on this node ({'; '.join(f.warnings)}), so these facts are "
                    "not recorded as this node's (the daemon would take them for a fabric change); nothing was "
                    f"written. Give discovery more time with --timeout SECONDS (this run: {timeout_s:g} s, at most 60), "
                    "or run it as a user who may read what was withheld, then record again; `moetune fabric show` "
                    "without --record shows what was read", 1)
    if record:  # a store error is a message and its exit status (1: busy or not writable), not a traceback
        with open_store(db, config, mode="create") as store:
            # a capture's facts are recorded as another node's (even one of this node: the daemon's first start
            # compares the node with what it recorded as its own only)
            if from_dir is not None:
                store.upsert_fingerprint(f.fingerprint, f.to_dict(), origin="capture")
            else:  # this node's: a change since its recorded facts is recorded as the daemon records it
                from moetune.tuner.fabric.change import record_node_facts

                note = record_node_facts(store, f, by="fabric show --record").note()
                if note:
                    err.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True)
    if as_json:
        typer.echo(json.dumps(_summary(f), indent=1))
    else:
        _print_facts(f)


@app.command("capture")
def capture(
    dest: Path = typer.Argument(..., parser=path_arg, help="Directory to write (must not exist or be empty)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
    timeout_s: float = typer.Option(1.5, "--timeout", callback=_check_timeout, help=_TIMEOUT_HELP),
) -> None:
    """Save what discovery reads on this node (sys/, proc/, commands/) for support or tests."""
    from moetune.tuner.fabric.capture import capture_node
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.fabric.errors import DiscoveryError

    try:
        path = capture_node(dest, timeout_s=timeout_s)
        f = discover(path)  # read it back: a capture must describe the node exactly
    except DiscoveryError as e:  # exit 1 where a write failed as it was made (a full disk), else 2
        raise _fail(str(e), write_error_code(e))
    n_files = sum(1 for p in path.rglob("*") if p.is_file())
    if as_json:
        typer.echo(json.dumps({"path": str(path), "files": n_files, "fingerprint": f.fingerprint,
                               "transports": f.transport_names}))
    else:
        _out().print(f"captured {n_files} files to {escape(str(path))}  fingerprint {f.fingerprint}  "
                   f"transports: {', '.join(f.transport_names)}")


def _stored_facts(fp_hash: str | None, db: Path | None = None, config: Path | None = None, *,
                  this_node: bool = False) -> tuple[str, dict[str, Any]]:
    """The stored facts `fp_hash` (a hash or prefix) names; with none, the newest stored facts: of this node alone
    where `this_node` (the live node is compared: another node's imported or captured facts are not its past)."""
    path = db_path(db, config)
    if not path.exists():  # the store's "run `moetune db upgrade`" leads to "no fingerprint yet": say the way at once
        raise _fail(f"no database at {path}: nothing recorded to compare with; record this node's fabric with "
                    f"`moetune fabric show --record{db_flag(path)}` or pass --against DIR")
    with open_store(db, config, mode="read") as store:  # an existing database at head, never created or migrated
        row = store.get_fingerprint(fp_hash) if fp_hash is not None else None
        allrows = list(store.list_fingerprints()) if row is None else []  # read in the same open only when needed
        own = [r for r in store.local_fingerprints() if r["facts"]] if fp_hash is None and this_node else []
    rows: list[Any] = [row] if row is not None else []
    if not rows:
        # the live node's default is its latest recorded fabric (origin local, this node's id), else the latest of
        # unknown origin (recorded before migration 0010); never another node's imported or captured facts, which a
        # store holds too and which made a diff of this node a "change". A capture is compared with the latest facts
        # of any origin. A model tune records its preset's key (no facts) too: no discovered fabric to compare with.
        if fp_hash is not None:
            rows = [r for r in allrows if str(r["hash"]).startswith(fp_hash)]
        elif this_node:
            rows = own or [r for r in allrows if r["facts"] and r.get("origin") is None]
        else:
            rows = [r for r in allrows if r["facts"]]
        if fp_hash is not None and len(rows) > 1:
            raise _fail(f"fingerprint prefix {fp_hash} is ambiguous ({len(rows)} stored fingerprints match)")
    if not rows:
        if fp_hash:
            raise _fail(f"fingerprint {fp_hash} is not in the store")
        others = sum(1 for r in allrows if r["facts"]) if this_node else 0
        held = (f" (only {others} of other nodes or captures: pass --against HASH to compare with one)" if others
                else f" (only {len(allrows)} without facts, such as a model tune's preset:... key)" if allrows else "")
        raise _fail(f"the store holds no discovered fingerprint{' of this node' if this_node else ''} yet{held}; record one with "
                    "`moetune fabric show --record` or pass --against DIR")
    row = rows[0]
    facts = row["facts"]
    if not facts:
        raise _fail(f"the store has fingerprint {row['hash']} but not its facts")
    from moetune.tuner.fabric.facts import FactsError, read_facts

    try:  # a row an older import (which did not check facts) or a hand edit stored: said, not a KeyError in the diff
        read_facts(facts)
    except FactsError as e:
        raise _fail(f"the stored facts of fingerprint {row['hash']} in {path} cannot be read ({e}); compare with "
                    "a capture instead (--against DIR), or record this node's facts again "
                    f"(`moetune fabric show --record{db_flag(path)}`)")
    return str(row["hash"]), facts


@app.command("diff")
def diff(
    against: str | None = typer.Option(None, "--against", help="A stored fingerprint hash (or prefix) or a capture DIR; "
                                       "default: this node's most recently recorded fingerprint (with --from: the store's most recent one)."),
    from_dir: Path | None = path_option(None, "--from", "--capture", help="Compare this capture instead of the live node (--capture, as for `moetune profile` and `tune`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    timeout_s: float = typer.Option(1.5, "--timeout", callback=_check_timeout, help=_TIMEOUT_HELP),
    db: Path | None = path_option(None, "--db", help="Profile database (default: configured)."),
    config: Path | None = path_option(None, "--config", help="TOML config file."),
) -> None:
    """Why the fabric changed: readable reasons (exit 0: the same fabric, 1: changed).

    Changed: another fingerprint, or the same one on other physical GPUs, which the daemon takes as a change too (the profiles measured on the parts replaced are marked stale and re-tuned)."""
    from moetune.tuner.fabric.fingerprint import REPLACED, diff_facts, fingerprint

    if against is not None and not against.strip():  # Path("") is ".": the current folder was read as a capture
        raise _fail("--against is empty: give a stored fingerprint hash (or its first 4+ hex digits) or a "
                    "capture directory, or leave --against out to compare with this node's most recently recorded fingerprint")
    if against is not None and Path(against).is_dir():
        if db is not None or config is not None:  # taken and ignored: the capture is compared, no database is read
            raise _fail(f"{'--db' if db is not None else '--config'}: names the database a stored fingerprint is read "
                        f"from; --against {against} is a capture directory, compared without any database: leave "
                        f"{'--db' if db is not None else '--config'} out, or give --against a stored fingerprint hash")
        old_f = _discover(Path(against), timeout_s)
        old_hash, old = old_f.fingerprint, old_f.to_dict()
    elif against is None or re.fullmatch(r"[0-9a-fA-F]{4,64}", against):
        old_hash, old = _stored_facts(against.lower() if against else None, db, config, this_node=from_dir is None)
        old_hash = fingerprint(old) if old.get("gpus") is not None else old_hash
    else:
        raise _fail(f"--against {against!r} is neither a capture directory nor a fingerprint hash")
    new_f = _discover(from_dir, timeout_s)
    new = new_f.to_dict()
    reasons = diff_facts(old, new)
    same = old_hash == new_f.fingerprint
    # a GPU swapped for another of the same model keeps the fingerprint but is a change all the same (the daemon's rule,
    # fabric.change.same_hardware): this said "(not performance-relevant) GPU 1 replaced" and exit 0
    replaced = [r for r in reasons if REPLACED in r] if same else []
    if as_json:
        typer.echo(json.dumps({"old": old_hash, "new": new_f.fingerprint, "changed": not same or bool(replaced),
                               "fingerprint_changed": not same, "gpus_replaced": replaced, "reasons": reasons}))
    elif same:
        _out().print(f"fingerprint unchanged: {new_f.fingerprint}" + (
            ", but on other GPUs: a change (the daemon marks the profiles measured on the parts replaced stale and "
            "re-tunes them)" if replaced else ""))
        for r in reasons:
            _out().print(f"  - {r}" if r in replaced else f"  (not performance-relevant) {r}")
    else:
        _out().print(f"fingerprint {old_hash} → {new_f.fingerprint}")
        for r in reasons or ["changed, but no readable reason found (facts from another moetune version?)"]:
            _out().print(f"  - {r}")
    raise typer.Exit(0 if same and not replaced else 1)
