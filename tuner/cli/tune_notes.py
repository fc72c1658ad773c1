"""What `moetune tune` says around its results: the notes, the forced-fit banner and the outcome messages."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from moetune.tuner.cli.db import abort
from moetune.tuner.cli.tune_storage import redacted

# `moetune tune`'s stderr console: tune.py prints its notes on this one too
err = Console(stderr=True, soft_wrap=True)


_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup


def quiet_optuna() -> None:
    """Optuna logs a failed trial as a WARNING with its exception: Ctrl-C printed a full KeyboardInterrupt
    traceback and "Trial N failed with value None." over the progress bar. The CLI reports failures itself (the
    interrupted line, each study's first failure), so only Optuna's errors are shown."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)


def store_failed(e: BaseException, store: object, url: str, ran: int) -> str:
    """A profile-database error during the tune (a corrupt or locked file, a full disk): name the database and
    say what is kept. The trials are in the study storage, apart from the database: a re-run resumes them. Only a
    damaged file (or another StoreError of the file) gets "fix the database": a busy one, one this user may not
    write and a full disk have their own advice."""
    from moetune.tuner.store import StoreBusy, StoreFull, StoreNotWritable

    db = getattr(store, "path", None)
    head = f"the profile database {db} failed: {e}" if db is not None and str(db) not in str(e) else \
        f"the profile database failed: {e}"
    if isinstance(e, StoreFull):  # nothing is wrong with the file: the disk took no more (e names its folder)
        if ran:
            return (f"{head}; the {ran} trial(s) this run finished are saved in the studies file {redacted(url)}: free "
                    "space, then run the same command again: the studies resume and the profiles are written then")
        return f"{head}; no trial ran"  # e ends "free space there, then run the command again"
    if isinstance(e, StoreBusy | StoreNotWritable):  # nothing is wrong with the file: no "fix the database"
        fix = "" if isinstance(e, StoreBusy) else " make it writable (or pass another --db) and"  # e says "retry"
        if ran:
            return (f"{e}; the {ran} trial(s) this run finished are saved in the studies file {redacted(url)}:{fix} "
                    "run the same command again: the studies resume and the profiles are written then")
        return f"{e}; no trial ran" + (f":{fix} run the command again" if fix else "")
    if ran:
        kept = (f"the {ran} trial(s) this run finished are saved in the studies file {redacted(url)}; fix the "
                "database (or pass another --db) and run the same command again: the studies resume and the "
                "profiles are written then")
    else:
        kept = "no trial ran; fix the database (or pass another --db) and run the command again"
    return f"{head}; {kept}"



def model_preset_warning(preset: str | None) -> str:
    """The model backend's --preset checked before any database is opened (missing, unknown or unreadable: exit 2);
    its `[calibration] warning` when it is a fit the calibration checks refused, else ''."""
    from moetune.tuner.fabric_model.calibration_record import forced_fit_warning
    from moetune.tuner.fabric_model.presets import load_preset

    if preset is None:
        _fail("the model backend needs --preset: a preset name, or a calibrated preset file of this node "
              "(`moetune model calibrate --out FILE`) with --node-model")
    try:
        return forced_fit_warning(load_preset(preset))
    except (OSError, ValueError) as e:  # PresetError names the preset and what is wrong with it
        _fail(str(e))


def tune_scale_note(backend: str, preset: str | None, results: list) -> str | None:
    """The model backend's note where the EP size it predicted at lies beyond the most ranks the preset's calibration
    measured together (`[calibration] world`), or a token count outside the tokens per GPU its rows measured
    (`[calibration] tokens`), as `model predict` says it; None elsewhere, or where the preset records neither. Advice only: a preset file that cannot be read again (edited or removed during the tune) gives
    none, never a failure of a tune whose profiles are stored."""
    if backend != "model" or preset is None or not results:
        return None
    from moetune.tuner.cli.model import scale_note
    from moetune.tuner.fabric_model.presets import load_preset

    try:
        pr = load_preset(preset)
    except (OSError, ValueError):  # PresetError is a ValueError
        return None
    gpus = max(r.study.workload.nodes * r.study.workload.gpus_per_node for r in results)
    return scale_note(pr, gpus, "this tune", tokens=[r.study.workload.tokens for r in results])


def forced_note(preset: str, warning: str, node_model: bool, again: bool = False) -> str:
    """What the user is told, before and after the tune, when --preset is a forced (refused) fit: the explicit
    choice is honoured, never silently. `again` (after the results): the reminder only, its warning (the reasons,
    long) was printed once, before the tune."""
    use = "profiles stored as THIS NODE's model" if node_model else "profiles stored from it"
    if again:
        stored = ", stored as THIS NODE's model," if node_model else ""
        return (f"[bold red]FORCED MODEL: this tune's profiles{stored} rest on {escape(preset)}, a fit the "
                "calibration checks REFUSED[/bold red] [red](why: printed before the tune; the --json rows' "
                "forced_model). For a model to trust, re-run `moetune profile` or `moetune model calibrate` without "
                "--force.[/red]")
    return (f"[bold red]FORCED MODEL: {escape(preset)} is a fit the calibration checks REFUSED (written by "
            f"`moetune model calibrate --force`):[/bold red] {escape(warning)}\n"
            f"[red]its predictions are not trusted; the {use} rest on it. For a model to trust, re-run "
            "`moetune profile` or `moetune model calibrate` without --force.[/red]")


def row_note(row: dict[str, Any]) -> str | None:
    """The line under the results table for a row that stored nothing, or whose stored number is not its study's
    best (the side-by-side measurement is); None for the others."""
    best, sb = row["best_us"], row["study_best_us"]
    if row["written"] and (sb is None or best is None or abs(sb - best) <= 1e-9):
        return None
    # the store's reason is why it wrote or did not: alone after a written row, "no current profile for this key"
    # read as "nothing stored" beside a stored column that said new
    outcome = (f"stored {best:,.1f} µs as measured side by side ({row['reason']})" if row["written"] and best is not None
               else row["reason"])
    return (f"{row['family']} {row['model']} S={row['tokens']}: study best {'-' if sb is None else f'{sb:,.1f}'} µs "
            f"in its search trial; {outcome}")


def budget_ended(results: list, asked: int, timeout: float | None, source: str) -> None:
    """Say on stderr what share of the time budget each study got (where it was shared by several), and which
    studies it cut short, with the trials each ran of those asked: a table of winners does not show that they come
    from a shortened search (the exit code stays as it is)."""
    if timeout is not None and len(results) > 1:
        shares = "; ".join(f"{escape(r.study.family)} {escape(r.study.workload.model.name)} S={r.study.workload.tokens}"
                           f" {r.budget_s:.1f} s (took {r.used_s:.1f} s)" for r in results
                           if r.budget_s is not None and r.used_s is not None)
        err.print(f"[dim]the time budget ({escape(source)}, {timeout:g} s) shared over {len(results)} studies, each "
                  f"the time left / the studies left: {shares}[/dim]", soft_wrap=False)
    cut = [r for r in results if r.budget_ended]
    if not cut:
        return
    # wrapped at the console's width between words (the stderr console prints soft-wrapped lines whole)
    err.print(f"[yellow]the time budget ({escape(source)}, {timeout:g} s) ended the tune early: {len(cut)} of "
              f"{len(results)} studies ran fewer trials than the {asked} asked, or no side-by-side check[/yellow]",
              soft_wrap=False)
    for r in cut:
        ran = r.study.trials
        # a study whose trials all ran was cut at the side-by-side check of its winner: nothing was stored
        what = " (not started)" if ran == 0 else " (the side-by-side check not run: nothing stored)" if ran >= asked else ""
        err.print(f"  {escape(r.study.family)} {escape(r.study.workload.model.name)} S={r.study.workload.tokens}: "
                  f"{ran} of {asked} trials{what}"
                  f"{f' in its {r.budget_s:.1f} s' if r.budget_s is not None else ''}", soft_wrap=False)
    err.print("  run the same command again (or with a larger --timeout) to go on: the studies resume", soft_wrap=False)


def no_success(failed: list, total: int, modelled: bool = False) -> None:
    """Name the studies without a successful trial on stderr; exit 1 when that is every study (nothing measured, or
    with a modelling backend, `modelled`, nothing predicted: a model tune never measures, so it must not say so)."""
    if not failed:
        return
    for r in failed:
        what = f"{escape(r.study.family)} {escape(r.study.workload.model.name)} S={r.study.workload.tokens}"
        if r.budget_ended and r.study.trials == 0:  # no trial failed: the time budget was spent before it
            err.print(f"[yellow]{what}: no trial, the time budget ended before this study started[/yellow]",
                      soft_wrap=False)
            continue
        why = r.study.first_error  # recorded as the tune summed the study up (a real failure before a cut trial)
        err.print(f"[yellow]{what}: no successful trial[/yellow]" + (f" (first failure: {escape(why)})" if why else ""),
                  soft_wrap=False)
    if len(failed) == total:
        done = "predicted (MODELLED)" if modelled else "measured"
        err.print(f"[red]error:[/red] no study had a successful trial: nothing was {done} or stored", soft_wrap=False)
        raise typer.Exit(1)


def nothing_stored(results: list) -> None:
    """Exit 1 when the tune left no profile for any of its keys: nothing written, and none stored before (a winner
    that failed when measured again, ...). A key with no successful trial is named by `no_success` already."""
    if not results or any(r.stored != "none" for r in results):
        return
    err.print("[red]error:[/red] nothing stored: no key got a profile from this tune and none had one before",
              soft_wrap=False)
    for r in results:
        if r.study.best is not None:  # the others: "no successful trial", said above
            err.print(f"  {escape(r.study.family)} {escape(r.study.workload.model.name)} "
                      f"S={r.study.workload.tokens}: {escape(r.reason)}", soft_wrap=True)
    raise typer.Exit(1)
