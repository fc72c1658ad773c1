"""CPU-side checks of the send-count refusal of the one-sided transports (library ABI 22), with the compiled library
and the symmetric buffers faked: the nvlink transport passes the rows its counts address (send_rows of a packed
send, src_rows of a strided one, x_rows and tok_rows of the gather), the ctypes table agrees with the C prototypes,
and the Python side names the refusal errors and clears only a refusal. The kernels themselves: host simulation of
the proxy's (tests/test_proxy_refusal.py), a GPU for nvlink's (tests/test_gpu_onesided.py)."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from moetune.runtime import csrc_build
from moetune.runtime.knobs import default_knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.transports import _onesided
from moetune.runtime.transports._onesided import OneSidedError, decode_error
from moetune.runtime.transports.nvlink import NvlinkTransport
from moetune.runtime.transports.proxy import ProxyTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_mtlib import FakeMtLib

CSRC = Path(__file__).resolve().parents[1] / "csrc"


class RecLib(FakeMtLib):
    """The library calls of the one-sided transports: each recorded with its arguments; `rc[name]` is returned (0
    unless set), `last_error` is mt_last_error's text."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.rc: dict[str, int] = {}
        self.last_error = b""

    def mt_last_error(self) -> bytes:
        return self.last_error

    def call(self, name: str, args: tuple) -> int:
        self.calls.append((name, args))
        super().call(name, args)
        return self.rc.get(name, 0)

    def args_of(self, name: str) -> tuple:
        return [a for n, a in self.calls if n == name][-1]


class FakeSymm:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.peer_ptrs = [0x100000]
        self.local = torch.zeros(nbytes, dtype=torch.uint8)
        self.backend = "fake"

    def close(self) -> None:
        pass


@pytest.fixture
def lib(monkeypatch: pytest.MonkeyPatch) -> RecLib:
    """A world of 1 over the fakes (as tests/test_transport_lifecycle.py builds it)."""
    rec = RecLib()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(csrc_build, "load", lambda **kw: rec)
    monkeypatch.setattr(_onesided, "SymmBuffer", lambda nbytes, group, device, lib, mode="torch", timeout_s=20.0: FakeSymm(nbytes))
    monkeypatch.setattr(_onesided, "_all_gather_ints", lambda values, group, device: [list(values)])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(_onesided.OneSidedTransport, "_current_stream_done", lambda self, timeout_s: True)
    return rec


def _on_cpu(t: Any) -> Any:
    """A transport built for cuda:0 over the fakes, made to take CPU tensors (no GPU here): the calls run as far as
    the library, which records them."""
    t.device = torch.device("cpu")
    t._stream = lambda: 0
    return t


def _check_types(name: str, args: tuple) -> None:
    """The arguments against the ctypes table: as many, and a non-negative int where it says c_uint64."""
    types = csrc_build.SIGNATURES[name][1]
    assert len(args) == len(types), (name, len(args), len(types))
    for i, (a, t) in enumerate(zip(args, types, strict=True)):
        if t is ctypes.c_uint64:
            assert isinstance(a, int) and a >= 0, (name, i, a)
        elif t is ctypes.c_int:
            assert isinstance(a, int), (name, i, a)


def test_nvlink_passes_the_rows_its_counts_address(lib: RecLib) -> None:
    """mt_nvl_exchange gets the packed send's rows, mt_nvl_exchange_strided the strided source's rows (its stride and
    row bytes after them), mt_nvl_exchange_gather x's rows and tok's entries: what the kernel checks the send counts
    (and, for the gather, the tokens) against before anything is sent."""
    t = _on_cpu(NvlinkTransport(None, default_knobs("nvlink"), torch.device("cuda", 0), options=RuntimeOptions(),
                                max_send_rows=64, row_bytes=256))
    try:
        sc = torch.tensor([5])
        t.exchange(torch.zeros(5, 8), sc, sc)
        a = lib.args_of("mt_nvl_exchange")
        _check_types("mt_nvl_exchange", a)
        assert a[2:4] == (5, 32), a  # send_rows, row_bytes
        t.exchange_fused(torch.zeros(7, 4, dtype=torch.float64), torch.tensor([7]))
        assert lib.args_of("mt_nvl_exchange")[2:4] == (7, 32)

        base = torch.zeros(6, 16)
        t.exchange_strided(base[:, :8], torch.tensor([6]), torch.tensor([6]))
        a = lib.args_of("mt_nvl_exchange_strided")
        _check_types("mt_nvl_exchange_strided", a)
        assert a[2:5] == (6, 64, 32), a  # src_rows, src_stride, row_bytes

        x, idx, w = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
        tok = torch.arange(6, dtype=torch.int64)  # more entries than S x world: the counts may address all of them
        t.dispatch_gather(x, tok, idx, w, torch.tensor([4]), row_bytes=64, id_off=16, weight_off=32)
        a = lib.args_of("mt_nvl_exchange_gather")
        _check_types("mt_nvl_exchange_gather", a)
        assert a[2] == 4 and a[3] == 16 and a[4] == 16 and a[6] == 6, a  # x_rows, x_stride, payload, tok_rows
    finally:
        t.close()


