"""`moetune tune show`: the studies kept, or one study's summary (reads only)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from moetune.tuner.cli._args import path_option, text_option
from moetune.tuner.cli._tables import Col, print_table
from moetune.tuner.cli.db import abort
from moetune.tuner.cli.tune_notes import quiet_optuna
from moetune.tuner.cli.tune_storage import (
    STORAGE_EMPTY,
    read_config,
    read_failed,
    redacted,
    refuse_memory,
    storage_url,
)

# --study "" matched every study's name
STUDY_EMPTY = "an empty name matches every study (leave the option out to list the studies)"


_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup


def show(
    study: str = text_option(None, "--study", "-s", empty=STUDY_EMPTY, help="Study name (default: list the studies)."),
    storage: str = text_option(None, "--storage", empty=STORAGE_EMPTY, help="Optuna storage URL."),
    db: Path = path_option(None, "--db", help="Profile database (its studies file, NAME-studies.db for NAME.db, sits beside it)."),
    config: Path = path_option(None, "--config", help="TOML config file (for the default database)."),
    as_json: bool = typer.Option(False, "--json", help="JSON output."),
) -> None:
    # help paragraphs on one line each: Rich prints a docstring's own line breaks as they are
    """Summarise the studies (or one study: its best and policy-default trials, the profile stored for its key, importances); reads only.

    The storage is opened read-only and one without Optuna's tables is refused, never given them."""
    import warnings

    from moetune.tuner.search.readback import NotAMoetuneStudy, describe_study, list_studies

    quiet_optuna()
    warnings.simplefilter("ignore")  # Optuna's experimental/deprecation notes are not the user's to read
    if db is None and storage is None:
        db = read_config(config).db_path
    url = storage_url(storage, db)
    from moetune.tuner.search.storage import StorageRefused, refuse_query, sqlite_path

    if storage is not None:
        refuse_memory(storage, "a new one holds no studies")
    try:
        refuse_query(url)  # a query string (`?mode=rw`) is refused by name here, before any read
    except StorageRefused as e:
        _fail(f"--storage {redacted(url)}: {e}")
    p = sqlite_path(url)
    try:
        missing = p is not None and not p.exists()
    except OSError as e:  # a name too long for the file system: said as a storage that cannot be opened
        read_failed(url, storage is not None, e)
    if missing:
        _fail(f"no studies yet ({p} does not exist)")
    try:
        names_rows = list_studies(url)
    except Exception as e:  # SQLAlchemy / sqlite3 / Optuna: a bad URL, a folder, a file that is not a database
        read_failed(url, storage is not None, e)
    if study is None:
        rows = names_rows
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        print_table(Console(), (Col("study", "text"), Col("trials", "num"), Col("best µs", "num"), Col("backend", "word")),
                    [(escape(r["study"]), str(r["trials"]), "-" if r["best_us"] is None else f"{r['best_us']:,.1f}",
                      escape(str(r["backend"]) + (" (modelled)" if r.get("modelled") else ""))) for r in rows],
                    title=escape(f"studies in {redacted(url)}"))
        return
    names = [r["study"] for r in names_rows]
    if study not in names:  # a unique part of a name will do (names are long)
        hits = [n for n in names if study in n]
        if len(hits) == 1:
            study = hits[0]
        elif len(hits) > 1:
            _fail(f"{study!r} matches {len(hits)} studies: " + ", ".join(hits[:10]))
    try:
        d = describe_study(url, study)
    except KeyError:
        _fail(f"no study named {study!r} in {redacted(url)}")
    except NotAMoetuneStudy as e:
        _fail(f"{e} ({redacted(url)})")
    except Exception as e:  # as list_studies: a file changed or locked meanwhile is one line, not a traceback
        read_failed(url, storage is not None, e)
    # what the profile database (--db, else the configured one) holds for the study's key: the stored number (after
    # the tune's side-by-side check, where it made one), not a ratio of trials; the summary stands without it
    stored_note = "no profile database given (--db)" if db is None else f"{db} does not exist"
    if db is not None and Path(db).expanduser().exists():
        try:
            from moetune.tuner.search.readback import stored_for_key
            from moetune.tuner.store.store import Store

            with Store(db, readonly=True) as ro:
                d["stored"] = stored_for_key(ro, d.get("key"), d.get("best_knobs"))
        except Exception as e:  # broad: a newer schema, a locked or foreign file: said, the study still shown
            stored_note = f"{db} could not be read: {e}"
    if "stored" not in d:
        d["stored_note"] = stored_note
    if as_json:
        typer.echo(json.dumps(d, indent=2, default=str))
        return
    c = Console()
    # the name and the backend label carry a preset's own name (stored text): shown as written, as in the list
    c.print(f"[bold]{escape(d['study'])}[/bold]  backend {escape(str(d['backend']))}"
            f"{' (modelled)' if d['modelled'] else ''}")
    cut = d.get("interrupted") or 0  # the failed trials cut short (Ctrl-C, a process that died): not counted
    c.print("trials: " + ", ".join(f"{k} {v}" + (f" ({cut} interrupted, not counted)" if k == "fail" and cut else "")
                                   for k, v in d["states"].items() if v))
    if d["best_us"] is not None or d["default_us"] is not None:
        c.print(f"{d['trials_note']}:")
    if d["best_us"] is not None:
        sp = d.get("best_spread_us")
        c.print(f"  best trial: {d['best_us']:,.1f} µs" + (f" ± {sp:,.1f}" if sp else "") + f" (trial {d['best_trial']})")
    if d["default_us"] is not None:
        c.print(f"  policy default trial: {d['default_us']:,.1f} µs")
    if d["best_knobs"]:
        c.print("best trial's knobs: " + ", ".join(f"{k}={v}" for k, v in d["best_knobs"].items()))
    if "stored" not in d:
        c.print(f"stored for this key: not looked up ({escape(d['stored_note'])})")
    elif d["stored"] is None:
        c.print("stored for this key: nothing")
    else:
        p = d["stored"]
        c.print(f"stored for this key: {p['latency_us']:,.1f} ± {p['spread_us']:,.1f} µs, {escape(p['backend'])} "
                f"({p['provenance']}, {str(p['updated'])[:19]}), "
                + ("the best trial's knobs" if p["is_study_best"] else
                   "knobs " + ", ".join(f"{k}={v}" for k, v in p["knobs"].items())))
    if d["importances"]:
        print_table(c, (Col("parameter", "word"), Col("importance", "num")),
                    [(escape(k), f"{v:.3f}") for k, v in d["importances"].items()],
                    title="parameter importances (fANOVA)")
    elif d["importance_note"]:
        c.print(f"importances: {d['importance_note']}")
    for f in d["failed"]:
        if f.get("interrupted"):  # cut short, not a failed measurement (not counted): its own word, not "failed: None"
            why = "" if f["error"] in ("interrupted", None) else f" ({escape(str(f['error']))})"
            c.print(f"[yellow]trial {f['trial']} interrupted[/yellow]{why} (not counted)")
        else:
            c.print(f"[red]trial {f['trial']} failed:[/red] {escape(str(f['error'] or 'no reason recorded'))}")


def register(app: typer.Typer) -> None:
    """Add `show` to the `moetune tune` app."""
    app.command("show")(show)
