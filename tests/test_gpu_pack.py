"""GPU test of the EP buffer's packing kernels (csrc/ep_pack.cu) against the torch ops they replace.

One GPU is enough (no exchange): random routing with out-of-range ids, several S and world sizes, for
every send row the kernels must write the same bytes as the torch path (EPBuffer._pack_torch), the same
token order (padded with S) and the same per-rank counts. Skipped with a reason without CUDA or nvcc.
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
        from moetune.runtime.buffer import EPBuffer
        from moetune.runtime.knobs import Knobs

        self.world, self.model, self.max_tokens = world, model, max_tokens
        self.hidden, self.topk, self.experts_per_rank = model.hidden, model.topk, model.experts // world
        self.dtype, self.device, self.knobs = torch.bfloat16, torch.device("cuda", 0), Knobs()
        self._stage = self._stage_views = self._send = None
        self._pack_lib = lib
        self._cls = EPBuffer
        EPBuffer._layout(self)

    def __getattr__(self, name):  # borrow EPBuffer's methods, bound to this object
        return getattr(self._cls, name).__get__(self)


@pytest.mark.parametrize(("world", "s"), [(2, 1), (2, 128), (2, 1000), (4, 257), (8, 64), (2, 0)])
def test_pack_kernels_equal_the_torch_path(world: int, s: int) -> None:
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
    send_f, tok_f, cnt_f = p._pack_fused(x, idx, w, s)
    send_f, tok_f, cnt_f = send_f.clone(), tok_f.clone(), cnt_f.clone()  # the torch path reuses the send buffer
    send_t, tok_t, cnt_t = p._pack_torch(x, idx, idx, w, s)
    torch.cuda.synchronize()
    assert torch.equal(cnt_f, cnt_t)
    assert torch.equal(tok_f, tok_t)
    n = int(cnt_t.sum())
    ids_end = p.weight_off + 4 * m.topk  # bytes the receiver reads: payload, ids, weights
    assert torch.equal(send_f[:n, :ids_end], send_t[:n, :ids_end])