def _c_prototypes(text: str) -> dict[str, list[str]]:
    """MT_API functions of a C source: name -> parameter types (the parameter name and /* */ comments dropped)."""
    out = {}
    for m in re.finditer(r"MT_API\s+int\s+(mt_\w+)\s*\(([^)]*)\)", re.sub(r"/\*.*?\*/", "", text, flags=re.S)):
        params = [p.strip() for p in m.group(2).replace("\n", " ").split(",") if p.strip()]
        out[m.group(1)] = [re.sub(r"\s*\w+$", "", p).replace("const ", "").replace(" *", "*").strip() for p in params]
    return out


def _matches(c_type: str, py_type: Any) -> bool:
    if c_type.endswith("*"):
        return py_type in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(py_type, ctypes._Pointer)
    return {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
            "double": ctypes.c_double}.get(c_type) is py_type


def test_the_ctypes_table_matches_the_c_prototypes_of_the_exchanges() -> None:
    """Every mt_nvl_* and mt_pxy_* function the table binds, against its prototype in csrc/ (ep_nvlink.cu,
    proxy_gpu.cu): as many parameters, of matching kinds -- an argument added on one side only (send_rows) would shift
    every later one. And the library and the Python check both say ABI 22 or later."""
    protos = {**_c_prototypes((CSRC / "ep_nvlink.cu").read_text()), **_c_prototypes((CSRC / "proxy_gpu.cu").read_text())}
    names = [n for n in csrc_build.SIGNATURES if n.startswith(("mt_nvl_", "mt_pxy_"))]
    assert {"mt_nvl_exchange", "mt_nvl_exchange_gather", "mt_pxy_clear_error", "mt_nvl_clear_error"} <= set(names)
    for name in names:
        c_types, py_types = protos[name], csrc_build.SIGNATURES[name][1]
        assert len(c_types) == len(py_types), (name, c_types, py_types)
        bad = [(i, c, p) for i, (c, p) in enumerate(zip(c_types, py_types, strict=True)) if not _matches(c, p)]
        assert not bad, (name, bad)
    assert protos["mt_nvl_exchange"][2] == "uint64_t" and protos["mt_nvl_exchange_gather"][6] == "uint64_t"
    abi = int(re.search(r"mt_abi_version\(\) \{ return (\d+);", (CSRC / "mt_common.cu").read_text()).group(1))
    assert abi == csrc_build.ABI_VERSION >= 22


def test_the_ctypes_table_matches_the_c_prototypes_of_the_other_entry_points() -> None:
    """The rest of the table against csrc/ (the allocators, the proxy engine, host staging, packing, fp8), as the
    exchanges above. ABI 23 added timeout_s (a double, before the out-pointers) to mt_proxy_create, mt_ipc_malloc and
    mt_device_malloc: the bound of their set-up waits, until then a fixed 20 s whatever the caller configured. A
    library of ABI 22 would read an out-pointer where the timeout is: the load check refuses it (ABI 23 both sides)."""
    protos: dict[str, list[str]] = {}
    for f in ("mt_common.cu", "proxy_engine.cpp", "host_staged.cu", "ep_pack.cu", "ep_fp8.cu"):
        protos.update(_c_prototypes((CSRC / f).read_text()))
    names = [n for n in csrc_build.SIGNATURES if n in protos]
    assert {"mt_proxy_create", "mt_ipc_malloc", "mt_device_malloc", "mt_hs_create", "mt_pack_rows"} <= set(names)
    for name in names:
        c_types, py_types = protos[name], csrc_build.SIGNATURES[name][1]
        assert len(c_types) == len(py_types), (name, c_types, py_types)
        bad = [(i, c, p) for i, (c, p) in enumerate(zip(c_types, py_types, strict=True)) if not _matches(c, p)]
        assert not bad, (name, bad)
    for name in ("mt_proxy_create", "mt_ipc_malloc", "mt_device_malloc"):
        c_types = protos[name]
        i = c_types.index("double")
        assert i == len(c_types) - (2 if name == "mt_ipc_malloc" else 1) - 1, (name, c_types)  # before the outs
    abi = int(re.search(r"mt_abi_version\(\) \{ return (\d+);", (CSRC / "mt_common.cu").read_text()).group(1))
    assert abi == csrc_build.ABI_VERSION >= 23


