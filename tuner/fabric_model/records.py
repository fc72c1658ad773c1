"""The fabric model's records: the Workload asked about, the MODELLED Prediction and TransferPrediction."""

from __future__ import annotations

from typing import Any

import msgspec

from moetune.runtime.routing import parse_routing
from moetune.runtime.shapes import MAX_TOKENS_PER_GPU, ModelShape, get_model, tokens_per_gpu_problem

# The most ranks (nodes x GPUs per node) the model predicts. Its cost grows with the ranks: 524288 took 46 s and 1.8 GB
# a prediction, 8M did not end in minutes (`model predict -n 1048576` of a custom shape with 8M experts); 65536, more
# than any EP group runs, takes ~10 s.
MAX_PES = 1 << 16


class Workload(msgspec.Struct, frozen=True):
    """One EP layer's workload. `model` may be a ModelShape or a name/`custom:H,I,E,K` spec."""

    model: ModelShape
    tokens_per_gpu: int
    nodes: int
    gpus_per_node: int
    routing: str = "uniform"
    # tokens per tile: the expert GEMMs' row padding, and the PUT size of layout `expert_tiles`
    tile: int = 128
    # False: GPUs of a node may not talk peer-to-peer (NCCL_P2P_DISABLE=1): intra-node traffic is staged.
    p2p: bool = True
    # The collective transports' wire layout, as EPBuffer(dense=...): None takes the runtime's own rule
    # (runtime/buffer/layout_choice.py `picks_dense`, what the tuner measures), False the packed layout, True the
    # dense one (every capacity slot, S rows, to every rank).
    dense: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            msgspec.structs.force_setattr(self, "model", get_model(self.model))
        if not isinstance(self.model, ModelShape):
            raise ValueError(f"model must be a ModelShape or a model name, got {type(self.model).__name__}")
        for name in ("tokens_per_gpu", "nodes", "gpus_per_node", "tile"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        # the constructor checks no types: dense="packed" (a true string) ran the dense layout, the opposite
        if not isinstance(self.p2p, bool):
            raise ValueError(f"p2p must be True or False, got {self.p2p!r}")
        if self.dense is not None and not isinstance(self.dense, bool):
            raise ValueError(f"dense must be None (the runtime's rule), False (packed) or True (dense), got "
                             f"{self.dense!r}")
        problem = tokens_per_gpu_problem(self.tokens_per_gpu)  # the rule `query --tokens` shares
        if problem:
            raise ValueError(f"tokens_per_gpu {problem}")
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.tile < 1:
            raise ValueError(f"tile must be >= 1, got {self.tile}")
        if self.tile > MAX_TOKENS_PER_GPU:
            # a tile pads each expert's rows to a multiple of it: above the most tokens per GPU moetune handles it is
            # no GEMM tile, and a huge one made an absurd expert time or an OverflowError. One above the tokens an
            # expert receives is fine (a kernel's fixed tile at decode)
            raise ValueError(f"tile must be at most {MAX_TOKENS_PER_GPU} (the most tokens per GPU moetune handles), "
                             f"got {self.tile}")
        if self.nodes * self.gpus_per_node > MAX_PES:
            raise ValueError(f"an EP group of {self.nodes * self.gpus_per_node} ranks ({self.nodes} nodes x "
                             f"{self.gpus_per_node} GPUs) is beyond what the fabric model predicts (at most {MAX_PES})")
        try:
            self.model.check_ep(self.nodes * self.gpus_per_node)  # the runtime's one rule (runtime/shapes.py)
        except ValueError as e:
            raise ValueError(f"{e} ({self.nodes} nodes x {self.gpus_per_node} GPUs)") from None
        if not isinstance(self.routing, str):  # the parser failed on it with an AttributeError ('strip')
            raise ValueError(f"routing must be a string (uniform or zipf:S, e.g. zipf:1.2), got {self.routing!r}")
        parse_routing(self.routing)

    @property
    def pes(self) -> int:
        return self.nodes * self.gpus_per_node


class Prediction(msgspec.Struct, kw_only=True):
    """A MODELLED prediction for one dispatch + combine of one EP layer, per GPU (PE)."""

    latency_us: float
    dispatch_us: float
    combine_us: float
    fences: int
    proxy_stalls: int
    nic_stalls: int
    bytes_on_wire: float
    transfers: int
    phases: dict[str, float]
    modelled: bool = True
    layer_us: float = 0.0  # dispatch + expert compute (modelled) + combine
    expert_us: float = 0.0
    preset: str = ""
    transport: str = ""
    notes: list[str] = msgspec.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class TransferPrediction(msgspec.Struct, kw_only=True):
    """MODELLED microbenchmark: N concurrent transfers of one size from one PE (Perseus-style)."""

    time_us: float
    put_only_us: float
    throughput_gbps: float
    put_only_gbps: float
    relative_throughput: float
    fence_time_us: float
    fence_share: float
    fences: int
    proxy_stalls: int
    nic_stalls: int
    modelled: bool = True

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)
