"""The collective transport: NCCL `all_to_all_single` on GPUs, gloo on CPU.

Rows bound for each destination are packed contiguously by the EP buffer (one block per peer, rank
order), so one `all_to_all_single` with split sizes moves everything: one transfer per peer. Counts
travel first in a small equal-split all-to-all (`exchange_blocks`). With pipelining the buffer uses
`exchange_async` on two channels (two process groups over the same ranks: dispatch and combine), so a
combine can travel while later dispatch chunks are still in flight (NCCL runs each communicator on its
own CUDA stream; gloo runs async work handles).

Run with NCCL peer-to-peer disabled (NCCL_P2P_DISABLE=1, set before NCCL initialises), NCCL stages every
transfer through host memory itself; `host_staged` (host_staged.py) stages through host memory with the copy
engines instead, and falls back to this class where it cannot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moetune.runtime import _args, _once
from moetune.runtime.knobs import Knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.transports.base import Availability, EPTransport

_EXTRA_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def warn_channels_not_honoured(ranks: list[int], channels: int, world_size: int) -> None:
    """Say once per EP group (per process) that `channels` > 1 runs as one communicator on a sub-group."""
    _once.say_once(
        "collective.subgroup_channels", tuple(ranks),
        f"moetune: this EP buffer asks for {channels} communicators (the knob `channels`, plus a combine "
        f"channel when pipelined), but the EP group "
        f"({len(ranks)} of {world_size} ranks) is not the whole world: extra communicators would need every "
        "world rank to take part in building them, so this EP group runs on ONE communicator (combine queues "
        "behind dispatch). A profile tuned with channels > 1 on a whole-world group is not what runs here.",
        category=RuntimeWarning, stacklevel=3)


# torch >= 2.13 names them *_single (the old names warn); older torch only has the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """The timeout `group` (else the default group) was made with, as its backend holds it; None (torch's default)
    where this torch does not say."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(device).options._timeout  # type: ignore[union-attr]
    except Exception:  # a private attribute: another torch may lack it
        return None


class CollectiveTransport(EPTransport):
    name: ClassVar[str] = "collective"
    # NCCL collectives capture (the dense layout never syncs with the host): tests/test_buffer_streams.py replays one
    graph_capturable: ClassVar[bool] = True
    async_exchange: ClassVar[bool] = True
    dense_collectives: ClassVar[bool] = True

    def __init__(self, group: dist.ProcessGroup | None, knobs: Knobs, device: torch.device | str, *, channels: int = 1,
                 options: RuntimeOptions | Mapping[str, Any] | None = None):
        _args.check_int("channels", channels, 1, f"{type(self).__name__}: ")
        super().__init__(group, knobs, device, options=options)
        self.groups: list[dist.ProcessGroup | None] = [group]
        if dist.is_initialized() and channels > 1 and self.world > 1:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            if len(ranks) == dist.get_world_size():
                # new_group is collective over the whole default group: every rank builds the EP buffer.
                # Extra communicators are cached per (group, channel) and shared by later buffers, so
                # building many buffers (benchmarks, layers) does not create a communicator each time.
                for ch in range(1, channels):
                    key = (id(group) if group is not None else 0, tuple(ranks), ch)
                    if key not in _EXTRA_GROUPS:
                        # the group's own timeout: torch's default (30 min for gloo) left a rank waiting on a
                        # peer that stopped mid-exchange for that long, past the timeout the job set
                        _EXTRA_GROUPS[key] = dist.new_group(ranks=ranks, backend=dist.get_backend(group),
                                                            timeout=_group_timeout(group, self.device))
                    self.groups.append(_EXTRA_GROUPS[key])
            else:
                # A sub-group cannot build extra communicators without every world rank taking part:
                # fall back to one channel (combine then queues behind dispatch on the same communicator),
                # and say so once.
                warn_channels_not_honoured(ranks, channels, dist.get_world_size())

    @classmethod
    def availability(cls, device: torch.device | None = None, options: RuntimeOptions | None = None) -> Availability:
        if not dist.is_available():
            return Availability(False, "torch.distributed is not available in this torch build")
        if device is not None and device.type == "cuda":
            if not torch.cuda.is_available():
                return Availability(False, "no CUDA device")
            if not dist.is_nccl_available():
                return Availability(False, "torch was built without NCCL")
            return Availability(True, "NCCL all_to_all_single")
        if not dist.is_gloo_available():
            return Availability(False, "torch was built without gloo")
        return Availability(True, "gloo all_to_all_single (CPU)")

    # -- the EPTransport interface ---------------------------------------------------------------
    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        return self.exchange_blocks(send_counts.reshape(self.world, 1)).reshape(self.world)

    def exchange(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        s = [int(c) for c in send_counts.tolist()]
        r = [int(c) for c in recv_counts.tolist()]
        out, work = self.exchange_async(send, s, r)
        if work is not None:
            work.wait()
        return out

    # -- what the EP buffer uses ------------------------------------------------------------------
    def exchange_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [world, ...]: block d goes to rank d; returns [world, ...] with block s from rank s."""
        if self.world == 1:
            return blocks.clone()
        out = torch.empty_like(blocks)
        dist.all_to_all_single(out, blocks.contiguous(), group=self.groups[0])
        return out

    def exchange_async(
        self,
        send: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        out: torch.Tensor | None = None,
        *,
        channel: int = 0,
    ) -> tuple[torch.Tensor, dist.Work | None]:
        """Post one all_to_all_single of rows (split sizes in rows, rank order). Returns (out, work);
        `work.wait()` (None when nothing had to travel) before reading `out` (on CUDA: makes the current
        stream wait for the communicator's stream)."""
        rows = sum(recv_splits)
        if out is None:
            out = torch.empty((rows, *send.shape[1:]), dtype=send.dtype, device=send.device)
        if self.world == 1:
            if rows:
                out.copy_(send[:rows])
            return out, None
        group = self.groups[channel % len(self.groups)]
        work = dist.all_to_all_single(
            out, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group, async_op=True
        )
        return out, work

    def gather_async(self, out: torch.Tensor, inp: torch.Tensor, *, channel: int = 0) -> dist.Work | None:
        """Dense layout dispatch: every rank's `inp` [n, ...] lands in `out` [world * n, ...] (rank order)."""
        if self.world == 1:
            out.copy_(inp)
            return None
        return _ALL_GATHER(out, inp, group=self.groups[channel % len(self.groups)], async_op=True)

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, *, channel: int = 0) -> dist.Work | None:
        """Dense layout combine: block r of `inp` [world * n, ...] goes to rank r, where the blocks of all
        ranks are summed into `out` [n, ...]."""
        if self.world == 1:
            out.copy_(inp)
            return None
        return _REDUCE_SCATTER(out, inp, group=self.groups[channel % len(self.groups)], async_op=True)

    @property
    def channels(self) -> int:
        return len(self.groups)

    def close(self) -> None:
        """Nothing to free: the extra communicators are cached for the process (see `release_channels`)."""


def release_channels() -> None:
    """Destroy the cached extra communicators (call before destroying the default process group)."""
    for g in _EXTRA_GROUPS.values():
        try:
            dist.destroy_process_group(g)
        except Exception:
            pass
    _EXTRA_GROUPS.clear()

