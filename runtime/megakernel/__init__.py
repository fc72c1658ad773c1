"""The MoE megakernel on one GPU (issue 17): routing + one persistent kernel with an on-GPU scheduler.

`MegakernelMoE(model, max_tokens=...)` is the layer; `MegakernelConfig` its tunable settings;
`schedule` a CPU model of the kernel's task graph and scheduler, `topk` of the routing kernels' top-k order.
CUDA sources: csrc/megakernel/.
"""

from moetune.runtime._lazy import lazy_getattr

from .config import ConfigError, MegakernelConfig

__all__ = ["ConfigError", "MegakernelConfig", "MegakernelError", "MegakernelMoE"]

# the layer imports torch: load it only when asked for (the package's one lazy loader, as runtime/ and buffer/)
__getattr__ = lazy_getattr(__name__, {"MegakernelMoE": ".layer", "MegakernelError": ".layer"})
