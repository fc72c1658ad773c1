"""`moetune model`: The fabric model: predicted (modelled) dispatch/combine cost on any fabric."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from moetune.runtime.shapes import MAX_TOKENS_PER_GPU
from moetune.tuner.cli import model_calibrate
from moetune.tuner.cli._args import distinct_values, int_list, path_option, path_text_option, routing_problem
from moetune.tuner.cli._help import examples
from moetune.tuner.cli._tables import Col, print_table
from moetune.tuner.cli.db import abort
from moetune.tuner.cli.model_output import LABEL, console, esc
from moetune.tuner.cli.model_plot import plot, plot_file

app = typer.Typer(help="The fabric model: predicted (modelled) dispatch/combine cost on any fabric.", no_args_is_help=True)


_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup


# the Workload fields the options set, by the option's name and in words: a Workload error starting with a
# field ("tokens_per_gpu must be >= 1") is shown with the option the user typed
_FIELD_OPTIONS = {"tokens_per_gpu": ("--tokens", "tokens per GPU"), "nodes": ("--nodes", "nodes"),
                  "gpus_per_node": ("--gpus-per-node", "GPUs per node"), "tile": ("--tile", "tile")}


def _option_named(message: str, words: bool = False) -> str:
    """A Workload error with the field it starts with named as the option (or, `words`, in words)."""
    field, _, rest = message.partition(" ")
    if field in _FIELD_OPTIONS and rest:
        return f"{_FIELD_OPTIONS[field][1 if words else 0]} {rest}"
    return message


def _build(preset: str, model: str, nodes: int | None, tokens: int, gpus_per_node: int | None, knobs: str,
           routing: str, tile: int):
    from moetune.runtime.knobs import KnobError, Knobs, default_knobs
    from moetune.runtime.shapes import get_model
    from moetune.tuner.fabric_model.presets import load_preset
    from moetune.tuner.fabric_model.records import Workload

    # -g 0 is a value to refuse as -3 is, not "not given" (it fell to the preset's GPUs per node)
    if gpus_per_node is not None and gpus_per_node < 1:
        _fail(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    if why := routing_problem(routing):  # Workload's own check said "unknown routing ''", naming no option
        _fail(why)
    try:
        pr = load_preset(preset)
        shape = get_model(model)
        if nodes is None:  # sweep's default: 4 nodes, or as many as the preset's fabric connects
            nodes = min(4, pr.max_nodes) if pr.max_nodes else 4
        # the same Workload checks apply to every value `model sweep --values` varies (_check_sweep_values)
        w = Workload(shape, tokens, nodes, gpus_per_node or pr.gpus_per_node, routing=routing, tile=tile)
        # the defaults of the transport --knobs names, else the preset's first (another transport on the first's
        # defaults was refused for a fence mode the user never set)
        transport = _given_values(knobs).get("transport") or pr.transports[0]
        base = default_knobs(transport)
        if transport in ("proxy", "ibgda"):
            base = base.replace(fence_mode="proxy_drain" if transport == "proxy" else "nic_ordered")
        k = Knobs.parse(knobs, base=base) if knobs else base
    except KnobError as e:
        _fail(f"unsafe or invalid knobs: {e}")
    except ValueError as e:
        _fail(_option_named(str(e)))
    return pr, w, k


def _preset_said(pr: Any) -> str:
    """The preset as the tables and plots name it: a file's path too (a calibrated or edited copy keeps the shipped
    preset's name: three different predictions read as one), and a forced fit's warning (`calibrate --force`)."""
    said = pr.name if not pr.path else f"{pr.name} (file {pr.path})"
    warning = str((pr.calibration or {}).get("warning") or "")
    return f"{said} · {warning.split(':')[0]}" if warning else said  # its problems: in the JSON and the file


def _preset_facts(pr: Any) -> dict[str, Any]:
    """What the JSON says of the preset besides its name: the file it was read from and a forced fit's warning."""
    return {"preset_file": pr.path, "preset_warning": (pr.calibration or {}).get("warning")}


