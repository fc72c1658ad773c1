"""The host_staged transport's phase: each peer's block to host memory, (the NIC,) and up, copy engines."""

from __future__ import annotations

import math

from moetune.runtime.knobs import Knobs
from moetune.tuner.fabric_model.params import Params
from moetune.tuner.fabric_model.phases.layouts import bytes_out_in, layout_extras, runs_dense, wire_hits
from moetune.tuner.fabric_model.phases.phase import Phase, staged_time
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.wire_rows import token_bytes


def phase_host_staged(p: Params, w: Workload, knobs: Knobs, *, dispatch: bool, loads, hits) -> Phase:
    """moetune's staged transport (runtime/transports/host_staged.py): each peer's block D2H, (NIC), H2D by the
    copy engines, straight from the rows the EP buffer hands it: the dense layout's stage rows (dispatch) or the
    expert output rows (combine), the packed layout's send rows (built by the plan's gather before the counts
    exchange: `layout_extras`, as for collective). No pack kernel, and no SM count (num_sms is not read)."""
    ph = Phase()
    G = w.gpus_per_node
    tb = token_bytes(w.model, knobs, dispatch=dispatch)
    dense = runs_dense(w, knobs)
    out, inn, peers = bytes_out_in(w, loads, wire_hits(hits, dense), tb, dispatch, copies=False)
    if peers == 0:
        ph.us = p.launch
        return ph
    nic_bytes = 0.0
    if w.nodes > 1:
        if not p.has_nic:
            raise ValueError(f"preset {p.name!r} has no network: it cannot reach PEs on other nodes")
        nic_bytes = out * (w.pes - G) / (w.pes - 1)
    per_peer_tokens = out / tb / peers
    ck = knobs.chunk_tokens
    chunks_per_peer = max(1, math.ceil(per_peer_tokens / ck)) if ck else 1
    chunks = peers * chunks_per_peer
    t = staged_time(p, out, inn, chunks, knobs.pipeline_depth, G, nic_bytes)
    if nic_bytes:
        t += p.rtt
    ph.us = t
    ph.bytes = out
    ph.transfers = chunks
    ph.parts = {"staged": t}
    # packed: the counts exchange is the collective's (an NCCL all_to_all_single), then the host sync
    layout_extras(p, w, knobs, ph, hits, tb, dispatch=dispatch, dense=dense)
    return ph
