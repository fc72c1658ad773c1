"""The bring-up's microbenchmark plan and the proxy request batches it measures (CPU: no transfer runs)."""

from __future__ import annotations

import pytest

from moetune.tuner.measure import micro as microbench


def test_plan_says_why_each_benchmark_does_not_apply_on_a_cpu_node() -> None:
    rows = {(b.transport, b.runner): (ok, why) for b, ok, why in microbench.plan(["collective"], 0)}
    assert rows[("collective", "gloo_p2p")][0]
    assert rows[("nvlink", "nccl_p2p")] == (False, "needs 2 GPUs, node has 0")
    assert ("proxy", "proxy_signalled") not in rows  # only planned where two GPUs exist


def test_plan_on_two_gpus_includes_the_signalled_proxy_benchmark() -> None:
    rows = {(b.transport, b.runner): (ok, why) for b, ok, why in microbench.plan(["nvlink", "collective"], 2)}
    assert ("proxy", "proxy_signalled") in rows
    _ok, why = rows[("proxy", "proxy_signalled")]
    assert why  # applicable or not, it says why


@pytest.mark.parametrize("c", microbench.PROXY_CONCURRENCY)
def test_proxy_request_batches_follow_the_signalling(c: int) -> None:
    pytest.importorskip("torch")
    from moetune.runtime.transports import proxy as P

    for signalling in (None, "coupled", "decoupled"):
        reqs, npe, per = microbench.proxy_requests(c, 16384, signalling, src_base=1 << 20)
        puts = [r for r in reqs if r.op == P.OP_PUT]
        sigs = [r for r in reqs if r.op == P.OP_SIGNAL]
        assert npe * per == c == len(puts)
        assert all(r.bytes == 16384 for r in puts)
        assert sorted(r.src for r in puts) == [(1 << 20) + i * 16384 for i in range(c)]  # no two share a source
        if signalling == "coupled":
            assert all(r.flags & P.F_SIGNAL for r in puts) and not sigs
        elif signalling == "decoupled":
            assert not any(r.flags & P.F_SIGNAL for r in puts) and len(sigs) == npe
            # a PUT names the slot of the SIGNAL that covers it: the engine's peer_hash keeps them on one of the PE's
            # streams (nic_ordered needs it; csrc/proxy_engine.cpp)
            assert {(r.peer, r.signal_idx) for r in puts} <= {(r.peer, r.signal_idx) for r in sigs}
        else:
            assert not any(r.flags & P.F_SIGNAL for r in puts) and not sigs


def test_report_draws_signalled_efficiency_and_tabulates_fence_cost(tmp_path) -> None:
    from moetune.tuner.bringup.report import ReportData, write_report

    rows = []
    for d in ("0->1", "1->0"):
        for c in (1, 16, 96):
            for mode, fence, eff in (("coupled+proxy_drain", "proxy_drain", 1.0 / c), ("decoupled+nic_ordered", "nic_ordered", 0.8)):
                extra = {"mode": mode, "fence_mode": fence, "concurrency": c, "direction": d}
                rows.append({"kind": "signalled_efficiency", "transport": "proxy", "size_bytes": 16384, "value": eff,
                             "spread": 0.0, "unit": "ratio", "extra": extra})
                if mode.startswith("coupled"):
                    rows.append({"kind": "fence_cost", "transport": "proxy", "size_bytes": 16384, "value": 2.0 + c,
                                 "spread": 0.0, "unit": "us", "extra": extra})
    path = write_report(ReportData(node="test", fingerprint="f" * 16, measurements=rows), tmp_path)
    text = path.read_text()
    assert (tmp_path / "signalled.png").stat().st_size > 10_000
    assert "![Signalled against put-only throughput (measured)](signalled.png)" in text
    assert "| `proxy_drain` | 16 KiB | 3.00 | 18.00 | 98.00 |" in text


def test_a_report_rewritten_without_a_plot_removes_only_its_own_earlier_one(tmp_path) -> None:
    """`moetune report --out rA` for another node left the first node's latency/bandwidth plots beside a report
    that said nothing was measured. A plot file no earlier report of ours showed is the user's: kept."""
    from moetune.tuner.bringup.report import ReportData, write_report

    rows = [{"kind": "latency", "transport": "nvlink", "size_bytes": size, "value": 2.0 + size / 1e6, "spread": 0.1,
             "unit": "us", "extra": {}} for size in (1024, 65536, 1 << 20)]
    write_report(ReportData(node="a", fingerprint="a" * 16, measurements=rows), tmp_path)
    assert (tmp_path / "latency.png").exists()
    (tmp_path / "tuned.png").write_bytes(b"the user's")  # no earlier report showed a tuned.png
    text = write_report(ReportData(node="b", fingerprint="b" * 16), tmp_path).read_text()
    assert "latency.png" not in text and not (tmp_path / "latency.png").exists()
    assert (tmp_path / "tuned.png").read_bytes() == b"the user's"


def test_a_failed_microbenchmark_says_what_its_ranks_raised_not_their_tracebacks() -> None:
    """A gloo rank that could not find its interface: the error named two tracebacks' file and code lines ("File
    .../distributed_c10d.py, line 2169 ... backend_class = ProcessGroupGloo(") before the exception."""
    from moetune.tuner.measure.micro import failure_summary

    tb = ('Traceback (most recent call last):\n  File "/x/distributed_c10d.py", line 2169, in _new_group\n'
          "    backend_class = ProcessGroupGloo(\n                    ^^^^^^^^^^^^^^^^^\n"
          "RuntimeError: [enforce fail at device.cc:84] Unable to find address for: bogus0\n")
    out = failure_summary(tb + tb + "a rank failed (exit codes [1, 1])\n")
    assert out == "RuntimeError: [enforce fail at device.cc:84] Unable to find address for: bogus0 | a rank failed (exit codes [1, 1])"
    assert failure_summary("torch.distributed.DistBackendError: NCCL error\n") == "torch.distributed.DistBackendError: NCCL error"
    assert failure_summary("a\nb\nc\nd\ne\nf\n") == "b | c | d | e | f"  # no exception named: the output's end
