"""`moetune bench`: benchmarks on this node (EP dispatch/combine, the MoE layer by engine, knob sets, named scenarios)."""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from moetune.tuner.cli._args import (
    SEED_MAX,
    distinct_values,
    int_list,
    nearest_existing,
    path_text_option,
    routing_problem,
    seed_problem,
    text_option,
    write_error_code,
)
from moetune.tuner.cli._tables import Col, print_table
from moetune.tuner.cli.db import abort
from moetune.tuner.measure import COUNT_MAX

app = typer.Typer(help="Benchmarks on this node: EP dispatch/combine, the MoE layer by engine (megakernel, unfused, "
                  "torch), knob sets side by side, named scenarios.", no_args_is_help=True)

_err = Console(stderr=True, soft_wrap=True)

# bench ep --transport "" was taken for no override (`if transport:`): the knobs' transport ran instead; bench run
# --case "" was refused by the scenario ("has no case ''"), naming no option
TRANSPORT_EMPTY = "an empty transport names none (leave the option out for the one --knobs sets, else collective)"
CASE_EMPTY = "an empty case names none (leave the option out to run every case)"


LAUNCHES_MAX = 1_000  # the most launches of a scenario (a launch takes seconds to minutes); COUNT_MAX: the calls


def _check_at_most(limit: int, **counts: int) -> None:
    """Refuse (exit 2, naming the option) a count above `limit`; keyword `iters` is --iters. Their lower bounds are
    checked beside, with their own words."""
    for name, v in counts.items():
        if v > limit:
            _fail(f"--{name} must be at most {limit}, got {v}")


def _check_seed(seed: int) -> None:
    if seed_problem(seed):
        _fail(seed_problem(seed))


# options the layer benchmarks share
def _model_opt() -> typer.models.OptionInfo:
    return typer.Option("qwen3-30b", "--model", help="qwen3-30b, gpt-oss-120b, deepseek-v3 or custom:H,I,E,K[,dtype].")


def _seed_opt() -> typer.models.OptionInfo:
    return typer.Option(0, "--seed", help=f"Seed of weights and inputs (0 to {SEED_MAX}).")


def _json_opt() -> typer.models.OptionInfo:
    return typer.Option(False, "--json", help="Print one JSON object.")


_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup


def _skips(cases: list[dict], who: str, *, exit: bool = True) -> bool:
    """Name every skipped and every failed case on stderr; when a case failed (its launches reported an error:
    no timing) or every case was skipped (nothing was measured): exit 1 (after the report, which still says why),
    so a script does not take the table for a whole result. `exit` False: say so, and return True instead of exiting
    (the caller has more to say first, then exits 1); False when the run is whole."""
    for c in cases:
        if "skipped" in c:
            _err.print(f"[yellow]{escape(str(c[who]))} skipped:[/yellow] {escape(str(c['skipped']))}")
        elif "failed" in c:
            _err.print(f"[red]{escape(str(c[who]))} S={c['S']} failed:[/red] {escape(str(c['failed']))}")
    failed = False
    if any("failed" in c for c in cases):
        _err.print("[red]error:[/red] a case failed: its calls are not in the table (no timing)")
        failed = True
    elif not any("skipped" not in c for c in cases):
        _err.print("[red]error:[/red] every requested case was skipped: nothing was measured")
        failed = True
    if failed and exit:
        raise typer.Exit(1)
    return failed


def _footer(rep: dict, who: str, *, exit: bool = True) -> bool:
    """Below a table (`bench moe`, `bench knobs`): when, at which commit and on what it ran, then `_skips`."""
    m = rep["meta"]
    _err.print(f"[dim]{m['date']}, git {m['git_sha'][:10]}{' (dirty)' if m['git_dirty'] else ''}, {m['hardware']}, "
               f"torch {m['torch']}[/dim]")
    return _skips(rep["cases"], who, exit=exit)


def _results_path(results: str | None) -> Path:
    """The --results CSV (default bench/results/summary.csv), refused unless it is absent, empty or a results
    table this version can append to: checked before a benchmark runs, so no measurement is lost."""
    from moetune.tuner.measure import results as R
    from moetune.tuner.measure.scenarios import checkout

    path = Path(results) if results else checkout.SUMMARY_CSV
    try:
        R.check_table(path)
    except R.ResultsError as e:
        _fail(f"--results: {e}")
    above = nearest_existing(path.parent)
    if not above.is_dir():  # the folders of a new file could not be made: say so now, not after the run
        _fail(f"--results {path}: {above} is not a directory")
    why = R.write_problem(path)
    if why:  # a read-only disk or folder: refused before the run, not after it (its rows would be lost)
        _fail(f"--results {path}: cannot write there ({why}); give a writable file with --results")
    return path


def _check_world(world: int, *, spawned: bool) -> None:
    """--world: >= 1, and where this command spawns the ranks (not under torchrun) at most `spawn_limit` of them."""
    from moetune.tuner.measure.scenarios.runner import spawn_limit

    if world < 1:
        _fail(f"--world must be >= 1, got {world}")
    if spawned and world > spawn_limit():
        _fail(f"--world {world}: too many ranks to spawn here (at most {spawn_limit()}, 8 per CPU)")

# what `bench ep --serve` applies: its cases (model, tokens, knobs, ...) come on stdin, its environment from its start
SERVE_OPTIONS = frozenset({"world", "backend", "timeout", "serve"})


