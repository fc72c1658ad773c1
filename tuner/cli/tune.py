"""`moetune tune`: Optuna searches over the EP knobs.

    moetune tune --model qwen3-30b --tokens 128,1024,4096 [--backend model|local] [--preset P]
                 [--trials N] [--timeout S] [--storage URL] [--seed N] [--db PATH]
    moetune tune show [--study NAME] [--json]

Here: the `tune` command and its options' checks. `tune show` is in tune_show.py, the study-storage checks in
tune_storage.py, the notes and outcome messages in tune_notes.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from moetune.runtime.config import MAX_TRIALS
from moetune.runtime.profile_record import WHAT_IF_ONLY
from moetune.tuner.cli import tune_show
from moetune.tuner.cli._args import (
    distinct_buckets,
    int_list,
    path_option,
    path_text_option,
    routing_problem,
    seed_problem,
    text_option,
    tokens_over_bucket,
)
from moetune.tuner.cli._help import examples
from moetune.tuner.cli._tables import Col, print_table
from moetune.tuner.cli.db import abort
from moetune.tuner.cli.tune_notes import (
    budget_ended,
    err,
    forced_note,
    model_preset_warning,
    no_success,
    nothing_stored,
    quiet_optuna,
    row_note,
    store_failed,
    tune_scale_note,
)
from moetune.tuner.cli.tune_storage import (
    STORAGE_EMPTY,
    check_storage,
    open_store,
    read_config,
    redacted,
    refuse_memory,
    server_lost,
    storage_url,
    tuning_storage_failed,
)

app = typer.Typer(help="Optuna searches over the EP knobs (`moetune tune --model M ...`; `moetune tune show`).",
                  invoke_without_command=True, no_args_is_help=False, epilog=examples(("tune",)))


# the capture option's two spellings (Click does not say which one was typed): errors name both
CAPTURE_OPT = "--from/--capture"

COMM_BACKENDS = ("nccl", "gloo")  # what the local backend launches its ranks with (`moetune bench ep --backend`)

# --backend "" was taken for the configured backend (`backend or cfg_backend`)
BACKEND_EMPTY = "an empty backend names none: give model or local (leave the option out for config [tune] backend)"
FAMILY_EMPTY = "an empty family names none (leave the option out for every family of the fabric)"


_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup



def cuda_problem(comm: str, world: int, given: bool, why_default: str) -> str:
    """Why `comm` (nccl) cannot run `world` ranks on this machine ('' when it can, or `comm` is gloo): NCCL puts
    each rank on its own CUDA GPU; without them the ranks started, then failed ~10 s later in init
    (torch._C has no _cuda_setDevice). `given`: --comm was given; else `why_default` says why nccl was chosen."""
    if comm != "nccl":
        return ""
    from moetune.tuner.search.local_backend import cuda_gpus

    found = cuda_gpus()
    if found >= world:
        return ""
    what = "--comm nccl" if given else f"--comm nccl (the default: {why_default})"
    return (f"{what} needs {world} CUDA GPUs on this machine (one per rank, --world {world}), found {found}: "
            "pass --comm gloo to measure between CPU processes" + ("" if found < 2 else f", or --world {found}"))


def _parse_tokens(text: str) -> list[int]:
    """--tokens: counts >= 1, none above the largest token bucket, one a bucket (a note names those sharing one)."""
    try:
        out = int_list(text, "--tokens")
    except ValueError as e:
        raise typer.BadParameter(str(e).removeprefix("--tokens: "), param_hint="--tokens") from None
    if not out or any(t < 1 for t in out):
        raise typer.BadParameter(f"token counts must be integers >= 1, got {text!r}", param_hint="--tokens")
    if why := tokens_over_bucket(out):  # profile's rule: it was tuned and stored at the largest bucket, rc 0
        _fail(why)  # profile's words, one line
    out, note = distinct_buckets(out)
    if note:  # one study a bucket: said once, not a silent drop (nor the same study run again)
        err.print(escape(note))
    return out


# the options one backend alone reads: given with the other, each was accepted and did nothing
LOCAL_ONLY = {"world": "--world", "comm": "--comm", "repeats": "--repeats", "trial_timeout": "--trial-timeout"}
MODEL_ONLY = {"preset": "--preset", "node_model": "--node-model"}


def _inert_options(ctx: typer.Context, backend: str) -> str:
    """Why the options given cannot go with `backend` ('' when they can): the local backend's (ranks launched here:
    --world, --comm, --repeats, --trial-timeout) with the model backend, which launches nothing, and the model
    backend's (--preset, --node-model) with the local backend, which measures and predicts nothing."""
    def given(name: str) -> bool:  # typed, not the option's default (Typer's click: by the source's name)
        return getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")

    if backend == "model":
        extra = [opt for name, opt in LOCAL_ONLY.items() if given(name)]
        why = "apply to the local backend's runs on this node; --backend model launches none (it predicts)"
    else:
        extra = [opt for name, opt in MODEL_ONLY.items() if given(name)]
        why = "apply to the fabric model; --backend local measures on this node and predicts nothing"
    if not extra:
        return ""
    return (f"{', '.join(extra)}: {'it applies' if len(extra) == 1 else 'they apply'}{why.removeprefix('apply')}: "
            f"leave {'it' if len(extra) == 1 else 'them'} out, or use --backend {'local' if backend == 'model' else 'model'}")