def _words(code: int, rank: int, peer: int, slot: int, epoch: int, seen: int, expected: int) -> list[int]:
    def s32(v: int) -> int:
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= 1 << 31 else v

    seen &= (1 << 64) - 1
    return [code, rank, peer, slot, epoch, s32(seen), s32(seen >> 32), s32(expected)] + [0] * 8


def test_refusal_errors_are_named() -> None:
    msg = decode_error(_words(9, 1, 0, -1, 5, 0, 0))
    assert msg.startswith("a peer refused its send counts: rank 0 refused its send counts in this call (epoch 5")
    assert "rank 1 exchanged no rows with it" in msg and "clear_error() on every rank" in msg, msg
    msg = decode_error(_words(8, 0, 1, 2, 3, 4096, 4))  # the gather's token outside x
    assert "rank 0's send row for rank 1 gathers token 4096; x holds 4 tokens (epoch 3)" in msg, msg
    assert "other ranks' calls fail at once (peer refused)" in msg, msg
    msg = decode_error(_words(8, 0, 1, 1, 3, 9, 8))
    assert "send counts through rank 1 add up to 9 rows; send holds 8 rows (epoch 3)" in msg, msg


@pytest.mark.parametrize("cls", [NvlinkTransport, ProxyTransport])
def test_clear_error_raises_what_the_library_refuses(lib: RecLib, cls: type) -> None:
    """clear_error() calls the library's clear (mt_nvl_clear_error / mt_pxy_clear_error) on its context: 0 clears,
    a refusal to clear (another error than a refused call) is a OneSidedError with the library's words."""
    t = cls(None, default_knobs(cls.name), torch.device("cuda", 0), options=RuntimeOptions())
    native = "mt_nvl_clear_error" if cls is NvlinkTransport else "mt_pxy_clear_error"
    try:
        t.clear_error()
        assert lib.args_of(native)[0] is t._h
        lib.rc[native] = 107
        lib.last_error = b"the error record holds code 1: only a refused call (codes 8, 9) can be cleared"
        with pytest.raises(OneSidedError, match=rf"{cls.name}: clear_error: the error record holds code 1"):
            t.clear_error()
    finally:
        t.close()
    with pytest.raises(OneSidedError, match="not running"):
        t.clear_error()


def test_proxy_clear_error_refuses_a_failed_proxy_thread(lib: RecLib) -> None:
    """A proxy thread whose CUDA call failed may have lost copies or signals: nothing to clear, and the library's
    clear is not called."""
    t = ProxyTransport(None, default_knobs("proxy"), torch.device("cuda", 0), options=RuntimeOptions())
    try:
        lib.rc["mt_proxy_error"] = 5
        with pytest.raises(OneSidedError, match=r"the proxy engine failed .* build a new transport"):
            t.clear_error()
        assert not [n for n, _ in lib.calls if n == "mt_pxy_clear_error"]
    finally:
        lib.rc["mt_proxy_error"] = 0
        t.close()


def test_a_library_of_an_older_abi_is_refused_before_any_call(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """A prebuilt library (MOETUNE_CSRC_LIB) of ABI 22 has every symbol, but its mt_proxy_create / mt_ipc_malloc /
    mt_device_malloc take no timeout_s: called with ABI 23's arguments it would read an out-pointer where the timeout
    is. load() asks mt_abi_version first and refuses it, saying why and what to do."""
    called: list[str] = []

    class Fn:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, *args: Any) -> int:
            called.append(self.name)
            return 22 if self.name == "mt_abi_version" else 0

    class OldLib:
        def __getattr__(self, name: str) -> Fn:
            fn = Fn(name)
            setattr(self, name, fn)
            return fn

    old = tmp_path / "libmoetune_csrc.so"
    monkeypatch.setenv("MOETUNE_CSRC_LIB", str(old))
    monkeypatch.setattr(csrc_build.ctypes, "CDLL", lambda path: OldLib())
    monkeypatch.setattr(csrc_build, "_lib", None)
    monkeypatch.setattr(csrc_build, "_lib_error", None)
    with pytest.raises(csrc_build.BuildError, match=r"ABI 22, expected 23: the library was built from other sources"):
        csrc_build.load()
    assert called == ["mt_abi_version"]
    assert "MOETUNE_CSRC_LIB" in str(csrc_build._lib_error)
