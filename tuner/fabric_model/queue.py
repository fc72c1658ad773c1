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
* signals are 8-byte messages: coupled, one per transfer; decoupled, one per transfer of the group (the
  tile layout's kernels, as Perseus counts) or, with `group_signal`, one per group (the runtime's proxy:
  csrc/proxy_xchg.h produce_exchange posts one SIGNAL after each group of PUTs);
* the runtime's layout adds, before any data PUT (`words`, `local_words`, `self_chunks`): the count words
  (immediate 8-byte writes, cuStreamWriteValue64 in csrc/proxy_engine.cpp: issued like a signal, one
  small message each on the peer's QP, never fenced), then the PUTs to this PE itself (a local copy at
  `self_bw`, no NIC) with their signals and fences (the engine drains on every signal, a self one too).

Long runs of identical tiles (or groups) reach a periodic regime: once two consecutive periods move
the state by the same amounts, the run jumps ahead by whole periods and the next period is checked to
move the state the same way (else the jump is undone and retried shorter). This keeps one prediction
within milliseconds even at 64K tokens per GPU; tests compare it with a full replay.
"""

from __future__ import annotations

import operator
from math import isclose as _isclose

SIGNAL_BYTES = 8.0
# Advance long periodic runs by whole periods (False: replay every tile; tests compare the two).
EXTRAPOLATE = True
# How many runs were advanced by whole periods (for tests).
STATS = {"advanced": 0}

# (rtt_us, [(bytes_per_tile, tiles, messages_per_tile, ready_first_us, ready_step_us), ...])
Run = tuple[float, int, int, float, float]
Dest = tuple[float, list[Run]]


class QueueSim:
    __slots__ = (
        "copy_free",
        "cta",
        "fence_busy",
        "fence_pe",
        "fence_us",
        "fence_wait",
        "fences",
        "flag_us",
        "half",
        "issue_busy",
        "last_arrive",
        "lbw",
        "link",
        "max_ack",
        "messages",
        "ncta",
        "nic_stalls",
        "nic_wait",
        "npes",
        "o",
        "proxy",
        "proxy_stalls",
        "put_c",
        "qbw",
        "qp_ack",
        "qp_free",
        "quiet",
        "rtt",
        "shared",
        "sig_c",
        "signals",
        "so",
        "t",
        "t0",
        "transfers",
        "wire_us",
        "words",
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
        self.words = 0
        self.copy_free = t0

    # -- the runtime layout's extra requests (never inside a periodic run) -------------------------
    def write64(self, q: int, n: int, ci: int) -> None:
        """n count words on QP q (a remote peer): posted like signals (sig_c each, a signal_overhead
        message each on the QP), never flagged; counted as words, not signals."""
        self.signal(q, n, False, self.t0, ci)
        self.signals -= n
        self.words += n

    def local_words(self, n: int, ci: int) -> None:
        """n count words to peers the NIC does not carry (this PE, NVLink peers): issue cost only."""
        c = self.sig_c * n
        if self.proxy:
            self.t += c
        else:
            self.cta[ci] += c
        self.issue_busy += c

    def local_put(self, b: float, bw: float, r0: float, ci: int) -> float:
        """One PUT to this PE itself: posted (put_c), then a local copy of b bytes at bw (one copy engine,
        in order); complete when copied (no wire, no round trip). Returns the time it was posted."""
        c = self.put_c
        clock = self.t if self.proxy else self.cta[ci]
        start = (clock if clock > r0 else r0) + c
        if self.proxy:
            self.t = start
        else:
            self.cta[ci] = start
        self.issue_busy += c
        done = (start if start > self.copy_free else self.copy_free) + b / bw
        self.copy_free = done
        if done > self.max_ack:
            self.max_ack = done
        if done > self.last_arrive:
            self.last_arrive = done
        return start

    def local_signal(self, flagged: bool, ci: int) -> None:
        """A signal to this PE itself after its copies (issue cost; nic_ordered: the stream holds it behind
        the copies, one NIC stall counted as for a remote signal)."""
        self.local_words(1, ci)  # the same issue cost as one local word
        if flagged:
            self.nic_stalls += 1

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
        self._on_wire(q, post_first, done, w, track_arrival)
        self.messages += n * m
        self.transfers += n
        return end

    def _on_wire(self, q: int, post_first: float, done: float, w: float, track_arrival: bool) -> None:
        """The link carries w µs from post_first on; QP q is free at `done`, its ack one RTT after the
        later of the two; with track_arrival the receiver sees it half an RTT after."""
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
        self._on_wire(q, post_first, done, n * SIGNAL_BYTES / self.lbw, True)
        self.signals += n

    # -- periodic-regime extrapolation -----------------------------------------------------------
    _TIME = ("t", "link", "max_ack", "last_arrive")
    _ACC = ("fence_wait", "fence_busy", "nic_wait", "issue_busy", "wire_us",
            "fences", "proxy_stalls", "nic_stalls", "messages", "signals", "transfers")

    # one C-level call for the named fields: snapshot runs twice per simulated period (the calibration fit's hot path)
    _get_fields = operator.attrgetter(*_TIME, *_ACC)

    def snapshot(self, qs: tuple[int, ...], ci: int) -> tuple[float, ...]:
        free, ack, t0 = self.qp_free, self.qp_ack, self.t0
        return (
            *QueueSim._get_fields(self),
            *[free.get(q, t0) for q in qs],
            *[ack.get(q, t0) for q in qs],
            self.cta[ci],
        )

    def save(self) -> tuple:
        return (tuple(getattr(self, k) for k in self._TIME + self._ACC), list(self.cta), dict(self.qp_free),
                dict(self.qp_ack))

    def restore(self, state: tuple) -> None:
        for k, v in zip(self._TIME + self._ACC, state[0], strict=True):
            setattr(self, k, v)
        self.cta, self.qp_free, self.qp_ack = list(state[1]), dict(state[2]), dict(state[3])

    def advance(self, qs: tuple[int, ...], ci: int, delta: tuple[float, ...], reps: int) -> None:
        """Move every variable the periodic run touches on by `reps` periods of `delta`."""
        STATS["advanced"] += 1
        names = self._TIME + self._ACC
        for i, k in enumerate(names):
            setattr(self, k, getattr(self, k) + reps * delta[i])
        i = len(names)
        for q in qs:
            self.qp_free[q] = self.qp_free.get(q, self.t0) + reps * delta[i]
            i += 1
        for q in qs:
            self.qp_ack[q] = self.qp_ack.get(q, self.t0) + reps * delta[i]
            i += 1
        self.cta[ci] += reps * delta[i]


def _same(d1: tuple[float, ...], d2: tuple[float, ...]) -> bool:
    """Every pair within 1e-9 relative (1e-9 absolute below 1): |x - y| <= 1e-9 * max(1, |x|, |y|).

    math.isclose computes that very bound (a positive factor keeps the max), in C: this runs for every simulated
    period, and the calibration fit spent a fifth of its time in the Python form. It differs only where a change is
    infinite: x == y == inf (isclose: close; the Python form: inf - inf is nan, not close) and an infinite x beside
    another y (isclose: not close; the Python form: inf <= 1e-9 * inf, close). Finite changes, the only ones a
    period of finite times makes, get the same answer, so the predictions are bit-identical."""
    for x, y in zip(d1, d2, strict=True):  # noqa: SIM110 (a loop: all(<generator>) is slower on this hot path)
        if not _isclose(x, y, rel_tol=1e-9, abs_tol=1e-9):
            return False
    return True


def _delta(s: tuple[float, ...], s_prev: tuple[float, ...]) -> tuple[float, ...]:
    """s - s_prev per element (equal lengths: two snapshots of the same QPs and CTA)."""
    assert len(s) == len(s_prev)
    return tuple(map(operator.sub, s, s_prev))


def _periodic(sim: QueueSim, qs: tuple[int, ...], ci: int, total: int, one, skip) -> None:
    """Run `total` periods: `one()` simulates the next period, `skip(r)` moves the caller's
    bookkeeping on by r periods. Once two consecutive periods change the state by the same amounts the
    run is periodic: jump ahead by whole periods, then check that the next period still changes the
    state by the same amounts (else undo and jump less; a regime change shows as a different step)."""
    done = 0
    if not EXTRAPOLATE or total < 5:  # too short to find, jump and check a period: just replay
        for _ in range(total):
            one()
            skip(1)
        return
    prev: tuple[float, ...] | None = None
    s_prev = sim.snapshot(qs, ci)
    while done < total:
        one()
        skip(1)
        done += 1
        s = sim.snapshot(qs, ci)
        delta = _delta(s, s_prev)
        s_prev = s
        if not EXTRAPOLATE or prev is None or not _same(delta, prev):
            prev = delta
            continue
        chunk = total - done - 1
        while chunk >= 1:
            state = sim.save()
            sim.advance(qs, ci, delta, chunk)
            skip(chunk)
            before = sim.snapshot(qs, ci)
            one()
            skip(1)
            after = sim.snapshot(qs, ci)
            if _same(_delta(after, before), delta):
                done += chunk + 1
                s_prev = after
                break
            sim.restore(state)
            skip(-(chunk + 1))
            chunk //= 2
        prev = None  # after a jump (or a failed one) look for two equal periods again


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
    group_signal: bool = False,
    words: int = 0,
    local_words: int = 0,
    self_chunks: list[float] | None = None,
    self_bw: float = 0.0,
    self_ready: float = 0.0,
) -> QueueSim:
    """Replay one PE's requests (see the module docstring); returns the final simulator state.

    `words` count words to each destination of `dests` and to each of `local_words` more ranks off the NIC
    (this PE, NVLink peers) are posted first; then `self_chunks` (bytes per PUT to this PE, ready at `self_ready`) with their signals, then
    the destinations' runs."""
    sim = QueueSim(p, kind, npes=npes, qps=qps, num_sms=num_sms, t0=t0)
    put_only = signalling == "none"
    cidx = 0
    if words:
        # one poster (the proxy thread; IBGDA: destination d's words from CTA d, spread over the CTAs)
        for j in range(local_words):
            sim.local_words(words, (len(dests) + j) % sim.ncta)
        for d in range(len(dests)):
            sim.rtt, sim.half = dests[d][0], 0.5 * dests[d][0]
            sim.write64(sim.qp(d * qps), words, d % sim.ncta)
    if self_chunks:
        nch = len(self_chunks)
        g = 1 if signalling == "coupled" else (group if group > 0 else nch)
        for i, b in enumerate(self_chunks):
            sim.local_put(b, self_bw, self_ready, 0)
            if not put_only and ((i + 1) % g == 0 or i == nch - 1):
                sim.local_signal(sim.fence(fence), 0)
    for d, (rtt, runs) in enumerate(dests):
        sim.rtt, sim.half = rtt, 0.5 * rtt
        ntiles = sum(r[1] for r in runs)
        if ntiles == 0:
            continue
        base = d * qps
        rr = 0
        if signalling == "coupled":
            period = qps  # tiles rotate over the peer's QPs (peer_hash: a tile is a group; round_robin too)
            qs = tuple(sorted({sim.qp(base + j) for j in range(qps)}))
            bk = [0, 0, 0]  # tile index in the run, group index, round-robin counter
            for b, n, m, r0, rstep in runs:
                ci = cidx % sim.ncta
                cidx += 1
                bk[0] = 0

                def one(b=b, m=m, r0=r0, rstep=rstep, ci=ci, base=base, period=period, bk=bk) -> None:
                    k, gi, rr = bk
                    for j in range(period):
                        _coupled_tile(sim, base, qps, qp_mapping, gi + j, rr + 2 * j, b, m, r0 + (k + j) * rstep, ci,
                                      fence)

                def skip(r: int, period=period, bk=bk) -> None:
                    bk[0] += r * period
                    bk[1] += r * period
                    bk[2] += 2 * r * period

                _periodic(sim, qs, ci, n // period, one, skip)
                while bk[0] < n:
                    _coupled_tile(sim, base, qps, qp_mapping, bk[1], bk[2], b, m, r0 + bk[0] * rstep, ci, fence)
                    bk[0] += 1
                    bk[1] += 1
                    bk[2] += 2
            continue
        # decoupled (or put only): groups of `gs` tiles, a group's PUTs, one fence, its signals
        gs = ntiles if (group == 0 or put_only) else group
        pending = [[b, n, m, r0, rstep, 0] for b, n, m, r0, rstep in runs]
        for item in pending:
            item[5] = cidx % sim.ncta  # one CTA owns one transfer (IBGDA posts from it)
            cidx += 1
        gi = 0
        ri = 0
        # put only (the counterfactual) has no signal to keep on its PUTs' QP: the PUTs spread over every
        # QP of the peer, as the signalled run's do at best (else it could be slower than signalled)
        hashed = (qp_mapping == "peer_hash" and not put_only) or qps == 1
        period = qps
        qs = tuple(sorted({sim.qp(base + j) for j in range(qps)}))
        extrapolated: set[int] = set()
        nsig = 1 if group_signal else gs  # signals after each whole group
        while ri < len(pending):
            b, n, m, r0, rstep, ci = pending[ri]
            if not put_only and ri not in extrapolated and gs < n and n >= gs * 3 * period:
                # whole groups inside one long run of identical tiles (QP rotation repeats every
                # `qps` groups)
                extrapolated.add(ri)
                item = pending[ri]
                st = [gi, rr]

                def one(item=item, base=base, ci=ci, st=st, gs=gs, period=period, hashed=hashed, nsig=nsig) -> None:
                    g0, rr0 = st
                    for j in range(period):
                        _group_from_run(sim, item[0], gs, item[2], item[3] + j * gs * item[4], item[4], ci, base,
                                        qps, hashed, g0 + j, rr0 + (gs + nsig) * j, fence, nsig)

                def skip(r: int, item=item, st=st, gs=gs, period=period, nsig=nsig) -> None:
                    item[1] -= r * period * gs
                    item[3] += r * period * gs * item[4]
                    st[0] += r * period
                    st[1] += (gs + nsig) * r * period

                _periodic(sim, qs, ci, (n // gs) // period, one, skip)
                gi, rr = st
                if item[1] == 0:
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
            sig_n = 1 if group_signal else gs - need
            flagged = sim.fence(fence)
            if hashed:
                sim.signal(sim.qp(q_grp), sig_n, flagged, last_post, ci)
            else:
                for j in range(min(qps, sig_n)):
                    cnt = sig_n // qps + (1 if j < sig_n % qps else 0)
                    sim.signal(sim.qp(base + ((rr + j) % qps)), cnt, flagged and j == 0, last_post, ci)
                rr += sig_n
    return sim


def _group_from_run(sim: QueueSim, b: float, gs: int, m: int, r0: float, rstep: float, ci: int, base: int,
                    qps: int, hashed: bool, gi: int, rr: int, fence: str, nsig: int) -> None:
    """One decoupled group of gs identical tiles: PUTs, one fence, nsig signals (gs, or 1 per group)."""
    if hashed:
        q = sim.qp(base + (gi % qps))
        post = sim.put(q, b, gs, m, r0, rstep, ci, False)
        flagged = sim.fence(fence)
        sim.signal(q, nsig, flagged, post, ci)
        return
    post = 0.0
    for j in range(min(qps, gs)):
        cnt = gs // qps + (1 if j < gs % qps else 0)
        post = max(post, sim.put(sim.qp(base + ((rr + j) % qps)), b, cnt, m, r0 + j * rstep, rstep * qps, ci, False))
    rr += gs
    flagged = sim.fence(fence)
    for j in range(min(qps, nsig)):
        cnt = nsig // qps + (1 if j < nsig % qps else 0)
        sim.signal(sim.qp(base + ((rr + j) % qps)), cnt, flagged and j == 0, post, ci)


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
