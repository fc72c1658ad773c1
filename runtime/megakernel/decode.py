"""The decode kernel's work split (csrc/megakernel/mk_decode.cuh), modelled on the CPU.

A launch has `grid` CTAs, one per SM, of WARPS warps. Their warps take the P = S x topk x I (gate, up) row pairs
(pair q is slot q // I, intermediate column q % I) one at a time: warps 1.. first STATIC_ROUNDS pairs by their index
(global warp g = c (WARPS - 1) + w - 1 takes g, g + W, ... below P0 = min(P, STATIC_ROUNDS W), W = grid (WARPS - 1)),
then every warp the rest from a launch-wide counter; once it runs out, each CTA adds, for every slot, how many of
that slot's pairs it finished to the slot's counter. CTA c owns output rows
[c R, min((c + 1) R, H)) with R = ceil(H / G); it waits for each slot's counter to reach I, slot by slot in order,
and adds that slot's down projection for its rows. `plan` gives the row blocks and the task counts the kernel
leaves in its ctl words (the GPU tests compare them); `simulate` runs the CTAs interleaved in a random order to
check that every pair is computed once whichever CTA takes it, every counter reaches I, every output row is written
once, and a slot that never completes ends in the timeout error, never a hang.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ERR_INPUT_TIMEOUT = 6  # MK_ERR_INPUT_TIMEOUT
WARPS = 16  # DEC_THREADS / 32
STATIC_ROUNDS = 2  # DEC_STATIC_ROUNDS
MAX_SLOTS = 64  # DEC_MAX_SLOTS: the most routed rows (S x topk) a decode launch takes; fewer where W_down rows
                # do not fit each CTA's shared memory (S=1 only on qwen3-30b)


@dataclass(frozen=True)
class DecodePlan:
    grid: int
    rows: int                                  # output rows per CTA
    slots: int                                 # routed rows S x topk
    intermediate: int
    hidden: int
    row_blocks: tuple[tuple[int, int], ...]    # per CTA: [r0, r1) of the output rows (empty past H)

    @property
    def pairs(self) -> int:
        return self.slots * self.intermediate

    @property
    def total(self) -> int:
        """Tasks the kernel counts: the pairs (handed out by the counter) plus the CTAs with output rows."""
        return self.pairs + sum(r1 > r0 for r0, r1 in self.row_blocks)

    @property
    def n_tiles(self) -> int:
        return self.slots

    @property
    def static_end(self) -> int:
        """P0: the pairs below it go by warp index, the rest through the counter."""
        return min(self.pairs, STATIC_ROUNDS * self.grid * (WARPS - 1))

    def static_pairs(self, cta: int) -> list[int]:
        """The pairs CTA `cta`'s warps take by index, before the counter's."""
        w_all = self.grid * (WARPS - 1)
        return [q for w in range(1, WARPS) for r in range(STATIC_ROUNDS)
                if (q := cta * (WARPS - 1) + w - 1 + r * w_all) < self.static_end]


def plan(*, tokens: int, topk: int, hidden: int, intermediate: int, grid: int) -> DecodePlan:
    if tokens < 1 or topk < 1 or grid < 1 or hidden < 1 or intermediate < 1:
        raise ValueError(f"decode plan: tokens, topk, hidden, intermediate and grid must be >= 1, got {tokens}, "
                         f"{topk}, {hidden}, {intermediate}, {grid}")
    rows = -(-hidden // grid)
    return DecodePlan(grid=grid, rows=rows, slots=tokens * topk, intermediate=intermediate, hidden=hidden,
                      row_blocks=tuple((min(c * rows, hidden), min((c + 1) * rows, hidden)) for c in range(grid)))


@dataclass
class DecodeSim:
    pairs_done: list[int]       # times each pair was computed
    counters: list[int]         # final slot counters
    rows_written: list[int]     # times each output row was written
    error: int = 0              # 0, or ERR_INPUT_TIMEOUT
    error_slot: int = -1


def simulate(p: DecodePlan, *, seed: int = 0, stall_slot: int = -1, timeout_polls: int = 1000) -> DecodeSim:
    """Interleave the CTAs (a random runnable CTA takes one step at a time) until every CTA ends.

    A CTA's steps: compute its pairs by index, then take the next pair from the shared counter and compute it,
    until the counter runs out; then add
    its per-slot counts to the slot counters; then per slot, poll the slot's counter (a poll that sees it short stays
    on that slot; past `timeout_polls` polls it records the timeout, as the kernel's bounded wait does, and goes on);
    once every slot is past, write its rows. `stall_slot`: that slot never reads as complete."""
    rng = random.Random(seed)
    i = p.intermediate
    sim = DecodeSim(pairs_done=[0] * p.pairs, counters=[0] * p.slots, rows_written=[0] * p.hidden)
    state = [-1] * p.grid   # -1: taking pairs; s in 0..slots-1: waiting for slot s; slots: finished
    polls = [0] * p.grid
    done = [[0] * p.slots for _ in range(p.grid)]  # per CTA: pairs of each slot it finished
    todo = [p.static_pairs(c) for c in range(p.grid)]
    nxt = p.static_end
    running = list(range(p.grid))
    while running:
        c = rng.choice(running)
        if state[c] == -1:
            if todo[c]:
                q = todo[c].pop(0)
            else:
                q, nxt = nxt, nxt + 1
            if q < p.pairs:
                sim.pairs_done[q] += 1
                done[c][q // i] += 1
            else:  # the counter ran out: signal what this CTA did, then wait (if it owns rows)
                for s, n in enumerate(done[c]):
                    sim.counters[s] += n
                r0, r1 = p.row_blocks[c]
                state[c] = 0 if r1 > r0 else p.slots
        elif state[c] < p.slots:
            s = state[c]
            if s != stall_slot and sim.counters[s] >= i:
                state[c] += 1
                polls[c] = 0
            else:
                polls[c] += 1
                if polls[c] > timeout_polls:
                    if not sim.error:
                        sim.error, sim.error_slot = ERR_INPUT_TIMEOUT, s
                    state[c] += 1
                    polls[c] = 0
        if state[c] == p.slots:
            r0, r1 = p.row_blocks[c]
            for r in range(r0, r1):
                sim.rows_written[r] += 1
            running.remove(c)
    return sim