def scale_note(pr: Any, gpus: int, what: str, up_to: bool = False, tokens: Iterable[int] = ()) -> str | None:
    """Where `gpus` (the most GPUs predicted; `up_to`: a sweep over nodes) lies beyond the most ranks the preset's
    calibration measured together (its `[calibration] world`), or one of `tokens` (the tokens per GPU predicted) lies
    outside the tokens per GPU its rows measured (`[calibration] tokens`): a note saying that `what` ("this
    prediction", "this sweep", "this tune") extrapolates; None where it does not, or where the preset records no
    measured scale or range (none is guessed). `model predict`, `model sweep` and `tune --backend model` print it."""
    from moetune.tuner.fabric_model.calibration_record import calibrated_tokens, calibrated_world

    notes = []
    world = calibrated_world(pr)
    if world is not None and gpus > world:
        # "ranks": the rows' world counts the processes of the measured all-to-all (GPUs, or gloo host processes)
        notes.append(f"preset {pr.name} was calibrated on measurements of at most {world} ranks ([calibration] world = "
                     f"{world}); at {'up to ' if up_to else ''}{gpus} GPUs {what} extrapolates {gpus / world:g}x beyond "
                     "the measured scale")
    span = calibrated_tokens(pr)
    outside = sorted({t for t in tokens if span and not span[0] <= t <= span[1]})
    if span and outside:
        notes.append(f"preset {pr.name} was calibrated on measurements of {span[0]} to {span[1]} tokens per GPU "
                     f"([calibration] tokens); at {', '.join(str(t) for t in outside)} tokens per GPU {what} "
                     "extrapolates outside the measured range")
    return "; ".join(notes) or None


def _workload(w: Any, swept: str | None = None) -> dict[str, Any]:
    """The workload a prediction ran (JSON); the field a sweep varies (`swept`: nodes or tokens) is None."""
    out = {"model": w.model.name, "tokens_per_gpu": w.tokens_per_gpu, "nodes": w.nodes,
           "gpus_per_node": w.gpus_per_node, "routing": w.routing, "tile": w.tile}
    if swept is not None:
        out[{"tokens": "tokens_per_gpu"}.get(swept, swept)] = None
    return out


def _workload_title(w: Any, swept: str | None = None) -> str:
    """'4x8 GPUs · 256 tokens/GPU · uniform · tile 128' for a title, less the variable a sweep varies."""
    parts = [f"{w.gpus_per_node} GPUs/node" if swept == "nodes" else f"{w.nodes}x{w.gpus_per_node} GPUs",
             None if swept == "tokens" else f"{w.tokens_per_gpu} tokens/GPU", w.routing, f"tile {w.tile}"]
    return " · ".join(p for p in parts if p)


def _knob_str(k) -> str:
    d = k.to_dict()
    keys = ("transport", "signalling", "group_size", "fence_mode", "qp_mapping", "qps_per_pe", "compression",
            "chunk_tokens", "pipeline_depth", "num_sms")
    return ",".join(f"{x}={d[x]}" for x in keys)


