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
    assert p.rows == 16 and p.slots == p.n_tiles == 8
    assert sum(r1 > r0 for r0, r1 in p.row_blocks) == 128
    assert p.total == 132 + 128
    # contiguous, disjoint ranges that cover the pairs: 6144 over 132 CTAs, 46 or 47 each
    assert p.pair_ranges[0][0] == 0 and p.pair_ranges[-1][1] == 8 * 768
    assert all(a[1] == b[0] for a, b in zip(p.pair_ranges, p.pair_ranges[1:], strict=False))
    assert {q1 - q0 for q0, q1 in p.pair_ranges} == {46, 47}
    # a CTA whose range spans two slots signals both, with the pairs it did of each
    spans = [c for c in range(p.grid) if len(p.signals(c)) == 2]
    assert spans and all(sum(n for _, n in p.signals(c)) == p.pair_ranges[c][1] - p.pair_ranges[c][0] for c in spans)


def test_more_ctas_than_pairs_counts_only_working_ctas():
    p = dec.plan(tokens=1, topk=1, hidden=128, intermediate=64, grid=100)
    assert sum(q1 > q0 for q0, q1 in p.pair_ranges) == 64
    assert p.total == 64 + 64  # rows = ceil(128 / 100) = 2: 64 CTAs hold rows
    p2 = dec.plan(tokens=1, topk=1, hidden=128, intermediate=64, grid=200)
    assert p2.rows == 1 and sum(r1 > r0 for r0, r1 in p2.row_blocks) == 128


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
    """The CUDA side's split (mk_decode.cuh) uses the same formulas as the model: rows ceil(H / grid), pair ranges
    P c / G, one CTA per SM."""
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    assert "d.rows = (int)((H + sms - 1) / sms);" in src and "d.grid = sms;" in src
    assert re.search(r"q0 = P \* blockIdx\.x / gridDim\.x, q1 = P \* \(blockIdx\.x \+ 1\) / gridDim\.x", src)
    assert "r0 = blockIdx.x * d.rows" in src


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
    assert "DEC_LOGIT0 = (DEC_MAX_SLOTS + 1) * DEC_STRIDE" in src and "DEC_CNT_WORDS = DEC_LOGIT0 + DEC_MAX_LOGITS" in src
    assert (consts["DEC_MAX_SLOTS"] + 1) * consts["DEC_STRIDE"] + consts["DEC_MAX_LOGITS"] == _lib.DEC_CNT_WORDS
    assert consts["DEC_MAX_SLOTS"] == dec.MAX_SLOTS  # the bound the bring-up report names
    assert "~__float_as_int(a)" in src and "__int_as_float(~wait_logit(" in src


