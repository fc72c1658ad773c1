"""The queued-transport mechanism of the fabric model (CPU proxy or IBGDA posting to RC queue pairs).

One source PE's requests are replayed in FIFO order, destination by destination:

* a request is posted by the proxy thread (one at a time, `put_us`/`signal_us` each) or, for IBGDA, by
  the GPU CTA that owns the transfer (`post_sm_us` of SM time each);
* each QP is an in-order pipeline: a message occupies it for a per-message overhead plus bytes /
  per-QP bandwidth; all QPs share the NIC link (work-conserving, served in post order);
* a message is complete (acked) one round trip after it left the wire; each destination has its own
  round trip (median + a seeded exponential-tail quantile);
* `drain` fence: the proxy stops until every earlier request completed (if the transport's fence is a
  quiet), then walks every PE once; `nic` fence: the next signal carries the NIC fence flag and the QP
  holds it until the QP's earlier requests completed; `off`: no ordering (a counterfactual);
* signals are 8-byte messages, one per transfer.

Long runs of identical tiles in coupled mode (PUT, FENCE, SIGNAL per tile) reach a periodic regime
after a couple of tiles; the rest of the run is advanced by whole periods (exact for that regime),
which keeps one prediction within milliseconds even at 64K tokens per GPU.
"""

from __future__ import annotations

SIGNAL_BYTES = 8.0
# Advance long periodic runs by whole periods (False: replay every tile; tests compare the two).
EXTRAPOLATE = True

# (rtt_us, [(bytes_per_tile, tiles, messages_per_tile, ready_first_us, ready_step_us), ...])
Run = tuple[float, int, int, float, float]
Dest = tuple[float, list[Run]]


