"""The nvlink transport's phase: GPU stores into peers' memory, CTAs per peer, signals as device writes."""

from __future__ import annotations

import math

from moetune.runtime.knobs import MAX_SLOTS, KnobError, Knobs
from moetune.tuner.fabric_model.params import Params, group_problem
from moetune.tuner.fabric_model.phases.phase import Phase, reduce_us
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.wire_rows import SIGNAL_BYTES, token_bytes


def ctas_per_peer(p: Params, num_sms: int, world: int) -> int:
    """CTAs the nvlink kernel gives each destination (csrc/ep_nvlink.cu mt_nvl_ctas_per_peer)."""
    return max(1, min(num_sms // world, p.sms // world, MAX_SLOTS))


def nvlink_time(p: Params, bytes_per_peer: list[float], groups: int, num_sms: int, cpp: int | None = None) -> float:
    """GPU stores into peers' memory over NVLink: no proxy, signals as device writes. `cpp`: the CTAs
    that copy one peer's bytes (their SM copy rate bounds that peer's stream)."""
    if not bytes_per_peer:
        return p.launch
    total = sum(bytes_per_peer)
    bw = min(p.nvl_egress, num_sms * p.sm_copy, p.hbm)
    peer_bw = min(p.nvl_peer, (cpp if cpp is not None else num_sms) * p.sm_copy)
    t = max(total / bw, max(bytes_per_peer) / peer_bw)
    # each group's signal follows a system fence + flag store; spread over the communicating CTAs
    sig = p.nvl_sig * math.ceil(groups / max(1, num_sms))
    return p.launch + t + p.nvl_lat + sig


def _nvlink_signals(p: Params, knobs: Knobs, world: int) -> tuple[int, int]:
    """(transfers = signal slots, system fences) per peer of the nvlink kernel: one per CTA; decoupled,
    one fence per group of group_size CTAs (clamped to the CTAs; 0 = all of them), csrc/ep_nvlink.cu."""
    cpp = ctas_per_peer(p, knobs.num_sms, world)
    if knobs.signalling == "coupled":
        return cpp, cpp
    g = cpp if knobs.group_size <= 0 else min(knobs.group_size, cpp)
    return cpp, math.ceil(cpp / g)


def phase_nvlink(p: Params, w: Workload, knobs: Knobs, *, dispatch: bool, hits) -> Phase:
    ph = Phase()
    why = group_problem(p, "nvlink", w.pes, w.nodes)  # as the runtime's check_world refuses it (transports/_onesided.py)
    if why:
        raise KnobError(why, ("transport",))
    if not p.has_nvl:
        raise KnobError(f"preset {p.name!r} has no NVLink", ("transport",))
    if not w.p2p and w.gpus_per_node > 1:
        # GPU stores into a peer's memory need peer-to-peer; with it disabled nothing can be stored
        raise KnobError("transport 'nvlink' needs GPU peer-to-peer, which this workload disables (p2p=False); "
                        "use host_staged or collective", ("transport",))
    S, G = w.tokens_per_gpu, w.gpus_per_node
    tb = token_bytes(w.model, knobs, dispatch=dispatch)
    if dispatch:  # PE 0 sends every other PE the rows of its tokens that PE needs
        bpp = [S * float(hits[d]) * tb for d in range(1, G)]
    else:  # the most needed PE returns one row per row it received, to every other PE
        bpp = [S * float(hits.max()) * tb] * (G - 1)
    cpp, fences = _nvlink_signals(p, knobs, G)
    groups = (G - 1) * fences
    ph.us = nvlink_time(p, bpp, groups, knobs.num_sms, cpp)
    ph.bytes = sum(bpp) + (G - 1) * cpp * SIGNAL_BYTES
    ph.transfers = (G - 1) * cpp
    ph.parts = {"nvlink": ph.us}
    if G > 1:
        # phase 0/1 of csrc/ep_nvlink.cu: the count-matrix row stored into every rank (tagged words, inside the
        # same launch); a CTA's offset in d's buffer waits for the words of the lower ranks: one NVLink latency
        # before the rows of any rank above the lowest move (dispatch: exchange_fused / dispatch_gather; combine
        # the same kernel)
        ph.parts["counts"] = p.nvl_lat
        ph.us += p.nvl_lat
        ph.bytes += (G - 1) * G * SIGNAL_BYTES
    # the cpp CTAs of this PE's own slot copy its own rows locally (read + write), beside the peers' CTAs
    own = S * float(hits[0] if dispatch else hits.max()) * tb
    ph.parts["self_copy"] = own / min(cpp * p.sm_copy, p.hbm / 2.0)
    ph.us = max(ph.us, p.launch + ph.parts.get("counts", 0.0) + ph.parts["self_copy"])
    if not dispatch:
        ph.parts["reduce"] = red = reduce_us(p, w, hits, tb)
        ph.us += red
    return ph
