"""Which engine a `MoELayer` runs: the unfused chain or the megakernel, and why not the megakernel.

The choice (the knob `engine`; `MoELayer(..., engine=...)` overrides it), made once, at construction:
- `engine="unfused"` passed to the layer wins over everything.
- `engine="megakernel"` passed to the layer is a request: where the megakernel cannot run, the layer raises
  `MegakernelUnavailable` naming the reason (a caller who asked for it must not get a silently slower layer), before
  any profile is looked up (the layer's EP buffer looks none up at world 1, where the layer never exchanges:
  `MoELayer` builds it with `autoload_at_world1=False`).
- Knobs with `engine=megakernel` (explicit, or from a profile) are a preference: where it cannot run, the
  layer falls back to the unfused engine with ONE `EngineFallbackWarning` per process and reason.
- Neither (no knobs, no engine): at world 1 on a device where the megakernel can run, the layer auto-loads the
  profile of family `megakernel` (daemon -> read-only database -> policy default, runtime/profiles/autoload.py)
  and runs the engine it names, with that profile per token bucket (every lookup under the layer's buffer's
  RuntimeOptions, as the buffer's own: none of them acts on a megakernel profile, but the lookup is keyed and
  cached by the options the layer runs, never re-resolved from the config). On a CUDA device where it cannot run, one
  warning says why; on a CPU device the unfused engine is the only one and is chosen silently.

Whether the megakernel can run (`MegakernelEngine.problem`: world 1, then `megakernel_problem` in
runtime/megakernel/engine.py) is asked at most once per decision; building it may still fail later, which turns
into the same request-or-fallback decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from moetune.runtime.engines.base import MoEEngine
from moetune.runtime.engines.megakernel import MegakernelEngine
from moetune.runtime.engines.unfused import UnfusedEngine
from moetune.runtime.knobs import Knobs
from moetune.runtime.megakernel import engine as _mk

if TYPE_CHECKING:
    from moetune.runtime.moe_layer import MoELayer

# the knob `engine`'s values -> the classes that run them (a test checks it against knobs.ENGINES)
ENGINE_CLASSES: dict[str, type[MoEEngine]] = {c.name: c for c in (UnfusedEngine, MegakernelEngine)}


class EngineChoice(NamedTuple):
    engine: MoEEngine
    note: str = ""  # why the engine is not the one the knobs or the profile named ("" where it is)
    resolution: Any = None  # the autoload Resolution where the megakernel profile was looked up


def choose_engine(layer: MoELayer, engine: str | None, knobs: Knobs | None, max_tokens: int, *,
                  runnable: bool = False) -> EngineChoice:
    """The engine `layer` runs (its weights and buffer built), by the rules above; builds the megakernel when it is
    chosen. Raises `MegakernelUnavailable` where `engine="megakernel"` was asked for and it cannot run. `runnable`:
    `refuse_unrunnable_megakernel` found no problem already (not asked again)."""
    if engine == "unfused":
        return EngineChoice(UnfusedEngine())
    world = layer.buffer.world
    world1 = world == 1
    asked: list[str | None] = [None] if runnable else []  # MegakernelEngine.problem's answer, once asked

    def problem() -> str | None:
        if not asked:
            asked.append(MegakernelEngine.problem(layer.device, layer.dtype, layer.model, world))
        return asked[0]

    if engine == "megakernel" and problem() is not None:  # refused before any profile lookup: a daemon round trip
        raise _unavailable(str(problem()))  # and its "NO tuned profile" warning for an engine that cannot run here

    wanted: Knobs | None = None
    resolution: Any = None
    profiled = False  # the knobs come from a stored profile (per token bucket), not from the caller
    if knobs is not None:
        wanted = knobs if knobs.engine == "megakernel" else None
        if engine == "megakernel" and wanted is None:
            wanted = knobs.replace(engine="megakernel")
    elif engine == "megakernel" or (world1 and problem() is None):
        if world1:
            from moetune.runtime.profile_record import nearest_bucket
            from moetune.runtime.profiles.autoload import autoload_profile

            # under the buffer's options, as the buffer's own lookup: the layer's options end to end. For the token
            # bucket of expected_tokens, as every other bucket is looked up (MegakernelEngine.resolve): the profile is
            # installed for that bucket, and the count itself may be nearer another stored bucket than the bucket is
            resolution = autoload_profile(model=layer.model, ep_size=1, nodes=1,
                                          max_tokens=nearest_bucket(layer.expected_tokens),
                                          device=layer.device, transport_family=_mk.ENGINE_FAMILY, dtype=layer.dtype,
                                          options=layer.buffer.options)
            profiled = True
            if resolution.knobs.engine == "megakernel":
                wanted = resolution.knobs
            elif engine == "megakernel":
                wanted = resolution.knobs.replace(engine="megakernel")
        else:
            wanted = Knobs(engine="megakernel")
    elif world1 and layer.device.type == "cuda":  # auto on a GPU that cannot run it: say so once
        why = str(problem())
        _mk.warn_fallback_once(why)
        return EngineChoice(UnfusedEngine(), note=why)
    if wanted is None:
        return EngineChoice(UnfusedEngine(), resolution=resolution)
    built: MegakernelEngine | None = None
    why_not = problem()
    if why_not is None:
        built, why_not = MegakernelEngine.build(layer, wanted, max_tokens, profiled=profiled)
    if built is None:
        why_not = str(why_not)
        if engine == "megakernel":
            raise _unavailable(why_not)
        _mk.warn_fallback_once(why_not)
        return EngineChoice(UnfusedEngine(), note=why_not, resolution=resolution)
    return EngineChoice(built, resolution=resolution)


def refuse_unrunnable_megakernel(layer: MoELayer) -> None:
    """`MegakernelUnavailable` where the megakernel cannot run on the layer's device, dtype, model and world: asked
    before the layer builds its weights (minutes, or more memory than the node has, for a large model on a CPU)
    rather than after."""
    why = MegakernelEngine.problem(layer.device, layer.dtype, layer.model, layer.buffer.world)
    if why is not None:
        raise _unavailable(why)


def _unavailable(why: str) -> _mk.MegakernelUnavailable:
    return _mk.MegakernelUnavailable(f"engine='megakernel' was asked for, but the megakernel cannot run here: {why}")
