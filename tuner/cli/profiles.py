"""`moetune profiles`: Tuned profiles in the database: list, show, delete, export, import."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import typer
from rich.markup import escape

from moetune.runtime.profile_record import (
    COMM_METRIC,
    LAYER_METRIC,
    MODELLED_METRIC,
    PROFILE_STATUSES,
    PROVENANCES,
    WHAT_IF_LABEL,
    WHAT_IF_ONLY,
    metric_of_backend,
    provenance_of_backend,
    runtime_refusal,
)
from moetune.runtime.profiles.perf_env import perf_env_digest
from moetune.tuner.cli._args import (
    id_command_class,
    path_arg,
    path_option,
    path_text,
    text_option,
    write_error_code,
)
from moetune.tuner.cli._tables import Col, print_table
from moetune.tuner.cli.db import (
    CONFIG_HELP,
    DB_HELP,
    db_flag,
    err,
    fail,
    open_store,
    out,
    print_json,
    serving_daemon,
)

app = typer.Typer(help="Tuned profiles in the database: list, show, delete, export, import.", no_args_is_help=True)

MAX_ID = (1 << 63) - 1  # SQLite INTEGER
# --fingerprint "" is the start of every fingerprint: with one stored, list and export took it silently
FINGERPRINT_EMPTY = "an empty fingerprint is the start of every one (leave the option out for all fingerprints)"
# the table's fingerprint column (its first 10 characters) is the second it leaves out on a narrow terminal (80
# columns, a pipe): the help names where the whole fingerprint is always shown
FINGERPRINT_HELP = ("Only this fabric fingerprint, or the start of one: `profiles list --json` (key.fingerprint) and "
                    "`profiles show ID` show it whole; the table, its first 10 characters where the terminal is wider "
                    "than 80 columns (the caption names the columns it leaves out).")
# Rich labels: anything not measured is said loudly.
# what a profile's latency times, by `metric_of_backend`
METRIC_SAYS = {COMM_METRIC: "the dispatch → combine round trip",
               LAYER_METRIC: "the whole MoE layer",
               MODELLED_METRIC: "a prediction of the fabric model, not a measurement"}
PROVENANCE_LABEL = {
    "measured": "[green]measured[/]",
    "node_model": "[yellow]MODELLED[/] (node)",
    "preset": "[red]PRESET[/] (MODELLED)",  # a preset fabric's numbers are the fabric model's predictions
}


def _record_json(pid: int, rec: Any) -> dict[str, Any]:
    # perf_env always present: the variables, or null where it was not recorded (unknown, never "none set")
    env = rec.tuned_perf_env
    d = {"id": pid, **msgspec.to_builtins(rec), "profile_hash": rec.profile_hash, "perf_env": env,
         "perf_env_digest": perf_env_digest(env) if env is not None else None,
         # likewise the data-path runtime options: null where not recorded
         "runtime_options": rec.tuned_runtime_options, "runtime_options_digest": rec.runtime_options_digest,
         # and the routing: an unrecorded one is UNSET, which to_builtins leaves out (the key was missing)
         "routing": rec.tuned_routing or None,
         # why no lookup ever serves the row (its knobs contradict its family, or a what-if profile): listed beside
         # served rows, it read as one in use; null where one may serve it (every row has the same keys)
         "not_served": rec.not_served}
    # provenance and measured_on as the runtime takes them (as the table shows them): a row stored as measured whose
    # backend does not measure read "measured" here while the table said PRESET; the stored labels beside them
    eff = rec.as_effective()
    if (eff.provenance, eff.measured_on) != (rec.provenance, rec.measured_on):
        d.update(provenance=str(eff.provenance), measured_on=eff.measured_on, stored_provenance=str(rec.provenance),
                 stored_measured_on=rec.measured_on)
    # whether latency_us is a prediction, in every row as `tune --json` says it: the table labels it MODELLED, while
    # here a node model's row carried the word nowhere (provenance "node_model", its own software hash)
    d["modelled"] = eff.provenance != "measured"
    return d


def perf_env_lines(rec: Any) -> list[tuple[str, str]]:
    """(field, value) rows of `profiles show` for the performance environment a profile was measured in."""
    env = rec.tuned_perf_env
    if env is None:
        why = ("not recorded: measured by an older moetune" if rec.effective_provenance == "measured"
               else "not recorded: a prediction, measured in no process")
        return [("perf_env", f"unknown ({why})")]
    rows = [("perf_env", f"{len(env)} variable(s), digest {perf_env_digest(env)}" if env
             else f"none set (digest {perf_env_digest(env)})")]
    return rows + [(f"perf_env.{name}", value) for name, value in sorted(env.items())]


def runtime_options_lines(rec: Any) -> list[tuple[str, str]]:
    """(field, value) rows of `profiles show` for the data-path runtime options a profile was measured under."""
    opts = rec.tuned_runtime_options
    if opts is None:
        why = ("not recorded: measured by an older moetune" if rec.effective_provenance == "measured"
               else "not recorded: a prediction, run under no options")
        return [("runtime_options", f"unknown ({why})")]
    rows = [("runtime_options", f"{len(opts)} option(s), digest {rec.runtime_options_digest}")]
    return rows + [(f"runtime_options.{name}", json.dumps(value)) for name, value in sorted(opts.items())]


def _check_status(status: str | None) -> None:
    if status is not None and status not in PROFILE_STATUSES:
        raise typer.BadParameter(f"must be one of {', '.join(PROFILE_STATUSES)}, got {status!r}", param_hint="--status")


def _check_provenance(provenance: str | None) -> None:
    if provenance is not None and provenance not in PROVENANCES:
        raise typer.BadParameter(
            f"must be one of {', '.join(PROVENANCES)}, got {provenance!r}", param_hint="--provenance"
        )


TABLE_LIMIT = 500  # rows `profiles list` draws by default

# The daemon is its database's single writer and serves the profiles it loaded (at start, and when one of its re-tune
# jobs ends; no request reloads them): `delete` and `import` refuse a database it serves unless told to write anyway.
DAEMON_HINT = (" (it serves the profiles it loaded at start: a change written behind it is not served until it "
               "restarts), then start it again; or pass --force to write anyway")
FORCE_HELP = ("Write even while a daemon serves the database (it keeps serving the profiles it loaded until it "
              "restarts, or one of its re-tune jobs ends).")


@app.command("list")
def list_cmd(
    status: str | None = typer.Option(None, "--status", help="current, stale or superseded."),
    fingerprint: str | None = text_option(None, "--fingerprint", empty=FINGERPRINT_EMPTY, help=FINGERPRINT_HELP),
    provenance: str | None = typer.Option(None, "--provenance", help="measured, node_model or preset."),
    limit: int = typer.Option(TABLE_LIMIT, "--limit", min=0, help="At most this many profiles in the table, the newest (0: all; drawing 10,000 rows takes seconds). --json lists all."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """List stored profiles, with where their numbers come from (measured, MODELLED, PRESET)."""
    with _filtered_store(db, config, status, fingerprint, provenance) as (store, fingerprint):
        rows = store.list_profiles(status=status, fingerprint=fingerprint, provenance=provenance)
    if json_out:
        print_json([_record_json(pid, rec) for pid, rec in rows])
        return
    total = len(rows)
    if limit and total > limit:  # the table of 11,000 rows took 16 s before its first line; ids ascend: newest last
        rows = rows[-limit:]
    # 80 columns (a pipe, a CI log) hold no 12 columns: updated, backend, dtype and fingerprint are left out in that
    # order (the caption says so), the rest wrap; a number or a status is never cut (`_tables`)
    cols = (Col("id", "num"), Col("status", "word"), Col("provenance", "word"), Col("family"),
            Col("fingerprint", drop=2), Col("ep", "num"), Col("shape", "word"), Col("dtype", drop=3), Col("tokens", "num"),
            Col("µs", "word", "right"), Col("backend", drop=4), Col("updated", "num", drop=5))
    colour = {"current": "green", "stale": "yellow", "superseded": "dim"}
    cells = []
    unserved: list[tuple[int, str]] = []  # (id, why) of the rows no lookup serves: said under the table
    for pid, r in rows:
        k = r.key
        why = r.not_served
        if why is not None:
            unserved.append((pid, why))
        cells.append((
            str(pid),
            f"[{colour[r.status]}]{r.status}[/]" + (" [red]NOT SERVED[/]" if why is not None else ""),
            PROVENANCE_LABEL[str(r.effective_provenance)],  # as the runtime takes it (a hand-edited label: db check)
            escape(k.transport_family),
            escape(k.fingerprint[:10]),
            f"{k.ep_size}" if k.nodes == 1 else f"{k.ep_size}/{k.nodes}n",
            # hidden, intermediate, experts, top-k as words: wrapped between them at 80 columns, never inside one
            f"h{k.hidden} i{k.intermediate} e{k.experts} k{k.topk}",
            escape(k.dtype),
            str(k.token_bucket),
            f"{r.latency_us:.1f} ±{r.spread_us:.1f}",  # wraps before the ± at 80 columns, never inside a number
            escape(r.backend),
            escape(r.updated[:10]),
        ))
    title = (f"{total} profile(s)" if len(rows) == total else
             f"{total} profile(s), the newest {len(rows)} shown (--limit 0 shows all, --json lists all)")
    print_table(out, cols, cells, title=title, title_justify="left",
                left_out_hint="--json shows them")
    for pid, why in unserved:  # a reason is longer than a cell: one line each, by id
        out.print(f"profile {pid} is NOT SERVED: {escape(why)}", soft_wrap=False)  # wrapped to the width, as the table


@app.command(cls=id_command_class())
def show(
    profile_id: int = typer.Argument(..., min=1, max=MAX_ID, metavar="ID", help="Profile id (see `moetune profiles list`)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Show one profile: its key, knobs and measurement, and the NCCL/NVSHMEM/FI environment it was measured in."""
    with open_store(db, config, mode="read") as store:
        rec = store.get_profile(profile_id)
        if rec is None:
            _no_profile(store, profile_id)
    if json_out:
        print_json(_record_json(profile_id, rec))
        return
    # Stored text (an imported file's backend, versions, ...) is shown as is, never read as Rich markup.
    rows: list[tuple[str, str]] = []
    for name, value in rec.key.to_dict().items():
        rows.append((f"key.{name}", escape(str(value))))
    for name, value in rec.knobs.to_dict().items():
        rows.append((f"knobs.{name}", escape(str(value))))
    # which figure the number is: a bring-up's round trip and a local tune's whole layer are never compared, and
    # one key's rows of both read as one key getting 20x slower
    rows.append(("latency_us", f"{rec.latency_us:.3f} ± {rec.spread_us:.3f} ({METRIC_SAYS[metric_of_backend(rec.backend)]})"))
    rows.append(("backend", escape(rec.backend)))
    eff = rec.effective_provenance
    why_not = ("its backend is not this node's model" if rec.provenance != "measured" else
               "its backend does not measure" if provenance_of_backend(rec.backend) != "measured" else
               "its key is a what-if preset's modelled fabric, on which nothing is measured")
    rows.append(("provenance", PROVENANCE_LABEL[str(eff)] + ("" if eff == rec.provenance else escape(
        f" (stored as {rec.provenance}, but {why_not}: `moetune db check`)"))))
    # measured_on as the effective provenance has it (a preset's name, not the key's fingerprint a mislabelled row
    # stores), as the runtime and an export take it; the stored one beside it where they differ
    on = rec.as_effective().measured_on
    from moetune.tuner.cli.query import MEASURED_ON_LABEL, preset_note

    # "measured_on" only where it was measured: a modelled row's names the node model or preset that predicted it, as
    # `query` labels it (it read "measured_on preset:NAME:DIGEST" under "PRESET (MODELLED)"); --json keeps the field
    on_label = "measured_on" if eff == "measured" else MEASURED_ON_LABEL.get(str(eff), "measured_on (as recorded)")
    rows.append((on_label, escape(on or "(unknown)") + ("" if on == rec.measured_on else escape(
        f" (stored as {rec.measured_on or '(unknown)'})"))))

    # an edited copy of a shipped preset keeps its name: the digest says which; another node's model says so
    shipped, origin = preset_note(str(eff), on, rec.backend)
    if origin:
        rows.append(("preset", escape(origin) if shipped else f"[red]{escape(origin)}[/]"))
    rows.append(("routing", escape(rec.tuned_routing or "(not recorded)")))
    unrunnable = runtime_refusal(rec.key, rec.knobs)
    if unrunnable:  # kept as a modelled what-if report (the store refuses it labelled measured)
        rows.append(("runtime", f"[yellow]{escape(WHAT_IF_ONLY.format(why=unrunnable))}[/]"))
    why_unserved = rec.not_served
    if why_unserved is not None and why_unserved != WHAT_IF_LABEL.format(why=unrunnable):
        # as `list` says it: a contradicting row had no line here (a what-if one has the line above)
        rows.append(("served", f"[red]NOT SERVED[/]: {escape(why_unserved)}"))
    for name, value in perf_env_lines(rec) + runtime_options_lines(rec):
        rows.append((escape(name), escape(value)))
    for name, value in sorted(rec.software_versions.items()):
        rows.append((escape(f"software.{name}"), escape(str(value))))
    rows.append(("created", escape(rec.created)))
    rows.append(("updated", escape(rec.updated)))
    # a long value (a hash, an NCCL variable) wraps at 80 columns, never cut
    print_table(out, (Col("field", "word", style="bold"), Col("value")), rows,
                title=escape(f"profile {profile_id} ({rec.status}, hash {rec.profile_hash})"), show_header=False)


