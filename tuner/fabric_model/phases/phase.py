"""A phase's MODELLED record (Phase) and costs several transports share: combine's reduce, host staging."""

from __future__ import annotations

from moetune.runtime.shapes import DTYPES
from moetune.tuner.fabric_model.params import Params
from moetune.tuner.fabric_model.records import Workload


class Phase:
    __slots__ = ("bytes", "fences", "nic_stalls", "parts", "proxy_stalls", "sm_us", "transfers", "us")

    def __init__(self) -> None:
        self.us = 0.0
        self.fences = self.proxy_stalls = self.nic_stalls = self.transfers = 0
        self.bytes = 0.0
        self.sm_us = 0.0
        self.parts: dict[str, float] = {}


def reduce_us(p: Params, w: Workload, hits, row_bytes: float) -> float:
    """combine's last kernel (csrc/ep_pack.cu combine_reduce; the packed layout's index_add moves the same
    bytes): every returned row read once (S x sum over ranks of P(token needs r), this PE's own rows
    included), every token's output row written once, at HBM speed, after a launch."""
    S = w.tokens_per_gpu
    out_row = w.model.hidden * DTYPES[w.model.dtype]
    return p.launch + S * (float(hits.sum()) * row_bytes + out_row) / p.hbm


def staged_time(p: Params, bytes_out: float, bytes_in: float, chunks: int, depth: int, gpn: int,
                nic_bytes: float = 0.0) -> float:
    """Device→host→device through pinned host memory (PCIe crossed twice), in `chunks` pieces, pipelined at any
    `depth`: the pieces go down on one copy stream and come up on another, posted together (runtime/transports/
    host_staged.py `_move`: send j, receive j, send j+1, ...; NCCL's staged path double-buffers its chunks alike), so
    piece j+1 goes down while piece j comes up, whether the pieces are staging messages (chunk_tokens) or blocks of
    other peers. Deeper pipelines (`depth` > 2) also hide part of the per-copy overhead (assumed)."""
    if bytes_out <= 0 and bytes_in <= 0:
        return 0.0
    n = max(1, chunks)
    a = bytes_out / n / p.d2h  # this GPU's outgoing chunk, device → host
    b = bytes_in / n / p.h2d  # an incoming chunk, host → device
    c = (nic_bytes / n / (p.nic_bw * p.c_nic_eff)) if nic_bytes > 0 else 0.0
    # both directions share the GPU's link without duplex: out and in of a pipelined stage cannot
    # overlap on it (unpipelined they run one after the other either way, so only the stage changes)
    link = max(a, b) if p.duplex else a + b
    ov = p.memcpy
    # double buffering: piece i+1 goes out while piece i comes in (was charged one after the other at depth 1, so a
    # staging message size, chunk_tokens, only ever added copy overheads there); deeper pipelines hide the per-copy
    # launch overhead too
    hide = max(1, min(depth - 1, 4))
    stage = max(link, c) + ov / hide
    t = (a + b + c + 2 * ov) + (n - 1) * stage
    # every staged byte is written to host memory once and read back once, by every GPU of the node
    host = gpn * max(bytes_out, bytes_in) * 2.0 / p.host_mem
    return max(t, host)
