"""GPU test of the EP buffer's packing kernels (csrc/ep_pack.cu) against the torch ops they replace.

One GPU is enough (no exchange): random routing with out-of-range ids, several S and world sizes, for
every send row the kernels must write the same bytes as the torch path (EPBuffer._pack_torch), the same
token order (padded with S) and the same per-rank counts; the inverse map must point every (token, rank)
at the row that carries it; combine's reduce kernel must equal zeros + index_add (bit for bit where a
token has at most two rows, as with 2 ranks) for every activation dtype. Skipped with a reason without
CUDA or nvcc.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _lib():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from moetune.runtime import csrc_build

    ok, why = csrc_build.availability()
    if not ok:
        pytest.skip(f"csrc library unavailable: {why}")
    return csrc_build.load()


class _Packer:
    """The attributes EPBuffer's packing methods read, for one (model, world) without a process group."""

    def __init__(self, model, world: int, max_tokens: int, lib):
        from moetune.runtime.buffer.facade import EPBuffer
        from moetune.runtime.knobs import Knobs
        from moetune.runtime.options import RuntimeOptions

        self.world, self.model, self.max_tokens = world, model, max_tokens
        self.hidden, self.topk, self.experts_per_rank = model.hidden, model.topk, model.experts // world
        self.dtype, self.device, self.knobs = torch.bfloat16, torch.device("cuda", 0), Knobs()
        self._stage = self._stage_views = self._send = None
        self._pack_lib = lib
        self._gather = False
        self.options = RuntimeOptions()
        self._cls = EPBuffer
        EPBuffer._layout(self)

    def __getattr__(self, name):  # borrow EPBuffer's methods, bound to this object
        return getattr(self._cls, name).__get__(self)