def _given_options(ctx: typer.Context) -> list[str]:
    """The options typed on the command line (not left at their defaults), as the command line names them."""
    return [f"--{p.name.replace('_', '-')}" if not p.opts else p.opts[0] for p in ctx.command.params
            if p.name and getattr(ctx.get_parameter_source(p.name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")
            and p.name not in SERVE_OPTIONS]


@app.command("ep")
def ep(
    ctx: typer.Context,
    world: int = typer.Option(2, "--world", help="EP ranks to launch, >= 1 (spawned here, at most 8 per CPU, unless run under torchrun)."),
    backend: str = typer.Option("gloo", "--backend", "--comm", help="gloo (CPU) or nccl (GPUs) (--comm, as for `moetune tune`)."),
    model: str = typer.Option("qwen3-30b", "--model", help="qwen3-30b, gpt-oss-120b, deepseek-v3 or custom:H,I,E,K[,dtype]."),
    tokens: int = typer.Option(128, "--tokens", help="Tokens per rank (S), 0 to 4194304."),
    knobs: str = typer.Option("", "--knobs", help="Knob overrides, name=value,... (e.g. compression=fp8_e4m3,pipeline_depth=2; none when left out or \"\")."),
    routing: str = typer.Option("uniform", "--routing", help="uniform or zipf:S (e.g. zipf:1.2)."),
    iters: int = typer.Option(20, "--iters", help=f"Timed iterations (1 to {COUNT_MAX})."),
    warmup: int = typer.Option(5, "--warmup", help=f"Warm-up iterations (not timed; 0 to {COUNT_MAX}); at least one per rotated input set: a value below their number (4) is raised to it (the report's warmup_note says so)."),
    verify: bool = typer.Option(False, "--verify", help="Check the layer's output against the single-process dense reference."),
    layer: bool = typer.Option(True, "--layer/--no-layer", help="Also time the whole MoE layer (builds expert weights); --no-layer times dispatch and combine only."),
    as_json: bool = _json_opt(),
    transport: str | None = text_option(None, "--transport", empty=TRANSPORT_EMPTY, help="Override the knobs' transport (collective, host_staged, ...)."),
    impl: str = typer.Option("moetune", "--impl", help="moetune (EPBuffer, in the wire layout --layout picks) or plain (unpacked all_to_all_single baseline; it takes no --knobs or --layout)."),
    seed: int = typer.Option(0, "--seed", help=f"Seed of activations, routing and weights (0 to {SEED_MAX})."),
    layout: str = typer.Option("auto", "--layout", help="Collective wire layout: auto, dense (all-gather/reduce-scatter) or packed (counts + all_to_all)."),
    profile: bool = typer.Option(False, "--profile", help="Also run 5 round trips under torch.profiler and print rank 0's tables (top ops by device and by host time)."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help="Also capture dispatch → identity experts → combine in one CUDA graph, and dispatch → combine alone in another, and time their replays (as a serving engine's decode graph runs them); each is checked once more with new inputs (and, for the device-resident layout, a poisoned receive buffer). Needs a layout without host syncs (dense collective or host_staged, nvlink; proxy cannot be replayed); reports graph_roundtrip_us / graph_pair_us or why not."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds any collective may wait before failing, > 0."),
    no_p2p: bool = typer.Option(False, "--no-p2p", help="Emulate a node without GPU peer-to-peer: NCCL_P2P_DISABLE=1 in the ranks, set before NCCL initialises (--backend nccl only; any transport). Off by default: the ranks get the environment the tuner measures in and a launcher serves (launcher_env), which sets no NCCL variable."),
    serve: bool = typer.Option(False, "--serve", help="Persistent worker: launch the ranks once, then read one JSON case per line on stdin and print one JSON result per line (see moetune.tuner.measure.worker); only --world, --backend and --timeout apply (any other option is refused)."),
) -> None:
    """Time EP dispatch, combine and the whole MoE layer; with --verify, the error vs the dense reference."""
    if not (math.isfinite(timeout) and timeout > 0):  # torch's process group would fail deep in C++ instead
        _fail(f"--timeout must be a number of seconds > 0, got {timeout:g}")
    _check_seed(seed)
    if serve:
        from moetune.tuner.measure import worker as bench_worker

        ignored = _given_options(ctx)
        if ignored:  # dropped without a word: --no-p2p measured with P2P on, --model another model than asked
            _fail(f"{', '.join(ignored)}: --serve takes each case (model, tokens, knobs, ...) as a JSON line on stdin "
                  "and applies only --world, --backend and --timeout; leave "
                  f"{'it' if len(ignored) == 1 else 'them'} out (for no peer-to-peer, start the worker with "
                  "NCCL_P2P_DISABLE=1 in its environment)")

        if backend not in ("gloo", "nccl"):
            _fail(f"--backend must be gloo or nccl, got {backend!r}")
        _check_world(world, spawned=True)
        raise typer.Exit(bench_worker.serve(world, backend, timeout))
    from moetune.runtime import KnobError, Knobs, get_model
    from moetune.runtime.testing.launch import LaunchError, launch
    from moetune.tuner.measure import ep as bench_ep

    if backend not in ("gloo", "nccl"):
        _fail(f"--backend must be gloo or nccl, got {backend!r}")
    if impl not in ("moetune", "plain"):
        _fail(f"--impl must be moetune or plain, got {impl!r}")
    if verify and impl == "plain":  # the baseline builds no layer: nothing would be checked, and exit 0 said it passed
        _fail("--verify checks moetune's MoE layer against the dense reference; --impl plain has no layer to check")
    # the baseline reads no knob and has one layout: `--impl plain --knobs compression=fp8_e4m3` timed the
    # uncompressed baseline and its report listed compression fp8_e4m3 among the knobs, exit 0
    inert = [opt for opt, on in (("--knobs", bool(knobs.strip())), ("--layout", layout != "auto")) if on]
    if inert and impl == "plain":
        _fail(f"{' and '.join(inert)} {'apply' if len(inert) > 1 else 'applies'} to moetune's EP buffer; --impl plain "
              "times the unpacked all_to_all_single baseline, which reads no knob and has one layout: leave "
              f"{'them' if len(inert) > 1 else 'it'} out, or use --impl moetune")
    if layout not in ("auto", "dense", "packed"):
        _fail(f"--layout must be auto, dense or packed, got {layout!r}")
    try:
        shape = get_model(model)
    except ValueError as e:
        _fail(str(e))
    try:
        if transport is not None:  # that transport's safe defaults under the --knobs overrides
            from moetune.runtime.knobs import default_knobs

            k = Knobs.parse(knobs, base=default_knobs(transport)).replace(transport=transport)
        else:
            k = Knobs.parse(knobs)
    except KnobError as e:
        _fail(str(e))
    if why := routing_problem(routing):
        _fail(why)
    if no_p2p and backend != "nccl":
        _fail("--no-p2p disables NCCL's GPU peer-to-peer; it needs --backend nccl")
    torchrun = bench_ep.under_torchrun()
    nodes = 1
    if torchrun:
        import os

        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        nodes = max(1, -(-world // max(1, local)))
        if no_p2p and os.environ.get("NCCL_P2P_DISABLE") != "1":
            _err.print("[yellow]note:[/yellow] --no-p2p under torchrun: NCCL_P2P_DISABLE=1 is set now in each rank, "
                       "before NCCL initialises")
    _check_world(world, spawned=not torchrun)
    try:
        shape.check_ep(world)
    except ValueError as e:
        _fail(f"--world {world}: {e}")
    if tokens < 0:
        _fail(f"--tokens must be >= 0, got {tokens}")
    from moetune.runtime.shapes import MAX_TOKENS_PER_GPU, tokens_per_gpu_problem

    # the cap of `query`, `model` and `tune`: 99999999 started the ranks, then failed allocating 819 GB
    if tokens > MAX_TOKENS_PER_GPU:
        _fail(f"--tokens {tokens_per_gpu_problem(tokens)} per rank")
    if iters < 1 or warmup < 0:
        _fail("--iters must be >= 1 and --warmup >= 0")
    _check_at_most(COUNT_MAX, iters=iters, warmup=warmup)
    if cuda_graph and backend != "nccl":
        _fail("--cuda-graph needs --backend nccl (CUDA graphs exist on GPUs only)")
    if k.transport not in ("collective", "host_staged") and impl == "moetune":
        from moetune.runtime.transports.registry import available_transports

        av = available_transports("cuda" if backend == "nccl" else "cpu").get(k.transport)
        if av is None or not av.ok:
            _fail(f"transport {k.transport!r} is not available here: {av.reason if av else 'not registered'}")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < (1 if torchrun else world):
            _fail(f"--backend nccl needs {world} CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    cfg = {
        "model": model, "tokens": tokens, "knobs": k.to_dict(), "routing": routing, "iters": iters,
        "warmup": warmup, "verify": verify, "impl": impl, "seed": seed, "backend": backend, "layer": impl == "moetune" and layer,
        "dense": {"auto": None, "dense": True, "packed": False}[layout], "graph": cuda_graph,
        "profile": profile,
    }
    # the environment the tuner measures this knob set in and a launcher serves it in (set before NCCL/NVSHMEM
    # initialise in the ranks); --no-p2p adds NCCL_P2P_DISABLE=1 explicitly, never the transport choice
    env = ep_environment(k, no_p2p=no_p2p, nodes=nodes)
    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt

    # the report is printed at the end: Ctrl-C or SIGTERM before it prints nothing; the spawned ranks are ended
    # by launch() before the line (none is left running). A torchrun worker keeps SIGTERM's default: torchrun
    # ends its workers so, and a rank tearing its group down there could wait on peers already gone
    ranks = "this rank stopped (torchrun ends the others)" if torchrun else f"its {world} rank process(es) ended"
    with ends_cleanly_on_interrupt(lambda: f"the benchmark was stopped and {ranks}; no report printed", _err,
                                   sigterm=not torchrun):
        try:
            if torchrun:
                import os

                os.environ.update(env)
                rep = bench_ep.run_torchrun(cfg, timeout)
                if rep is None:
                    return  # only rank 0 reports
            else:
                from moetune.tuner.cli._progress import RichProgress

                # the ranks print nothing until they report (98 s at the README's example on 2 CPUs looked hung):
                # an elapsed-time bar on a terminal, a "still running" line elsewhere (stderr: --json stays clean)
                bar = RichProgress(transient=True)
                step = bar.add(f"bench ep: {world} {backend} rank(s), {iters} round trip(s) per phase", 1)
                try:
                    rep = launch(bench_ep.bench_entry, world, backend=backend, args=(cfg,), timeout_s=timeout,
                                 join_timeout_s=max(120.0, 4 * timeout + 60), env=env)[0]
                    bar.update(step, 1)
                finally:
                    bar.close()
        except LaunchError as e:
            first = next(iter(sorted(e.errors.items())))
            _fail(f"benchmark failed on {len(e.errors)} rank(s); rank {first[0]}: {first[1].splitlines()[0]}")
    assert rep is not None
    rep = bench_ep.finish_report(rep, verify)
    # a result carries its code, date, hardware and command (as bench moe's and bench knobs'); the command as
    # parsed, defaults included, with the warm-up that ran (bench_case raises one below its input sets)
    import shlex

    flags = [("--transport", transport), ("--knobs", knobs or None)]
    cmd = " ".join(["moetune bench ep", f"--world {world} --backend {backend} --model {shlex.quote(model)} --tokens "
                    f"{tokens} --routing {shlex.quote(routing)} --iters {iters} --warmup {rep.get('warmup', warmup)} "
                    f"--seed {seed} --impl {impl} --layout {layout} --timeout {timeout:g}",
                    *(f"{o} {shlex.quote(v)}" for o, v in flags if v is not None),
                    *(o for o, on in (("--no-layer", not layer), ("--verify", verify), ("--cuda-graph", cuda_graph),
                                      ("--profile", profile), ("--no-p2p", no_p2p)) if on)])
    rep["meta"] = _stamp(cmd)
    from moetune.tuner.measure.outputs import ep_report_problem

    # the round trip (and its CUDA-graph replays, and with --verify the layer) checked against its bound, as the
    # tuner's trials and the ep scenario check it: a run whose output was wrong is no measurement
    wrong = ep_report_problem(rep)
    if as_json:
        typer.echo(json.dumps(rep))
    else:
        _print_table(rep)
    if wrong is not None:
        _err.print(f"[red]FAILED:[/red] {escape(wrong)}; its timings are no measurement")
        raise typer.Exit(1)


def _torch_error(e: BaseException) -> str:
    """One line for an error torch raised while timing (a traceback reached the user): its type and first line, and
    for an allocation that failed, what to lower."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    hint = ("; lower --tokens or the model's size" if "allocate" in first or "out of memory" in first.lower()
            or isinstance(e, MemoryError) else "")
    return f"the benchmark failed: {type(e).__name__}: {first}{hint}"


def _stopped_before_the_end(what: str, as_json: bool) -> str:
    """What `bench moe` / `bench knobs` left when Ctrl-C or SIGTERM stopped them: nothing (they write no file, and
    print their table or JSON report only once every case is timed)."""
    return f"the {what} was stopped; no {'JSON report' if as_json else 'table'} printed (it comes once every case is timed)"


def ep_environment(knobs: Any, *, no_p2p: bool = False, nodes: int = 1) -> dict[str, str]:
    """The variables `bench ep` sets in its ranks: `launcher_env(knobs, transport, nodes)`, the function the tuner's
    `knob_environment` returns (so a `bench ep` run, the tuner's subprocess mode included, measures in the
    environment the tuner's persistent worker measures in and a launcher serves), plus NCCL_P2P_DISABLE=1 only
    with `no_p2p` (emulating a node without GPU peer-to-peer; never implied by the transport). The family's
    provider variables (NVSHMEM_REMOTE_TRANSPORT for proxy:<provider>) come from the caller's environment, where
    the tuner sets them; `bench ep` knows only the transport."""
    from moetune.runtime.profiles.launcher_env import launcher_env

    env = launcher_env(knobs, knobs.transport, nodes)
    if no_p2p:
        env["NCCL_P2P_DISABLE"] = "1"
    return env


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.1f}" if abs(v) >= 1 or v == 0 else f"{v:.2g}"  # 0.0019 TB/s, 0.05 µs: not "0.0"


# the timed phases of a report, in table order, and their labels
_PHASES = {
    "dispatch_us": "dispatch", "combine_us": "combine", "roundtrip_us": "roundtrip", "layer_us": "layer",
    "graph_roundtrip_us": "roundtrip (CUDA graph)", "graph_pair_us": "dispatch + combine (CUDA graph)",
    "dispatch_host_us": "dispatch, host issue (rank 0)", "combine_host_us": "combine, host issue (rank 0)",
    "roundtrip_host_us": "roundtrip, host issue (rank 0)",
}


def _print_table(rep: dict) -> None:
    c = Console()
    kn = rep["knobs"]
    rows = [(label, _fmt(s["median"]), _fmt(s["p10"]), _fmt(s["p90"]))
            for name, label in _PHASES.items() if (s := rep.get(name))]
    print_table(c, (Col("phase", "word"), Col("median µs", "num"), Col("p10 µs", "num"), Col("p90 µs", "num")), rows,
                title=(f"EP bench: {rep['model']}, S={rep['tokens']}/rank, world {rep['world']} ({rep['backend']}), "
                       f"{rep['impl']} ({rep.get('layout', '?')} layout), {kn['transport']}, compression={kn['compression']}, depth={kn['pipeline_depth']}, "
                       f"routing={rep['routing']}"))
    if rep.get("graph_error"):
        c.print(f"[yellow]CUDA graph:[/yellow] {escape(str(rep['graph_error']))}")
    elif rep.get("graph_pair_error"):  # the round trip replayed; dispatch + combine alone could not (no row above)
        c.print(f"[yellow]dispatch + combine (CUDA graph):[/yellow] {escape(str(rep['graph_pair_error']))}")
    if rep.get("profile"):
        c.print(rep["profile"], markup=False, highlight=False)
    from moetune.tuner.measure.outputs import EP_CHECKS, rel_err_problem

    if rep.get("warmup_note"):  # raised to the rotation (bench_case): the table's warm-up is not the one asked for
        c.print(f"[yellow]note:[/yellow] {escape(rep['warmup_note'])}")

    # each output checked (outputs.ep_report_problem, the same list): its relative error beside its bound
    for err_key, bound_key, label, what in EP_CHECKS:
        err, bound = rep.get(err_key), rep.get(bound_key)
        if err is None or bound is None:  # a phase not run: not checked
            continue
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (err, bound)):
            c.print(f"{label}: max relative error [red]{escape(repr(err))}[/red] (bound {escape(repr(bound))}): not a "
                    "checked number", highlight=False)
            continue
        colour = "red" if rel_err_problem(float(err), float(bound), what) else "green"
        c.print(f"{label}: max relative error [{colour}]{err:.3g}[/{colour}] (bound {bound:.3g})")


# -- named scenarios (bench/scenarios/*.toml; tuner/measure/scenarios/) ---------------------------------------


def _check_tokens(toks: list[int]) -> None:
    """--tokens of the layer benchmarks: one or more token counts, each >= 1."""
    if not toks or any(t < 1 for t in toks):
        _fail(f"--tokens must be token counts >= 1, got {','.join(map(str, toks)) or 'none'}")
    from moetune.runtime.shapes import MAX_TOKENS_PER_GPU, tokens_per_gpu_problem

    for t in toks:  # the cap `bench ep`, `query` and `model` apply
        if t > MAX_TOKENS_PER_GPU:
            _fail(f"--tokens {tokens_per_gpu_problem(t)} per rank")


def _check_moe_knobs(text: str, mk: Any, engines: list[str]) -> None:
    """`bench moe --knobs`: settings of the megakernel, which only the megakernel engine reads. Anything else was
    timed as if it had not been given: an EP knob (num_sms: the layer runs on one device, no exchange), engine=unfused
    (the megakernel still ran) or mk_* knobs beside an --engine list without the megakernel."""
    from moetune.runtime.knobs import MK_KNOBS, Knobs

    given = [n for n, v in mk.to_dict().items() if v != getattr(Knobs(engine="megakernel"), n)]
    other = [n for n in given if n not in MK_KNOBS]
    if other:
        _fail(f"--knobs {text!r}: {', '.join(other)} {'is' if len(other) == 1 else 'are'} not the megakernel's (bench moe "
              "times the layer on one device: no EP exchange reads it); --knobs takes the mk_* knobs")
    if "engine" in given:
        _fail(f"--knobs {text!r}: engine={mk.engine} does not choose what is timed (--engine does); --knobs sets the "
              "megakernel's mk_* knobs")
    if given and "megakernel" not in engines:
        _fail(f"--knobs {text!r} sets the megakernel's knobs, but --engine {','.join(engines)} times no megakernel")


def _once_each(items: list[Any], option: str) -> list[Any]:
    """`items` with each one once, a note on stderr naming those given more than once (`distinct_values`)."""
    items, note = distinct_values(items, option, "timed")
    if note:
        _err.print(escape(f"note: {note}"))
    return items


def _warmup_for(warmup: int, rotate: int) -> int:
    """The warm-up `bench moe` / `bench knobs` run (`moe.warmup_for`: at least one untimed call per rotated input), its
    note on stderr before anything is timed where --warmup was raised."""
    from moetune.tuner.measure.moe import warmup_for

    warmup, note = warmup_for(warmup, rotate)
    if note:
        _err.print(f"[yellow]note:[/yellow] {note} (the report and its command say --warmup {warmup})")
    return warmup


@app.command("moe")
def moe(
    engine: str = typer.Option("megakernel,unfused,torch", "--engine", help="Engines to time side by side in this process: megakernel, unfused, torch (the plain torch path: gate, top-k, sort, two grouped GEMMs, index_add; comma-separated)."),
    model: str = _model_opt(),
    tokens: str = typer.Option("1,16,128,1024,4096", "--tokens", help="Token counts S (comma-separated)."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help="Also capture one CUDA graph per input and time its replays."),
    knobs: str = typer.Option("", "--knobs", help="The megakernel's knobs, e.g. mk_bm=16,mk_stages=3 (engine=megakernel is implied; its defaults when left out or \"\")."),
    iters: int = typer.Option(50, "--iters", help=f"Timed single calls per case (1 to {COUNT_MAX})."),
    warmup: int = typer.Option(10, "--warmup", help=f"Untimed calls first (0 to {COUNT_MAX}); at least one per rotated input: a value below --rotate is raised to it (with a note), so no input's first call is timed."),
    rotate: int = typer.Option(4, "--rotate", help=f"Input tensors rotated over (one graph each; 1 to {COUNT_MAX})."),
    seed: int = _seed_opt(),
    rest: float = typer.Option(0.0, "--rest", help="Seconds of idle GPU before every timed block (0 to 60; 0: back to back). Where the layer draws the power limit (S=4096 on an H200) a block timed right after another runs clocked down."),
    as_json: bool = _json_opt(),
) -> None:
    # help paragraphs on one line each: Rich prints a docstring's own line breaks as they are
    """The whole MoE layer (routing included) on one device: each engine per S, with the floors beside (at the rates measured on this GPU model, an H200's where none were).

    Prints a table of µs per forward (medians) on stdout, or with --json one report (p10 and p90 too); writes no file (`moetune bench run moe-megakernel-vs-unfused --from-report FILE` appends a --json report to summary.csv)."""
    from moetune.runtime import KnobError, Knobs, get_model
    from moetune.tuner.measure import moe as M

    try:
        shape = get_model(model)
        toks = int_list(tokens, "--tokens")
        engines = [e.strip() for e in engine.split(",")] if engine.strip() else []
        mk = Knobs.parse(knobs, base=Knobs(engine="megakernel"))
    except (ValueError, KnobError) as e:
        _fail(str(e))
    if "" in engines:  # a lost name is a typo, not one to skip ("unfused,,torch"), as --tokens 1,,2 is refused
        _fail(f"--engine: expected comma-separated engines, got {engine!r} (an empty item)")
    # each named with its value, as bench knobs does (one message for all four named none of them)
    for name, v in (("--iters", iters), ("--rotate", rotate)):
        if v < 1:
            _fail(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        _fail(f"--warmup must be >= 0, got {warmup}")
    if not 0 <= rest <= 60:  # NaN too
        _fail(f"--rest must be in 0..60 seconds, got {rest:g}")
    _check_at_most(COUNT_MAX, iters=iters, warmup=warmup, rotate=rotate)
    _check_seed(seed)
    warmup = _warmup_for(warmup, rotate)
    # checked before anything is timed (bench_moe would refuse them only after the 'timing ...' line)
    bad = [e for e in engines if e not in M.ENGINES]
    if bad or not engines:
        what = (f"{', '.join(map(repr, bad))} {'is not an engine' if len(bad) == 1 else 'are not engines'}" if bad
                else "no engine given")
        _fail(f"--engine: {what}; engines must be among {', '.join(M.ENGINES)} (one or more, comma-separated)")
    _check_tokens(toks)
    engines, toks = _once_each(engines, "--engine"), _once_each(toks, "--tokens")
    _check_moe_knobs(knobs, mk, engines)
    import torch
    # the table comes at the end: say what runs now (on a CPU the default S list takes minutes)
    where = "CUDA" if torch.cuda.is_available() else "the CPU (no CUDA device: slow, a plumbing check)"
    _err.print(f"[dim]timing {escape(', '.join(engines))} at S={','.join(map(str, toks))} ({warmup} + {iters} calls "
               f"each) on {where} ...[/dim]")
    # per (engine, S) case, on stderr (stdout stays the table or the --json report): a bar on a terminal, else a
    # line per case (RichProgress: a log or a pipe would see a Rich bar only once, at the end)
    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt
    from moetune.tuner.cli._progress import RichProgress

    bar = RichProgress(console=_err)
    with ends_cleanly_on_interrupt(lambda: _stopped_before_the_end("timing", as_json), _err):
        try:
            rep = M.bench_moe(shape, toks, engines, graph=cuda_graph, iters=iters, warmup=warmup, rotate=rotate,
                              seed=seed, knobs=mk, rest_s=rest, progress=bar)
        except ValueError as e:
            _fail(str(e))
        except (RuntimeError, MemoryError) as e:  # torch's: out of memory for this shape and S, as `bench ep` says it
            _fail(_torch_error(e))
        finally:
            bar.close()
    # the command as parsed, defaults included, so the result file says exactly what ran
    # values quoted for a shell (`--knobs "mk_bn=128, mk_stages=3"` was stamped unquoted: two words)
    cmd = (f"moetune bench moe --engine {','.join(engines)} --model {shlex.quote(model)} --tokens "
           f"{','.join(map(str, toks))}{' --cuda-graph' if cuda_graph else ''}"
           f"{f' --knobs {shlex.quote(knobs)}' if knobs else ''} --iters {iters} "
           f"--warmup {warmup} --rotate {rotate} --seed {seed}{f' --rest {rest:g}' if rest else ''}")
    rep["meta"] = _stamp(cmd)
    if cuda_graph and not rep["graph"]:  # bench_moe times graphs on CUDA only: say so, not a silent eager-only run
        _err.print(f"[yellow]--cuda-graph ignored:[/yellow] no CUDA device here ({rep['device']}), eager calls only")
    ran = any("skipped" not in c for c in rep["cases"])
    if as_json:
        typer.echo(json.dumps(rep))
        _skips(rep["cases"], "engine")
        return
    if not ran:
        _skips(rep["cases"], "engine")
    rows = []
    timed = [c for c in rep["cases"] if "skipped" not in c and "failed" not in c]  # the others: named on stderr below
    # what each output was checked against: the unfused engine's output, or the fp32 dense reference (the unfused
    # engine's own, and every engine's where the unfused one is not timed beside it); a column for each that was used
    checks = [(k, h) for k, h in (("rel_err_vs_unfused", "rel err vs unfused"),
                                  ("rel_err_vs_reference", "rel err vs fp32 ref")) if any(k in c for c in timed)]
    for c in timed:
        g = c.get("graph_us", {}).get("median")
        rows.append((str(c["S"]), escape(c["engine"]), _fmt(c["eager_us"]["median"]), "-" if g is None else _fmt(g),
                     _fmt(c["weight_floor_us"]), _fmt(c["tensor_floor_us"]), _fmt(c["plain_read_us"]["median"]),
                     *("-" if c.get(k) is None else f"{c[k]:.2e}" for k, _ in checks)))
    fr = rep["floor_rates"]
    whose = ("as measured on this GPU model" if fr["this_gpu_model"] else
             f"{escape(fr['gpu'])}'s rates (this moetune has none for this device; the gpu-rates and gpu-gemm-rate "
             "scenarios measure them)")
    cols = (Col("S", "num"), Col("engine", "word", "right"), Col("eager", "num"), Col("graph", "num"),
            Col("weight floor", "num", drop=2), Col("tensor floor", "num", drop=3), Col("plain read", "num", drop=1),
            *(Col(h, "num", drop=4 if len(checks) > 1 and k == "rel_err_vs_reference" else 0) for k, h in checks))
    print_table(Console(), cols, rows, left_out_hint="--json shows them",
                title=f"MoE layer {rep['model']} on {rep['device']} (µs, median of {iters}"
                      f"{f', each block after {rest:g} s idle' if rest else ''}; floors MODELLED (computed, not timed): weights at "
                      f"{fr['read_tbps']:g} TB/s, tensor cores at {fr['tensor_tflops']:g} TFLOP/s, {whose}; plain "
                      "read: two sums over the expected experts' weights, measured here)")
    _footer(rep, "engine")


@app.command("knobs")
def knobs_side_by_side(
    vs: str = typer.Option(..., "--vs", help="Variants to set beside the base: NAME=KNOBS;NAME=KNOBS, each KNOBS on top of --knobs (e.g. 'ct8=mk_combine_tokens=8;narrow=mk_bn=128'); a variant of no knob (NAME=) is refused."),
    knobs: str = typer.Option("", "--knobs", help="The base variant's knobs (engine=megakernel is implied; engine=unfused for the unfused layer; the defaults when left out or \"\")."),
    model: str = _model_opt(),
    tokens: str = typer.Option("16,128,1024", "--tokens", help="Token counts S (comma-separated)."),
    iters: int = typer.Option(200, "--iters", help=f"Interleaved rounds (one call of each variant per round; 1 to {COUNT_MAX})."),
    warmup: int = typer.Option(20, "--warmup", help=f"Untimed rounds first (0 to {COUNT_MAX}); at least one per rotated input: a value below --rotate is raised to it (with a note), so no input's first call is timed."),
    rotate: int = typer.Option(8, "--rotate", help=f"Input tensors rotated over (one graph each; 1 to {COUNT_MAX})."),
    chain: int = typer.Option(20, "--chain", help=f"Forwards per chain (one CUDA graph of back-to-back layers; 1 to {COUNT_MAX})."),
    seed: int = _seed_opt(),
    as_json: bool = _json_opt(),
) -> None:
    # help paragraphs on one line each: Rich prints a docstring's own line breaks as they are
    """Knob sets of the MoE layer side by side in one process, interleaved call by call, with each variant's per-round difference to the base.

    The drift between rounds cancels in that difference. Single graph replays and chains of --chain forwards (a setting that changes what one layer leaves the next shows in its own chain).

    Prints a table of µs per forward (medians, differences with p10..p90) on stdout, or with --json one report; writes no file."""
    from moetune.runtime import KnobError, Knobs, get_model
    from moetune.tuner.measure import moe_compare as MC

    for name, v in (("--iters", iters), ("--rotate", rotate), ("--chain", chain)):
        if v < 1:
            _fail(f"{name} must be >= 1, got {v}")
    if warmup < 0:
        _fail(f"--warmup must be >= 0, got {warmup}")
    _check_at_most(COUNT_MAX, iters=iters, warmup=warmup, rotate=rotate, chain=chain)
    _check_seed(seed)
    warmup = _warmup_for(warmup, rotate)
    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt

    with ends_cleanly_on_interrupt(lambda: _stopped_before_the_end("comparison", as_json), _err):
        try:
            shape = get_model(model)
            toks = int_list(tokens, "--tokens")
            _check_tokens(toks)
            toks = _once_each(toks, "--tokens")
            base = Knobs.parse(knobs, base=Knobs(engine="megakernel"))
            try:  # its words named no option ("give at least one variant: ...")
                variants = {"base": base, **MC.parse_variants(vs, base)}
            except (ValueError, KnobError) as e:
                raise ValueError(f"--vs: {e}") from None
            rep = MC.compare_knobs(shape, toks, variants, iters=iters, warmup=warmup, rotate=rotate, chained=chain,
                                   seed=seed, progress=lambda m: _err.print(f"[dim]{m}[/dim]"))
        except (ValueError, KnobError) as e:
            _fail(str(e))
        except typer.Exit:  # a refusal already said (_check_tokens): click's Exit is a RuntimeError, not torch's
            raise
        except (RuntimeError, MemoryError) as e:  # torch's: out of memory for this shape and S
            _fail(_torch_error(e))
    cmd = (f"moetune bench knobs --vs {vs!r}{f' --knobs {shlex.quote(knobs)}' if knobs else ''} --model "
           f"{shlex.quote(model)} --tokens {','.join(map(str, toks))} --iters {iters} --warmup {warmup} --rotate "
           f"{rotate} --chain {chain} --seed {seed}")
    rep["meta"] = _stamp(cmd)
    if as_json:  # the failed cases, then why a variant has no difference to the base (the base failed, say): one exit
        typer.echo(json.dumps(rep))
        _no_differences(rep["cases"], failed=_skips(rep["cases"], "variant", exit=False))
        return
    if not any("skipped" not in c for c in rep["cases"]):
        _skips(rep["cases"], "variant")
    call = "single graph replays" if rep["graph"] else "single eager calls (no GPU: a plumbing check)"

    def diff(q: dict | None) -> str:  # wraps before the (p10..p90) at 80 columns, never inside a number
        return "-" if q is None else f"{q['median']:+.1f} ({q['p10']:+.1f}..{q['p90']:+.1f})"

    rows = [(str(c["S"]), escape(c["variant"]), _fmt(c["single_us"]["median"]), diff(c.get("minus_base_us")),
             _fmt(c["chain_us"]["median"]), diff(c.get("chain_minus_base_us"))) for c in rep["cases"]
            if "skipped" not in c and "failed" not in c]
    cols = (Col("S", "num"), Col("variant", "word", "right"), Col("single", "num"),
            Col("minus base (p10..p90)", "word", "right"), Col("chain", "num"),
            Col("chain minus base (p10..p90)", "word", "right"))
    print_table(Console(), cols, rows,
                title=f"{rep['model']} on {rep['device']}: knob sets side by side, {iters} interleaved rounds (µs; "
                      f"{call}, chains of {chain} per forward; minus base: per-round differences)")
    for n, k in rep["variants"].items():
        _err.print(f"[dim]{n}: {k or 'the defaults'}[/dim]")
    _no_differences(rep["cases"], failed=_footer(rep, "variant", exit=False))


def _no_differences(cases: list[dict], *, failed: bool = False) -> None:
    """Say why variants were timed without their difference to the base (the base skipped here, or failed or wrong at
    that S) and exit 1: the comparison asked for was not made there (never against another variant instead). Said
    also where a case failed (`failed`: `_skips` said so and left the exit to this): a failed or wrong base is the
    usual reason; exit 1 once."""
    why = list(dict.fromkeys(c["no_difference"] for c in cases if "no_difference" in c))
    for w in why:
        _err.print(f"[red]error:[/red] {escape(w)}")
    if why or failed:
        raise typer.Exit(1)


@app.command("list")
def list_scenarios(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per scenario."),
) -> None:
    """The named benchmark scenarios, what each needs (GPUs, world, backend) and its cases (baseline first)."""
    from moetune.tuner.measure.scenarios import definitions
    from moetune.tuner.measure.scenarios.errors import ScenarioError

    try:
        scns = definitions.load_all()
    except ScenarioError as e:
        _fail(str(e))
    if as_json:
        for s in scns.values():
            typer.echo(json.dumps({"name": s.name, "driver": s.driver, "gpus": s.needs.gpus, "world": s.needs.world,
                                   "backend": s.needs.backend, "hardware": s.needs.hardware, "launches": s.launches,
                                   "cases": [c.name for c in s.cases], "metrics": list(s.metrics),
                                   "smoke": "skip: " + s.smoke_skip if s.smoke_skip else "cpu"}))
        return
    rows = [(escape(s.name), escape(s.needs.describe()).replace(", ", "\n"), escape(s.driver), escape(", ".join(c.name for c in s.cases)),
             "GPU only" if s.smoke_skip else "gloo/CPU") for s in scns.values()]
    # scenario and case names are copied into `bench run NAME --case CASE`: never broken inside (word columns);
    # at 80 columns the driver is left out instead. A need a line ("2 GPUs", "world 2", "nccl")
    print_table(Console(), (Col("scenario", "word"), Col("needs", "word"), Col("driver", "word", drop=1),
                            Col("cases (baseline first)", "word"), Col("smoke", "word")), rows,
                title="benchmark scenarios (bench/scenarios/)", left_out_hint="--json shows it")


def _stamp(command: str) -> dict:
    """What a result file needs to be a result: code (git SHA), versions, hardware, date and the command."""
    from datetime import UTC, datetime

    from moetune.tuner.measure.scenarios import stamp

    return {**stamp.machine_facts("none", fingerprint=_fingerprint),
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command}


def _fingerprint() -> str:
    from moetune.tuner.fabric.discovery import discover

    return discover().fingerprint


def _read_report(path: str) -> Any:
    """The JSON of a --from-report file; exit 2 naming the file where it cannot be read or is not JSON."""
    what = "give the file `moetune bench moe --json` printed"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        _fail(f"--from-report {path}: not a JSON report (not UTF-8 text); {what}")
    except OSError as e:
        _fail(f"--from-report {path}: cannot read it ({e.strerror or e})")
    if not text.strip():
        _fail(f"--from-report {path}: the file is empty, not a JSON report; {what}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        _fail(f"--from-report {path}: not a JSON report (line {e.lineno}, column {e.colno}: {e.msg}); {what}")


@app.command("run")
def run_scenario(
    scenario: str = typer.Argument(..., help="A scenario name (`moetune bench list`)."),
    case: str = text_option(None, "--case", empty=CASE_EMPTY, help="Run only this case, beside the baseline (first, and again last where the driver times its cases one by one; the drivers that time all cases in one process run it once)."),
    launches: int = typer.Option(None, "--launches", help=f"Launches (1 to {LAUNCHES_MAX}; default: the scenario's; 1 with --smoke)."),
    smoke: bool = typer.Option(False, "--smoke", help="Tiny sizes on CPU/gloo: checks the plumbing, rows marked source=smoke."),
    results: str = path_text_option(None, "--results", help="CSV to append to (default: bench/results/summary.csv of the moetune source tree, whatever the current "
                                 "directory)."),
    from_report: str = path_text_option(None, "--from-report", help="Run nothing: append a `moetune bench moe --json` "
                                    "report measured elsewhere (a GPU machine) as one launch, source=imported, if it "
                                    "measured what the scenario asks (driver moe)."),
) -> None:
    """Run every case of a scenario side by side, several launches; append stamped rows to summary.csv."""
    from moetune.tuner.cli._interrupt import ends_cleanly_on_interrupt
    from moetune.tuner.measure import results as R
    from moetune.tuner.measure.scenarios import definitions, moe_report, runner
    from moetune.tuner.measure.scenarios.errors import ScenarioError

    if launches is not None:  # its lower bound: the runner's (it checks a scenario's own launches too)
        _check_at_most(LAUNCHES_MAX, launches=launches)
    out = _results_path(results)
    saved: list[dict[str, Any]] = []  # the rows of the launches already appended to `out`

    def kept() -> str:  # what the finished launches left in the table, said on Ctrl-C or SIGTERM
        done = len({str(r["launch"]) for r in saved})
        return (f"the {len(saved)} row(s) of {done} finished launch(es) are in {out}; the launch in progress was not "
                "saved" if saved else f"no launch finished: nothing appended to {out}")

    try:
        s = definitions.get(scenario)
        if from_report is not None:
            if case is not None or launches is not None or smoke:
                _fail("--from-report takes no --case, --launches or --smoke (the report is one launch of every case)")
            rep = _read_report(from_report)
            rows = moe_report.import_moe_report(s, rep, origin=from_report, results=out)
        else:
            # `kill`/`timeout` end it as Ctrl-C does: the drivers' processes ended, a line, exit 130 / 143
            with ends_cleanly_on_interrupt(kept, _err):
                rows = runner.run(s, case=case, launches=launches, smoke=smoke, results=out,
                                  progress=lambda m: _err.print(f"[dim]{m}[/dim]"), fingerprint=_fingerprint,
                                  on_saved=saved.extend)
    except R.RowsNotSaved as e:  # the table could not be written after all: the rows are kept, never lost
        if e.kept is None:
            typer.echo(e.text, nl=False)
        _fail(f"--results {e}", write_error_code(e))
    except (ScenarioError, R.ResultsError) as e:
        _fail(str(e))
    except OSError as e:  # the table could not be read or written (permissions, a full disk)
        _fail(f"--results {out}: {e.strerror or e}", write_error_code(e))
    modelled = any(R.is_modelled(r) for r in rows)
    # the rows' `source` says how the launch ran (measured, or modelled for a prediction a run made; smoke; an
    # import): the title never calls predictions measured
    kind = "imported" if from_report is not None else "smoke" if smoke else "run here" if modelled else "measured"
    if modelled:
        kind += "; the MODELLED ones are predictions, not measurements"
    # the scenario's first metric the rows have, else their first (a smoke run's sizes are not the named ones)
    shown = next((m for m in s.metrics if any(r["metric"] == m for r in rows)),
                 next((str(r["metric"]) for r in rows if r.get("metric")), None))
    # the unit says what a number is (µs, GB/s; a prediction's carries MODELLED)
    shown_rows = [r for r in rows if r["metric"] == shown or str(r.get("note", "")).startswith("FAILED")]
    launch_ids = list(dict.fromkeys(str(r["launch"]) for r in shown_rows))
    one = len(launch_ids) == 1  # one launch (a --smoke run, an import): its id goes in the title, not in every row
    cells = [(*(() if one else (escape(str(r["launch"])),)), escape(str(r["case"])), escape(str(r["metric"])),
              escape(str(r.get("unit") or "")), _fmt(r.get("median")), _fmt(r.get("p10")), _fmt(r.get("p90")),
              escape(str(r.get("note") or ""))) for r in shown_rows]
    # at 80 columns the spread goes first, then the launch id: the case, metric, unit and median stay
    cols = (*(() if one else (Col("launch", "num", "left", drop=1),)), Col("case", "word"), Col("metric", "word"),
            Col("unit", "word"), Col("median", "num", "left"), Col("p10", "num", "left", drop=2),
            Col("p90", "num", "left", drop=2), Col("note"))
    print_table(Console(), cols, cells, title=f"{scenario}: {len(rows)} rows appended ({kind})"
                + (f", launch {launch_ids[0]}" if one else ""),
                left_out_hint=f"every column is in {out}")
    if all(str(r.get("note", "")).startswith("FAILED") for r in rows):
        _err.print("[red]every case failed[/red]")
        raise typer.Exit(1)


def _not_a_summary(path: Path, title: str) -> str | None:
    """Why the regular file `path` is not a summary `bench summarize` wrote (its first line is not `title`), or None
    where it may be replaced: one that starts with it, an empty file, none at all, or no regular file (a device or a
    pipe is written, never replaced)."""
    if not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            head = f.read(len(title) + 1)
    except OSError as e:
        return f"it cannot be read to check that `moetune bench summarize` wrote it ({e.strerror or e})"
    if not head or head.rstrip(b"\r\n") == title.encode():
        return None
    return f"it was not written by `moetune bench summarize` (its first line is not \"{title}\")"


@app.command("summarize")
def summarize_scenarios(
    results: str = path_text_option(None, "--results", help="CSV to read (default: bench/results/summary.csv of the moetune source tree, whatever the "
                                 "current directory)."),
    out: str = path_text_option(None, "--out", help="Markdown to write (default: BENCHMARKS.md of the moetune source tree, whatever the "
                             "current directory); '-' prints it. An existing file is replaced only where `bench summarize` wrote it (its "
                             "first line \"# moetune benchmarks\")."),
) -> None:
    """Regenerate BENCHMARKS.md from summary.csv: per scenario its latest batch, medians / p10 / p90, ratios."""
    from moetune.tuner.measure import results as R
    from moetune.tuner.measure.scenarios import checkout, definitions, summary
    from moetune.tuner.measure.scenarios.errors import ScenarioError

    src = Path(results) if results else checkout.SUMMARY_CSV
    # a mistyped --results would otherwise read as "no rows yet" and overwrite BENCHMARKS.md with an empty summary
    if results and not src.exists():
        _fail(f"--results {src}: no such file")
    if results and src.is_file() and src.stat().st_size == 0:  # as a missing one: no empty summary written
        _fail(f"--results {src}: the file is empty (no header row, no results): nothing to summarize; "
              "`moetune bench run NAME --results FILE` appends rows to it")
    path = None if out == "-" else Path(out) if out else checkout.BENCHMARKS_MD
    if path is not None:  # refused before anything is read or written
        if path.is_dir():
            _fail(f"--out {path} is a directory; give the Markdown file to write")
        if not path.parent.is_dir():
            _fail(f"--out {path}: its folder {path.parent} does not exist")
        if src.exists() and path.exists() and os.path.samefile(path, src):  # a link to it too
            _fail(f"--out {path} is the results file being read (--results {src}): the measurements are never "
                  "replaced by their summary; give another file")
        from moetune.tuner.store._schema import is_sqlite_file

        if path.is_file() and is_sqlite_file(path):  # `--out moetune.db` replaced the profile database, exit 0
            _fail(f"--out {path} is a SQLite database (a moetune profile database?): never replaced by a summary; "
                  "give the Markdown file to write")
        why = _not_a_summary(path, summary.TITLE)
        if why:  # `--out README.md` (or any notes of the user's) was replaced by the summary, exit 0
            _fail(f"--out {path}: {why}, so it is not replaced: move it, or give another --out (or - to print it)")
        why = R.write_problem(path)
        if why:
            _fail(f"--out {path}: cannot write there ({why}); give a writable file with --out, or --out - to print it")
    try:
        scenarios, rows = definitions.load_all(), R.read_rows(src)
        md = summary.summarize(scenarios, rows, source=src)
    except R.ResultsError as e:
        _fail(f"--results: {e}")
    except ScenarioError as e:
        _fail(str(e))
    n_bad, bad = R.row_problems(rows, scenarios)
    if n_bad:  # summarized without them, said (the table silently switched to another metric)
        _err.print(escape(f"warning: {src}: {n_bad} row(s) left out of the summary: " + "; ".join(bad)
                          + ("; ..." if n_bad > len(bad) else "")))
    if path is None:
        typer.echo(md, nl=False)
        return
    from moetune.tuner.store.atomic_files import write_atomic

    try:
        if path.exists() and not path.is_file():  # a device or a pipe (/dev/stdout): written, never replaced
            path.write_text(md, encoding="utf-8")
        else:  # a full disk or a crash mid-write leaves the old file whole
            write_atomic(path, md)
    except OSError as e:
        _fail(f"--out {path}: cannot write it ({e.strerror or e})", write_error_code(e))
    _err.print(f"wrote {path} ({md.count(chr(10))} lines)")
