"""The decode kernel's work split on the CPU (runtime/megakernel/decode.py models csrc/megakernel/mk_decode.cuh):
every (gate, up) pair computed once, every slot counter reaching I, every output row written once, in any CTA
order; a slot that never completes ends in the timeout error. No GPU needed."""

from __future__ import annotations

import re

import pytest

from moetune.runtime.megakernel import ConfigError, MegakernelConfig, _lib
from moetune.runtime.megakernel import decode as dec

SHAPES = [  # (tokens, topk, hidden, intermediate, grid)
    (1, 8, 2048, 768, 132),   # Qwen3-30B-A3B at S = 1 on an H200: 128 CTAs with rows, 4 without
    (2, 4, 1024, 256, 132),
    (1, 2, 256, 64, 7),       # fewer pairs per CTA than warps, rows not a multiple of the grid
    (3, 1, 128, 64, 200),     # more CTAs than output rows
    (1, 1, 128, 64, 100),     # some CTAs with no pairs at all
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_pair_and_row_once_in_any_order(shape, seed):
    s, k, h, i, g = shape
    p = dec.plan(tokens=s, topk=k, hidden=h, intermediate=i, grid=g)
    sim = dec.simulate(p, seed=seed)
    assert sim.error == 0
    assert sim.pairs_done == [1] * (s * k * i)
    assert sim.counters == [i] * (s * k)
    assert sim.rows_written == [1] * h


def test_plan_counts_for_qwen3_at_one_token():
    p = dec.plan(tokens=1, topk=8, hidden=2048, intermediate=768, grid=132)
    assert p.rows == 16 and p.slots == p.n_tiles == 8 and p.pairs == 8 * 768
    assert sum(r1 > r0 for r0, r1 in p.row_blocks) == 128
    assert p.total == 8 * 768 + 128


def test_task_count_is_pairs_plus_row_owners():
    p = dec.plan(tokens=1, topk=1, hidden=128, intermediate=64, grid=100)
    assert p.total == 64 + 64  # rows = ceil(128 / 100) = 2: 64 CTAs hold rows
    p2 = dec.plan(tokens=1, topk=1, hidden=128, intermediate=64, grid=200)
    assert p2.rows == 1 and sum(r1 > r0 for r0, r1 in p2.row_blocks) == 128


def test_static_pairs_are_disjoint_and_below_p0():
    p = dec.plan(tokens=1, topk=8, hidden=2048, intermediate=768, grid=132)
    assert p.static_end == 2 * 132 * 15
    got = sorted(q for c in range(p.grid) for q in p.static_pairs(c))
    assert got == list(range(p.static_end))
    small = dec.plan(tokens=1, topk=1, hidden=128, intermediate=64, grid=100)  # fewer pairs than warps
    assert small.static_end == 64 and sorted(q for c in range(100) for q in small.static_pairs(c)) == list(range(64))


@pytest.mark.parametrize("seed", range(6))
def test_pairs_go_to_whichever_cta_asks(seed):
    """With the shared counter, some CTAs may take no pair at all (others took them all first) and still end; every
    pair is computed once and every slot counter reaches I."""
    p = dec.plan(tokens=1, topk=2, hidden=256, intermediate=64, grid=200)
    sim = dec.simulate(p, seed=seed)
    assert sim.error == 0 and sim.pairs_done == [1] * 128 and sim.counters == [64, 64]
    assert sim.rows_written == [1] * 256


@pytest.mark.parametrize("stall", [0, 7])
def test_stalled_slot_times_out_and_the_launch_ends(stall):
    p = dec.plan(tokens=1, topk=8, hidden=2048, intermediate=768, grid=132)
    sim = dec.simulate(p, seed=3, stall_slot=stall, timeout_polls=200)
    assert (sim.error, sim.error_slot) == (dec.ERR_INPUT_TIMEOUT, stall)
    assert sim.rows_written == [1] * 2048  # every CTA still ends (the rows are garbage; the host sees the error)


def test_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match="grid"):
        dec.plan(tokens=1, topk=8, hidden=2048, intermediate=768, grid=0)