class QueueSim:
    __slots__ = (
        "cta", "fence_busy", "fence_pe", "fence_us", "fence_wait", "fences", "flag_us", "half", "issue_busy",
        "last_arrive", "lbw", "link", "max_ack", "messages", "ncta", "nic_stalls", "nic_wait", "npes", "o",
        "proxy", "proxy_stalls", "put_c", "qbw", "qp_ack", "qp_free", "quiet", "rtt", "shared", "sig_c",
        "signals", "so", "t", "t0", "transfers", "wire_us",
    )

    def __init__(self, p, kind: str, *, npes: int, qps: int, num_sms: int, t0: float = 0.0) -> None:
        self.proxy = kind == "proxy"
        self.lbw, self.qbw = p.nic_bw, p.qp_bw
        extra = 0.0 if self.proxy else p.wqe_fetch_us
        self.o, self.so = p.msg_o + extra, p.sig_o + extra
        self.shared = p.shared_qps
        if self.proxy:
            self.put_c, self.sig_c, self.flag_us = p.put_us, p.sig_us, p.flag_us
            self.fence_us, self.fence_pe = p.fence_us, p.fence_pe_us
            fq = p.fence_quiet
            self.quiet = fq == "always" or (fq == "multi_qp" and (qps > 1 or self.shared > 1))
            self.t = t0 + p.poll_us
        else:
            self.put_c = self.sig_c = p.post_sm_us
            self.flag_us = self.fence_us = self.fence_pe = 0.0
            self.quiet = False
            self.t = t0
        self.npes = npes
        self.t0 = t0
        self.ncta = max(1, num_sms)
        self.cta = [t0] * self.ncta
        self.qp_free: dict[int, float] = {}
        self.qp_ack: dict[int, float] = {}
        self.link = self.max_ack = self.last_arrive = t0
        self.rtt = self.half = 0.0
        self.fences = self.proxy_stalls = self.nic_stalls = self.messages = self.signals = self.transfers = 0
        self.fence_wait = self.fence_busy = self.nic_wait = self.issue_busy = self.wire_us = 0.0

    # -- primitive requests ----------------------------------------------------------------------
    def qp(self, q: int) -> int:
        return q % self.shared if self.shared else q

    def put(self, q: int, b: float, n: int, m: int, r0: float, rstep: float, ci: int, track_arrival: bool) -> float:
        """Post n tiles (each m messages of b/m bytes) on QP q; returns the time the last was posted."""
        c = self.put_c
        clock = self.t if self.proxy else self.cta[ci]
        start = clock if clock > r0 else r0
        post_first = start + c
        end = start + n * m * c
        last_ready = r0 + (n - 1) * rstep + m * c
        if last_ready > end:
            end = last_ready
        if self.proxy:
            self.t = end
        else:
            self.cta[ci] = end
        self.issue_busy += n * m * c
        f = self.qp_free.get(q, self.t0)
        s = post_first if post_first > f else f
        done = s + n * m * self.o + n * b / self.qbw
        tail_piece = end + self.o + (b / m) / self.qbw
        if tail_piece > done:
            done = tail_piece
        w = n * b / self.lbw
        self.wire_us += w
        link = (self.link if self.link > post_first else post_first) + w
        self.link = link
        wire = link if link > done else done
        self.qp_free[q] = done
        ack = wire + self.rtt
        if ack > self.qp_ack.get(q, self.t0):
            self.qp_ack[q] = ack
        if ack > self.max_ack:
            self.max_ack = ack
        if track_arrival and wire + self.half > self.last_arrive:
            self.last_arrive = wire + self.half
        self.messages += n * m
        self.transfers += n
        return end

    def fence(self, mode: str) -> bool:
        """Returns True when the next signal must carry the NIC fence flag."""
        if mode == "drain":
            self.fences += 1
            c0 = self.t
            t = c0 + self.fence_us
            if self.quiet:
                self.proxy_stalls += 1
                if self.max_ack > t:
                    self.fence_wait += self.max_ack - t
                    t = self.max_ack
            t += self.npes * self.fence_pe
            self.t = t
            self.fence_busy += t - c0
            return False
        if mode == "nic":
            self.fences += 1
            if self.proxy:
                self.t += self.flag_us
                self.fence_busy += self.flag_us
            return True
        return False

    def signal(self, q: int, n: int, flagged: bool, after: float, ci: int) -> None:
        """n signals on QP q (the first one flagged when `flagged`), posted after time `after`."""
        c = self.sig_c
        if self.proxy:
            post_first = self.t + c
            self.t += n * c
            end = self.t
        else:
            clock = self.cta[ci]
            if after > clock:
                clock = after
            post_first = clock + c
            end = clock + n * c
            self.cta[ci] = end
        self.issue_busy += n * c
        f = self.qp_free.get(q, self.t0)
        s = post_first if post_first > f else f
        if flagged:
            self.nic_stalls += 1
            a = self.qp_ack.get(q, self.t0)
            if a > s:
                self.nic_wait += a - s
                s = a
        done = s + n * self.so
        if end + self.so > done:
            done = end + self.so
        w = n * SIGNAL_BYTES / self.lbw
        link = (self.link if self.link > post_first else post_first) + w
        self.link = link
        wire = link if link > done else done
        self.qp_free[q] = done
        ack = wire + self.rtt
        if ack > self.qp_ack.get(q, self.t0):
            self.qp_ack[q] = ack
        if ack > self.max_ack:
            self.max_ack = ack
        if wire + self.half > self.last_arrive:
            self.last_arrive = wire + self.half
        self.signals += n

    # -- periodic-regime extrapolation -----------------------------------------------------------
    _TIME = ("t", "link", "max_ack", "last_arrive")
    _ACC = ("fence_wait", "fence_busy", "nic_wait", "issue_busy", "wire_us",
            "fences", "proxy_stalls", "nic_stalls", "messages", "signals", "transfers")

    def snapshot(self, qs: tuple[int, ...], ci: int) -> tuple:
        return (
            tuple(getattr(self, k) for k in self._TIME),
            tuple(getattr(self, k) for k in self._ACC),
            tuple(self.qp_free.get(q, self.t0) for q in qs),
            tuple(self.qp_ack.get(q, self.t0) for q in qs),
            self.cta[ci],
        )

    def advance(self, qs: tuple[int, ...], ci: int, s0: tuple, s1: tuple, reps: int) -> None:
        for k, a, b in zip(self._TIME, s0[0], s1[0], strict=True):
            setattr(self, k, b + reps * (b - a))
        for k, a, b in zip(self._ACC, s0[1], s1[1], strict=True):
            setattr(self, k, b + reps * (b - a))
        for q, a, b in zip(qs, s0[2], s1[2], strict=True):
            self.qp_free[q] = b + reps * (b - a)
        top = s1[0][2]
        for q, a, b in zip(qs, s0[3], s1[3], strict=True):
            v = b + reps * (b - a)
            self.qp_ack[q] = v
            top = max(top, v)
        self.max_ack = max(self.max_ack, top)
        self.last_arrive = max(self.last_arrive, top - self.half)
        self.cta[ci] = s1[4] + reps * (s1[4] - s0[4])


