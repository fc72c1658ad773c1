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
    assert sim.rows_written == [1] * 2048  # every CTA still ends (the host sees the error)
    assert sim.aborted and sim.rows_nan == [1] * 2048 and sim.rows_stale == 0  # every CTA waits on the stalled slot


@pytest.mark.parametrize("shape", SHAPES)
def test_an_aborted_launch_writes_no_finite_row_over_missing_h(shape):
    """A CTA whose logit wait gave up (decode = 2) stores no h (its picks are -1) but still signals its pairs; a CTA
    that got every logit could see the counts complete and sum the last launch's h into finite-looking rows (only the
    failed CTA writing NaN). The failed CTA raises or sees the abort before signalling, and every CTA reads the flag
    before its exit ticket: in any CTA order, no row is written finite unless every pair's h was computed."""
    s, k, h, i, g = shape
    p = dec.plan(tokens=s, topk=k, hidden=h, intermediate=i, grid=g)
    working = [c for c in range(g) if p.pair_ranges[c][1] > p.pair_ranges[c][0]]
    stale_before = 0
    for seed in range(6):
        fail = {working[(seed * 7) % len(working)]}
        sim = dec.simulate(p, seed=seed, failed=fail, timeout_polls=50)
        assert sim.aborted and sim.rows_written == [1] * h and sim.rows_stale == 0
        assert all(sim.rows_nan[r] for c in fail for r in range(*p.row_blocks[c]))
        stale_before += dec.simulate(p, seed=seed, failed=fail, timeout_polls=50, nan_if_aborted=False).rows_stale
        sim = dec.simulate(p, seed=seed)  # no failure: nothing NaN
        assert not sim.aborted and sim.rows_nan == [0] * h and sim.rows_stale == 0
    assert stale_before > 0  # without the NaN on abort (nan_if_aborted=False): finite rows over h never computed


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


def test_phase3_moves_w_down_to_registers_during_the_slot_wait():
    """Phase 3 (runs 167-168): each warp's first DEC_PRE k-rounds of W_down leave shared memory for registers once
    the copies landed and before the slot poll; h comes from the L2 after the poll's barrier (no shared copy); the
    warp's first unit takes the rounds held in registers, its later units all rounds from shared memory."""
    from moetune.runtime.megakernel import _lib

    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    body = src[src.index("if (nr > 0) {\n    // 3."):]
    order = [body.index(k) for k in ("mbar_wait(p, bar, 0", "wpre[j][r] = ", "wait_count(p, cnt + DEC_STRIDE * tid")]
    order.append(body.index("__syncthreads();", order[-1]))
    order.append(body.index("__ldcg(hg + "))
    assert order == sorted(order)
    assert "h_off" not in src and "constexpr int DEC_PRE = MK_DEC_PRE;" in src
    assert "unit_sums(warp, a, lane + 32 * DEC_PRE);" in body and "for (int u = warp + DEC_WARPS; u < units" in body


