"""Error bounds of the MoE layer against the fp32 dense reference, shared by the runtime's self-tests and the tuner's
output checks (the tuner imports them from here; the runtime never imports the tuner). No torch import."""

from __future__ import annotations

# What a bf16 layer of torch ops (the unfused engine, the plain torch path, a one-sided transport's layer) may differ
# from the fp32 dense reference by (max |out - ref| / max |ref|): the runtime issue's bf16 bound for the layer
BF16_LAYER_REL_ERR_BOUND = 3e-2