def run_queue(
    p,
    kind: str,
    dests: list[Dest],
    *,
    npes: int,
    signalling: str,
    group: int,
    fence: str,
    qp_mapping: str,
    qps: int,
    num_sms: int,
    t0: float = 0.0,
) -> QueueSim:
    """Replay one PE's requests (see the module docstring); returns the final simulator state."""
    sim = QueueSim(p, kind, npes=npes, qps=qps, num_sms=num_sms, t0=t0)
    put_only = signalling == "none"
    cidx = 0
    for d, (rtt, runs) in enumerate(dests):
        sim.rtt, sim.half = rtt, 0.5 * rtt
        ntiles = sum(r[1] for r in runs)
        if ntiles == 0:
            continue
        base = d * qps
        rr = 0
        if signalling == "coupled":
            gi = 0
            period = qps  # peer_hash rotates tiles over the peer's QPs; round_robin too (2 requests/tile)
            qs = tuple(sorted({sim.qp(base + j) for j in range(qps)}))
            for b, n, m, r0, rstep in runs:
                ci = cidx % sim.ncta
                cidx += 1
                k = 0
                done_extra = False
                while k < n:
                    if EXTRAPOLATE and not done_extra and k >= period and n - k >= 3 * period:
                        done_extra = True
                        s0 = sim.snapshot(qs, ci)
                        for _ in range(period):
                            rr = _coupled_tile(sim, base, qps, qp_mapping, gi, rr, b, m, r0 + k * rstep, ci, fence)
                            k += 1
                            gi += 1
                        s1 = sim.snapshot(qs, ci)
                        reps = (n - k) // period
                        sim.advance(qs, ci, s0, s1, reps)
                        k += reps * period
                        gi += reps * period
                        rr += reps * 2 * period
                        continue
                    rr = _coupled_tile(sim, base, qps, qp_mapping, gi, rr, b, m, r0 + k * rstep, ci, fence)
                    k += 1
                    gi += 1
            continue
        # decoupled (or put only): groups of `gs` tiles, a group's PUTs, one fence, its signals
        gs = ntiles if (group == 0 or put_only) else group
        pending = [[b, n, m, r0, rstep, 0] for b, n, m, r0, rstep in runs]
        for item in pending:
            item[5] = cidx % sim.ncta  # one CTA owns one transfer (IBGDA posts from it)
            cidx += 1
        gi = 0
        ri = 0
        hashed = qp_mapping == "peer_hash" or qps == 1
        period = qps
        qs = tuple(sorted({sim.qp(base + j) for j in range(qps)}))
        extrapolated: set[int] = set()
        while ri < len(pending):
            b, n, m, r0, rstep, ci = pending[ri]
            if (EXTRAPOLATE and hashed and not put_only and ri not in extrapolated and gs < n
                    and n >= gs * 4 * period):
                # whole groups inside one long run of identical tiles: warm up one period, measure
                # one period, advance by whole periods
                extrapolated.add(ri)
                for _ in range(period):
                    _group_from_run(sim, pending[ri], gs, base + (gi % qps), fence)
                    gi += 1
                s0 = sim.snapshot(qs, ci)
                for _ in range(period):
                    _group_from_run(sim, pending[ri], gs, base + (gi % qps), fence)
                    gi += 1
                s1 = sim.snapshot(qs, ci)
                reps = (pending[ri][1] // gs) // period - 1
                if reps > 0:
                    sim.advance(qs, ci, s0, s1, reps)
                    pending[ri][1] -= reps * period * gs
                    pending[ri][3] += reps * period * gs * rstep
                    gi += reps * period
                if pending[ri][1] == 0:
                    ri += 1
                continue
            need = gs
            q_grp = base + (gi % qps)
            last_post = t0
            while need > 0 and ri < len(pending):
                b, n, m, r0, rstep, ci = pending[ri]
                take = n if n <= need else need
                if hashed:
                    last_post = max(last_post, sim.put(sim.qp(q_grp), b, take, m, r0, rstep, ci, put_only))
                else:
                    for j in range(min(qps, take)):
                        cnt = take // qps + (1 if j < take % qps else 0)
                        q = sim.qp(base + ((rr + j) % qps))
                        last_post = max(last_post, sim.put(q, b, cnt, m, r0 + j * rstep, rstep * qps, ci, put_only))
                    rr += take
                need -= take
                if take == n:
                    ri += 1
                else:
                    pending[ri][1] = n - take
                    pending[ri][3] = r0 + take * rstep
            gi += 1
            if put_only:
                continue
            sig_n = gs - need
            flagged = sim.fence(fence)
            if hashed:
                sim.signal(sim.qp(q_grp), sig_n, flagged, last_post, ci)
            else:
                for j in range(min(qps, sig_n)):
                    cnt = sig_n // qps + (1 if j < sig_n % qps else 0)
                    sim.signal(sim.qp(base + ((rr + j) % qps)), cnt, flagged and j == 0, last_post, ci)
                rr += sig_n
    return sim


def _group_from_run(sim: QueueSim, item: list, gs: int, q: int, fence: str) -> None:
    """One decoupled group of gs tiles taken from the front of a run (peer-hashed QP q)."""
    b, n, m, r0, rstep, ci = item
    q = sim.qp(q)
    post = sim.put(q, b, gs, m, r0, rstep, ci, False)
    item[1] = n - gs
    item[3] = r0 + gs * rstep
    flagged = sim.fence(fence)
    sim.signal(q, gs, flagged, post, ci)


def _coupled_tile(sim: QueueSim, base: int, qps: int, qp_mapping: str, gi: int, rr: int, b: float, m: int,
                  r: float, ci: int, fence: str) -> int:
    """PUT, FENCE, SIGNAL for one tile. Returns the updated round-robin counter."""
    if qp_mapping == "peer_hash" or qps == 1:
        q_put = q_sig = sim.qp(base + (gi % qps))
    else:
        q_put = sim.qp(base + (rr % qps))
        q_sig = sim.qp(base + ((rr + 1) % qps))
        rr += 2
    post = sim.put(q_put, b, 1, m, r, 0.0, ci, False)
    flagged = sim.fence(fence)
    sim.signal(q_sig, 1, flagged, post, ci)
    return rr