@app.command("predict", epilog=examples(("model", "predict")))
def predict_cmd(
    preset: str = path_text_option(..., "--preset", "-p", help="Preset name (moetune model presets) or a .toml path."),
    model: str = typer.Option("qwen3-30b", "--model", "-m", help="qwen3-30b, gpt-oss-120b, deepseek-v3 or custom:H,I,E,K."),
    nodes: int = typer.Option(1, "--nodes", "-n", help="Nodes, >= 1 (nodes × GPUs per node must divide the model's experts evenly, at most 65536 ranks)."),
    tokens: int = typer.Option(1024, "--tokens", "-t", help=f"Tokens per GPU, 1 to {MAX_TOKENS_PER_GPU}."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", "-g", help="GPUs per node (default: the preset's)."),
    knobs: str = typer.Option("", "--knobs", "-k", help="Knob overrides name=value,... (none when left out or \"\": the preset's transport defaults)."),
    routing: str = typer.Option("uniform", "--routing", help="uniform or zipf:<exponent>."),
    tile: int = typer.Option(128, "--tile", help=f"Tokens per tile (expert GEMM padding), 1 to {MAX_TOKENS_PER_GPU}."),
    phase: str = typer.Option("both", "--phase", help="both, dispatch or combine."),
    layout: str = typer.Option(
        "auto", "--layout",
        help="Wire layout of the collective transports (collective, host_staged): auto (the runtime's own rule, "
             "EPBuffer(dense=None)), packed or dense. The other transports have one layout each: auto only."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Predict one EP dispatch + combine (MODELLED, not measured)."""
    import msgspec

    from moetune.runtime.knobs import KnobError
    from moetune.tuner.fabric_model.predict import predict

    dense = {"auto": None, "packed": False, "dense": True}
    if layout not in dense:
        _fail(f"--layout must be auto, packed or dense, got {layout!r}")
    pr, w, k = _build(preset, model, nodes, tokens, gpus_per_node, knobs, routing, tile)
    if phase not in ("both", "dispatch", "combine"):
        _fail(f"--phase must be both, dispatch or combine, got {phase!r}")
    if layout != "auto" and k.transport not in ("collective", "host_staged"):
        _fail(f"--layout {layout} applies to the collective transports (collective, host_staged); transport "
              f"{k.transport!r} has one layout (use --layout auto)")
    if why := _one_rank(k.transport, w.pes, "a prediction of {families} would be a latency",
                        "Predict an EP group of 2 or more ranks (--gpus-per-node × --nodes >= 2)"):
        _fail(why)
    w = msgspec.structs.replace(w, dense=dense[layout])
    try:
        res = predict(pr, w, k, phase=phase)  # type: ignore[arg-type]
    except KnobError as e:
        _fail(f"unsafe or invalid knobs (not predicted): {e}")
    except ValueError as e:
        _fail(str(e))
    scale = scale_note(pr, w.pes, "this prediction", tokens=[w.tokens_per_gpu])
    unread = _unread_note(knobs, k.transport)
    if as_json:
        out = {"label": LABEL, **res.to_dict(), **_preset_facts(pr), "extrapolation": scale,
               "workload": {**_workload(w), "layout": layout, "phase": phase}, "knobs": k.to_dict()}
        if unread:
            out["notes"] = [*out["notes"], unread]
        if phase != "both":  # the other phase was not modelled: no number stands for it
            out[f"{'combine' if phase == 'dispatch' else 'dispatch'}_us"] = None
        typer.echo(json.dumps(out))
        return
    # --phase dispatch/combine models one phase: the other is "not modelled", never a 0.0 µs prediction
    modelled = {"dispatch", "combine"} if phase == "both" else {phase}
    both = " + ".join(x for x in ("dispatch", "combine") if x in modelled)
    rows = [
        (f"latency ({both})", f"{res.latency_us:,.1f} µs"),
        ("dispatch", f"{res.dispatch_us:,.1f} µs" if "dispatch" in modelled else "not modelled"),
        ("combine", f"{res.combine_us:,.1f} µs" if "combine" in modelled else "not modelled"),
        ("expert FFN (modelled compute)", f"{res.expert_us:,.1f} µs"),
        (f"layer ({both.replace(' + ', ' + FFN + ') if phase == 'both' else both + ' + FFN'})",
         f"{res.layer_us:,.1f} µs"),
        ("fences", f"{res.fences}"),
        ("proxy stalls", f"{res.proxy_stalls}"),
        ("NIC stalls", f"{res.nic_stalls}"),
        ("transfers", f"{res.transfers}"),
        ("bytes on the wire", f"{res.bytes_on_wire / 1e6:,.3f} MB"),
    ]
    print_table(console, [Col("quantity", "word"), Col("value (modelled)", "num")], rows,
                title=f"{LABEL}: {esc(_preset_said(pr))} · {esc(w.model.name)} · {esc(_workload_title(w))}"
                      + ("" if phase == "both" else f" · {phase} only"))
    print_table(console, [Col("phase", "word"), Col("µs", "num")],
                [(esc(name), f"{v:,.1f}") for name, v in res.phases.items()],
                title=f"{LABEL}: per-phase breakdown (µs; component times overlap)")
    console.print(f"knobs: {esc(_knob_str(k))}")
    for note in res.notes:  # what was modelled (the wire layout); the MODELLED note is the closing line
        if not note.startswith(LABEL):
            console.print(f"modelled: {esc(note)}")
    if unread:
        console.print(f"note: {esc(unread)}", soft_wrap=True)
    if scale:
        console.print(f"[yellow]note[/yellow]: {esc(scale)}", soft_wrap=True)
    console.print(f"[yellow]{LABEL}[/yellow]: predicted by the fabric model from preset parameters, not measured.")


def _one_rank(transport: str, gpus: int, done: str, fix: str) -> str:
    """Why `gpus` ranks (nodes × GPUs per node) predict no exchange of `transport`, '' when they do: the rule the
    tune backends apply (`one_rank_exchange`), so `model predict`/`sweep` never print a latency of no exchange."""
    from moetune.tuner.search.backends import one_rank_exchange

    return one_rank_exchange(gpus, [transport], done=done, fix=fix)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SWEEP_PUTS = 8  # the fewest chunks of the busiest peer's rows a group_size sweep's chunk_tokens cuts (when 0 gives one)


def _given_values(knobs: str) -> dict[str, str]:
    """name -> value as a --knobs string sets them (not parsed: Knobs.parse refuses a name given twice)."""
    return {name.strip(): value.strip() for name, _, value in
            (part.partition("=") for part in knobs.split(",") if "=" in part)}


def _unread_note(knobs: str, transport: str) -> str | None:
    """A note naming the knobs --knobs set that the model does not read for `transport` (`KNOBS_READ`): any value of
    them predicts the same, so a number printed beside them must not look as if it modelled them; None if none."""
    from moetune.tuner.fabric_model.predict import KNOBS_READ

    unread = sorted(_given_knobs(knobs) - KNOBS_READ[transport])
    if not unread:
        return None
    return (f"{', '.join(unread)} (set with --knobs) not read by the model for transport {transport}: any value "
            "predicts the same")


def _given_knobs(knobs: str) -> set[str]:
    """The knob names a --knobs string sets (a default knob and one set to the same value differ here)."""
    return set(_given_values(knobs))


def _group_sweep(pr: Any, w0: Any, k0: Any, knobs: str, values_given: bool) -> tuple[Any, int, str, list[str]]:
    """(knobs, grid, unit, notes) of a sweep over group_size: what a decoupled group_size groups per peer in the
    model (`predict.group_grid`: PUTs for proxy/ibgda, CTAs for nvlink). Refused (exit 2) for a transport whose
    prediction reads no group_size. Without --values, chunk_tokens 0 (each peer's rows in ONE PUT: every group
    size the same run) is replaced by a chunk cutting the busiest peer's rows in SWEEP_PUTS, unless --knobs set
    chunk_tokens (the grid is then the PUTs the model charges: that many, or one more for some peers); the notes
    say so, or why there is one transfer per peer."""
    from moetune.runtime.knobs import KnobError
    from moetune.tuner.fabric_model.group_grids import busiest_peer_rows, group_grid

    grid = group_grid(pr, w0, k0)
    if grid == 0:
        from moetune.runtime.knobs import default_knobs

        grouped = [t for t in pr.transports if t in ("proxy", "ibgda", "nvlink")]
        # a command that works: the transport's own default fence mode ('none' is not possible on proxy/ibgda)
        how = (" with " + " or ".join(f"-k transport={t},fence_mode={default_knobs(t).fence_mode}" for t in grouped)
               if grouped else f" (preset {pr.name!r} has no transport with signal groups)")
        _fail(f"--over group_size: transport {k0.transport!r} has no signal groups (the model reads no group_size "
              f"for it: every point would be the same); sweep --over nodes or tokens, or sweep a transport with "
              f"signal groups{how}")
    notes: list[str] = []
    if k0.transport == "nvlink":
        if grid == 1:
            notes.append(f"one CTA per peer with num_sms={k0.num_sms} over {w0.gpus_per_node} GPUs: group_size has "
                         "nothing to group; pass -k num_sms=N (more SMs) to sweep group sizes")
        return k0, grid, "CTA" if grid == 1 else "CTAs", notes
    rows = max(1, math.ceil(busiest_peer_rows(w0) - 1e-9))
    if grid == 1 and k0.chunk_tokens == 0 and not values_given and "chunk_tokens" not in _given_knobs(knobs):
        # exactly SWEEP_PUTS chunks (as many as the rows allow) where some chunk gives that many, else the fewest above
        target = min(SWEEP_PUTS, rows)
        # the largest chunk giving `target` PUTs is ceil(rows / target), and a smaller one gives more PUTs
        chunk = math.ceil(rows / target)
        if math.ceil(rows / chunk) != target:
            chunk = max(1, rows // target)
        try:
            k1 = k0.replace(chunk_tokens=chunk)
        except KnobError:
            k1 = k0
        else:
            g1 = group_grid(pr, w0, k1)
            if g1 > 1:
                notes.append(f"chunk_tokens={chunk} for this sweep ({g1} PUTs to the busiest peer): with "
                             f"chunk_tokens=0 the busiest peer's {rows} rows go in ONE PUT and every group size is "
                             "the same run; pass -k chunk_tokens=N to choose the chunk")
                return k1, g1, "PUTs", notes
    if grid == 1:
        notes.append(f"one transfer per peer with chunk_tokens={k0.chunk_tokens} (the busiest peer's {rows} rows in "
                     "one PUT): "
                     "group_size has nothing to group; pass -k chunk_tokens=N (fewer rows than that) to sweep "
                     "group sizes")
    return k0, grid, "PUT" if grid == 1 else "PUTs", notes


def _same_everywhere(series: dict[str, list[dict]], transport: str) -> list[str]:
    """A note when no group size changes the prediction (every modelled row the same): say so rather than leave
    identical rows to be read as a finding."""
    points = {(r["latency_us"], r["fences"]) for rows in series.values() for r in rows if "error" not in r}
    modelled = {r["x"] for rows in series.values() for r in rows if "error" not in r}
    if len(points) != 1 or len(modelled) < 2:
        return []
    why = (": its signals are device writes spread over the kernel's CTAs, at most (GPUs per node - 1) x CTAs per "
           "peer < num_sms groups, one round of signals whatever the group size") if transport == "nvlink" else ""
    return [f"group_size changes nothing in the {transport} prediction for this workload (every row the same){why}"]


def _check_sweep_values(over: str, xs: list[int], w0: Any) -> None:
    """Refuse the --values `model predict` refuses for the same option (exit 2 naming --values), with
    predict's own checks (Knobs, Workload), so an input error never shows up as an n/a row. n/a stays for
    settings one fence mode, or this preset, cannot run."""
    from moetune.runtime.knobs import Knobs
    from moetune.tuner.fabric_model.records import Workload

    for x in xs:
        try:
            if over == "group_size":
                # the knob's own range; whether it divides the transfers differs per fence mode (n/a)
                Knobs(signalling="decoupled", group_size=x)
            elif over == "nodes":
                Workload(w0.model, w0.tokens_per_gpu, x, w0.gpus_per_node, routing=w0.routing, tile=w0.tile)
            else:
                Workload(w0.model, x, w0.nodes, w0.gpus_per_node, routing=w0.routing, tile=w0.tile)
        except ValueError as e:  # KnobError is a ValueError
            _fail(f"--values: {over} = {x} is not a valid input: {_option_named(str(e), words=True)}")


@app.command("sweep")
def sweep_cmd(
    ctx: typer.Context,
    preset: str = path_text_option(..., "--preset", "-p", help="Preset name or .toml path."),
    model: str = typer.Option("qwen3-30b", "--model", "-m", help="qwen3-30b, gpt-oss-120b, deepseek-v3 or custom:H,I,E,K."),
    over: str = typer.Option("group_size", "--over", help="group_size, nodes or tokens."),
    values: str | None = typer.Option(None, "--values", help="Comma-separated x values (default: group_size the "
                                      "divisors of the transfers a group groups per peer: PUTs for proxy/ibgda, where "
                                      "chunk_tokens 0 (one PUT) is replaced by a chunk cutting the busiest peer's rows in at least 8 unless --knobs "
                                      "sets it, CTAs for nvlink; nodes 1,2,4,8,16 up to the preset's most nodes, "
                                      "tokens 64,256,1024,4096,16384). A group_size above the transfers per peer is "
                                      "n/a: the same run as group_size 0."),
    nodes: int | None = typer.Option(None, "--nodes", "-n", help="Nodes, >= 1 (nodes × GPUs per node must "
                                     "divide the model's experts evenly, at most 65536 ranks; refused with --over nodes, which sweeps them; "
                                     "default: 4, or the preset's most nodes if fewer)."),
    tokens: int = typer.Option(256, "--tokens", "-t", help=f"Tokens per GPU, 1 to {MAX_TOKENS_PER_GPU} (refused with "
                               "--over tokens, which sweeps them)."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", "-g", help="GPUs per node (default: the preset's)."),
    knobs: str = typer.Option("", "--knobs", "-k", help="Base knob overrides name=value,... (none when left out or \"\": the preset's transport defaults)."),
    routing: str = typer.Option("uniform", "--routing", help="uniform or zipf:<exponent>."),
    tile: int = typer.Option(128, "--tile", help=f"Tokens per tile (expert GEMM padding), 1 to {MAX_TOKENS_PER_GPU}."),
    out: Path | None = path_option(None, "--out", help="Write a plot (latency and fences vs x, per fence mode): PNG, "
                                    "or the format of the file's suffix (.svg, .pdf, ...); no suffix: FILE.png. An "
                                    "existing file is replaced only with --force."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file (with --out only)."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Sweep one variable for each fence mode the transport allows (MODELLED)."""
    from moetune.runtime.knobs import ALLOWED_FENCE_MODES, KnobError
    from moetune.tuner.fabric_model.predict import predict
    from moetune.tuner.fabric_model.records import Workload

    if over not in ("group_size", "nodes", "tokens"):
        _fail(f"--over must be group_size, nodes or tokens, got {over!r}")
    if force and out is None:  # it did nothing, silently: refused as `model calibrate --force` without --out is
        _fail("--force acts on the --out file (--force replaces an existing plot): give --out FILE, or leave it out")
    # the swept variable's own option: ignored without a word (`--over tokens -t 5`), or refused for a value the
    # sweep never models (`--over nodes -n 3` on 2 GPUs a node: "128 experts do not divide ... group of 6")
    swept = {"nodes": "--nodes", "tokens": "--tokens"}.get(over)
    if swept and getattr(ctx.get_parameter_source(over), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP"):
        _fail(f"{swept}: --over {over} sweeps it (--values gives its values): leave {swept} out")
    # a bad --out is refused before the (slow) sweep, not after it
    plot_path = plot_file(out, force) if out is not None else None
    pr, w0, k0 = _build(preset, model, nodes, tokens, gpus_per_node, knobs, routing, tile)
    modes = ALLOWED_FENCE_MODES[k0.transport]
    grid, unit, notes = 0, "", []
    one_rank_fix = "Sweep an EP group of 2 or more ranks (--gpus-per-node × --nodes >= 2)"
    if over != "nodes" and (why := _one_rank(k0.transport, w0.pes, "a sweep of {families} would be latencies",
                                                  one_rank_fix)):
        _fail(why)
    if over == "group_size":
        k0, grid, unit, notes = _group_sweep(pr, w0, k0, knobs, values is not None)
    if unread := _unread_note(knobs, k0.transport):
        notes.append(unread)
    if values is not None:  # --values "" is an empty list to refuse, not "not given"
        try:
            xs = int_list(values, "--values")
        except ValueError as e:
            _fail(str(e))
        if not xs:
            _fail(f"--values: nothing to sweep in {values!r}; give comma-separated integers")
        xs, note = distinct_values(xs, "--values", "swept")  # the same point printed (and plotted) again is no finding
        if note:
            notes.append(note)
        _check_sweep_values(over, xs, w0)
        lowest = f"the {{families}} point at nodes = {min(xs)} would be a latency"
        if over == "nodes" and (why := _one_rank(k0.transport, min(xs) * w0.gpus_per_node, lowest, one_rank_fix)):
            _fail(f"--values: {why}")
    elif over == "group_size":
        xs = _divisors(grid)
    elif over == "nodes":  # up to the most nodes the preset's fabric connects
        xs = [n for n in (1, 2, 4, 8, 16) if not pr.max_nodes or n <= pr.max_nodes]
        lowest = "the {families} point at nodes = 1 would be a latency"
        if xs and (why := _one_rank(k0.transport, xs[0] * w0.gpus_per_node, lowest, one_rank_fix)):
            xs = xs[1:]  # one GPU on one node: no exchange, so no point (as predict refuses)
            if not xs:
                _fail(why)
            notes.append(f"nodes = 1 left out: with {w0.gpus_per_node} GPU per node that is an EP group of one rank, "
                         "which exchanges nothing")
    else:
        xs = [64, 256, 1024, 4096, 16384]
    if not xs:
        _fail("nothing to sweep")
    series: dict[str, list[dict]] = {}
    # coupled signals every transfer: it has no group size (a decoupled group_size given with --knobs made every
    # coupled point n/a, "an invalid or unsafe setting", for a combination the sweep itself made)
    variants = [(f"coupled/{m}", {"signalling": "coupled", "fence_mode": m, "group_size": 0}) for m in modes]
    variants += [(f"decoupled/{m}", {"signalling": "decoupled", "fence_mode": m}) for m in modes]
    if k0.transport not in ("proxy", "ibgda", "nvlink"):
        variants = [(f"{k0.transport}", {})]
    for label, change in variants:
        rows = []
        for x in xs:
            try:
                kk = k0.replace(**change)
                w = w0
                if over == "group_size":
                    if kk.signalling == "decoupled" and x > grid:
                        # the model (as the runtime) makes one group of a peer's transfers: no new point
                        raise ValueError(f"a group_size above the {grid} {unit} per peer makes one group per peer: "
                                         "the same run as group_size 0")
                    kk = kk.replace(group_size=0) if kk.signalling == "coupled" else kk.replace(group_size=x)
                elif over == "nodes":
                    w = Workload(w0.model, w0.tokens_per_gpu, x, w0.gpus_per_node, routing=w0.routing, tile=w0.tile)
                else:
                    w = Workload(w0.model, x, w0.nodes, w0.gpus_per_node, routing=w0.routing, tile=w0.tile)
                r = predict(pr, w, kk)
                rows.append({"x": x, "latency_us": r.latency_us, "layer_us": r.layer_us, "fences": r.fences,
                             "proxy_stalls": r.proxy_stalls, "nic_stalls": r.nic_stalls, "transfers": r.transfers,
                             "modelled": True})
            except (KnobError, ValueError) as e:
                rows.append({"x": x, "error": str(e), "modelled": True})
        series[label] = rows
    drawable = any("error" not in r for rows in series.values() for r in rows)
    if over == "group_size" and grid > 1:  # one transfer per peer: the notes say so already
        notes += _same_everywhere(series, k0.transport)
    # the most GPUs a modelled point has (a sweep over nodes varies them; n/a points predict nothing)
    gpus = max((r["x"] if over == "nodes" else w0.nodes) * w0.gpus_per_node
               for rows in series.values() for r in rows if "error" not in r) if drawable else 0
    # the tokens per GPU of the modelled points (a sweep over tokens varies them)
    tokens = {r["x"] if over == "tokens" else w0.tokens_per_gpu
              for rows in series.values() for r in rows if "error" not in r}
    scale = scale_note(pr, gpus, "this sweep", up_to=over == "nodes", tokens=tokens)
    if as_json:
        typer.echo(json.dumps({"label": LABEL, "preset": pr.name, **_preset_facts(pr), "extrapolation": scale,
                               "model": w0.model.name, "over": over,
                               "workload": _workload(w0, None if over == "group_size" else over),
                               "knobs": k0.to_dict(), "notes": notes, "series": series,
                               "plot": str(plot_path) if plot_path and drawable else None}))
    else:
        cols = [Col(over, "num")]
        for label in series:
            short = label.replace("coupled", "c").replace("decoupled", "d").replace("proxy_drain", "drain")
            short = short.replace("nic_ordered", "nic").replace("dec", "d")
            # at 80 columns the fences go first (the last series' first), each named by its series
            cols += [Col(f"{short} µs", "num"), Col(f"{short} fences", "num", drop=len(cols))]
        table_rows = []
        reasons: dict[str, int] = {}  # the model's reason for each n/a, numbered once however many cells it covers
        for i, x in enumerate(xs):
            cells = [str(x)]
            for rows in series.values():
                r = rows[i]
                if "error" in r:
                    n = reasons.setdefault(r["error"], len(reasons) + 1)
                    cells += [f"n/a ({n})", "-"]
                else:
                    cells += [f"{r['latency_us']:,.1f}", str(r["fences"])]
            table_rows.append(cells)
        print_table(console, cols, table_rows, title=f"{LABEL}: {esc(_preset_said(pr))} · {esc(w0.model.name)} · "
                    f"{esc(_workload_title(w0, None if over == 'group_size' else over))} · sweep over {over}",
                    left_out_hint="--json shows them")
        console.print(f"[yellow]{LABEL}[/yellow]: n/a = not modelled for this workload (an invalid or unsafe "
                       "setting, or a group size past what there is to group: the same run as group_size 0)"
                       + (", because:" if reasons else "."))
        for why, n in reasons.items():
            console.print(f"  ({n}) {esc(why)}", soft_wrap=True)
        for note in notes:  # a knob chosen for the sweep, or why there is one point
            console.print(f"note: {esc(note)}", soft_wrap=True)
        if scale:
            console.print(f"[yellow]note[/yellow]: {esc(scale)}", soft_wrap=True)
    if not drawable:
        # nothing could be modelled: a failure whether or not a plot was asked for (an empty figure says nothing)
        where = f" (no plot written to {esc(plot_path)})" if plot_path is not None else ""
        Console(stderr=True).print(f"[red]nothing modelled[/red]{where}: every point of the sweep is n/a (the "
                                   "model's reasons are given with it)", soft_wrap=True)
        raise typer.Exit(1)
    if plot_path is not None:
        plot(series, over, plot_path,
              f"{_preset_said(pr)} · {w0.model.name} · {_workload_title(w0, None if over == 'group_size' else over)}")
        if not as_json:
            # the path the file really has (a suffix-less --out gets '.png')
            console.print(f"plot ({LABEL}) written to {esc(plot_path)}", soft_wrap=True)  # a path stays whole


@app.command("presets")
def presets_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the shipped fabric presets."""
    from moetune.tuner.fabric_model.presets import list_presets, load_preset

    items = []
    for name in list_presets():
        p = load_preset(name)
        items.append({"name": p.name, "family": p.family, "transports": list(p.transports),
                      "gpus_per_node": p.gpus_per_node, "calibrated": bool(p.calibration),
                      "description": p.description})
    if as_json:
        typer.echo(json.dumps(items))
        return
    # transports are left out first at 80 columns: the family names the one a prediction is for
    print_table(console, [Col("name", "word"), Col("family", "word"), Col("transports", "word", drop=1),
                           Col("GPUs/node", "num"), Col("calibrated", "word")],
                [(esc(it["name"]), esc(it["family"]), esc(", ".join(it["transports"])), str(it["gpus_per_node"]),
                  "yes" if it["calibrated"] else "no") for it in items],
                title="fabric model presets (parameters with sources; predictions are MODELLED)",
                left_out_hint="--json shows them")


model_calibrate.register(app)  # `moetune model calibrate` (model_calibrate.py), listed after presets
