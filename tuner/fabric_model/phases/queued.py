"""The queued transports' phase (proxy, IBGDA): one PE's requests, count words first, in FIFO order."""

from __future__ import annotations

import math

from moetune.runtime.knobs import KnobError, Knobs
from moetune.tuner.fabric_model.params import Params, group_problem
from moetune.tuner.fabric_model.phases.nvlink import nvlink_time
from moetune.tuner.fabric_model.phases.phase import Phase, reduce_us
from moetune.tuner.fabric_model.queue import run_queue
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.routing import spread_quantiles
from moetune.tuner.fabric_model.wire_rows import (
    SIGNAL_BYTES,
    any_row_probability,
    chunking,
    expected_puts,
    token_bytes,
)

MAX_MESSAGES = 2_000_000  # guard against absurd chunking


def round_trips(p: Params, n: int) -> list[float]:
    q = spread_quantiles(n)
    return [p.rtt + p.tail * x for x in q]


def _signals_per_peer(knobs: Knobs, puts: int) -> int:
    """Signals (= fences) the runtime's proxy posts for `puts` PUTs to one peer: coupled one per PUT;
    decoupled one per group of group_size PUTs, a last partial group included (0: one per peer)."""
    if puts <= 0:
        return 0
    if knobs.signalling == "coupled":
        return puts
    g = knobs.group_size if knobs.group_size > 0 else puts
    return -(-puts // g)


def _rows_on_peers_with_rows(rows_to: dict[int, float], peers: list[int], p_row: dict[int, float],
                             tokens: int) -> dict[int, float]:
    """`rows_to` (the expected rows of each peer) for `peers`, put on the peers that get any row. The runtime sends a
    peer that gets none its count words only (csrc/proxy_xchg.h produce_exchange: chunking(0) is no PUT, no signal),
    and at decode sizes most peers get none: `tokens` tokens each needing peer d with probability p_row[d] give it a
    row with probability 1 - (1 - p)^tokens. PUTs go to the expected number of such peers, rounded (at least one
    where any row is expected), those with the most rows (post order among equals), which carry all the expected
    rows; the other peers get 0 (no PUT). With every peer likely to get rows nothing changes."""
    total = sum(rows_to[d] for d in peers)
    if total <= 0:
        return {d: rows_to[d] for d in peers}
    # the same P(X >= 1) as expected_puts' chunk_tokens 0, so _puts_on_peers charges these peers one PUT each there
    expected = sum(any_row_probability(p_row[d], tokens) for d in peers)
    n = min(len(peers), max(1, math.floor(expected + 0.5)))
    if n == len(peers):
        return {d: rows_to[d] for d in peers}
    chosen = sorted(peers, key=lambda d: -rows_to[d])[:n]  # stable: post order among equals
    scale = total / sum(rows_to[d] for d in chosen)
    return {d: (rows_to[d] * scale if d in chosen else 0.0) for d in peers}


def _puts_on_peers(rows_to: dict[int, float], peers: list[int], p_row: dict[int, float], tokens: int,
                   ck: int) -> dict[int, int]:
    """The PUTs each of `peers` is charged: the engine's expected count for the set (the sum over its peers of
    `expected_puts`: E[ceil(X / chunk_tokens)], X ~ Binomial(tokens, p_row[d])), rounded, on the peers that carry
    rows (`rows_to` > 0: `_rows_on_peers_with_rows`), at least one each, shared out by their own expectation (largest
    remainder, post order among equals). Chunking the rows piled on those peers rounded up instead: qwen3-30b on
    2 x 8 GPUs at S=2, chunk_tokens 1 had 10 remote PUTs for 6.6 rows (the engine's expectation: 6.6)."""
    out = {d: 0 for d in peers}
    getting = [d for d in peers if rows_to[d] > 0]
    if not getting:
        return out
    want = {d: expected_puts(p_row[d], tokens, ck) for d in peers}
    total = max(len(getting), math.floor(sum(want.values()) + 0.5))
    weight = sum(want[d] for d in getting)
    quota = {d: total * want[d] / weight if weight > 0 else total / len(getting) for d in getting}
    got = {d: max(1, math.floor(quota[d])) for d in getting}
    by_remainder = sorted(getting, key=lambda d: -(quota[d] - math.floor(quota[d])))  # stable: post order
    i = 0
    while sum(got.values()) < total:
        got[by_remainder[i % len(getting)]] += 1
        i += 1
    while sum(got.values()) > total:  # the at-least-one took more than the quotas: back from the most over quota
        d = max((d for d in getting if got[d] > 1), key=lambda d: got[d] - quota[d])
        got[d] -= 1
    out.update(got)
    return out


def charged_puts(peers: list[int], p_row: dict[int, float], tokens: int,
                 ck: int) -> tuple[dict[int, float], dict[int, int]]:
    """(rows, PUTs) the model charges each of one set of `peers` (the queue's, or the NVLink ones) of a PE whose
    `tokens` tokens each need peer d with probability p_row[d]: the expected rows put on the peers that get any
    (`_rows_on_peers_with_rows`), the expected PUTs shared out over them (`_puts_on_peers`). The one statement of
    the charge: `phase_queued` prices it, the `model sweep` grid and the search space bound group sizes by its
    largest share."""
    rows = _rows_on_peers_with_rows({d: tokens * p_row[d] for d in peers}, peers, p_row, tokens)
    return rows, _puts_on_peers(rows, peers, p_row, tokens, ck)


def _sender(hits, pes: int, dispatch: bool) -> tuple[int, dict[int, float]]:
    """(the PE the runtime layout models, P(a token of it needs peer d) for every other PE): dispatch, PE 0 sending
    its tokens; combine, the most needed PE returning the rows every token owner sent it."""
    src = 0 if dispatch else int(hits.argmax())
    return src, {d: float(hits[d] if dispatch else hits[src]) for d in range(pes) if d != src}


def charged_own_puts(hits, src: int, tokens: int, chunk_tokens: int) -> tuple[float, int]:
    """(rows, PUTs) the model charges the rows PE `src` sends itself: csrc/proxy_xchg.h produce_exchange loops over
    every rank, this one included, so its X ~ Binomial(tokens, hits[src]) rows are chunking(X) PUTs with their
    signals grouped by group_size like a peer's (`charged_puts` of a set of one)."""
    rows, puts = charged_puts([src], {src: float(hits[src])}, tokens, chunk_tokens)
    return rows[src], puts[src]


def puts_charged_each_peer(hits, pes: int, gpus_per_node: int, nvlink_apart: bool, tokens: int,
                           chunk_tokens: int, *, own: bool = True) -> tuple[int, ...]:
    """The PUTs the runtime layout charges each peer, dispatch's peers then combine's, each the queue's peers (post
    order) then the NVLink ones (`charged_puts` of each set, as `phase_queued` prices them), then (`own`) the PUTs the
    PE sends itself (`charged_own_puts`: a PUT group of its own, which group_size groups as a peer's): `hits` P(a
    token needs rank r), `nvlink_apart` whether this node's peers are a set of their own (`nvlink_apart`). The one
    rule the `model sweep` grid (`most_puts_to_a_peer`) and the search space's chunk and group grids ask: two
    chunk_tokens with the same tuple are charged the same PUTs on every peer and to itself. `own=False`: the peers'
    only (what the grid asked before the own PUTs counted: `SearchSpace.grid_rule` compares the two)."""
    out: list[int] = []
    for dispatch in (True, False):
        src, p_row = _sender(hits, pes, dispatch)
        for peers in split_peers(pes, gpus_per_node, src, nvlink_apart):
            puts = charged_puts(peers, p_row, tokens, chunk_tokens)[1]
            out += [puts[d] for d in peers]
        if own and pes > 1:  # EP 1: no exchange kernel, nothing is grouped
            out.append(charged_own_puts(hits, src, tokens, chunk_tokens)[1])
    return tuple(out)


def most_puts_to_a_peer(p: Params, w: Workload, knobs: Knobs, hits) -> int:
    """The most PUTs the runtime layout charges one destination, over dispatch and combine, both sets of peers and
    the PE itself (`puts_charged_each_peer`), 0 for none: what a decoupled group_size groups, a group size at or
    above it is one signal per destination. The own PUTs count (produce_exchange signals them by group_size as a
    peer's), though as combine is priced they never raise it: there every peer is charged the most needed rank's p,
    at least PE 0's own p in dispatch and equal to the combining PE's own, and a set's largest share is at least
    round(E) of its p."""
    return max(puts_charged_each_peer(hits, w.pes, w.gpus_per_node, nvlink_apart(p, w, knobs), w.tokens_per_gpu,
                                      knobs.chunk_tokens), default=0)


def _rank_runs(rows: float, tb: float, ck: int, ready: float,
               puts: int | None = None) -> list[tuple[float, int, int, float, float]]:
    """One peer's PUTs in the runtime layout: full chunks of `c` rows, then the last (partial) chunk; every
    row packed before the exchange starts (all ready at `ready`). `puts`: the count charged where it is not
    chunking's of `rows` (an expected count, `_puts_on_peers`): that many PUTs of equal size."""
    c, n = chunking(rows, ck)
    if puts is not None and puts != n:
        return [(rows / puts * tb, puts, 1, ready, 0.0)] if puts > 0 and rows > 0 else []
    if n == 0:
        return []
    if n == 1:
        return [(rows * tb, 1, 1, ready, 0.0)]
    return [(c * tb, n - 1, 1, ready, 0.0), ((rows - (n - 1) * c) * tb, 1, 1, ready, 0.0)]


def _queued_peers(p: Params, w: Workload, knobs: Knobs, src: int) -> tuple[list[int], list[int], bool]:
    """(peers reached through the queue in post order, peers reached over NVLink, NVLink used) of PE `src`."""
    remote, local, nvl_intra = _peer_sets(p, w, knobs, src)
    if remote and not p.has_nic and not _intra_by_proxy(p, knobs):
        raise ValueError(f"preset {p.name!r} has no network: it cannot reach PEs on other nodes")
    return remote, local, nvl_intra


def _intra_by_proxy(p: Params, knobs: Knobs) -> bool:
    # has_proxy first: a preset without a proxy section has no proxy_intra (the grid asks before predict refuses it)
    return knobs.transport == "proxy" and p.has_proxy and p.proxy_intra


def nvlink_apart(p: Params, w: Workload, knobs: Knobs) -> bool:
    """Whether a PE reaches this node's peers over NVLink, a set apart from the queue's (not where the proxy serves
    them too, nor without NVLink / P2P)."""
    return p.has_nvl and w.p2p and not _intra_by_proxy(p, knobs)


def split_peers(pes: int, gpus_per_node: int, src: int, nvl_intra: bool) -> tuple[list[int], list[int]]:
    """(the peers PE `src` reaches through the queue in post order, those it reaches over NVLink): with `nvl_intra`
    this node's peers are the NVLink set, else the queue serves them too (first)."""
    G = max(1, gpus_per_node)
    node = src // G
    remote = [d for d in range(pes) if d // G != node]
    rot = (node * G) % max(1, len(remote))
    remote = remote[rot:] + remote[:rot]
    local = [d for d in range(node * G, node * G + G) if d != src and d < pes]
    if not nvl_intra:
        # the proxy serves this node's peers too, or there is no NVLink / P2P: they go through the queue
        return local + remote, []
    return remote, local


def _peer_sets(p: Params, w: Workload, knobs: Knobs, src: int) -> tuple[list[int], list[int], bool]:
    """`_queued_peers` where the preset may not reach them (no network): the grid's sets, for a run predict refuses."""
    nvl_intra = nvlink_apart(p, w, knobs)
    return (*split_peers(w.pes, w.gpus_per_node, src, nvl_intra), nvl_intra)


class _CountWords:
    """The count words of the runtime's one-sided exchange (csrc/proxy_xchg.h), for source PE `src` of
    `world`: every rank's poster first writes its count-matrix row (world 8-byte words) to every rank, in
    rank order (the proxy thread: rank q's words are its pushes q*world+1 .. q*world+world); the PUTs to rank
    d wait for d's first word to this PE (d >= src: d has entered the call) and for column d of every lower
    rank's row (the destination offset). exchange_counts (dispatch only) posts one word per rank and waits
    for every rank's. A word is posted like a signal (proxy: signal_us each, one thread; IBGDA: post_sm_us
    each, rank q's words from CTA q mod num_sms) and lands after the signal message overhead plus half the
    peer's round trip (NVLink peers: the NVLink latency; this PE: at once)."""

    def __init__(self, p: Params, kind: str, src: int, world: int, remote: list[int], local: list[int],
                 rtts: list[float], ncta: int) -> None:
        self.p, self.src, self.world = p, src, world
        self.proxy = kind == "proxy"
        self.ncta = max(1, ncta)
        self.issue_each = p.sig_us if self.proxy else p.post_sm_us
        self.poll = p.poll_us if self.proxy else 0.0
        over = (p.sig_o + (0.0 if self.proxy else p.wqe_fetch_us)) if p.has_nic else 0.0
        self.one_way = {d: over + 0.5 * rtts[i] for i, d in enumerate(remote)}
        for d in local:
            self.one_way[d] = p.nvl_lat
        self.one_way[src] = 0.0

    def _pos(self, q: int, col: int, per_rank: int) -> int:
        """Place (1-based) of the word for rank q, column col in its poster's sequence."""
        if self.proxy:
            return q * per_rank + col + 1
        return (q // self.ncta) * per_rank + col + 1

    def counts_kernel(self, launch: bool = True) -> float:
        """exchange_counts: launch (`launch=False`: the kernel is queued behind the pack kernel, whose launch
        the host has already paid), then the later of this PE's `world` words posted and the last peer's word
        here (each peer's word for this PE) landed."""
        start = self.p.launch if launch else 0.0
        if self.world < 2:
            return start
        last = max(v for d, v in self.one_way.items() if d != self.src)
        c = self.issue_each
        own = self.world if self.proxy else -(-self.world // self.ncta)
        return start + self.poll + max(own * c, self._pos(self.src, 0, 1) * c + last)

    def gate(self, x_start: float, d: int) -> float:
        """When the PUTs to rank d may be posted: the words they wait for have landed."""
        c, r, w = self.issue_each, self.src, self.world
        t = x_start
        if d >= r:
            t = max(t, x_start + self.poll + self._pos(r, 0, w) * c + self.one_way.get(d, 0.0))
        for s in range(r):
            t = max(t, x_start + self.poll + self._pos(r, d, w) * c + self.one_way.get(s, 0.0))
        return t

    @property
    def matrix_issue(self) -> float:
        """This PE's poster time for its count-matrix row to every rank (world x world words)."""
        n = self.world * self.world if self.proxy else -(-self.world // self.ncta) * self.world
        return n * self.issue_each


def phase_queued(p: Params, w: Workload, knobs: Knobs, *, dispatch: bool, loads, hits, t0: float,
                 layout: str = "runtime") -> Phase:
    """Dispatch (source PE 0 sends every other PE its rows) or combine (the most needed PE returns one row
    per row it received to every token owner) over proxy/IBGDA + NVLink inside the node.

    layout `runtime` (default): what runtime/transports/proxy.py + csrc/proxy_xchg.h send (module docstring):
    one pack kernel writes every peer's rows (dispatch; combine sends the expert output as it is), then per
    peer ceil(rows / chunk_tokens) PUTs (one with chunk_tokens 0, at most MAX_SLOTS), signals by
    `_signals_per_peer`; a peer that gets no row only its count words (`_rows_on_peers_with_rows`), and the PUTs
    are the engine's expected count over the rows a peer may get (`_puts_on_peers`). IBGDA
    posts the same requests from GPU CTAs. `expert_tiles`: one bare copy per (token, expert) in tiles of
    `tile` tokens per expert, each tile a PUT with its own signal (see `predict`)."""
    ph = Phase()
    S, P, G = w.tokens_per_gpu, w.pes, w.gpus_per_node
    kind = knobs.transport
    # a proxy serving the node's own peers is the runtime's proxy transport, whose check_world refuses more than
    # MAX_WORLD ranks as it refuses nvlink; a NIC preset's proxy across nodes is the Perseus model, not it
    why = group_problem(p, kind, P, w.nodes)
    if why:
        raise KnobError(why, ("transport",))
    tiles = layout == "expert_tiles"
    host_waits = kind == "proxy" and not tiles  # the runtime's proxy transport: host-completed calls
    tb = token_bytes(w.model, knobs, dispatch=dispatch, layout=layout)
    ck = knobs.chunk_tokens
    if tiles:
        row_sums = loads.sum(axis=1)
        src = 0 if dispatch else int(row_sums.argmax())
    else:
        src = _sender(hits, P, dispatch)[0]
    remote_pes, local_pes, nvl_intra = _queued_peers(p, w, knobs, src)
    dests = []
    rtts = round_trips(p, len(remote_pes)) if remote_pes else []
    nmsg = 0
    total_bytes = 0.0
    local_bytes = [0.0] * len(local_pes)
    local_groups = 0
    if tiles:
        # one transfer per (source PE, remote expert), split into tiles of `tile` tokens (each tile is one PUT
        # with its own signal, as tile-based EP kernels send them); chunk_tokens splits a tile into NIC messages
        if dispatch:
            per_dest = {d: [S * float(x) * tb for x in loads[d]] for d in range(1, P)}
        else:
            mine = [S * float(x) * tb for x in loads[src]]
            per_dest = {d: mine for d in range(P) if d != src}
        pack_bw = min(max(1, knobs.num_sms) * p.sm_copy, p.hbm / 2.0)
        acc = t0 + p.launch
        for i, d in enumerate(remote_pes):
            runs = []
            for b in per_dest[d]:
                tk = b / tb
                n = max(1, math.ceil(tk / w.tile - 1e-9))
                tile_b = b / n
                m = max(1, math.ceil(tk / n / ck - 1e-9)) if ck else 1
                step = tile_b / pack_bw
                runs.append((tile_b, n, m, acc + step, step))
                acc += b / pack_bw
                nmsg += n * m
                total_bytes += b
            dests.append((rtts[i], runs))
        epp = loads.shape[1]
        local_bytes = [sum(per_dest[d]) for d in local_pes]
        local_groups = len(local_pes) * (epp if knobs.signalling == "coupled" else
                                         max(1, epp // (knobs.group_size or epp)))
        # receiver ingress: the most loaded receiver takes bytes from every other PE
        per_sender = float(row_sums.max() if dispatch else row_sums.mean()) * S * tb
        ready = t0
    else:
        # P(a token of the sender needs the receiver): dispatch, this PE's token needs d; combine, d's token needed src
        p_row = _sender(hits, P, dispatch)[1]
        # a peer that gets no row is sent count words only: the rows (and PUTs) go to the peers that get any, per set
        # (the queue's peers, the NVLink peers: each keeps its own bytes), and the PUTs the engine makes on average,
        # not the piled rows' chunks rounded up (per set too)
        rows_to: dict[int, float] = {}
        puts_to: dict[int, int] = {}
        for peers in (remote_pes, local_pes):
            rows, puts = charged_puts(peers, p_row, S, ck)
            rows_to.update(rows)
            puts_to.update(puts)
        # dispatch: one pack kernel (csrc/ep_pack.cu rows: a grid over every SM, each byte read and written)
        # writes the rows for every rank, this one's own included, before the exchange kernel starts
        pack = S * float(hits.sum()) * tb / (p.hbm / 2.0) + p.launch if dispatch else 0.0
        if pack:
            ph.parts["pack"] = pack
        cw = _CountWords(p, kind, src, P, remote_pes, local_pes, rtts, knobs.num_sms)
        # dispatch: exchange_counts (runtime/buffer/_resident.py) is its own kernel before the exchange kernel;
        # combine's exchange is given the counts, but still posts its count-matrix row. The proxy's calls are
        # host-completed (csrc/proxy_gpu.cu host_wait_done, option proxy_host_wait, on by default): the counts
        # kernel is launched right behind the pack kernels (its launch hidden by theirs), then the host spins
        # on the kernel's completion word before it launches the exchange kernel (whose launch is exposed).
        # IBGDA has no runtime transport and no host wait: its two launches stay as they were.
        counts = cw.counts_kernel(launch=not (host_waits and pack)) if dispatch else 0.0
        if counts:
            ph.parts["counts"] = counts
        wait_counts = p.poll_us if host_waits and dispatch else 0.0
        if wait_counts:
            ph.parts["host_wait_counts"] = wait_counts
        x_start = t0 + pack + counts + wait_counts + p.launch
        ready = x_start
        gates = {d: cw.gate(x_start, d) for d in remote_pes + local_pes}
        for i, d in enumerate(remote_pes):
            runs = _rank_runs(rows_to[d], tb, ck, gates[d], puts_to[d])
            nmsg += sum(r[1] for r in runs)
            total_bytes += rows_to[d] * tb
            dests.append((rtts[i], runs))
        for j, d in enumerate(local_pes):
            local_bytes[j] = rows_to[d] * tb
            local_groups += _signals_per_peer(knobs, puts_to[d])
        if local_pes:
            ready = max(gates[d] for d in local_pes)
        # the rows this PE sends itself: PUTs through the same poster, a local copy (read + write at HBM speed).
        # csrc/proxy_xchg.h produce_exchange loops over every rank, this one included: its X ~ Binomial(S, p) rows
        # are chunking(X) PUTs like a peer's, so they are charged the same expected count (`charged_puts` of a set
        # of one), not the expected rows rounded up and chunked (S p = 2.06 rows, chunk_tokens 1: 2 PUTs, not 3)
        self_rows, self_puts = charged_own_puts(hits, src, S, ck)
        self_chunks = [b for b, n, *_ in _rank_runs(self_rows, tb, ck, x_start, self_puts) for _ in range(n)]
        if self_chunks:
            ph.parts["self_copy"] = self_rows * tb / (p.hbm / 2.0)
        # count words: the matrix row (world words) to every rank; dispatch adds exchange_counts' row
        ph.bytes += (P - 1) * (P + (1 if dispatch else 0)) * SIGNAL_BYTES
        ph.parts["count_matrix_issue"] = cw.matrix_issue
        # receiver ingress: dispatch, the most needed PE takes its rows from every other PE; combine, a token
        # owner takes back one row per row it sent
        per_sender = S * tb * float(hits.max() if dispatch else hits.mean())
    if nmsg > MAX_MESSAGES:
        raise ValueError(f"chunk_tokens={ck} gives {nmsg} messages per PE; use larger chunks")
    fence = "drain" if knobs.fence_mode == "proxy_drain" else "nic"
    t_net = t0
    if dests or (not tiles and P > 1):
        extra = {} if tiles else dict(
            words=P, local_words=len(local_pes) + 1, self_chunks=self_chunks, self_bw=p.hbm / 2.0, self_ready=x_start)
        r = run_queue(
            p, kind, dests, npes=P, signalling=knobs.signalling, group=knobs.group_size, fence=fence,
            qp_mapping=knobs.qp_mapping, qps=knobs.qps_per_pe, num_sms=knobs.num_sms,
            group_signal=not tiles, t0=t0 if tiles else x_start, **extra,
        )
        t_net = r.last_arrive
        if dests:
            ing = per_sender * (P - (G if nvl_intra else 1))
            data0 = min(gates[d] for d in remote_pes) if not tiles else t0 + p.launch
            ing_t = data0 + ing / p.nic_bw + p.rtt
            t_net = max(t_net, ing_t)
            ph.parts["ingress_bound"] = ing_t - t0
        ph.fences, ph.proxy_stalls, ph.nic_stalls = r.fences, r.proxy_stalls, r.nic_stalls
        ph.parts.update({
            "proxy_issue" if kind == "proxy" else "gpu_post": r.issue_busy,
            "fence_proxy_blocked": r.fence_busy,
            "fence_wait_completion": r.fence_wait,
            "nic_stall_held_sum": r.nic_wait,
            "wire": r.wire_us,
        })
        ph.sm_us = 0.0 if kind == "proxy" else r.issue_busy
        ph.transfers = r.transfers
        ph.bytes += total_bytes + r.signals * SIGNAL_BYTES
    t_nvl = t0
    if local_pes:
        t_nvl = ready + nvlink_time(p, local_bytes, local_groups, knobs.num_sms)
        ph.parts["nvlink"] = t_nvl - t0
        ph.bytes += sum(local_bytes) + (0 if tiles else local_groups * SIGNAL_BYTES)
    # IBGDA: SM time spent posting delays the compute the same SMs would do
    sm_pen = ph.sm_us / p.sms if kind == "ibgda" else 0.0
    ph.parts["sm_contention"] = sm_pen
    ph.us = max(t_net, t_nvl) - t0 + sm_pen
    if not dests and not local_pes:  # EP size 1: the kernel still launches
        ph.us = p.launch
    elif host_waits:
        # the host's wait for the exchange kernel's completion word: what follows (combine's reduce, the
        # caller's next kernel) is launched only after it
        ph.parts["host_wait_exchange"] = p.poll_us
        ph.us += p.poll_us
    if not dispatch and not tiles and (dests or local_pes):
        ph.parts["reduce"] = red = reduce_us(p, w, hits, tb)
        ph.us += red
    return ph