def _whole_fingerprint(store: Any, given: str | None) -> str | None:
    """The stored fingerprint --fingerprint names: itself, else the one it is the start of (`list` shows the first 10
    characters; that prefix matched nothing, silently). Exit 2 when none or several start so."""
    if given is None:
        return None
    known = [str(r["hash"]) for r in store.list_fingerprints()]
    if given in known:
        return given
    hits = [h for h in known if h.startswith(given)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise fail(f"--fingerprint {given!r} is the start of {len(hits)} fingerprints: {', '.join(hits[:5])}"
                   + (", ..." if len(hits) > 5 else "") + "; give more of it")
    raise fail(f"--fingerprint {given!r}: no stored fingerprint is or starts with it "
               f"({len(known)} stored; `moetune profiles list --json` shows them whole)")


def _no_profile(store: Any, profile_id: int) -> NoReturn:
    """Exit 2: no such profile, or one stored that this moetune cannot read (said so, with how to remove it)."""
    unreadable = store.unreadable_profiles(profile_id)
    if unreadable:  # the command names this database: a plain `delete` acts on the default one's profile of that id
        raise fail(f"profile {profile_id} is stored but this moetune cannot read it: {unreadable[0][1]} "
                   f"(`moetune profiles delete {profile_id}{db_flag(store.path)}` removes it)")
    raise fail(f"no profile {profile_id}")


def _confirmed(question: str) -> bool:
    """typer.confirm, where Ctrl-C at the question ends the command as Ctrl-C ends every command: one line, exit 130
    (Click turns it into an Abort, which Typer ended as "Aborted." and exit 1). The end of stdin (a script's empty
    input) answers no, said as a no is (the caller's exit 1), not as Click's bare "Aborted."."""
    try:
        return typer.confirm(question)
    except typer.Abort as e:
        if isinstance(e.__context__, KeyboardInterrupt):  # Click raises Abort `from None` inside its except
            err.print("\ninterrupted: nothing deleted", markup=False, highlight=False)
            raise typer.Exit(130) from None
        err.print("\nno answer (the input ended)", markup=False, highlight=False)
        return False


@app.command(cls=id_command_class())
def delete(
    profile_id: int = typer.Argument(..., min=1, max=MAX_ID, metavar="ID", help="Profile id (see `moetune profiles list`)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask."),
    force: bool = typer.Option(False, "--force", help=FORCE_HELP),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Delete one profile (also one this moetune cannot read, which `moetune db check` lists). Refused while a daemon serves the database, unless --force."""
    with open_store(db, config, mode="write", no_daemon=None if force else DAEMON_HINT + " (nothing deleted)") as store:
        unreadable = store.unreadable_profiles(profile_id)  # every read skips such a row: deleting it must work
        if not unreadable and store.get_profile(profile_id) is None:
            raise fail(f"no profile {profile_id}")
        what = f" (unreadable: {unreadable[0][1]})" if unreadable else ""
        if not yes and sys.stdin is None:  # started with stdin closed (`<&-`): no one to answer the question
            raise fail(f"delete {profile_id}: stdin is closed, so it cannot ask; pass --yes to delete without asking")
        if not yes and not _confirmed(f"delete profile {profile_id}{what}?"):
            # a no ended with exit 1 and not a word: said, so a script's log shows why nothing happened
            err.print(f"nothing deleted: profile {profile_id} kept (--yes deletes without asking)", markup=False,
                      highlight=False)
            raise typer.Exit(1)
        store.delete_profile(profile_id)
        path = store.path
    out.print(f"deleted profile {profile_id}")
    pid = serving_daemon(path) if force else None  # unforced, no daemon served it (its lock was held meanwhile)
    if pid is not None:  # the database changed, not what the daemon answers (`query` still got the profile)
        err.print(escape(f"note: daemon pid {pid} serves {path} and keeps serving the profiles it loaded, profile "
                         f"{profile_id} included, until it is restarted (or one of its re-tune jobs ends)"))


@contextlib.contextmanager
def _filtered_store(db: Path | None, config: Path | None, status: str | None, fingerprint: str | None,
                    provenance: str | None) -> Iterator[tuple[Any, str | None]]:
    """The store opened for reading and the whole --fingerprint, once --status and --provenance are checked (before the
    store is opened): `list` and `export` take their filters alike."""
    _check_status(status)
    _check_provenance(provenance)
    with open_store(db, config, mode="read") as store:
        yield store, _whole_fingerprint(store, fingerprint)


@app.command("export")
def export_cmd(
    path: str = typer.Argument(..., parser=path_text, help='JSON file to write ("-" for stdout); an existing file is replaced only with --force.'),
    status: str | None = typer.Option(None, "--status", help="Only profiles with this status: current, stale or superseded."),
    fingerprint: str | None = text_option(None, "--fingerprint", empty=FINGERPRINT_EMPTY, help=FINGERPRINT_HELP),
    provenance: str | None = typer.Option(None, "--provenance", help="Only profiles of this provenance: measured, node_model or preset."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file (also a read-only one; its permissions are kept)."),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Export profiles (and their fingerprints' facts) to a JSON file."""
    with _filtered_store(db, config, status, fingerprint, provenance) as (store, fingerprint):
        if path == "-":
            if sys.stdout is None:  # started with stdout closed (`>&-`): the export would go nowhere
                raise fail("export -: stdout is closed; give a file to write, or pipe stdout somewhere")
            sys.stdout.buffer.write(store.dump_profiles(status=status, fingerprint=fingerprint, provenance=provenance))
            sys.stdout.flush()
            return
        try:
            n = store.export_profiles(path, status=status, fingerprint=fingerprint, provenance=provenance,
                                      replace=force)
        except FileExistsError:  # an existing file (a read-only one too) is replaced only when asked
            ro = " (read-only)" if _read_only(Path(path).expanduser()) else ""
            raise fail(f"{path} already exists{ro}: not replaced (--force replaces it)") from None
        except OSError as e:  # 1: no space, an I/O error (the path is fine); 2: the path cannot be written
            raise fail(f"cannot write {path}: {e.strerror or e}", write_error_code(e)) from None
    out.print(escape(f"exported {n} profile(s) to {path}"))
    from moetune.tuner.store.io import MAX_IMPORT_BYTES

    size = Path(path).expanduser().stat().st_size
    if size > MAX_IMPORT_BYTES:  # written whole, but `profiles import` would refuse it: said now, not at the import
        err.print(escape(f"warning: {path} is {size >> 20} MiB, over the {MAX_IMPORT_BYTES >> 20} MiB that `moetune "
                          "profiles import` takes: export it in parts (--status current, --fingerprint, --provenance)"))


def _read_only(path: Path) -> bool:
    try:
        return not (os.access(path, os.W_OK) and path.stat().st_mode & 0o222)  # root may write a 0444 file
    except OSError:
        return False


def _refuse_no_format(data: bytes, source: str) -> None:
    """A JSON object without a "format" field (`{}`, some other tool's JSON) is no export file: the store's check
    said "format 'None'". Other problems (not JSON, not an object, another format) are the store's to name."""
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nested too deeply, which the store says
        return
    if isinstance(raw, dict) and "format" not in raw:
        what = "an empty JSON object" if not raw else "a JSON object without a \"format\" field"
        raise fail(f"{source} is not a moetune export file ({what}; an export starts "
                   '{"format": "moetune-profiles", ...}): write one with `moetune profiles export FILE` '
                   "(database unchanged)")


@app.command("import")
def import_cmd(
    path: Path = typer.Argument(..., parser=path_arg, help='JSON file written by `moetune profiles export` ("-" for stdin).'),
    skip_invalid: bool = typer.Option(
        False, "--skip-invalid",
        help="Leave out the profile records that are invalid on their own (each is named on stderr, and in --json's "
             "\"invalid\") and import the rest. Without it one invalid record refuses the whole file. A problem of the "
             "file itself (format, fingerprints, two current records for one key, every record invalid) is refused either way.",
    ),
    force: bool = typer.Option(False, "--force", help=FORCE_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
    db: Path | None = path_option(None, "--db", help=DB_HELP),
    config: Path | None = path_option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Import profiles: all or nothing, validated before anything is written; the error names every invalid record (--skip-invalid imports the rest). Refused while a daemon serves the database, unless --force."""
    from moetune.tuner.fabric.facts import facts_problem
    from moetune.tuner.store.store import ProfileImportError, parse_export

    stdin = str(path) == "-"
    source = "<stdin>" if stdin else str(path)
    if stdin and sys.stdin is None:  # started with stdin closed (`<&-`)
        raise fail("import -: no stdin (it is closed); pipe an export into it (moetune profiles export - | moetune "
                   "profiles import -)")
    if stdin and sys.stdin.isatty():  # reading would wait for typing: say what `-` is for
        raise fail("import -: stdin is a terminal; pipe an export into it (moetune profiles export - | moetune "
                   "profiles import -)")
    from moetune.tuner.store.io import MAX_IMPORT_BYTES, read_import, too_big_message

    try:  # never more than the limit read into memory (a stray multi-GB file or an endless pipe)
        if stdin:
            data = sys.stdin.buffer.read(MAX_IMPORT_BYTES + 1)
            if len(data) > MAX_IMPORT_BYTES:
                raise ProfileImportError(too_big_message(source))
        else:
            data = read_import(path)
    except OSError as e:
        raise fail(f"cannot read {source}: {e.strerror or e}") from None
    except ProfileImportError as e:
        raise fail(f"{e} (database unchanged)") from None
    if not data:  # not "not valid JSON: Input data was truncated"
        raise fail(f"{'stdin' if stdin else source} is empty: nothing to import (database unchanged)")
    _refuse_no_format(data, source)
    try:  # validate before opening: a bad file must not create (or upgrade) a database either
        parse_export(data, source=source, skip_invalid=skip_invalid, check_facts=facts_problem)
    except ProfileImportError as e:
        raise fail(f"{e} (database unchanged)") from None
    with open_store(db, config, mode="create", no_daemon=None if force else DAEMON_HINT + " (database unchanged)") as store:
        try:
            res = store.import_bytes(data, source=source, skip_invalid=skip_invalid, check_facts=facts_problem)
        except ProfileImportError as e:
            raise fail(f"{e} (database unchanged)") from None
    pid = serving_daemon(store.path) if force and (res.inserted or res.replaced or res.completed) else None
    if pid is not None:
        err.print(escape(f"note: daemon pid {pid} serves {store.path} and keeps serving the profiles it loaded, "
                         "before this import, until it is restarted (or one of its re-tune jobs ends)"))
    for line in res.invalid:
        err.print(escape(f"left out (invalid): {line}"))
    for line in res.differing:
        err.print(escape(f"already present, differs: {line}"))
    if json_out:
        print_json(msgspec.to_builtins(res))
    else:
        left_out = f", {len(res.invalid)} invalid left out (listed above)" if res.invalid else ""
        # records the file itself calls superseded or stale go in as history (every inserted one is counted once)
        history = res.inserted - res.current - res.kept_superseded
        completed = (f", {res.completed} already present and completed (routing / perf_env the database had lost, "
                     "filled in)" if res.completed else "")
        out.print(
            escape(
                f"imported {res.inserted} profile(s) from {source}: {res.current} current, {history} as history, "
                f"{res.replaced} replaced, {res.kept_superseded} kept as superseded, {res.skipped} already "
                f"present{completed}{left_out}"
            )
        )
