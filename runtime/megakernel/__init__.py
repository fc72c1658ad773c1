"""The MoE megakernel on one GPU (issue 17): routing + one persistent kernel with an on-GPU scheduler.

`MegakernelMoE(model, max_tokens=...)` is the layer; `MegakernelConfig` its tunable settings;
`schedule` a CPU model of the kernel's task graph and scheduler. CUDA sources: csrc/megakernel/.
"""

from .config import ConfigError, MegakernelConfig

__all__ = ["ConfigError", "MegakernelConfig", "MegakernelError", "MegakernelMoE"]


def __getattr__(name: str):  # the layer imports torch: load it only when asked for
    if name in ("MegakernelMoE", "MegakernelError"):
        from . import layer

        return getattr(layer, name)
    raise AttributeError(name)
