"""`moetune tune`: Optuna searches over the EP knobs.

    moetune tune --model qwen3-30b --tokens 128,1024,4096 [--backend model|local] [--preset P]
                 [--trials N] [--timeout S] [--storage URL] [--seed N] [--db PATH]
    moetune tune show [--study NAME] [--json]
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Literal, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

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

app = typer.Typer(help="Optuna searches over the EP knobs (`moetune tune --model M ...`; `moetune tune show`).",
                  invoke_without_command=True, no_args_is_help=False, epilog=examples(("tune",)))

err = Console(stderr=True, soft_wrap=True)


# the capture option's two spellings (Click does not say which one was typed): errors name both
CAPTURE_OPT = "--from/--capture"

COMM_BACKENDS = ("nccl", "gloo")  # what the local backend launches its ranks with (`moetune bench ep --backend`)

# --storage "": refused by its parser (it was taken for the default studies file: `if storage:`)
STORAGE_EMPTY = ("an empty URL names no storage (leave the option out for the default studies file NAME-studies.db "
                 "beside the profile database NAME.db)")
# --backend "" was taken for the configured backend (`backend or cfg_backend`); --study "" matched every study's name
BACKEND_EMPTY = "an empty backend names none: give model or local (leave the option out for config [tune] backend)"
STUDY_EMPTY = "an empty name matches every study (leave the option out to list the studies)"
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


def _redact(url: str) -> str:
    from moetune.tuner.search.tune import _redact as redact

    return redact(url)  # a postgresql:// URL's password stays off the terminal


# another process holds or is creating the studies file: the file is fine, a re-run works (never "move it aside")
BUSY_MARKERS = ("database is locked", "database table is locked", "already exists", "UNIQUE constraint failed")


Problem = tuple[Literal["busy", "denied", "full", ""], str]  # _storage_problem's answer


def _storage_failed(url: str, given: bool, e: BaseException, problem: Problem | None = None) -> NoReturn:
    """Exit with `_storage_error`'s message: 1 where nothing is wrong in what was given (the storage is busy: a re-run
    works; this user may not write the file or its folder; the disk under it is full), 2 otherwise."""
    problem = problem or _storage_problem(url, e)
    _fail(_storage_error(url, given, e, problem), 1 if problem[0] else 2)


def _read_failed(url: str, given: bool, e: BaseException) -> NoReturn:
    """`tune show`'s read failed. Optuna wraps SQLAlchemy's errors (StorageInternalError "...invalid data in the
    commit..."): the chain says what happened. A writer changed the file under the read (DatabaseChanged, after the
    reads `list_studies`/`describe_study` ran again) or holds it locked: exit 1, retry; else `_storage_failed`."""
    from moetune.tuner.search.readback import changed_while_read
    from moetune.tuner.search.storage import sqlite_path
    from moetune.tuner.search.workers import exception_chain

    if changed_while_read(e):
        where = f"--storage {_redact(url)}" if given else f"the studies file {sqlite_path(url) or _redact(url)}"
        _fail(f"{where}: the studies file changed while being read (a tune is writing it); the file is kept as it is: "
              "retry", 1)
    busy = next((x for x in exception_chain(e) if _storage_busy(x)), None)
    _storage_failed(url, given, busy or e)


def _why(e: BaseException) -> str:
    return str(getattr(e, "orig", None) or e)


def _storage_busy(e: BaseException) -> bool:
    return any(m in _why(e) for m in BUSY_MARKERS)


def _storage_problem(url: str, e: BaseException) -> Problem:
    """What failed that is not wrong in what was given, read once per failure: ("busy", "") when another process
    holds or is creating the studies file; ("denied", why) when this user cannot write the SQLite studies file or its
    folder (SQLite's "readonly database" or "unable to open database file", and the permissions say so); ("full",
    why) when SQLite said, anywhere in e's chain (Optuna wraps it: StorageInternalError, or the AssertionError its
    `_run_trial` raises when the trial's state could not be stored), that the disk took no more (`_disk_full`);
    ("", "") for anything else."""
    from moetune.tuner.search.storage import sqlite_path
    from moetune.tuner.store._folders import not_writable
    from moetune.tuner.store.sqlite_errors import SQLITE_CANNOT_WRITE

    if _storage_busy(e):
        return "busy", ""
    path = sqlite_path(url)
    full = _disk_full(url, e)
    if full is not None:
        if full[0] == "io" and path is not None:  # an I/O error where this user may not write: the permission says why
            denied = not_writable(path, side_files=True)
            if denied:
                return "denied", denied
        return "full", full[1]
    if path is None or not any(m in _why(e) for m in SQLITE_CANNOT_WRITE):
        return "", ""
    denied = not_writable(path, side_files=True)
    return ("denied", denied) if denied else ("", "")


def _disk_full(url: str, e: BaseException) -> tuple[str, str] | None:
    """(kind, why) when an exception in e's chain is SQLite's answer of a disk that took no more
    (`sqlite_errors.disk_failed`: SQLITE_FULL, kind "full", or SQLITE_IOERR, kind "io": on a full disk the -wal/-shm cannot
    grow), why naming the folder of the studies file; else None."""
    from moetune.tuner.search.storage import sqlite_path
    from moetune.tuner.search.workers import exception_chain
    from moetune.tuner.store.sqlite_errors import disk_failed

    for x in exception_chain(e):
        kind = disk_failed(x)
        if kind is None:
            continue
        path = sqlite_path(url)
        disk = f"the disk holding {Path(os.path.abspath(path)).parent}" if path is not None else "its disk"
        state = "is full" if kind == "full" else "is full or failed"
        return kind, f"{disk} {state} (SQLite: {(_why(x).splitlines() or [''])[0]})"
    return None


def _storage_error(url: str, given: bool, e: BaseException, problem: Problem | None = None) -> str:
    """The error for a study storage that cannot be opened, naming --storage (or the default studies file).
    `problem`: `_storage_problem(url, e)` where the caller has it already."""
    from moetune.tuner.search.storage import sqlite_path

    kind, reason = problem or _storage_problem(url, e)  # reason: the denial's, the full disk's
    why = (_why(e).splitlines() or [""])[0] or type(e).__name__  # SQLAlchemy's first line
    path = sqlite_path(url)
    if path is not None and path.is_dir():
        why = f"{path} is a directory"
    if kind == "busy":
        where = f"--storage {_redact(url)}" if given else f"the studies file {path or _redact(url)}"
        return (f"{where} is busy: another moetune process is using or creating it ({type(e).__name__}: {why}); "
                "the file is kept as it is: run the command again")
    if "://" not in url:  # SQLAlchemy's "Could not parse SQLAlchemy URL" says nothing of what to type
        return f"--storage {url}: not a storage URL (a SQLite file is sqlite:///{Path(url).expanduser().resolve()})"
    if kind == "full":  # reason: the folder, SQLite's words
        where = f"--storage {_redact(url)}" if given else f"the studies file {path or _redact(url)}"
        check = " (or check the disk)" if "full or failed" in reason else ""
        return (f"{where}: {reason}; free space there{check}, then run the same command again: the study resumes "
                "(the trials the file holds are kept)")
    if kind == "denied":
        return f"--storage {_redact(url)}: {reason}" if given else f"the studies file (the default --storage): {reason}"
    if given:
        return f"--storage {_redact(url)}: cannot open the study storage ({type(e).__name__}: {why})"
    return (f"the studies file {path or _redact(url)} (the default --storage, beside the profile database) cannot be "
            f"opened ({type(e).__name__}: {why}); it is left as it is: move it aside or pass --storage")


def _refuse_memory(storage: str, why: str) -> None:
    """Exit 2 on an in-memory SQLite --storage (`sqlite://`, `sqlite:///:memory:`): it exited 0 and the studies
    vanished."""
    from moetune.tuner.search.storage import is_memory

    if is_memory(storage):
        _fail(f"--storage {storage}: an in-memory database: {why}; give a file (sqlite:///PATH) or a server URL "
              "(postgresql://...)")


def _check_storage(url: str, given: bool, *, create: bool = True) -> None:
    """Open the study storage once before anything runs: a bad URL, a folder or a file that is not a database is
    one clear error, not a traceback from Optuna or SQLAlchemy. `create` False: only what can be checked without
    creating anything (`refuse_storage`: a URL that does not parse, another program's file, a missing folder),
    before the profile database is created (a refused storage leaves no new --db file behind)."""
    import warnings

    from moetune.tuner.search.storage import (
        StorageRefused,
        make_storage,
        refuse_default_storage,
        refuse_storage,
    )

    try:
        with warnings.catch_warnings():  # Optuna's experimental-feature notes are for the real run, not this check
            warnings.simplefilter("ignore")
            if create:
                make_storage(url, own=not given)  # the default studies file is moetune's own (WAL)
            else:  # the checks that create nothing, once, before the profile database is made
                if not given:
                    refuse_default_storage(url)
                refuse_storage(url)
    except StorageRefused as e:  # another program's file, a folder that does not exist: the reason is the message
        _fail(f"--storage {_redact(url)}: {e}" if given
              else f"the studies file (the default --storage, beside the profile database): {e}", e.exit_code)
    except Exception as e:  # SQLAlchemy / sqlite3 / a missing driver / Optuna's schema check: all mean "cannot open"
        _storage_failed(url, given, e)


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


def _load_config(config: Path | None, *, measuring: bool = False):
    """The configuration, or a clear error naming the key and file (never silently the defaults). `measuring`: its
    [runtime] table checked too (a bad key fails here, not in every trial) and --config made the chain the trials
    measure under (`load_config_checked`); `tune show` reads no runtime option and keeps working past a bad one."""
    from moetune.runtime.config import ConfigError, load_config
    from moetune.runtime.options import load_config_checked

    try:
        return load_config_checked(config) if measuring else load_config(config)
    except ConfigError as e:
        _fail(str(e))


def _open_store(db: Path | None, *, readonly: bool = False):
    try:
        from moetune.tuner.store.store import Store  # type: ignore[attr-defined]
    except ImportError as e:
        _fail(f"the profile store is not available in this build ({e})")
    try:
        # intact: a damaged file is refused before the trials (they ran for minutes, then the write failed or spread it)
        store = Store(db, readonly=readonly, intact=not readonly)
    except (RuntimeError, OSError, ValueError) as e:  # StoreError: not a database, damaged, newer schema, busy, ...
        _fail(str(e), getattr(e, "exit_code", 2))
    from moetune.tuner.cli.db import say_upgraded

    say_upgraded(store)
    return store


def _storage_url(storage: str | None, db: Path | None, store=None) -> str:
    from moetune.tuner.search.storage import default_storage_url

    if storage is not None:
        return storage
    return default_storage_url(db or (store.path if store is not None else None))


@app.callback(invoke_without_command=True)
def tune(
    ctx: typer.Context,
    model: list[str] = typer.Option(None, "--model", "-m", help="Model shape (qwen3-30b, deepseek-v3, gpt-oss-120b, custom:H,I,E,K). Repeatable."),
    tokens: str = typer.Option("128,1024,4096", "--tokens", "-t", help="Tokens per GPU, comma separated (tuned at the nearest bucket, once a bucket; at most 65536, the largest)."),
    backend: str = text_option(None, "--backend", "-b", empty=BACKEND_EMPTY, help="model (fabric model; needs --preset) or local (the real runtime) (default: config \\[tune] backend, model)."),
    preset: str = path_text_option(None, "--preset", "-p", help="Fabric-model preset for the model backend."),
    trials: int = typer.Option(None, "--trials", "-n", help="Finished trials per study (default: config \\[tune] trials, 40)."),
    timeout: float = typer.Option(None, "--timeout", help="Wall-clock budget in seconds for the whole tune (default: config \\[tune] timeout_s, 600), shared over its studies (one per family, model and token bucket): each in turn gets the time left divided by the studies left, so what one does not use goes to the next; stderr says each study's share."),
    storage: str = text_option(None, "--storage", empty=STORAGE_EMPTY, help="Optuna storage URL (default: NAME-studies.db beside the profile database NAME.db, moetune-studies.db for moetune.db; postgresql://... to share a study)."),
    seed: int = typer.Option(0, "--seed", help="Sampler seed (0 to 4294967295)."),
    db: Path = path_option(None, "--db", help="Profile database (default: configured)."),
    config: Path = path_option(None, "--config", help="TOML config file (its \\[tune] section gives the defaults)."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes in the EP group."),
    ep_size: int = typer.Option(None, "--ep-size", help="EP group size (default: --world with the local backend, else GPUs per node × nodes; 2 × nodes on a node without GPUs). The local backend stores only what it measures: --ep-size = --world, --nodes 1."),
    family: list[str] = text_option(None, "--family", "-f", empty=FAMILY_EMPTY, help="Only these transport families (repeatable), e.g. host_staged."),
    policy: Path = path_option(None, "--policy", help="User policy file or directory overriding the packaged policies."),
    routing: str = typer.Option("uniform", "--routing", help="uniform or zipf:S."),
    world: int = typer.Option(None, "--world", help="Local backend: ranks to launch on this node (default: --ep-size, else GPUs found, else 2)."),
    comm: str = typer.Option(None, "--comm", help="Local backend: nccl or gloo (default: nccl with GPUs, else gloo)."),
    repeats: int = typer.Option(3, "--repeats", help="Local backend: runs per trial (median and spread)."),
    trial_timeout: float = typer.Option(120.0, "--trial-timeout", help="Local backend: seconds before a run is killed."),
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
    cfg = _load_config(config, measuring=True)
    cfg_trials, cfg_timeout, cfg_backend = int(cfg.tune.trials), cfg.tune.timeout_s, str(cfg.tune.backend)
    backend = backend if backend is not None else cfg_backend
    if backend not in ("model", "local"):
        raise typer.BadParameter(f"expected model or local, got {backend!r}", param_hint="--backend")
    trials = trials if trials is not None else cfg_trials
    if trials < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--trials")
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
        _refuse_memory(storage, "the studies would be lost when moetune exits: nothing could resume or show them")
    forced = _model_preset_warning(preset) if backend == "model" else ""

    _quiet_optuna()
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
        err.print(_forced_note(preset, forced, node_model))
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
    from moetune.tuner.search.tune import check_tune

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
    url = _storage_url(storage, db_path)  # the URL tune_profiles_detailed opens (storage, else beside the store)
    _check_storage(url, storage is not None, create=False)  # refused: no profile database created
    from moetune.tuner.cli._run_lock import close_orphaned_runs, hold_run_lock, refuse_serving_daemon

    refuse_serving_daemon(db_path)  # the daemon is its database's single writer (as for `profile`)
    if backend == "local":
        # one measuring run per database at a time (a `profile` or another local `tune`): the second refuses at once,
        # as their measurements would skew each other. Model tunes may share a study and a database (workers of one
        # study, tests/test_tune_storage_journal.py): they measure nothing
        hold_run_lock(db_path, ctx)
    store = _open_store(db_path)
    close_orphaned_runs(store)  # rows of runs killed before they ended: `interrupted`, not `running` forever
    _check_storage(url, storage is not None)  # refused --db: no studies file created
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
            from sqlite3 import Error as SqliteError

            import optuna
            from sqlalchemy.exc import SQLAlchemyError

            if interrupt_behind(e) is not None:  # raised while an interrupt unwound: no failure, the interrupt
                raise
            if isinstance(e, FabricMovedOn):  # nothing stored under the old fingerprint since the change
                _fail(str(e), e.exit_code)
            if isinstance(e, StoreError):  # before `ValueError/OSError`: the profile database, not the tune, failed
                _fail(_store_failed(e, store, url, ran[0]), e.exit_code)
            if isinstance(e, ValueError | OSError):
                _fail(str(e))
            if isinstance(e, SQLAlchemyError | SqliteError):  # the study storage failed while tuning
                _storage_failed(url, storage is not None, e)
            cause = e.__cause__ or e.__context__  # Optuna's StorageInternalError wraps SQLite's "readonly", "locked"
            if isinstance(e, optuna.exceptions.OptunaError) and isinstance(cause, SQLAlchemyError | SqliteError):
                problem = _storage_problem(url, cause)
                if problem[0]:
                    _storage_failed(url, storage is not None, cause, problem)
            # a full disk under the studies file, however Optuna passed it on: a StorageInternalError, or the
            # AssertionError ("Should not reach.") its `_run_trial` raises when the trial's end could not be stored
            full = _disk_full(url, e)
            if full is not None:
                _storage_failed(url, storage is not None, e, _storage_problem(url, e))
            if isinstance(e, optuna.exceptions.OptunaError):  # e.g. a trial another process finished meanwhile
                _fail(f"the tune stopped on an Optuna error ({type(e).__name__}: {e}); the finished trials are kept "
                      f"in {_redact(url)}: run the same command again to resume")
            raise
        finally:
            bar.close()
    scale = _scale_note(backend, preset, results)
    rows = []
    for r in results:
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
            "extrapolation": scale,  # the EP size tuned at lies beyond the preset's measured scale (model predict's)
        })
    # a tune where no study had one successful trial measured nothing: say why and exit 1, not 0
    no_trial = [r for r in results if r.study.best is None]
    if forced:  # again after the progress bar and the results, where it is read: the reminder, not the reasons twice
        err.print(_forced_note(preset, forced, node_model, again=True))
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        _budget_ended(results, trials, timeout, budget_from)
        _no_success(no_trial, len(results))
        _nothing_stored(results)
        return
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
                      STORED_CELL[row["stored"]]))
        note = row_note(row)
        if note is not None:
            notes.append(note)
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
    _budget_ended(results, trials, timeout, budget_from)
    _no_success(no_trial, len(results))
    _nothing_stored(results)


# the table's "stored" column: TuneResult.stored
STORED_CELL = {"new": "[green]new[/green]", "kept": "[yellow]kept[/yellow]", "none": "[red]none[/red]"}


def _quiet_optuna() -> None:
    """Optuna logs a failed trial as a WARNING with its exception: Ctrl-C printed a full KeyboardInterrupt
    traceback and "Trial N failed with value None." over the progress bar. The CLI reports failures itself (the
    interrupted line, each study's first failure), so only Optuna's errors are shown."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)


def _store_failed(e: BaseException, store: object, url: str, ran: int) -> str:
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
            return (f"{head}; the {ran} trial(s) this run finished are saved in the studies file {_redact(url)}: free "
                    "space, then run the same command again: the studies resume and the profiles are written then")
        return f"{head}; no trial ran"  # e ends "free space there, then run the command again"
    if isinstance(e, StoreBusy | StoreNotWritable):  # nothing is wrong with the file: no "fix the database"
        fix = "" if isinstance(e, StoreBusy) else " make it writable (or pass another --db) and"  # e says "retry"
        if ran:
            return (f"{e}; the {ran} trial(s) this run finished are saved in the studies file {_redact(url)}:{fix} "
                    "run the same command again: the studies resume and the profiles are written then")
        return f"{e}; no trial ran" + (f":{fix} run the command again" if fix else "")
    if ran:
        kept = (f"the {ran} trial(s) this run finished are saved in the studies file {_redact(url)}; fix the "
                "database (or pass another --db) and run the same command again: the studies resume and the "
                "profiles are written then")
    else:
        kept = "no trial ran; fix the database (or pass another --db) and run the command again"
    return f"{head}; {kept}"


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


def _model_preset_warning(preset: str | None) -> str:
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


def _scale_note(backend: str, preset: str | None, results: list) -> str | None:
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


def _forced_note(preset: str, warning: str, node_model: bool, again: bool = False) -> str:
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


def _budget_ended(results: list, asked: int, timeout: float | None, source: str) -> None:
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


def _no_success(failed: list, total: int) -> None:
    """Name the studies without a successful trial on stderr; exit 1 when that is every study (nothing measured)."""
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
        err.print("[red]error:[/red] no study had a successful trial: nothing was measured or stored", soft_wrap=False)
        raise typer.Exit(1)


def _nothing_stored(results: list) -> None:
    """Exit 1 when the tune left no profile for any of its keys: nothing written, and none stored before (a winner
    that failed when measured again, ...). A key with no successful trial is named by `_no_success` already."""
    if not results or any(r.stored != "none" for r in results):
        return
    err.print("[red]error:[/red] nothing stored: no key got a profile from this tune and none had one before",
              soft_wrap=False)
    for r in results:
        if r.study.best is not None:  # the others: "no successful trial", said above
            err.print(f"  {escape(r.study.family)} {escape(r.study.workload.model.name)} "
                      f"S={r.study.workload.tokens}: {escape(r.reason)}", soft_wrap=True)
    raise typer.Exit(1)


@app.command("show")
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

    _quiet_optuna()
    warnings.simplefilter("ignore")  # Optuna's experimental/deprecation notes are not the user's to read
    if db is None and storage is None:
        db = _load_config(config).db_path
    url = _storage_url(storage, db)
    from moetune.tuner.search.storage import StorageRefused, refuse_query, sqlite_path

    if storage is not None:
        _refuse_memory(storage, "a new one holds no studies")
    try:
        refuse_query(url)  # a query string (`?mode=rw`) is refused by name here, before any read
    except StorageRefused as e:
        _fail(f"--storage {_redact(url)}: {e}")
    p = sqlite_path(url)
    if p is not None and not p.exists():
        _fail(f"no studies yet ({p} does not exist)")
    try:
        names_rows = list_studies(url)
    except Exception as e:  # SQLAlchemy / sqlite3 / Optuna: a bad URL, a folder, a file that is not a database
        _read_failed(url, storage is not None, e)
    if study is None:
        rows = names_rows
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        print_table(Console(), (Col("study", "text"), Col("trials", "num"), Col("best µs", "num"), Col("backend", "word")),
                    [(escape(r["study"]), str(r["trials"]), "-" if r["best_us"] is None else f"{r['best_us']:,.1f}",
                      escape(str(r["backend"]) + (" (modelled)" if r.get("modelled") else ""))) for r in rows],
                    title=escape(f"studies in {_redact(url)}"))
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
        _fail(f"no study named {study!r} in {_redact(url)}")
    except NotAMoetuneStudy as e:
        _fail(f"{e} ({_redact(url)})")
    except Exception as e:  # as list_studies: a file changed or locked meanwhile is one line, not a traceback
        _read_failed(url, storage is not None, e)
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
    c.print(f"[bold]{d['study']}[/bold]  backend {d['backend']}{' (modelled)' if d['modelled'] else ''}")
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
