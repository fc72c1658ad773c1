"""`moetune profile` (the bring-up flow) and `moetune report`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from moetune.runtime.config import MAX_TRIALS
from moetune.tuner.cli._args import (
    distinct_buckets,
    distinct_shapes,
    int_list,
    nearest_existing,
    path_option,
    tokens_over_bucket,
    write_error_code,
)
from moetune.tuner.cli._help import examples
from moetune.tuner.cli._progress import RichProgress
from moetune.tuner.cli._tables import Col, print_table
from moetune.tuner.cli.db import abort

_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup

# every key `--plan` takes (bringup.flow.Plan's fields; a test holds the two together): the help listed 6 of 11
PLAN_KEYS = ("models, tokens, trials, repeats, iters, compare_rounds, trial_timeout_s, microbench_sizes, backend, "
             "ep_sizes, world")


def _out_dir_problem(path: Path, hint: str = "") -> str | None:
    """Why the report folder `path` cannot be written (None when it can): it is not a directory, or it (or, when it
    does not exist yet, the nearest folder above it) is not a writable directory, or it holds a report.md that
    moetune did not write (never replaced; `hint` follows that reason: what to do instead)."""
    from moetune.tuner.bringup.report import foreign_report

    if path.exists():
        if not path.is_dir():
            return "exists and is not a directory (the report is a folder: report.md and its plots)"
        if not os.access(path, os.W_OK | os.X_OK):
            return "not writable"
        problem = _tried(path)
        if problem is not None:
            return problem
        foreign = foreign_report(path)
        return foreign + hint if foreign else None
    above = nearest_existing(path.parent)
    if not above.is_dir():
        return f"cannot create it, {above} is not a directory"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"cannot create it, {above} is not writable"
    return _tried(path)


def _tried(path: Path) -> str | None:
    """Why making the folder `path` (where missing) or a file in it fails, found by doing both (None when they work);
    what it made is removed again, so a check leaves no folder behind. `os.access` alone let through what the kernel
    refuses: root passes every permission bit, and nothing is made under /proc (`--report-dir /proc/x` failed with
    "[Errno 2]" only after the whole bring-up)."""
    import contextlib
    import tempfile

    missing: list[Path] = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    made: list[Path] = []
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
            except OSError as e:
                return f"cannot create {'it' if d == path else d} ({e.strerror or e})"
            made.append(d)
        try:
            fd, probe = tempfile.mkstemp(prefix=".moetune-check-", dir=path)
        except OSError as e:
            return f"cannot write in it ({e.strerror or e})"
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
        return None
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()


def _check_out_dir(path: Path, option: str) -> None:
    """Exit 2 naming the option unless the report folder `path` is a directory or can be made: checked before any
    work, so a long bring-up does not end on a FileExistsError. "-" is refused: elsewhere (`bench summarize --out -`,
    `profiles export -`) it means stdout, and a folder named "-" in the current folder was made instead."""
    if str(path) == "-":  # the parser keeps a Path: "./-" reads as "-" too, hence the absolute path in the hint
        _fail(f'{option} -: "-" is not stdout here: the report is a folder (report.md and its PNG plots), not one '
              'file; pass a folder (for a folder named "-", give its absolute path)')
    problem = _out_dir_problem(path, hint=f": move it, or pass another {option}")
    if problem is not None:
        _fail(f"{option} {path}: {problem}")


# `moetune report`'s folder when the one beside the database cannot be written (a shared, read-only database)
CWD_REPORT = "moetune-report"


def _default_report_dir(db_path: Path, other_node: str = "") -> Path:
    """report/ beside the database; when that cannot be written (a database the user may read but not write, as
    /var/lib/moetune owned by the daemon's user), ./moetune-report/ with a note saying why; else exit 2 naming
    both and --out. `other_node`: the fingerprint of the node a capture of another node describes, whose report
    is never this node's report/ (the rule `profile` follows): report-<fingerprint>/, ./moetune-report-<fingerprint>/."""
    suffix = f"-{other_node}" if other_node else ""
    beside = db_path.parent / f"report{suffix}"
    problem = _out_dir_problem(beside)
    if problem is None:
        return beside
    try:
        fallback = Path.cwd() / f"{CWD_REPORT}{suffix}"
    except OSError:  # the current directory was removed
        fallback, why = Path(f"{CWD_REPORT}{suffix}"), "the current directory no longer exists"
    else:
        why = _out_dir_problem(fallback)
    if why is not None:
        _fail(f"cannot write the report beside the database ({beside}: {problem}) nor to {fallback} ({why}): "
              "pass --out DIR")
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"note: report folder {beside}: {problem}; writing the report to {fallback} instead (--out DIR to choose)",
        markup=False)
    return fallback


