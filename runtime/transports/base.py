"""The transport interface: how packed token rows move between the ranks of an EP group.

The EP buffer packs the rows bound for each destination rank contiguously (rank order) and hands
them to a transport; plain implementations (collective, nvlink, proxy, ...) subclass `EPTransport`,
as Optuna's samplers subclass `BaseSampler`. A transport that cannot run here says why through
`availability()` instead of failing at import.

Lifecycle: `availability()` (a class method: may it run here?), construction (collective over the group),
`reserve()` / `stage_capacity()` once with the buffer's sizes, then any number of exchanges, then `close()`.

Capabilities: what a transport can do beyond `exchange_counts` / `exchange` is declared here, once, as class
attributes with their defaults; the EP buffer reads them instead of probing for methods. A subclass that sets
a capability to True implements the methods it names (the defaults below raise NotImplementedError).
`CAPABILITIES` lists them (a test checks every registered transport against it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist

from moetune.runtime import _args
from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.options import RuntimeOptions


class Availability(NamedTuple):
    ok: bool
    reason: str


# name -> what it promises (docs/runtime.md and the capability test read this)
CAPABILITIES: dict[str, str] = {
    "device_counts": "exchange() takes the counts as device tensors with no host round trip and returns a "
                     "capacity-padded view: the EP buffer keeps every count on the GPU (device-resident layout)",
    "graph_capturable": "no host state passes to the GPU per call, so a CUDA-graph replay of an exchange is valid",
    "async_exchange": "exchange_async / exchange_blocks with host split lists, and a `channels=N` constructor "
                      "argument (communicators or lanes per direction); the packed layout's pipelining uses them",
    "dense_collectives": "gather_async / reduce_scatter_async: the dense layout (every capacity slot to every rank)",
    "fused_counts": "exchange_fused(send, send_counts): the counts travel inside the exchange (one launch)",
    "strided_combine": "exchange_strided(rows, ...): combine reads strided rows in place (e.g. recv_x itself)",
    "gathers_tokens": "dispatch_gather(...): the exchange kernel builds the wire rows straight from the tokens",
}


def transport_device(device: Any, who: str = "") -> torch.device:
    """A transport's device as a torch.device (a str such as "cuda:1" accepted; anything else named)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{who}device must be a torch.device or a str such as 'cuda:0', got {type(device).__name__}")
    return torch.device(device)


