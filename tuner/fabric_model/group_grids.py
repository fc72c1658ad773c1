"""The transfers a decoupled group_size groups per peer: the grids the search and `model sweep` offer."""

from __future__ import annotations

import math

from moetune.runtime.knobs import Knobs
from moetune.runtime.routing import parse_routing
from moetune.tuner.fabric_model.params import as_preset, params
from moetune.tuner.fabric_model.phases.nvlink import ctas_per_peer
from moetune.tuner.fabric_model.phases.queued import most_puts_to_a_peer
from moetune.tuner.fabric_model.presets import Preset
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.routing import rank_hits
from moetune.tuner.fabric_model.wire_rows import chunking, route


def transfers_per_peer(w: Workload, chunk_tokens: int = 0) -> int:
    """The PUTs one PE posts to one peer under uniform routing, its mean rows chunked: ceil(S x P(token needs the
    peer) / chunk_tokens) (1 with chunk_tokens 0; at most MAX_SLOTS). Not the model's charge, whose largest share
    may be one more (`group_grid` is the sweep's grid). Any group size is valid (a last partial group is sent as is,
    csrc/proxy_xchg.h): a count, not a divisibility rule. 1 for EP size 1."""
    if w.pes < 2:
        return 1
    rows = w.tokens_per_gpu * float(rank_hits(w.model.experts, w.model.topk, 0.0, w.pes)[0])
    return max(1, chunking(rows, chunk_tokens)[1])


def busiest_peer_rows(w: Workload) -> float:
    """The rows one PE sends its busiest peer, S x max over ranks of P(token needs the rank) under the workload's
    routing (dispatch sends rank d S x P(d) rows; combine returns the most needed rank's count to every peer)."""
    _, s = parse_routing(w.routing)
    return w.tokens_per_gpu * float(rank_hits(w.model.experts, w.model.topk, s, w.pes).max())


def group_grid(preset: Preset | str, w: Workload, knobs: Knobs) -> int:
    """How many transfers a decoupled `group_size` groups per peer in `predict`'s runtime layout, the most any
    peer gets: proxy/ibgda the most PUTs the model charges a peer (`phases.queued.most_puts_to_a_peer`: the expected
    PUTs of a set of peers shared out by largest remainder, so some peers get one more than the mean; ONE with
    chunk_tokens 0; the busiest peer's mean rows chunked gave 1 at decode where the model charges some peers 2), nvlink the kernel's CTAs per peer (`ctas_per_peer`, which depends on
    num_sms); 0 for the transports whose prediction reads no group_size (collective, host_staged). A group
    size above it makes one group of every peer's transfers: the same run as group_size 0 (one per peer)."""
    preset = as_preset(preset)
    if knobs.transport in ("proxy", "ibgda"):
        _, hits = route(w)
        return max(1, most_puts_to_a_peer(params(preset), w, knobs, hits))
    if knobs.transport == "nvlink":
        return ctas_per_peer(params(preset), knobs.num_sms, w.gpus_per_node)
    return 0


def expert_tiles_per_peer(w: Workload) -> int:
    """The group-size grid of layout `expert_tiles`: experts per PE x tiles of `tile` tokens per expert under
    uniform routing. A decoupled group size must divide it there (Knobs.check_workload)."""
    per_expert = w.tokens_per_gpu * w.model.topk / w.model.experts
    return (w.model.experts // w.pes) * max(1, math.ceil(per_expert / w.tile - 1e-9))
