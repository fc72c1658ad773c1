"""CPU checks of what the one-sided transports hand their kernels (compiled library and symmetric buffers faked, as
in tests/test_onesided_send_rows_cpu.py): a proxy call inside a CUDA-graph capture, whose host epoch the graph would
replay, and the nvlink kernels' row reads of a one-row tensor whose columns are not adjacent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moetune.runtime.knobs import default_knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.transports import proxy as proxy_mod
from moetune.runtime.transports._onesided import OneSidedError
from moetune.runtime.transports.nvlink import NvlinkTransport
from moetune.runtime.transports.proxy import ProxyTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_onesided_send_rows_cpu import RecLib, _on_cpu
from test_onesided_send_rows_cpu import lib as lib  # the fixture the tests take (re-exported: ruff keeps it)


def test_proxy_refuses_a_call_captured_in_a_cuda_graph(lib: RecLib, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's call epoch is a kernel argument from the host (mt_pxy_exchange / mt_pxy_counts take it): a captured
    call replays the epoch of the capture. Every replay after the first, and the first after any eager call, then
    finds its signal slots already at that epoch (>= is all the wait asks) and its count words from an earlier replay
    with the same tag, so it reads rows before they land: wrong rows, no error. Refused before any launch instead
    (graph_capturable is False); an eager call still runs."""
    t = _on_cpu(ProxyTransport(None, default_knobs("proxy"), torch.device("cuda", 0), options=RuntimeOptions(),
                               max_send_rows=8, row_bytes=32))
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA build (the stand-in answers for it)
        monkeypatch.setattr(proxy_mod, "capturing", lambda device: True)
        sc = torch.tensor([2])
        with pytest.raises(OneSidedError, match="CUDA graph"):
            t.exchange_counts(sc)
        with pytest.raises(OneSidedError, match="CUDA graph"):
            t.exchange(torch.zeros(2, 8), sc, sc)
        assert not [n for n, _ in lib.calls if n in ("mt_pxy_exchange", "mt_pxy_counts")]
        assert (t._epoch, t._counts_epoch) == (0, 0)  # nothing consumed: the ranks stay in step
        monkeypatch.setattr(proxy_mod, "capturing", lambda device: False)
        t.exchange(torch.zeros(2, 8), sc, sc)
        assert lib.args_of("mt_pxy_exchange")[-2] == 1  # the epoch
    finally:
        t.close()


def test_nvlink_copies_a_one_row_tensor_whose_columns_are_not_adjacent(lib: RecLib) -> None:
    """The strided exchange and the gather read each row as row_bytes contiguous bytes. A one-row tensor skipped the
    column-stride check (it looked at rows > 1 only): [1, H] with column stride 2 (a column of a wider tensor) went
    to the kernel as is, and its bytes (every other element, and those of the next columns) were sent in place of
    the row. Such a tensor is sent through a contiguous copy, as one of more rows is."""
    t = _on_cpu(NvlinkTransport(None, default_knobs("nvlink"), torch.device("cuda", 0), options=RuntimeOptions(),
                                max_send_rows=64, row_bytes=256))
    try:
        base = torch.arange(16, dtype=torch.float32).reshape(1, 16)
        rows = base[:, ::2]  # [1, 8], column stride 2
        n_strided = len([n for n, _ in lib.calls if n == "mt_nvl_exchange_strided"])
        t.exchange_strided(rows, torch.tensor([1]), torch.tensor([1]))
        assert len([n for n, _ in lib.calls if n == "mt_nvl_exchange_strided"]) == n_strided  # not read in place
        a = lib.args_of("mt_nvl_exchange")
        sent = t._keep[0]
        assert a[1] == sent.data_ptr() and sent.is_contiguous() and torch.equal(sent, rows)

        x = torch.arange(16, dtype=torch.bfloat16).reshape(1, 16)[:, ::2]  # one token, column stride 2
        idx, w = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2)
        tok = torch.zeros(1, dtype=torch.int64)
        t.dispatch_gather(x, tok, idx, w, torch.tensor([1]), row_bytes=64, id_off=16, weight_off=32)
        a = lib.args_of("mt_nvl_exchange_gather")
        sent_x = t._keep[0]
        assert a[1] == sent_x.data_ptr() and sent_x.is_contiguous() and torch.equal(sent_x, x)
        assert a[3] == 16 and a[4] == 16  # x_stride, payload_bytes: one row of 8 bf16
    finally:
        t.close()