@pytest.mark.parametrize("n_pairs", [0, 1, 3, 4, 5, 16, 46, 47, 63, 373])
@pytest.mark.parametrize("hidden", [128, 1024, 2048, 2560])
def test_phase2_items_cover_every_pair_and_plane_once(n_pairs, hidden):
    """Phase 2's items (GROUP pairs x VEC k planes) cover each (pair, plane) of the CTA exactly once, no warp takes
    more than ceil(items / warps) of them (warp 0 the fewest: it starts late), and each pair's batches are distinct
    slots of the kernel's partial sums."""
    per_warp = dec.pair_items(n_pairs, hidden)
    planes = hidden // dec.PLANE
    seen = [(pr, kt) for rows in per_warp for pr, k0, k1 in rows for kt in range(k0, k1)]
    assert sorted(seen) == [(pr, kt) for pr in range(n_pairs) for kt in range(planes)]
    nb = -(-planes // dec.VEC)
    items = -(-n_pairs // dec.GROUP) * nb
    counts = [len({(pr // dec.GROUP, k0) for pr, k0, _ in rows}) for rows in per_warp]
    assert sum(counts) == items and max(counts, default=0) <= -(-items // dec.WARPS) and counts[0] == min(counts)
    batches = [(pr, k0 // dec.VEC) for rows in per_warp for pr, k0, _ in rows]
    assert len(set(batches)) == len(batches) == n_pairs * nb


def test_phase2_formulas_are_the_kernels():
    """The kernel's phase-2 loop uses the model's split (pair_items) and constants."""
    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    assert f"DEC_VEC = {dec.VEC};" in src and "DEC_THREADS = 512" in src and dec.WARPS == 512 // 32
    assert "const int items = (n2 + 3) / 4 * NB, R2 = (items + DEC_WARPS - 1) / DEC_WARPS;" in src
    assert "const int i_lo = warp ? warp - 1 : (DEC_WARPS - 1) * R2, i_step = warp ? DEC_WARPS - 1 : 1;" in src
    assert "const int pr = it / NB * 4 + (lane >> 3), kt0 = it % NB * DEC_VEC;" in src
    assert "[it % NB * d.pairs + pr]" in src and "NB = (H / 64 + DEC_VEC - 1) / DEC_VEC" in src


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
    assert "~__float_as_int(a)" in src and "const int v = wait_logit(p, cnt + DEC_LOGIT0 + i, i);" in src
    assert "lg[i] = __int_as_float(~v);" in src


def _kernel_src() -> tuple[str, str]:
    """(wait_logit's body, k_decode's body) of mk_decode.cuh, comments dropped."""
    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    code = "\n".join(line.split("//")[0] for line in src.splitlines()) + "\n"
    wl = code[code.index("int wait_logit("):]
    body = code[code.index("void __launch_bounds__(DEC_THREADS, 1) k_decode("):]
    return wl[:wl.index("\n}\n")], body[:body.index("\n}\n")]


def test_decode_abort_flag_is_the_launchs_own():
    """The decode kernel's waits poll, and its reports raise, its own abort flag (a word of its counters), never ctl's
    MK_CTL_ABORT: only the task graph's routing kernels lift that one (every launch), and no kernel runs before a
    decode launch, so an earlier launch's error (k_lists' bad id) left every later decode launch aborted from its
    start. The CTA with the last exit ticket zeroes the flag with the counters; the host's constant is the kernel's."""
    src = (_lib.source_dir() / "mk_decode.cuh").read_text()
    assert "DEC_CNT_TICKET = DEC_MAX_SLOTS, DEC_ABORT = DEC_STRIDE * DEC_CNT_TICKET + 16," in src
    ticket = 32 * dec.MAX_SLOTS  # the exit ticket's word (DEC_STRIDE * DEC_CNT_TICKET)
    word = _lib.DEC_ABORT
    assert word == ticket + 16
    # in the ticket's 128-byte line (apart from the slot counters and the logits), not its 32-byte sector
    assert ticket < word < ticket + 32 and word // 8 != ticket // 8
    wl, body = _kernel_src()
    assert "MK_CTL_ABORT" not in wl and "MK_CTL_ABORT" not in body
    assert "if (*(volatile int32_t*)&p.dec_cnt[DEC_ABORT]) break;" in wl
    assert re.search(r"report\(p, MK_ERR_INPUT_TIMEOUT, [^;]*, p\.dec_cnt \+ DEC_ABORT\);", wl)
    assert "int32_t* const dab = cnt + DEC_ABORT;" in body
    calls = re.findall(r"\b(report|mbar_wait|wait_count)\(([^;]*)\);", body)
    assert {c[0] for c in calls} == {"report", "mbar_wait", "wait_count"} and len(calls) == 5
    assert all(args.replace(" ", "").endswith(",dab") for _, args in calls), calls
    last = body[body.index("if (tid == 0 && ticket == (int)gridDim.x - 1) {"):]
    assert "cnt[DEC_ABORT] = 0;" in last
    # every CTA's waits come before its ticket: the ones owning no rows take it after their pairs' signals
    assert body.index("if (nr == 0) ticket = atom_add_acq_rel(") > body.index("wait_logit(")
    assert body.index("wait_count(p, cnt") < body.index("      ticket = atom_add_acq_rel(")


def test_failed_logit_wait_routes_nothing():
    """A CTA whose logit wait gave up (a timeout, or this launch aborted) routes nothing: its picks stay -1 (no top-k on
    logits never written, no weight read for them; block 0 leaves -1 in topk_idx), it stores no h for them, and its
    output rows are written NaN (not computed), never a sum that looks like an output. It still signals its pairs, so
    every CTA with rows reads the abort flag after its slot waits and before its exit ticket (the last ticket's CTA
    lifts the flag) and writes its rows NaN where it is set (the model: test_an_aborted_launch_writes_no_finite_row_*)."""
    _, body = _kernel_src()
    assert "if (v == 0) s_failed = 1;" in body and body.count("failed = s_failed != 0;") == 2
    assert body.index("if (v == 0) s_failed = 1;") < body.index("failed = s_failed != 0;")
    waits = body.index("wait_count(p, cnt + DEC_STRIDE * tid")
    read = body.index("if (*(volatile int32_t*)dab) s_failed = 1;")
    ticket = body.index("ticket = atom_add_acq_rel(cnt + DEC_STRIDE * DEC_CNT_TICKET, 1);", waits)
    final = body.rindex("failed = s_failed != 0;")
    assert waits < body.index("__syncthreads();", waits) < read < ticket < final < body.index("bf16* out = (bf16*)p.out;")
    assert body.index("__syncthreads();", ticket) < final  # the flag reaches every thread through a barrier
    assert "int e = -1, bad = -1;" in body and "if (!failed) warp_topk<NI>(" in body
    assert "if (lane < K && !failed && (e < 0 || e >= E)) {" in body
    assert "if (s_e[(int)((q0 + pr) / I)] < 0) continue;" in body
    assert "__float2bfloat16(failed ? __int_as_float(0x7fffffff)" in body
    # the shared flag is set to 0 before the barrier that precedes the logit waits
    assert body.index("s_failed = 0;") < body.index("pdl_enter(p);") < body.index("wait_logit(")


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