@pytest.mark.parametrize("mode", [1, 2])  # the one-CTA plan and the grid plan
@pytest.mark.parametrize(("world", "s"), [(2, 1), (2, 128), (2, 1000), (4, 257), (8, 64), (2, 0), (2, 5000), (8, 3001)])
def test_pack_kernels_equal_the_torch_path(world: int, s: int, mode: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.shapes import get_model

    lib = _lib()
    m = get_model("qwen3-30b")
    g = torch.Generator(device="cpu").manual_seed(world * 1000 + s)
    x = torch.randn(s, m.hidden, generator=g).to(torch.bfloat16).cuda()
    idx = torch.rand(s, m.experts, generator=g).topk(m.topk, dim=1).indices
    if s:
        idx[0, 0] = m.experts + 3  # out of range: counted for no rank, never sent
        idx[s // 2, 1] = -1
    idx = idx.cuda()
    w = torch.rand(s, m.topk, generator=g).cuda()
    p = _Packer(m, world, max(s, 1), lib)
    from moetune.runtime.options import RuntimeOptions

    p.options = RuntimeOptions(plan_mode=mode)
    send_f, tok_f, cnt_f, inv = p._pack_fused(x, idx, w, s)
    send_f, tok_f, cnt_f = send_f.clone(), tok_f.clone(), cnt_f.clone()  # the torch path reuses the send buffer
    send_t, tok_t, cnt_t = p._pack_torch(x, idx, idx, w, s)
    torch.cuda.synchronize()
    assert torch.equal(cnt_f, cnt_t)
    assert torch.equal(tok_f, tok_t)
    n = int(cnt_t.sum())
    ids_end = p.weight_off + 4 * m.topk  # bytes the receiver reads: payload, ids, weights
    assert torch.equal(send_f[:n, :ids_end], send_t[:n, :ids_end])
    # the inverse map: (t, d) -> the row carrying token t to rank d, -1 where t has no expert on d
    epr = m.experts // world
    ids, inv = idx.cpu(), inv.cpu()
    tok = tok_f.cpu().tolist()
    starts = [0]
    for c in cnt_t.cpu().tolist():
        starts.append(starts[-1] + c)
    for t in range(s):
        for d in range(world):
            needs = any(0 <= e < m.experts and e // epr == d for e in ids[t].tolist())
            r = int(inv[t, d])
            if needs:
                assert starts[d] <= r < starts[d + 1] and tok[r] == t, (t, d, r)
            else:
                assert r == -1, (t, d, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("world", "s", "hidden"), [(2, 300, 2048), (2, 7, 1025), (4, 129, 2880), (2, 0, 64)])
def test_combine_reduce_equals_index_add(dtype: torch.dtype, world: int, s: int, hidden: int) -> None:
    from moetune.runtime.shapes import get_model

    lib = _lib()
    m = get_model("qwen3-30b")
    g = torch.Generator(device="cpu").manual_seed(world * 7 + s + hidden)
    idx = torch.rand(s, m.experts, generator=g).topk(m.topk, dim=1).indices
    if s:
        idx[0] = m.experts + 1  # a token routed nowhere: its output is zero
    idx = idx.cuda()
    tok = torch.empty(s * world, dtype=torch.int64, device="cuda")
    inv = torch.empty(s, world, dtype=torch.int64, device="cuda")
    cnt = torch.empty(world, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    scratch = torch.empty(max(1, lib.mt_pack_plan_scratch(s, world)), dtype=torch.int32, device="cuda")
    assert lib.mt_pack_plan(idx.data_ptr(), s, m.topk, m.experts, world, tok.data_ptr(), cnt.data_ptr(),
                            inv.data_ptr(), scratch.data_ptr(), 0, stream) == 0
    # rows as they come back, in a wider buffer (row stride hidden + 8) to test the strided read
    back_full = torch.randn(s * world + 1, hidden + 8, generator=g).to(dtype).cuda()
    back = back_full[:, :hidden]
    code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
    out = torch.full((s, hidden), float("nan"), dtype=dtype, device="cuda")
    assert lib.mt_combine_reduce(back.data_ptr(), back.stride(0), inv.data_ptr(), s, world, hidden, code,
                                 out.data_ptr(), stream) == 0
    ref = torch.zeros(s + 1, hidden, dtype=dtype, device="cuda")
    ref.index_add_(0, tok, back[: s * world])
    ref32 = torch.zeros(s + 1, hidden, dtype=torch.float32, device="cuda")
    ref32.index_add_(0, tok, back[: s * world].float())
    torch.cuda.synchronize()
    if s:
        assert not torch.isnan(out).any()
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    if world == 2:  # two rows at most: one rounding either way
        assert torch.equal(out, ref[:s])
    else:  # fp32 accumulation, one rounding: within one unit of the dtype of the exact sum
        tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
        err = (out.float() - ref32[:s]).abs() / ref32[:s].abs().clamp_min(1.0)
        assert s == 0 or float(err.max()) <= tol * 1.01


@pytest.mark.parametrize("granularity", ["per_token", "per_128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_kernels_write_the_bytes_of_the_torch_path(dtype: torch.dtype, granularity: str) -> None:
    """csrc/ep_fp8.cu quantises into wire rows and dequantises them with the arithmetic of runtime/fp8.py:
    the same fp8 bytes, scales and dequantised values, bit for bit (tiny, huge and zero rows included)."""
    from moetune.runtime.fp8 import dequantise, fp8_available, num_scale_groups, quantise_into

    if not fp8_available():
        pytest.skip("this torch build has no float8_e4m3fn")
    lib = _lib()
    s, h, k = 257, 2048, 8
    g = torch.Generator(device="cpu").manual_seed(7)
    x = (torch.randn(s, h, generator=g) * torch.logspace(-3, 3, s).unsqueeze(1)).to(dtype)
    x[3] = 0.0  # an all-zero token: scale from the tiny floor
    x = x.cuda()
    idx = torch.randint(0, 128, (s, k), generator=g).cuda()
    w = torch.rand(s, k, generator=g).cuda()
    groups = num_scale_groups(h, granularity)
    id_off, weight_off = h, h + 8 * k
    scale_off = weight_off + 4 * k
    row_bytes = (scale_off + 4 * groups + 15) // 16 * 16
    rows = torch.zeros(s, row_bytes, dtype=torch.uint8, device="cuda")
    code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
    stream = torch.cuda.current_stream().cuda_stream
    assert lib.mt_fp8_quant_rows(x.data_ptr(), code, s, h, groups, idx.data_ptr(), w.data_ptr(), k, rows.data_ptr(),
                                 row_bytes, id_off, weight_off, scale_off, stream) == 0
    ref_rows = torch.zeros_like(rows)  # the torch path EPBuffer takes without the kernels
    q_ref = ref_rows[:, :h]
    sc_ref = ref_rows.view(torch.float32).narrow(1, scale_off // 4, groups)
    quantise_into(x, q_ref, sc_ref, granularity)
    torch.cuda.synchronize()
    assert torch.equal(rows[:, :h], q_ref)
    assert torch.equal(rows[:, scale_off : scale_off + 4 * groups].view(torch.float32), sc_ref)
    assert torch.equal(rows[:, id_off:weight_off].view(torch.int64), idx)
    assert torch.equal(rows[:, weight_off:scale_off].view(torch.float32), w)
    out = torch.empty(s, h, dtype=dtype, device="cuda")
    assert lib.mt_fp8_dequant_rows(rows.data_ptr(), row_bytes, s, h, groups, scale_off, code, out.data_ptr(),
                                   stream) == 0
    ref = dequantise(q_ref, sc_ref, dtype)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
