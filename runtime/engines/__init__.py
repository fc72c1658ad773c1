"""The MoE layer's engines: how a `MoELayer` computes its output once its weights and buffer exist.

`base` holds `MoEEngine`, the interface with its capabilities declared as class attributes (as
`transports/base.py` does for transports); `unfused` the torch chain (gate → dispatch → experts → combine; world
1: `local_forward`); `megakernel` routing + one persistent kernel (`runtime/megakernel`), with its per token
bucket profiles; `choice` which one a layer runs (once, at construction) and why not the megakernel. The public
names load lazily from their modules, so importing one submodule does not import the rest.
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "CAPABILITIES": ".base",
    "ENGINE_CLASSES": ".choice",
    "EngineChoice": ".choice",
    "MegakernelEngine": ".megakernel",
    "MoEEngine": ".base",
    "UnfusedEngine": ".unfused",
    "choose_engine": ".choice",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = ["CAPABILITIES", "ENGINE_CLASSES", "EngineChoice", "MegakernelEngine", "MoEEngine", "UnfusedEngine",
           "choose_engine"]