def test_model_formulas_are_the_kernels():
    """The CUDA side's split (mk_decode.cuh) is the model's: rows ceil(H / grid), one CTA per SM, pairs handed out one
    at a time from the DEC_CNT_NEXT counter (zeroed by the last CTA), each CTA's per-slot counts added once the
    counter runs out."""
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    assert "d.rows = (int)((H + sms - 1) / sms);" in src and "d.grid = sms;" in src
    assert "r0 = blockIdx.x * d.rows" in src
    assert "int32_t* next = cnt + DEC_STRIDE * DEC_CNT_NEXT;" in src and src.count("atomicAdd(next, 1)") == 1
    assert f"constexpr int DEC_STATIC_ROUNDS = {dec.STATIC_ROUNDS};" in src and "DEC_THREADS = 512" in src
    assert dec.WARPS == 512 // 32
    assert "const int W = (int)gridDim.x * (DEC_WARPS - 1), wg = (int)blockIdx.x * (DEC_WARPS - 1) + warp - 1;" in src
    assert "const int P0 = (int)min(P, (int64_t)DEC_STATIC_ROUNDS * W);" in src
    assert "if (warp > 0 && r < DEC_STATIC_ROUNDS && wg + r * W < P0) return wg + W * r++;" in src
    assert "return lane == 0 ? P0 + atomicAdd(next, 1) : 0;" in src
    assert "cnt[DEC_STRIDE * DEC_CNT_NEXT] = 0;" in src
    assert "if (s_done[s]) red_release(cnt + DEC_STRIDE * s, s_done[s]);" in src


def test_config_decode_field():
    assert MegakernelConfig().decode == 1
    assert MegakernelConfig.parse("decode=0").decode == 0
    with pytest.raises(ConfigError, match="decode"):
        MegakernelConfig.parse("decode=2")


def test_counter_buffer_size_matches_the_kernel():
    """The layer allocates the decode kernel's counters and logit words (`_lib.DEC_CNT_WORDS`, zeros): the size the
    kernel indexes, and the logits past the counters (stored inverted, so zero means not yet written)."""
    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    consts = {n: int(v) for n, v in re.findall(r"\b(DEC_MAX_SLOTS|DEC_STRIDE|DEC_MAX_LOGITS) = (\d+)", src)}
    assert set(consts) == {"DEC_MAX_SLOTS", "DEC_STRIDE", "DEC_MAX_LOGITS"}
    assert "DEC_LOGIT0 = (DEC_MAX_SLOTS + 2) * DEC_STRIDE" in src and "DEC_CNT_WORDS = DEC_LOGIT0 + DEC_MAX_LOGITS" in src
    assert (consts["DEC_MAX_SLOTS"] + 2) * consts["DEC_STRIDE"] + consts["DEC_MAX_LOGITS"] == _lib.DEC_CNT_WORDS
    assert consts["DEC_MAX_SLOTS"] == dec.MAX_SLOTS  # the bound the bring-up report names
    assert "~__float_as_int(a)" in src and "__int_as_float(~wait_logit(" in src


@pytest.mark.parametrize("shape", SHAPES)
def test_task_count_is_counted(shape):
    """The CTA with the last exit ticket counts the tasks from the slot counters it zeroes (every pair computed, each
    CTA's signals being before its ticket) plus the CTAs with output rows."""
    s, k, h, i, g = shape
    p = dec.plan(tokens=s, topk=k, hidden=h, intermediate=i, grid=g)
    rows = -(-h // g)
    assert p.total == s * k * i + min(g, -(-h // rows))
    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    assert "int tasks = min((int)gridDim.x, (H + d.rows - 1) / d.rows);" in src
    assert "tasks += ld_relaxed(cnt + DEC_STRIDE * s);" in src