def _open(db: Path | None, config: Path | None, *, readonly: bool = False):
    """(config, store) or a clear error (never a traceback) naming the bad key/file or database.

    `readonly`: the database must exist (a report of nothing would only create an empty one)."""
    from moetune.runtime.config import ConfigError, load_config
    from moetune.runtime.options import load_config_checked
    from moetune.tuner.cli.db import say_upgraded, warn_if_damaged
    from moetune.tuner.store.store import Store, StoreError

    try:
        # a bring-up measures: [runtime] checked and --config made the chain its trials run under; a report reads
        cfg = load_config(config) if readonly else load_config_checked(config)
        # intact: a damaged file is refused before any stage measures (and writes its results into it)
        store = Store(db or cfg.db_path, readonly=readonly, intact=not readonly)
        say_upgraded(store)
        if readonly:  # a report of a damaged file is made, with a warning (as every reader)
            warn_if_damaged(store)
        return cfg, store
    except StoreError as e:  # names the database; exit 1 when another process holds it or this user may not write it
        _fail(str(e), e.exit_code)
    except (ConfigError, RuntimeError, OSError) as e:  # ConfigError names key + file
        _fail(str(e))


def profile(
    ctx: typer.Context,
    model: list[str] = typer.Option([], "--model", "-m", help="Model shape to tune (repeatable): qwen3-30b, gpt-oss-120b, deepseek-v3 or custom:H,I,E,K (default: qwen3-30b)."),
    tokens: str | None = typer.Option(None, "--tokens", show_default=False, help="Comma-separated tokens per rank to tune for (token buckets; default: 128,1024,4096, with --quick 128,1024)."),
    quick: bool = typer.Option(False, "--quick", help="A short plan: one model, two buckets, few trials (≈ 2 min on a CPU)."),
    plan_file: Path | None = path_option(None, "--plan", help=f"TOML plan (a \\[plan] table, or the keys at the top): {PLAN_KEYS} (default: one EP group of every GPU of the node; the options given beside it win)."),
    trials: int | None = typer.Option(None, "--trials", help=f"Trials per (family, model, bucket) study, 1 to {MAX_TRIALS} (default: 16, with --quick 4)."),
    db: Path | None = path_option(None, "--db", help="Profile database (default: configured / $MOETUNE_HOME)."),
    config: Path | None = path_option(None, "--config", help="Extra config file."),
    capture: Path | None = path_option(None, "--capture", help="Describe the node from a capture instead of the live node (tests, support). A capture of another node (its fingerprint or software not this node's) is not measured: its discovery, plan and report only (nothing recorded in the database)."),
    report_dir: Path | None = path_option(None, "--report-dir", help="Where the report goes (default: report/ beside the database; report-FINGERPRINT/ for a --capture of another node). A report.md or plot there that moetune did not write is never replaced: refused (a report.md before the bring-up runs). Not \"-\": the report is a folder, not one file for stdout."),
    restart: bool = typer.Option(False, "--restart", help="Forget earlier progress of this plan on this node and start over: every stage runs again and tuning starts new studies (earlier studies and stored profiles are kept)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Bring a node up: discover → microbenchmark → calibrate → tune → store profiles → report.

    What is tuned: the EP transports per EP size (2+ GPUs; gloo ranks without GPUs) and, on an sm_90 GPU, the MoE megakernel (family megakernel): a one-GPU node has no EP size to tune, so with no sm_90 GPU, or every model left out (a model the megakernel cannot run is left out and said), it tunes nothing and exits 1. Profiles go to the database (--db), the report to --report-dir.

    Interrupted (Ctrl-C)? Run it again without --restart: finished stages are skipped and tuning resumes.
    """
    from moetune.tuner.cli._interrupt import say_sigterm_early

    # SIGTERM before the stages' own handling below (Optuna's import, the node's discovery: seconds) ended the
    # command with -15 and no word; a refusal on the way ends the command, and the handler with it
    before_stages = say_sigterm_early("before any stage ran; nothing was measured or stored")
    ctx.call_on_close(before_stages)
    import logging

    import optuna

    from moetune.runtime.config import ConfigError
    from moetune.runtime.knobs import KnobError
    from moetune.runtime.options import load_config_checked
    from moetune.runtime.shapes import get_model
    from moetune.tuner.bringup.flow import Bringup, Plan
    from moetune.tuner.bringup.report import NotOurReport, foreign_report
    from moetune.tuner.fabric.errors import DiscoveryError
    from moetune.tuner.fabric.moved import FabricMovedOn
    from moetune.tuner.store.db_file import database_path
    from moetune.tuner.store.store import StoreError

    # ERROR: Optuna logs a failed trial (Ctrl-C included) as a WARNING with its traceback; the flow reports failures
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.getLogger("moetune").setLevel(logging.WARNING)
    console = Console(stderr=as_json)
    plan = Plan.quick() if quick else Plan()
    # each option checked by itself, its error naming it alone (an unknown --model said "--model/--tokens/--trials")
    for m in model:
        try:
            get_model(m)
        except ValueError as e:
            _fail(f"--model: {e}")
    toks: list[int] = []
    if tokens is not None:  # `--tokens ""` is refused as `tune` refuses it (an empty item), never the default buckets
        try:
            toks = int_list(tokens, "--tokens")
        except ValueError as e:
            _fail(str(e))
        if any(t < 1 for t in toks):
            _fail(f"--tokens: token counts must be integers >= 1, got {tokens!r}")
        if why := tokens_over_bucket(toks):  # tuned at the nearest bucket: the largest, without a word
            _fail(why)
    if trials is not None and not 1 <= trials <= MAX_TRIALS:  # 10**20 was taken: a study that never ends
        _fail(f"--trials must be an integer from 1 to {MAX_TRIALS}, got {trials}")
    try:
        if plan_file is not None:
            plan = Plan.from_file(plan_file, plan)
        if model:
            plan.models = list(model)
        if toks:
            plan.tokens = toks
        if trials is not None:
            plan.trials = trials
        plan.validate(f"plan file {plan_file}" if plan_file is not None else "plan")
    except ValueError as e:
        _fail(str(e))
    # one study a bucket, as tune: `tokens = [128, 128, 100]` was tuned as bucket 128 once without a word; said once
    # on stderr, never a silent drop
    plan.tokens, note = distinct_buckets(plan.tokens, "--tokens" if toks else
                                         f"plan file {plan_file}: tokens" if plan_file is not None else "tokens")
    if note:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"note: {note}", markup=False)
    # one study a shape too: a model named twice (or by its custom:H,I,E,K beside its name) was tuned and compared twice
    plan.models, note = distinct_shapes(plan.models, "--model" if model else
                                        f"plan file {plan_file}: models" if plan_file is not None else "models")
    if note:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"note: {note}", markup=False)
    if report_dir is not None:
        _check_out_dir(report_dir, "--report-dir")
    # the node and the plan are checked before the database is opened: a refusal leaves no new database behind
    try:
        db_file = database_path(db or load_config_checked(config).db_path)
    except ConfigError as e:  # names the key and the file
        _fail(str(e))
    try:
        flow = Bringup(store=None, plan=plan, state_dir=db_file.parent, console=console, capture=capture,
                       report_dir=report_dir, progress=RichProgress(), db_path=db_file)  # stderr, --json too
    except (DiscoveryError, ValueError) as e:  # ValueError: an EP size of the plan this node cannot measure
        _fail(str(e))
    # the default folder's report.md checked as --report-dir's is: found only after the whole bring-up, it was replaced
    foreign = foreign_report(flow.report_dir) if report_dir is None and flow.report_dir.is_dir() else None
    if foreign:
        _fail(f"report folder {flow.report_dir}: {foreign}: move it, or pass --report-dir DIR")
    no_cuda = _no_cuda_for_nccl(flow, capture)
    if no_cuda:  # every measurement would start NCCL ranks that fail in init: refused up front
        _fail(no_cuda)
    from moetune.tuner.cli._run_lock import close_orphaned_runs, hold_run_lock, refuse_serving_daemon
    from moetune.tuner.search.storage import default_storage_url

    studies = default_storage_url(db_file)  # the studies file the tune stage opens
    if flow.measures:
        from moetune.tuner.cli.tune_storage import check_storage

        refuse_serving_daemon(db_file)
        # one measuring run per database at a time (a second `profile` or a `tune`): the second refuses at once
        hold_run_lock(db_file, ctx)
        # checked as `tune` checks it: opened only at the tune stage, a file there that is not a database, or a newer
        # Optuna's, failed after the microbenchmarks and calibration
        check_storage(studies, False, create=False, storage_option=False)  # refused: no profile database created
        _cfg, store = _open(db, config)
        close_orphaned_runs(store)  # rows of runs killed before they ended: `interrupted`, not `running` forever
        check_storage(studies, False, storage_option=False)
    else:
        from moetune.tuner.store.store import Store

        # a capture of another node: no stage measures or writes (the report comes from the run's state), so the
        # database is neither opened nor created (an empty moetune.db was made); a throwaway one stands in for it
        store = Store(":memory:")
    flow.store = store
    db_shown = str(store.path) if flow.measures else None  # no database was used
    if restart:  # deleting the state alone resumed the finished studies: nothing was tuned again
        flow.state.restart()
    console.print(f"node [bold]{flow.facts.gpu_count} GPU(s)[/] {flow.facts.gpu_model or ''} · fingerprint "
                  f"{flow.facts.fingerprint} · transports {', '.join(flow.facts.transport_names)} · db "
                  f"{escape(db_shown or f'{db_file} not opened (nothing is written for a capture of another node)')}")
    for line in node_limits(flow.facts):  # what discovery did not read, and what this node cannot run and why
        console.print(line, style="yellow" if line.startswith("warning") else None, markup=False)
    console.print(flow.ep_note, markup=False)
    # the plan's left-out models, said before the stages (they were said only as the tune stage ran)
    for name, why in flow.mk_left_out.items():
        console.print(flow.mk_left_note(name, why), style="yellow", markup=False)
    if flow.not_measured:  # said before the stages run, and again in the report
        console.print(f"[yellow]{escape(flow.not_measured)}[/]")
    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt

    # Ctrl-C, or SIGTERM raised as KeyboardInterrupt: the progress closed, one line, exit 130 / 143. The `except`s are
    # inside it, so `RuntimeError` below never takes its typer.Exit (a RuntimeError) for a failed stage
    # the same command again, --restart and all, starts over again: after one, the way on is without it
    again = "run it again without --restart" if restart else "run the same command again"
    before_stages()  # from here the stages' handling says what is kept; after them, SIGTERM is as it was
    with ends_cleanly_on_interrupt(lambda: f"{again} to continue where it stopped", console):
        try:
            try:
                done = flow.run()
            finally:
                flow.progress.close()  # its last lines before any message below (closed after one, they followed it)
        except StoreError as e:  # e.g. another process holds the database: exit 1, as db/tune/profiles do
            _fail(f"{e} (finished stages are kept; {again} to continue)", e.exit_code)
        except FabricMovedOn as e:  # before RuntimeError: says itself what a rerun does
            _fail(str(e), e.exit_code)
        except NotOurReport as e:  # a plot file of the user's (or a report.md put there meanwhile): nothing replaced
            where = f"--report-dir {report_dir}" if report_dir is not None else f"report folder {flow.report_dir}"
            _fail(f"{where}: {e}: move it, or pass {'another ' if report_dir is not None else ''}--report-dir DIR "
                  f"(finished stages are kept; {again} to continue)")
        except OSError as e:
            # the report folder passed the up-front check but could not be written (root and /proc, a folder removed
            # meanwhile): name the option, as `report --out` does
            mine = report_dir is not None and e.filename is not None and str(e.filename).startswith(str(report_dir))
            _fail(f"{'--report-dir ' if mine else ''}{e} (finished stages are kept; {again} to continue)",
                  write_error_code(e))
        except (ValueError, KnobError, RuntimeError) as e:
            _fail(f"{e} (finished stages are kept; {again} to continue)")
        except Exception as e:  # the studies file failed under the tune stage (Optuna's and SQLite's errors)
            from moetune.tuner.cli._interrupt import interrupt_behind
            from moetune.tuner.cli.tune_storage import tuning_storage_failed

            if interrupt_behind(e) is not None:  # raised while an interrupt unwound: the interrupt, said as one
                raise
            # a full disk, a file this user may not write: exit 1 naming the file, as `tune` says it
            tuning_storage_failed(studies, False, e, storage_option=False)
            if isinstance(e, optuna.exceptions.OptunaError):
                _fail(f"the tuning stopped on an Optuna error ({type(e).__name__}: {e}) (finished stages and trials "
                      f"are kept; {again} to continue)")
            raise
    rows = done.get("compare") or []
    failed = flow.failures()
    if as_json:  # a failed run's time is NaN: null here (JSON has no NaN; `NaN` broke jq and every strict reader)
        from moetune.tuner.fabric_model.calibration import finite_or_none

        typer.echo(json.dumps(finite_or_none({"fingerprint": flow.facts.fingerprint, "db": db_shown, "ep_sizes": flow.ep_sizes,
                               "ep_note": flow.ep_note, "profiles": rows,
                               "unavailable": [{"family": t.name, "why": t.reason} for t in flow.facts.unavailable],
                               "discovery_warnings": list(flow.facts.warnings),
                               "not_measured": flow.not_measured or None,
                               "calibration": done.get("calibrate"), "report": done.get("report"),
                               # as the tune stage recorded them (a resumed run's too)
                               "megakernel_left_out": [{"model": m, "reason": why} for m, why in flow.left_out.items()],
                               # transport families an EP size could not be served by, left out before its studies
                               "left_out": flow.ep_left_out,
                               "failed": failed}), indent=1, allow_nan=False))
        _failed_parts(Console(stderr=True, highlight=False), failed, again)
        _nothing_tuned(Console(stderr=True, highlight=False), flow)
        return
    cells = []

    def us(v: float, spread: float) -> str:
        return f"{v:.0f} ± {spread:.0f}" if v == v else "failed"  # NaN: that run failed

    for r in rows:
        sp = r["default_us"] / r["tuned_us"] if r["tuned_us"] and r["tuned_us"] == r["tuned_us"] else float("nan")
        cells.append((escape(r["model"]), str(r.get("ep_size") or "–"), str(r["tokens"]), escape(r["family"]),
                      us(r["default_us"], r["default_spread"]), us(r["tuned_us"], r["tuned_spread"]),
                      f"{sp:.2f}×" if sp == sp else "–",
                      escape(r.get("stored", "current") if r["written"] else r["reason"]),  # wraps between words, never cut
                      escape(r["knobs"] or "(default)")))
    # a number ("123 ± 4" too) is never wrapped or cut, nor is a model, family or knob folded inside itself (run 188
    # printed "qwen3-30 / b", "megakern / el" at 80 columns); the knobs, the widest, give way first: the report
    # file whose path follows lists them
    cols = (Col("model", "word"), Col("EP", "num"), Col("S", "num"), Col("family", "word"),
            Col("default µs", "num"), Col("tuned µs", "num"), Col("speedup", "num", drop=2),
            Col("stored", "word"), Col("changed knobs", "word", drop=1))
    if cells or not (flow.not_measured or flow.nothing_tuned):  # an empty table says nothing: a line below says why
        print_table(console, cols, cells, title="tuned profiles (measured side by side with the policy default)",
                    left_out_hint="the report lists them")
    for line in kept_lines(rows):
        console.print(line, markup=False)
    console.print(flow.ep_note, markup=False)
    # said by the tune stage when it ran; a resumed run's summary says it too, from what that stage recorded
    for name, why in flow.left_out.items():
        console.print(flow.mk_left_note(name, why), style="yellow", markup=False)
    for row in flow.ep_left_out:
        console.print(flow.ep_left_note(row), style="yellow", markup=False)
    cal = done.get("calibrate") or {}
    if "mean_abs_rel_err" in cal:
        console.print(f"node fabric model: {cal['preset_file']} (fit error mean {100 * cal['mean_abs_rel_err']:.1f}%, "
                      f"max {100 * cal['max_abs_rel_err']:.1f}%)")
    elif cal.get("refused"):  # said by the stage when it ran; a resumed run's summary says it too
        # what to do next: the same command again only resumes this finished bring-up and writes no model again
        # an earlier bring-up's node model stays in place (the daemon's model re-tune uses it): "NOT written" alone
        # read as if this node had none
        then = (f"; the node model from an earlier bring-up ({cal['earlier_node_model']}) is left as it was"
                if cal.get("earlier_node_model") else
                "; a rerun resumes this bring-up and writes none: fix the measurements and run `moetune profile "
                "--restart`, or let the daemon re-tune by measuring ([tune] backend = \"local\")")
        console.print(f"[yellow]node fabric model NOT written (calibration refused): "
                      f"{escape('; '.join(map(str, cal['refused'])) + then)}[/]")
    elif cal.get("skipped"):
        console.print(f"node fabric model not calibrated: {cal['skipped']}", markup=False)
    if flow.not_measured:
        console.print(f"[yellow]{escape(flow.not_measured)}[/]")
    console.print(f"report: {done.get('report')}")
    _failed_parts(console, failed, again)
    _nothing_tuned(console, flow)


def node_limits(facts: Any) -> list[str]:
    """What the start of a bring-up says of the node beyond the transports it found: each discovery warning (what
    was not read: the facts are incomplete) and the transport families it cannot run, each with why (no NVLink
    between PCIe-only GPUs, no ACTIVE InfiniBand port, no GPUDirect RDMA, one GPU). Only the families found were
    named, so a node without NVLink or a NIC said nothing of why none was tuned."""
    out = [f"warning: discovery: {w}" for w in facts.warnings]
    if facts.unavailable:
        out.append("not available here (not tuned): " + "; ".join(f"{t.name}: {t.reason}" for t in facts.unavailable))
    return out


def _failed_parts(console: Console, failed: list[str], again: str = "run the same command again") -> None:
    """Exit 1 (the work failed) naming each failed part of the bring-up: its stage is not done, a rerun tries it
    again. A bucket whose trials all failed was said nowhere and the command exited 0."""
    if not failed:
        return
    console.print(f"[red]error:[/] {len(failed)} part(s) of the bring-up failed ({again} to try them again; finished "
                  "parts are kept):", soft_wrap=True)
    for why in failed:
        console.print(f"  {escape(why)}", soft_wrap=True)
    raise typer.Exit(1)


def _nothing_tuned(console: Console, flow: Any) -> None:
    """Exit 1 (as `tune` and `bench knobs` do where nothing was measured) when the bring-up of this node tuned
    nothing: a one-GPU node where the megakernel cannot run, or whose every planned model it cannot run. It exited 0
    and its report said the megakernel "is what was tuned". A capture of another node measures nothing by design: its
    status is unchanged."""
    if flow.measures and flow.nothing_tuned:
        hint = "; plan a model it can run (--model)" if flow.mk_ok else ""  # else the reason says what is missing
        console.print(f"[red]error:[/] {escape(flow.nothing_tuned)}{hint}", soft_wrap=True)
        raise typer.Exit(1)


def kept_lines(rows: list[dict]) -> list[str]:
    """Why each bucket's tuned setting is not what it runs (the compare stage's `why_default`): the table's "policy
    default" or "current profile" said what, only the report file said why. Where the store refused what the
    comparison chose, its reason too: the key keeps the profile it had."""
    out = []
    for r in rows:
        if not r.get("why_default"):
            continue
        what = f"{r['family']} {r['model']} S={r['tokens']}: the {r.get('stored', 'default')} chosen: {r['why_default']}"
        out.append(what if r.get("written", True) else f"{what}; not stored ({r['reason']}), the key keeps what it had")
    return out


def _no_cuda_for_nccl(flow: object, capture: Path | None) -> str:
    """Why the bring-up cannot measure its EP groups here ('' when it can): on a node with >= 2 GPUs it launches
    one NCCL rank per GPU, and torch finds fewer CUDA GPUs on this machine (a CPU build of torch, hidden GPUs, a
    --capture of another node). The ranks started and every measurement failed in init, minutes of them."""
    from moetune.tuner.search.local_backend import cuda_gpus

    if (getattr(flow, "comm_backend", "") != "nccl" or not getattr(flow, "tune_ep", False)
            or not getattr(flow, "measures", True)):  # a capture of another node: nothing is launched
        return ""
    need, found = max(flow.ep_sizes), cuda_gpus()  # type: ignore[attr-defined]
    if found >= need:
        return ""
    gpus = flow.facts.gpu_count  # type: ignore[attr-defined]
    where = f"--capture {capture} describes a node" if capture is not None else "this node has"
    fix = ("run `moetune profile` on the node the capture was taken on" if capture is not None else
           "check that torch is a CUDA build and that CUDA_VISIBLE_DEVICES shows the GPUs")
    return (f"{where} with {gpus} GPUs, so the bring-up measures EP size {need} with NCCL, one CUDA GPU per rank, "
            f"on this machine; torch finds {found} CUDA GPU(s) here: {fix}")


def report(
    db: Path | None = path_option(None, "--db", help="Profile database (default: \\[store] db, $MOETUNE_HOME, XDG data dir)."),
    config: Path | None = path_option(None, "--config", help="Extra config file."),
    out: Path | None = path_option(None, "--out", help="Output directory (default: report/ beside the database, report-<fingerprint>/ for a --capture of another node; ./moetune-report/ (-<fingerprint>) when that cannot be written or holds a report.md moetune did not write). A report.md or plot there that moetune did not write is never replaced: refused. Not \"-\": the report is a folder, not one file for stdout."),
    capture: Path | None = path_option(None, "--capture", help="Report on the node a capture describes."),
) -> None:
    """Write the bring-up report (Markdown + PNG plots) of this node from the database."""
    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt, interrupts_ignored

    console = Console()
    where: dict[str, Any] = {}  # the folder, once chosen: what it held before and which of its folders were missing
    printed: list[Path] = []

    def done(path: Path) -> None:
        """The report is whole (report.md, written last, is in place): said once; an interrupt now changes nothing."""
        with interrupts_ignored():
            if not printed:
                console.print(f"report: {path}")
                printed.append(path)

    # Ctrl-C (or SIGTERM) before the report is whole, its imports (matplotlib: a second or so) included: one line
    # saying what is left, the folder it made removed when it is still empty, exit 130 (143). It ended with no word
    # and left an empty folder behind.
    with ends_cleanly_on_interrupt(lambda: _report_left(where)):
        from moetune.tuner.bringup.flow import report_from_store
        from moetune.tuner.bringup.report import NotOurReport
        from moetune.tuner.fabric.discovery import capture_not_this_node, discover
        from moetune.tuner.fabric.errors import DiscoveryError

        if out is not None:
            _check_out_dir(out, "--out")
        _cfg, store = _open(db, config, readonly=True)
        try:
            facts = discover(capture)
        except DiscoveryError as e:
            _fail(str(e))
        # a capture of another node: its report goes to report-<its fingerprint>/, never over this node's report/ (as
        # `profile --capture` of another node does); an explicit --out is the caller's choice
        other = capture_not_this_node(facts, capture) if capture is not None and out is None else ""
        dest = out or _default_report_dir(Path(store.path), facts.fingerprint if other else "")
        where.update(dest=dest, missing=_missing_dirs(dest), before=_files_in(dest))
        try:
            try:
                path = report_from_store(store, facts, dest)
            except NotOurReport as e:  # a plot file of the user's (or a report.md put there meanwhile): nothing replaced
                _fail(f"{'--out' if out is not None else 'report folder'} {dest}: {e}: move it, or pass "
                      f"{'another ' if out is not None else ''}--out DIR")
            except OSError as e:  # the folder vanished, a full disk, a plot file we may not replace
                _fail(f"{'--out ' if out is not None else 'report folder '}{dest}: cannot write the report "
                      f"({e.strerror or e})", write_error_code(e))
            done(path)
        except KeyboardInterrupt:  # after report.md was put in place (it is written last): the report is whole
            if "report.md" not in _written(where):
                raise
            done(dest / "report.md")


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist, deepest first: the folders writing the report makes."""
    out = []
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def _files_in(path: Path) -> dict[str, int]:
    """The files in the folder `path` by name, with their modification times (none when it cannot be read)."""
    try:
        return {p.name: p.stat().st_mtime_ns for p in path.iterdir() if p.is_file() and not p.name.startswith(".")}
    except OSError:
        return {}


def _written(where: dict[str, Any]) -> list[str]:
    """The files of the report folder this run wrote or replaced (by their modification times), sorted."""
    if "dest" not in where:
        return []
    before = where["before"]
    return sorted(n for n, t in _files_in(where["dest"]).items() if before.get(n) != t)


def _report_left(where: dict[str, Any]) -> str:
    """What an interrupted `report` left: nothing (and the folder it made removed again when still empty), or the
    plots it wrote before report.md (written last), which are left in the folder."""
    dest = where.get("dest")
    if dest is None:
        return "no report written"
    written = _written(where)
    if not written:
        removed = []
        for d in where["missing"]:  # deepest first; rmdir removes only an empty folder
            try:
                d.rmdir()
            except OSError:
                break
            removed.append(d)
        if removed:
            return f"no report written; the empty folder {removed[-1]} it made is removed"
        if where["missing"]:
            return f"no report written; the folder {dest} it made is left"
        return f"no report written; {dest} is as it was"
    earlier = " (the report.md there is the earlier one)" if "report.md" in where["before"] else ""
    return (f"the report is not complete: report.md was not written{earlier}; {', '.join(written)} written in "
            f"{dest} {'is' if len(written) == 1 else 'are'} left there; run the same command again for the whole "
            "report")


def register(app: typer.Typer) -> None:
    app.command("profile", epilog=examples(("profile",)))(profile)
    app.command("report")(report)