class EPTransport(ABC):
    """Moves rows between the ranks of `group`. One instance per EP buffer, reused across calls."""

    # the registry name, and the value of the knob `transport` this class runs (the constructor refuses others)
    name: ClassVar[str]
    device_counts: ClassVar[bool] = False
    # a correctness promise (a replay moves the right rows): a transport makes it itself, where a capture test
    # proves it; a new one is not capturable until it does
    graph_capturable: ClassVar[bool] = False
    async_exchange: ClassVar[bool] = False
    dense_collectives: ClassVar[bool] = False
    fused_counts: ClassVar[bool] = False
    strided_combine: ClassVar[bool] = False
    gathers_tokens: ClassVar[bool] = False
    # the compiled csrc library where the transport loaded it (the buffer's fused kernels reuse it), else None
    lib: Any = None

    def __init__(self, group: dist.ProcessGroup | None, knobs: Knobs, device: torch.device | str, *,
                 options: RuntimeOptions | Mapping[str, Any] | None = None):
        who = f"{type(self).__name__}: "
        self.check_arguments(group, knobs, who)
        self.group = group
        self.knobs = knobs
        self.device = transport_device(device, who)
        # the EP buffer passes its options; a transport built on its own resolves them (config, variables); a
        # mapping overrides those as EPBuffer's does (anything else is a TypeError here, not an AttributeError later)
        self.options = RuntimeOptions.resolve(options)
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    @classmethod
    def check_arguments(cls, group: Any, knobs: Any, who: str) -> None:
        """Refuse a group that is not one and knobs that are not this transport's. __init__ runs this first; a
        subclass that does collective work before calling it (host_staged) runs it before that work, so a rank
        given the wrong knobs is refused before any collective, not after (where the others would wait on it)."""
        _args.check_group(group, who)
        _args.check_knobs(knobs, who, optional=False)
        if knobs.transport != cls.name:
            # another family's knobs would be ignored here (or rewritten), and the digest the ranks compare would
            # describe a setting that is not the one running
            raise KnobError(f"{who}needs transport={cls.name} knobs, got transport={knobs.transport!r}",
                            ("transport",))

    @classmethod
    @abstractmethod
    def availability(cls, device: torch.device | None = None, options: RuntimeOptions | None = None) -> Availability:
        """Whether this transport can run on this machine, and why not. `options`: the runtime options it would run
        with (the EP buffer passes its own; None: resolved from the MOETUNE_* variables and the config), for a
        transport whose answer depends on them."""

    @classmethod
    def check_rows(cls, knobs: Knobs, max_rows: int, who: str = "") -> None:
        """Refuse knobs that would not act as named on calls that send up to `max_rows` rows to one peer (KnobError
        naming the knob; local, no collective). Default: nothing to refuse (the proxy's chunk_tokens has a limit)."""

    @classmethod
    def check_world(cls, world: int, who: str = "") -> None:
        """Refuse an EP group of `world` ranks this transport cannot serve (KnobError naming `transport`; local, no
        collective: the EP buffer runs it among its argument checks, before any collective or allocation). Default:
        any size."""

    @classmethod
    def combine_shares_lanes(cls, device: torch.device, options: RuntimeOptions) -> bool:
        """Whether pipelined combines do better on the dispatch communicators/lanes than on their own (the
        knob `combine_lanes=auto` asks this). Default: no, combine gets its own. A prediction made before the
        transport is built; what decides is the built transport's `settle_combine_lanes`."""
        return False

    def settle_combine_lanes(self, dispatch_channels: int) -> bool:
        """With the knob `combine_lanes=auto` and pipelined chunks, the EP buffer builds the transport with lanes of
        its own for combine (`channels=2 x dispatch_channels`) and then asks this, before `reserve` /
        `stage_capacity`: True puts combine on the dispatch lanes (the transport may give back the lanes that then
        go unused). Collective: every rank must answer alike. Default: the class's `combine_shares_lanes`."""
        return bool(type(self).combine_shares_lanes(self.device, self.options))

    # -- sizing (collective: every rank, same arguments) --------------------------------------------
    def reserve(self, max_send_rows: int, row_bytes: int) -> None:
        """Size the receive buffers for calls in which each rank sends up to `max_send_rows` rows of `row_bytes` in
        all, summed over its destinations (a per-rank bound, not per peer; one-sided)."""

    def stage_capacity(self, rows: int, row_bytes: int) -> None:
        """Size the staging slots for blocks of up to `rows` rows of `row_bytes` (host_staged)."""

    # -- the required interface ----------------------------------------------------------------------
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

    # -- optional, declared by the capabilities above -------------------------------------------------
    def exchange_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """async_exchange: blocks [world, ...] equal blocks, block d to rank d; returns the received blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not declare async_exchange")

    def exchange_async(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       out: torch.Tensor | None = None, *, channel: int = 0) -> tuple[torch.Tensor, Any]:
        """async_exchange: post the exchange on `channel`; returns (out, work with .wait() or None)."""
        raise NotImplementedError(f"{type(self).__name__} does not declare async_exchange")

    def gather_async(self, out: torch.Tensor, inp: torch.Tensor, *, channel: int = 0) -> Any:
        """dense_collectives: all-gather `inp` into `out` (rank order); returns a work or None."""
        raise NotImplementedError(f"{type(self).__name__} does not declare dense_collectives")

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, *, channel: int = 0) -> Any:
        """dense_collectives: sum `inp` over ranks, this rank's block into `out`; returns a work or None."""
        raise NotImplementedError(f"{type(self).__name__} does not declare dense_collectives")

    def exchange_fused(self, send: torch.Tensor, send_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fused_counts: (received rows, recv_counts) in one launch."""
        raise NotImplementedError(f"{type(self).__name__} does not declare fused_counts")

    def exchange_strided(self, rows: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """strided_combine: as exchange(), reading `rows` with their stride."""
        raise NotImplementedError(f"{type(self).__name__} does not declare strided_combine")

    def dispatch_gather(self, x: torch.Tensor, tok: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                        send_counts: torch.Tensor, *, row_bytes: int, id_off: int,
                        weight_off: int) -> tuple[torch.Tensor, torch.Tensor]:
        """gathers_tokens: build the wire rows from the tokens inside the receivers' buffers."""
        raise NotImplementedError(f"{type(self).__name__} does not declare gathers_tokens")

    def close(self) -> None:
        """Release communication resources (symmetric memory, proxy threads)."""
