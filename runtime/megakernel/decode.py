"""The decode kernel's work split (csrc/megakernel/mk_decode.cuh), modelled on the CPU.

A launch has `grid` CTAs, one per SM. CTA c computes the (gate, up) row pairs [P c / G, P (c + 1) / G) of the
P = S x topk x I (pair q is slot q // I, intermediate column q % I) and then adds, for every slot its range touches,
how many of that slot's pairs it finished to the slot's counter. CTA c owns output rows [c R, min((c + 1) R, H))
with R = ceil(H / G); it waits for each slot's counter to reach I, slot by slot in order, and adds that slot's down
projection for its rows. `plan` gives the ranges and the task counts the kernel leaves in its ctl words (the GPU
tests compare them); `simulate` runs the CTAs interleaved in a random order to check that every pair is computed
once, every counter reaches I, every output row is written once, and a slot that never completes ends in the
timeout error, never a hang; and that a launch that aborts (a timeout, or a CTA whose logit wait gave up: it stores
no h but still signals its pairs) writes no finite row over h that was not computed in it.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass

from .weights import PLANE  # k elements per plane of the k-tiled weights

ERR_INPUT_TIMEOUT = 6  # MK_ERR_INPUT_TIMEOUT
MAX_SLOTS = 64  # DEC_MAX_SLOTS: the most routed rows (S x topk) a decode launch takes; fewer where W_down rows
                # do not fit each CTA's shared memory (S=1 only on qwen3-30b)


@dataclass(frozen=True)
class DecodePlan:
    grid: int
    rows: int                                  # output rows per CTA
    slots: int                                 # routed rows S x topk
    intermediate: int
    hidden: int
    pair_ranges: tuple[tuple[int, int], ...]   # per CTA: [q0, q1) of the pairs
    row_blocks: tuple[tuple[int, int], ...]    # per CTA: [r0, r1) of the output rows (empty past H)

    @property
    def total(self) -> int:
        """Tasks the kernel counts: CTAs with pairs to compute plus CTAs with output rows."""
        return sum(q1 > q0 for q0, q1 in self.pair_ranges) + sum(r1 > r0 for r0, r1 in self.row_blocks)

    @property
    def n_tiles(self) -> int:
        return self.slots

    def signals(self, cta: int) -> list[tuple[int, int]]:
        """(slot, pairs) the CTA adds to the slot counters once its range is done, as the kernel's loop does."""
        q0, q1 = self.pair_ranges[cta]
        if q1 <= q0:
            return []
        i = self.intermediate
        return [(s, min(q1, (s + 1) * i) - max(q0, s * i)) for s in range(q0 // i, (q1 - 1) // i + 1)]


def plan(*, tokens: int, topk: int, hidden: int, intermediate: int, grid: int) -> DecodePlan:
    if tokens < 1 or topk < 1 or grid < 1 or hidden < 1 or intermediate < 1:
        raise ValueError(f"decode plan: tokens, topk, hidden, intermediate and grid must be >= 1, got {tokens}, "
                         f"{topk}, {hidden}, {intermediate}, {grid}")
    slots = tokens * topk
    pairs = slots * intermediate
    rows = -(-hidden // grid)
    return DecodePlan(grid=grid, rows=rows, slots=slots, intermediate=intermediate, hidden=hidden,
                      pair_ranges=tuple((pairs * c // grid, pairs * (c + 1) // grid) for c in range(grid)),
                      row_blocks=tuple((min(c * rows, hidden), min((c + 1) * rows, hidden)) for c in range(grid)))


WARPS = 16      # DEC_WARPS
VEC = 8         # DEC_VEC: k planes an item of phase 2 loads at once
GROUP = 4       # consecutive pairs an item takes: 4 x 128 contiguous bytes of each plane per load


def pair_items(n_pairs: int, hidden: int, *, warps: int = WARPS, vec: int = VEC) -> list[list[tuple[int, int, int]]]:
    """Phase 2 inside one CTA: its `n_pairs` (gate, up) pairs split into items of GROUP consecutive pairs x `vec` k
    planes, as the kernel's loop hands them to warps (warps 1.. take R = ceil(items / warps) each in a stride of
    warps - 1, warp 0, which starts late, the rest). Per warp, in order: (pair, first plane, end plane) of every
    row its lanes load; an item's sums go to batch `first plane // vec` of the pair."""
    planes = hidden // PLANE
    nb = -(-planes // vec)
    items = -(-n_pairs // GROUP) * nb
    r = -(-items // warps)
    out: list[list[tuple[int, int, int]]] = []
    for w in range(warps):
        lo, step, hi = (w - 1, warps - 1, min(items, (warps - 1) * r)) if w else ((warps - 1) * r, 1, items)
        rows = []
        for it in range(lo, hi, step):
            kt0 = it % nb * vec
            rows += [(pr, kt0, min(kt0 + vec, planes)) for pr in range(it // nb * GROUP, it // nb * GROUP + GROUP)
                     if pr < n_pairs]
        out.append(rows)
    return out


@dataclass
class DecodeSim:
    pairs_done: list[int]       # times each pair was computed
    counters: list[int]         # final slot counters
    rows_written: list[int]     # times each output row was written
    rows_nan: list[int]         # times each output row was written NaN (not computed: the launch aborted)
    rows_stale: int = 0         # rows written finite although some pair's h was not computed in this launch
    error: int = 0              # 0, or ERR_INPUT_TIMEOUT
    error_slot: int = -1
    aborted: bool = False       # the launch's abort flag (DEC_ABORT) was raised


def simulate(p: DecodePlan, *, seed: int = 0, stall_slot: int = -1, timeout_polls: int = 1000,
             failed: Collection[int] = (), nan_if_aborted: bool = True) -> DecodeSim:
    """Interleave the CTAs (a random runnable CTA takes one step at a time) until every CTA ends.

    A CTA's steps: compute its pairs and signal; then per slot, poll the slot's counter (a poll that sees it short
    stays on that slot, or gives it up once the launch is aborted; past `timeout_polls` polls it records the timeout
    and raises the abort, as the kernel's bounded wait does, and goes on); once every slot is past, write its rows,
    NaN where it has no picks or (`nan_if_aborted`, the kernel's thread 0 reading the flag before its exit ticket)
    the launch is aborted by then. `stall_slot`: that slot never reads as complete. `failed`: CTAs whose logit wait
    gave up (decode = 2): each raised the abort (its report, or the flag it saw) before its signals, computes no
    pair (its picks are -1) but still signals its range, and waits for no slot. `nan_if_aborted=False`: the kernel
    before, where only such a CTA wrote NaN rows."""
    rng = random.Random(seed)
    i = p.intermediate
    sim = DecodeSim(pairs_done=[0] * (p.slots * i), counters=[0] * p.slots, rows_written=[0] * p.hidden,
                    rows_nan=[0] * p.hidden)
    state = [-1] * p.grid   # -1: pairs not done; s in 0..slots-1: waiting for slot s; slots: finished
    polls = [0] * p.grid
    running = list(range(p.grid))
    while running:
        c = rng.choice(running)
        if state[c] == -1:
            q0, q1 = p.pair_ranges[c]
            if c in failed:
                sim.aborted = True
            else:
                for q in range(q0, q1):
                    sim.pairs_done[q] += 1
            for s, n in p.signals(c):
                sim.counters[s] += n
            r0, r1 = p.row_blocks[c]
            state[c] = 0 if r1 > r0 and c not in failed else p.slots
        elif state[c] < p.slots:
            s = state[c]
            if (s != stall_slot and sim.counters[s] >= i) or sim.aborted:  # wait_count: the count, then the flag
                state[c] += 1
                polls[c] = 0
            else:
                polls[c] += 1
                if polls[c] > timeout_polls:
                    if not sim.error:
                        sim.error, sim.error_slot = ERR_INPUT_TIMEOUT, s
                    sim.aborted = True
                    state[c] += 1
                    polls[c] = 0
        if state[c] == p.slots:
            nan = c in failed or (nan_if_aborted and sim.aborted)
            whole = all(sim.pairs_done)
            r0, r1 = p.row_blocks[c]
            for r in range(r0, r1):
                sim.rows_written[r] += 1
                sim.rows_nan[r] += nan
                sim.rows_stale += not nan and not whole
            running.remove(c)
    return sim
