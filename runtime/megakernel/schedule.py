"""A faithful Python model of the megakernel's task graph and scheduler (csrc/megakernel/mk_moe.cu).

The GPU scheduler and this model share every formula: m-tiles per expert ceil(count / bm) numbered
expert-major, N1 = 2I/128 GEMM1 n-blocks and N2 = H/128 GEMM2 n-blocks per m-tile, one combine task per
`combine_tokens` tokens and column block (4 blocks when H/8 divides by 4), the release rules (GEMM2 of an m-tile once its N1 GEMM1 tasks are done; a combine
tile once it has seen tokens x topk x N2 finished GEMM2 rows) and the queue discipline (processors claim
slots in order; one producer publishes), and decode split-K (`splits`: a GEMM task runs as parts over K;
the part that finishes last adds all parts in part order and alone signals readiness). `simulate` runs it step by step on the CPU so the dependency
logic, the task counts and the timeout path are tested without a GPU; the GPU tests compare the kernel's
own counts (ctl words) with `plan`.

The wide tile (`bn=256`, MkParams.bn) keeps the 128-column n-block bookkeeping: a task covers n-blocks nb (even)
and nb + 1 and counts both when it finishes (g1done += 2; each of its rows counts 2 in its combine tile), so
the release thresholds are unchanged and a launch has half as many GEMM tasks (`Plan.nblk` = 2).

`tail` (MkParams.tail_rows, `MegakernelConfig.tail`): an expert's last r <= tail rows past a multiple of bm ride
in its last full m-tile (`expert_tiles`, `tile_end`: mk_index.h's functions of the same names).

`publish_all` (MkParams.publish_all, the mma-core tiles): the scheduler publishes every task at launch in the
order of `all_tasks` (GEMM1s, then GEMM2s tile-major, then COMBINEs) and a processor that claims a GEMM2 or a
COMBINE waits for its inputs itself (the kernel streams the GEMM2's first weight stages meanwhile). No
deadlock: a task waits only for tasks in earlier slots, which resident CTAs claimed before it.

`overlap` (MkParams.overlap, the wgmma tiles' default and the only kernel with tail rows): k_experts_ov's producer
warpgroup claims a CTA's next slot while its consumers still run the current task, so a CTA holds up to three slots
(a COMBINE running, the next word ready, one more claimed); `simulate(overlap=True)` runs that discipline across the
grid (the one-CTA barrier protocol is tests/test_megakernel_cpu.py's `_overlap_pipeline`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

BN = 128  # weight rows per tile (BN in mk_moe.cu)

GEMM1, GEMM2, COMBINE = 1, 2, 3
ERR_SCHED_TIMEOUT, ERR_PROC_TIMEOUT, ERR_INPUT_TIMEOUT = 1, 2, 6


@dataclass(frozen=True)
class Task:
    kind: int
    expert: int
    mtile: int  # m-tile within the expert (combine: the combine tile)
    nblock: int
    tile: int   # global m-tile id (combine: 0)
    part: int = 0   # split-K part (0..parts-1)
    parts: int = 1  # split-K parts of this GEMM task (1: not split)


@dataclass(frozen=True)
class Plan:
    n1: int
    n2: int
    nc: int                        # combine tasks (column blocks) per combine tile
    tile_base: tuple[int, ...]     # exclusive prefix of m-tiles per expert; [E] = total m-tiles
    n_tiles: int
    n_ctiles: int
    total: int
    rows: tuple[tuple[int, ...], ...]  # per expert: rows t*K + j in list order
    ctile_target: tuple[int, ...]  # finished (row, GEMM2 n-block) pairs each combine tile waits for
    ks1: int = 1                   # split-K parts per GEMM1 / GEMM2 task this launch (`splits`)
    ks2: int = 1
    nblk: int = 1                  # 128-column n-blocks per GEMM task: 2 for the wide tile (bn = 256)
    bm: int = 16                   # rows per m-tile (the last may hold `tail` more)
    tail: int = 0

    def tile_rows(self, expert: int, mtile: int) -> tuple[int, ...]:
        """The rows (t*K + j) m-tile `mtile` of `expert` computes."""
        rows = self.rows[expert]
        return rows[mtile * self.bm : tile_end(len(rows), mtile, self.bm, self.tail)]

    def tile_expert(self, tile: int) -> int:
        lo, hi = 0, len(self.tile_base) - 2
        while lo < hi:  # largest e with base[e] <= tile (the kernel's binary search)
            mid = (lo + hi + 1) >> 1
            if self.tile_base[mid] <= tile:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def gemm1_tasks(self) -> list[Task]:
        """Queue order of the kernel: tile-major, then n-field = nb + N1 * part."""
        out = []
        w = self.nblk  # wide tile: task index -> first n-block 2 * index (never split: ks1 = 1)
        for i in range(self.n_tiles * self.n1 // w * self.ks1):
            tile, nf = divmod(i, self.n1 // w * self.ks1)
            nf *= w
            e = self.tile_expert(tile)
            out.append(Task(GEMM1, e, tile - self.tile_base[e], nf % self.n1, tile, nf // self.n1, self.ks1))
        return out

    def gemm2_tasks(self, tile: int) -> list[Task]:
        e = self.tile_expert(tile)
        w = self.nblk
        return [Task(GEMM2, e, tile - self.tile_base[e], nf * w % self.n2, tile, nf * w // self.n2, self.ks2)
                for nf in range(self.n2 // w * self.ks2)]


    def all_tasks(self) -> list[Task]:
        """publish_all's queue: every GEMM1, then every m-tile's GEMM2s (tile-major), then the COMBINEs."""
        out = self.gemm1_tasks()
        for tile in range(self.n_tiles):
            out += self.gemm2_tasks(tile)
        return out + [Task(COMBINE, 0, c, cb, 0) for c in range(self.n_ctiles) for cb in range(self.nc)]


def expert_tiles(count: int, bm: int, tail: int) -> int:
    """m-tiles of an expert with `count` rows (mk_index.h: expert_tiles): ceil(count / bm), less one when its last
    r = count % bm rows (1 <= r <= tail) ride in its last full m-tile."""
    n, r = -(-count // bm), count % bm
    return n - 1 if tail > 0 and n > 1 and 0 < r <= tail else n


def tile_end(count: int, mtile: int, bm: int, tail: int) -> int:
    """One past the last of m-tile `mtile`'s rows in its expert's list (mk_index.h: tile_end)."""
    return count if mtile + 1 >= expert_tiles(count, bm, tail) else (mtile + 1) * bm


def splits(want: int, *, n_tiles: int, bm: int, max_tiles: int) -> int:
    """Split-K parts of a GEMM task this launch (sk_splits in mk_moe.cu): decode tiles (bm = 16) only, and only
    while the launch's m-tiles fit the partial-sum buffer (`max_tiles`, 0 = none)."""
    return want if want > 1 and bm == 16 and n_tiles <= max_tiles else 1


