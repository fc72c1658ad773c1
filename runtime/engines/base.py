"""The engine interface: how a `MoELayer` turns its inputs into its output.

A layer builds its weights and its EP buffer, then runs ONE engine, chosen at construction (`choice.py`) and
never switched: `unfused` (the torch chain) or `megakernel` (routing + one persistent kernel, world 1 only).
The layer keeps what every engine shares (arguments, weights, the input checks at world 1, `close()`) and hands
each call to its engine; an engine takes the layer as an argument and keeps no reference to it.

Lifecycle: `problem(...)` (a class method, cheap: may it run a layer here, and why not), construction by
`choice.choose_engine`, then per call `forward` / `forward_routed` (the layer has checked the inputs at world 1;
an engine whose settings are per token bucket settles the call's bucket itself), `resolve_buckets` before CUDA
graphs are captured, `rebind` after the layer's parameters were replaced, `check` / `clear_error` of a
device-side error record; `close` when the layer is closed.

Capabilities: what tells the engines apart is declared here, once, as class attributes with their defaults; the
layer reads them instead of testing which engine it holds. `CAPABILITIES` lists them (a test checks every engine
class against it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from moetune.runtime.knobs import Knobs
    from moetune.runtime.moe_layer import MoELayer

# name -> what it promises (a test checks that every engine class declares each as a bool)
CAPABILITIES: dict[str, str] = {
    "distinct_expert_ids": "forward_routed needs a token's expert ids to be distinct (the layer's input check at "
                           "world 1 refuses repeats)",
    "tiled_weights": "while the engine runs, the layer's expert parameters hold the megakernel's k-tiled layout "
                     "(runtime/megakernel/weights.py; state_dict and load_state_dict convert)",
}


class MoEEngine(ABC):
    """Computes one `MoELayer`'s output. One instance per layer, for the layer's life."""

    # the value of the knob `engine` (and of `MoELayer.engine`) this class runs
    name: ClassVar[str]
    distinct_expert_ids: ClassVar[bool] = False
    tiled_weights: ClassVar[bool] = False

    # what the layer shows of its engine (`MoELayer.megakernel`, `.engine_knobs`, `.engine_buckets`): the
    # MegakernelMoE it launches, the knob set it runs with, its per token bucket knobs ({bucket: knobs}; None where
    # one setting holds for every S). None for an engine that has none.
    megakernel: Any = None
    knobs: Knobs | None = None
    buckets: dict[int, Knobs] | None = None

    @classmethod
    @abstractmethod
    def problem(cls, device: Any, dtype: Any, model: Any, world: int) -> str | None:
        """Why this engine cannot run a layer of `model` with `dtype` activations on `device` in a group of `world`
        ranks, or None. Cheap (no build, no launch); building it may still fail later."""

    @abstractmethod
    def forward(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        """`layer`'s output for `x` [S, H] (at world 1 the layer has checked `x`)."""

    @abstractmethod
    def forward_routed(self, layer: MoELayer, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
        """`layer`'s output with given routing (at world 1 the layer has checked the inputs)."""

    # -- optional hooks: the defaults are those of an engine with nothing per bucket, no copy of the parameters
    # and no device-side error record -----------------------------------------------------------------------
    def resolve_buckets(self, max_tokens: int) -> dict[int, Knobs]:
        """Resolve every token bucket a call of 1..max_tokens tokens falls in, now (before capturing CUDA graphs).
        Returns {bucket: knobs}; {} where the settings are not per bucket."""
        return {}

    def rebind(self, layer: MoELayer) -> None:
        """Take `layer`'s parameters anew where their storage changed (after `load_state_dict(assign=True)`).
        Default: the engine reads the parameters from the layer at every call, nothing to do."""

    def check(self) -> None:
        """Raise a device-side error recorded since the last `clear_error()` (a host sync). Default: the engine's
        errors raise at the call, nothing to do."""

    def clear_error(self) -> None:
        """Forget the device-side error record. Default: none kept, nothing to do."""

    def close(self) -> None:
        """Let go of what the engine holds for its calls (its scratch on the device) once the layer is closed; the
        layer calls no other hook after it, except `rebind` (load_state_dict), which must then do nothing. What the
        layer shows of the engine (its name, `knobs`, `buckets`, `tiled_weights`) stays. Default: nothing held."""