@pytest.mark.parametrize("shape", SHAPES)
def test_task_count_closed_form(shape):
    """The CTA with the last exit ticket writes the task count without a counter: min(P, grid) CTAs have pairs
    (the ranges P c / G grow by at most one per CTA when P < G) plus the CTAs with output rows."""
    s, k, h, i, g = shape
    p = dec.plan(tokens=s, topk=k, hidden=h, intermediate=i, grid=g)
    rows = -(-h // g)
    assert p.total == min(s * k * i, g) + min(g, -(-h // rows))
    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    assert "(int)min(P, (int64_t)gridDim.x) + min((int)gridDim.x, (H + d.rows - 1) / d.rows)" in src


# ---- the streaming kernel: the same split over the touched experts (one counter each) ----------------------------
STREAM_SHAPES = [  # (tokens, topk, hidden, intermediate, grid, touched experts)
    (16, 8, 2048, 768, 132, 84),   # Qwen3-30B-A3B at S = 16 (bench input 1 of run 94: 84 experts)
    (2, 8, 2048, 768, 132, 16),
    (4, 2, 256, 64, 7, 1),         # every slot on one expert
    (3, 4, 128, 64, 200, 5),       # more CTAs than units
]


@pytest.mark.parametrize("shape", STREAM_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_stream_every_unit_and_row_once_in_any_order(shape, seed):
    s, k, h, i, g, touched = shape
    p = dec.plan(tokens=s, topk=k, hidden=h, intermediate=i, grid=g, touched=touched)
    assert p.n_tiles == touched and p.slots == s * k
    sim = dec.simulate(p, seed=seed)
    assert sim.error == 0
    assert sim.pairs_done == [1] * (touched * i // 8)  # units of 8 columns
    assert sim.counters == [i] * touched
    assert sim.rows_written == [1] * h
    assert p.total == min(touched * i // 8, g) + min(g, -(-h // p.rows))


def test_stream_stalled_expert_times_out_and_no_experts_is_empty():
    p = dec.plan(tokens=16, topk=8, hidden=2048, intermediate=768, grid=132, touched=84)
    sim = dec.simulate(p, seed=4, stall_slot=40, timeout_polls=100)
    assert (sim.error, sim.error_slot) == (dec.ERR_INPUT_TIMEOUT, 40)
    assert sim.rows_written == [1] * 2048
    empty = dec.plan(tokens=2, topk=2, hidden=64, intermediate=32, grid=8, touched=0)  # every pick invalid
    sim = dec.simulate(empty)
    assert sim.error == 0 and sim.rows_written == [1] * 64 and empty.total == 0 + 8
    with pytest.raises(ValueError, match="touched"):
        dec.plan(tokens=2, topk=2, hidden=64, intermediate=32, grid=8, touched=5)
    with pytest.raises(ValueError, match="% 8"):
        dec.plan(tokens=2, topk=2, hidden=64, intermediate=36, grid=8, touched=2)


def test_stream_kernel_formulas_and_plan():
    """The streaming kernel splits nk x I/8 units as the model does (U c / G per CTA, one counter per touched expert
    counting 8 columns a unit, the same closed-form task count with U for P), sizes its ring from the shared memory
    left after its lists (at least three entries, one below x) and is chosen only where the staged kernel does not
    fit."""
    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    body = src[src.index("k_decode_stream(const MkParams p"):]
    assert re.search(r"u0 = U \* blockIdx\.x / gridDim\.x, u1 = U \* \(blockIdx\.x \+ 1\) / gridDim\.x", body)
    assert "const int JB = I / 8" in body and "const int64_t U = (int64_t)nk * JB;" in body
    assert "red_release(cnt + DEC_STRIDE * k, (int)(hi - lo) * 8);" in body
    assert "(int)min(U, (int64_t)gridDim.x) + min((int)gridDim.x, (H + d.rows - 1) / d.rows)" in body
    assert "p.ctl[MK_CTL_TILES] = nk;" in body
    plan = src[src.index("inline DecPlan dec_stream_plan("):]
    assert "if (ring < 3 || x_off < ring_off || (x_off - ring_off) / entry < 1) return d;" in plan
    assert "const int64_t entry = up(((int64_t)d.rows + hcap) * (I * 2 + DEC_PAD))" in plan
    mk = (_lib.source_dir() / "mk_moe.cu").read_text()
    assert "DecPlan d = S * K <= DEC_STAGED_SLOTS ? dec_plan(S, H, I, K, E, sms) : DecPlan{};" in mk
    assert "if (d.bytes == 0 || d.bytes > SMEM_MAX) d = dec_stream_plan(S, H, I, K, E, sms, SMEM_MAX);" in mk
    consts = dict(re.findall(r"\b(DEC_STAGED_SLOTS|DEC_MAX_SLOTS) = (\d+)", src))
    assert (int(consts["DEC_STAGED_SLOTS"]), int(consts["DEC_MAX_SLOTS"])) == (dec.STAGED_SLOTS, dec.MAX_SLOTS)


def test_config_decode_stream_field():
    assert MegakernelConfig().decode_stream == 1
    assert MegakernelConfig.parse("decode_stream=0").decode_stream == 0
    with pytest.raises(ConfigError, match="decode_stream"):
        MegakernelConfig.parse("decode_stream=3")


def _mma16816(a_regs, b_regs):
    """m16n8k16 as the PTX ISA lays out its fragments: lane (g, q) holds A (row g + 8 ((i >> 1) & 1), k 2q + (i & 1)
    + 8 (i >> 2)) as its element i = 0..7, B (k 2q + (i & 1) + 8 (i >> 1), column g) as element i = 0..3. Rebuilds A
    and B from the lanes' elements and returns A @ B (16 x 8), with every element placed exactly once."""
    import numpy as np

    a, b = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        for i in range(8):
            a[g + 8 * ((i >> 1) & 1), 2 * q + (i & 1) + 8 * (i >> 2)] = a_regs[lane][i]
        for i in range(4):
            b[2 * q + (i & 1) + 8 * (i >> 1), g] = b_regs[lane][i]
    assert not np.isnan(a).any() and not np.isnan(b).any()
    return a @ b


def _words(v, w):
    """32-bit word w of a 16-byte run: its two bf16 elements, the lower one first."""
    return [v[2 * w], v[2 * w + 1]]


def test_permuted_k_mma_chunk_is_the_dot_product():
    """mma_chunk32 (mk_decode.cuh): each lane passes its 16-byte runs (elements 8q .. 8q+7 of A rows g, g + 8 and of B
    column g) as words 2s, 2s + 1 of step s; the two steps' products add up to the 32-wide chunk's A @ B."""
    import numpy as np

    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((16, 32)), rng.standard_normal((32, 8))
    out = np.zeros((16, 8))
    for s in range(2):
        a_regs, b_regs = [], []
        for lane in range(32):
            g, q = lane >> 2, lane & 3
            # the lane's 16 bytes of A rows g, g + 8 and of B column g
            ag, ag8, xb = A[g, 8 * q:8 * q + 8], A[g + 8, 8 * q:8 * q + 8], B[8 * q:8 * q + 8, g]
            # a = {ag.w[2s], ag8.w[2s], ag.w[2s+1], ag8.w[2s+1]}, b = {x.w[2s], x.w[2s+1]}
            a_regs.append(_words(ag, 2 * s) + _words(ag8, 2 * s) + _words(ag, 2 * s + 1) + _words(ag8, 2 * s + 1))
            b_regs.append(_words(xb, 2 * s) + _words(xb, 2 * s + 1))
        out += _mma16816(a_regs, b_regs)
    np.testing.assert_allclose(out, A @ B, rtol=1e-12, atol=1e-12)
    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    assert "const uint32_t a[4] = {ag.x, ag8.x, ag.y, ag8.y};" in src and "mma16816(c, a, b.x, b.y);" in src
    assert "const uint32_t a[4] = {ag.z, ag8.z, ag.w, ag8.w};" in src and "mma16816(c, a, b.z, b.w);" in src