def reduce_parts(parts: list[list[float]]) -> list[float]:
    """The split-K reduction of mk_moe.cu in fp32: sum = p[0]; sum += p[1]; ... in part order, whatever order
    the parts finished in. Every add rounds to fp32 (struct round trip), so this is the kernel's arithmetic."""
    import struct

    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    out = [f32(v) for v in parts[0]]
    for p in parts[1:]:
        out = [f32(a + f32(b)) for a, b in zip(out, p, strict=True)]
    return out


def split_slot(arrivals: Iterable[tuple[int, list[float]]], splits: int) -> list[float]:
    """One split-K slot as mk_moe.cu (run_gemm) runs it, its parts finishing in the order of `arrivals` ((part,
    fp32 partials) each): every part stores its partials in its own place of sk_part and counts itself in sk_cnt;
    the part that counts last sums the stored places (`reduce_parts`: part order) and returns that sum."""
    places: list[list[float] | None] = [None] * splits
    count = 0
    for part, partial in arrivals:
        if not 0 <= part < splits or places[part] is not None:
            raise ValueError(f"split-K slot: part {part} is out of range 0..{splits - 1} or arrived twice")
        places[part] = partial
        count += 1
        if count == splits:  # the last to count: every place is stored
            return reduce_parts([q for q in places if q is not None])
    raise ValueError(f"split-K slot: {count} of {splits} parts arrived")


