"""The transport interface: how packed token rows move between the ranks of an EP group.

The EP buffer packs the rows bound for each destination rank contiguously (rank order) and hands
them to a transport; plain implementations (collective, nvlink, proxy, ...) subclass `EPTransport`,
as Optuna's samplers subclass `BaseSampler`. A transport that cannot run here says why through
`availability()` instead of failing at import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist

from moetune.runtime.knobs import Knobs


class Availability(NamedTuple):
    ok: bool
    reason: str


class EPTransport(ABC):
    """Moves rows between the ranks of `group`. One instance per EP buffer, reused across calls."""

    name: ClassVar[str]
    # True when exchange() takes the counts as device tensors with no host round trip and returns a
    # capacity-padded view (the one-sided transports): the EP buffer then keeps every count on the GPU.
    device_counts: ClassVar[bool] = False
    # False when a call passes host state to the GPU per call (so a CUDA-graph replay would reuse stale state)
    graph_capturable: ClassVar[bool] = True

    def __init__(self, group: dist.ProcessGroup | None, knobs: Knobs, device: torch.device):
        self.group = group
        self.knobs = knobs
        self.device = device
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    @classmethod
    @abstractmethod
    def availability(cls, device: torch.device | None = None) -> Availability:
        """Whether this transport can run on this machine, and why not."""

    @abstractmethod
    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """send_counts[d] rows go to rank d; returns recv_counts[s] rows arriving from rank s.

        Both are int64 tensors of length world on `device`.
        """

    @abstractmethod
    def exchange(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Send `send` (rows grouped by destination rank, in rank order) and return the received rows.

        The result holds at least sum(recv_counts) rows, grouped by source rank in rank order; rows past
        that (capacity padding of one-sided transports) are not meaningful.
        """

    def close(self) -> None:
        """Release communication resources (symmetric memory, proxy threads)."""
