"""CPU-side checks of the one-sided transports: import, absence reporting, knob validation, nvcc build."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_sim

ROOT = Path(__file__).resolve().parents[1]


def test_transports_import_and_report_absence_without_cuda() -> None:
    import torch

    from moetune.runtime.transports.registry import get_transport

    for name in ("nvlink", "proxy"):
        cls = get_transport(name)
        assert cls.name == name
        a = cls.availability(None)
        if not torch.cuda.is_available():
            assert not a.ok
            assert "CUDA" in a.reason  # a clear reason, not an exception


def test_one_sided_transports_refuse_a_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU machine too (here with the library and one GPU faked): a buffer on the CPU never gets nvlink or proxy,
    so a CPU EPBuffer's fallback stays collective (the GPU machine's suite caught it, run 164)."""
    import torch

    from moetune.runtime import csrc_build
    from moetune.runtime.transports.registry import get_transport

    monkeypatch.setattr(csrc_build, "availability", lambda: (True, "built"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("nvlink", "proxy"):
        a = get_transport(name).availability(torch.device("cpu"))
        assert not a.ok and "needs a CUDA device, the buffer is on cpu" in a.reason
        assert get_transport(name).availability(torch.device("cuda", 0)).ok


def test_host_staged_availability_probes_the_library_only_for_its_native_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """EPBuffer asks every transport's availability with its options before building it; probing the compiled library
    may build csrc/ with nvcc, which host_staged needs only with hs_native (found in review: a build ran with
    MOETUNE_HS_NATIVE=0)."""
    import torch
    import torch.distributed as dist

    from moetune.runtime import csrc_build
    from moetune.runtime.options import RuntimeOptions
    from moetune.runtime.transports.host_staged import HostStagedTransport

    probed: list[int] = []
    monkeypatch.setattr(csrc_build, "availability", lambda: (probed.append(1), (True, "built"))[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    cuda = torch.device("cuda", 0)
    a = HostStagedTransport.availability(cuda, RuntimeOptions(hs_native=False))
    assert a.ok and "MOETUNE_HS_NATIVE=0" in a.reason and probed == [], (a, probed)
    a = HostStagedTransport.availability(cuda, RuntimeOptions(hs_native=True))
    assert a.ok and "copy engines" in a.reason and probed == [1], (a, probed)


def test_csrc_build_module_reports_absence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from moetune.runtime import csrc_build

    monkeypatch.setenv("MOETUNE_NVCC", str(tmp_path / "no-such-nvcc"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(csrc_build.Path, "is_file", lambda self: False)
    assert csrc_build.find_nvcc() is None
    with pytest.raises(csrc_build.BuildError, match="nvcc not found"):
        csrc_build.build()
    ok, why = csrc_build.availability()
    assert not ok and why


def test_cache_key_depends_on_arch_and_compiler() -> None:
    from moetune.runtime import csrc_build

    a = csrc_build.build_key("nvcc 13.0", "sm_90")
    assert a == csrc_build.build_key("nvcc 13.0", "sm_90")
    assert a != csrc_build.build_key("nvcc 13.0", "sm_100")
    assert a != csrc_build.build_key("nvcc 12.8", "sm_90")


def test_arch_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime import csrc_build

    monkeypatch.setenv("MOETUNE_CUDA_ARCH", "90")
    assert csrc_build.cuda_arch() == "sm_90"
    monkeypatch.setenv("MOETUNE_CUDA_ARCH", "sm_100")
    assert csrc_build.cuda_arch() == "sm_100"


def test_knobs_refuse_round_robin_nic_ordered_with_several_qps() -> None:
    from moetune.runtime.knobs import KnobError, Knobs
    from moetune.runtime.transports.proxy import validate_modes

    with pytest.raises(KnobError) as e:
        Knobs(transport="proxy", fence_mode="nic_ordered", qp_mapping="round_robin", qps_per_pe=2)
    assert "qp_mapping" in e.value.knobs
    with pytest.raises(KnobError):
        validate_modes("nic_ordered", "round_robin", 4)
    # the safe neighbours are accepted
    validate_modes("nic_ordered", "peer_hash", 4)
    validate_modes("nic_ordered", "round_robin", 1)
    validate_modes("proxy_drain", "round_robin", 4)


def test_proxy_engine_validates_before_touching_cuda() -> None:
    from moetune.runtime.knobs import KnobError
    from moetune.runtime.transports.proxy import ProxyEngine

    with pytest.raises(KnobError):
        ProxyEngine(0, [0], [0], [0], qps=4, qp_mapping="round_robin", fence_mode="nic_ordered")


def test_request_layout_matches_csrc() -> None:
    from moetune.runtime.transports.proxy import Request

    assert ctypes.sizeof(Request) == 64
    assert Request.seq.offset == 56 and Request.src.offset == 16 and Request.value.offset == 40
    header = (ROOT / "csrc" / "proxy_engine.h").read_text()
    assert "sizeof(MtRequest) == 64" in header


def test_limits_match_csrc() -> None:
    from moetune.runtime.transports import _onesided

    header = (ROOT / "csrc" / "mt_common.h").read_text()
    assert f"#define MT_MAX_WORLD {_onesided.MAX_WORLD}" in header
    assert f"#define MT_MAX_SLOTS {_onesided.MAX_SLOTS}" in header


def test_no_bare_device_synchronize_outside_the_bounded_wait() -> None:
    """Every wait of the transports' library for the device's work is bounded (mt::device_sync_within, directly or
    through mt::setup_sync_within in the creations): a bare cudaDeviceSynchronize, on the caller's thread, waits for
    a stuck persistent kernel forever. The one call left is device_sync_within's, on a thread of its own."""
    calls = {}
    for f in sorted((ROOT / "csrc").glob("*.[ch]*")):
        code = [ln.split("//", 1)[0] for ln in f.read_text().splitlines()]
        n = sum("cudaDeviceSynchronize(" in ln for ln in code)
        if n:
            calls[f.name] = n
    assert calls == {"mt_common.h": 1}, calls


def test_error_decoding_is_readable() -> None:
    from moetune.runtime.transports._onesided import decode_error

    msg = decode_error([2, 1, 0, 5, 7, 3, 0, 7] + [0] * 8)
    assert "timeout waiting for a data signal" in msg and "rank 1" in msg and "slot 5" in msg


def test_bench_scripts_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    for script in ("bench/proxy_micro.py", "bench/tools/onesided_ep.py", "bench/tools/ep_kernels.py"):
        r = subprocess.run([sys.executable, script, "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "dry-run" in r.stdout
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").rglob("*.sh")
                     if "results" not in p.relative_to(ROOT).parts)  # every shell script
    assert "bench/tools/device_env.sh" in scripts and not any("gpu_run" in s for s in scripts)
    for sh in scripts:
        r = subprocess.run(["bash", "-n", sh], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (sh, r.stderr)


@pytest.mark.slow
@pytest.mark.skipif(
    not any(Path(p).is_file() for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc")) and not os.environ.get("CUDA_HOME"),
    reason="nvcc not installed here",
)
def test_csrc_compiles_with_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime import csrc_build

    if csrc_build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path))
    monkeypatch.setenv("MOETUNE_CUDA_ARCH", "sm_90")
    info = csrc_build.build()
    assert info.built and info.path.exists()
    again = csrc_build.build()
    assert not again.built and again.path == info.path  # cached
    lib = ctypes.CDLL(str(info.path))
    csrc_build._bind(lib)  # every symbol the Python side calls exists
    assert lib.mt_abi_version() == csrc_build.ABI_VERSION


def test_exchange_tool_summarises_its_rows() -> None:
    """bench/tools/onesided_ep.py's table: a row per measured case, an ERROR row for a case whose run raised."""
    stat = {"median": 30.0, "p10": 29.0, "p90": 31.0, "n": 20}
    ep = [
        {"bench": "onesided_ep", "transport": "nvlink", "knobs": "signalling=coupled,num_sms=24", "model": "qwen3-30b",
         "tokens": 128, "rank": 0, "dispatch_us": stat, "combine_us": stat, "layer_us": stat, "layer_us_graph": stat,
         "host_issue_us": stat, "GBps_dispatch": 20.0, "roundtrip_equal": True},
        {"bench": "onesided_ep", "transport": "nvlink", "knobs": "x", "model": "qwen3-30b", "tokens": 16384, "rank": 0,
         "dispatch_us": stat, "combine_us": stat, "layer_us": stat, "GBps_dispatch": 340.0, "roundtrip_equal": True},
        {"bench": "onesided_ep", "transport": "proxy", "knobs": "y", "rank": 0, "error": "Traceback\nOneSidedError: boom"},
    ]
    sys.path.insert(0, str(ROOT / "bench" / "tools"))
    try:
        import onesided_ep

        lines = onesided_ep.summarize(ep)
    finally:
        sys.path.pop(0)
    assert any("ERROR" in ln for ln in lines) and len(lines) == 4


@pytest.fixture(scope="module")
def sim_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:

    tmp_path = tmp_path_factory.mktemp("mtsim")

    out = proxy_sim.build(tmp_path / "libmtsim.so")
    from moetune.runtime import csrc_build

    lib = ctypes.CDLL(str(out))
    for name in ("mt_proxy_create", "mt_proxy_enqueue", "mt_proxy_quiesce", "mt_proxy_stats", "mt_proxy_error",
                 "mt_proxy_bench", "mt_proxy_destroy", "mt_last_error", "mt_proxy_reset_stats", "mt_proxy_set_batch",
                 "mt_proxy_set_timeout", "mt_pxy_create", "mt_pxy_set_data", "mt_pxy_set_host_wait", "mt_pxy_counts", "mt_pxy_exchange",
                 "mt_pxy_error", "mt_pxy_destroy", "mt_proxy_diag", "mt_proxy_cpu", "mt_proxy_cpu_list"):
        res, args = csrc_build.SIGNATURES[name]
        getattr(lib, name).restype = res
        getattr(lib, name).argtypes = args
    lib.mt_proxy_mark_gpu_producer_internal.argtypes = [ctypes.c_void_p]
    lib.mtsim_set_async.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.mtsim_set_async.restype = None
    lib.mtsim_set_idle_naps.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong]
    lib.mtsim_set_idle_naps.restype = None
    lib.mtsim_set_alias.argtypes = [ctypes.c_int]
    lib.mtsim_set_alias.restype = None
    lib.mtsim_stream_create.restype = ctypes.c_void_p
    for name in ("mtsim_stream_destroy", "mtsim_stream_sync"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = None
    lib.mtsim_stream_wait_word.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64, ctypes.c_double]
    lib.mtsim_stream_wait_word.restype = None
    lib.mt_pxy_sim_done.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)),
                                    ctypes.POINTER(ctypes.c_uint64)]
    return lib


@pytest.mark.parametrize("fence_mode,qp_mapping,batch", [(1, 0, 1), (1, 1, 1), (2, 1, 1), (0, 0, 1), (2, 1, 32), (1, 0, 8)])
def test_proxy_engine_drain_loop_in_host_simulation(
    sim_lib: ctypes.CDLL, fence_mode: int, qp_mapping: int, batch: int
) -> None:
    """The real engine (FIFO, drain loop, fence modes, flow control) with host stand-ins for CUDA."""
    from moetune.runtime.transports.proxy import F_SIGNAL, OP_PUT, OP_SIGNAL, OP_WRITE64, STAT_NAMES, Request

    lib = sim_lib
    npeers, size, per = 3, 256, 70
    src = (ctypes.c_uint8 * (npeers * per * size))(*[(i * 7) % 251 for i in range(npeers * per * size)])
    data = [(ctypes.c_uint8 * (per * size))() for _ in range(npeers)]
    ctrl = [(ctypes.c_uint64 * 64)() for _ in range(npeers)]
    sig = [(ctypes.c_uint64 * 128)() for _ in range(npeers)]
    addr = lambda a: ctypes.addressof(a)  # noqa: E731
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    h = ctypes.c_void_p()
    rc = lib.mt_proxy_create(0, npeers, u64([addr(d) for d in data]), u64([addr(c) for c in ctrl]),
                             u64([addr(s) for s in sig]), 2, qp_mapping, fence_mode, 16, None, 0, 20.0, ctypes.byref(h))
    assert rc == 0, lib.mt_last_error()
    try:
        assert lib.mt_proxy_set_batch(h, batch) == 0
        reqs = []
        for p in range(npeers):
            for t in range(per):
                reqs.append(Request(OP_PUT, p, F_SIGNAL if t % 4 == 0 else 0, t,
                                    addr(src) + (p * per + t) * size, t * size, size, 41, 0, 0))
            reqs.append(Request(OP_SIGNAL, p, 0, 100, 0, 0, 0, 42, 0, 0))
            reqs.append(Request(OP_WRITE64, p, 0, 0, 0, 8 * 5, 0, 0xABC, 0, 0))
        arr = (Request * len(reqs))(*reqs)
        assert lib.mt_proxy_enqueue(h, arr, len(arr), 10.0) == 0, lib.mt_last_error()  # 16-slot ring wraps
        assert lib.mt_proxy_quiesce(h, 10.0) == 0, lib.mt_last_error()
        for p in range(npeers):
            assert bytes(data[p]) == bytes(src)[p * per * size : (p + 1) * per * size]
            assert all(sig[p][t] == 41 for t in range(0, per, 4)) and sig[p][1] == 0
            assert sig[p][100] == 42 and ctrl[p][5] == 0xABC
        st = (ctypes.c_uint64 * len(STAT_NAMES))()
        lib.mt_proxy_stats(h, st, len(STAT_NAMES))
        stats = dict(zip(STAT_NAMES, list(st), strict=True))
        nsig = npeers * (len(range(0, per, 4)) + 1)
        assert stats["processed"] == len(reqs) and stats["puts"] == npeers * per and stats["signals"] == nsig
        assert stats["drains"] == (nsig if fence_mode == 1 else 0)
        if batch == 1:
            assert stats["batches"] == 0  # (with batching, how many PUTs meet in one drain depends on timing)
        # the microbenchmark entry point: epoch-valued signals, one time per iteration
        out = (ctypes.c_double * 4)()
        assert lib.mt_proxy_bench(h, arr, len(arr), 4, 1000, 10, 10.0, out) == 0, lib.mt_last_error()
        assert all(x > 0 for x in out) and sig[0][0] == 1030 and sig[2][100] == 1030
        # a host producer excludes GPU producers
        assert lib.mt_proxy_mark_gpu_producer_internal(h) != 0
        # a bad request is reported, the engine keeps draining
        bad = (Request * 2)(Request(OP_PUT, 99, 0, 0, addr(src), 0, 1, 0, 0, 0), Request(OP_SIGNAL, 0, 0, 7, 0, 0, 0, 5, 0, 0))
        lib.mt_proxy_enqueue(h, bad, 2, 10.0)
        assert lib.mt_proxy_quiesce(h, 10.0) != 0
        buf = ctypes.create_string_buffer(256)
        assert lib.mt_proxy_error(h, buf, 256) != 0 and b"out of range" in buf.value
    finally:
        lib.mt_proxy_destroy(h)


# (knob name, signalling coupled?, group_size, chunk_rows, qps, qp_mapping, fence_mode, batch, world)
EXCHANGE_VARIANTS = [
    ("drain-coupled-1qp", 1, 0, 0, 1, 1, 1, 1, 2),
    ("drain-decoupled-rr2-chunk3", 0, 0, 3, 2, 0, 1, 1, 2),
    ("ordered-decoupled-hash4-chunk4", 0, 0, 4, 4, 1, 2, 1, 2),
    ("ordered-coupled-hash2-chunk5", 1, 0, 5, 2, 1, 2, 1, 2),
    ("ordered-decoupled-g2-rr1-chunk2", 0, 2, 2, 1, 0, 2, 1, 2),
    ("ordered-decoupled-hash2-batch8", 0, 0, 2, 2, 1, 2, 8, 3),
]


def _run_ranks(rank_main, world: int) -> None:
    """One thread per simulated rank; each must finish within 120 s."""
    import threading

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"


def _sim_exchange(lib: ctypes.CDLL, variant: tuple, *, async_delay_us: int = -1, timeout_s: float = 5.0,
                  iters: int = 40, skew: bool = False, read_late: bool = False) -> tuple[list[str], list[int], bytes]:
    """Run counts + exchange `iters` times on one CPU thread per rank (csrc/proxy_xchg.h, the code the
    kernels run) against real proxy engines; async_delay_us >= 0: asynchronous simulated streams, every
    copy delayed that long. Each rank sends from one buffer it reuses, as EPBuffer reuses its send rows: filled
    before each call and overwritten as soon as the call returns (a call may return only once its own PUTs have
    read it: the kernel's ACK wait). read_late: each rank reads the rows of call e only in call e+2, after its
    counts and before its exchange (the latest a caller may: the view stays valid until the second next exchange),
    and slowly (read twice, 2 ms apart). Returns (failures, engine 0's stats, engine 0's diagnostic line)."""
    import numpy as np

    _name, coupled, group, chunk, qps, mapping, fence, batch, world = variant
    max_rows, row_bytes = 24, 48
    ctrl_bytes = 8 * 8 * 1024 + 8 * 2 * 8 + 8 * 2 * 8 * 8  # MT_CTRL_BYTES
    per_parity = world * max_rows * row_bytes
    ctrl = [np.zeros(ctrl_bytes // 8, dtype=np.uint64) for _ in range(world)]
    data = [np.zeros(2 * per_parity, dtype=np.uint8) for _ in range(world)]
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    cptr = [c.ctypes.data for c in ctrl]
    dptr = [d.ctypes.data for d in data]
    engines, ctxs = [], []
    lib.mtsim_set_async(1 if async_delay_us >= 0 else 0, max(0, async_delay_us))
    try:
        for r in range(world):
            h = ctypes.c_void_p()
            rc = lib.mt_proxy_create(0, world, u64(dptr), u64(cptr), u64([c + 8 * r * 1024 for c in cptr]), qps,
                                     mapping, fence, 32, None, 0, 20.0, ctypes.byref(h))
            assert rc == 0, lib.mt_last_error()
            engines.append(h)
            assert lib.mt_proxy_set_batch(h, batch) == 0
            x = ctypes.c_void_p()
            assert lib.mt_pxy_create(h, 0, r, world, cptr[r], timeout_s, ctypes.byref(x)) == 0, lib.mt_last_error()
            assert lib.mt_pxy_set_data(x, per_parity) == 0
            ctxs.append(x)
        rng = np.random.default_rng(7)
        counts = rng.integers(0, max_rows // world + 1, size=(iters, world, world))  # [it, src, dst]
        counts[::5, :, 0] = 0
        if skew:  # rank 0 sends the most rows, the others one: they finish their own sends long before rank 0's land
            counts[:, 0, :] = max_rows // world
            counts[:, 1:, :] = 1
        sends = [[rng.integers(0, 255, size=(int(counts[it, r].sum()), row_bytes), dtype=np.uint8)
                  for r in range(world)] for it in range(iters)]
        failures: list[str] = []

        def rank_main(r: int) -> None:
            err = (ctypes.c_int * 16)()
            recv = np.zeros(world, dtype=np.int64)
            send = np.full((max_rows, row_bytes), 0xDD, dtype=np.uint8)  # this rank's send rows, reused

            def read(it: int, linger: float = 0.0) -> None:
                """Check the rows call `it` delivered here, then poison them (nobody writes this area before our
                call it+2); `linger`: check them again that much later."""
                par = (it + 1) & 1
                out = data[r][par * per_parity : (par + 1) * per_parity].reshape(-1, row_bytes)
                want = np.concatenate([
                    sends[it][s][int(counts[it, s, :r].sum()) : int(counts[it, s, : r + 1].sum())] for s in range(world)
                ])
                assert np.array_equal(out[: len(want)], want), f"it {it}: rank {r} received wrong rows"
                if linger:
                    time.sleep(linger)
                    assert np.array_equal(out[: len(want)], want), (
                        f"it {it}: rank {r}'s rows were overwritten while it read them, before its call {it + 2}")
                out[: len(want)] = 0xEE

            try:
                for it in range(iters):
                    epoch = it + 1
                    sc = np.ascontiguousarray(counts[it, r], dtype=np.int64)
                    rc = lib.mt_pxy_counts(ctxs[r], sc.ctypes.data, recv.ctypes.data, epoch, 0)
                    assert rc == 0, f"counts rc {rc}: {lib.mt_last_error()}"
                    assert recv.tolist() == counts[it, :, r].tolist(), f"it {it}: counts {recv} != {counts[it, :, r]}"
                    if read_late and it >= 2:
                        read(it - 2, linger=0.002)
                    rows = len(sends[it][r])
                    send[:rows] = sends[it][r]
                    rcv = recv.copy()
                    rc = lib.mt_pxy_exchange(ctxs[r], send.ctypes.data, len(send), row_bytes, sc.ctypes.data, rcv.ctypes.data,
                                             coupled, group, chunk, epoch, 0)
                    send.fill(0xDD)  # the caller's next use of its rows: a PUT still reading them sends this
                    assert rc == 0, f"exchange rc {rc}: {lib.mt_last_error()}"
                    lib.mt_pxy_error(ctxs[r], err)
                    assert err[0] == 0, f"it {it}: error record {list(err)[:8]}"
                    if not read_late:
                        read(it)
                for it in range(max(0, iters - 2), iters) if read_late else ():
                    read(it)
            except BaseException as e:
                failures.append(f"rank {r}: {e}")

        _run_ranks(rank_main, world)
        st = (ctypes.c_uint64 * 10)()
        lib.mt_proxy_stats(engines[0], st, 10)
        buf = ctypes.create_string_buffer(512)
        lib.mt_proxy_diag(engines[0], buf, 512)
        return failures, list(st), buf.value
    finally:
        for x in ctxs:
            lib.mt_pxy_destroy(x)
        for h in engines:
            lib.mt_proxy_destroy(h)
        lib.mtsim_set_async(0, 0)


@pytest.mark.parametrize("variant", EXCHANGE_VARIANTS, ids=[v[0] for v in EXCHANGE_VARIANTS])
def test_proxy_exchange_many_iterations_in_host_simulation(sim_lib: ctypes.CDLL, variant: tuple) -> None:
    """counts + exchange, 40 calls without barriers, random counts (zeros included), a 32-slot FIFO
    (wraps, flow control), outputs poisoned after being checked: every epoch delivers exactly what the
    senders sent, with no error and no timeout."""
    failures, st, diag = _sim_exchange(sim_lib, variant)
    assert not failures, failures
    assert st[7] == 40  # one ACK per exchange
    assert diag.startswith(b"thread idle at slot ") and b"acks 40" in diag, diag


@pytest.mark.parametrize("variant", EXCHANGE_VARIANTS, ids=[v[0] for v in EXCHANGE_VARIANTS])
def test_proxy_exchange_with_asynchronous_streams_in_host_simulation(sim_lib: ctypes.CDLL, variant: tuple) -> None:
    """The same with asynchronous simulated streams (each QP stream a thread running its operations in
    order, every copy 150 µs late): the safe fence modes still deliver every row before its signal (batched
    PUTs too: issued before the signal behind them), and a call returns only once its own PUTs have read the
    send rows (the reused send buffer is overwritten at once)."""
    failures, st, _ = _sim_exchange(sim_lib, variant, async_delay_us=150, iters=20)
    assert not failures, failures
    assert st[7] == 20


@pytest.mark.parametrize("variant", [EXCHANGE_VARIANTS[0], EXCHANGE_VARIANTS[5]], ids=lambda v: v[0])
def test_a_late_reader_keeps_its_rows_until_its_call_two_later_in_host_simulation(sim_lib: ctypes.CDLL,
                                                                                   variant: tuple) -> None:
    """The receive view of call e stays valid until the caller's call e+2: a rank that reads it only then (after
    that call's counts, slowly) still finds its rows, because a sender writes the area of call e+2 only once the
    receiver entered it (its count-matrix row of that call)."""
    failures, st, _ = _sim_exchange(sim_lib, variant, iters=12, read_late=True)
    assert not failures, failures
    assert st[7] == 12


@pytest.mark.parametrize("variant", [EXCHANGE_VARIANTS[1], EXCHANGE_VARIANTS[5]], ids=lambda v: v[0])
def test_proxy_kernel_calls_wake_sleeping_engines_in_host_simulation(sim_lib: ctypes.CDLL, variant: tuple) -> None:
    """Each counts/exchange launch wakes its idle-sleeping engine and keeps it polling until the kernel finished
    (mt_proxy_expect_internal): with every idle sleep 30 s long, a sleep that only a timeout ended would exceed the
    calls' 5 s timeout. The engines sleep between the calls (the harness's setup alone outlasts the 200 us grace)."""
    lib = sim_lib
    lib.mtsim_set_idle_naps(30 * 10**9, 30 * 10**9)
    try:
        failures, st, _ = _sim_exchange(lib, variant, async_delay_us=150, iters=8)
    finally:
        lib.mtsim_set_idle_naps(0, 0)
    assert not failures, failures
    assert st[7] == 8


def test_round_robin_nic_ordered_race_shows_with_asynchronous_streams(sim_lib: ctypes.CDLL) -> None:
    """What Knobs refuses: round_robin + nic_ordered with 2 QPs puts a signal on another stream than its
    data, so a receiver can see the signal first and read stale rows. Same settings with peer_hash: clean.
    The race is a matter of thread timing: on a loaded machine one run of 10 calls may not lose it, so the unsafe
    setting gets up to five runs to show it (a safe ordering never shows it, however many)."""
    unsafe = ("rr-nic-ordered-2qp", 1, 0, 2, 2, 0, 2, 1, 2)  # coupled: each signal on the stream after its PUT's
    seen: list[list[str]] = []
    for _ in range(5):
        failures, _, _ = _sim_exchange(sim_lib, unsafe, async_delay_us=300, iters=10, timeout_s=1.0, skew=True)
        seen.append(failures)
        if any("received wrong rows" in f for f in failures):
            break
    else:
        raise AssertionError(f"the unsafe ordering delivered every row in five runs: {seen}")
    safe = ("hash-nic-ordered-2qp", 1, 0, 2, 2, 1, 2, 1, 2)
    failures, _, _ = _sim_exchange(sim_lib, safe, async_delay_us=300, iters=10, timeout_s=1.0, skew=True)
    assert not failures, failures




def test_registry_resolves_the_onesided_transports() -> None:
    from moetune.runtime.transports.nvlink import NvlinkTransport
    from moetune.runtime.transports.proxy import ProxyTransport
    from moetune.runtime.transports.registry import available_transports, get_transport

    assert get_transport("nvlink") is NvlinkTransport and get_transport("proxy") is ProxyTransport
    av = available_transports("cpu")
    for name in ("nvlink", "proxy"):
        assert name in av and isinstance(av[name].reason, str) and av[name].reason
    import torch

    if not torch.cuda.is_available():
        assert not av["nvlink"].ok and not av["proxy"].ok


def test_epbuffer_reserves_the_receive_buffer_of_onesided_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    """EPBuffer calls reserve(max_tokens, row_bytes) once on a transport that has it, and its packed
    rows go through exchange() with counts per rank, returning a padded capacity view (as nvlink/proxy do)."""
    import torch

    from moetune.runtime.buffer import facade as B
    from moetune.runtime.knobs import default_knobs
    from moetune.runtime.shapes import get_model
    from moetune.runtime.transports.base import Availability, EPTransport

    calls: list[tuple] = []

    class FakeOneSided(EPTransport):
        name = "nvlink"

        @classmethod
        def availability(cls, device=None, options=None) -> Availability:
            return Availability(True, "fake")

        def reserve(self, max_send_rows: int, row_bytes: int) -> None:
            calls.append(("reserve", max_send_rows, row_bytes))
            self.cap = max_send_rows * self.world * row_bytes

        def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
            return send_counts.clone()

        def exchange(self, send, send_counts, recv_counts):
            rows = send.shape[0]
            assert send_counts.tolist() == [rows] and recv_counts.tolist() == [rows]
            assert rows * send[:1].numel() * send.element_size() <= self.cap
            calls.append(("exchange", rows))
            pad = torch.full((rows + 5, *send.shape[1:]), 7, dtype=send.dtype)  # capacity rows past the data
            pad[:rows] = send
            return pad

    monkeypatch.setattr(B, "get_transport", lambda name: FakeOneSided)
    m = get_model("qwen3-30b")
    buf = B.EPBuffer(None, default_knobs("nvlink"), model=m, max_tokens=16, device="cpu", dtype=torch.float32)
    assert calls == [("reserve", 16, buf.row_bytes)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, m.hidden, generator=g)
    idx = torch.rand(12, m.experts, generator=g).topk(m.topk, dim=1).indices
    w = torch.rand(12, m.topk, generator=g)
    recv_x, _meta, handle = buf.dispatch(x, idx, w)
    out = buf.combine(recv_x.contiguous(), handle)
    assert torch.equal(out, x)  # world 1: every token comes back once
    assert [c[0] for c in calls].count("reserve") == 1 and [c[0] for c in calls].count("exchange") == 3


def test_proxy_exchange_alone_times_out_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """A rank whose peer never comes: its call returns (bounded) with a count-word timeout in the error
    record, instead of hanging; the proxy thread is idle (it consumed everything it was given)."""
    import time

    import numpy as np

    lib = sim_lib
    world = 2
    ctrl = [np.zeros(8 * 1024 + 2 * 8 + 2 * 64, dtype=np.uint64) for _ in range(world)]
    data = [np.zeros(4096, dtype=np.uint8) for _ in range(world)]
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    cptr = [c.ctypes.data for c in ctrl]
    h, x = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.mt_proxy_create(0, world, u64([d.ctypes.data for d in data]), u64(cptr), u64(cptr), 1, 1, 1, 64, None, 0,
                               20.0, ctypes.byref(h)) == 0
    try:
        assert lib.mt_pxy_create(h, 0, 0, world, cptr[0], 0.3, ctypes.byref(x)) == 0
        sc = np.ones(world, dtype=np.int64)
        rc = np.zeros(world, dtype=np.int64)
        t0 = time.monotonic()
        assert lib.mt_pxy_counts(x, sc.ctypes.data, rc.ctypes.data, 1, 0) == 0, lib.mt_last_error()
        assert time.monotonic() - t0 < 10
        err = (ctypes.c_int * 16)()
        lib.mt_pxy_error(x, err)
        assert err[0] == 1 and err[2] == 1  # count-word timeout, peer 1
        buf = ctypes.create_string_buffer(512)
        lib.mt_proxy_diag(h, buf, 512)
        assert b"idle at slot 2" in buf.value and b"words 2" in buf.value, buf.value
    finally:
        if x:
            lib.mt_pxy_destroy(x)
        lib.mt_proxy_destroy(h)


def test_proxy_calls_give_the_caller_its_own_device_back_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """Building, using and destroying a proxy transport on device 1 leaves the calling thread's current device as it
    was (3 here): every C entry point that switches device restores it on return (mt::DeviceGuard), or the thread
    stays on the transport's device (torch.cuda.set_device undone by a create, or by a GC finalizer's destroy on
    any thread)."""
    import numpy as np

    lib = sim_lib
    ctrl = np.zeros(8 * 1024 + 2 * 8 + 2 * 64, dtype=np.uint64)
    data = np.zeros(2 * 4096, dtype=np.uint8)
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    h, x = ctypes.c_void_p(), ctypes.c_void_p()
    lib.mtsim_set_device(3)
    try:
        assert lib.mt_proxy_create(1, 1, u64([data.ctypes.data]), u64([ctrl.ctypes.data]), u64([ctrl.ctypes.data]), 1,
                                   1, 1, 64, None, 0, 20.0, ctypes.byref(h)) == 0, lib.mt_last_error()
        assert lib.mtsim_get_device() == 3
        assert lib.mt_pxy_create(h, 1, 0, 1, ctrl.ctypes.data, 5.0, ctypes.byref(x)) == 0, lib.mt_last_error()
        assert lib.mtsim_get_device() == 3
        assert lib.mt_pxy_set_data(x, 4096) == 0
        send = np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)
        sc, rc = np.array([4], dtype=np.int64), np.zeros(1, dtype=np.int64)
        assert lib.mt_pxy_counts(x, sc.ctypes.data, rc.ctypes.data, 1, 0) == 0, lib.mt_last_error()
        assert lib.mtsim_get_device() == 3 and rc.tolist() == [4]
        assert lib.mt_pxy_exchange(x, send.ctypes.data, 4, 16, sc.ctypes.data, rc.ctypes.data, 1, 0, 0, 1, 0) == 0, \
            lib.mt_last_error()
        assert lib.mtsim_get_device() == 3
        err = (ctypes.c_int * 16)()
        lib.mt_pxy_error(x, err)
        assert err[0] == 0, list(err)
        assert (data[4096 : 4096 + 64].reshape(4, 16) == send).all()  # epoch 1: parity 1
        assert lib.mt_pxy_destroy(x) == 0
        x = ctypes.c_void_p()
        assert lib.mtsim_get_device() == 3
        assert lib.mt_proxy_destroy(h) == 0
        h = ctypes.c_void_p()
        assert lib.mtsim_get_device() == 3
    finally:
        if x:
            lib.mt_pxy_destroy(x)
        if h:
            lib.mt_proxy_destroy(h)
        lib.mtsim_set_device(0)


@pytest.mark.parametrize("timeout_s", [1e11, float("inf")])
def test_a_huge_timeout_waits_instead_of_failing_at_once_in_host_simulation(sim_lib: ctypes.CDLL,
                                                                            timeout_s: float) -> None:
    """timeout_s=1e11 (or inf) means "wait as long as it takes" (the library caps it at a week, mt::timeout_ns): an
    exchange that needs a few waits succeeds: (uint64_t)(timeout_s * 1e9) is out of range (gcc gives 0), and
    uncapped would time out every wait that does not see its word at once. Asynchronous streams with a copy delay
    make the waits real."""
    import numpy as np

    world, rb, rows = 2, 32, 6
    sim_lib.mtsim_set_async(1, 2000)
    ranks = proxy_sim.SimRanks(sim_lib, world, 64 * rb, timeout_s=timeout_s)
    try:
        for epoch in (1, 2, 3):
            sends = [np.full((rows, rb), 16 * epoch + r, dtype=np.uint8) for r in range(world)]
            out = ranks.exchange(sends, [[3, 3], [3, 3]], epoch, chunk_rows=1)
            for r, o in enumerate(out):
                assert o["rc_counts"] == 0 and o["rc"] == 0 and o["err"][0] == 0, (r, o["err"][:8])
                assert o["recv"] == [3, 3]
                assert [int(row[0]) for row in o["rows"][:6]] == [16 * epoch] * 3 + [16 * epoch + 1] * 3
    finally:
        ranks.close()
        sim_lib.mtsim_set_async(0, 0)


# negative: caught by the exchange_counts call before the exchange (slot 3: a count no count word carries); the
# exchange then refuses the same counts before any PUT (its refusal unrecorded behind the first)
@pytest.mark.parametrize("counts,err,seen", [([3, 3], [8, 0, 1, 1], 6), ([-1, 2], [8, 0, 0, 3], -1)],
                         ids=["past-the-rows", "negative"])
def test_send_counts_outside_the_send_rows_are_refused_before_any_put_in_host_simulation(
        sim_lib: ctypes.CDLL, counts: list[int], err: list[int], seen: int) -> None:
    """Rank 0's send buffer holds 4 rows (the memory after it: 0xEE rows). Send counts that sum past 4 rows, or a
    negative one, would make PUTs whose source lies outside the buffer (the 0xEE rows landing in rank 1's receive
    area, and both calls succeeding). The kernel refuses the counts before any PUT: rank 0 reports
    MT_ERR_SEND_COUNTS (peer = the first bad destination; slot 0: negative, 1: past the rows), and no byte outside a
    send buffer reaches any rank. Rank 0 still publishes its count-matrix row, marked refused, so rank 1 reports
    MT_ERR_PEER_REFUSED naming rank 0 at once, not after its count-word timeout (20 s here)."""
    import numpy as np

    from moetune.runtime.transports._onesided import decode_error

    world, rb, rows = 2, 32, 4
    big = np.full((3 * rows, rb), 0xEE, dtype=np.uint8)
    big[:rows] = 10
    ranks = proxy_sim.SimRanks(sim_lib, world, 16 * rb, timeout_s=20.0)
    try:
        t0 = time.monotonic()
        out = ranks.exchange([big[:rows], np.full((rows, rb), 11, dtype=np.uint8)], [counts, [2, 2]])
        seconds = time.monotonic() - t0
        assert not any((d == 0xEE).any() for d in ranks.data), "bytes from outside rank 0's send rows were sent"
    finally:
        ranks.close()
    r0, r1 = out
    assert r0["rc"] == 0 and r0["err"][:4] == err, r0["err"][:8]
    got = (r0["err"][5] & 0xFFFFFFFF) | ((r0["err"][6] & 0xFFFFFFFF) << 32)
    assert got == seen % (1 << 64) and r0["err"][7] == (rows if seen >= 0 else -1), r0["err"][:8]
    assert r1["rc"] == 0 and r1["err"][:4] == [9, 1, 0, -1], r1["err"][:8]  # rank 1: rank 0 refused (its marked row)
    assert seconds < 10, seconds  # not the 20 s count-word timeout
    msg = decode_error(r0["err"])
    assert "send_counts do not fit the send rows" in msg, msg
    if seen < 0:
        assert "exchange_counts: rank 0's count for rank 0 is -1, outside 0..549755813887" in msg, msg
    else:
        assert "send counts through rank 1 add up to 6 rows; send holds 4 rows" in msg, msg
        assert "the other ranks' calls fail at once" in msg, msg
    msg = decode_error(r1["err"])
    assert "a peer refused its send counts: rank 0 refused its send counts in this call" in msg, msg


def _alias_run(lib: ctypes.CDLL, host_wait: int, iters: int = 8) -> list[str]:
    """Two ranks, asynchronous "kernels", every stream of the process (QP streams and each rank's compute
    stream) aliased onto ONE simulated hardware queue; after each launch the caller queues work behind the
    kernel on its compute stream (as the GPU tests do: an event for NCCL, a copy to the host), then waits
    for it. Returns the failures seen."""
    import numpy as np

    world, max_rows, row_bytes = 2, 16, 32
    per_parity = world * max_rows * row_bytes
    ctrl = [np.zeros(8 * 1024 + 2 * 8 + 2 * 64, dtype=np.uint64) for _ in range(world)]
    data = [np.zeros(2 * per_parity, dtype=np.uint8) for _ in range(world)]
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    cptr = [c.ctypes.data for c in ctrl]
    lib.mtsim_set_async(1, 0)
    lib.mtsim_set_alias(1)
    engines, ctxs, comp = [], [], []
    failures: list[str] = []
    try:
        for r in range(world):
            h, x = ctypes.c_void_p(), ctypes.c_void_p()
            assert lib.mt_proxy_create(0, world, u64([d.ctypes.data for d in data]), u64(cptr),
                                       u64([c + 8 * r * 1024 for c in cptr]), 1, 1, 2, 64, None, 0, 20.0, ctypes.byref(h)) == 0
            engines.append(h)
            assert lib.mt_pxy_create(h, 0, r, world, cptr[r], 1.0, ctypes.byref(x)) == 0
            assert lib.mt_pxy_set_data(x, per_parity) == 0
            lib.mt_pxy_set_host_wait(x, host_wait)
            ctxs.append(x)
            comp.append(lib.mtsim_stream_create())

        def queue_behind_kernel(r: int) -> None:
            word, n = ctypes.POINTER(ctypes.c_uint64)(), ctypes.c_uint64()
            lib.mt_pxy_sim_done(ctxs[r], ctypes.byref(word), ctypes.byref(n))
            lib.mtsim_stream_wait_word(comp[r], word, n.value, 5.0)
            lib.mtsim_stream_sync(comp[r])

        def rank_main(r: int) -> None:
            err = (ctypes.c_int * 16)()
            recv = np.zeros(world, dtype=np.int64)
            sc = np.full(world, 3, dtype=np.int64)
            send = np.full((3 * world, row_bytes), 10 + r, dtype=np.uint8)
            for it in range(iters):
                assert lib.mt_pxy_counts(ctxs[r], sc.ctypes.data, recv.ctypes.data, it + 1, 0) == 0
                queue_behind_kernel(r)
                assert lib.mt_pxy_exchange(ctxs[r], send.ctypes.data, len(send), row_bytes, sc.ctypes.data, None, 0, 0, 0,
                                           it + 1, 0) == 0
                queue_behind_kernel(r)
                lib.mt_pxy_error(ctxs[r], err)
                if err[0] != 0:
                    failures.append(f"rank {r} call {it + 1}: error record {list(err)[:8]}")
                    return

        _run_ranks(rank_main, world)
        return failures
    finally:
        for x in ctxs:
            lib.mt_pxy_destroy(x)
        for h in engines:
            lib.mt_proxy_destroy(h)
        for s in comp:
            lib.mtsim_stream_destroy(s)
        lib.mtsim_set_alias(0)
        lib.mtsim_set_async(0, 0)


def test_host_completed_calls_survive_hardware_queue_aliasing_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """A model of run 1's proxy failure and of its fix. Asynchronous calls (run 1): work the caller queues
    behind the spinning kernel shares a hardware queue with the proxy's QP stream, the proxy's stream writes
    wait behind it, and the kernel times out. Host-completed calls (now): nothing is queued behind a running
    kernel, every call completes."""
    assert _alias_run(sim_lib, host_wait=1) == []
    failures = _alias_run(sim_lib, host_wait=0)
    assert failures and all("error record" in f for f in failures), failures


def test_quiesce_is_bounded_when_a_qp_stream_never_completes_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """mt_proxy_quiesce(timeout) must end within its timeout, in a reported error, when a QP stream stays busy: here
    the engine's stream shares one simulated hardware queue with work that waits for a word nobody writes (as a copy
    behind a spinning kernel). A cudaStreamSynchronize there would wait as long as the blocker does (8 s here,
    forever on a GPU) and then return success."""
    from moetune.runtime.transports.proxy import OP_WRITE64, Request

    lib = sim_lib
    lib.mtsim_set_async(1, 0)
    lib.mtsim_set_alias(1)
    sink: list = []
    gate = (ctypes.c_uint64 * 1)()
    h = None
    try:
        h = _sim_engine(lib, None, sink)
        queue = lib.mtsim_stream_create()  # the one hardware queue: also the engine's QP stream
        lib.mtsim_stream_wait_word(queue, ctypes.cast(gate, ctypes.POINTER(ctypes.c_uint64)), 1, 8.0)
        req = (Request * 1)(Request(OP_WRITE64, 0, 0, 0, 0, 8, 0, 7, 0, 0))
        assert lib.mt_proxy_enqueue(h, req, 1, 5.0) == 0, lib.mt_last_error()
        t0 = time.monotonic()
        rc = lib.mt_proxy_quiesce(h, 0.5)
        took = time.monotonic() - t0
        assert rc == 213 and b"did not complete" in lib.mt_last_error(), (rc, lib.mt_last_error())
        assert took < 4.0, took
        gate[0] = 1  # the blocker ends: the write lands and the engine quiesces
        assert lib.mt_proxy_quiesce(h, 10.0) == 0, lib.mt_last_error()
        assert sink[1][1] == 7
    finally:
        gate[0] = 1
        if h is not None:
            lib.mt_proxy_destroy(h)
        lib.mtsim_set_alias(0)
        lib.mtsim_set_async(0, 0)


def test_a_drain_and_destroy_are_bounded_when_a_qp_stream_never_completes_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """The proxy thread's drain before a signal (proxy_drain) and mt_proxy_destroy wait for a QP stream at most the
    engine's timeout (mt_proxy_set_timeout), as mt_proxy_quiesce does: here the stream shares one simulated hardware
    queue with work that waits for a word nobody writes (as a copy behind a spinning kernel). The drain fails the
    engine with 213 and writes no signal; destroy returns 213 and leaks the engine's memory rather than free it under
    the stream. A cudaStreamSynchronize in either would wait as long as the blocker (30 s here, forever on a GPU)."""
    from moetune.runtime.transports.proxy import OP_SIGNAL, OP_WRITE64, Request

    lib = sim_lib
    lib.mtsim_set_async(1, 0)
    lib.mtsim_set_alias(1)
    sink: list = []
    gate = (ctypes.c_uint64 * 1)()
    h = None
    try:
        h = _sim_engine(lib, None, sink)
        for bad in (0.0, -1.0, float("nan")):
            assert lib.mt_proxy_set_timeout(h, bad) == 215 and b"is not > 0" in lib.mt_last_error()
        assert lib.mt_proxy_set_timeout(h, 0.5) == 0
        queue = lib.mtsim_stream_create()  # the one hardware queue: also the engine's QP stream
        lib.mtsim_stream_wait_word(queue, ctypes.cast(gate, ctypes.POINTER(ctypes.c_uint64)), 1, 30.0)
        req = (Request * 2)(Request(OP_WRITE64, 0, 0, 0, 0, 8, 0, 7, 0, 0), Request(OP_SIGNAL, 0, 0, 3, 0, 0, 0, 9, 0, 0))
        t0 = time.monotonic()
        assert lib.mt_proxy_enqueue(h, req, 2, 5.0) == 0, lib.mt_last_error()
        buf = ctypes.create_string_buffer(512)
        while (code := lib.mt_proxy_error(h, buf, 512)) == 0 and time.monotonic() - t0 < 10.0:
            time.sleep(0.01)
        assert code == 213 and time.monotonic() - t0 < 10.0, (code, buf.value)
        assert b"QP stream 0 did not complete its transfers within 0.5 s (drain before a signal)" in buf.value
        assert sink[2][3] == 0  # no signal for data that may not have landed
        t0 = time.monotonic()
        rc, h = lib.mt_proxy_destroy(h), None
        took = time.monotonic() - t0
        assert rc == 213 and b"within 0.5 s of destroy" in lib.mt_last_error() and b"leaked" in lib.mt_last_error()
        assert took < 4.0, took
    finally:
        gate[0] = 1  # the blocker ends; the queue's worker runs what is left (into `sink`) before alias(0) joins it
        if h is not None:
            lib.mt_proxy_destroy(h)
        lib.mtsim_set_alias(0)
        lib.mtsim_set_async(0, 0)


def test_kernel_context_destroy_is_bounded_when_a_launch_never_completes_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """mt_pxy_destroy waits for this context's own launches (the completion word of the last one not captured) at
    most the context's timeout, and then returns 324 with the leak named in mt_last_error, instead of waiting for
    the device (cudaDeviceSynchronize, unbounded and also other libraries' work) and joining the simulated kernel.
    Here the completion word is wound back after launch 1, so launch 2 waits in stream order for a kernel that never
    completes (as a kernel stuck on its stream): a destroy that joined that "kernel" would never return."""
    import threading

    import numpy as np

    lib = sim_lib
    ctrl = np.zeros(8 * 1024 + 2 * 8 + 2 * 64, dtype=np.uint64)
    data = np.zeros(2 * 4096, dtype=np.uint8)
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    h, x = ctypes.c_void_p(), ctypes.c_void_p()
    sc, recv = np.array([2], dtype=np.int64), np.zeros(1, dtype=np.int64)
    word, n = ctypes.POINTER(ctypes.c_uint64)(), ctypes.c_uint64()
    try:
        assert lib.mt_proxy_create(0, 1, u64([data.ctypes.data]), u64([ctrl.ctypes.data]), u64([ctrl.ctypes.data]), 1,
                                   1, 1, 64, None, 0, 20.0, ctypes.byref(h)) == 0, lib.mt_last_error()
        assert lib.mt_pxy_create(h, 0, 0, 1, ctrl.ctypes.data, 0.5, ctypes.byref(x)) == 0, lib.mt_last_error()
        assert lib.mt_pxy_counts(x, sc.ctypes.data, recv.ctypes.data, 1, 0) == 0, lib.mt_last_error()
        lib.mt_pxy_sim_done(x, ctypes.byref(word), ctypes.byref(n))
        assert word[0] == 1 == n.value
        lib.mt_pxy_set_host_wait(x, 0)
        word[0] = 0  # launch 1 "never completed": launch 2 waits behind it
        assert lib.mt_pxy_counts(x, sc.ctypes.data, recv.ctypes.data, 2, 0) == 0, lib.mt_last_error()
        got: dict[str, object] = {}
        ctx, x = x, ctypes.c_void_p()  # the thread's to destroy, also where it hangs
        t = threading.Thread(target=lambda: got.update(rc=lib.mt_pxy_destroy(ctx), err=lib.mt_last_error()),
                             daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(10.0)
        took = time.monotonic() - t0
        assert not t.is_alive(), "mt_pxy_destroy did not return within 10 s"
        assert got["rc"] == 324 and took < 4.0, (got, took)
        assert b"proxy kernel launch 2 did not complete within 0.5 s (completed up to 0)" in got["err"], got
        assert b"leaked rather than freed" in got["err"], got
    finally:
        if word:
            word[0] = 1  # the held "kernel" runs now, into the leaked words, before the engine goes
            deadline = time.monotonic() + 10.0
            while word[0] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        if x:
            lib.mt_pxy_destroy(x)
        if h:
            lib.mt_proxy_destroy(h)


def _timed_call(lib: ctypes.CDLL, call: Callable[[], int]) -> tuple[int, bytes, float]:
    """call() on a thread of its own (one that hangs fails the test, not the run): its result, that thread's
    mt_last_error after it, and the seconds it took."""
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(rc=call(), err=lib.mt_last_error()), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(10.0)
    took = time.monotonic() - t0
    assert not t.is_alive(), "the call did not return within 10 s"
    return got["rc"], got["err"], took


def test_creation_is_bounded_when_the_device_never_idles_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """mt_proxy_create and mt_pxy_create wait for their set-up memsets within a bound (mt::setup_sync_within), as the
    destroys wait, instead of a bare cudaDeviceSynchronize: here the simulated device never becomes idle (a stuck
    persistent kernel) until the test says so. The engine's create returns 216 past the timeout_s it was given (ABI
    23), the kernel context's 326 past the context's timeout, each naming the leak in mt_last_error and freeing nothing
    a queued memset may still write; neither waits for the device to be idle. Once it is, both succeed."""
    import numpy as np

    lib = sim_lib
    lib.mtsim_set_device_busy.argtypes = [ctypes.c_int]
    lib.mtsim_set_device_busy.restype = None
    lib.mtsim_device_frees.restype = ctypes.c_ulonglong
    ctrl = np.zeros(8 * 1024 + 2 * 8 + 2 * 64, dtype=np.uint64)
    data = np.zeros(4096, dtype=np.uint8)
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    peers = (u64([data.ctypes.data]), u64([ctrl.ctypes.data]), u64([ctrl.ctypes.data]))

    def engine(out: ctypes.c_void_p, timeout_s: float = 0.5) -> int:
        return lib.mt_proxy_create(0, 1, *peers, 1, 1, 1, 64, None, 0, timeout_s, ctypes.byref(out))

    def context(eng: ctypes.c_void_p, out: ctypes.c_void_p) -> int:
        return lib.mt_pxy_create(eng, 0, 0, 1, ctrl.ctypes.data, 0.5, ctypes.byref(out))

    h, x, lost, lost_x = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    try:
        lib.mtsim_set_device_busy(1)
        frees = lib.mtsim_device_frees()
        rc, err, took = _timed_call(lib, lambda: engine(lost))
        assert rc == 216 and took < 4.0, (rc, err, took)
        assert b"mt_proxy_create: the set-up work on device 0" in err and b"did not complete within 0.5 s" in err, err
        assert b"FIFO, control page and device words are leaked rather than freed" in err, err
        assert not lost.value and lib.mtsim_device_frees() == frees  # nothing freed, no engine handed out
        # the caller's bound, whatever it is: 1.5 s is waited out, not 0.5 s and not the old fixed 20 s
        rc, err, took = _timed_call(lib, lambda: engine(lost, 1.5))
        assert rc == 216 and 1.4 < took < 6.0 and b"did not complete within 1.5 s" in err, (rc, err, took)
        assert not lost.value

        lib.mtsim_set_device_busy(0)
        assert engine(h) == 0, lib.mt_last_error()
        lib.mtsim_set_device_busy(1)
        frees = lib.mtsim_device_frees()
        rc, err, took = _timed_call(lib, lambda: context(h, lost_x))
        assert rc == 326 and took < 4.0, (rc, err, took)
        assert b"mt_pxy_create: the set-up work on device 0 (the memset of its abort flag) did not complete within " \
               b"0.5 s" in err, err
        assert b"error record, completion word and abort flag are leaked rather than freed" in err, err
        assert not lost_x.value and lib.mtsim_device_frees() == frees

        lib.mtsim_set_device_busy(0)
        assert context(h, x) == 0, lib.mt_last_error()  # the success path as before
    finally:
        lib.mtsim_set_device_busy(0)  # the detached waits of the failed creations return now
        if x:
            lib.mt_pxy_destroy(x)
        if h:
            lib.mt_proxy_destroy(h)


def test_the_allocators_zeroing_is_bounded_by_the_callers_timeout_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """mt_ipc_malloc and mt_device_malloc (csrc/mt_common.cu) wait for their zeroing within the timeout_s they are
    given (ABI 23; a fixed 20 s before): on a simulated device that never idles, 120 once that bound has passed, the
    pointer nulled (the memory leaked, nothing freed). A timeout_s that is not a finite number > 0 is refused (121)
    before anything is allocated. On an idle device both succeed as before: zeroed memory (and an IPC handle)."""
    from moetune.runtime import csrc_build

    lib = sim_lib
    for name in ("mt_ipc_malloc", "mt_device_malloc", "mt_device_free"):
        res, args = csrc_build.SIGNATURES[name]
        getattr(lib, name).restype = res
        getattr(lib, name).argtypes = args
    lib.mtsim_set_device_busy.argtypes = [ctypes.c_int]
    lib.mtsim_set_device_busy.restype = None
    lib.mtsim_device_frees.restype = ctypes.c_ulonglong
    handle = ctypes.create_string_buffer(64)

    def ipc(ptr: ctypes.c_void_p, timeout_s: float) -> int:
        return lib.mt_ipc_malloc(0, 4096, timeout_s, ctypes.byref(ptr), handle)

    def dev(ptr: ctypes.c_void_p, timeout_s: float) -> int:
        return lib.mt_device_malloc(0, 4096, timeout_s, ctypes.byref(ptr))

    for name, alloc in (("mt_ipc_malloc", ipc), ("mt_device_malloc", dev)):
        frees = lib.mtsim_device_frees()
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            p = ctypes.c_void_p()
            assert alloc(p, bad) == 121 and not p.value, (name, bad)
            assert f"{name}: timeout_s".encode() in lib.mt_last_error()
        try:
            lib.mtsim_set_device_busy(1)
            for bound in (0.5, 1.5):
                p = ctypes.c_void_p()
                rc, err, took = _timed_call(lib, lambda p=p, bound=bound, alloc=alloc: alloc(p, bound))
                assert rc == 120 and bound - 0.1 < took < bound + 4.0, (name, rc, err, took)
                assert f"{name}: the zeroing of 4096 bytes on device 0 did not complete within {bound:.1f} s".encode() \
                    in err, err
                assert not p.value and lib.mtsim_device_frees() == frees  # leaked, not freed under the memset
        finally:
            lib.mtsim_set_device_busy(0)  # the detached waits return now
        p = ctypes.c_void_p()
        assert alloc(p, 20.0) == 0 and p.value, lib.mt_last_error()
        assert bytes((ctypes.c_char * 4096).from_address(p.value)) == bytes(4096)
        if alloc is ipc:
            assert handle.raw[:8] == p.value.to_bytes(8, "little")  # the simulation's handle: the address
        assert lib.mt_device_free(0, p) == 0


def test_proxy_create_refuses_a_timeout_that_is_not_a_finite_number_above_zero(sim_lib: ctypes.CDLL) -> None:
    """mt_proxy_create's timeout_s (ABI 23) is refused, as mt_proxy_set_timeout refuses one (215), when it is not a
    finite number > 0: not mapped to a default, so a caller's bad bound is an error instead of a silent 20 s. Nothing
    is created."""
    import numpy as np

    ctrl = np.zeros(8 * 1024 + 2 * 8 + 2 * 64, dtype=np.uint64)
    one = (ctypes.c_uint64 * 1)(ctrl.ctypes.data)
    for bad in (0.0, -1.0, float("nan"), float("inf"), float("-inf")):
        h = ctypes.c_void_p()
        rc = sim_lib.mt_proxy_create(0, 1, one, one, one, 1, 1, 1, 64, None, 0, bad, ctypes.byref(h))
        assert rc == 215 and not h.value, (bad, rc)
        assert b"mt_proxy_create: timeout_s" in sim_lib.mt_last_error() and b"is not a finite number > 0" in \
            sim_lib.mt_last_error()


def _engine_cpu(lib: ctypes.CDLL, h: ctypes.c_void_p) -> list:
    """mt_proxy_cpu + mt_proxy_cpu_list: [requested CPUs, state, errno, current, tid] (csrc/proxy_engine.h
    MtProxyCpuField; the requested set as a sorted tuple, () when none)."""
    out = (ctypes.c_int * 5)()
    assert lib.mt_proxy_cpu(h, out, 5) == 0
    listed = (ctypes.c_int * max(out[0], 1))()
    assert lib.mt_proxy_cpu_list(h, listed, out[0]) == 0
    return [tuple(sorted(listed[:out[0]])), *out[1:]]


def _thread_cpus(tid: int) -> tuple[str, int]:
    """What the kernel says of a thread: its allowed CPUs (as a list) and the CPU it last ran on."""
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    allowed = next(ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:"))
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    last_cpu = int(stat.rsplit(")", 1)[1].split()[36])  # field 39 (processor), counted after the command name
    return allowed, last_cpu


def _sim_engine(lib: ctypes.CDLL, cpus: tuple[int, ...] | None, sink: list) -> ctypes.c_void_p:
    data, ctrl, sig = (ctypes.c_uint8 * 256)(), (ctypes.c_uint64 * 64)(), (ctypes.c_uint64 * 64)()
    sink += [data, ctrl, sig]
    u64 = lambda a: (ctypes.c_uint64 * 1)(ctypes.addressof(a))  # noqa: E731
    h = ctypes.c_void_p()
    arr = None if cpus is None else (ctypes.c_int * len(cpus))(*cpus)
    n = -1 if cpus is None else len(cpus)
    assert lib.mt_proxy_create(0, 1, u64(data), u64(ctrl), u64(sig), 1, 1, 1, 16, arr, n, 20.0, ctypes.byref(h)) == 0, \
        lib.mt_last_error()
    return h


def _drains(lib: ctypes.CDLL, h: ctypes.c_void_p, sig: ctypes.Array, value: int) -> None:
    from moetune.runtime.transports.proxy import OP_SIGNAL, Request

    req = (Request * 1)(Request(OP_SIGNAL, 0, 0, 3, 0, 0, 0, value, 0, 0))
    assert lib.mt_proxy_enqueue(h, req, 1, 10.0) == 0 and lib.mt_proxy_quiesce(h, 10.0) == 0
    assert sig[3] == value


def test_proxy_thread_pins_itself_to_the_cpus_asked_for_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """The engine thread pins itself (pthread_setaffinity_np from the thread) to the set asked for and reports it;
    the kernel's view of that thread (/proc/self/task/<tid>, sched_getaffinity(tid)) is that set. Each CPU this
    process may use alone, then the whole set."""
    from moetune.runtime.transports._affinity import format_cpulist

    allowed = tuple(sorted(os.sched_getaffinity(0)))
    keep: list = []
    for cpus in [(c,) for c in allowed[-4:]] + [allowed]:
        h = _sim_engine(sim_lib, cpus, keep)
        try:
            requested, state, err, current, tid = _engine_cpu(sim_lib, h)
            assert (requested, state, err) == (cpus, 2, 0)  # MT_PCPU_PINNED
            assert current in cpus and tid > 0 and tid != threading.get_native_id()
            assert tuple(sorted(os.sched_getaffinity(tid))) == cpus
            assert _thread_cpus(tid)[0] == format_cpulist(cpus) and _thread_cpus(tid)[1] in cpus
            _drains(sim_lib, h, keep[-1], 77)  # and it still drains
        finally:
            sim_lib.mt_proxy_destroy(h)
    # no CPU asked for (-1 or 0 CPUs): the thread keeps the process's CPUs
    for none in (None, ()):
        h = _sim_engine(sim_lib, none, keep)
        try:
            requested, state, err, current, tid = _engine_cpu(sim_lib, h)
            assert (requested, state, err) == ((), 1, 0) and current >= 0  # MT_PCPU_UNPINNED
            assert tuple(sorted(os.sched_getaffinity(tid))) == allowed
        finally:
            sim_lib.mt_proxy_destroy(h)


def test_every_engine_of_a_process_gets_the_whole_set_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """A model builds one EP buffer, so one proxy engine, per MoE layer: every engine given the same set is
    pinned to all of it (the OS spreads their threads), none is narrowed to one CPU of it."""
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    keep: list = []
    engines = [_sim_engine(sim_lib, allowed, keep) for _ in range(6)]
    try:
        tids = set()
        for i, h in enumerate(engines):
            requested, state, err, _current, tid = _engine_cpu(sim_lib, h)
            assert (requested, state, err) == (allowed, 2, 0)
            assert tuple(sorted(os.sched_getaffinity(tid))) == allowed
            tids.add(tid)
            _drains(sim_lib, h, keep[3 * i + 2], 5 + i)
        assert len(tids) == len(engines)
    finally:
        for h in engines:
            sim_lib.mt_proxy_destroy(h)


def test_a_refused_pinning_leaves_the_engine_running_unpinned_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """A set the process may not use (or past the engine's limit): the engine is made all the same, the thread
    is unpinned with the errno recorded, and it drains."""
    import errno

    keep: list = []
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    not_allowed = max(allowed) + 1  # beyond the process's CPUs (and likely the machine's)
    for cpus in ((not_allowed,), (not_allowed, not_allowed + 1), (allowed[0], 70000)):
        h = _sim_engine(sim_lib, cpus, keep)
        try:
            requested, state, err, _current, tid = _engine_cpu(sim_lib, h)
            assert (requested, state, err) == (cpus, 3, errno.EINVAL)  # MT_PCPU_FAILED
            assert tuple(sorted(os.sched_getaffinity(tid))) == allowed
            _drains(sim_lib, h, keep[-1], 9)
        finally:
            sim_lib.mt_proxy_destroy(h)
    h = ctypes.c_void_p()
    one = (ctypes.c_uint64 * 1)(0)
    bad = (ctypes.c_int * 2)(0, -2)
    assert sim_lib.mt_proxy_create(0, 1, one, one, one, 1, 1, 1, 16, bad, 2, 20.0, ctypes.byref(h)) != 0  # a bad argument
    assert b"bad cpu -2" in sim_lib.mt_last_error()
    assert sim_lib.mt_proxy_create(0, 1, one, one, one, 1, 1, 1, 16, bad, -2, 20.0, ctypes.byref(h)) != 0
    assert b"bad ncpus -2" in sim_lib.mt_last_error()
    assert sim_lib.mt_proxy_create(0, 1, one, one, one, 1, 1, 1, 16, None, 3, 20.0, ctypes.byref(h)) != 0
    assert b"no cpus array" in sim_lib.mt_last_error()


def test_proxy_engine_reports_its_cpus_and_warns_once_when_pinning_fails(sim_lib: ctypes.CDLL,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """ProxyEngine (the Python side) over the simulated library: cpu_binding() reads where the thread runs (the
    set asked for, the kernel's mask of the thread); a refused pinning is a ProxyCpuWarning, once, with the
    reason, never an error."""
    import warnings

    from moetune.runtime import _once, csrc_build
    from moetune.runtime.transports import _affinity
    from moetune.runtime.transports.proxy import ProxyEngine

    monkeypatch.setattr(csrc_build, "load", lambda **kw: sim_lib)
    _once.reset()
    data, sig = (ctypes.c_uint8 * 256)(), (ctypes.c_uint64 * 64)()
    peers = ([ctypes.addressof(data)], [ctypes.addressof(data)], [ctypes.addressof(sig)])
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    for cpu, want in (((allowed[0],), (allowed[0],)), (list(reversed(allowed)), allowed), (set(allowed), allowed)):
        eng = ProxyEngine(0, *peers, cpu=cpu)
        try:
            b = eng.cpu_binding()
            assert (b.requested, b.state, b.allowed, b.error) == (want, "pinned", want, "")
            assert b.current in want and _thread_cpus(b.tid)[0] == _affinity.format_cpulist(want)
        finally:
            eng.close()
    for empty in ({"cpu": ()}, {}):  # the empty set, also the default
        eng = ProxyEngine(0, *peers, **empty)
        try:
            b = eng.cpu_binding()
            assert (b.state, b.requested, b.allowed) == ("unpinned", None, allowed)
        finally:
            eng.close()
    bad = max(allowed) + 1
    with pytest.warns(_affinity.ProxyCpuWarning, match=rf"could not pin itself to CPUs {bad} \(Invalid argument"):
        eng = ProxyEngine(0, *peers, cpu=(bad,))
    try:
        b = eng.cpu_binding()
        assert b.state == "failed" and "errno 22" in b.error and b.allowed == allowed
    finally:
        eng.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ProxyEngine(0, *peers, cpu=[bad]).close()  # the same reason again: not repeated
    with pytest.raises(ValueError, match="cpu must be >= 0"):
        ProxyEngine(0, *peers, cpu=(-1,))
    with pytest.raises(ValueError, match="cpu must be >= 0"):
        ProxyEngine(0, *peers, cpu=[0, -1])
    with pytest.raises(TypeError, match="cpu must be an int"):
        ProxyEngine(0, *peers, cpu=["0"])


def test_an_explicit_zero_timeout_is_not_the_default_in_host_simulation(sim_lib: ctypes.CDLL,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """ProxyEngine.quiesce(timeout=0) looks once and fails at once while a copy is still in flight (every copy 2 s
    late here), not taken as the engine's 30 s (as `timeout or timeout_s` would take a 0). None is the engine's
    timeout; a negative or non-finite timeout is refused naming the argument (the C side read it as 0, or saturated
    inf), a non-number too."""
    from moetune.runtime import csrc_build
    from moetune.runtime.transports.proxy import OP_PUT, ProxyEngine, Request

    monkeypatch.setattr(csrc_build, "load", lambda **kw: sim_lib)
    src, data, sig = (ctypes.c_uint8 * 64)(), (ctypes.c_uint8 * 64)(), (ctypes.c_uint64 * 64)()
    # 2 s per copy, and a bound of 1 s: on a loaded CI box (2 pytest-xdist workers on 2 cores) the copy must still
    # be in flight when quiesce(0) looks, and quiesce(0) must still end far sooner than the copy
    sim_lib.mtsim_set_async(1, 2_000_000)
    eng = None
    try:
        eng = ProxyEngine(0, [ctypes.addressof(data)], [ctypes.addressof(data)], [ctypes.addressof(sig)],
                          timeout_s=30.0)
        put = (Request * 1)(Request(OP_PUT, 0, 0, 0, ctypes.addressof(src), 0, 64, 0, 0, 0))
        eng.enqueue(put, timeout=0)  # room in the FIFO: no wait needed
        t0 = time.monotonic()
        with pytest.raises(csrc_build.CsrcError, match=r"quiesce failed \(code 213\)"):
            eng.quiesce(timeout=0)
        assert time.monotonic() - t0 < 1.0
        eng.quiesce()  # None: the engine's 30 s
        for bad in (-1, -0.5, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=r"proxy engine quiesce: timeout must be finite and >= 0 seconds"):
                eng.quiesce(timeout=bad)
            with pytest.raises(ValueError, match=r"proxy engine enqueue: timeout must be finite and >= 0 seconds"):
                eng.enqueue(put, timeout=bad)
        for bad in ("1", True):
            with pytest.raises(TypeError, match=r"proxy engine quiesce: timeout must be a number of seconds or None"):
                eng.quiesce(timeout=bad)  # type: ignore[arg-type]
    finally:
        if eng is not None:
            eng.close()
        sim_lib.mtsim_set_async(0, 0)


def test_the_engines_of_many_layers_all_get_the_numa_set_in_host_simulation(
        sim_lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Under the default proxy_cpu="numa", every engine of a process (one per MoE layer's EP buffer) is pinned
    to the GPU's whole NUMA-local set that the process may use, not all to the same single CPU."""
    import torch

    from moetune.runtime import csrc_build
    from moetune.runtime.options import RuntimeOptions
    from moetune.runtime.transports import _affinity
    from moetune.runtime.transports import proxy as P

    allowed = tuple(sorted(os.sched_getaffinity(0)))
    gpu = tmp_path / "pci" / "0000:19:00.0"
    gpu.mkdir(parents=True)
    (gpu / "numa_node").write_text("0\n")
    (gpu / "local_cpulist").write_text(_affinity.format_cpulist(allowed) + "\n")
    monkeypatch.setattr(_affinity, "SYSFS_PCI", str(tmp_path / "pci"))
    monkeypatch.setattr(P, "gpu_pci_address", lambda device: "0000:19:00.0")
    monkeypatch.setattr(csrc_build, "load", lambda **kw: sim_lib)
    data, sig = (ctypes.c_uint8 * 256)(), (ctypes.c_uint64 * 64)()
    peers = ([ctypes.addressof(data)], [ctypes.addressof(data)], [ctypes.addressof(sig)])
    engines = []
    try:
        for _layer in range(8):
            choice = P.proxy_cpu_choice(RuntimeOptions(), torch.device("cuda", 0))
            assert choice.cpus == allowed, choice
            engines.append(P.ProxyEngine(0, *peers, cpu=choice.cpus))  # as the transport and micro.py pass it
        masks = [e.cpu_binding().allowed for e in engines]
        assert masks == [allowed] * len(engines)
        assert len({e.cpu_binding().tid for e in engines}) == len(engines)
    finally:
        for e in engines:
            e.close()


def test_more_ranks_than_one_node_holds_are_refused_among_the_buffers_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvlink and proxy serve at most MAX_WORLD (8) ranks (csrc MT_MAX_WORLD). EPBuffer's local checks (the first
    agreement, before autoload and any allocation) refuse a larger group in the transport check, as a KnobError
    naming the knob, and the constructor raises the same: let through, every rank would go on and raise a
    RuntimeError ('world 16 > 8') only in the transport's constructor."""
    import torch
    import torch.distributed as dist

    from moetune.runtime import csrc_build
    from moetune.runtime.buffer import facade as B
    from moetune.runtime.knobs import KnobError, default_knobs
    from moetune.runtime.options import RuntimeOptions
    from moetune.runtime.shapes import get_model
    from moetune.runtime.transports import _onesided
    from moetune.runtime.transports.registry import get_transport

    monkeypatch.setattr(csrc_build, "availability", lambda: (True, "built"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    m = get_model("qwen3-30b")

    def checks(world: int, transport: str):
        buf = B.EPBuffer.__new__(B.EPBuffer)
        buf.world, buf.rank, buf.model, buf.max_tokens = world, 0, m, 16
        buf.hidden, buf.topk, buf.dtype = m.hidden, m.topk, torch.bfloat16
        buf.device, buf.options = torch.device("cuda", 0), RuntimeOptions()
        return buf._check_knobs(default_knobs(transport), None)

    for name in ("nvlink", "proxy"):
        assert checks(_onesided.MAX_WORLD, name) is None
        code, err = checks(16, name)
        assert code == B._CHECKS.index("transport") + 1
        assert isinstance(err, KnobError) and err.knobs == ("transport",)
        assert f"transport={name} serves at most 8 ranks" in str(err) and "has 16" in str(err)
    collective = checks(16, "collective")  # no world limit ("no CUDA device" on this box)
    assert collective is None or "8 ranks" not in str(collective[1])

    # a transport built on its own: refused before anything is loaded or allocated
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 9)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(csrc_build, "load", lambda: (_ for _ in ()).throw(AssertionError("loaded the library")))
    for name in ("nvlink", "proxy"):
        with pytest.raises(KnobError, match=r"serves at most 8 ranks on one node.*has 9"):
            get_transport(name)(None, default_knobs(name), "cuda:0")


def test_row_counts_that_are_not_integers_are_refused_not_truncated() -> None:
    """The one-sided transports took any counts tensor and converted it to int64: float counts were truncated
    (2.7 rows became 2, so the senders and receivers moved other rows than the caller named) and bools became 0/1;
    a list failed on an AttributeError. Integer tensors of any width are still taken."""
    import torch

    from moetune.runtime.transports.registry import get_transport

    for name in ("nvlink", "proxy"):
        t = get_transport(name).__new__(get_transport(name))
        t.world, t.device = 2, torch.device("cpu")
        for bad in (torch.tensor([2.7, 1.0]), torch.tensor([True, False]), torch.tensor([1, 2], dtype=torch.float16)):
            with pytest.raises(ValueError, match=rf"{name}: counts must be an integer tensor.*{bad.dtype}"):
                t._counts_arg(bad)
        with pytest.raises(TypeError, match=r"counts must be an integer tensor of 2 row counts.*got list"):
            t._counts_arg([1, 2])
        got = t._counts_arg(torch.tensor([3, 4], dtype=torch.int32))
        assert got.dtype == torch.int64 and got.tolist() == [3, 4]
        with pytest.raises(ValueError, match="counts must have 2 entries"):
            t._counts_arg(torch.tensor([1, 2, 3]))


def test_proxy_context_refuses_a_rank_outside_its_world_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """mt_pxy_create refuses a rank outside 0..world-1 (306), as mt_nvl_create does (101), before it marks the engine
    or allocates anything: the kernels index the count matrix and the count words by rank, so such a rank wrote its
    row past MT_CTRL_BYTES of every peer's control region (rank >= MT_MAX_WORLD) or into a row no rank reads."""
    import numpy as np

    lib = sim_lib
    ctrl = np.zeros(8 * 1024 + 2 * 8 + 2 * 64, dtype=np.uint64)
    data = np.zeros(2 * 4096, dtype=np.uint8)
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    h = ctypes.c_void_p()
    assert lib.mt_proxy_create(0, 2, u64([data.ctypes.data] * 2), u64([ctrl.ctypes.data] * 2),
                               u64([ctrl.ctypes.data] * 2), 1, 1, 1, 64, None, 0, 5.0, ctypes.byref(h)) == 0, \
        lib.mt_last_error()
    try:
        for rank in (2, 8, -1):
            x = ctypes.c_void_p()
            rc = lib.mt_pxy_create(h, 0, rank, 2, ctrl.ctypes.data, 5.0, ctypes.byref(x))
            if rc == 0:
                lib.mt_pxy_destroy(x)
            assert rc == 306 and not x.value, (rank, rc)
            assert f"mt_pxy_create: rank {rank} outside 0..1".encode() in lib.mt_last_error()
        x = ctypes.c_void_p()  # a valid rank still builds on the same engine
        assert lib.mt_pxy_create(h, 0, 1, 2, ctrl.ctypes.data, 5.0, ctypes.byref(x)) == 0, lib.mt_last_error()
        assert lib.mt_pxy_destroy(x) == 0
    finally:
        lib.mt_proxy_destroy(h)


def test_proxy_context_refuses_a_world_other_than_its_engines_peers_in_host_simulation(sim_lib: ctypes.CDLL) -> None:
    """mt_pxy_create refuses a world other than its engine's peer count (307): the kernels push count words to every
    rank of the world (a peer the engine lacks fails the engine, 700) and the ACK lane waits on ack[peer * qps + k]
    for every peer of the world, past the engine's npeers * qps ACK words."""
    import numpy as np

    lib = sim_lib
    ctrl = np.zeros(8 * 1024 + 2 * 8 + 2 * 64, dtype=np.uint64)
    data = np.zeros(2 * 4096, dtype=np.uint8)
    u64 = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    h = ctypes.c_void_p()
    assert lib.mt_proxy_create(0, 1, u64([data.ctypes.data]), u64([ctrl.ctypes.data]), u64([ctrl.ctypes.data]), 2, 1,
                               1, 64, None, 0, 5.0, ctypes.byref(h)) == 0, lib.mt_last_error()
    try:
        x = ctypes.c_void_p()
        rc = lib.mt_pxy_create(h, 0, 0, 2, ctrl.ctypes.data, 5.0, ctypes.byref(x))
        if rc == 0:
            lib.mt_pxy_destroy(x)
        assert rc == 307 and not x.value, rc
        assert b"mt_pxy_create: world 2 but the proxy engine has 1 peers" in lib.mt_last_error()
        x = ctypes.c_void_p()  # the matching world still builds on the same engine
        assert lib.mt_pxy_create(h, 0, 0, 1, ctrl.ctypes.data, 5.0, ctypes.byref(x)) == 0, lib.mt_last_error()
        assert lib.mt_pxy_destroy(x) == 0
    finally:
        lib.mt_proxy_destroy(h)
