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