@app.callback(invoke_without_command=True)
def tune(
    ctx: typer.Context,
    model: list[str] = typer.Option(None, "--model", "-m", help="Model shape (qwen3-30b, deepseek-v3, gpt-oss-120b, custom:H,I,E,K). Repeatable."),
    tokens: str = typer.Option("128,1024,4096", "--tokens", "-t", help="Tokens per GPU, comma separated (tuned at the nearest bucket, once a bucket; at most 65536, the largest)."),
    backend: str = text_option(None, "--backend", "-b", empty=BACKEND_EMPTY, help="model (fabric model; needs --preset) or local (the real runtime) (default: config \\[tune] backend, model)."),
    preset: str = path_text_option(None, "--preset", "-p", help="Fabric-model preset for the model backend."),
    trials: int = typer.Option(None, "--trials", "-n", help=f"Finished trials per study, 1 to {MAX_TRIALS} (default: config \\[tune] trials, 40)."),
    timeout: float = typer.Option(None, "--timeout", help="Wall-clock budget in seconds for the whole tune (default: config \\[tune] timeout_s, 600), shared over its studies (one per family, model and token bucket): each in turn gets the time left divided by the studies left, so what one does not use goes to the next; stderr says each study's share."),
    storage: str = text_option(None, "--storage", empty=STORAGE_EMPTY, help="Optuna storage URL (default: NAME-studies.db beside the profile database NAME.db, moetune-studies.db for moetune.db; postgresql://... to share a study)."),
    seed: int = typer.Option(0, "--seed", help="Sampler seed (0 to 4294967295)."),
    db: Path = path_option(None, "--db", help="Profile database (default: configured)."),
    config: Path = path_option(None, "--config", help="TOML config file (its \\[tune] section gives the defaults)."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes in the EP group, >= 1."),
    ep_size: int = typer.Option(None, "--ep-size", help="EP group size (default: --world with the local backend, else GPUs per node × nodes; 2 × nodes on a node without GPUs). The local backend stores only what it measures: --ep-size = --world, --nodes 1."),
    family: list[str] = text_option(None, "--family", "-f", empty=FAMILY_EMPTY, help="Only these transport families (repeatable), e.g. host_staged."),
    policy: Path = path_option(None, "--policy", help="User policy file or directory overriding the packaged policies."),
    routing: str = typer.Option("uniform", "--routing", help="uniform or zipf:S."),
    world: int = typer.Option(None, "--world", help="Local backend: ranks to launch on this node (default: --ep-size, else GPUs found, else 2)."),
    comm: str = typer.Option(None, "--comm", help="Local backend: nccl or gloo (default: nccl with GPUs, else gloo)."),
    repeats: int = typer.Option(3, "--repeats", help="Local backend: runs per trial (median and spread), >= 1."),
    trial_timeout: float = typer.Option(120.0, "--trial-timeout", help="Local backend: seconds before a run is killed, > 0."),
    capture: Path = path_option(None, "--from", "--capture", help="Discover from a fabric capture directory instead of this node (--capture, as for `moetune profile`): the local backend, or the model backend with --node-model (with a plain --preset the preset's fabric is predicted, so it is refused)."),
    node_model: bool = typer.Option(False, "--node-model", help="Model backend: --preset is a calibrated model of THIS node (profiles get this node's key)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Tune the knobs for each transport family × model × token bucket and store the winners."""
    if ctx.invoked_subcommand is not None:
        _no_options_before(ctx, policy)
        return
    if not model:
        typer.echo(ctx.get_help())
        _fail("give at least one --model (e.g. --model qwen3-30b)")
    from moetune.runtime.shapes import get_model

    try:
        shapes = [get_model(m) for m in model]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--model")
    from moetune.tuner.cli._args import distinct_shapes

    names, note = distinct_shapes(list(model))
    if note:  # one study a shape and bucket: said once, not the same studies (and side-by-side check) run again
        err.print(escape(note))
        shapes = [get_model(m) for m in names]
    toks = _parse_tokens(tokens)
    cfg = read_config(config, measuring=True)
    cfg_trials, cfg_timeout, cfg_backend = int(cfg.tune.trials), cfg.tune.timeout_s, str(cfg.tune.backend)
    backend = backend if backend is not None else cfg_backend
    if backend not in ("model", "local"):
        raise typer.BadParameter(f"expected model or local, got {backend!r}", param_hint="--backend")
    trials = trials if trials is not None else cfg_trials
    if not 1 <= trials <= MAX_TRIALS:  # 10**20 was taken: a study that never ends ([tune] trials: checked as read)
        raise typer.BadParameter(f"must be 1 to {MAX_TRIALS}, got {trials}", param_hint="--trials")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        _fail(f"--timeout must be a number of seconds > 0, got {timeout}")
    budget_from = "--timeout"  # named where the budget ends the tune early
    if timeout is None and cfg_timeout:
        timeout, budget_from = float(cfg_timeout), "[tune] timeout_s"
    if not (math.isfinite(trial_timeout) and trial_timeout > 0):
        _fail(f"--trial-timeout must be a number of seconds > 0, got {trial_timeout}")
    if seed_problem(seed):
        _fail(seed_problem(seed))
    if repeats < 1:
        _fail(f"--repeats must be >= 1, got {repeats}")
    if world is not None and world < 1:
        _fail(f"--world must be >= 1, got {world}")
    if nodes < 1:
        _fail(f"--nodes must be >= 1, got {nodes}")
    if ep_size is not None and ep_size < 1:  # 0 was taken for "not given" and silently replaced by the default
        _fail(f"--ep-size must be >= 1, got {ep_size}")
    if comm is not None and comm not in COMM_BACKENDS:
        _fail(f"--comm must be {' or '.join(COMM_BACKENDS)}, got {comm!r}")
    # after each value's own check (a bad value is named as such), before anything runs
    if why := _inert_options(ctx, backend):
        _fail(why)
    # up front: the first study refused it ("model error: ... unknown routing"), the database already made
    if why := routing_problem(routing):
        _fail(why)
    if family:  # a name no family has: refused before any database is made (the search refused it after)
        twice = sorted({f for f in family if family.count(f) > 1})
        if twice:  # one family, one set of studies: named once in errors and tuned once, as a shape given twice
            family = list(dict.fromkeys(family))
            err.print(escape(f"--family: {', '.join(twice)} given more than once, taken once"))
        from moetune.tuner.search.policy import _known_families_text
        from moetune.tuner.store.validate import is_known_family

        unknown = [f for f in family if not is_known_family(f)]  # proxy:libfabric/<provider> is one
        if unknown:
            _fail(f"--family {', '.join(unknown)}: not a transport family (known: {_known_families_text()})")
    if capture is not None:  # before anything runs (it was ignored, or a traceback, when it did not exist)
        from moetune.tuner.fabric.errors import DiscoveryError
        from moetune.tuner.fabric.sources import read_capture_manifest

        try:
            read_capture_manifest(capture)
        except DiscoveryError as e:  # names the path itself
            _fail(f"{CAPTURE_OPT} {e}")  # "--from/--capture PATH: what is wrong"
        if backend == "model" and preset is not None and not node_model:
            # the preset's facts stand for the fabric (its GPUs per node, its key): the capture was never read, and
            # the tune predicted the preset's fabric as if it were the captured node's, without a word
            _fail(f"{CAPTURE_OPT} {capture}: --backend model --preset {preset} predicts the preset's fabric (its GPUs, "
                  "its links, stored under the preset's key), not the capture's: the capture would be read for "
                  "nothing. Leave it out, or add --node-model with a model calibrated on that node (`moetune model "
                  "calibrate --this-node --out FILE` there, or its `moetune profile`)")
    from moetune.tuner.search.policy import ENV_POLICY

    if policy is not None or os.environ.get(ENV_POLICY):
        from moetune.tuner.search.policy import PolicyError, load_policy, packaged_families

        if policy is not None and not policy.exists():
            raise typer.BadParameter(f"{policy} does not exist", param_hint="--policy")
        try:  # validate early: every packaged family with the override (--policy, else $MOETUNE_POLICY) applied
            for fam in packaged_families():
                load_policy(fam, policy)
        except PolicyError as e:
            _fail(str(e) if policy is not None else f"{ENV_POLICY}: {e}")

    if storage is not None:
        refuse_memory(storage, "the studies would be lost when moetune exits: nothing could resume or show them")
    forced = model_preset_warning(preset) if backend == "model" else ""

    quiet_optuna()
    logging.getLogger("moetune").setLevel(logging.WARNING)

    facts = None
    local_opts: dict = {}
    if backend == "local" or preset is None or node_model:
        try:
            from moetune.tuner.fabric.discovery import discover  # type: ignore[attr-defined]
        except ImportError as e:
            _fail(f"fabric discovery is not available in this build ({e}); use --backend model --preset P")
        from moetune.tuner.fabric.errors import DiscoveryError

        try:
            facts = discover(capture)
        except DiscoveryError as e:
            if capture is None:
                _fail(str(e))
            # a capture's error names its path (or a file in it): the option once, the path once
            _fail(f"{CAPTURE_OPT} {e}" if str(e).startswith(str(capture)) else f"{CAPTURE_OPT} {capture}: {e}")
    if backend == "local" and capture is not None:
        from moetune.tuner.fabric.discovery import capture_not_this_node

        # the trials run HERE: their numbers may only be stored under this node's key, never the capture's
        other = capture_not_this_node(facts, capture)
        if other:  # before any database is created
            _fail(f"--backend local measures on this node, but {other}: a measurement made here is never stored "
                  "under another node's fingerprint. Run the tune on that node, leave out "
                  f"{CAPTURE_OPT} to tune this one, or predict a fabric like it with --backend model --preset P, without "
                  f"{CAPTURE_OPT} (stored as MODELLED under the preset's key)")
    if backend == "model" and node_model and preset is not None and facts is not None:
        from moetune.tuner.fabric_model.presets import load_preset, node_model_refusal

        # labelled node_model (outranking presets everywhere) only when calibrated on this very fingerprint
        why = node_model_refusal(load_preset(preset), facts.fingerprint)
        if why:  # before any database is created
            _fail(f"--node-model: {why}")
    if forced:  # said once the preset is accepted for this use (a refused --node-model says only why)
        err.print(forced_note(preset, forced, node_model))
    if backend == "local":
        gpus = facts.gpu_count
        # the ranks launched on this node: --world, else the EP size asked (what is measured is what is stored)
        local_opts = {"world": world or ep_size or (gpus if gpus >= 2 else 2),
                      "comm_backend": comm or ("nccl" if gpus else "gloo"), "repeats": repeats, "timeout_s": trial_timeout}
        source = f"{CAPTURE_OPT} {capture}" if capture is not None else "discovery"
        from moetune.tuner.search.tune import gloo_ranks_problem

        why = gloo_ranks_problem(local_opts["world"], gpus) if local_opts["comm_backend"] == "gloo" else ""
        if why:  # refused up front, as `profile` refuses such an EP size: a trial would take minutes
            _fail(f"--world {local_opts['world']}: {why} ({source} found {gpus} GPU(s))")
        no_cuda = cuda_problem(local_opts["comm_backend"], local_opts["world"], comm is not None,
                               f"{source} found {gpus} GPU(s)")
        if no_cuda:  # refused up front, as `moetune bench ep --backend nccl` is
            _fail(no_cuda)
    from moetune.tuner.search.model_backend import ModelBackend
    from moetune.tuner.search.tune import check_tune, group_left_out_note

    try:  # what the search would refuse before its first study (a family not on this fabric, ...): before any file is made
        # the banner above gave a forced fit's warning: the backend does not log it a second time
        tune_backend: Any = ModelBackend(preset, warn_forced=False) if forced else backend
        plan = check_tune(facts, models=shapes, backend=tune_backend, preset=preset,
                   ep_size=ep_size or (local_opts.get("world") if backend == "local" else None), nodes=nodes,
                   families=family or None, policy_override=policy, node_model=node_model, local_options=local_opts)
    except (ValueError, OSError) as e:
        # an unmeasured EP group or gloo on a GPU node: LocalBackend.refusal says why; the flags that chose it here
        where = (f" (--world {local_opts['world']}, --ep-size {ep_size or local_opts['world']}, --nodes {nodes}, "
                 f"--comm {local_opts['comm_backend']}; {source} found {facts.gpu_count} GPU(s))"
                 if backend == "local" and facts is not None else "")
        _fail(f"{e}{where}")
    db_path = db if db is not None else cfg.db_path
    url = storage_url(storage, db_path)  # the URL tune_profiles_detailed opens (storage, else beside the store)
    check_storage(url, storage is not None, create=False)  # refused: no profile database created
    from moetune.tuner.cli._run_lock import close_orphaned_runs, hold_run_lock, refuse_serving_daemon

    refuse_serving_daemon(db_path)  # the daemon is its database's single writer (as for `profile`)
    if backend == "local":
        # one measuring run per database at a time (a `profile` or another local `tune`): the second refuses at once,
        # as their measurements would skew each other. Model tunes may share a study and a database (workers of one
        # study, tests/test_tune_storage_journal.py): they measure nothing
        hold_run_lock(db_path, ctx)
    store = open_store(db_path)
    close_orphaned_runs(store)  # rows of runs killed before they ended: `interrupted`, not `running` forever
    check_storage(url, storage is not None)  # refused --db: no studies file created
    from moetune.tuner.cli._progress import RichProgress
    from moetune.tuner.fabric.moved import FabricGuard, FabricMovedOn, GuardedStore
    from moetune.tuner.search.tune import tune_profiles_detailed
    from moetune.tuner.store import StoreError

    # a measurement is stored under the fingerprint discovered at the start: before each profile is stored, the
    # node is discovered again, and on a change nothing more is stored under the old one (a prediction is of the
    # facts it was given, stored under their fingerprint, whatever the node became meanwhile)
    measured_store = store
    if backend == "local" and facts is not None:
        measured_store = GuardedStore(store, FabricGuard(facts, rerun=(
            "Run the tune again: it measures the node as it is now and stores under its new fingerprint.")))
    # on stderr, with --json too: stdout holds the JSON alone, and a long tune still shows that it runs
    bar = RichProgress(label="MODELLED" if backend == "model" else "")
    ran = [0]  # trials this run finished: what a store error after them says is kept

    def count(_name: str, _study: object, _trial: object) -> None:
        ran[0] += 1

    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt, interrupt_behind

    # Ctrl-C, or SIGTERM raised as KeyboardInterrupt: the progress bar closed, one line, exit 130 / 143. The `except`s
    # are inside it, so none of them takes its typer.Exit (a RuntimeError) for a failure of the tune
    with ends_cleanly_on_interrupt(lambda: "the study is saved; run the same command again to resume", err):
        try:
            if backend == "local" and capture is None and facts is not None:
                # this node, discovered live and measured on: its facts recorded (as `profile` and the daemon do),
                # so the runtime's read-only fallback knows the node and serves the profiles measured here (a
                # placeholder fingerprint without facts identifies no node: `query` fell back to the defaults)
                # (with the daemon's change rule: profiles measured on GPUs since replaced are stale from now on)
                from moetune.tuner.fabric.change import record_node_facts

                note = record_node_facts(store, facts, by="tune --backend local").note()
                if note:
                    err.print(f"[yellow]note:[/yellow] {escape(note)}")
            results = tune_profiles_detailed(
                measured_store, facts, models=shapes, tokens=toks, backend=backend, preset=preset, trials=trials,
                timeout_s=timeout, ep_size=ep_size or (local_opts.get("world") if backend == "local" else None),
                nodes=nodes, progress=bar, storage=storage, seed=seed, families=family or None,
                policy_override=policy, routing=routing, local_options=local_opts, node_model=node_model,
                on_trial=count, plan=plan)  # check_tune's plan: built (and its warnings said) once
        except Exception as e:
            import optuna

            if interrupt_behind(e) is not None:  # raised while an interrupt unwound: no failure, the interrupt
                raise
            if isinstance(e, FabricMovedOn):  # nothing stored under the old fingerprint since the change
                _fail(str(e), e.exit_code)
            if isinstance(e, StoreError):  # before `ValueError/OSError`: the profile database, not the tune, failed
                _fail(store_failed(e, store, url, ran[0]), e.exit_code)
            lost = server_lost(url, e)  # before the rest: Optuna's wrapping of it names "invalid data", or none
            if lost is not None:
                _fail(lost, 1)  # nothing given was wrong: the same command resumes
            if isinstance(e, ValueError | OSError):
                _fail(str(e))
            # the study storage failed while tuning (a full disk under it too, however Optuna passed it on)
            tuning_storage_failed(url, storage is not None, e)
            if isinstance(e, optuna.exceptions.OptunaError):  # e.g. a trial another process finished meanwhile
                _fail(f"the tune stopped on an Optuna error ({type(e).__name__}: {e}); the finished trials are kept "
                      f"in {redacted(url)}: run the same command again to resume")
            raise
        finally:
            bar.close()
    scale = tune_scale_note(backend, preset, results)
    # each JSON row says what its own profile extrapolates (its tokens, its EP size), not the whole tune's note
    # the families check_tune left out, their transport unable to serve the EP group: said with the results, not
    # only in a log line (a script reading --json saw no trace of them)
    left_out = [{"family": f, "reason": why} for f, why in plan.left_out.items()]
    rows = _result_rows(results, trials, forced, [tune_scale_note(backend, preset, [r]) for r in results], left_out)
    # a tune where no study had one successful trial measured nothing: say why and exit 1, not 0
    no_trial = [r for r in results if r.study.best is None]
    # what the backend's numbers are (its declared provenance, not its name): a model tune predicts, never measures
    modelled = any(r.effective_provenance != "measured" for r in results)
    if forced:  # again after the progress bar and the results, where it is read: the reminder, not the reasons twice
        err.print(forced_note(preset, forced, node_model, again=True))
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        budget_ended(results, trials, timeout, budget_from)
        no_success(no_trial, len(results), modelled)
        nothing_stored(results)
        return
    _print_results(rows, backend, scale)
    for lo in left_out:  # under the table, as the runtime's bound says it (the tune's one wording)
        Console().print(group_left_out_note(lo["family"], lo["reason"], plan.ep_size, nodes), markup=False)
    budget_ended(results, trials, timeout, budget_from)
    no_success(no_trial, len(results), modelled)
    nothing_stored(results)


def _result_rows(results: list, trials: int, forced: str, scales: list[str | None],
                 left_out: list[dict[str, str]] | None = None) -> list[dict[str, Any]]:
    """One row a study (the --json rows; the table is drawn from them): its trials, best, default and what was
    stored, with what the numbers are (provenance, a forced fit's warning, the extrapolation note of that study's own
    EP size and tokens: `scales`, one per result), and the tune's families left out for its EP group (`left_out`:
    `{"family", "reason"}` each, in every row as `forced_model` is: the rows are a list, kept so for scripts)."""
    rows = []
    for r, scale in zip(results, scales, strict=True):
        rec = r.record
        rows.append({
            "study": r.study.study_name, "family": r.study.family, "model": r.study.workload.model.name,
            "tokens": r.study.workload.tokens, "trials": r.study.trials, "complete": r.study.complete,
            "failed": r.study.failed, "pruned": r.study.pruned,
            "study_best_us": r.study.best.median_us if r.study.best else None,
            "best_us": rec.latency_us if rec else None, "spread_us": rec.spread_us if rec else None,
            "default_us": r.study.default_value, "written": r.written, "stored": r.stored, "reason": r.reason,
            "backend": rec.backend if rec else None, "knobs": rec.knobs.to_dict() if rec else None,
            # what the numbers are, in every row (a table says MODELLED in its title only): the stored record's
            # provenance, else (nothing stored) the backend's
            "provenance": r.effective_provenance, "modelled": r.effective_provenance != "measured",
            "trials_asked": trials, "stopped_by_timeout": r.budget_ended,
            # its share of --timeout (the time left over the studies left, when it started) and the time it took
            "budget_s": r.budget_s, "used_s": r.used_s,
            "forced_model": forced or None,  # the [calibration] warning of a refused fit tuned on anyway
            # this study's EP size or tokens lie beyond what the preset's calibration measured (model predict's note)
            "extrapolation": scale,
            # no run of this runtime can take it (proxy at EP 32): a what-if report, which autoload passes over
            "runtime_refusal": r.runtime_refusal,
            # the families this tune left out before any study: their transport cannot serve its EP group
            "left_out": list(left_out or []),
        })
    return rows


def _print_results(rows: list[dict[str, Any]], backend: str, scale: str | None) -> None:
    """The results table on stdout, its legend, the line under it for each row whose stored number is not
    its study's best, and the extrapolation note."""
    from rich import box

    # through the layout helper: no cell cut with '…' at 80 columns (a long model or family name made the table
    # wider than a pipe's console, and no_wrap columns were cut)
    # where names are long (custom:7168,2048,256,8, proxy:libfabric/cxi) the spread, the trial counts, then the
    # ratio (default / best: both shown) give way
    # a ratio only of predictions (deterministic): a measured best is the side-by-side check's number, the default's
    # a search trial measured alone, and their ratio is no speed-up anyone measured
    ratio = backend == "model"
    cols = (Col("family", "word"), Col("model", "word"), Col("S", "num"), Col("trials", "num", drop=2),
            Col("default µs", "num"), Col("best µs", "num"), Col("±", "num", drop=3),
            *((Col("×", "num", drop=1),) if ratio else ()), Col("stored", "word"))
    cells = []
    notes = []
    for row in rows:
        best, default = row["best_us"], row["default_us"]
        cells.append((escape(row["family"]), escape(row["model"]), str(row["tokens"]),
                      f"{row['complete']}/{row['failed']}/{row['pruned']}",
                      "-" if default is None else f"{default:,.1f}",
                      "-" if best is None else f"{best:,.1f}",
                      "-" if best is None else f"{row['spread_us']:,.1f}",
                      *((f"{default / best:.2f}" if best and default else "-",) if ratio else ()),
                      STORED_CELL[row["stored"]] + (" (what-if)" if row["runtime_refusal"] else "")))
        note = row_note(row)
        if note is not None:
            notes.append(note)
        if row["runtime_refusal"]:  # stored as modelled, for what-if reports only
            notes.append(f"{row['family']} {row['model']} S={row['tokens']}: "
                         + WHAT_IF_ONLY.format(why=row["runtime_refusal"]))
    c = Console()
    print_table(c, cols, cells, title="tuned profiles" + (" (MODELLED: predicted, not measured)" if backend == "model"
                                                          else ""), box=box.SIMPLE_HEAD, pad_edge=False,
                collapse_padding=True, left_out_hint="--json has them")
    c.print("trials = complete/failed/pruned; " + ("× = default / best; " if ratio else
            "default µs: the default's search trial; best µs: as stored (measured side by side); ")
            + "stored: new current profile, the old one kept, or none (nothing stored, and no earlier profile for "
            "the key)")
    for n in notes:
        c.print(n, markup=False)  # wrapped between words at the console's width (soft_wrap printed one long line)
    if scale:
        c.print(f"[yellow]note[/yellow]: {escape(scale)}")


# the table's "stored" column: TuneResult.stored
STORED_CELL = {"new": "[green]new[/green]", "kept": "[yellow]kept[/yellow]", "none": "[red]none[/red]"}


# what `moetune tune` takes for itself: given before a subcommand (`tune --db X show`), they were silently ignored
OWN_OPTIONS = ("model", "tokens", "backend", "preset", "trials", "timeout", "storage", "seed", "db", "config", "nodes",
               "ep_size", "family", "policy", "routing", "world", "comm", "repeats", "trial_timeout", "capture",
               "node_model", "as_json")


def _no_options_before(ctx: typer.Context, policy: Path | None) -> None:
    """Refuse `moetune tune`'s own options given before a subcommand: they do not reach it (a missing --policy
    path was accepted and the exit code was 0)."""
    if policy is not None and not policy.exists():
        _fail(f"--policy {policy}: no such file or directory")
    given = [p for p in ctx.command.params
             if p.name in OWN_OPTIONS and getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"]
    if given:
        names = ", ".join(p.opts[0] for p in given)
        _fail(f"{names}: an option of `moetune tune`, given before `{ctx.invoked_subcommand}`, which does not take "
              f"it from there; put the subcommand's options after it (`moetune tune {ctx.invoked_subcommand} --help`)")


tune_show.register(app)  # `moetune tune show` (tune_show.py)
