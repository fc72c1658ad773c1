"""The unfused engine: the layer as torch ops over its EP buffer.

World 1: `MoELayer.local_forward` (sort by expert, two grouped GEMMs, no exchange). World > 1: the gate, then
`dispatch` → `MoELayer.experts` → `combine` over the EP buffer (pipelined in chunks where the knobs ask for it).
Runs any dtype on any device; the layer's parameters stay row-major and are read at every call, in the dtype and on
the device the layer was built with (its inputs' and its buffer's): a call (and `load_state_dict(assign=True)`) first
checks that they still are, so `.float()`, `.to()` or a checkpoint of another dtype is named, not left to a dtype
mismatch deep in a matmul.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moetune.runtime.engines.base import MoEEngine
from moetune.runtime.pipeline import pipelined_moe

if TYPE_CHECKING:
    from moetune.runtime.moe_layer import MoELayer


class UnfusedEngine(MoEEngine):
    name: ClassVar[str] = "unfused"
    # not for every setting: world 1 with grouped GEMMs captures (local_forward keeps everything on the device), the
    # per-expert loop (no grouped GEMM) syncs, and at world > 1 the EP buffer's layout and transport decide
    # (docs/runtime.md, "CUDA graphs")

    @classmethod
    def problem(cls, device: Any, dtype: Any, model: Any, world: int) -> str | None:
        return None  # torch ops: every device, dtype and group

    def forward(self, layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
        self._rebind_all(layer)
        if layer.buffer.world == 1:  # one rank: no exchange (the layer checked x)
            return layer.local_forward(x, *layer.route(x))
        if (not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != layer.model.hidden
                or x.device != layer.device):
            # Still take part in the collective input check so every rank reports the problem (an x on another
            # device would fail the gate's matmul here, on this rank only, while the others wait in dispatch).
            s = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else 0
            idx = torch.zeros(s, layer.model.topk, dtype=torch.int64, device=layer.device)
            return layer.forward_routed(x, idx, torch.zeros(s, layer.model.topk, device=layer.device))
        idx, w = layer.route(x)
        return layer.forward_routed(x, idx, w)

    def forward_routed(self, layer: MoELayer, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
        self._rebind_all(layer)
        buf = layer.buffer
        if buf.world == 1:  # the layer checked the inputs
            return layer.local_forward(x, topk_idx.long(), topk_weights)
        if buf.num_chunks > 1:
            # its own experts return one row per received row: no per-chunk agreement (a host sync per chunk)
            return pipelined_moe(buf, x, topk_idx, topk_weights, layer.experts, agree=False)
        recv_x, meta, handle = buf.dispatch(x, topk_idx, topk_weights)
        try:
            rows = layer.experts(recv_x, meta)
        except Exception as e:  # out of memory on the rank the routing sent the most rows, say
            buf.refuse_combine(e, handle)
        return buf.combine(rows, handle)

    def _rebind_all(self, layer: MoELayer) -> None:
        """`rebind` before a call; at world > 1 a refusal reaches every rank (through the dispatch's input check), not
        this rank alone while the others wait in their dispatch."""
        try:
            self.rebind(layer)
        except ValueError as e:
            if layer.buffer.world == 1:
                raise
            layer.buffer.refuse_dispatch(e)

    def rebind(self, layer: MoELayer) -> None:
        """Nothing to hand over (the parameters are read at every call), but they must still be what the layer was
        built with: ValueError naming the first that is not (its dtype, device or shape)."""
        m = layer.model
        e = len(layer.local_experts)
        for name, shape in (("w_gate_up", (e, 2 * m.intermediate, m.hidden)), ("w_down", (e, m.hidden, m.intermediate)),
                            ("gate", (m.experts, m.hidden))):
            t = getattr(layer, name)
            if t.dtype != layer.dtype or t.device != layer.device or t.shape != shape:
                raise ValueError(f"MoELayer: the layer runs {layer.dtype} {name} {shape} on {layer.device} (its inputs' "
                                 f"and its buffer's), but {name} is now {t.dtype} {tuple(t.shape)} on {t.device} (after "
                                 f".to(), .float(), .half() or load_state_dict(assign=True)?); build a new layer with "
                                 f"the dtype and device wanted, or load weights of its own dtype")
