"""A preset's parameters as the model reads them (Params, flattened for speed); its transport checks."""

from __future__ import annotations

from moetune.runtime.knobs import KnobError, Knobs, one_sided_world_problem
from moetune.tuner.fabric_model.presets import Preset, load_preset


class Params:
    __slots__ = tuple(
        ["name", "sms", "tflops", "eff", "hbm", "sm_copy", "launch", "has_nvl", "nvl_egress", "nvl_peer", "nvl_lat", "nvl_sig", "d2h", "h2d", "memcpy", "host_mem", "duplex", "c_alpha", "c_sync", "c_peer", "c_intra", "c_nic_eff", "c_host_alpha", "c_host_chunk", "has_nic", "nic_bw", "qp_bw", "msg_o", "sig_o", "rtt", "tail", "shared_qps", "has_proxy", "put_us", "sig_us", "flag_us", "fence_us", "fence_pe_us", "poll_us", "fence_quiet", "proxy_intra", "has_ibgda", "post_sm_us", "wqe_fetch_us"]
    )


_PCACHE: dict[int, tuple[Preset, Params]] = {}


def params(preset: Preset) -> Params:
    hit = _PCACHE.get(id(preset))
    if hit is not None and hit[0] is preset:
        return hit[1]
    g = preset.get
    p = Params()
    p.name = preset.name
    p.sms, p.tflops, p.eff = g("gpu.sms"), g("gpu.tflops_bf16"), g("gpu.gemm_efficiency")
    p.hbm, p.sm_copy, p.launch = g("gpu.hbm_gbps") * 1e3, g("gpu.sm_copy_gbps") * 1e3, g("gpu.launch_us")
    p.has_nvl = preset.has("nvlink")
    if p.has_nvl:
        p.nvl_egress, p.nvl_peer = g("nvlink.egress_gbps") * 1e3, g("nvlink.peer_gbps") * 1e3
        p.nvl_lat, p.nvl_sig = g("nvlink.latency_us"), g("nvlink.signal_us")
    p.d2h, p.h2d = g("pcie.d2h_gbps") * 1e3, g("pcie.h2d_gbps") * 1e3
    p.memcpy, p.host_mem, p.duplex = g("pcie.memcpy_us"), g("pcie.host_mem_gbps") * 1e3, bool(g("pcie.duplex"))
    p.c_alpha, p.c_peer = g("collective.alpha_us"), g("collective.per_peer_us")
    p.c_sync = g("collective.sync_us")
    p.c_intra, p.c_nic_eff = g("collective.intra_gbps") * 1e3, g("collective.nic_efficiency")
    p.c_host_alpha, p.c_host_chunk = g("collective.host_alpha_us"), g("collective.host_chunk_kb") * 1024.0
    p.has_nic = preset.has("nic")
    if p.has_nic:
        p.nic_bw, p.qp_bw = g("nic.gbps") * 1e3, g("nic.qp_gbps") * 1e3
        p.msg_o, p.sig_o = g("nic.msg_overhead_us"), g("nic.signal_overhead_us")
        p.rtt, p.tail, p.shared_qps = g("nic.rtt_us"), g("nic.tail_us"), int(g("nic.shared_qps"))
    p.has_proxy = preset.has("proxy")
    if p.has_proxy:
        p.put_us, p.sig_us, p.flag_us = g("proxy.put_us"), g("proxy.signal_us"), g("proxy.fence_flag_us")
        p.fence_us, p.fence_pe_us, p.poll_us = g("proxy.fence_us"), g("proxy.fence_per_pe_us"), g("proxy.poll_us")
        p.fence_quiet, p.proxy_intra = g("proxy.fence_quiet"), bool(g("proxy.serves_intra_node"))
    p.has_ibgda = preset.has("ibgda")
    if p.has_ibgda:
        p.post_sm_us, p.wqe_fetch_us = g("ibgda.post_sm_us"), g("ibgda.wqe_fetch_us")
    if len(_PCACHE) > 256:  # calibration builds many short-lived presets
        _PCACHE.clear()
    _PCACHE[id(preset)] = (preset, p)
    return p


def as_preset(preset: Preset | str) -> Preset:
    return preset if isinstance(preset, Preset) else load_preset(preset)


def check_transport(preset: Preset, knobs: Knobs) -> None:
    if knobs.transport not in preset.transports:
        raise KnobError(
            f"transport {knobs.transport!r} is not available on preset {preset.name!r} "
            f"(available: {', '.join(preset.transports)})",
            ("transport",),
        )


def check_queued(preset: Preset, p: Params, knobs: Knobs) -> None:
    """A queued transport needs its poster: a preset may list it without the [proxy]/[ibgda] section."""
    if knobs.transport == "proxy" and not p.has_proxy:
        raise KnobError(f"preset {preset.name!r} has no CPU proxy", ("transport",))
    if knobs.transport == "ibgda" and not p.has_ibgda:
        raise KnobError(f"preset {preset.name!r} has no IBGDA", ("transport",))


def group_problem(p: Params, transport: str, pes: int, nodes: int) -> str | None:
    """Why the modelled `transport` cannot serve an EP group of `pes` ranks on `nodes` hosts (None when it can): nvlink
    as the runtime's one-sided rule says (`one_sided_world_problem`: at most MAX_WORLD ranks, one node), and a proxy
    that serves the node's own peers (proxy.serves_intra_node: the runtime's proxy transport) at most MAX_WORLD ranks;
    a NIC preset's proxy across nodes (the Perseus model) and the other transports have no such bound. The model's one
    statement of the bound: the phases raise it for a trial, the tune asks it before its first study
    (`ModelBackend.group_problem`), so a study never runs trials that can only fail on it."""
    if transport == "nvlink":
        return one_sided_world_problem("nvlink", pes, nodes=nodes)
    if transport == "proxy" and p.has_proxy and p.proxy_intra:
        return one_sided_world_problem("proxy", pes)  # its ranks on other nodes go over the NIC: only the count bounds
    return None