def plan(topk_idx: list[list[int]], *, experts: int, hidden: int, intermediate: int, bm: int,
         combine_tokens: int, split_k1: int = 1, split_k2: int = 1, split_max_tiles: int = 0, bn: int = BN,
         tail: int = 0) -> Plan:
    """The task graph for routing `topk_idx` ([S][K] expert ids); `split_*` as MegakernelConfig (the layer
    passes the launch's `config.split_room(...)[0]` as `split_max_tiles`); `bn` the launch's
    columns per task (`MegakernelConfig.pick_bn(bm)`: 256 = the wide tile, bm = 128 only); `tail` its tail rows
    (`MegakernelConfig.tail`: the wide tile only)."""
    if tail and (bn != 2 * BN or not 0 < tail <= 16):
        raise ValueError(f"tail rows (1..16) need the wide tile (bn=256), got tail={tail}, bn={bn}")
    if bn not in (BN, 2 * BN):
        raise ValueError(f"bn must be 128 or 256, got {bn}")
    if bn == 2 * BN and (bm != 128 or hidden % bn or 2 * intermediate % bn):
        raise ValueError(f"bn=256 needs bm=128 and hidden, 2 x intermediate multiples of 256, got bm={bm}, "
                         f"{hidden}, {2 * intermediate}")
    s = len(topk_idx)
    k = len(topk_idx[0]) if s else 0
    rows: list[list[int]] = [[] for _ in range(experts)]
    for t, sel in enumerate(topk_idx):
        for j, e in enumerate(sel):
            rows[e].append(t * k + j)
    base = [0]
    for e in range(experts):
        base.append(base[-1] + expert_tiles(len(rows[e]), bm, tail))
    n1, n2, nc = 2 * intermediate // BN, hidden // BN, combine_blocks(hidden)
    n_tiles = base[-1]
    n_ct = -(-s // combine_tokens)
    target = tuple((min(s, (c + 1) * combine_tokens) - c * combine_tokens) * k * n2 for c in range(n_ct))
    ks1 = splits(split_k1, n_tiles=n_tiles, bm=bm, max_tiles=split_max_tiles)
    ks2 = splits(split_k2, n_tiles=n_tiles, bm=bm, max_tiles=split_max_tiles)
    w = bn // BN
    return Plan(n1, n2, nc, tuple(base), n_tiles, n_ct, n_tiles * (n1 // w * ks1 + n2 // w * ks2) + n_ct * nc,
                tuple(map(tuple, rows)), target, ks1, ks2, w, bm, tail)


def combine_blocks(hidden: int) -> int:
    """Column blocks per combine tile (combine_blocks in mk_moe.cu)."""
    return 4 if (hidden // 8) % 4 == 0 else 1


def combine_discards(topk: int, c: int, c0: int, chunks: int, lane: int) -> bool:
    """Whether a COMBINE lane discards the 128-byte y lines that start at its chunk `c` (combine_items in mk_moe.cu,
    MK_Y_L2 bit 2): top-k 8 only, and only a line its task and its warp's round read whole, i.e. chunks c..c+7
    (8 bf16 each) of one token inside the task's column block [c0, c0 + chunks), on lanes lane..lane+7 of the round.
    A line shared with another column block's task or another round (hidden % 256 == 128) is left alone."""
    return topk == 8 and c % 8 == 0 and c - c0 + 8 <= chunks and lane <= 24


@dataclass
class SimResult:
    executed: list[Task] = field(default_factory=list)  # in completion order
    error: int = 0
    error_where: int = -1
    published: int = 0
    steps: int = 0
    held_max: int = 0  # most queue slots one processor held at once (claimed, not yet finished)


@dataclass
class _OvCta:
    """One CTA of the overlap kernel (k_experts_ov) in `simulate`: its producer's claims in claim order that the
    consumers have not taken yet ([slot, claim step, task or None until published, end]), the producer's state
    ("free": may claim once the slot of claim j - 2 is free; "wait": in wait_slot for its last claim; "issue": issuing a
    GEMM's stages, which ends once the consumers took that GEMM, or at once where the stages fit the ring; "done"),
    the consumers' running task (task, finish step, claim index) and the claim indices whose task slot is free again
    (tempty: a COMBINE's when its word is read, a GEMM's after its signal)."""
    claims: list[list] = field(default_factory=list)
    prod: str = "free"
    issuing: int = -1
    n_claims: int = 0
    taken: int = 0
    run: tuple | None = None
    freed: set[int] = field(default_factory=set)
    ended: bool = False


def simulate(p: Plan, *, processors: int, bm: int, topk: int, combine_tokens: int, stall_tile: int = -1,
             timeout_steps: int = 50, seed: int = 0, max_steps: int = 1_000_000,
             publish_all: bool = False, overlap: bool = False, ring_fits: bool = False) -> SimResult:
    """Run the scheduler and `processors` processor CTAs in lock-step rounds; tasks take 1..3 rounds.

    Each round: the subscriber sweeps the counters once and publishes what is ready; each idle processor
    claims the next slot (atomicAdd order) and starts it once published; running tasks finish at random
    times (seeded) and bump their counters. Asserts the dependency rules on every task start.
    `publish_all`: every task is in the queue from the start; a processor holding a GEMM2 / COMBINE whose
    inputs are not done waits (counted against `timeout_steps`: ERR_INPUT_TIMEOUT), then runs it.
    `overlap`: the overlap kernel's discipline (k_experts_ov, wgmma tiles: not with publish_all), see `_OvCta`: a CTA's
    producer claims the next slot once it has issued the current GEMM's stages (`ring_fits`: they fit the stage ring,
    so at once; else once its consumers took the GEMM) or at once after a COMBINE word, and never while its consumers
    have not freed the task slot of claim j - 2; the consumers run the claimed tasks in claim order. Otherwise a
    processor holds one slot at a time (k_experts).
    """
    if overlap and publish_all:
        raise ValueError("overlap: the overlap kernel runs the wgmma tiles, which ignore publish_all (the mma core's)")
    rng = random.Random(seed)
    res = SimResult()
    queue: list[Task] = p.all_tasks() if publish_all else p.gemm1_tasks()
    g1done = [0] * p.n_tiles
    comb = [0] * p.n_ctiles
    rel_tile = [False] * p.n_tiles
    rel_ct = [False] * p.n_ctiles
    done_g2: set[tuple[int, int]] = set()
    parts_done: dict[tuple[int, int, int], int] = {}  # split-K: finished parts per (kind, tile, nb) slot
    head = 0
    # per processor: None (idle), ("wait", slot, since) or ("run", task, finish_step)
    state: list[tuple | None] = [None] * processors
    sched_since = 0
    seen = -1
    released = 0
    need = p.n_tiles + p.n_ctiles
    sched_done = need == 0 or publish_all
    step = 0

    def finish(t: Task) -> None:
        """Task t is done: its signal (split-K: only the part that finishes last, after the fixed-order sum)."""
        res.executed.append(t)
        if t.parts > 1:
            key = (t.kind, t.tile, t.nblock)
            parts_done[key] = parts_done.get(key, 0) + 1
            assert parts_done[key] <= t.parts, f"slot {key} finished {parts_done[key]} parts"
            if parts_done[key] < t.parts:
                return
        if t.kind == GEMM1:  # a wide task (nblk = 2) finishes n-blocks nblock and nblock + 1
            g1done[t.tile] += p.nblk
        elif t.kind == GEMM2:
            for q in range(p.nblk):
                done_g2.add((t.tile, t.nblock + q))
            for r in _tile_rows(p, t, bm):
                comb[(r // topk) // combine_tokens] += p.nblk

    ctas = [_OvCta() for _ in range(processors if overlap else 0)]

    def _overlap_round(c: _OvCta) -> bool:
        """One round of an overlap CTA: its consumers finish / take a task, its producer claims / waits / issues.
        Returns whether the CTA still has work (busy)."""
        nonlocal head
        if c.run is not None and step >= c.run[1]:  # the consumers' task ends: its signal, a GEMM's slot freed
            finish(c.run[0])
            if c.run[0].kind != COMBINE:
                c.freed.add(c.run[2])
            c.run = None
        if c.run is None and not c.ended and c.claims and (c.claims[0][2] is not None or c.claims[0][3]):
            _, _, t, end = c.claims.pop(0)  # tfull: the word the producer wrote (0: end of work)
            j = c.taken
            c.taken += 1
            if end:
                c.ended = True
            else:
                _check_ready(p, t, g1done, done_g2, topk, bm, combine_tokens)
                c.run = (t, step + rng.randint(1, 3), j)
                if t.kind == COMBINE:  # the word is all a COMBINE needs from its slot
                    c.freed.add(j)
        if c.prod == "issue" and (ring_fits or c.taken > c.issuing):
            c.prod = "free"
        if c.prod == "free" and (c.n_claims < 2 or c.n_claims - 2 in c.freed):
            c.claims.append([head, step, None, False])
            head += 1
            c.n_claims += 1
            c.prod = "wait"
        elif c.prod == "wait":
            cl = c.claims[-1]  # unresolved, so not taken by the consumers
            if cl[0] < len(queue):
                cl[2] = queue[cl[0]]
                c.prod = "free" if cl[2].kind == COMBINE else "issue"
                c.issuing = c.n_claims - 1
            elif cl[0] >= p.total or res.error:
                cl[3], c.prod = True, "done"
            elif step - cl[1] > timeout_steps:
                res.error, res.error_where = res.error or ERR_PROC_TIMEOUT, cl[0]
                cl[3], c.prod = True, "done"
        return not (c.ended and c.prod == "done")

    while step < max_steps:
        step += 1
        # subscriber sweep
        if not sched_done and not res.error:
            got = 0
            # progress = any unreleased counter moved (the kernel compares the sum with the last sweep's)
            total_seen = sum(g1done[t] for t in range(p.n_tiles) if not rel_tile[t]) + sum(
                comb[c] for c in range(p.n_ctiles) if not rel_ct[c])
            for tile in range(p.n_tiles):
                if not rel_tile[tile] and tile != stall_tile and g1done[tile] == p.n1:
                    rel_tile[tile] = True
                    queue += p.gemm2_tasks(tile)
                    got += 1
            for c in range(p.n_ctiles):
                if not rel_ct[c] and comb[c] == p.ctile_target[c]:
                    rel_ct[c] = True
                    queue += [Task(COMBINE, 0, c, cb, 0) for cb in range(p.nc)]
                    got += 1
            released += got
            if got or total_seen != seen:
                sched_since, seen = step, total_seen
            elif step - sched_since > timeout_steps:
                res.error, res.error_where = ERR_SCHED_TIMEOUT, released
            sched_done = released == need
        # processors
        busy = False
        if overlap:
            for cta in ctas:
                busy |= _overlap_round(cta)
            res.held_max = max([res.held_max] + [len(c.claims) + (c.run is not None) for c in ctas])
            if not busy and (sched_done or res.error):
                break
            continue
        for i in range(processors):
            st = state[i]
            if st is None:
                st = state[i] = ("wait", head, step)
                head += 1
                res.held_max = 1
            if st[0] == "wait":
                slot = st[1]
                if slot < len(queue) and publish_all:
                    state[i] = ("inputs", queue[slot], step)
                    st = state[i]
                elif slot < len(queue):
                    t = queue[slot]
                    _check_ready(p, t, g1done, done_g2, topk, bm, combine_tokens)
                    state[i] = ("run", t, step + rng.randint(1, 3))
                    busy = True
                elif slot >= p.total or res.error:
                    state[i] = ("exit",)
                elif step - st[2] > timeout_steps:
                    res.error, res.error_where = res.error or ERR_PROC_TIMEOUT, slot
                    state[i] = ("exit",)
                else:
                    busy = True
            if st[0] == "inputs":  # publish_all: the processor waits for the claimed task's inputs
                t = st[1]
                if not _inputs_done(p, t, g1done, comb, stall_tile):
                    if res.error:
                        state[i] = ("exit",)
                    elif step - st[2] > timeout_steps:
                        res.error, res.error_where = ERR_INPUT_TIMEOUT, t.tile if t.kind == GEMM2 else t.mtile
                        state[i] = ("exit",)
                    else:
                        busy = True
                    continue
                _check_ready(p, t, g1done, done_g2, topk, bm, combine_tokens)
                state[i] = ("run", t, step + rng.randint(1, 3))
                busy = True
            elif st[0] == "run":
                busy = True
                if step >= st[2]:
                    finish(st[1])
                    state[i] = None
        if not busy and (sched_done or res.error):
            break
    res.published = len(queue)
    res.steps = step
    return res


def _inputs_done(p: Plan, t: Task, g1done: list[int], comb: list[int], stall_tile: int) -> bool:
    """publish_all: the counter a processor waits on for task t (the kernel's wait_inputs)."""
    if t.kind == GEMM2:
        return t.tile != stall_tile and g1done[t.tile] >= p.n1
    if t.kind == COMBINE:
        return comb[t.mtile] >= p.ctile_target[t.mtile]
    return True


def _tile_rows(p: Plan, t: Task, bm: int) -> tuple[int, ...]:
    assert bm == p.bm, f"simulated with bm={bm}, planned with {p.bm}"
    return p.tile_rows(t.expert, t.mtile)


def _check_ready(p: Plan, t: Task, g1done: list[int], done_g2: set[tuple[int, int]], topk: int, bm: int,
                 ct: int) -> None:
    if t.kind == GEMM2:
        assert g1done[t.tile] == p.n1, f"GEMM2 of tile {t.tile} started with {g1done[t.tile]}/{p.n1} GEMM1 done"
    elif t.kind == COMBINE:
        toks = set(range(t.mtile * ct, min(len(p.ctile_target) * ct, (t.mtile + 1) * ct)))
        for tile in range(p.n_tiles):
            e = p.tile_expert(tile)
            rows = p.tile_rows(e, tile - p.tile_base[e])
            if any(r // topk in toks for r in rows):
                for nb in range(p.n2):
                    assert (tile, nb) in done_g2, f"combine {t.mtile} started before GEMM2 ({tile}, {nb})"
